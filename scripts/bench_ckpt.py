"""Checkpoint throughput beside the disk's own: save and restore GB/s of a training state, a
sequential write and read of the same bytes in the same run, restore onto the same mesh vs a
new one, how long an async save holds up training; and every conversion's GB/s and peak host
memory: `ckpt import-hf` / `export-hf` of a Hugging Face safetensors LLaMA, `import-dcp` /
`export-dcp` of a PyTorch Distributed Checkpoint (DCP), `export-universal` / `import-deepspeed`
of a DeepSpeed universal directory, `import-deepspeed` of ZeRO-2 rank files,
`import-megatron-core` of a Megatron-Core torch_dist checkpoint and `import-shards --format
megatron` of Megatron-LM rank files.

    python scripts/bench_ckpt.py [--model small] [--dir DIR] [--repeats 3] [--dcp-gb 2]
                                 [--hf-gb 2] [--conversions-only] [--in-process] [--json]
                                 [--quick]

Reads are cold: every file is flushed and dropped from the page cache first (fadvise). The
state is saved from `--strategy` (home) on all devices (8 simulated ones on a CPU machine).
Each conversion runs once, as the real command (`hotjax.cli.main(["ckpt", ...])`) in a fresh
process, timed end to end (the process's start included) against a cold read of its input or
an fsynced write of its output; its peak RSS is the process's own (VmHWM as it exits), beside
that of `ckpt inspect` (the same imports, no tensor read). With `--in-process` each runs in
this process instead, one after another: its seconds without a process's start, its peak RSS
this process's from the conversion's start (the peak reset first, /proc/self/clear_refs). The
foreign checkpoints are written
first (`hotjax.checkpoint.formats.fakes`), not timed: a LLaMA of vocabulary 32000 and width 768
(12 heads, MLP 2048) with as many layers as make `--hf-gb` of fp32 weights (safetensors files
of at most 1 GB, Hugging Face's index beside them), and `--dcp-gb` of fp32 weights and AdamW
moments, which torch saves from several writer threads (a `.distcp` file each, as several ranks
write). `export-universal` converts the DCP import; `import-deepspeed` reads what it wrote, and
ZeRO-2 rank files of the DCP checkpoint's model and bytes (fp32 weights and AdamW moments over
4 ranks). The torch_dist checkpoint holds the DCP checkpoint's model and as many bytes (weights
and Adam moments, per parameter); the Megatron-LM rank files (tp=2, pp=2) the Hugging Face
checkpoint's model and bytes.
`--quick`: the `tiny` model (and foreign checkpoints), one repeat, two steps, the conversions
in this process (a smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from quick_option import in_one_line, parse_args  # beside this script

from hotjax.checkpoint.formats import fakes

if TYPE_CHECKING:
    from rich.console import Console

    from hotjax.models.llama import LlamaConfig

CHUNK = 64 << 20
QUICK = {"model": "tiny", "repeats": 1, "steps": 2, "seq_len": 64, "dcp_gb": 0, "hf_gb": 0,
         "in_process": True}
DCP_BYTES_PER_PARAM = 12  # fp32 weight, exp_avg and exp_avg_sq
HF_BYTES_PER_PARAM = 4  # fp32 weight
MEGATRON_TP, MEGATRON_PP = 2, 2  # the Megatron-LM rank files' layout
ZERO_DP = 4  # the ZeRO-2 rank files' data-parallel size
ROOT = Path(__file__).resolve().parent.parent  # where `python -m hotjax.cli` runs


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


def foreign_config(gb: float, bytes_per_param: int) -> LlamaConfig:
    """The LLaMA whose checkpoint of `bytes_per_param` per parameter holds at least `gb` GB:
    vocabulary 32000, width 768 (12 heads, MLP 2048) and as many layers as that takes; for
    `gb` 0 the `tiny` preset."""
    from hotjax.models.llama import LlamaConfig, preset

    if gb <= 0:
        return preset("tiny")
    base = LlamaConfig(vocab_size=32000, dim=768, n_layers=0, n_heads=12, n_kv_heads=12,
                       ffn_dim=2048)
    layer = dataclasses.replace(base, n_layers=1).num_params() - base.num_params()
    wanted = gb * 1e9 / bytes_per_param - base.num_params()
    return dataclasses.replace(base, n_layers=max(1, -int(-wanted // layer)))


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM) since it started or since `_reset_peak`."""
    with open("/proc/self/status") as status:
        return 1024 * next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM back to the resident memory now (Linux 4.0+)


