"""cuDNN's packed attention without a GPU: the documents handed to it equal the document mask,
the wrapper around it (padding, the document cap's fallback) equals dense attention when a
reference stands in for cuDNN, and each micro-step's kernel is chosen by what pays."""

import dataclasses

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import TOLERANCE, packed_rows, qkv, values_and_grads

import hotjax.models.cudnn_attention as cudnn_attention
from hotjax.models.attention import choose_backend, dense_attention
from hotjax.models.cudnn_attention import (
    WORKSPACE_LIMIT,
    cudnn_packed_attention,
    document_runs,
    runs_mask,
    workspace_bytes,
)
from hotjax.sharding.strategy import Strategy
from hotjax.step import BucketStep, document_cap


def document_mask(segment_ids_BxT: np.ndarray, positions_BxT: np.ndarray) -> np.ndarray:
    return ((segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :])
            & (segment_ids_BxT[:, :, None] > 0)
            & (positions_BxT[:, None, :] <= positions_BxT[:, :, None]))


def test_the_documents_handed_to_cudnn_are_the_document_mask():
    segment_ids_BxT, positions_BxT = packed_rows(4, 256, [1, 7, 40, 300], padding_rows=1)
    cap = document_cap(segment_ids_BxT)
    lengths, offsets, count = document_runs(segment_ids_BxT, cap)
    np.testing.assert_array_equal(runs_mask(lengths, offsets, 256),
                                  document_mask(segment_ids_BxT, positions_BxT))
    assert count.tolist() == [len(set(row[row > 0])) for row in segment_ids_BxT]
    on_device = document_runs(jnp.asarray(segment_ids_BxT), cap)
    for host, device in zip((lengths, offsets, count), on_device, strict=True):
        np.testing.assert_array_equal(host, np.asarray(device))


def test_unused_document_slots_are_minus_one_and_a_row_past_the_cap_is_counted():
    segment_ids = np.array([[1, 1, 2, 0, 3, 3, 0, 0], [0] * 8], np.int32)
    lengths, offsets, count = document_runs(segment_ids, 2)
    assert lengths.tolist() == [[2, 1], [-1, -1]]
    assert offsets.tolist() == [[0, 2, -1], [-1, -1, -1]]
    assert count.tolist() == [3, 0]


@pytest.mark.parametrize("documents, cap", [(0, 2), (1, 2), (3, 4), (4, 4), (5, 8), (33, 64)])
def test_the_document_cap_is_a_power_of_two(documents, cap):
    segment_ids = np.zeros((2, 128), np.int32)
    segment_ids[1, :documents] = np.arange(1, documents + 1)
    assert document_cap(segment_ids) == cap


def packed_reference(query, key, value, q_seqlen, kv_seqlen, q_offsets, kv_offsets, *,
                     scale, mask_type):
    """What cuDNN's packed causal layout computes, from its lengths and offsets alone."""
    assert mask_type.name == "CAUSAL"
    T = query.shape[1]
    columns = jnp.arange(T)
    starts, ends = q_offsets[:, :-1, None], q_offsets[:, :-1, None] + q_seqlen[:, :, None]
    run_BxT = jnp.argmax((columns >= starts) & (columns < ends) & (q_seqlen[:, :, None] > 0),
                         axis=1)
    inside_BxT = jnp.any((columns >= starts) & (columns < ends) & (q_seqlen[:, :, None] > 0),
                         axis=1)
    segment_BxT = jnp.where(inside_BxT, run_BxT + 1, 0)
    out = dense_attention(query, key, value, segment_BxT, jnp.broadcast_to(columns, (1, T)))
    return out * (query.shape[-1] ** -0.5 / scale)  # a wrong scale shows


@pytest.fixture
def reference_cudnn(monkeypatch):
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "dot_product_attention", packed_reference)


@pytest.mark.parametrize("own_cap", [True, False])
def test_the_cudnn_wrapper_equals_dense_attention(reference_cudnn, own_cap):
    """GQA, padding inside and after rows, documents across every edge. Under the rows' own
    document cap cuDNN's branch computes them (the fallback here answers zeros); under a cap
    they overflow, the fallback does (the stand-in would miss the documents past the cap)."""
    segment_ids_BxT, positions_BxT = packed_rows(2, 64, [5, 9, 30])
    segment_ids_BxT[0, 20:23] = 0
    positions_BxT[0, 20:23] = 0
    q, k, v = qkv(2, 64, 4, 2)
    seg, pos = jnp.asarray(segment_ids_BxT), jnp.asarray(positions_BxT)
    cap = document_cap(segment_ids_BxT) if own_cap else 2

    def fallback(q, k, v, segment_ids):
        return jnp.zeros_like(q) if own_cap else dense_attention(q, k, v, segment_ids, pos)

    def ours(q, k, v):
        return cudnn_packed_attention(q, k, v, seg, fallback=fallback, max_docs=cap)

    out, grads = values_and_grads(ours, q, k, v, seg)
    want = values_and_grads(lambda q, k, v: dense_attention(q, k, v, seg, pos), q, k, v, seg)
    for a, b in zip(jax.tree.leaves((out, grads)), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOLERANCE, rtol=TOLERANCE)
    padding = segment_ids_BxT == 0
    for x in (out, *grads):
        assert not np.asarray(x)[padding].any()


@pytest.fixture
def jax_fixed(monkeypatch):
    monkeypatch.setattr(cudnn_attention, "gqa_offsets_fixed", lambda: True)


@pytest.mark.parametrize("requested, dtype, capability, documents, workspace, kernel, note", [
    # Rows of long documents (at most one per 1,024 tokens): cuDNN.
    ("auto", "bfloat16", 9, 8, 0, "cudnn", None),
    ("auto", "float16", None, 2, 0, "cudnn", None),  # a deviceless target: capability unknown
    # Short documents, an unknown count, a workspace past the limit: the Pallas kernel.
    ("auto", "bfloat16", 9, 16, 0, "pallas", None),
    ("auto", "bfloat16", 9, 0, 0, "pallas", None),
    ("auto", "bfloat16", 9, 2, WORKSPACE_LIMIT + 1, "pallas", None),
    # What cuDNN's packed layout cannot take.
    ("auto", "float32", 9, 2, 0, "pallas", None),
    ("auto", "bfloat16", 8, 2, 0, "pallas", None),
    ("cudnn", "float32", 9, 2, 0, "pallas",
     "cuDNN's packed layout takes 16-bit inputs, not float32"),
    ("cudnn", "bfloat16", 8, 2, 0, "pallas",
     "cuDNN's packed layout needs Hopper or later (compute capability 8)"),
    # Asked for by name, it runs whatever the documents (rows past its cap fall back).
    ("cudnn", "bfloat16", 9, 64, 0, "cudnn", None),
    ("pallas", "bfloat16", 9, 2, 0, "pallas", None),
])
def test_cudnn_runs_packed_rows_where_it_pays(jax_fixed, requested, dtype, capability,
                                               documents, workspace, kernel, note):
    assert choose_backend(requested, "gpu", ring=False, packed=True, seq_len=8192, dtype=dtype,
                          documents=documents, workspace=workspace,
                          capability=capability) == (kernel, note)


@pytest.mark.parametrize("head_dim, documents, seq_len, kernel", [
    (128, 4, 8192, "cudnn"),  # measured 1.14x the FA2-split fallback (8K rows, 2K documents)
    (128, 16, 32768, "pallas"),  # measured 0.92x it (32K rows of 2K-token documents)
    (128, 8, 8192, "pallas"),  # past the cap measured to pay
    (64, 8, 8192, "cudnn"),  # the two-loop fallback there: the documents' rule alone
    (0, 8, 8192, "cudnn"),  # head dim not known: as against the two-loop fallback
])
def test_cudnn_pays_against_the_fallbacks_own_backward(jax_fixed, head_dim, documents, seq_len,
                                                       kernel):
    """Against the fallback's FA2-split backward (16-bit heads of 128) cuDNN's packed layout
    takes rows of at most `CUDNN_OVER_FA2_DOCUMENTS` documents; against the two-loop one, any
    row of long documents."""
    assert choose_backend("auto", "gpu", ring=False, packed=True, seq_len=seq_len,
                          dtype="bfloat16", documents=documents, capability=9,
                          head_dim=head_dim) == (kernel, None)


def test_a_ring_and_other_platforms_never_take_cudnns_packed_layout(jax_fixed):
    assert choose_backend("auto", "gpu", ring=True, packed=True, seq_len=8192, dtype="bfloat16",
                          documents=2) == ("pallas-ring", None)
    assert choose_backend("auto", "cpu", ring=False, packed=True, seq_len=8192,
                          dtype="bfloat16", documents=2) == ("blockwise", None)


def test_a_jax_that_misplaces_gqa_offsets_keeps_the_pallas_kernel(monkeypatch):
    monkeypatch.setattr(cudnn_attention, "gqa_offsets_fixed", lambda: False)
    kernel, note = choose_backend("cudnn", "gpu", ring=False, packed=True, seq_len=8192,
                                  dtype="bfloat16", documents=2, capability=9)
    assert kernel == "pallas" and "upgrade jax" in note
    assert choose_backend("auto", "gpu", ring=False, packed=True, seq_len=8192,
                          dtype="bfloat16", documents=2, capability=9) == ("pallas", None)


def test_the_installed_jax_is_read_for_the_gqa_fix():
    """jax 0.10.2 scales packed K/V offsets by the query heads (the bug); 0.11.2 does not."""
    version = tuple(int(x) for x in jax.__version__.split(".")[:2])
    if version <= (0, 10):
        assert not cudnn_attention.gqa_offsets_fixed()
    elif version >= (0, 11):
        assert cudnn_attention.gqa_offsets_fixed()


def test_the_workspace_is_eight_bytes_a_slot_element():
    """129.6 GiB asked for one 32K row of 128 slots, 32 heads of 128 (an H100)."""
    assert workspace_bytes(1, 32768, 128, 32, 128) / 2**30 == pytest.approx(128, rel=0.02)


def test_only_a_gpu_bucket_off_the_ring_compiles_per_document_cap(devices):
    config = dataclasses.replace(helpers.TINY, vocab_size=256)
    arrays = {"segment_ids": np.array([[1, 1, 2, 3, 0, 0, 0, 0]], np.int32)}
    step = BucketStep(config, Strategy.parse("data=8"), tuple(devices))
    assert step.documents(arrays) == 0  # the CPU's kernel does not depend on them
    step.by_documents = True
    assert step.documents(arrays) == 4
