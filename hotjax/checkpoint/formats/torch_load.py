"""The one place a foreign checkpoint's torch files are loaded: `torch.load`'s weights-only
loader, memory-mapped (`load`); DCP `.metadata` and saved objects (`read_dcp_metadata`,
`dcp_reader`, `dcp_planner`); `torch.save` files of pickled objects read as data
(`read_torch_save`). What each may build is `allowed`'s; no code a file names ever runs.
`need_torch` is the one guard for a missing torch."""

from __future__ import annotations

import functools
import io
import pickle
import re
import sys
import threading
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from hotjax.checkpoint.formats import allowed
from hotjax.checkpoint.meta import first_line
from hotjax.errors import UserError
from hotjax.paths import inside, shown

_CRAFTED = "the file is not a PyTorch checkpoint's, or was crafted; nothing was run"
# A DCP `.metadata` lists every chunk of every tensor: a few MiB for a 70B model saved by a
# thousand ranks. Unpickling builds at most a few times a file's bytes in objects.
MAX_METADATA_BYTES = 512 * 2**20
# A pickled object (Megatron's args, an optimizer's param groups), unpacked: a few KiB to MiB.
MAX_OBJECT_BYTES = 64 * 2**20


def _named(text: str) -> str:
    """A `module.name` a pickle refers to, as a message shows it."""
    return text if len(text) <= 80 and text.isprintable() else shown(text, 80)


def need_torch(what: str) -> Any:
    """torch, or a one-line error: `what` ("DeepSpeed checkpoints") need it."""
    try:
        import torch
    except ImportError:
        raise UserError(f"{what} need torch: pip install 'hotjax[torch]'") from None
    return torch


# torch's `safe_globals` sets and then restores one process-wide list: loads from several threads
# (an import's writers) would drop each other's classes.
_LOADING = threading.Lock()


def load(file: Path, allow: Sequence[Any], *, what: str, refused: str, unreadable: str) -> Any:
    """A `torch.save` file, tensors memory-mapped (read when touched), by torch's weights-only
    loader, which besides tensors and plain containers builds only `allow` (`allowed`'s).
    `what` names the checkpoints for a missing torch; a refusal is a line ending in `refused`
    (its `{detail}` what was refused), a damaged file one ending in `unreadable` (its `{error}`
    the loader's)."""
    torch = need_torch(what)
    try:
        with _LOADING, torch.serialization.safe_globals(list(allow)):
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise UserError(f"{file}: torch's weights-only loader refuses it"
                        + refused.format(detail=refused_by_torch(e))) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise UserError(f"{file}: " + unreadable.format(error=first_line(e))) from None


# ---------------------------------------------------------------------------- DCP

class _MetadataUnpickler(pickle.Unpickler):
    """A DCP `.metadata` unpickler that builds torch's records and refuses anything else."""

    def __init__(self, file: BinaryIO, where: Path):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = allowed.dcp_metadata().get((module, name))
        if found is None:
            raise UserError(f"{self.where}: refers to {_named(module + '.' + name)}, which a "
                            f"checkpoint's metadata never holds: {_CRAFTED}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UserError(f"{self.where}: holds a persistent id, which a checkpoint's metadata "
                        f"never holds: {_CRAFTED}")


def read_dcp_metadata(directory: Path) -> Any:
    """The `Metadata` of the DCP checkpoint in `directory`, its rank files checked to lie
    inside it; post-processed as torch's `FileSystemReader.read_metadata` does."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    file = directory / ".metadata"
    if file.stat().st_size > MAX_METADATA_BYTES:
        raise UserError(f"{file}: holds {file.stat().st_size:,} bytes, more than any DCP "
                        f"checkpoint's metadata ({MAX_METADATA_BYTES:,}, MAX_METADATA_BYTES): "
                        f"{_CRAFTED}")
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f, file).load()
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle fails in many ways
        raise UserError(f"{file}: unreadable ({type(e).__name__}: {first_line(e)}): the "
                        f"checkpoint is damaged") from None
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(metadata, Metadata) or not isinstance(storage, dict) or not all(
            isinstance(s, _StorageInfo) for s in storage.values()):
        raise UserError(f"{file}: holds no DCP metadata with its rank files (it unpickles to "
                        f"{type(metadata).__name__}): the checkpoint is damaged")
    checked: set[str] = set()
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name not in checked:
            inside(directory, name, file)
            checked.add(name)
    if not isinstance(getattr(metadata, "storage_meta", None), StorageMeta):
        metadata.storage_meta = StorageMeta()
    return metadata


def saved_object(value: BinaryIO, where: Path, key: str) -> Any:
    """A DCP checkpoint's saved object (a `torch.save` stream), by torch's weights-only loader:
    tensors and plain data only."""
    import torch

    try:
        _check_unpacked(value, where, f"saved object {key}")
        refused = torch.serialization.get_unsafe_globals_in_checkpoint(value)
        value.seek(0)
        if not refused:
            return torch.load(value, map_location="cpu", weights_only=True)
        detail = f"refers to {', '.join(_named(r) for r in refused[:3])}"
    except pickle.UnpicklingError as e:
        detail = refused_by_torch(e)
    except Exception as e:  # noqa: BLE001 - a damaged stream fails in many ways
        raise UserError(f"{where}: saved object {key} is unreadable ({type(e).__name__}: "
                        f"{first_line(e)}): the checkpoint is damaged") from None
    raise UserError(f"{where}: torch's weights-only loader refuses saved object {key} "
                    f"({detail}): {_CRAFTED}")


def refused_by_torch(e: BaseException) -> str:
    """What torch's weights-only loader refused, from its error: the global the file refers
    to, or the loader's reason."""
    text = str(e)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return f"refers to {_named(found[1])}"
    reason = text.split("WeightsUnpickler error:")[-1].split("Check the documentation")[0]
    return " ".join(reason.split(" Please use")[0].split()[:16])


