"""The LM head and the cross-entropy, fused for training: the fp32 logits never exist whole and
every matmul of the head runs in the compute dtype.

Autodiff of `logits = x @ head` (fp32 out) then `token_loss` holds the B x T x V fp32 logits,
their softmax and their fp32 gradient at once, and runs the head's two backward matmuls with an
fp32 operand (the logits' gradient): on an H100 with a 128K vocabulary that was 27 of the 1B
model's 197 ms step at 8K tokens, as TF32 GEMMs, and 58 of 200 ms for four layers of Llama-3-8B's
width; at 32K tokens the logits' buffers alone asked for 68 GiB
(`docs/measurements/h100-2026-11-27b/`).

`head_loss` instead walks the tokens in `loss_chunks` chunks (strided: chunk c holds tokens c,
c + C, ..., so a sequence split over context ranks stays split the same way): per chunk, the
logits, their log-sum-exp, the loss, and the loss's gradient with respect to the logits, cast
to the compute dtype at once. Since the loss is the last thing computed, that gradient is known
in the forward pass (times `seed`, the cotangent the caller's backward will pass); the head's
two backward matmuls then run once over all tokens on it. The backward pass only scales the
stored gradients by (cotangent / seed), 1 in training. The cost: the logits' gradient in the
compute dtype, B x T x V x 2 bytes in bf16 (the fp32 logits were twice that, several times).

`token_loss` is the reference: the same loss from whole logits, by autodiff, as evaluation and
the tests compute it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

Array = jax.Array
Constrain = Callable[[Array, tuple[str | None, ...]], Array]
NO_TARGET = -1  # a position without a next token in its document: no loss
LOSS_CHUNK_BYTES = 2**30  # of fp32 logits, all devices together, per chunk
MIN_CHUNK_TOKENS = 128  # per row: a chunk's matmuls stay matmul-sized


def token_loss(logits_BxTxV: Array, targets_BxT: Array) -> tuple[Array, Array]:
    """Summed cross-entropy over positions with a target, and their number."""
    _, nll_BxT, _ = _cross_entropy(logits_BxTxV.astype(jnp.float32), targets_BxT)
    return jnp.sum(nll_BxT), jnp.sum(targets_BxT != NO_TARGET)


def loss_chunks(B: int, T: int, V: int) -> int:
    """How many chunks `head_loss` cuts T tokens into: the fewest (a power of two dividing T)
    whose fp32 logits fit `LOSS_CHUNK_BYTES`, none under `MIN_CHUNK_TOKENS` tokens a row."""
    chunks = 1
    while (B * T // chunks * V * 4 > LOSS_CHUNK_BYTES and T % (2 * chunks) == 0
           and T // (2 * chunks) >= MIN_CHUNK_TOKENS):
        chunks *= 2
    return chunks


def head_loss(x_BxTxD: Array, head_DxV: Array, targets_BxT: Array, seed: Array,
              on_rows: Constrain, chunks: int | None = None) -> tuple[Array, Array]:
    """The summed cross-entropy of `x @ head` over positions with a target, and their number;
    its gradients are those of the sum times `seed`, a nonzero scalar (module docstring). `x`
    and `head` in the compute dtype; `on_rows` lays out each chunk's logits (batch, inner_seq,
    vocab)."""
    B, T, _ = x_BxTxD.shape
    chunks = chunks or loss_chunks(B, T, head_DxV.shape[1])
    count = jnp.sum(targets_BxT != NO_TARGET)
    return _fused(x_BxTxD, head_DxV, targets_BxT, jnp.asarray(seed, jnp.float32), on_rows,
                  chunks), count


def _cross_entropy(logits_BxTxV: Array, targets_BxT: Array) -> tuple[Array, Array, Array]:
    """fp32 logits' log-sum-exp, cross-entropy (0 where there is no target) and the targets'
    one-hot. A one-hot contraction rather than a gather: with the vocabulary split over
    `tensor` each rank reduces its own slice, so full logits are never gathered
    (vocab-parallel CE); the one-hot of NO_TARGET is all zeros."""
    target_BxTxV = jax.nn.one_hot(targets_BxT, logits_BxTxV.shape[-1], dtype=jnp.float32)
    lse_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
    nll_BxT = lse_BxT - jnp.sum(logits_BxTxV * target_BxTxV, axis=-1)
    return lse_BxT, jnp.where(targets_BxT != NO_TARGET, nll_BxT, 0.0), target_BxTxV


def _strided(a_BxTx: Array, chunks: int) -> Array:
    """[B, T, ...] -> [C, B, T/C, ...]: chunk c holds tokens c, c + C, ..."""
    B, T = a_BxTx.shape[:2]
    return jnp.moveaxis(a_BxTx.reshape(B, T // chunks, chunks, *a_BxTx.shape[2:]), 2, 0)


def _unstrided(a_CxBxTx: Array) -> Array:
    """`_strided`'s inverse."""
    C, B, Tc = a_CxBxTx.shape[:3]
    return jnp.moveaxis(a_CxBxTx, 0, 2).reshape(B, Tc * C, *a_CxBxTx.shape[3:])


