"""What every benchmark's command line shares: `--quick`, a smoke-test setting of seconds that
`tests/test_benchmarks*.py` run, so that a benchmark which breaks fails the tests; the console
its tables print to; and `--processes N`, which runs the benchmark as N processes of one CPU
device each, pinned to their own cores (`hotjax launch`): a real N-device cluster on a CPU
machine, where simulated devices in one process would share its cores."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hotjax.targets import quiet_plugin_without_a_driver

if TYPE_CHECKING:
    from rich.console import Console

# Every benchmark imports this module before JAX: on a machine without an NVIDIA driver, the
# CUDA plugin (installed for compiling to targets) is not loaded, so it prints nothing.
quiet_plugin_without_a_driver()


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
               quick: dict[str, Any]) -> argparse.Namespace:
    """The arguments, with `--quick` putting `quick`'s settings under any flag given."""
    parser.add_argument("--quick", action="store_true", help="a smoke test of seconds: "
                        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in quick.items()))
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def in_one_line(name: str, main: Callable[[], int]) -> int:
    """`main()`'s exit code, or 2 after one line on a `UserError` (bad input: the message
    names the problem and the fix), as `report` ends the benchmarks it runs."""
    from hotjax.errors import UserError

    try:
        return main()
    except UserError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2


def add_processes_option(parser: argparse.ArgumentParser) -> None:
    """`--processes N` (see the module), and the options `hotjax launch` gives each process."""
    from hotjax.commands.options import add_process_options

    parser.add_argument("--processes", type=int, metavar="N", help="run as N processes of one "
                        "CPU device each, pinned to their own cores (hotjax launch): a real "
                        "N-device cluster")
    parser.add_argument("--link", metavar="RATE", help="with --processes: each process in a "
                        "network namespace of its own, its cable to a switch carrying at most "
                        "RATE each way (50MB/s, 400Mbit), or a profile's link scaled to this "
                        "machine's compute (a800-4x8:intra, a800-4x8:inter); needs root and "
                        "iproute2")
    add_process_options(parser)
    parser.add_argument("--report-file", help=argparse.SUPPRESS)  # process 0 writes it


def _process_args(args: argparse.Namespace) -> tuple[str | None, int | None, int | None, int]:
    return (getattr(args, "coordinator", None), getattr(args, "num_processes", None),
            getattr(args, "process_id", None), getattr(args, "heartbeat_timeout", 30))


def _launched(script: str, args: argparse.Namespace) -> dict | int:
    """The report of this benchmark run as `args.processes` pinned processes of one device
    each (their progress on stderr), or the failing process's exit code."""
    import json
    import tempfile
    from pathlib import Path

    from hotjax import launch
    from hotjax.errors import UserError

    if args.processes < 1:
        raise UserError(f"--processes {args.processes}: pass a positive number")
    argv = _without(args.argv, "--processes")  # the same command in each process
    rate = None
    if args.link is not None:  # resolved once, here: the processes run on the shaped link
        from hotjax.link import check_tools, resolve

        check_tools()
        shares = launch.core_shares(args.processes)
        rate, how = resolve(args.link, args.processes, 1, shares[0] if shares else None)
        if how:
            print(f"--link {args.link}: {how}", file=sys.stderr, flush=True)
        argv = _without(argv, "--link")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "report.json"
        code = launch.run([sys.executable, script, *argv, "--report-file", str(path)],
                          args.processes, 1, out=sys.stderr, link=rate)
        return code or json.loads(path.read_text())


def _without(argv: list[str], flag: str) -> list[str]:
    """`argv` less `flag` and its value (`--flag V` or `--flag=V`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(f"{flag}="):
            out.append(a)
    return out


def console(stderr: bool, width: int = 120) -> Console:
    """A rich console on stderr or stdout; into a file or a pipe, `width` columns (rich would
    wrap tables at 80)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else width)


def report(name: str, args: argparse.Namespace, run, print_table, devices: int | None = None,
           exit_code=lambda found: 0, width: int = 120) -> int:
    """A benchmark's end: start JAX (`devices`: simulated CPU devices, where a launch sets
    none), `run(args, progress)` for its report, print the table (to stderr under `--json`,
    which prints the report's JSON), and exit with `exit_code(report)`, or 2 with one line
    on a `UserError`. Under `--processes N` the run is N launched processes (see the module);
    process 0 hands its report back."""
    import io
    import json
    from pathlib import Path

    from hotjax.errors import UserError
    from hotjax.startup import SIMULATED_CPU_DEVICES, simulate_cpu_devices, start_jax

    def finish() -> int:
        progress = console(stderr=True, width=width)
        processes = _process_args(args)
        if getattr(args, "link", None) and not getattr(args, "processes", None):
            raise UserError(f"--link {args.link}: a link joins processes: add --processes 2")
        if getattr(args, "processes", None) and processes[2] is None:
            found = _launched(sys.modules[run.__module__].__file__, args)
            if isinstance(found, int):
                return found
        else:
            # `devices` simulated CPU devices where none are set (a launched process has its
            # own); the run takes every device there is.
            simulate_cpu_devices(devices or SIMULATED_CPU_DEVICES)
            start_jax(None, processes)
            if processes[2]:  # one voice: process 0's
                from rich.console import Console

                progress = Console(file=io.StringIO())
            found = _run_launched(run, args, progress, processes)
            if processes[2] is not None:
                if processes[2] == 0 and args.report_file:
                    Path(args.report_file).write_text(json.dumps(found))
                return 0
        print_table(found, progress if args.json else console(stderr=False, width=width))
        if args.json:
            print(json.dumps(found, indent=1))
        return exit_code(found)

    return in_one_line(name, finish)


def _run_launched(run, args: argparse.Namespace, progress: Console, processes) -> dict:
    """`run(args, progress)`; in a launched process, a collective failing because another
    process is gone is one line (a `UserError`), not a traceback."""
    import jax

    from hotjax import distributed
    from hotjax.errors import UserError

    try:
        return run(args, progress)
    except jax.errors.JaxRuntimeError as e:
        _, count, index, _ = processes
        lost = None if index is None else distributed.lost_peer(
            e, index, count, then="rerun the benchmark")
        if lost is None:
            raise
        raise UserError(lost) from None


def machine(devices: Sequence[Any]) -> dict:
    """What a benchmark ran on: its devices, this host's CPUs, Python and JAX, and its load."""
    import os
    import platform

    import jax

    from hotjax.launch import LINK_ENV

    link = os.environ.get(LINK_ENV)
    return {"platform": devices[0].platform, "device_kind": devices[0].device_kind,
            "devices": len(devices), "cpus": os.cpu_count(),
            "link_bytes_per_s": float(link) if link else None,
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "jax": jax.__version__,
            "load_average": os.getloadavg()}


def print_machine(m: dict, console: Console) -> None:
    """The `hardware:` line under a benchmark's table."""
    link = (f", a link shaped to {m['link_bytes_per_s'] / 1e6:,.1f} MB/s"
            if m.get("link_bytes_per_s") else "")
    console.print(f"hardware: {m['devices']} {m['platform']} device(s) ({m['device_kind']}), "
                  f"{m['cpus']} CPUs{link}, {m['processor']}, python {m['python']}, "
                  f"jax {m['jax']}, "
                  f"load average {' '.join(f'{x:.1f}' for x in m['load_average'])}",
                  markup=False, highlight=False)
