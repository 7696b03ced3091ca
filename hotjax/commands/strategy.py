"""`hotjax strategy show`: what each strategy of a table does to the model, before a long run.

Imports nothing heavy until a command runs: JAX must start after the device count is set.
With `--memory` it compiles (never runs) each bucket's micro-step under every remat policy and
reports XLA's activation memory per device; with `--target` XLA:GPU's, for GPUs this machine lacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from hotjax.choices import REMAT_POLICIES
from hotjax.commands.options import add_options, run_config
from hotjax.config import DEFAULT_MODEL
from hotjax.errors import UserError


def _step_memory(config, bucket, rows: int, policies: list[str], target
                 ) -> dict[str, dict[str, int]]:
    """Per remat policy: XLA's per-device bytes of one micro-step (`hotjax.step.step_memory`),
    compiled for this machine's devices or for `target`'s."""
    import jax

    from hotjax import targets
    from hotjax.step import bucket_step, step_memory

    count = bucket.strategy.num_devices
    devices = tuple(jax.devices()[:count] if target is None else targets.devices(target, count))
    memory = {}
    for policy in policies:
        step = bucket_step(dataclasses.replace(config, remat=policy), bucket.strategy, devices)
        memory[policy] = step_memory(step.compiled((rows, bucket.max_len)))
    return memory


def _policies(text: str | None) -> list[str]:
    if text is None:
        return list(REMAT_POLICIES)
    policies = [p.strip() for p in text.split(",") if p.strip()]
    if not policies or set(policies) - set(REMAT_POLICIES):
        raise UserError(f"--policies {text!r}: choose from {', '.join(REMAT_POLICIES)}, "
                        f"comma-separated")
    return policies


def _show(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.markup import escape

    from hotjax import targets
    from hotjax.startup import start_jax

    # Checked before JAX starts: a table file, or one strategy as the table of --context.
    tabled = args.table.endswith(".toml")
    run = run_config(args, **{"strategies" if tabled else "strategy": args.table})
    policies = _policies(args.policies)
    target = targets.prepare(args.target)  # before JAX starts: it runs on the CPU
    # Enough simulated devices for the widest mesh (a table's meshes are not known yet).
    start_jax(None)
    import jax

    from hotjax.models.optimizers import named
    from hotjax.run import model_config, named_model, strategy_table
    from hotjax.sharding.report import most_sharded, state_bytes

    optimizer = named(run.optimizer)
    table = strategy_table(run)
    buckets = list(table.buckets)
    # As `hotjax train` builds it with these options (the model's own vocabulary).
    name = run.model or DEFAULT_MODEL
    model = named_model(name)
    config = model_config(run, model, model.vocab_size)
    platform = jax.default_backend() if target is None else "gpu"
    reports = _reports(buckets, config, platform, optimizer)
    home = table.home or most_sharded(table.strategies, config, optimizer)
    state = sum(state_bytes(home, config, optimizer).values())
    if args.memory:
        with Console(stderr=True).status("compiling each bucket's micro-step per remat policy"):
            for bucket, report in zip(buckets, reports, strict=True):
                _add_memory(report, config, bucket, policies, target, state)
    if args.json:
        print(json.dumps(reports, indent=2))
        return
    console = Console()
    why = "the table names it" if table.home else "the most sharded"
    console.print(escape(f"home {home} ({why}): fp32 weights, gradient sum and "
                         f"{optimizer.label}'s state stay there, {_mib(state)} per device"))
    for bucket, report in zip(buckets, reports, strict=True):
        title = f"{report['strategy']} on {name}"
        if tabled:
            title = f"bucket <= {bucket.max_len} tokens: {title}"
        # "[rules]" is not rich markup.
        _print_bucket(console, escape(title), bucket, report, optimizer.label, platform,
                      policies)


def _reports(buckets: list, config, platform: str, optimizer) -> list[dict]:
    """Per bucket, `hotjax.sharding.report.describe`'s report of its strategy, with the table's
    micro-step rows and remat policy, and a ring's blocks per rank."""
    import numpy as np

    from hotjax.models.attention import ring_block_counts
    from hotjax.sharding.report import describe

    reports = [describe(b.strategy, config, platform, optimizer)
               | {"micro_rows": b.micro_rows, "remat": b.remat} for b in buckets]
    for bucket, report in zip(buckets, reports, strict=True):
        attention = report["attention"]
        if attention["ring"] > 1:
            # The work of each rank on one causal row of the bucket's length.
            attention["ring_blocks"] = ring_block_counts(
                np.ones((1, bucket.max_len), np.int32), np.arange(bucket.max_len)[None],
                attention["ring"], attention["balanced"], attention["block"]).tolist()
    return reports


def _add_memory(report: dict, config, bucket, policies: list[str], target, state: int) -> None:
    """XLA's activation bytes of the bucket's micro-step per remat policy into `report`, and
    with a target, whether its step fits beside the home's `state` bytes."""
    rows = bucket.micro_rows or report["batch_shards"]
    stats = _step_memory(config, bucket, rows, policies, target)
    report["activation_bytes"] = {"rows": rows, "max_len": bucket.max_len, **{
        p: s["peak"] - s["state"] for p, s in stats.items()}}
    if target is not None:
        # What a device holds while the bucket runs: the step's peak beside the home's fp32
        # state, against the memory the target declares.
        report["target"] = {
            "name": target.name, "device": target.description,
            "devices": bucket.strategy.num_devices, "memory_bytes": target.memory,
            "home_bytes": state, "step_peak_bytes": {p: s["peak"] for p, s in stats.items()},
            "fits": {p: s["peak"] + state <= target.memory for p, s in stats.items()}}


