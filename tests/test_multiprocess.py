"""Several processes, one run: `hotjax launch` runs training as 2 processes x 4 CPU devices
(gloo collectives between them) with the losses of one process on 8 devices; checkpoints pass
between one process and two under other layouts; a process lost mid-step or mid-save ends the
run within seconds, one that stops answering within a minute in one line, a stop signal to the
launcher saves on every process, and reruns resume from the last complete checkpoint as if never
stopped."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, TINY_RUN, hotjax, load_file, records, start_hotjax, table, write_table

from hotjax.checkpoint import dirs
from hotjax.cli import main
from hotjax.preemption import REQUEUE_EXIT


def _launch(*flags: str, devices_per_process: int = 4) -> list[str]:
    """`hotjax launch`'s arguments: the tiny run as 2 processes."""
    return ["launch", "--processes", "2", "--devices-per-process", str(devices_per_process),
            "--", *TINY_RUN, *flags]


def _one_process(tmp_path: Path, *flags: str) -> list[dict]:
    metrics = tmp_path / f"one-{len(list(tmp_path.glob('one-*')))}.jsonl"
    assert main([*TINY_RUN, *flags, "--metrics-jsonl", str(metrics)]) == 0
    return records(metrics)


def test_two_processes_train_a_hot_table_as_one_process_does_and_one_resumes_it(tmp_path):
    """2 processes x 4 devices train the hot table with the losses of one process on 8
    devices; the checkpoint the two wrote resumes in one process under another strategy, and
    the one process's in two under fsdp. A step of the hot table across 2 processes is slow
    (its layout switches are device_puts between the processes): 2 steps, saving at step 1,
    are the fewest that leave a checkpoint to resume and a step after it."""
    flags = ["--steps", "2", "--strategies", str(table("hot"))]
    ck = tmp_path / "ck"
    saves = ["--save-every", "1"]
    done = hotjax(*_launch(*flags, "--metrics-jsonl", str(tmp_path / "two.jsonl"),
                           "--ckpt-dir", str(ck), *saves), cwd=tmp_path)
    assert (ck / ".hotjax.lock").is_file()  # taken by process 0 alone: a second would fail
    # Process 0 speaks for the run: its lines alone carry the progress and the summary.
    assert "[0] step     2" in done.stdout and "[1] step" not in done.stdout
    assert "jax.device_put: the run spans 2 processes" in done.stdout
    two = records(tmp_path / "two.jsonl")
    one = _one_process(tmp_path, *flags, "--ckpt-dir", str(tmp_path / "ck1"), *saves)
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one],
                               rtol=0, atol=1e-5)
    # The checkpoint both processes wrote at step 1 resumes in one process, on 4 devices,
    # under one strategy: step 2 as the two processes took it.
    resumed = _one_process(tmp_path, "--steps", "2", "--devices", "4", "--strategy",
                           "data=2,fsdp=2", "--resume-from", str(ck / "1"))
    assert [r["step"] for r in resumed] == [2]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in two[1:]],
                               rtol=0, atol=1e-5)
    # And the other way round: one process's checkpoint resumes in two, under fsdp.
    hotjax(*_launch("--steps", "2", "--strategy", "fsdp=8", "--resume-from",
                    str(tmp_path / "ck1" / "1"), "--metrics-jsonl",
                    str(tmp_path / "two-resumed.jsonl")), cwd=tmp_path)
    resumed = records(tmp_path / "two-resumed.jsonl")
    assert [r["step"] for r in resumed] == [2]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in one[1:]],
                               rtol=0, atol=1e-5)


def _mixed_corpus(path: Path) -> Path:
    """Documents of a long-tailed mix: every sixth fills most of a 1024-token row, the rest are
    30-200 bytes; packed, rows of one long document beside rows of many short ones."""
    rng = np.random.default_rng(0)
    with path.open("w") as f:
        for i in range(300):
            n = 1000 if i % 6 == 0 else int(rng.integers(30, 200))
            f.write(json.dumps({"text": "".join(rng.choice(list("abcdefgh "), n))}) + "\n")
    return path


