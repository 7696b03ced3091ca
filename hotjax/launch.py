"""`hotjax launch`: one hotjax command as several processes on this machine, joined by JAX's
multi-process runtime — what a cluster's scheduler (`srun`, `mpirun`) does across machines.

Each process gets the coordinator's address (a free local port), the process count and its
id, and its share of the devices: on CPU, simulated devices (`JAX_NUM_CPU_DEVICES`); with
NVIDIA GPUs, its own block of them (`CUDA_VISIBLE_DEVICES`). Their output is prefixed with the
process id. When one fails, the others are stopped and the launcher exits with its code. A stop
signal the launcher gets (SIGTERM, SIGINT, SIGUSR1: a scheduler's preemption notice) goes on to
every process, which finish their step, save and exit with `REQUEUE_EXIT` together; so does
the launcher.

On CPU each process is pinned to its own share of this machine's cores (its CPU affinity, which
XLA's thread pools inherit and size themselves by), so with one device per process a CPU machine
is a real cluster: every device computes on its own cores in parallel with the others, and their
collectives cross a network (gloo over loopback). Simulated devices in one process, by contrast,
share its cores: a step costs the sum of all their work, and neither the communication a
strategy avoids nor the imbalance between data shards shows. Measure strategies here.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from hotjax.preemption import REQUEUE_EXIT
from models.errors import UserError

STOP_GRACE_S = 10  # after SIGTERM, before SIGKILL
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def register(commands: argparse._SubParsersAction) -> None:
    launch = commands.add_parser("launch", help="run `hotjax train` (or `hotjax plan "
                                 "--measure`) as several processes on this machine (JAX's "
                                 "multi-process runtime)")
    launch.add_argument("--processes", type=int, default=2, help="how many (default: "
                        "%(default)s)")
    launch.add_argument("--devices-per-process", type=int, help="CPU: simulated devices per "
                        "process (default 4); GPU: GPUs per process (default: all, split "
                        "evenly)")
    launch.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="CPU: pin each process to its own cores (default: on)")
    launch.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- train ... or -- plan --measure ... (the command every "
                        "process runs)")
    launch.set_defaults(handler=_launch)


def _launch(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if command[:1] not in (["train"], ["plan"]):
        raise UserError("hotjax launch runs training or planning: hotjax launch --processes 2 "
                        "-- train ... (or -- plan --measure ...)")
    if args.processes < 1:
        raise UserError(f"--processes {args.processes}: pass a positive number")
    taken = [f for f in ("--coordinator", "--num-processes", "--process-id") if f in command]
    if taken:
        raise UserError(f"{taken[0]}: hotjax launch sets it for each process: drop it")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        raise UserError(f"--devices-per-process {args.devices_per_process}: pass a positive "
                        f"number")
    return run([sys.executable, "-m", "hotjax.cli", *command], args.processes,
               args.devices_per_process, pin=args.pin)


def run(program: list[str], processes: int, devices_per_process: int | None,
        out: IO[str] | None = None, pin: bool = True) -> int:
    """Runs `program` (an argv that takes hotjax's `--coordinator/--num-processes/--process-id`)
    as `processes` processes; 0 when all succeed, else the first failure's exit code (the rest
    stopped). On CPU with `pin`, each process runs on its own cores (`core_shares`), as the
    first line says."""
    out = out or sys.stdout
    coordinator = f"127.0.0.1:{_free_port()}"
    gpus = _gpus()
    cores = core_shares(processes) if pin and not gpus else None
    if not gpus:
        print(f"hotjax launch: {describe_cpu_cluster(processes, devices_per_process or 4, cores)}",
              file=out, flush=True)
    started = []
    for i in range(processes):
        env = dict(os.environ)
        if gpus:
            per = devices_per_process or max(1, len(gpus) // processes)
            if per * processes > len(gpus):
                raise UserError(f"{processes} processes x {per} GPUs: this machine has "
                                f"{len(gpus)}")
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * per:(i + 1) * per])
        else:
            env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process or 4)
        argv = [*program, "--coordinator", coordinator, "--num-processes", str(processes),
                "--process-id", str(i)]
        own = cores[i] if cores else None
        process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, bufsize=1,
                                   start_new_session=True,
                                   preexec_fn=functools.partial(os.sched_setaffinity, 0, own)
                                   if own else None)
        threading.Thread(target=_relay, args=(process.stdout, f"[{i}] ", out),
                         daemon=True).start()
        started.append(process)
    forwarding = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, functools.partial(_forward, started))
                for sig in FORWARDED} if forwarding else {}
    try:
        return _supervise(started, out)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _forward(processes: list[subprocess.Popen], signum: int, _frame) -> None:
    """Passes a stop signal on to every process still running (each in its own session)."""
    for p in processes:
        if p.poll() is None:
            os.killpg(p.pid, signum)


def core_shares(processes: int) -> list[set[int]] | None:
    """Each process's cores: this process's allowed cores in equal consecutive blocks (the
    remainder unused), or None when there are fewer cores than processes."""
    allowed = sorted(os.sched_getaffinity(0))
    per = len(allowed) // processes
    if per == 0:
        return None
    return [set(allowed[i * per:(i + 1) * per]) for i in range(processes)]


def describe_cpu_cluster(processes: int, devices: int, cores: list[set[int]] | None) -> str:
    """The launch's first line on CPU: what kind of cluster the processes make."""
    shape = f"{processes} processes x {devices} CPU device{'s' * (devices > 1)}"
    if cores is None:
        return (f"{shape}, unpinned: the processes share this machine's "
                f"{len(os.sched_getaffinity(0))} cores, so their timings add up rather than "
                f"run in parallel")
    where = " | ".join(_ranges(c) for c in cores)
    if devices == 1:
        return (f"{shape}, each pinned to its own cores ({where}): a real {processes}-device "
                f"cluster, compute in parallel, collectives over gloo")
    return (f"{shape}, each process pinned to its own cores ({where}); the {devices} devices of "
            f"a process share its cores (one device per process is a real cluster)")


def _ranges(cores: set[int]) -> str:
    ordered = sorted(cores)
    return (f"core {ordered[0]}" if len(ordered) == 1
            else f"cores {ordered[0]}-{ordered[-1]}" if ordered[-1] - ordered[0] + 1 == len(
                ordered) else "cores " + ",".join(map(str, ordered)))


def _supervise(processes: list[subprocess.Popen], out: IO[str]) -> int:
    while True:
        codes = [p.poll() for p in processes]
        if REQUEUE_EXIT in codes and all(c in (None, 0, REQUEUE_EXIT) for c in codes):
            if None in codes:  # stopped and saving together: let the others finish theirs
                time.sleep(0.2)
                continue
            print(f"hotjax launch: the run was stopped and saved; exit {REQUEUE_EXIT} (rerun "
                  f"the same command to resume)", file=out, flush=True)
            return REQUEUE_EXIT
        failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None:
            _stop([p for p in processes if p.poll() is None])
            print(f"hotjax launch: process {failed} exited with code {codes[failed]}; the "
                  f"others were stopped", file=out, flush=True)
            return codes[failed] if codes[failed] > 0 else 128 - codes[failed]  # killed: 128+N
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


def _stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in processes:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _relay(stream: IO[str], prefix: str, out: IO[str]) -> None:
    for line in stream:
        out.write(prefix + line)
        out.flush()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpus() -> list[str]:
    """This machine's NVIDIA GPUs, as CUDA_VISIBLE_DEVICES numbers them (none: CPU)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g]
    found = Path("/proc/driver/nvidia/gpus")
    return [str(i) for i in range(len(list(found.iterdir())))] if found.is_dir() else []
