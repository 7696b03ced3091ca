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
