"""JAX's persistent compilation cache: on by default on accelerators, so a step compiles once
per machine."""

from __future__ import annotations

import os
from pathlib import Path

import jax

from hotjax.config import cache_root


def enable_compilation_cache(path: str | Path | None = None) -> Path | None:
    """Cache compiled programs under `path` (default: `$HOTJAX_CACHE/jax`).

    Not on XLA:CPU with several (simulated) devices: there, multi-device executables loaded
    from the cache hung on their first run in about half of our trials (jax 0.10.2), while
    freshly compiled ones never did. Returns the cache directory, or None when off.
    `$HOTJAX_COMPILATION_CACHE`, where set, is the directory on every backend (the test suite
    shares one among its processes).
    """
    if forced := os.environ.get("HOTJAX_COMPILATION_CACHE"):
        path = forced
    elif jax.default_backend() == "cpu" and jax.device_count() > 1:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = Path(path) if path else cache_root() / "jax"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
