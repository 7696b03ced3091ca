"""How many packed rows each length bucket gets in every mini-batch.

Shapes must not change between steps (each bucket's step compiles once), so each bucket's row
count is fixed for a run. It is planned from the corpus's length distribution: pack a fixed
sample of sequence lengths first-fit-decreasing within each bucket, then give each bucket
rows in proportion to what its sequences needed. When a mini-batch holds more of a bucket than
planned, the overflow fills room in longer buckets' rows or waits for the next mini-batch;
nothing is dropped.
"""

import bisect
import math
from collections.abc import Sequence

import numpy as np

from hotjax.data.corpus import Corpus
from hotjax.data.packing import pack_rows
from hotjax.data.tokenizer import Tokenizer

ESTIMATE_DOCUMENTS = 8192  # documents whose lengths plan the rows
RATIO_SAMPLE_BYTES = 1 << 20  # text tokenized to measure the tokenizer's tokens per byte


def bucket_of(length: int, max_lens: Sequence[int]) -> int:
    """The first bucket whose rows hold a sequence of `length` tokens."""
    return bisect.bisect_left(max_lens, length)


def plan_rows(
    lengths: Sequence[int],
    max_lens: Sequence[int],
    row_multiples: Sequence[int],
    *,
    batch_tokens: int | None = None,
    batch_sequences: int | None = None,
) -> tuple[int, ...]:
    """Rows per bucket for mini-batches of `batch_tokens` padded tokens or `batch_sequences`
    sequences, given a sample of sequence `lengths` (each at most the largest bucket).

    By tokens, bucket b gets the share of the budget its sample rows take (rows x max_len),
    rounded down, then what is left goes row by row to the buckets furthest below their share;
    by sequences, the rows its sample needed per sequence times the count, rounded up. Every
    bucket gets at least one row, so none starves, and a multiple of its `row_multiples` entry,
    so its rows split evenly over the strategy's batch shards.
    """
    needed = [0] * len(max_lens)
    by_bucket: list[list[int]] = [[] for _ in max_lens]
    for length in lengths:
        by_bucket[bucket_of(length, max_lens)].append(int(length))
    for b, members in enumerate(by_bucket):
        needed[b] = len(pack_rows(members, max_lens[b]))
    if not len(lengths):  # no sample (one bucket needs none): every bucket counts as one row
        needed = [1] * len(max_lens)
    multiples = list(row_multiples)
    if batch_tokens is None:
        assert batch_sequences is not None, "pass batch_tokens or batch_sequences"
        rows = [math.ceil(batch_sequences * n / max(len(lengths), 1)) for n in needed]
        return tuple(_round_up(max(r, 1), k) for r, k in zip(rows, multiples, strict=True))
    padded = sum(n * m for n, m in zip(needed, max_lens, strict=True))
    ideal = [batch_tokens * n / padded for n in needed]
    rows = [_round_up(max(math.floor(x), 1), k) for x, k in zip(ideal, multiples, strict=True)]
    # Rounding down leaves budget: give it to the buckets furthest below their share.
    while True:
        spare = batch_tokens - sum(r * m for r, m in zip(rows, max_lens, strict=True))
        short = [b for b, (x, r) in enumerate(zip(ideal, rows, strict=True))
                 if x > r and multiples[b] * max_lens[b] <= spare]
        if not short:
            return tuple(rows)
        b = max(short, key=lambda b: (ideal[b] - rows[b]) * max_lens[b])
        rows[b] += multiples[b]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def estimated_lengths(
    corpus: Corpus, tokenizer: Tokenizer, context: int, long_documents: str
) -> np.ndarray:
    """Sequence lengths of a fixed sample of documents, from their text sizes and the
    tokenizer's measured tokens per byte: tokenizing a whole corpus to plan would take long."""
    rng = np.random.default_rng(0)  # the same sample in every process, whatever the seed
    order = rng.permutation(corpus.num_documents)
    ratio = _tokens_per_byte(corpus, tokenizer, order)
    sizes_N = corpus.sizes_D[np.sort(order[:ESTIMATE_DOCUMENTS])]
    lengths_N = np.ceil(sizes_N[sizes_N > 0] * ratio).astype(np.int64) + 2  # BOS, EOS
    return cut(lengths_N, context, long_documents)


def cut(lengths_N: np.ndarray, context: int, long_documents: str) -> np.ndarray:
    """Documents' sequence lengths once those over `context` are split, or else truncated."""
    if long_documents != "split":
        return np.minimum(lengths_N, context)
    full, rest = np.divmod(lengths_N, context)
    return np.concatenate([np.full(int(full.sum()), context), rest[rest > 0]])


def _tokens_per_byte(corpus: Corpus, tokenizer: Tokenizer, order: np.ndarray) -> float:
    texts, total = [], 0
    for i in order:
        if total >= RATIO_SAMPLE_BYTES:
            break
        if corpus.sizes_D[i]:
            texts.append(corpus.read(int(i)))
            total += int(corpus.sizes_D[i])
    tokens = sum(len(ids) for ids in tokenizer.encode_batch(texts))
    return tokens / max(sum(len(t.encode()) for t in texts), 1)