@functools.cache
def _dcp_classes() -> tuple[type, type]:
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, default_planner

    class Reader(FileSystemReader):
        """torch's reader of a DCP directory, whose `.metadata` is read by `read_dcp_metadata`
        (once: given, or on first use)."""

        def __init__(self, path: Path, metadata: Any = None):
            super().__init__(str(path))
            self._metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self._metadata is None:
                self._metadata = read_dcp_metadata(Path(self.path))
            self._metadata.storage_meta.load_id = self.load_id
            return self._metadata

    class Planner(DefaultLoadPlanner):
        """torch's load planner, whose saved objects are read by `saved_object`."""

        def __init__(self, directory: Path):
            super().__init__()
            self.directory = directory

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            key = read_item.dest_index.fqn
            info = self.metadata.storage_data[read_item.storage_index]
            loaded = saved_object(value, self.directory / info.relative_path, key)
            if self.flatten_state_dict:
                default_planner.set_element(self.original_state_dict, self.mappings[key], loaded)
            else:
                self.state_dict[key] = loaded

    return Reader, Planner


def dcp_reader(directory: Path, metadata: Any = None) -> Any:
    """A torch `StorageReader` of the DCP checkpoint in `directory` that runs no code it holds
    (`metadata`: its `read_dcp_metadata`, if read already)."""
    return _dcp_classes()[0](directory, metadata)


def dcp_planner(directory: Path) -> Any:
    """torch's default `LoadPlanner`, reading saved objects as tensors and plain data only."""
    return _dcp_classes()[1](directory)


# ---------------------------------------------------------------------------- torch.save

class _Opaque:
    """An object of a class this reader does not build (an enum or config of Megatron's, a
    torch dtype): its pickled arguments and state are kept, its code never runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _InertUnpickler(pickle.Unpickler):
    """Megatron's objects hold its own classes (`AttnBackend`, ...), which torch's weights-only
    loader refuses: these become `_Opaque`, and tensors None; only plain data is built. A
    function or class of Python's own library is refused: such a file was crafted."""

    def __init__(self, file: BinaryIO, where: Path):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        plain = allowed.PLAIN.get((module, name))
        if plain is not None:
            return plain
        if module.partition(".")[0] in sys.stdlib_module_names:
            raise UserError(f"{self.where}: refers to {_named(module + '.' + name)}, which a "
                            f"Megatron checkpoint never holds: {_CRAFTED}")
        return type(name, (_Opaque,), {"origin": module})

    def persistent_load(self, pid: Any) -> None:
        return None


def _check_unpacked(source: Path | BinaryIO, where: Path, what: str) -> None:
    """A `torch.save` archive (a zip) of pickled objects unpacks to at most MAX_OBJECT_BYTES:
    a small archive cannot claim gigabytes (a compression bomb)."""
    with zipfile.ZipFile(source) as archive:
        size = sum(i.file_size for i in archive.infolist())
    if not isinstance(source, Path):
        source.seek(0)
    if size > MAX_OBJECT_BYTES:
        raise UserError(f"{where}: {what} unpacks to {size:,} bytes, more than any checkpoint's "
                        f"pickled objects ({MAX_OBJECT_BYTES:,}, MAX_OBJECT_BYTES): {_CRAFTED}")


def read_torch_save(source: Path | BinaryIO, where: Path) -> Any:
    """The plain content of a `torch.save` file or stream, no code of its classes run."""
    try:
        _check_unpacked(source, where, "its content")
        with zipfile.ZipFile(source) as archive:
            pkl = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
            return _InertUnpickler(archive.open(pkl), where).load()
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle fails in many ways
        raise UserError(f"{where}: not a readable torch.save file ({type(e).__name__}): the "
                        f"checkpoint is damaged") from None
