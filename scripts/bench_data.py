"""Is the data pipeline ever the bottleneck? Its tokens/s on the stdlib corpus, beside the
trainer's tokens/s on the same machine (the `small` preset, data parallel).

    python scripts/bench_data.py [--json]

On a CPU-only machine the trainer runs on 8 simulated devices. Tokens are real (non-padding)
tokens delivered to, or trained on by, a step; the pipeline must keep >= 10x ahead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before JAX is imported, below
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REQUIRED_RATIO = 10


def bench_pipeline(make, batches: int) -> dict:
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


def bench_trainer(batches: list, vocab_size: int, model: str, steps: int) -> dict:
    import jax

    from hotjax.compile_cache import enable_compilation_cache
    from hotjax.optim import OptimConfig
    from hotjax.train import get_trainer
    from models.llama import preset
    from sharding.strategy import Strategy

    enable_compilation_cache()
    devices = tuple(jax.devices())
    config = dataclasses.replace(preset(model), vocab_size=vocab_size)
    strategy = Strategy.parse(f"data={len(devices)}")
    trainer = get_trainer(config, OptimConfig(total_steps=steps + 1), strategy, devices)
    state = trainer.init(0)
    arrays = [trainer.batch_arrays(b) for b in batches[: steps + 1]]
    started = time.perf_counter()
    state, metrics = trainer.step(state, arrays[0])  # compiles (or loads the cached program)
    float(metrics["loss"])
    compile_s = time.perf_counter() - started
    started = time.perf_counter()
    for batch in arrays[1:]:
        state, metrics = trainer.step(state, batch)
    float(metrics["loss"])  # waits for the last step
    seconds = time.perf_counter() - started
    tokens = sum(b.real_tokens for b in batches[1 : steps + 1])
    return {"model": model, "params": config.num_params(), "compute_dtype": config.compute_dtype,
            "strategy": str(strategy), "devices": f"{len(devices)} {devices[0].platform}",
            "first_step_s": compile_s, "steps": steps, "real_tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--batches", type=int, default=40, help="pipeline mini-batches timed")
    parser.add_argument("--steps", type=int, default=3, help="trainer steps timed after compile")
    parser.add_argument("--model", default="small")
    args = parser.parse_args()

    from hotjax.data import BucketedBatches, PackedBatches, load_tokenizer, open_corpus

    corpus = open_corpus("stdlib")
    tokenizer = load_tokenizer(None, corpus)
    ctx, budget = args.context, args.batch_tokens
    buckets = (ctx // 4, ctx // 2, ctx)
    pipelines = {
        f"one bucket of {ctx}": lambda: PackedBatches(corpus, tokenizer, ctx, budget, seed=0),
        f"buckets {'/'.join(map(str, buckets))}": lambda: BucketedBatches(
            corpus, tokenizer, buckets, batch_tokens=budget, seed=0),
    }
    results = {name: bench_pipeline(make, args.batches) for name, make in pipelines.items()}
    single = PackedBatches(corpus, tokenizer, ctx, budget, seed=0)
    trainer = bench_trainer([next(single) for _ in range(args.steps + 1)],
                            tokenizer.vocab_size, args.model, args.steps)
    slowest = min(r["tokens_per_s"] for r in results.values())
    report = {
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version()},
        "corpus": {"source": corpus.source, "documents": corpus.num_documents,
                   "tokenizer": tokenizer.identity},
        "batch_tokens": budget,
        "pipeline": results,
        "trainer": trainer,
        "ratio": slowest / trainer["tokens_per_s"],
        "required_ratio": REQUIRED_RATIO,
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print(report)
    return 0 if report["ratio"] >= REQUIRED_RATIO else 1


def _print(report: dict) -> None:
    from rich.console import Console
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
                  f"({t['compute_dtype']})")
    Console().print(table)
    verdict = "ok" if report["ratio"] >= report["required_ratio"] else "TOO SLOW"
    Console().print(f"slowest pipeline / trainer = {report['ratio']:,.1f}x "
                    f"(needs >= {report['required_ratio']}x): {verdict}")


if __name__ == "__main__":
    sys.exit(main())
