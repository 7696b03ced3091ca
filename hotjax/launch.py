"""One hotjax command as several processes on this machine, joined by JAX's multi-process
runtime — what a cluster's scheduler (`srun`, `mpirun`) does across machines, and what the
command `hotjax launch` (`hotjax.commands.launch`) runs.

Each process gets the coordinator's address (a free local port), the process count and its
id, and its share of the devices: on CPU, simulated devices (`JAX_NUM_CPU_DEVICES`); with
NVIDIA GPUs, its own block of them (`CUDA_VISIBLE_DEVICES`). Their output is prefixed with the
process id. When one fails, the others are stopped and the launcher exits with its code. A stop
signal the launcher gets (SIGTERM, SIGINT, SIGUSR1: a scheduler's preemption notice) goes on to
every process, which finish their step, save and exit with `REQUEUE_EXIT` together; so does
the launcher. A process that stops answering without exiting (hung, or stopped) misses JAX's
heartbeats: about `--heartbeat-timeout` seconds after its last one JAX's runtime fails the run
(a fatal C++ log and an abort in another process), and the launcher at once ends every process
and says so in one line of its own (10 s of heartbeat: the launch ends in about 10 s, always
within a minute). The launcher leaves no process behind: one that outlasts a SIGTERM by
`STOP_GRACE_S` is killed.

On CPU each process is pinned to its own share of this machine's cores (its CPU affinity, which
XLA's thread pools inherit and size themselves by), so with one device per process a CPU machine
is a real cluster: every device computes on its own cores in parallel with the others, and their
collectives cross a network (gloo over loopback, or under `--link` a shaped one). Simulated
devices in one process, by contrast, share its cores: a step costs the sum of all their work,
and neither the communication a strategy avoids nor the imbalance between data shards shows.
Measure strategies here.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from hotjax.distributed import HEARTBEAT_TIMEOUT_S
from hotjax.errors import UserError
from hotjax.link import Network, describe_rate, shaped_network
from hotjax.preemption import REQUEUE_EXIT

STOP_GRACE_S = 10  # after SIGTERM, before SIGKILL
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


LINK_ENV = "HOTJAX_LINK_BYTES_PER_S"  # set in each launched process under --link


def run(program: list[str], processes: int, devices_per_process: int | None,
        out: IO[str] | None = None, pin: bool = True, link: float | None = None,
        verbose: bool = False) -> int:
    """Runs `program` (an argv that takes hotjax's `--coordinator/--num-processes/--process-id`)
    as `processes` processes; 0 when all succeed, else the first failure's exit code (the rest
    stopped), or a `UserError` when JAX's runtime failed the run for a process that stopped
    answering. On CPU with `pin`, each process runs on its own cores (`core_shares`), as the
    first line says. `link` (bytes/s): each process runs in a network namespace of its own,
    joined by a switch, its cable carrying at most that each way (`hotjax.link`), all removed
    however the launch ends.
    `verbose` passes on the lines of the runtime's chatter (`CHATTER`) too."""
    out = out or sys.stdout
    with contextlib.ExitStack() as stack:
        network = (stack.enter_context(shaped_network(link, processes)) if link is not None
                   else None)
        return _run(program, processes, devices_per_process, out, pin, link, network, verbose)


def _run(program: list[str], processes: int, devices_per_process: int | None, out: IO[str],
         pin: bool, link: float | None, network: Network | None, verbose: bool) -> int:
    # Process 0 serves the coordinator; under --link at its own address on the switch.
    coordinator = f"{network.addresses[0] if network else '127.0.0.1'}:{_free_port()}"
    gpus = _gpus()
    cores = core_shares(processes) if pin and not gpus else None
    first = ("" if gpus else describe_cpu_cluster(processes, devices_per_process or 4, cores))
    if processes == 1:
        first = ("1 process: it joins no cluster and runs no collectives, as the command would "
                 "without hotjax launch (pass --processes 2 or more for a cluster)")
    if network:
        first = (f"{first or f'{processes} processes'} over a link shaped to "
                 f"{describe_rate(link)} each way (tc tbf on each process's cable to a switch; "
                 f"network namespaces {network.switch}-*)")
    if first:
        print(f"hotjax launch: {first}", file=out, flush=True)
    started: list[subprocess.Popen] = []
    relays: list[_Relay] = []
    forwarding = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, functools.partial(_forward, started))
                for sig in FORWARDED} if forwarding else {}
    try:
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
            if link is not None:  # what the processes' network is, for their reports
                env[LINK_ENV] = str(link)
            # `ip netns exec` execs the program in this same process: its pinning holds.
            wrap = ["ip", "netns", "exec", network.nodes[i]] if network else []
            argv = [*wrap, *program, "--coordinator", coordinator, "--num-processes",
                    str(processes), "--process-id", str(i)]
            own = cores[i] if cores else None
            process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, bufsize=1,
                                       start_new_session=True,
                                       preexec_fn=functools.partial(_child_setup, own))
            started.append(process)
            relays.append(_Relay(process, f"[{i}] ", out, verbose))
            relays[-1].start()
        return _supervise(started, relays, program, out)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop([p for p in started if p.poll() is None])  # none outlives the launcher


def _child_setup(cores: set[int] | None) -> None:
    """In each child before it runs: its own cores, and a SIGTERM from the kernel should the
    launcher die without stopping it (killed outright), so that it saves and ends too."""
    if cores:
        os.sched_setaffinity(0, cores)
    with contextlib.suppress(OSError, AttributeError):  # Linux only
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _forward(processes: list[subprocess.Popen], signum: int, _frame) -> None:
    """Passes a stop signal on to every process still running (each in its own session)."""
    for p in processes:
        if p.poll() is None:
            _signal_group(p, signum)


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


