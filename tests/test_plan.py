"""`hotjax plan`'s search: the dynamic program finds the fastest table that brute force finds,
every bucket fits the budget, the table it writes loads and runs as planned, and bad input is
one line."""

import dataclasses
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import MODEL

from hotjax.checkpoint import meta
from hotjax.cli import main
from hotjax.planning import search as plan
from hotjax.planning.cost import (
    COST_MODEL_VERSION,
    bucket_reduction_seconds,
    reduction_home_seconds,
)
from hotjax.planning.measure import profile_path
from hotjax.planning.profile import load_profile
from hotjax.sharding.strategy import Strategy
from hotjax.sharding.table import load_table, parse_table

ROOT = Path(__file__).resolve().parents[1]
STDLIB = ROOT / "docs" / "stdlib-lengths.json"
CONTEXT = 2048
GiB = 2**30


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    documents = np.asarray(json.loads(STDLIB.read_text())["quantiles"])
    return plan.typical_batch(np.minimum(documents, CONTEXT), 64)


@pytest.fixture(scope="module")
def search() -> plan.Search:
    return plan.Search(MODEL, load_profile("a800-4x8"), 8, 80 * GiB)


def test_typical_batch_takes_evenly_spaced_quantiles():
    assert plan.typical_batch(np.arange(1, 101), 4).tolist() == [13, 38, 63, 88]
    assert plan.typical_batch(np.array([0, 5, 7]), 4).tolist() == [5, 5, 7, 7]


def test_the_search_finds_the_fastest_table_brute_force_finds(search, lengths):
    """Every table of up to two buckets over the candidate boundaries and every strategy per
    bucket, each priced as a whole step: none is faster than the dynamic program's table. (The
    program weighs the buckets' micro-steps and reductions; the switches, and the part of a
    reduction that depends on the home, are added to the tables it finds for each home: here
    ZeRO-2's home, whose split gradients ZeRO-1's partial sums are reduce-scattered into, wins
    over ZeRO-1's replicated ones, whose micro-steps compute as fast.)"""
    found = plan.fastest(search, lengths, CONTEXT, max_buckets=2)
    cuts = plan.boundaries(lengths, CONTEXT)
    assert cuts == [512, 1024, CONTEXT]
    best = np.inf
    for inner in (c for k in range(2) for c in itertools.combinations(cuts[:-1], k)):
        highs = [*inner, CONTEXT]
        for strategies in itertools.product(search.strategies, repeat=len(highs)):
            table = plan.fixed_table(search, lengths, list(zip(highs, strategies, strict=True)))
            if table is not None:
                best = min(best, table.seconds)
    assert found.seconds == pytest.approx(best, rel=1e-9)
    assert found.seconds == pytest.approx(sum(b.seconds for b in found.buckets)
                                          + found.switch_seconds)
    # The buckets cover every sequence once, and the step's tokens.
    assert sum(b.sequences for b in found.buckets) == len(lengths)
    assert sum(b.tokens for b in found.buckets) == lengths.sum()


