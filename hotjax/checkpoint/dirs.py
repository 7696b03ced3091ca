"""Checkpoint directories on disk: the step directories one holds, which are complete and which
the newest; how an array is named inside one; and new output directories, which appear whole or
not at all.

A checkpoint directory holds one directory per step (`store` writes and reads them). A step
directory is complete or absent: Orbax writes `<step>.orbax-checkpoint-tmp*` and renames it once
every item is committed, so `latest` never names a partial one; the outputs of imports and
exports are written beside their place and renamed into it (`write_atomically`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path

import orbax.checkpoint as ocp

from hotjax.errors import UserError

TMP_MARK = ".orbax-checkpoint-tmp"
# The items of a step directory: the arrays, the metadata (`meta`), the data position and the
# tokenizer's file.
PARAMS, OPT_STATE, META, DATA, TOKENIZER = "params", "opt_state", "meta", "data", "tokenizer"


def array_path(path: tuple) -> str:
    """`layers/wq`, `1/0/mu/embed`: a tree path as `inspect` and fingerprints name it."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in path)


def steps(directory: str | Path) -> list[int]:
    """The complete checkpoints' steps in `directory` (Orbax's notion of finalized)."""
    directory = Path(directory).absolute()
    return sorted(ocp.utils.checkpoint_steps(directory)) if directory.is_dir() else []


# What Orbax takes for a step of a checkpoint directory, complete or partial: these it lists,
# restores and deletes.
_STEP_NAME = re.compile(rf"\d+({re.escape(TMP_MARK)}.*)?")


def check_steps(directory: Path) -> None:
    """Refuses a checkpoint directory holding, under a step's name, anything but a directory:
    Orbax deletes old steps and partial saves by name, and a link among them would lead the
    deletion outside."""
    with os.scandir(directory) as entries:
        for entry in entries:
            if not _STEP_NAME.fullmatch(entry.name) or entry.is_dir(follow_symlinks=False):
                continue
            what = "a symbolic link" if entry.is_symlink() else "not a directory"
            raise UserError(f"--ckpt-dir {directory}: its entry {entry.name} is {what}, not a "
                            f"step directory hotjax wrote: remove it or choose another "
                            f"--ckpt-dir (nothing was deleted)")


def latest(directory: str | Path) -> Path | None:
    """The newest complete step directory in `directory`, if any."""
    found = steps(directory)
    return Path(directory).absolute() / str(found[-1]) if found else None


def find(path: str | Path) -> Path:
    """The complete step directory `path` names: itself, or the newest one inside it; every
    file in it found to lie inside it (`check_inside`)."""
    path = Path(path).absolute()
    if TMP_MARK in path.name:
        raise UserError(f"{path}: an incomplete checkpoint (its save never finished): "
                        f"resume from a complete one")
    if not path.is_dir():
        raise UserError(f"{path}: no such checkpoint directory")
    if any((path / item).exists() for item in (META, PARAMS, "_CHECKPOINT_METADATA")):
        return check_inside(path, path)
    step_dir = latest(path)
    if step_dir is None:
        raise UserError(f"{path}: holds no complete checkpoint")
    return check_inside(step_dir, path)


def check_inside(step_dir: Path, checkpoint: Path) -> Path:
    """`step_dir`, once it and every file in it were found to lie inside it (inside
    `checkpoint`, the directory it was found in, for the step directory itself), symbolic links
    resolved, and to be plain files and directories: what Orbax and TensorStore then read is
    the checkpoint's own, never a file elsewhere, a device or a pipe."""
    root = _resolved(step_dir, checkpoint.resolve(), checkpoint)
    for where, subdirs, files in os.walk(step_dir, onerror=_unreadable):
        for name in (*subdirs, *files):
            entry = Path(where) / name
            kind = os.stat(_resolved(entry, root, step_dir)).st_mode
            if not (stat.S_ISREG(kind) or stat.S_ISDIR(kind)):
                raise UserError(f"{entry}: not a file or a directory: a checkpoint holds "
                                f"nothing else, so it is damaged or crafted; nothing was read")
    return step_dir


def _resolved(entry: Path, root: Path, checkpoint: Path) -> Path:
    """Where `entry` leads, links followed, refused unless inside `root`."""
    try:
        found = entry.resolve(strict=True)
        ok = found.is_relative_to(root)
    except (OSError, RuntimeError):  # a dangling link, a loop of links
        found, ok = entry, False
    if not ok:
        raise UserError(f"{entry}: leads outside {checkpoint}: a checkpoint's files lie inside "
                        f"it, so it is damaged or crafted; nothing outside was read")
    return found


def _unreadable(e: OSError) -> None:
    raise UserError(f"{e.filename}: unreadable ({e.strerror}): the checkpoint is damaged")


def check_new_directory(directory: str | Path) -> Path:
    """`directory`, unless something is there already (outputs never overwrite) or it cannot
    be made there: checked before any work."""
    directory = Path(directory).absolute()
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise UserError(f"{directory}: exists and is not an empty directory: choose a new "
                        f"output directory (nothing was written)")
    parent = directory.parent
    while not parent.exists():
        parent = parent.parent
    if not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
        raise UserError(f"{directory}: cannot be written: {parent} is not a writable directory "
                        f"(nothing was written)")
    return directory


def write_atomically(out: Path, write: Callable[[Path], None]) -> Path:
    """`write` into a scratch directory beside `out`, renamed to `out` once complete: a failed
    write leaves nothing, the parent directories it made included."""
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        scratch.mkdir()
        write(scratch)
        if out.exists():
            out.rmdir()  # empty: check_new_directory saw to that
        os.replace(scratch, out)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        for parent in made:  # innermost first
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
    return out
