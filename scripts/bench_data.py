"""Is the data pipeline ever the bottleneck? Its tokens/s on the stdlib corpus, beside the
trainer's tokens/s on the same machine (the `small` preset, data parallel).

    python scripts/bench_data.py [--json] [--quick] [--tokenizer bytes]

On a CPU-only machine the trainer runs on 8 simulated devices. Tokens are real (non-padding)
tokens delivered to, or trained on by, a step; the pipeline must keep >= 10x ahead (the exit
status says whether it does). `--quick`: the `tiny` model, short rows, few mini-batches, the
byte tokenizer (a smoke test: the tiny trainer is fast, so its ratio is no verdict).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from hotjax.data import MiniBatch

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before JAX is imported, below

from quick_option import parse_args  # beside this script

from hotjax.commands.options import add_options

REQUIRED_RATIO = 10
QUICK = {"model": "tiny", "context": 128, "batch_tokens": 2048, "batches": 10, "steps": 2,
         "tokenizer": "bytes"}


def bench_pipeline(make: Callable[[], Iterator], batches: int) -> dict:
    """Real tokens/s of `batches` mini-batches, after the first (which starts the readers)."""
    started = time.perf_counter()
    stream = make()
    next(stream)
    first = time.perf_counter() - started
    started, tokens = time.perf_counter(), 0
    for _ in range(batches):
        tokens += next(stream).real_tokens
    seconds = time.perf_counter() - started
    return {"startup_s": first, "batches": batches, "real_tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds}


def bench_trainer(minibatches: list[MiniBatch], vocab_size: int, model: str, steps: int) -> dict:
    """Real tokens/s of `steps` steps of a `hotjax.Run` on one-bucket mini-batches, after one that
    compiles."""
    import jax

    from hotjax.compile_cache import enable_compilation_cache
    from hotjax.models.llama import as_trained, preset
    from hotjax.optim import OptimConfig
    from hotjax.run import Run
    from hotjax.sharding.strategy import Strategy
    from hotjax.sharding.table import StrategyTable

    enable_compilation_cache()
    devices = jax.devices()
    config = as_trained(preset(model), vocab_size)
    strategy = Strategy.parse(f"data={len(devices)}")
    table = StrategyTable.single(strategy, minibatches[0].max_lens[-1], "bench_data")
    run = Run(config, table, OptimConfig(total_steps=steps + 1), minibatches, devices=devices)
    state = run.init(0)
    started = time.perf_counter()
    state, metrics = run.step(state)  # compiles
    float(metrics["loss"])
    compile_s = time.perf_counter() - started
    started = time.perf_counter()
    for _ in minibatches[1:]:
        state, metrics = run.step(state)
    float(metrics["loss"])  # waits for the last step
    seconds = time.perf_counter() - started
    tokens = sum(b.real_tokens for b in minibatches[1:])
    return {"model": model, "params": config.num_params(), "compute_dtype": config.compute_dtype,
            "strategy": str(strategy), "devices": f"{len(devices)} {devices[0].platform}",
            "device_kind": devices[0].device_kind, "micro_rows": run.trainer.micro_rows[0],
            "first_step_s": compile_s, "steps": steps, "real_tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document to stdout (the table goes to stderr)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--batches", type=int, default=40, help="pipeline mini-batches timed")
    parser.add_argument("--steps", type=int, default=3, help="trainer steps timed after compile")
    parser.add_argument("--model", default="small")
    add_options(parser, "tokenizer")  # as hotjax train's
    args = parse_args(parser, argv, QUICK)

    from hotjax.data import MiniBatches, load_tokenizer, open_corpus

    corpus = open_corpus("stdlib")
    tokenizer = load_tokenizer(args.tokenizer, corpus)
    ctx, budget = args.context, args.batch_tokens
    buckets = (ctx // 4, ctx // 2, ctx)
    pipelines = {
        f"one bucket of {ctx}": lambda: MiniBatches(corpus, tokenizer, [ctx],
                                                    batch_tokens=budget),
        f"buckets {'/'.join(map(str, buckets))}": lambda: MiniBatches(
            corpus, tokenizer, buckets, batch_tokens=budget),
    }
    results = {name: bench_pipeline(make, args.batches) for name, make in pipelines.items()}
    single = MiniBatches(corpus, tokenizer, [ctx], batch_tokens=budget)
    trainer = bench_trainer([next(single) for _ in range(args.steps + 1)],
                            tokenizer.vocab_size, args.model, args.steps)
    slowest = min(r["tokens_per_s"] for r in results.values())
    report = {
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version()},
        "corpus": {"source": corpus.source, "documents": corpus.num_documents,
                   "tokenizer": tokenizer.identity},
        "context": ctx, "batch_tokens": budget,
        "pipeline": results,
        "trainer": trainer,
        "ratio": slowest / trainer["tokens_per_s"],
        "required_ratio": REQUIRED_RATIO, "quick": args.quick,
    }
    from rich.console import Console

    # With --json the table goes to stderr; into a file or a pipe, rich would wrap it at 80.
    _print(report, Console(stderr=args.json, width=150))
    if args.json:
        print(json.dumps(report, indent=1))
    return 0 if args.quick or report["ratio"] >= REQUIRED_RATIO else 1


def _print(report: dict, console: Console) -> None:
    from rich.table import Table

    t = report["trainer"]
    table = Table(title=f"data pipeline vs trainer on {report['corpus']['source']} "
                        f"({report['machine']['cpus']} CPUs, trainer on {t['devices']} devices)")
    for column in ("", "real tokens/s", "x trainer", "notes"):
        table.add_column(column, justify="left" if column in ("", "notes") else "right")
    for name, r in report["pipeline"].items():
        table.add_row(f"pipeline: {name}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['tokens_per_s'] / t['tokens_per_s']:,.1f}",
                      f"{r['batches']} mini-batches of {report['batch_tokens']:,} tokens; "
                      f"first in {r['startup_s']:.2f} s")
    table.add_row(f"trainer: {t['model']} ({t['params'] / 1e6:.1f}M), {t['strategy']}",
                  f"{t['tokens_per_s']:,.0f}", "1.0",
                  f"{t['steps']} steps after a {t['first_step_s']:.1f} s first step "
                  f"({t['compute_dtype']}, micro-steps of {t['micro_rows']} x "
                  f"{report['context']})")
    console.print(table)
    verdict = ("no verdict (--quick)" if report["quick"]
               else "ok" if report["ratio"] >= report["required_ratio"] else "TOO SLOW")
    console.print(f"slowest pipeline / trainer = {report['ratio']:,.1f}x "
                  f"(needs >= {report['required_ratio']}x): {verdict}")
    m = report["machine"]
    console.print(f"hardware: {m['cpus']} CPUs, {m['processor']}, python {m['python']}; trainer "
                  f"on {t['devices']} device(s) ({t['device_kind']})", highlight=False)


if __name__ == "__main__":
    sys.exit(main())
