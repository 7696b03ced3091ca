"""What a foreign checkpoint's pickles may build, per kind of file: the one allow-list every
reader's loads go through (`torch_load`); anything else is refused, or kept as inert data."""

from __future__ import annotations

import argparse
import functools
import pickle
from collections import OrderedDict
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

import numpy as np

from hotjax.paths import shown


@functools.cache
def dcp_metadata() -> dict[tuple[str, str], Any]:
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


def _latin1(text: object = "", encoding: object = "latin1") -> bytes:
    """bytes as pickle protocol 2 writes them (`_codecs.encode(text, 'latin1')`)."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"bytes of {type(text).__name__} in {shown(encoding, 80)}")
    return text.encode("latin1")


# What an inert read of a `torch.save` file (Megatron's args, `common.pt`) builds as data.
PLAIN: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict, ("argparse", "Namespace"): argparse.Namespace,
    **{("pathlib", f"{s}Path"): p for s, p in (("Posix", PurePosixPath),
                                               ("Windows", PureWindowsPath))},
    ("_codecs", "encode"): _latin1, ("builtins", "bytes"): _latin1,
    ("builtins", "bytearray"): lambda *a: bytearray(_latin1(*a)),
    **{("builtins", t.__name__): t for t in (set, frozenset, slice, complex)}}

# What a weights-only load of a Megatron rank file may build besides tensors: its `args`, and
# the numpy arrays of its RNG state (`rng_state`, unless saved with --no-save-rng).
MEGATRON_RANK_FILE = [argparse.Namespace, np.ndarray, np.dtype, type(np.dtype(np.uint32)),
                      np._core.multiarray._reconstruct]


class ZeroStage(int):
    """deepspeed.runtime.zero.config.ZeroStageEnum, as the stage number."""


class Record:
    """A DeepSpeed object pickled with its attributes (a loss scaler, a fragment address)."""

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


class FragmentAddress(Record):
    numel: int
    start: int


# DeepSpeed's own classes in its files, read as plain records, so that DeepSpeed need not be
# installed.
DEEPSPEED = [(ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
             (Record, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
             (Record, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
             (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address")]
