"""GPUs to compile for without one: XLA's whole GPU pipeline (SPMD partitioning, fusion, Triton
and Pallas kernels to PTX and SASS, buffer assignment) runs on any machine for devices described
by a target config, and `memory_analysis()` then gives each device's bytes as XLA:GPU plans them.

A target is a name (`h100`, `a100`, `a800`: configs shipped in `hotjax/targets/`) or a file in
the same text form (XLA's `xla/tools/hlo_opt/gpu_specs/*.txtpb`). It needs the `gpu-compile`
extra (JAX's CUDA plugin matching the installed jax, and ptxas from NVIDIA's nvcc wheel) and
the CPU platform for JAX itself: `prepare` sets `JAX_PLATFORMS=cpu` before JAX starts, since
without a GPU the plugin would not register. What it cannot give: timings (no autotuning) and
cost analyses; cuDNN builds no graph without a device, so its own errors and workspace show
only on a real GPU.
"""

from __future__ import annotations

import ctypes.util
import dataclasses
import functools
import importlib.util
import math
import os
import re
import sys
import types
from pathlib import Path
from typing import Any

from hotjax.errors import UserError

SHIPPED = Path(__file__).with_name("targets")
GPUS_PER_HOST = 8  # a target of more devices is laid out as hosts of eight, as DGX/HGX nodes
_INSTALL = "pip install 'hotjax[gpu-compile]' (JAX's CUDA plugin and ptxas, about 1.2 GB)"


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU to compile for: its name, its config's text and the memory it declares."""

    name: str
    config: str  # the target config (text proto)
    memory: int  # device_memory_size, bytes
    description: str

    @classmethod
    def named(cls, target: str) -> Target:
        """A shipped target by name, or a target config file."""
        shipped = SHIPPED / f"{target.lower()}.txtpb"
        path = shipped if shipped.is_file() else Path(target)
        if not path.is_file():
            names = ", ".join(sorted(p.stem for p in SHIPPED.glob("*.txtpb")))
            raise UserError(f"--target {target}: neither a known GPU ({names}) nor a target "
                            f"config file (XLA's gpu_specs/*.txtpb form)")
        text = path.read_text()
        memory = re.search(r"device_memory_size:\s*(\d+)", text)
        if "gpu_device_info" not in text or memory is None:
            raise UserError(f"--target {target}: {path} holds no gpu_device_info with a "
                            f"device_memory_size: not a GPU target config")
        described = re.search(r'device_description_str:\s*"([^"]*)"', text)
        return cls(path.stem, text, int(memory.group(1)),
                   described.group(1) if described else path.stem)


def available() -> bool:
    """Whether the `gpu-compile` extra is installed."""
    return importlib.util.find_spec("jax_cuda12_plugin") is not None


def prepare(target: str | None) -> Target | None:
    """Before JAX starts: the target (None: none asked for), its extra checked and JAX set to
    run on the CPU, which compiling for a target needs (the GPU plugin registers without a
    GPU only then)."""
    if target is None:
        return None
    for name in _PLUGIN_MODULES:
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) is None:
            del sys.modules[name]  # hidden by `quiet_plugin_without_a_driver`: wanted now
    found = Target.named(target)
    if not available():
        raise UserError(f"--target {target}: compiling for a GPU without one needs JAX's CUDA "
                        f"plugin: {_INSTALL}")
    platforms = os.environ.get("JAX_PLATFORMS")
    if platforms not in (None, "", "cpu"):
        raise UserError(f"--target {target}: JAX_PLATFORMS is {platforms!r}; compiling for a "
                        f"target runs JAX on the CPU: unset it")
    os.environ["JAX_PLATFORMS"] = "cpu"
    return found


def devices(target: Target, count: int) -> list[Any]:
    """`count` devices of `target` (compile-only: programs for them compile, never run), in
    hosts of GPUS_PER_HOST."""
    hosts = math.ceil(count / GPUS_PER_HOST)
    per_host = min(count, GPUS_PER_HOST)
    if hosts * per_host != count:
        raise UserError(f"{count} devices of {target.name}: a target spans whole hosts of "
                        f"{GPUS_PER_HOST} GPUs beyond one host: choose a multiple of "
                        f"{GPUS_PER_HOST}")
    return list(_topology(target.config, f"1x{hosts}x{per_host}").devices)


def cpu_without_a_driver() -> None:
    """Before JAX starts: on a machine with no NVIDIA driver but the CUDA plugin installed (for
    compiling to targets), JAX runs on the CPU, as it would anyway, without trying the plugin
    first (which logs a traceback of its failed CUDA check). A user's JAX_PLATFORMS stands."""
    if available() and not _driver():
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


# What JAX imports of its CUDA plugin when it starts: its kernels' modules, and the module
# whose `initialize()` registers the plugin.
_PLUGIN_MODULES = ("jax_cuda12_plugin", "jax_plugins.xla_cuda12")


def quiet_plugin_without_a_driver() -> None:
    """Before JAX is imported, for a command that compiles for no target: on a machine with no
    NVIDIA driver the CUDA plugin (installed for targets) is not loaded. Loading it logs lines of
    its own to stderr ("Could not find cuda drivers"), which would break a command's one-line
    errors; JAX runs on the CPU either way. `prepare` undoes it."""
    if "jax" in sys.modules or not available() or _driver():
        return  # JAX has looked for its plugins already, or there is nothing to hide
    sys.modules[_PLUGIN_MODULES[0]] = None  # an import of it fails as if it were absent
    inert = types.ModuleType(_PLUGIN_MODULES[1])
    inert.initialize = lambda: None  # found by JAX's plugin search, it registers nothing
    sys.modules[_PLUGIN_MODULES[1]] = inert


def _driver() -> bool:
    return Path("/dev/nvidiactl").exists() or ctypes.util.find_library("cuda") is not None


@functools.cache
def _topology(config: str, shape: str) -> Any:
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc("gpu-target", "cuda", target_config=config,
                                            topology=shape)
    except Exception as e:  # noqa: BLE001 - the plugin's errors are of several types
        raise UserError(f"JAX's CUDA plugin cannot describe the target ({e}): run with "
                        f"JAX_PLATFORMS=cpu and the plugin matching jax ({_INSTALL})") from None