def test_two_pinned_processes_of_one_device_train_balanced_data_parallel_as_one_device(tmp_path):
    """The testbed: 2 processes of one CPU device, each pinned to its own core; `data=2`
    places rows on the two by estimated work, and the losses are one device's."""
    dp = write_table(tmp_path / "dp.toml", {"max_len": 1024, "mesh": "data = 2", "rules": "dp",
                                            "micro_rows": 4})
    flags = ["--data", str(_mixed_corpus(tmp_path / "d.jsonl")), "--context", "1024",
             "--batch-tokens", "8192", "--steps", "2"]  # later flags win over TINY_RUN's
    done = hotjax(*_launch(*flags, "--strategies", str(dp), "--metrics-jsonl",
                           str(tmp_path / "two.jsonl"), devices_per_process=1), cwd=tmp_path)
    first = done.stdout.splitlines()[0]
    assert "2 processes x 1 CPU device, each pinned to its own cores (core 0 | core 1)" in first
    two = records(tmp_path / "two.jsonl")
    metrics = tmp_path / "one.jsonl"
    assert main([*TINY_RUN, *flags, "--devices", "1", "--strategy", "data=1", "--metrics-jsonl",
                 str(metrics)]) == 0
    one = records(metrics)
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one],
                               rtol=0, atol=1e-5)
    # Placed by work, the shards even out: step 2's packing order gave one shard 5 % more.
    assert [r["imbalance_before"] for r in two] == pytest.approx([1.028, 1.047], abs=1e-3)
    assert [r["imbalance"] for r in two] == pytest.approx([1.014, 1.007], abs=1e-3)
    assert all(r["imbalance"] == r["imbalance_before"] == 1 for r in one)


# Saving every 2 steps, 10 steps leave the rerun that is killed mid-save three saves to catch
# (steps 6, 8, 10) after the two steps it waits for.
FAULT_STEPS = 10
FAULTS = ["--steps", str(FAULT_STEPS), "--strategy", "fsdp=8"]


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
    return [p for p in ck.iterdir() if dirs.TMP_MARK in p.name] if ck.is_dir() else []


def _kill_process_1(launcher: subprocess.Popen, moment: str, ck: Path, metrics: Path
                    ) -> tuple[str, list[Path]]:
    """SIGKILLs process 1 at `moment`: once two steps are done ("mid-step"), or while a save is
    under way ("mid-save": process 1 is stopped as soon as a save appears, and killed if the
    save is still unfinished, else let go until the next). The launcher's output, and the
    partial saves the kill left."""
    try:
        _wait(lambda: metrics.exists() and len(records(metrics)) >= 2, launcher)
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
        start = max(dirs.steps(ck), default=0)
        args = _launch(*FAULTS, "--ckpt-dir", str(ck), "--save-every", "2", "--keep-last", "2",
                       "--metrics-jsonl", str(metrics))
        if moment is None:
            output, partial = hotjax(*args, cwd=tmp_path).stdout, []
        else:
            launcher = start_hotjax(*args, cwd=tmp_path)
            output, partial = _kill_process_1(launcher, moment, ck, metrics)
        if start:
            assert f"resumed from {ck / str(start)} (step {start})" in output, output[-3000:]
        steps = records(metrics)
        assert [r["step"] for r in steps] == list(range(start + 1, start + 1 + len(steps)))
        np.testing.assert_allclose([r["loss"] for r in steps],
                                   [reference[r["step"]] for r in steps], rtol=0, atol=1e-5)
        runs.append((moment, steps, partial, dirs.steps(ck)))
    (_, _, _, after_step), (_, _, partial, after_save), (_, last, _, final) = runs
    assert after_step and len(partial) == 1  # the kill hit a save
    saving = int(partial[0].name.split(".")[0])
    assert saving not in after_save and saving > max(after_save)  # the partial one never used
    assert last[-1]["step"] == FAULT_STEPS and final[-1] == FAULT_STEPS


# Two processes of one CPU device each, pinned to its own core: data parallel over both.
PINNED = ["--steps", "6", "--strategy", "data=2"]


