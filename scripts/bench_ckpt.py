"""Checkpoint throughput beside the disk's own: save and restore GB/s of a training state, a
sequential write and read of the same bytes in the same run, restore onto the same mesh vs a
new one, how long an async save holds up training, and `ckpt import-dcp` / `export-dcp` of a
PyTorch Distributed Checkpoint (DCP).

    python scripts/bench_ckpt.py [--model small] [--dir DIR] [--repeats 3] [--dcp-gb 1.25]
                                 [--json] [--quick]

Reads are cold: every file is flushed and dropped from the page cache first (fadvise). The
state is saved from `--strategy` (home) on all devices (8 simulated ones on a CPU machine).
The DCP checkpoint is written by torch itself (not timed): a LLaMA of vocabulary 32000 and
width 768 with as many layers as make its fp32 weights and AdamW moments reach `--dcp-gb`, in
Hugging Face naming, from several writer threads (a `.distcp` file each, as several ranks
write). Its import is timed end to end against a cold read of as many bytes, its export
against a write.
`--quick`: the `tiny` model (and DCP checkpoint), one repeat, two steps (a smoke test).
"""

from __future__ import annotations

import argparse
import ctypes.util
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from quick_option import parse_args  # beside this script

if TYPE_CHECKING:
    from rich.console import Console

    from models.llama import LlamaConfig

CHUNK = 64 << 20
QUICK = {"model": "tiny", "repeats": 1, "steps": 2, "seq_len": 64, "dcp_gb": 0}
DCP_WRITERS = 4  # torch's writer threads: one .distcp file each
DCP_BYTES_PER_PARAM = 12  # fp32 weight, exp_avg and exp_avg_sq


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


def _bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def dcp_config(gb: float) -> LlamaConfig:
    """The LLaMA whose DCP checkpoint holds at least `gb` GB: vocabulary 32000, width 768 (12
    heads, MLP 2048) and as many layers as that takes; for `gb` 0 the `tiny` preset."""
    from models.llama import LlamaConfig, preset

    if gb <= 0:
        return preset("tiny")
    base = LlamaConfig(vocab_size=32000, dim=768, n_layers=0, n_heads=12, n_kv_heads=12,
                       ffn_dim=2048)
    layer = dataclasses.replace(base, n_layers=1).num_params() - base.num_params()
    wanted = gb * 1e9 / DCP_BYTES_PER_PARAM - base.num_params()
    return dataclasses.replace(base, n_layers=max(1, -int(-wanted // layer)))


def write_dcp(directory: Path, config: LlamaConfig) -> None:
    """A DCP checkpoint of random weights, AdamW moments and step of `config`, as a torch run
    saves `{"model": model.state_dict(), "optim": optimizer.state_dict()}`."""
    import jax
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp

    from models.hf import params_to_hf_state
    from models.llama import abstract_params

    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32),
                          abstract_params(config))
    model = {name: torch.from_numpy(x) for name, x in params_to_hf_state(params, config).items()}
    del params
    torch.manual_seed(0)
    # Moments of a real run's scale; exp_avg_sq is never negative.
    optim = {name: {"exp_avg": 1e-3 * torch.randn_like(x), "exp_avg_sq": 1e-6 * torch.rand_like(x),
                    "step": torch.tensor(5.0)} for name, x in model.items()}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model, "optim": {"state": optim}}, no_dist=True,
                 storage_writer=dcp.FileSystemWriter(str(directory), thread_count=DCP_WRITERS))


def _return_freed_heap() -> None:
    """Give the heap that the last import freed back to the system, as a new process starts
    without it: glibc keeps it, and each repeat would hold a GB or two more."""
    libc = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    if trim:
        trim(0)


