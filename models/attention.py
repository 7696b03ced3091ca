"""Attention over packed rows: a blockwise kernel that never computes what the mask hides, ring
attention when the sequence is split over devices, and the GPU kernels that may replace it.

The mask: query t sees key s iff both lie in the same document (segment id, 0 is padding), s is
not later in that document (positions) and not later in the row (columns). Rows hold each
document as one run in position order, so the column rule hides nothing a document would show;
it is what lets whole blocks above the diagonal go uncomputed. Padding sees nothing and its
output is zero. On GPU packed rows run the same block skipping as a Pallas (Triton) kernel,
`hotjax.models.packed_attention`; rows known to be one document each run cuDNN's.

The blockwise kernel (FlashAttention-2's algorithm, in plain JAX) walks query blocks against key
blocks with an online softmax, so memory is O(T x block) instead of O(T^2). Before it starts it
lists the block pairs that something in them can see — from each block's range of segments,
positions and columns — and loops over those alone, forward and backward: blocks above the
causal diagonal and blocks whose documents do not meet are never computed. Query heads share
their K/V head by a grouped einsum; K/V are never repeated.

Under context parallelism each rank keeps its queries and passes its K/V chunk around the ring
(`ppermute`, issued before the chunk's computation so the two overlap); the backward pass sends
the K/V gradients around with them. With `balanced` chunks (rank i holds chunks i and 2C-1-i)
every rank computes about the same number of blocks. Each chunk is computed by the blockwise
kernel, or on GPU by the ring step's Pallas kernel ("pallas-ring",
`hotjax.models.packed_attention.ring_step`) over the same list of visible block pairs; the chunks'
results merge by their log-sum-exp.

Letters: B rows, T query tokens, S key tokens, N query heads, K K/V heads, G query heads per
K/V head, H head dim, Q a query block's tokens, W a key block's tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from hotjax.choices import ATTENTION_BACKENDS
from hotjax.models.cudnn_attention import (
    cudnn_packed_attention,
    cudnn_packed_support,
    cudnn_pays,
    workspace_bytes,
)

Array = jax.Array
# Default block edge by platform: small blocks skip more of a packed row; on a GPU larger
# blocks keep the matrix units busy.
DEFAULT_BLOCK = {"cpu": 256, "gpu": 512}
PALLAS_BLOCK = 128  # rows the packed-attention Pallas kernel takes: a multiple of its tiles
RING_BLOCK = 16  # the ring step's least tile edge (Triton's matmuls take no fewer rows)
_NONE = jnp.iinfo(jnp.int32).max  # the lower bound of a block with no real token


def accumulating(dtype: jnp.dtype, platform: str | None = None) -> jnp.dtype:
    """The dtype for matmuls that accumulate in fp32: XLA:CPU has no fp16 x fp16 -> fp32 dot,
    so there fp16 operands are widened (bf16 and every accelerator keep their own).
    `platform`: the one compiled for (None: JAX's default backend; a GPU target compiled on a
    CPU host names "gpu")."""
    if jnp.dtype(dtype) == jnp.float16 and (platform or jax.default_backend()) == "cpu":
        return jnp.dtype(jnp.float32)
    return jnp.dtype(dtype)


class Tokens(NamedTuple):
    """What the mask reads of each token, all [B, T] int32."""

    segment: Array
    position: Array
    column: Array  # index in the whole row (before any split over devices)


@dataclasses.dataclass(frozen=True)
class AttentionSharding:
    """Where attention runs: queries laid out as `q` ([B, T, N, H]), keys and values as `kv`;
    when the sequence axis is split, K/V go round a ring over its mesh axes."""

    mesh: Mesh
    q: PartitionSpec
    kv: PartitionSpec
    balanced: bool = False

    @property
    def ring_axes(self) -> tuple[str, ...]:
        return _axes(self.q, 1)

    @property
    def ring_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.ring_axes)


def choose_backend(requested: str, platform: str, *, ring: bool, packed: bool,
                   seq_len: int | None = None, dtype=None, documents: int = 0,
                   workspace: int = 0, capability: int | None = None, head_dim: int = 0
                   ) -> tuple[str, str | None]:
    """The kernel that runs, and why it is not the one requested (None when it is).

    On GPU, "auto" takes cuDNN's fused attention for rows that are one document each, and for
    packed rows where its packed layout runs (`cudnn_packed_support`: 16-bit inputs, Hopper or
    later, a JAX whose packed offsets honour GQA) and pays (`cudnn_pays`: long documents, by
    `documents`, the step's cap, 0 when not known; a `workspace` in bytes within its limit,
    `hotjax.models.cudnn_attention.workspace_bytes`; `head_dim`, 0 when not known, for the
    fallback's backward it is measured against). Other packed rows take the packed-attention
    Pallas kernel (`hotjax.models.packed_attention`, for rows its tiles divide; `seq_len` None: not
    yet known). A context-parallel ring takes the ring step's Pallas kernel ("pallas-ring")
    whatever was asked for, where its tiles divide `seq_len`, then the tokens of a rank's
    chunk (of each of its halves when balanced). Every other platform runs the blockwise
    kernel. `capability`: the GPU's compute capability (major), None when not known.
    """
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}: choose one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    if requested in ("blockwise", "dense"):
        return requested, None
    if platform != "gpu":
        why = f"{requested} needs a GPU" if requested != "auto" else None
        return "blockwise", why
    if ring:
        if not _pallas_available():
            return "blockwise", "the Pallas GPU kernel is not importable"
        if seq_len is not None and seq_len % RING_BLOCK:
            return "blockwise", (f"the ring's Pallas kernel tiles a rank's chunk ({seq_len} "
                                 f"tokens) in blocks of {RING_BLOCK} or more")
        return "pallas-ring", None if requested in ("auto", "pallas") else (
            f"{requested} cannot pass K/V around a context-parallel ring")
    if requested in ("auto", "cudnn") and packed:
        why = cudnn_packed_support(dtype, capability)
        fallback_backward = "two-loop"  # the fallback's backward, cuDNN measured against it
        if dtype is not None and head_dim and _pallas_available():
            from hotjax.models.packed_attention import default_backward

            fallback_backward = default_backward(dtype, head_dim)
        pays = seq_len is not None and cudnn_pays(seq_len, documents, workspace,
                                                  fallback_backward)
        if why is None and (requested == "cudnn" or pays):
            return "cudnn", None
        fallback, fallback_why = choose_backend("pallas", platform, ring=False, packed=True,
                                                seq_len=seq_len)
        return fallback, why if requested == "cudnn" else fallback_why
    wanted = "cudnn" if requested == "auto" else requested
    if wanted == "pallas" and not _pallas_available():
        return "blockwise", "the Pallas GPU kernel is not importable"
    if wanted == "pallas" and seq_len is not None and seq_len % PALLAS_BLOCK:
        return "blockwise", f"Pallas tiles rows in blocks of {PALLAS_BLOCK} tokens"
    return wanted, None


def _pallas_available() -> bool:
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    return True


def attention(q_BxTxNxH: Array, k_BxTxKxH: Array, v_BxTxKxH: Array, segment_ids_BxT: Array,
              positions_BxT: Array, *, backend: str = "auto", block: int = 0,
              packed: bool = True, documents: int = 0,
              sharding: AttentionSharding | None = None, interpret: bool = False) -> Array:
    """Softmax attention under the document-causal mask, output [B, T, N, H] in q's dtype.

    `block`: the block edge of the blockwise kernel (0: the platform's default). `packed`:
    whether rows may hold several documents (False lets cuDNN take plain causal rows).
    `documents`: the most documents a row holds (0: not known). `sharding`: run per device
    under this layout (a ring when the sequence is split); None leaves the layout to XLA.
    `interpret`: choose as on a GPU and run its Pallas kernels in Pallas' interpreter, on any
    platform (how they are tested without one).
    """
    ring = sharding is not None and sharding.ring_size > 1
    device = sharding.mesh.devices.flat[0] if sharding is not None else jax.devices()[0]
    platform = "gpu" if interpret else device.platform
    B, T, N, H = q_BxTxNxH.shape
    if sharding is not None:  # one device's rows and heads
        B, N = (size // math.prod(sharding.mesh.shape[a] for a in _axes(sharding.q, dim))
                for size, dim in ((B, 0), (N, 2)))
    # Under a ring a kernel tiles one rank's chunk, each half of it apart when balanced.
    tiled = T // (sharding.ring_size * (1 + sharding.balanced)) if ring else T
    kernel, _ = choose_backend(backend, platform, ring=ring, packed=packed, seq_len=tiled,
                               dtype=q_BxTxNxH.dtype, documents=documents,
                               workspace=workspace_bytes(B, T, documents, N, H),
                               capability=compute_capability(device), head_dim=H)
    block = block or DEFAULT_BLOCK.get(platform, DEFAULT_BLOCK["gpu"])
    if kernel == "dense":
        return dense_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, positions_BxT)
    local = functools.partial(_local_attention, kernel=kernel, block=block,
                              documents=documents if packed else 1, interpret=interpret)
    if sharding is None:
        return local(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, positions_BxT,
                     shard=_Shard())
    head_axes = _axes(sharding.q, 2)
    shard = _Shard(sharding.ring_axes, sharding.ring_size, sharding.balanced, head_axes,
                   math.prod(sharding.mesh.shape[a] for a in head_axes),
                   kv_replicated=bool(head_axes) and _axes(sharding.kv, 2) != head_axes)
    tokens = PartitionSpec(*sharding.q[:2])
    # Without replication checks: the kernel's loop carries start as constants (the same on
    # every device) and become per-device, which the checker would have us annotate at every
    # loop; the outputs are per-device by construction.
    return jax.shard_map(
        functools.partial(local, shard=shard), mesh=sharding.mesh,
        in_specs=(sharding.q, sharding.kv, sharding.kv, tokens, tokens), out_specs=sharding.q,
        check_vma=False)(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT, positions_BxT)


def compute_capability(device: jax.Device) -> int | None:
    """A GPU's compute capability (major), None where the device does not say (a CPU, a
    deviceless compile's target)."""
    found = getattr(device, "compute_capability", None)
    try:
        return int(str(found).split(".")[0])
    except ValueError:
        return None


def _axes(spec: PartitionSpec, dim: int) -> tuple[str, ...]:
    part = spec[dim] if len(spec) > dim else None
    return () if part is None else (part,) if isinstance(part, str) else tuple(part)


def dense_attention(q_BxTxNxH: Array, k_BxTxKxH: Array, v_BxTxKxH: Array,
                    segment_ids_BxT: Array, positions_BxT: Array) -> Array:
    """The reference: every score materialised, masked by documents and positions only (so it
    also holds for rows whose columns were reordered)."""
    same_doc_BxTxT = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
    causal_BxTxT = positions_BxT[:, None, :] <= positions_BxT[:, :, None]
    mask_Bx1xTxT = (same_doc_BxTxT & causal_BxTxT)[:, None]
    dtype, wide = q_BxTxNxH.dtype, accumulating(q_BxTxNxH.dtype)
    out_BxTxNxH = jax.nn.dot_product_attention(q_BxTxNxH.astype(wide), k_BxTxKxH.astype(wide),
                                               v_BxTxKxH.astype(wide), mask=mask_Bx1xTxT)
    return jnp.where((segment_ids_BxT > 0)[:, :, None, None], out_BxTxNxH, 0).astype(dtype)


class _Shard(NamedTuple):
    """One device's place: the ring its sequence chunk is on (size 1: none) and the mesh axes
    its query heads are split over."""

    ring_axes: tuple[str, ...] = ()
    ring_size: int = 1
    balanced: bool = False
    head_axes: tuple[str, ...] = ()
    head_ways: int = 1
    kv_replicated: bool = False  # query heads split over `head_axes`, K/V heads not


def _local_attention(q_BxTxNxH: Array, k_BxSxKxH: Array, v_BxSxKxH: Array,
                     segment_ids_BxT: Array, positions_BxT: Array, *, shard: _Shard, kernel: str,
                     block: int, documents: int, interpret: bool = False) -> Array:
    """One device's share: its query rows and heads, against every K/V chunk of its ring.
    `documents`: the most a row holds (1: rows are one causal document each; 0: not known)."""
    B, T, N, H = q_BxTxNxH.shape
    if shard.kv_replicated:
        # More tensor ranks than K/V heads: every rank holds all K/V heads; keep the ones this
        # rank's query heads read (query head n reads K/V head n // G).
        K = k_BxSxKxH.shape[2]
        G = N * shard.head_ways // K
        first = lax.axis_index(shard.head_axes) * N // G
        k_BxSxKxH, v_BxSxKxH = (lax.dynamic_slice_in_dim(x, first, -(-N // G), axis=2)
                                for x in (k_BxSxKxH, v_BxSxKxH))
    if kernel == "cudnn" and documents == 1:
        return _cudnn(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH)
    if kernel == "cudnn":
        # Rows past the cap (possible only where the cap is not the step's own) take the
        # Pallas kernel, whose tiles the row's length then divides, else the blockwise one.
        fallback, _ = choose_backend("pallas", "gpu", ring=False, packed=True, seq_len=T)
        return cudnn_packed_attention(
            q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxT, max_docs=documents,
            fallback=lambda q, k, v, seg: _local_attention(
                q, k, v, seg, positions_BxT, shard=shard._replace(kv_replicated=False),
                kernel=fallback, block=block, documents=documents, interpret=interpret))
    if kernel == "pallas":
        return _pallas(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segment_ids_BxT, interpret=interpret)
    columns_BxT = jnp.broadcast_to(_columns(T, shard), (B, T))
    tokens = Tokens(segment_ids_BxT, positions_BxT, columns_BxT)
    # A balanced chunk is two halves far apart in the row: no block may straddle them.
    halves = 2 if shard.balanced else 1
    if kernel == "pallas-ring":
        from hotjax.models.packed_attention import block_for

        edge = block_for(q_BxTxNxH.dtype, H, T // halves)
        return _ring(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, tokens, shard,
                     _Chunks(kernel, (edge, edge), interpret))
    dtype, wide = q_BxTxNxH.dtype, accumulating(q_BxTxNxH.dtype)
    blocks = (block_edge(T // halves, block), block_edge(k_BxSxKxH.shape[1] // halves, block))
    out_BxTxNxH = _ring(q_BxTxNxH.astype(wide), k_BxSxKxH.astype(wide), v_BxSxKxH.astype(wide),
                        tokens, shard, _Chunks(kernel, blocks))
    return out_BxTxNxH.astype(dtype)


def _columns(T: int, shard: _Shard) -> Array:
    """The row columns of this device's T tokens: its chunk of the ring, or with `balanced`
    its two chunks i and 2C-1-i."""
    local = jnp.arange(T, dtype=jnp.int32)
    if shard.ring_size == 1:
        return local
    rank = lax.axis_index(shard.ring_axes)
    if not shard.balanced:
        return rank * T + local
    half = T // 2
    chunk = jnp.where(local < half, rank, 2 * shard.ring_size - 1 - rank)
    return chunk * half + local % half


def block_edge(length: int, block: int) -> int:
    """The largest block edge up to `block` that divides `length`."""
    return next(b for b in range(min(block, length), 0, -1) if length % b == 0)


def visible_blocks(q: Tokens, k: Tokens, q_block: int, k_block: int) -> Array:
    """[B, T/q_block, S/k_block]: whether any query of a block may see any key of another.
    Conservative (a block that shows nothing may be listed, never the reverse): it compares
    each block's range of segments, positions and columns over its non-padding tokens. NumPy
    tokens give a NumPy answer (the host's estimate of the kernel's work)."""
    on_host = all(isinstance(x, np.ndarray) for t in (q, k) for x in t)
    xp = np if on_host else jnp

    def bounds(t: Tokens, block: int) -> tuple[Array, ...]:
        B, T = t.segment.shape
        real = (t.segment > 0).reshape(B, T // block, block)

        def lo(x: Array) -> Array:
            return xp.min(xp.where(real, x.reshape(real.shape), _NONE), axis=-1)

        def hi(x: Array) -> Array:
            return xp.max(xp.where(real, x.reshape(real.shape), -1), axis=-1)

        return lo(t.segment), hi(t.segment), lo(t.position), hi(t.position), lo(t.column), \
            hi(t.column)

    q_seg_lo, q_seg_hi, _, q_pos_hi, _, q_col_hi = (x[:, :, None] for x in bounds(q, q_block))
    k_seg_lo, k_seg_hi, k_pos_lo, _, k_col_lo, _ = (x[:, None, :] for x in bounds(k, k_block))
    return ((q_seg_lo <= k_seg_hi) & (k_seg_lo <= q_seg_hi) & (k_pos_lo <= q_pos_hi)
            & (k_col_lo <= q_col_hi))


def ring_block_counts(segment_ids_BxT: np.ndarray, positions_BxT: np.ndarray, ways: int,
                      balanced: bool, block: int) -> np.ndarray:
    """Block pairs each rank of a context-parallel ring computes for these rows (in row order,
    before any reordering), summed over the ring's steps: the work the kernel does."""
    B, T = segment_ids_BxT.shape
    columns = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    chunk = T // ways
    if balanced:
        half = chunk // 2
        owned = [np.r_[r * half:(r + 1) * half, (2 * ways - 1 - r) * half:(2 * ways - r) * half]
                 for r in range(ways)]
    else:
        owned = [np.arange(r * chunk, (r + 1) * chunk) for r in range(ways)]
    tokens = [Tokens(*(jnp.asarray(x[:, cols]) for x in (segment_ids_BxT, positions_BxT, columns)))
              for cols in owned]
    edge = block_edge(chunk // 2 if balanced else chunk, block)
    return np.array([sum(int(visible_blocks(tokens[r], tokens[source], edge, edge).sum())
                         for source in range(ways)) for r in range(ways)])


def _pairs(visible_BxIxJ: Array) -> tuple[tuple[Array, Array, Array], Array]:
    """The (row, query block, key block) triples of the visible pairs, first `count` valid."""
    _, I, J = visible_BxIxJ.shape
    flat = visible_BxIxJ.reshape(-1)
    (index,) = jnp.nonzero(flat, size=flat.size, fill_value=0)
    row, rest = jnp.divmod(index, I * J)
    return (row, *jnp.divmod(rest, J)), jnp.sum(flat, dtype=jnp.int32)


def _mask(q: Tokens, k: Tokens, b: Array, i: Array, j: Array, blocks: tuple[int, int]) -> Array:
    """[Q, W]: which queries of block (b, i) see which keys of block (b, j)."""
    def take(t: Tokens, index: Array, block: int) -> Tokens:
        return Tokens(*(lax.dynamic_slice(x, (b, index * block), (1, block))[0] for x in t))

    qt, kt = take(q, i, blocks[0]), take(k, j, blocks[1])
    return ((qt.segment[:, None] == kt.segment[None, :]) & (qt.segment[:, None] > 0)
            & (kt.position[None, :] <= qt.position[:, None])
            & (kt.column[None, :] <= qt.column[:, None]))


def _block(x: Array, b: Array, index: Array, block: int) -> Array:
    """Rows `index*block ...` of row b of a [B, T, ...] array."""
    start = (b, index * block) + (0,) * (x.ndim - 2)
    return lax.dynamic_slice(x, start, (1, block, *x.shape[2:]))[0]


def _add_block(x: Array, update: Array, b: Array, index: Array, block: int) -> Array:
    start = (b, index * block) + (0,) * (x.ndim - 2)
    return lax.dynamic_update_slice(x, (_block(x, b, index, block) + update)[None], start)


class _Softmax(NamedTuple):
    """The running online softmax of every query, fp32: unnormalised output, max and sum."""

    out_BxTxKxGxH: Array
    max_BxTxKxG: Array
    sum_BxTxKxG: Array


def _forward_chunk(state: _Softmax, q_BxTxKxGxH: Array, k_BxSxKxH: Array, v_BxSxKxH: Array,
                   q: Tokens, k: Tokens, blocks: tuple[int, int], scale: float) -> _Softmax:
    """Fold one K/V chunk into the running softmax, visible block pairs only."""
    (rows, qi, kj), count = _pairs(visible_blocks(q, k, *blocks))
    Q, W = blocks

    def pair(n: Array, state: _Softmax) -> _Softmax:
        b, i, j = rows[n], qi[n], kj[n]
        q_QxKxGxH = _block(q_BxTxKxGxH, b, i, Q)
        k_WxKxH, v_WxKxH = _block(k_BxSxKxH, b, j, W), _block(v_BxSxKxH, b, j, W)
        s_QxKxGxW = jnp.einsum("qkgh,wkh->qkgw", q_QxKxGxH, k_WxKxH,
                               preferred_element_type=jnp.float32) * scale
        mask_Qx1x1xW = _mask(q, k, b, i, j, blocks)[:, None, None, :]
        s_QxKxGxW = jnp.where(mask_Qx1x1xW, s_QxKxGxW, -jnp.inf)
        max_QxKxG = _block(state.max_BxTxKxG, b, i, Q)
        new_max_QxKxG = jnp.maximum(max_QxKxG, s_QxKxGxW.max(axis=-1))
        shift_QxKxG = jnp.where(jnp.isfinite(new_max_QxKxG), new_max_QxKxG, 0.0)
        p_QxKxGxW = jnp.exp(s_QxKxGxW - shift_QxKxG[..., None])
        rescale_QxKxG = jnp.exp(max_QxKxG - shift_QxKxG)
        pv_QxKxGxH = jnp.einsum("qkgw,wkh->qkgh", p_QxKxGxW.astype(v_WxKxH.dtype), v_WxKxH,
                                preferred_element_type=jnp.float32)
        out_QxKxGxH = _block(state.out_BxTxKxGxH, b, i, Q) * rescale_QxKxG[..., None] + pv_QxKxGxH
        sum_QxKxG = _block(state.sum_BxTxKxG, b, i, Q) * rescale_QxKxG + p_QxKxGxW.sum(axis=-1)
        start = (b, i * Q)
        return _Softmax(
            lax.dynamic_update_slice(state.out_BxTxKxGxH, out_QxKxGxH[None], (*start, 0, 0, 0)),
            lax.dynamic_update_slice(state.max_BxTxKxG, new_max_QxKxG[None], (*start, 0, 0)),
            lax.dynamic_update_slice(state.sum_BxTxKxG, sum_QxKxG[None], (*start, 0, 0)))

    return lax.fori_loop(0, count, pair, state)


def _backward_chunk(grads: tuple[Array, Array, Array], q_BxTxKxGxH: Array, k_BxSxKxH: Array,
                    v_BxSxKxH: Array, q: Tokens, k: Tokens, lse_BxTxKxG: Array,
                    dout_BxTxKxGxH: Array, delta_BxTxKxG: Array, blocks: tuple[int, int],
                    scale: float) -> tuple[Array, Array, Array]:
    """FlashAttention-2's backward over one K/V chunk: add its share of dq, and this chunk's
    dk and dv, recomputing each visible block's probabilities from the saved log-sum-exp."""
    (rows, qi, kj), count = _pairs(visible_blocks(q, k, *blocks))
    Q, W = blocks
    dtype = k_BxSxKxH.dtype

    def pair(n: Array, grads: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        dq, dk, dv = grads
        b, i, j = rows[n], qi[n], kj[n]
        q_QxKxGxH = _block(q_BxTxKxGxH, b, i, Q)
        k_WxKxH, v_WxKxH = _block(k_BxSxKxH, b, j, W), _block(v_BxSxKxH, b, j, W)
        dout_QxKxGxH = _block(dout_BxTxKxGxH, b, i, Q)
        s_QxKxGxW = jnp.einsum("qkgh,wkh->qkgw", q_QxKxGxH, k_WxKxH,
                               preferred_element_type=jnp.float32) * scale
        mask_Qx1x1xW = _mask(q, k, b, i, j, blocks)[:, None, None, :]
        p_QxKxGxW = jnp.where(mask_Qx1x1xW,
                              jnp.exp(s_QxKxGxW - _block(lse_BxTxKxG, b, i, Q)[..., None]), 0.0)
        dv_WxKxH = jnp.einsum("qkgw,qkgh->wkh", p_QxKxGxW.astype(dtype), dout_QxKxGxH,
                              preferred_element_type=jnp.float32)
        dp_QxKxGxW = jnp.einsum("qkgh,wkh->qkgw", dout_QxKxGxH, v_WxKxH,
                                preferred_element_type=jnp.float32)
        ds_QxKxGxW = (p_QxKxGxW * (dp_QxKxGxW - _block(delta_BxTxKxG, b, i, Q)[..., None])
                      * scale).astype(dtype)
        dq_QxKxGxH = jnp.einsum("qkgw,wkh->qkgh", ds_QxKxGxW, k_WxKxH,
                                preferred_element_type=jnp.float32)
        dk_WxKxH = jnp.einsum("qkgw,qkgh->wkh", ds_QxKxGxW, q_QxKxGxH,
                              preferred_element_type=jnp.float32)
        return (_add_block(dq, dq_QxKxGxH, b, i, Q), _add_block(dk, dk_WxKxH, b, j, W),
                _add_block(dv, dv_WxKxH, b, j, W))

    return lax.fori_loop(0, count, pair, grads)


def _rotate(tree, shard: _Shard):
    """Every array of `tree` one step round the ring (rank r to r + 1)."""
    n = shard.ring_size
    return jax.tree.map(lambda x: lax.ppermute(x, shard.ring_axes,
                                               [(r, (r + 1) % n) for r in range(n)]), tree)


def _grouped(x_BxTxNxH: Array, K: int) -> Array:
    B, T, N, H = x_BxTxNxH.shape
    return x_BxTxNxH.reshape(B, T, K, N // K, H)


class _Chunks(NamedTuple):
    """How a rank computes each K/V chunk of its ring: `kernel` "blockwise" (XLA) or
    "pallas-ring" (the ring step's Pallas kernel, in Pallas' interpreter when `interpret`), on
    blocks of (queries, keys)."""

    kernel: str
    blocks: tuple[int, int]
    interpret: bool = False


def _merge(a: _Softmax, b: _Softmax) -> _Softmax:
    """Two online softmaxes over disjoint keys as one."""
    top = jnp.maximum(a.max_BxTxKxG, b.max_BxTxKxG)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    weight_a, weight_b = jnp.exp(a.max_BxTxKxG - shift), jnp.exp(b.max_BxTxKxG - shift)
    return _Softmax(a.out_BxTxKxGxH * weight_a[..., None] + b.out_BxTxKxGxH * weight_b[..., None],
                    top, a.sum_BxTxKxG * weight_a + b.sum_BxTxKxG * weight_b)


def _kernel_forward_chunk(state: _Softmax, q_BxTxKxGxH: Array, k_BxSxKxH: Array,
                          v_BxSxKxH: Array, q: Tokens, k: Tokens, chunks: _Chunks) -> _Softmax:
    """`_forward_chunk` by the ring step's Pallas kernel: its normalised output over the chunk
    is an online softmax whose max is its log-sum-exp and whose sum is 1."""
    from hotjax.models.packed_attention import ring_step

    B, T, K, G, H = q_BxTxKxGxH.shape
    out_BxTxNxH, lse_BxNxT = ring_step(
        q_BxTxKxGxH.reshape(B, T, K * G, H), k_BxSxKxH, v_BxSxKxH, q[:2], k[:2],
        visible_blocks(q, k, *chunks.blocks), block=chunks.blocks[0], interpret=chunks.interpret)
    lse_BxTxKxG = lse_BxNxT.transpose(0, 2, 1).reshape(B, T, K, G)
    return _merge(state, _Softmax(out_BxTxNxH.reshape(B, T, K, G, H), lse_BxTxKxG,
                                  jnp.isfinite(lse_BxTxKxG).astype(jnp.float32)))


def _kernel_backward_chunk(grads: tuple[Array, Array, Array], q_BxTxKxGxH: Array,
                           k_BxSxKxH: Array, v_BxSxKxH: Array, q: Tokens, k: Tokens,
                           lse_BxTxKxG: Array, dout_BxTxKxGxH: Array, delta_BxTxKxG: Array,
                           chunks: _Chunks) -> tuple[Array, Array, Array]:
    """`_backward_chunk` by the ring step's Pallas kernel, under the packed kernel's backward
    (`hotjax.models.packed_attention.default_backward`)."""
    from hotjax.models.packed_attention import default_backward, ring_step_backward

    B, T, K, G, H = q_BxTxKxGxH.shape

    def per_head(x_BxTxKxG: Array) -> Array:
        return x_BxTxKxG.reshape(B, T, K * G).transpose(0, 2, 1)

    dq_BxTxNxH, dk_BxSxKxH, dv_BxSxKxH = ring_step_backward(
        q_BxTxKxGxH.reshape(B, T, K * G, H), k_BxSxKxH, v_BxSxKxH, q[:2], k[:2],
        visible_blocks(q, k, *chunks.blocks), per_head(lse_BxTxKxG), per_head(delta_BxTxKxG),
        dout_BxTxKxGxH.reshape(B, T, K * G, H), block=chunks.blocks[0],
        backward=default_backward(q_BxTxKxGxH.dtype, H), interpret=chunks.interpret)
    dq, dk, dv = grads
    return dq + dq_BxTxNxH.reshape(dq.shape), dk + dk_BxSxKxH, dv + dv_BxSxKxH


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ring(q_BxTxNxH: Array, k_BxSxKxH: Array, v_BxSxKxH: Array, tokens: Tokens,
          shard: _Shard, chunks: _Chunks) -> Array:
    """A rank's queries against every K/V chunk of its ring (one chunk: no ring)."""
    return _ring_forward(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, tokens, shard, chunks)[0]


def _ring_forward(q_BxTxNxH: Array, k_BxSxKxH: Array, v_BxSxKxH: Array, tokens: Tokens,
                  shard: _Shard, chunks: _Chunks):
    B, T, N, H = q_BxTxNxH.shape
    K = k_BxSxKxH.shape[2]
    q_BxTxKxGxH = _grouped(q_BxTxNxH, K)
    state = _Softmax(jnp.zeros(q_BxTxKxGxH.shape, jnp.float32),
                     jnp.full(q_BxTxKxGxH.shape[:-1], -jnp.inf, jnp.float32),
                     jnp.zeros(q_BxTxKxGxH.shape[:-1], jnp.float32))
    chunk = (k_BxSxKxH, v_BxSxKxH, tokens)
    for step in range(shard.ring_size):
        # The next chunk is sent for before this one is computed, so the two overlap.
        following = _rotate(chunk, shard) if step + 1 < shard.ring_size else None
        if chunks.kernel == "blockwise":
            state = _forward_chunk(state, q_BxTxKxGxH, *chunk[:2], tokens, chunk[2],
                                   chunks.blocks, H ** -0.5)
        else:
            state = _kernel_forward_chunk(state, q_BxTxKxGxH, *chunk[:2], tokens, chunk[2],
                                          chunks)
        chunk = following
    seen = state.sum_BxTxKxG > 0
    out_BxTxKxGxH = state.out_BxTxKxGxH / jnp.where(seen, state.sum_BxTxKxG, 1.0)[..., None]
    lse_BxTxKxG = jnp.where(seen, state.max_BxTxKxG + jnp.log(state.sum_BxTxKxG), 0.0)
    out_BxTxNxH = out_BxTxKxGxH.reshape(B, T, N, H).astype(q_BxTxNxH.dtype)
    return out_BxTxNxH, (q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, tokens, out_BxTxNxH, lse_BxTxKxG)


def _ring_backward(shard: _Shard, chunks: _Chunks, residuals, dout_BxTxNxH: Array):
    q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, tokens, out_BxTxNxH, lse_BxTxKxG = residuals
    H, K = q_BxTxNxH.shape[-1], k_BxSxKxH.shape[2]
    dout_BxTxKxGxH = _grouped(dout_BxTxNxH.astype(q_BxTxNxH.dtype), K)
    delta_BxTxKxG = jnp.sum(_grouped(dout_BxTxNxH.astype(jnp.float32), K)
                            * _grouped(out_BxTxNxH.astype(jnp.float32), K), axis=-1)
    dq = jnp.zeros(dout_BxTxKxGxH.shape, jnp.float32)
    dkv = (jnp.zeros(k_BxSxKxH.shape, jnp.float32), jnp.zeros(v_BxSxKxH.shape, jnp.float32))
    chunk = (k_BxSxKxH, v_BxSxKxH, tokens)
    for step in range(shard.ring_size):
        following = _rotate(chunk, shard) if step + 1 < shard.ring_size else None
        shared = (_grouped(q_BxTxNxH, K), *chunk[:2], tokens, chunk[2], lse_BxTxKxG,
                  dout_BxTxKxGxH, delta_BxTxKxG)
        if chunks.kernel == "blockwise":
            dq, *dkv = _backward_chunk((dq, *dkv), *shared, chunks.blocks, H ** -0.5)
        else:
            dq, *dkv = _kernel_backward_chunk((dq, *dkv), *shared, chunks)
        if shard.ring_size > 1:
            # K/V gradients travel with their chunk; the last step brings them home.
            dkv = _rotate(tuple(dkv), shard)
        chunk = following
    dk, dv = dkv
    return (dq.reshape(q_BxTxNxH.shape).astype(q_BxTxNxH.dtype), dk.astype(k_BxSxKxH.dtype),
            dv.astype(v_BxSxKxH.dtype), None)


_ring.defvjp(_ring_forward, _ring_backward)


def _cudnn(q_BxTxNxH: Array, k_BxTxKxH: Array, v_BxTxKxH: Array) -> Array:
    """cuDNN's fused attention, for rows that are one causal document each."""
    return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, is_causal=True,
                                        implementation="cudnn")


def _pallas(q_BxTxNxH: Array, k_BxTxKxH: Array, v_BxTxKxH: Array, segment_ids_BxT: Array,
            *, interpret: bool = False) -> Array:
    """The packed-attention Pallas kernel (causal by column, as our rows are; GQA without
    repeating K/V; padding's output zero)."""
    from hotjax.models.packed_attention import packed_attention

    return packed_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT,
                            interpret=interpret)
