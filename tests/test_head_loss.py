"""The fused LM head and cross-entropy (`hotjax.models.head_loss`) against the loss from whole
logits by autodiff: alone, in every chunking, in bf16; and a training step cut into chunks, under
strategies that split the rows, the sequence and the vocabulary, against one device uncut."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY

from hotjax import step
from hotjax.data import Batch, MiniBatch
from hotjax.models import head_loss
from hotjax.models.head_loss import NO_TARGET, loss_chunks, token_loss
from hotjax.models.llama import bind, init_params
from hotjax.optim import OptimConfig
from hotjax.sharding.strategy import Strategy
from hotjax.sharding.table import StrategyTable
from hotjax.train import Trainer

B, T, D, V = 2, 64, 16, 40
# A vocabulary no other test module uses: the steps compiled here, cut into chunks, are this
# module's alone in the per-(config, strategy, shape) cache.
CONFIG = dataclasses.replace(TINY, vocab_size=320)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=1, total_steps=2)
ROWS, SEQ = 8, 64


def _inputs(dtype):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (B, T, D), jnp.float32).astype(dtype)
    head = (0.5 * jax.random.normal(keys[1], (D, V), jnp.float32)).astype(dtype)
    targets = jax.random.randint(keys[2], (B, T), 0, V)
    # No target at each row's last token and over a stretch of padding.
    targets = targets.at[:, -1].set(NO_TARGET).at[1, 40:].set(NO_TARGET)
    return x, head, targets


def _reference(x, head, targets, seed):
    """seed x the loss sum from whole fp32 logits, its count, and its gradients."""
    def scaled(x, head):
        logits = jnp.einsum("btd,dv->btv", x.astype(jnp.float32), head.astype(jnp.float32),
                            precision="highest")
        total, count = token_loss(logits, targets)
        return total * seed, (total, count)

    (_, (total, count)), grads = jax.value_and_grad(scaled, argnums=(0, 1), has_aux=True)(
        x, head)
    return total, count, grads


def _fused(x, head, targets, seed, chunks):
    def scaled(x, head):
        total, count = head_loss.head_loss(x, head, targets, seed, lambda a, _axes: a, chunks)
        return total * seed, (total, count)

    (_, (total, count)), grads = jax.jit(jax.value_and_grad(scaled, argnums=(0, 1),
                                                            has_aux=True))(x, head)
    return total, count, grads


@pytest.mark.parametrize("chunks", [1, 2, 8])
def test_fused_loss_and_gradients_equal_autodiff_of_whole_logits(chunks):
    x, head, targets = _inputs(jnp.float32)
    seed = 0.37  # the loss scale over the token slots, as a micro-step passes it
    with jax.default_matmul_precision("highest"):
        total, count, (dx, dhead) = _fused(x, head, targets, seed, chunks)
    ref_total, ref_count, (ref_dx, ref_dhead) = _reference(x, head, targets, seed)
    assert int(count) == int(ref_count) == (T - 1) + 40
    np.testing.assert_allclose(float(total), float(ref_total), rtol=1e-6)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dhead, ref_dhead, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(dx)[1, 40:] == 0)  # no target: no gradient


def test_bf16_gradients_stay_within_bf16_rounding_of_fp32():
    x, head, targets = _inputs(jnp.bfloat16)
    total, _, (dx, dhead) = _fused(x, head, targets, 1.0, 4)
    ref_total, _, (ref_dx, ref_dhead) = _reference(x, head, targets, 1.0)
    assert dx.dtype == dhead.dtype == jnp.bfloat16  # the head's matmuls ran in bf16
    assert abs(float(total) - float(ref_total)) <= 1e-3 * abs(float(ref_total))
    for got, want in ((dx, ref_dx), (dhead, ref_dhead)):
        error = np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want)))
        assert error <= 2e-2 * np.max(np.abs(np.asarray(want))), error


def test_forward_alone_is_the_loss_sum():
    """Evaluation calls the fused loss without a gradient: the sum, no logits' gradient."""
    x, head, targets = _inputs(jnp.float32)
    with jax.default_matmul_precision("highest"):
        total, count = jax.jit(lambda x, h: head_loss.head_loss(
            x, h, targets, 1.0, lambda a, _axes: a, 4))(x, head)
    ref_total, ref_count, _ = _reference(x, head, targets, 1.0)
    np.testing.assert_allclose(float(total), float(ref_total), rtol=1e-6)
    assert int(count) == int(ref_count)


