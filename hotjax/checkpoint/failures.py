"""What a failed checkpoint write or read says: the errno of a write the file system refused,
the log filters that keep Orbax's threads from printing its traceback again, and one line for an
array that cannot be read.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
from pathlib import Path

from hotjax.checkpoint import meta as meta_lib

# What a write that the file system refuses fails with, by errno: Python's own file writes
# raise OSError, TensorStore's name the code (`[os_error_code='28']`).
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS,
                 errno.EFBIG, errno.EIO)


def write_errno(error: BaseException | None) -> int | None:
    """The errno (ENOSPC) if `error`, or an error it was raised from or during, is a refused
    write; None otherwise."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _WRITE_ERRNOS:
            return error.errno
        code = re.search(r"os_error_code='(\d+)'", str(error))
        if code and int(code.group(1)) in _WRITE_ERRNOS:
            return int(code.group(1))
        error = error.__cause__ or error.__context__
    return None


def write_failure(error: BaseException | None) -> str | None:
    """The system's reason ("No space left on device") if `error` is a refused write."""
    code = write_errno(error)
    return None if code is None else os.strerror(code)


class _WithoutFailedWrites(logging.Filter):
    """Drops the records of a failed write: Orbax's threads log it with its traceback (and
    asyncio a future that held it); the save reports it once, as one line. Likewise a failed
    read of arrays (an error naming its TensorStore spec): asyncio logs the errors of the
    arrays read beside the one the restore says."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and (write_failure(record.exc_info[1])
                                         or "tensorstore_spec=" in str(record.exc_info[1])))


def report_failed_writes_once() -> None:
    """Orbax's and asyncio's logs leave out a refused write's or a failed read's traceback,
    said once as a line; TensorStore's callbacks into the closed event loop of a failed write
    or read, each a traceback, are not printed."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _WithoutFailedWrites) for f in logger.filters):
            logger.addFilter(_WithoutFailedWrites())
    if not getattr(sys.unraisablehook, "_drops_closed_loops", False):
        sys.unraisablehook = _without_closed_loops(sys.unraisablehook)


def _without_closed_loops(hook):
    """A failed write stops Orbax's event loop while TensorStore's callbacks still post to it:
    each reports `Event loop is closed` as an unraisable error, which says nothing more."""

    def unraisable(report) -> None:
        if not (isinstance(report.exc_value, RuntimeError)
                and str(report.exc_value) == "Event loop is closed"):
            hook(report)

    unraisable._drops_closed_loops = True
    return unraisable


def read_failure(e: BaseException, step_dir: Path) -> str:
    """One line for a failed read: the item and array TensorStore names, and why."""
    chain = [e]
    while (chain[-1].__cause__ or chain[-1].__context__) and len(chain) < 16:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    text = " ".join(str(x) for x in chain)
    where = re.search(r'local file "([^"]+)"', text)
    array = re.search(r'in "([^"]+?)/c/', text)
    reason = meta_lib.first_line(chain[-1]).rsplit('": ', 1)[-1]
    return (f"{where.group(1) if where else step_dir}: "
            f"{'array ' + array.group(1).replace('.', '/') + ' ' if array else ''}unreadable "
            f"({reason}): the checkpoint is truncated or damaged: resume from another one")
