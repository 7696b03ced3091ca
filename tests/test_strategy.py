"""Strategies and strategy tables: parsing, validation, meshes and the shardings they give."""

import dataclasses

import jax
import numpy as np
import pytest
from helpers import TINY
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from hotjax.errors import UserError
from hotjax.models.llama import abstract_params, padded_vocab, param_axes
from hotjax.sharding.strategy import (
    DEFAULT_RULES,
    RULE_SETS,
    Layout,
    Strategy,
    canonical_devices,
    fit_to_model,
    ways,
)
from hotjax.sharding.table import Bucket, StrategyTable, load_table, parse_table


def layout(text: str, devices: list[jax.Device]) -> Layout:
    return Layout(Strategy.parse(text), devices)


def specs(shardings: dict) -> dict:
    return jax.tree.map(lambda s: s.spec, shardings, is_leaf=lambda s: isinstance(s, NamedSharding))


# --- Strategy.parse -------------------------------------------------------------------------------


def test_parse_orders_sizes_as_stage_data_fsdp_context_tensor_and_defaults_to_auto_rules():
    strategy = Strategy.parse("fsdp=4, data=2")

    assert strategy.sizes == (1, 2, 4, 1, 1)
    assert strategy.axes == {"stage": 1, "data": 2, "fsdp": 4, "context": 1, "tensor": 1}
    assert strategy.stages == 1 and strategy.microbatches is None
    assert strategy.num_devices == 8
    assert DEFAULT_RULES == "auto"
    assert strategy.rules.name == "auto"
    assert strategy.rules == RULE_SETS["auto"]
    assert str(strategy) == "data2·fsdp4 [auto]"


@pytest.mark.parametrize("text, shown", [
    ("fsdp=8", "fsdp8 [auto]"),
    ("data=1", "single [auto]"),
    ("context=2,tensor=4,rules=megatron-sp", "context2·tensor4 [megatron-sp]"),
    ("tensor=4,data=2,rules=megatron", "data2·tensor4 [megatron]"),
])
def test_a_strategy_shows_its_axes_above_1_and_its_rules_name(text, shown):
    assert str(Strategy.parse(text)) == shown


def test_parse_takes_a_named_rule_set():
    strategy = Strategy.parse("data=8,rules=dp")

    assert strategy.sizes == (1, 8, 1, 1, 1)
    assert strategy.rules.name == "dp"
    assert strategy.rules.params == (("layers", ("stage",)),)  # only a pipeline splits them
    assert strategy.rules.activations == (("batch", ("data", "fsdp")),)


def test_parsed_and_created_strategies_are_equal_and_hash_alike():
    # Strategies key caches of compiled steps, so equal strategies must hash alike.
    parsed = Strategy.parse("data=2,fsdp=4")
    created = Strategy.create({"data": 2, "fsdp": 4}, "auto")

    assert parsed == created
    assert hash(parsed) == hash(created)
    assert parsed == Strategy.create({"fsdp": 4, "data": 2})
    assert parsed != Strategy.parse("data=2,fsdp=4,rules=dp")
    assert parsed != Strategy.parse("data=2,fsdp=4,rules=fsdp")


def test_fsdp_axis_under_dp_rules_is_accepted_because_the_batch_splits_over_it(devices):
    strategy = Strategy.parse("fsdp=8,rules=dp")
    lay = Layout(strategy, devices)

    assert strategy.sizes == (1, 1, 8, 1, 1)
    assert lay.batch_sharding.spec == P("fsdp")
    assert lay.batch_shards == 8


@pytest.mark.parametrize("text, sizes", [
    ("tensor=8", (1, 1, 1, 1, 8)),
    ("context=8", (1, 1, 1, 8, 1)),
    ("data=2,tensor=4", (1, 2, 1, 1, 4)),
    ("fsdp=2,context=2,tensor=2", (1, 1, 2, 2, 2)),
])
def test_default_rules_use_every_mesh_axis(text, sizes):
    strategy = Strategy.parse(text)

    assert strategy.sizes == sizes
    assert strategy.rules == RULE_SETS["auto"]
    assert RULE_SETS["auto"].mesh_axes_used() == {"stage", "data", "fsdp", "context", "tensor"}


@pytest.mark.parametrize("text, axis, rules", [
    ("tensor=8,rules=fsdp", "tensor=8", "fsdp"),
    ("context=8,rules=dp", "context=8", "dp"),
    ("data=2,tensor=4,rules=context", "tensor=4", "context"),
    ("tensor=8,rules=dp", "tensor=8", "dp"),
    ("context=2,data=4,rules=dp", "context=2", "dp"),
    ("context=2,fsdp=4,rules=zero2", "context=2", "zero2"),
    ("fsdp=2,tensor=4,rules=fsdp", "tensor=4", "fsdp"),
])
def test_an_axis_the_chosen_rules_do_not_use_is_rejected(text, axis, rules):
    with pytest.raises(UserError) as e:
        Strategy.parse(text)
    assert str(e.value) == (
        f"--strategy {text!r}: mesh axis {axis} is not used by rules {rules!r} (every device "
        f"would repeat the same work): choose rules that use it, or drop the axis")


@pytest.mark.parametrize("text, named, fix", [
    ("pipe=2", "'pipe'", "use stage, data, fsdp, context, tensor"),
    ("data=2,pipe=4", "'pipe'", "use stage, data, fsdp, context, tensor"),
    ("data=x", "'data'", "must be a positive integer"),
    ("data=2.5", "'data'", "must be a positive integer"),
    ("data=-8", "'data'", "must be a positive integer"),
    ("data=", "'data'", "must be a positive integer"),
    ("data=²", "'data'", "must be a positive integer"),
    ("data=0", "data=0", "must be a positive integer"),
    ("data", "'data'", "expected AXIS=SIZE items, like 'data=2,fsdp=4'"),
    ("data=8,fsdp", "fsdp", "expected AXIS=SIZE items"),
    ("", "''", "give at least one mesh axis, e.g. 'data=8'"),
    (" , ", "' , '", "give at least one mesh axis"),
    ("rules=dp", "rules=dp", "give at least one mesh axis"),
    ("data=8,rules=zero", "'zero'",
     f"choose one of {', '.join(RULE_SETS)}, or give an inline table"),
    ("data=8,rules=tp", "'tp'", "choose one of dp, zero1"),
])
def test_bad_strategy_text_is_a_user_error_naming_the_item_and_the_fix(text, named, fix):
    with pytest.raises(UserError) as e:
        Strategy.parse(text)
    message = str(e.value)
    assert named in message
    assert fix in message


