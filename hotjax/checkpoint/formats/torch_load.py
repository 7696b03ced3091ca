"""Foreign checkpoints' pickles (DCP `.metadata` and saved objects, Megatron's `torch.save`
files) read as data, no code they name ever run; `inside` keeps their file names inside them."""

from __future__ import annotations

import argparse
import functools
import io
import pickle
import re
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, BinaryIO

from hotjax.checkpoint.meta import first_line
from models.errors import UserError
from models.paths import inside, shown

__all__ = ["dcp_planner", "dcp_reader", "inside", "read_dcp_metadata", "read_torch_save",
           "refused_by_torch", "saved_object"]

_CRAFTED = "the file is not a PyTorch checkpoint's, or was crafted; nothing was run"
# A DCP `.metadata` lists every chunk of every tensor: a few MiB for a 70B model saved by a
# thousand ranks. Unpickling builds at most a few times a file's bytes in objects.
MAX_METADATA_BYTES = 512 * 2**20
# A pickled object (Megatron's args, an optimizer's param groups), unpacked: a few KiB to MiB.
MAX_OBJECT_BYTES = 64 * 2**20


def _shown(value: object) -> str:
    return shown(value, 80)


def _named(text: str) -> str:
    """A `module.name` a pickle refers to, as a message shows it."""
    return text if len(text) <= 80 and text.isprintable() else _shown(text)


# ---------------------------------------------------------------------------- DCP

@functools.cache
def _metadata_globals() -> dict[tuple[str, str], Any]:
    """What a DCP `.metadata` names: torch's record classes, dtypes, sizes and layouts."""
    import torch
    from torch.distributed.checkpoint import filesystem, metadata, planner

    found: dict[tuple[str, str], Any] = {}
    for module, names in (
            (metadata, ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                        "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                        "StorageMeta", "_MEM_FORMAT_ENCODING")),
            (filesystem, ("_StorageInfo", "_StoragePrefix")),
            # Megatron-Core keeps its save's plans there, to save again without planning.
            (planner, ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                       "BytesIOWriteData"))):
        found.update({(module.__name__, n): getattr(module, n) for n in names
                      if hasattr(module, n)})
    found.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    found[("torch", "Size")] = torch.Size
    # How torch pickles a layout: a lookup among torch's layouts by name.
    found[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    found[("collections", "OrderedDict")] = OrderedDict
    # A checkpoint id, kept as a path that touches no file system (written on any system).
    for system, pure in (("Posix", PurePosixPath), ("Windows", PureWindowsPath)):
        found[("pathlib", f"{system}Path")] = found[("pathlib", f"Pure{system}Path")] = pure
    return found


class _MetadataUnpickler(pickle.Unpickler):
    """A DCP `.metadata` unpickler that builds torch's records and refuses anything else."""

    def __init__(self, file: BinaryIO, where: Path):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_globals().get((module, name))
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


def _latin1(text: object = "", encoding: object = "latin1") -> bytes:
    """bytes as pickle protocol 2 writes them (`_codecs.encode(text, 'latin1')`)."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"bytes of {type(text).__name__} in {_shown(encoding)}")
    return text.encode("latin1")


_PLAIN: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict, ("argparse", "Namespace"): argparse.Namespace,
    **{("pathlib", f"{s}Path"): p for s, p in (("Posix", PurePosixPath),
                                               ("Windows", PureWindowsPath))},
    ("_codecs", "encode"): _latin1, ("builtins", "bytes"): _latin1,
    ("builtins", "bytearray"): lambda *a: bytearray(_latin1(*a)),
    **{("builtins", t.__name__): t for t in (set, frozenset, slice, complex)}}


class _InertUnpickler(pickle.Unpickler):
    """Megatron's objects hold its own classes (`AttnBackend`, ...), which torch's weights-only
    loader refuses: these become `_Opaque`, and tensors None; only plain data is built. A
    function or class of Python's own library is refused: such a file was crafted."""

    def __init__(self, file: BinaryIO, where: Path):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        plain = _PLAIN.get((module, name))
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
