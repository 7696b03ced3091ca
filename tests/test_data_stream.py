"""The iterators: every document once per epoch, bucketed shapes, exact resume, process shares."""

import itertools
import json
import re
from pathlib import Path

import grain
import numpy as np
import pytest
from test_data import BOS, EOS, PAD, byte_sequence, random_texts, write_files

from hotjax.data import (
    Batch,
    BucketedBatches,
    ByteTokenizer,
    MiniBatch,
    PackedBatches,
    open_corpus,
)
from models.errors import UserError

BYTES = ByteTokenizer()


def segments(batch: Batch) -> list[tuple[int, ...]]:
    """The sequences in a batch, after checking each row's layout against its segment ids."""
    found = []
    for tokens_T, segment_ids_T, positions_T in zip(
        batch.tokens, batch.segment_ids, batch.positions, strict=True
    ):
        used = int(np.count_nonzero(segment_ids_T))
        assert not segment_ids_T[used:].any()  # padding only at the end
        assert (tokens_T[used:] == PAD).all() and not positions_T[used:].any()
        starts = np.flatnonzero(np.diff(segment_ids_T[:used], prepend=0))
        assert segment_ids_T[starts].tolist() == list(range(1, len(starts) + 1))
        for start, stop in itertools.pairwise([*starts.tolist(), used]):
            assert positions_T[start:stop].tolist() == list(range(stop - start))
            found.append(tuple(tokens_T[start:stop].tolist()))
    return found


def text_of(sequence: tuple[int, ...]) -> str:
    return bytes(t for t in sequence if t < 256).decode()


def epochs(batches: BucketedBatches, count: int = 1) -> list[list[MiniBatch]]:
    """The mini-batches of the first `count` epochs of a fresh iterator, epoch by epoch."""
    found: list[list[MiniBatch]] = [[] for _ in range(count)]
    while (minibatch := next(batches)).epoch < count:
        found[minibatch.epoch].append(minibatch)
    return found


def assert_same(a: MiniBatch | Batch, b: MiniBatch | Batch) -> None:
    for x, y in zip(getattr(a, "buckets", [a]), getattr(b, "buckets", [b]), strict=True):
        for name in ("tokens", "segment_ids", "positions"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))


@pytest.fixture
def text_corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    """40 documents of up to 29 characters; two are empty and some are longer than a row."""
    texts = random_texts(40, 30, seed=1)
    texts[3] = texts[17] = ""
    files = {f"doc{i:03}.txt": t.encode() for i, t in enumerate(texts)}
    return write_files(tmp_path / "corpus", files), texts


@pytest.fixture(scope="module")
def mixed_corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    """300 uniquely named documents with long-tailed lengths from 8 to ~250 bytes."""
    rng = np.random.default_rng(2)
    lengths = np.minimum(8 + rng.pareto(1.2, size=300) * 20, 250).astype(int)
    letters = np.array(list("abcdefgh ijklmnop"))
    texts = [f"{i:03}:" + "".join(rng.choice(letters, n)) for i, n in enumerate(lengths)]
    root = tmp_path_factory.mktemp("mixed")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return root / "docs.jsonl", texts


def bucketed(path: Path, **options) -> BucketedBatches:
    defaults = {"batch_tokens": 1024, "seed": 0}
    return BucketedBatches(open_corpus(str(path)), BYTES, (32, 64, 128, 256),
                           **{**defaults, **options})


# One bucket: the single-strategy trainer's batches


def test_an_epoch_of_batches_holds_every_document_once(text_corpus) -> None:
    root, texts = text_corpus
    expected = sorted(byte_sequence(t, 16) for t in texts if t)
    batches = PackedBatches(open_corpus(str(root)), BYTES, 16, 64, seed=0)
    found, real = [], 0
    while real < sum(map(len, expected)):
        batch = next(batches)
        assert batch.tokens.shape == (4, 16) and batches.rows == 4
        found += segments(batch)
        real += batch.real_tokens
    assert sorted(found) == expected
    state = batches.get_state()
    assert (state["epoch"], state["taken"], state["carry"]) == (0, len(texts), [])


def test_batches_follow_the_seeded_shuffle(tmp_path: Path) -> None:
    texts = [f"{i:02} is a document longer than a row" for i in range(12)]
    root = write_files(tmp_path, {f"{i:02}.txt": t.encode() for i, t in enumerate(texts)})
    corpus = open_corpus(str(root))
    order = [grain.MapDataset.range(12).shuffle(seed=7)[k] for k in range(12)]
    batches = PackedBatches(corpus, BYTES, 8, 32, seed=7)
    # Every document fills a row, so rows take documents in shuffled order.
    for first in (0, 4):
        np.testing.assert_array_equal(
            next(batches).tokens, [byte_sequence(texts[i], 8) for i in order[first : first + 4]]
        )
    other = next(PackedBatches(corpus, BYTES, 8, 32, seed=8))
    assert not np.array_equal(other.tokens[0], byte_sequence(texts[order[0]], 8))


