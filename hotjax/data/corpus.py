"""Where training documents come from: the stdlib, a directory, a JSONL file or one text file.

`open_corpus` scans the source once (to validate it, count odd files and fingerprint it) but keeps
only an index of byte spans; `Corpus.read` loads one document's text when it is needed.
"""

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hotjax.errors import UserError

BINARY_SNIFF_BYTES = 8192  # a NUL byte this early marks a file as binary
_FIX = "pass a directory of text files, a .jsonl file with a 'text' field, or a text file"


@dataclass(frozen=True)
class CorpusStats:
    """What the scan found: documents kept, and files or lines that needed care."""

    documents: int
    empty: int  # documents with no text; packing drops them
    replaced: int  # documents that were not valid UTF-8, decoded with U+FFFD replacements
    binary: int  # files skipped because they look binary
    bytes: int  # raw size of the documents kept


@dataclass(frozen=True, eq=False)
class Corpus:
    """An index of documents: document i is bytes [start, stop) of `files[file]`."""

    source: str  # the path the user gave, or "stdlib"
    files: tuple[Path, ...]
    spans_Dx3: np.ndarray  # int64 rows of (file index, start byte, stop byte)
    jsonl: bool  # whether each span is a JSON line holding a "text" field
    stats: CorpusStats
    fingerprint: str  # hash of the documents' names and contents, for cache keys

    @property
    def num_documents(self) -> int:
        return len(self.spans_Dx3)

    def read(self, i: int) -> str:
        """The text of document i."""
        file, start, stop = (int(x) for x in self.spans_Dx3[i])
        with self.files[file].open("rb") as f:
            f.seek(start)
            text = f.read(stop - start).decode("utf-8", errors="replace")
        return json.loads(text)["text"] if self.jsonl else text


def stdlib_files() -> list[Path]:
    """The running interpreter's standard-library `.py` files (not site-packages), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "site-packages"]
        paths += [Path(dirpath, name) for name in filenames if name.endswith(".py")]
    return sorted(paths, key=lambda p: p.relative_to(root).as_posix())


def open_corpus(path: str | None) -> Corpus:
    """Index a corpus: None is the stdlib; else a directory, a `.jsonl` file or a text file."""
    if path is None:
        return _index_files("stdlib", Path(sysconfig.get_paths()["stdlib"]), stdlib_files())
    root = Path(path)
    if root.is_dir():
        files = sorted(
            (p for p in root.rglob("*") if p.is_file()),
            key=lambda p: p.relative_to(root).as_posix(),
        )
        return _index_files(path, root, files)
    if root.is_file() and root.suffix == ".jsonl":
        return _index_jsonl(path, root)
    if root.is_file():
        return _index_files(path, root.parent, [root])
    raise UserError(f"corpus not found: {path} — {_FIX}, or omit it for the stdlib corpus")


def _index_files(source: str, root: Path, paths: list[Path]) -> Corpus:
    """Each text file is one document; files with NUL bytes near the start are skipped."""
    hasher = hashlib.sha256(b"files\0")
    kept, sizes = [], []
    empty = replaced = binary = 0
    for p in paths:
        raw = _read_bytes(p)
        if b"\0" in raw[:BINARY_SNIFF_BYTES]:
            binary += 1
            continue
        empty += not raw
        replaced += not _is_utf8(raw)
        name = p.relative_to(root).as_posix().encode()
        hasher.update(len(name).to_bytes(8, "little") + name + len(raw).to_bytes(8, "little"))
        hasher.update(raw)
        kept.append(p)
        sizes.append(len(raw))
    if not kept:
        raise UserError(f"no text files in corpus {source} ({binary} binary skipped) — {_FIX}")
    spans_Dx3 = np.zeros((len(kept), 3), np.int64)
    spans_Dx3[:, 0] = np.arange(len(kept))
    spans_Dx3[:, 2] = sizes
    stats = CorpusStats(len(kept), empty, replaced, binary, sum(sizes))
    return _checked(Corpus(source, tuple(kept), spans_Dx3, False, stats, hasher.hexdigest()[:16]))


def _index_jsonl(source: str, path: Path) -> Corpus:
    """Each non-blank line is a JSON object whose "text" string is one document."""
    raw = _read_bytes(path)
    spans, empty, replaced, stop = [], 0, 0, 0
    for lineno, line in enumerate(raw.splitlines(keepends=True), start=1):
        stop += len(line)
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8", errors="replace"))
        except json.JSONDecodeError:
            raise UserError(
                f"{source}:{lineno}: not valid JSON — each line must be a JSON object with a "
                f"'text' string"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise UserError(f"{source}:{lineno}: no 'text' string field — add one to each line")
        empty += not record["text"]
        replaced += not _is_utf8(line)
        spans.append((0, stop - len(line), stop))
    spans_Dx3 = np.array(spans, np.int64).reshape(-1, 3)
    stats = CorpusStats(len(spans), empty, replaced, 0, len(raw))
    hasher = hashlib.sha256(b"jsonl\0" + raw)
    return _checked(Corpus(source, (path,), spans_Dx3, True, stats, hasher.hexdigest()[:16]))


def _checked(corpus: Corpus) -> Corpus:
    if corpus.stats.documents == corpus.stats.empty:
        raise UserError(
            f"empty corpus: {corpus.source} has no non-empty documents — add text or pass "
            f"another corpus"
        )
    return corpus


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise UserError(
            f"cannot read corpus file {path}: {e.strerror} — fix its permissions"
        ) from e


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
