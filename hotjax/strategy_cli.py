"""`hotjax strategy show`: what each strategy of a table does to the model, before a long run.

Imports nothing heavy until a command runs: JAX must start after the device count is set.
With `--memory` it compiles (never runs) each bucket's micro-step under every remat policy and
reports XLA's activation memory per device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from hotjax.config import RunConfig, at_least, at_most
from models.bounds import MAX_SEQ_LEN
from models.options import ATTENTION_BACKENDS, REMAT_POLICIES


def _table(text: str, context: int):
    """A table file, or one strategy as the table of one bucket of `context` tokens."""
    from sharding.strategy import Strategy
    from sharding.table import StrategyTable, load_table

    if text.endswith(".toml"):
        return load_table(text)
    return StrategyTable.single(Strategy.parse(text), context, text)


def _activation_memory(config, bucket, rows: int) -> dict[str, int]:
    """Per remat policy: XLA's per-device bytes of one micro-step beyond its arguments."""
    import jax

    from hotjax.step import bucket_step, step_memory
    from models.options import REMAT_POLICIES

    devices = tuple(jax.devices()[:bucket.strategy.num_devices])
    memory = {}
    for policy in REMAT_POLICIES:
        step = bucket_step(dataclasses.replace(config, remat=policy), bucket.strategy, devices)
        stats = step_memory(step.compiled((rows, bucket.max_len)))
        memory[policy] = stats["peak"] - stats["state"]
    return memory


