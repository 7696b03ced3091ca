"""A Hugging Face `datasets` dataset saved with `save_to_disk` as a corpus: each row's text field
one document, read by `datasets` itself (its Arrow files memory-mapped, one value at a time).

`index` checks the directory's own JSON files within bounds before `datasets` reads them (every
data file it names inside the directory), and sizes each document from Arrow's lengths before any
text is read; `Rows.text` reads one back for `Corpus.read`.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hotjax.data import records
from models import bounds
from models.errors import UserError

INFO, STATE, SPLITS = "dataset_info.json", "state.json", "dataset_dict.json"  # as `datasets`
DEFAULT_SPLIT = "train"  # of a DatasetDict, unless --data-split names another
_FIX = "save it again with Dataset.save_to_disk, or pass another --data"


def is_saved(path: Path) -> bool:
    """Whether `path` is a directory `save_to_disk` wrote: a Dataset's or a DatasetDict's."""
    return path.is_dir() and ((path / INFO).is_file() and (path / STATE).is_file()
                              or (path / SPLITS).is_file())


def split_of(path: Path, split: str | None) -> Path:
    """The directory of the Dataset `path` holds: itself, or a DatasetDict's `split` (default
    DEFAULT_SPLIT), one of the splits its dataset_dict.json lists."""
    if not (path / SPLITS).is_file():
        if split is not None:
            raise UserError(f"--data-split {split}: {path} holds one dataset, not a "
                            f"DatasetDict of splits — drop --data-split")
        return path
    listed = bounds.mapping(bounds.read_json(path / SPLITS, "split list", _FIX), "the file",
                            str(path / SPLITS), _FIX).get("splits")
    if not isinstance(listed, list) or not all(isinstance(s, str) for s in listed):
        raise UserError(f"{path / SPLITS}: splits is {bounds.show(listed)}, not a list of "
                        f"names — {_FIX}")
    chosen = split or DEFAULT_SPLIT
    if chosen not in listed:
        names = ", ".join(map(str, listed[:20]))
        raise UserError(f"{path}: no split {chosen!r} (splits: {names}) — name one with "
                        f"--data-split")
    return _inside(path, chosen, path / SPLITS)


def _inside(directory: Path, name: str, where: Path) -> Path:
    """`directory / name`, refused unless it resolves inside `directory`."""
    found = (directory / name).resolve()
    if not found.is_relative_to(directory.resolve()) or found == directory.resolve():
        raise UserError(f"{where}: names {name!r}, which leads outside {directory}: nothing "
                        f"outside was read — {_FIX}")
    return found


def data_files(directory: Path) -> list[Path]:
    """The Arrow files a Dataset directory's state.json names, each inside the directory;
    its dataset_info.json checked within the JSON bounds too (`datasets` parses both whole)."""
    bounds.read_json(directory / INFO, "dataset info", _FIX)
    state = bounds.mapping(bounds.read_json(directory / STATE, "dataset state", _FIX),
                           "the file", str(directory / STATE), _FIX)
    files = state.get("_data_files")
    if not isinstance(files, list) or not all(
            isinstance(f, dict) and isinstance(f.get("filename"), str) for f in files):
        raise UserError(f"{directory / STATE}: _data_files is {bounds.show(files)}, not a list "
                        f"of {{filename: ...}} — {_FIX}")
    return [_inside(directory, f["filename"], directory / STATE) for f in files]


@dataclass(frozen=True)
class Rows:
    """A saved Dataset's text column, memory-mapped: record batch `a`'s row `b` is a
    document."""

    batches: tuple[Any, ...]  # pyarrow arrays of strings

    def text(self, a: int, b: int) -> str:
        value = self.batches[a][b].as_py()
        return "" if value is None else value


def open_rows(directory: Path, text_field: str) -> Rows:
    """The `text_field` column of the Dataset saved in `directory`, as `datasets` reads it."""
    try:
        import datasets
    except ModuleNotFoundError:
        raise UserError(f"--data {directory} is a Hugging Face dataset, which needs its "
                        f"library: pip install hotjax[datasets]") from None
    data_files(directory)
    try:
        dataset = datasets.load_from_disk(str(directory), keep_in_memory=False)
    except Exception as e:  # `datasets` and Arrow raise many kinds for a damaged directory
        raise UserError(f"cannot read the dataset {directory}: {type(e).__name__}: "
                        f"{(str(e).strip().splitlines() or [''])[0][:300]} — {_FIX}") from None
    if text_field not in dataset.column_names:
        raise UserError(f"{directory}: no column {text_field!r} (columns: "
                        f"{', '.join(dataset.column_names)}) — name the column that holds the "
                        f"text (--text-field)")
    column = dataset.data.table.column(text_field)
    if str(column.type) not in ("string", "large_string"):
        raise UserError(f"{directory}: column {text_field!r} is {column.type}, not text — name "
                        f"a string column (--text-field)")
    return Rows(tuple(column.chunks))


def index(directory: Path, text_field: str) -> records.Found:
    """The documents of the Dataset saved in `directory`: every row of its `text_field`
    column, sized from Arrow's lengths, each at most MAX_DOCUMENT_BYTES."""
    import pyarrow as pa

    rows = open_rows(directory, text_field)
    spans, sizes, replaced = [], [], 0
    for a, batch in enumerate(rows.batches):
        sizes_n, bad_n = records.sizes_of(batch.cast(pa.large_binary()))
        if len(sizes_n) and sizes_n.max() > records.MAX_DOCUMENT_BYTES:
            row = int(np.argmax(sizes_n))
            raise records.too_long(f"{directory} (record batch {a}, row {row})",
                                   int(sizes_n[row]), "split the document into several rows")
        spans.append(np.stack([np.zeros(len(sizes_n), np.int64),
                               np.full(len(sizes_n), a, np.int64),
                               np.arange(len(sizes_n), dtype=np.int64)], axis=1))
        sizes.append(sizes_n)
        replaced += int(bad_n.sum())
    return records.Found("dataset", np.concatenate(spans) if spans else np.zeros((0, 3), np.int64),
                         np.concatenate(sizes) if sizes else np.zeros(0, np.int64), replaced)