def run_ckpt(*args: str | Path, drop: Path | None = None,
             in_process: bool = False) -> dict[str, float]:
    """`hotjax ckpt *args` in a fresh process (one CPU device, the CLI's own), or with
    `in_process` in this one: its seconds, end to end, and its peak RSS in bytes. `drop` is
    dropped from the page cache first."""
    if drop is not None:
        _drop_cache(drop)
    if in_process:
        from hotjax.cli import main as hotjax

        _reset_peak()
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            code = hotjax(["ckpt", *map(str, args)])
        seconds = time.perf_counter() - started
        if code != 0:
            raise RuntimeError(f"hotjax ckpt {' '.join(map(str, args))} exited {code}")
        return {"seconds": seconds, "peak_rss_bytes": _peak_rss_bytes()}
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    with tempfile.NamedTemporaryFile("r", suffix=".peak") as peak:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "hotjax.peak", peak.name, "ckpt",
                               *map(str, args)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"hotjax ckpt {' '.join(map(str, args))} failed:\n{done.stderr}")
        return {"seconds": seconds, "peak_rss_bytes": int(peak.read())}


def _conversion(run: dict[str, float], nbytes: int, disk_gb_s: float) -> dict[str, float]:
    return {**run, "bytes": nbytes, "gb_s": nbytes / run["seconds"] / 1e9,
            "disk_gb_s": disk_gb_s}


def conversions(root: Path, hf_gb: float, dcp_gb: float, in_process: bool = False) -> dict:
    """Each conversion of a Hugging Face directory of `hf_gb` and a DCP checkpoint of `dcp_gb`
    (and of the DeepSpeed universal directory exported from its import), each a fresh process
    or with `in_process` in this one: seconds, GB/s of the larger side against the disk's cold
    read (imports) or fsynced write (exports), peak RSS."""
    convert = functools.partial(run_ckpt, in_process=in_process)
    hf_config, dcp_config = foreign_config(hf_gb, HF_BYTES_PER_PARAM), foreign_config(
        dcp_gb, DCP_BYTES_PER_PARAM)
    hf, dcp = root / "hf", root / "dcp"
    fakes.write_hf(hf, hf_config)
    fakes.write_dcp(dcp, dcp_config)
    config_json = fakes.write_config(root / "dcp-config", dcp_config)
    largest = max(_bytes(hf), _bytes(dcp))
    disk = disk_baseline(root, largest)
    read, write = disk["read_gb_s"], disk["write_gb_s"]
    out: dict = {"disk_read_gb_s": read, "disk_write_gb_s": write, "in_process": in_process}

    hf_bytes = _bytes(hf)
    imported = _conversion(convert("import-hf", hf, root / "hf-in", drop=hf), hf_bytes, read)
    baseline = convert("inspect", root / "hf-in")
    run = convert("export-hf", root / "hf-in", root / "hf-out", drop=root / "hf-in")
    out["baseline_rss_bytes"] = baseline["peak_rss_bytes"]
    out["hf"] = {"bytes": hf_bytes, "layers": hf_config.n_layers,
                 "params": hf_config.num_params(), "import": imported,
                 "export": _conversion(run, _bytes(root / "hf-out"), write)}
    for path in ("hf", "hf-in", "hf-out"):
        shutil.rmtree(root / path)

    dcp_bytes = _bytes(dcp)
    run = convert("import-dcp", dcp, root / "dcp-in", "--config", config_json, drop=dcp)
    imported = _conversion(run, dcp_bytes, read)
    run = convert("export-dcp", root / "dcp-in", root / "dcp-out", drop=root / "dcp-in")
    out["dcp"] = {"bytes": dcp_bytes, "files": len(list(dcp.glob("*.distcp"))),
                  "params": dcp_config.num_params(), "layers": dcp_config.n_layers,
                  "import": imported, "export": _conversion(run, _bytes(root / "dcp-out"), write),
                  "disk_read_gb_s": read, "disk_write_gb_s": write,
                  "import_vs_disk_read": imported["gb_s"] / read}
    run = convert("export-universal", root / "dcp-in", root / "ds", drop=root / "dcp-in")
    exported = _conversion(run, _bytes(root / "ds"), write)
    run = convert("import-deepspeed", root / "ds", root / "ds-in", "--config", config_json,
                   drop=root / "ds")
    out["deepspeed"] = {"bytes": _bytes(root / "ds"), "export_universal": exported,
                        "import": _conversion(run, _bytes(root / "ds"), read)}
    fakes.write_zero(root / "zero", dcp_config, ZERO_DP)
    run = convert("import-deepspeed", root / "zero", root / "zero-in", "--config", config_json,
                   drop=root / "zero")
    out["zero"] = {"bytes": _bytes(root / "zero"), "dp": ZERO_DP, "layers": dcp_config.n_layers,
                   "import": _conversion(run, _bytes(root / "zero"), read)}
    for path in ("dcp", "dcp-config", "dcp-in", "dcp-out", "ds", "ds-in", "zero", "zero-in"):
        shutil.rmtree(root / path)
    out.update(megatron_conversions(root, hf_config, dcp_config, read, convert))
    return out


