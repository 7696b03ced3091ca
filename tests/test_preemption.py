"""Stops and faults end in one line: a stop signal saves the step reached and exits for a
requeue, a second one ends the run at once, a save the disk refuses names what it needs, and
every bad number is refused before anything runs; each rerun resumes as if never stopped."""

import errno
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_RUN, records, start_hotjax

from hotjax.checkpoint import dirs
from hotjax.cli import main
from hotjax.preemption import REQUEUE_EXIT

# A tiny model on byte tokens in fp32 on one device: saves are written in the background.
RUN = [*TINY_RUN, "--devices", "1", "--strategy", "data=1", "--steps", "12"]


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(path)}


@pytest.fixture(scope="module", autouse=True)
def corpus(tmp_path_factory) -> None:
    """A small corpus (read and measured in a moment), as every run's --data."""
    from hotjax.data import open_corpus

    text = "".join(open_corpus(None).read(i) for i in range(20))
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text[i:i + 300]}) + "\n"
                            for i in range(0, 300 * 200, 300)))
    RUN.extend(["--data", str(path)])
    yield
    del RUN[-2:]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus) -> dict[int, float]:
    metrics = tmp_path_factory.mktemp("reference") / "metrics.jsonl"
    assert main([*RUN, "--metrics-jsonl", str(metrics)]) == 0
    return _losses(metrics)