def test_a_tables_switches_and_reduction_are_priced_bucket_by_bucket(search, lengths):
    """The weights go from home through each bucket that runs, in turn; each bucket's fp32
    gradients go home; a bucket without rows moves nothing; a `local` bucket's one reduction
    is part of its seconds, and said apart."""
    dp, tp, fsdp = (Strategy.parse(t) for t in (
        "data=8,rules=dp", "data=2,tensor=4,rules=megatron-sp", "fsdp=8,rules=fsdp"))
    table = [(512, dp), (1024, tp), (CONTEXT, fsdp)]
    run = [plan.RunAs(8, "none", "local"), *[plan.RunAs(8, "none", "sharded")] * 2]
    found = plan.fixed_table(search, lengths, table, run=run)
    widen = 4 / MODEL.dtype.itemsize
    assert found.home == fsdp
    assert found.weights_in == tuple(search.switch_seconds(a, b) for a, b in (
        (fsdp, dp), (dp, tp), (tp, fsdp)))
    # The data-parallel bucket's partial sums are reduce-scattered into the home's layout where
    # it splits them; the norms, which it keeps whole, are all-reduced: that much more.
    assert found.gradients_home == tuple(
        widen * search.switch_seconds(s, fsdp)
        + reduction_home_seconds(MODEL, s, fsdp, search.profile, r.accumulate)
        for s, r in zip((dp, tp, fsdp), run, strict=True))
    assert found.gradients_home[0] > 0 == widen * search.switch_seconds(dp, fsdp)
    # Gathering the weights moves bytes, splitting them none; tensor's gradients are re-split.
    assert found.weights_in[0] > 0 == found.weights_in[1] and found.gradients_home[1] > 0
    assert found.switch_seconds == pytest.approx(sum(found.weights_in + found.gradients_home))
    local, *sharded = found.buckets
    assert local.reduction_seconds == pytest.approx(bucket_reduction_seconds(
        MODEL, dp, search.profile, "local")) and 0 < local.reduction_seconds < local.seconds
    assert all(b.reduction_seconds == 0 for b in sharded)
    # Nothing longer than 1,024 tokens: the last bucket is empty, and it moves nothing.
    idle = plan.fixed_table(search, np.minimum(lengths, 1024), table, run=run)
    assert idle.weights_in[2] == idle.gradients_home[2] == idle.buckets[2].seconds == 0


def test_buckets_fit_the_budget_and_a_budget_too_small_is_one_line(lengths):
    profile = load_profile("a800-4x8")
    roomy = plan.plan(plan.Search(MODEL, profile, 8, 80 * GiB), lengths, CONTEXT)
    tight_budget = max(b.peak_bytes for b in roomy.buckets) // 2
    tight = plan.plan(plan.Search(MODEL, profile, 8, tight_budget), lengths, CONTEXT)
    assert all(b.peak_bytes <= tight_budget for b in tight.buckets)
    assert tight.seconds >= roomy.seconds
    with pytest.raises(plan.UserError, match="fits 0.0 GiB per device.*raise the memory budget"):
        plan.plan(plan.Search(MODEL, profile, 8, 2**20), lengths, CONTEXT)