@pytest.mark.parametrize("mesh", [{"data": 8.0}, {"data": "8"}, {"data": True}, {"data": -1}])
def test_create_rejects_sizes_that_are_not_positive_integers(mesh):
    with pytest.raises(UserError, match=r"bucket 3: mesh axis data=.* must be a positive integer"):
        Strategy.create(mesh, where="bucket 3")


# --- Inline rules ---------------------------------------------------------------------------------


def test_inline_rules_equal_the_named_fsdp_rules(devices):
    inline = Strategy.create({"data": 2, "fsdp": 4}, {
        "params": {"embed": "fsdp", "layers": "stage"},
        "activations": {"batch": ["data", "fsdp"]},
    })
    named = Strategy.create({"data": 2, "fsdp": 4}, "fsdp")

    assert inline.rules.name == "inline"
    assert inline.rules.params == named.rules.params == (("embed", ("fsdp",)),
                                                         ("layers", ("stage",)))
    assert inline.rules.activations == named.rules.activations == (("batch", ("data", "fsdp")),)
    assert inline.rules.grads is inline.rules.optimizer is None
    axes, shapes = param_axes(TINY), abstract_params(TINY)
    assert (Layout(inline, devices).param_shardings(axes, shapes)
            == Layout(named, devices).param_shardings(axes, shapes))
    assert Layout(inline, devices).batch_sharding == Layout(named, devices).batch_sharding


@pytest.mark.parametrize("rules, named", [
    ({"params": {"embed": "pipe"}, "activations": {"batch": "data"}}, "'pipe' for 'embed'"),
    ({"params": {}, "activations": {"batch": ["data", "pipeline"]}}, "'pipeline' for 'batch'"),
])
def test_inline_rules_naming_an_unknown_mesh_axis_are_rejected(rules, named):
    with pytest.raises(UserError, match="unknown mesh axis") as e:
        Strategy.create({"data": 8}, rules)
    assert named in str(e.value)
    assert "use stage, data, fsdp, context, tensor" in str(e.value)


@pytest.mark.parametrize("rules", [{"param": {"embed": "fsdp"}}, {"zero": {}}, ["fsdp"], 3, {}])
def test_inline_rules_of_the_wrong_shape_are_rejected(rules):
    with pytest.raises(UserError) as e:
        Strategy.create({"fsdp": 8}, rules)
    assert str(e.value) == ("strategy: rules must be a rule-set name or a table with 'params', "
                            "'activations', 'grads', 'optimizer' (each logical axis -> mesh axes)")


@pytest.mark.parametrize("rules, expected", [
    ({"params": {"embd": "fsdp"}, "activations": {"batch": "fsdp"}},
     "strategy: params: unknown logical axis 'embd': use vocab, embed, heads, kv_heads, head_dim, "
     "mlp, layers, norm"),
    ({"params": {"seq": "fsdp"}, "activations": {"batch": "fsdp"}},
     "strategy: params: unknown logical axis 'seq': use vocab"),
    ({"activations": {"batch": "fsdp", "embd": "fsdp"}},
     "strategy: activations: unknown logical axis 'embd': use batch, seq, inner_seq, "
     "embed, heads, kv_heads, head_dim, mlp, vocab"),
    ({"activations": {"batch": "fsdp", "layers": "fsdp"}},
     "strategy: activations: unknown logical axis 'layers': use batch"),
    ({"activations": {"batch": "fsdp"}, "grads": {"embd": "fsdp"}},
     "strategy: grads: unknown logical axis 'embd': use vocab, embed"),
    ({"activations": {"batch": "fsdp"}, "optimizer": {"embd": "fsdp"}},
     "strategy: optimizer: unknown logical axis 'embd': use vocab, embed"),
])
def test_inline_rules_with_an_unknown_logical_axis_are_rejected_naming_it(rules, expected):
    # Parameters and activations have their own logical axes: `seq` is no parameter's axis.
    with pytest.raises(UserError) as e:
        Strategy.create({"fsdp": 8}, rules)
    assert str(e.value).startswith(expected)


def test_inline_rules_take_grads_and_optimizer_maps_for_zero():
    strategy = Strategy.create({"data": 2, "fsdp": 4}, {
        "activations": {"batch": ["data", "fsdp"]},
        "grads": {"embed": "fsdp"},
        "optimizer": {"embed": "fsdp", "vocab": "fsdp"},
    })
    embed = ("vocab", "embed")

    assert strategy.rules.params == ()
    assert strategy.rules.grads == (("embed", ("fsdp",)),)
    assert strategy.rules.optimizer == (("embed", ("fsdp",)), ("vocab", ("fsdp",)))
    assert strategy.param_spec(embed) == P()
    assert strategy.grad_spec(embed) == P(None, "fsdp")
    assert strategy.optimizer_spec(embed) == P("fsdp")  # `vocab` comes first and takes fsdp


def test_inline_grads_alone_leave_the_optimizer_state_following_the_parameters():
    strategy = Strategy.create({"fsdp": 8}, {
        "params": {"mlp": "fsdp"}, "activations": {"batch": "fsdp"}, "grads": {"embed": "fsdp"},
    })
    w_up = ("layers", "embed", "mlp")

    assert strategy.rules.optimizer is None
    assert strategy.param_spec(w_up) == P(None, None, "fsdp")
    assert strategy.grad_spec(w_up) == P(None, "fsdp")
    assert strategy.optimizer_spec(w_up) == P(None, None, "fsdp")


def test_an_axis_used_only_by_the_optimizer_rules_is_not_idle():
    # fsdp splits nothing but the optimizer state, and that is enough to keep it.
    strategy = Strategy.create({"data": 2, "fsdp": 4}, {
        "activations": {"batch": "data"}, "optimizer": {"embed": "fsdp"},
    })

    assert strategy.rules.mesh_axes_used() == {"data", "fsdp"}
    assert strategy.activation_spec(("batch", "seq")) == P("data")
    assert strategy.optimizer_spec(("vocab", "embed")) == P(None, "fsdp")
    with pytest.raises(UserError, match="mesh axis fsdp=4 is not used by rules 'inline'"):
        Strategy.create({"data": 2, "fsdp": 4}, {"activations": {"batch": "data"}})


# --- Layout: the mesh -----------------------------------------------------------------------------


