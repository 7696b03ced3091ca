"""`hotjax plan`'s search: the dynamic program finds the fastest table that brute force finds,
every bucket fits the budget, the table it writes loads and runs as planned, and bad input is
one line."""

import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hotjax import plan
from hotjax.cli import main
from models.llama import preset
from sharding.profile import load_profile
from sharding.table import load_table

ROOT = Path(__file__).resolve().parents[1]
STDLIB = ROOT / "docs" / "stdlib-lengths.json"
TINY = dataclasses.replace(preset("tiny"), vocab_size=256)
CONTEXT = 2048
GiB = 2**30


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    documents = np.asarray(json.loads(STDLIB.read_text())["quantiles"])
    return plan.typical_batch(np.minimum(documents, CONTEXT), 64)


@pytest.fixture(scope="module")
def search() -> plan.Search:
    return plan.Search(TINY, load_profile("a800-4x8"), 8, 80 * GiB)


def test_typical_batch_takes_evenly_spaced_quantiles():
    assert plan.typical_batch(np.arange(1, 101), 4).tolist() == [13, 38, 63, 88]
    assert plan.typical_batch(np.array([0, 5, 7]), 4).tolist() == [5, 5, 7, 7]


def test_the_search_finds_the_fastest_table_brute_force_finds(search, lengths):
    """Every table of up to two buckets over the candidate boundaries and every strategy per
    bucket, priced bucket by bucket: none computes faster than the plan."""
    found = plan.plan(search, lengths, CONTEXT, max_buckets=2)
    cuts = plan.boundaries(lengths, CONTEXT)
    assert cuts == [512, 1024, CONTEXT]
    best = np.inf
    for inner in (c for k in range(2) for c in itertools.combinations(cuts[:-1], k)):
        highs = [*inner, CONTEXT]
        for strategies in itertools.product(search.strategies, repeat=len(highs)):
            table = plan.fixed_table(search, lengths, list(zip(highs, strategies, strict=True)))
            if table is not None:
                best = min(best, sum(b.seconds for b in table.buckets))
    compute = sum(b.seconds for b in found.buckets)
    assert compute == pytest.approx(best, rel=1e-9)
    assert found.seconds == pytest.approx(compute + found.switch_seconds)
    # The buckets cover every sequence once, and the step's tokens.
    assert sum(b.sequences for b in found.buckets) == len(lengths)
    assert sum(b.tokens for b in found.buckets) == lengths.sum()


def test_buckets_fit_the_budget_and_a_budget_too_small_is_one_line(lengths):
    profile = load_profile("a800-4x8")
    roomy = plan.plan(plan.Search(TINY, profile, 8, 80 * GiB), lengths, CONTEXT)
    tight_budget = max(b.peak_bytes for b in roomy.buckets) // 2
    tight = plan.plan(plan.Search(TINY, profile, 8, tight_budget), lengths, CONTEXT)
    assert all(b.peak_bytes <= tight_budget for b in tight.buckets)
    assert tight.seconds >= roomy.seconds
    with pytest.raises(plan.UserError, match="fits 0.0 GiB per device.*raise the memory budget"):
        plan.plan(plan.Search(TINY, profile, 8, 2**20), lengths, CONTEXT)


def test_masking_documents_never_costs_more_than_concatenating_them(search, lengths):
    masked, concatenated = plan.baselines(search, lengths, CONTEXT).values()
    assert masked.buckets[0].strategy == concatenated.buckets[0].strategy
    assert masked.seconds <= concatenated.seconds


def test_the_written_table_loads_with_each_bucket_as_planned(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    assert main(["plan", "--model", "tiny", "--profile", "a800-4x8", "--devices", "8",
                 "--context", str(CONTEXT), "--lengths", str(STDLIB), "--batch-sequences",
                 "64", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    table = load_table(out)
    planned = report["plan"]["buckets"]
    assert [b.max_len for b in table.buckets] == [b["max_len"] for b in planned]
    assert [str(b.strategy) for b in table.buckets] == [b["strategy"] for b in planned]
    assert [b.micro_rows for b in table.buckets] == [b["micro_rows"] for b in planned]
    assert table.max_len == CONTEXT
    assert sum(b["token_share"] for b in planned) == pytest.approx(1.0)
    for name, other in report["compared"].items():
        assert other["seconds"] >= report["plan"]["seconds"] * (1 - 1e-3), name


@pytest.mark.parametrize(("flags", "message"), [
    (["--lengths", "missing.json"], "--lengths missing.json: no such file"),
    (["--profile", "nowhere"], "hardware profile not found"),
    (["--context", "0"], "--context 0: pass a positive number"),
    (["--batch-sequences", "0"], "--batch-sequences 0: plan for at least one sequence"),
    (["--devices", "64"], "64 devices: profile a800-4x8 has 32"),
])
def test_bad_input_is_one_line(flags, message, tmp_path):
    argv = ["plan", "--model", "tiny", "--profile", "a800-4x8", "--lengths", str(STDLIB),
            *flags]
    done = subprocess.run([sys.executable, "-m", "hotjax.cli", *argv], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("hotjax: error: ")
    assert message in done.stderr and "Traceback" not in done.stderr


def test_strategies_auto_plans_for_this_machine_and_trains_like_one_device(tmp_path,
                                                                           monkeypatch, capsys):
    """`--strategies auto` plans with this machine's cached profile (here the A800 numbers for
    one node of the 8 simulated devices) and trains the same losses as one device."""
    profiles = tmp_path / "cache" / "profiles"
    profiles.mkdir(parents=True)
    text = (ROOT / "sharding" / "profiles" / "a800-4x8.toml").read_text()
    text = text.replace('platform = "gpu"', 'platform = "cpu"').replace("nodes = 4", "nodes = 1")
    (profiles / "cpu-8x1.toml").write_text(text)
    monkeypatch.setenv("HOTJAX_CACHE", str(tmp_path / "cache"))
    run = ["train", "--model", "tiny", "--tokenizer", "bytes", "--compute-dtype", "float32",
           "--context", "512", "--batch-tokens", "2048", "--steps", "2"]
    losses = {}
    for name, flags in (("auto", ["--strategies", "auto"]), ("one device", ["--devices", "1"])):
        metrics = tmp_path / f"{name}.jsonl"
        assert main([*run, *flags, "--metrics-jsonl", str(metrics)]) == 0
        losses[name] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert "--strategies auto: planned on profile a800-4x8" in capsys.readouterr().err
    np.testing.assert_allclose(losses["auto"], losses["one device"], rtol=0, atol=1e-5)
