"""The packed-attention Pallas GPU kernel: equal to dense attention (values and gradients, run by
Pallas' interpreter on CPU) under each of its backwards, computing only the blocks documents span
and masking only the tiles that need it, and compiling for an H100; the same of the ring step's
kernel over one K/V chunk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hotjax import targets
from hotjax.models.attention import Tokens, dense_attention, visible_blocks
from hotjax.models.packed_attention import (
    BACKWARDS,
    Tiles,
    backward_tiles,
    block_bounds,
    block_for,
    computed_blocks,
    default_backward,
    interior_blocks,
    packed_attention,
    ring_step,
    ring_step_backward,
)
from hotjax.planning.cost import document_pairs

TOLERANCE = 1e-5  # fp32: only the order of the softmax sums differs
# bf16, of the largest reference value: bf16's rounding of the output and gradients (measured:
# 0.4 % in the interpreter, the two-loop kernel's error alike).
BF16_TOLERANCE = 1e-2


def rows_of(seq_len: int, *rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids and positions of rows holding documents of these lengths end to end from
    column 0, padding after."""
    segment_ids_BxT = np.zeros((len(rows), seq_len), np.int32)
    positions_BxT = np.zeros((len(rows), seq_len), np.int32)
    for r, lengths in enumerate(rows):
        start = 0
        for d, length in enumerate(lengths):
            segment_ids_BxT[r, start:start + length] = d + 1
            positions_BxT[r, start:start + length] = np.arange(length)
            start += length
    return segment_ids_BxT, positions_BxT


def test_values_and_gradients_equal_dense_attention_when_interpreted():
    """Documents crossing blocks of 64, one starting mid-block after a short one, padding at
    the end (a whole block of it in the last row), a row of one document; GQA (N=4, K=2)."""
    segment_ids_BxT, positions_BxT = rows_of(256, [30, 70, 100, 40], [256], [5, 64, 64, 20, 3])
    B, T, N, K, H = 3, 256, 4, 2, 16
    keys = jax.random.split(jax.random.key(0), 4)
    q, dout = (jax.random.normal(key, (B, T, N, H)) for key in keys[:2])
    k, v = (jax.random.normal(key, (B, T, K, H)) for key in keys[2:])
    segment_ids = jnp.asarray(segment_ids_BxT)

    got, got_vjp = jax.vjp(lambda q, k, v: packed_attention(q, k, v, segment_ids, block=64,
                                                            interpret=True), q, k, v)
    want, want_vjp = jax.vjp(lambda q, k, v: dense_attention(
        q, k, v, segment_ids, jnp.asarray(positions_BxT)), q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOLERANCE, rtol=TOLERANCE)
    assert not np.asarray(got)[2, 156:].any()  # padding's output is zero
    for got_grad, want_grad in zip(got_vjp(dout), want_vjp(dout), strict=True):
        np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad), atol=TOLERANCE,
                                   rtol=TOLERANCE)


@pytest.mark.parametrize(("dtype", "K"), [(jnp.float32, 4), (jnp.float32, 1),
                                          (jnp.bfloat16, 1)])