def dcp_times(root: Path, config: LlamaConfig, repeats: int) -> dict:
    """`import_dcp` of a DCP checkpoint from cold, `export_dcp` of what it made, and the disk's
    cold read and fsynced write of as many bytes: medians of `repeats`."""
    from hotjax.checkpoint.dcp import export_dcp, import_dcp

    source, imported, exported = root / "dcp", root / "dcp-imported", root / "dcp-exported"
    write_dcp(source, config)
    nbytes, files = _bytes(source), len(list(source.glob("*.distcp")))
    disk = [disk_baseline(root, nbytes) for _ in range(repeats)]
    imports, exports, written = [], [], 0
    for _ in range(repeats + 1):  # the first warms up (first loads and saves): not counted
        _return_freed_heap()
        _drop_cache(source)
        started = time.perf_counter()
        step_dir = import_dcp(source, imported, config)
        imports.append(time.perf_counter() - started)
        _drop_cache(imported)
        started = time.perf_counter()
        export_dcp(step_dir, exported)
        exports.append(time.perf_counter() - started)
        written = _bytes(exported)
        shutil.rmtree(imported)
        shutil.rmtree(exported)
    shutil.rmtree(source)
    import_s, export_s = statistics.median(imports[1:]), statistics.median(exports[1:])
    read_gb_s = statistics.median(d["read_gb_s"] for d in disk)
    return {"bytes": nbytes, "files": files, "params": config.num_params(),
            "layers": config.n_layers,
            "import": {"seconds": import_s, "gb_s": nbytes / import_s / 1e9},
            "export": {"seconds": export_s, "gb_s": written / export_s / 1e9, "bytes": written},
            "disk_read_gb_s": read_gb_s,
            "disk_write_gb_s": statistics.median(d["write_gb_s"] for d in disk),
            "import_vs_disk_read": nbytes / import_s / 1e9 / read_gb_s}


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
    parser.add_argument("--dcp-gb", type=float, default=1.25,
                        help="the DCP checkpoint's size at least, weights and AdamW moments "
                             "(default: %(default)s, 8 layers; 0: the tiny model's)")
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
    disk_bytes = _bytes(ckpt)

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
    dcp = dcp_times(root, dcp_config(args.dcp_gb), args.repeats)
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
        "dcp": dcp,
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
    for column in ("what", "seconds", "GB/s", "disk alone, GB/s", "of the disk's"):
        table.add_column(column, justify="right")

    def row(what: str, x: dict, disk_gb_s: float, how: str) -> None:
        table.add_row(what, f"{x['seconds']:.3f}", f"{x['gb_s']:.3f}",
                      f"{disk_gb_s:.3f} ({how})", f"{x['gb_s'] / disk_gb_s:.2f}x")

    row("save (async, to commit)", r["save"], r["disk"]["write_gb_s"], "write+fsync")
    for name, x in r["restore"].items():
        row(f"restore, {name}", x, r["disk"]["read_gb_s"], "cold read")
    t = r["training"]
    table.add_row("save call (training held up), alone", f"{r['save']['blocked_s']:.3f}", "",
                  "")
    table.add_row("save call, between train steps", f"{t['blocked_per_save_s']:.3f}", "", "")
    table.add_row("train step, no save", f"{t['step_s']:.3f}", "", "")
    table.add_row("train step + async save each step", f"{t['step_s_saving_every_step']:.3f}",
                  "", "")
    d = r["dcp"]
    of = f"{d['bytes'] / 1e6:.0f} MB in {d['files']} .distcp files, {d['layers']} layers"
    row(f"DCP import ({of}), end to end", d["import"], d["disk_read_gb_s"], "cold read")
    row(f"DCP export of that import ({d['export']['bytes'] / 1e6:.0f} MB)", d["export"],
        d["disk_write_gb_s"], "write+fsync")
    console.print(table)
    console.print(f"hardware: {hw['devices']} {hw['platform']} device(s) ({hw['device_kind']}), "
                  f"{hw['cpus']} CPUs, {hw['machine']}, python {hw['python']}, jax {hw['jax']}",
                  highlight=False)


if __name__ == "__main__":
    sys.exit(main())
