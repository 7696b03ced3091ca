"""Hot switching: buckets under their own strategies give the single-strategy training."""

import dataclasses
import itertools
import json

import jax
import numpy as np
import pytest

from hotjax.data import ByteTokenizer, open_corpus
from hotjax.data.stream import BucketedBatches
from hotjax.hot import HotTrainer, best_order, most_sharded
from hotjax.optim import OptimConfig
from hotjax.train import get_trainer
from models.llama import PRESETS
from sharding.strategy import Strategy
from sharding.table import Bucket, StrategyTable, parse_table

CONFIG = dataclasses.replace(PRESETS["tiny"], vocab_size=384, compute_dtype="float32")
OPTIM = OptimConfig(lr=1e-3, warmup_steps=2, total_steps=5)
TABLE = parse_table({"bucket": [
    {"max_len": 32, "mesh": {"data": 8}},
    {"max_len": 64, "mesh": {"data": 2, "tensor": 4}, "rules": "megatron"},
    {"max_len": 128, "mesh": {"fsdp": 2, "context": 4}, "rules": "context"},
]}, "three-buckets")
STEPS = 5


def _uniform(strategy: str) -> StrategyTable:
    return StrategyTable(tuple(Bucket(b.max_len, Strategy.parse(strategy))
                               for b in TABLE.buckets), strategy)


@pytest.fixture(scope="module")
def minibatches(tmp_path_factory):
    """Five mini-batches of documents of mixed lengths, split into the table's buckets."""
    rng = np.random.default_rng(0)
    stdlib = open_corpus(None)
    text = "".join(stdlib.read(i) for i in range(30))
    lengths = rng.choice([10, 20, 40, 50, 90, 120], size=400)
    starts = rng.integers(0, len(text) - 200, size=400)
    path = tmp_path_factory.mktemp("mixed") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text[s:s + n]}) + "\n"
                            for s, n in zip(starts, lengths, strict=True)))
    batches = BucketedBatches(open_corpus(str(path)), ByteTokenizer(),
                              [b.max_len for b in TABLE.buckets], batch_tokens=2048,
                              row_multiples=8, seed=0)
    return list(itertools.islice(batches, STEPS))


def _train(trainer: HotTrainer, minibatches):
    state, losses = trainer.init(seed=0), []
    for minibatch in minibatches:
        state, metrics, _ = trainer.step(state, minibatch)
        losses.append(metrics["loss"])
    return np.array(losses), jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def one_device(devices, minibatches):
    return _train(HotTrainer(CONFIG, OPTIM, _uniform("data=1"), devices[:1]), minibatches)


def _assert_same(run, reference):
    (losses, params), (ref_losses, ref_params) = run, reference
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params, ref_params)
    assert max(jax.tree.leaves(diffs)) <= 1e-5, diffs


def test_every_bucket_has_rows_of_its_length(minibatches):
    for minibatch in minibatches:
        assert [b.tokens.shape[1] for b in minibatch.buckets] == [32, 64, 128]
        assert all(b.tokens.shape[0] % 8 == 0 and b.real_tokens > 0 for b in minibatch.buckets)


def test_hot_switched_training_equals_one_strategy_and_one_device(devices, minibatches,
                                                                  one_device):
    hot = HotTrainer(CONFIG, OPTIM, TABLE, devices)
    static = HotTrainer(CONFIG, OPTIM, _uniform("data=8"), devices)
    hot_run = _train(hot, minibatches)
    _assert_same(hot_run, one_device)
    _assert_same(_train(static, minibatches), one_device)
    assert hot_run[0][-1] < hot_run[0][0]


def test_one_bucket_equals_the_plain_trainer(devices, minibatches):
    """The accumulate-then-divide update is the single-strategy trainer's update."""
    table = StrategyTable((Bucket(128, Strategy.parse("fsdp=8")),), "one")
    batches = [m.buckets[2] for m in minibatches]
    hot = HotTrainer(CONFIG, OPTIM, table, devices)
    plain = get_trainer(CONFIG, OPTIM, Strategy.parse("fsdp=8"), tuple(devices))
    hot_state, plain_state = hot.init(0), plain.init(0)
    for batch in batches:
        minibatch = dataclasses.replace(minibatches[0], buckets=(batch,))
        hot_state, hot_metrics, _ = hot.step(hot_state, minibatch)
        plain_state, plain_metrics = plain.step(plain_state, plain.batch_arrays(batch))
        assert hot_metrics["loss"] == pytest.approx(float(plain_metrics["loss"]), abs=1e-5)
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                         hot_state.params, plain_state.params)
    assert max(jax.tree.leaves(diffs)) <= 1e-5, diffs


def test_home_is_the_strategy_holding_the_least_state_per_device():
    # tensor=4 splits the matrices 4 ways, fsdp=2 only 2 ways, data=8 not at all.
    assert most_sharded(TABLE, CONFIG) == TABLE.buckets[1].strategy
    assert most_sharded(_uniform("data=8"), CONFIG) == Strategy.parse("data=8")


def test_best_order_minimises_the_chain_of_switches():
    costs = {(-1, 0): 5, (-1, 1): 1, (-1, 2): 9, (0, 1): 7, (1, 0): 7, (0, 2): 1, (2, 0): 1,
             (1, 2): 2, (2, 1): 2}
    assert best_order(costs, 3) == [1, 2, 0]  # 1 + 2 + 1
