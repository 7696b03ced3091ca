"""Pre-tokenized corpora: token ids that the tokenizer never reads again, in a `.npy` or an
ArrayRecord file; `--tokenizer` names the tokenizer that made them, for its vocabulary, BOS, EOS
and pad.

A `.npy` holds one 1-D integer array, the documents' ids one after another, each document ending
with the tokenizer's EOS id (so the file's last id is the EOS, which `index` takes as the
separator); it is read memory-mapped (`numpy.load`, never a pickle), a document's ids at a time.
An ArrayRecord file (`.array_record`, as Grain reads; its shards named one at a time) holds one
record per document: its ids as little-endian int32 bytes (`numpy.asarray(ids, "<i4").tobytes()`),
without BOS or EOS, which training adds as to tokenized text; read a record at a time.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hotjax.data import records
from hotjax.errors import UserError

SUFFIX = ".npy"
RECORDS = ".array_record"  # in the name: Grain's shards are NAME.array_record-00000-of-00008
KINDS = ("tokens", "token_records")  # a .npy, an ArrayRecord file
_FIX = ("save the ids with numpy.save as one 1-D integer array, each document followed by the "
        "tokenizer's EOS id")
_RECORDS_FIX = ("write one record per document, its ids as little-endian int32 bytes "
                "(numpy.asarray(ids, '<i4').tobytes())")
_RECORDS_READ = 1024  # records read at a time while indexing


def kind_of(path: Path) -> str | None:
    """The kind of pre-tokenized file the name of `path` says, if any."""
    if path.suffix.lower() == SUFFIX:
        return "tokens"
    return "token_records" if RECORDS in path.name.lower() else None


def opener(kind: str):
    """How a file of `kind` is opened for `document`."""
    return open_ids if kind == "tokens" else open_records


def _checked(ids: np.ndarray, tokenizer, where: str) -> list[int]:
    if len(ids) and (int(ids.max()) >= tokenizer.vocab_size or int(ids.min()) < 0):
        raise UserError(f"{where}: holds ids outside 0 to {tokenizer.vocab_size - 1}, the "
                        f"tokenizer's — pass the --tokenizer that made the ids")
    return ids.tolist()


@dataclass(frozen=True)
class TokenFile:
    """A `.npy` of ids, memory-mapped, and the EOS id that ends each of its documents."""

    ids_T: np.ndarray
    eos_id: int

    def document(self, a: int, b: int, tokenizer, where: str) -> list[int]:
        """Ids [a, b) (a document, without its EOS, `where` in messages), checked against
        `tokenizer`."""
        if tokenizer.eos_id != self.eos_id:
            raise UserError(f"{where}: its documents end with id {self.eos_id}, but the "
                            f"tokenizer's EOS is {tokenizer.eos_id} — pass the --tokenizer that "
                            f"made the ids")
        return _checked(self.ids_T[a:b], tokenizer, where)


@dataclass(frozen=True)
class TokenRecords:
    """An ArrayRecord file of documents' ids, a record each."""

    path: Path
    reader: Any  # array_record's ArrayRecordReader, whose reads may run in several threads

    def document(self, a: int, b: int, tokenizer, where: str) -> list[int]:
        """The ids of record a (records [a, b) are one document; `where` in messages)."""
        return _checked(_ids(where, self.read(a, b, where)[0]), tokenizer, where)

    def read(self, a: int, b: int, where: str) -> list[bytes]:
        """The bytes of records [a, b)."""
        try:
            return self.reader.read(a, b)
        except RuntimeError as e:  # Riegeli's refusal of a damaged file
            raise UserError(f"cannot read ArrayRecord file {where}: "
                            f"{(str(e).splitlines() or [''])[0][:300]} — {_RECORDS_FIX}") from None


def _ids(where: str, raw: bytes) -> np.ndarray:
    if len(raw) % 4:
        raise UserError(f"{where}: {len(raw):,} bytes, not whole int32 ids — "
                        f"{_RECORDS_FIX}")
    if len(raw) // 4 > records.MAX_DOCUMENT_BYTES:
        raise UserError(f"{where}: {len(raw) // 4:,} ids, past the "
                        f"{records.MAX_DOCUMENT_BYTES:,} one document may hold "
                        f"(MAX_DOCUMENT_BYTES) — split the document")
    return np.frombuffer(raw, "<i4")


