"""`hotjax train --strategies auto` against the default table: measured step time on this machine.

    python scripts/bench_auto.py [--json] [--quick] [--model tiny] [--steps 6] [--rounds 3]
                                 [--batch-tokens 8192] [--compute-dtype D]

Two runs of `hotjax train` on the same flags and so the same mini-batches: one under the default
strategy table (`sharding/tables/default.toml`, its meshes derived from the device count, whose
context is 2048), one under `--strategies auto` at the same context (the
table the cost model plans with this machine's profile, measured once and cached). In each of
`--rounds` rounds each runs once, in turn, in this process and as the command (`hotjax.cli.main`),
so that load which drifts slows both alike; compiled steps are reused after the first round. A
run's first step is left out; each method's step time is the median over the other steps of every
round. Reported per method: its buckets as the cost model prices them (strategy, micro-batch
rows, predicted seconds) on the typical step `--strategies auto` plans for, the measured median
step time, real tokens/s, padding and losses; and auto/default of the measured and of the
predicted step time (<= 1: auto is no worse). `--quick`: one round of 2 steps (one timed) on
2,048-token mini-batches of byte tokens in float32 (a smoke test), planned, where this machine has
no profile cached, on a quick one measured for the run alone. On simulated CPU devices the
timings compare the two on this machine only: its 8 fake devices share its cores.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from quick_option import machine, parse_args, print_machine, report  # beside this script

from hotjax.commands.options import add_options

if TYPE_CHECKING:
    from rich.console import Console

    from hotjax.planning.search import Plan

QUICK = {"steps": 2, "rounds": 1, "batch_tokens": 2048, "compute_dtype": "float32",
         "tokenizer": "bytes"}
METHODS = ("default", "auto")


def run(args: argparse.Namespace, progress: Console) -> dict:
    import jax

    from hotjax.cli import main as hotjax
    from hotjax.cli import run_config as run_config_of
    from hotjax.config import RunConfig
    from hotjax.data import estimated_lengths, load_tokenizer, open_corpus
    from hotjax.errors import UserError
    from hotjax.models.llama import preset
    from hotjax.planning import search as plan
    from hotjax.planning.measure import local_profile, profile_path
    from hotjax.run import model_config, plan_search, strategy_table

    if args.steps < 2 or args.rounds < 1:
        raise UserError("--steps 2 or more (the first is left out) and --rounds 1 or more")
    devices = jax.devices()
    default = strategy_table(RunConfig(), len(devices))
    context = default.max_len
    flags = ["--model", args.model, "--context", str(context), "--steps", str(args.steps),
             "--batch-tokens", str(args.batch_tokens)]
    if args.compute_dtype:
        flags += ["--compute-dtype", args.compute_dtype]
    if args.tokenizer:
        flags += ["--tokenizer", args.tokenizer]
    argv = {"default": ["train", *flags], "auto": ["train", *flags, "--strategies", "auto"]}

    # What the runs train on and what `--strategies auto` plans with (measuring the profile
    # now, if this machine has none cached, so that no timed run does; a quick run measures a
    # quick one, for itself alone).
    if args.quick and not profile_path().exists():
        os.environ["HOTJAX_CACHE"] = tempfile.mkdtemp(prefix="bench_auto-")
        atexit.register(shutil.rmtree, os.environ["HOTJAX_CACHE"], ignore_errors=True)
        local_profile(progress, quick=True)
    run_config = run_config_of(argv["auto"])
    corpus = open_corpus(run_config.data)
    tokenizer = load_tokenizer(run_config.tokenizer, corpus, vocab_size=run_config.vocab_size)
    config = model_config(run_config, preset(run_config.model), tokenizer.vocab_size)
    search, typical = plan_search(run_config, config, len(devices),
                                  estimated_lengths(corpus, tokenizer), progress)
    predicted = {"auto": plan.plan(search, typical, context),
                 "default": plan.fixed_table(search, typical,
                                             [(b.max_len, b.strategy) for b in default.buckets])}

    records: dict[str, list[list[dict]]] = {m: [] for m in METHODS}
    said: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            for m in METHODS:  # in turn, so that a busy moment of the machine hits both alike
                metrics = Path(scratch) / f"{m}-{r}.jsonl"
                progress.print(f"round {r + 1}/{args.rounds}: hotjax {' '.join(argv[m])}",
                               highlight=False, markup=False)
                output = io.StringIO()
                with (contextlib.redirect_stderr(output), contextlib.redirect_stdout(output),
                      _wide_console()):
                    code = hotjax([*argv[m], "--metrics-jsonl", str(metrics)])
                if code != 0:
                    raise UserError(f"hotjax {' '.join(argv[m])} exited {code}: "
                                    f"{output.getvalue().strip().splitlines()[-1]}")
                said[m] = output.getvalue()
                steps = [json.loads(line) for line in metrics.read_text().splitlines()]
                records[m].append(steps)
                timed = [s["seconds"] for s in steps[1:]]
                progress.print(f"  median step {statistics.median(timed):.3f} s, last loss "
                               f"{steps[-1]['loss']:.5f}", highlight=False)
    return {
        "machine": machine(devices),
        "model": {"preset": args.model, "params": config.num_params(),
                  "compute_dtype": config.compute_dtype},
        "context": context, "batch_tokens": args.batch_tokens, "steps": args.steps,
        "rounds": args.rounds, "profile": search.profile.name,
        "commands": {m: f"hotjax {' '.join(argv[m])}" for m in METHODS},
        "planned_line": _line(said["auto"], "--strategies auto:"),
        "trainers": {m: _line(said[m], "home ") for m in METHODS},
        **summarize(records, predicted),
    }


@contextlib.contextmanager
def _wide_console():
    """Captured, `hotjax train`'s console would wrap its lines at 80 columns."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "1000"
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def _line(output: str, start: str) -> str:
    """The first line of `output` that starts with `start` ("" if none)."""
    return next((line for line in output.splitlines() if line.startswith(start)), "")


