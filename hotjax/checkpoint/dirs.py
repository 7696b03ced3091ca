"""Checkpoint directories on disk: the step directories one holds, which are complete and which
the newest; how an array is named inside one; and new output directories, which appear whole or
not at all.

A checkpoint directory holds one directory per step (`store` writes and reads them). A step
directory is complete or absent: Orbax writes `<step>.orbax-checkpoint-tmp*` and renames it once
every item is committed, so `latest` never names a partial one; the outputs of imports and
exports are written beside their place and renamed into it (`write_atomically`).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import orbax.checkpoint as ocp

from models.errors import UserError

TMP_MARK = ".orbax-checkpoint-tmp"
# The items of a step directory: the arrays, the metadata (`meta`) and the data position.
PARAMS, OPT_STATE, META, DATA = "params", "opt_state", "meta", "data"


def array_path(path: tuple) -> str:
    """`layers/wq`, `1/0/mu/embed`: a tree path as `inspect` and fingerprints name it."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in path)


def steps(directory: str | Path) -> list[int]:
    """The complete checkpoints' steps in `directory` (Orbax's notion of finalized)."""
    directory = Path(directory).absolute()
    return sorted(ocp.utils.checkpoint_steps(directory)) if directory.is_dir() else []


def latest(directory: str | Path) -> Path | None:
    """The newest complete step directory in `directory`, if any."""
    found = steps(directory)
    return Path(directory).absolute() / str(found[-1]) if found else None


def find(path: str | Path) -> Path:
    """The complete step directory `path` names: itself, or the newest one inside it."""
    path = Path(path).absolute()
    if TMP_MARK in path.name:
        raise UserError(f"{path}: an incomplete checkpoint (its save never finished): "
                        f"resume from a complete one")
    if not path.is_dir():
        raise UserError(f"{path}: no such checkpoint directory")
    if any((path / item).exists() for item in (META, PARAMS, "_CHECKPOINT_METADATA")):
        return path
    step_dir = latest(path)
    if step_dir is None:
        raise UserError(f"{path}: holds no complete checkpoint")
    return step_dir


def check_new_directory(directory: str | Path) -> Path:
    """`directory`, unless something is there already: outputs never overwrite."""
    directory = Path(directory).absolute()
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise UserError(f"{directory}: exists and is not an empty directory: choose a new "
                        f"output directory (nothing was written)")
    return directory


def write_atomically(out: Path, write: Callable[[Path], None]) -> Path:
    """`write` into a scratch directory beside `out`, renamed to `out` once complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    scratch.mkdir()
    try:
        write(scratch)
        if out.exists():
            out.rmdir()  # empty: check_new_directory saw to that
        os.replace(scratch, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out