def _chunked(x_BxTxD: Array, head_DxV: Array, targets_BxT: Array, seed: Array,
             on_rows: Constrain, chunks: int, gradient: bool) -> tuple[Array, Array | None]:
    """The loss sum, and with `gradient` the gradient of seed x sum with respect to the
    logits, [C, B, T/C, V] in the compute dtype (chunked as `_strided`)."""
    def chunk(total: Array, xt: tuple[Array, Array]) -> tuple[Array, Array | None]:
        x_BxTxD, targets_BxT = xt
        logits_BxTxV = on_rows(jnp.einsum("btd,dv->btv", x_BxTxD, head_DxV,
                                          preferred_element_type=jnp.float32),
                               ("batch", "inner_seq", "vocab"))
        lse_BxT, nll_BxT, target_BxTxV = _cross_entropy(logits_BxTxV, targets_BxT)
        total = total + jnp.sum(nll_BxT)
        if not gradient:
            return total, None
        # d(nll)/d(logits) = softmax - one-hot, zero where there is no target.
        weight_BxT = jnp.where(targets_BxT != NO_TARGET, seed, 0.0)
        d_BxTxV = (jnp.exp(logits_BxTxV - lse_BxT[..., None]) - target_BxTxV) * weight_BxT[
            ..., None]
        return total, d_BxTxV.astype(x_BxTxD.dtype)

    return jax.lax.scan(chunk, jnp.zeros((), jnp.float32),
                        (_strided(x_BxTxD, chunks), _strided(targets_BxT, chunks)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused(x_BxTxD: Array, head_DxV: Array, targets_BxT: Array, seed: Array,
           on_rows: Constrain, chunks: int) -> Array:
    total, _ = _chunked(x_BxTxD, head_DxV, targets_BxT, seed, on_rows, chunks, gradient=False)
    return total


def _fused_forward(x_BxTxD: Array, head_DxV: Array, targets_BxT: Array, seed: Array,
                   on_rows: Constrain, chunks: int) -> tuple[Array, tuple]:
    total, d_CxBxTxV = _chunked(x_BxTxD, head_DxV, targets_BxT, seed, on_rows, chunks,
                                gradient=True)
    # The head's backward matmuls, once over every token, on the compute-dtype gradient, in the
    # compute dtype as the layers' are (XLA accumulates them in fp32).
    dx_BxTxD = _unstrided(jnp.einsum("cbtv,dv->cbtd", d_CxBxTxV, head_DxV))
    d_head_DxV = jnp.einsum("cbtd,cbtv->dv", _strided(x_BxTxD, chunks), d_CxBxTxV)
    return total, (dx_BxTxD, d_head_DxV, seed)


def _fused_backward(_on_rows: Constrain, _chunks: int, saved: tuple, ct_total: Array
                    ) -> tuple[Array, Array, None, Array]:
    dx_BxTxD, d_head_DxV, seed = saved
    # The stored gradients are of seed x the sum (seed is never 0); the cotangent asked for is
    # ct_total: in training the two are equal, and this scales by exactly 1.
    ratio = ct_total / seed
    return (dx_BxTxD * ratio.astype(dx_BxTxD.dtype), d_head_DxV * ratio.astype(d_head_DxV.dtype),
            None, jnp.zeros_like(seed))


_fused.defvjp(_fused_forward, _fused_backward)
