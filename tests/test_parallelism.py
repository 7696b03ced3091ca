"""Every parallelism as a strategy: one train step under it equals the single-device step; what
XLA says each compiled piece (a bucket's micro-step, the home update) holds per device."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from helpers import MODEL, compiled_update, packed_rows, trainer

from hotjax import step
from hotjax.data import Batch, MiniBatch
from hotjax.sharding.strategy import Strategy
from hotjax.step import (
    BATCH_KEYS,
    balanced_order,
    bucket_step,
    micro_step_inputs,
    next_token_targets,
    step_memory,
)
from hotjax.train import Trainer

# GQA with 4 K/V heads for 8 query heads, and with 2.
CONFIG = MODEL
GQA2 = dataclasses.replace(CONFIG, n_kv_heads=2)
ROWS, SEQ = 8, 64

STRATEGIES = [
    ("data=8,rules=dp", CONFIG),
    ("fsdp=8,rules=fsdp", CONFIG),
    ("fsdp=8,rules=zero1", CONFIG),
    ("fsdp=8,rules=zero2", CONFIG),
    ("context=8,rules=context", CONFIG),
    ("context=8,rules=context,balanced=true", CONFIG),
    ("tensor=8,rules=megatron", CONFIG),
    ("tensor=8,rules=megatron-sp", CONFIG),
    ("data=2,tensor=4,rules=megatron-sp", CONFIG),
    ("fsdp=2,context=4,rules=context", CONFIG),
    ("data=2,context=4,rules=megatron-sp,balanced=true", CONFIG),
    ("data=2,fsdp=2,tensor=2", CONFIG),
    ("data=2,context=2,tensor=2,rules=megatron-sp", CONFIG),
    ("tensor=8", GQA2),  # K/V heads replicated over the tensor group
    ("context=8,rules=context-fsdp", CONFIG),
    ("fsdp=2,context=4,rules=context-zero1", CONFIG),
    ("fsdp=2,context=4,rules=ulysses-fsdp", CONFIG),  # K/V heads exchanged
    ("context=8,rules=ulysses", CONFIG),  # 4 K/V heads over 8 ranks: gathered whole
]


@pytest.fixture(scope="module")
def batch() -> Batch:
    """Rows of three documents each, row r ending in r padding tokens, in the shapes every
    strategy accepts."""
    return packed_rows(ROWS, SEQ)


def _trainer(strategy: str, config, devices) -> Trainer:
    """A single strategy: the one-bucket table, home in that strategy."""
    return trainer(strategy, devices, max_len=SEQ, config=config)


def _one_step(trainer: Trainer, batch: Batch):
    state, metrics, _ = trainer.step(trainer.init(seed=0), MiniBatch((batch,)))
    return float(metrics["loss"]), jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def single_device(devices, batch):
    return {config: _one_step(_trainer("data=1", config, devices[:1]), batch)
            for config in (CONFIG, GQA2)}


@pytest.fixture(scope="module", autouse=True)
def _compiled_here():
    """Each strategy's micro-step and update compile in this module, not reused from a module
    before it on this worker: what XLA says while partitioning them is read below."""
    step.bucket_step.cache_clear()
    step.home.cache_clear()


@pytest.mark.parametrize("strategy, config", STRATEGIES, ids=[s for s, _ in STRATEGIES])
def test_one_step_equals_the_single_device_step(strategy, config, devices, batch, single_device,
                                                capfd):
    """Equal to one device, and partitioned without XLA's warning that it must replicate an
    array to reshard it (XLA logs it to this process's stderr while compiling)."""
    trainer = _trainer(strategy, config, devices)
    (bucket,) = trainer.buckets

    def compiled() -> bool:
        return any(bucket.is_compiled((rows, SEQ)) for rows in range(1, ROWS + 1))

    assert not compiled()
    loss, params = _one_step(trainer, batch)
    assert compiled()  # here: what XLA logs while compiling it is this test's
    ref_loss, ref_params = single_device[config]
    assert abs(loss - ref_loss) <= 1e-5
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params, ref_params)
    assert max(jax.tree.leaves(diffs)) <= 1e-5, diffs
    assert "Involuntary full rematerialization" not in capfd.readouterr().err


def test_kv_heads_fewer_than_tensor_are_replicated_and_said_so(devices):
    trainer = _trainer("tensor=8", GQA2, devices)
    assert trainer.notes == ("2 K/V heads < tensor=8: each K/V head is replicated over 4 "
                             "tensor ranks",)
    wk = trainer.home.state_shardings.params["layers"]["wk"]
    wq = trainer.home.state_shardings.params["layers"]["wq"]
    assert wk.spec == jax.sharding.PartitionSpec()  # replicated
    assert wq.spec == jax.sharding.PartitionSpec(None, None, "tensor")


