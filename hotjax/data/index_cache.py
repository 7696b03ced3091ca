"""A corpus's index kept on disk under the hash of its content (`$HOTJAX_CACHE/corpus-index`),
so that opening the same corpus again hashes its bytes but parses none of them.

The key is the SHA-256 of every byte the corpus's fingerprint covers (each file's name, size and
whole content) and of what else shapes the index (the text field, each file's kind, the size
limits, this format's version): a changed byte is another key. The cache is never beside the
corpus, which may be read-only, and where a stray file would become a document. A cache file is
read as untrusted: its length checked against its header before the body is read, the body
against its own digest, every value against its bounds; any doubt and the corpus is scanned
again.
"""

import contextlib
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hotjax import bounds
from hotjax.config import cache_root
from hotjax.data import records

VERSION = 1
# How `Corpus` reads each file; stored by position, so a new kind goes at the end.
KINDS = ("text", "jsonl", "json", "parquet", "dataset", "tokens", "arrow", "token_records")
_MAGIC = b"hotjax corpus index\0"
_HEADER = len(_MAGIC) + 32 + 3 * 8 + 32  # magic, key, (version, files, documents), digest


@dataclass(frozen=True)
class Index:
    """What a scan finds, less what hashing alone knows: each file's kind, each document's span
    (file, a, b) and text size, and the documents decoded with replacements."""

    kinds: tuple[str, ...]
    spans_Dx3: np.ndarray  # int64
    sizes_D: np.ndarray  # int64
    replaced: int


def directory() -> Path:
    return cache_root() / "corpus-index"


def key(content: bytes, text_field: str, kinds: list[str]) -> bytes:
    """The cache key of a corpus whose fingerprinted bytes hash to `content`."""
    shape = (f"{VERSION}\0{records.MAX_DOCUMENT_BYTES}\0{records.MAX_BLOCK_BYTES}\0"
             f"{text_field}\0{','.join(kinds)}")
    return hashlib.sha256(content + shape.encode()).digest()


def load(cache_key: bytes, expected_kinds: list[str]) -> Index | None:
    """The index cached under `cache_key` for files of `expected_kinds`, or None when there is
    none or it fails any check."""
    try:
        with (directory() / f"{cache_key.hex()}.idx").open("rb") as f:
            header = f.read(_HEADER)
            if len(header) != _HEADER or not header.startswith(_MAGIC):
                return None
            at = len(_MAGIC)
            stored_key, (version, files, documents), digest = (
                header[at:at + 32], np.frombuffer(header, "<i8", 3, at + 32).tolist(),
                header[at + 56:])
            if (stored_key != cache_key or version != VERSION or files != len(expected_kinds)
                    or not 0 <= documents <= bounds.MAX_COUNT // 32):
                return None
            body_bytes = files + 32 * documents + 8
            if os.fstat(f.fileno()).st_size != _HEADER + body_bytes:
                return None
            body = f.read(body_bytes)
    except OSError:
        return None
    if len(body) != body_bytes or hashlib.blake2b(body, digest_size=32).digest() != digest:
        return None
    return _checked(body, files, documents, expected_kinds)


def _checked(body: bytes, files: int, documents: int, expected: list[str]) -> Index | None:
    """The index a digest-verified body holds, if every value is one a scan could give."""
    codes = np.frombuffer(body, np.uint8, files)
    if codes.size and codes.max() >= len(KINDS):
        return None
    kinds = tuple(KINDS[c] for c in codes)
    # A `.json` file asked for as records holds an array or JSON lines; others are as asked.
    if any(k != e and (e, k) != ("json", "jsonl") for k, e in zip(kinds, expected, strict=True)):
        return None
    spans_Dx3 = np.frombuffer(body, "<i8", 3 * documents, files).reshape(-1, 3)
    sizes_D = np.frombuffer(body, "<i8", documents, files + 24 * documents)
    replaced = int(np.frombuffer(body, "<i8", 1, files + 32 * documents)[0])
    if documents and (spans_Dx3.min() < 0 or spans_Dx3[:, 0].max() >= files
                      or np.any(np.diff(spans_Dx3[:, 0]) < 0) or sizes_D.min() < 0
                      or sizes_D.max() > records.MAX_DOCUMENT_BYTES):
        return None
    if not 0 <= replaced <= documents:
        return None
    return Index(kinds, spans_Dx3.astype(np.int64), sizes_D.astype(np.int64), replaced)


def save(cache_key: bytes, index: Index) -> None:
    """Keeps `index` under `cache_key`, whole or not at all; a cache that cannot be written
    (read-only, full) only costs the next run a scan."""
    body = (np.array([KINDS.index(k) for k in index.kinds], np.uint8).tobytes()
            + index.spans_Dx3.astype("<i8").tobytes() + index.sizes_D.astype("<i8").tobytes()
            + np.array([index.replaced], "<i8").tobytes())
    header = (_MAGIC + cache_key
              + np.array([VERSION, len(index.kinds), len(index.sizes_D)], "<i8").tobytes()
              + hashlib.blake2b(body, digest_size=32).digest())
    path = directory() / f"{cache_key.hex()}.idx"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(header + body)
        os.replace(partial, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(partial)
