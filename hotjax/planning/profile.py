"""Hardware profiles: what a cluster offers a cost model, read from small TOML files.

A profile gives each device's peak matmul rate and memory, how devices group into nodes, the
share of peak the kernels reach (`efficiency`, the matmuls' optionally by GEMM size, attention's
by query heads per device), and the bus
bandwidth of each collective by group size, inside one node and across nodes; optionally what a
micro-step costs whatever its size (`[device] step_overhead_ms`) and each collective besides its
bytes (`[links] latency_us`), which show where steps are short; and the bandwidth of the
memory-bound elementwise work (`[device] elementwise_gbps`: norms, residual adds, the loss).
A collective's table may also say how its bandwidth changes with the size of its tensor
(`by_bytes`: bytes = share of the table's bandwidth), and a profile may measure all-to-all apart
(`OPTIONAL_COLLECTIVES`; without it an all-to-all is priced at the all-gather's bandwidth).
Measured values are written into the same format (`profile_toml`, beside its reader
`parse_profile`), so a calibrated profile is a file like the shipped ones
(`hotjax/planning/profiles/*.toml`).

On GPU a plan fills what JAX's allocator hands out, not the device's memory: JAX preallocates
75 % of it unless told otherwise, and hotjax tells it `ALLOCATOR_FRACTION`
(`set_allocator_fraction`, before JAX starts a GPU backend; a fraction the user set is kept and
planned against).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hotjax.errors import UserError
from hotjax.sharding.transfers import Topology

PROFILES = Path(__file__).parent / "profiles"
# Collectives by name: a ring all-reduce, its two halves, and one point-to-point send (pipeline
# stage transfers, ring attention's K/V). Time = bytes moved per device / bus bandwidth (see
# `hotjax.planning.cost`).
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "send")
# Collectives a profile may measure and need not (the shipped ones do not), each priced where it
# has none at the bandwidth of one it must have: an all-to-all moves (n-1)/n of each device's
# tensor over every link at once, as an all-gather does (Ulysses' exchanges).
OPTIONAL_COLLECTIVES = {"all-to-all": "all-gather"}
# The attention kernels a profile may price apart (`[efficiency] attention_KERNEL`, "-" as
# "_"), by `hotjax.models.work.attention_backend`'s names; `attention` prices the others.
ATTENTION_KERNELS = ("cudnn", "pallas", "pallas-fa2", "pallas-ring", "blockwise")
_TOP_KEYS = ("name", "platform", "nodes", "devices_per_node", "device", "efficiency", "links",
             "collectives")
TERA, GIGA, GiB = 1e12, 1e9, 2**30
# The share of each GPU's memory JAX's allocator may take in a hotjax process. JAX's default is
# 0.75 (https://docs.jax.dev/en/latest/gpu_memory_allocation.html); the rest of the device holds
# the CUDA context, cuBLAS/cuDNN workspaces and NCCL's buffers, which need a few GiB, not 20.
ALLOCATOR_FRACTION = 0.9
# The variable JAX reads, and the older name it still honours (both set is an error in JAX).
MEMORY_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def set_allocator_fraction(environ: dict[str, str] | None = None) -> None:
    """Let JAX's GPU allocator take `ALLOCATOR_FRACTION` of each device, unless the user named
    a fraction: call before JAX starts a GPU backend (the first JAX operation)."""
    environ = os.environ if environ is None else environ
    if not any(environ.get(name) for name in MEMORY_FRACTION_VARS):
        environ[MEMORY_FRACTION_VARS[0]] = str(ALLOCATOR_FRACTION)


def allocator_fraction(platform: str, environ: dict[str, str] | None = None) -> float:
    """The share of a device's memory a hotjax process may allocate on `platform`: on GPU the
    fraction the environment gives JAX, or hotjax's; elsewhere all of it."""
    if platform != "gpu":
        return 1.0
    environ = os.environ if environ is None else environ
    for name in MEMORY_FRACTION_VARS:
        if environ.get(name):
            try:
                fraction = float(environ[name])
            except ValueError:
                fraction = 0.0
            if not 0 < fraction <= 1:
                raise UserError(f"{name} = {environ[name]!r}: give JAX's GPU memory fraction "
                                f"as a number in (0, 1]")
            return fraction
    return ALLOCATOR_FRACTION


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """The share of peak a kernel reaches by a size: a GEMM's by its smallest dimension per
    device (tokens, or a weight's rows or columns after tensor parallelism splits it),
    attention's by its query heads per device. `flat` where no size was measured, else
    interpolated linearly in log size between the measured ones (clamped at the ends)."""

    flat: float
    by_size: tuple[tuple[int, float], ...] = ()

    def at(self, size: float) -> float:
        if not self.by_size:
            return self.flat
        sizes = [math.log(s) for s, _ in self.by_size]
        return float(np.interp(math.log(max(size, 1)), sizes, [e for _, e in self.by_size]))


