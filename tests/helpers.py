"""What the test files share: a tiny model, one optimizer, one way to build a trainer and its
mini-batches, a tiny run's flags, strategy tables as files, and one way to run hotjax (in this
process or a new one) and read its metrics and one-line errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import typing
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np

from hotjax.data import Batch, MiniBatch
from hotjax.models.llama import PRESETS, LlamaConfig, abstract_params
from hotjax.optim import OptimConfig
from hotjax.sharding.strategy import Strategy
from hotjax.sharding.table import Bucket, StrategyTable
from hotjax.step import Accumulator, Home
from hotjax.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
TABLES = Path(__file__).resolve().parent / "tables"

# The tiny preset (GQA: 8 query heads, 4 K/V) in fp32: sharded results equal one device's up to
# the order of float sums.
TINY = dataclasses.replace(PRESETS["tiny"], compute_dtype="float32")

# TINY as `hotjax train` builds it on byte tokens: their 259 ids padded to 384 embedding rows, a
# multiple of every mesh size the tests use.
MODEL = dataclasses.replace(TINY, vocab_size=384)

# The optimizer of every trainer the tests build in this process, so that those of one strategy
# share their compiled update. Adam's first update is about lr * grad / (|grad| + eps): where a
# gradient is near zero, fp32 reduction order moves it, so params can differ by up to ~lr there;
# LLaMA's lr keeps that well under 1e-5. The warmup ends at the first step.
OPTIM = OptimConfig(lr=1e-3, warmup_steps=1, total_steps=4)


def trainer(layout: str | Strategy | StrategyTable, devices, *, max_len: int = 64,
            rows: int | None = None, config: LlamaConfig = MODEL, optim: OptimConfig = OPTIM,
            **options) -> Trainer:
    """A Trainer of `config` and `optim` under `layout`: a table, or one strategy (text or
    parsed) as a table of one bucket of `max_len`-token rows, `rows` a micro-step (None: the
    trainer's choice). `options` are the Trainer's."""
    if not isinstance(layout, StrategyTable):
        strategy = Strategy.parse(layout) if isinstance(layout, str) else layout
        layout = StrategyTable((Bucket(max_len, strategy, rows),), str(strategy))
    return Trainer(config, optim, layout, devices, **options)


def packed_rows(rows: int, length: int, *, documents: int = 3, padded: bool = True,
                seed: int = 0) -> Batch:
    """`rows` rows of `length` byte tokens, each packed with `documents` documents cut at random
    places; with `padded`, row r ends in r padding tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 259, size=(rows, length)).astype(np.int32)
    segments = np.zeros((rows, length), np.int32)
    positions = np.zeros((rows, length), np.int32)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(4, length - 4), size=documents - 1, replace=False))
        bounds = [0, *cuts, length - (r if padded else 0)]
        for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True), start=1):
            segments[r, a:b], positions[r, a:b] = s, np.arange(b - a)
    return Batch(tokens * (segments > 0), segments, positions)


def minibatch(*buckets: tuple[int, int], documents: int = 3, padded: bool = True,
              seed: int = 0) -> MiniBatch:
    """A mini-batch of one bucket per (rows, length): `packed_rows` of each."""
    return MiniBatch(tuple(packed_rows(rows, length, documents=documents, padded=padded,
                                       seed=seed + i) for i, (rows, length) in enumerate(buckets)))


def compiled_update(home: Home) -> jax.stages.Compiled:
    """The home's one update (`Home.apply`), compiled for its state and gradient sum."""
    def shaped(shapes, shardings):
        return jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                     sharding=sharding),
                            shapes, shardings)

    grads = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, np.float32),
                         abstract_params(home.config))
    acc = Accumulator(grads, jax.ShapeDtypeStruct((), np.float32),
                      jax.ShapeDtypeStruct((), np.int32))
    return home.apply.lower(home.abstract_state(), shaped(acc, home.acc_shardings)).compile()


