"""Step time and XLA-reported per-device memory of each strategy, at two sequence lengths.

    python scripts/bench_strategies.py [--json] [--quick] [--seq-lens 512,2048]
                                       [--strategies "A; B"] [--processes N]

Each (strategy, sequence length) trains the same synthetic packed mini-batch (random tokens, a
few documents per row) as a one-bucket `hotjax.Run` whose one micro-step holds every row: the
micro-step is compiled ahead of time, XLA's memory analysis read, then one warm-up step and
`--steps` timed ones. A strategy that cannot run a shape (sizes that do not divide, a mesh of the
wrong device count) is reported, not fatal. `--quick`: the `tiny` model, 512-token mini-batches
of short rows, three strategies (data, context and pipeline parallel), one timed step (a smoke
test). On simulated CPU devices the timings say nothing about a GPU cluster: 8 fake devices
share the machine's cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from quick_option import (  # beside this script
    add_processes_option,
    machine,
    parse_args,
    print_machine,
    report,
)

from hotjax.errors import UserError

if TYPE_CHECKING:
    import jax
    from rich.console import Console

    from hotjax.data import Batch
    from hotjax.models.llama import LlamaConfig
    from hotjax.optim import OptimConfig
    from hotjax.sharding.strategy import Strategy

DEFAULT_STRATEGIES = "; ".join((
    "data=8,rules=dp", "fsdp=8,rules=zero1", "fsdp=8,rules=zero2", "fsdp=8,rules=fsdp",
    "context=8,rules=context", "tensor=8,rules=megatron", "tensor=8,rules=megatron-sp",
    "data=2,tensor=4,rules=megatron-sp", "fsdp=2,context=4,rules=context", "data=2,fsdp=2,tensor=2",
    "stage=2,data=4", "stage=4,tensor=2", "stage=2,data=2,tensor=2,microbatches=8",
))
DOCS_PER_ROW = 3
MiB = 2**20
# Recorded by JAX for each program looked up in the persistent compilation cache.
CACHE_MISS = "/jax/compilation_cache/cache_misses"
TRACED_STEPS = 2  # bench_one's steps under the profiler, after the timed ones
HOST_MEMORY_SHARE = 0.8  # of the host's available memory that simulated devices may plan to use
QUICK = {"model": "tiny", "seq_lens": "64,128", "batch_tokens": 512, "steps": 1,
         "strategies": "data=8,rules=dp; fsdp=2,context=4,rules=context; stage=2,data=4"}


def synthetic_batch(rows: int, seq_len: int, vocab_size: int, seed: int = 0) -> Batch:
    """Random tokens packed `DOCS_PER_ROW` documents to a row, each row ending in up to
    seq_len/16 padding tokens, as the data pipeline would hand them over."""
    from hotjax.data import Batch

    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab_size, size=(rows, seq_len), dtype=np.int32)
    segments = np.zeros((rows, seq_len), np.int32)
    positions = np.zeros((rows, seq_len), np.int32)
    for r in range(rows):
        end = seq_len - int(rng.integers(0, seq_len // 16 + 1))
        cuts = np.sort(rng.choice(np.arange(1, end), size=min(DOCS_PER_ROW, end) - 1,
                                  replace=False))
        for segment, (a, b) in enumerate(pairwise([0, *cuts, end]), start=1):
            segments[r, a:b], positions[r, a:b] = segment, np.arange(b - a)
    tokens[segments == 0] = 0
    return Batch(tokens, segments, positions)


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def bench_one(config: LlamaConfig, optim: OptimConfig, strategy: Strategy, batch: Batch,
              devices: tuple[jax.Device, ...], steps: int, cache_misses: list[str],
              micro_rows: int | None = None, trace_dir: str | None = None) -> dict:
    """Compile seconds, XLA memory and median step seconds of one strategy on one batch, in
    micro-steps of `micro_rows` rows (None: one micro-step holding every row). With
    `trace_dir`, two more steps after the timed ones run under JAX's profiler, its trace
    written there (the timed steps pay nothing for it).

    Simulated CPU devices share the host's memory: a step whose planned peak would exhaust it
    is compiled and measured by XLA, but not run.
    """
    import itertools

    import jax

    from hotjax.data import MiniBatch
    from hotjax.run import Run
    from hotjax.sharding.table import Bucket, StrategyTable
    from hotjax.step import bucket_step, step_memory

    rows, seq_len = batch.tokens.shape
    shards = bucket_step(config, strategy, devices).layout.batch_shards
    # Rows per micro-step, padded to split evenly (all rows by default).
    micro_rows = -(-(micro_rows or rows) // shards) * shards
    micro_steps = -(-rows // micro_rows)
    # The config's remat policy named in the table: the trainer takes a bucket's from there.
    table = StrategyTable((Bucket(seq_len, strategy, micro_rows, config.remat),), str(strategy))
    run = Run(config, table, optim, itertools.repeat(MiniBatch((batch,))), devices=devices)
    misses_before = len(cache_misses)
    started = time.perf_counter()
    run.compile()
    trainer = run.trainer
    step = step_memory(trainer.buckets[0].compiled((micro_rows, seq_len)))
    resident = trainer.home.resident_bytes()
    result = {"rows_run": micro_rows * micro_steps, "micro_rows": micro_rows,
              "micro_steps": micro_steps, "compile_s": time.perf_counter() - started,
              "compile_cached": (jax.config.jax_enable_compilation_cache
                                 and len(cache_misses) == misses_before),
              "notes": list(trainer.notes),
              "memory_bytes": {"resident": resident, "step": step["peak"],
                               "temp": step["temp"], "peak": resident + step["peak"]}}
    host_need, available = len(devices) * result["memory_bytes"]["peak"], host_available_bytes()
    if (devices[0].platform == "cpu" and available is not None
            and host_need > HOST_MEMORY_SHARE * available):
        return result | {"status": "too big for host", "error": (
            f"{len(devices)} simulated devices would need {host_need / 2**30:.1f} GiB of host "
            f"memory; {available / 2**30:.1f} GiB is available: compiled, not run")}
    state = run.init(seed=0)
    times = []
    for _ in range(steps + 1):  # the first is the warm-up
        started = time.perf_counter()
        state, metrics = run.step(state)
        jax.block_until_ready((state, metrics.device))
        times.append(time.perf_counter() - started)
    step_s = statistics.median(times[1:])
    if trace_dir is not None:
        with jax.profiler.trace(trace_dir):
            for _ in range(TRACED_STEPS):
                state, metrics = run.step(state)
            jax.block_until_ready((state, metrics.device))
    return result | {"status": "ok", "warmup_s": times[0], "step_s": step_s,
                     "step_s_each": times[1:], "loss": float(metrics["loss"]),
                     "tokens_per_s": batch.real_tokens / step_s}


def run(args: argparse.Namespace, console: Console) -> dict:
    import jax

    from hotjax.models.llama import as_trained, preset
    from hotjax.optim import OptimConfig
    from hotjax.sharding.strategy import Strategy
    from hotjax.startup import select_devices

    strategies = [Strategy.parse(text) for text in _split(args.strategies, ";")]
    seq_lens = [_positive(text, "--seq-lens") for text in _split(args.seq_lens, ",")]
    too_long = [n for n in seq_lens if n > args.batch_tokens]
    if too_long:
        raise UserError(f"--seq-lens {too_long[0]} is longer than --batch-tokens "
                        f"{args.batch_tokens}: a mini-batch holds at least one row")
    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: time at least one step")
    if args.micro_rows is not None and args.micro_rows < 1:
        raise UserError(f"--micro-rows {args.micro_rows}: pass a positive number of rows")
    devices = tuple(select_devices(args.devices))
    on_cpu = devices[0].platform == "cpu"
    dtype = args.compute_dtype or ("float32" if on_cpu else "bfloat16")
    model = preset(args.model)
    config = as_trained(model, compute_dtype=dtype)
    # One optimizer schedule for all, long enough that no timed step is at a schedule edge.
    optim = OptimConfig(warmup_steps=1, total_steps=args.steps + 2)
    cache_misses: list[str] = []
    jax.monitoring.register_event_listener(
        lambda event, **_: cache_misses.append(event) if event == CACHE_MISS else None)

    results = []
    total = len(strategies) * len(seq_lens)
    for strategy in strategies:
        for seq_len in seq_lens:
            batch = synthetic_batch(args.batch_tokens // seq_len, seq_len, model.vocab_size)
            entry = {"strategy": str(strategy), "seq_len": seq_len,
                     "rows": batch.tokens.shape[0], "real_tokens": batch.real_tokens,
                     "notes": []}
            try:
                entry |= bench_one(config, optim, strategy, batch, devices, args.steps,
                                   cache_misses, args.micro_rows)
            except UserError as e:
                entry |= {"status": "does not fit", "error": str(e)}
            except Exception as e:  # an XLA failure (out of memory...): report it, go on
                entry |= {"status": "failed", "error": f"{type(e).__name__}: {e}"}
            results.append(entry)
            console.print(f"[{len(results)}/{total}] {_progress(entry)}", markup=False,
                          highlight=False)
    return {
        "machine": machine(devices),
        "model": {"preset": args.model, "params": config.num_params(),
                  "vocab_size": config.vocab_size, "compute_dtype": dtype},
        "batch_tokens": args.batch_tokens, "steps": args.steps,
        # One process's several CPU devices share its cores; `--processes` pins one per core.
        "simulated": on_cpu and len(devices) > jax.process_count(),
        "results": results,
    }


def _progress(entry: dict) -> str:
    parts = []
    if "compile_s" in entry:
        parts.append(f"compile {entry['compile_s']:.1f} s"
                     + (" (from cache)" if entry["compile_cached"] else ""))
        parts.append(f"peak {entry['memory_bytes']['peak'] / MiB:,.0f} MiB/device")
    if entry["status"] == "ok":
        parts.append(f"step {entry['step_s']:.2f} s")
    else:
        parts.append(f"{entry['status']}: {entry['error']}")
    return f"{entry['strategy']} @ {entry['seq_len']}: " + ", ".join(parts)


def print_table(report: dict, console: Console) -> None:
    from rich.markup import escape
    from rich.table import Table

    m, model = report["machine"], report["model"]
    table = Table(title=f"strategies on {model['preset']} ({model['params'] / 1e6:.1f}M params, "
                        f"{model['compute_dtype']}), {report['batch_tokens']:,} tokens per step",
                  title_justify="left")
    for column in ("strategy", "seq", "rows", "micro-steps", "compile s", "resident MiB",
                   "step MiB", "peak MiB", "step s", "tokens/s"):
        table.add_column(column, justify="left" if column == "strategy" else "right",
                         no_wrap=column == "strategy")
    errors: list[str] = []  # footnotes, each message once
    for seq_len in sorted({r["seq_len"] for r in report["results"]}):
        for r in (r for r in report["results"] if r["seq_len"] == seq_len):
            cells = ["-"] * 6
            if "compile_s" in r:
                cells[:4] = [f"{r['compile_s']:.1f}" + ("*" if r["compile_cached"] else ""),
                             *(f"{r['memory_bytes'][k] / MiB:,.1f}"
                               for k in ("resident", "step", "peak"))]
            if r["status"] == "ok":
                cells[4:] = [f"{r['step_s']:.2f}", f"{r['tokens_per_s']:,.0f}"]
            else:
                message = f"{r['status']}: {r['error']}"
                if message not in errors:
                    errors.append(message)
                cells[5] = f"[red]({errors.index(message) + 1})[/]"
            rows = f"{r['rows']}" + (f"→{r['rows_run']}" if r.get("rows_run", r["rows"])
                                     != r["rows"] else "")
            micro = (f"{r['micro_steps']} x {r['micro_rows']}" if "micro_steps" in r else "-")
            table.add_row(escape(r["strategy"]), str(seq_len), rows, micro, *cells)
        table.add_section()
    console.print(table)
    print_machine(m, console)
    console.print(f"memory: per device (XLA's memory analysis). resident: the home strategy's "
                  f"fp32 params, Adam moments and gradient sum; step: the compiled micro-step's "
                  f"peak (compute weights, accumulator, batch, temporaries); peak: both. step s: "
                  f"median of "
                  f"{report['steps']} after a warm-up; tokens/s counts real (non-padding) tokens; "
                  f"rows a→b: padded with empty rows to split evenly; micro-steps: how many x "
                  f"their rows (a pipeline runs them in one 1F1B schedule). * compile loaded "
                  f"from the persistent cache.", highlight=False)
    for i, error in enumerate(errors, 1):
        console.print(f"({i}) {error}", markup=False, highlight=False)
    for note in sorted({n for r in report["results"] for n in r["notes"]}):
        console.print(f"note: {note}", markup=False, highlight=False)
    if report["simulated"]:
        console.print("[yellow]simulated CPU devices:[/] they share the machine's cores, so these "
                      "timings compare strategies on this machine only and do not model a GPU "
                      "cluster; the memory figures are per device as XLA plans them.")


def _split(text: str, sep: str) -> list[str]:
    return [part.strip() for part in text.split(sep) if part.strip()]


def _positive(text: str, flag: str) -> int:
    if not text.isdecimal() or int(text) < 1:
        raise UserError(f"{flag}: {text!r} is not a positive integer")
    return int(text)



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="model preset (default: %(default)s); "
                        "its vocabulary is padded to a multiple of 128")
    parser.add_argument("--seq-lens", default="512,2048", help="row lengths, comma-separated")
    # 4096 keeps a default run of `small` within minutes on 2 cores; 16384 gives every strategy
    # at least one 2048-token row per device.
    parser.add_argument("--batch-tokens", type=int, default=4096,
                        help="tokens per mini-batch: rows = batch tokens / row length "
                        "(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--micro-rows", type=int, help="rows per micro-step (default: every "
                        "row in one micro-step); a pipeline runs a bucket's micro-steps in one "
                        "1F1B schedule")
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"),
                        help="default: float32 on CPU, bfloat16 on accelerators")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                        help="strategies separated by ';', each like 'data=2,tensor=4,rules=NAME'")
    parser.add_argument("--devices", type=int, help="use N devices; on CPU, N simulated ones "
                        "(default: 8 simulated CPUs, or all accelerators)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document to stdout (the table goes to stderr)")
    add_processes_option(parser)
    args = parse_args(parser, argv, QUICK)

    return report("bench_strategies", args, run, print_table, args.devices,
                  lambda found: 1 if any(r["status"] == "failed" for r in found["results"])
                  else 0)

if __name__ == "__main__":
    sys.exit(main())