def _long_tailed(batch_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """A long-tailed sample of sequence lengths (lognormal, median 300) and the typical batch
    `plan_search` draws from it for mini-batches of `batch_tokens`."""
    rng = np.random.default_rng(3)
    sample = np.minimum(np.ceil(rng.lognormal(np.log(300), 1.6, 2000)).astype(int) + 2, CONTEXT)
    return sample, plan.typical_batch(sample, round(batch_tokens / sample.mean()))


def _drawn_steps(search: plan.Search, found: plan.Plan) -> list[float]:
    """`found`'s step on each of the search's drawn mini-batches, its micro-steps as planned."""
    table = [(b.max_len, b.strategy) for b in found.buckets]
    return [plan.fixed_table(search, batch, table, run=[b.run_as for b in found.buckets]).seconds
            for batch in search.drawn]


def test_a_table_is_planned_only_where_it_gains_more_than_the_cost_models_error(monkeypatch):
    """Short documents under ZeRO-1 and the rest under ZeRO-2 is the fastest table here; it is
    planned when its predicted gain over the best single strategy, both priced on the drawn
    mini-batches as their micro-steps run, exceeds MARGIN, and otherwise that strategy alone
    is, and the plan says why; each carries its drawn steps' prices."""
    sample, typical = _long_tailed(4 * CONTEXT)
    search = plan.Search(MODEL, load_profile("a800-4x8"), 2, 80 * GiB,
                         fill=plan.Fill(sample, batch_tokens=4 * CONTEXT))
    table = plan.fastest(search, typical, CONTEXT, 4)
    single = plan.fastest(search, typical, CONTEXT, 1)
    table_s, single_s = _drawn_steps(search, table), _drawn_steps(search, single)
    gain = np.mean(single_s) / np.mean(table_s)
    assert len(table.buckets) > 1 and gain > 1
    assert abs(gain - single.seconds / table.seconds) > 1e-6  # not the typical batch's
    monkeypatch.setattr(plan, "MARGIN", gain * 1.01)
    kept = plan.plan(search, typical, CONTEXT)
    assert kept.buckets == single.buckets and kept.seconds == single.seconds
    assert kept.drawn_seconds == pytest.approx(single_s, rel=1e-12)
    assert kept.why.startswith(f"one strategy, {single.buckets[0].strategy}: the best table")
    assert (f"only {gain:.3f}x as fast on {plan.DRAWN_BATCHES} drawn mini-batches, within the "
            f"cost model's error") in kept.why
    monkeypatch.setattr(plan, "MARGIN", gain / 1.01)
    switched = plan.plan(search, typical, CONTEXT)
    assert switched.buckets == table.buckets
    assert switched.expected_seconds == pytest.approx(np.mean(table_s), rel=1e-12)
    assert switched.why.startswith(f"a table of {len(table.buckets)} buckets: predicted "
                                   f"{gain:.3f}x the best single strategy")


@pytest.mark.parametrize("size", [{"batch_tokens": 4 * CONTEXT}, {"batch_sequences": 48}])
def test_drawn_mini_batches_are_what_a_shuffled_stream_takes(size):
    """Each drawn mini-batch holds sequences of the sample, as many as the batch size takes: by
    tokens, up to the sequence that would pass it; the same draw for the same sample, and the
    batches differ from one another."""
    sample, _ = _long_tailed(4 * CONTEXT)
    fill = plan.Fill(sample, **size)
    drawn = fill.drawn()
    assert len(drawn) == plan.DRAWN_BATCHES
    assert all(np.isin(batch, sample).all() for batch in drawn)
    if "batch_sequences" in size:
        assert {len(batch) for batch in drawn} == {48}
    else:
        assert all(0 < batch.sum() <= size["batch_tokens"] for batch in drawn)
        assert min(batch.sum() for batch in drawn) > size["batch_tokens"] - sample.max()
    assert all(np.array_equal(a, b) for a, b in zip(drawn, fill.drawn(), strict=True))
    assert len({tuple(batch) for batch in drawn}) == len(drawn)


def test_micro_steps_hold_no_more_rows_than_the_mini_batches_fill():
    """The typical batch of a long-tailed corpus packs 5 rows of CONTEXT, the run's
    mini-batches of 4 x CONTEXT tokens fill 4 (a typical mini-batch of the whole sample, as the
    trainer counts it): under fsdp=2 the planned micro-step holds 4 rows, the trainer's own
    sizing (`micro_units`), not 6 (5 rows rounded up to the shards, a third of them empty).
    Mini-batches half the size fill 2 rows, and a micro-step holds 2."""
    from hotjax.train import micro_units

    sample, typical = _long_tailed(4 * CONTEXT)
    (zero1,) = [s for s in plan.candidate_strategies(MODEL, 2) if str(s) == "fsdp2 [zero1]"]
    profile = load_profile("a800-4x8")
    for batch_tokens, rows in ((4 * CONTEXT, 4), (2 * CONTEXT, 2)):
        fill = plan.Fill(sample, batch_tokens=batch_tokens)
        search = plan.Search(MODEL, profile, 2, 80 * GiB, [zero1], fill=fill)
        (bucket,) = plan.fixed_table(search, typical, [(CONTEXT, zero1)]).buckets
        assert bucket.rows == 5 and bucket.micro_rows == rows
        assert rows == 2 * micro_units(fill.rows(0, CONTEXT), 2, 64)
        assert all(b.micro_rows <= rows for b in plan.plan(search, typical, CONTEXT).buckets)


def test_the_trainer_and_the_planner_size_micro_steps_by_one_rule():
    """No more rows than a typical mini-batch fills, spread over the fewest micro-steps."""
    from hotjax.train import MAX_MICRO_UNITS, micro_units

    assert micro_units(4.0, 2, 64) == 2  # 4 rows over 2 shards: one micro-step of 4
    assert micro_units(5.0, 2, 64) == 2  # not 3: a micro-step of 6 rows leaves one empty
    assert micro_units(42.0, 8, 64) == 3  # two micro-steps of 24 rows, not of 40 (80 slots)
    assert micro_units(42.0, 8, 2) == 2  # what fits in memory bounds it
    assert micro_units(12.0, 8, 64) == 1 and micro_units(0.3, 8, 64) == 1
    assert micro_units(None, 8, 100) == MAX_MICRO_UNITS


def test_a_run_far_off_its_predicted_steps_says_so_in_one_line():
    """Each of the first steps against the cost model's price of its own documents: the
    median ratio within the cost model's error either way, nothing; past it, one line with
    both and their ratio."""
    # Steps twice and four times as long as the first, each near its own price: nothing.
    assert plan.prediction_check([1.0, 2.0, 4.0], [1.05, 2.1, 3.7]) is None
    assert plan.prediction_check([1.0] * 3, [0.93, 0.92, 0.5]) is None
    line = plan.prediction_check([1.8935, 1.8935, 2.0], [4.2, 5.1, 7.9])
    assert line == ("--strategies auto: steps took 5,100.0 ms (median of 3), 2.69x what the "
                    "cost model predicts for their documents (1,893.5 ms), past its error "
                    "(1.10x): the plan may not be the fastest here; time a single --strategy "
                    "against it")
    assert "\n" not in line
    assert plan.prediction_check([1.0] * 3, [0.8, 0.85, 0.9]).startswith(
        "--strategies auto: steps took 850.0 ms (median of 3), 0.85x")


def test_masking_documents_never_costs_more_than_concatenating_them(search, lengths):
    masked, concatenated = plan.baselines(search, lengths, CONTEXT).values()
    assert masked.buckets[0].strategy == concatenated.buckets[0].strategy
    assert masked.seconds <= concatenated.seconds


def _one_bucket(platform: str, lengths: list[int], masked: bool = True) -> tuple:
    """The predicted bucket of rows of CONTEXT under data=2 on the A800 profile on `platform`,
    and the micro-step priced as if every row were one causal document."""
    profile = dataclasses.replace(load_profile("a800-4x8"), platform=platform)
    (strategy,) = [s for s in plan.candidate_strategies(MODEL, 2) if str(s) == "data2 [dp]"]
    search = plan.Search(MODEL, profile, 2, 80 * GiB, [strategy])
    table = plan.fixed_table(search, np.asarray(lengths), [(CONTEXT, strategy)], masked=masked)
    (bucket,) = table.buckets
    micro = search.micro_step(strategy, CONTEXT, search.resident[strategy], bucket.rows)
    return bucket, micro.time


def test_a_bucket_is_priced_at_its_busiest_data_shard():
    """One row holds a 2048-token document, the other sixteen of 128: over 2 data shards the
    micro-step waits for the long row, whose attention is the whole causal triangle (blocks of
    256 on CPU: 36 of them), against the short row's 8 diagonal blocks."""
    bucket, whole_rows = _one_bucket("cpu", [CONTEXT, *[128] * 16])
    assert (bucket.rows, bucket.micro_rows, bucket.micro_steps) == (2, 2, 1)
    assert bucket.seconds == pytest.approx(whole_rows.seconds)
    assert bucket.imbalance == pytest.approx(36 / ((36 + 8) / 2))
    # Two rows of short documents: each shard computes 8 of the 36 blocks.
    short, _ = _one_bucket("cpu", [128] * 32)
    assert short.seconds == pytest.approx(whole_rows.with_attention(8 / 36).seconds)
    assert short.imbalance == 1.0


def test_document_masking_is_discounted_only_where_the_kernel_skips_masked_blocks():
    """On CPU the blockwise kernel skips blocks no document spans, and so does the
    packed-attention Pallas kernel a packed row runs on GPU."""
    short = [128] * 32
    cpu, cpu_whole = (_one_bucket("cpu", short, masked)[0] for masked in (True, False))
    assert cpu.seconds < cpu_whole.seconds
    gpu, gpu_whole = (_one_bucket("gpu", short, masked)[0] for masked in (True, False))
    assert gpu.seconds < gpu_whole.seconds


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
    # The step a run should expect, priced on mini-batches drawn as a run draws them.
    drawn = report["plan"]["drawn_seconds"]
    assert len(drawn) == plan.DRAWN_BATCHES and min(drawn) > 0 and len(set(drawn)) > 1
    assert report["plan"]["expected_seconds"] == pytest.approx(np.mean(drawn))
    assert f"predicted {report['plan']['expected_seconds']:.3f} s per step" in out.read_text()


@pytest.mark.parametrize(("flags", "message"), [
    (["--lengths", "missing.json"], "--lengths missing.json: no such file"),
    (["--profile", "nowhere"], "hardware profile not found"),
    (["--context", "0"], "--context 0: pass a positive number"),
    (["--batch-sequences", "0"], "--batch-sequences 0: pass a positive number"),
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
    one node of the 8 simulated devices) and trains the same losses as one device; its steps,
    far slower on CPU than A800s, are reported off the prediction after the warm-up."""
    monkeypatch.setenv("HOTJAX_CACHE", str(tmp_path / "cache"))
    cached = profile_path()
    assert cached.relative_to(tmp_path / "cache").parts == (
        "profiles", f"cost-model-v{COST_MODEL_VERSION}", "cpu-8x1.toml")
    cached.parent.mkdir(parents=True)
    text = (ROOT / "hotjax" / "planning" / "profiles" / "a800-4x8.toml").read_text()
    text = text.replace('platform = "gpu"', 'platform = "cpu"').replace("nodes = 4", "nodes = 1")
    cached.write_text(text)
    # A profile cached under another cost model is not read (it would plan on the A800's).
    stale = cached.parent.parent / "cpu-8x1.toml"
    stale.write_text(text.replace("a800-4x8", "stale"))
    same = ["--model", "tiny", "--tokenizer", "bytes", "--compute-dtype", "float32",
            "--context", "512", "--batch-tokens", "2048"]
    monkeypatch.setattr(plan, "PREDICTION_STEPS", 1)  # checked after one warm-up step and one
    checked, check = [], plan.prediction_check  # what each check held the steps to
    monkeypatch.setattr(plan, "prediction_check", lambda predicted, measured: checked.append(
        (list(predicted), list(measured))) or check(predicted, measured))
    run = ["train", *same, "--steps", "2"]
    losses = {}
    for name, flags in (("auto", ["--strategies", "auto", "--ckpt-dir", str(tmp_path / "ck")]),
                        ("one device", ["--devices", "1", "--strategy", "data=1"])):
        metrics = tmp_path / f"{name}.jsonl"
        assert main([*run, *flags, "--metrics-jsonl", str(metrics)]) == 0
        losses[name] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    err = capsys.readouterr().err
    assert "--strategies auto: planned on profile a800-4x8" in err
    assert err.count("--strategies auto: steps took") == 1
    # The step after the warm-up, held to the price of its own documents, not the one the
    # plan printed (its drawn mini-batches' mean).
    typical = float(re.search(r"planned on profile a800-4x8, predicted ([\d,.]+) ms per step",
                              err)[1].replace(",", "")) / 1e3
    ((predicted, measured),) = checked
    assert len(predicted) == len(measured) == 1 and 0 < predicted[0] != typical
    np.testing.assert_allclose(losses["auto"], losses["one device"], rtol=0, atol=1e-5)
    # The table trained (as its checkpoint records it) is the one `hotjax plan` writes for the
    # same flags, home included.
    trained = parse_table(meta.read(tmp_path / "ck" / "2")["strategy_table"], "checkpoint")
    assert main(["plan", *same, "--out", str(tmp_path / "plan.toml")]) == 0
    planned = load_table(tmp_path / "plan.toml")
    assert planned == trained and planned.home is not None


def test_a_rule_set_added_to_rule_sets_is_planned_and_priced_by_what_it_maps(monkeypatch):
    """A new entry of `RULE_SETS` — Megatron's layout with its axes swapped: attention and the
    MLP split over `fsdp`, the weights' `embed` and the batch over `tensor` — becomes a
    candidate of its own, and the cost model prices its collectives by the device groups its
    rules map, not by the axes' names: on `fsdp=2·tensor=4` it costs what Megatron costs on
    `fsdp=4·tensor=2` (a tensor-parallel group of 2, weights gathered over 4), term by term."""
    from hotjax.planning.cost import micro_step_time
    from hotjax.sharding.strategy import RULE_SETS, Rules, Strategy

    tensor_like = {"heads": "fsdp", "kv_heads": "fsdp", "mlp": "fsdp", "vocab": "fsdp"}
    swapped = Rules.from_mappings("swapped", {"layers": "stage", "embed": "tensor", **tensor_like},
                                  {"batch": ("data", "tensor"), **tensor_like})
    monkeypatch.setitem(RULE_SETS, "swapped", swapped)
    profile = load_profile("a800-4x8")
    candidates = {str(s): s for s in plan.candidate_strategies(MODEL, 8)}
    assert "fsdp2·tensor4 [swapped]" in candidates
    new, megatron = candidates["fsdp2·tensor4 [swapped]"], Strategy.parse(
        "fsdp=4,tensor=2,rules=megatron")
    shape = (4, CONTEXT)
    priced, reference = (micro_step_time(MODEL, s, shape, profile) for s in (new, megatron))
    assert priced.tensor > 0 and priced.fsdp > 0
    assert priced.terms() == pytest.approx(reference.terms(), rel=1e-12)
    # The search prices it like any other candidate and can choose it.
    search = plan.Search(MODEL, profile, 8, 80 * GiB)
    assert new in search.strategies
    lengths = np.full(8, CONTEXT)
    (bucket,) = plan.fixed_table(search, lengths, [(CONTEXT, new)]).buckets
    only = plan.plan(plan.Search(MODEL, profile, 8, 80 * GiB, [new]), lengths, CONTEXT)
    assert [b.strategy for b in only.buckets] == [new]
    assert only.buckets[0].seconds == pytest.approx(bucket.seconds)


def test_the_table_recorded_is_the_one_written_not_its_fit_to_the_model(devices):
    """`tiny` has 4 K/V heads: under `tensor=8` the trainer replicates each over two ranks (its
    rules lose `kv_heads`). The run's table, as checkpoints record it, keeps the rules the user
    named, and so does its home."""
    from hotjax.optim import OptimConfig
    from hotjax.sharding.strategy import Strategy
    from hotjax.sharding.table import StrategyTable
    from hotjax.train import Trainer

    written = StrategyTable.single(Strategy.parse("tensor=8,rules=megatron"), 256, "test")
    trainer = Trainer(MODEL, OptimConfig(), written, devices)
    assert trainer.home.layout.strategy.rules != written.buckets[0].strategy.rules  # fitted
    assert trainer.home_strategy == written.buckets[0].strategy
    recorded = dataclasses.replace(written, home=trainer.home_strategy).to_dict()
    assert recorded["home"]["rules"] == "megatron"
    assert recorded["bucket"][0]["rules"] == "megatron"


def test_a_declared_memory_wall_refuses_whole_rows_and_admits_a_ring(devices):
    """The wall between data=2 (each device a whole row) and a balanced context ring (each
    device half of one): the trainer, by XLA's memory analysis as always, refuses the first
    under that budget whatever it recomputes and trains the second."""
    from hotjax.optim import OptimConfig
    from hotjax.planning.wall import keeps_whole_rows, memory_wall
    from hotjax.sharding.strategy import Strategy
    from hotjax.sharding.table import StrategyTable
    from hotjax.train import Trainer

    config = dataclasses.replace(MODEL, compute_dtype="float32")
    whole, ring = Strategy.parse("data=2"), Strategy.parse("context=2,balanced=true")
    assert keeps_whole_rows(whole) and keeps_whole_rows(Strategy.parse("tensor=2"))
    assert not keeps_whole_rows(ring)
    assert not keeps_whole_rows(Strategy.parse("tensor=2,rules=megatron-sp"))
    wall = memory_wall(config, 512, devices[:2], [whole, ring])
    assert wall.floor.peak_bytes < wall.budget_bytes < wall.ceiling.peak_bytes
    assert wall.ceiling.strategy == whole and wall.floor.strategy == ring

    def trainer(strategy: Strategy) -> Trainer:
        table = StrategyTable.single(strategy, 512, "wall")
        return Trainer(config, OptimConfig(), table, devices[:2],
                       device_memory=wall.budget_bytes)

    assert trainer(ring).check_memory(wall.budget_bytes)
    with pytest.raises(plan.UserError, match="needs .* per device"):
        trainer(whole).check_memory(wall.budget_bytes)


def test_a_table_is_priced_at_the_micro_steps_a_trainer_runs(search, lengths):
    """Given the micro-steps the search itself would choose, `run` prices the table as the
    search does; micro-steps of more rows than the bucket holds compute the empty ones too, and
    a policy that recomputes pays for its second forward pass."""
    strategy = search.strategies[0]
    table = [(CONTEXT, strategy)]
    (own,) = plan.fixed_table(search, lengths, table).buckets
    micro = search.micro_step(strategy, CONTEXT, search.resident[strategy], own.rows)
    chosen = plan.RunAs(micro.rows, micro.remat, micro.accumulate)
    (same,) = plan.fixed_table(search, lengths, table, run=[chosen]).buckets
    assert same == own

    def priced(run: plan.RunAs) -> plan.Choice:
        (bucket,) = plan.fixed_table(search, lengths, table, run=[run]).buckets
        assert (bucket.micro_rows, bucket.remat) == (run.micro_rows, run.remat)
        return bucket

    wide = priced(dataclasses.replace(chosen, micro_rows=4 * own.rows * strategy.batch_shards))
    assert wide.micro_steps == 1 and wide.seconds > own.seconds
    full, kept = (priced(dataclasses.replace(chosen, remat=r)) for r in ("full", "none"))
    assert full.seconds > kept.seconds



def test_a_checked_plan_finds_the_one_strategy_xla_fits_where_the_model_errs_both_ways(lengths):
    """Near a memory wall the model errs both ways: the strategy it fits XLA puts over the
    budget, and the one XLA fits the model puts 2 % over. `plan_checked` measures the model's
    near misses once nothing else fits, plans that one, and corrects a fit to exactly what XLA
    measured (a margin over it would refuse it again)."""
    from hotjax.planning.memory import micro_step_memory

    profile = load_profile("a800-4x8")
    probe = plan.Search(MODEL, profile, 2, 80 * GiB)

    def step_bytes(strategy, remat: str, rows: int) -> int:
        return micro_step_memory(dataclasses.replace(MODEL, remat=remat), strategy,
                                 (rows, CONTEXT), profile.platform).peak

    def least(strategy) -> int:  # one row per batch shard at the context, beside its own home
        return min(step_bytes(strategy, remat, strategy.batch_shards)
                   for remat in plan.REMAT_POLICIES) + probe.resident[strategy]

    by_need = sorted(probe.strategies, key=least)
    wrong = by_need[0]
    right = next(s for s in by_need[1:] if least(s) / 1.02 > least(wrong))
    budget = int(least(right) / 1.02)
    xla = {wrong: 3.0, right: 0.9}  # XLA's micro-step bytes over the model's
    assert 0.9 * (least(right) - probe.resident[right]) + probe.resident[right] < budget
    checked = []

    def measured(choice: plan.Choice, home) -> int:
        used = round(xla.get(choice.strategy, 1.0) * step_bytes(
            choice.strategy, choice.remat, choice.micro_rows)) + probe.resident[home]
        checked.append((choice.strategy, used))
        return used

    search, lines = plan.Search(MODEL, profile, 2, budget, [wrong, right]), []
    found = plan.plan_checked(search, lengths, CONTEXT, measured, progress=lines.append)
    assert {b.strategy for b in found.buckets if b.rows} == {right}
    assert checked[0][0] == wrong and checked[0][1] > budget  # the model's fit, refused
    assert all(measured(b, found.home) <= budget for b in found.buckets)  # what trains fits
    corrected = [ratio for (strategy, *_), ratio in search.corrections.items()
                 if strategy == right]
    assert corrected and all(r == pytest.approx(0.9, rel=1e-4) for r in corrected)
    assert len(lines) == len(checked) - len(found.buckets)
    assert lines[0].startswith(f"checking the plan by XLA: {wrong} at ")


def test_a_checked_plan_goes_on_while_each_round_measures_something_new(lengths, monkeypatch):
    """Near a tight wall the model can fit many micro-steps that XLA puts over, and find them a
    few a round: here every strategy needing less than Megatron at the context (the rings,
    Ulysses, megatron-sp) and the short buckets' ZeRO, measured 5 % over the model. `plan_checked`
    goes on past eight rounds while each measures a micro-step it had not, measures each once,
    and plans what XLA fits."""
    from hotjax.planning.memory import micro_step_memory

    profile = load_profile("a800-4x8")
    probe = plan.Search(MODEL, profile, 2, 80 * GiB)

    def least(strategy) -> int:  # one row per batch shard at the context, beside its own home
        return min(micro_step_memory(dataclasses.replace(MODEL, remat=remat), strategy,
                                     (strategy.batch_shards, CONTEXT), profile.platform).peak
                   for remat in plan.REMAT_POLICIES) + probe.resident[strategy]

    right = next(s for s in probe.strategies if str(s) == "tensor2 [megatron]")
    budget = int(least(right) * 1.001)
    assert sum(least(s) < budget for s in probe.strategies) >= 6
    checked, rounds, planned = [], [], plan.plan
    monkeypatch.setattr(plan, "plan", lambda *a, **k: rounds.append(1) or planned(*a, **k))

    def measured(choice: plan.Choice, home) -> int:
        checked.append((choice.strategy, choice.max_len, choice.micro_rows, choice.remat, home))
        fits = choice.strategy == right
        return choice.peak_bytes if fits else max(round(1.05 * choice.peak_bytes), budget + 1)

    search = plan.Search(MODEL, profile, 2, budget)
    found = plan.plan_checked(search, lengths, CONTEXT, measured)
    assert {b.strategy for b in found.buckets if b.rows} == {right}
    assert len(rounds) > 8 and len(checked) == len(set(checked))
    assert all(measured(b, found.home) <= budget for b in found.buckets if b.rows)


def test_a_strategys_measured_under_count_carries_to_its_longer_rows_not_its_shorter():
    """XLA's bytes over the model's for one micro-step scale the strategy's others not measured
    yet at that length (any remat policy) and longer, never shorter ones."""
    search = plan.Search(MODEL, load_profile("a800-4x8"), 2, 80 * GiB)
    strategy = search.strategies[0]
    shards, home = strategy.batch_shards, search.resident[strategy]

    def peak(length: int, remat: str) -> int:
        run = plan.RunAs(shards, remat, "local")
        return search.micro_step_as_run(strategy, length, run, shards).peak_bytes

    cases = [(length, remat) for length in (512, 1024, 2048) for remat in ("dots", "full")]
    before = {case: peak(*case) for case in cases}
    measured = plan.Choice(0, 1024, strategy, shards, "dots", 1, shards, 0, 0, 0.0,
                           before[1024, "dots"] + home)
    search.correct(measured, home, 2 * before[1024, "dots"] + home)
    for (length, remat), bytes_before in before.items():
        assert peak(length, remat) == pytest.approx(bytes_before * (2 if length >= 1024 else 1),
                                                    abs=2)