def megatron_conversions(root: Path, weights: LlamaConfig, with_adam: LlamaConfig,
                         disk_gb_s: float, convert=run_ckpt) -> dict:
    """`import-megatron-core` of a torch_dist checkpoint of `with_adam` (weights and Adam
    moments) and `import-shards --format megatron` of Megatron-LM rank files of `weights`: their
    seconds, GB/s against the disk's cold read, peak RSS (`convert`, as `run_ckpt`, runs each)."""
    mc, mg = root / "mc", root / "mg"
    fakes.write_megatron_core(mc, with_adam)
    run = convert("import-megatron-core", mc, root / "mc-in", drop=mc)
    out = {"megatron_core": {"bytes": _bytes(mc), "layers": with_adam.n_layers,
                             "import": _conversion(run, _bytes(mc), disk_gb_s)}}
    shutil.rmtree(mc)
    shutil.rmtree(root / "mc-in")
    fakes.write_megatron(mg, weights, MEGATRON_TP, MEGATRON_PP)
    run = convert("import-shards", "--format", "megatron", mg, root / "mg-in", drop=mg)
    out["megatron"] = {"bytes": _bytes(mg), "layers": weights.n_layers, "tp": MEGATRON_TP,
                       "pp": MEGATRON_PP, "import": _conversion(run, _bytes(mg), disk_gb_s)}
    shutil.rmtree(mg)
    shutil.rmtree(root / "mg-in")
    return out


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
    parser.add_argument("--dcp-gb", type=float, default=2.0,
                        help="the DCP checkpoint's size at least, weights and AdamW moments "
                             "(default: %(default)s, 17 layers; 0: the tiny model's)")
    parser.add_argument("--hf-gb", type=float, default=2.0,
                        help="the Hugging Face checkpoint's size at least, fp32 weights "
                             "(default: %(default)s, 64 layers; 0: the tiny model's)")
    parser.add_argument("--conversions-only", action="store_true",
                        help="only the imports and exports (no training state is saved)")
    parser.add_argument("--in-process", action="store_true",
                        help="run each conversion in this process, not a fresh one (no start "
                             "timed; the peak RSS this process's from the conversion's start)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object to stdout (the table goes to stderr)")
    args = parse_args(parser, argv, QUICK)

    from hotjax import start_jax

    start_jax(None)
    import jax

    devices = jax.devices()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")).absolute()
    root.mkdir(parents=True, exist_ok=True)
    result = {
        "hardware": {"cpus": os.cpu_count(), "platform": devices[0].platform,
                     "device_kind": devices[0].device_kind,
                     "devices": len(devices), "machine": platform.machine(),
                     "python": sys.version.split()[0], "jax": jax.__version__},
        **({} if args.conversions_only else state_times(args, root)),
        "conversions": conversions(root, args.hf_gb, args.dcp_gb, args.in_process),
    }
    result["dcp"] = result["conversions"]["dcp"]
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    from rich.console import Console

    # With --json the table goes to stderr; into a file or a pipe, rich would wrap it at 80.
    console = Console(stderr=args.json, width=150)
    if not args.conversions_only:
        _table(result, console)
    _conversions_table(result, console)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


