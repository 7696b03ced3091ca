"""A Pallas GPU (Triton) flash-attention kernel for packed rows that computes only the blocks
some document spans: below the causal diagonal and no further back than a block's documents go.

Rows hold each document as one contiguous run (segment id 0 is padding: it sees nothing and its
output is zero), so query t sees key s iff both are in the same run and s <= t. Outside the
kernel, `block_bounds` finds per query block the first key block it needs (the one holding the
start of the document of its first real token) and per key block the query blocks that need it
(up to the one holding the end of its last real token's document); the kernels loop over those
alone. Forward: grid (rows, query heads, query blocks), online softmax over key blocks from that
bound up to the diagonal.

Backward, one of `BACKWARDS` (`packed_attention(backward=)`):
- "two-loop": one fused kernel on the forward's grid: dK/dV of key block j over
  query blocks from the diagonal to j's bound, then dQ of query block j like the forward; QKᵀ
  and dO·Vᵀ are computed in both loops (7 tile matmuls). Query head n reads K/V head n // G;
  with G > 1 each query head's dK/dV are written in fp32 and summed outside the kernel.
- "fa2", FlashAttention-2's form: grid (rows, K/V heads, key blocks); a program loops over
  its K/V head's G query heads and, for each, the query blocks that see its key block, dK/dV
  summed in registers, each tile's dS·K added into an fp32 dQ (`plgpu.atomic_add`): 5 tile
  matmuls. "fa2-split": the same without dQ (4), then dQ in a kernel of its own per query
  head and query block (3), no atomics. Tiles, warps and stages: `BACKWARD_TILES` by dtype and
  head dim, or `tiles=`. Tiles a document covers whole and all below the diagonal
  (`interior_blocks`) skip the mask: each loop runs masked tiles, then those, then masked.

Measured (one H100, JAX 0.11.2, bf16, N=32, K=8, H=128, forward + backward, `scripts/bench_gpu.py
kernels`; docs/measurements/h100-2026-11-27e): "fa2-split" at 64 x 64 tiles, 4 warps and 2
stages ran 1.6-1.8x the two-loop backward's speed on every row measured: 1.07 against 1.79 ms
on an 8K row of 256-token documents, 2.20 against 3.63 of 2,048-token ones, 6.16 against 11.03
for one 8K document, and at 32K 3.10 against 5.56, 7.59 against 13.47 (cuDNN's packed layout:
8.22) and 89.7 against 150.1 ms (312 and 343 TFLOP/s of useful work on one document; cuDNN
554). Of the other tiles tried at 8K, 128 x 64 at 8 warps came nearest (2.56 ms on 2K-token
documents); 64 x 128 (FlashAttention-2's own at H=128) and 32 x 128 were no faster than the
two-loop kernel. "fa2" (dQ by atomic adds) was 2.2x slower than the two-loop kernel at 64 x 128
(docs/measurements/h100-2026-11-27d): the atomics, which "fa2-split" does without. So
`default_backward` takes "fa2-split" where it was measured faster (16-bit inputs, H=128) and the
two-loop kernel elsewhere until measured. Errors against dense attention equal the two-loop
kernel's on that GPU, fp32 and bf16, all three backwards.

A context-parallel ring (`hotjax.models.attention`) runs one step of its own per K/V chunk a rank
holds:
`ring_step` returns its queries' output over that chunk's keys with its log-sum-exp, for the
ring to merge, and `ring_step_backward` their share of dQ and the chunk's dK/dV from the final
log-sum-exp. A rank's chunk is not one run of the row (balanced chunks are two), so these mask
by positions within documents, not columns, and loop over the block pairs a table computed
outside the kernel lists, forward and backward. The ring's backward is the two-loop form or
FA2-split's (a K/V head's query heads in one program, dK/dV summed there, no per-head fp32
copies; then dQ per query block, on the table refined to `backward_tiles`); the ring takes
`default_backward`'s choice, FA2-split's on the strength of the packed kernel's measurement on
the same tile code: the ring's own speed under it is not yet measured.

Letters as in `hotjax.models.attention`; Q and W are blocks of queries and keys (`block` tokens
both, or `Tiles.query` and `Tiles.key` in the FA2 backwards).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

Array = jax.Array
BLOCK = 128  # the largest tile edge on both sequence axes (see `block_for`)
_MASKED = -0.7 * float(np.finfo(np.float32).max)  # finite: a row of masks gives no NaN
_LOG2E = math.log2(math.e)  # scores are kept in base 2 (exp2 is the GPU's native exponential)


def block_for(dtype, head_dim: int, seq_len: int) -> int:
    """The tile edge for rows of `seq_len` tokens: the largest power of two dividing the row up
    to 128 for 16-bit inputs whose head row is at most 256 bytes (H=128 in bf16), else up to
    64. The backward's fp32 tiles decide: fp32 inputs at 128 ask 257 KiB of shared memory at
    H=64 already (measured on an H200: 263,680 bytes of 232,448), more than an H100's or
    H200's 227 KiB."""
    itemsize = jnp.dtype(dtype).itemsize
    edge = BLOCK if itemsize <= 2 and itemsize * head_dim <= 256 else BLOCK // 2
    while seq_len % edge:
        edge //= 2
    return edge


