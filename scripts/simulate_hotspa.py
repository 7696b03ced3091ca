"""The HotSPa paper's settings by simulation: predicted step times on its cluster profile of
(i) `hotjax plan`'s table, (ii) the paper's hand-picked tables (both bucket combinations), (iii)
the best single strategy with document-masked packing, (iv) that strategy on concatenated
sequences without masking and (v) on one sequence per row padded to the context, as the paper's
Megatron-LM baseline runs them.

    python scripts/simulate_hotspa.py [--json] [--quick] [--lengths STATS.json]
                                      [--profile a800-4x8]
                                      [--models llama2-7b,llama2-13b,hotspa-32b]
                                      [--devices 8,16,32] [--contexts 16384,...,131072]

Nothing runs on devices: every number is the cost model's (`hotjax.planning.cost`) for the profile,
on a typical step of 512 sequences drawn from `--lengths` (the bundled code corpus by default:
the Python standard library under the default 8k BPE, saved by `hotjax data stats --json`),
each document one sequence truncated to the context, as in the paper. The paper trains its 32B
on 32 GPUs only, and so does this (`MIN_DEVICES`). Plans fill what JAX's allocator hands a
process (`hotjax.planning.profile.ALLOCATOR_FRACTION` of each GPU). `--quick`: 7B on 8 devices at
16K, a step of 128 sequences (a smoke test; the search takes longer the more a step holds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from quick_option import console, parse_args  # beside this script

LENGTHS = Path(__file__).resolve().parents[1] / "docs" / "stdlib-lengths.json"
QUICK = {"models": "llama2-7b", "devices": "8", "contexts": "16384", "batch_sequences": 128}
K = 1024
# The paper's hand-picked tables: <DP, TP, PP> per bucket from the shortest bucket up, by
# (model, devices, context) and bucket combination (c1: 4K and 16K boundaries at 32K context,
# 4K at 16K; c2 adds 8K). ZeRO shards the optimizer state whenever DP > 1.
PAPER = {
    ("llama2-7b", 8, 32 * K): {
        "c1": [(4 * K, (8, 1, 1)), (16 * K, (2, 2, 2)), (32 * K, (1, 4, 2))],
        "c2": [(4 * K, (8, 1, 1)), (8 * K, (4, 2, 1)), (16 * K, (2, 2, 2)), (32 * K, (1, 4, 2))]},
    ("llama2-7b", 8, 16 * K): {
        "c1": [(4 * K, (8, 1, 1)), (16 * K, (2, 2, 2))],
        "c2": [(4 * K, (8, 1, 1)), (8 * K, (4, 2, 1)), (16 * K, (2, 2, 2))]},
    ("llama2-7b", 16, 32 * K): {
        "c1": [(4 * K, (16, 1, 1)), (16 * K, (4, 4, 1)), (32 * K, (2, 4, 2))],
        "c2": [(4 * K, (16, 1, 1)), (8 * K, (8, 2, 1)), (16 * K, (4, 4, 1)),
               (32 * K, (2, 4, 2))]},
    ("llama2-7b", 16, 16 * K): {
        "c1": [(4 * K, (16, 1, 1)), (16 * K, (4, 4, 1))],
        "c2": [(4 * K, (16, 1, 1)), (8 * K, (8, 2, 1)), (16 * K, (4, 4, 1))]},
    ("llama2-13b", 8, 32 * K): {
        "c1": [(4 * K, (4, 2, 1)), (16 * K, (1, 4, 2)), (32 * K, (1, 8, 1))],
        "c2": [(4 * K, (4, 2, 1)), (8 * K, (2, 2, 2)), (16 * K, (1, 4, 2)), (32 * K, (1, 8, 1))]},
    ("llama2-13b", 8, 16 * K): {
        "c1": [(4 * K, (4, 2, 1)), (16 * K, (1, 4, 2))],
        "c2": [(4 * K, (4, 2, 1)), (8 * K, (2, 2, 2)), (16 * K, (1, 4, 2))]},
    ("llama2-13b", 16, 32 * K): {
        "c1": [(4 * K, (8, 2, 1)), (16 * K, (4, 4, 1)), (32 * K, (2, 8, 1))],
        "c2": [(4 * K, (8, 2, 1)), (8 * K, (4, 2, 2)), (16 * K, (4, 4, 1)), (32 * K, (2, 8, 1))]},
    ("llama2-13b", 16, 16 * K): {
        "c1": [(4 * K, (8, 2, 1)), (16 * K, (4, 4, 1))],
        "c2": [(4 * K, (8, 2, 1)), (8 * K, (4, 2, 2)), (16 * K, (4, 4, 1))]},
}
# The paper's 32B (`hotspa-32b`) runs on 32 GPUs only (SOSP'24 §7).
MIN_DEVICES = {"hotspa-32b": 32}
COLUMNS = ("plan", "paper c1", "paper c2", "static, masked", "static, no masking",
           "static, padded")


def paper_strategy(dp: int, tp: int, pp: int):
    """<DP, TP, PP> as a hotjax strategy: Megatron tensor parallelism, 1F1B pipeline stages."""
    from hotjax.sharding.strategy import Strategy

    mesh = {"stage": pp, "data": dp, "tensor": tp}
    return Strategy.create({a: n for a, n in mesh.items() if n > 1} or {"data": 1},
                           "megatron" if tp > 1 else "dp")


def simulate(model: str, devices: int, context: int, documents, profile, batch: int) -> dict:
    from hotjax.data.buckets import cut
    from hotjax.models.llama import preset
    from hotjax.planning import search as plan
    from hotjax.sharding.strategy import fit_to_model

    config = preset(model)
    lengths = plan.typical_batch(cut(documents, context, "truncate"), batch)
    started = time.perf_counter()
    search = plan.Search(config, profile, devices, profile.memory_bytes)
    found = plan.plan(search, lengths, context)
    plan_s = time.perf_counter() - started
    static = plan.baselines(search, lengths, context)
    best = next(iter(static.values()), None)
    results = {"plan": found, "static, masked": best,
               "static, no masking": static.get(
                   "the same, concatenated without masking (Megatron-LM)")}
    if best is not None:
        results["static, padded"] = plan.fixed_table(
            search, lengths, [(context, best.buckets[0].strategy)], masked=False,
            packed=False, padded=True)
    for name, table in PAPER.get((model, devices, context), {}).items():
        strategies = [(high, fit_to_model(paper_strategy(*sizes), config)[0])
                      for high, sizes in table]
        results[f"paper {name}"] = plan.fixed_table(search, lengths, strategies)
    return {"model": model, "devices": devices, "context": context, "plan_s": plan_s,
            "tokens": int(lengths.sum()), "sequences": len(lengths),
            "seconds": {k: (None if v is None else v.seconds) for k, v in results.items()},
            "tables": {k: (None if v is None else [f"({b.low}, {b.max_len}]: {b.strategy}"
                                                   for b in v.buckets])
                       for k, v in results.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document to stdout (the table goes to stderr)")
    parser.add_argument("--lengths", default=str(LENGTHS), help="document lengths (`hotjax "
                        "data stats --json`; default: the Python standard library, 8k BPE)")
    parser.add_argument("--profile", default="a800-4x8")
    parser.add_argument("--models", default="llama2-7b,llama2-13b,hotspa-32b")
    parser.add_argument("--devices", default="8,16,32")
    parser.add_argument("--contexts", default="16384,32768,65536,131072")
    parser.add_argument("--batch-sequences", type=int, default=512)
    args = parse_args(parser, argv, QUICK)

    import numpy as np

    from hotjax.planning.profile import load_profile

    stats = json.loads(Path(args.lengths).read_text())
    documents = np.asarray(stats["quantiles"], np.int64)
    profile = load_profile(args.profile)
    rows = [simulate(model, int(devices), int(context), documents, profile,
                     args.batch_sequences)
            for model in args.models.split(",") for devices in args.devices.split(",")
            for context in args.contexts.split(",")
            if int(devices) >= MIN_DEVICES.get(model, 0)]
    report = {"profile": profile.name, "lengths": stats["corpus"]["source"],
              "tokenizer": stats["tokenizer"], "batch_sequences": args.batch_sequences,
              "rows": rows}
    _print(report, console(stderr=args.json, width=160))
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


def _print(report: dict, out) -> None:
    from rich.table import Table

    table = Table(title=f"predicted step seconds on {report['profile']}, "
                        f"{report['batch_sequences']} sequences of {report['lengths']} per step "
                        f"(the plan's speed-up)")
    for column in ("model", "devices", "context", *COLUMNS, "search s"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for r in report["rows"]:
        table.add_row(r["model"], str(r["devices"]), f"{r['context'] // 1024}K",
                      *(_cell(r["seconds"], c) for c in COLUMNS), f"{r['plan_s']:.1f}")
    out.print(table)
    out.print("plan: `hotjax plan`'s table; paper c1/c2: the paper's hand-picked tables "
              "(— where it gives none); static: the best single strategy with packing and "
              "document masking, the same on concatenated sequences without masking, and on "
              "one sequence per row padded to the context. Cost model only: nothing ran.")


def _cell(seconds: dict, name: str) -> str:
    if name not in seconds:
        return "—"
    if seconds[name] is None:
        return "does not fit"
    ratio = "" if name == "plan" else f" ({seconds[name] / seconds['plan']:.2f}x)"
    return f"{seconds[name]:.1f}{ratio}"


if __name__ == "__main__":
    sys.exit(main())