@dataclasses.dataclass(frozen=True)
class Bandwidths:
    """Bus bandwidth (bytes/s per device) of one collective, by group size: `intra` for groups
    inside one node, `inter` for groups that span nodes; `by_bytes` (tensor bytes per device,
    share of the table's bandwidth), where measured, scales it by the size of the tensor (the
    tables hold it at the largest size measured): gloo between two processes sent 512 KiB at
    0.79 of a shaped link and 4 MiB at 0.53, and all-gathered 512 KiB at 1.0 of it and 4 MiB at
    0.73."""

    intra: tuple[tuple[int, float], ...]
    inter: tuple[tuple[int, float], ...]
    by_bytes: tuple[tuple[int, float], ...] = ()

    def at(self, group: int, crosses_nodes: bool, nbytes: float | None = None) -> float:
        """The bandwidth of a group of `group` devices moving tensors of `nbytes` (None: at
        the tables' size); a group size not listed takes the nearest listed one (by ratio; the
        smaller on a tie), a tensor size the interpolation in log size of `by_bytes` (clamped
        at its ends)."""
        table = self.inter if crosses_nodes else self.intra
        _, bandwidth = min(table, key=lambda entry: (abs(math.log(entry[0] / group)), entry[0]))
        if nbytes is None or not self.by_bytes:
            return bandwidth
        return bandwidth * Efficiency(1.0, self.by_bytes).at(nbytes)


