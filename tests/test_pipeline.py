"""Pipeline stages: the stacked layers split over `stage`, a micro-step's rows into micro-batches
run 1F1B's schedule (or GPipe's), and one step equals one device's; a stage holds its share of
the layers, and under 1F1B the residuals of at most 2S - 1 micro-batches."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MODEL, OPTIM, TINY_RUN, compiled_update, error, minibatch, trainer

from hotjax.cli import main
from hotjax.data import Batch, MiniBatch
from hotjax.errors import UserError
from hotjax.models.llama import PRESETS, abstract_params
from hotjax.models.pipeline import (
    _shared_head,
    bubble,
    filled_microbatches,
    head_cut,
    in_flight,
)
from hotjax.sharding.report import describe
from hotjax.sharding.strategy import Strategy
from hotjax.step import Home, bucket_step, chain_inputs, micro_step_inputs, step_memory

# Eight layers, so that each of eight stages holds one; fp32, so that every layout must give the
# one-device numbers to reduction-order noise.
CONFIG = dataclasses.replace(MODEL, n_layers=8)
SEQ, ROWS = 64, 16


@pytest.fixture(scope="module", name="minibatch")
def two_documents_a_row() -> MiniBatch:
    """Rows of two documents each, row r ending in r padding tokens."""
    return minibatch((ROWS, SEQ), documents=2)


def _one_step(strategy: str | Strategy, devices, minibatch: MiniBatch, config=CONFIG,
              rows: int | None = None):
    run = trainer(strategy, devices, max_len=SEQ, rows=rows, config=config)
    state, metrics, _ = run.step(run.init(seed=0), minibatch)
    return float(metrics["loss"]), jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def one_device(devices, minibatch):
    return _one_step("data=1", devices[:1], minibatch)


@pytest.mark.parametrize("strategy", [
    "stage=2,data=4,microbatches=2", "stage=2,data=4",  # M = S, and M = 2S (the default)
    "stage=4,tensor=2,microbatches=4", "stage=4,tensor=2",
    "stage=2,fsdp=2,tensor=2,microbatches=2", "stage=2,fsdp=2,tensor=2",
    "stage=8,microbatches=8", "stage=8",
])
def test_one_pipelined_step_equals_the_single_device_step(strategy, devices, minibatch,
                                                          one_device):
    _assert_equal(_one_step(strategy, devices, minibatch), one_device)


def _assert_equal(step, reference_step) -> None:
    loss, params = step
    assert loss == pytest.approx(reference_step[0], abs=1e-5)
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        reference = reference_step[1]
        for key in path:
            reference = reference[key.key]
        np.testing.assert_allclose(x, reference, atol=1e-5, rtol=0, err_msg=str(path))


@pytest.mark.parametrize("strategy, schedule, remat, tied", [
    # 16 rows in micro-steps of 4: four micro-steps of one bucket.
    ("stage=2,data=2,tensor=2,microbatches=2", "gpipe", "none", False),
    ("stage=2,data=2,tensor=2,microbatches=2", "1f1b", "full", False),
    ("stage=2,context=2,data=2,rules=context,microbatches=2", "1f1b", "dots", True),
])
def test_each_schedule_and_remat_policy_over_several_micro_steps_equals_one_device(
        strategy, schedule, remat, tied, devices, minibatch, one_device):
    config = dataclasses.replace(CONFIG, remat=remat, tie_embeddings=tied,
                                 pipeline_schedule=schedule)
    # The reference recomputes nothing and runs no pipeline: neither changes a number.
    reference = (_one_step("data=1", devices[:1], minibatch,
                           dataclasses.replace(CONFIG, tie_embeddings=True))
                 if tied else one_device)
    _assert_equal(_one_step(strategy, devices, minibatch, config), reference)


def test_a_bucket_of_three_micro_steps_runs_as_one_schedule_and_equals_one_device(
        devices, minibatch):
    """Ten rows in micro-steps of four: one 1F1B schedule over a chain of four micro-steps'
    micro-batches, the fourth micro-step empty and not run, the third half empty."""
    rows = minibatch.buckets[0]
    ten = MiniBatch((Batch(rows.tokens[:10], rows.segment_ids[:10], rows.positions[:10]),))
    strategy = Strategy.parse("stage=2,data=2,tensor=2,microbatches=2")
    bucket = bucket_step(CONFIG, strategy, tuple(devices))
    micro = micro_step_inputs(bucket.layout, ten.buckets[0], 4)
    ((chain, arrays),) = bucket.calls(micro)
    assert (len(micro), chain) == (3, 4)
    # Micro-batches of two rows (one per data shard): six hold rows, the last two none.
    assert int(filled_microbatches(arrays["segment_ids"], chain * 2)) == 6
    _assert_equal(_one_step(strategy, devices, ten, rows=4),
                  _one_step("data=1", devices[:1], ten))


def test_chained_micro_batches_are_the_micro_steps_own_on_the_same_data_shards():
    """Micro-step k's micro-batch m becomes micro-batch k·M + m of the chain, each data shard
    keeping its rows: rows numbered (micro-step, shard, row), read back through the schedule's
    view of micro-batches."""
    K, shards, M, per = 3, 2, 2, 2  # rows per micro-step: shards x M x rows per micro-batch
    R = shards * M * per
    micro = [{"tokens": (100 * k + np.arange(R, dtype=np.int32))[:, None].repeat(3, axis=1)}
             for k in range(K)]
    tokens = chain_inputs(micro, 4, shards, M)["tokens"][:, 0]
    by_micro_batch = tokens.reshape(-1, 4 * M).T  # `hotjax.models.pipeline._micro_batches`
    for k in range(K):
        own = micro[k]["tokens"][:, 0].reshape(-1, M).T  # the micro-step run alone
        for m in range(M):
            np.testing.assert_array_equal(by_micro_batch[k * M + m], own[m])
    assert not by_micro_batch[K * M:].any()  # the empty micro-step's micro-batches last
    # Each data shard's half of the chain holds its own rows of every micro-step.
    for shard, half in enumerate(np.split(tokens, shards)):
        assert {t % 100 // (R // shards) for t in half if t} == {shard}


@pytest.mark.parametrize(("rows", "tokens", "row_shards", "cut"), [
    (8, 6, 2, "rows"), (4, 6, 4, "tokens"), (3, 5, 1, None)])
def test_the_head_shared_by_the_stage_groups_gives_the_whole_micro_batchs_sums(
        rows, tokens, row_shards, cut):
    """The head's work cut among two stage groups (by rows where each data shard's block
    divides, else by tokens, else not at all): summed over the pieces, the loss, the count and
    the weights' gradients (each piece's kept apart, `[pieces, ...]`) are the whole
    micro-batch's; cut by rows, each piece's rows come from every data shard's own block."""
    def head(p, x, targets):
        mask = targets >= 0
        return jnp.sum(jnp.where(mask, (x @ p["w"]).sum(-1), 0.0) ** 2), jnp.sum(mask)

    assert head_cut(rows, tokens, 2, row_shards) == cut
    pieces = 1 if cut is None else 2
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(rows, tokens, 3)), jnp.float32)
    targets = jnp.asarray(rng.integers(-1, 5, size=(rows, tokens)), jnp.int32)
    p = {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)}
    shared = _shared_head(head, cut, 2, row_shards)
    p_S = jax.tree.map(lambda w: jnp.broadcast_to(w, (pieces, *w.shape)), p)
    (totals, counts), d_S = jax.value_and_grad(
        lambda p_S: (lambda t, c: (t.sum(), c))(*shared(p_S, x, targets)), has_aux=True)(p_S)
    (total, count), d = jax.value_and_grad(lambda p: head(p, x, targets), has_aux=True)(p)
    assert d_S["w"].shape == (pieces, 3, 4) and counts.shape == (pieces,)
    np.testing.assert_allclose(totals, total, rtol=1e-6)
    assert int(counts.sum()) == int(count)
    np.testing.assert_allclose(d_S["w"].sum(0), d["w"], rtol=1e-5)
    if cut == "rows":  # row r of data shard b's block of 4 goes to group (r % 4) // 2
        ids = jnp.arange(rows, dtype=jnp.float32)[:, None, None] * jnp.ones((1, tokens, 3))
        seen = jax.vmap(lambda a: a[:, 0, 0])(
            _shared_head(lambda p, a, t: (a, t), cut, 2, row_shards)(p_S, ids, targets)[0])
        np.testing.assert_array_equal(seen, [[0, 1, 4, 5], [2, 3, 6, 7]])


