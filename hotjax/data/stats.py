"""A corpus as the trainer sees it: token lengths, each bucket's share, and the padding that each
way of laying sequences into rows costs (one per row, packed to the context, packed per bucket).

Every figure is computed over the whole corpus, tokenized once; `corpus_stats` returns plain
data (JSON-ready) for the `hotjax data stats` command to print or plot.
"""

from collections.abc import Callable, Sequence

import numpy as np

from hotjax.data.buckets import cut, pack_buckets
from hotjax.data.corpus import Corpus
from hotjax.data.packing import pack_rows, to_sequences
from hotjax.data.tokenizer import Tokenizer
from hotjax.errors import UserError

TOKENIZE_CHUNK = 256  # documents per tokenizer call
QUANTILES = 1024  # document lengths kept in the report, at evenly spaced quantiles (for plans)


def document_lengths(
    corpus: Corpus, tokenizer: Tokenizer, progress: Callable[[int], None] = lambda done: None
) -> np.ndarray:
    """Each document's sequence length before truncation: its tokens plus BOS and EOS, or 0 for
    a document with no tokens. `progress` hears how many documents are done."""
    lengths_D = np.zeros(corpus.num_documents, np.int64)
    for start in range(0, corpus.num_documents, TOKENIZE_CHUNK):
        docs = range(start, min(start + TOKENIZE_CHUNK, corpus.num_documents))
        ids = corpus.encode_batch(docs, tokenizer)
        lengths_D[start:docs.stop] = [len(x) + 2 if x else 0 for x in ids]
        progress(docs.stop)
    return lengths_D


def sequence_lengths(lengths_D: np.ndarray, corpus: Corpus, tokenizer: Tokenizer, context: int,
                     long_documents: str) -> np.ndarray:
    """The training sequences' lengths once long documents are truncated or split."""
    if long_documents == "error" and (lengths_D > context).any():
        doc = int(np.argmax(lengths_D > context))
        try:
            to_sequences(corpus.encode(doc, tokenizer), tokenizer, context, long_documents)
        except UserError as e:
            raise UserError(f"{corpus.describe(doc)}: {e}") from None
    return cut(lengths_D[lengths_D > 0], context, long_documents)


def corpus_stats(
    corpus: Corpus,
    tokenizer: Tokenizer,
    lengths_D: np.ndarray,
    context: int,
    max_lens: Sequence[int],
    long_documents: str = "truncate",
) -> dict:
    """The whole report, as plain data."""
    lengths_N = sequence_lengths(lengths_D, corpus, tokenizer, context, long_documents)
    buckets = _buckets(lengths_N, max_lens)
    doc_lengths = lengths_D[lengths_D > 0]
    s = corpus.stats
    return {
        "corpus": {"source": corpus.source, "documents": s.documents, "empty": s.empty,
                   "replaced": s.replaced, "binary_skipped": s.binary, "bytes": s.bytes,
                   "fingerprint": corpus.fingerprint},
        "tokenizer": {"identity": tokenizer.identity, "vocab_size": tokenizer.vocab_size},
        "context": context,
        "long_documents": long_documents,
        "tokens": {"documents": int(doc_lengths.sum()), "sequences": len(lengths_N),
                   "in_sequences": int(lengths_N.sum()),
                   "truncated": int(np.maximum(doc_lengths - context, 0).sum())
                   if long_documents == "truncate" else 0},
        "lengths": {name: int(np.percentile(doc_lengths, q)) for name, q in
                    (("min", 0), ("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))},
        "histogram": _histogram(doc_lengths),
        "quantiles": quantiles(doc_lengths, min(QUANTILES, len(doc_lengths))),
        "buckets": buckets,
        "layouts": _layouts(lengths_N, context, buckets),
    }


def quantiles(lengths: np.ndarray, count: int) -> list[int]:
    """`count` lengths at evenly spaced quantiles of `lengths`: a distribution `hotjax plan`
    reads back as that many equally likely documents."""
    ordered = np.sort(lengths)
    return ordered[((np.arange(count) + 0.5) / count * len(ordered)).astype(int)].tolist()


def _histogram(lengths: np.ndarray) -> list[dict]:
    """Documents and tokens per power-of-two length range [2^k, 2^(k+1))."""
    bins = np.floor(np.log2(lengths)).astype(int)
    return [{"min": 1 << int(k), "max": (2 << int(k)) - 1,
             "documents": int((bins == k).sum()), "tokens": int(lengths[bins == k].sum())}
            for k in range(int(bins.min()), int(bins.max()) + 1)]


def _buckets(lengths_N: np.ndarray, max_lens: Sequence[int]) -> list[dict]:
    found = []
    for max_len, rows in zip(max_lens, pack_buckets(lengths_N.tolist(), max_lens), strict=True):
        members = lengths_N[[i for row in rows for i in row]]
        found.append({"max_len": max_len, "sequences": len(members),
                      "tokens": int(members.sum()),
                      "token_share": float(members.sum() / lengths_N.sum()),
                      "rows": len(rows), "padding": len(rows) * max_len - int(members.sum())})
    return found


def _layouts(lengths_N: np.ndarray, context: int, buckets: list[dict]) -> list[dict]:
    """Padding and dense attention cost (rows x length², as XLA computes masked attention) of
    each layout, attention relative to packing every sequence into context-length rows."""
    real = int(lengths_N.sum())
    shapes = {
        "pad to max": [(len(lengths_N), context)],
        "packed to context": [(len(pack_rows(lengths_N.tolist(), context)), context)],
        "bucketed": [(b["rows"], b["max_len"]) for b in buckets],
    }
    packed_attention = shapes["packed to context"][0][0] * context**2
    found = []
    for name, rows in shapes.items():
        padded = sum(r * n for r, n in rows)
        found.append({"name": name, "rows": sum(r for r, _ in rows), "padded_tokens": padded,
                      "real_tokens": real, "waste": 1 - real / padded,
                      "attention": sum(r * n * n for r, n in rows) / packed_attention})
    return found
