"""Several processes, one run: `hotjax launch` runs training as 2 processes x 4 CPU devices
(gloo collectives between them) with the losses of one process on 8 devices; a checkpoint the
two processes wrote resumes in one process under another layout; a lost process ends the run
within seconds."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from hotjax.cli import main

TINY = ["train", "--model", "tiny", "--tokenizer", "bytes", "--compute-dtype", "float32",
        "--log-every", "1", "--context", "256", "--batch-tokens", "2048"]
HOT = """
[[bucket]]
max_len = 64
mesh = { data = 8 }
rules = "dp"
[[bucket]]
max_len = 128
mesh = { data = 2, tensor = 4 }
rules = "megatron"
[[bucket]]
max_len = 256
mesh = { context = 4, tensor = 2 }
rules = "megatron"
"""


def _launch_argv(*flags: str) -> list[str]:
    return [sys.executable, "-m", "hotjax.cli", "launch", "--processes", "2",
            "--devices-per-process", "4", "--", *TINY, *flags]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _one_process(tmp_path: Path, *flags: str) -> list[dict]:
    metrics = tmp_path / f"one-{len(list(tmp_path.glob('one-*')))}.jsonl"
    assert main([*TINY, *flags, "--metrics-jsonl", str(metrics)]) == 0
    return _records(metrics)


def test_two_processes_train_a_hot_table_as_one_process_does_and_one_resumes_it(tmp_path):
    (tmp_path / "hot.toml").write_text(HOT)
    flags = ["--steps", "5", "--strategies", str(tmp_path / "hot.toml")]
    ck = tmp_path / "ck"
    done = subprocess.run(_launch_argv(*flags, "--metrics-jsonl", str(tmp_path / "two.jsonl"),
                                       "--ckpt-dir", str(ck), "--save-every", "3",
                                       "--keep-every", "3"),
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    # Process 0 speaks for the run: its lines alone carry the progress and the summary.
    assert "[0] step     5" in done.stdout and "[1] step" not in done.stdout
    assert "jax.device_put: the run spans 2 processes" in done.stdout
    two = _records(tmp_path / "two.jsonl")
    one = _one_process(tmp_path, *flags)
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one],
                               rtol=0, atol=1e-5)
    # The checkpoint both processes wrote at step 3 resumes in one process, on 4 devices,
    # under one strategy: steps 4 and 5 as the two processes took them.
    resumed = _one_process(tmp_path, "--steps", "5", "--devices", "4", "--strategy",
                           "data=2,fsdp=2", "--resume-from", str(ck / "3"))
    assert [r["step"] for r in resumed] == [4, 5]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in two[3:]],
                               rtol=0, atol=1e-5)


def test_a_lost_process_ends_the_launch_within_seconds(tmp_path):
    metrics = tmp_path / "m.jsonl"
    launcher = subprocess.Popen(
        _launch_argv("--steps", "1000", "--strategy", "fsdp=8", "--metrics-jsonl", str(metrics)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(_records(metrics)) >= 2):
            assert launcher.poll() is None and time.monotonic() < deadline, "never trained"
            time.sleep(0.5)
        # Process 1 is the launcher's child whose command line ends with "--process-id 1".
        children = subprocess.run(["pgrep", "-P", str(launcher.pid), "-f", "process-id 1$"],
                                  capture_output=True, text=True).stdout.split()
        assert len(children) == 1, children
        os.kill(int(children[0]), signal.SIGKILL)
        killed = time.monotonic()
        output, _ = launcher.communicate(timeout=60)
        assert time.monotonic() - killed < 60
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGKILL
    assert "hotjax launch: process 1 exited with code -9; the others were stopped" in output
