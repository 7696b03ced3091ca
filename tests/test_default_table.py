"""The default strategy table on any device count: sharding/tables/default.toml's buckets, their
meshes derived from the count (`hotjax.run.default_table`), and `hotjax train` without
--strategy training under it."""

import contextlib
import io
import json
import math

import pytest
from helpers import TINY_RUN, records

from hotjax.cli import main
from hotjax.config import RunConfig
from hotjax.run import DEFAULT_TABLE, default_table, strategy_table
from hotjax.sharding.strategy import Strategy
from hotjax.sharding.table import load_table

RULES = ("megatron", "megatron-sp", "megatron")  # default.toml's, bucket by bucket


@pytest.mark.parametrize(("devices", "meshes"), [
    (1, ("data=1,tensor=1", "data=1,tensor=1", "context=1,tensor=1")),
    (2, ("data=1,tensor=2", "data=1,tensor=2", "context=1,tensor=2")),
    (4, ("data=2,tensor=2", "data=1,tensor=4", "context=2,tensor=2,balanced=true")),
    # 3 context ways would not split a 2048-token row into balanced chunks: data takes them.
    (6, ("data=3,tensor=2", "data=3,tensor=2", "data=3,tensor=2")),
    (8, ("data=4,tensor=2", "data=2,tensor=4", "context=4,tensor=2,balanced=true")),
])
def test_default_table_keeps_tensor_ways_up_to_the_counts_power_of_two(devices, meshes):
    table = default_table(devices)
    assert [b.max_len for b in table.buckets] == [256, 1024, 2048]
    assert table.strategies == [Strategy.parse(f"{mesh},rules={rules}")
                                for mesh, rules in zip(meshes, RULES, strict=True)]
    assert strategy_table(RunConfig(), devices) == table


def test_default_table_on_8_devices_is_the_file_as_written():
    written = load_table(DEFAULT_TABLE)
    derived = default_table(8)
    assert len(derived.buckets) == len(written.buckets)
    for ours, theirs in zip(derived.buckets, written.buckets, strict=True):
        assert ours == theirs


def test_train_without_strategy_on_2_devices_trains_the_derived_table(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 6})
                              + "\n" for i in range(40)))
    metrics = tmp_path / "m.jsonl"
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(err):
        patch.setenv("COLUMNS", "400")
        assert main([*TINY_RUN, "--devices", "2", "--steps", "1", "--data", str(corpus),
                     "--metrics-jsonl", str(metrics)]) == 0
    assert ("buckets 256: tensor2 [megatron] -> 1024: tensor2 [megatron-sp] -> "
            "2048: tensor2 [megatron]") in err.getvalue()
    # Untrained, the model predicts its 384 embedding rows (259 byte ids, padded) about evenly.
    [step] = records(metrics)
    assert step["step"] == 1 and step["loss"] == pytest.approx(math.log(384), abs=0.02)
