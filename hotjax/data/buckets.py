"""Length buckets: which bucket holds a sequence, how a bucket's sequences fill its rows, and
how long a corpus's documents are (estimated, for planning and for what truncation drops)."""

import bisect
from collections.abc import Sequence

import numpy as np

from hotjax.data.corpus import Corpus
from hotjax.data.packing import pack_rows
from hotjax.data.tokenizer import Tokenizer

ESTIMATE_DOCUMENTS = 8192  # documents whose lengths are estimated
RATIO_SAMPLE_BYTES = 1 << 20  # text tokenized to measure the tokenizer's tokens per byte


def bucket_of(length: int, max_lens: Sequence[int]) -> int:
    """The first bucket whose rows hold a sequence of `length` tokens."""
    return bisect.bisect_left(max_lens, length)


def pack_buckets(lengths: Sequence[int], max_lens: Sequence[int]) -> list[list[list[int]]]:
    """Sequence indices per row of each bucket: each sequence in the first bucket that holds
    it, each bucket packed first-fit-decreasing into rows of its length (`pack_rows`)."""
    own: list[list[int]] = [[] for _ in max_lens]
    for i, length in enumerate(lengths):
        own[bucket_of(length, max_lens)].append(i)
    return [[[members[j] for j in row] for row in pack_rows([lengths[i] for i in members], m)]
            for members, m in zip(own, max_lens, strict=True)]


def typical_rows(lengths_N: np.ndarray, max_lens: Sequence[int], *, batch_tokens: int | None = None,
                 batch_sequences: int | None = None) -> list[float]:
    """Rows each bucket needs in a typical mini-batch: a sample of sequence lengths packed into
    the buckets, scaled to the mini-batch's size (tokens or sequences)."""
    rows = pack_buckets(lengths_N.tolist(), max_lens)
    scale = (batch_tokens / max(int(lengths_N.sum()), 1) if batch_tokens is not None
             else (batch_sequences or 0) / max(len(lengths_N), 1))
    return [len(r) * scale for r in rows]


def estimated_lengths(corpus: Corpus, tokenizer: Tokenizer) -> np.ndarray:
    """Sequence lengths (BOS and EOS included, before any cut) of a fixed sample of documents,
    from their text sizes and the tokenizer's measured tokens per byte: tokenizing a whole
    corpus would take long."""
    rng = np.random.default_rng(0)  # the same sample in every process, whatever the seed
    order = rng.permutation(corpus.num_documents)
    ratio = _tokens_per_byte(corpus, tokenizer, order)
    sizes_N = corpus.sizes_D[np.sort(order[:ESTIMATE_DOCUMENTS])]
    return np.ceil(sizes_N[sizes_N > 0] * ratio).astype(np.int64) + 2


def cut(lengths_N: np.ndarray, context: int, long_documents: str) -> np.ndarray:
    """Documents' sequence lengths once those over `context` are split, or else truncated."""
    if long_documents != "split":
        return np.minimum(lengths_N, context)
    full, rest = np.divmod(lengths_N, context)
    return np.concatenate([np.full(int(full.sum()), context), rest[rest > 0]])


def _tokens_per_byte(corpus: Corpus, tokenizer: Tokenizer, order: np.ndarray) -> float:
    docs, total = [], 0
    for i in order:
        if total >= RATIO_SAMPLE_BYTES:
            break
        if corpus.sizes_D[i]:
            docs.append(int(i))
            total += int(corpus.sizes_D[i])
    tokens = sum(len(ids) for ids in corpus.encode_batch(docs, tokenizer))
    return tokens / max(total, 1)
