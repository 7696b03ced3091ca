"""Hot switching and micro-stepping: a table's buckets, each under its own strategy and cut into
micro-batches, give the training of one device on the same data (HotSPa's lossless property).

The reference never sees a bucket: it is one device under the single strategy `data=1`, trained
on each mini-batch's rows all padded to the longest bucket's length, as one bucket.
"""

import dataclasses
import itertools
import json
from typing import NamedTuple

import jax
import numpy as np
import pytest
from helpers import MODEL, OPTIM

from hotjax.data import Batch, ByteTokenizer, MiniBatch, MiniBatches, open_corpus
from hotjax.errors import UserError
from hotjax.sharding.report import most_sharded
from hotjax.sharding.strategy import Strategy
from hotjax.sharding.table import Bucket, StrategyTable, parse_table
from hotjax.train import BucketMetrics, Trainer, best_order

# Vocabulary padded to 384 so that it splits over tensor=4; fp32 so that every layout must give
# the same numbers to fp32 reduction-order noise.
CONFIG = MODEL
TABLE = parse_table({"bucket": [
    {"max_len": 32, "mesh": {"data": 8}},
    {"max_len": 64, "mesh": {"data": 2, "tensor": 4}, "rules": "megatron"},
    {"max_len": 128, "mesh": {"fsdp": 2, "context": 4}, "rules": "context"},
]}, "three-buckets")
MAX_LENS = [b.max_len for b in TABLE.buckets]
LONGEST = MAX_LENS[-1]
STEPS = 4
ONE = Strategy.parse("data=1")
FSDP8 = Strategy.parse("fsdp=8")


class Run(NamedTuple):
    losses: np.ndarray
    grad_norms: np.ndarray
    params: dict  # after the last step, on the host
    reports: list[list[BucketMetrics]]  # per step


def _train(trainer: Trainer, minibatches: list[MiniBatch]) -> Run:
    state, losses, norms, reports = trainer.init(seed=0), [], [], []
    for minibatch in minibatches:
        state, metrics, buckets = trainer.step(state, minibatch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
        reports.append(buckets)
    return Run(np.array(losses), np.array(norms), jax.tree.map(np.asarray, state.params),
               reports)


def _widened(minibatch: MiniBatch, length: int = LONGEST) -> MiniBatch:
    """Every row of `minibatch`, padded to `length` tokens, in one bucket: the same documents
    at the same positions, so the same loss and gradients."""
    def rows(key: str) -> np.ndarray:
        return np.concatenate([np.pad(getattr(b, key), ((0, 0), (0, length - b.tokens.shape[1])))
                               for b in minibatch.buckets])

    return MiniBatch((Batch(rows("tokens"), rows("segment_ids"), rows("positions")),))


def _one_device(devices, minibatches: list[MiniBatch]) -> Run:
    trainer = Trainer(CONFIG, OPTIM, StrategyTable.single(ONE, LONGEST, "one"), devices[:1])
    return _train(trainer, [_widened(m) for m in minibatches])


def _assert_same(run: Run, reference: Run, tolerance: float = 1e-5) -> None:
    np.testing.assert_allclose(run.losses, reference.losses, rtol=0, atol=tolerance)
    np.testing.assert_allclose(run.grad_norms, reference.grad_norms, rtol=tolerance)
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), run.params, reference.params)
    assert max(jax.tree.leaves(diffs)) <= tolerance, diffs


def _emptied(batch: Batch) -> Batch:
    return Batch(*(np.zeros((0, batch.tokens.shape[1]), np.int32) for _ in range(3)))


@pytest.fixture(scope="module")
def minibatches(tmp_path_factory) -> list[MiniBatch]:
    """Mini-batches of documents of mixed lengths, split into the table's buckets."""
    rng = np.random.default_rng(0)
    stdlib = open_corpus(None)
    text = "".join(stdlib.read(i) for i in range(30))
    lengths = rng.choice([10, 20, 40, 50, 90, 120], size=400)
    starts = rng.integers(0, len(text) - 200, size=400)
    path = tmp_path_factory.mktemp("mixed") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text[s:s + n]}) + "\n"
                            for s, n in zip(starts, lengths, strict=True)))
    batches = MiniBatches(open_corpus(str(path)), ByteTokenizer(), MAX_LENS, batch_tokens=2048,
                          seed=0)
    return list(itertools.islice(batches, STEPS))


@pytest.fixture(scope="module")
def one_device(devices, minibatches) -> Run:
    return _one_device(devices, minibatches)


