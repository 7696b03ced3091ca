"""The headline: real tokens/s of a hot-switched strategy table against one static strategy, on
the same mini-batches of mixed-length documents, under a per-device memory budget.

    python scripts/bench_mixed.py [--json] [--quick] [--steps 2] [--device-memory MiB]
                                  [--table T.toml] [--strategy S | --candidates "S1; S2"]

Every method trains from the same weights on the same mini-batches: the next documents of the
corpus's seeded shuffle up to `--batch-tokens` real tokens (`MiniBatches` draws the same
documents whatever its bucket lengths or packing).
  hot  the table: each length bucket under its own strategy, hot-switched between;
  a    the best single strategy (of the `--candidates` that fit the budget, the most real
       tokens/s on the first mini-batch, per CPU second on simulated devices), one bucket at
       the context, documents packed first-fit-decreasing;
  b    that strategy, one document per context-length row (padded);
  c    the table's buckets, every one under that strategy.
Each is a `Trainer` with `device_memory`: a bucket's micro-batches hold the most rows that fit
the budget by XLA's memory analysis; a method any part of which does not fit is an error.
Reported per method: median wall and CPU seconds per step, real tokens/s, the padding share of
the token slots computed, bytes switched, each step's loss (the same for every method up to
float rounding), and the ratios hot/a, hot/b, hot/c and c/a of real tokens/s. `--quick`: the
tiny model at a short context with a fixed (a) (a smoke test). On simulated CPU devices the
timings compare methods on this machine only: 8 fake devices share its cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quick_option import console, machine, parse_args, print_machine  # noqa: E402  (beside this script)

from hotjax.cli import start_jax  # noqa: E402  (imports no JAX: the device count comes first)
from models.errors import UserError  # noqa: E402

if TYPE_CHECKING:
    from rich.console import Console

    from hotjax.data import MiniBatch
    from hotjax.optim import OptimConfig
    from hotjax.train import Trainer
    from models.llama import LlamaConfig
    from sharding.strategy import Strategy
    from sharding.table import StrategyTable

MiB = 2**20
METHODS = {"hot": "hot-switched table", "a": "one strategy, packed to context",
           "b": "one strategy, a document per row", "c": "one strategy, the table's buckets"}
# The default table's shorter buckets, as (context // n, strategy); the context's bucket takes
# the strategy of (a).
SHORT_BUCKETS = ((8, "data=8,rules=dp"), (2, "data=2,tensor=4,rules=megatron-sp"))
# One shorter bucket in a quick run: every method's longest bucket then shares (a)'s compiled
# micro-steps, since the home (and so the memory left) is (a)'s strategy throughout.
QUICK_SHORT_BUCKETS = ((4, "data=8,rules=dp"),)
CANDIDATES = ("data=8,rules=dp; tensor=8,rules=megatron-sp; "
              "fsdp=2,context=4,rules=context,balanced=true; "
              "context=8,rules=context,balanced=true; data=2,tensor=4,rules=megatron-sp")
# On `tiny` in fp32 one 4096-token row needs ~3.7 GiB on one device (8 heads x 4096^2 fp32
# attention probabilities per layer, kept for the backward pass), so data=8 does not fit 1 GiB
# while 8-way sharded strategies do; 8 devices x 1 GiB also fits a 24 GiB host.
DEVICE_MEMORY_MIB = 1024
# The budget still splits (a) and (b) into micro-steps. Seed 1: on Python 3.11's standard
# library, both mini-batches then hold a document of the short bucket.
QUICK = {"context": 512, "batch_tokens": 4096, "device_memory": 40.0, "steps": 1,
         "tokenizer": "bytes", "strategy": "fsdp=2,context=4,rules=context,balanced=true",
         "switch_method": "device_put", "seed": 1}


def timed(fn: Callable, *args: Any) -> tuple[Any, float, float]:
    """`fn(*args)`, its wall seconds and this process's CPU seconds (on a shared machine the
    steadier measure: other processes' load lengthens the wall time only)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def build(table: StrategyTable, data: list[MiniBatch], args: argparse.Namespace,
          config: LlamaConfig, optim: OptimConfig, devices: list) -> Trainer:
    """The table's trainer, its micro-batches sized to the budget and to the rows `data`
    puts in each bucket on average, checked and compiled."""
    from hotjax.train import Trainer

    typical = [sum(m.buckets[b].tokens.shape[0] for m in data) / len(data)
               for b in range(len(table.buckets))]
    trainer = Trainer(config, optim, table, devices, device_memory=args.device_memory,
                      typical_rows=typical, switch_method=args.switch_method)
    for part, used in trainer.memory().items():
        if used > args.device_memory * MiB:
            raise UserError(f"{table.source}: the {part} needs {used / MiB:,.1f} MiB per device, "
                            f"over --device-memory {args.device_memory:g}: raise it")
    trainer.prepare()
    return trainer


