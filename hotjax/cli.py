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

from hotjax.commands import ckpt, config_file, data, generate, launch, plan, strategy, train
from hotjax.commands.options import run_config as _run_config
from hotjax.config import RunConfig
from hotjax.errors import UserError
from hotjax.preemption import REQUEUE_EXIT, Preempted
from hotjax.targets import quiet_plugin_without_a_driver

# Each adds one command group.
COMMANDS = (train, strategy, data, plan, ckpt, generate, launch)


def run_config(argv: Sequence[str]) -> RunConfig:
    """The run `hotjax train` with these arguments (starting with "train") makes."""
    return _run_config(_parse(argv))


class _Parser(argparse.ArgumentParser):
    """argparse, its errors (an unknown flag, `--steps abc`) in hotjax's one-line form."""

    commands: argparse._SubParsersAction  # the top parser's: each command's parser

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"hotjax: error: {message}: see {self.prog} --help\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hotjax", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(commands)
    parser.commands = commands
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments; a command's `--config FILE.toml` gives the defaults its flags override."""
    parser = _parser()
    args = parser.parse_args(argv)
    path = getattr(args, config_file.DEST, None)
    if path is None:
        return args
    command = parser.commands.choices[args.command]
    found = config_file.read(path, command)
    command.set_defaults(**found)
    return config_file.flags_win(parser.parse_args(argv), found)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parse(argv)
        if getattr(args, "target", None) is None:
            quiet_plugin_without_a_driver()
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