@dataclasses.dataclass(frozen=True)
class Profile:
    """A cluster: `nodes` x `devices_per_node` devices of `peak_flops` (dense, compute dtype) and
    `device_bytes` each, of which a process may allocate `memory_bytes`, running on JAX platform
    `platform`."""

    name: str
    platform: str
    nodes: int
    devices_per_node: int
    peak_flops: float
    memory_bytes: int  # what JAX's allocator hands a process per device: plans fill this
    matmul_efficiency: float  # share of peak the model's matmuls reach (where no size says)
    attention_efficiency: float  # share of peak the attention kernel reaches (where none says)
    intra_node_bandwidth: float  # bytes/s per device and direction (the transfer scheduler's links)
    inter_node_bandwidth: float
    # (name, bandwidths) for each of COLLECTIVES and those of OPTIONAL_COLLECTIVES measured
    collectives: tuple[tuple[str, Bandwidths], ...]
    source: str = "<profile>"
    device_bytes: int = 0  # the device's memory (0: as `memory_bytes`)
    matmul_by_size: tuple[tuple[int, float], ...] = ()  # (GEMM's smallest dimension, efficiency)
    # Measured where they show (`hotjax.planning.measure`); 0 in the shipped GPU profiles, whose
    # micro-steps are long beside them.
    step_overhead: float = 0.0  # seconds every micro-step costs whatever its size
    collective_latency: float = 0.0  # seconds every collective costs besides its bytes
    # Bytes/s the model's elementwise passes move (`hotjax.planning.cost.ELEMENTWISE`); 0: not
    # priced apart (a fitted matmul rate carries that work).
    elementwise_bandwidth: float = 0.0
    # (kernel, share of peak) of the attention kernels measured apart (`ATTENTION_KERNELS`),
    # and the GPU's compute capability (major; None: not stated), which decides whether
    # cuDNN's packed attention runs.
    attention_by_kernel: tuple[tuple[str, float], ...] = ()
    compute_capability: int | None = None
    # (query heads per device, share of peak) of the kernel `attention_efficiency` prices,
    # measured at the head splits the devices allow (`hotjax.planning.measure`): on XLA:CPU
    # the blockwise kernel runs 20-25 % faster per head with half of `tiny`'s heads (its
    # score blocks stay in cache), which priced tensor parallelism and Ulysses 12-20 % high.
    attention_by_heads: tuple[tuple[int, float], ...] = ()
    # (tokens in a row of one kernel call, share of peak) of the same kernel with all heads,
    # measured at the row lengths trained: on XLA:CPU the blockwise kernel ran rows of 128 and
    # 256 tokens (a block each) 1.5 times slower per pair than rows of 512 and more, which the
    # matmul rate fitted on 128-token rows took for slow matmuls (and priced 512-token rows
    # 10-25 % high).
    attention_by_length: tuple[tuple[int, float], ...] = ()
    # Bytes/s per device `jax.device_put` reached resharding arrays on all the profile's
    # devices, counted as the bytes a device lacks, and the seconds each switch cost besides
    # (`hotjax.planning.measure.switch_rate`): across nodes where there are several, else
    # inside the node; 0: not measured (the links stand in). Between two processes on a link
    # shaped to 7.7 MB/s each way the weights' switches moved near the link's rate, where
    # gloo's ring send of 4 MiB (the node link) measured 0.45-0.53 of it.
    switch_bandwidth: float = 0.0
    switch_latency: float = 0.0

    @property
    def matmul(self) -> Efficiency:
        return Efficiency(self.matmul_efficiency, self.matmul_by_size)

    def attention_at(self, kernel: str, heads: float | None = None,
                     length: int | None = None) -> float:
        """The share of peak attention kernel `kernel` reaches (`hotjax.models.attention`'s
        names), running `heads` query heads per device (None: the model's all) on rows of
        `length` tokens (None: those it was measured on). The heads' and the length's effects
        multiply: each was measured with the other at the reference."""
        measured = dict(self.attention_by_kernel)
        if kernel in measured:
            return measured[kernel]
        share = self.attention_efficiency
        if heads is not None:
            share = Efficiency(share, self.attention_by_heads).at(heads)
        if length is not None and self.attention_by_length:
            share *= (Efficiency(self.attention_efficiency, self.attention_by_length).at(length)
                      / self.attention_efficiency)
        return share

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def bandwidth(self, collective: str, group: int, crosses_nodes: bool,
                  nbytes: float | None = None) -> float:
        """Bytes/s per device of `collective` over `group` devices, each moving a tensor of
        `nbytes` (None: at the profile's reference size); one of `OPTIONAL_COLLECTIVES` the
        profile lacks at the bandwidth of the one it stands for."""
        tables = dict(self.collectives)
        if collective not in tables:
            collective = OPTIONAL_COLLECTIVES[collective]
        return tables[collective].at(group, crosses_nodes, nbytes)

    def switch_seconds(self, nbytes: float, crosses_nodes: bool) -> float:
        """A hot switch in which a device lacks at most `nbytes`: at the rate measured where
        it applies (a switch that spans nodes, or any on one node), with its fixed cost, else
        at the link's rate."""
        if self.switch_bandwidth and crosses_nodes == (self.nodes > 1):
            return self.switch_latency + nbytes / self.switch_bandwidth
        return nbytes / (self.inter_node_bandwidth if crosses_nodes
                         else self.intra_node_bandwidth)

    def topology(self) -> Topology:
        """The links as the transfer scheduler sees them."""
        return Topology(devices_per_node=self.devices_per_node,
                        intra_node_bandwidth=self.intra_node_bandwidth,
                        inter_node_bandwidth=self.inter_node_bandwidth)


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (`a800-4x8`, `h100-1x8`) or a TOML file by path."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = PROFILES / f"{name_or_path}.toml"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        shipped = ", ".join(sorted(p.stem for p in PROFILES.glob("*.toml")))
        raise UserError(f"hardware profile not found: {path}: pass a .toml file or one of "
                        f"{shipped}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read hardware profile {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML ({e}): fix the syntax") from None
    return parse_profile(data, str(path))