# `hotjax train` of TINY on byte tokens, logging every step. One set of flags for every test
# that trains in this process: the compiled steps are cached per (config, strategy, shape), so
# a test that trains as another did compiles nothing.
TINY_RUN = ("train", "--model", "tiny", "--tokenizer", "bytes", "--context", "256",
            "--batch-tokens", "2048", "--compute-dtype", "float32", "--log-every", "1")

SUBPROCESS_TIMEOUT_S = 600  # a loaded 2-core machine; a hang fails the test instead


def small_corpus(directory: Path) -> Path:
    """`directory/docs.jsonl`: 200 documents of 300 bytes of the default corpus's text. A run
    reads and measures it in a moment, where the default corpus takes seconds to measure."""
    from hotjax.data import open_corpus

    text = "".join(open_corpus(None).read(i) for i in range(20))
    path = directory / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text[i:i + 300]}) + "\n"
                            for i in range(0, 300 * 200, 300)))
    return path


def table(name: str) -> Path:
    """tests/tables/NAME.toml: a strategy table several tests train under."""
    path = TABLES / f"{name}.toml"
    assert path.is_file(), f"no strategy table {path}"
    return path


def table_text(*buckets: Mapping[str, object], home: Mapping[str, object] | None = None) -> str:
    """A strategy table's TOML from its buckets, each {"max_len": 64, "mesh": "data = 8",
    "rules": "dp", ...}: a string value other than the mesh is quoted, the rest written as is."""
    def value(key: str, v: object) -> str:
        if key == "mesh":
            return f"{{ {v} }}"
        return json.dumps(v) if isinstance(v, str) else str(v)

    lines = []
    if home is not None:
        lines.append("home = { " + ", ".join(f"{k} = {value(k, v)}" for k, v in home.items())
                     + " }")
    for bucket in buckets:
        lines += ["[[bucket]]", *(f"{k} = {value(k, v)}" for k, v in bucket.items())]
    return "\n".join(lines) + "\n"


def write_table(path: Path, *buckets: Mapping[str, object],
                home: Mapping[str, object] | None = None) -> Path:
    """`table_text(*buckets, home=home)` written to `path`; returns `path`."""
    path.write_text(table_text(*buckets, home=home))
    return path


def records(source: Path | str) -> list[dict]:
    """The JSON records of a metrics file (a path; none if it does not exist yet) or of a
    command's stdout (a string): lines that are whole JSON objects."""
    if isinstance(source, Path):
        if not source.exists():
            return []
        source = source.read_text()
    return [json.loads(line) for line in source.splitlines()
            if line.startswith("{") and line.endswith("}")]


def one_line(err: str) -> str:
    """The one `hotjax: error:` line of stderr, its last line (a run's header may come
    before), and no traceback."""
    errors = [line for line in err.splitlines() if line.startswith("hotjax: error: ")]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    assert "Traceback" not in err, err
    return errors[0]


def error(argv: list[str], capsys) -> str:
    """`hotjax argv` in this process: exits 2 with one error line, which is returned."""
    from hotjax.cli import main

    assert main(argv) == 2
    return one_line(capsys.readouterr().err)


def environment(devices: int = 8, **extra: str) -> dict[str, str]:
    """This process's environment for a new one on `devices` simulated CPU devices, with wide
    lines (rich would wrap long paths) and `extra` added."""
    return {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices), "JAX_PLATFORMS": "cpu",
            "COLUMNS": "400", **extra}


