"""Bounds on values read from files a stranger may have written, checked before they cost memory:
JSON's size and depth, numbers' types and ranges, a LLaMA config's fields, tensors' values.
Free of JAX imports."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from models.errors import UserError
from models.options import ATTENTION_BACKENDS, REMAT_POLICIES

# A metadata or config file is a few KiB (a checkpoint's fingerprints, a strategy table, an HF
# config): 16 MiB is far past any real one and still cheap to parse.
MAX_JSON_BYTES = 16 * 2**20
# Real metadata nests 5 deep at most; Python's parser gives up near 1000, and code walking a
# deeper value would exhaust the stack.
MAX_JSON_DEPTH = 64
# Text shown of a bad value in a message: enough to recognise it, never a whole file.
_SHOWN_CHARS = 40

# Per field of a model, the largest value any LLaMA-like model uses, with wide margin (Llama
# 3.1 405B: dim 16384, 126 layers, 128 heads of 128, ffn 53248; vocabularies up to ~2^18;
# contexts up to ~2^23): larger claims are errors or attacks, refused before any shape is built.
MAX_VOCAB = 2**24
MAX_DIM = 2**17
MAX_LAYERS = 2**12
MAX_HEADS = 2**12
MAX_HEAD_DIM = 2**12
MAX_FFN = 2**20
MAX_SEQ_LEN = 2**24
# Steps are int32 on the devices (the train state's step, optax's Adam count).
MAX_STEP = 2**31 - 1
# Whole numbers that count documents, tokens or bytes: past any real corpus, inside int64.
MAX_COUNT = 2**62
# A model one of whose parameters (fp32, stacked over its layers) exceeds the host's memory
# cannot be initialised, imported or exported here: those hold a whole parameter at a time.
PARAM_BYTES = 4

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# `models.llama.RopeScaling`'s fields and defaults (a test holds the two equal).
ROPE_DEFAULTS: dict[str, float | int] = {"factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}
# `models.llama.LlamaConfig`'s fields (a test holds the two equal): the required ones, then
# those with defaults.
MODEL_REQUIRED = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")
MODEL_OPTIONAL = ("head_dim", "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings",
                  "max_seq_len", "compute_dtype", "remat", "attention", "attention_block",
                  "attention_documents", "pipeline_schedule")


def host_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def show(value: Any) -> str:
    """A bad value as a message shows it: short, one line, whatever its size or nesting."""
    if isinstance(value, list | tuple | dict | set):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"a {value.bit_length()}-bit integer"
    if isinstance(value, str | bytes) and len(value) > _SHOWN_CHARS:
        return f"{value[:_SHOWN_CHARS]!r}... ({len(value):,} long)"
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return repr(value)
    return f"a {type(value).__name__}"


def whole(value: Any, name: str, low: int, high: int, where: str, fix: str) -> int:
    """`value` if it is a whole number (not a bool, a float or a string) from low to high."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{where}: {name} is {show(value)}, not a whole number: {fix}")
    if not low <= value <= high:
        raise UserError(f"{where}: {name} is {show(value)}, outside {low:,} to {high:,}: {fix}")
    return value


