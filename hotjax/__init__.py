"""hotjax: hot-switched parallelism for LLaMA training on mixed-length data.

The library a training script uses (see `examples/train_llama.py`):

    import hotjax

    hotjax.start_jax(devices=8)   # first: settles the device count, the compilation cache
    with hotjax.Run(hotjax.RunConfig(model="tiny", strategies="auto")) as run:
        state, step = run.initial_state()
        state, metrics = run.step(state)

`Run`, `resumed_config`, `train`, `StrategyTable`, `Strategy` and `load_table` are imported on
first use, so that importing `hotjax` does not start JAX (`RunConfig` is free of it).
"""

import os

from hotjax.config import RunConfig, cache_root

__version__ = "0.1.0"

# Public names -> the module that defines them (PEP 562: imported when first asked for).
_LAZY = {"Run": "hotjax.run", "train": "hotjax.run", "resumed_config": "hotjax.run",
         "StrategyTable": "sharding.table", "load_table": "sharding.table",
         "Strategy": "sharding.strategy"}
__all__ = ["RunConfig", "cache_root", "simulate_cpu_devices", "start_jax", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hotjax' has no attribute {name!r}")


# Simulated CPU devices are threads sharing a few cores: on a loaded machine one of them can
# wait minutes at a collective, and XLA's default rendezvous timeout then aborts the process.
_PATIENT_CPU_COLLECTIVES = ("--xla_cpu_collective_timeout_seconds=3600",
                            "--xla_cpu_collective_call_terminate_timeout_seconds=3600",
                            "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300")


def simulate_cpu_devices(count: int) -> None:
    """Before JAX starts: `count` CPU devices (unless already set), with patient collectives.
    Only the CPU backend reads these, so on an accelerator they are inert."""
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(count))
    flags = os.environ.get("XLA_FLAGS", "")
    missing = [f for f in _PATIENT_CPU_COLLECTIVES if f.split("=")[0] not in flags]
    os.environ["XLA_FLAGS"] = " ".join([flags, *missing]).strip()


SIMULATED_CPU_DEVICES = 8


def start_jax(devices: int | None = None,
              processes: tuple[str | None, int | None, int | None, int] = (None, None, None, 30),
              ) -> None:
    """Call before anything else starts JAX: settles the device count, joins the other
    processes of a run of several, then turns on the persistent compilation cache.

    On a CPU-only machine `devices` (default 8) simulated devices are made; only the CPU
    backend reads the variable, and only before JAX starts, so on an accelerator it is inert.
    `processes` is (coordinator, process count, process id, heartbeat seconds), as `hotjax
    launch` passes them."""
    from hotjax.config import at_least

    at_least("--devices", devices, 1)
    at_least("--heartbeat-timeout", processes[3], 1)
    simulate_cpu_devices(devices or SIMULATED_CPU_DEVICES)
    from hotjax.targets import cpu_without_a_driver

    cpu_without_a_driver()
    from hotjax.planning.profile import set_allocator_fraction

    set_allocator_fraction()  # on a GPU, the memory plans count on (before the backend starts)
    from hotjax import distributed

    distributed.initialize(*processes)
    from hotjax.compile_cache import enable_compilation_cache

    enable_compilation_cache()
