"""Stop signals: a run asked to stop (SIGTERM, SIGINT, or the signal a scheduler is told to send
first) finishes its step, saves, and exits with a code a scheduler requeues on; a second signal
ends it at once.

Python's handler for a signal runs in the main thread once it returns to Python, which inside
XLA (compiling, or in a collective) can take minutes; the wake-up pipe is written at once, by
whichever thread the signal interrupts, so a thread of its own watches that.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

from hotjax.errors import UserError

REQUEUE_EXIT = 75  # EX_TEMPFAIL (sysexits.h): stopped with the state saved; run it again
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):  # noqa: N818 - an outcome, not a failure
    """The run stopped on a signal at a step boundary; the message is its one line."""

    def __init__(self, line: str, *, speaks: bool = True):
        super().__init__(line)
        self.speaks = speaks  # one process speaks for a run of several


def parse_signal(name: str | None) -> signal.Signals | None:
    """`--preempt-signal USR1` (or SIGUSR1, or 10): the signal a scheduler sends first."""
    if name is None:
        return None
    text = name.upper().removeprefix("SIG")
    try:
        return signal.Signals(int(text)) if text.isdigit() else signal.Signals[f"SIG{text}"]
    except (KeyError, ValueError):
        raise UserError(f"--preempt-signal {name}: not a signal: name one such as USR1 "
                        f"(SLURM's --signal=USR1@60 sends it before the end)") from None


_CLOSE = 0  # written to the wake-up pipe to end the watcher (no signal has number 0)


def _seen_by_the_watcher(signum: int, frame: object) -> None:
    """The main thread's handler: nothing to do, the watcher thread has seen the signal."""


class StopSignals:
    """Watches the stop signals from a thread of its own while in its `with` block (entered
    in the main thread); `requested` says whether one came.

    A second signal calls `on_abort` (the run removes a save it interrupted), prints one line
    and ends the process at once with 128 + the signal's number, as the signal itself would.
    """

    def __init__(self, extra: signal.Signals | None = None):
        self.signals = {*STOP_SIGNALS, *([extra] if extra else [])}
        self.received: signal.Signals | None = None
        self.on_abort: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._watch, name="stop-signals", daemon=True)

    def __enter__(self) -> StopSignals:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._wakeup = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._handlers = {s: signal.signal(s, _seen_by_the_watcher) for s in self.signals}
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._handlers.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(self._wakeup)
        os.write(self._write, bytes([_CLOSE]))
        self._thread.join()
        os.close(self._read)
        os.close(self._write)

    @property
    def requested(self) -> bool:
        return self.received is not None

    def agreed(self) -> bool:
        """Whether any process of the run was asked to stop: a collective under several
        processes (every one calls it at the same step), so all stop after the same step."""
        import jax

        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(int(self.requested))
        return bool(flags.any())

    def _watch(self) -> None:
        while True:
            for number in os.read(self._read, 64):
                if number == _CLOSE:
                    return
                if number not in self.signals:
                    continue
                if self.received is not None:
                    self._abort(signal.Signals(number))
                self.received = signal.Signals(number)

    def _abort(self, sig: signal.Signals) -> None:
        if self.on_abort is not None:
            self.on_abort()
        line = (f"hotjax: stopped at once by a second {sig.name}: the step under way and any "
                f"save in progress are dropped; rerun the same command to resume from the last "
                f"complete checkpoint\n")
        os.write(2, line.encode())
        os._exit(128 + sig)
