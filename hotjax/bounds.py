"""Bounds on values read from files a stranger may have written, checked before they cost memory:
JSON's size and depth, numbers' types and ranges, tensors' values (a LLaMA config's fields:
`hotjax.models.fields`). Free of JAX imports."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hotjax.errors import UserError

# A metadata or config file is a few KiB (a checkpoint's fingerprints, a strategy table, an HF
# config): 16 MiB is far past any real one and still cheap to parse.
MAX_JSON_BYTES = 16 * 2**20
# Real metadata nests 5 deep at most; Python's parser gives up near 1000, and code walking a
# deeper value would exhaust the stack.
MAX_JSON_DEPTH = 64
# Text shown of a bad value in a message: enough to recognise it, never a whole file.
SHOWN_CHARS = 40

# The largest vocabulary and sequence any LLaMA-like model uses, with wide margin
# (vocabularies up to ~2^18, contexts up to ~2^23): larger claims are errors or attacks.
MAX_VOCAB = 2**24
MAX_SEQ_LEN = 2**24
# Steps are int32 on the devices (the train state's step, optax's Adam count).
MAX_STEP = 2**31 - 1
# Whole numbers that count documents, tokens or bytes: past any real corpus, inside int64.
MAX_COUNT = 2**62
# A model one of whose parameters (fp32, stacked over its layers) exceeds the host's memory
# cannot be initialised, imported or exported here: those hold a whole parameter at a time.
PARAM_BYTES = 4

def host_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def show(value: Any) -> str:
    """A bad value as a message shows it: short, one line, whatever its size or nesting."""
    if isinstance(value, list | tuple | dict | set):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"a {value.bit_length()}-bit integer"
    if isinstance(value, str | bytes) and len(value) > SHOWN_CHARS:
        return f"{value[:SHOWN_CHARS]!r}... ({len(value):,} long)"
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
