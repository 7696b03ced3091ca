"""The data layer: corpus → tokens → length buckets → packed, document-masked mini-batches."""

import importlib

from hotjax.data.buckets import bucket_of, cut, estimated_lengths, pack_buckets, typical_rows
from hotjax.data.corpus import (
    EMBEDDED_CORPORA,
    Corpus,
    CorpusStats,
    open_corpus,
    shakespeare_root,
    stdlib_files,
)
from hotjax.data.packing import LONG_DOCUMENTS, Batch, assemble, pack_rows, to_sequences
from hotjax.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    default_cache_dir,
    load_tokenizer,
    train_bpe,
)

# The iterators live in `stream`, which imports Grain, which imports JAX — and JAX reads the CPU
# device count when imported. So `stream` loads on first use, and importing `hotjax.data` before
# `hotjax.start_jax` stays safe.
_STREAM = ("MiniBatch", "MiniBatches", "Share")


def __getattr__(name: str):
    if name in _STREAM:
        return getattr(importlib.import_module("hotjax.data.stream"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EMBEDDED_CORPORA",
    "LONG_DOCUMENTS",
    "Batch",
    "ByteTokenizer",
    "Corpus",
    "CorpusStats",
    "HFTokenizer",
    "MiniBatch",
    "MiniBatches",
    "Share",
    "SentencePieceTokenizer",
    "Tokenizer",
    "assemble",
    "bucket_of",
    "cut",
    "default_cache_dir",
    "estimated_lengths",
    "load_tokenizer",
    "open_corpus",
    "pack_rows",
    "pack_buckets",
    "shakespeare_root",
    "stdlib_files",
    "to_sequences",
    "typical_rows",
    "train_bpe",
]