def _pinned_launch(tmp_path: Path, *flags: str) -> subprocess.Popen:
    return start_hotjax(*_launch(*PINNED, *flags, devices_per_process=1), cwd=tmp_path)


def _end(launcher: subprocess.Popen, timeout: float) -> str:
    """The launcher's output once it exits within `timeout` seconds (else it is killed)."""
    try:
        return launcher.communicate(timeout=timeout)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_sigterm_to_a_pinned_launch_saves_the_step_reached_and_the_rerun_resumes_equal(tmp_path):
    """SIGTERM to the launcher mid-run: both processes finish the step under way, save it
    (each its own part of one complete checkpoint) and exit 75, as does the launcher; the same
    command again trains the remaining steps with the uninterrupted run's losses."""
    reference = {r["step"]: r["loss"] for r in _one_process(tmp_path, *PINNED, "--devices", "2")}
    ck, metrics = tmp_path / "ck", tmp_path / "two.jsonl"
    flags = ["--ckpt-dir", str(ck), "--metrics-jsonl", str(metrics)]
    launcher = _pinned_launch(tmp_path, *flags)
    try:
        _wait(lambda: metrics.exists() and len(records(metrics)) >= 1, launcher)
        launcher.send_signal(signal.SIGTERM)
    finally:
        output = _end(launcher, 120)
    reached = records(metrics)[-1]["step"]
    assert launcher.returncode == REQUEUE_EXIT and 1 <= reached < 6, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert (f"[0] hotjax: preempted at step {reached}: saved {ck / str(reached)}; rerun the same "
            f"command to resume") in output
    assert "[1] hotjax:" not in output  # process 0 speaks for the run
    assert output.rstrip().endswith(f"hotjax launch: the run was stopped and saved; exit "
                                    f"{REQUEUE_EXIT} (rerun the same command to resume)")
    assert dirs.steps(ck) == [reached] and not _saving(ck)
    for item in ("params", "opt_state"):
        assert {d.name for d in (ck / str(reached) / item).glob("ocdbt.process_*")} == {
            "ocdbt.process_0", "ocdbt.process_1"}
    first = records(metrics)

    again = _pinned_launch(tmp_path, *flags)
    output = _end(again, 300)
    assert again.returncode == 0, output[-3000:]
    assert f"resumed from {ck / str(reached)} (step {reached})" in output, output[-3000:]
    steps = [*first, *records(metrics)]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([r["loss"] for r in steps],
                               [reference[r["step"]] for r in steps], rtol=0, atol=1e-5)


HEARTBEAT_S = 10
ENDED_WITHIN_S = 60  # JAX finds the silence within about 2 x HEARTBEAT_S; a loaded machine


def test_a_peer_that_stops_answering_ends_every_process_in_one_line_within_a_minute(tmp_path):
    """Process 1 is stopped (SIGSTOP: neither dead nor answering) mid-run. JAX's heartbeat
    finds it, its runtime fails the run with a fatal C++ log and an abort in process 0; the
    launcher ends every process, process 1 included, and says what happened in one line of
    its own, within ENDED_WITHIN_S of the stop."""
    metrics = tmp_path / "two.jsonl"
    launcher = _pinned_launch(tmp_path, "--heartbeat-timeout", str(HEARTBEAT_S),
                              "--metrics-jsonl", str(metrics))
    try:
        _wait(lambda: metrics.exists() and len(records(metrics)) >= 1, launcher)
        children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                  text=True).stdout.split()
        process_1 = _process_1(launcher)
        os.kill(process_1, signal.SIGSTOP)
        stopped = time.monotonic()
    finally:
        output = _end(launcher, ENDED_WITHIN_S)
    assert time.monotonic() - stopped < ENDED_WITHIN_S
    assert launcher.returncode == 2, output[-3000:]
    ours = [line for line in output.splitlines() if "hotjax:" in line]
    assert ours == [f"hotjax: error: process 1 of the run stopped answering (no heartbeat for "
                    f"{HEARTBEAT_S} s): every process was ended; rerun the command to resume "
                    f"from the last complete checkpoint"], output[-3000:]
    # JAX's own report (a fatal log, a stack trace) is left out, and no traceback is shown.
    for noise in ("Terminating process", "Check failure", "coordination_service", "Traceback"):
        assert noise not in output, output[-3000:]
    assert len(children) == 2
    for child in map(int, children):  # none left behind, stopped or not
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)


