"""A run's checkpoint directory, checked before anything slow starts: made, written to, holding
nothing but directories under steps' names, and then this run's alone while it lasts (a lock
the kernel releases when its holder ends)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import uuid
from pathlib import Path

from hotjax.checkpoint import dirs
from hotjax.errors import UserError

LOCK_FILE = ".hotjax.lock"  # a file: Orbax counts only directories named by a step
_HOLDER_BYTES = 4096  # what is read of a lock file: hotjax writes it, but it is found on disk
_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def advice(code: int | None) -> str:
    """What to do about a write the file system refused with errno `code`."""
    if code in _SPACE:
        return "free space or choose another --ckpt-dir"
    return "choose a writable --ckpt-dir"


def _refused(directory: Path, e: OSError) -> UserError:
    return UserError(f"--ckpt-dir {directory}: cannot write there "
                     f"({e.strerror or os.strerror(e.errno or 0)}): {advice(e.errno)}")


class Lock:
    """A run's hold on its checkpoint directory: the lock file, open and locked."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def release(self) -> None:
        # The file stays: removing it would let a run that opened it before the removal lock
        # a file that no longer is the directory's, beside a third run locking a new one.
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def writable(directory: str | Path) -> Path:
    """`directory`, made if absent, once a file was written there and removed again, and its
    steps found to be directories (`dirs.check_steps`)."""
    directory = Path(directory).absolute()
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{directory}: not a directory: choose a checkpoint directory")
    probe = directory / f".hotjax-probe-{uuid.uuid4().hex[:8]}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"hotjax")
        probe.unlink()
    except OSError as e:
        raise _refused(directory, e) from None
    dirs.check_steps(directory)
    return directory


def take(directory: str | Path) -> Lock:
    """The lock on `directory` (which exists), or one line naming the run that holds it."""
    directory = Path(directory).absolute()
    path = directory / LOCK_FILE
    # Held open for reading only: a file open for writing would keep the file system from
    # being remounted read-only. Not followed if a link: the lock is the directory's own file.
    flags = os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | flags, 0o644)
    except OSError as e:
        raise _refused(directory, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise UserError(f"--ckpt-dir {directory} is in use by {holder}: wait for it to end or "
                        f"choose another --ckpt-dir") from None
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        out = os.open(path, os.O_WRONLY | os.O_TRUNC | flags)
        try:
            os.write(out, json.dumps(record).encode())
        finally:
            os.close(out)
    except OSError as e:
        os.close(fd)
        raise _refused(directory, e) from None
    return Lock(path, fd)


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says: pid, host and since when."""
    try:
        record = json.loads(os.pread(fd, _HOLDER_BYTES, 0))
        pid, host, since = record["pid"], record["host"], record["since"]
    except (OSError, ValueError, TypeError, KeyError):
        return "another hotjax run"  # its record not yet written, or not hotjax's
    if not (isinstance(pid, int) and isinstance(host, str) and isinstance(since, str)):
        return "another hotjax run"
    host, since = ("".join(c for c in s if c.isprintable())[:100] for s in (host, since))
    return f"hotjax pid {pid} on {host} since {since}"


def hold(directory: str | Path) -> Lock | None:
    """Makes `directory`, checks it takes a file and locks it for this run; process 0 does,
    for a run of several processes, whose others stop with it (and hold None)."""
    import jax

    directory = Path(directory).absolute()
    held, error = None, None
    if jax.process_index() == 0:
        try:
            held = take(writable(directory))
        except UserError as e:
            error = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        # Every process learns whether process 0 could: none waits on it in a collective.
        if multihost_utils.process_allgather(int(error is not None)).any() and error is None:
            error = UserError(f"process 0 of the run cannot use --ckpt-dir {directory} (its "
                              f"line says why): process {jax.process_index()} stops too")
    if error is not None:
        raise error
    return held
