"""Where a training run's records go besides the console: the --metrics-jsonl file,
TensorBoard event files (--tensorboard) and Weights & Biases (--wandb), each a `Sink` opened
before anything slow starts; and the JAX profiler trace of --trace-steps."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import stat
from pathlib import Path
from typing import Protocol

from hotjax.config import RunConfig
from hotjax.errors import UserError

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write refused for want of space
TRACE_DIR = "trace"  # where --trace-steps writes without --tensorboard


class Sink(Protocol):
    """Takes each step's record (a dict with its "step"), in order, then is closed."""

    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


def open_sinks(run: RunConfig) -> list[Sink]:
    """The sinks `run` names, each opened now, so that a path it cannot write at or a missing
    package is one line at the start, not a traceback after compiling."""
    sinks: list[Sink] = []
    try:
        if run.metrics_jsonl is not None:
            sinks.append(JsonLines(run.metrics_jsonl))
        if run.tensorboard is not None:
            sinks.append(TensorBoard(run.tensorboard))
        if run.wandb is not None:
            sinks.append(WeightsAndBiases(run.wandb, dataclasses.asdict(run)))
    except BaseException:
        close(sinks)
        raise
    return sinks


def close(sinks: list[Sink]) -> None:
    for sink in sinks:
        with contextlib.suppress(Exception):  # the run's own failure is the one to report
            sink.close()


def scalars(record: dict) -> dict[str, float]:
    """A record's numbers, by their JSON names (no step, no per-bucket lists)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, int | float)}


class JsonLines:
    """--metrics-jsonl: one JSON object per step. Opened to append (nothing in it is lost
    until the first record replaces it); a write the file system refuses (a full disk) ends
    the run in one line."""

    def __init__(self, path: str):
        try:
            self.file = open(path, "a")  # noqa: SIM115 - closed when the run ends
        except OSError as e:
            fix = ("create its directory or choose another path" if e.errno == errno.ENOENT
                   else "choose a writable path")
            raise UserError(f"--metrics-jsonl {path}: cannot write there ({e.strerror}): "
                            f"{fix}") from None
        self.fresh = True

    def write(self, record: dict) -> None:
        try:
            if self.fresh and stat.S_ISREG(os.fstat(self.file.fileno()).st_mode):
                self.file.truncate(0)  # this run's steps replace what the file held
            self.fresh = False
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:
            fix = ("free space or choose another --metrics-jsonl" if e.errno in _FULL
                   else "choose a writable --metrics-jsonl")
            raise UserError(f"--metrics-jsonl {self.file.name}: writing step "
                            f"{record['step']}'s metrics failed ({e.strerror}): {fix}") from None

    def close(self) -> None:
        # Every line was flushed as written: what a failed write left in the buffer is lost.
        with contextlib.suppress(OSError):
            self.file.close()


class TensorBoard:
    """--tensorboard DIR: each record's numbers as scalars of its step, tagged by their JSON
    names, in TensorBoard event files (written by tensorboardX: no TensorFlow)."""

    def __init__(self, directory: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise UserError(f"--tensorboard {directory}: tensorboardX is not installed: pip "
                            f"install hotjax[tensorboard]") from None
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(directory)
        except OSError as e:
            raise UserError(f"--tensorboard {directory}: cannot write there ({e.strerror}): "
                            f"choose a writable directory") from None

    def write(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WeightsAndBiases:
    """--wandb PROJECT: each record's numbers logged at its step, the run's options as the
    W&B run's config (`WANDB_MODE=offline` keeps them on this machine)."""

    def __init__(self, project: str, config: dict):
        try:
            import wandb
        except ImportError:
            raise UserError(f"--wandb {project}: wandb is not installed: pip install "
                            f"hotjax[wandb]") from None
        self.run = wandb.init(project=project, config=config)

    def write(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"], commit=True)  # the step is whole

    def close(self) -> None:
        self.run.finish()


class Trace:
    """--trace-steps A:B: a JAX profiler trace from step A's start to step B's end (its
    results waited for), as XPlane (TensorBoard's profile tab) and Perfetto JSON files."""

    def __init__(self, steps: tuple[int, int] | None, directory: str | None):
        self.steps, self.directory = steps, Path(directory or TRACE_DIR)
        self.pending, self.tracing = steps is not None, False

    def before(self, step: int) -> None:
        """Starts the trace before its first step (a resumed run's first, past A)."""
        if self.pending and self.steps[0] <= step <= self.steps[1]:
            import jax

            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.pending, self.tracing = False, True

    def after(self, step: int) -> Path | None:
        """Ends the trace after its last step: where it was written (else None)."""
        if not self.tracing or step < self.steps[1]:
            return None
        self.stop()
        return self.directory

    def stop(self) -> None:
        if self.tracing:
            import jax

            self.tracing = False
            jax.profiler.stop_trace()
