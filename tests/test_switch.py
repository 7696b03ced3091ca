"""The hot-switch executor: scheduled switches move the tiny model's values exactly, to exactly the
target shardings, as fresh buffers, and agree with `jax.device_put`."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MODEL
from jax.sharding import NamedSharding, PartitionSpec

from hotjax.errors import UserError
from hotjax.models.llama import abstract_params, param_axes
from hotjax.sharding.strategy import Layout, Strategy, fit_to_model
from hotjax.sharding.switch import chosen_method, scheduled_switch, switch
from hotjax.sharding.transfers import MIN_PIECE_BYTES, Topology

TWO_NODES_OF_4 = Topology(devices_per_node=4)


def shardings(text: str, devices) -> dict:
    return Layout(fit_to_model(Strategy.parse(text), MODEL)[0], devices).param_shardings(
        param_axes(MODEL), abstract_params(MODEL))


@pytest.fixture(scope="module")
def values() -> dict:
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32),
                        abstract_params(MODEL))


def assert_holds(tree, expected, target_shardings) -> None:
    for x, want, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(expected),
                                 jax.tree.leaves(target_shardings), strict=True):
        np.testing.assert_array_equal(np.asarray(x), want)
        assert x.sharding == sharding


def buffers(tree) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)
            for s in x.addressable_shards}


@pytest.mark.parametrize("source, target, min_piece_bytes", [
    ("data=2,tensor=4", "fsdp=2,context=4", MIN_PIECE_BYTES),
    ("tensor=8", "data=8", MIN_PIECE_BYTES),  # K/V heads replicated over pairs of devices
    ("data=4,tensor=2", "data=2,tensor=4", 0),  # slices split among their replicas
])
def test_a_planned_switch_moves_the_values_exactly_to_the_target_shardings(
        source, target, min_piece_bytes, values, devices):
    src = jax.device_put(values, shardings(source, devices))
    targets = shardings(target, devices)
    planned = scheduled_switch(src, targets, TWO_NODES_OF_4, min_piece_bytes=min_piece_bytes)
    assert planned.plan.transfers, "the pair moves data"

    out = planned(src)

    assert_holds(out, values, targets)
    assert_holds(jax.device_put(src, targets, may_alias=False), values, targets)  # the baseline
    assert not buffers(out) & buffers(src)


def test_a_tree_of_several_dtypes_and_a_scalar_switches_exactly(values, devices):
    mesh = Layout(Strategy.parse("data=4,tensor=2"), devices).mesh
    tree = {"params": jax.tree.map(lambda v: v.astype(jnp.bfloat16), values),
            "step": np.int32(7)}
    expected = jax.tree.map(np.asarray, tree)
    src = jax.device_put(tree, {"params": shardings("data=4,tensor=2", devices),
                                "step": NamedSharding(mesh, PartitionSpec())})
    targets = {"params": shardings("data=2,tensor=4", devices),
               "step": Layout(Strategy.parse("data=8"), devices).replicated}

    out = switch(src, targets, "scheduled", TWO_NODES_OF_4)

    assert_holds(out, expected, targets)
    assert out["params"]["embed"].dtype == jnp.bfloat16 and out["step"].dtype == jnp.int32


@pytest.mark.parametrize("method", ["scheduled", "device_put"])
def test_the_source_stays_valid_after_the_switched_tree_is_donated(method, values, devices):
    # Norm weights are replicated under both strategies: the leaves `device_put`
    # returns aliased (donating the new tree then invalidated the old one).
    src = jax.device_put(values, shardings("data=2,tensor=4", devices))
    out = switch(src, shardings("fsdp=2,context=4", devices), method, TWO_NODES_OF_4)
    assert not buffers(out) & buffers(src)

    consumed = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)(out)
    jax.block_until_ready(consumed)
    jax.tree.map(lambda x: x.delete(), consumed)

    jax.tree.map(lambda x, want: np.testing.assert_array_equal(np.asarray(x), want), src, values)


def test_auto_measures_both_methods_once_per_layout_pair_and_keeps_the_faster(values, devices):
    src = jax.device_put(values, shardings("data=2,tensor=4", devices))
    targets = shardings("fsdp=2,context=4", devices)
    assert chosen_method(src, targets, TWO_NODES_OF_4) is None

    out = switch(src, targets, "auto", TWO_NODES_OF_4)

    assert chosen_method(src, targets, TWO_NODES_OF_4) in ("scheduled", "device_put")
    assert_holds(out, values, targets)
    again = jax.device_put(values, shardings("data=2,tensor=4", devices))  # new arrays
    assert scheduled_switch(again, targets, TWO_NODES_OF_4) is scheduled_switch(src, targets,
                                                                            TWO_NODES_OF_4)


def test_an_unknown_method_or_a_leaf_that_is_not_an_array_is_a_user_error(devices):
    replicated = Layout(Strategy.parse("data=8"), devices).replicated
    with pytest.raises(UserError, match="scheduled, device_put, auto"):
        switch({"w": jnp.ones(8)}, {"w": replicated}, "fastest")
    with pytest.raises(UserError, match="tree of jax.Array, got a ndarray"):
        switch({"w": np.ones(8)}, {"w": replicated}, "scheduled")