class _Run:
    """`hotjax train` in a process of its own, its output collected as it comes."""

    def __init__(self, *flags: str, cwd: Path):
        self.process = start_hotjax(*RUN, *flags, cwd=cwd)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout))
        self._reader.start()

    def wait_for(self, condition, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.process.poll() is None, "".join(self.lines)[-3000:]
            assert time.monotonic() < deadline, "made no progress"
            time.sleep(0.002)

    def signal(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    def end(self) -> tuple[int, list[str]]:
        try:
            code = self.process.wait(timeout=120)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            self._reader.join()
        assert "Traceback" not in "".join(self.lines), "".join(self.lines)[-3000:]
        return code, [line.strip() for line in self.lines if line.startswith("hotjax:")]


def test_a_stop_signal_saves_the_step_reached_and_the_rerun_resumes_as_if_never_stopped(
        tmp_path, uninterrupted):
    """SIGTERM mid-run: the step under way finishes and is saved, one line, exit 75. Rerun and
    signalled twice while it compiles: it ends at once (128 + 15), nothing partial left. The
    last rerun trains every remaining step with the uninterrupted run's losses."""
    ck, metrics = tmp_path / "ck", tmp_path / "run.jsonl"
    flags = ["--ckpt-dir", str(ck), "--save-every", "2", "--metrics-jsonl", str(metrics)]
    run = _Run(*flags, cwd=tmp_path)
    run.wait_for(lambda: metrics.exists() and len(records(metrics)) >= 2)
    run.signal(signal.SIGTERM)
    code, lines = run.end()
    reached = records(metrics)[-1]["step"]
    assert code == REQUEUE_EXIT and 2 <= reached < 12
    assert lines == [f"hotjax: preempted at step {reached}: saved {ck / str(reached)}; rerun "
                     f"the same command to resume"]
    assert dirs.steps(ck)[-1] == reached and not list(ck.glob(f"*{dirs.TMP_MARK}*"))

    again = _Run(*flags, cwd=tmp_path)
    again.wait_for(lambda: any("resumed from" in line for line in again.lines))
    again.signal(signal.SIGTERM)
    time.sleep(0.05)
    again.signal(signal.SIGTERM)
    code, lines = again.end()
    assert code == 128 + signal.SIGTERM
    assert len(lines) == 1 and lines[0].startswith("hotjax: stopped at once by a second SIGTERM")
    assert dirs.steps(ck)[-1] == reached and not list(ck.glob(f"*{dirs.TMP_MARK}*"))

    assert main([*RUN, *flags]) == 0
    resumed = _losses(metrics)
    assert sorted(resumed) == list(range(reached + 1, 13))
    np.testing.assert_allclose([resumed[s] for s in sorted(resumed)],
                               [uninterrupted[s] for s in sorted(resumed)], rtol=0, atol=1e-5)


def test_a_save_the_disk_refuses_is_one_line_and_the_earlier_checkpoints_resume(
        tmp_path, uninterrupted, monkeypatch, capsys):
    """Step 3's save fails as a full disk fails it (its JSON written last, its arrays already
    in the partial directory): one line naming the directory, the reason and the space needed;
    the partial save removed; steps 1 and 2 resume with the uninterrupted run's losses."""
    from orbax.checkpoint import JsonCheckpointHandler

    written = JsonCheckpointHandler._save_fn

    async def full_at_step_3(self, item, directory):
        if str(directory).startswith(str(tmp_path / "ck" / f"3{dirs.TMP_MARK}")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
        await written(self, item, directory)

    ck, metrics = tmp_path / "ck", tmp_path / "run.jsonl"
    flags = ["--ckpt-dir", str(ck), "--save-every", "1", "--metrics-jsonl", str(metrics)]
    with monkeypatch.context() as patch:
        patch.setattr(JsonCheckpointHandler, "_save_fn", full_at_step_3)
        assert main([*RUN, *flags]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "hotjax:" in line]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"hotjax: error: --ckpt-dir {ck}: saving step 3 failed (No "
                                f"space left on device): a checkpoint needs about 1.6 MiB and ")
    assert errors[0].endswith("the checkpoints of steps 1, 2 are intact")
    assert dirs.steps(ck) == [1, 2] and not list(ck.glob(f"*{dirs.TMP_MARK}*"))

    assert main([*RUN, *flags]) == 0
    resumed = _losses(metrics)
    assert sorted(resumed) == list(range(3, 13))
    np.testing.assert_allclose([resumed[s] for s in sorted(resumed)],
                               [uninterrupted[s] for s in sorted(resumed)], rtol=0, atol=1e-5)


BAD_NUMBERS = [
    (["--lr", "-1"], "--lr -1.0: pass a finite number above 0"),
    (["--lr", "nan"], "--lr nan: pass a finite number above 0"),
    (["--lr", "inf"], "--lr inf: pass a finite number above 0"),
    (["--warmup-steps", "-3"], "--warmup-steps -3: warm up within the run: give 0 to --steps"),
    (["--warmup-steps", "40", "--steps", "30"], "--warmup-steps 40: warm up within the run"),
    (["--heartbeat-timeout", "-1"], "--heartbeat-timeout -1: pass a positive number"),
    (["--batch-tokens", "-5"], "--batch-tokens -5: pass a positive number"),
    (["--batch-sequences", "0"], "--batch-sequences 0: pass a positive number"),
    (["--context", "0"], "--context 0: pass a positive number"),
    (["--seed", "-1"], "--seed -1: pass 0 or more"),
    (["--steps", "0"], "--steps 0: pass a positive number"),
    (["--save-every", "-1", "--ckpt-dir", "ck"], "--save-every -1: pass a positive number"),
    (["--keep-last", "0"], "--keep-last 0: pass a positive number"),
    (["--keep-every", "0"], "--keep-every 0: pass a positive number"),
    (["--log-every", "0"], "--log-every 0: pass a positive number"),
    (["--vocab-size", "0"], "--vocab-size 0: pass a positive number"),
    (["--device-memory", "-5"], "argument --device-memory: '-5' is not a memory size: give a "
     "positive number with a unit, like 80GiB, 512MiB or 80GB (a bare number is MiB): see "
     "hotjax train --help"),
    (["--device-memory", "nan"], "argument --device-memory: 'nan' is not a memory size"),
    (["--device-memory", "0GiB"], "argument --device-memory: '0GiB': give a memory size above 0"),
    (["--initial-loss-scale", "0"], "--initial-loss-scale 0.0: pass a finite number above 0"),
    (["--loss-scale", "-8"], "--loss-scale -8: give dynamic, off or a number above 0"),
    (["--loss-scale-period", "0"], "--loss-scale-period 0: pass a positive number"),
    (["--attention-block", "-1"], "--attention-block -1: pass 0 or more"),
    (["--devices", "0"], "--devices 0: pass a positive number"),
    (["--preempt-signal", "USR9"], "--preempt-signal USR9: not a signal"),
    (["--steps", "abc"], "argument --steps: invalid int value: 'abc': see hotjax train --help"),
]
OTHER_COMMANDS = [
    (["plan", "--memory-gib", "nan"], "--memory-gib nan: pass a finite number above 0"),
    (["plan", "--device-memory", "80XB"], "argument --device-memory: '80XB' is not a memory "
     "size"),
    (["plan", "--vocab-size", "0"], "--vocab-size 0: pass a positive number"),
    (["data", "stats", "--vocab-size", "-2"], "--vocab-size -2: pass a positive number"),
    (["strategy", "show", "data=8", "--context", "0"], "--context 0: pass a positive number"),
]


@pytest.mark.parametrize(("argv", "message"),
                         [(["train", *flags], message) for flags, message in BAD_NUMBERS]
                         + OTHER_COMMANDS)
def test_every_bad_number_is_refused_in_one_line_before_anything_runs(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors (`--steps abc`)
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"hotjax: error: {message}"), err
