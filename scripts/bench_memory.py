"""Per-device memory of a training micro-step per (strategy, remat policy), compiled, not run.

    python scripts/bench_memory.py [--json] [--quick] [--model llama2-7b] [--rows 8]
                                   [--seq-len 4096] [--strategies "A; B"] [--policies none,full]
                                   [--accumulate local,sharded] [--home STRATEGY]
                                   [--device-memory 80GiB] [--target h100]

For each strategy and each remat policy (`hotjax.models.llama.REMAT_POLICIES`) the bucket's gradient
micro-step on a micro-step of `--rows` rows of `--seq-len` tokens is compiled ahead of time and
XLA's memory analysis read: its per-device peak (compute-dtype weights, the fp32 gradient
accumulator in the bucket's layout, the micro-batch and every temporary). Added to it are the
home's resident bytes (fp32 master weights, AdamW moments and the fp32 gradient sum) under the
same strategy, or under `--home` (a table's home, for one of its buckets), which stay on every
device while a bucket runs. `--accumulate`: the bucket's gradient sums as each data shard's
partial sum reduced once per bucket (`local`), or split over the data axes (`sharded`:
`hotjax.step`). The total is compared with `--device-memory` (80GiB: an A100/H100; a bare
number is MiB). Nothing is allocated or run, so the 7B model needs no accelerator: on a CPU-only
machine the step is compiled for 8 simulated devices, and the figures are XLA:CPU's plan (its
fusions and buffer reuse, the blockwise attention kernel). `--target h100` (a100, a800, or an
XLA target config file) compiles it for 8 of that GPU instead, still without one: XLA:GPU's plan
(its fusions, the Pallas attention kernel), compared with the GPU's memory unless
`--device-memory` says otherwise. Beside each peak: the cost model's prediction
(`hotjax.planning.memory.micro_step_memory` for the platform compiled for) and XLA's over it.
`--quick`: the `tiny` model on rows of 1024 tokens (a smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time
from typing import TYPE_CHECKING

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before JAX is imported, below

from quick_option import machine, parse_args, report  # beside this script

from hotjax.config import memory_size
from hotjax.errors import UserError

if TYPE_CHECKING:
    import jax
    from rich.console import Console

    from hotjax.models.llama import LlamaConfig
    from hotjax.sharding.strategy import Strategy

DEFAULT_STRATEGIES = "data=2,tensor=4; fsdp=8,rules=fsdp"
QUICK = {"model": "tiny", "rows": 8, "seq_len": 1024}
GiB, MiB = 2**30, 2**20
DEFAULT_DEVICE_MEMORY = 80 * GiB  # an A100's or H100's


def measure(config: LlamaConfig, strategy: Strategy, policy: str,
            devices: tuple[jax.Device, ...], shape: tuple[int, int],
            accumulate: str = "local") -> dict:
    """Compile seconds and XLA's per-device bytes of one micro-step, compiled and not run."""
    from hotjax.step import bucket_step, step_memory

    step = bucket_step(dataclasses.replace(config, remat=policy), strategy, devices, accumulate)
    started = time.perf_counter()
    compiled = step.compiled(shape)
    compile_s = time.perf_counter() - started
    memory = step_memory(compiled)
    return {"step_peak_bytes": memory["peak"], "step_args_bytes": memory["state"],
            "step_temp_bytes": memory["temp"], "compile_s": compile_s,
            "notes": list(step.notes)}


def run(args: argparse.Namespace, progress: Console) -> dict:
    import jax

    from hotjax import targets
    from hotjax.models.llama import REMAT_POLICIES, as_trained, preset
    from hotjax.optim import OptimConfig
    from hotjax.planning.memory import micro_step_memory
    from hotjax.sharding.strategy import ACCUMULATE, Strategy
    from hotjax.step import home

    if args.rows < 1 or args.seq_len < 1:
        raise UserError(f"--rows {args.rows} --seq-len {args.seq_len}: both must be positive")
    strategies = [Strategy.parse(text) for text in _split(args.strategies, ";")]
    policies = _split(args.policies, ",") if args.policies else list(REMAT_POLICIES)
    unknown = [p for p in policies if p not in REMAT_POLICIES]
    if unknown or not policies or not strategies:
        raise UserError(f"--policies {args.policies!r}: choose from {', '.join(REMAT_POLICIES)}"
                        if unknown or not policies else "--strategies: give at least one")
    modes = _split(args.accumulate, ",")
    if not modes or set(modes) - set(ACCUMULATE):
        raise UserError(f"--accumulate {args.accumulate!r}: choose from {', '.join(ACCUMULATE)}")
    target = args.compile_for
    here = tuple(jax.devices())  # the home's layout (its bytes are the same on any device)
    devices = here if target is None else tuple(targets.devices(target, len(here)))
    platform = devices[0].platform
    limit = (args.device_memory if args.device_memory is not None
             else target.memory if target is not None else DEFAULT_DEVICE_MEMORY)
    model = preset(args.model)
    # As training does: the vocabulary padded so that it splits over tensor-parallel ranks.
    config = as_trained(model)
    shape = (args.rows, args.seq_len)

    results = []
    total = len(strategies) * len(policies) * len(modes)
    homes = {}
    for strategy in strategies:
        home_strategy = Strategy.parse(args.home) if args.home else strategy
        if home_strategy not in homes:
            homes[home_strategy] = home(config, OptimConfig(), home_strategy,
                                        here).resident_bytes()
        resident = homes[home_strategy]
        for policy, accumulate in itertools.product(policies, modes):
            progress.print(f"[{len(results) + 1}/{total}] compiling {strategy}, remat {policy}, "
                           f"{accumulate} sums ({args.rows} x {args.seq_len} tokens)...",
                           markup=False, highlight=False)
            entry = {"strategy": str(strategy), "remat": policy, "accumulate": accumulate,
                     "home": str(home_strategy),
                     **measure(config, strategy, policy, devices, shape, accumulate),
                     "resident_bytes": resident}
            entry["total_bytes"] = entry["step_peak_bytes"] + resident
            entry["fits"] = entry["total_bytes"] <= limit
            entry["predicted_peak_bytes"] = micro_step_memory(
                dataclasses.replace(config, remat=policy), strategy, shape, platform,
                accumulate).peak
            entry["xla_over_predicted"] = entry["step_peak_bytes"] / entry["predicted_peak_bytes"]
            results.append(entry)
            progress.print(f"    compiled in {entry['compile_s']:.1f} s: step peak "
                           f"{_size(entry['step_peak_bytes'])} + resident {_size(resident)} = "
                           f"{_size(entry['total_bytes'])} per device", markup=False,
                           highlight=False)
    return {
        "machine": machine(devices),
        "compile_only": True,
        "model": {"preset": args.model, "params": config.num_params(),
                  "vocab_size": config.vocab_size, "compute_dtype": config.compute_dtype,
                  "attention": config.attention},
        "rows": args.rows, "seq_len": args.seq_len,
        "target": None if target is None else {"name": target.name, "device": target.description,
                                               "memory_bytes": target.memory},
        "device_memory_gib": limit / GiB,
        "results": results,
    }


