"""A single strategy (the one-bucket table): its loss, and that every layout computes what one
device does."""

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MODEL, OPTIM, trainer

from hotjax.data import Batch, ByteTokenizer, MiniBatch, MiniBatches, open_corpus
from hotjax.errors import UserError
from hotjax.models.head_loss import NO_TARGET, token_loss
from hotjax.sharding.strategy import Layout, Strategy
from hotjax.sharding.table import Bucket, StrategyTable
from hotjax.step import micro_step_inputs, next_token_targets
from hotjax.train import Trainer

SEQ = 128


@pytest.fixture(scope="module")
def stdlib_batches(tmp_path_factory) -> list[MiniBatch]:
    """Mixed-length pieces of real code, so rows hold several documents and some padding;
    one bucket, with as many rows as each mini-batch needs."""
    rng = np.random.default_rng(0)
    text = open_corpus(None).read(0)
    starts = rng.integers(0, len(text) - 400, size=300)
    pieces = [text[s:s + n] for s, n in zip(starts, rng.integers(5, 300, size=300), strict=True)]
    path = tmp_path_factory.mktemp("corpus") / "pieces.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in pieces))
    batches = MiniBatches(open_corpus(str(path)), ByteTokenizer(), [SEQ], batch_tokens=1024,
                          seed=0)
    return list(itertools.islice(batches, 3))


def _trainer(strategy: str, devices, config=MODEL) -> Trainer:
    return trainer(strategy, devices, max_len=SEQ, config=config)


def _run(strategy: str, devices, batches, config=MODEL):
    trainer = _trainer(strategy, devices, config)
    state = trainer.init(seed=0)
    losses, params = [], []
    for batch in batches:
        state, metrics = trainer.train_step(state, batch)
        losses.append(metrics["loss"])
        params.append(jax.tree.map(np.asarray, state.params))
    return np.array(losses), params


@pytest.fixture(scope="module")
def one_device_run(devices, stdlib_batches):
    return _run("data=1", devices[:1], stdlib_batches)


@pytest.mark.parametrize("strategy", ["data=8,rules=dp", "fsdp=8", "data=2,fsdp=4"])
def test_every_strategy_trains_exactly_like_one_device(strategy, devices, stdlib_batches,
                                                       one_device_run):
    losses, params = _run(strategy, devices, stdlib_batches)
    ref_losses, ref_params = one_device_run
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert losses[-1] < losses[0]  # the three updates did something
    for step in range(len(losses)):
        diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params[step],
                             ref_params[step])
        assert max(jax.tree.leaves(diffs)) <= 1e-5, (step, diffs)


def _plain_jax_training(batches: list[MiniBatch]):
    """The reference the trainer answers to, written without any of its code: the model's loss
    over every row of a mini-batch by `jax.value_and_grad`, divided by the target count, then
    one Optax update — no buckets, micro-batches, switches or accumulators."""
    from hotjax.models.llama import bind, init_params, param_axes
    from hotjax.optim import make_optimizer

    tx = make_optimizer(OPTIM, param_axes(MODEL))
    params = init_params(MODEL, seed=0)
    opt_state, losses = tx.init(params), []

    @jax.jit
    def step(params, opt_state, tokens, segments, positions, targets):
        def loss_fn(params):
            logits = bind(MODEL, params)(tokens, segments, positions)
            total, count = token_loss(logits, targets)
            return total / count

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return jax.tree.map(jnp.add, params, updates), opt_state, loss

    for minibatch in batches:
        (batch,) = minibatch.buckets
        params, opt_state, loss = step(params, opt_state, batch.tokens, batch.segment_ids,
                                       batch.positions,
                                       next_token_targets(batch.tokens, batch.segment_ids))
        losses.append(float(loss))
    return np.array(losses), jax.tree.map(np.asarray, params)


def test_one_device_equals_a_plain_jax_training_loop(stdlib_batches, one_device_run):
    ref_losses, ref_params = _plain_jax_training(stdlib_batches)
    losses, params = one_device_run
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params[-1], ref_params)
    assert max(jax.tree.leaves(diffs)) <= 1e-5, diffs


def test_first_loss_is_the_untrained_cross_entropy(one_device_run):
    # Initial logits are near zero, so the loss starts at about ln(vocab).
    losses, _ = one_device_run
    assert abs(losses[0] - np.log(MODEL.vocab_size)) < 0.05


