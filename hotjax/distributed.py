"""One run over several processes: JAX's multi-controller runtime (`jax.distributed`).

Every process runs the same command; each drives its local devices, and `jax.devices()` lists
them all. A process learns its place from `--coordinator/--num-processes/--process-id` (what
`hotjax launch` passes), or, given none, from the scheduler that started several of them (an
`srun` step, an Open MPI job), which JAX detects itself. Between CPU processes collectives go
over gloo.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys

import numpy as np

from hotjax.errors import UserError

HEARTBEAT_TIMEOUT_S = 30  # a process silent this long ends the run (JAX's default waits 100)
TOGETHER_TIMEOUT_S = 1800  # how long `together` waits for the slowest process
_meetings = itertools.count()


def _cluster_processes() -> int:
    """The processes a scheduler started this one among (1: none): an `srun` step of several
    tasks, or an Open MPI job of several ranks. JAX's own detection then finds the rest."""
    if os.environ.get("SLURM_STEP_ID") is not None:
        return int(os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS")
                   or 1)
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None,
               heartbeat_timeout: int = HEARTBEAT_TIMEOUT_S) -> None:
    """Joins the run's processes (a no-op for a single process). Call before JAX starts. A
    process silent for `heartbeat_timeout` seconds ends the run (JAX's default waits 100): JAX
    aborts the others with a fatal log, which `hotjax launch` reports in one line."""
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if any(given) and not all(given):
        raise UserError("--coordinator, --num-processes and --process-id go together: pass all "
                        "three (hotjax launch does), or none on a cluster JAX detects")
    if not any(given) and _cluster_processes() == 1:
        return
    if all(given):
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise UserError(f"--process-id {process_id} of --num-processes {num_processes}: "
                            f"give a process id from 0 to {num_processes - 1}")
        if num_processes == 1:
            return
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # hotjax stops on signals itself (`hotjax.preemption`); JAX's preemption service would
    # take SIGTERM from it, with a handler of its own.
    jax.config.update("jax_enable_preemption_service", False)
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id,
                                   heartbeat_timeout_seconds=heartbeat_timeout)
    except (RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"joining the run's processes failed ({first}): check --coordinator "
                        f"{coordinator} is reachable and every process was started") from None
    # Orbax's background save threads log a failed collective with its traceback; the main
    # thread's own failure is the one reported, as one line (`lost_peer`).
    logging.getLogger("absl").addFilter(_without_lost_peers)
    sys.excepthook = exit_at_once(sys.excepthook)


def together(what: str) -> None:
    """Waits until every process of the run gets here (nothing in one process), at JAX's
    coordination service rather than in a collective. Call it where the processes may have
    drifted apart, before their first collectives: when a group of devices first communicates,
    gloo gives each process 30 s to meet its peers, and a process compiling under load can fall
    further behind (`GetKeyValue() timed out`). Every process must call it in the same order."""
    import jax

    if jax.process_count() == 1:
        return
    from orbax.checkpoint import multihost

    multihost.get_barrier_sync_fn()(key=f"hotjax-{next(_meetings)}-{what}",
                                    timeout_ms=TOGETHER_TIMEOUT_S * 1000)


def exit_at_once(hook):
    """`hook` (an uncaught exception's report), then this process's exit with code 1 at once.
    At a normal exit JAX waits in a shutdown barrier for every process (up to 5 minutes),
    while a peer blocked in a collective with this one waits for it: the launcher would see
    neither exit. Exiting at once lets it stop the others (checkpoints are complete or absent,
    so a save cut short loses nothing)."""

    def report_and_exit(kind, value, traceback) -> None:
        hook(kind, value, traceback)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    return report_and_exit


# What a collective with a process that is gone fails with: its connection reset or closed
# (gloo), or the coordination service's report of a task that stopped.
_LOST_PEER = ("connection reset", "connection closed", "broken pipe", "heartbeat", "gloo",
              "coordination service")


def _is_lost_peer(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from or during, is a lost peer's."""
    seen = set()
    while error is not None and id(error) not in seen:
        if any(m in str(error).lower() for m in _LOST_PEER):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _without_lost_peers(record: logging.LogRecord) -> bool:
    """A log filter dropping the records of a lost peer's failed collective."""
    return not (record.exc_info and _is_lost_peer(record.exc_info[1]))


RESUME = "rerun the command to resume from the last complete checkpoint"


def lost_peer(error: Exception, process_index: int, process_count: int,
              then: str = RESUME) -> str | None:
    """A one-line account of `error` if it is a collective failing because another process of
    the run is gone (None otherwise), ending in what to do `then`. With two processes the lost
    one is the other."""
    text = str(error).strip()
    if process_count < 2 or not _is_lost_peer(error):
        return None
    others = [p for p in range(process_count) if p != process_index]
    who = f"process {others[0]}" if len(others) == 1 else "another process"
    first = text.splitlines()[0] if text else type(error).__name__
    return f"{who} of the run is gone ({first}): process {process_index} stops too; {then}"


def is_main() -> bool:
    """Whether this process prints progress and writes metrics (process 0)."""
    import jax

    return jax.process_index() == 0


def from_process_0(text: str) -> str:
    """Process 0's `text`, on every process (a collective, as `gather`)."""
    data = np.frombuffer(text.encode(), np.uint8).astype(np.int32)
    return gather(data)[0].astype(np.uint8).tobytes().decode()


def gather(vector: np.ndarray) -> list[np.ndarray]:
    """Every process's int32 `vector` (lengths may differ), process 0's first. A collective:
    every process calls it at the same point of the run."""
    from jax.experimental import multihost_utils

    sizes = multihost_utils.process_allgather(np.array(len(vector), np.int32))
    padded = np.zeros(max(int(sizes.max()), 1), np.int32)  # none empty: XLA takes no 0-size
    padded[:len(vector)] = vector
    rows = multihost_utils.process_allgather(padded)
    return [row[:size] for row, size in zip(rows, sizes, strict=True)]