@pytest.mark.parametrize("text, used", [("data=4", "4"), ("data=2,fsdp=8", "16")])
def test_layout_rejects_a_strategy_whose_sizes_do_not_multiply_to_the_device_count(
        text, used, devices):
    with pytest.raises(UserError) as e:
        layout(text, devices)
    message = str(e.value)
    assert f"uses {used} devices but 8 are in use" in message
    assert "multiply to 8" in message
    assert f"--devices {used}" in message


def test_mesh_has_every_canonical_axis_with_unused_ones_of_size_1(devices):
    mesh = layout("data=2,fsdp=4", devices).mesh

    assert mesh.axis_names == ("stage", "data", "fsdp", "context", "tensor")
    assert dict(mesh.shape) == {"stage": 1, "data": 2, "fsdp": 4, "context": 1, "tensor": 1}
    assert mesh.devices.shape == (1, 2, 4, 1, 1)
    assert mesh.axis_types == (AxisType.Auto,) * 5


@pytest.mark.parametrize("text, sizes", [
    ("data=8", (1, 8, 1, 1, 1)), ("data=2,fsdp=4", (1, 2, 4, 1, 1)), ("fsdp=8", (1, 1, 8, 1, 1)),
])
def test_every_mesh_is_a_reshape_of_one_canonical_device_order(text, sizes, devices):
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    expected = np.array(ordered, dtype=object).reshape(sizes)

    # The order the devices are handed over in must not matter.
    for given in (devices, devices[::-1], devices[1::2] + devices[::2]):
        assert canonical_devices(given) == ordered
        np.testing.assert_array_equal(layout(text, given).mesh.devices, expected)


# --- Layout: parameter and batch shardings --------------------------------------------------------


def test_fsdp_axis_splits_every_embed_dimension_of_the_tiny_model_8_ways(devices):
    got = layout("fsdp=8", devices).param_shardings(param_axes(TINY), abstract_params(TINY))

    assert specs(got) == {
        "embed": P(None, "fsdp"),          # vocab, embed
        "lm_head": P("fsdp"),              # embed, vocab
        "final_norm": P(),                 # norm
        "layers": {
            "attn_norm": P(),              # layers, norm
            "mlp_norm": P(),
            "wq": P(None, "fsdp"),         # layers, embed, heads, head_dim
            "wk": P(None, "fsdp"),         # layers, embed, kv_heads, head_dim
            "wv": P(None, "fsdp"),
            "wo": P(None, None, None, "fsdp"),  # layers, heads, head_dim, embed
            "w_gate": P(None, "fsdp"),     # layers, embed, mlp
            "w_up": P(None, "fsdp"),
            "w_down": P(None, None, "fsdp"),  # layers, mlp, embed
        },
    }
    assert all(s.mesh.shape["fsdp"] == 8 for s in jax.tree.leaves(got))


@pytest.mark.parametrize("text", ["data=8,rules=dp", "fsdp=8,rules=dp", "data=8"])
def test_parameters_are_replicated_when_no_rule_splits_them_over_a_used_axis(text, devices):
    # dp has no parameter rules; auto's `embed -> fsdp` is dropped when fsdp has size 1.
    got = layout(text, devices).param_shardings(param_axes(TINY), abstract_params(TINY))

    leaves = jax.tree.leaves(specs(got), is_leaf=lambda s: isinstance(s, P))
    assert len(leaves) == 12
    assert all(spec == P() for spec in leaves)


@pytest.mark.parametrize("text, spec, shards", [
    ("data=2,fsdp=4", P(("data", "fsdp")), 8),
    ("data=2,fsdp=4,rules=dp", P(("data", "fsdp")), 8),
    ("data=8", P("data"), 8),
    ("fsdp=8", P("fsdp"), 8),
])
def test_batch_rows_split_over_every_data_like_axis_of_size_above_1(text, spec, shards, devices):
    lay = layout(text, devices)

    assert lay.batch_sharding.spec == spec
    assert lay.batch_sharding.mesh is lay.mesh
    assert lay.batch_shards == shards
    assert lay.seq_shards == 1
    assert lay.strategy.activation_spec(("batch", "seq", "embed")) == spec
    assert lay.replicated.spec == P()


@pytest.mark.parametrize("text, spec, batch_shards, seq_shards", [
    ("context=8", P(None, "context"), 1, 8),
    ("data=2,context=4", P("data", "context"), 2, 4),
    ("fsdp=2,context=4,rules=context", P("fsdp", "context"), 2, 4),
    ("data=2,tensor=4", P("data"), 2, 1),
    ("data=2,tensor=4,rules=megatron-sp", P("data"), 2, 4),
    ("context=2,tensor=4,rules=megatron-sp", P(None, "context"), 1, 8),
])
def test_rows_lie_as_attention_reads_them_and_the_stream_splits_them_under_sp_over_tensor(
        text, spec, batch_shards, seq_shards, devices):
    """A micro-step's rows lie split over context as attention reads them; the residual
    stream splits them further over tensor under sequence parallelism (`seq_shards`)."""
    lay = layout(text, devices)

    assert lay.batch_sharding.spec == spec
    assert lay.batch_shards == batch_shards
    assert lay.seq_shards == seq_shards


def test_a_mesh_axis_shards_at_most_one_dimension():
    strategy = Strategy.create({"fsdp": 8}, {"params": {"vocab": "fsdp", "embed": "fsdp"}})

    assert strategy.param_spec(("vocab", "embed")) == P("fsdp")
    assert strategy.param_spec(("embed", "vocab")) == P("fsdp")
    assert strategy.param_spec(("layers", "mlp", "embed")) == P(None, None, "fsdp")


def test_specs_come_from_the_strategy_without_devices():
    # 16 devices: more than the tests have, yet every spec is known without a mesh.
    strategy = Strategy.parse("data=2,fsdp=2,context=2,tensor=2")

    assert strategy.num_devices == 16
    assert strategy.param_spec(("layers", "embed", "heads", "head_dim")) == P(
        None, "fsdp", "tensor")
    assert strategy.activation_spec(("batch", "seq", "embed")) == P(("data", "fsdp"), "context")
    assert not hasattr(Layout, "param_spec")
    assert not hasattr(Layout, "activation_spec")


@pytest.mark.parametrize("spec, expected", [
    (P(), ()),
    (P(None, "fsdp"), (1, 4)),
    (P(("data", "fsdp"), None, "tensor"), (8, 1, 3)),
    (P("context"), (1,)),
])
def test_ways_counts_the_pieces_each_dimension_is_cut_into(spec, expected):
    sizes = {"data": 2, "fsdp": 4, "context": 1, "tensor": 3}

    assert ways(spec, sizes) == expected