def test_xla_memory_of_micro_step_and_update_shrinks_with_sharding_as_expected(devices):
    """Per-device argument bytes, as XLA reports them: a bucket's micro-step holds the compute
    weights (fp32 here), the fp32 gradient sum and one micro-step's rows; the home update holds the
    fp32 master weights, the Adam moments and the gradient sum."""
    norms = 2 * CONFIG.n_layers * CONFIG.dim + CONFIG.dim  # norm scales are never split
    matrices = CONFIG.num_params() - norms
    # Per device: (parameter, Adam-moment, gradient) copies of the matrices; batch split ways.
    expected = {
        "data=8,rules=dp": (1, 2, 1, 8),
        "fsdp=8,rules=zero1": (1, 2 / 8, 1, 8),
        "fsdp=8,rules=zero2": (1, 2 / 8, 1 / 8, 8),
        "fsdp=8,rules=fsdp": (1 / 8, 2 / 8, 1 / 8, 8),
        "data=2,tensor=4,rules=megatron": (1 / 4, 2 / 4, 1 / 4, 2),
    }
    for strategy, (params, moments, grads, batch_ways) in expected.items():
        trainer = _trainer(strategy, CONFIG, devices)
        rows = trainer.micro_rows[0]
        assert rows % batch_ways == 0
        batch_bytes = len(BATCH_KEYS) * rows * SEQ * 4  # int32 tokens, segment ids, ...
        micro = step_memory(trainer.buckets[0].compiled((rows, SEQ)))["state"]
        update = step_memory(compiled_update(trainer.home))["state"]
        # Slack of 64 bytes: the loss sum, target count and step counters, a few scalars.
        assert micro == pytest.approx(4 * ((params + grads) * matrices + 2 * norms)
                                      + batch_bytes / batch_ways, abs=64), strategy
        assert update == pytest.approx(4 * ((params + moments + grads) * matrices + 4 * norms),
                                       abs=64), strategy
        # The home's own count of its state agrees with XLA's.
        assert trainer.home.state_bytes() == pytest.approx(
            4 * ((params + moments) * matrices + 3 * norms), abs=64), strategy


def test_balanced_order_gives_each_context_rank_chunks_i_and_2c_minus_1_minus_i():
    order = balanced_order(16, ways=4)  # 8 chunks of 2 tokens; rank r holds order[4r:4r+4]
    assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    # Causal work per rank: a token at position p attends to p + 1 tokens.
    work = (order + 1).reshape(4, 4).sum(axis=1)
    assert work.tolist() == [34, 34, 34, 34]


def _reductions(compiled: jax.stages.Compiled) -> list[str]:
    """The all-reduces and reduce-scatters of a compiled program that span more than one
    device (XLA leaves some over groups of one, which move nothing)."""
    found = []
    for line in compiled.as_text().splitlines():
        op = re.search(r"= .* (all-reduce|reduce-scatter)(-start)?\(", line)
        if not op:
            continue
        groups = re.search(r"replica_groups=(\S+)", line).group(1)
        if re.fullmatch(r"\{(\{\d+\},?)+\},?", groups) or re.match(r"\[\d+,1\]<=", groups):
            continue  # every group a single device
        found.append(f"{op.group(1)} {groups}")
    return found


def test_a_data_parallel_micro_step_reduces_nothing_and_its_bucket_reduces_once(devices):
    """Under `local` accumulation a data=8 micro-step keeps each shard's gradients (and loss
    and target counts) apart; the bucket's one reduction adds them up. Under `sharded` the
    micro-step reduces every time, into an eighth of the sum per device."""
    trainer = _trainer("data=8,rules=dp", CONFIG, devices)
    bucket = trainer.buckets[0]
    assert bucket.accumulate == "local" and bucket.partial == ("data",)
    micro = bucket.compiled((8, SEQ))
    assert _reductions(micro) == []
    acc = jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                sharding=sharding),
                       jax.eval_shape(bucket.zeros), bucket.acc_shardings)
    reduce = bucket.reducer(trainer.home.acc_shardings).lower(acc).compile()
    assert len(_reductions(reduce)) >= 1
    # ZeRO-3 over fsdp reduce-scatters every micro-step; data keeps its partial sums.
    fsdp = _trainer("data=2,fsdp=4,rules=fsdp", CONFIG, devices).buckets[0]
    assert fsdp.partial == ("data",)
    assert _reductions(fsdp.compiled((8, SEQ)))
    sharded = bucket_step(CONFIG, Strategy.parse("data=8,rules=dp"), tuple(devices), "sharded")
    assert _reductions(sharded.compiled((8, SEQ)))
    assert sharded.accumulator_bytes() == pytest.approx(bucket.accumulator_bytes() / 8,
                                                        rel=0.02)


@pytest.mark.parametrize("strategy", ["data=8,rules=dp", "data=2,fsdp=2,tensor=2"])
def test_local_and_sharded_accumulation_sum_the_same_gradients(strategy, devices, batch):
    """Two micro-steps of eight rows, accumulated either way, reduce to the same sums."""
    batch = Batch(*(np.concatenate([a, a[::-1]]) for a in (batch.tokens, batch.segment_ids,
                                                           batch.positions)))
    sums = {}
    for accumulate in ("local", "sharded"):
        trainer = _trainer(strategy, CONFIG, devices)
        step = bucket_step(CONFIG, Strategy.parse(strategy), tuple(devices), accumulate)
        compute = jax.device_put(trainer.home.cast(trainer.init(seed=0).params),
                                 step.param_shardings)
        acc, scale = step.zeros(), step.place_scale(trainer.home.no_scale)
        for arrays in micro_step_inputs(step.layout, batch, 8):
            acc = step.compiled((8, SEQ))(compute, acc, step.place(arrays), scale)
        sums[accumulate] = jax.tree.map(np.asarray,
                                        step.reduce(acc, trainer.home.acc_shardings))
    local, sharded = sums.values()
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), local.grads, sharded.grads)
    assert max(jax.tree.leaves(diffs)) <= 1e-5, diffs
    assert float(local.loss_sum) == pytest.approx(float(sharded.loss_sum), rel=1e-6)
    targets = next_token_targets(batch.tokens, batch.segment_ids)
    assert int(local.targets) == int(sharded.targets) == int((targets >= 0).sum())