def test_loss_counts_only_tokens_that_continue_a_document():
    rng = np.random.default_rng(0)
    V = 11
    logits = rng.normal(size=(2, 6, V)).astype(np.float32)
    tokens = rng.integers(0, V, size=(2, 6)).astype(np.int32)
    segments = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]], np.int32)
    targets = next_token_targets(tokens, segments)
    total, count = token_loss(jnp.asarray(logits), jnp.asarray(targets))

    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    # Targets: row 0 predicts positions 1, 2 (doc 1) and 4 (doc 2); row 1 predicts 1..5.
    predicted = [(0, 1), (0, 2), (0, 4)] + [(1, t) for t in range(1, 6)]
    expected = -sum(log_probs[b, t - 1, tokens[b, t]] for b, t in predicted)
    assert int(count) == len(predicted)
    np.testing.assert_allclose(float(total), expected, rtol=1e-6)


def test_padding_content_does_not_change_the_loss(devices, stdlib_batches):
    (batch,) = stdlib_batches[0].buckets
    assert (batch.segment_ids == 0).any(), "the test needs a batch with padding"
    noisy = np.where(batch.segment_ids == 0, 7, batch.tokens).astype(np.int32)
    trainer = _trainer("data=8,rules=dp", devices)
    losses = []
    for tokens in (batch.tokens, noisy):
        minibatch = MiniBatch((dataclasses.replace(batch, tokens=tokens),))
        _, metrics = trainer.train_step(trainer.init(seed=0), minibatch)
        losses.append(metrics["loss"])
    assert losses[0] == losses[1]


def test_bfloat16_compute_keeps_float32_master_weights(devices, stdlib_batches, one_device_run):
    bf16 = dataclasses.replace(MODEL, compute_dtype="bfloat16")
    losses, params = _run("data=8,rules=dp", devices, stdlib_batches, config=bf16)
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(params[-1]))
    ref_losses, _ = one_device_run
    np.testing.assert_allclose(losses, ref_losses, atol=2e-2)


def test_a_bucket_is_cut_into_micro_batches_and_only_the_last_is_padded(devices):
    layout = Layout(Strategy.parse("data=8,rules=dp"), devices)
    tokens = np.arange(11 * 16, dtype=np.int32).reshape(11, 16)
    segments = np.ones_like(tokens)
    micro = micro_step_inputs(layout, Batch(tokens, segments, np.zeros_like(tokens)), 8)
    assert [m["tokens"].shape for m in micro] == [(8, 16), (8, 16)]
    np.testing.assert_array_equal(np.concatenate([m["tokens"] for m in micro])[:11], tokens)
    last = micro[1]
    assert int(last["segment_ids"].sum()) == 3 * 16  # three real rows, five empty ones
    assert (last["targets"][3:] == NO_TARGET).all()  # the empty rows have nothing to predict
    np.testing.assert_array_equal(last["targets"][:3, :-1], tokens[8:, 1:])


def test_micro_rows_or_buckets_that_do_not_fit_the_layout_are_user_errors(devices,
                                                                         stdlib_batches):
    table = StrategyTable((Bucket(SEQ, Strategy.parse("data=8"), 4),), "four-rows")
    with pytest.raises(UserError, match="micro_rows 4 does not split over the 8 batch shards"):
        Trainer(MODEL, OPTIM, table, devices)
    trainer = _trainer("data=8,rules=dp", devices)
    (batch,) = stdlib_batches[0].buckets
    shorter = MiniBatch((Batch(*(a[:, :64] for a in (batch.tokens, batch.segment_ids,
                                                      batch.positions))),))
    with pytest.raises(UserError, match=r"mini-batch buckets \[64\] are not the table's \[128\]"):
        trainer.step(trainer.init(seed=0), shorter)


def test_a_run_built_from_parts_steps_without_waiting_and_trains_as_the_trainer(
        devices, stdlib_batches, one_device_run):
    """`Run` of a model, a table and an optax optimizer made in Python: each step returns
    before its metrics are read (device values, fetched when asked), and the losses and weights
    are the trainer's with hotjax's own AdamW."""
    from hotjax.models.llama import param_axes
    from hotjax.optim import make_optimizer
    from hotjax.run import Run

    table = StrategyTable.single(Strategy.parse("data=1"), SEQ, "in Python")
    run = Run(MODEL, table, make_optimizer(OPTIM, param_axes(MODEL)), stdlib_batches,
              devices=devices[:1])
    state, steps = run.init(0), []
    for _ in stdlib_batches:
        state, metrics = run.step(state)
        assert isinstance(metrics.device["loss"], jax.Array)  # not read yet
        steps.append(metrics)
    ref_losses, ref_params = one_device_run
    np.testing.assert_allclose([m["loss"] for m in steps], ref_losses, rtol=0, atol=1e-5)
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))),
                         jax.tree.map(np.asarray, state.params), ref_params[-1])
    assert max(jax.tree.leaves(diffs)) <= 1e-5, diffs