def choose(candidates: list[Strategy], data: list[MiniBatch], args: argparse.Namespace,
           config: LlamaConfig, optim: OptimConfig, devices: list, console: Console
           ) -> tuple[Strategy, list[dict]]:
    """Of the candidates that fit the budget, the fastest on a step of `data[0]` after one
    that compiles (a lone candidate is not timed), with a report on each."""
    from sharding.table import StrategyTable

    speed = "tokens_per_cpu_s" if devices[0].platform == "cpu" else "tokens_per_s"
    report, fitting = [], []
    for strategy in candidates:
        entry = {"strategy": str(strategy)}
        report.append(entry)
        try:
            trainer = build(StrategyTable.single(strategy, args.context, f"candidate {strategy}"),
                            data, args, config, optim, devices)
        except UserError as e:
            entry |= {"status": "does not fit", "error": str(e)}
            console.print(str(e), markup=False)
            continue
        entry |= {"status": "fits", "micro_rows": trainer.micro_rows[0],
                  "peak_bytes": max(trainer.memory().values())}
        if len(candidates) > 1:
            minibatch = data[0]
            state, _ = trainer.train_step(trainer.init(0), minibatch)
            _, wall, cpu = timed(trainer.train_step, state, minibatch)
            entry |= {"tokens_per_s": minibatch.real_tokens / wall,
                      "tokens_per_cpu_s": minibatch.real_tokens / cpu}
            console.print(f"candidate {strategy}: {entry['tokens_per_s']:,.0f} tokens/s, "
                          f"{entry['tokens_per_cpu_s']:,.0f} tokens/CPU-s", markup=False)
        fitting.append((entry.get(speed, 0.0), strategy))
    if not fitting:
        raise UserError(f"no candidate strategy fits {args.device_memory:g} MiB per device at "
                        f"{args.context} tokens: raise --device-memory or add candidates")
    best = max(fitting, key=lambda f: f[0])[1]  # the first of equals
    for entry in report:
        entry["chosen"] = entry["strategy"] == str(best)
    return best, report


