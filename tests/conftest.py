"""Tests run on CPU with 8 simulated devices and the persistent compilation cache on."""

import os

from hotjax import simulate_cpu_devices

simulate_cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from hotjax.compile_cache import enable_compilation_cache  # noqa: E402

enable_compilation_cache()


@pytest.fixture(scope="session")
def devices() -> list[jax.Device]:
    found = jax.devices()
    assert len(found) == 8, "tests expect 8 simulated CPU devices (JAX_NUM_CPU_DEVICES=8)"
    return found
