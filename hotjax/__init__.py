"""hotjax: hot-switched parallelism for LLaMA training on mixed-length data.

The library a training script uses (see `examples/train_llama.py`):

    import hotjax

    devices = hotjax.start_jax(8)   # first: settles the device count, the compilation cache
    run = hotjax.Run(model, table, optax.adamw(1e-3), batches, devices=devices)  # from parts
    run = hotjax.Run.from_config(hotjax.RunConfig(model="tiny"), devices=devices)  # or options
    state = run.init()
    state, metrics = run.step(state)  # returns at once; metrics["loss"] waits for the step

Importing `hotjax` starts nothing: JAX and the library load on first use of `Run`,
`resumed_config`, `StrategyTable`, `Bucket`, `Strategy`, `load_table`, `LlamaConfig` or
`OptimConfig`; `RunConfig` and `start_jax` are free of JAX until called.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from hotjax.config import RunConfig, cache_root
from hotjax.startup import simulate_cpu_devices, start_jax
from hotjax.version import __version__

if TYPE_CHECKING:
    from hotjax.models.llama import LlamaConfig
    from hotjax.optim import OptimConfig
    from hotjax.run import Run, resumed_config
    from hotjax.sharding.strategy import Strategy
    from hotjax.sharding.table import Bucket, StrategyTable, load_table

# Public names -> the module that defines them (PEP 562: imported when first asked for).
_LAZY = {"Run": "hotjax.run", "resumed_config": "hotjax.run", "OptimConfig": "hotjax.optim",
         "LlamaConfig": "hotjax.models.llama", "StrategyTable": "hotjax.sharding.table",
         "Bucket": "hotjax.sharding.table", "load_table": "hotjax.sharding.table",
         "Strategy": "hotjax.sharding.strategy"}
__all__ = ["Bucket", "LlamaConfig", "OptimConfig", "Run", "RunConfig", "Strategy", "StrategyTable",
           "__version__", "cache_root", "load_table", "resumed_config", "simulate_cpu_devices",
           "start_jax"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hotjax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
