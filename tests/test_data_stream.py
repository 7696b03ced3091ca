"""The mini-batch stream: the seeded shuffled documents cut at the batch size, each mini-batch
packed per bucket, the same data whatever the table, and an exact resume.

Every mini-batch is checked against a reference built here: Grain's seeded order (the
documented `range → shuffle(seed) → repeat`), each document as `[BOS, bytes, EOS]` truncated or
split at the context, cut greedily at the budget, and packed with a plain first-fit-decreasing.
"""

import functools
import itertools
import json
import re
import threading
from collections import Counter
from pathlib import Path

import grain
import numpy as np
import pytest
from test_data import BOS, EOS, PAD, first_fit_decreasing, random_texts, write_files

from hotjax.data import (
    Batch,
    ByteTokenizer,
    MiniBatch,
    MiniBatches,
    Share,
    assemble,
    open_corpus,
)
from hotjax.errors import UserError

BYTES = ByteTokenizer()
Sequence = tuple[int, ...]


def segments(batch: Batch) -> list[Sequence]:
    """The sequences in a batch, after checking each row's layout against its segment ids."""
    found = []
    for tokens_T, segment_ids_T, positions_T in zip(
        batch.tokens, batch.segment_ids, batch.positions, strict=True
    ):
        used = int(np.count_nonzero(segment_ids_T))
        assert used, "a row without a sequence"  # a bucket gets only the rows it needs
        assert not segment_ids_T[used:].any()  # padding only at the end
        assert (tokens_T[used:] == PAD).all() and not positions_T[used:].any()
        starts = np.flatnonzero(np.diff(segment_ids_T[:used], prepend=0))
        assert segment_ids_T[starts].tolist() == list(range(1, len(starts) + 1))
        for start, stop in itertools.pairwise([*starts.tolist(), used]):
            assert positions_T[start:stop].tolist() == list(range(stop - start))
            found.append(tuple(tokens_T[start:stop].tolist()))
    return found


def contents(minibatch: MiniBatch, max_lens: tuple[int, ...], packing: str = "ffd"
             ) -> Counter[Sequence]:
    """The mini-batch's sequences, after checking its layout: each bucket's rows as long as the
    bucket, each sequence in the first bucket that holds it, one per row when not packed."""
    assert minibatch.max_lens == max_lens
    found: Counter[Sequence] = Counter()
    for batch, low, high in zip(minibatch.buckets, (0, *max_lens[:-1]), max_lens, strict=True):
        assert batch.tokens.shape[1] == high
        sequences = segments(batch)
        assert all(low < len(s) <= high for s in sequences)
        if packing == "none":
            assert len(sequences) == batch.tokens.shape[0]
        assert (batch.sequences, batch.real_tokens) == (len(sequences), sum(map(len, sequences)))
        found.update(sequences)
    assert minibatch.sequences == found.total()
    assert minibatch.real_tokens == sum(len(s) * k for s, k in found.items())
    assert sorted(minibatch.document_lengths()) == sorted(len(s) for s in found.elements())
    return found


def assert_same(a: MiniBatch, b: MiniBatch) -> None:
    assert a.epoch == b.epoch
    for x, y in zip(a.buckets, b.buckets, strict=True):
        for name in ("tokens", "segment_ids", "positions"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))


# The reference


def document_order(count: int, seed: int, epochs: int) -> list[int]:
    """Documents in visiting order: a fresh seeded shuffle each epoch (Grain's)."""
    shuffled = grain.MapDataset.range(count).shuffle(seed=seed).repeat()
    return [int(shuffled[k]) for k in range(epochs * count)]