def test_batches_emit_the_fullest_rows_and_carry_the_rest(tmp_path: Path) -> None:
    # Texts in visiting order; with BOS and EOS their sequences are 7, 6, 4, 4, 8, 8 long.
    texts = ["aaaaa", "bbbb", "cc", "dd", "eeeeee", "ffffff"]
    order = [grain.MapDataset.range(6).shuffle(seed=0)[k] for k in range(6)]
    files = {f"{doc}.txt": texts[k].encode() for k, doc in enumerate(order)}
    corpus = open_corpus(str(write_files(tmp_path, files)))
    batches = PackedBatches(corpus, BYTES, 10, 20, seed=0)

    def row(*ks: int) -> list[int]:
        tokens = [t for k in ks for t in byte_sequence(texts[k], 10)]
        return tokens + [PAD] * (10 - len(tokens))

    # Window 7+6+4+4 packs as [7] [6 4] [4]: the two fullest rows go out, the last 4 waits.
    np.testing.assert_array_equal(next(batches).tokens, [row(1, 2), row(0)])
    # Window 4+8+8 packs as [8] [8] [4]; the 4 waits again, then ends the epoch alone.
    np.testing.assert_array_equal(next(batches).tokens, [row(4), row(5)])
    state = batches.get_state()
    assert (state["epoch"], state["taken"], state["carry"]) == (0, 6, [[int(order[3]), 0]])
    np.testing.assert_array_equal(next(batches).tokens, [row(3), row()])
    assert not np.array_equal(next(batches).tokens, [row(1, 2), row(0)])  # epoch 1 reshuffles


def test_same_seed_gives_identical_batches(text_corpus) -> None:
    corpus = open_corpus(str(text_corpus[0]))
    a, b = (PackedBatches(corpus, BYTES, 16, 64, seed=3) for _ in range(2))
    for _ in range(40):  # past the first epoch
        assert_same(next(a), next(b))
    assert a.get_state()["epoch"] >= 1


def test_batch_smaller_than_a_row_is_a_user_error(text_corpus) -> None:
    corpus = open_corpus(str(text_corpus[0]))
    message = "batch_tokens (8) must be at least the longest bucket's length (16)"
    with pytest.raises(UserError, match=re.escape(message)):
        PackedBatches(corpus, BYTES, 16, 8, seed=0)


# Buckets


def test_a_bucketed_epoch_holds_every_document_once(mixed_corpus) -> None:
    path, texts = mixed_corpus
    batches = bucketed(path, row_multiples=(4, 2, 2, 1))
    rows = batches.rows
    assert [r % k for r, k in zip(rows, (4, 2, 2, 1), strict=True)] == [0, 0, 0, 0]
    found, promoted = [], 0
    for minibatch in epochs(batches)[0]:
        for batch, stats, num_rows, low, high in zip(
                minibatch.buckets, minibatch.stats, rows, (0, 32, 64, 128), (32, 64, 128, 256),
                strict=True):
            assert batch.tokens.shape == (stats.rows, high) == (num_rows, high)
            sequences = segments(batch)
            assert all(len(s) <= high for s in sequences)
            promoted += sum(len(s) <= low for s in sequences)
            assert (stats.sequences, stats.real_tokens) == (len(sequences), batch.real_tokens)
            assert stats.padding_tokens == batch.tokens.size - batch.real_tokens
            found += sequences
        assert minibatch.real_tokens + minibatch.padding_tokens == sum(
            r * m for r, m in zip(rows, (32, 64, 128, 256), strict=True))
    assert sorted(found) == sorted(byte_sequence(t, 256) for t in texts)
    assert promoted  # short sequences also fill the room left in longer buckets' rows


def test_bucket_rows_fit_the_corpus_and_keep_the_budget(mixed_corpus) -> None:
    batches = bucketed(mixed_corpus[0], batch_tokens=2048)
    capacity = sum(r * m for r, m in zip(batches.rows, (32, 64, 128, 256), strict=True))
    assert 2048 - 256 <= capacity <= 2048 + 32 * 4
    minibatches = epochs(batches)[0]
    # Fixed shapes waste little: most padding is in the last mini-batches of the epoch.
    real = sum(m.real_tokens for m in minibatches[:-2])
    assert real / (capacity * (len(minibatches) - 2)) > 0.8
    assert max(m.carried for m in minibatches) < 40


def test_a_mini_batch_of_sequences_holds_about_that_many(mixed_corpus) -> None:
    batches = bucketed(mixed_corpus[0], batch_tokens=None, batch_sequences=32)
    counts = [sum(s.sequences for s in m.stats) for m in epochs(batches)[0]]
    assert sum(counts) == 300
    assert all(24 <= c <= 40 for c in counts[:-2]), counts


