"""`hotjax launch`: one hotjax command as several processes on this machine (`hotjax.launch`
starts, joins and supervises them)."""

from __future__ import annotations

import argparse
import sys

from hotjax.errors import UserError
from hotjax.launch import core_shares, run
from hotjax.link import check_tools, resolve


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
    launch.add_argument("--link", metavar="RATE", help="run each process in a network "
                        "namespace of its own, its cable to a switch carrying at most RATE each "
                        "way (50MB/s, 400Mbit), or a profile's link scaled to this machine's "
                        "compute (a800-4x8:intra or :inter); needs root and iproute2")
    launch.add_argument("--verbose", action="store_true", help="also pass on the lines the "
                        "runtime prints on every run (gloo's \"Rank N is connected to M peer "
                        "ranks\"), hidden by default")
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
    rate = None
    if args.link is not None:
        check_tools()  # before timing anything: nothing starts without them
        shares = core_shares(args.processes) if args.pin else None
        rate, how = resolve(args.link, args.processes, args.devices_per_process or 4,
                            shares[0] if shares else None)
        if how:
            print(f"hotjax launch: --link {args.link}: {how}", flush=True)
    return run([sys.executable, "-m", "hotjax.cli", *command], args.processes,
               args.devices_per_process, pin=args.pin, link=rate, verbose=args.verbose)