def state_times(args: argparse.Namespace, root: Path) -> dict:
    """Save and restore of `--model`'s training state, and training held up by async saves."""
    import jax

    from hotjax.checkpoint import meta as meta_lib
    from hotjax.models.llama import preset

    config = dataclasses.replace(preset(args.model), compute_dtype="float32")
    devices = jax.devices()
    home = _trainer(args, config, args.strategy, devices)
    state, batch = _one_step(home, args.seq_len)
    nbytes = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
    record = meta_lib.record(step=0, source="bench", items=[], model=config.to_dict())
    disk = [disk_baseline(root, nbytes) for _ in range(args.repeats)]
    ckpt, saves, blocked = _save_seconds(args, root, state, record)
    restores = {name: _restore_seconds(args, ckpt, _trainer(args, config, strategy,
                                                            devices[:count]))
                for name, strategy, count in (
                    ("same mesh", args.strategy, len(devices)),
                    ("new mesh", args.new_mesh, len(devices)),
                    ("new device count", f"fsdp={args.new_devices}", args.new_devices))}
    # Training held up by an async save: steps alone, then a save after every step.
    state, step_alone, _ = _steps(args, home, state, batch, None, record)
    state, step_saving, held = _steps(args, home, state, batch, root / "loop", record)
    shutil.rmtree(root / "loop", ignore_errors=True)
    gb = nbytes / 1e9
    return {
        "model": args.model, "home": args.strategy, "state_bytes": nbytes,
        "disk_bytes": _bytes(ckpt), "batch": list(batch.buckets[0].tokens.shape),
        "disk": {"write_gb_s": statistics.median(d["write_gb_s"] for d in disk),
                 "read_gb_s": statistics.median(d["read_gb_s"] for d in disk)},
        "save": {"gb_s": gb / statistics.median(saves), "seconds": statistics.median(saves),
                 "blocked_s": statistics.median(blocked)},
        "restore": {name: {"gb_s": gb / s, "seconds": s} for name, s in restores.items()},
        "training": {"step_s": step_alone, "step_s_saving_every_step": step_saving,
                     "blocked_per_save_s": statistics.median(held),
                     "steps": args.steps},
    }


def _trainer(args: argparse.Namespace, config, strategy: str, devices: list):
    """The trainer of a run of `config` under one strategy over `--seq-len`-token rows."""
    from hotjax.optim import OptimConfig
    from hotjax.run import Run
    from hotjax.sharding.strategy import Strategy
    from hotjax.sharding.table import StrategyTable

    table = StrategyTable.single(Strategy.parse(strategy), args.seq_len, strategy)
    return Run(config, table, OptimConfig(total_steps=1000), (), devices=devices).trainer


def _one_step(home, seq: int):
    """The state after one step on random tokens, one row per batch shard (so that the
    optimizer moments are not zeros, which would compress to nothing), and that mini-batch."""
    import numpy as np

    from hotjax.data import Batch, MiniBatch

    rng = np.random.default_rng(0)
    rows = home.micro_rows[0]
    tokens_BxT = rng.integers(0, home.config.vocab_size, (rows, seq)).astype(np.int32)
    batch = MiniBatch((Batch(tokens_BxT, np.ones_like(tokens_BxT),
                             np.tile(np.arange(seq, dtype=np.int32), (rows, 1))),))
    state, metrics, _ = home.step(home.init(0), batch)
    float(metrics["loss"])
    return state, batch


def _save_seconds(args: argparse.Namespace, root: Path, state, record: dict
                  ) -> tuple[Path, list[float], list[float]]:
    """The last checkpoint written, and each save's seconds to complete and to return (the
    first save, which compiles, not counted)."""
    from hotjax.checkpoint import store

    saves, blocked = [], []
    for repeat in range(args.repeats + 1):
        # Each save a step-1 checkpoint of its own: a checkpoint's step is its state's count.
        ckpt = root / f"ck-{repeat}"
        checkpoints = store.Checkpoints(ckpt, keep_last=1)
        started = time.perf_counter()
        blocked.append(checkpoints.save(1, state.params, state.opt_state, record, None))
        checkpoints.wait()
        saves.append(time.perf_counter() - started)
        checkpoints.close()
        if repeat < args.repeats:
            shutil.rmtree(ckpt)
    return ckpt, saves[1:], blocked[1:]