def profile_toml(profile: Profile) -> str:
    """`profile` in the TOML form `hotjax.planning.profile.parse_profile` reads, every number
    written so that it reads back to the same value."""
    def table(entries: tuple[tuple[int, float], ...], unit: float = GIGA) -> str:
        return "{ " + ", ".join(f"{size} = {_in_units(x, unit)}" for size, x in entries) + " }"

    device_bytes = profile.device_bytes or profile.memory_bytes
    lines = [f"# {profile.source}",
             "# Units: TFLOP/s, GiB, GB/s (1e9 bytes/s) per device and direction.",
             f"name = {_string(profile.name)}", f"platform = {_string(profile.platform)}",
             f"nodes = {profile.nodes}", f"devices_per_node = {profile.devices_per_node}", "",
             "[device]", f"peak_tflops = {_in_units(profile.peak_flops, TERA)}",
             f"memory_gib = {_in_units(device_bytes, GiB)}",
             f"allocator_fraction = {_in_units(profile.memory_bytes / device_bytes, 1)}"
             "  # of memory_gib, what the allocator hands a process",
             *([f"step_overhead_ms = {_in_units(profile.step_overhead, 1e-3)}"]
               if profile.step_overhead else []),
             *([f"elementwise_gbps = {_in_units(profile.elementwise_bandwidth, GIGA)}"]
               if profile.elementwise_bandwidth else []),
             *([f"compute_capability = {profile.compute_capability}"]
               if profile.compute_capability is not None else []), "",
             "[efficiency]", f"matmul = {_in_units(profile.matmul_efficiency, 1)}",
             f"attention = {_in_units(profile.attention_efficiency, 1)}",
             *(f"attention_{kernel.replace('-', '_')} = {_in_units(share, 1)}"
               for kernel, share in profile.attention_by_kernel),
             *([f"matmul_by_size = {table(profile.matmul_by_size, 1)}"] if profile.matmul_by_size
               else []),
             *([f"attention_by_heads = {table(profile.attention_by_heads, 1)}"]
               if profile.attention_by_heads else []),
             *([f"attention_by_length = {table(profile.attention_by_length, 1)}"]
               if profile.attention_by_length else []), "",
             "[links]", f"intra_node_gbps = {_in_units(profile.intra_node_bandwidth, GIGA)}",
             f"inter_node_gbps = {_in_units(profile.inter_node_bandwidth, GIGA)}",
             *([f"latency_us = {_in_units(profile.collective_latency, 1e-6)}"]
               if profile.collective_latency else []),
             *([f"switch_gbps = {_in_units(profile.switch_bandwidth, GIGA)}"
                "  # jax.device_put resharding, per device"]
               if profile.switch_bandwidth else []),
             *([f"switch_latency_ms = {_in_units(profile.switch_latency, 1e-3)}"]
               if profile.switch_latency else []), "",
             "# Bus bandwidth of each collective (nccl-tests' busbw) by group size, for groups "
             "inside one node", "# (intra) and groups spanning nodes (inter)."]
    if profile.nodes == 1 and all(b.intra == b.inter for _, b in profile.collectives):
        lines.append("# One node: no group spans nodes, so inter repeats intra.")
    for name, bandwidths in profile.collectives:
        lines += [f"[collectives.{name}]", f"intra = {table(bandwidths.intra)}",
                  f"inter = {table(bandwidths.inter)}",
                  *([f"by_bytes = {table(bandwidths.by_bytes, 1)}"] if bandwidths.by_bytes
                    else []), ""]
    return "\n".join(lines)


