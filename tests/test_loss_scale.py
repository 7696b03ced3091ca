"""FP16 loss scaling: an overflow anywhere in a mini-batch skips exactly that update and halves
the scale; finite steps grow it; the scale is part of the optimizer state."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import MODEL, minibatch

from hotjax.data import MiniBatch
from hotjax.errors import UserError
from hotjax.optim import OptimConfig, loss_scale, make_optimizer
from hotjax.sharding.table import parse_table
from hotjax.train import Trainer

FP16 = dataclasses.replace(MODEL, compute_dtype="float16")
TABLE = parse_table({"bucket": [
    {"max_len": 32, "mesh": {"data": 8}},
    {"max_len": 64, "mesh": {"data": 2, "tensor": 4}, "rules": "megatron"},
]}, "two-buckets")
OVERFLOW = 2.0**40  # the loss times this overflows fp16 gradients (max 65504)


def documents(seed: int = 0) -> MiniBatch:
    """Four documents in each of the table's two buckets, one a row."""
    return minibatch((4, 32), (4, 64), documents=1, padded=False, seed=2 * seed)


def host(tree):
    return jax.tree.map(np.asarray, tree)


def assert_identical(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def inner_adam(opt_state):
    """The clipping and AdamW state under the loss scale and Optax's finite check."""
    return opt_state[1].inner_state


@pytest.mark.parametrize("overflowing_bucket", [0, 1])
def test_an_overflow_in_one_bucket_skips_the_whole_update_and_halves_the_scale(
        devices, monkeypatch, overflowing_bucket):
    optim = OptimConfig(loss_scaling="dynamic")
    trainer = Trainer(FP16, optim, TABLE, devices)
    state = trainer.init(seed=0)
    state, first = trainer.train_step(state, documents(0))  # a normal step moves Adam's state
    assert not first["skipped"] and first["loss_scale"] == 2.0**15
    before = host(state)
    # The test hook: one bucket's micro-steps see a loss scale that overflows fp16.
    bucket = trainer.buckets[overflowing_bucket]
    monkeypatch.setattr(bucket, "place_scale", lambda scale: jax.device_put(
        jnp.float32(OVERFLOW), bucket.layout.replicated))
    state, metrics = trainer.train_step(state, documents(1))
    assert metrics["skipped"] and metrics["skipped_steps"] == 1
    assert metrics["loss_scale"] == 2.0**15  # the scale this step ran with ...
    assert float(loss_scale(state.opt_state)) == 2.0**14  # ... halved for the next
    assert_identical(state.params, before.params)
    assert_identical(inner_adam(state.opt_state), inner_adam(before.opt_state))
    assert int(state.step) == int(before.step) + 1  # the data moved on all the same


def test_a_dynamic_scale_doubles_after_its_period_and_a_static_one_stays(devices):
    for scaling, expected in (("dynamic", [2.0**3, 2.0**3, 2.0**4, 2.0**4, 2.0**5]),
                              ("static", [2.0**3] * 5)):
        optim = OptimConfig(loss_scaling=scaling, loss_scale=2.0**3, loss_scale_period=2)
        trainer = Trainer(FP16, optim, TABLE, devices)
        state, scales = trainer.init(seed=0), []
        for step in range(5):
            state, metrics = trainer.train_step(state, documents(step))
            assert not metrics["skipped"]
            scales.append(metrics["loss_scale"])
        assert scales == expected, scaling


def test_a_static_scale_still_skips_an_overflowing_update(devices):
    optim = OptimConfig(loss_scaling="static", loss_scale=OVERFLOW)
    trainer = Trainer(FP16, optim, TABLE, devices)
    state = trainer.init(seed=0)
    before = host(state)
    state, metrics = trainer.train_step(state, documents(0))
    assert metrics["skipped"] and metrics["loss_scale"] == OVERFLOW
    assert float(loss_scale(state.opt_state)) == OVERFLOW
    assert_identical(state.params, before.params)


def test_without_loss_scaling_the_optimizer_is_plain_adamw():
    params = {"w": jnp.ones((2, 2))}
    plain = make_optimizer(OptimConfig(), {"w": ("embed", "mlp")})
    assert loss_scale(plain.init(params)) is None
    scaled = make_optimizer(OptimConfig(loss_scaling="dynamic"), {"w": ("embed", "mlp")})
    assert float(loss_scale(scaled.init(params))) == 2.0**15
    assert isinstance(scaled.init(params)[1], optax.ApplyIfFiniteState)


@pytest.mark.parametrize("fields, message", [
    ({"loss_scaling": "sometimes"}, "loss scaling 'sometimes': choose one of off, dynamic"),
    ({"loss_scale": 0.0}, "give a positive scale"),
    ({"loss_scale_period": 0}, "a period of at least one step"),
])
def test_bad_loss_scaling_is_refused(fields, message):
    with pytest.raises(UserError, match=message):
        OptimConfig(**fields)
