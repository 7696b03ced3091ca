"""Resuming: the steps after a resume equal the uninterrupted run's, on any layout or device
count, and, in new processes, after a SIGKILL at any moment, mid-save included.

The layouts resume in this process (`hotjax.cli.main`, which builds its run anew from the
command line and the checkpoint, as a new process would): each compiles its step once, and the
origins' steps serve the resumes that share them. A resume in a new process is what the crash
test's every process is."""

import concurrent.futures
import contextlib
import io
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from helpers import TINY_RUN, records, small_corpus, start_hotjax, table

from hotjax.checkpoint import dirs
from hotjax.cli import main


def _start(flags: list[str], devices: int, cwd: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """`hotjax train` in a new process with `devices` simulated devices, in `cwd`; stderr to a
    file."""
    err = cwd / f"{name}.err"
    with err.open("w") as sink:
        process = start_hotjax(*TINY_RUN, *flags, cwd=cwd, devices=devices,
                               stdout=subprocess.DEVNULL, stderr=sink)
    return process, err


def _run(flags: list[str], devices: int, cwd: Path, name: str,
         timeout: float = 240.0) -> tuple[int, str]:
    """`_start` and wait; a process that stops making progress fails the test, not hangs it."""
    process, err = _start(flags, devices, cwd, name)
    try:
        return process.wait(timeout=timeout), err.read_text()
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"hotjax train {' '.join(flags)} did not finish in {timeout:.0f} s: "
                    f"{err.read_text()[-1500:]}")


def _train(flags: list[str], devices: int) -> tuple[int, str]:
    """`hotjax train` in this process on its first `devices` devices: exit code and stderr
    (unwrapped: rich would cut long paths at 80 columns)."""
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(err):
        patch.setenv("COLUMNS", "400")
        code = main([*TINY_RUN, "--devices", str(devices), *flags])
    return code, err.getvalue()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    """`--data` of every run here: a small corpus, measured in a moment."""
    return ["--data", str(small_corpus(tmp_path_factory.mktemp("corpus")))]


class Resume(NamedTuple):
    origin: str  # which uninterrupted run's step-2 checkpoint it resumes: a key of ORIGINS
    devices: int
    flags: tuple[str, ...]


# Uninterrupted runs on 8 devices, each saving at steps 2 and 4.
ORIGINS = {"data": ("--strategy", "data=8"), "fsdp": ("--strategy", "fsdp=8"),
           "table": ("--strategies", str(table("dp")))}