def summarize(records: dict[str, list[list[dict]]], predicted: dict[str, Plan | None]) -> dict:
    """Per method: medians over every round's steps after the first; the losses of its first
    round; and the ratios auto/default."""
    median = statistics.median
    methods = {}
    for m, runs in records.items():
        timed = [s for steps in runs for s in steps[1:]]
        found = predicted[m]
        methods[m] = {
            "buckets": [] if found is None else [
                {"max_len": b.max_len, "strategy": str(b.strategy), "micro_rows": b.micro_rows,
                 "remat": b.remat, "micro_steps": b.micro_steps, "predicted_s": b.seconds}
                for b in found.buckets],
            "predicted_s": None if found is None else found.seconds,
            "step_s": median(s["seconds"] for s in timed),
            "tokens_per_s": median(s["tokens"] / s["seconds"] for s in timed),
            "padding": 1 - sum(s["tokens"] for s in runs[0]) / sum(s["slots"] for s in runs[0]),
            "real_tokens": [s["tokens"] for s in runs[0]],
            "losses": [s["loss"] for s in runs[0]],
            "step_seconds": [[s["seconds"] for s in steps] for steps in runs],
        }
    auto, default = methods["auto"], methods["default"]
    ratio = auto["step_s"] / default["step_s"]
    return {"methods": methods, "auto_over_default": ratio, "no_worse": ratio <= 1.0,
            "predicted_auto_over_default": (
                auto["predicted_s"] / default["predicted_s"]
                if auto["predicted_s"] and default["predicted_s"] else None),
            "max_loss_difference": max(abs(a - d) for a, d in
                                       zip(auto["losses"], default["losses"], strict=True)),
            "same_tokens": auto["real_tokens"] == default["real_tokens"]}


def print_table(found: dict, console: Console) -> None:
    from rich.markup import escape
    from rich.table import Table

    model, m = found["model"], found["machine"]
    table = Table(title=f"hotjax train: default table vs --strategies auto. {model['preset']} "
                        f"({model['params'] / 1e6:.2f}M params, {model['compute_dtype']}), "
                        f"context {found['context']}, {found['batch_tokens']:,}-token "
                        f"mini-batches; medians of {found['rounds']} x "
                        f"{found['steps'] - 1} steps (runs alternating)", title_justify="left")
    for column in ("method", "bucket: strategy (micro rows, remat): predicted ms",
                   "predicted step ms", "measured step s", "real tokens/s", "pad %"):
        table.add_column(column, justify="left" if column[0] in "mb" else "right")
    for name, r in found["methods"].items():
        buckets = "\n".join(f"{b['max_len']}: {b['strategy']} ({b['micro_rows']}, {b['remat']})"
                            f" {b['predicted_s'] * 1e3:,.1f}" for b in r["buckets"])
        predicted = "does not fit" if r["predicted_s"] is None else f"{r['predicted_s'] * 1e3:,.1f}"
        table.add_row(name, escape(buckets) or "-", predicted, f"{r['step_s']:.3f}",
                      f"{r['tokens_per_s']:,.0f}", f"{100 * r['padding']:.1f}")
    console.print(table)
    predicted = found["predicted_auto_over_default"]
    console.print(f"auto / default step time: measured {found['auto_over_default']:.2f} "
                  f"({'no worse' if found['no_worse'] else 'WORSE'}), predicted "
                  + ("-" if predicted is None else f"{predicted:.2f}")
                  + f" (profile {found['profile']}). Same real tokens every step: "
                  f"{found['same_tokens']}; largest loss difference "
                  f"{found['max_loss_difference']:.1e}.", style="bold", highlight=False)
    console.print(escape(found["planned_line"]), highlight=False)
    for name, trainer in found["trainers"].items():
        console.print(escape(f"{name} trainer: {trainer}"), highlight=False)
    print_machine(m, console)
    if m["platform"] == "cpu":
        console.print("[yellow]simulated CPU devices:[/] they share the machine's cores, so "
                      "these timings compare the two tables on this machine only.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="model preset (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=6,
                        help="steps per run, the first left out (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of each method, alternating (default: %(default)s)")
    parser.add_argument("--batch-tokens", type=int, default=8192,
                        help="real tokens per mini-batch, at most (default: %(default)s)")
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"),
                        help="default: hotjax train's")
    add_options(parser, "tokenizer")  # as hotjax train's
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document to stdout (the tables go to stderr)")
    args = parse_args(parser, argv, QUICK)
    return report("bench_auto", args, run, print_table)


if __name__ == "__main__":
    sys.exit(main())
