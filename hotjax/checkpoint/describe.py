"""What `hotjax ckpt inspect` shows of a checkpoint, read without loading any array."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hotjax.checkpoint import dirs, store
from hotjax.checkpoint import meta as meta_lib


def describe(path: str | Path) -> dict[str, Any]:
    """A checkpoint's step, metadata, sizes and arrays (shape and dtype), read without
    loading any array."""
    step_dir = dirs.find(path)
    meta = meta_lib.read(step_dir)
    items = {}
    for item in meta["items"]:
        arrays = store.saved_arrays(step_dir, item)
        items[item] = {
            "disk_bytes": sum(f.stat().st_size for f in (step_dir / item).rglob("*")
                              if f.is_file()),
            "bytes": sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in arrays.values()),
            "arrays": {name: {"shape": list(a.shape), "dtype": str(a.dtype)}
                       for name, a in arrays.items()}}
    siblings = dirs.steps(step_dir.parent)
    return {"path": str(step_dir), "step": meta["step"],
            "steps_in_directory": siblings,
            **{k: v for k, v in meta.items() if k not in ("step", "fingerprints")},
            "data_position": meta_lib.read_data(step_dir), "arrays": items}