def open_records(path: Path) -> TokenRecords:
    """The ArrayRecord file at `path`, opened for reads of any record in any order."""
    try:
        from array_record.python.array_record_module import ArrayRecordReader
    except ModuleNotFoundError:
        raise UserError(f"--data {path} is an ArrayRecord file, which needs its library: pip "
                        f"install array_record") from None
    try:
        reader = ArrayRecordReader(str(path), "readahead_buffer_size:0,max_parallelism:0")
        ok = reader.ok() and reader.num_records() > 0
    except RuntimeError as e:
        raise UserError(f"cannot read ArrayRecord file {path}: "
                        f"{(str(e).splitlines() or [''])[0][:300]} — {_RECORDS_FIX}") from None
    if not ok:
        raise UserError(f"{path}: holds no records, or is not an ArrayRecord file — "
                        f"{_RECORDS_FIX}")
    return TokenRecords(path, reader)


def open_ids(path: Path) -> TokenFile:
    """The ids of `path`, memory-mapped, refused unless one 1-D integer array ending with its
    separator."""
    try:
        ids_T = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise UserError(f"cannot read token ids {path}: {str(e)[:200]} — {_FIX}") from None
    if not isinstance(ids_T, np.ndarray) or ids_T.ndim != 1 or ids_T.dtype.kind not in "iu":
        raise UserError(f"{path}: holds {getattr(ids_T, 'dtype', type(ids_T).__name__)} of shape "
                        f"{getattr(ids_T, 'shape', '?')}, not one 1-D array of integer ids — "
                        f"{_FIX}")
    if not len(ids_T):
        raise UserError(f"{path}: holds no ids — {_FIX}")
    return TokenFile(ids_T, int(ids_T[-1]))


def index(path: Path, kind: str) -> records.Found:
    """The documents of the pre-tokenized file at `path` (of `kind`), each at most
    MAX_DOCUMENT_BYTES ids."""
    if kind == "token_records":
        return _index_records(path)
    return _index_ids(path)


def _index_records(path: Path) -> records.Found:
    """An ArrayRecord file's records, each a document."""
    tokens = open_records(path)
    n = tokens.reader.num_records()
    sizes_N = np.zeros(n, np.int64)
    for start in range(0, n, _RECORDS_READ):
        for k, raw in enumerate(tokens.read(start, min(n, start + _RECORDS_READ), str(path))):
            sizes_N[start + k] = len(_ids(f"{path} (record {start + k})", raw))
    records_N = np.arange(n, dtype=np.int64)
    spans_Nx3 = np.stack([np.zeros(n, np.int64), records_N, records_N + 1], axis=1)
    return records.Found("token_records", spans_Nx3, sizes_N, 0)


def _index_ids(path: Path) -> records.Found:
    """The documents of the `.npy` at `path`: the ids up to each EOS (the file's last id), each
    at most MAX_DOCUMENT_BYTES ids."""
    tokens = open_ids(path)
    ends_N = np.flatnonzero(tokens.ids_T == tokens.eos_id)
    starts_N = np.concatenate([[0], ends_N[:-1] + 1])
    sizes_N = (ends_N - starts_N).astype(np.int64)
    if sizes_N.max() > records.MAX_DOCUMENT_BYTES:
        doc = int(np.argmax(sizes_N))
        raise UserError(f"{path} (document {doc}): {int(sizes_N[doc]):,} ids, past the "
                        f"{records.MAX_DOCUMENT_BYTES:,} one document may hold "
                        f"(MAX_DOCUMENT_BYTES) — split the document")
    spans_Nx3 = np.stack([np.zeros_like(starts_N), starts_N, ends_N], axis=1).astype(np.int64)
    return records.Found("tokens", spans_Nx3, sizes_N, 0)
