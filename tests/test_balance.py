"""Work balance across data shards (`hotjax.balance`): each row's estimated work counts the
blocks the attention kernel computes, placements keep every row exactly once and even the
shards out where the rows allow, and the micro-batches carry the rows where they were placed."""

import dataclasses
import itertools
import re

import numpy as np
import pytest

from hotjax.balance import (
    EMPTY,
    imbalance,
    place,
    row_work,
)
from hotjax.data import Batch
from hotjax.models.llama import preset
from hotjax.models.work import ATTENTION_TRAINING, MATMUL_TRAINING
from hotjax.sharding.strategy import Layout, Strategy
from hotjax.step import NO_TARGET, micro_step_inputs, next_token_targets

# In bf16, as `hotjax train` runs it: the GPU kernel tiles bf16 rows by 128 tokens.
TINY = dataclasses.replace(preset("tiny"), vocab_size=384)


def _documents(lengths: list[int], row: int) -> tuple[np.ndarray, np.ndarray]:
    """One row's segment ids and positions holding documents of `lengths` (then padding)."""
    segments, positions = np.zeros(row, np.int32), np.zeros(row, np.int32)
    start = 0
    for i, n in enumerate(lengths):
        segments[start:start + n], positions[start:start + n] = i + 1, np.arange(n)
        start += n
    return segments, positions


def test_a_rows_work_is_its_tokens_matmuls_and_the_attention_blocks_the_kernel_computes():
    long_doc = _documents([2048], 2048)
    short_docs = _documents([256] * 8, 2048)  # each document inside its own 256-token block
    segments, positions = (np.stack(x) for x in zip(long_doc, short_docs, strict=True))
    work = row_work(segments, positions, TINY, "cpu")  # the CPU kernel's blocks: 256 tokens
    c = TINY
    layer = c.dim * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads) + 3 * c.dim * c.ffn_dim
    matmuls = MATMUL_TRAINING * (c.n_layers * layer + c.dim * c.vocab_size) * 2048
    per_block = ATTENTION_TRAINING * 4 * c.n_heads * c.head_dim * c.n_layers * 256 * 256
    # The causal triangle of 8 x 8 blocks against its 8 diagonal blocks.
    np.testing.assert_allclose(work, [matmuls + 36 * per_block, matmuls + 8 * per_block])
    # The packed-attention Pallas kernel on GPU skips the same, in 128-token tiles: the triangle
    # of 16 x 16 tiles against 8 documents of 2 x 2 tiles, 3 below or on the diagonal each.
    on_gpu = row_work(segments, positions, TINY, "gpu")
    np.testing.assert_allclose(on_gpu, matmuls + np.array([136, 24]) * per_block / 4)


def _check_permutation(order: np.ndarray, rows: int, micro_rows: int) -> None:
    assert len(order) % micro_rows == 0 and len(order) < rows + micro_rows
    assert sorted(order[order != EMPTY]) == list(range(rows))


def test_placement_evens_out_rows_packed_heaviest_first():
    # First-fit-decreasing packs the long documents first: in order, shard 0 takes them all.
    work = np.array([10.0, 10, 10, 10, 1, 1, 1, 1])
    placed = place(work, micro_rows=8, shards=2)
    _check_permutation(placed.order, 8, 8)
    assert placed.before == pytest.approx(40 / 22)
    assert placed.after == pytest.approx(1.0)
    assert imbalance(work[placed.order], 8, 2) == pytest.approx(placed.after)


def test_placement_is_never_worse_than_row_order_and_near_the_best_one():
    rng = np.random.default_rng(0)
    for rows, micro_rows in [(r, m) for r in range(3, 7) for m in (2, 4) if r <= m + 2] * 4:
        work = rng.lognormal(0, 1, rows)
        placed = place(work, micro_rows=micro_rows, shards=2, pad_work=0.1)
        _check_permutation(placed.order, rows, micro_rows)
        assert 1 <= placed.after <= placed.before
        # Against every placement of these rows (padding rows cost pad_work).
        padded = np.concatenate([work, np.full(len(placed.order) - rows, 0.1)])
        best = min(imbalance(padded[list(p)], micro_rows, 2)
                   for p in itertools.permutations(range(len(padded))))
        assert placed.after <= best * 7 / 6 + 1e-12  # LPT's bound for two shards


def test_one_row_heavier_than_the_rest_together_cannot_be_balanced():
    placed = place(np.array([9.0, 1, 1, 1]), micro_rows=4, shards=2)
    # Two rows a shard: the long document's and a short one, against two short ones.
    assert placed.after == pytest.approx(10 / 6)


