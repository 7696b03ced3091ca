"""A checkpoint directory is one run's, and a write it refuses ends the run: read-only at the
start or mid-run, or removed mid-run, the run ends within seconds in one line naming the cause
(exit 2) and its earlier checkpoints resume; a second run, or launch, on a directory in use
stops at its start naming the holder, until the holder ends, however it ends."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import hotjax, records
from test_preemption import RUN, _Run, corpus  # noqa: F401 - corpus: a fixture

from hotjax.checkpoint import dirs, lock
from hotjax.cli import main

ENDS_WITHIN_S = 60  # from the fault to the process's exit: seconds, not Orbax's 300 s timeouts


class _ReadOnly:
    """A tmpfs mounted at `path`, remounted read-only on `freeze` (permissions do not stop
    root, whom mounting needs)."""

    def __init__(self, path: Path):
        self.path = path
        path.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)],
                                 capture_output=True, text=True)
        if mounted.returncode != 0:
            pytest.skip(f"mounting a tmpfs needs root: {mounted.stderr.strip()}")

    def freeze(self, pid: int | None = None) -> None:
        """Read-only from now on. `pid`, a process writing there, is paused while the mount
        changes: a file it holds open for writing (an unfinished save) refuses the change."""
        deadline = time.monotonic() + 30
        while True:
            if pid:
                os.kill(pid, signal.SIGSTOP)
            try:
                done = subprocess.run(["mount", "-o", "remount,ro", str(self.path)],
                                      capture_output=True).returncode == 0
            finally:
                if pid:
                    os.kill(pid, signal.SIGCONT)
            if done:
                return
            assert time.monotonic() < deadline, "the file system stayed writable"
            time.sleep(0.01)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


@pytest.fixture
def read_only(tmp_path):
    fs = _ReadOnly(tmp_path / "fs")
    try:
        yield fs
    finally:
        fs.unmount()


def _errors(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if "hotjax" in line and "error" in line]


def test_a_read_only_ckpt_dir_stops_the_run_at_its_start_in_one_line(read_only, capsys):
    """A new directory there, or the read-only directory itself: one line, exit 2, before
    anything is compiled."""
    read_only.freeze()
    for ck in (read_only.path / "ck", read_only.path):
        started = time.monotonic()
        assert main([*RUN, "--ckpt-dir", str(ck)]) == 2
        assert time.monotonic() - started < ENDS_WITHIN_S
        err = capsys.readouterr().err
        assert _errors(err) == [f"hotjax: error: --ckpt-dir {ck}: cannot write there "
                                f"(Read-only file system): choose a writable --ckpt-dir"]
        assert "compiled" not in err


def _saving_in_the_background(ck: Path, tmp_path: Path, monkeypatch) -> _Run:
    """A run saving every step into `ck`, once step 2 is saved. One device in its process:
    its saves are written by Orbax's threads, as on an accelerator (simulated devices save
    in the main thread)."""
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "1")
    run = _Run("--ckpt-dir", str(ck), "--save-every", "1", cwd=tmp_path)
    run.wait_for(lambda: 2 in dirs.steps(ck))
    return run


def test_a_ckpt_dir_turned_read_only_mid_run_ends_it_and_its_earlier_steps_resume(
        read_only, tmp_path, monkeypatch):
    """Read-only once step 2 is saved: the next save fails in one line naming the read-only
    file system (not space), exit 2 within seconds; the steps it names intact resume."""
    ck = read_only.path / "ck"
    run = _saving_in_the_background(ck, tmp_path, monkeypatch)
    read_only.freeze(run.process.pid)
    frozen = time.monotonic()
    code, lines = run.end()
    assert time.monotonic() - frozen < ENDS_WITHIN_S
    kept = dirs.steps(ck)
    assert code == 2 and len(lines) == 1, lines
    assert re.fullmatch(
        rf"hotjax: error: --ckpt-dir {re.escape(str(ck))}: saving step \d+ failed \(Read-only "
        rf"file system\): choose a writable --ckpt-dir; the checkpoints of steps "
        rf"{', '.join(map(str, kept))} are intact", lines[0]), lines[0]
    assert 2 <= kept[-1] < 12

    metrics = tmp_path / "resumed.jsonl"
    assert main([*RUN, "--resume-from", str(ck), "--metrics-jsonl", str(metrics)]) == 0
    assert [r["step"] for r in records(metrics)] == list(range(kept[-1] + 1, 13))


def test_a_ckpt_dir_removed_mid_run_ends_it_in_one_line_naming_the_removal(
        tmp_path, monkeypatch):
    """Removed once step 2 is saved: the next save fails in one line (Orbax would otherwise
    make the directory anew and go on saving without the steps lost), exit 2 within seconds."""
    ck = tmp_path / "ck"
    run = _saving_in_the_background(ck, tmp_path, monkeypatch)
    run.process.send_signal(signal.SIGSTOP)
    try:
        shutil.rmtree(ck)
    finally:
        run.process.send_signal(signal.SIGCONT)
    removed = time.monotonic()
    code, lines = run.end()
    assert time.monotonic() - removed < ENDS_WITHIN_S
    assert code == 2 and len(lines) == 1, lines
    assert re.fullmatch(
        rf"hotjax: error: --ckpt-dir {re.escape(str(ck))}: saving step \d+ failed: the "
        rf"directory vanished \(removed or moved while the run wrote to it\): rerun with a "
        rf"--ckpt-dir that nothing else removes", lines[0]), lines[0]


HOLD = ("import sys, time\nfrom hotjax.checkpoint import lock\n"
        "lock.take(lock.writable(sys.argv[1]))\nprint('held', flush=True)\ntime.sleep(600)")


def _in_use(ck: Path, pid: int) -> str:
    return (rf"hotjax: error: --ckpt-dir {re.escape(str(ck))} is in use by hotjax pid {pid} on "
            rf"{re.escape(socket.gethostname())} since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d \S+: "
            rf"wait for it to end or choose another --ckpt-dir")


def test_a_second_run_on_a_ckpt_dir_stops_at_its_start_until_the_holder_is_killed(
        tmp_path, capsys):
    """While another process holds the directory: one line naming its pid, host and start,
    exit 2, before anything is compiled. Once it is killed (SIGKILL: nothing of its own
    unlocks), the run trains and saves there; the lock file is no checkpoint to Orbax,
    `dirs.find` or `hotjax ckpt inspect`."""
    ck = tmp_path / "ck"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(ck)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert main([*RUN, "--ckpt-dir", str(ck)]) == 2
        err = capsys.readouterr().err
        (line,) = _errors(err)
        assert re.fullmatch(_in_use(ck, holder.pid), line), line
        assert "compiled" not in err
    finally:
        holder.kill()
        holder.wait()
    assert main([*RUN, "--ckpt-dir", str(ck)]) == 0
    assert (ck / lock.LOCK_FILE).is_file()
    assert json.loads((ck / lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert dirs.steps(ck) == [12] and dirs.find(ck) == ck / "12"
    capsys.readouterr()
    assert main(["ckpt", "inspect", str(ck)]) == 0
    assert "complete steps in its directory: [12]" in capsys.readouterr().out


def test_a_launch_of_two_processes_on_a_held_ckpt_dir_stops_both_at_their_start(tmp_path):
    """Process 0 alone takes the lock; refused, it says why and process 1 stops with it, at
    once, rather than wait for it in a collective."""
    ck = tmp_path / "ck"
    held = lock.take(lock.writable(ck))
    try:
        started = time.monotonic()
        done = hotjax("launch", "--processes", "2", "--devices-per-process", "1", "--", *RUN,
                      "--ckpt-dir", str(ck), cwd=tmp_path, ok=False)
        assert time.monotonic() - started < ENDS_WITHIN_S * 2  # two processes start JAX
    finally:
        held.release()
    assert done.returncode == 2, done.stdout[-3000:]
    assert "Traceback" not in done.stdout
    zero = [line for line in _errors(done.stdout) if line.startswith("[0]")]
    one = [line for line in _errors(done.stdout) if line.startswith("[1]")]
    assert len(zero) == 1 and re.fullmatch(_in_use(ck, os.getpid()), zero[0][4:]), zero
    assert one == [f"[1] hotjax: error: process 0 of the run cannot use --ckpt-dir {ck} (its "
                   f"line says why): process 1 stops too"]