def _print_bucket(console, title: str, bucket, report: dict, optimizer: str, platform: str,
                  policies: list[str]) -> None:
    """One bucket's report: its parameters' placement, bytes, micro-steps, gradients,
    pipeline, activations, attention, remat and memory."""
    from rich.markup import escape
    from rich.table import Table

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
                  f"{_mib(b['grads'])}, {optimizer} state {_mib(b['optimizer'])}")
    console.print(_micro_steps_line(report))
    console.print(_gradients_line(report["gradients"]))
    if report["pipeline"]:
        tokens = (report["micro_rows"] or report["batch_shards"]) * bucket.max_len
        console.print(_pipeline_line(report["pipeline"], tokens))
    activations = Table("activation", "placement", title="activations", title_justify="left")
    for activation, spec in report["activations"].items():
        activations.add_row(activation, spec)
    console.print(activations)
    console.print(_attention_line(report["attention"], platform))
    if report["remat"]:
        console.print(f"remat: {report['remat']} (the table's)")
    if "activation_bytes" in report:
        console.print(_memory_table(report, policies))


def _micro_steps_line(report: dict) -> str:
    shards, rows, pipeline = report["batch_shards"], report["micro_rows"], report["pipeline"]
    split = (f"{shards} way(s)" if not pipeline else
             f"{shards} ways ({shards // pipeline['microbatches']} batch shard(s) x "
             f"{pipeline['microbatches']} pipeline micro-batches)")
    one_schedule = pipeline and pipeline["schedule_per"] == "bucket"
    return f"micro-steps: rows split {split}; " + (
        f"{rows} row(s) each (the table's)" if rows else
        f"{shards} row(s) each (a bucket's micro-steps run as one pipeline schedule)"
        if one_schedule else
        f"{shards} row(s) each by default, or the most that fit --device-memory")


def _pipeline_line(pipeline: dict, tokens: int) -> str:
    """The pipeline's schedule, bubble, activations held and bytes sent per micro-step of
    `tokens` tokens."""
    per_bucket = (f" for one micro-step, {pipeline['bubble_four_micro_steps']:.0%} for "
                  f"a bucket of 4 (one schedule per bucket)"
                  if pipeline["schedule_per"] == "bucket"
                  else " (one schedule per micro-step)")
    return (f"pipeline ({pipeline['schedule']}): {pipeline['stages']} stages of "
            f"{pipeline['layers_per_stage']} layer(s), {pipeline['microbatches']} "
            f"micro-batches, {pipeline['iterations']} ticks; bubble "
            f"{pipeline['bubble']:.0%}{per_bucket}; at most {pipeline['in_flight']} "
            f"micro-batches' activations held per stage; each device sends the next stage "
            f"{_mib(pipeline['stage_bytes_per_token'] * tokens)} per micro-step of "
            f"{tokens:,} tokens (activations forward, gradients back)")


def _memory_table(report: dict, policies: list[str]):
    from rich.table import Table

    memory, target = report["activation_bytes"], report.get("target")
    shape = f"one micro-step of {memory['rows']} x {memory['max_len']} tokens"
    if target is None:
        table = Table("remat", "activation memory per device", title=f"XLA, {shape}",
                      title_justify="left")
        for policy in policies:
            table.add_row(policy, _mib(memory[policy]))
        return table
    table = Table("remat", "activation memory per device", "step peak",
                  f"+ home {_mib(target['home_bytes'])}",
                  f"fits {target['memory_bytes'] / 2**30:.1f} GiB",
                  title=f"{shape}, per XLA:GPU for {target['devices']} {target['device']}, "
                        f"compiled on this machine without one", title_justify="left")
    for policy in policies:
        peak = target["step_peak_bytes"][policy]
        table.add_row(policy, _mib(memory[policy]), _mib(peak),
                      _mib(peak + target["home_bytes"]),
                      "yes" if target["fits"][policy] else "[red]no[/]")
    return table


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
    if attention["long_documents_kernel"] != kernel:
        line += (f"; micro-steps of long documents (at most one per 1,024 tokens): "
                 f"{attention['long_documents_kernel']} (cuDNN's packed layout)")
    elif attention["cudnn_packed_unused"]:
        line += f"; cuDNN's packed layout unused: {attention['cudnn_packed_unused']}"
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
    add_options(show, "model", "context", "compute_dtype", "attention", "attention_block",
                "optimizer")
    show.add_argument("--memory", action="store_true", help="also compile each bucket's "
                      "micro-step under every remat policy and report XLA's activation memory "
                      "(takes a while)")
    show.add_argument("--policies", metavar="P1,P2", help="with --memory: the remat policies "
                      f"to compile, comma-separated (default: all of {', '.join(REMAT_POLICIES)})")
    show.add_argument("--target", metavar="GPU|FILE", help="compile for this GPU instead of "
                      "this machine's devices (h100, a100, a800, or an XLA target config file; "
                      "no GPU needed): XLA:GPU's attention kernel and memory, against the "
                      "GPU's memory")
    show.add_argument("--json", action="store_true", help="print JSON instead of tables")
    show.set_defaults(handler=_show)
