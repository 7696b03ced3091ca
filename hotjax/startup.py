"""Process start-up: the device count settled before JAX starts, the other processes of a run
joined, the compilation cache turned on. Imports JAX only inside `start_jax`."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax

SIMULATED_CPU_DEVICES = 8
NO_PROCESSES = (None, None, None, 30)  # (coordinator, process count, process id, heartbeat s)

# Simulated CPU devices are threads sharing a few cores: on a loaded machine one of them can
# wait minutes at a collective, and XLA's default rendezvous timeout then aborts the process.
_PATIENT_CPU_COLLECTIVES = ("--xla_cpu_collective_timeout_seconds=3600",
                            "--xla_cpu_collective_call_terminate_timeout_seconds=3600",
                            "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300")


def simulate_cpu_devices(count: int) -> None:
    """Before JAX starts: `count` CPU devices (unless already set), with patient collectives.
    Only the CPU backend reads these, so on an accelerator they are inert. JAX imported
    already (by optax, say) read the variable then: its setting is changed too, which holds
    until its first operation starts the backend."""
    if "JAX_NUM_CPU_DEVICES" not in os.environ:
        os.environ["JAX_NUM_CPU_DEVICES"] = str(count)
        if "jax" in sys.modules:
            sys.modules["jax"].config.update("jax_num_cpu_devices", count)
    flags = os.environ.get("XLA_FLAGS", "")
    missing = [f for f in _PATIENT_CPU_COLLECTIVES if f.split("=")[0] not in flags]
    os.environ["XLA_FLAGS"] = " ".join([flags, *missing]).strip()


def start_jax(devices: int | None = None,
              processes: tuple[str | None, int | None, int | None, int] = NO_PROCESSES,
              ) -> list[jax.Device]:
    """Call before anything else starts JAX: settles the device count, joins the other
    processes of a run of several, then turns on the persistent compilation cache. Returns the
    devices a run uses (hand them to `Run`): the first `devices` of them, default all.

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
    return select_devices(devices)


def select_devices(count: int | None) -> list[jax.Device]:
    """The first `count` devices (None: all of them)."""
    import jax

    from hotjax.errors import UserError

    available = jax.devices()
    if count is None:
        return available
    if not 1 <= count <= len(available):
        raise UserError(f"--devices {count}: {len(available)} {available[0].platform} devices "
                        f"are available: pass a number from 1 to {len(available)}")
    return available[:count]