# What JAX 0.10's runtime prints as it aborts a process: the coordinator (process 0) found
# process 1 silent, or process 1 found the coordinator silent. Then a line that is not JAX's.
SILENT_1 = (
    "E1126 03:01:42.037103    4558 coordination_service.cc:1549] [98563] Use error polling to "
    "propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy "
    "(stopped sending heartbeats):\n1\n"
    "The tasks have crashed. Check the task logs for an earlier error.\n"
    "F1126 03:01:42.879348    5884 client.h:80] Terminating process because the JAX distributed "
    "service detected fatal errors. absl::Status: UNAVAILABLE: ...\n"
    "*** Check failure stack trace: ***\n"
    "    @     0x7f84b3440634  absl::lts_20260107::log_internal::LogMessage::SendToLog()\n")
SILENT_0 = (
    "F1126 03:03:20.129158    6179 client.h:80] Terminating process because the JAX distributed "
    "service detected fatal errors. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded\n\n"
    "RPC: /xla.coordination.CoordinationService/Heartbeat\n*** Check failure stack trace: ***\n")


@pytest.mark.parametrize(("log", "aborts", "silent"), [
    (SILENT_1, True, "process 1"), (SILENT_0, True, "process 0"),
    (SILENT_1.replace("\n1\n", "\n/job:jax_worker/replica:0/task:1\n"), True, "process 1"),
    # The service's error lines, from a process that then ends otherwise, are all shown.
    (SILENT_1[:SILENT_1.index("F1126")], False, None)])
def test_the_launcher_reads_jax_s_fatal_log_as_the_process_that_stopped_answering(
        log, aborts, silent):
    import io

    from hotjax.launch import _Relay

    code = f"import os, sys; sys.stdout.write({log + 'after'!r}); sys.stdout.flush(); " + (
        "os.abort()" if aborts else "sys.exit(1)")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    out = io.StringIO()
    relay = _Relay(process, "[0] ", out)
    relay.start()
    relay.join(30)
    assert relay.silent_process(2) == silent
    shown = out.getvalue()
    assert shown == ("" if silent else "".join(f"[0] {line}" for line in
                                               (log + "after").splitlines(keepends=True)))


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


def test_a_launched_benchmark_losing_a_peer_is_one_line_naming_it():
    import jax

    from hotjax.errors import UserError

    quick_option = load_file("scripts/quick_option.py")

    def run(error):
        def raising(args, progress):
            raise error
        return raising

    gloo = jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllReduce failed: Connection closed by peer")
    with pytest.raises(UserError) as raised:
        quick_option._run_launched(run(gloo), None, None, ("127.0.0.1:1234", 2, 1, 30))
    assert str(raised.value) == (
        "process 0 of the run is gone (UNKNOWN: Gloo AllReduce failed: Connection closed by "
        "peer): process 1 stops too; rerun the benchmark")
    # Anything else, or in a process not launched, is the error it was.
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        quick_option._run_launched(run(oom), None, None, ("127.0.0.1:1234", 2, 1, 30))
    with pytest.raises(jax.errors.JaxRuntimeError, match="Gloo"):
        quick_option._run_launched(run(gloo), None, None, (None, None, None, 30))
    assert quick_option._run_launched(lambda args, progress: {"ok": 1}, None, None,
                                      (None, None, None, 30)) == {"ok": 1}


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
    from hotjax.sharding.table import load_table

    def plan(*flags: str) -> str:
        done = hotjax("launch", "--processes", "2", "--devices-per-process", "2", "--", "plan",
                      "--model", "tiny", "--lengths", ROOT / "docs" / "stdlib-lengths.json",
                      "--context", "1024", *flags, cwd=tmp_path,
                      env={"HOTJAX_CACHE": str(tmp_path / "cache")})
        return done.stdout + done.stderr

    output = plan("--measure", "--quick-measure", "--out", str(tmp_path / "planned.toml"))
    profile = load_profile(tmp_path / "cache" / "profiles" /
                           f"cost-model-v{COST_MODEL_VERSION}" / "cpu-4x2.toml")
    assert (profile.name, profile.nodes, profile.devices_per_node) == ("measured-cpu-2x2", 2, 2)
    for name, bandwidths in profile.collectives:
        assert [g for g, _ in bandwidths.intra] == [2], name
        assert [g for g, _ in bandwidths.inter] == [2, 4], name
        assert all(b > 0 for _, b in (*bandwidths.intra, *bandwidths.inter))
    assert profile.inter_node_bandwidth > 0 and profile.intra_node_bandwidth > 0
    assert "[0] table written to" in output and "[1] table written to" not in output
    planned = load_table(tmp_path / "planned.toml")
    planned.check_devices(4)
    assert planned.max_len == 1024
    # Planning again reads the cached profile (process 0's, for both): nothing is measured.
    again = plan("--json")
    assert "measuring" not in again and '"profile": "measured-cpu-2x2"' in again


