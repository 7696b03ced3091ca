"""JAX's persistent compilation cache: on by default, so a step compiles once per machine."""

from __future__ import annotations

from pathlib import Path

import jax

from hotjax import cache_root


def enable_compilation_cache(path: str | Path | None = None) -> Path:
    """Cache compiled programs under `path` (default: `$HOTJAX_CACHE/jax`)."""
    path = Path(path) if path else cache_root() / "jax"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
