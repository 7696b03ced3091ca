"""`hotjax train` as a user runs it: same losses on every layout, and one-line errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hotjax.cli import main

# The embedded default corpus (the Python standard library), a tiny model, byte tokens.
TINY_RUN = ["train", "--model", "tiny", "--tokenizer", "bytes", "--context", "256",
            "--batch-tokens", "2048", "--compute-dtype", "float32", "--log-every", "1"]


def _train(tmp_path, *flags: str) -> list[dict]:
    metrics = tmp_path / f"metrics-{len(list(tmp_path.iterdir()))}.jsonl"
    assert main([*TINY_RUN, *flags, "--metrics-jsonl", str(metrics)]) == 0
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def data_parallel_losses(tmp_path_factory) -> list[float]:
    records = _train(tmp_path_factory.mktemp("dp"), "--steps", "3", "--strategy", "data=8")
    return [r["loss"] for r in records]


@pytest.mark.parametrize("flags", [["--strategy", "fsdp=8"], ["--devices", "1"],
                                   ["--strategy", "data=8"]])
def test_layouts_give_the_same_loss_trajectory(flags, tmp_path, data_parallel_losses):
    losses = [r["loss"] for r in _train(tmp_path, "--steps", "3", *flags)]
    np.testing.assert_allclose(losses, data_parallel_losses, rtol=0, atol=1e-5)


def test_training_lowers_the_loss_and_records_every_step(tmp_path):
    records = _train(tmp_path, "--steps", "8", "--warmup-steps", "2", "--lr", "1e-2")
    assert [r["step"] for r in records] == list(range(1, 9))
    for r in records:
        assert set(r) >= {"step", "loss", "tokens", "seconds", "tokens_per_s"}
        assert r["tokens"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
    # From uniform guesses over the 259 byte tokens padded to 384 embedding rows, to well below.
    assert records[0]["loss"] == pytest.approx(np.log(384), abs=0.05)
    assert records[-1]["loss"] < records[0]["loss"] - 1.0


def test_a_bucket_table_trains_with_hot_switching(tmp_path):
    table = tmp_path / "table.toml"
    table.write_text("[[bucket]]\nmax_len = 128\nmesh = { data = 8 }\nrules = 'dp'\n"
                     "[[bucket]]\nmax_len = 256\nmesh = { data = 2, tensor = 4 }\n"
                     "rules = 'megatron-sp'\n")
    records = _train(tmp_path, "--steps", "4", "--warmup-steps", "1", "--lr", "1e-2",
                     "--strategies", str(table))
    assert [[b["max_len"] for b in r["buckets"]] for r in records][0] in ([128, 256], [256, 128])
    for r in records:
        assert r["tokens"] == sum(b["tokens"] for b in r["buckets"]) > 0
        assert all(b["compute_s"] > 0 and b["switch_s"] >= 0 for b in r["buckets"])
    assert records[-1]["loss"] < records[0]["loss"]


def test_a_home_strategy_that_cannot_hold_the_state_is_refused(tmp_path, capsys):
    table = tmp_path / "table.toml"
    table.write_text("[[bucket]]\nmax_len = 128\nmesh = { data = 8 }\nrules = 'dp'\n"
                     "[[bucket]]\nmax_len = 256\nmesh = { data = 2, tensor = 4 }\n"
                     "rules = 'megatron-sp'\n")
    # The tiny model's fp32 state is 0.4 MiB per device even in the most sharded layout.
    assert main([*TINY_RUN, "--steps", "1", "--strategies", str(table),
                 "--device-memory", "0.1"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("hotjax: error: --device-memory 0.1: the home state needs 0.")
    assert "use a more sharded strategy" in error


def _hotjax(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "hotjax.cli", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def _bad_inputs(tmp_path) -> dict[str, tuple[list[str], str]]:
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{ this is not a tokenizer")
    return {
        "mesh": (["--strategy", "data=3"], "make its sizes multiply to 8"),
        "preset": (["--model", "llama5"], "unknown model preset 'llama5'"),
        "data path": (["--data", str(tmp_path / "missing")], str(tmp_path / "missing")),
        "empty corpus": (["--data", str(empty)], str(empty)),
        "tokenizer": (["--data", str(broken), "--tokenizer", str(broken)], str(broken)),
    }


@pytest.mark.parametrize("case", ["mesh", "preset", "data path", "empty corpus", "tokenizer"])
def test_bad_input_is_one_line_without_traceback(case, tmp_path):
    flags, expected = _bad_inputs(tmp_path)[case]
    result = _hotjax("train", "--model", "tiny", *flags, cwd=tmp_path)  # a later --model wins
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("hotjax: error:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr
