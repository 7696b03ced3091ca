"""cuDNN's fused attention on packed rows: each row's documents handed to cuDNN as a ragged
batch of causal sequences (its "packed layout"), so no masked block is computed and no mask is
materialised.

cuDNN takes per row the start (`offsets`, [B, M+1]) and length (`lengths`, [B, M]) of at most M
documents, unused entries -1; JAX turns them into cuDNN's ragged offsets. M is a static cap: a
row with more than M documents would be cut short, so such rows take the fallback kernel
instead (`lax.cond`, decided on the device per call). Padding (segment id 0) lies in no
document; its output and its Q/K/V gradients are set to zero here, whatever cuDNN leaves there.

cuDNN's cost grows with M as well as with the documents' work: it treats each of the B x M
slots as a sequence as long as the row. Measured on an H100 (jax 0.11.2, cuDNN 9.19, bf16,
32/8 heads of 128, forward + backward of an 8K row of 256-token documents): 2.36 ms at M = 48,
4.14 ms at M = 128, and at M = 512 a 129 GiB workspace (`docs/measurements/h100-2026-11-27/`).
So the cap is the step's own (`hotjax.step.document_cap`: its rows' most documents, rounded up
to a power of two), and `hotjax.models.attention.choose_backend` gives cuDNN only rows of long
documents.

Two facts of JAX decide where this runs at all (`cudnn_packed_support`): the packed layout
needs Hopper or later and 16-bit inputs, and until jax PR 39521 (merged 2026-07-29) JAX scaled
the K/V offsets by the query head count, silently wrong under grouped-query attention (jax
0.10.2 has the bug; 0.11.2 passed the GQA check on an H100).

Letters as in `hotjax.models.attention`; M documents per row at most.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array
# cuDNN's packed layout pays where a row holds at most one document per this many tokens;
# also the cap where the step's own is not known (rows past it run the fallback).
CUDNN_TOKENS_PER_DOCUMENT = 1024
# Against the fallback's FA2-split backward, the most documents a row's cap may hold for
# cuDNN's packed layout to pay (measured paying at 4, losing at 16; 8 not measured).
CUDNN_OVER_FA2_DOCUMENTS = 4
# Its workspace: about 8 bytes per (row, slot, token, query head, head dim), an fp32 dQ per
# slot it seems (129.6 GiB asked for one 32K row, M = 128, 32 heads of 128, on an H100). A
# micro-step whose workspace would pass the limit takes the fallback: no plan prices it.
WORKSPACE_BYTES_PER_ELEMENT = 8
WORKSPACE_LIMIT = 4 << 30


def workspace_bytes(rows: int, seq_len: int, documents: int, heads: int, head_dim: int) -> int:
    """The bytes cuDNN's packed layout asks for one device's rows, `documents` slots each."""
    return WORKSPACE_BYTES_PER_ELEMENT * rows * documents * seq_len * heads * head_dim


def cudnn_pays(seq_len: int, documents: int, workspace: int,
               fallback: str = "two-loop") -> bool:
    """Whether rows of `seq_len` tokens and at most `documents` documents (0: not known) run
    faster on cuDNN's packed layout than on the fallback kernel under its `fallback` backward
    (`hotjax.models.packed_attention.default_backward`), within the workspace limit. On an H100,
    against the two-loop backward: 1.5-2x faster for rows of 2K-token documents or one document,
    slower for 256-token ones (`docs/measurements/h100-2026-11-27/`). Against FA2-split's
    (`docs/measurements/h100-2026-11-27e/`): 1.14x faster at a cap of 4 documents (8K rows of
    2K-token documents), 1.08x slower at 16 (32K rows of them), so only up to
    `CUDNN_OVER_FA2_DOCUMENTS`."""
    return documents > 0 and documents * CUDNN_TOKENS_PER_DOCUMENT <= seq_len and \
        workspace <= WORKSPACE_LIMIT and (fallback == "two-loop"
                                          or documents <= CUDNN_OVER_FA2_DOCUMENTS)


def max_documents(seq_len: int) -> int:
    """The cap M of documents per row of `seq_len` tokens where the step's own is not known
    (at least 2, the packed layout's minimum)."""
    return max(2, seq_len // CUDNN_TOKENS_PER_DOCUMENT)


def document_runs(segment_ids_BxT, max_docs: int):
    """(lengths [B, M], offsets [B, M+1], count [B]), int32: each row's runs of one non-zero
    segment id (its documents) in row order, unused entries -1, and how many runs the row has
    (more than M: the row does not fit). NumPy in, NumPy out."""
    xp = np if isinstance(segment_ids_BxT, np.ndarray) else jnp
    seg = segment_ids_BxT
    B, T = seg.shape
    edge = xp.zeros((B, 1), seg.dtype)
    before = xp.concatenate([edge, seg[:, :-1]], axis=1)
    after = xp.concatenate([seg[:, 1:], edge], axis=1)
    starts = (seg > 0) & (seg != before)
    ends = (seg > 0) & (seg != after)
    count = starts.sum(axis=1).astype(np.int32)
    first_BxM, last_BxM = _first_columns(starts, max_docs), _first_columns(ends, max_docs)
    used = first_BxM >= 0
    lengths = xp.where(used, last_BxM - first_BxM + 1, -1).astype(np.int32)
    offsets = xp.concatenate([first_BxM, xp.full((B, 1), -1, np.int32)], axis=1)
    return lengths, offsets.astype(np.int32), count


def _first_columns(flags_BxT, m: int):
    """[B, m]: the columns of each row's first m set flags, -1 past the last."""
    if isinstance(flags_BxT, np.ndarray):
        out = np.full((flags_BxT.shape[0], m), -1, np.int32)
        for b, row in enumerate(flags_BxT):
            cols = np.flatnonzero(row)[:m]
            out[b, :len(cols)] = cols
        return out
    return jax.vmap(lambda row: jnp.nonzero(row, size=m, fill_value=-1)[0])(
        flags_BxT).astype(jnp.int32)


def runs_mask(lengths_BxM, offsets_BxM1, seq_len: int) -> np.ndarray:
    """[B, T, T] bool, on the host: what cuDNN's packed causal layout lets query t see — key s
    in the same run, not after t. The conversion's test compares it with the document mask."""
    B = lengths_BxM.shape[0]
    mask = np.zeros((B, seq_len, seq_len), bool)
    for b in range(B):
        for start, length in zip(offsets_BxM1[b, :-1], lengths_BxM[b], strict=True):
            if length > 0:
                run = slice(start, start + length)
                mask[b, run, run] = np.tril(np.ones((length, length), bool))
    return mask


@functools.cache
def gqa_offsets_fixed() -> bool:
    """Whether the installed JAX scales packed K/V offsets by the K/V head count (jax PR 39521);
    before it, by the query head count, wrong when they differ."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    fix = getattr(cudnn, "_fix_seqlen_offsets", None)
    if fix is None:
        return True  # rewritten since: the bug lived in this function
    return "kv_offsets * N * H" not in inspect.getsource(fix)


def cudnn_packed_support(dtype, compute_capability: int | None) -> str | None:
    """Why cuDNN's packed layout cannot run here (None: it can). `dtype`: the inputs' (None:
    not known); `compute_capability`: the GPU's major version, None when not known (a
    deviceless compile for a named target)."""
    if not gqa_offsets_fixed():
        return f"jax {jax.__version__} places packed K/V wrongly under GQA (fixed by jax " \
               f"PR 39521, in jax 0.11.2): upgrade jax for cuDNN's packed attention"
    if dtype is not None and jnp.dtype(dtype).itemsize != 2:
        return f"cuDNN's packed layout takes 16-bit inputs, not {jnp.dtype(dtype).name}"
    if compute_capability is not None and compute_capability < 9:
        return f"cuDNN's packed layout needs Hopper or later (compute capability " \
               f"{compute_capability})"
    return None


def cudnn_packed_attention(q_BxTxNxH: Array, k_BxTxKxH: Array, v_BxTxKxH: Array,
                           segment_ids_BxT: Array, *, fallback: Callable[..., Array],
                           max_docs: int = 0) -> Array:
    """Attention under the document-causal mask of packed rows (each document one run, segment
    id 0 padding), [B, T, N, H] in q's dtype; rows of more than `max_docs` documents (0:
    `max_documents`) run `fallback(q, k, v, segment_ids)` instead."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    T, H = q_BxTxNxH.shape[1], q_BxTxNxH.shape[3]
    max_docs = max_docs or max_documents(T)
    lengths_BxM, offsets_BxM1, count_B = document_runs(segment_ids_BxT, max_docs)
    real_BxTx1x1 = (segment_ids_BxT > 0)[:, :, None, None]
    # Zeroing the inputs at padding makes their gradients there zero: cuDNN writes none.
    q, k, v = (jnp.where(real_BxTx1x1, x, 0) for x in (q_BxTxNxH, k_BxTxKxH, v_BxTxKxH))

    def cudnn(q, k, v, _):
        return dot_product_attention(q, k, v, q_seqlen=lengths_BxM, kv_seqlen=lengths_BxM,
                                     q_offsets=offsets_BxM1, kv_offsets=offsets_BxM1,
                                     scale=H ** -0.5, mask_type=MaskType.CAUSAL)

    out_BxTxNxH = lax.cond(jnp.all(count_B <= max_docs), cudnn, fallback, q, k, v,
                           segment_ids_BxT)
    return jnp.where(real_BxTx1x1, out_BxTxNxH, 0).astype(q_BxTxNxH.dtype)
