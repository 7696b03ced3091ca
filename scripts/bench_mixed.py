"""The headline: real tokens/s of a hot-switched strategy table against one static strategy, on
the same mini-batches of mixed-length documents, under a per-device memory budget.

    python scripts/bench_mixed.py [--json] [--quick] [--steps 2] [--device-memory SIZE]
                                  [--table T.toml] [--strategy S | --candidates "S1; S2"]
                                  [--processes 2 [--link RATE]] [--device-memory wall]

Every method trains from the same weights on the same mini-batches: the next documents of the
corpus's seeded shuffle up to `--batch-tokens` real tokens (`MiniBatches` draws the same
documents whatever its bucket lengths or packing).
  hot  the table: each length bucket under its own strategy, hot-switched between;
  auto `--strategies auto`: the table the cost model plans for these documents on this
       machine's profile, measured in the same run on the benchmark's model;
  a    the best static strategy: of the candidates that fit the budget (default: every
       strategy the planner knows over the devices, `candidate_strategies`), the most real
       tokens/s measured on the first mini-batch (per CPU second on simulated devices), one
       bucket at the context, documents packed first-fit-decreasing with document masking,
       its rows placed on data shards by estimated work (`hotjax.balance`);
  a0   the same without that balance (rows in packing order);
  b    that strategy, one document per context-length row (padded);
  c    auto's buckets (without `--auto`, the table's), every one under that strategy: the
       ablation that keeps the buckets and drops the switching (auto/c).
Every candidate that fits is timed on the first mini-batch (a step that compiles, then one
timed) and priced by the cost model on the same documents; the report lists each one's measured
and predicted step. On 8 simulated devices the complete set is some 90 strategies, each
compiled: `--candidates` narrows it.
`--processes 2` runs it all as two processes of one CPU device each, pinned to their own cores
(a real 2-device cluster, where simulated devices in one process share its cores): there the
hand-written table puts the short bucket under data parallelism and the long one under balanced
context parallelism.
`--link RATE` (with `--processes`) joins them by a shaped link (`hotjax launch --link`: a rate,
or a profile's link scaled to this machine's compute, like a800-4x8:inter), and
`--device-memory wall` declares a memory wall: the budget under which the context's rows fit no
strategy that keeps them whole, with every remat policy, found over the complete set of
strategies whatever `--candidates` says (`hotjax.planning.wall`). auto plans as `hotjax train
--strategies auto` does (`hotjax.run.plan_search`): its buckets hold no more rows per
micro-step than the run's mini-batches fill.
Each is a `hotjax.Run` with `device_memory`: a bucket's micro-steps hold the most rows that
fit the budget by XLA's memory analysis; a method any part of which does not fit is an error
(checked before its first step, as `hotjax train --device-memory` checks it).
Reported per method: median wall and CPU seconds per step, the cost model's predicted step
(`hotjax.planning.search.fixed_table` on each step's own documents, its median over the same
timed steps), real tokens/s, the padding share of
the token slots computed, the data shards' imbalance (busiest over mean estimated work), bytes
switched, each step's loss (the same for every method up to float rounding), and the ratios
hot/a, auto/a, hot/b, hot/c, c/a and a/a0 of real tokens/s. `--quick`: the
tiny model at a 256-token context, two candidates for (a) (a smoke test). On simulated CPU
devices the timings compare methods on this machine only: 8 fake devices share its cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from quick_option import (  # beside this script
    add_processes_option,
    machine,
    parse_args,
    print_machine,
    report,
)

from hotjax.commands.options import add_options
from hotjax.config import memory_size, shown_bytes
from hotjax.errors import UserError

if TYPE_CHECKING:
    from rich.console import Console

    from hotjax.data import MiniBatch
    from hotjax.models.llama import LlamaConfig
    from hotjax.optim import OptimConfig
    from hotjax.sharding.strategy import Strategy
    from hotjax.sharding.table import Bucket, StrategyTable
    from hotjax.train import Trainer

MiB = 2**20
METHODS = {"hot": "hot-switched table", "auto": "--strategies auto (planned)",
           "a": "one strategy, packed to context", "a0": "(a) without work balance",
           "b": "one strategy, a document per row",
           "c": "one strategy, auto's buckets (the table's without auto)"}
# The default table's shorter buckets, as (context // n, strategy); the context's bucket takes
# the strategy of (a).
SHORT_BUCKETS = ((8, "data=8,rules=dp"), (2, "data=2,tensor=4,rules=megatron-sp"))
# One shorter bucket in a quick run: every method's longest bucket then shares (a)'s compiled
# micro-steps, since the home (and so the memory left) is (a)'s strategy throughout; and at
# 128 tokens the short one shares the profile's data-parallel micro-step (8 x 128).
QUICK_SHORT_BUCKETS = ((2, "data=8,rules=dp"),)
# With other device counts (`--processes N`): a table of data parallelism for the short bucket
# and balanced context parallelism for the long one.
OTHER_TABLE = ((8, "data={n},rules=dp"), (1, "context={n},rules=context,balanced=true"))
PROCESS_DEVICE_MEMORY_MIB = 6144  # per process of one device, two on a 24 GiB host
# On `tiny` in fp32 one 4096-token row needs ~3.7 GiB on one device (8 heads x 4096^2 fp32
# attention probabilities per layer, kept for the backward pass), so data=8 does not fit 1 GiB
# while 8-way sharded strategies do; 8 devices x 1 GiB also fits a 24 GiB host.
DEVICE_MEMORY_MIB = 1024
# A quick run's two candidates for (a), both timed and priced, split the rows over all 8
# devices: a mini-batch's rows (fewer than 16) then run in micro-steps of a row per device,
# within the budget, so that each candidate compiles a single micro-step, which (a), (a0), (b)
# and the hot table's long bucket share. Both shard the weights, so the hot table's
# data-parallel bucket switches away from home. Seed 1: on Python 3.11's standard library,
# both mini-batches then hold a document of the short bucket.
QUICK = {"context": 256, "batch_tokens": 2048, "device_memory": 40 * MiB, "steps": 1,
         "tokenizer": "bytes", "switch_method": "device_put", "seed": 1,
         "candidates": "fsdp=8,rules=fsdp; data=2,fsdp=4,rules=fsdp"}


WALL = "wall"


def budget(text: str) -> int | str:
    """`--device-memory`: a size, or `wall` (found in the run, on its model and devices)."""
    return WALL if text.strip().lower() == WALL else memory_size(text)


def methods_list(text: str) -> tuple[str, ...]:
    """`--methods`: known names, (a) among them (the others are measured against it)."""
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method {unknown[0]!r}: choose from "
                                         f"{', '.join(METHODS)}")
    return tuple(dict.fromkeys(("a", *names)))


def timed(fn: Callable, *args: Any) -> tuple[Any, float, float]:
    """`fn(*args)`, its wall seconds and this process's CPU seconds (on a shared machine the
    steadier measure: other processes' load lengthens the wall time only)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def build(table: StrategyTable, data: list[MiniBatch], args: argparse.Namespace,
          config: LlamaConfig, optim: OptimConfig, devices: list, balance: bool = True
          ) -> Trainer:
    """The trainer of the table's run, its micro-steps sized to the budget and to the rows
    `data` puts in each bucket on average, checked and compiled."""
    from hotjax.run import Run

    typical = [sum(m.buckets[b].tokens.shape[0] for m in data) / len(data)
               for b in range(len(table.buckets))]
    run = Run(config, table, optim, data, devices=devices, device_memory=args.device_memory,
              typical_rows=typical, balance=balance, bucket_timings=args.bucket_timings,
              switch_method=args.switch_method)
    run.trainer.check_memory(args.device_memory)  # as `hotjax train --device-memory` checks it
    run.compile()
    return run.trainer


