"""Checkpoint throughput beside the disk's own: save and restore GB/s of a training state, a
sequential write and read of the same bytes in the same run, restore onto the same mesh vs a
new one, and how long an async save holds up training.

    python scripts/bench_ckpt.py [--model small] [--dir DIR] [--repeats 3] [--json] [--quick]

Reads are cold: every file is flushed and dropped from the page cache first (fadvise). The
state is saved from `--strategy` (home) on all devices (8 simulated ones on a CPU machine).
`--quick`: the `tiny` model, one repeat, two steps (a smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from quick_option import parse_args  # beside this script

if TYPE_CHECKING:
    from rich.console import Console

CHUNK = 64 << 20
QUICK = {"model": "tiny", "repeats": 1, "steps": 2, "seq_len": 64}


def _drop_cache(path: Path) -> None:
    """Flush `path` (a file or a tree) to disk and drop it from the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_baseline(directory: Path, nbytes: int) -> dict[str, float]:
    """Sequential write (with fsync, as TensorStore syncs its files) and cold read, GB/s."""
    file = directory / "baseline.bin"
    block = os.urandom(CHUNK)
    started = time.perf_counter()
    with open(file, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[:min(CHUNK, left)])
        os.fsync(f.fileno())
    write_s = time.perf_counter() - started
    _drop_cache(file)
    started = time.perf_counter()
    with open(file, "rb", buffering=0) as f:
        while f.read(CHUNK):
            pass
    read_s = time.perf_counter() - started
    file.unlink()
    return {"write_gb_s": nbytes / write_s / 1e9, "read_gb_s": nbytes / read_s / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="model preset (default: %(default)s)")
    parser.add_argument("--strategy", default="fsdp=8", help="the home layout that saves")
    parser.add_argument("--new-mesh", default="data=2,fsdp=4", help="a layout on all devices")
    parser.add_argument("--new-devices", type=int, default=4, help="fsdp over this many")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="train steps per blocking run")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object to stdout (the table goes to stderr)")
    args = parse_args(parser, argv, QUICK)

    from hotjax.cli import start_jax

    start_jax(None)
    import jax
    import numpy as np

    from hotjax.checkpoint import meta as meta_lib
    from hotjax.checkpoint import store
    from hotjax.data import Batch, MiniBatch
    from hotjax.optim import OptimConfig
    from hotjax.train import Trainer
    from models.llama import preset
    from sharding.strategy import Strategy
    from sharding.table import StrategyTable

    config = dataclasses.replace(preset(args.model), compute_dtype="float32")
    optim = OptimConfig(total_steps=1000)
    devices = jax.devices()

    def trainer(strategy: str, count: int) -> Trainer:
        table = StrategyTable.single(Strategy.parse(strategy), args.seq_len, strategy)
        return Trainer(config, optim, table, devices[:count])

    home = trainer(args.strategy, len(devices))
    # One row per batch shard; one step first, so that the optimizer moments are not zeros
    # (which would compress to nothing).
    rng = np.random.default_rng(0)
    rows, seq = home.micro_rows[0], args.seq_len
    tokens_BxT = rng.integers(0, config.vocab_size, (rows, seq)).astype(np.int32)
    batch = MiniBatch((Batch(tokens_BxT, np.ones_like(tokens_BxT),
                             np.tile(np.arange(seq, dtype=np.int32), (rows, 1))),))
    state, metrics, _ = home.step(home.init(0), batch)
    float(metrics["loss"])
    nbytes = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
    record = meta_lib.record(step=0, source="bench", items=[], model=config.to_dict())
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")).absolute()
    root.mkdir(parents=True, exist_ok=True)

    disk = [disk_baseline(root, nbytes) for _ in range(args.repeats)]
    ckpt = root / "ck"
    checkpoints = store.Checkpoints(ckpt, keep_last=1)
    saves, blocked = [], []
    for step in range(1, args.repeats + 2):  # the first save compiles: not counted
        started = time.perf_counter()
        blocked.append(checkpoints.save(step, state.params, state.opt_state, record, None))
        checkpoints.wait()
        saves.append(time.perf_counter() - started)
    saves, blocked = saves[1:], blocked[1:]
    checkpoints.close()
    disk_bytes = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())

    def restore_s(strategy: str, count: int) -> float:
        targets = trainer(strategy, count).home.abstract_state()
        items = {"params": targets.params, "opt_state": targets.opt_state}
        times = []
        for _ in range(args.repeats + 1):
            _drop_cache(ckpt)
            started = time.perf_counter()
            jax.block_until_ready(store.restore(ckpt, items).arrays)
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

    restores = {"same mesh": restore_s(args.strategy, len(devices)),
                "new mesh": restore_s(args.new_mesh, len(devices)),
                "new device count": restore_s(f"fsdp={args.new_devices}", args.new_devices)}

    # Training held up by an async save: steps alone, then a save after every step.
    def loop(save: bool) -> tuple[float, list[float]]:
        nonlocal state
        run = store.Checkpoints(root / f"loop-{save}", keep_last=1) if save else None
        held: list[float] = []
        started = time.perf_counter()
        for _ in range(args.steps):
            state, metrics, _ = home.step(state, batch)
            float(metrics["loss"])
            if run:
                held.append(run.save(int(state.step), state.params, state.opt_state, record,
                                     None))
        elapsed = time.perf_counter() - started
        if run:
            run.close()
        return elapsed / args.steps, held

    step_alone, _ = loop(False)
    step_saving, held = loop(True)
    shutil.rmtree(root / "loop-True", ignore_errors=True)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)

    gb = nbytes / 1e9
    result = {
        "hardware": {"cpus": os.cpu_count(), "platform": devices[0].platform,
                     "device_kind": devices[0].device_kind,
                     "devices": len(devices), "machine": platform.machine(),
                     "python": sys.version.split()[0], "jax": jax.__version__},
        "model": args.model, "home": args.strategy, "state_bytes": nbytes,
        "disk_bytes": disk_bytes, "batch": [rows, seq],
        "disk": {"write_gb_s": statistics.median(d["write_gb_s"] for d in disk),
                 "read_gb_s": statistics.median(d["read_gb_s"] for d in disk)},
        "save": {"gb_s": gb / statistics.median(saves), "seconds": statistics.median(saves),
                 "blocked_s": statistics.median(blocked)},
        "restore": {name: {"gb_s": gb / s, "seconds": s} for name, s in restores.items()},
        "training": {"step_s": step_alone, "step_s_saving_every_step": step_saving,
                     "blocked_per_save_s": statistics.median(held),
                     "steps": args.steps},
    }
    from rich.console import Console

    # With --json the table goes to stderr; into a file or a pipe, rich would wrap it at 80.
    _table(result, Console(stderr=args.json, width=150))
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