def test_a_dimension_that_does_not_split_evenly_is_a_user_error_naming_the_parameter(devices):
    cfg = dataclasses.replace(TINY, dim=60)  # 60 % 8 == 4
    lay = layout("fsdp=8", devices)

    with pytest.raises(UserError) as e:
        lay.param_shardings(param_axes(cfg), abstract_params(cfg))
    message = str(e.value)
    assert message == ("parameter embed dimension 1 (embed=60) does not split 8 ways under "
                       "fsdp8 [auto]: choose sizes that divide it")


def test_an_unpadded_vocabulary_does_not_split_over_tensor(devices):
    # 259 tokens: the vocabulary must be padded (to 384) before tensor parallelism splits it.
    with pytest.raises(UserError) as e:
        layout("data=2,tensor=4", devices).param_shardings(param_axes(TINY), abstract_params(TINY))
    assert str(e.value) == ("parameter embed dimension 0 (vocab=259) does not split 4 ways under "
                            "data2·tensor4 [auto]: choose sizes that divide it")


def test_a_nested_parameter_that_does_not_split_is_named_by_its_path(devices):
    lay = layout("fsdp=8", devices)
    axes = {"layers": {"w_down": ("layers", "mlp", "embed")}}
    shapes = {"layers": {"w_down": jax.ShapeDtypeStruct((2, 176, 36), np.float32)}}

    with pytest.raises(UserError, match=r"parameter layers/w_down dimension 2 \(embed=36\)"):
        lay.param_shardings(axes, shapes)


def test_device_put_with_fsdp_sharding_gives_each_device_an_eighth_of_embed(devices):
    lay = layout("fsdp=8", devices)
    shardings = lay.param_shardings(param_axes(TINY), abstract_params(TINY))
    embed_VxD = np.arange(259 * 64, dtype=np.float32).reshape(259, 64)
    w_down = np.arange(2 * 176 * 64, dtype=np.float32).reshape(2, 176, 64)

    placed = jax.device_put(embed_VxD, shardings["embed"])
    placed_down = jax.device_put(w_down, shardings["layers"]["w_down"])

    assert placed.addressable_shards[0].data.shape == (259, 8)
    assert placed_down.addressable_shards[0].data.shape == (2, 176, 8)
    # The k-th device in canonical order holds the k-th slice of embed columns.
    by_device = {s.device: np.asarray(s.data) for s in placed.addressable_shards}
    for k, device in enumerate(canonical_devices(devices)):
        np.testing.assert_array_equal(by_device[device], embed_VxD[:, 8 * k:8 * (k + 1)])
    np.testing.assert_array_equal(np.asarray(placed), embed_VxD)


def test_device_put_with_a_replicated_parameter_gives_every_device_the_whole_array(devices):
    lay = layout("data=8,rules=dp", devices)
    shardings = lay.param_shardings(param_axes(TINY), abstract_params(TINY))

    placed = jax.device_put(np.ones((2, 64, 8, 8), np.float32), shardings["layers"]["wq"])

    assert len(placed.addressable_shards) == 8
    assert all(s.data.shape == (2, 64, 8, 8) for s in placed.addressable_shards)


# --- Rule sets ------------------------------------------------------------------------------------

TINY_AXES = param_axes(TINY)
WQ, W_DOWN = TINY_AXES["layers"]["wq"], TINY_AXES["layers"]["w_down"]
EMBED, LM_HEAD = TINY_AXES["embed"], TINY_AXES["lm_head"]
# Megatron-style splits on every axis its parameters use: fsdp on `embed`, tensor on the rest.
FC = ("fsdp", "context")  # the state split over data x context
FSDP_AND_TENSOR = (P(None, "fsdp", "tensor"), P(None, "tensor", "fsdp"), P("tensor", "fsdp"),
                   P("fsdp", "tensor"))


def test_the_tiny_axes_the_rule_set_tests_rely_on():
    assert (WQ, W_DOWN) == (("layers", "embed", "heads", "head_dim"), ("layers", "mlp", "embed"))
    assert (EMBED, LM_HEAD) == (("vocab", "embed"), ("embed", "vocab"))


def test_the_named_rule_sets_and_auto_is_megatron():
    assert list(RULE_SETS)[-1] == "auto"
    assert all(rules.name == name for name, rules in RULE_SETS.items())
    auto, megatron = RULE_SETS["auto"], RULE_SETS["megatron"]
    assert (auto.params, auto.activations, auto.grads, auto.optimizer) == (
        megatron.params, megatron.activations, None, None)
    assert auto != megatron  # the name differs, so so do the strategies' cache keys


@pytest.mark.parametrize("rules, mesh, wq, w_down, embed, lm_head", [
    ("dp", "data=2,fsdp=4", P(), P(), P(), P()),
    ("zero1", "data=2,fsdp=4", P(), P(), P(), P()),
    ("zero2", "data=2,fsdp=4", P(), P(), P(), P()),
    ("fsdp", "data=2,fsdp=4", P(None, "fsdp"), P(None, None, "fsdp"), P(None, "fsdp"),
     P("fsdp")),
    ("context", "fsdp=2,context=4", P(None, "fsdp"), P(None, None, "fsdp"), P(None, "fsdp"),
     P("fsdp")),
    ("context-zero1", "fsdp=2,context=4", P(), P(), P(), P()),
    ("context-fsdp", "fsdp=2,context=4", P(None, FC), P(None, None, FC), P(None, FC), P(FC)),
    ("ulysses", "fsdp=2,context=4", P(None, "fsdp"), P(None, None, "fsdp"), P(None, "fsdp"),
     P("fsdp")),
    ("ulysses-fsdp", "fsdp=2,context=4", P(None, FC), P(None, None, FC), P(None, FC), P(FC)),
    ("megatron", "data=2,tensor=4", P(None, None, "tensor"), P(None, "tensor"), P("tensor"),
     P(None, "tensor")),
    ("megatron", "fsdp=2,context=2,tensor=2", *FSDP_AND_TENSOR),
    ("megatron-sp", "fsdp=2,context=2,tensor=2", *FSDP_AND_TENSOR),
    ("auto", "fsdp=2,context=2,tensor=2", *FSDP_AND_TENSOR),
])
def test_each_rule_set_places_the_tiny_parameters(rules, mesh, wq, w_down, embed, lm_head):
    strategy = Strategy.parse(f"{mesh},rules={rules}")

    assert strategy.rules.name == rules
    assert strategy.param_spec(WQ) == wq
    assert strategy.param_spec(W_DOWN) == w_down
    assert strategy.param_spec(EMBED) == embed
    assert strategy.param_spec(LM_HEAD) == lm_head


