"""Fingerprints of a checkpoint's arrays: one uint32 per array, the same whatever layout or
device count holds it, so that a restore on any mesh checks every array it reads.

Version 2 (`meta.FINGERPRINT_VERSION`) covers the array's dtype besides its bits, so that the
same bits read as another type do not match; version 1, written before, covers the bits alone.
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hotjax.checkpoint.dirs import array_path
from hotjax.checkpoint.meta import FINGERPRINT_VERSION as VERSION


def _salt(dtype: Any, version: int) -> int:
    return zlib.crc32(np.dtype(dtype).name.encode()) if version >= 2 else 0


def _words(x: Any, xp: Any) -> Any:
    """`x`'s bits as unsigned words of its item's size, or of 32 bits for a larger item (an
    8-byte item is two words, in memory order)."""
    size = x.dtype.itemsize
    if size <= 4:
        return x.reshape(-1).view({1: xp.uint8, 2: xp.uint16, 4: xp.uint32}[size])
    if xp is np:
        return np.ascontiguousarray(x).reshape(-1).view(np.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)


def _sum(x: Any, xp: Any = jnp, version: int = VERSION) -> Any:
    # Each word's bits times an odd weight set by its position, summed mod 2**32: integer
    # arithmetic is exact in any order, so every layout of the same values agrees, and any one
    # changed element changes the sum. `xp` is jax.numpy (on device) or numpy (on host).
    bits = _words(x, xp).astype(xp.uint32)
    index = xp.arange(bits.size, dtype=xp.uint32)
    return xp.sum(bits * (2 * index + 1), dtype=xp.uint32) + xp.uint32(_salt(x.dtype, version))


def of_host(x: np.ndarray, block: int = 1 << 20, version: int = VERSION) -> int:
    """`_sum` of a host array, a block of words at a time: the same sum (mod 2**32), without
    its temporaries of several times the array; with its dtype's salt (`version` 2)."""
    flat = _words(np.asarray(x), np)
    total = _salt(x.dtype, version)
    for start in range(0, flat.size, block):
        bits = flat[start:start + block].astype(np.uint32)
        index = np.arange(start, start + bits.size, dtype=np.uint32)
        total += int(np.sum(bits * (2 * index + 1), dtype=np.uint32))
    return total % 2**32


_on_devices = jax.jit(lambda leaves, version=VERSION: [_sum(x, jnp, version) for x in leaves],
                      static_argnames="version")


def values(leaves: list[Any], version: int = VERSION) -> list[int]:
    """The fingerprint of each array of `leaves`, device or host."""
    # Arrays in this process's host memory (numpy, or on its CPU devices) are read in place: on
    # CPU a compiled program would cost more than the arithmetic. Arrays spread over several
    # processes are summed where they live.
    if all(isinstance(x, np.ndarray) or (x.is_fully_addressable
                                         and {d.platform for d in x.devices()} == {"cpu"})
           for x in leaves):
        return [of_host(np.asarray(x), version=version) for x in leaves]
    return [int(v) for v in jax.device_get(_on_devices(leaves, version=version))]


def of_tree(tree: Any) -> dict[str, int]:
    """Each array's fingerprint, by path: computed where the arrays live, device or host."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    found = values([x for _, x in leaves])
    return {array_path(p): v for (p, _), v in zip(leaves, found, strict=True)}


def of_items(items: dict[str, Any]) -> dict[str, dict[str, int]]:
    """`of_tree` of several items at once (one computation), by item."""
    both = of_tree(items)
    return {item: {path.split("/", 1)[1]: v for path, v in both.items()
                   if path.split("/", 1)[0] == item} for item in items}