def print_table(report: dict, console: Console) -> None:
    from rich.markup import escape
    from rich.table import Table

    m, model = report["machine"], report["model"]
    limit = report["device_memory_gib"]
    # GiB for real models; MiB where every figure would round to 0.00 GiB (--quick).
    big = max((r["total_bytes"] for r in report["results"]), default=0) >= GiB
    unit, scale = ("GiB", GiB) if big else ("MiB", MiB)
    table = Table(title=f"per-device memory of one micro-step of {model['preset']} "
                        f"({model['params'] / 1e9:.2f}B params, {model['compute_dtype']}), "
                        f"{report['rows']} rows x {report['seq_len']} tokens, compiled not run",
                  title_justify="left")
    for column in ("strategy", "remat", "sums", "compile s", f"step peak {unit}",
                   f"predicted {unit}", "XLA / predicted", f"resident {unit}", f"total {unit}",
                   f"fits {limit:.4g} GiB"):
        table.add_column(column, justify="left" if column in ("strategy", "remat", "sums")
                         else "right")
    for r in report["results"]:
        table.add_row(escape(r["strategy"]), r["remat"], r["accumulate"], f"{r['compile_s']:.1f}",
                      f"{r['step_peak_bytes'] / scale:.2f}",
                      f"{r['predicted_peak_bytes'] / scale:.2f}", f"{r['xla_over_predicted']:.2f}",
                      f"{r['resident_bytes'] / scale:.2f}",
                      f"{r['total_bytes'] / scale:.2f}", "yes" if r["fits"] else "[red]no[/]")
    console.print(table)
    console.print("step peak: XLA's planned peak of the micro-step (compute-dtype weights, fp32 "
                  "gradient accumulator, micro-batch, temporaries); predicted: the cost model's "
                  "(hotjax.planning.cost) for the same platform; sums: the gradient sums "
                  "(local: each data shard's, reduced once per bucket; sharded: split over the "
                  "data axes); resident: the home's fp32 "
                  "weights, AdamW moments and gradient sum; total = step peak + resident.")
    where = ("on this machine without one" if report["target"] else
             "an accelerator's XLA plans the same program with its own fusions and kernels")
    console.print(f"compile-only: nothing was allocated or run. Compiled by "
                  f"XLA:{m['platform'].upper()} for {m['devices']} {m['device_kind']} devices "
                  f"({m['cpus']} CPUs, {m['processor']}, python {m['python']}, jax {m['jax']}); "
                  f"{where}.", markup=False, highlight=False)


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def _split(text: str, sep: str) -> list[str]:
    return [part.strip() for part in text.split(sep) if part.strip()]



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama2-7b", help="model preset (default: "
                        "%(default)s, in its compute dtype); its vocabulary is padded to a "
                        "multiple of 128")
    parser.add_argument("--rows", type=int, default=8, help="rows per micro-step")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per row")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                        help="strategies separated by ';', each like 'data=2,tensor=4,rules=NAME' "
                        "(default: %(default)s)")
    parser.add_argument("--policies", help="remat policies, comma-separated (default: every "
                        "one of hotjax.models.llama.REMAT_POLICIES)")
    parser.add_argument("--accumulate", default="local", help="gradient sums, comma-separated: "
                        "local (per data shard, reduced once per bucket), sharded (split over "
                        "the data axes) (default: %(default)s)")
    parser.add_argument("--home", help="the home strategy whose resident state is added "
                        "(default: each strategy's own)")
    parser.add_argument("--device-memory", type=memory_size, metavar="SIZE",
                        help="memory per device that the total is compared with, like 80GiB "
                        "(a bare number is MiB; default: the --target's, else 80GiB)")
    parser.add_argument("--target", metavar="GPU|FILE", help="compile for 8 of this GPU "
                        "without one (h100, a100, a800, or an XLA target config file): "
                        "XLA:GPU's memory instead of this machine's XLA's")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document to stdout (the table goes to stderr)")
    args = parse_args(parser, argv, QUICK)
    from hotjax import targets

    try:
        args.compile_for = targets.prepare(args.target)  # before JAX starts: it runs on the CPU
    except UserError as e:
        print(f"bench_memory: error: {e}", file=sys.stderr)
        return 2
    return report("bench_memory", args, run, print_table)


if __name__ == "__main__":
    sys.exit(main())
