"""The data layer: corpus → tokens → packed, document-masked batches."""

from hotjax.data.corpus import Corpus, CorpusStats, open_corpus, stdlib_files
from hotjax.data.packing import Batch, PackedBatches, assemble, pack_rows, to_sequence
from hotjax.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    default_cache_dir,
    load_tokenizer,
    train_bpe,
)

__all__ = [
    "Batch",
    "ByteTokenizer",
    "Corpus",
    "CorpusStats",
    "HFTokenizer",
    "PackedBatches",
    "SentencePieceTokenizer",
    "Tokenizer",
    "assemble",
    "default_cache_dir",
    "load_tokenizer",
    "open_corpus",
    "pack_rows",
    "stdlib_files",
    "to_sequence",
    "train_bpe",
]
