"""Several processes, one run: `hotjax launch` runs training as 2 processes x 4 CPU devices
(gloo collectives between them) with the losses of one process on 8 devices; checkpoints pass
between one process and two under other layouts; a process lost mid-step or mid-save ends the
run within seconds, and reruns resume from the last complete checkpoint as if never stopped."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hotjax.checkpoint import store
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
    saves = ["--save-every", "3", "--keep-every", "3"]
    done = subprocess.run(_launch_argv(*flags, "--metrics-jsonl", str(tmp_path / "two.jsonl"),
                                       "--ckpt-dir", str(ck), *saves),
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    # Process 0 speaks for the run: its lines alone carry the progress and the summary.
    assert "[0] step     5" in done.stdout and "[1] step" not in done.stdout
    assert "jax.device_put: the run spans 2 processes" in done.stdout
    two = _records(tmp_path / "two.jsonl")
    one = _one_process(tmp_path, *flags, "--ckpt-dir", str(tmp_path / "ck1"), *saves)
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
    # And the other way round: one process's checkpoint resumes in two, under fsdp.
    done = subprocess.run(_launch_argv("--steps", "5", "--strategy", "fsdp=8", "--resume-from",
                                       str(tmp_path / "ck1" / "3"), "--metrics-jsonl",
                                       str(tmp_path / "two-resumed.jsonl")),
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    resumed = _records(tmp_path / "two-resumed.jsonl")
    assert [r["step"] for r in resumed] == [4, 5]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in one[3:]],
                               rtol=0, atol=1e-5)


def _mixed_corpus(path: Path) -> Path:
    """Documents of a long-tailed mix: every sixth fills most of a 2048-token row, the rest are
    60-400 bytes; packed, rows of one long document beside rows of many short ones."""
    rng = np.random.default_rng(0)
    with path.open("w") as f:
        for i in range(300):
            n = 2000 if i % 6 == 0 else int(rng.integers(60, 400))
            f.write(json.dumps({"text": "".join(rng.choice(list("abcdefgh "), n))}) + "\n")
    return path


def test_two_pinned_processes_of_one_device_train_balanced_data_parallel_as_one_device(tmp_path):
    """The testbed: 2 processes of one CPU device, each pinned to its own core; `data=2`
    places rows on the two by estimated work, and the losses are one device's."""
    (tmp_path / "dp.toml").write_text('[[bucket]]\nmax_len = 2048\nmesh = { data = 2 }\n'
                                      'rules = "dp"\nmicro_rows = 4\n')
    flags = [*TINY[:TINY.index("--context")], "--data", str(_mixed_corpus(tmp_path / "d.jsonl")),
             "--context", "2048", "--batch-tokens", "16384", "--steps", "2"]
    done = subprocess.run([sys.executable, "-m", "hotjax.cli", "launch", "--processes", "2",
                           "--devices-per-process", "1", "--", *flags, "--strategies",
                           str(tmp_path / "dp.toml"), "--metrics-jsonl",
                           str(tmp_path / "two.jsonl")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    first = done.stdout.splitlines()[0]
    assert "2 processes x 1 CPU device, each pinned to its own cores (core 0 | core 1)" in first
    two = _records(tmp_path / "two.jsonl")
    metrics = tmp_path / "one.jsonl"
    assert main([*flags, "--devices", "1", "--metrics-jsonl", str(metrics)]) == 0
    one = _records(metrics)
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one],
                               rtol=0, atol=1e-5)
    # Placed by work, the shards even out: step 2's packing order gave one shard 12 % more.
    assert [r["imbalance_before"] for r in two] == pytest.approx([1.041, 1.125], abs=1e-3)
    assert [r["imbalance"] for r in two] == pytest.approx([1.027, 1.009], abs=1e-3)
    assert all(r["imbalance"] == r["imbalance_before"] == 1 for r in one)


FAULTS = ["--steps", "14", "--strategy", "fsdp=8"]