def reference_stream(texts: list[str], seed: int, context: int, long_documents: str,
                     epochs: int) -> list[tuple[int, Sequence]]:
    """(epoch, sequence) in the order the stream takes them; empty documents give none."""
    stream = []
    for k, doc in enumerate(document_order(len(texts), seed, epochs)):
        if not texts[doc]:
            continue
        whole = (BOS, *texts[doc].encode(), EOS)
        stops = range(0, len(whole), context) if long_documents == "split" else [0]
        stream += [(k // len(texts), whole[start:start + context]) for start in stops]
    return stream


def reference_cut(stream: list[tuple[int, Sequence]], batch_tokens: int | None = None,
                  batch_sequences: int | None = None) -> list[list[tuple[int, Sequence]]]:
    """The complete mini-batches of `stream`: the next sequences up to `batch_tokens` real
    tokens (the one that would pass it starts the next) or exactly `batch_sequences`."""
    found, current, tokens = [], [], 0
    for epoch, sequence in stream:
        if current and (len(current) == batch_sequences if batch_sequences
                        else tokens + len(sequence) > batch_tokens):
            found.append(current)
            current, tokens = [], 0
        current.append((epoch, sequence))
        tokens += len(sequence)
    return found


def reference_buckets(sequences: list[Sequence], max_lens: tuple[int, ...], packing: str
                      ) -> list[Batch]:
    """Each sequence (in stream order) in the first bucket that holds it; each bucket packed
    first-fit-decreasing into as many rows as it needs, or one sequence per row."""
    own: list[list[Sequence]] = [[] for _ in max_lens]
    for s in sequences:
        own[next(b for b, m in enumerate(max_lens) if len(s) <= m)].append(s)
    batches = []
    for members, max_len in zip(own, max_lens, strict=True):
        rows = ([[i] for i in range(len(members))] if packing == "none"
                else first_fit_decreasing([len(s) for s in members], max_len))
        batches.append(assemble([[np.array(members[i], np.int32) for i in row] for row in rows],
                                len(rows), max_len, PAD))
    return batches


# Corpora


@pytest.fixture(scope="module")
def mixed_corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    """300 uniquely numbered documents with long-tailed lengths from 8 to ~250 bytes, and 5
    empty ones."""
    rng = np.random.default_rng(2)
    lengths = np.minimum(8 + rng.pareto(1.2, size=300) * 20, 250).astype(int)
    letters = np.array(list("abcdefgh ijklmnop"))
    texts = [f"{i:03}:" + "".join(rng.choice(letters, n)) for i, n in enumerate(lengths)]
    for i in (0, 61, 122, 183, 244):
        texts[i] = ""
    root = tmp_path_factory.mktemp("mixed")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return root / "docs.jsonl", texts


def batches(path: Path, max_lens=(32, 64, 128, 256), **options) -> MiniBatches:
    if "batch_sequences" not in options:
        options.setdefault("batch_tokens", 1024)
    return MiniBatches(open_corpus(str(path)), BYTES, max_lens, **options)


# The data of each mini-batch

CUTS = {
    "tokens, truncated": ((32, 64, 128, 256), {"batch_tokens": 1024}),
    "tokens, truncated at 64": ((16, 64), {"batch_tokens": 300}),
    "tokens, split": ((16, 32, 64), {"batch_tokens": 256, "long_documents": "split"}),
    "sequences, split": ((16, 64), {"batch_sequences": 6, "long_documents": "split"}),
    "sequences, unpacked": ((256,), {"batch_sequences": 4, "packing": "none"}),
    "tokens, unpacked": ((100, 200, 256), {"batch_tokens": 700, "packing": "none"}),
    "tokens, the context": ((16, 48), {"batch_tokens": 48, "long_documents": "split"}),
}


@pytest.mark.parametrize("kind", CUTS)
def test_mini_batches_are_the_seeded_stream_cut_and_packed(kind, mixed_corpus) -> None:
    path, texts = mixed_corpus
    max_lens, options = CUTS[kind]
    seed, packing = 3, options.get("packing", "ffd")
    stream = reference_stream(texts, seed, max_lens[-1], options.get("long_documents",
                                                                     "truncate"), epochs=3)
    expected = reference_cut(stream, options.get("batch_tokens"), options.get("batch_sequences"))
    expected = expected[:next(k for k, m in enumerate(expected) if m[0][0] == 2) + 1]
    found, taken = batches(path, max_lens, seed=seed, **options), 0
    for want in expected:  # two epochs and into the third
        minibatch = next(found)
        sequences = [s for _, s in want]
        assert contents(minibatch, max_lens, packing) == Counter(sequences)
        assert minibatch.epoch == want[0][0]
        for got, ref in zip(minibatch.buckets, reference_buckets(sequences, max_lens, packing),
                            strict=True):
            for name in ("tokens", "segment_ids", "positions"):
                np.testing.assert_array_equal(getattr(got, name), getattr(ref, name))
        taken += len(sequences)
        if "batch_tokens" in options:  # the next sequence would pass the budget
            budget, after = options["batch_tokens"], len(stream[taken][1])
            assert minibatch.real_tokens <= budget < minibatch.real_tokens + after
        else:
            assert minibatch.sequences == options["batch_sequences"]
    assert any(len({e for e, _ in m}) == 2 for m in expected)  # one spans an epoch boundary


def test_an_epoch_holds_every_document_once(mixed_corpus) -> None:
    path, texts = mixed_corpus
    # 295 documents have text, so 59 mini-batches of 5 sequences are exactly one epoch.
    stream = batches(path, (64, 256), batch_sequences=5, seed=11)
    expected = Counter((BOS, *t.encode(), EOS) for t in texts if t)
    first = [next(stream) for _ in range(59)]
    second = [next(stream) for _ in range(59)]
    for epoch, minibatches in enumerate((first, second)):
        assert [m.epoch for m in minibatches] == [epoch] * 59
        assert sum((contents(m, (64, 256)) for m in minibatches), Counter()) == expected
    assert contents(first[0], (64, 256)) != contents(second[0], (64, 256))  # reshuffled
    assert next(stream).epoch == 2
    order = document_order(len(texts), seed=11, epochs=2)  # the reference's order, likewise
    assert sorted(order[:300]) == sorted(order[300:]) == list(range(300))
    assert order[:300] != order[300:]


def test_a_token_budget_keeps_whole_sequences_and_no_more(mixed_corpus) -> None:
    """Real tokens, not padding, fill the budget: however much the layout pads, each mini-batch
    holds at most `batch_tokens` real tokens, and more than the budget less one sequence."""
    path = mixed_corpus[0]
    stream = batches(path, (256,), batch_tokens=512, packing="none", seed=0)
    minibatches = [next(stream) for _ in range(40)]
    assert all(m.real_tokens <= 512 for m in minibatches)
    assert min(m.real_tokens for m in minibatches) > 512 - 256
    # Padded to 256 per sequence, the rows hold far more than the budget.
    assert sum(b.tokens.size for m in minibatches for b in m.buckets) > 3 * 40 * 512


def test_the_table_does_not_change_the_data(mixed_corpus) -> None:
    """The same documents, cut the same way, whatever buckets (of the same context) lay them
    out, packed or not: a mini-batch is data, not layout."""
    path = mixed_corpus[0]
    tables = [((256,), "ffd"), ((32, 256), "ffd"), ((32, 64, 128, 256), "ffd"),
              ((100, 200, 256), "ffd"), ((32, 64, 128, 256), "none")]
    found = []
    for max_lens, packing in tables:
        stream = batches(path, max_lens, batch_tokens=2048, packing=packing, seed=4)
        minibatches = [next(stream) for _ in range(12)]  # into the second epoch
        assert minibatches[-1].epoch == 1
        found.append([(m.epoch, contents(m, max_lens, packing)) for m in minibatches])
    assert all(f == found[0] for f in found[1:])


def test_unpacked_rows_hold_one_sequence_each(mixed_corpus) -> None:
    path = mixed_corpus[0]
    minibatch = next(batches(path, (32, 64, 128, 256), packing="none"))
    for batch in minibatch.buckets:
        assert batch.tokens.shape[0] == batch.sequences
        assert (batch.segment_ids.max(axis=1) == 1).all()
    packed = next(batches(path, (32, 64, 128, 256)))
    assert sum(b.tokens.shape[0] for b in packed.buckets) < minibatch.sequences
    assert contents(packed, (32, 64, 128, 256)) == contents(minibatch, (32, 64, 128, 256),
                                                             "none")


def test_same_seed_same_mini_batches_other_seed_others(mixed_corpus) -> None:
    path = mixed_corpus[0]
    a, b = batches(path, seed=9), batches(path, seed=9, read_threads=0)
    for _ in range(30):  # past the first epoch, read ahead in threads or not
        assert_same(next(a), next(b))
    assert contents(next(batches(path, seed=10)), (32, 64, 128, 256)) != contents(
        next(batches(path, seed=9)), (32, 64, 128, 256))


# Long documents


def test_split_documents_keep_every_token_and_truncated_ones_their_start(tmp_path: Path) -> None:
    texts = ["abcdefghijklmn", "xy", "0123456789"]  # 16, 4 and 12 tokens with BOS and EOS
    corpus = open_corpus(str(write_files(tmp_path, {f"{i}.txt": t.encode()
                                                    for i, t in enumerate(texts)})))
    order = document_order(3, seed=0, epochs=1)
    whole = {i: (BOS, *t.encode(), EOS) for i, t in enumerate(texts)}
    split = MiniBatches(corpus, BYTES, (4, 8), batch_sequences=1, long_documents="split")
    minibatches = [next(split) for _ in range(5)]  # one sequence each: a bucket stays empty
    assert all(sorted(b.tokens.shape[0] for b in m.buckets) == [0, 1] for m in minibatches)
    pieces = [s for m in minibatches for b in m.buckets for s in segments(b)]
    assert pieces == [whole[i][start:start + 8] for i in order
                      for start in range(0, len(whole[i]), 8)]
    assert {(BOS, *b"abcdefg"), (*b"hijklmn", EOS), (BOS, *b"xy", EOS), (BOS, *b"0123456"),
            (*b"789", EOS)} == set(pieces)
    assert next(split).epoch == 1
    truncate = MiniBatches(corpus, BYTES, (4, 8), batch_sequences=3)
    assert contents(next(truncate), (4, 8)) == Counter(w[:8] for w in whole.values())


def test_a_document_longer_than_the_context_is_a_user_error(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "short"}\n{"text": "' + "x" * 70 + '"}\n')
    stream = MiniBatches(open_corpus(str(path)), BYTES, (16, 64), batch_tokens=256,
                         long_documents="error")
    message = f"{path}:2: a document of 72 tokens (with BOS and EOS) is longer than the largest"
    with pytest.raises(UserError, match=re.escape(message)) as error:
        next(stream)
    assert "\n" not in str(error.value)


def test_a_corpus_without_tokens_is_a_user_error(tmp_path: Path) -> None:
    class NoTokens(ByteTokenizer):
        def encode(self, text: str) -> list[int]:
            return []

    corpus = open_corpus(str(write_files(tmp_path, {"a.txt": b"a", "b.txt": b"b"})))
    stream = MiniBatches(corpus, NoTokens(), (8,), batch_tokens=8)
    with pytest.raises(UserError, match=re.escape(f"no document of {tmp_path} has tokens")):
        next(stream)


# Exact resume

RESUMES = {
    "tokens, truncated": ((32, 64, 128, 256), {"batch_tokens": 1024}),
    "tokens, split": ((16, 64), {"batch_tokens": 256, "long_documents": "split"}),
    "sequences, split": ((16, 32), {"batch_sequences": 9, "long_documents": "split"}),
}


@pytest.mark.parametrize("kind", RESUMES)
def test_a_restored_iterator_continues_exactly(kind, mixed_corpus) -> None:
    path = mixed_corpus[0]
    max_lens, options = RESUMES[kind]
    stream = batches(path, max_lens, seed=5, **options)
    states, minibatches = [], []
    for _ in range(80):
        states.append(json.loads(json.dumps(stream.get_state())))  # as a checkpoint keeps it
        minibatches.append(next(stream))
    assert minibatches[-1].epoch >= 1
    chosen = {7, 23, next(k for k, m in enumerate(minibatches) if m.epoch == 1)}
    if "split" in kind:  # mid-document: pieces of a split document wait for the next step
        middles = [k for k, s in enumerate(states[:75]) if any(p[2] for p in s["pending"])]
        assert len(middles) > 3
        chosen |= set(middles[:3])
    for k in sorted(chosen):
        resumed = batches(path, max_lens, seed=5, **options)
        resumed.set_state(states[k])
        for j in range(5):
            assert_same(next(resumed), minibatches[k + j])


def test_a_state_resumes_on_another_table_with_the_same_data(mixed_corpus) -> None:
    path = mixed_corpus[0]
    options = {"batch_tokens": 512, "long_documents": "split", "seed": 1}
    stream = batches(path, (16, 32, 64), **options)
    for _ in range(10):
        next(stream)
    state = stream.get_state()
    expected = [contents(next(stream), (16, 32, 64)) for _ in range(5)]
    other = batches(path, (64,), packing="none", **options)
    other.set_state(state)
    assert [contents(next(other), (64,), "none") for _ in range(5)] == expected


@pytest.mark.parametrize(
    ("changes", "corpus"),
    [({"seed": 6}, "mixed"), ({}, "other"), ({"max_lens": (32, 128)}, "mixed"),
     ({"long_documents": "split"}, "mixed"), ({"batch_tokens": 2048}, "mixed"),
     ({"batch_tokens": None, "batch_sequences": 8}, "mixed")],
)
def test_a_state_from_another_stream_is_a_one_line_user_error(changes, corpus, mixed_corpus,
                                                              tmp_path) -> None:
    path = mixed_corpus[0]
    state = batches(path, seed=5).get_state()
    if corpus == "other":
        texts = random_texts(20, 50, seed=0)
        path = write_files(tmp_path, {f"{i}.txt": f"{i} {t}".encode() for i, t in enumerate(texts)})
    options = {"seed": 5, **changes}
    if options.get("batch_tokens", 0) is None:
        del options["batch_tokens"]
    with pytest.raises(UserError, match=re.escape(
            "resume with the same corpus, tokenizer, seed, context, long-document handling "
            "and batch size")) as error:
        batches(path, **options).set_state(state)
    assert "\n" not in str(error.value)


# Options


@pytest.mark.parametrize(
    ("max_lens", "options", "message"),
    [
        ((16, 64), {"batch_tokens": 32},
         "batch_tokens (32) must be at least the longest bucket's length (64)"),
        ((16, 64), {"batch_tokens": 256, "batch_sequences": 8},
         "give the mini-batch size as batch_tokens or batch_sequences, not both"),
        ((16, 64), {}, "give the mini-batch size as batch_tokens or batch_sequences"),
        ((16, 64), {"batch_sequences": 0}, "batch_sequences (0) must be positive"),
        ((64, 16), {"batch_tokens": 256}, "bucket lengths [64, 16]: give positive, increasing"),
        ((0, 16), {"batch_tokens": 256}, "bucket lengths [0, 16]: give positive, increasing"),
        ((), {"batch_tokens": 256}, "bucket lengths []: give positive, increasing"),
        ((16, 64), {"batch_tokens": 256, "seed": -1}, "seed -1: choose a seed from 0 to 2**32"),
        ((16, 64), {"batch_tokens": 256, "long_documents": "drop"},
         "long documents 'drop': choose one of truncate, split, error"),
        ((16, 64), {"batch_tokens": 256, "packing": "greedy"},
         "packing 'greedy': choose one of ffd, none"),
    ],
)
def test_bad_options_are_one_line_user_errors(max_lens, options, message, mixed_corpus) -> None:
    with pytest.raises(UserError, match=re.escape(message)) as error:
        MiniBatches(open_corpus(str(mixed_corpus[0])), BYTES, max_lens, **options)
    assert "\n" not in str(error.value)


# A real corpus


def test_the_stdlib_fills_every_bucket_within_the_budget() -> None:
    max_lens, budget = (1024, 4096, 16384), 262144
    stream = MiniBatches(open_corpus("stdlib"), BYTES, max_lens, batch_tokens=budget)
    minibatches = [next(stream) for _ in range(4)]
    assert all(budget - 16384 < m.real_tokens <= budget for m in minibatches)
    assert all(m.buckets[b].sequences for m in minibatches for b in range(3))
    for m in minibatches:  # first fit: any two rows of a bucket hold more than one row
        for batch in m.buckets:
            fill = sorted(np.count_nonzero(batch.segment_ids, axis=1).tolist())
            assert len(fill) < 2 or fill[0] + fill[1] > batch.tokens.shape[1]


# Several processes reading one stream


class Recording(ByteTokenizer):
    """Bytes, noting the texts it tokenized, in order."""

    def __init__(self) -> None:
        object.__setattr__(self, "texts", [])

    def encode(self, text: str) -> list[int]:
        self.texts.append(text)
        return super().encode(text)


def read_by_processes(path: Path, count: int, steps: int, state: dict | None = None,
                      **options) -> tuple[list[list[MiniBatch]], list[list[str]], list[dict]]:
    """`count` streams sharing the reading, run in threads as processes would run; gathers meet
    at a barrier. Each one's mini-batches, the texts it tokenized, and its final state. The
    streams read without read-ahead threads, so what each tokenized is exactly its share."""
    barrier, slots = threading.Barrier(count), [None] * count

    def gather(index: int, vector: np.ndarray) -> list[np.ndarray]:
        slots[index] = vector
        barrier.wait()
        everyone = list(slots)
        barrier.wait()
        return everyone

    tokenizers = [Recording() for _ in range(count)]
    streams = [MiniBatches(open_corpus(str(path)), tokenizers[i], (32, 64, 128, 256),
                           share=Share(i, count, functools.partial(gather, i)), read_threads=0,
                           **options)
               for i in range(count)]
    for stream in streams:
        if state is not None:
            stream.set_state(state)
    for tokenizer in tokenizers:
        tokenizer.texts.clear()  # what a restore re-reads is not the stream's reading
    results: list[list[MiniBatch]] = [[] for _ in range(count)]

    def run(i: int) -> None:
        results[i] = [next(streams[i]) for _ in range(steps)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, [t.texts for t in tokenizers], [s.get_state() for s in streams]


def test_processes_sharing_the_reading_see_one_process_s_mini_batches(mixed_corpus) -> None:
    """Three processes each tokenize every third document of the stream and each holds exactly
    the mini-batches one process reads, across an epoch's end; their state resumes in one
    process, and one process's in three."""
    path, texts = mixed_corpus
    options = {"batch_tokens": 1024, "seed": 3}
    single = batches(path, **options)
    expected = [next(single) for _ in range(24)]
    assert expected[17].epoch == 1
    results, read, states = read_by_processes(path, 3, 18, **options)
    for minibatches in results:
        for got, want in zip(minibatches, expected[:18], strict=True):
            assert_same(got, want)
    order = [texts[d] for d in document_order(len(texts), 3, epochs=2)]
    assert len(read[0]) == len(read[1]) == len(read[2]) > len(texts) // 3
    for i in range(3):
        assert read[i] == order[i:3 * len(read[i]):3]

    assert states[0] == states[1] == states[2]
    alone = batches(path, **options)
    alone.set_state(json.loads(json.dumps(states[0])))
    for k in range(18, 24):
        assert_same(next(alone), expected[k])
    midway = batches(path, **options)
    for _ in range(7):
        next(midway)
    results, _, _ = read_by_processes(path, 3, 10, state=midway.get_state(), **options)
    for minibatches in results:
        for got, want in zip(minibatches, expected[7:17], strict=True):
            assert_same(got, want)
