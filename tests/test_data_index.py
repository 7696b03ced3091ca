"""The corpus index cached under its content's hash: a restart hashes but does not scan, a changed
byte scans again, and a damaged cache file is scanned past and rewritten."""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hotjax.data import corpus as corpus_module
from hotjax.data import index_cache, open_corpus


@pytest.fixture
def scans(tmp_path: Path, monkeypatch) -> list[int]:
    """Counts the corpus scans, under a cache of this test's own."""
    monkeypatch.setenv("HOTJAX_CACHE", str(tmp_path / "cache"))
    counted: list[int] = []
    scan = corpus_module._scan

    def counting(listed, text_field):
        counted.append(len(listed))
        return scan(listed, text_field)

    monkeypatch.setattr(corpus_module, "_scan", counting)
    return counted


def _corpus(root: Path) -> Path:
    """A directory of every kind a directory holds: text, JSON lines, Parquet, a binary file."""
    root.mkdir()
    (root / "a.txt").write_text("first document\n")
    (root / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                          for t in ["one", "", "thr\u00e9e"]))
    pq.write_table(pa.table({"text": ["p", "q", "rr"]}), root / "c.parquet", row_group_size=2)
    (root / "d.bin").write_bytes(b"\0\1\2")
    return root


def _same(a, b) -> None:
    assert (a.files, a.kinds, a.stats, a.fingerprint) == (b.files, b.kinds, b.stats, b.fingerprint)
    np.testing.assert_array_equal(a.spans_Dx3, b.spans_Dx3)
    np.testing.assert_array_equal(a.sizes_D, b.sizes_D)
    assert [a.read(i) for i in range(a.num_documents)] == [
        b.read(i) for i in range(b.num_documents)]


def test_a_restart_reads_the_index_from_its_cache_without_a_scan(tmp_path, scans) -> None:
    root = _corpus(tmp_path / "corpus")
    first = open_corpus(str(root))
    again = open_corpus(str(root))
    assert scans == [3]  # the binary file is skipped before any scan
    _same(first, again)
    assert again.stats.documents == 7 and again.stats.empty == 1 and again.stats.binary == 1
    assert [again.read(i) for i in range(7)] == [
        "first document\n", "one", "", "thr\u00e9e", "p", "q", "rr"]
    assert len(list(index_cache.directory().glob("*.idx"))) == 1


def test_a_changed_byte_scans_again_whatever_its_size_and_time(tmp_path, scans) -> None:
    root = _corpus(tmp_path / "corpus")
    first = open_corpus(str(root))
    stat = (root / "a.txt").stat()
    (root / "a.txt").write_text("First document\n")  # the same size
    os.utime(root / "a.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same time
    changed = open_corpus(str(root))
    assert scans == [3, 3]
    assert changed.read(0) == "First document\n" and changed.fingerprint != first.fingerprint
    (root / "a.txt").write_text("first document\n")
    _same(open_corpus(str(root)), first)
    assert scans == [3, 3]  # the first content's index is still cached


def test_another_text_field_is_another_index(tmp_path, scans) -> None:
    (tmp_path / "r.jsonl").write_text('{"text": "a", "body": "bb"}\n')
    assert open_corpus(str(tmp_path / "r.jsonl")).sizes_D.tolist() == [1]
    assert open_corpus(str(tmp_path / "r.jsonl"), text_field="body").sizes_D.tolist() == [2]
    assert scans == [1, 1]


_HEADER = len(b"hotjax corpus index\0") + 32 + 24 + 32


def _forged(raw: bytes, at: int, value: int) -> bytes:
    """`raw` with the body's int64 at `at` (past the kinds) set to `value`, its digest made
    again: a file that passes the digest but holds a value no scan gives."""
    files = int.from_bytes(raw[_HEADER - 32 - 16:_HEADER - 32 - 8], "little")
    body = bytearray(raw[_HEADER:])
    body[files + 8 * at:files + 8 * at + 8] = value.to_bytes(8, "little", signed=True)
    digest = hashlib.blake2b(bytes(body), digest_size=32).digest()
    return raw[:_HEADER - 32] + digest + bytes(body)


def _flip_last(raw: bytes) -> bytes:
    return raw[:-1] + bytes([raw[-1] ^ 1])


def _claim_more_documents(raw: bytes) -> bytes:
    at = len(b"hotjax corpus index\0") + 32 + 16  # the header's document count
    return raw[:at] + (2**40).to_bytes(8, "little") + raw[at + 8:]


@pytest.mark.parametrize("damage", [
    lambda raw: b"", lambda raw: raw[:-9], lambda raw: raw + b"\0", _flip_last,
    _claim_more_documents, lambda raw: b"x" * len(raw),
    lambda raw: _forged(raw, 0, 7), lambda raw: _forged(raw, 22, -1),
    lambda raw: _forged(raw, 22, 2**40)],
    ids=["empty", "truncated", "longer", "a flipped byte", "a larger count", "garbage",
         "a span in a file not listed", "a negative size", "a size past any document"])
def test_a_damaged_cache_file_is_scanned_past_and_rebuilt(tmp_path, scans, damage) -> None:
    root = _corpus(tmp_path / "corpus")
    first = open_corpus(str(root))
    (cached,) = index_cache.directory().glob("*.idx")
    good = cached.read_bytes()
    cached.write_bytes(damage(good))
    _same(open_corpus(str(root)), first)
    assert scans == [3, 3]
    assert cached.read_bytes() == good
    open_corpus(str(root))
    assert scans == [3, 3]


def test_a_cache_that_cannot_be_written_costs_only_a_scan(tmp_path, scans, monkeypatch) -> None:
    (tmp_path / "cache").write_text("a file where the cache directory would be")
    root = _corpus(tmp_path / "corpus")
    _same(open_corpus(str(root)), open_corpus(str(root)))
    assert scans == [3, 3]