@pytest.mark.parametrize("text", [
    "fsdp=8,rules=dp", "fsdp=8,rules=fsdp", "fsdp=2,context=4,rules=context",
    "fsdp=2,tensor=4,rules=megatron", "fsdp=2,tensor=4,rules=megatron-sp", "fsdp=2,tensor=4",
])
def test_without_zero_maps_grads_and_optimizer_state_follow_the_parameters(text):
    strategy = Strategy.parse(text)

    assert strategy.rules.grads is strategy.rules.optimizer is None
    for axes in (WQ, W_DOWN, EMBED, LM_HEAD):
        param = strategy.param_spec(axes)
        assert strategy.grad_spec(axes) == strategy.optimizer_spec(axes) == param


def test_zero1_splits_only_the_optimizer_state_over_fsdp():
    strategy = Strategy.parse("data=2,fsdp=4,rules=zero1")

    assert strategy.param_spec(EMBED) == P()
    assert strategy.grad_spec(EMBED) == P()
    assert strategy.optimizer_spec(EMBED) == P(None, "fsdp")
    assert strategy.optimizer_spec(LM_HEAD) == P("fsdp")
    assert strategy.optimizer_spec(W_DOWN) == P(None, None, "fsdp")
    assert strategy.activation_spec(("batch", "seq", "embed")) == P(("data", "fsdp"))


def test_context_zero1_splits_only_the_optimizer_state_over_fsdp_and_context():
    """Megatron's distributed optimizer: parameters and gradients whole on every rank of the
    data x context group, the optimizer state split over all of them."""
    strategy = Strategy.parse("fsdp=2,context=4,rules=context-zero1")

    assert strategy.param_spec(EMBED) == strategy.grad_spec(EMBED) == P()
    assert strategy.optimizer_spec(EMBED) == P(None, FC)
    assert strategy.optimizer_spec(W_DOWN) == P(None, None, FC)
    assert strategy.activation_spec(("batch", "seq", "embed")) == P("fsdp", "context")
    assert strategy.ring == 4


def test_ulysses_trades_the_sequence_split_for_the_heads_inside_attention_only():
    strategy = Strategy.parse("fsdp=2,context=4,rules=ulysses")

    assert strategy.activation_spec(("batch", "seq", "embed")) == P("fsdp", "context")
    assert strategy.activation_spec(("batch", "inner_seq", "mlp")) == P("fsdp", "context")
    assert strategy.attention_specs() == (P("fsdp", None, "context"), P("fsdp", None, "context"))
    assert strategy.exchange_axes == ("context",) and strategy.ring == 1
    assert Strategy.parse("fsdp=2,context=4,rules=context").attention_specs()[0] == P(
        "fsdp", "context")


def test_ulysses_gathers_kv_heads_fewer_than_its_ranks_and_says_so():
    fitted, notes = fit_to_model(Strategy.parse("context=8,rules=ulysses"), TINY)

    assert notes == ("4 K/V heads < context=8: each K/V head is replicated over 2 context "
                     "ranks",)
    assert fitted.attention_specs() == (P(None, None, "context"), P())


@pytest.mark.parametrize("text, config, message", [
    ("context=8,rules=ulysses", dataclasses.replace(TINY, n_heads=4, n_kv_heads=4),
     "context8 [ulysses]: 4 attention heads do not split over context=8: choose a context size "
     "that divides 4"),
    ("context=4,rules=ulysses", dataclasses.replace(TINY, n_heads=12, n_kv_heads=3),
     "context4 [ulysses]: 3 K/V heads neither split over nor replicate evenly across "
     "context=4: choose a context size that divides or is a multiple of 3"),
    ("context=8,rules=ulysses,balanced=true", TINY, "a balanced chunk order needs the sequence "
     "split over a context axis larger than 1 (a ring)"),
])
def test_a_ulysses_layout_that_does_not_fit_is_one_line(text, config, message):
    with pytest.raises(UserError) as e:
        fit_to_model(Strategy.parse(text), config)
    assert message in str(e.value)


def test_attn_heads_may_map_only_axes_that_split_the_sequence():
    with pytest.raises(UserError, match="rules 'inline' map attn_heads to data, which does "
                                        "not split inner_seq: .* map data to inner_seq too"):
        Strategy.create({"data": 2, "context": 2}, {"activations": {
            "batch": "data", "seq": "context", "inner_seq": "context", "attn_heads": "data"}})


def test_zero2_splits_the_gradients_and_the_optimizer_state_over_fsdp():
    strategy = Strategy.parse("data=2,fsdp=4,rules=zero2")

    assert strategy.param_spec(EMBED) == P()
    assert strategy.grad_spec(EMBED) == P(None, "fsdp")
    assert strategy.optimizer_spec(EMBED) == P(None, "fsdp")
    assert strategy.param_spec(WQ) == P()
    assert strategy.grad_spec(WQ) == strategy.optimizer_spec(WQ) == P(None, "fsdp")


@pytest.mark.parametrize("text", ["data=8,rules=zero1", "data=8,rules=zero2"])
def test_zero_splits_nothing_without_an_fsdp_axis(text):
    strategy = Strategy.parse(text)

    assert strategy.grad_spec(EMBED) == strategy.optimizer_spec(EMBED) == P()


def test_param_shardings_take_the_grad_or_optimizer_spec_for_zero(devices):
    lay = layout("fsdp=8,rules=zero1", devices)
    axes, shapes = param_axes(TINY), abstract_params(TINY)

    params = specs(lay.param_shardings(axes, shapes))
    grads = specs(lay.param_shardings(axes, shapes, lay.strategy.grad_spec))
    optimizer = specs(lay.param_shardings(axes, shapes, spec=lay.strategy.optimizer_spec))

    assert params == grads
    assert all(spec == P() for spec in jax.tree.leaves(params, is_leaf=lambda s: isinstance(s, P)))
    assert optimizer == specs(layout("fsdp=8,rules=fsdp", devices).param_shardings(axes, shapes))
    assert optimizer["embed"] == P(None, "fsdp")