def parse_profile(data: Mapping[str, Any], source: str) -> Profile:
    """A profile from its TOML form, validated: every field present, every number positive."""
    _known(data, _TOP_KEYS, source)
    device = _table(data, "device", source, ("peak_tflops", "memory_gib"),
                    ("allocator_fraction", "step_overhead_ms", "elementwise_gbps",
                     "compute_capability"))
    kernels = {f"attention_{k.replace('-', '_')}": k for k in ATTENTION_KERNELS}
    efficiency = _table(data, "efficiency", source, ("matmul", "attention"),
                        ("matmul_by_size", "attention_by_heads", "attention_by_length",
                         *kernels))
    links = _table(data, "links", source, ("intra_node_gbps", "inter_node_gbps"),
                   ("latency_us", "switch_gbps", "switch_latency_ms"))
    by_size, by_heads, by_length = (
        _efficiencies(data["efficiency"].get(f"{of}_by_{size}", {}),
                      f"{source}: efficiency.{of}_by_{size}", example)
        for of, size, example in (("matmul", "size", "{ 256 = 0.3, 4096 = 0.6 }"),
                                  ("attention", "heads", "{ 8 = 0.3, 4 = 0.35 }"),
                                  ("attention", "length", "{ 128 = 0.05, 1024 = 0.07 }")))
    for key, table, field, of in (("efficiency", efficiency, "matmul", "peak"),
                                  ("efficiency", efficiency, "attention", "peak"),
                                  *(("efficiency", efficiency, k, "peak") for k in kernels),
                                  ("device", device, "allocator_fraction", "the memory")):
        if table.get(field, 0) > 1:
            raise UserError(f"{source}: {key}.{field} = {table[field]} is a share of {of}: "
                            f"give a number in (0, 1]")
    platform = data.get("platform")
    if platform not in ("cpu", "gpu", "tpu"):
        raise UserError(f"{source}: platform = {platform!r}: give the JAX platform, one of "
                        f"'cpu', 'gpu', 'tpu'")
    device_bytes = int(device["memory_gib"] * GiB)
    fraction = device.get("allocator_fraction") or allocator_fraction(platform)
    nodes = _count(data, "nodes", source)
    collectives = data.get("collectives")
    if not isinstance(collectives, Mapping):
        raise UserError(f"{source}: no [collectives] tables: add [collectives.NAME] for each of "
                        f"{', '.join(COLLECTIVES)}")
    _known(collectives, (*COLLECTIVES, *OPTIONAL_COLLECTIVES), f"{source}: collectives")
    named = (*COLLECTIVES, *(name for name in OPTIONAL_COLLECTIVES if name in collectives))
    return Profile(
        name=str(data.get("name", Path(source).stem)), platform=platform, nodes=nodes,
        devices_per_node=_count(data, "devices_per_node", source),
        peak_flops=device["peak_tflops"] * TERA, memory_bytes=int(device_bytes * fraction),
        device_bytes=device_bytes, matmul_efficiency=efficiency["matmul"],
        matmul_by_size=by_size, attention_efficiency=efficiency["attention"],
        intra_node_bandwidth=links["intra_node_gbps"] * GIGA,
        inter_node_bandwidth=links["inter_node_gbps"] * GIGA,
        collectives=tuple((name, _bandwidths(collectives, name, source)) for name in named),
        source=source, step_overhead=device.get("step_overhead_ms", 0.0) * 1e-3,
        collective_latency=links.get("latency_us", 0.0) * 1e-6,
        switch_bandwidth=links.get("switch_gbps", 0.0) * GIGA,
        switch_latency=links.get("switch_latency_ms", 0.0) * 1e-3,
        elementwise_bandwidth=device.get("elementwise_gbps", 0.0) * GIGA,
        attention_by_kernel=tuple((kernel, efficiency[key]) for key, kernel in kernels.items()
                                  if key in efficiency),
        attention_by_heads=by_heads, attention_by_length=by_length,
        compute_capability=int(device["compute_capability"]) if "compute_capability" in device
        else None)