def choose(candidates: list[Strategy], data: list[MiniBatch], args: argparse.Namespace,
           config: LlamaConfig, optim: OptimConfig, devices: list, search: Any,
           lengths: np.ndarray, console: Console) -> tuple[Strategy, list[dict]]:
    """Of the candidates that fit the budget, the fastest on a step of `data[0]` after one
    that compiles (a lone candidate is not timed), with a report on each: its measured step
    and, with a `search`, the cost model's on the same documents (`lengths`)."""
    import jax

    from hotjax.sharding.table import StrategyTable

    # Simulated devices share this process's cores: per CPU second. Pinned processes of one
    # device each, or accelerators, run in parallel: per wall second.
    simulated = devices[0].platform == "cpu" and jax.process_count() == 1
    speed = "tokens_per_cpu_s" if simulated else "tokens_per_s"
    report, fitting = [], []
    for number, strategy in enumerate(candidates, 1):
        entry = {"strategy": str(strategy)}
        report.append(entry)
        console.print(f"candidate {number}/{len(candidates)}: {strategy}", markup=False)
        try:
            trainer = build(StrategyTable.single(strategy, args.context, f"candidate {strategy}"),
                            data, args, config, optim, devices)
        except UserError as e:
            entry |= {"status": "does not fit", "error": str(e)}
            console.print(str(e), markup=False)
            continue
        entry |= {"status": "fits", "micro_rows": trainer.micro_rows[0],
                  "remat": trainer.buckets[0].config.remat,
                  "peak_bytes": max(trainer.memory().values())}
        forecast = predict(search, trainer, "a", [lengths]) if search else None
        entry["predicted_s"] = forecast[0]["seconds"] if forecast else None
        if len(candidates) > 1:
            minibatch = data[0]
            state, _ = trainer.train_step(trainer.init(0), minibatch)
            _, wall, cpu = timed(trainer.train_step, state, minibatch)
            entry |= {"step_s": wall, "cpu_s": cpu, "tokens_per_s": minibatch.real_tokens / wall,
                      "tokens_per_cpu_s": minibatch.real_tokens / cpu}
            console.print(f"candidate {strategy}: {wall:.2f} s ({cpu:.1f} CPU-s), predicted "
                          + ("-" if entry["predicted_s"] is None
                             else f"{entry['predicted_s']:.2f} s"), markup=False)
        fitting.append((entry.get(speed, 0.0), strategy))
    if not fitting:
        raise UserError(f"no candidate strategy fits {shown_bytes(args.device_memory)} per "
                        f"device at {args.context} tokens: raise --device-memory or add "
                        f"candidates")
    best = max(fitting, key=lambda f: f[0])[1]  # the first of equals
    if jax.process_count() > 1:  # each process timed its own: process 0's choice for all
        from hotjax.distributed import from_process_0

        best = candidates[int(from_process_0(str(candidates.index(best))))]
    for entry in report:
        entry["chosen"] = entry["strategy"] == str(best)
    return best, report


