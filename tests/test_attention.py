"""Blockwise and ring attention equal dense attention (values and gradients, fp32), compute
only the blocks the mask shows, and pick a kernel per platform; remat policies change memory,
never the numbers."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import MODEL

from hotjax.models.attention import (
    Tokens,
    _pallas,
    attention,
    choose_backend,
    dense_attention,
    ring_block_counts,
    visible_blocks,
)
from hotjax.models.head_loss import token_loss
from hotjax.models.llama import bind, init_params, layers_unrolled
from hotjax.optim import OptimConfig
from hotjax.sharding.strategy import Layout, Strategy, fit_to_model
from hotjax.sharding.table import Bucket, StrategyTable, parse_table
from hotjax.step import BucketStep, balanced_order, next_token_targets, step_memory
from hotjax.train import Trainer

TOLERANCE = 1e-5  # fp32: only the order of the softmax sums differs


def packed_rows(rows: int, seq_len: int, lengths: list[int], seed: int = 0,
                padding_rows: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids and positions of rows packed with documents of the given lengths (drawn at
    random), each row ending in some padding; the last `padding_rows` rows are all padding."""
    rng = np.random.default_rng(seed)
    segment_ids_BxT = np.zeros((rows, seq_len), np.int32)
    positions_BxT = np.zeros((rows, seq_len), np.int32)
    for r in range(rows - padding_rows):
        start, segment = 0, 1
        end = seq_len - int(rng.integers(0, seq_len // 8))
        while start < end:
            length = min(int(rng.choice(lengths)), end - start)
            segment_ids_BxT[r, start:start + length] = segment
            positions_BxT[r, start:start + length] = np.arange(length)
            start, segment = start + length, segment + 1
    return segment_ids_BxT, positions_BxT


def qkv(rows: int, seq_len: int, heads: int, kv_heads: int, head_dim: int = 16, seed: int = 1):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(rows, seq_len, n, head_dim)), jnp.float32)
                 for n in (heads, kv_heads, kv_heads))


def values_and_grads(fn, q, k, v, segment_ids_BxT):
    """fn's output and the gradients of a random projection of it; padding outputs carry no
    loss (as in training), so they get no cotangent."""
    weights = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)
    weights = weights * (jnp.asarray(segment_ids_BxT) > 0)[:, :, None, None]

    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * weights), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=TOLERANCE, rtol=TOLERANCE)


CASES = {
    "packed rows of many documents": (3, 256, [5, 17, 30, 64], 8, 4, 0),
    "one document per row": (2, 256, [256], 8, 4, 0),
    "rows of padding only": (4, 128, [9, 40], 8, 4, 2),
    "GQA 8/2": (2, 128, [7, 33, 100], 8, 2, 0),
}


@pytest.mark.parametrize("case", CASES)
def test_blockwise_attention_equals_dense_values_and_gradients(case):
    rows, seq_len, lengths, heads, kv_heads, padding = CASES[case]
    segment_ids_BxT, positions_BxT = packed_rows(rows, seq_len, lengths, padding_rows=padding)
    q, k, v = qkv(rows, seq_len, heads, kv_heads)

    def blockwise(q, k, v):
        return attention(q, k, v, segment_ids_BxT, positions_BxT, backend="blockwise", block=32)

    def dense(q, k, v):
        return dense_attention(q, k, v, segment_ids_BxT, positions_BxT)

    assert_close(values_and_grads(blockwise, q, k, v, segment_ids_BxT),
                 values_and_grads(dense, q, k, v, segment_ids_BxT))


def tokens(segment_ids_BxT: np.ndarray, positions_BxT: np.ndarray) -> Tokens:
    columns_BxT = np.broadcast_to(np.arange(segment_ids_BxT.shape[1]), segment_ids_BxT.shape)
    return Tokens(*(jnp.asarray(x, jnp.int32) for x in (segment_ids_BxT, positions_BxT,
                                                        columns_BxT)))


