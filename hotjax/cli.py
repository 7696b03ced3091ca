"""The `hotjax` command line. JAX is imported only after the device count is settled.

Each command group registers itself through `register(commands)`, which adds a subparser whose
`handler` default takes the parsed args; the options a training run takes are defined once,
in `hotjax.commands.options`.
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Sequence

from hotjax.commands import ckpt, data, generate, launch, plan, strategy, train
from hotjax.commands.options import run_config as _run_config
from hotjax.config import RunConfig
from hotjax.preemption import REQUEUE_EXIT, Preempted
from hotjax.targets import quiet_plugin_without_a_driver
from models.errors import UserError

# Each adds one command group.
COMMANDS = (train, strategy, data, plan, ckpt, generate, launch)


def run_config(argv: Sequence[str]) -> RunConfig:
    """The run `hotjax train` with these arguments (starting with "train") makes."""
    return _run_config(_parser().parse_args(argv))


class _Parser(argparse.ArgumentParser):
    """argparse, its errors (an unknown flag, `--steps abc`) in hotjax's one-line form."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"hotjax: error: {message}: see {self.prog} --help\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hotjax", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "target", None) is None:
        quiet_plugin_without_a_driver()
    try:
        code = args.handler(args)  # an exit code, or None for success
    except UserError as e:
        print(f"hotjax: error: {e}", file=sys.stderr)
        return 2
    except Preempted as e:
        if e.speaks:
            print(f"hotjax: {e}", file=sys.stderr)
        return REQUEUE_EXIT
    except KeyboardInterrupt:
        print("hotjax: interrupted", file=sys.stderr)
        return 130
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