def run(args: argparse.Namespace, console: Console) -> dict:
    import jax

    from hotjax.data import MiniBatches, load_tokenizer, open_corpus
    from hotjax.models.llama import as_trained
    from hotjax.optim import OptimConfig
    from hotjax.planning.profile import profile_toml
    from hotjax.run import named_model
    from hotjax.sharding.strategy import Strategy
    from hotjax.sharding.table import Bucket, load_table
    from hotjax.startup import select_devices

    if args.steps < 1 or args.warmup < 1:
        raise UserError("--steps and --warmup: run at least one of each")
    devices = select_devices(None)
    n = len(devices)
    if args.device_memory is None:
        args.device_memory = (DEVICE_MEMORY_MIB if n == 8 else PROCESS_DEVICE_MEMORY_MIB) * MiB
    dtype = args.compute_dtype or ("float32" if devices[0].platform == "cpu" else "bfloat16")
    corpus = open_corpus(args.data)
    tokenizer = load_tokenizer(args.tokenizer, corpus)
    config = as_trained(named_model(args.model), tokenizer.vocab_size, compute_dtype=dtype)
    total = args.warmup + args.steps
    optim = OptimConfig(warmup_steps=1, total_steps=total + 1)
    wall = wall_budget(args, config, devices, console) if args.device_memory == WALL else None
    table = load_table(args.table) if args.table else None
    if table is not None and table.max_len != args.context:
        raise UserError(f"{table.source}: its longest bucket is {table.max_len}, not the context "
                        f"({args.context}): pass --context {table.max_len}")
    hand = (QUICK_SHORT_BUCKETS if args.quick else SHORT_BUCKETS) if n == 8 else OTHER_TABLE
    buckets = [Bucket(args.context // d, Strategy.parse(s.format(n=n))) for d, s in hand]
    short = [b for b in buckets if b.max_len < args.context]
    max_lens = ([b.max_len for b in table.buckets] if table
                else [*(b.max_len for b in short), args.context])

    def draw(lengths: list[int], packing: str = "ffd") -> list[MiniBatch]:
        stream = MiniBatches(corpus, tokenizer, lengths, batch_tokens=args.batch_tokens,
                             packing=packing, seed=args.seed)
        return [next(stream) for _ in range(total)]

    data = {"hot": draw(max_lens), "a": draw([args.context]), "b": draw([args.context], "none")}
    data["c"], data["a0"] = data["hot"], data["a"]  # c: auto's buckets where it is planned
    search, lengths = None, [m.document_lengths() for m in data["a"]]
    auto, why = None, None
    if args.auto:
        search, auto, why = planned(config, devices, args, np.concatenate(lengths), console)
        data["auto"] = draw([b.max_len for b in auto.buckets])
        data["c"] = data["auto"]
    methods = [m for m in METHODS if m in data and m in args.methods]
    check_same_documents({m: data[m] for m in methods})
    static, candidate_report = choose(candidate_list(args, config, n), data["a"], args, config,
                                      optim, devices, search, lengths[0], console)
    tables = method_tables(table, buckets, static, auto, args.context)
    trainers = {m: build(tables[m], data[m], args, config, optim, devices, balance=m != "a0")
                for m in methods}
    for m, trainer in trainers.items():
        console.print(f"{m}: {trainer.describe()}", markup=False)
    predicted = {m: predict(search, trainers[m], m, lengths) for m in methods} if search else {}

    records = train(trainers, data, total, args.warmup, console)
    return {
        "machine": machine(devices),
        "processes": jax.process_count(),
        "model": {"preset": args.model, "params": config.num_params(),
                  "vocab_size": config.vocab_size, "compute_dtype": dtype},
        "corpus": corpus.source, "tokenizer": tokenizer.identity,
        **{k: getattr(args, k) for k in ("quick", "context", "batch_tokens", "warmup", "steps",
                                         "switch_method", "seed")},
        "device_memory": args.device_memory / MiB,  # MiB in the report, as its table shows
        "static_strategy": str(static), "candidates": candidate_report,
        "wall": None if wall is None else {
            "budget_bytes": wall.budget_bytes, "fits": [
                {"strategy": str(f.strategy), "whole_rows": f.whole_rows,
                 "peak_bytes": f.peak_bytes, "remat": f.remat, "accumulate": f.accumulate}
                for f in wall.fits]},
        "profile": search.profile.name if search else None,
        "profile_toml": profile_toml(search.profile) if search else None,
        "auto_plan": None if auto is None else auto.toml(), "auto_why": why,
        **summarize(records, trainers, predicted, args.warmup),
    }


def wall_budget(args: argparse.Namespace, config: LlamaConfig, devices: list, console: Console):
    """`--device-memory wall`: the memory wall at the context (`hotjax.planning.wall`), its
    budget set as the device memory."""
    from hotjax.planning.wall import memory_wall

    wall = memory_wall(config, args.context, devices,
                       progress=lambda line: console.print(line, markup=False))
    args.device_memory = wall.budget_bytes
    console.print(f"memory wall at {args.context} tokens per row: "
                  f"{shown_bytes(wall.budget_bytes)} per device, below "
                  f"{wall.ceiling.strategy} keeping rows whole "
                  f"({shown_bytes(wall.ceiling.peak_bytes)}, remat {wall.ceiling.remat}) and "
                  f"above {wall.floor.strategy} splitting them "
                  f"({shown_bytes(wall.floor.peak_bytes)})", markup=False)
    return wall


def check_same_documents(data: dict[str, list[MiniBatch]]) -> None:
    """Every method's mini-batch of a step holds the same documents, only bucketed apart."""
    for step, minibatches in enumerate(zip(*data.values(), strict=True)):
        seen = {(m.sequences, m.real_tokens) for m in minibatches}
        if len(seen) > 1:
            raise RuntimeError(f"mini-batch {step}: methods hold different documents: {seen}")


def method_tables(table: StrategyTable | None, buckets: list[Bucket], static: Strategy,
                  auto: StrategyTable | None, context: int) -> dict[str, StrategyTable | None]:
    """Each method's strategy table: hot's (`--table`, or the hand-written one: `buckets`
    below the context and its bucket under (a)), auto's, and the static strategy's."""
    from hotjax.sharding.table import Bucket, StrategyTable

    if table is None:
        short = [b for b in buckets if b.max_len < context]
        long = next((b.strategy for b in buckets if b.max_len == context), static)
        table = StrategyTable((*short, Bucket(context, long)), "hand-written table")
    single = StrategyTable.single(static, context, METHODS["a"])
    return {"hot": table, "auto": auto, "a": single, "a0": single, "b": single,
            "c": StrategyTable(tuple(Bucket(b.max_len, static)
                                     for b in (auto or table).buckets), METHODS["c"])}


def candidate_list(args: argparse.Namespace, config: LlamaConfig, n: int) -> list:
    """The strategies (a)'s static one is chosen from: `--strategy`, `--candidates`, or every
    strategy the planner knows over `n` devices (each fits its remat policy)."""
    from hotjax.sharding.strategy import Strategy

    if args.strategy or args.candidates:
        texts = [args.strategy] if args.strategy else args.candidates.split(";")
        return [Strategy.parse(t.strip()) for t in texts if t.strip()]
    from hotjax.planning.search import candidate_strategies

    return candidate_strategies(config, n)


def train(trainers: dict, data: dict[str, list[MiniBatch]], total: int, warmup: int,
          console: Console) -> dict[str, list[dict]]:
    """Each method's `total` steps' metrics and seconds, the methods' steps interleaved, so
    that a busy moment of the machine hits all alike."""
    states = {m: trainer.init(0) for m, trainer in trainers.items()}
    records: dict[str, list[dict]] = {m: [] for m in trainers}
    for step in range(total):
        for m, trainer in trainers.items():
            (states[m], metrics), seconds, cpu = timed(trainer.train_step, states[m],
                                                       data[m][step])
            records[m].append(metrics | {"seconds": seconds, "cpu_s": cpu})
            warm = " (warm-up)" if step < warmup else ""
            console.print(f"step {step + 1}/{total}{warm} {m}: {seconds:.2f} s ({cpu:.1f} CPU-s),"
                          f" loss {metrics['loss']:.5f}, imbalance {metrics['imbalance']:.2f}",
                          markup=False)
    return records


def planned(config: LlamaConfig, devices: list, args: argparse.Namespace, lengths: np.ndarray,
            console: Console) -> tuple[Any, StrategyTable, str]:
    """The cost model's search on this machine's profile, measured here on the benchmark's own
    model and dtype (`--strategies auto` measures a reference model once per machine: on CPU
    attention's rate depends on the head width), and the table it plans for a typical step of
    these documents, as `hotjax train --strategies auto` plans it (`hotjax.run.plan_search`:
    the same typical step, and buckets of no more rows than the mini-batches fill), and why
    it is that table (`Plan.why`: one strategy where no table gains more than the model's
    error)."""

    from hotjax.config import RunConfig
    from hotjax.planning import search as plan_lib
    from hotjax.planning.measure import measure_profile
    from hotjax.planning.wall import xla_bytes
    from hotjax.run import plan_search

    console.print("measuring this machine's profile on the model...", markup=False)
    profile = measure_profile(devices, model=config, quick=args.quick)
    run = RunConfig(context=args.context, batch_tokens=args.batch_tokens,
                    device_memory=args.device_memory)
    search, typical = plan_search(run, config, len(devices), lengths, console, profile)
    found = plan_lib.plan_checked(search, typical, args.context, xla_bytes(config, devices),
                                  progress=lambda line: console.print(line, markup=False))
    console.print(f"auto: planned on profile {profile.name}, predicted "
                  f"{found.seconds * 1e3:,.1f} ms per typical step, "
                  f"{found.expected_seconds * 1e3:,.1f} on {len(found.drawn_seconds)} drawn "
                  f"mini-batches; {found.why}", markup=False)
    return search, found.table(METHODS["auto"]), found.why


def predict(search: Any, trainer: Trainer, method: str, lengths: list[np.ndarray]
            ) -> list[dict] | None:
    """The cost model's step of `trainer`'s table on each mini-batch's documents, its micro-steps
    as the trainer runs them: seconds, of which switching, and each bucket's (None where a
    bucket does not fit its memory model)."""
    from hotjax.run import priced_steps

    plans = priced_steps(search, trainer, lengths, padded=method == "b")
    if plans is None:
        return None
    return [{"seconds": p.seconds, "switch_s": p.switch_seconds,
             "buckets": {b.max_len: {"predicted_s": b.seconds, **dict(zip(
                 ("predicted_compute_s", "predicted_switch_s", "predicted_gradients_s"), parts,
                 strict=True))} for b, parts in zip(p.buckets, p.bucket_parts(), strict=True)}}
            for p in plans]


def summarize(records: dict[str, list[dict]], trainers: dict[str, Trainer],
              predicted: dict[str, list[dict] | None], warmup: int) -> dict:
    """Per method: medians over the timed steps (the cost model's too, each step predicted on
    its own documents), padding and losses over all of them."""
    median = statistics.median
    methods = {}
    for m, steps in records.items():
        for step, plan in zip(steps, predicted.get(m) or (), strict=False):
            step["predicted_s"] = plan["seconds"]
            step["predicted_switch_s"] = plan["switch_s"]
            for bucket in step["buckets"]:
                bucket.update(plan["buckets"][bucket["max_len"]])
        timed_steps, trainer = steps[warmup:], trainers[m]
        forecast = all("predicted_s" in r for r in timed_steps)
        methods[m] = {
            "description": METHODS[m], "home": str(trainer.home.layout.strategy),
            "buckets": [{"max_len": b.max_len, "strategy": str(s.layout.strategy),
                         "micro_rows": rows} for b, s, rows
                        in zip(trainer.table.buckets, trainer.buckets, trainer.micro_rows,
                               strict=True)],
            "memory_bytes": trainer.memory(),
            "step_s": median(r["seconds"] for r in timed_steps),
            "cpu_s": median(r["cpu_s"] for r in timed_steps),
            "tokens_per_s": median(r["tokens"] / r["seconds"] for r in timed_steps),
            "tokens_per_cpu_s": median(r["tokens"] / r["cpu_s"] for r in timed_steps),
            "predicted_s": median(r["predicted_s"] for r in timed_steps) if forecast else None,
            "predicted_tokens_per_s": median(r["tokens"] / r["predicted_s"] for r in timed_steps)
            if forecast else None,
            "imbalance_before": median(r["imbalance_before"] for r in steps),
            "imbalance": median(r["imbalance"] for r in steps),
            "switched_bytes": median(r["switched_bytes"] for r in timed_steps),
            "padding": 1 - sum(r["tokens"] for r in steps) / sum(r["slots"] for r in steps),
            "losses": [r["loss"] for r in steps],
            "steps": steps,
        }

    def ratios(key: str) -> dict[str, float]:
        v = {m: methods[m][key] for m in methods}
        pairs = ("hot/a", "auto/a", "hot/b", "hot/c", "auto/c", "c/a", "a/a0")
        return {p: v[p.split("/")[0]] / v[p.split("/")[1]] for p in pairs
                if all(v.get(m) for m in p.split("/"))}

    reference = methods["a"]["losses"]
    return {"methods": methods, "ratios": ratios("tokens_per_s"),
            "predicted_ratios": ratios("predicted_tokens_per_s"),
            "ratios_cpu": ratios("tokens_per_cpu_s"),
            "max_loss_difference": max(abs(x - y) for m in methods
                                       for x, y in zip(methods[m]["losses"], reference,
                                                       strict=True))}


def print_bucket_timings(report: dict, console: Console) -> None:
    """With `--bucket-timings`: each timed step's buckets, each part measured against its
    price: the micro-steps, the weights into the bucket's layout, its gradients home (the one
    reduction of `local` accumulation with their move, or their switch)."""
    from rich.table import Table

    table = Table(title="buckets of the timed steps, measured / predicted seconds: micro-steps, "
                        "weights in, gradients home, and the three together",
                  title_justify="left")
    for column in ("method", "step", "bucket", "rows", "micro-steps", "remat", "compute s",
                   "weights in s", "gradients s", "all s", "measured / predicted"):
        table.add_column(column, justify="left" if column == "method" else "right")
    parts = (("compute_s", "predicted_compute_s"), ("switch_s", "predicted_switch_s"),
             ("gradients_s", "predicted_gradients_s"))
    for name, r in report["methods"].items():
        for number, step in enumerate(r["steps"][report["warmup"]:], report["warmup"] + 1):
            for b in step["buckets"]:
                if b.get("compute_s") is None:
                    continue
                priced = "predicted_s" in b
                cells = [f"{b[m]:.2f} / {b[p]:.2f}" if priced else f"{b[m]:.2f}"
                         for m, p in parts]
                measured = sum(b[m] for m, _ in parts)
                guess = sum(b[p] for _, p in parts) if priced else None
                table.add_row(name, str(number), str(b["max_len"]), str(b["rows"]),
                              str(b["micro_steps"]), b["remat"], *cells,
                              f"{measured:.2f}" if guess is None
                              else f"{measured:.2f} / {guess:.2f}",
                              f"{measured / guess:.2f}" if guess else "-")
    if table.row_count:
        console.print(table)


def print_candidates(report: dict, console: Console) -> None:
    """The candidates for (a): each one's measured step on the first mini-batch beside the
    cost model's, fastest first (per CPU second on simulated devices), those that do not fit
    last."""
    from rich.markup import escape
    from rich.table import Table

    simulated = report["machine"]["platform"] == "cpu" and report["processes"] == 1
    speed = "tokens_per_cpu_s" if simulated else "tokens_per_s"
    table = Table(title=f"candidates for (a) on the first mini-batch: measured (one step after "
                        f"one that compiles) and predicted, by {speed.replace('_', ' ')}",
                  title_justify="left")
    for column in ("strategy", "rows", "remat", "peak MiB", "step s", "CPU s", "predicted s",
                   "measured / predicted", "tokens/s", "tokens/CPU-s"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    fits = [c for c in report["candidates"] if c["status"] == "fits"]
    for c in sorted(fits, key=lambda c: -c.get(speed, 0.0)):
        measured, guess = c.get("step_s"), c.get("predicted_s")
        cells = [f"{c['micro_rows']}", c["remat"], f"{c['peak_bytes'] / MiB:,.1f}",
                 *("-" if measured is None else f"{c[k]:.2f}" for k in ("step_s", "cpu_s")),
                 "-" if guess is None else f"{guess:.2f}",
                 "-" if measured is None or not guess else f"{measured / guess:.2f}",
                 *("-" if measured is None else f"{c[k]:,.0f}"
                   for k in ("tokens_per_s", "tokens_per_cpu_s"))]
        table.add_row(escape(c["strategy"]) + (" (a)" if c["chosen"] else ""), *cells)
    for c in report["candidates"]:
        if c["status"] != "fits":
            table.add_row(escape(c["strategy"]), "does not fit", *[""] * 8)
    console.print(table)


def print_report(report: dict, console: Console) -> None:
    from rich.markup import escape
    from rich.table import Table

    m, model = report["machine"], report["model"]
    table = Table(title=f"{model['preset']} ({model['params'] / 1e6:.2f}M params, "
                        f"{model['compute_dtype']}), context {report['context']}, "
                        f"{report['batch_tokens']:,}-token mini-batches of the same documents, "
                        f"{report['device_memory']:g} MiB per device; medians of "
                        f"{report['steps']} steps after {report['warmup']} warm-up",
                  title_justify="left")
    for column in ("method", "bucket: strategy (rows per micro-step)", "peak MiB", "pad %",
                   "imbalance", "step s", "predicted s", "CPU s", "switched MiB", "tokens/s",
                   "tokens/CPU-s"):
        table.add_column(column, justify="left" if column[0] in "mb" else "right")
    for name, r in report["methods"].items():
        buckets = "\n".join(f"{b['max_len']}: {b['strategy']} ({b['micro_rows']})"
                            for b in r["buckets"])
        predicted = "-" if r["predicted_s"] is None else f"{r['predicted_s']:.2f}"
        table.add_row(f"{name}: {r['description']}", escape(buckets),
                      f"{max(r['memory_bytes'].values()) / MiB:,.1f}",
                      f"{100 * r['padding']:.0f}",
                      f"{r['imbalance']:.2f} (of {r['imbalance_before']:.2f})",
                      f"{r['step_s']:.2f}", predicted, f"{r['cpu_s']:.1f}",
                      f"{r['switched_bytes'] / MiB:.2f}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['tokens_per_cpu_s']:,.0f}")
    console.print(table)
    for key, what in (("ratios", "tokens/s"), ("ratios_cpu", "tokens/CPU-s"),
                      ("predicted_ratios", "tokens/s the cost model predicts")):
        console.print(f"ratios of real {what}: " + ", ".join(
            f"{k} = {v:.2f}" for k, v in report[key].items()), style="bold", highlight=False)
    print_candidates(report, console)
    console.print(f"(a): {report['static_strategy']}. Largest loss difference "
                  f"between methods: {report['max_loss_difference']:.1e}. peak: XLA's "
                  f"per-device peak of the largest part (home state plus a bucket's micro-step). "
                  f"pad %: padding share of the token slots computed. imbalance: the busiest "
                  f"data shard's estimated work over the mean's, rows placed by work (of: in "
                  f"packing order); medians over steps. predicted: the cost model on profile "
                  f"{report['profile']}. switched MiB: weights "
                  f"into buckets and gradients home, summed over devices (switch method "
                  f"{report['switch_method']}).", markup=False, highlight=False)
    print_bucket_timings(report, console)
    print_machine(m, console)
    if m["platform"] == "cpu" and report["processes"] > 1:
        console.print(f"[green]pinned processes:[/] {report['processes']} processes of one CPU "
                      f"device each, each on its own core: their compute runs in parallel and "
                      f"their collectives cross gloo over loopback, as a small cluster's do.")
    elif m["platform"] == "cpu":
        console.print("[yellow]simulated CPU devices:[/] they share the machine's cores, so "
                      "these timings compare methods on this machine only and do not model a "
                      "GPU cluster: no link is slower than memory, and the blockwise "
                      "attention kernel (which skips the blocks a mask hides) runs in plain "
                      "XLA, not as a fused GPU kernel.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document to stdout (the tables go to stderr)")
    parser.add_argument("--model", default="tiny", help="model preset (default: %(default)s)")
    parser.add_argument("--context", type=int, default=4096,
                        help="the longest bucket, in tokens (default: %(default)s)")
    parser.add_argument("--batch-tokens", type=int, default=12288,
                        help="real tokens per mini-batch, at most (default: %(default)s)")
    parser.add_argument("--device-memory", type=budget, metavar="SIZE|wall",
                        help=f"per-device memory budget, like 6GiB (a bare number is MiB; "
                        f"default: {DEVICE_MEMORY_MIB} MiB on 8 devices, else "
                        f"{PROCESS_DEVICE_MEMORY_MIB} MiB), or `wall`: the budget under which "
                        f"the context's rows fit no strategy that keeps them whole, while one "
                        f"that splits them fits (hotjax.planning.wall)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps first (default: %(default)s)")
    parser.add_argument("--table", help="a strategy table (TOML) for the hot run; default: "
                        + ", ".join(f"<= context/{n}: {s}" for n, s in SHORT_BUCKETS)
                        + ", <= context: the strategy of (a)")
    parser.add_argument("--candidates", help="strategies for (a), separated by ';' (default: "
                        "every strategy the planner knows over the devices, each timed)")
    parser.add_argument("--auto", action=argparse.BooleanOptionalAction, default=True,
                        help="run --strategies auto and the cost model's predictions (default: "
                        "on; the profile is measured in the run, on the model)")
    parser.add_argument("--strategy", help="use this strategy for (a) instead of choosing")
    parser.add_argument("--methods", type=methods_list, default=tuple(METHODS),
                        help="the methods run, comma-separated (default: all of "
                        + ", ".join(METHODS) + "; a always)")
    add_options(parser, "data", "tokenizer")  # as hotjax train's
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"),
                        help="default: float32 on CPU, bfloat16 on accelerators")
    parser.add_argument("--switch-method", default="auto",
                        choices=("auto", "scheduled", "device_put"))
    parser.add_argument("--seed", type=int, default=0, help="document order")
    parser.add_argument("--bucket-timings", action="store_true",
                        help="time each bucket's compute and switching (a host synchronisation "
                             "per bucket), beside the cost model's prediction of each")
    add_processes_option(parser)
    args = parse_args(parser, argv, QUICK)
    return report("bench_mixed", args, run, print_report, devices=8, width=150)


if __name__ == "__main__":
    sys.exit(main())