def _restore_seconds(args: argparse.Namespace, ckpt: Path, trainer) -> float:
    """The median seconds to restore `ckpt` into `trainer`'s home layout, page cache dropped
    (the first restore, which compiles, not counted)."""
    import jax

    from hotjax.checkpoint import store

    targets = trainer.home.abstract_state()
    items = {"params": targets.params, "opt_state": targets.opt_state}
    times = []
    for _ in range(args.repeats + 1):
        _drop_cache(ckpt)
        started = time.perf_counter()
        jax.block_until_ready(store.restore(ckpt, items).arrays)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def _steps(args: argparse.Namespace, home, state, batch, saves_to: Path | None, record: dict):
    """`--steps` steps from `state` (donated), with an async save after each into `saves_to`
    where given: the state reached, seconds per step, and each save's seconds held up."""
    from hotjax.checkpoint import store

    run = store.Checkpoints(saves_to, keep_last=1) if saves_to else None
    held: list[float] = []
    started = time.perf_counter()
    for _ in range(args.steps):
        state, metrics, _ = home.step(state, batch)
        float(metrics["loss"])
        if run:
            held.append(run.save(int(state.step), state.params, state.opt_state, record, None))
    elapsed = time.perf_counter() - started
    if run:
        run.close()
    return state, elapsed / args.steps, held


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
    console.print(table)


def _conversions_table(r: dict, console: Console) -> None:
    from rich.table import Table

    c, hw = r["conversions"], r["hardware"]
    base = c["baseline_rss_bytes"]
    where = "in one process" if c["in_process"] else "each a fresh `hotjax ckpt` process"
    table = Table(title=f"conversions, {where} ({hw['cpus']} cores); "
                        f"peak RSS of `ckpt inspect` (no tensor read): {base / 1e9:.2f} GB")
    for column in ("what", "GB", "seconds", "GB/s", "disk alone, GB/s", "peak RSS, GB",
                   "above inspect, GB", "of the checkpoint"):
        table.add_column(column, justify="right")

    def row(what: str, x: dict, checkpoint: int, how: str) -> None:
        above = x["peak_rss_bytes"] - base
        table.add_row(what, f"{x['bytes'] / 1e9:.2f}", f"{x['seconds']:.1f}", f"{x['gb_s']:.3f}",
                      f"{x['disk_gb_s']:.3f} ({how})", f"{x['peak_rss_bytes'] / 1e9:.2f}",
                      f"{above / 1e9:.2f}", f"{above / checkpoint:.2f}x")

    hf, dcp, ds = c["hf"], c["dcp"], c["deepspeed"]
    row(f"import-hf ({hf['layers']} layers, fp32)", hf["import"], hf["bytes"], "cold read")
    row("export-hf of that import", hf["export"], hf["bytes"], "write+fsync")
    row(f"import-dcp ({dcp['layers']} layers, {dcp['files']} .distcp files)", dcp["import"],
        dcp["bytes"], "cold read")
    row("export-dcp of that import", dcp["export"], dcp["bytes"], "write+fsync")
    row("export-universal of that import", ds["export_universal"], dcp["bytes"], "write+fsync")
    row("import-deepspeed of that universal directory", ds["import"], dcp["bytes"], "cold read")
    zero = c["zero"]
    row(f"import-deepspeed (ZeRO-2 rank files, dp={zero['dp']}, {zero['layers']} layers)",
        zero["import"], zero["bytes"], "cold read")
    mc, mg = c["megatron_core"], c["megatron"]
    row(f"import-megatron-core (torch_dist, {mc['layers']} layers, Adam moments)", mc["import"],
        mc["bytes"], "cold read")
    row(f"import-shards --format megatron (tp={mg['tp']}, pp={mg['pp']}, {mg['layers']} "
        f"layers, fp32)", mg["import"], mg["bytes"], "cold read")
    console.print(table)
    console.print(f"hardware: {hw['devices']} {hw['platform']} device(s) ({hw['device_kind']}), "
                  f"{hw['cpus']} CPUs, {hw['machine']}, python {hw['python']}, jax {hw['jax']}",
                  highlight=False)


if __name__ == "__main__":
    sys.exit(in_one_line("bench_ckpt", main))