def test_chunks_fit_the_byte_budget_and_keep_rows_of_matmul_size():
    # Llama 3's vocabulary: 8K tokens of fp32 logits are 4.2 GB, four chunks of 1.05 GB.
    assert loss_chunks(1, 8192, 128256) == 4
    assert loss_chunks(1, 32768, 128256) == 16
    assert loss_chunks(8, 2048, 256) == 1  # small logits: one chunk
    # Never under MIN_CHUNK_TOKENS tokens a row, nor a chunk that does not divide the row.
    assert loss_chunks(64, 256, 128256) == 256 // head_loss.MIN_CHUNK_TOKENS
    assert loss_chunks(64, 384, 128256) == 2  # 192 tokens a row; 96 would be too few


@pytest.fixture(scope="module")
def batch() -> Batch:
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, CONFIG.vocab_size, size=(ROWS, SEQ)).astype(np.int32)
    segments = np.zeros((ROWS, SEQ), np.int32)
    positions = np.zeros((ROWS, SEQ), np.int32)
    for r in range(ROWS):
        bounds = [0, 20 + r, SEQ - r]  # two documents, then r padding tokens
        for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True), start=1):
            segments[r, a:b], positions[r, a:b] = s, np.arange(b - a)
    return Batch(tokens, segments, positions)


def _one_step(strategy: str, devices, batch: Batch):
    table = StrategyTable.single(Strategy.parse(strategy), SEQ, strategy)
    trainer = Trainer(CONFIG, OPTIM, table, devices)
    state, metrics, _ = trainer.step(trainer.init(seed=0), MiniBatch((batch,)))
    return float(metrics["loss"]), jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def uncut(devices, batch):
    """One device, the loss in one chunk (the default for these sizes)."""
    step.bucket_step.cache_clear()
    assert loss_chunks(ROWS, SEQ, CONFIG.vocab_size) == 1
    return _one_step("data=1", devices[:1], batch)


@pytest.fixture
def cut_into_eight(monkeypatch):
    """Every step compiled here cuts its loss into 8 chunks of 8 tokens a row."""
    monkeypatch.setattr(head_loss, "LOSS_CHUNK_BYTES", 1)
    monkeypatch.setattr(head_loss, "MIN_CHUNK_TOKENS", SEQ // 8)
    step.bucket_step.cache_clear()
    yield
    step.bucket_step.cache_clear()


@pytest.mark.parametrize("strategy", [
    "data=1",
    # The vocabulary split (vocab-parallel cross-entropy), and the sequence.
    "data=2,context=2,tensor=2,rules=megatron-sp",
    "fsdp=2,context=4,rules=ulysses-fsdp",
    "stage=2,data=4",  # the head inside the 1F1B schedule
])
def test_a_step_cut_into_chunks_equals_one_device_uncut(strategy, devices, batch, uncut,
                                                        cut_into_eight):
    assert loss_chunks(ROWS, SEQ, CONFIG.vocab_size) == 8
    loss, params = _one_step(strategy, devices if strategy != "data=1" else devices[:1], batch)
    ref_loss, ref_params = uncut
    assert abs(loss - ref_loss) <= 1e-5
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params, ref_params)
    assert max(jax.tree.leaves(diffs)) <= 1e-5, diffs


def _vocab_dots(loss_of_params) -> list[tuple[str, str]]:
    """The operand types of every matmul over a vocabulary-sized axis in the lowered gradient
    of a bf16 model's loss."""
    config = dataclasses.replace(CONFIG, compute_dtype="bfloat16")
    rows = {"tokens": jnp.ones((2, 64), jnp.int32), "segment_ids": jnp.ones((2, 64), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(64, dtype=jnp.int32), (2, 64)),
            "targets": jnp.ones((2, 64), jnp.int32)}
    text = jax.jit(jax.grad(lambda p: loss_of_params(config, p, rows))).lower(
        init_params(config)).as_text()
    operands = re.findall(r"stablehlo\.dot_general[^\n]*: \((tensor<[^>]*>), (tensor<[^>]*>)\)",
                          text)
    return [pair for pair in operands
            if any(re.search(rf"[<x]{config.vocab_size}x", t) for t in pair)]


def test_the_heads_matmuls_run_in_the_compute_dtype():
    """Autodiff of fp32 logits runs the head's two backward matmuls on the fp32 gradient
    (TF32 GEMMs on a GPU); the fused loss runs all three in bf16."""
    def fused(config, params, rows):
        return bind(config, params).loss(rows["tokens"], rows["segment_ids"], rows["positions"],
                                         rows["targets"], 1.0)[0]

    def whole(config, params, rows):
        logits = bind(config, params)(rows["tokens"], rows["segment_ids"], rows["positions"])
        return token_loss(logits, rows["targets"])[0]

    assert any("f32" in a or "f32" in b for a, b in _vocab_dots(whole))
    dots = _vocab_dots(fused)
    assert len(dots) == 3, dots  # the logits, the input's gradient, the head's gradient
    assert all("bf16" in a and "bf16" in b for a, b in dots), dots
