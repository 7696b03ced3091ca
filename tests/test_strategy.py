"""Strategies and strategy tables: parsing, validation, meshes and the shardings they give."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from hotjax.errors import UserError
from models.llama import PRESETS, abstract_params, param_axes
from sharding.strategy import RULE_SETS, Layout, Strategy, canonical_devices
from sharding.table import Bucket, StrategyTable, load_table, parse_table

TINY = PRESETS["tiny"]  # V=259, D=64, L=2, N=8, K=4, H=8, F=176


def layout(text: str, devices: list[jax.Device]) -> Layout:
    return Layout(Strategy.parse(text), devices)


def specs(shardings: dict) -> dict:
    return jax.tree.map(lambda s: s.spec, shardings, is_leaf=lambda s: isinstance(s, NamedSharding))


# --- Strategy.parse -------------------------------------------------------------------------------


def test_parse_orders_sizes_as_data_fsdp_context_tensor_and_defaults_to_fsdp_rules():
    strategy = Strategy.parse("fsdp=4, data=2")

    assert strategy.sizes == (2, 4, 1, 1)
    assert strategy.axes == {"data": 2, "fsdp": 4, "context": 1, "tensor": 1}
    assert strategy.num_devices == 8
    assert strategy.rules.name == "fsdp"
    assert strategy.rules == RULE_SETS["fsdp"]
    assert str(strategy) == "data2·fsdp4 [fsdp]"


def test_parse_takes_a_named_rule_set():
    strategy = Strategy.parse("data=8,rules=dp")

    assert strategy.sizes == (8, 1, 1, 1)
    assert strategy.rules.name == "dp"
    assert strategy.rules.params == ()
    assert strategy.rules.activations == (("batch", ("data", "fsdp")),)


def test_parsed_and_created_strategies_are_equal_and_hash_alike():
    # Strategies key caches of compiled steps, so equal strategies must hash alike.
    parsed = Strategy.parse("data=2,fsdp=4")
    created = Strategy.create({"data": 2, "fsdp": 4}, "fsdp")

    assert parsed == created
    assert hash(parsed) == hash(created)
    assert parsed != Strategy.parse("data=2,fsdp=4,rules=dp")


def test_fsdp_axis_under_dp_rules_is_accepted_because_the_batch_splits_over_it(devices):
    strategy = Strategy.parse("fsdp=8,rules=dp")
    lay = Layout(strategy, devices)

    assert strategy.sizes == (1, 8, 1, 1)
    assert lay.batch_sharding.spec == P("fsdp")
    assert lay.batch_shards == 8


@pytest.mark.parametrize("text, axis", [
    ("tensor=8", "tensor=8"),
    ("context=8", "context=8"),
    ("data=2,tensor=4", "tensor=4"),
    ("tensor=8,rules=dp", "tensor=8"),
    ("context=2,data=4,rules=dp", "context=2"),
])
def test_an_axis_no_rule_uses_is_rejected(text, axis):
    with pytest.raises(UserError, match="not used by rules") as e:
        Strategy.parse(text)
    assert axis in str(e.value)
    assert "drop the axis" in str(e.value)


@pytest.mark.parametrize("text, named, fix", [
    ("pipe=2", "'pipe'", "use data, fsdp, context, tensor"),
    ("data=2,pipe=4", "'pipe'", "use data, fsdp, context, tensor"),
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
    ("data=8,rules=zero", "'zero'", "choose one of dp, fsdp"),
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
        "params": {"embed": "fsdp"},
        "activations": {"batch": ["data", "fsdp"]},
    })
    named = Strategy.create({"data": 2, "fsdp": 4}, "fsdp")

    assert inline.rules.name == "inline"
    assert inline.rules.params == named.rules.params == (("embed", ("fsdp",)),)
    assert inline.rules.activations == named.rules.activations == (("batch", ("data", "fsdp")),)
    axes, shapes = param_axes(TINY), abstract_params(TINY)
    assert (Layout(inline, devices).param_shardings(axes, shapes)
            == Layout(named, devices).param_shardings(axes, shapes))
    assert Layout(inline, devices).batch_sharding == Layout(named, devices).batch_sharding


@pytest.mark.parametrize("rules, named", [
    ({"params": {"embed": "pipe"}, "activations": {"batch": "data"}}, "'pipe' for 'embed'"),
    ({"params": {}, "activations": {"batch": ["data", "stage"]}}, "'stage' for 'batch'"),
])
def test_inline_rules_naming_an_unknown_mesh_axis_are_rejected(rules, named):
    with pytest.raises(UserError, match="unknown mesh axis") as e:
        Strategy.create({"data": 8}, rules)
    assert named in str(e.value)
    assert "use data, fsdp, context, tensor" in str(e.value)


@pytest.mark.parametrize("rules", [{"param": {"embed": "fsdp"}}, ["fsdp"], 3])
def test_inline_rules_of_the_wrong_shape_are_rejected(rules):
    with pytest.raises(UserError, match="rules must be a rule-set name or a table with 'params'"):
        Strategy.create({"fsdp": 8}, rules)


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

    assert mesh.axis_names == ("data", "fsdp", "context", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "context": 1, "tensor": 1}
    assert mesh.devices.shape == (2, 4, 1, 1)
    assert mesh.axis_types == (AxisType.Auto,) * 4


@pytest.mark.parametrize("text, sizes", [
    ("data=8", (8, 1, 1, 1)), ("data=2,fsdp=4", (2, 4, 1, 1)), ("fsdp=8", (1, 8, 1, 1)),
])
def test_every_mesh_is_a_reshape_of_one_canonical_device_order(text, sizes, devices):
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    expected = np.array(ordered, dtype=object).reshape(sizes)

    # The order the devices are handed over in must not matter.
    for given in (devices, devices[::-1], devices[1::2] + devices[::2]):
        assert canonical_devices(given) == ordered
        np.testing.assert_array_equal(layout(text, given).mesh.devices, expected)


# --- Layout: parameter and batch shardings --------------------------------------------------------


def test_fsdp_splits_every_embed_dimension_of_the_tiny_model_8_ways(devices):
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
    # dp has no parameter rules; fsdp's `embed -> fsdp` is dropped when fsdp has size 1.
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
    assert lay.activation_spec(("batch", "seq", "embed")) == spec
    assert lay.replicated.spec == P()


def test_a_mesh_axis_shards_at_most_one_dimension(devices):
    strategy = Strategy.create({"fsdp": 8}, {"params": {"vocab": "fsdp", "embed": "fsdp"}})
    lay = Layout(strategy, devices)

    assert lay.param_spec(("vocab", "embed")) == P("fsdp")
    assert lay.param_spec(("embed", "vocab")) == P("fsdp")
    assert lay.param_spec(("layers", "mlp", "embed")) == P(None, None, "fsdp")


def test_a_dimension_that_does_not_split_evenly_is_a_user_error_naming_the_parameter(devices):
    cfg = dataclasses.replace(TINY, dim=60)  # 60 % 8 == 4
    lay = layout("fsdp=8", devices)

    with pytest.raises(UserError) as e:
        lay.param_shardings(param_axes(cfg), abstract_params(cfg))
    message = str(e.value)
    assert "parameter embed dimension 1 (embed=60)" in message
    assert "does not split 8 ways under fsdp8 [fsdp]" in message
    assert "choose sizes that divide it" in message


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
    assert [s.sizes for s in table.strategies] == [(8, 1, 1, 1), (2, 4, 1, 1), (1, 8, 1, 1)]
    assert [s.rules.name for s in table.strategies] == ["fsdp", "fsdp", "fsdp"]
    assert table.strategies == [Strategy.parse("data=8"), Strategy.parse("data=2,fsdp=4"),
                                Strategy.parse("fsdp=8")]
    assert table.max_len == 4096
    table.check_devices(8)


def test_a_table_takes_named_and_inline_rules_per_bucket():
    table = parse_table({"bucket": [
        {"max_len": 512, "mesh": {"data": 8}, "rules": "dp"},
        {"max_len": 2048, "mesh": {"fsdp": 8},
         "rules": {"params": {"embed": "fsdp"}, "activations": {"batch": ["fsdp"]}}},
    ]}, "t.toml")

    assert table.strategies[0] == Strategy.create({"data": 8}, "dp")
    assert table.strategies[1].rules.params == (("embed", ("fsdp",)),)
    assert table.strategies[1].rules.activations == (("batch", ("fsdp",)),)


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
    message = str(e.value)
    assert "table.toml: bucket 1 (max_len 256)" in message
    assert "uses 8 devices but 4 are in use" in message


def test_check_devices_names_a_later_bucket_that_does_not_fit():
    table = StrategyTable((Bucket(256, Strategy.parse("data=8")),
                           Bucket(1024, Strategy.parse("data=4"))), "t.toml")

    with pytest.raises(UserError, match=r"t.toml: bucket 2 \(max_len 1024\): mesh data4 \[fsdp\] "
                                        r"uses 4 devices but 8"):
        table.check_devices(8)


def test_single_wraps_one_strategy_as_a_one_bucket_table():
    table = StrategyTable.single(Strategy.parse("data=8"), 2048, "--strategy 'data=8'")

    assert table.max_len == 2048
    assert table.strategies == [Strategy.parse("data=8")]
    assert table.bucket_for(2048).max_len == 2048
    with pytest.raises(UserError, match=r"^--strategy 'data=8': mesh data8 \[fsdp\] uses 8 "
                                        r"devices but 4 are in use: .* or pass --devices 8$"):
        table.check_devices(4)


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
    (BUCKET.format(256) + "[[bucket]]\nmax_len = 512\nmesh = { data = 2, tensor = 4 }\n",
     "bucket 2: mesh axis tensor=4 is not used by rules 'fsdp'"),
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
])
def test_a_bad_rule_in_a_table_names_the_file_and_bucket(rules, expected, tmp_path):
    path = write(tmp_path, BUCKET.format(256) + f"rules = {rules}\n", "lengths.toml")

    with pytest.raises(UserError, match=f"lengths.toml: bucket 1: .*{expected}"):
        load_table(path)


@pytest.mark.parametrize("text", ["bucket = [1024]\n", "bucket = ['data']\n"])
def test_a_bucket_entry_that_is_not_a_table_is_a_user_error(text, tmp_path):
    with pytest.raises(UserError, match=r"lengths.toml: bucket 1: .*table"):
        load_table(write(tmp_path, text, "lengths.toml"))