def test_optimizer_shardings_check_that_the_split_dimension_divides(devices):
    cfg = dataclasses.replace(TINY, dim=60)
    lay = layout("fsdp=8,rules=zero2", devices)

    lay.param_shardings(param_axes(cfg), abstract_params(cfg))  # replicated: nothing to divide
    with pytest.raises(UserError, match=r"^parameter embed dimension 1 \(embed=60\) does not "
                                        r"split 8 ways under fsdp8 \[zero2\]"):
        lay.param_shardings(param_axes(cfg), abstract_params(cfg), lay.strategy.optimizer_spec)


def test_megatron_places_the_whole_tiny_model_with_a_padded_vocabulary(devices):
    cfg = dataclasses.replace(TINY, vocab_size=padded_vocab(TINY.vocab_size))  # 384
    lay = layout("data=2,tensor=4,rules=megatron", devices)

    got = lay.param_shardings(param_axes(cfg), abstract_params(cfg))

    assert cfg.vocab_size == 384
    assert specs(got) == {
        "embed": P("tensor"),                   # vocab, embed
        "lm_head": P(None, "tensor"),           # embed, vocab
        "final_norm": P(),
        "layers": {
            "attn_norm": P(),
            "mlp_norm": P(),
            "wq": P(None, None, "tensor"),      # layers, embed, heads, head_dim
            "wk": P(None, None, "tensor"),      # layers, embed, kv_heads, head_dim
            "wv": P(None, None, "tensor"),
            "wo": P(None, "tensor"),            # layers, heads, head_dim, embed
            "w_gate": P(None, None, "tensor"),  # layers, embed, mlp
            "w_up": P(None, None, "tensor"),
            "w_down": P(None, "tensor"),        # layers, mlp, embed
        },
    }
    placed = jax.device_put(np.zeros((384, 64), np.float32), got["embed"])
    assert {s.data.shape for s in placed.addressable_shards} == {(96, 64)}


@pytest.mark.parametrize("axes, spec", [
    (("batch", "seq", "embed"), P("fsdp", "context")),
    (("batch", "inner_seq", "heads", "head_dim"), P("fsdp", "context", "tensor")),
    (("batch", "inner_seq", "kv_heads", "head_dim"), P("fsdp", "context", "tensor")),
    (("batch", "inner_seq", "mlp"), P("fsdp", "context", "tensor")),
    (("batch", "inner_seq", "vocab"), P("fsdp", "context", "tensor")),
    (("vocab", "embed"), P("tensor")),  # a weight in its compute layout: gathered over fsdp
    (("layers", "embed", "heads", "head_dim"), P(None, None, "tensor")),
])
def test_auto_activations_split_batch_sequence_and_heads(axes, spec):
    assert Strategy.parse("fsdp=2,context=2,tensor=2").activation_spec(axes) == spec


@pytest.mark.parametrize("text, axes, spec", [
    ("data=2,tensor=4,rules=megatron-sp", ("batch", "seq", "embed"), P("data", "tensor")),
    ("data=2,tensor=4,rules=megatron-sp", ("batch", "inner_seq", "heads", "head_dim"),
     P("data", None, "tensor")),
    ("data=2,tensor=4,rules=megatron", ("batch", "seq", "embed"), P("data")),
    ("context=2,tensor=4,rules=megatron-sp", ("batch", "seq", "embed"),
     P(None, ("context", "tensor"))),
    ("fsdp=2,context=4,rules=context", ("batch", "seq", "embed"), P("fsdp", "context")),
    ("fsdp=2,context=4,rules=context", ("batch", "inner_seq", "heads", "head_dim"),
     P("fsdp", "context")),
    ("fsdp=2,context=4,rules=context", ("batch", "inner_seq", "kv_heads", "head_dim"),
     P("fsdp", "context")),
])
def test_sequence_parallel_and_context_activation_specs(text, axes, spec):
    # K/V are split like the queries (they go round a ring); megatron-sp splits the residual
    # stream's `seq` over tensor as well, but not the sequence inside attention and the MLP.
    assert Strategy.parse(text).activation_spec(axes) == spec


# --- fit_to_model ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text, cfg", [
    ("data=8", TINY),
    ("fsdp=8,rules=fsdp", dataclasses.replace(TINY, n_heads=6, n_kv_heads=3, dim=48)),
    ("tensor=4,data=2", TINY),  # 4 K/V heads split 4 ways
    ("tensor=2,data=4", TINY),
    ("tensor=8,rules=megatron", dataclasses.replace(TINY, n_kv_heads=8)),
])
def test_fit_to_model_keeps_a_strategy_whose_heads_split_evenly(text, cfg):
    strategy = Strategy.parse(text)

    assert fit_to_model(strategy, cfg) == (strategy, ())


def test_fit_to_model_replicates_kv_heads_when_tensor_exceeds_them():
    cfg = dataclasses.replace(TINY, n_kv_heads=2)
    strategy = Strategy.parse("tensor=8")

    fitted, notes = fit_to_model(strategy, cfg)

    assert notes == ("2 K/V heads < tensor=8: each K/V head is replicated over 4 tensor ranks",)
    assert fitted.sizes == strategy.sizes
    assert fitted.rules.name == "auto"
    assert "kv_heads" not in dict(fitted.rules.params)
    assert "kv_heads" not in dict(fitted.rules.activations)
    assert dict(strategy.rules.params)["kv_heads"] == ("tensor",)
    wk = TINY_AXES["layers"]["wk"]
    assert strategy.param_spec(wk) == P(None, None, "tensor")
    assert fitted.param_spec(wk) == P()
    assert fitted.param_spec(WQ) == P(None, None, "tensor")  # query heads still split
    assert fitted.activation_spec(("batch", "inner_seq", "kv_heads", "head_dim")) == P()
    assert fitted.activation_spec(("batch", "inner_seq", "heads", "head_dim")) == P(
        None, None, "tensor")


def test_fit_to_model_rejects_a_tensor_size_that_does_not_divide_the_heads():
    with pytest.raises(UserError) as e:
        fit_to_model(Strategy.parse("tensor=3"), TINY)
    assert str(e.value) == ("tensor3 [auto]: 8 attention heads do not split over tensor=3: "
                            "choose a tensor size that divides 8")


def test_fit_to_model_rejects_kv_heads_that_neither_split_nor_replicate_evenly():
    # 6 query heads split over tensor=2, but 3 K/V heads neither split 2 ways nor replicate.
    cfg = dataclasses.replace(TINY, dim=48, n_heads=6, n_kv_heads=3)

    with pytest.raises(UserError) as e:
        fit_to_model(Strategy.parse("data=4,tensor=2"), cfg)
    assert str(e.value) == ("data4·tensor2 [auto]: 3 K/V heads neither split over nor replicate "
                            "evenly across tensor=2: choose a tensor size that divides or is a "
                            "multiple of 3")