def test_a_chained_schedule_holds_no_more_than_one_micro_step_by_xla(devices):
    """Four micro-steps in one schedule hold the residuals of 2S - 1 micro-batches, as one
    does: XLA's temporaries grow by less than a tenth (the four's int32 rows), not fourfold."""
    bucket = bucket_step(CONFIG, Strategy.parse("stage=2,data=4,microbatches=2"),
                         tuple(devices))
    one, four = (step_memory(bucket.compiled((8, SEQ), chain))["temp"] for chain in (1, 4))
    assert one <= four < 1.1 * one


def test_1f1b_holds_fewer_micro_batches_than_gpipe_by_xla(devices):
    """Eight micro-batches over two stages: GPipe keeps nine ticks' activations, 1F1B three
    micro-batches'. XLA's temporaries of the micro-step shrink by a third (14.1 against 20.9 MB
    on this tiny model, where the logits and the gradients weigh as much as the activations)."""
    strategy = Strategy.parse("stage=2,data=4,microbatches=8")

    def temp(schedule: str) -> int:
        config = dataclasses.replace(CONFIG, pipeline_schedule=schedule)
        step = bucket_step(config, strategy, tuple(devices)).compiled((32, SEQ))
        return step_memory(step)["temp"]

    assert (in_flight(2, 8, "gpipe"), in_flight(2, 8)) == (9, 3)
    assert temp("1f1b") < 0.7 * temp("gpipe")