def test_one_shard_keeps_the_rows_in_order():
    placed = place(np.array([1.0, 5, 2]), micro_rows=2, shards=1)
    np.testing.assert_array_equal(placed.order, [0, 1, 2, EMPTY])
    assert placed.before == placed.after == 1.0


def test_micro_batches_carry_each_row_where_it_was_placed(devices):
    layout = Layout(Strategy.parse("data=2"), devices[:2])
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 100, (3, 16)).astype(np.int32)
    segments = np.repeat(np.array([[1], [1], [2]], np.int32), 16, axis=1)
    segments[2, 10:] = 0  # padding at the end of the last row
    positions = np.tile(np.arange(16, dtype=np.int32), (3, 1))
    order = np.array([2, 0, EMPTY, 1])
    micro = micro_step_inputs(layout, Batch(tokens, segments, positions), 2, order)
    targets = next_token_targets(tokens, segments)
    stacked = {k: np.concatenate([m[k] for m in micro]) for k in micro[0]}
    for slot, row in enumerate(order):
        if row == EMPTY:
            assert not stacked["tokens"][slot].any() and not stacked["segment_ids"][slot].any()
            assert (stacked["targets"][slot] == NO_TARGET).all()
        else:
            np.testing.assert_array_equal(stacked["tokens"][slot], tokens[row])
            np.testing.assert_array_equal(stacked["targets"][slot], targets[row])


def test_shards_that_meet_once_per_bucket_balance_their_totals():
    """Two rows per micro-step over two data shards: shards that meet every micro-step wait
    for the heavier row of each (similar rows paired: 5+4, 3+3, 2+1); shards that meet only at
    the bucket's end wait for the heavier total, which placement evens out exactly."""
    work = np.array([1.0, 3, 5, 2, 4, 3])
    per_step = place(work, 2, 2)
    assert per_step.after == pytest.approx((5 + 3 + 2) / 9)
    in_order = imbalance(work, 2, 2, per_bucket=True)
    assert in_order == pytest.approx(max(1 + 5 + 4, 3 + 2 + 3) / 9)
    placed = place(work, 2, 2, per_bucket=True)
    _check_permutation(placed.order, 6, 2)
    totals = [work[placed.order[shard::2]].sum() for shard in range(2)]
    assert totals == [9.0, 9.0] and placed.after == pytest.approx(1.0)
    assert placed.before == pytest.approx(in_order)


@pytest.mark.parametrize(("text", "accumulate", "independent"), [
    ("data=2", "local", True), ("data=2,tensor=4", "local", True),
    ("fsdp=2,rules=zero1", "local", True), ("data=2", "sharded", False),
    ("fsdp=2,rules=fsdp", "local", False), ("fsdp=2,rules=zero2", "local", False),
    ("data=2,fsdp=2,rules=fsdp", "local", False), ("tensor=2", "local", False)])
def test_data_shards_meet_once_per_bucket_only_where_nothing_splits_over_them(
        text, accumulate, independent):
    from hotjax.sharding.strategy import independent_shards

    assert independent_shards(Strategy.parse(text), accumulate) is independent


def test_a_data_parallel_micro_step_exchanges_nothing_between_its_shards(devices):
    """Under local accumulation the data shards' micro-step has no collective (they meet at
    the bucket's reduction), and its inputs are placed without one: the same arrays as
    `jax.device_put`, which across processes would first check that every process agrees."""
    import jax

    from hotjax.step import bucket_step

    bucket = bucket_step(TINY, Strategy.parse("data=2"), tuple(devices[:2]))
    hlo = bucket.compiled((2, 256)).as_text()
    # Collectives over groups of one device (a shard_map's psum over an axis of size 1) move
    # nothing; any other would make the shards meet.
    groups = re.findall(r"(?:all-reduce|all-gather|reduce-scatter|all-to-all)\(.*?"
                        r"replica_groups=(\{[^=]*\}),", hlo)
    assert groups and all(re.fullmatch(r"\{(\{\d+\},?)+\}", g) for g in groups), groups
    assert "collective-permute(" not in hlo
    arrays = {"tokens": np.arange(2 * 256, dtype=np.int32).reshape(2, 256)}
    placed = bucket.place(arrays)["tokens"]
    put = jax.device_put(arrays["tokens"], bucket.layout.batch_sharding)
    assert placed.sharding == put.sharding
    np.testing.assert_array_equal(np.asarray(placed), arrays["tokens"])
