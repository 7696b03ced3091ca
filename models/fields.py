"""A LLaMA config's fields read from a file a stranger may have written, checked for type and
range before any shape is built. Free of JAX imports."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hotjax.bounds import (
    MAX_JSON_DEPTH,
    MAX_SEQ_LEN,
    MAX_VOCAB,
    PARAM_BYTES,
    SHOWN_CHARS,
    depth,
    host_memory,
    mapping,
    real,
    show,
    text,
    whole,
)
from hotjax.choices import ATTENTION_BACKENDS, REMAT_POLICIES
from hotjax.errors import UserError

# Per field of a model, the largest value any LLaMA-like model uses, with wide margin (Llama
# 3.1 405B: dim 16384, 126 layers, 128 heads of 128, ffn 53248; vocabularies up to ~2^18;
# contexts up to ~2^23): larger claims are errors or attacks, refused before any shape is built.
MAX_DIM = 2**17
MAX_LAYERS = 2**12
MAX_HEADS = 2**12
MAX_HEAD_DIM = 2**12
MAX_FFN = 2**20
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# `hotjax.models.llama.RopeScaling`'s fields and defaults (a test holds the two equal).
ROPE_DEFAULTS: dict[str, float | int] = {"factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}
# `hotjax.models.llama.LlamaConfig`'s fields (a test holds the two equal): the required ones, then
# those with defaults.
MODEL_REQUIRED = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")
MODEL_OPTIONAL = ("head_dim", "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings",
                  "max_seq_len", "compute_dtype", "remat", "attention", "attention_block",
                  "attention_documents", "pipeline_schedule", "scan_unroll")


def check_model(fields: Any, where: str, fix: str, names: Mapping[str, str] | None = None, *,
                fits_host: bool = True) -> dict[str, Any]:
    """The fields of a `LlamaConfig` read from a file, checked for type, range and the
    divisibility of heads, and (unless not `fits_host`: the caller builds no parameter) for a
    largest parameter that fits this host's memory; returned with reals as floats. `names`
    maps a field to what the file calls it, for messages."""
    names = names or {}

    def name(field: str) -> str:
        return names.get(field, field)

    fields = mapping(fields, "the model", where, fix)
    if depth(fields) > MAX_JSON_DEPTH:
        raise UserError(f"{where}: the model nests deeper than {MAX_JSON_DEPTH} levels "
                        f"(MAX_JSON_DEPTH): {fix}")
    unknown = [str(k)[:SHOWN_CHARS] for k in fields if k not in MODEL_REQUIRED + MODEL_OPTIONAL]
    missing = [name(k) for k in MODEL_REQUIRED if k not in fields]
    if unknown or missing:
        problem = (f"lacks {', '.join(missing)}" if missing
                   else f"has unknown fields {', '.join(unknown[:4])}")
        raise UserError(f"{where}: the model {problem}: {fix}")
    out = dict(fields)
    for field, high in (("vocab_size", MAX_VOCAB), ("dim", MAX_DIM), ("n_layers", MAX_LAYERS),
                        ("n_heads", MAX_HEADS), ("ffn_dim", MAX_FFN)):
        out[field] = whole(fields[field], name(field), 1, high, where, fix)
    heads = out["n_heads"]
    out["n_kv_heads"] = whole(fields["n_kv_heads"], name("n_kv_heads"), 1, heads, where, fix)
    if heads % out["n_kv_heads"]:
        raise UserError(f"{where}: {name('n_heads')} ({heads}) is not a multiple of "
                        f"{name('n_kv_heads')} ({out['n_kv_heads']}): {fix}")
    if fields.get("head_dim") is None and out["dim"] < heads:
        raise UserError(f"{where}: {name('dim')} ({out['dim']}) is less than {name('n_heads')} "
                        f"({heads}), so a head has no dimensions: {fix}")
    if fields.get("head_dim") is not None:
        whole(fields["head_dim"], name("head_dim"), 1, MAX_HEAD_DIM, where, fix)
    for field, low in (("max_seq_len", 1), ("attention_block", 0), ("attention_documents", 0)):
        if field in fields:
            whole(fields[field], name(field), low, MAX_SEQ_LEN, where, fix)
    if "scan_unroll" in fields:
        whole(fields["scan_unroll"], name("scan_unroll"), 0, MAX_LAYERS, where, fix)
    if "rope_theta" in fields:
        out["rope_theta"] = real(fields["rope_theta"], name("rope_theta"), where, fix)
    if "norm_eps" in fields:
        out["norm_eps"] = real(fields["norm_eps"], name("norm_eps"), where, fix, high=1.0)
    if "tie_embeddings" in fields and not isinstance(fields["tie_embeddings"], bool):
        raise UserError(f"{where}: {name('tie_embeddings')} is {show(fields['tie_embeddings'])},"
                        f" not true or false: {fix}")
    for field, choices in (("compute_dtype", COMPUTE_DTYPES), ("attention", ATTENTION_BACKENDS),
                           ("pipeline_schedule", ())):
        if field in fields:
            text(fields[field], name(field), where, fix, choices=choices, limit=64)
    if "remat" in fields and not isinstance(fields["remat"], bool):  # a bool: written by old
        text(fields["remat"], name("remat"), where, fix, choices=REMAT_POLICIES)  # hotjax
    if fields.get("rope_scaling") is not None:
        out["rope_scaling"] = _rope_scaling(fields["rope_scaling"], name("rope_scaling"), where,
                                            fix)
    if fits_host:
        _check_size(out, where, fix)
    return out


def _rope_scaling(value: Any, name: str, where: str, fix: str) -> dict[str, Any]:
    scaling = mapping(value, name, where, fix)
    unknown = [str(k)[:SHOWN_CHARS] for k in scaling if k not in ROPE_DEFAULTS]
    if unknown:
        raise UserError(f"{where}: {name} has unknown fields {', '.join(unknown[:4])}: {fix}")
    out = {**ROPE_DEFAULTS, **scaling}
    for field in ("factor", "low_freq_factor", "high_freq_factor"):
        out[field] = real(out[field], f"{name}.{field}", where, fix)
    whole(out["original_max_position_embeddings"], f"{name}.original_max_position_embeddings",
          1, MAX_SEQ_LEN, where, fix)
    if out["high_freq_factor"] <= out["low_freq_factor"]:  # Llama 3 divides by their gap
        raise UserError(f"{where}: {name}.high_freq_factor ({out['high_freq_factor']:g}) is "
                        f"not above low_freq_factor ({out['low_freq_factor']:g}): {fix}")
    return {k: out[k] for k in scaling}


def _check_size(fields: dict[str, Any], where: str, fix: str) -> None:
    """The largest parameter (fp32, stacked over the layers) fits this host's memory."""
    layers, dim, ffn = fields["n_layers"], fields["dim"], fields["ffn_dim"]
    head_dim = fields.get("head_dim") or dim // fields["n_heads"]
    largest = max(layers * dim * fields["n_heads"] * head_dim, layers * dim * ffn,
                  fields["vocab_size"] * dim) * PARAM_BYTES
    memory = host_memory()
    if largest > memory:
        raise UserError(f"{where}: the model's largest parameter alone would take "
                        f"{largest / 2**30:,.1f} GiB, more than this machine's "
                        f"{memory / 2**30:,.1f} GiB of memory: {fix}")
