"""Each optimizer declares its state (`hotjax.models.optimizers`): the arrays it declares per
weight are optax's, the bytes `strategy show` and the home choice count are the home's, its
checkpoint resumes where an uninterrupted run goes, and another optimizer's checkpoint is refused
in one line unless only its weights are restored."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import TINY, trainer

from hotjax.checkpoint import meta as meta_lib
from hotjax.checkpoint import store
from hotjax.checkpoint.formats.pivot import ExportSource
from hotjax.checkpoint.training import restore_state
from hotjax.data import Batch, MiniBatch
from hotjax.errors import UserError
from hotjax.models.llama import PRESETS, abstract_params, param_axes
from hotjax.models.optimizers import FACTOR_MIN, OPTIMIZERS, SCHEDULES
from hotjax.optim import OptimConfig, make_optimizer
from hotjax.sharding.report import state_bytes
from hotjax.sharding.strategy import Strategy
from hotjax.train import Trainer

# Wide enough that Adafactor factors its matrices (both of their dimensions >= FACTOR_MIN).
WIDE = PRESETS["small"]
STRATEGY = "fsdp=2"
RECORD = {"model": TINY.to_dict(), "tokenizer": {"identity": "bytes"}, "data": {}}


def _optim(name: str) -> OptimConfig:
    return OptimConfig(name=name, lr=3e-3, warmup_steps=1, total_steps=4)


def _trainer(name: str, devices) -> Trainer:
    return trainer(STRATEGY, devices[:2], config=TINY, optim=_optim(name))


def _batch(seed: int) -> MiniBatch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, TINY.vocab_size, (4, 64)).astype(np.int32)
    positions = np.tile(np.arange(64, dtype=np.int32), (4, 1))
    return MiniBatch((Batch(tokens, np.ones_like(tokens), positions),))


def _host(tree):
    return jax.tree.map(np.array, tree)  # copies, never views of device buffers


def _save(directory, name: str, state, step: int):
    checkpoints = store.Checkpoints(directory)
    record = meta_lib.record(step=step, source="test", items=[], model=TINY.to_dict(),
                             tokenizer={"identity": "bytes"},
                             optimizer=dataclasses.asdict(_optim(name)))
    checkpoints.save(step, state.params, state.opt_state, record, None)
    checkpoints.close()
    return directory / str(step)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_declared_state_of_each_weight_is_optaxs(name):
    declared = OPTIMIZERS[name]
    params = abstract_params(WIDE)
    state = jax.eval_shape(make_optimizer(OptimConfig(name=name), param_axes(WIDE)).init, params)
    weights = {"/".join(k.key for k in path): leaf.shape
               for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    found: dict[str, list] = {w: [] for w in weights}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        owner = [w for w in weights if keys.endswith("/" + w)]
        if owner:
            found[owner[0]].append(leaf.shape)
        else:
            assert leaf.shape == (), keys  # step counters
    for weight, shape in weights.items():
        assert sorted(found[weight]) == sorted(declared.state_shapes(shape)), weight
    copies = sum(len([a for a in declared.state_shapes(s) if a == s]) for s in weights.values())
    assert copies == declared.copies * len(weights) or declared.factored
    if declared.factored:  # the wide matrices keep rows and columns, not copies of themselves
        factored = {w for w, shape in weights.items() if shape not in declared.state_shapes(shape)}
        assert factored == {w for w, shape in weights.items()
                            if sorted((0, *shape))[-2] >= FACTOR_MIN} >= {"embed", "layers/w_up"}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_strategy_shows_the_bytes_of_the_homes_optimizer_state(name, devices):
    home = _trainer(name, devices).home
    counted = state_bytes(Strategy.parse(STRATEGY), TINY, OPTIMIZERS[name])
    scalars = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(home._state_shapes)
                  if x.shape == ())  # step counters: replicated, left out of the count
    assert home.state_bytes() == counted["params"] + counted["optimizer"] + scalars


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_resumed_run_equals_the_uninterrupted_one(name, devices, tmp_path):
    trainer = _trainer(name, devices)
    state, _, _ = trainer.step(trainer.init(seed=0), _batch(0))
    path = _save(tmp_path, name, state, 1)
    state, _, _ = trainer.step(state, _batch(1))
    uninterrupted = _host(state)
    resumed = restore_state(path, trainer.home, RECORD)
    assert resumed.step == 1
    declared = OPTIMIZERS[name]
    if declared.torch:  # its state by torch's names for the torch exports, or a refusal
        assert ExportSource.of(path).state_fields == tuple(t for t, _ in declared.torch)
    else:
        with pytest.raises(UserError, match="keeps state torch's optimizers do not name"):
            ExportSource.of(path)
    state, _, _ = trainer.step(resumed.state, _batch(1))
    for want, got in zip(jax.tree.leaves(uninterrupted), jax.tree.leaves(_host(state)),
                         strict=True):
        np.testing.assert_array_equal(got, want)


def test_another_optimizers_checkpoint_is_refused_unless_only_its_weights_are_asked_for(
        devices, tmp_path):
    lion = _trainer("lion", devices)
    state = lion.init(seed=0)
    path = _save(tmp_path, "lion", state, 3)
    params = _host(state.params)
    adamw = _trainer("adamw", devices)
    with pytest.raises(UserError) as refused:
        restore_state(path, adamw.home, RECORD)
    assert "\n" not in str(refused.value)
    assert "lion's but this run trains with adamw: pass --optimizer lion" in str(refused.value)
    resumed = restore_state(path, adamw.home, RECORD, weights_only=True)
    assert resumed.step == 0 and resumed.data is None
    for want, got in zip(jax.tree.leaves(params), jax.tree.leaves(_host(resumed.state.params)),
                         strict=True):
        np.testing.assert_array_equal(got, want)


# lr 1, warmup 2, horizon 10, minimum 0.1, WSD decaying the last half after the warmup: the rate
# at steps 1, 2, 6, 8, 10 and 12 (after the horizon), by each shape's formula.
SHAPE = {"lr": 1.0, "warmup_steps": 2, "total_steps": 12, "decay_steps": 10,
         "min_lr_ratio": 0.1, "decay_fraction": 0.5}
SHAPE_STEPS = np.array([1, 2, 6, 8, 10, 12])
SHAPE_RATES = {"cosine": [0.5, 1, 0.55, 0.1 + 0.45 * (1 + np.cos(0.75 * np.pi)), 0.1, 0.1],
               "linear": [0.5, 1, 0.55, 0.325, 0.1, 0.1],
               "constant": [0.5, 1, 1, 1, 1, 1],
               "wsd": [0.5, 1, 1, 0.55, 0.1, 0.1]}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_schedules_rate_at_a_step_is_its_formulas(schedule):
    rate = OptimConfig(schedule=schedule, **SHAPE).lr_schedule()
    np.testing.assert_allclose(rate(SHAPE_STEPS - 1), SHAPE_RATES[schedule], rtol=1e-6)
    if schedule == "cosine":  # optax's own, as the run counts steps from 1
        optax_rate = optax.warmup_cosine_decay_schedule(0.0, 1.0, 2, 10, 0.1)
        np.testing.assert_allclose(rate(SHAPE_STEPS - 1), optax_rate(SHAPE_STEPS), rtol=1e-6)


def test_the_flags_settings_reach_adamws_update():
    from hotjax.cli import run_config
    from hotjax.run import optim_config

    flags = ["--schedule", "constant", "--warmup-steps", "0", "--lr", "0.5", "--beta1", "0.8",
             "--beta2", "0.7", "--eps", "0.25", "--clip-norm", "1.5"]
    params = {"w": jnp.full((2, 3), 2.0), "norm": jnp.full((3,), 2.0)}
    grads = {"w": jnp.full((2, 3), 1.0), "norm": jnp.full((3,), -1.0)}  # norm 3: clipped to 1.5
    axes = {"w": ("embed", "mlp"), "norm": ("norm",)}
    for decay in (0.0, 0.1):
        optim = optim_config(run_config(["train", *flags, "--weight-decay", str(decay)]))
        tx = make_optimizer(optim, axes)
        updates, state = tx.update(grads, tx.init(params), params)
        clipped = jax.tree.map(lambda g: g * 1.5 / 3.0, grads)
        adam = optax.tree_utils.tree_get(state, "ScaleByAdamState")
        # The first moments, (1 - b1) g and (1 - b2) g^2; bias-corrected, g and g^2 again.
        np.testing.assert_allclose(adam.mu["w"], 0.2 * clipped["w"], rtol=1e-6)
        np.testing.assert_allclose(adam.nu["norm"], 0.3 * clipped["norm"] ** 2, rtol=1e-6)
        for name in params:
            g = clipped[name]
            want = -0.5 * (g / (jnp.abs(g) + 0.25) + decay * params[name] * (name == "w"))
            np.testing.assert_allclose(updates[name], want, rtol=1e-6)