def _runs(segment_ids_BxT):
    """([B, T], [B, T]): the column where each token's run (document) starts and ends; runs
    are cut where the id changes. NumPy in, NumPy out."""
    xp = np if isinstance(segment_ids_BxT, np.ndarray) else jnp
    seg = segment_ids_BxT
    B, T = seg.shape
    columns = xp.arange(T, dtype=np.int32)
    starts = xp.concatenate([xp.ones((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    ends = xp.concatenate([seg[:, 1:] != seg[:, :-1], xp.ones((B, 1), bool)], axis=1)
    if xp is np:
        run_start = np.maximum.accumulate(np.where(starts, columns, 0), axis=1)
        run_end = np.minimum.accumulate(np.where(ends, columns, T - 1)[:, ::-1], axis=1)[:, ::-1]
        return run_start, run_end
    # lax's cumulative max/min, an associative scan: `jnp.maximum.accumulate` is a
    # sequential loop of T steps, which on a GPU cost more than the kernel it feeds
    # (384 ms of a 8K-token row's forward and backward on an H200, for 160 blocks).
    return (lax.cummax(jnp.where(starts, columns, 0), axis=1),
            lax.cummin(jnp.where(ends, columns, T - 1), axis=1, reverse=True))


def block_bounds(segment_ids_BxT, block: int, key_block: int = 0):
    """([B, T/block], [B, T/key_block]) int32: for each query block the first key block it
    may see, and for each key block one past the last query block that may see it; a block of
    padding gets an empty range (first past its diagonal; end at the first query block its
    keys could reach). Key blocks are `block` tokens unless `key_block` says otherwise.
    NumPy segment ids give NumPy answers (the host's count of the kernel's work)."""
    xp = np if isinstance(segment_ids_BxT, np.ndarray) else jnp
    seg, (run_start, run_end) = segment_ids_BxT, _runs(segment_ids_BxT)
    B, T = seg.shape
    key_block = key_block or block
    real_BxIxQ = (seg > 0).reshape(B, T // block, block)
    real_BxJxW = (seg > 0).reshape(B, T // key_block, key_block)
    own_I = xp.arange(T // block, dtype=np.int32)
    first = xp.min(xp.where(real_BxIxQ, (run_start // key_block).reshape(real_BxIxQ.shape), T),
                   axis=-1)
    last = xp.max(xp.where(real_BxJxW, (run_end // block).reshape(real_BxJxW.shape), -1),
                  axis=-1)
    past_diagonal_I = (own_I * block + block - 1) // key_block + 1
    first = xp.where(real_BxIxQ.any(axis=-1), first, past_diagonal_I)
    diagonal_J = xp.arange(T // key_block, dtype=np.int32) * key_block // block
    end = xp.where(real_BxJxW.any(axis=-1), last + 1, diagonal_J)
    return first.astype(np.int32), end.astype(np.int32)


def interior_blocks(segment_ids_BxT, block: int, key_block: int):
    """Where tiles need no mask: ([B, T/block] x 2, [B, T/key_block] x 2) int32, per query
    block the range [lo, hi) of key blocks it sees whole, and per key block the range of
    query blocks that see it whole. A tile is whole when all its keys precede all its queries
    and one document spans from its first key to its last query; the kernels clip these
    ranges to their loops' bounds and mask the tiles outside them (the diagonal, and the
    edges of documents)."""
    xp = np if isinstance(segment_ids_BxT, np.ndarray) else jnp
    seg, (run_start, run_end) = segment_ids_BxT, _runs(segment_ids_BxT)
    T = seg.shape[1]
    own_I = xp.arange(T // block, dtype=np.int32)
    own_J = xp.arange(T // key_block, dtype=np.int32)
    # Query block i: its last token's document reaches back to key block lo; the keys of
    # blocks below hi all precede its first query.
    last_I = own_I * block + block - 1
    lo_I = xp.where(seg[:, last_I] > 0, -(-run_start[:, last_I] // key_block), T)
    hi_I = xp.broadcast_to(own_I * block // key_block, lo_I.shape)
    # Key block j: the first query block after all its keys, to the last one its first
    # token's document covers.
    first_J = own_J * key_block
    lo_J = xp.broadcast_to(-(-(first_J + key_block) // block), lo_I.shape[:1] + own_J.shape)
    hi_J = xp.where(seg[:, first_J] > 0, (run_end[:, first_J] + 1) // block, 0)
    return tuple(x.astype(np.int32) for x in (lo_I, hi_I, lo_J, hi_J))


def computed_blocks(segment_ids_BxT, block: int = BLOCK):
    """[B] (query block, key block) pairs the kernel computes per row (each pass, each head);
    a row's causal triangle is n(n+1)/2 of n blocks."""
    first, _ = block_bounds(segment_ids_BxT, block)
    xp = np if isinstance(first, np.ndarray) else jnp
    own = xp.arange(first.shape[1], dtype=np.int32)
    return xp.maximum(own - first + 1, 0).sum(axis=1)


class _Queries(NamedTuple):
    """A query block inside a kernel: its rows, segment ids, causal order (columns or
    positions) and, in the backward pass, dO and its rows' base-2 log-sum-exp and delta."""

    q_QxH: Array
    seg_Q: Array
    order_Q: Array
    do_QxH: Array | None = None
    lse_Q: Array | None = None
    delta_Q: Array | None = None


class _Keys(NamedTuple):
    """A key block inside a kernel: its K and V rows, segment ids and causal order."""

    k_WxH: Array
    v_WxH: Array
    seg_W: Array
    order_W: Array


def _columns(index, block: int) -> Array:
    return index * block + jnp.arange(block)


def _scores(queries: _Queries, keys: _Keys, scale: float, masked: bool = True
            ) -> tuple[Array, Array | None]:
    """Base-2 scaled scores of a query block against a key block, and the mask: the same
    document, not padding, the key not later. An interior tile (`masked` False) has none."""
    s_QxW = plgpu.dot(queries.q_QxH, keys.k_WxH.T) * (scale * _LOG2E)
    if not masked:
        return s_QxW, None
    q_seg_Q = queries.seg_Q
    mask_QxW = ((q_seg_Q[:, None] == keys.seg_W[None, :]) & (q_seg_Q[:, None] > 0)
                & (keys.order_W[None, :] <= queries.order_Q[:, None]))
    return jnp.where(mask_QxW, s_QxW, _MASKED), mask_QxW


def _fold(carry, queries: _Queries, keys: _Keys, scale: float):
    """A key block folded into a query block's online softmax (output, max, sum; base 2).
    Masked scores weigh until a real one lifts the max above them (then exp2 gives 0): a row
    that sees nothing ends with its max at _MASKED or below."""
    acc_QxH, m_Q, l_Q = carry
    s_QxW, _ = _scores(queries, keys, scale)
    m_next = jnp.maximum(m_Q, s_QxW.max(axis=-1))
    p_QxW = jnp.exp2(s_QxW - m_next[:, None])
    shrink = jnp.exp2(m_Q - m_next)
    acc_QxH = acc_QxH * shrink[:, None] + plgpu.dot(p_QxW.astype(keys.v_WxH.dtype), keys.v_WxH)
    return acc_QxH, m_next, l_Q * shrink + p_QxW.sum(axis=-1)


def _empty(block: int, H: int):
    return (jnp.zeros((block, H), jnp.float32), jnp.full((block,), -jnp.inf, jnp.float32),
            jnp.zeros((block,), jnp.float32))


def _score_grads(queries: _Queries, keys: _Keys, scale: float, masked: bool = True
                 ) -> tuple[Array, Array]:
    """A tile's probabilities P and the gradient dS of its (unscaled) scores, fp32."""
    s_QxW, mask_QxW = _scores(queries, keys, scale, masked)
    p_QxW = jnp.exp2(s_QxW - queries.lse_Q[:, None])
    if masked:  # explicitly: a padding query's lse is no normaliser of its masked scores
        p_QxW = jnp.where(mask_QxW, p_QxW, 0)
    dp_QxW = plgpu.dot(queries.do_QxH, keys.v_WxH.T)
    return p_QxW, p_QxW * (dp_QxW - queries.delta_Q[:, None]) * scale


def _key_grads(carry, queries: _Queries, keys: _Keys, scale: float, masked: bool = True):
    """A query block's share of a key block's dK and dV (fp32), and the tile's dS."""
    dk_WxH, dv_WxH = carry
    p_QxW, ds_QxW = _score_grads(queries, keys, scale, masked)
    dv_WxH = dv_WxH + plgpu.dot(p_QxW.astype(queries.do_QxH.dtype).T, queries.do_QxH)
    dk_WxH = dk_WxH + plgpu.dot(ds_QxW.astype(queries.q_QxH.dtype).T, queries.q_QxH)
    return (dk_WxH, dv_WxH), ds_QxW


def _query_grads(dq_QxH: Array, queries: _Queries, keys: _Keys, scale: float,
                 masked: bool = True) -> Array:
    """A key block's share of a query block's dQ (fp32)."""
    _, ds_QxW = _score_grads(queries, keys, scale, masked)
    return dq_QxH + plgpu.dot(ds_QxW.astype(keys.k_WxH.dtype), keys.k_WxH)


def _three_ranges(body, start, lo, hi, end, carry):
    """`body(masked)` looped over [start, end): masked outside [lo, hi), which is clipped to
    it, and plain inside."""
    lo = jnp.clip(lo, start, end)
    hi = jnp.clip(hi, lo, end)
    carry = lax.fori_loop(start, lo, body(True), carry)
    carry = lax.fori_loop(lo, hi, body(False), carry)
    return lax.fori_loop(hi, end, body(True), carry)


def _forward_kernel(first_ref, q_ref, k_ref, v_ref, seg_ref, o_ref, lse_ref, *, block: int,
                    scale: float):
    i = pl.program_id(2)
    q_seg_Q = seg_ref[pl.ds(i * block, block)]
    queries = _Queries(q_ref[...], q_seg_Q, _columns(i, block))

    def body(j, carry):
        keys = pl.ds(j * block, block)
        return _fold(carry, queries, _Keys(k_ref[keys, :], v_ref[keys, :], seg_ref[keys],
                                           _columns(j, block)), scale)

    acc_QxH, m_Q, l_Q = lax.fori_loop(first_ref[i], i + 1, body, _empty(block, q_ref.shape[-1]))
    real_Q = q_seg_Q > 0
    # A padding query's row is all masks: its sums are junk, its output zero.
    o_ref[...] = jnp.where(real_Q[:, None], acc_QxH / l_Q[:, None], 0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(real_Q, m_Q + jnp.log2(l_Q), 0)


def _backward_kernel(first_ref, end_ref, q_ref, k_ref, v_ref, seg_ref, do_ref, lse_ref,
                     delta_ref, dq_ref, dk_ref, dv_ref, *, block: int, scale: float):
    j = pl.program_id(2)

    def query_block(i) -> _Queries:
        rows = pl.ds(i * block, block)
        return _Queries(q_ref[rows, :], seg_ref[rows], _columns(i, block), do_ref[rows, :],
                        lse_ref[rows], delta_ref[rows])

    def key_block(jj) -> _Keys:
        keys = pl.ds(jj * block, block)
        return _Keys(k_ref[keys, :], v_ref[keys, :], seg_ref[keys], _columns(jj, block))

    # dK, dV of key block j: the query blocks from the diagonal to the last one that sees it.
    keys = key_block(j)
    zeros = jnp.zeros((block, q_ref.shape[-1]), jnp.float32)
    dk_WxH, dv_WxH = lax.fori_loop(
        j, end_ref[j], lambda i, carry: _key_grads(carry, query_block(i), keys, scale)[0],
        (zeros, zeros))
    dk_ref[...] = dk_WxH.astype(dk_ref.dtype)
    dv_ref[...] = dv_WxH.astype(dv_ref.dtype)

    # dQ of query block j: the key blocks the forward pass read.
    queries = query_block(j)
    dq_ref[...] = lax.fori_loop(
        first_ref[j], j + 1, lambda jj, dq: _query_grads(dq, queries, key_block(jj), scale),
        zeros).astype(dq_ref.dtype)


def _key_block_kernel(end_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, seg_ref, do_ref, lse_ref,
                      delta_ref, *out_refs, rows: int, scale: float):
    """Key block j of one K/V head, for each of its G query heads the query blocks of `rows`
    from the diagonal to the last that sees it: dK and dV summed in registers over heads and
    blocks. Given dQ (`out_refs` dQ's zeros aliased in, dQ, dK, dV) each tile's dS·K is added
    into it (fp32, atomically: programs of other key blocks add to the same rows); given
    (dK, dV) dQ is `_query_block_kernel`'s."""
    dq_ref = out_refs[1] if len(out_refs) == 4 else None
    dk_ref, dv_ref = out_refs[-2:]
    j = pl.program_id(2)
    W, H = k_ref.shape
    keys = _Keys(k_ref[...], v_ref[...], seg_ref[pl.ds(j * W, W)], _columns(j, W))

    def head(g, carry):
        def tile(masked: bool):
            def body(i, carry):
                r = pl.ds(i * rows, rows)
                queries = _Queries(q_ref[r, g, :], seg_ref[r], _columns(i, rows),
                                   do_ref[r, g, :], lse_ref[g, r], delta_ref[g, r])
                carry, ds_QxW = _key_grads(carry, queries, keys, scale, masked)
                if dq_ref is not None:
                    plgpu.atomic_add(dq_ref, (r, g, slice(None)),
                                     plgpu.dot(ds_QxW.astype(keys.k_WxH.dtype), keys.k_WxH))
                return carry
            return body
        return _three_ranges(tile, j * W // rows, lo_ref[j], hi_ref[j], end_ref[j], carry)

    zeros = jnp.zeros((W, H), jnp.float32)
    dk_WxH, dv_WxH = lax.fori_loop(0, q_ref.shape[1], head, (zeros, zeros))
    dk_ref[...] = dk_WxH.astype(dk_ref.dtype)
    dv_ref[...] = dv_WxH.astype(dv_ref.dtype)


def _query_block_kernel(first_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, seg_ref, do_ref,
                        lse_ref, delta_ref, dq_ref, *, keys: int, scale: float):
    """dQ of one query head's query block i over the key blocks of `keys` the forward read."""
    i = pl.program_id(2)
    Q, H = q_ref.shape
    queries = _Queries(q_ref[...], seg_ref[pl.ds(i * Q, Q)], _columns(i, Q), do_ref[...],
                       lse_ref[...], delta_ref[...])

    def tile(masked: bool):
        def body(j, dq_QxH):
            cols = pl.ds(j * keys, keys)
            return _query_grads(dq_QxH, queries, _Keys(k_ref[cols, :], v_ref[cols, :],
                                                       seg_ref[cols], _columns(j, keys)),
                                scale, masked)
        return body

    diagonal = (i * Q + Q - 1) // keys + 1
    dq_ref[...] = _three_ranges(tile, first_ref[i], lo_ref[i], hi_ref[i], diagonal,
                                jnp.zeros((Q, H), jnp.float32)).astype(dq_ref.dtype)


def _ring_forward_kernel(count_ref, listed_ref, q_ref, k_ref, v_ref, q_seg_ref, q_pos_ref,
                         k_seg_ref, k_pos_ref, o_ref, lse_ref, *, block: int, scale: float):
    i = pl.program_id(2)
    rows = pl.ds(i * block, block)
    queries = _Queries(q_ref[...], q_seg_ref[rows], q_pos_ref[rows])

    def body(n, carry):
        keys = pl.ds(listed_ref[i, n] * block, block)
        return _fold(carry, queries, _Keys(k_ref[keys, :], v_ref[keys, :], k_seg_ref[keys],
                                           k_pos_ref[keys]), scale)

    acc_QxH, m_Q, l_Q = lax.fori_loop(0, count_ref[i], body, _empty(block, q_ref.shape[-1]))
    seen_Q = m_Q > _MASKED  # padding, or no key of this chunk in the query's document
    o_ref[...] = jnp.where(seen_Q[:, None], acc_QxH / jnp.where(seen_Q, l_Q, 1)[:, None], 0)
    lse_ref[...] = jnp.where(seen_Q, (m_Q + jnp.log2(l_Q)) / _LOG2E, -jnp.inf)


def _ring_backward_kernel(k_count_ref, k_listed_ref, q_count_ref, q_listed_ref, q_ref, k_ref,
                          v_ref, q_seg_ref, q_pos_ref, k_seg_ref, k_pos_ref, do_ref, lse_ref,
                          delta_ref, dq_ref, dk_ref, dv_ref, *, block: int, scale: float):
    j = pl.program_id(2)

    def query_block(i) -> _Queries:
        rows = pl.ds(i * block, block)
        return _Queries(q_ref[rows, :], q_seg_ref[rows], q_pos_ref[rows], do_ref[rows, :],
                        lse_ref[rows], delta_ref[rows])

    def key_block(jj) -> _Keys:
        keys = pl.ds(jj * block, block)
        return _Keys(k_ref[keys, :], v_ref[keys, :], k_seg_ref[keys], k_pos_ref[keys])

    # dK, dV of key block j: the query blocks that see it.
    keys = key_block(j)
    zeros = jnp.zeros((block, q_ref.shape[-1]), jnp.float32)
    dk_WxH, dv_WxH = lax.fori_loop(
        0, q_count_ref[j],
        lambda n, carry: _key_grads(carry, query_block(q_listed_ref[j, n]), keys, scale)[0],
        (zeros, zeros))
    dk_ref[...] = dk_WxH
    dv_ref[...] = dv_WxH

    # dQ of query block j: the key blocks it sees.
    queries = query_block(j)
    dq_ref[...] = lax.fori_loop(
        0, k_count_ref[j],
        lambda n, dq: _query_grads(dq, queries, key_block(k_listed_ref[j, n]), scale), zeros)


def _ring_key_block_kernel(count_ref, listed_ref, q_ref, k_ref, v_ref, q_seg_ref, q_pos_ref,
                           k_seg_ref, k_pos_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                           rows: int, scale: float):
    """The ring step's FA2-split backward, key block j of one K/V head: for each of its G query
    heads the listed query blocks of `rows` that see it, dK and dV summed in registers."""
    j = pl.program_id(2)
    W, H = k_ref.shape
    cols = pl.ds(j * W, W)
    keys = _Keys(k_ref[...], v_ref[...], k_seg_ref[cols], k_pos_ref[cols])

    def head(g, carry):
        def body(n, carry):
            r = pl.ds(listed_ref[j, n] * rows, rows)
            queries = _Queries(q_ref[r, g, :], q_seg_ref[r], q_pos_ref[r], do_ref[r, g, :],
                               lse_ref[g, r], delta_ref[g, r])
            return _key_grads(carry, queries, keys, scale)[0]
        return lax.fori_loop(0, count_ref[j], body, carry)

    zeros = jnp.zeros((W, H), jnp.float32)
    dk_ref[...], dv_ref[...] = lax.fori_loop(0, q_ref.shape[1], head, (zeros, zeros))


def _ring_query_block_kernel(count_ref, listed_ref, q_ref, k_ref, v_ref, q_seg_ref, q_pos_ref,
                             k_seg_ref, k_pos_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
                             keys: int, scale: float):
    """The ring step's FA2-split backward, dQ of one query head's query block i over the
    listed key blocks of `keys` it sees."""
    i = pl.program_id(2)
    Q = q_ref.shape[0]
    rows = pl.ds(i * Q, Q)
    queries = _Queries(q_ref[...], q_seg_ref[rows], q_pos_ref[rows], do_ref[...], lse_ref[...],
                       delta_ref[...])

    def body(n, dq_QxH):
        cols = pl.ds(listed_ref[i, n] * keys, keys)
        return _query_grads(dq_QxH, queries, _Keys(k_ref[cols, :], v_ref[cols, :],
                                                   k_seg_ref[cols], k_pos_ref[cols]), scale)

    dq_ref[...] = lax.fori_loop(0, count_ref[i], body, jnp.zeros(q_ref.shape, jnp.float32))


def _specs(B: int, T: int, N: int, G: int, H: int, block: int):
    """BlockSpecs on the grid (row b, query head n, block i): n's block i of [B, T, N, H], the
    whole row of K/V head n // G, and whole rows of [B, T/block], [B, T/block, T/block],
    [B, T] and [B, N, T]."""
    blocks = T // block
    return dict(
        bounds=pl.BlockSpec((None, blocks), lambda b, n, i: (b, 0)),
        table=pl.BlockSpec((None, blocks, blocks), lambda b, n, i: (b, 0, 0)),
        q_block=pl.BlockSpec((None, block, None, H), lambda b, n, i: (b, i, n, 0)),
        q_row=pl.BlockSpec((None, T, None, H), lambda b, n, i: (b, 0, n, 0)),
        kv_row=pl.BlockSpec((None, T, None, H), lambda b, n, i: (b, 0, n // G, 0)),
        tokens=pl.BlockSpec((None, T), lambda b, n, i: (b, 0)),
        head_block=pl.BlockSpec((None, None, block), lambda b, n, i: (b, n, i)),
        head_row=pl.BlockSpec((None, None, T), lambda b, n, i: (b, n, 0)),
    )


def _check(q_BxTxNxH: Array, k_BxSxKxH: Array, block: int) -> None:
    (_, T, N, H), (_, S, K, _) = q_BxTxNxH.shape, k_BxSxKxH.shape
    if T % block or block & (block - 1) or H & (H - 1) or N % K or S != T:
        raise ValueError(f"packed attention needs a power-of-two block ({block}) dividing the "
                         f"row ({T}), as many keys as queries ({S}), a power-of-two head dim "
                         f"({H}) and N ({N}) a multiple of K ({K})")


def _warps(block: int) -> int:
    return 4 if block <= 64 else 8


class Tiles(NamedTuple):
    """The FA2 backwards' tiling: `query` rows per step of a program's loop over query blocks,
    `key` rows of the key block a program owns, Triton's warps and pipeline stages."""

    query: int
    key: int
    warps: int
    stages: int


# The FA2 backwards' tiles by (bytes per input element, head dim): (2, 128) measured, the best
# of seven on an H100 (the module's docstring), the others chosen by reasoning (`scripts/
# bench_gpu.py kernels --fa2-tiles` times them). Each compiles for an H100 within its shared
# memory (compiled on the CPU; the fp32 H=256 backward beside a forward of `block=32`, as
# `block_for`'s 64 does not fit there).
BACKWARD_TILES = {
    # 64 queries by 64 keys, 4 warps, 2 stages: measured fastest at H=128 (1.6-1.8x the
    # two-loop kernel); at FlashAttention-2's 64 x 128 and 8 warps it ran 1.7-1.9x slower.
    (2, 128): Tiles(64, 64, 4, 2),
    # Half the width: 4 warps hold dK and dV in as many registers; a stage more hides loads.
    (2, 64): Tiles(64, 128, 4, 3),
    # Twice the width: dK and dV at 64 keys keep 128 registers at 8 warps; K and V (64 KiB)
    # leave shared memory for one stage of Q and dO.
    (2, 256): Tiles(64, 64, 8, 1),
    # fp32 doubles every tile's bytes: the two-loop kernel's 128 tiles overflowed shared memory
    # at H=64 (`block_for`), so half each edge.
    (4, 64): Tiles(32, 64, 4, 2),
    (4, 128): Tiles(32, 64, 8, 2),
    (4, 256): Tiles(32, 32, 8, 1),
}
BACKWARDS = ("two-loop", "fa2", "fa2-split")
# (bytes per input element, head dim) where "fa2-split" was measured faster than the two-loop
# backward on a GPU (the module's docstring); elsewhere the two-loop one until measured.
FA2_MEASURED_FASTER = frozenset({(2, 128)})


def default_backward(dtype, head_dim: int) -> str:
    """The backward `packed_attention` runs unless told: "fa2-split" where measured faster."""
    width = 2 if jnp.dtype(dtype).itemsize <= 2 else 4
    return "fa2-split" if (width, head_dim) in FA2_MEASURED_FASTER else "two-loop"


def backward_tiles(dtype, head_dim: int, seq_len: int) -> Tiles:
    """`BACKWARD_TILES`' entry for the narrowest listed head dim at least `head_dim` (the
    widest past them), its edges halved until they divide the row."""
    width = 2 if jnp.dtype(dtype).itemsize <= 2 else 4
    listed = sorted(h for w, h in BACKWARD_TILES if w == width)
    tiles = BACKWARD_TILES[(width, next((h for h in listed if h >= head_dim), listed[-1]))]
    query, key = tiles.query, tiles.key
    while seq_len % query:
        query //= 2
    while seq_len % key:
        key //= 2
    return tiles._replace(query=query, key=key)


def packed_attention(q_BxTxNxH: Array, k_BxTxKxH: Array, v_BxTxKxH: Array,
                     segment_ids_BxT: Array, *, block: int = 0, backward: str | None = None,
                     tiles: Tiles | None = None, interpret: bool = False) -> Array:
    """Attention under the document-causal mask of packed rows, [B, T, N, H] in q's dtype.
    `block`: the forward's tile edge, and the two-loop backward's (0: `block_for`);
    `backward`: one of `BACKWARDS` (None: `default_backward`), the FA2 ones under `tiles`
    (None: `backward_tiles`); `interpret` runs the kernels in Pallas' interpreter (any
    platform)."""
    _, T, _, H = q_BxTxNxH.shape
    backward = backward or default_backward(q_BxTxNxH.dtype, H)
    if backward not in BACKWARDS:
        raise ValueError(f"packed attention's backward is one of {BACKWARDS}, not {backward!r}")
    block = block or block_for(q_BxTxNxH.dtype, H, T)
    if backward != "two-loop":
        tiles = tiles or backward_tiles(q_BxTxNxH.dtype, H, T)
    return _attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, block, backward,
                      tiles, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention(q_BxTxNxH: Array, k_BxTxKxH: Array, v_BxTxKxH: Array, segment_ids_BxT: Array,
               block: int, backward: str, tiles: Tiles | None, interpret: bool) -> Array:
    return _forward(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, block, backward, tiles,
                    interpret)[0]


def _forward(q_BxTxNxH: Array, k_BxTxKxH: Array, v_BxTxKxH: Array, segment_ids_BxT: Array,
             block: int, backward: str, tiles: Tiles | None, interpret: bool):
    del backward, tiles  # the backward's
    _check(q_BxTxNxH, k_BxTxKxH, block)
    (B, T, N, H), K = q_BxTxNxH.shape, k_BxTxKxH.shape[2]
    segment_ids_BxT = segment_ids_BxT.astype(jnp.int32)
    first_BxI, end_BxJ = block_bounds(segment_ids_BxT, block)
    spec = _specs(B, T, N, N // K, H, block)
    out_BxTxNxH, lse_BxNxT = pl.pallas_call(
        functools.partial(_forward_kernel, block=block, scale=H ** -0.5),
        grid=(B, N, T // block),
        in_specs=[spec["bounds"], spec["q_block"], spec["kv_row"], spec["kv_row"],
                  spec["tokens"]],
        out_specs=[spec["q_block"], spec["head_block"]],
        out_shape=[jax.ShapeDtypeStruct(q_BxTxNxH.shape, q_BxTxNxH.dtype),
                   jax.ShapeDtypeStruct((B, N, T), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=_warps(block), num_stages=2),
        interpret=interpret, name="packed_attention_forward",
    )(first_BxI, q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT)
    residuals = (q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, first_BxI, end_BxJ,
                 out_BxTxNxH, lse_BxNxT)
    return out_BxTxNxH, residuals


def _backward(block: int, backward: str, tiles: Tiles | None, interpret: bool, residuals,
              dout_BxTxNxH: Array):
    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, first_BxI, end_BxJ, out_BxTxNxH, \
        lse_BxNxT = residuals
    dout_BxTxNxH = dout_BxTxNxH.astype(q_BxTxNxH.dtype)
    delta_BxNxT = jnp.einsum("btnh,btnh->bnt", out_BxTxNxH.astype(jnp.float32),
                             dout_BxTxNxH.astype(jnp.float32))
    if backward != "two-loop":
        return _fa2_backward(backward == "fa2", tiles, interpret, q_BxTxNxH, k_BxTxKxH,
                             v_BxTxKxH, segment_ids_BxT, dout_BxTxNxH, lse_BxNxT, delta_BxNxT)
    (B, T, N, H), K = q_BxTxNxH.shape, k_BxTxKxH.shape[2]
    G = N // K
    spec = _specs(B, T, N, G, H, block)
    # Per query head; summed over each K/V head's G query heads below, in fp32 when G > 1.
    kv_dtype = k_BxTxKxH.dtype if G == 1 else jnp.float32
    dq_BxTxNxH, dk_BxTxNxH, dv_BxTxNxH = pl.pallas_call(
        functools.partial(_backward_kernel, block=block, scale=H ** -0.5),
        grid=(B, N, T // block),
        in_specs=[spec["bounds"], spec["bounds"], spec["q_row"], spec["kv_row"],
                  spec["kv_row"], spec["tokens"], spec["q_row"], spec["head_row"],
                  spec["head_row"]],
        out_specs=[spec["q_block"]] * 3,
        out_shape=[jax.ShapeDtypeStruct(q_BxTxNxH.shape, q_BxTxNxH.dtype),
                   jax.ShapeDtypeStruct((B, T, N, H), kv_dtype),
                   jax.ShapeDtypeStruct((B, T, N, H), kv_dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=_warps(block), num_stages=2),
        interpret=interpret, name="packed_attention_backward",
    )(first_BxI, end_BxJ, q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, dout_BxTxNxH,
      lse_BxNxT, delta_BxNxT)
    if G > 1:
        dk_BxTxNxH, dv_BxTxNxH = (x.reshape(B, T, K, G, H).sum(axis=3).astype(k_BxTxKxH.dtype)
                                  for x in (dk_BxTxNxH, dv_BxTxNxH))
    return dq_BxTxNxH, dk_BxTxNxH, dv_BxTxNxH.astype(v_BxTxKxH.dtype), None


def _fa2_backward(atomic: bool, tiles: Tiles, interpret: bool, q_BxTxNxH: Array,
                  k_BxTxKxH: Array, v_BxTxKxH: Array, segment_ids_BxT: Array,
                  dout_BxTxNxH: Array, lse_BxNxT: Array, delta_BxNxT: Array):
    """dK and dV by one program per (row, K/V head, key block of `tiles.key`) over the query
    blocks of `tiles.query` that see it, for all G query heads of that K/V head; dQ added
    there (`atomic`) or by one program per (row, query head, query block)."""
    for block in tiles[:2]:
        _check(q_BxTxNxH, k_BxTxKxH, block)
    first_BxI, end_BxJ = block_bounds(segment_ids_BxT, *tiles[:2])
    lo_BxI, hi_BxI, lo_BxJ, hi_BxJ = interior_blocks(segment_ids_BxT, *tiles[:2])
    inputs = (q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, dout_BxTxNxH, lse_BxNxT,
              delta_BxNxT)
    grads = _key_blocks(atomic, tiles, interpret, (end_BxJ, lo_BxJ, hi_BxJ), inputs)
    if not atomic:
        grads = (_query_blocks(tiles, interpret, (first_BxI, lo_BxI, hi_BxI), inputs), *grads)
    dq_BxTxNxH, dk_BxTxKxH, dv_BxTxKxH = grads
    return dq_BxTxNxH.astype(q_BxTxNxH.dtype), dk_BxTxKxH, dv_BxTxKxH, None


def _key_block_specs(T: int, G: int, H: int, W: int):
    """BlockSpecs on the grid (row b, K/V head h, key block j) of the FA2 backwards: the whole
    row of h's G query heads in [B, T, N, H], key block j of [B, T, K, H], whole rows of
    [B, T], and of h's G query heads in [B, N, T]."""
    return (pl.BlockSpec((None, T, G, H), lambda b, h, j: (b, 0, h, 0)),
            pl.BlockSpec((None, W, None, H), lambda b, h, j: (b, j, h, 0)),
            pl.BlockSpec((None, T), lambda b, h, j: (b, 0)),
            pl.BlockSpec((None, G, T), lambda b, h, j: (b, h, 0)))


def _key_blocks(atomic: bool, tiles: Tiles, interpret: bool, bounds_J, inputs):
    """`_key_block_kernel` on the grid (row, K/V head, key block): (fp32 dQ,) dK, dV."""
    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = inputs[:3]
    (B, T, N, H), K = q_BxTxNxH.shape, k_BxTxKxH.shape[2]
    G, Q, W = N // K, tiles.query, tiles.key
    bounds = pl.BlockSpec((None, T // W), lambda b, h, j: (b, 0))
    group_row, key_block, tokens, group_tokens = _key_block_specs(T, G, H, W)
    dq_shape = jax.ShapeDtypeStruct(q_BxTxNxH.shape, jnp.float32)
    return pl.pallas_call(
        functools.partial(_key_block_kernel, rows=Q, scale=H ** -0.5),
        grid=(B, K, T // W),
        in_specs=[bounds] * 3 + [group_row, key_block, key_block, tokens, group_row]
        + [group_tokens] * 2 + [group_row] * atomic,
        out_specs=[group_row] * atomic + [key_block] * 2,
        out_shape=[dq_shape] * atomic + [jax.ShapeDtypeStruct(x.shape, x.dtype)
                                         for x in (k_BxTxKxH, v_BxTxKxH)],
        input_output_aliases={10: 0} if atomic else {},
        compiler_params=plgpu.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages),
        interpret=interpret, name="packed_attention_backward_fa2",
    )(*bounds_J, *inputs, *[jnp.zeros(dq_shape.shape, jnp.float32)] * atomic)


def _query_blocks(tiles: Tiles, interpret: bool, bounds_I, inputs) -> Array:
    """`_query_block_kernel` on the grid (row, query head, query block): dQ in q's dtype."""
    q_BxTxNxH, k_BxTxKxH = inputs[:2]
    (B, T, N, H), K = q_BxTxNxH.shape, k_BxTxKxH.shape[2]
    spec = _specs(B, T, N, N // K, H, tiles.query)
    return pl.pallas_call(
        functools.partial(_query_block_kernel, keys=tiles.key, scale=H ** -0.5),
        grid=(B, N, T // tiles.query),
        in_specs=[spec["bounds"]] * 3 + [spec["q_block"], spec["kv_row"], spec["kv_row"],
                                         spec["tokens"], spec["q_block"]]
        + [spec["head_block"]] * 2,
        out_specs=spec["q_block"],
        out_shape=jax.ShapeDtypeStruct(q_BxTxNxH.shape, q_BxTxNxH.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages),
        interpret=interpret, name="packed_attention_backward_fa2_dq",
    )(*bounds_I, *inputs)


_attention.defvjp(_forward, _backward)


def _listed(visible_BxIxJ: Array) -> tuple[Array, Array]:
    """([B, I], [B, I, J]) int32: how many key blocks each query block sees, and which (those
    first, in order)."""
    count_BxI = visible_BxIxJ.sum(axis=-1, dtype=jnp.int32)
    listed_BxIxJ = jnp.argsort(jnp.logical_not(visible_BxIxJ).astype(jnp.int32), axis=-1,
                               stable=True)
    return count_BxI, listed_BxIxJ.astype(jnp.int32)


def ring_step(q_BxTxNxH: Array, k_BxSxKxH: Array, v_BxSxKxH: Array,
              q_tokens: tuple[Array, Array], k_tokens: tuple[Array, Array],
              visible_BxIxJ: Array, *, block: int, interpret: bool = False
              ) -> tuple[Array, Array]:
    """One step of a context-parallel ring: a rank's queries against the K/V chunk it holds
    (S = T). Tokens are (segment ids, positions within documents), [B, T] and [B, S];
    `visible_BxIxJ` says which (query block, key block) pairs may see something (at least
    those: `hotjax.models.attention.visible_blocks`). Returns the output over this chunk's keys,
    fp32 [B, T, N, H], and its natural log-sum-exp, fp32 [B, N, T]; a query that sees none of
    them gets 0 and -inf."""
    _check(q_BxTxNxH, k_BxSxKxH, block)
    (B, T, N, H), K = q_BxTxNxH.shape, k_BxSxKxH.shape[2]
    spec = _specs(B, T, N, N // K, H, block)
    return pl.pallas_call(
        functools.partial(_ring_forward_kernel, block=block, scale=H ** -0.5),
        grid=(B, N, T // block),
        in_specs=[spec["bounds"], spec["table"], spec["q_block"], spec["kv_row"],
                  spec["kv_row"]] + [spec["tokens"]] * 4,
        out_specs=[spec["q_block"], spec["head_block"]],
        out_shape=[jax.ShapeDtypeStruct(q_BxTxNxH.shape, jnp.float32),
                   jax.ShapeDtypeStruct((B, N, T), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=_warps(block), num_stages=2),
        interpret=interpret, name="ring_attention_forward",
    )(*_listed(visible_BxIxJ), q_BxTxNxH, k_BxSxKxH, v_BxSxKxH,
      *_int32(q_tokens), *_int32(k_tokens))


def ring_step_backward(q_BxTxNxH: Array, k_BxSxKxH: Array, v_BxSxKxH: Array,
                       q_tokens: tuple[Array, Array], k_tokens: tuple[Array, Array],
                       visible_BxIxJ: Array, lse_BxNxT: Array, delta_BxNxT: Array,
                       dout_BxTxNxH: Array, *, block: int, backward: str = "two-loop",
                       tiles: Tiles | None = None, interpret: bool = False
                       ) -> tuple[Array, Array, Array]:
    """The backward of `ring_step` given the ring's final natural log-sum-exp and delta
    (rowsum(dO * O) of its final output), [B, N, T]: this chunk's share of dQ, and its dK and
    dV, all fp32. `backward`: "two-loop" (one kernel on `block`'s tiles, dK/dV per query head
    summed outside it) or "fa2-split" (`_ring_key_blocks` and `_ring_query_blocks` on `tiles`,
    None: `backward_tiles`, each edge at most `block`)."""
    _check(q_BxTxNxH, k_BxSxKxH, block)
    (B, T, N, H), K = q_BxTxNxH.shape, k_BxSxKxH.shape[2]
    # Base 2 in the kernel; a query that sees nothing has every probability masked.
    lse_BxNxT = jnp.where(jnp.isfinite(lse_BxNxT), lse_BxNxT * _LOG2E, 0)
    inputs = (q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, *_int32(q_tokens), *_int32(k_tokens),
              dout_BxTxNxH.astype(q_BxTxNxH.dtype), lse_BxNxT, delta_BxNxT)
    if backward == "fa2-split":
        tiles = tiles or backward_tiles(q_BxTxNxH.dtype, H, T)
        tiles = tiles._replace(query=min(tiles.query, block), key=min(tiles.key, block))
        # The table refined to the tiles: a block pair that may see something, all its tiles.
        visible_BxIxJ = jnp.repeat(jnp.repeat(visible_BxIxJ, block // tiles.query, axis=1),
                                   block // tiles.key, axis=2)
        dk_BxSxKxH, dv_BxSxKxH = _ring_key_blocks(tiles, interpret, visible_BxIxJ, inputs)
        dq_BxTxNxH = _ring_query_blocks(tiles, interpret, visible_BxIxJ, inputs)
        return dq_BxTxNxH, dk_BxSxKxH, dv_BxSxKxH
    if backward != "two-loop":
        raise ValueError(f"the ring step's backward is two-loop or fa2-split, not {backward!r}")
    spec = _specs(B, T, N, N // K, H, block)
    dq_BxTxNxH, dk_BxSxNxH, dv_BxSxNxH = pl.pallas_call(
        functools.partial(_ring_backward_kernel, block=block, scale=H ** -0.5),
        grid=(B, N, T // block),
        in_specs=[spec["bounds"], spec["table"]] * 2
        + [spec["q_row"], spec["kv_row"], spec["kv_row"]] + [spec["tokens"]] * 4
        + [spec["q_row"], spec["head_row"], spec["head_row"]],
        out_specs=[spec["q_block"]] * 3,
        out_shape=[jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)] * 3,
        compiler_params=plgpu.CompilerParams(num_warps=_warps(block), num_stages=2),
        interpret=interpret, name="ring_attention_backward",
    )(*_listed(visible_BxIxJ), *_listed(visible_BxIxJ.transpose(0, 2, 1)), *inputs)
    # Per query head: each K/V head's G query heads summed.
    dk_BxSxKxH, dv_BxSxKxH = (x.reshape(B, T, K, N // K, H).sum(axis=3)
                              for x in (dk_BxSxNxH, dv_BxSxNxH))
    return dq_BxTxNxH, dk_BxSxKxH, dv_BxSxKxH


def _ring_key_blocks(tiles: Tiles, interpret: bool, visible_BxIxJ: Array, inputs
                     ) -> tuple[Array, Array]:
    """`_ring_key_block_kernel` on the grid (row, K/V head, key block): fp32 dK, dV."""
    q_BxTxNxH, k_BxSxKxH = inputs[:2]
    (B, T, N, H), K = q_BxTxNxH.shape, k_BxSxKxH.shape[2]
    G, I, J = N // K, T // tiles.query, T // tiles.key
    group_row, key_block, tokens, group_tokens = _key_block_specs(T, G, H, tiles.key)
    return pl.pallas_call(
        functools.partial(_ring_key_block_kernel, rows=tiles.query, scale=H ** -0.5),
        grid=(B, K, J),
        in_specs=[pl.BlockSpec((None, J), lambda b, h, j: (b, 0)),
                  pl.BlockSpec((None, J, I), lambda b, h, j: (b, 0, 0)),
                  group_row, key_block, key_block] + [tokens] * 4
        + [group_row, group_tokens, group_tokens],
        out_specs=[key_block] * 2,
        out_shape=[jax.ShapeDtypeStruct(k_BxSxKxH.shape, jnp.float32)] * 2,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages),
        interpret=interpret, name="ring_attention_backward_fa2",
    )(*_listed(visible_BxIxJ.transpose(0, 2, 1)), *inputs)


def _ring_query_blocks(tiles: Tiles, interpret: bool, visible_BxIxJ: Array, inputs) -> Array:
    """`_ring_query_block_kernel` on the grid (row, query head, query block): fp32 dQ."""
    q_BxTxNxH, k_BxSxKxH = inputs[:2]
    (B, T, N, H), K = q_BxTxNxH.shape, k_BxSxKxH.shape[2]
    I, J = T // tiles.query, T // tiles.key
    spec = _specs(B, T, N, N // K, H, tiles.query)
    return pl.pallas_call(
        functools.partial(_ring_query_block_kernel, keys=tiles.key, scale=H ** -0.5),
        grid=(B, N, I),
        in_specs=[pl.BlockSpec((None, I), lambda b, n, i: (b, 0)),
                  pl.BlockSpec((None, I, J), lambda b, n, i: (b, 0, 0)),
                  spec["q_block"], spec["kv_row"], spec["kv_row"]] + [spec["tokens"]] * 4
        + [spec["q_block"], spec["head_block"], spec["head_block"]],
        out_specs=spec["q_block"],
        out_shape=jax.ShapeDtypeStruct(q_BxTxNxH.shape, jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages),
        interpret=interpret, name="ring_attention_backward_fa2_dq",
    )(*_listed(visible_BxIxJ), *inputs)


def _int32(tokens: tuple[Array, Array]) -> tuple[Array, ...]:
    return tuple(x.astype(jnp.int32) for x in tokens)
