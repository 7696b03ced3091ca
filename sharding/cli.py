"""`hotjax strategy show`: what each strategy of a table does to the model, before a long run."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from hotjax.errors import UserError
from models.llama import LlamaConfig, abstract_params, param_axes, preset
from sharding.strategy import Strategy, fit_to_model, ways
from sharding.table import load_table

# Where activations are constrained in the model, by their logical axes.
ACTIVATIONS = {
    "residual stream": ("batch", "seq", "embed"),
    "attention queries / output": ("batch", "inner_seq", "heads", "head_dim"),
    "attention keys / values": ("batch", "kv_seq", "kv_heads", "head_dim"),
    "MLP hidden": ("batch", "inner_seq", "mlp"),
    "logits": ("batch", "inner_seq", "vocab"),
}
FP32 = 4
ADAM_MOMENTS = 2


def describe(strategy: Strategy, config: LlamaConfig) -> dict[str, Any]:
    """The placement of every parameter and activation, and per-device bytes of the state."""
    fitted, notes = fit_to_model(strategy, config)
    sizes = fitted.axes
    flat_axes = _flatten(param_axes(config))
    flat_shapes = _flatten(abstract_params(config))
    params, totals = [], {"params": 0, "grads": 0, "optimizer": 0}
    for name, axes in flat_axes.items():
        shape = flat_shapes[name].shape
        specs = {"params": fitted.param_spec(axes), "grads": fitted.grad_spec(axes),
                 "optimizer": fitted.optimizer_spec(axes)}
        for kind, spec in specs.items():
            pieces = ways(spec, sizes)
            if any(size % n for size, n in zip(shape, pieces, strict=False)):
                raise UserError(f"{strategy}: parameter {name} {shape} does not split as "
                                f"{tuple(spec)}: choose mesh sizes that divide it")
            copies = ADAM_MOMENTS if kind == "optimizer" else 1
            totals[kind] += copies * FP32 * math.prod(shape) // math.prod(pieces)
        params.append({"name": name, "shape": list(shape), "axes": list(axes),
                       "spec": _spec_text(specs["params"]),
                       "zero": {k: _spec_text(v) for k, v in specs.items() if k != "params"
                                and v != specs["params"]}})
    return {"strategy": str(strategy), "mesh": {a: n for a, n in sizes.items() if n > 1},
            "rules": fitted.rules.name, "notes": list(notes), "params": params,
            "bytes_per_device": totals,
            "activations": {k: _spec_text(fitted.activation_spec(v))
                            for k, v in ACTIVATIONS.items()}}


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _spec_text(spec) -> str:
    return "(" + ", ".join("·".join(p) if isinstance(p, tuple) else str(p) for p in spec) + ")" \
        if len(spec) else "replicated"


def _strategies(text: str) -> list[tuple[int | None, Strategy]]:
    """(bucket length, strategy) for a table file, or (None, strategy) for one strategy."""
    if text.endswith(".toml"):
        return [(bucket.max_len, bucket.strategy) for bucket in load_table(text).buckets]
    return [(None, Strategy.parse(text))]


def _show(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    entries = _strategies(args.table)
    config = preset(args.model)
    reports = [describe(strategy, config) for _, strategy in entries]
    if args.json:
        print(json.dumps(reports, indent=2))
        return
    console = Console()
    for (max_len, _), report in zip(entries, reports, strict=True):
        title = f"{report['strategy']} on {args.model}"
        if max_len is not None:
            title = f"bucket <= {max_len} tokens: {title}"
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