# --- Strategy tables ------------------------------------------------------------------------------

THREE_BUCKETS = """\
[[bucket]]
max_len = 256
mesh = { data = 8 }

[[bucket]]
max_len = 1024
mesh = { data = 2, fsdp = 4 }

[[bucket]]
max_len = 4096
mesh = { fsdp = 8 }
rules = "fsdp"
"""


def write(tmp_path, text: str, name: str = "table.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_three_bucket_table_loads_with_its_lengths_and_strategies(tmp_path):
    path = write(tmp_path, THREE_BUCKETS)

    table = load_table(path)

    assert table.source == str(path)
    assert [b.max_len for b in table.buckets] == [256, 1024, 4096]
    assert [s.sizes for s in table.strategies] == [(1, 8, 1, 1, 1), (1, 2, 4, 1, 1),
                                                   (1, 1, 8, 1, 1)]
    assert [s.rules.name for s in table.strategies] == ["auto", "auto", "fsdp"]
    assert table.strategies == [Strategy.parse("data=8"), Strategy.parse("data=2,fsdp=4"),
                                Strategy.parse("fsdp=8,rules=fsdp")]
    assert table.max_len == 4096
    table.check_devices(8)


def test_a_table_takes_named_and_inline_rules_per_bucket():
    table = parse_table({"bucket": [
        {"max_len": 512, "mesh": {"data": 8}, "rules": "dp"},
        {"max_len": 2048, "mesh": {"fsdp": 8},
         "rules": {"params": {"embed": "fsdp"}, "activations": {"batch": ["fsdp"]}}},
        {"max_len": 4096, "mesh": {"fsdp": 8},
         "rules": {"activations": {"batch": "fsdp"}, "grads": {"embed": "fsdp"},
                   "optimizer": {"embed": "fsdp"}}},
        {"max_len": 8192, "mesh": {"context": 2, "tensor": 4}, "rules": "megatron-sp"},
    ]}, "t.toml")

    assert table.strategies[0] == Strategy.create({"data": 8}, "dp")
    assert table.strategies[1].rules.params == (("embed", ("fsdp",)),)
    assert table.strategies[1].rules.activations == (("batch", ("fsdp",)),)
    assert table.strategies[2].rules.params == ()
    assert table.strategies[2].rules.grads == table.strategies[2].rules.optimizer == (
        ("embed", ("fsdp",)),)
    assert table.strategies[3] == Strategy.create({"context": 2, "tensor": 4}, "megatron-sp")


@pytest.mark.parametrize("length, max_len", [(1, 256), (256, 256), (257, 1024), (300, 1024),
                                             (1024, 1024), (1025, 4096), (4096, 4096)])
def test_a_sequence_goes_to_the_smallest_bucket_that_holds_it(length, max_len, tmp_path):
    table = load_table(write(tmp_path, THREE_BUCKETS))

    bucket = table.bucket_for(length)

    assert isinstance(bucket, Bucket)
    assert bucket.max_len == max_len
    assert bucket is table.buckets[[256, 1024, 4096].index(max_len)]


def test_a_sequence_longer_than_the_largest_bucket_is_a_user_error(tmp_path):
    table = load_table(write(tmp_path, THREE_BUCKETS))

    with pytest.raises(UserError) as e:
        table.bucket_for(5000)
    message = str(e.value)
    assert "table.toml" in message
    assert "5000 tokens" in message
    assert "largest bucket (4096)" in message
    assert "add a bucket or truncate" in message


def test_check_devices_names_the_first_bucket_whose_mesh_does_not_fit(tmp_path):
    table = load_table(write(tmp_path, THREE_BUCKETS))

    with pytest.raises(UserError) as e:
        table.check_devices(4)
    assert str(e.value) == (f"{table.source}: bucket 1 (max_len 256): mesh data8 [auto] uses 8 "
                            f"devices but 4 are in use: make its sizes multiply to 4, or pass "
                            f"--devices 8")


def test_check_devices_names_a_later_bucket_that_does_not_fit():
    table = StrategyTable((Bucket(256, Strategy.parse("data=8")),
                           Bucket(1024, Strategy.parse("data=4"))), "t.toml")

    with pytest.raises(UserError) as e:
        table.check_devices(8)
    assert str(e.value) == ("t.toml: bucket 2 (max_len 1024): mesh data4 [auto] uses 4 devices "
                            "but 8 are in use: make its sizes multiply to 8, or pass --devices 4")


def test_single_wraps_one_strategy_as_a_one_bucket_table():
    table = StrategyTable.single(Strategy.parse("data=8"), 2048, "--strategy 'data=8'")

    assert table.max_len == 2048
    assert table.strategies == [Strategy.parse("data=8")]
    assert table.bucket_for(2048).max_len == 2048
    table.check_devices(8)
    with pytest.raises(UserError) as e:
        table.check_devices(4)
    assert str(e.value) == ("--strategy 'data=8': mesh data8 [auto] uses 8 devices but 4 are in "
                            "use: make its sizes multiply to 4, or pass --devices 8")


BUCKET = "[[bucket]]\nmax_len = {}\nmesh = {{ data = 8 }}\n"


@pytest.mark.parametrize("text, expected", [
    (BUCKET.format(1024) + BUCKET.format(256),
     "bucket 2: max_len 256 is not larger than bucket 1's 1024"),
    (BUCKET.format(256) + BUCKET.format(256),
     "bucket 2: max_len 256 is not larger than bucket 1's 256"),
    (BUCKET.format(256) + BUCKET.format(1024) + BUCKET.format(512),
     "bucket 3: max_len 512 is not larger than bucket 2's 1024"),
    ("", "no [[bucket]] entries: add at least one"),
    ("[bucket]\nmax_len = 256\nmesh = { data = 8 }\n", "no [[bucket]] entries"),
    ("name = 'x'\n" + BUCKET.format(256), "unknown key 'name'"),
    (BUCKET.format(256) + "mseh = { data = 8 }\n", "bucket 1: unknown key 'mseh'"),
    (BUCKET.format('"1024"'), "bucket 1: max_len must be a positive integer, got '1024'"),
    (BUCKET.format(1024.0), "bucket 1: max_len must be a positive integer, got 1024.0"),
    (BUCKET.format(0), "bucket 1: max_len must be a positive integer, got 0"),
    (BUCKET.format("true"), "bucket 1: max_len must be a positive integer, got True"),
    ("[[bucket]]\nmesh = { data = 8 }\n", "bucket 1: max_len must be a positive integer"),
    ("[[bucket]]\nmax_len = 256\n", "bucket 1: mesh must be a table like { data = 8 }"),
    ("[[bucket]]\nmax_len = 256\nmesh = 8\n", "bucket 1: mesh must be a table"),
    (BUCKET.format(256) + "[[bucket]]\nmax_len = 512\nmesh = { pipe = 8 }\n",
     "bucket 2: unknown mesh axis 'pipe'"),
    (BUCKET.format(256) + "[[bucket]]\nmax_len = 512\nmesh = { data = 2, tensor = 4 }\n"
     "rules = 'fsdp'\n", "bucket 2: mesh axis tensor=4 is not used by rules 'fsdp'"),
    (BUCKET.format(256) + "[[bucket]]\nmax_len = 512\nmesh = { context = 8 }\nrules = 'zero1'\n",
     "bucket 2: mesh axis context=8 is not used by rules 'zero1'"),
    ("[[bucket]\nmax_len = 256\n", "not valid TOML"),
    ("[[bucket]]\nmax_len = = 256\n", "not valid TOML"),
])
def test_a_bad_table_is_a_user_error_naming_the_file(text, expected, tmp_path):
    path = write(tmp_path, text, "lengths.toml")

    with pytest.raises(UserError) as e:
        load_table(path)
    assert "lengths.toml" in str(e.value)
    assert expected in str(e.value)


def test_a_missing_table_file_is_a_user_error_naming_it(tmp_path):
    with pytest.raises(UserError, match="strategy table not found: .*nowhere.toml"):
        load_table(tmp_path / "nowhere.toml")


@pytest.mark.parametrize("rules, expected", [
    ("'zero3'", "unknown rule set 'zero3'"),
    ("{ params = { embed = 'pipe' } }", "unknown mesh axis 'pipe'"),
    ("{ optimizer = { embd = 'fsdp' } }", "optimizer: unknown logical axis 'embd'"),
])
def test_a_bad_rule_in_a_table_names_the_file_and_bucket(rules, expected, tmp_path):
    path = write(tmp_path, BUCKET.format(256) + f"rules = {rules}\n", "lengths.toml")

    with pytest.raises(UserError, match=f"lengths.toml: bucket 1: .*{expected}"):
        load_table(path)


@pytest.mark.parametrize("text", ["bucket = [1024]\n", "bucket = ['data']\n"])
def test_a_bucket_entry_that_is_not_a_table_is_a_user_error(text, tmp_path):
    with pytest.raises(UserError, match=r"lengths.toml: bucket 1: .*table"):
        load_table(write(tmp_path, text, "lengths.toml"))


def test_balanced_chunk_order_is_a_context_parallel_option():
    strategy = Strategy.parse("fsdp=2,context=4,rules=context,balanced=true")
    assert strategy.balanced and str(strategy) == "fsdp2·context4 [context, balanced]"
    assert strategy.ring == 4
    assert not Strategy.parse("fsdp=2,context=4,rules=context").balanced
    with pytest.raises(UserError, match="balanced chunk order needs the sequence split over a "
                                        "context axis"):
        Strategy.parse("data=8,balanced=true")
    with pytest.raises(UserError, match="balanced must be true or false"):
        Strategy.parse("context=8,balanced=yes")


def test_a_table_bucket_can_ask_for_the_balanced_order(tmp_path):
    path = write(tmp_path, "[[bucket]]\nmax_len = 256\nmesh = { context = 8 }\n"
                           "rules = 'context'\nbalanced = true\n")
    assert load_table(path).buckets[0].strategy.balanced


def _tables(count: int, seed: int) -> list[StrategyTable]:
    """Random tables over every kind of bucket entry: the planner's candidate strategies on 8
    devices, pipelines, inline rules, balanced context, rows, remat and a home or none."""
    from hotjax.planning.search import candidate_strategies

    config = dataclasses.replace(TINY, vocab_size=padded_vocab(TINY.vocab_size))
    strategies = [*candidate_strategies(config, 8),
                  Strategy.parse("stage=2,data=4,microbatches=6"),
                  Strategy.create({"data": 2, "fsdp": 4},
                                  {"params": {"embed": "fsdp"},
                                   "activations": {"batch": ["data", "fsdp"]},
                                   "optimizer": {"embed": ["fsdp"]}}, "inline")]
    rng = np.random.default_rng(seed)
    tables = []
    for _ in range(count):
        lengths = np.sort(rng.choice(np.arange(64, 8192, 64), rng.integers(1, 5), replace=False))
        buckets = tuple(Bucket(int(n), strategies[rng.integers(len(strategies))],
                               None if rng.random() < 0.3 else int(rng.integers(1, 5)) * 8,
                               [None, "none", "dots", "full"][rng.integers(4)])
                        for n in lengths)
        home = None if rng.random() < 0.3 else strategies[rng.integers(len(strategies))]
        tables.append(StrategyTable(buckets, "random", home))
    return tables


def test_any_table_reads_back_identical_from_its_toml_and_its_checkpoint_record(tmp_path):
    import json

    tables = _tables(60, seed=1)
    assert any(t.home is None for t in tables) and any(t.home for t in tables)
    for i, table in enumerate(tables):
        path = tmp_path / f"{i}.toml"
        path.write_text(table.toml(f"table {i}\nwritten by a test"))
        assert load_table(path) == table, path.read_text()
        # A checkpoint keeps the same data as JSON.
        record = json.loads(json.dumps(table.to_dict()))
        assert parse_table(record, "record") == table
        assert parse_table(record, "record").home == table.home


def test_a_table_home_on_other_devices_is_one_line():
    table = parse_table({"home": {"mesh": {"fsdp": 4}}, "bucket": [
        {"max_len": 128, "mesh": {"data": 8}}]}, "t.toml")
    with pytest.raises(UserError, match=r"t.toml: home: mesh fsdp4 .* uses 4 devices but 8"):
        table.check_devices(8)
    with pytest.raises(UserError, match="home must be a table with mesh and rules"):
        parse_table({"home": {"mesh": {"fsdp": 8}, "max_len": 3},
                     "bucket": [{"max_len": 128, "mesh": {"data": 8}}]}, "t.toml")