def _table(r: dict, console: Console) -> None:
    from rich.table import Table

    hw = r["hardware"]
    table = Table(title=f"checkpoint of {r['model']} ({r['state_bytes'] / 1e6:.0f} MB of params "
                        f"+ optimizer state; {r['disk_bytes'] / 1e6:.0f} MB on disk), saved "
                        f"from {r['home']} on {hw['devices']} {hw['platform']} devices, "
                        f"{hw['cpus']} cores")
    for column in ("what", "seconds", "GB/s", "disk alone, GB/s"):
        table.add_column(column, justify="right")
    table.add_row("save (async, to commit)", f"{r['save']['seconds']:.3f}",
                  f"{r['save']['gb_s']:.3f}", f"{r['disk']['write_gb_s']:.3f} (write+fsync)")
    for name, x in r["restore"].items():
        table.add_row(f"restore, {name}", f"{x['seconds']:.3f}", f"{x['gb_s']:.3f}",
                      f"{r['disk']['read_gb_s']:.3f} (cold read)")
    t = r["training"]
    table.add_row("save call (training held up), alone", f"{r['save']['blocked_s']:.3f}", "",
                  "")
    table.add_row("save call, between train steps", f"{t['blocked_per_save_s']:.3f}", "", "")
    table.add_row("train step, no save", f"{t['step_s']:.3f}", "", "")
    table.add_row("train step + async save each step", f"{t['step_s_saving_every_step']:.3f}",
                  "", "")
    console.print(table)
    console.print(f"hardware: {hw['devices']} {hw['platform']} device(s) ({hw['device_kind']}), "
                  f"{hw['cpus']} CPUs, {hw['machine']}, python {hw['python']}, jax {hw['jax']}",
                  highlight=False)


if __name__ == "__main__":
    sys.exit(main())