# One entry per layout: adding a layout (a new rule set, mesh or table) is one line here.
RESUMES = {
    "8->4 devices": Resume("data", 4, ("--strategy", "data=4")),
    "data->fsdp": Resume("data", 8, ("--strategy", "fsdp=8")),
    "fsdp->data": Resume("fsdp", 8, ("--strategy", "data=8")),
    "8->2 devices": Resume("fsdp", 2, ("--strategy", "fsdp=2")),
    "fsdp->tensor": Resume("fsdp", 8, ("--strategy", "data=2,tensor=4")),
    "data->context": Resume("data", 8, ("--strategy", "data=4,context=2")),
    # The same buckets and row multiples under another strategy.
    "another bucket table": Resume("table", 8, ("--strategies", str(table("zero2")))),
}


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory) -> dict[str, tuple[list[dict], Path]]:
    """Per origin: its four steps' metrics, and its checkpoints (steps 2 and 4)."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    runs = {}
    for origin, flags in ORIGINS.items():
        metrics, ckpt = directory / f"{origin}.jsonl", directory / origin
        code, err = _train([*data, "--steps", "4", *flags, "--ckpt-dir", str(ckpt),
                            "--save-every", "2", "--metrics-jsonl", str(metrics)], 8)
        assert code == 0, err
        runs[origin] = records(metrics), ckpt
    return runs


@pytest.fixture(scope="module")
def resumed(data, uninterrupted, tmp_path_factory) -> dict[str, tuple[int, str, list[dict]]]:
    """Every resume in RESUMES: exit code, stderr, metrics."""
    directory = tmp_path_factory.mktemp("resumed")
    runs = {}
    for i, (name, layout) in enumerate(RESUMES.items()):
        metrics = directory / f"{i}.jsonl"
        step_2 = uninterrupted[layout.origin][1] / "2"
        code, err = _train([*data, "--steps", "4", *layout.flags, "--resume-from",
                            str(step_2), "--metrics-jsonl", str(metrics)], layout.devices)
        runs[name] = code, err, records(metrics)
    return runs


@pytest.mark.parametrize("name", RESUMES)
def test_resumed_steps_equal_the_uninterrupted_run(name, resumed, uninterrupted):
    code, err, records = resumed[name]
    assert code == 0, err
    assert "(step 2)" in err and "resumed from" in err
    reference = uninterrupted[RESUMES[name].origin][0]
    assert [r["step"] for r in records] == [3, 4]
    np.testing.assert_allclose([r["loss"] for r in records],
                               [r["loss"] for r in reference[2:]], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------- crash safety

STEPS = 16
# One device and two rows a step: the cheapest process that still trains, saves and restores
# for real (the tests' unoptimized machine code runs a 2,048-token step of `tiny` in ~1.5 s).
CRASH_TRAIN = ["--steps", str(STEPS), "--devices", "1", "--strategy", "data=1",
               "--batch-tokens", "512"]
CRASH_RUN = [*CRASH_TRAIN, "--save-every", "1", "--keep-last", "2"]


class Trial(NamedTuple):
    kill: str  # "mid-save", "random" or "none" (runs to the end)
    start: int  # the step it resumed from
    records: list[dict]
    complete: list[int]  # complete checkpoints left behind
    partial: list[str]  # partial saves left behind


def _wait(condition, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and process.poll() is None:
        assert time.monotonic() < deadline, "the training process made no progress"
        time.sleep(0.002)


def _chain(directory: Path, seed: int, kills: int, data: list[str]) -> list[Trial]:
    """Training processes on one checkpoint directory: each of the first `kills` SIGKILLed
    after its first step, either as soon as a save is under way or after a seeded random
    delay; the last runs to the end. Each resumes from what the one before left."""
    rng = np.random.default_rng(seed)
    ckpt = directory / "ck"
    trials = []
    for i in range(kills + 1):
        kill = "none" if i == kills else ("mid-save", "random")[i % 2]
        metrics = directory / f"{i}.jsonl"
        start = max(dirs.steps(ckpt), default=0)
        flags = [*CRASH_RUN, *data, "--ckpt-dir", str(ckpt), "--metrics-jsonl", str(metrics)]
        if kill == "none":
            code, text = _run(flags, 1, directory, str(i))
            assert code == 0, text
        else:
            process, err = _start(flags, 1, directory, str(i))
            try:
                _wait(lambda m=metrics: len(records(m)) >= 1, process)
                if kill == "mid-save":
                    _wait(lambda: any(dirs.TMP_MARK in p.name for p in ckpt.iterdir()),
                          process)
                else:
                    time.sleep(rng.uniform(0.0, 0.6))
            finally:
                process.send_signal(signal.SIGKILL)
                process.wait()
            text = err.read_text()
        if start:
            assert f"resumed from {ckpt / str(start)} (step {start})" in text, text
        else:
            assert "resumed from" not in text, text
        trials.append(Trial(kill, start, records(metrics), dirs.steps(ckpt),
                            [p.name for p in ckpt.iterdir() if dirs.TMP_MARK in p.name]))
    return trials


def test_sigkill_at_any_moment_resumes_from_the_last_complete_checkpoint(data, tmp_path):
    reference = tmp_path / "reference.jsonl"
    assert main([*TINY_RUN, *CRASH_TRAIN, *data, "--metrics-jsonl", str(reference)]) == 0
    losses = {r["step"]: r["loss"] for r in records(reference)}
    chains = [tmp_path / "a", tmp_path / "b"]
    for chain in chains:
        chain.mkdir()
    # Two chains side by side (five kills each) halve the wall time on two cores.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        trials = [t for ts in pool.map(_chain, chains, [1, 2], [5, 5], [data] * 2)
                  for t in ts]

    assert sum(t.kill != "none" for t in trials) >= 10
    assert sum(bool(t.partial) for t in trials) >= 3, trials  # kills that hit a save
    for t in trials:
        # Each process continued at the exact data position: its steps are the next ones,
        # with the uninterrupted run's losses.
        assert [r["step"] for r in t.records] == list(range(t.start + 1,
                                                             t.start + 1 + len(t.records)))
        np.testing.assert_allclose([r["loss"] for r in t.records],
                                   [losses[r["step"]] for r in t.records], rtol=0, atol=1e-5)
        # A partial save is never among the complete ones, and lies past the newest of them.
        for name in t.partial:
            assert int(name.split(".")[0]) > max(t.complete, default=0)
    for last in (trials[5], trials[11]):
        assert last.kill == "none" and last.records[-1]["step"] == STEPS
        assert last.complete[-1] == STEPS
