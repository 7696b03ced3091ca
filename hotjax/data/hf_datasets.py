"""A Hugging Face `datasets` dataset as a corpus, saved with `save_to_disk` or in the local
Hugging Face cache (`hf:OWNER/NAME[:SPLIT]`, as `datasets.load_dataset` left it, read offline):
each row's text field one document, its Arrow files memory-mapped, one value read at a time.

`index` checks the directory's own JSON files within bounds before `datasets` reads them (every
data file it names inside the directory), and sizes each document from Arrow's lengths before any
text is read; `Rows.text` reads one back for `Corpus.read`. `cached_split` finds a cached
dataset's Arrow files, each then a corpus file of its own.
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hotjax import bounds
from hotjax.data import records
from hotjax.errors import UserError

INFO, STATE, SPLITS = "dataset_info.json", "state.json", "dataset_dict.json"  # as `datasets`
DEFAULT_SPLIT = "train"  # of a DatasetDict, unless --data-split names another
HUB_PREFIX = "hf:"  # --data hf:OWNER/NAME[:SPLIT], from the local Hugging Face cache
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


def open_rows(path: Path, kind: str, text_field: str) -> Rows:
    """The `text_field` column of a Dataset saved in the directory `path` (kind "dataset"), as
    `datasets` reads it, or of one Arrow file of the Hugging Face cache (kind "arrow")."""
    if kind == "arrow":
        import pyarrow as pa

        try:
            table = pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"cannot read {path} of the Hugging Face cache: "
                            f"{(str(e).strip().splitlines() or [''])[0][:300]} — load the "
                            f"dataset again online to repair the cache") from None
        return _text_column(table, text_field, path)
    datasets = _library(str(path))
    data_files(path)
    try:
        dataset = datasets.load_from_disk(str(path), keep_in_memory=False)
    except Exception as e:  # `datasets` and Arrow raise many kinds for a damaged directory
        raise UserError(f"cannot read the dataset {path}: {type(e).__name__}: "
                        f"{(str(e).strip().splitlines() or [''])[0][:300]} — {_FIX}") from None
    return _text_column(dataset.data.table, text_field, path)


def _library(source: str):
    try:
        import datasets
    except ModuleNotFoundError:
        raise UserError(f"--data {source} is a Hugging Face dataset, which needs its "
                        f"library: pip install hotjax[datasets]") from None
    return datasets


def _text_column(table, text_field: str, where: Path) -> Rows:
    if text_field not in table.column_names:
        raise UserError(f"{where}: no column {text_field!r} (columns: "
                        f"{', '.join(table.column_names)}) — name the column that holds the "
                        f"text (--text-field)")
    column = table.column(text_field)
    if str(column.type) not in ("string", "large_string"):
        raise UserError(f"{where}: column {text_field!r} is {column.type}, not text — name "
                        f"a string column (--text-field)")
    return Rows(tuple(column.chunks))


def index(path: Path, kind: str, text_field: str) -> records.Found:
    """The documents of a saved Dataset or a cached Arrow file (as `open_rows`): every row of
    its `text_field` column, sized from Arrow's lengths, each at most MAX_DOCUMENT_BYTES."""
    import pyarrow as pa

    rows = open_rows(path, kind, text_field)
    spans, sizes, replaced = [], [], 0
    for a, batch in enumerate(rows.batches):
        sizes_n, bad_n = records.sizes_of(batch.cast(pa.large_binary()))
        if len(sizes_n) and sizes_n.max() > records.MAX_DOCUMENT_BYTES:
            row = int(np.argmax(sizes_n))
            raise records.too_long(f"{path} (record batch {a}, row {row})",
                                   int(sizes_n[row]), "split the document into several rows")
        spans.append(np.stack([np.zeros(len(sizes_n), np.int64),
                               np.full(len(sizes_n), a, np.int64),
                               np.arange(len(sizes_n), dtype=np.int64)], axis=1))
        sizes.append(sizes_n)
        replaced += int(bad_n.sum())
    return records.Found(kind, np.concatenate(spans) if spans else np.zeros((0, 3), np.int64),
                         np.concatenate(sizes) if sizes else np.zeros(0, np.int64), replaced)


def cached_split(source: str, split: str | None) -> list[Path]:
    """The Arrow files of the dataset `source` names (`hf:OWNER/NAME[:SPLIT]`, the split else
    `split`, else DEFAULT_SPLIT) as `datasets.load_dataset` finds them in the local Hugging
    Face cache ($HF_HOME/datasets), offline: nothing is downloaded."""
    name, _, inline = source.removeprefix(HUB_PREFIX).partition(":")
    if not name or name.count("/") > 1 or name.startswith(("/", ".")) or name.endswith("/"):
        raise UserError(f"--data {source}: give hf:OWNER/NAME or hf:OWNER/NAME:SPLIT, a "
                        f"dataset's name on the Hugging Face hub")
    if inline and split and inline != split:
        raise UserError(f"--data {source} names split {inline!r}, --data-split {split!r}: "
                        f"keep one")
    chosen = inline or split or DEFAULT_SPLIT
    datasets = _library(source)
    try:
        with _offline(datasets):
            loaded = datasets.load_dataset(name)
    except ConnectionError:  # offline, and not in the cache
        raise UserError(f"--data {source}: not in the local Hugging Face cache "
                        f"({datasets.config.HF_DATASETS_CACHE}) — load it once online "
                        f"(python -c \"import datasets; datasets.load_dataset('{name}')\"), or "
                        f"set HF_HOME to the cache that holds it") from None
    except Exception as e:  # `datasets` raises many kinds for what it cannot read
        raise UserError(f"--data {source}: cannot read it from the local Hugging Face cache: "
                        f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
                        f" — load it again online, one configuration of it in the cache") from None
    if chosen not in loaded:
        raise UserError(f"--data {source}: no split {chosen!r} (splits: "
                        f"{', '.join(loaded)}) — name one: hf:{name}:SPLIT")
    files = [Path(f["filename"]) for f in loaded[chosen].cache_files]
    if not files:
        raise UserError(f"--data {source}: split {chosen!r} has no files in the cache — load "
                        f"it again online")
    return files


@contextlib.contextmanager
def _offline(datasets) -> Iterator[None]:
    """`datasets` and `huggingface_hub` offline (HF_HUB_OFFLINE) and quiet for a while: set on
    their modules, which read the environment once when imported, maybe before this."""
    from huggingface_hub import constants

    was = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.logging.get_verbosity()
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    datasets.logging.set_verbosity_error()  # not "Using the latest cached version ..."
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = was[:2]
        datasets.logging.set_verbosity(was[2])
