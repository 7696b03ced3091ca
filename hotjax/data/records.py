"""Documents stored as one field of records: JSON lines, a JSON array, or Parquet rows.

`index` validates a record file once and finds its documents; `read_block` and `field_of_line`
read them back for `Corpus.read`.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.errors import UserError

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
    if kind == "parquet":
        return _index_parquet(path, text_field)
    if kind == "json" and raw.lstrip()[:1] == b"[":
        return _index_json_array(path, raw, text_field)
    return _index_jsonl(path, raw, text_field)  # a .json file that is not an array: JSON lines


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


def _index_jsonl(path: Path, raw: bytes, text_field: str) -> Found:
    """Each non-blank line is a JSON object whose `text_field` string is one document."""
    spans, sizes, empty, replaced, stop = [], [], 0, 0, 0
    for lineno, line in enumerate(raw.splitlines(keepends=True), start=1):
        stop += len(line)
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8", errors="replace"))
        except json.JSONDecodeError:
            raise UserError(f"{path}:{lineno}: not valid JSON — each line must be a JSON object "
                            f"with a {text_field!r} string") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise _no_field(f"{path}:{lineno}", text_field)
        text = record[text_field]
        empty += not text
        replaced += not is_utf8(line)
        spans.append((0, stop - len(line), stop))
        sizes.append(len(text.encode()))
    return Found("jsonl", np.array(spans, np.int64).reshape(-1, 3), np.array(sizes, np.int64),
                 empty, replaced)


def _index_json_array(path: Path, raw: bytes, text_field: str) -> Found:
    """A JSON array of objects, each with a `text_field` string."""
    try:
        items = json.loads(raw.decode("utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}) — fix the file, "
                        f"or write one JSON object per line in a .jsonl file") from None
    for k, record in enumerate(items):
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise _no_field(f"{path}[{k}]", text_field)
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
