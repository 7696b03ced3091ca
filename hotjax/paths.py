"""File names read from a checkpoint, kept inside its directory: the one check of every name an
index, tracker or metadata file gives (`hotjax.checkpoint.formats` and `hotjax.models.hf` use
it)."""

from __future__ import annotations

import os
from pathlib import Path

from hotjax.errors import UserError

_SHOWN_CHARS = 512


def shown(value: object, limit: int = _SHOWN_CHARS) -> str:
    """A value read from a file as a message shows it: its repr, cut past `limit` characters
    (by default the length of a long path)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def inside(directory: Path, name: object, where: Path, *, within: Path | None = None) -> Path:
    """`directory / name`, for a file name read from `where`, refused unless it lies inside
    `directory`, symbolic links resolved (inside `within` instead, when given)."""
    directory = Path(os.path.abspath(directory))
    if not isinstance(name, str) or not name or "\0" in name:
        raise UserError(f"{where}: holds {shown(name)} where a file name belongs: the "
                        f"checkpoint is damaged")
    path = directory / name
    try:
        ok = (Path(os.path.normpath(path)).is_relative_to(directory)
              and path.resolve().is_relative_to(Path(within or directory).resolve()))
    except (OSError, RuntimeError):  # a loop of symbolic links
        ok = False
    if not ok:
        raise UserError(f"{where}: names {shown(name)}, which leads outside {directory}: a "
                        f"checkpoint's files lie inside it, so it is damaged or crafted; nothing "
                        f"outside was read")
    return path