def _supervise(processes: list[subprocess.Popen], relays: list[_Relay], program: list[str],
               out: IO[str]) -> int:
    while True:
        codes = [p.poll() for p in processes]
        if REQUEUE_EXIT in codes and all(c in (None, 0, REQUEUE_EXIT) for c in codes):
            if None in codes:  # stopped and saving together: let the others finish theirs
                time.sleep(0.2)
                continue
            _drain(relays)
            print(f"hotjax launch: the run was stopped and saved; exit {REQUEUE_EXIT} (rerun "
                  f"the same command to resume)", file=out, flush=True)
            return REQUEUE_EXIT
        failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None:
            relays[failed].join(RELAY_DRAIN_S)
            silent = relays[failed].silent_process(len(processes))
            if silent is not None:
                # The runtime has failed the run: the others can neither step nor save.
                _stop([p for p in processes if p.poll() is None], grace=0)
                raise UserError(f"{silent} of the run stopped answering (no heartbeat for "
                                f"{_heartbeat_timeout(program)} s): every process was ended; "
                                f"rerun the command to resume from the last complete "
                                f"checkpoint")
            _stop([p for p in processes if p.poll() is None])
            _drain(relays)
            print(f"hotjax launch: process {failed} exited with code {codes[failed]}; the "
                  f"others were stopped", file=out, flush=True)
            return codes[failed] if codes[failed] > 0 else 128 - codes[failed]  # killed: 128+N
        if all(c == 0 for c in codes):
            _drain(relays)
            return 0
        time.sleep(0.2)


def _drain(relays: list[_Relay]) -> None:
    """Waits for the ended processes' last lines, so that the launcher's own come after."""
    deadline = time.monotonic() + RELAY_DRAIN_S
    for relay in relays:
        relay.join(max(0.0, deadline - time.monotonic()))


def _stop(processes: list[subprocess.Popen], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM, then SIGKILL for those still running after `grace` seconds (0: at once)."""
    for p in processes:
        if grace > 0:
            _signal_group(p, signal.SIGTERM)
            _signal_group(p, signal.SIGCONT)  # a stopped process acts on SIGTERM once continued
        else:
            _signal_group(p, signal.SIGKILL)
    deadline = time.monotonic() + grace
    for p in processes:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # its group may be gone already
        os.killpg(process.pid, sig)


RELAY_DRAIN_S = 5  # for a failed process's last lines to reach its relay
# A line of JAX's coordination service in absl's log format ("E1126 03:01:42.037103  4558
# coordination_service.cc:1549] ..."), and the fatal error it ends a process with when a peer
# misses its heartbeats. jaxlib's Python callback for that (`missed_heartbeat_callback`) is
# unusable (it aborts converting the status), so the launcher reads the log instead.
_COORDINATION_LOG = re.compile(r"[EF]\d{4} [\d:.]+\s+\d+ coordination_service\w*\.cc:\d+\]"
                               r"|[EF]\d{4} .*JAX distributed service")
_JAX_FATAL = "Terminating process because the JAX distributed service detected fatal errors"
HELD_LINES = 200  # a fatal log and its stack trace are a few dozen
# Lines the runtime prints on every run that say nothing went wrong: gloo's report, as each
# process's CPU collectives connect, that a rank met its peers. `hotjax launch --verbose` shows
# them.
CHATTER = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks")


class _Relay(threading.Thread):
    """Passes one process's output on, prefixed, less the runtime's chatter (`CHATTER`) unless
    `verbose`. From the first line of JAX's coordination service on it holds the lines back:
    should the process die of JAX's fatal error, they are a C++ log and stack trace the launcher
    sums up in one line (`silent_process`); otherwise they are passed on when the process
    ends."""

    def __init__(self, process: subprocess.Popen, prefix: str, out: IO[str],
                 verbose: bool = False):
        super().__init__(daemon=True)
        self.process, self.prefix, self.out, self.verbose = process, prefix, out, verbose
        self.held: list[str] = []

    def run(self) -> None:
        for line in self.process.stdout:
            if self.held or _COORDINATION_LOG.match(line):
                self.held.append(line)
                if len(self.held) < HELD_LINES:
                    continue
                self._pass_on()  # too long for a fatal log: the output as it is
            elif self.verbose or not CHATTER.match(line):
                self._write(line)
        if self.held:
            self.process.wait()
            if not self._fatal():
                self._pass_on()

    def silent_process(self, processes: int) -> str | None:
        """Which process JAX's fatal error, held back, says stopped answering ("process 1",
        or "a process" when it names none); None when the process ended otherwise."""
        if not self._fatal():
            return None
        for before, line in zip(self.held, self.held[1:], strict=False):
            if "stopped sending heartbeats" in before:
                ids = re.findall(r"task:(\d+)", line) or re.findall(r"\b\d+\b", line)
                named = sorted({int(i) for i in ids if int(i) < processes})
                if named:
                    return "process" + "es" * (len(named) > 1) + " " + ", ".join(map(str, named))
        if any("CoordinationService/Heartbeat" in line for line in self.held):
            return "process 0"  # this one's heartbeats went unanswered: the coordinator's
        return "a process"

    def _fatal(self) -> bool:
        return (self.process.poll() not in (None, 0)
                and any(_JAX_FATAL in line for line in self.held))

    def _pass_on(self) -> None:
        held, self.held = self.held, []
        for line in held:
            self._write(line)

    def _write(self, line: str) -> None:
        self.out.write(self.prefix + line)
        self.out.flush()


def _heartbeat_timeout(program: list[str]) -> int:
    """The `--heartbeat-timeout` the processes were given (or its default)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--heartbeat-timeout", type=int, default=HEARTBEAT_TIMEOUT_S)
    return parser.parse_known_args(program)[0].heartbeat_timeout


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