def test_the_fa2_backwards_equal_dense_attention_when_interpreted(dtype, K):
    """Both FA2 backwards at query tiles of 16 and key tiles of 32: a document starting
    mid-tile and spanning whole tiles (both interior tile kinds: a query tile seeing a key tile
    whole, and the reverse), one of 3 tokens, padding to the end (a whole key tile of it); one
    K/V head per query head, and one for all 4 (GQA, its dK/dV summed in the program)."""
    segment_ids_BxT, positions_BxT = rows_of(128, [7, 84, 3])
    lo_I, hi_I, lo_J, hi_J = interior_blocks(segment_ids_BxT, 16, 32)
    assert (hi_I > lo_I).any() and (hi_J > lo_J).any()
    B, T, N, H = 1, 128, 4, 16
    keys = jax.random.split(jax.random.key(2), 4)
    q, dout = (jax.random.normal(key, (B, T, N, H)).astype(dtype) for key in keys[:2])
    k, v = (jax.random.normal(key, (B, T, K, H)).astype(dtype) for key in keys[2:])
    segment_ids, positions = jnp.asarray(segment_ids_BxT), jnp.asarray(positions_BxT)
    fp32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
    want, want_vjp = jax.vjp(lambda q, k, v: dense_attention(q, k, v, segment_ids, positions),
                             *fp32[:3])
    wants = [want, *want_vjp(fp32[3])]
    for backward in ("fa2", "fa2-split"):
        got, got_vjp = jax.vjp(lambda q, k, v, backward=backward: packed_attention(
            q, k, v, segment_ids, block=32, backward=backward, tiles=Tiles(16, 32, 4, 2),
            interpret=True), q, k, v)
        for got_x, want_x in zip([got, *got_vjp(dout)], wants, strict=True):
            assert got_x.dtype == dtype
            want_x = np.asarray(want_x)
            tolerance = (TOLERANCE if dtype == jnp.float32
                         else BF16_TOLERANCE * np.abs(want_x).max())
            np.testing.assert_allclose(np.asarray(got_x, np.float32), want_x, atol=tolerance,
                                       rtol=TOLERANCE)
        assert not np.asarray(got, np.float32)[0, 94:].any()  # padding's output is zero


