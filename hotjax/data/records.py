"""Documents stored as one field of records: JSON lines, a JSON array, or Parquet rows.

`index` validates a record file once and finds its documents; `read_block` and `field_of_line`
read them back for `Corpus.read`.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from models.errors import UserError

# The most bytes one document may hold: it is read, decoded and tokenized whole, its token ids
# Python ints while tokenizing (up to ~40 host bytes per byte of text), so 16 MiB of text
# costs under a GiB. Longer texts are rarely one document: split them into records.
MAX_DOCUMENT_BYTES = 16 * 2**20
# A JSON array file is parsed whole into Python objects, several times its size, and again
# when its documents are read: past this, JSON lines (read a line at a time) are the form.
MAX_JSON_ARRAY_BYTES = 256 * 2**20
_TEXT_TYPES = ("string", "large_string", "string_view", "binary", "large_binary", "binary_view")


@dataclass(frozen=True)
class Found:
    """The documents of one file: spans (file column left 0), text sizes, odd ones counted."""

    kind: str  # "text", "jsonl", "json" or "parquet": how `Corpus.read` finds a document
    spans_Nx3: np.ndarray
    sizes_N: np.ndarray
    empty: int
    replaced: int


def kind_of(path: Path, named: bool) -> str | None:
    """The record kind a file's suffix says, if any. A `.json` file is read as records only when
    named on its own: inside a directory it is more likely configuration, read as text."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".parquet") or (suffix == ".json" and named):
        return suffix[1:]
    return None


def index(path: Path, kind: str, raw: bytes, text_field: str) -> Found:
    """The documents of a JSON array or Parquet file, whose bytes `raw` are read whole."""
    if kind == "parquet":
        return _index_parquet(path, text_field)
    return _index_json_array(path, raw, text_field)


def is_json_array(path: Path) -> bool:
    """Whether a `.json` file holds an array (else it holds JSON lines)."""
    with path.open("rb") as f:
        while chunk := f.read(4096):
            if chunk.strip():
                return chunk.lstrip()[:1] == b"["
    return False


def field_of_line(line: str, text_field: str) -> str:
    return json.loads(line)[text_field]


def read_block(path: Path, kind: str, block: int, text_field: str) -> list[str]:
    """The texts of a JSON array file (its one block), or of one Parquet row group."""
    if kind == "json":
        return [r[text_field] for r in json.loads(path.read_bytes().decode(errors="replace"))]
    import pyarrow.parquet as pq  # here, not at the top: only Parquet corpora pay its import

    column = pq.ParquetFile(path).read_row_group(block, columns=[text_field]).column(0)
    return [_as_text(v) for v in column.to_pylist()]


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


def index_jsonl(path: Path, f: BinaryIO, text_field: str, seen: Callable[[bytes], None]) -> Found:
    """Each non-blank line of the open file `f` is a JSON object whose `text_field` string is
    one document. Lines are read one at a time, each at most MAX_DOCUMENT_BYTES: a longer one
    is refused before it is read whole. `seen` gets every byte read, in order."""
    spans, sizes, empty, replaced, stop, lineno = [], [], 0, 0, 0, 0
    while chunk := f.readline(MAX_DOCUMENT_BYTES + 1):
        seen(chunk)
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
            empty += not text
            replaced += not is_utf8(line)
            spans.append((0, stop - len(line), stop))
            sizes.append(_utf8_size(text, f"{path}:{lineno}", "split it into several records"))
    return Found("jsonl", np.array(spans, np.int64).reshape(-1, 3), np.array(sizes, np.int64),
                 empty, replaced)


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


def _index_json_array(path: Path, raw: bytes, text_field: str) -> Found:
    """A JSON array of objects, each with a `text_field` string."""
    fix = "fix the file, or write one JSON object per line in a .jsonl file"
    if len(raw) > MAX_JSON_ARRAY_BYTES:
        raise UserError(f"{path}: {len(raw):,} bytes, past the {MAX_JSON_ARRAY_BYTES:,} bytes "
                        f"of a JSON array file (MAX_JSON_ARRAY_BYTES), which is parsed whole — "
                        f"write one JSON object per line in a .jsonl file")
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
    return _found("json", [texts], empty=sum(not t for t in texts),
                  replaced=sum("\ufffd" in t for t in texts) if bad else 0)


def _index_parquet(path: Path, text_field: str) -> Found:
    """Each row of a string (or binary) column `text_field` is one document."""
    import pyarrow as pa  # here, not at the top: only Parquet corpora pay its import
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"cannot read Parquet file {path}: {e} — pass a valid .parquet "
                        f"file") from None
    schema = file.schema_arrow
    if text_field not in schema.names:
        raise UserError(f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)})"
                        f" — name the column that holds the text (--text-field)")
    if str(schema.field(text_field).type) not in _TEXT_TYPES:
        raise UserError(f"{path}: column {text_field!r} is {schema.field(text_field).type}, "
                        f"not text — name a string column (--text-field)")
    groups, replaced = [], 0
    for block in range(file.num_row_groups):
        values = file.read_row_group(block, columns=[text_field]).column(0).to_pylist()
        replaced += sum(isinstance(v, bytes) and not is_utf8(v) for v in values)
        for k, v in enumerate(values):
            _utf8_size(_as_text(v), f"{path} (row group {block}, row {k})",
                       "split the document into several rows")
        groups.append([_as_text(v) for v in values])
    return _found("parquet", groups, empty=sum(not t for g in groups for t in g),
                  replaced=replaced)


def _found(kind: str, blocks: list[list[str]], empty: int, replaced: int) -> Found:
    spans = [(0, b, k) for b, texts in enumerate(blocks) for k in range(len(texts))]
    sizes = [len(t.encode()) for texts in blocks for t in texts]
    return Found(kind, np.array(spans, np.int64).reshape(-1, 3), np.array(sizes, np.int64),
                 empty, replaced)


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