def load_file(relative: str):
    """The project's file `relative` (a script or an example) imported as a module."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def python(*args: str | Path, cwd: Path | None = None, devices: int = 8,
           env: Mapping[str, str] | None = None, timeout: float = SUBPROCESS_TIMEOUT_S,
           ok: bool = True) -> subprocess.CompletedProcess:
    """`python args` (a script, `-m module` or `-c code`) in a new process on `devices`
    simulated CPU devices: its exit code, stdout and stderr. With `ok`, asserts it exited 0."""
    done = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, env={**environment(devices), **(env or {})},
                          timeout=timeout)
    if ok:
        assert done.returncode == 0, (f"{' '.join(map(str, args))[:300]} exited "
                                      f"{done.returncode}:\n{done.stdout[-3000:]}\n"
                                      f"{done.stderr[-3000:]}")
    return done


LOSS_TOLERANCE = 1e-4  # a benchmark's losses across methods: only the summation order differs


def run_quick(script: str, *flags: str) -> dict:
    """scripts/SCRIPT.py's JSON report from `--quick --json`, after checking it exited cleanly."""
    return json.loads(python(f"scripts/{script}.py", "--quick", "--json", *flags).stdout)


def positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def hotjax(*args: str | Path, **how) -> subprocess.CompletedProcess:
    """`hotjax args` in a new process: `python("-m", "hotjax.cli", *args, **how)`."""
    return python("-m", "hotjax.cli", *args, **how)


def hotjax_error(*args: str | Path, **how) -> str:
    """`hotjax args` in a new process that exits 2 with one error line: that line."""
    done = hotjax(*args, ok=False, **how)
    assert done.returncode == 2, f"exited {done.returncode}:\n{done.stderr[-3000:]}"
    return one_line(done.stderr)


# A child that never starts JAX runs in ~40 MiB resident; `capped` caps its address space well
# above that, so that a regression fails in the child, not on the machine.
ADDRESS_SPACE = 4 * 2**30


class Capped(typing.NamedTuple):
    """How a capped child ended: its exit code (negative: the signal that killed it), stderr,
    peak resident MiB (NaN if it died by a signal) and CPU seconds."""

    code: int
    stderr: str
    peak_mib: float
    cpu_s: float


def capped(code: str, *args: str | Path, cwd: Path, env: Mapping[str, str] | None = None) -> Capped:
    """Python `code` (its argv `args`) in a fresh process that caps its own address space at
    ADDRESS_SPACE first. Its peak is its VmHWM at exit: the fork's copy of this process is not
    its own."""
    prelude = (f"import atexit, resource; resource.setrlimit(resource.RLIMIT_AS, "
               f"({ADDRESS_SPACE}, {ADDRESS_SPACE})); atexit.register(lambda: open('peak', 'w')"
               f".write(open('/proc/self/status').read()))\n")
    peak = cwd / "peak"
    peak.unlink(missing_ok=True)
    with open(cwd / "stderr.txt", "w+") as err:
        child = subprocess.Popen([sys.executable, "-c", prelude + code, *map(str, args)],
                                 cwd=cwd, stdout=subprocess.DEVNULL, stderr=err,
                                 env={**os.environ, **(env or {})})
        _, status, usage = os.wait4(child.pid, 0)
        err.seek(0)
        stderr = err.read()
    lines = peak.read_text().splitlines() if peak.exists() else []
    peak_kib = [int(line.split()[1]) for line in lines if line.startswith("VmHWM:")]
    return Capped(os.waitstatus_to_exitcode(status), stderr,
                  peak_kib[0] / 1024 if peak_kib else float("nan"),
                  usage.ru_utime + usage.ru_stime)


def capped_hotjax(*args: str | Path, cwd: Path, env: Mapping[str, str] | None = None) -> Capped:
    """`hotjax args` in a capped fresh process (`capped`)."""
    return capped("import runpy, sys; sys.argv[0] = 'hotjax'; "
                  "runpy.run_module('hotjax.cli', run_name='__main__')", *args, cwd=cwd, env=env)


def start_hotjax(*args: str | Path, cwd: Path | None = None, devices: int = 8,
                 env: Mapping[str, str] | None = None, stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT) -> subprocess.Popen:
    """`hotjax args` started in a new process, as `hotjax` does, and left running: by default
    its stdout and stderr together in one text pipe."""
    return subprocess.Popen([sys.executable, "-m", "hotjax.cli", *map(str, args)],
                            stdout=stdout, stderr=stderr, text=True, cwd=cwd or ROOT,
                            env={**environment(devices), **(env or {})})