def test_only_blocks_the_mask_shows_are_computed():
    n, block = 8, 16
    seq_len = n * block
    causal = tokens(np.ones((1, seq_len)), np.arange(seq_len)[None])
    # The lower triangle with its diagonal: the blocks above it are never computed.
    assert int(visible_blocks(causal, causal, block, block).sum()) == n * (n + 1) // 2
    # One document per block: each block sees itself only.
    per_block = tokens(np.repeat(np.arange(1, n + 1), block)[None],
                       np.tile(np.arange(block), n)[None])
    np.testing.assert_array_equal(visible_blocks(per_block, per_block, block, block)[0],
                                  np.eye(n, dtype=bool))
    # Documents straddling one block boundary add that one pair; padding adds nothing.
    segment_ids_BxT = np.zeros((1, seq_len), np.int32)
    positions_BxT = np.zeros((1, seq_len), np.int32)
    segment_ids_BxT[0, :24], positions_BxT[0, :24] = 1, np.arange(24)  # blocks 0 and 1
    segment_ids_BxT[0, 24:32], positions_BxT[0, 24:32] = 2, np.arange(8)  # block 1
    visible = visible_blocks(*(2 * [tokens(segment_ids_BxT, positions_BxT)]), block, block)[0]
    assert sorted(zip(*np.nonzero(np.asarray(visible)), strict=True)) == [(0, 0), (1, 0), (1, 1)]


