"""Documents stored as one field of records: JSON lines, a JSON array, or Parquet rows.

`index` validates a record file once and finds its documents; `read_block` and `field_of_line`
read them back for `Corpus.read`.
"""

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from hotjax.errors import UserError

# The most bytes one document may hold: it is read, decoded and tokenized whole, its token ids
# Python ints while tokenizing (up to ~40 host bytes per byte of text), so 16 MiB of text
# costs under a GiB. Longer texts are rarely one document: split them into records.
MAX_DOCUMENT_BYTES = 16 * 2**20
# A block (a JSON array file, a Parquet row group's text) is read whole into Python objects,
# several times its size, whenever one of its documents is read: past this, JSON lines (read a
# line at a time) or smaller row groups are the form.
MAX_BLOCK_BYTES = 256 * 2**20
_TEXT_TYPES = ("string", "large_string", "string_view", "binary", "large_binary", "binary_view")


@dataclass(frozen=True)
class Found:
    """The documents of one file: spans (file column left 0), text sizes (0: an empty
    document), and how many were not valid UTF-8."""

    kind: str  # "text", "jsonl", "json" or "parquet": how `Corpus.read` finds a document
    spans_Nx3: np.ndarray
    sizes_N: np.ndarray
    replaced: int


def kind_of(path: Path, named: bool) -> str | None:
    """The record kind a file's suffix says, if any. A `.json` file is read as records only when
    named on its own: inside a directory it is more likely configuration, read as text."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".parquet") or (suffix == ".json" and named):
        return suffix[1:]
    return None


def index(path: Path, kind: str, f: BinaryIO, text_field: str) -> Found:
    """The documents of the record file `path`, open as `f` at its start. The file is never
    held whole unless it is a JSON array (refused past MAX_BLOCK_BYTES before it is read)."""
    if kind == "parquet":
        return _index_parquet(path, text_field)
    if kind == "json" and _is_json_array(f):
        return _index_json_array(path, f, text_field)
    return _index_jsonl(path, f, text_field)


def _is_json_array(f: BinaryIO) -> bool:
    """Whether a `.json` file holds an array (else it holds JSON lines); `f` is left at its
    start."""
    try:
        while chunk := f.read(4096):
            if chunk.strip():
                return chunk.lstrip()[:1] == b"["
        return False
    finally:
        f.seek(0)


def field_of_line(line: str, text_field: str) -> str:
    return json.loads(line)[text_field]


def read_block(path: Path, kind: str, block: int, text_field: str) -> list[str]:
    """The texts of a JSON array file (its one block), or of one Parquet row group."""
    if kind == "json":
        return [r[text_field] for r in json.loads(path.read_bytes().decode(errors="replace"))]
    import pyarrow as pa  # here, not at the top: only Parquet corpora pay its import

    with _parquet_errors(path):
        column = _parquet(path).read_row_group(block, columns=[text_field]).column(0)
        # As bytes: a string column may hold invalid UTF-8, which Arrow does not check.
        values = column.cast(pa.large_binary()).to_pylist()
    return [_as_text(v) for v in values]


def _no_field(where: str, text_field: str) -> UserError:
    return UserError(f"{where}: no {text_field!r} string field — add one to each record, or "
                     f"name the field that holds the text (--text-field)")


def too_long(where: str, size: int | None, fix: str) -> UserError:
    """A document past MAX_DOCUMENT_BYTES (`size` None: not read to its end)."""
    what = (f"a document of {size:,} bytes, past the" if size is not None
            else "a line longer than the")
    return UserError(f"{where}: {what} {MAX_DOCUMENT_BYTES:,} bytes one document may hold "
                     f"(MAX_DOCUMENT_BYTES) — {fix}")


def _utf8_size(text: str, where: str, fix: str) -> int:
    """A document's size in UTF-8, refused past MAX_DOCUMENT_BYTES, or when JSON's escapes
    made it hold a lone surrogate (no UTF-8, and no tokenizer, takes one)."""
    try:
        size = len(text.encode())
    except UnicodeEncodeError as e:
        raise UserError(f"{where}: its text holds a lone surrogate ({text[e.start]!r}), which "
                        f"is not Unicode text — fix the record") from None
    if size > MAX_DOCUMENT_BYTES:
        raise too_long(where, size, fix)
    return size


def _index_jsonl(path: Path, f: BinaryIO, text_field: str) -> Found:
    """Each non-blank line of the open file `f` is a JSON object whose `text_field` string is
    one document. Lines are read one at a time, each at most MAX_DOCUMENT_BYTES: a longer one
    is refused before it is read whole."""
    spans, sizes, replaced, stop, lineno = [], [], 0, 0, 0
    while chunk := f.readline(MAX_DOCUMENT_BYTES + 1):
        if len(chunk) > MAX_DOCUMENT_BYTES and not chunk.endswith(b"\n"):
            raise too_long(f"{path}:{lineno + 1}", None, "split the document into several "
                           "records")
        for line in chunk.splitlines(keepends=True):  # as a bare CR ends a line too
            lineno += 1
            stop += len(line)
            if not line.strip():
                continue
            record = _record(line, f"{path}:{lineno}", text_field)
            text = record[text_field]
            replaced += not is_utf8(line)
            spans.append((0, stop - len(line), stop))
            sizes.append(_utf8_size(text, f"{path}:{lineno}", "split it into several records"))
    return Found("jsonl", np.array(spans, np.int64).reshape(-1, 3), np.array(sizes, np.int64),
                 replaced)


def _record(line: bytes, where: str, text_field: str) -> dict:
    try:
        record = json.loads(line.decode("utf-8", errors="replace"))
    except RecursionError:
        raise UserError(f"{where}: nests deeper than Python's JSON parser allows — each line "
                        f"must be a JSON object with a {text_field!r} string") from None
    except ValueError:  # JSONDecodeError, or an integer of more digits than Python parses
        raise UserError(f"{where}: not valid JSON — each line must be a JSON object with a "
                        f"{text_field!r} string") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise _no_field(where, text_field)
    return record


def _index_json_array(path: Path, f: BinaryIO, text_field: str) -> Found:
    """A JSON array of objects, each with a `text_field` string."""
    fix = "fix the file, or write one JSON object per line in a .jsonl file"
    size = os.fstat(f.fileno()).st_size
    if size > MAX_BLOCK_BYTES:
        raise UserError(f"{path}: {size:,} bytes, past the {MAX_BLOCK_BYTES:,} bytes of a "
                        f"JSON array file (MAX_BLOCK_BYTES), which is parsed whole — write one "
                        f"JSON object per line in a .jsonl file")
    raw = f.read(MAX_BLOCK_BYTES + 1)
    try:
        items = json.loads(raw.decode("utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}) — {fix}") from None
    except RecursionError:
        raise UserError(f"{path}: nests deeper than Python's JSON parser allows — {fix}") from None
    except ValueError as e:  # an integer of more digits than Python parses
        raise UserError(f"{path}: not valid JSON ({e}) — {fix}") from None
    for k, record in enumerate(items):
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise _no_field(f"{path}[{k}]", text_field)
        _utf8_size(record[text_field], f"{path}[{k}]", "split the document into several records")
    texts = [record[text_field] for record in items]
    # Only text decoded with replacements can hold U+FFFD when the file is not valid UTF-8.
    bad = not is_utf8(raw)
    return _found("json", [texts], replaced=sum("\ufffd" in t for t in texts) if bad else 0)


def _index_parquet(path: Path, text_field: str) -> Found:
    """Each row of a string (or binary) column `text_field` is one document. Each row group is
    sized before its text is read: its column's decompressed bytes from the footer, then each
    row's length read as a dictionary (a value repeated in every row is held once), at most
    MAX_BLOCK_BYTES a row group and MAX_DOCUMENT_BYTES a row."""
    import pyarrow as pa  # here, not at the top: only Parquet corpora pay its import
    import pyarrow.compute as pc

    with _parquet_errors(path):
        file = _parquet(path)
        schema = file.schema_arrow
        if text_field not in schema.names:
            raise UserError(f"{path}: no column {text_field!r} (columns: "
                            f"{', '.join(schema.names)}) — name the column that holds the text "
                            f"(--text-field)")
        if str(schema.field(text_field).type) not in _TEXT_TYPES:
            raise UserError(f"{path}: column {text_field!r} is {schema.field(text_field).type}, "
                            f"not text — name a string column (--text-field)")
        leaves = [file.metadata.schema.column(j).path for j in range(file.metadata.num_columns)]
        leaf = leaves.index(text_field)
        as_dictionary = _parquet(path, read_dictionary=[text_field])
        spans, sizes, replaced = [], [], 0
        for block in range(file.num_row_groups):
            claimed = file.metadata.row_group(block).column(leaf).total_uncompressed_size
            if claimed > MAX_BLOCK_BYTES:
                raise _block_too_large(path, block, f"its {text_field!r} column decompresses to "
                                       f"{claimed:,} bytes (so its footer says)")
            column = as_dictionary.read_row_group(block, columns=[text_field]).column(0)
            sizes_n, bad_n = [], []
            for chunk in column.chunks:
                sizes_v, bad_v = sizes_of(chunk.dictionary.cast(pa.binary()))
                low, high = pc.min_max(chunk.indices).values()
                if low.is_valid and not 0 <= low.as_py() <= high.as_py() < len(sizes_v):
                    raise _broken(path, f"row group {block} refers past its dictionary")
                indices = chunk.indices.fill_null(len(sizes_v))  # a null row: an empty text
                sizes_n.append(np.append(sizes_v, 0)[indices])
                bad_n.append(np.append(bad_v, False)[indices])
            sizes_n = np.concatenate(sizes_n) if sizes_n else np.zeros(0, np.int64)
            if sizes_n.sum() > MAX_BLOCK_BYTES:
                raise _block_too_large(path, block, f"its {len(sizes_n):,} rows hold "
                                       f"{int(sizes_n.sum()):,} bytes of text")
            if len(sizes_n) and sizes_n.max() > MAX_DOCUMENT_BYTES:
                row = int(np.argmax(sizes_n))
                raise too_long(f"{path} (row group {block}, row {row})", int(sizes_n[row]),
                               "split the document into several rows")
            spans += [(0, block, k) for k in range(len(sizes_n))]
            sizes.append(sizes_n)
            replaced += int(np.concatenate(bad_n).sum()) if bad_n else 0
    return Found("parquet", np.array(spans, np.int64).reshape(-1, 3),
                 np.concatenate(sizes).astype(np.int64) if sizes else np.zeros(0, np.int64),
                 replaced)


def sizes_of(values) -> tuple[np.ndarray, np.ndarray]:
    """Each of an Arrow binary array's values' size as text (invalid UTF-8 decoded with
    replacements), and whether it was invalid."""
    import pyarrow as pa
    import pyarrow.compute as pc

    sizes = pc.binary_length(values).fill_null(0).to_numpy(zero_copy_only=False)
    sizes = sizes.astype(np.int64)
    try:
        values.cast(pa.string())  # checks UTF-8
        return sizes, np.zeros(len(sizes), bool)
    except pa.ArrowInvalid:
        pass
    bad = np.array([v is not None and not is_utf8(v) for v in values.to_pylist()], bool)
    for k in np.flatnonzero(bad):
        sizes[k] = len(values[int(k)].as_py().decode("utf-8", errors="replace").encode())
    return sizes, bad


def _block_too_large(path: Path, block: int, what: str) -> UserError:
    return UserError(f"{path} (row group {block}): {what}, past the {MAX_BLOCK_BYTES:,} bytes "
                     f"of a row group, which is read whole (MAX_BLOCK_BYTES) — write the file in "
                     f"smaller row groups (pyarrow.parquet.write_table(..., row_group_size=...))")


def _parquet(path: Path, **options):
    """`path` as a `pyarrow.parquet.ParquetFile`."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path, **options)


@contextlib.contextmanager
def _parquet_errors(path: Path) -> Iterator[None]:
    """Arrow's refusals of a broken file, its footer or its pages, as one UserError line."""
    import pyarrow as pa

    try:
        yield
    # Arrow's own errors; a name in the file that is not UTF-8 is a UnicodeDecodeError.
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        raise _broken(path, (str(e).strip().splitlines() or [type(e).__name__])[0]) from None


def _broken(path: Path, reason: str) -> UserError:
    return UserError(f"cannot read Parquet file {path}: {reason} — pass a valid .parquet file")


def _found(kind: str, blocks: list[list[str]], replaced: int) -> Found:
    spans = [(0, b, k) for b, texts in enumerate(blocks) for k in range(len(texts))]
    sizes = [len(t.encode()) for texts in blocks for t in texts]
    return Found(kind, np.array(spans, np.int64).reshape(-1, 3), np.array(sizes, np.int64),
                 replaced)


def _as_text(value: str | bytes | None) -> str:
    if value is None:
        return ""
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
