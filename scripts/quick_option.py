"""What every benchmark's command line shares: `--quick`, a smoke-test setting of seconds that
`tests/test_benchmarks.py` runs, so that a benchmark which breaks fails the tests."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


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