def test_balanced_chunks_balance_the_ring_work():
    seq_len, ways, block = 4096, 4, 256
    segment_ids_BxT, positions_BxT = np.ones((1, seq_len)), np.arange(seq_len)[None]
    unbalanced = ring_block_counts(segment_ids_BxT, positions_BxT, ways, False, block)
    balanced = ring_block_counts(segment_ids_BxT, positions_BxT, ways, True, block)
    total = (seq_len // block) * (seq_len // block + 1) // 2  # the causal triangle
    assert unbalanced.sum() == balanced.sum() == total
    np.testing.assert_array_equal(unbalanced, [10, 26, 42, 58])  # rank 3 does 5.8x rank 0
    np.testing.assert_array_equal(balanced, [total // ways] * ways)


RING_LAYOUTS = [
    ("context=4,tensor=2,rules=megatron", 4),
    ("context=4,tensor=2,rules=megatron,balanced=true", 4),
    ("fsdp=2,context=4,rules=context,balanced=true", 4),
    ("context=8,rules=context", 4),
    ("context=2,tensor=4,rules=megatron,balanced=true", 2),  # K/V heads replicated over tensor
    ("data=2,tensor=4,rules=megatron-sp", 4),
    ("data=2,context=2,tensor=2,rules=megatron-sp,balanced=true", 4),
]


@pytest.mark.parametrize("text, kv_heads", RING_LAYOUTS)
def test_attention_under_every_layout_equals_dense(devices, text, kv_heads):
    """Per device under a strategy (a ring when the sequence is split), with small blocks so
    that every chunk holds several; the columns in the strategy's order, as the trainer
    lays them out."""
    config = dataclasses.replace(MODEL, n_kv_heads=kv_heads)
    strategy, _ = fit_to_model(Strategy.parse(text), config)
    layout = Layout(strategy, devices)
    rows, seq_len = 4, 128
    segment_ids_BxT, positions_BxT = packed_rows(rows, seq_len, [5, 20, 50, 128], seed=3)
    q, k, v = qkv(rows, seq_len, config.n_heads, kv_heads)
    order = (balanced_order(seq_len, strategy.ring) if strategy.balanced
             else np.arange(seq_len))
    back = np.argsort(order)

    def ring(q, k, v):
        out = attention(q[:, order], k[:, order], v[:, order], segment_ids_BxT[:, order],
                        positions_BxT[:, order], backend="blockwise", block=8,
                        sharding=layout.attention)
        return out[:, back]

    def dense(q, k, v):
        return dense_attention(q, k, v, segment_ids_BxT, positions_BxT)

    assert_close(values_and_grads(ring, q, k, v, segment_ids_BxT),
                 values_and_grads(dense, q, k, v, segment_ids_BxT))


RING_KERNEL_CASES = {  # strategy, K/V heads, dtype, rows of padding only
    "ring of 4, GQA 8/2, a row of padding": ("data=2,context=4,rules=context", 2, "float32", 1),
    "ring of 4, GQA 8/2, a row of padding, FA2-split backward":
        ("data=2,context=4,rules=context", 2, "float32", 1),
    "balanced ring of 2, heads split, K/V heads replicated":
        ("context=2,tensor=4,rules=megatron,balanced=true", 2, "float32", 0),
    "balanced ring of 4 in bfloat16": ("data=2,context=4,rules=context,balanced=true", 4,
                                       "bfloat16", 0),
}
BF16_TOLERANCE = 3e-2  # bfloat16 inputs, probabilities and dS: 8 bits of mantissa


@pytest.mark.parametrize("case", RING_KERNEL_CASES)
def test_the_ring_step_pallas_kernel_equals_dense_when_interpreted(devices, case, monkeypatch):
    """The ring with the ring step's Pallas kernel per K/V chunk, as on a GPU, run by Pallas'
    interpreter: chunks of 32 tokens (halves of 16 when balanced, the kernel's least tile),
    documents crossing chunks and tiles, in the strategy's column order. Padding's outputs
    and its K/V gradients are exactly zero. The FA2-split case takes that backward as heads of
    128 in 16 bits do (`default_backward`), here for the tiny model's fp32 heads."""
    import hotjax.models.packed_attention as packed

    text, kv_heads, dtype, padding = RING_KERNEL_CASES[case]
    config = dataclasses.replace(MODEL, n_kv_heads=kv_heads)
    strategy, _ = fit_to_model(Strategy.parse(text), config)
    layout = Layout(strategy, devices)
    rows, seq_len = 4, 128
    segment_ids_BxT, positions_BxT = packed_rows(rows, seq_len, [5, 20, 50, 128], seed=3,
                                                 padding_rows=padding)
    q, k, v = (x.astype(dtype) for x in qkv(rows, seq_len, config.n_heads, kv_heads))
    if "FA2-split" in case:
        monkeypatch.setattr(packed, "FA2_MEASURED_FASTER", {(4, q.shape[-1])})
        assert packed.default_backward(q.dtype, q.shape[-1]) == "fa2-split"
    order = (balanced_order(seq_len, strategy.ring) if strategy.balanced
             else np.arange(seq_len))
    back = np.argsort(order)

    def ring(q, k, v):
        out = attention(q[:, order], k[:, order], v[:, order], segment_ids_BxT[:, order],
                        positions_BxT[:, order], sharding=layout.attention, interpret=True)
        return out[:, back]

    def dense(q, k, v):  # in fp32, on the same (rounded) inputs
        return dense_attention(*(x.astype(jnp.float32) for x in (q, k, v)), segment_ids_BxT,
                               positions_BxT)

    got = values_and_grads(ring, q, k, v, segment_ids_BxT)
    tolerance = TOLERANCE if dtype == "float32" else BF16_TOLERANCE
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(values_and_grads(dense, q, k, v,
                                                                           segment_ids_BxT)),
                    strict=True):
        assert g.dtype == dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), atol=tolerance,
                                   rtol=tolerance)
    padded = segment_ids_BxT == 0
    out, (_, dk, dv) = got
    assert padded.any() and not any(np.asarray(x, np.float32)[padded].any()
                                    for x in (out, dk, dv))


def test_model_with_blockwise_attention_equals_the_dense_model():
    """Logits and parameter gradients of the whole model: the reference the strategy tests
    (tests/test_parallelism.py) build on, since their single device runs the blockwise kernel."""
    segment_ids_BxT, positions_BxT = packed_rows(2, 128, [9, 30, 70])
    tokens_BxT = np.random.default_rng(4).integers(0, 256, size=(2, 128)).astype(np.int32)
    targets_BxT = next_token_targets(tokens_BxT, segment_ids_BxT)
    params = init_params(MODEL)

    def run(backend: str):
        config = dataclasses.replace(MODEL, attention=backend, attention_block=16)

        def loss(params):
            logits = bind(config, params)(tokens_BxT, segment_ids_BxT, positions_BxT)
            total, count = token_loss(logits, targets_BxT)
            return total / count, logits

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    assert_close(run("blockwise"), run("dense"))