def _show(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from hotjax import start_jax

    at_least("--context", args.context, 1)
    at_most("--context", args.context, MAX_SEQ_LEN, "MAX_SEQ_LEN")
    # Enough simulated devices for the widest mesh (a table's meshes are not known yet).
    start_jax(None)
    from hotjax.planning.cost import most_sharded
    from hotjax.run import model_config
    from models.llama import preset
    from sharding.report import describe, state_bytes

    table = _table(args.table, args.context)
    buckets = list(table.buckets)
    # As `hotjax train` builds it with these flags (the preset's own vocabulary).
    model = preset(args.model)
    config = model_config(RunConfig(model=args.model, attention=args.attention), model,
                          model.vocab_size)
    import jax
    import numpy as np

    from models.attention import ring_block_counts

    platform = jax.default_backend()
    reports = [describe(b.strategy, config, platform) | {"micro_rows": b.micro_rows,
                                                         "remat": b.remat} for b in buckets]
    for bucket, report in zip(buckets, reports, strict=True):
        attention = report["attention"]
        if attention["ring"] > 1:
            # The work of each rank on one causal row of the bucket's length.
            attention["ring_blocks"] = ring_block_counts(
                np.ones((1, bucket.max_len), np.int32), np.arange(bucket.max_len)[None],
                attention["ring"], attention["balanced"], attention["block"]).tolist()
    if args.memory:
        with Console(stderr=True).status("compiling each bucket's micro-step per remat policy"):
            for bucket, report in zip(buckets, reports, strict=True):
                rows = bucket.micro_rows or report["batch_shards"]
                report["activation_bytes"] = {"rows": rows, "max_len": bucket.max_len,
                                              **_activation_memory(config, bucket, rows)}
    if args.json:
        print(json.dumps(reports, indent=2))
        return
    console = Console()
    home = table.home or most_sharded(table.strategies, config)
    state = sum(state_bytes(home, config).values())
    why = "the table names it" if table.home else "the most sharded"
    console.print(escape(f"home {home} ({why}): fp32 weights, gradient sum and Adam moments "
                         f"stay there, {_mib(state)} per device"))
    for bucket, report in zip(buckets, reports, strict=True):
        title = f"{report['strategy']} on {args.model}"
        if args.table.endswith(".toml"):
            title = f"bucket <= {bucket.max_len} tokens: {title}"
        title = escape(title)  # "[rules]" is not rich markup
        params = Table(title=title, title_justify="left")
        for column in ("parameter", "shape", "logical axes", "placement", "ZeRO grads / optim"):
            params.add_column(column)
        for p in report["params"]:
            params.add_row(p["name"], "x".join(map(str, p["shape"])), ", ".join(p["axes"]),
                           p["spec"], " / ".join(f"{k}: {v}" for k, v in p["zero"].items()))
        console.print(params)
        for note in report["notes"]:
            console.print(escape(f"note: {note}"))
        b = report["bytes_per_device"]
        console.print(f"per device (fp32): params {_mib(b['params'])}, grads "
                      f"{_mib(b['grads'])}, Adam moments {_mib(b['optimizer'])}")
        shards, rows, pipeline = report["batch_shards"], report["micro_rows"], report["pipeline"]
        split = (f"{shards} way(s)" if not pipeline else
                 f"{shards} ways ({shards // pipeline['microbatches']} batch shard(s) x "
                 f"{pipeline['microbatches']} pipeline micro-batches)")
        one_schedule = pipeline and pipeline["schedule_per"] == "bucket"
        console.print(f"micro-steps: rows split {split}; " + (
            f"{rows} row(s) each (the table's)" if rows else
            f"{shards} row(s) each (a bucket's micro-steps run as one pipeline schedule)"
            if one_schedule else
            f"{shards} row(s) each by default, or the most that fit --device-memory"))
        console.print(_gradients_line(report["gradients"]))
        if pipeline:
            tokens = (rows or shards) * bucket.max_len
            per_bucket = (f" for one micro-step, {pipeline['bubble_four_micro_steps']:.0%} for "
                          f"a bucket of 4 (one schedule per bucket)"
                          if pipeline["schedule_per"] == "bucket"
                          else " (one schedule per micro-step)")
            console.print(
                f"pipeline ({pipeline['schedule']}): {pipeline['stages']} stages of "
                f"{pipeline['layers_per_stage']} layer(s), {pipeline['microbatches']} "
                f"micro-batches, {pipeline['iterations']} ticks; bubble "
                f"{pipeline['bubble']:.0%}{per_bucket}; at most {pipeline['in_flight']} "
                f"micro-batches' activations held per stage; each device sends the next stage "
                f"{_mib(pipeline['stage_bytes_per_token'] * tokens)} per micro-step of "
                f"{tokens:,} tokens (activations forward, gradients back)")
        activations = Table("activation", "placement", title="activations",
                            title_justify="left")
        for name, spec in report["activations"].items():
            activations.add_row(name, spec)
        console.print(activations)
        console.print(_attention_line(report["attention"], platform))
        if report["remat"]:
            console.print(f"remat: {report['remat']} (the table's)")
        if "activation_bytes" in report:
            memory = report["activation_bytes"]
            policies = Table("remat", "activation memory per device", title=(
                f"XLA, one micro-step of {memory['rows']} x {memory['max_len']} tokens"),
                title_justify="left")
            for policy in REMAT_POLICIES:
                policies.add_row(policy, _mib(memory[policy]))
            console.print(policies)


def _gradients_line(gradients: dict) -> str:
    local, sharded = gradients["local"], gradients["sharded"]
    if not gradients["partial_axes"]:
        return (f"gradients: an fp32 sum of {_mib(local['accumulator_bytes'])} per device, "
                f"reduced within each micro-step (no data axis to keep apart)")
    over = "·".join(gradients["partial_axes"])
    return (f"gradients: each {over} shard keeps an fp32 partial sum of "
            f"{_mib(local['accumulator_bytes'])} per device, reduced once per bucket; where "
            f"that does not fit, reduce-scattered over {over} every micro-step into "
            f"{_mib(sharded['accumulator_bytes'])}")


def _attention_line(attention: dict, platform: str) -> str:
    kernel = attention["kernel"]
    line = f"attention on {platform}: {kernel}"
    if kernel == "blockwise":
        line += f" kernel, blocks of {attention['block']} tokens"
    if attention["ring"] > 1:
        line += (f", K/V round a ring of {attention['ring']} ranks"
                 + (" (balanced chunks)" if attention["balanced"] else "")
                 + "; blocks per rank on a causal row: "
                 + " ".join(map(str, attention["ring_blocks"])))
    if attention["note"]:
        line += f" ({attention['requested']} asked for: {attention['note']})"
    return line


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
    show.add_argument("--context", type=int, default=RunConfig().context,
                      help="row length for a single strategy (a table sets its own)")
    show.add_argument("--attention", choices=ATTENTION_BACKENDS, default="auto",
                      help="attention kernel asked for (default: %(default)s)")
    show.add_argument("--memory", action="store_true", help="also compile each bucket's "
                      "micro-step under every remat policy and report XLA's activation memory "
                      "(takes a while)")
    show.add_argument("--json", action="store_true", help="print JSON instead of tables")
    show.set_defaults(handler=_show)