@pytest.fixture(scope="module")
def fsdp_runs(devices, minibatches) -> dict[int, Run]:
    """The single strategy fsdp=8 on the widened mini-batches, by rows per micro-step: 8 (its
    default here: several micro-steps per step) and enough rows for one micro-step."""
    widened = [_widened(m) for m in minibatches]
    one_micro_step = -(-max(m.buckets[0].tokens.shape[0] for m in widened) // 8) * 8
    assert one_micro_step > 8
    runs = {}
    for rows in (8, one_micro_step):
        table = StrategyTable((Bucket(LONGEST, FSDP8, rows),), "fsdp")
        runs[rows] = _train(Trainer(CONFIG, OPTIM, table, devices), widened)
    return runs


def test_every_bucket_has_the_rows_its_sequences_need(minibatches):
    for minibatch in minibatches:
        assert minibatch.max_lens == tuple(MAX_LENS)
        for batch, max_len in zip(minibatch.buckets, MAX_LENS, strict=True):
            lengths = np.count_nonzero(batch.segment_ids, axis=1)
            assert lengths.all() and (lengths <= max_len).all()  # no empty row
    # The test data fills every bucket (the empty-bucket test empties one itself).
    assert all(b.real_tokens for m in minibatches for b in m.buckets)


@pytest.mark.parametrize("method", ["scheduled", "device_put"])
def test_hot_switched_table_equals_one_device(method, devices, minibatches, one_device):
    trainer = Trainer(CONFIG, OPTIM, TABLE, devices, switch_method=method)
    run = _train(trainer, minibatches)
    _assert_same(run, one_device)
    assert run.losses[-1] < run.losses[0]  # the updates did something
    # Every step ran the buckets in the planned order, and moved weights into (and gradients
    # out of) each bucket that is not laid out like home.
    home = trainer.home.layout.strategy
    assert any(b.micro_steps > 1 for report in run.reports for b in report)
    for report in run.reports:
        assert [b.max_len for b in report] == [MAX_LENS[i] for i in trainer.order]
        for b in report:
            if trainer.buckets[MAX_LENS.index(b.max_len)].layout.strategy != home:
                assert b.switched_bytes > 0, b


def test_several_micro_steps_equal_one_micro_step_and_one_device(fsdp_runs, one_device):
    (several, many), (one, single) = fsdp_runs.items()
    for report in fsdp_runs[several].reports:
        (bucket,) = report
        assert bucket.micro_rows == several and bucket.micro_steps > 1
        assert bucket.rows <= bucket.slots // LONGEST < bucket.rows + several
    for report in fsdp_runs[one].reports:
        (bucket,) = report
        assert bucket.micro_rows == one and bucket.micro_steps == 1
    _assert_same(many, single)
    _assert_same(many, one_device)
    _assert_same(single, one_device)


def test_a_single_strategy_at_home_in_fp32_switches_nothing(fsdp_runs):
    # Home is the strategy itself: the compute weights (fp32, a copy of the master weights)
    # and the summed gradients already have their target layouts.
    for run in fsdp_runs.values():
        assert [b.switched_bytes for report in run.reports for b in report] == [0] * STEPS


def test_an_empty_bucket_is_skipped_and_the_rest_equal_one_device(devices, minibatches):
    # Home fsdp=8 (it holds the least state per device) is also the layout of the 32 and
    # 128 buckets: only the 64 bucket, under tensor parallelism, moves anything.
    table = StrategyTable((Bucket(32, FSDP8), Bucket(64, TABLE.buckets[1].strategy),
                           Bucket(128, FSDP8)), "fsdp-megatron-fsdp")
    emptied = [dataclasses.replace(m, buckets=(m.buckets[0], _emptied(m.buckets[1]),
                                               m.buckets[2])) if step % 2 == 0 else m
               for step, m in enumerate(minibatches)]
    trainer = Trainer(CONFIG, OPTIM, table, devices, switch_method="device_put")
    assert trainer.home.layout.strategy == FSDP8
    run = _train(trainer, emptied)
    _assert_same(run, _one_device(devices, emptied))
    for step, report in enumerate(run.reports):
        moved = {b.max_len: b.switched_bytes for b in report}
        if step % 2 == 0:
            assert moved == {32: 0, 128: 0}
        else:
            assert moved[32] == moved[128] == 0 and moved[64] > 0


def test_micro_step_memory_does_not_depend_on_the_batch_size(devices, tmp_path):
    """A bucket's micro-step has one shape, so XLA's peak for it is the same whether a
    mini-batch brings a few rows or many: more rows only mean more micro-steps."""
    (tmp_path / "docs.jsonl").write_text("".join(
        json.dumps({"text": "x" * n}) + "\n" for n in range(20, 120, 7)))
    trainer = Trainer(CONFIG, OPTIM, StrategyTable.single(FSDP8, LONGEST, "fsdp"), devices)
    bucket, rows = trainer.buckets[0], trainer.micro_rows[0]
    peak = bucket.peak_bytes((rows, LONGEST))
    compiled = set(bucket._compiled)
    state, steps = trainer.init(seed=0), {}
    for batch_tokens in (LONGEST, 16 * LONGEST):
        minibatch = next(MiniBatches(open_corpus(str(tmp_path / "docs.jsonl")), ByteTokenizer(),
                                     [LONGEST], batch_tokens=batch_tokens, seed=0))
        state, _, (report,) = trainer.step(state, minibatch)
        assert report.micro_rows == rows
        steps[batch_tokens] = report.micro_steps
        assert set(bucket._compiled) == compiled  # no other shape was compiled
        assert bucket.peak_bytes((rows, LONGEST)) == peak
    assert steps[LONGEST] == 1 < steps[16 * LONGEST]
    # The report's per-bucket memory is that peak plus what stays resident.
    (during,) = [v for k, v in trainer.memory().items() if k.startswith("bucket")]
    assert during == trainer.home.resident_bytes() + peak


def test_micro_batches_sized_to_a_budget_are_the_most_that_fit(devices):
    """With a per-device budget, a bucket's micro-batch is the largest multiple of its batch
    shards whose micro-step XLA fits beside the resident home state and gradient sum — and no
    larger than a typical mini-batch fills."""
    table = StrategyTable.single(FSDP8, LONGEST, "fsdp")
    one = Trainer(CONFIG, OPTIM, table, devices)  # one row per batch shard: 8
    bucket, resident = one.buckets[0], one.home.resident_bytes()
    peaks = {rows: bucket.peak_bytes((rows, LONGEST)) for rows in (8, 16)}
    assert peaks[16] > peaks[8]
    # Room for 16 rows and half of 8 more: 16 fit, 24 would not.
    budget = resident + peaks[16] + (peaks[16] - peaks[8]) // 2  # bytes
    sized = Trainer(CONFIG, OPTIM, table, devices, device_memory=budget)
    assert sized.micro_rows == [16]
    assert max(sized.memory().values()) <= budget
    # A bucket that a typical mini-batch fills with 12 rows gets 8: one micro-step of 16
    # would mostly compute empty rows.
    assert Trainer(CONFIG, OPTIM, table, devices, device_memory=budget,
                   typical_rows=[12.0]).micro_rows == [8]
    # A budget the home state fits but no micro-step beside it still gives the smallest
    # micro-batch (the run's memory check refuses it with a one-line error)...
    tight = resident + peaks[8] // 2
    assert Trainer(CONFIG, OPTIM, table, devices, device_memory=tight).micro_rows == [8]
    # ...and one the home state does not fit is refused before any bucket compiles.
    with pytest.raises(UserError, match=r"--device-memory 0\.1 MiB: the home state needs 0\.2 MiB"):
        Trainer(CONFIG, OPTIM, table, devices, device_memory=2**20 // 10)


def test_bfloat16_hot_table_stays_within_bf16_rounding_of_one_device(devices, minibatches,
                                                                     one_device):
    """bf16 compute against the fp32 single device. bf16 keeps 8 significant bits, so each
    rounding of a weight or activation is off by up to 2**-9 ~ 2e-3 relative. The loss and
    the gradient norm are sums over ~2000 targets, where those errors, random in sign, mostly
    cancel: we see loss differences of 1e-4 to 7e-4 (growing over the steps as the weights
    drift apart) and gradient norms within 2e-3 relative. The bounds, 3e-3 in the loss and 1e-2
    relative in the gradient norm, leave a 4-6x margin over that noise; leaving out any one
    bucket's data moves, over these steps, the loss by 7e-3 to 2e-2 and the gradient norm by
    4% to 15%."""
    bf16 = dataclasses.replace(CONFIG, compute_dtype="bfloat16")
    trainer = Trainer(bf16, OPTIM, TABLE, devices, switch_method="device_put")
    run = _train(trainer, minibatches)
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(run.params))  # master weights
    differences = np.abs(run.losses - one_device.losses)
    assert differences.max() <= 3e-3, differences
    assert differences.max() > 1e-6  # it did compute in bf16
    np.testing.assert_allclose(run.grad_norms, one_device.grad_norms, rtol=1e-2)
    assert run.losses[-1] < run.losses[0]
    # The compute weights travel in bf16: half the bytes of fp32 compute weights.
    fp32 = Trainer(CONFIG, OPTIM, TABLE, devices)
    for pair, plan in trainer.weight_transfers.items():
        assert 2 * plan.bytes_moved == fp32.weight_transfers[pair].bytes_moved


def test_home_is_the_tables_or_the_strategy_holding_the_least_state_per_device(devices):
    # tensor=4 splits the matrices 4 ways, fsdp=2 only 2 ways, data=8 not at all.
    assert most_sharded(TABLE.strategies, CONFIG) == TABLE.buckets[1].strategy
    assert Trainer(CONFIG, OPTIM, TABLE, devices).home.layout.strategy == \
        TABLE.buckets[1].strategy
    uniform = StrategyTable(tuple(Bucket(m, Strategy.parse("data=8")) for m in MAX_LENS))
    assert most_sharded(uniform.strategies, CONFIG) == Strategy.parse("data=8")
    # A table that names its home keeps it (as `hotjax plan` writes them).
    named = dataclasses.replace(TABLE, home=Strategy.parse("fsdp=8"))
    assert Trainer(CONFIG, OPTIM, named, devices).home.layout.strategy == \
        Strategy.parse("fsdp=8")


def test_best_order_minimises_the_chain_of_switches():
    costs = {(-1, 0): 5, (-1, 1): 1, (-1, 2): 9, (0, 1): 7, (1, 0): 7, (0, 2): 1, (2, 0): 1,
             (1, 2): 2, (2, 1): 2}
    assert best_order(costs, 3) == [1, 2, 0]  # 1 + 2 + 1