def test_processes_of_a_launcher_killed_outright_are_stopped_by_the_kernel(tmp_path):
    """SIGKILL to the launcher leaves it no time to stop its processes: each was asked of the
    kernel to be sent SIGTERM when the launcher dies, so none runs on."""
    started = tmp_path / "started"
    child = f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(300)"
    launcher = subprocess.Popen([sys.executable, "-c", (
        "import sys; from hotjax import launch; "
        f"sys.exit(launch.run([sys.executable, '-c', {child!r}], 2, 1, pin=False))")])
    deadline, children = time.monotonic() + 60, []
    while (not started.exists() or len(children) < 2) and time.monotonic() < deadline:
        time.sleep(0.1)
        children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True,
                                  text=True).stdout.split()
    assert len(children) == 2
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in children)


def test_an_uncaught_error_in_a_process_of_a_run_exits_at_once():
    """A process of several that fails exits with code 1 right after its traceback, without
    JAX's shutdown barrier (here an exit handler that would wait a minute), so that the launcher
    sees it and stops the peer waiting for it in a collective."""
    script = ("import atexit, sys, time\n"
              "from hotjax.distributed import exit_at_once\n"
              "atexit.register(time.sleep, 60)\n"
              "sys.excepthook = exit_at_once(sys.excepthook)\n"
              "print('started', flush=True)\n"
              "raise RuntimeError('Gloo context initialization failed')\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=50)
    assert time.monotonic() - started < 30
    assert done.returncode == 1 and done.stdout == "started\n"
    assert done.stderr.rstrip().endswith("RuntimeError: Gloo context initialization failed")


def test_processes_wait_for_each_other_at_the_coordination_service():
    """`together` holds every process until the slowest arrives (process 1, 3 s late here), with
    no collective: what each process does after compiling, before gloo's 30 s rendezvous."""
    script = ("import sys, time\n"
              "from hotjax.distributed import initialize, together\n"
              "initialize(sys.argv[1], 2, int(sys.argv[2]))\n"
              "time.sleep(3 * int(sys.argv[2]))\n"
              "arrived = time.time()\n"
              "together('test')\n"
              "print(arrived, time.time(), flush=True)\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    env = os.environ | {"JAX_NUM_CPU_DEVICES": "1"}
    processes = [subprocess.Popen([sys.executable, "-c", script, coordinator, str(i)], cwd=ROOT,
                                  env=env, stdout=subprocess.PIPE, text=True) for i in (0, 1)]
    (arrived_0, left_0), (arrived_1, left_1) = (
        map(float, p.communicate(timeout=120)[0].split()) for p in processes)
    assert [p.returncode for p in processes] == [0, 0]
    assert left_0 >= arrived_1 and left_0 - arrived_0 > 2  # process 0 waited for process 1
    assert left_1 - arrived_1 < 2