def _bandwidths(collectives: Mapping[str, Any], name: str, source: str) -> Bandwidths:
    where = f"{source}: collectives.{name}"
    entry = collectives.get(name)
    if not isinstance(entry, Mapping):
        raise UserError(f"{where}: missing: add [collectives.{name}] with intra and inter "
                        f"tables of group size = GB/s")
    _known(entry, ("intra", "inter", "by_bytes"), where)
    return Bandwidths(*(_by_size(entry.get(side), f"{where}.{side}") for side in ("intra",
                                                                                  "inter")),
                      by_bytes=_efficiencies(entry.get("by_bytes", {}), f"{where}.by_bytes",
                                             "{ 262144 = 0.9, 4194304 = 1.0 }", of=None))


def _by_size(table: Any, where: str) -> tuple[tuple[int, float], ...]:
    if not isinstance(table, Mapping) or not table:
        raise UserError(f"{where}: give a table of group size = GB/s, like {{ 2 = 200, 8 = 180 }}")
    entries = []
    for size, gbps in table.items():
        if not size.isdecimal() or int(size) < 2:
            raise UserError(f"{where}: group size {size!r} must be an integer of at least 2")
        entries.append((int(size), _positive(gbps, f"{where}.{size}") * GIGA))
    return tuple(sorted(entries))


def _efficiencies(table: Any, where: str, example: str, of: str | None = "peak"
                  ) -> tuple[tuple[int, float], ...]:
    """A table of size = share of `of` (None: a positive factor, more than 1 allowed)."""
    if not isinstance(table, Mapping):
        raise UserError(f"{where}: give a table of size = share of {of or 'the bandwidth'}, "
                        f"like {example}")
    entries = []
    for size, share in table.items():
        if not size.isdecimal() or int(size) < 1:
            raise UserError(f"{where}: size {size!r} must be a positive integer")
        if _positive(share, f"{where}.{size}") > 1 and of:
            raise UserError(f"{where}.{size} = {share} is a share of {of}: give a number in "
                            f"(0, 1]")
        entries.append((int(size), float(share)))
    return tuple(sorted(entries))


def _table(data: Mapping[str, Any], key: str, source: str, fields: tuple[str, ...],
           optional: tuple[str, ...] = ()) -> dict[str, float]:
    """The numbers of table `key`: every one of `fields`, those of `optional` given (tables
    among them are left to the caller)."""
    table = data.get(key)
    if not isinstance(table, Mapping):
        raise UserError(f"{source}: no [{key}] table: add one with {', '.join(fields)}")
    _known(table, fields + optional, f"{source}: {key}")
    return {field: _positive(table.get(field), f"{source}: {key}.{field}")
            for field in fields + optional
            if field in fields or (field in table and not isinstance(table[field], Mapping))}


def _positive(value: Any, where: str) -> float:
    if (isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
            or not math.isfinite(value)):  # TOML reads inf and nan
        raise UserError(f"{where} = {value!r}: give a positive number")
    return float(value)


def _count(data: Mapping[str, Any], key: str, source: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{source}: {key} = {value!r}: give a positive integer")
    return value


def _known(table: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(table) - set(keys))
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}: use {', '.join(keys)}")


def _in_units(value: float | int, unit: float) -> str:
    """The shortest decimal that, times `unit`, reads back as `value` (TOML float syntax)."""
    for digits in range(1, 18):
        text = f"{value / unit:.{digits}g}"
        if type(value)(float(text) * unit) == value:  # as parse_profile reads it
            break
    else:
        text = repr(value / unit)
    return f"{text}.0" if text.lstrip("-").isdecimal() else text


def _string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