def _process_1(launcher: subprocess.Popen) -> int:
    """The launcher's child whose command line ends with "--process-id 1"."""
    children = subprocess.run(["pgrep", "-P", str(launcher.pid), "-f", "process-id 1$"],
                              capture_output=True, text=True).stdout.split()
    assert len(children) == 1, children
    return int(children[0])


def _wait(condition, launcher: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert launcher.poll() is None and time.monotonic() < deadline, "made no progress"
        time.sleep(0.002)


def _saving(ck: Path) -> list[Path]:
    return [p for p in ck.iterdir() if store.TMP_MARK in p.name] if ck.is_dir() else []


def _kill_process_1(launcher: subprocess.Popen, moment: str, ck: Path, metrics: Path
                    ) -> tuple[str, list[Path]]:
    """SIGKILLs process 1 at `moment`: once two steps are done ("mid-step"), or while a save is
    under way ("mid-save": process 1 is stopped as soon as a save appears, and killed if the
    save is still unfinished, else let go until the next). The launcher's output, and the
    partial saves the kill left."""
    try:
        _wait(lambda: metrics.exists() and len(_records(metrics)) >= 2, launcher)
        process_1 = _process_1(launcher)
        while moment == "mid-save":
            _wait(lambda: _saving(ck), launcher)
            os.kill(process_1, signal.SIGSTOP)
            partial = _saving(ck)
            if partial:
                break
            os.kill(process_1, signal.SIGCONT)
        left = _saving(ck)
        os.kill(process_1, signal.SIGKILL)
        killed = time.monotonic()
        output, _ = launcher.communicate(timeout=60)
        assert time.monotonic() - killed < 60
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGKILL
    assert "hotjax launch: process 1 exited with code -9; the others were stopped" in output
    # Process 0 stops by the launcher's signal or with a one-line error, never a traceback.
    assert "Traceback" not in output, output[-3000:]
    return output, left


def test_a_lost_process_ends_the_launch_and_a_rerun_resumes_as_if_never_stopped(tmp_path):
    """Process 1 is killed mid-step, then, in the rerun, mid-save; the last rerun trains to the
    end. Each rerun resumes from the newest complete checkpoint, never a partial one, and every
    step's loss is the uninterrupted run's."""
    reference = {r["step"]: r["loss"] for r in _one_process(tmp_path, *FAULTS)}
    ck = tmp_path / "ck"
    runs = []
    for i, moment in enumerate(("mid-step", "mid-save", None)):
        metrics = tmp_path / f"run-{i}.jsonl"
        start = max(store.steps(ck), default=0)
        argv = _launch_argv(*FAULTS, "--ckpt-dir", str(ck), "--save-every", "2", "--keep-last",
                            "2", "--metrics-jsonl", str(metrics))
        wide = {**os.environ, "COLUMNS": "400"}  # rich would wrap the checkpoint's path
        if moment is None:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                                  cwd=tmp_path, env=wide)
            assert done.returncode == 0, done.stdout[-3000:]
            output, partial = done.stdout, []
        else:
            launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, cwd=tmp_path, env=wide)
            output, partial = _kill_process_1(launcher, moment, ck, metrics)
        if start:
            assert f"resumed from {ck / str(start)} (step {start})" in output, output[-3000:]
        records = _records(metrics)
        assert [r["step"] for r in records] == list(range(start + 1, start + 1 + len(records)))
        np.testing.assert_allclose([r["loss"] for r in records],
                                   [reference[r["step"]] for r in records], rtol=0, atol=1e-5)
        runs.append((moment, records, partial, store.steps(ck)))
    (_, _, _, after_step), (_, _, partial, after_save), (_, last, _, final) = runs
    assert after_step and len(partial) == 1  # the kill hit a save
    saving = int(partial[0].name.split(".")[0])
    assert saving not in after_save and saving > max(after_save)  # the partial one never used
    assert last[-1]["step"] == 14 and final[-1] == 14