def test_interior_tiles_are_exactly_those_the_mask_fills():
    """Per key tile the query tiles that see it whole, and per query tile the key tiles it
    sees whole, are those where the document-causal mask is all true; the key tiles' bounds
    in query tiles hold every query tile that sees anything of them, and end at one that
    does. Tiles of 16 queries and 32 keys; padding mid-row and at the end."""
    segment_ids_BxT, _ = rows_of(256, [7, 84, 3, 100], [200])
    segment_ids_BxT[0, 94:110] = 0  # padding between documents
    seg = segment_ids_BxT
    columns = np.arange(256)
    mask_BxTxS = ((seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
                  & (columns[None, None, :] <= columns[None, :, None]))
    tiles_BxIxJ = mask_BxTxS.reshape(2, 16, 16, 8, 32)
    whole_BxIxJ, some_BxIxJ = tiles_BxIxJ.all(axis=(2, 4)), tiles_BxIxJ.any(axis=(2, 4))
    lo_I, hi_I, lo_J, hi_J = interior_blocks(segment_ids_BxT, 16, 32)
    _, end_J = block_bounds(segment_ids_BxT, 16, 32)
    own_I, own_J = np.arange(16), np.arange(8)
    for b in range(2):
        np.testing.assert_array_equal(
            whole_BxIxJ[b], (own_J >= lo_I[b][:, None]) & (own_J < hi_I[b][:, None]))
        np.testing.assert_array_equal(
            whole_BxIxJ[b].T, (own_I >= lo_J[b][:, None]) & (own_I < hi_J[b][:, None]))
        start_J = own_J * 32 // 16
        assert not (some_BxIxJ[b].T & ((own_I < start_J[:, None])
                                       | (own_I >= end_J[b][:, None]))).any()
        seen_J = some_BxIxJ[b].any(axis=0)
        assert some_BxIxJ[b, end_J[b][seen_J] - 1, own_J[seen_J]].all()
        np.testing.assert_array_equal(end_J[b][~seen_J], start_J[~seen_J])


def test_the_backward_tiles_come_from_the_table_and_divide_the_row():
    assert backward_tiles(jnp.bfloat16, 128, 8192) == Tiles(64, 64, 4, 2)  # measured fastest
    assert backward_tiles(jnp.bfloat16, 32, 8192) == backward_tiles(jnp.bfloat16, 64, 8192)
    assert backward_tiles(jnp.float32, 512, 8192) == backward_tiles(jnp.float32, 256, 8192)
    assert backward_tiles(jnp.bfloat16, 128, 96)[:2] == (32, 32)
    with pytest.raises(ValueError, match="backward is one of"):
        packed_attention(*[jnp.zeros((1, 64, 1, 16))] * 3, jnp.ones((1, 64), jnp.int32),
                         backward="fa3")


def test_each_block_reaches_back_to_its_first_document_and_forward_to_its_last():
    segment_ids_BxT, _ = rows_of(256, [5, 64, 64, 20, 3])  # 156 tokens: the last block padding
    first_BxI, end_BxJ = block_bounds(segment_ids_BxT, 64)
    # Query block 2 (columns 128-191) starts inside document 3 (columns 69-132), in block 1;
    # key block 1 holds the start of that document, seen up to block 2; block 3 sees nothing.
    np.testing.assert_array_equal(first_BxI, [[0, 0, 1, 4]])
    np.testing.assert_array_equal(end_BxJ, [[2, 3, 3, 3]])
    np.testing.assert_array_equal(computed_blocks(segment_ids_BxT, 64), [5])
    np.testing.assert_array_equal(computed_blocks(jnp.asarray(segment_ids_BxT), 64), [5])


def test_a_row_of_short_documents_computes_a_sliver_of_the_causal_triangle():
    """32K rows, blocks of 128 (256 per row, 32,896 in the triangle): documents of 512 tokens
    span 4 blocks (10 pairs each), of 2K tokens 16 (136 each). The cost model counts the same."""
    lengths = ([512] * 64, [2048] * 16, [32768])
    segment_ids_BxT, _ = rows_of(32768, *lengths)
    counts = computed_blocks(segment_ids_BxT, 128)
    np.testing.assert_array_equal(counts, [64 * 10, 16 * 136, 256 * 257 // 2])
    pairs = document_pairs(lengths, 32768, 1, False, 128)[:, 0]
    np.testing.assert_array_equal(pairs, counts * 128 * 128)


def test_the_bounds_are_a_parallel_scan_not_a_loop_over_the_row():
    """On a GPU `jnp.maximum.accumulate` is a loop of T steps: on an H200 it made a 8K row's
    forward and backward take 384 ms for 160 blocks (1.7 ms with `lax.cummax`)."""
    text = str(jax.make_jaxpr(lambda seg: block_bounds(seg, 128))(
        jax.ShapeDtypeStruct((2, 8192), jnp.int32)))
    assert "cummax" in text and "cummin" in text
    assert "while" not in text and "scan" not in text
    segment_ids_BxT, _ = rows_of(512, [100, 300, 50], [512])
    for got, want in zip(block_bounds(jnp.asarray(segment_ids_BxT), 64),
                         block_bounds(segment_ids_BxT, 64), strict=True):
        np.testing.assert_array_equal(got, want)


def _for_h100(fn, *shapes: tuple[tuple[int, ...], object]) -> jax.stages.Compiled:
    """`fn` compiled for one H100 on arguments of these (shape, dtype)."""
    target = targets.prepare("h100")
    mesh = Mesh(np.array(targets.devices(target, 1)), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(fn).lower(*(
        jax.ShapeDtypeStruct(shape, dtype, sharding=replicated) for shape, dtype in shapes
    )).compile()


def _forward_backward(dtype, H: int, T: int, block: int = 0, backward: str | None = "two-loop",
                      K: int = 32) -> jax.stages.Compiled:
    """Forward and backward of a [1, T, 32, H] row (K K/V heads) compiled for one H100."""
    def forward_backward(q, k, v, segment_ids, dout):
        out, vjp = jax.vjp(lambda q, k, v: packed_attention(q, k, v, segment_ids, block=block,
                                                            backward=backward), q, k, v)
        return out, vjp(dout)

    shape = (1, T, 32, H)
    return _for_h100(forward_backward, (shape, dtype), *[((1, T, K, H), dtype)] * 2,
                     ((1, T), jnp.int32), (shape, dtype))


KERNELS = {"two-loop": ["packed_attention_backward"],  # each backward's Triton kernels
           "fa2": ["packed_attention_backward_fa2"],
           "fa2-split": ["packed_attention_backward_fa2", "packed_attention_backward_fa2_dq"]}


def test_the_fa2_split_backward_is_the_default_only_where_measured_faster():
    """16-bit inputs at head dim 128 (1.6-1.8x the two-loop backward on an H100); the two-loop
    one elsewhere, and a default-built step compiles to fa2-split's kernels there."""
    assert default_backward(jnp.bfloat16, 128) == default_backward(jnp.float16, 128) == \
        "fa2-split"
    assert default_backward(jnp.bfloat16, 64) == default_backward(jnp.float32, 128) == \
        "two-loop"
    text = _forward_backward(jnp.bfloat16, 128, 1024, backward=None, K=8).as_text()
    kernels = {line.split('name = "')[1].split('"')[0]
               for line in text.splitlines() if "__gpu$xla.gpu.triton" in line}
    assert kernels == {"packed_attention_forward", *KERNELS["fa2-split"]}


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize(("dtype", "H", "edge"), [(jnp.bfloat16, 128, 128),
                                                  (jnp.float32, 64, 64)])
def test_it_compiles_for_an_h100_at_the_trainers_shapes(dtype, H, edge, backward):
    """LLaMA-3-8B's attention (N=32, K=8, H=128, bf16) and a float32 run's 64-wide heads on a
    4K row, forward and each backward: Triton kernels within the H100's shared memory at the
    tiles `block_for` and `backward_tiles` pick, and no T x T scores anywhere (the heads' would
    be 1 GiB in bf16): at most fp32 dK and dV per query head (the two-loop backward under GQA)
    or fp32 dQ (fa2's atomic adds) beside a megabyte."""
    T, N = 4096, 32
    assert block_for(dtype, H, T) == edge
    text = (compiled := _forward_backward(dtype, H, T, backward=backward, K=8)).as_text()
    kernels = [line.split('name = "')[1].split('"')[0]
               for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert sorted(kernels) == sorted(["packed_attention_forward", *KERNELS[backward]])
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * 4 * T * N * H + 2 ** 20


def test_float32_tiles_of_128_exceed_shared_memory():
    """The negative control of `block_for`'s float32 rule: 64-wide heads at tiles of 128 ask
    263,680 bytes of shared memory, as an H200 refused them at run time."""
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        _forward_backward(jnp.float32, 64, 2048, block=128)


def chunk_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, q_tokens: Tokens, k_tokens: Tokens):
    """The reference of one ring step: softmax over this chunk's keys alone, masked by
    documents and positions; a query that sees none of them gets 0 and a log-sum-exp of
    -inf. Returns [B, T, N, H] and [B, N, T]."""
    G = q_BxTxNxH.shape[2] // k_BxSxKxH.shape[2]
    k_BxSxNxH, v_BxSxNxH = (jnp.repeat(x, G, axis=2) for x in (k_BxSxKxH, v_BxSxKxH))
    s_BxNxTxS = jnp.einsum("btnh,bsnh->bnts", q_BxTxNxH, k_BxSxNxH) * q_BxTxNxH.shape[-1] ** -0.5
    mask_Bx1xTxS = ((q_tokens.segment[:, :, None] == k_tokens.segment[:, None, :])
                    & (q_tokens.segment[:, :, None] > 0)
                    & (k_tokens.position[:, None, :] <= q_tokens.position[:, :, None]))[:, None]
    s_BxNxTxS = jnp.where(mask_Bx1xTxS, s_BxNxTxS, -1e30)
    top_BxNxT = jax.lax.stop_gradient(s_BxNxTxS.max(axis=-1))
    p_BxNxTxS = jnp.where(mask_Bx1xTxS, jnp.exp(s_BxNxTxS - top_BxNxT[..., None]), 0)
    sum_BxNxT = p_BxNxTxS.sum(axis=-1)
    out_BxNxTxH = jnp.einsum("bnts,bsnh->bnth", p_BxNxTxS, v_BxSxNxH) / jnp.where(
        sum_BxNxT > 0, sum_BxNxT, 1)[..., None]
    lse_BxNxT = jnp.where(sum_BxNxT > 0, top_BxNxT + jnp.log(sum_BxNxT), -jnp.inf)
    return out_BxNxTxH.transpose(0, 2, 1, 3), lse_BxNxT


def test_a_ring_step_is_attention_over_the_chunk_it_holds_when_interpreted():
    """Queries of a row's second half against the K/V of its first, tiles of 16: a document
    crossing the halves and tiles, one that starts in the second half (its queries see
    nothing here: 0 and -inf), padding. Given its own log-sum-exp, as when the ring is one
    chunk, its backward is the chunk's gradients. GQA (N=4, K=2)."""
    segment_ids_BxT, positions_BxT = rows_of(128, [30, 70, 20], [100, 3])
    columns_BxT = np.broadcast_to(np.arange(128, dtype=np.int32), (2, 128))
    row = Tokens(*(jnp.asarray(x) for x in (segment_ids_BxT, positions_BxT, columns_BxT)))
    q_tokens, k_tokens = (Tokens(*(x[:, half] for x in row))
                          for half in (slice(64, None), slice(None, 64)))
    B, T, N, K, H = 2, 64, 4, 2, 16
    keys = jax.random.split(jax.random.key(1), 4)
    q, dout = (jax.random.normal(key, (B, T, N, H)) for key in keys[:2])
    k, v = (jax.random.normal(key, (B, T, K, H)) for key in keys[2:])
    visible_BxIxJ = visible_blocks(q_tokens, k_tokens, 16, 16)
    assert not visible_BxIxJ.all()  # some tile pairs are skipped

    got_out, got_lse = ring_step(q, k, v, q_tokens[:2], k_tokens[:2], visible_BxIxJ, block=16,
                                 interpret=True)
    (want_out, want_lse), vjp = jax.vjp(
        lambda q, k, v: chunk_attention(q, k, v, q_tokens, k_tokens), q, k, v)
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), atol=TOLERANCE,
                               rtol=TOLERANCE)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), atol=TOLERANCE,
                               rtol=TOLERANCE)
    unseen = np.isinf(np.asarray(want_lse))
    assert unseen[:, :, 36:].all() and not unseen[0, :, :36].any()  # from column 100 on

    delta_BxNxT = jnp.einsum("btnh,btnh->bnt", want_out, dout)
    wants = vjp((dout, jnp.zeros_like(want_lse)))
    # Both backwards; FA2-split at the table's tiles (clipped to the block) and at query tiles
    # half the block (the visible table refined to them).
    for backward, tiles in (("two-loop", None), ("fa2-split", None),
                            ("fa2-split", Tiles(8, 16, 4, 2))):
        got = ring_step_backward(q, k, v, q_tokens[:2], k_tokens[:2], visible_BxIxJ, want_lse,
                                 delta_BxNxT, dout, block=16, backward=backward, tiles=tiles,
                                 interpret=True)
        for got_grad, want_grad in zip(got, wants, strict=True):
            np.testing.assert_allclose(np.asarray(got_grad), np.asarray(want_grad),
                                       atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize(("dtype", "H", "backward"), [(jnp.bfloat16, 128, "two-loop"),
                                                      (jnp.float32, 64, "two-loop"),
                                                      (jnp.bfloat16, 128, "fa2-split")])
def test_the_ring_step_compiles_for_an_h100_at_the_trainers_shapes(dtype, H, backward):
    """A ring of 4 over 16K rows: a rank's 4K chunk of LLaMA2-7B's heads (N=32, H=128, bf16)
    and of a float32 run's 64-wide ones, the ring step forward and backward at the tile
    `block_for` picks: Triton kernels within the H100's shared memory (the forward and one
    backward, or FA2-split's two), no T x T scores."""
    T = 4096
    block = block_for(dtype, H, T)

    def forward_backward(q, k, v, segment_ids, positions, visible, dout):
        tokens = (segment_ids, positions)
        out, lse = ring_step(q, k, v, tokens, tokens, visible, block=block)
        delta = jnp.einsum("btnh,btnh->bnt", out, dout.astype(jnp.float32))
        return out, ring_step_backward(q, k, v, tokens, tokens, visible, lse, delta, dout,
                                       block=block, backward=backward)

    shape, blocks = (1, T, 32, H), T // block
    compiled = _for_h100(forward_backward, *[(shape, dtype)] * 3, *[((1, T), jnp.int32)] * 2,
                         ((1, blocks, blocks), jnp.bool_), (shape, dtype))
    kernels = 2 if backward == "two-loop" else 3
    assert compiled.as_text().count('custom_call_target="__gpu$xla.gpu.triton"') == kernels
    assert compiled.memory_analysis().temp_size_in_bytes < T * T * 2
