"""What every benchmark's command line shares: `--quick`, a smoke-test setting of seconds that
`tests/test_benchmarks.py` runs, so that a benchmark which breaks fails the tests; and the
console its tables print to."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
               quick: dict[str, Any]) -> argparse.Namespace:
    """The arguments, with `--quick` putting `quick`'s settings under any flag given."""
    parser.add_argument("--quick", action="store_true", help="a smoke test of seconds: "
                        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in quick.items()))
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    return args


def console(stderr: bool, width: int = 120) -> Console:
    """A rich console on stderr or stdout; into a file or a pipe, `width` columns (rich would
    wrap tables at 80)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else width)


def report(name: str, args: argparse.Namespace, run, print_table, devices: int | None = None,
           exit_code=lambda found: 0) -> int:
    """A benchmark's end: start JAX (`devices`: see `start_jax`), `run(args, progress)` for its
    report, print the table (to stderr under `--json`, which prints the report's JSON), and
    exit with `exit_code(report)`, or 2 with one line on a `UserError`."""
    import json

    from hotjax.cli import start_jax
    from models.errors import UserError

    progress = console(stderr=True)
    try:
        start_jax(devices)
        found = run(args, progress)
    except UserError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    print_table(found, progress if args.json else console(stderr=False))
    if args.json:
        print(json.dumps(found, indent=1))
    return exit_code(found)


def machine(devices: Sequence[Any]) -> dict:
    """What a benchmark ran on: its devices, this host's CPUs, Python and JAX, and its load."""
    import os
    import platform

    import jax

    return {"platform": devices[0].platform, "device_kind": devices[0].device_kind,
            "devices": len(devices), "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "jax": jax.__version__,
            "load_average": os.getloadavg()}


def print_machine(m: dict, console: Console) -> None:
    """The `hardware:` line under a benchmark's table."""
    console.print(f"hardware: {m['devices']} {m['platform']} device(s) ({m['device_kind']}), "
                  f"{m['cpus']} CPUs, {m['processor']}, python {m['python']}, jax {m['jax']}, "
                  f"load average {' '.join(f'{x:.1f}' for x in m['load_average'])}",
                  markup=False, highlight=False)