def test_the_pallas_gpu_kernel_equals_dense_when_interpreted():
    """The GPU kernel's wrapper (K/V repeated per query head, padding zeroed), run by Pallas'
    interpreter on CPU, since no GPU is here."""
    segment_ids_BxT, positions_BxT = packed_rows(2, 64, [7, 20, 64])
    q, k, v = qkv(2, 64, 8, 2)
    want = dense_attention(q, k, v, segment_ids_BxT, positions_BxT)
    got = _pallas(q, k, v, jnp.asarray(segment_ids_BxT), interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("requested, platform, ring, packed, kernel, note", [
    ("auto", "cpu", False, True, "blockwise", None),
    ("auto", "cpu", True, True, "blockwise", None),
    ("cudnn", "cpu", False, False, "blockwise", "cudnn needs a GPU"),
    ("pallas", "cpu", False, True, "blockwise", "pallas needs a GPU"),
    ("auto", "gpu", False, False, "cudnn", None),
    ("auto", "gpu", False, True, "pallas", None),
    ("auto", "gpu", True, True, "pallas-ring", None),
    ("pallas", "gpu", True, True, "pallas-ring", None),
    ("cudnn", "gpu", True, False, "pallas-ring",
     "cudnn cannot pass K/V around a context-parallel ring"),
    ("blockwise", "gpu", True, True, "blockwise", None),
    ("dense", "gpu", False, True, "dense", None),
])
def test_the_kernel_is_chosen_per_platform_and_falls_back_cleanly(requested, platform, ring,
                                                                  packed, kernel, note):
    assert choose_backend(requested, platform, ring=ring, packed=packed) == (kernel, note)


@pytest.mark.parametrize("platform, ring, packed, dtype",
                         list(itertools.product(("cpu", "gpu"), (False, True), (False, True),
                                                ("float32", "bfloat16"))))
def test_auto_takes_each_platforms_kernel_whatever_the_rows_and_dtype(platform, ring, packed,
                                                                      dtype):
    """The CPU runs the blockwise kernel; a GPU's ring the ring step's Pallas kernel, else
    cuDNN for rows of one document and the packed Pallas kernel for packed rows (documents
    not known: cuDNN's packed layout does not pay)."""
    kernel = ("blockwise" if platform == "cpu" else "pallas-ring" if ring
              else "pallas" if packed else "cudnn")
    assert choose_backend("auto", platform, ring=ring, packed=packed, seq_len=1024,
                          dtype=dtype) == (kernel, None)


def test_a_ring_falls_back_to_blockwise_where_its_kernel_cannot_run(monkeypatch):
    """The ring step's tiles must divide a rank's chunk (each balanced half), 16 at least."""
    assert choose_backend("auto", "gpu", ring=True, packed=True, seq_len=48) == (
        "pallas-ring", None)
    assert choose_backend("auto", "gpu", ring=True, packed=True, seq_len=40) == (
        "blockwise", "the ring's Pallas kernel tiles a rank's chunk (40 tokens) in blocks of 16 "
        "or more")
    monkeypatch.setattr("hotjax.models.attention._pallas_available", lambda: False)
    assert choose_backend("auto", "gpu", ring=True, packed=True) == (
        "blockwise", "the Pallas GPU kernel is not importable")


def test_pallas_takes_only_rows_its_tiles_divide():
    assert choose_backend("auto", "gpu", ring=False, packed=True, seq_len=1024) == ("pallas", None)
    assert choose_backend("auto", "gpu", ring=False, packed=True, seq_len=1000) == (
        "blockwise", "Pallas tiles rows in blocks of 128 tokens")


def test_a_trainer_notes_a_kernel_that_cannot_run_here(devices):
    step = BucketStep(dataclasses.replace(MODEL, attention="cudnn"), Strategy.parse("data=8"),
                      tuple(devices))
    assert step.notes == ("data8 [auto]: attention cudnn asked for, blockwise runs: cudnn needs "
                          "a GPU",)


def test_a_long_row_needs_a_quarter_of_the_dense_step_memory(devices):
    """XLA's peak of a tiny fp32 training micro-step on one 4096-token row, one device."""
    def peak(backend: str) -> int:
        config = dataclasses.replace(MODEL, attention=backend)
        step = BucketStep(config, Strategy.parse("data=1"), devices[:1])
        return step_memory(step.compiled((1, 4096)))["peak"]

    dense, blockwise = peak("dense"), peak("blockwise")
    assert dense > 2**30  # every score of 8 heads x 4096^2, and its gradient
    assert blockwise <= dense / 4


# --- remat --------------------------------------------------------------------------------------


def test_remat_policies_change_memory_not_the_gradients(devices):
    strategy = Strategy.parse("data=2,tensor=4,rules=megatron-sp")
    segment_ids_BxT, positions_BxT = packed_rows(2, 256, [30, 100, 256], seed=5)
    batch = {"tokens": np.random.default_rng(6).integers(0, 256, (2, 256)).astype(np.int32),
             "segment_ids": segment_ids_BxT, "positions": positions_BxT,
             "targets": np.where(segment_ids_BxT > 0, 7, -1).astype(np.int32)}
    params = init_params(MODEL)
    results, peaks = {}, {}
    for policy in ("none", "dots", "full"):
        step = BucketStep(dataclasses.replace(MODEL, remat=policy), strategy, devices)
        compiled = step.compiled((2, 256))
        peaks[policy] = step_memory(compiled)["peak"]
        results[policy] = compiled(jax.device_put(params, step.param_shardings), step.zeros(),
                                   step.place(batch), step.place_scale(jnp.float32(1)))
    assert peaks["full"] < peaks["dots"] < peaks["none"]
    # The layer loop unrolled (a GPU's choice under "none") computes the same gradients.
    unrolled = BucketStep(dataclasses.replace(MODEL, scan_unroll=MODEL.n_layers), strategy,
                          devices).compiled((2, 256))
    results["unrolled"] = unrolled(jax.device_put(params, step.param_shardings), step.zeros(),
                                   step.place(batch), step.place_scale(jnp.float32(1)))
    for policy in ("dots", "full", "unrolled"):
        assert_close(results[policy], results["none"])


def test_the_layer_loop_unrolls_on_a_gpu_without_remat_and_where_asked():
    assert layers_unrolled(MODEL, "cpu") == 1
    assert layers_unrolled(MODEL, "gpu") == MODEL.n_layers
    assert layers_unrolled(dataclasses.replace(MODEL, remat="dots"), "gpu") == 1
    assert layers_unrolled(dataclasses.replace(MODEL, scan_unroll=1), "gpu") == 1
    assert layers_unrolled(dataclasses.replace(MODEL, scan_unroll=99), "cpu") == MODEL.n_layers


def test_a_memory_budget_picks_the_cheapest_remat_policy_that_fits(devices):
    strategy = Strategy.parse("data=8,rules=dp")
    table = StrategyTable((Bucket(512, strategy),), "test")
    optim = OptimConfig()
    resident = Trainer(MODEL, optim, table, devices).home.resident_bytes()
    peaks = {policy: BucketStep(dataclasses.replace(MODEL, remat=policy), strategy,
                                devices).peak_bytes((8, 512)) for policy in ("none", "dots")}
    # Room for one row per device with `dots`, not with `none`.
    budget = resident + (peaks["none"] + peaks["dots"]) // 2  # bytes
    trainer = Trainer(MODEL, optim, table, devices, device_memory=budget)
    assert (trainer.buckets[0].config.remat, trainer.micro_rows) == ("dots", [8])
    # A policy named by the table (or --remat) is kept whatever the budget.
    named = StrategyTable((Bucket(512, strategy, remat="full"),), "test")
    assert Trainer(MODEL, optim, named, devices).buckets[0].config.remat == "full"
    assert Trainer(MODEL, optim, table, devices, remat="dots").buckets[0].config.remat == "dots"


def test_a_table_names_a_remat_policy_per_bucket():
    table = parse_table({"bucket": [{"max_len": 256, "mesh": {"data": 8}},
                                    {"max_len": 4096, "mesh": {"fsdp": 8}, "rules": "fsdp",
                                     "remat": "full"}]}, "t.toml")
    assert [b.remat for b in table.buckets] == [None, "full"]
    with pytest.raises(Exception, match="remat 'some': choose one of 'none', 'dots', 'full'"):
        parse_table({"bucket": [{"max_len": 256, "mesh": {"data": 8}, "remat": "some"}]},
                    "t.toml")