def test_a_stage_holds_its_share_of_the_layers_by_xla(devices):
    """XLA's bytes of the update's arguments (fp32 parameters, Adam moments, gradient sum): the
    layers' part under stage=4 is a quarter of data=8's, the rest (replicated) unchanged."""
    def argument_bytes(strategy: str) -> int:
        home = Home(CONFIG, OPTIM, Strategy.parse(strategy), devices)
        return compiled_update(home).memory_analysis().argument_size_in_bytes

    layers = sum(x.size * 4 for x in jax.tree.leaves(abstract_params(CONFIG)["layers"]))
    copies = 4  # parameters, two moments, the gradient sum
    saved = argument_bytes("data=8,rules=dp") - argument_bytes("stage=4,data=2,rules=dp")
    assert saved == pytest.approx(copies * layers * (1 - 1 / 4), rel=1e-3)
    report = describe(Strategy.parse("stage=4,data=2,rules=dp"), CONFIG)
    whole = describe(Strategy.parse("data=8,rules=dp"), CONFIG)
    assert whole["bytes_per_device"]["params"] - report["bytes_per_device"]["params"] == \
        layers * 3 // 4


def test_strategy_show_gives_stages_layers_micro_batches_and_the_bubble(capsys):
    assert main(["strategy", "show", "stage=4,tensor=2,microbatches=12", "--model", "small",
                 "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    pipeline = report["pipeline"]
    assert (pipeline["stages"], pipeline["layers_per_stage"], pipeline["microbatches"]) == \
        (4, PRESETS["small"].n_layers // 4, 12)
    assert pipeline["bubble"] == pytest.approx(3 / 15) == bubble(4, 12)
    assert report["batch_shards"] == 12  # rows: one per micro-batch (tensor splits no rows)
    assert report["mesh"] == {"stage": 4, "tensor": 2}
    layer = next(p for p in report["params"] if p["name"] == "layers/w_up")
    assert layer["spec"] == "(stage, None, tensor)"


@pytest.mark.parametrize("strategy, expected", [
    ("stage=4,data=2", "2 layers do not split into 4 pipeline stages"),
    ("stage=4,data=2,microbatches=2", "microbatches=2 < stage=4"),
    ("data=8,microbatches=4", "microbatches are a pipeline's"),
])
def test_bad_pipelines_are_one_line_errors(strategy, expected, tmp_path, capsys):
    assert expected in error([*TINY_RUN, "--steps", "1", "--strategy", strategy], capsys)


@pytest.mark.parametrize("rules, expected", [
    ('{ params = { embed = "fsdp" }, activations = { batch = "data" } }',
     "mesh axis stage=2 is not used by rules"),
    ('{ params = { embed = "stage" }, activations = { batch = "data" } }',
     "do not split the stacked layers over stage"),
    ('{ params = { layers = "stage" }, activations = { batch = ["data", "stage"] } }',
     "split activation axis batch over stage"),
])
def test_rules_that_cannot_hold_a_pipeline_are_refused(rules, expected):
    with pytest.raises(UserError, match=expected):
        import tomllib

        from hotjax.sharding.table import parse_table

        parse_table(tomllib.loads(f"[[bucket]]\nmax_len = 64\nmesh = {{ stage = 2, data = 4 }}\n"
                                  f"rules = {rules}\n"), "t.toml")