def test_a_collective_failing_for_a_lost_peer_is_one_line_naming_it():
    from hotjax.distributed import lost_peer

    gloo = RuntimeError("UNKNOWN: Gloo AllGather failed: [pair.cc:538] Read error "
                        "[127.0.0.1]:38078: Connection reset by peer\nmore detail")
    assert lost_peer(gloo, 0, 2) == (
        "process 1 of the run is gone (UNKNOWN: Gloo AllGather failed: [pair.cc:538] Read error "
        "[127.0.0.1]:38078: Connection reset by peer): process 0 stops too; rerun the command "
        "to resume from the last complete checkpoint")
    assert lost_peer(gloo, 2, 4).startswith("another process of the run is gone")
    assert lost_peer(RuntimeError("RESOURCE_EXHAUSTED: out of memory"), 0, 2) is None
    assert lost_peer(gloo, 0, 1) is None  # one process has no peers to lose


def test_background_logs_of_a_lost_peer_leave_the_report_to_the_one_line(caplog):
    """Orbax's save threads log a failed collective with its traceback; in a run of several
    processes those records are dropped (the main thread's one line reports the lost peer),
    and every other error still logs in full."""
    import logging

    from absl import logging as absl_logging

    from hotjax.distributed import _without_lost_peers

    logger = logging.getLogger("absl")
    logger.addFilter(_without_lost_peers)
    try:
        for cause in ("Gloo AllGather failed: Connection closed by peer [127.0.0.1]:36757",
                      "disk full"):
            try:
                raise RuntimeError(cause)
            except RuntimeError:
                absl_logging.exception("_SignalingThread.run() raised an exception")
            try:  # the same, wrapped by a caller
                try:
                    raise RuntimeError(cause)
                except RuntimeError as e:
                    raise ValueError("Failed to run the Commit operations") from e
            except ValueError:
                absl_logging.exception("background save thread failed")
    finally:
        logger.removeFilter(_without_lost_peers)
    assert [str(r.exc_info[1]) for r in caplog.records] == [
        "disk full", "Failed to run the Commit operations"]


def test_plan_measures_the_devices_of_every_process_as_nodes(tmp_path):
    """`hotjax launch ... -- plan --measure` profiles 2 processes x 2 devices as 2 nodes of 2:
    groups inside a process are intra-node, groups spanning both are inter-node; process 0
    alone reports and writes the table, for the 4 devices."""
    from hotjax.planning.cost import COST_MODEL_VERSION
    from hotjax.planning.profile import load_profile
    from sharding.table import load_table

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "HOTJAX_CACHE": str(tmp_path / "cache")}

    def plan(*flags: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "hotjax.cli", "launch", "--processes", "2",
             "--devices-per-process", "2", "--", "plan", "--model", "tiny", "--lengths",
             str(root / "docs" / "stdlib-lengths.json"), "--context", "1024", *flags],
            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout + done.stderr

    output = plan("--measure", "--out", str(tmp_path / "planned.toml"))
    profile = load_profile(tmp_path / "cache" / "profiles" /
                           f"cost-model-v{COST_MODEL_VERSION}" / "cpu-4x2.toml")
    assert (profile.name, profile.nodes, profile.devices_per_node) == ("measured-cpu-2x2", 2, 2)
    for name, bandwidths in profile.collectives:
        assert [g for g, _ in bandwidths.intra] == [2], name
        assert [g for g, _ in bandwidths.inter] == [2, 4], name
        assert all(b > 0 for _, b in (*bandwidths.intra, *bandwidths.inter))
    assert profile.inter_node_bandwidth > 0 and profile.intra_node_bandwidth > 0
    assert "[0] table written to" in output and "[1] table written to" not in output
    table = load_table(tmp_path / "planned.toml")
    table.check_devices(4)
    assert table.max_len == 1024
    # Planning again reads the cached profile (process 0's, for both): nothing is measured.
    again = plan("--json")
    assert "measuring" not in again and '"profile": "measured-cpu-2x2"' in again
