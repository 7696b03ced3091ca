"""`hotjax strategy show`: what each strategy of a table does to the model, before a long run.

Imports nothing heavy until a command runs: JAX must start after the device count is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json


def _strategies(text: str) -> list:
    """(bucket length, strategy, micro_rows) for each bucket of a table file, or
    (None, strategy, None) for one strategy."""
    from sharding.strategy import Strategy
    from sharding.table import load_table

    if text.endswith(".toml"):
        return [(b.max_len, b.strategy, b.micro_rows) for b in load_table(text).buckets]
    return [(None, Strategy.parse(text), None)]


def _show(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from models.llama import padded_vocab, preset
    from sharding.report import describe

    entries = _strategies(args.table)
    # As `hotjax train` builds it: the vocabulary padded to split over tensor ranks.
    model = preset(args.model)
    config = dataclasses.replace(model, vocab_size=padded_vocab(model.vocab_size))
    reports = [describe(strategy, config) | {"micro_rows": micro_rows}
               for _, strategy, micro_rows in entries]
    if args.json:
        print(json.dumps(reports, indent=2))
        return
    console = Console()
    for (max_len, _, _), report in zip(entries, reports, strict=True):
        title = f"{report['strategy']} on {args.model}"
        if max_len is not None:
            title = f"bucket <= {max_len} tokens: {title}"
        title = escape(title)  # "[rules]" is not rich markup
        params = Table(title=title, title_justify="left")
        for column in ("parameter", "shape", "logical axes", "placement", "ZeRO grads / optim"):
            params.add_column(column)
        for p in report["params"]:
            params.add_row(p["name"], "x".join(map(str, p["shape"])), ", ".join(p["axes"]),
                           p["spec"], " / ".join(f"{k}: {v}" for k, v in p["zero"].items()))
        console.print(params)
        for note in report["notes"]:
            console.print(f"note: {note}")
        b = report["bytes_per_device"]
        console.print(f"per device (fp32): params {_mib(b['params'])}, grads "
                      f"{_mib(b['grads'])}, Adam moments {_mib(b['optimizer'])}")
        shards = report["batch_shards"]
        rows = report["micro_rows"]
        console.print(f"micro-batches: rows split {shards} way(s); " + (
            f"{rows} row(s) each (the table's)" if rows else
            f"{shards} row(s) each by default, or the most that fit --device-memory"))
        activations = Table("activation", "placement", title="activations",
                            title_justify="left")
        for name, spec in report["activations"].items():
            activations.add_row(name, spec)
        console.print(activations)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def register(commands: argparse._SubParsersAction) -> None:
    strategy = commands.add_parser("strategy", help="inspect strategies and strategy tables")
    actions = strategy.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="each parameter's placement, per-device state bytes "
                              "and the activation layout of every strategy in a table")
    show.add_argument("table", metavar="TABLE.toml|STRATEGY",
                      help='a strategy table, or one strategy like "data=2,tensor=4"')
    show.add_argument("--model", default="small", help="model preset (default: %(default)s)")
    show.add_argument("--json", action="store_true", help="print JSON instead of tables")
    show.set_defaults(handler=_show)
