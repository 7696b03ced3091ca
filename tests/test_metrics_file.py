"""The --metrics-jsonl file is checked at a run's start, as --ckpt-dir is: a path it cannot be
written at (no directory, a directory, a read-only file system) ends the run in one line before
anything is compiled, and a write refused mid-run (a full disk) ends it in one line naming the
step; the file a rerun writes replaces the last run's."""

import pytest
from helpers import one_line, records
from test_ckpt_dir import read_only  # noqa: F401 - a fixture
from test_preemption import RUN, corpus  # noqa: F401 - a fixture

from hotjax.cli import main

SHORT = [*RUN, "--steps", "2"]


def _refused_at_start(path, capsys) -> str:
    assert main([*SHORT, "--metrics-jsonl", str(path)]) == 2
    err = capsys.readouterr().err
    assert "compiled" not in err, err
    return one_line(err)


@pytest.mark.parametrize("case, reason, fix", [
    ("no directory", "No such file or directory", "create its directory or choose another path"),
    ("a directory", "Is a directory", "choose a writable path"),
])
def test_a_metrics_path_that_takes_no_file_is_one_line_at_the_start(case, reason, fix, tmp_path,
                                                                     capsys):
    path = tmp_path / "absent" / "run.jsonl" if case == "no directory" else tmp_path
    assert _refused_at_start(path, capsys) == (
        f"hotjax: error: --metrics-jsonl {path}: cannot write there ({reason}): {fix}")


def test_a_metrics_file_on_a_read_only_file_system_is_one_line_at_the_start(
        read_only, capsys):  # noqa: F811 - the fixture imported
    read_only.freeze()
    path = read_only.path / "run.jsonl"
    assert _refused_at_start(path, capsys) == (
        f"hotjax: error: --metrics-jsonl {path}: cannot write there (Read-only file system): "
        f"choose a writable path")


def test_a_full_disk_under_the_metrics_file_ends_the_run_in_one_line(capsys):
    assert main([*SHORT, "--metrics-jsonl", "/dev/full"]) == 2  # every write: ENOSPC
    assert one_line(capsys.readouterr().err) == (
        "hotjax: error: --metrics-jsonl /dev/full: writing step 1's metrics failed (No space "
        "left on device): free space or choose another --metrics-jsonl")


def test_a_rerun_replaces_the_metrics_file_and_a_refused_one_leaves_it(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    assert main([*SHORT, "--metrics-jsonl", str(path)]) == 0
    assert main([*SHORT, "--metrics-jsonl", str(path)]) == 0
    assert [r["step"] for r in records(path)] == [1, 2]
    # Refused after the file was opened (a flag checked later): what it held is kept.
    assert main([*SHORT, "--metrics-jsonl", str(path), "--resume-from",
                 str(tmp_path / "absent")]) == 2
    assert [r["step"] for r in records(path)] == [1, 2]