def test_split_documents_keep_every_token(mixed_corpus) -> None:
    path, texts = mixed_corpus
    batches = BucketedBatches(open_corpus(str(path)), BYTES, (16, 64), batch_tokens=512,
                              long_documents="split")
    pieces = [s for m in epochs(batches)[0] for b in m.buckets for s in segments(b)]
    whole = [byte_sequence(t, 1000) for t in texts]
    assert sorted(p for p in pieces if p[0] == BOS) == sorted(w[:64] for w in whole)
    assert sum(p[-1] == EOS for p in pieces) == len(texts)
    assert len(pieces) == sum(-(-len(w) // 64) for w in whole)
    assert sorted(t for p in pieces for t in p) == sorted(t for w in whole for t in w)


def test_a_document_longer_than_the_largest_bucket_is_a_user_error(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "short"}\n{"text": "' + "x" * 70 + '"}\n')
    batches = BucketedBatches(open_corpus(str(path)), BYTES, (16, 64), batch_tokens=256,
                              long_documents="error")
    message = f"{path}:2: a document of 72 tokens (with BOS and EOS) is longer than the largest"
    with pytest.raises(UserError, match=re.escape(message)):
        next(batches)


# Exact resume


@pytest.mark.parametrize("kind", ["one bucket", "buckets", "split, by sequences"])
def test_a_restored_iterator_continues_exactly(kind, mixed_corpus) -> None:
    corpus = open_corpus(str(mixed_corpus[0]))

    def fresh():
        if kind == "one bucket":
            return PackedBatches(corpus, BYTES, 128, 512, seed=5)
        if kind == "buckets":
            return BucketedBatches(corpus, BYTES, (32, 64, 128, 256), batch_tokens=1024, seed=5)
        return BucketedBatches(corpus, BYTES, (32, 64), batch_sequences=24, seed=5,
                               long_documents="split")

    stream = fresh()
    states, batches = [], []
    for _ in range(70):  # into the second epoch
        states.append(json.loads(json.dumps(stream.get_state())))
        batches.append(next(stream))
    assert sum(bool(s["carry"]) for s in states) > 20 and states[-1]["epoch"] >= 1
    for k in (7, 23, *(k for k in range(1, 65) if states[k]["epoch"] > states[k - 1]["epoch"])):
        resumed = fresh()
        resumed.set_state(states[k])
        for j in range(5):
            assert_same(next(resumed), batches[k + j])


def test_a_state_from_other_options_is_a_user_error(mixed_corpus) -> None:
    corpus = open_corpus(str(mixed_corpus[0]))
    state = PackedBatches(corpus, BYTES, 128, 512, seed=5).get_state()
    with pytest.raises(UserError, match="resume with the same corpus, seed, buckets"):
        PackedBatches(corpus, BYTES, 128, 512, seed=6).set_state(state)


# Processes


def test_two_processes_read_each_document_once_per_epoch(mixed_corpus) -> None:
    path, texts = mixed_corpus
    shares = []
    for index in (0, 1):
        batches = bucketed(path, batch_tokens=2048, process_index=index, process_count=2)
        assert batches.rows == bucketed(path, batch_tokens=1024).rows  # same shapes everywhere
        for minibatches in epochs(batches, 2):
            names = [text_of(s)[:3] for m in minibatches for b in m.buckets
                     for s in segments(b)]
            assert len(names) == len(set(names))
            shares.append(set(names))
    every = {t[:3] for t in texts}
    for number in (0, 1):
        first, second = shares[number], shares[2 + number]
        assert not first & second and first | second == every
        assert abs(len(first) - len(second)) <= 1
    assert shares[0] != shares[1]  # each epoch deals the documents anew


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"process_index": 2, "process_count": 2}, "process 2 of 2: the index must be from 0"),
        ({"batch_tokens": 1001, "process_count": 2}, "batch_tokens (1001) does not split over 2"),
        ({"batch_sequences": 8}, "give the mini-batch size as batch_tokens or batch_sequences"),
        ({"seed": -1}, "seed -1: choose a seed from 0 to 2**32 - 1"),
        ({"long_documents": "drop"}, "long documents 'drop': choose one of truncate, split"),
        ({"row_multiples": (1, 2)}, "row multiples [1, 2]: give a positive multiple for each"),
    ],
)
def test_bad_iterator_options_are_user_errors(options, message, mixed_corpus) -> None:
    with pytest.raises(UserError, match=re.escape(message)):
        bucketed(mixed_corpus[0], **options)


def test_more_processes_than_documents_is_a_user_error(tmp_path: Path) -> None:
    corpus = open_corpus(str(write_files(tmp_path, {"a.txt": b"a", "b.txt": b"b"})))
    with pytest.raises(UserError, match="process 2 gets none — use fewer processes"):
        PackedBatches(corpus, BYTES, 8, 24, seed=0, process_index=2, process_count=3)


def test_the_stdlib_fills_every_bucket() -> None:
    batches = BucketedBatches(open_corpus("stdlib"), BYTES, (1024, 4096, 16384),
                              batch_tokens=262144)
    minibatches = [next(batches) for _ in range(5)]
    capacity = sum(r * m for r, m in zip(batches.rows, batches.max_lens, strict=True))
    assert 0.9 * 262144 <= capacity <= 262144 and batches.rows[-1] > batches.rows[0]
    assert all(sum(m.stats[b].sequences for m in minibatches) for b in range(3))
    assert sum(m.real_tokens for m in minibatches) > 0.9 * 5 * capacity
