"""hotjax: hot-switched parallelism for LLaMA training on mixed-length data."""

import os
from pathlib import Path

__version__ = "0.1.0"


def cache_root() -> Path:
    """Where hotjax keeps trained tokenizers and compiled programs: `$HOTJAX_CACHE`."""
    return Path(os.environ.get("HOTJAX_CACHE", "~/.cache/hotjax")).expanduser()


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