def run(args: argparse.Namespace, console: Console) -> dict:

    from hotjax.data import MiniBatches, load_tokenizer, open_corpus
    from hotjax.optim import OptimConfig
    from hotjax.run import select_devices
    from models.llama import padded_vocab, preset
    from sharding.strategy import Strategy
    from sharding.table import Bucket, StrategyTable, load_table

    if args.steps < 1 or args.warmup < 1:
        raise UserError("--steps and --warmup: run at least one of each")
    devices = select_devices(None)
    dtype = args.compute_dtype or ("float32" if devices[0].platform == "cpu" else "bfloat16")
    corpus = open_corpus(args.data)
    tokenizer = load_tokenizer(args.tokenizer, corpus)
    config = dataclasses.replace(preset(args.model), vocab_size=padded_vocab(tokenizer.vocab_size),
                                 compute_dtype=dtype)
    total = args.warmup + args.steps
    optim = OptimConfig(warmup_steps=1, total_steps=total + 1)
    table = load_table(args.table) if args.table else None
    if table is not None and table.max_len != args.context:
        raise UserError(f"{table.source}: its longest bucket is {table.max_len}, not the context "
                        f"({args.context}): pass --context {table.max_len}")
    short = [Bucket(args.context // n, Strategy.parse(s))
             for n, s in (QUICK_SHORT_BUCKETS if args.quick else SHORT_BUCKETS)]
    max_lens = ([b.max_len for b in table.buckets] if table
                else [*(b.max_len for b in short), args.context])

    def draw(lengths: list[int], packing: str = "ffd") -> list[MiniBatch]:
        stream = MiniBatches(corpus, tokenizer, lengths, batch_tokens=args.batch_tokens,
                             packing=packing, seed=args.seed)
        return [next(stream) for _ in range(total)]

    data = {"hot": draw(max_lens), "a": draw([args.context]), "b": draw([args.context], "none")}
    data["c"] = data["hot"]
    for step in range(total):
        seen = {(data[m][step].sequences, data[m][step].real_tokens) for m in METHODS}
        if len(seen) > 1:
            raise RuntimeError(f"mini-batch {step}: methods hold different documents: {seen}")

    texts = [args.strategy] if args.strategy else args.candidates.split(";")
    candidates = [Strategy.parse(t.strip()) for t in texts if t.strip()]
    static, candidate_report = choose(candidates, data["a"], args, config, optim, devices,
                                      console)
    table = table or StrategyTable((*short, Bucket(args.context, static)), "default table")
    single = StrategyTable.single(static, args.context, METHODS["a"])
    tables = {"hot": table, "a": single, "b": single,
              "c": StrategyTable(tuple(Bucket(b.max_len, static) for b in table.buckets),
                                 METHODS["c"])}
    trainers = {m: build(t, data[m], args, config, optim, devices) for m, t in tables.items()}
    for m, trainer in trainers.items():
        console.print(f"{m}: {trainer.describe()}", markup=False)

    states = {m: trainers[m].init(0) for m in METHODS}
    records: dict[str, list[dict]] = {m: [] for m in METHODS}
    for step in range(total):
        for m in METHODS:  # interleaved, so that a busy moment of the machine hits all alike
            (states[m], metrics), seconds, cpu = timed(trainers[m].train_step, states[m],
                                                       data[m][step])
            records[m].append(metrics | {"seconds": seconds, "cpu_s": cpu})
            warm = " (warm-up)" if step < args.warmup else ""
            console.print(f"step {step + 1}/{total}{warm} {m}: {seconds:.2f} s ({cpu:.1f} CPU-s),"
                          f" loss {metrics['loss']:.5f}", markup=False)
    return {
        "machine": machine(devices),
        "model": {"preset": args.model, "params": config.num_params(),
                  "vocab_size": config.vocab_size, "compute_dtype": dtype},
        "corpus": corpus.source, "tokenizer": tokenizer.identity,
        **{k: getattr(args, k) for k in ("quick", "context", "batch_tokens", "device_memory",
                                         "warmup", "steps", "switch_method", "seed")},
        "static_strategy": str(static), "candidates": candidate_report,
        **summarize(records, trainers, args.warmup),
    }


def summarize(records: dict[str, list[dict]], trainers: dict[str, Trainer], warmup: int
              ) -> dict:
    """Per method: medians over the timed steps, padding and losses over all of them."""
    median = statistics.median
    methods = {}
    for m, steps in records.items():
        timed_steps, trainer = steps[warmup:], trainers[m]
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
            "switched_bytes": median(r["switched_bytes"] for r in timed_steps),
            "padding": 1 - sum(r["tokens"] for r in steps) / sum(r["slots"] for r in steps),
            "losses": [r["loss"] for r in steps],
            "steps": steps,
        }

    def ratios(key: str) -> dict[str, float]:
        v = {m: methods[m][key] for m in METHODS}
        return {"hot/a": v["hot"] / v["a"], "hot/b": v["hot"] / v["b"],
                "hot/c": v["hot"] / v["c"], "c/a": v["c"] / v["a"]}

    hot = methods["hot"]["losses"]
    return {"methods": methods, "ratios": ratios("tokens_per_s"),
            "ratios_cpu": ratios("tokens_per_cpu_s"),
            "max_loss_difference": max(abs(x - y) for m in METHODS
                                       for x, y in zip(methods[m]["losses"], hot, strict=True))}


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
    for column in ("method", "bucket: strategy (micro-batch rows)", "peak MiB", "pad %",
                   "step s", "CPU s", "switched MiB", "tokens/s", "tokens/CPU-s"):
        table.add_column(column, justify="left" if column[0] in "mb" else "right")
    for name, r in report["methods"].items():
        buckets = "\n".join(f"{b['max_len']}: {b['strategy']} ({b['micro_rows']})"
                            for b in r["buckets"])
        table.add_row(f"{name}: {r['description']}", escape(buckets),
                      f"{max(r['memory_bytes'].values()) / MiB:,.1f}",
                      f"{100 * r['padding']:.0f}", f"{r['step_s']:.2f}", f"{r['cpu_s']:.1f}",
                      f"{r['switched_bytes'] / MiB:.2f}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['tokens_per_cpu_s']:,.0f}")
    console.print(table)
    for key, what in (("ratios", "tokens/s"), ("ratios_cpu", "tokens/CPU-s")):
        console.print(f"ratios of real {what}: " + ", ".join(
            f"{k} = {v:.2f}" for k, v in report[key].items()), style="bold", highlight=False)
    candidates = ", ".join(f"{c['strategy']} ({c['status']})" for c in report["candidates"])
    console.print(f"(a): {report['static_strategy']}, of {candidates}. Largest loss difference "
                  f"between methods: {report['max_loss_difference']:.1e}. peak: XLA's "
                  f"per-device peak of the largest part (home state plus a bucket's micro-step). "
                  f"pad %: padding share of the token slots computed. switched MiB: weights "
                  f"into buckets and gradients home, summed over devices (switch method "
                  f"{report['switch_method']}).", markup=False, highlight=False)
    print_machine(m, console)
    if m["platform"] == "cpu":
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
    parser.add_argument("--device-memory", type=float, default=DEVICE_MEMORY_MIB, metavar="MiB",
                        help="per-device memory budget (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps first (default: %(default)s)")
    parser.add_argument("--table", help="a strategy table (TOML) for the hot run; default: "
                        + ", ".join(f"<= context/{n}: {s}" for n, s in SHORT_BUCKETS)
                        + ", <= context: the strategy of (a)")
    parser.add_argument("--candidates", default=CANDIDATES,
                        help="strategies for (a), separated by ';'")
    parser.add_argument("--strategy", help="use this strategy for (a) instead of choosing")
    parser.add_argument("--data", help="corpus (default: the Python standard library)")
    parser.add_argument("--tokenizer", help="tokenizer.json, a SentencePiece .model or 'bytes' "
                        "(default: a byte-level BPE trained on the corpus and cached)")
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"),
                        help="default: float32 on CPU, bfloat16 on accelerators")
    parser.add_argument("--switch-method", default="auto", choices=("auto", "plan", "device_put"))
    parser.add_argument("--seed", type=int, default=0, help="document order")
    args = parse_args(parser, argv, QUICK)

    progress = console(stderr=True, width=150)
    try:
        start_jax(8)
        report = run(args, progress)
    except UserError as e:
        print(f"bench_mixed: error: {e}", file=sys.stderr)
        return 2
    print_report(report, progress if args.json else console(stderr=False, width=150))
    if args.json:
        print(json.dumps(report, indent=1))
    return 0



if __name__ == "__main__":
    sys.exit(main())