def real(value: Any, name: str, where: str, fix: str, *, low: float = 0.0,
         high: float = math.inf) -> float:
    """`value` as a float if it is a finite number (an int or a float, not a bool) above `low`
    and below `high`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"{where}: {name} is {show(value)}, not a number: {fix}")
    try:
        number = float(value)
    except OverflowError:  # an int past a float's range
        number = math.inf
    if not (math.isfinite(number) and low < number < high):
        limits = ([f"above {low:g}"] if low > -math.inf else []) + (
            [f"below {high:g}"] if high < math.inf else [])
        within = " and ".join(limits)
        raise UserError(f"{where}: {name} is {show(value)}, not a finite number"
                        f"{' ' + within if within else ''}: {fix}")
    return number


def finite(x: np.ndarray, what: str, fix: str, source: np.ndarray | None = None) -> None:
    """Refuses the array `x` (a tensor as training holds it) unless every element is a finite
    number; `source`, the array it was cast from, tells values the cast overflowed. One pass
    of float64 sums (which no float32 overflows), no copy of `x`."""
    if math.isfinite(float(np.sum(x, dtype=np.float64))):
        return
    nan, infinite = _non_finite(x)
    kinds = [f"{n:,} {kind}" for n, kind in ((nan, "NaN"), (infinite, "infinite")) if n]
    if source is not None and source.dtype != x.dtype:
        past = nan + infinite - sum(_non_finite(source))
        if past:
            kinds.append(f"{past:,} of them finite in {source.dtype} but past {x.dtype}'s "
                         f"range")
    raise UserError(f"{what}: {nan + infinite:,} of its {x.size:,} values not finite "
                    f"({', '.join(kinds)}): {fix}")


def _non_finite(x: np.ndarray, chunk: int = 2**22) -> tuple[int, int]:
    """(NaN, infinite) element counts of `x`, a chunk at a time."""
    flat = x.reshape(-1)
    nan = infinite = 0
    for start in range(0, flat.size, chunk):
        part = flat[start:start + chunk]
        nan += int(np.count_nonzero(np.isnan(part)))
        infinite += int(np.count_nonzero(np.isinf(part)))
    return nan, infinite


def text(value: Any, name: str, where: str, fix: str, *, choices: tuple[str, ...] = (),
         limit: int = 4096) -> str:
    """`value` if it is a string of at most `limit` characters (one of `choices`, if any)."""
    if not isinstance(value, str) or len(value) > limit:
        raise UserError(f"{where}: {name} is {show(value)}, not a string of at most {limit} "
                        f"characters: {fix}")
    if choices and value not in choices:
        raise UserError(f"{where}: {name} is {show(value)}, not one of {', '.join(choices)}: "
                        f"{fix}")
    return value


def mapping(value: Any, name: str, where: str, fix: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise UserError(f"{where}: {name} is {show(value)}, not an object: {fix}")
    return value


def read_json(file: Path, what: str, fix: str, limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in `file`, read only if it holds at most `limit` bytes and nests at most
    MAX_JSON_DEPTH deep; else one line naming the file and the bound."""
    try:
        with open(file, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise UserError(f"{file}: cannot read its {what} ({e.strerror}): {fix}") from None
    if len(raw) > limit:
        raise UserError(f"{file}: its {what} is over {limit:,} bytes (MAX_JSON_BYTES), more "
                        f"than any real one: {fix}")
    return parse_json(raw, str(file), what, fix)


def parse_json(raw: str | bytes, where: str, what: str, fix: str) -> Any:
    """JSON text parsed, its nesting at most MAX_JSON_DEPTH deep."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise UserError(f"{where}: its {what} nests deeper than {MAX_JSON_DEPTH} levels "
                        f"(MAX_JSON_DEPTH): {fix}") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, or an int of 4300+ digits
        reason = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{where}: its {what} is not valid JSON ({reason}): {fix}") from None
    if depth(value) > MAX_JSON_DEPTH:
        raise UserError(f"{where}: its {what} nests deeper than {MAX_JSON_DEPTH} levels "
                        f"(MAX_JSON_DEPTH): {fix}")
    return value


def depth(value: Any) -> int:
    """How deep lists and dicts nest in `value` (a scalar: 0), found without recursion, and no
    further than one level past MAX_JSON_DEPTH."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = (node.values() if isinstance(node, dict)
                    else node if isinstance(node, list | tuple) else None)
        if children is None:
            continue
        deepest = max(deepest, level)
        if level > MAX_JSON_DEPTH:
            break
        stack.extend((child, level + 1) for child in children)
    return deepest


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
    unknown = [str(k)[:_SHOWN_CHARS] for k in fields if k not in MODEL_REQUIRED + MODEL_OPTIONAL]
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
    unknown = [str(k)[:_SHOWN_CHARS] for k in scaling if k not in ROPE_DEFAULTS]
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
