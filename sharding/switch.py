"""The hot-switch executor: carries a `TransferSchedule` out on real arrays, beside the
baseline `jax.device_put`, and uses whichever measures faster for each pair of layouts.

A scheduled switch runs in three moves: on each sender, one program cuts the slices for each
receiver out of its source shards and fuses them into one flat buffer per receiver (per element
width: floats travel bit for bit as unsigned integers); one batched `jax.device_put` carries every
buffer to its receiver; on each receiver, one program assembles its target shards from the
buffers and from the slices it already held. It runs within one process. The results are always
fresh buffers, never the source's: callers donate them later, and `device_put` returns aliased
buffers for leaves whose sharding is equivalent in both layouts (donating those invalidated the
source).
"""

from __future__ import annotations

import concurrent.futures
import os
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding

from hotjax.errors import UserError
from hotjax.sharding.transfers import (
    MIN_PIECE_BYTES,
    Box,
    Piece,
    Topology,
    TransferSchedule,
    schedule_transfers,
    sharding_switches,
)

METHODS = ("scheduled", "device_put", "auto")
CALIBRATION_REPEATS = 3
# The per-device programs only move data. On CPU, LLVM's full optimisation adds half again to
# their compile time (one kernel per slice, seconds per layout pair) for no faster copies;
# level 0 compiles a little faster but copies 2-4x slower.
_CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


def switch(tree: Any, target_shardings: Any, method: str = "auto",
           topology: Topology | None = None, policy: str = "greedy") -> Any:
    """`tree` (of `jax.Array`s) resharded to `target_shardings`, as fresh arrays — or `tree`
    itself, untouched, when every array already has its target layout (nothing to move).

    method: "scheduled" runs the scheduler's fused per-peer messages; "device_put" is
    `jax.device_put(tree, target_shardings, may_alias=False)`; "auto" measures both the first
    time it sees a (source, target) pair of layouts and from then on uses the faster.
    """
    if method not in METHODS:
        raise UserError(f"unknown switch method {method!r}: choose one of {', '.join(METHODS)}")
    if already_laid_out(tree, target_shardings):
        return tree
    if method == "device_put":
        return jax.device_put(tree, target_shardings, may_alias=False)
    planned = scheduled_switch(tree, target_shardings, topology, policy)
    if method == "scheduled":
        return planned(tree)
    if planned.key not in _faster:
        seconds = {m: time_switch(tree, target_shardings, m, CALIBRATION_REPEATS, topology,
                                  policy) for m in ("scheduled", "device_put")}
        _faster[planned.key] = min(seconds, key=seconds.__getitem__)
    return switch(tree, target_shardings, _faster[planned.key], topology, policy)


def already_laid_out(tree: Any, target_shardings: Any) -> bool:
    """Whether every array of `tree` already has its target sharding (the same devices
    holding the same slices)."""
    leaves, treedef = jax.tree.flatten(tree)
    return all(isinstance(x, jax.Array) and x.sharding.is_equivalent_to(t, x.ndim)
               for x, t in zip(leaves, treedef.flatten_up_to(target_shardings), strict=True))


def chosen_method(tree: Any, target_shardings: Any, topology: Topology | None = None,
                  policy: str = "greedy") -> str | None:
    """What "auto" uses for this pair of layouts, or None before it has measured them."""
    return _faster.get(scheduled_switch(tree, target_shardings, topology, policy).key)


def time_switch(tree: Any, target_shardings: Any, method: str, repeats: int,
                topology: Topology | None = None, policy: str = "greedy") -> float:
    """Median wall seconds of `repeats` switches, after one untimed (compiling) run."""
    def once() -> float:
        started = time.perf_counter()
        jax.block_until_ready(switch(tree, target_shardings, method, topology, policy))
        return time.perf_counter() - started

    once()
    return statistics.median(once() for _ in range(repeats))


def scheduled_switch(tree: Any, target_shardings: Any, topology: Topology | None = None,
                   policy: str = "greedy", min_piece_bytes: int = MIN_PIECE_BYTES
                   ) -> ScheduledSwitch:
    """The scheduled switch from this tree's layouts to `target_shardings`, scheduled and compiled
    once per (source layouts, target layouts, shapes, dtypes, topology, policy)."""
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(target_shardings)
    for x in leaves:
        if not isinstance(x, jax.Array):
            raise UserError(f"switch takes a tree of jax.Array, got a {type(x).__name__}")
    topology = topology or job_topology()
    key = (treedef, tuple((x.shape, x.dtype, x.sharding, t)
                          for x, t in zip(leaves, targets, strict=True)),
           topology, policy, min_piece_bytes)
    if key not in _scheduled:
        devices = {d.id: d for s in (*targets, *(x.sharding for x in leaves))
                   for d in s.device_set}
        if any(d.process_index != jax.process_index() for d in devices.values()):
            raise UserError("a scheduled switch runs within one process, and these layouts span "
                            "several: use method='device_put'")
        plan = schedule_transfers(sharding_switches(leaves, targets), topology, policy,
                                  min_piece_bytes)
        _scheduled[key] = ScheduledSwitch(plan, devices, [x.dtype for x in leaves], targets, key)
    return _scheduled[key]


def job_topology() -> Topology:
    """The job's devices, the devices of one process forming a node."""
    return Topology.of_processes(jax.devices())


class ScheduledSwitch:
    """A `TransferSchedule` bound to devices: one gather program per sender and one assembly program
    per receiver, compiled (in parallel) when it is built, and the buffers' routes between them."""

    def __init__(self, plan: TransferSchedule, devices: Mapping[int, jax.Device],
                 dtypes: Sequence[Any], targets: Sequence[Sharding], key: Any = None):
        self.plan, self.key = plan, key
        self._targets = list(targets)
        dtypes = [np.dtype(d) for d in dtypes]
        # One buffer per (sender, receiver, wire dtype), numbered in sending order.
        messages: list[tuple[int, int, list[Piece]]] = []
        for transfer in plan.transfers:
            by_dtype: dict[np.dtype, list[Piece]] = defaultdict(list)
            for piece in transfer.pieces:
                by_dtype[_wire(dtypes[piece.array])].append(piece)
            messages.extend((transfer.sender, transfer.receiver, pieces)
                            for pieces in by_dtype.values())
        self._destinations = [devices[r] for _, r, _ in messages]
        kept = {t.receiver: t.pieces for t in plan.kept}
        receivers = sorted({d.id for target in targets for d in target.device_set})
        self._gathers = [_gather(devices[s], plan, dtypes, [(m, pieces) for m, (sender, _, pieces)
                                                            in enumerate(messages) if sender == s])
                         for s in sorted({s for s, _, _ in messages})]
        self._assemblies = [_assembly(devices[r], plan, dtypes, kept.get(r, ()),
                                      [(m, pieces) for m, (_, receiver, pieces)
                                       in enumerate(messages) if receiver == r])
                            for r in receivers]
        with (warnings.catch_warnings(), concurrent.futures.ThreadPoolExecutor(os.cpu_count())
              as pool):
            # A buffer whose size no target shard has cannot be reused: that is expected.
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            compiled = list(pool.map(_Program.compile, (*self._gathers, *self._assemblies)))
        for program, executable in zip((*self._gathers, *self._assemblies), compiled,
                                       strict=True):
            program.executable = executable

    def __call__(self, tree: Any) -> Any:
        leaves, treedef = jax.tree.flatten(tree)
        shards = [{s.device.id: s.data for s in x.addressable_shards} for x in leaves]
        outgoing: list[jax.Array] = [None] * len(self._destinations)  # type: ignore[list-item]
        for gather in self._gathers:
            for m, buffer in zip(gather.outputs, gather(shards, []), strict=True):
                outgoing[m] = buffer
        arrived = jax.device_put(outgoing, self._destinations)
        assembled: list[dict[int, jax.Array]] = [{} for _ in leaves]
        for assembly in self._assemblies:
            for a, shard in zip(assembly.outputs, assembly(shards, arrived), strict=True):
                assembled[a][assembly.device.id] = shard
        return treedef.unflatten([
            jax.make_array_from_single_device_arrays(
                x.shape, target, [assembled[a][d.id]
                                  for d in target.addressable_devices_indices_map(x.shape)])
            for a, (x, target) in enumerate(zip(leaves, self._targets, strict=True))])


class _Program:
    """One device's program: source shards of `arrays` (and, on a receiver, the buffers numbered
    `buffers`) in; `outputs` (buffer numbers, or array indices) out."""

    def __init__(self, device: jax.Device, fn: Callable, arrays: list[int],
                 buffers: list[int], outputs: list[int], inputs: list[jax.ShapeDtypeStruct]):
        self.device, self.arrays, self.buffers, self.outputs = device, arrays, buffers, outputs
        self._fn, self._inputs = fn, inputs
        self.executable: Any = None

    def compile(self) -> Any:
        options = _CPU_COMPILER_OPTIONS if self.device.platform == "cpu" else None
        # The buffers that arrived are the switch's own: donated, a target shard that is one
        # whole buffer takes its memory instead of a copy. Source shards are never donated.
        program = jax.jit(self._fn, out_shardings=SingleDeviceSharding(self.device),
                          donate_argnums=tuple(range(len(self.buffers))))
        return program.lower(*self._inputs).compile(options)

    def __call__(self, shards: list[dict[int, jax.Array]], arrived: list[jax.Array]
                 ) -> tuple[jax.Array, ...]:
        return self.executable(*(arrived[m] for m in self.buffers),
                               *(shards[a][self.device.id] for a in self.arrays))


def _gather(device: jax.Device, plan: TransferSchedule, dtypes: list[np.dtype],
            messages: list[tuple[int, list[Piece]]]) -> _Program:
    """The sender's program: for each message, its pieces cut from the source shards, flattened
    and concatenated in order."""
    arrays = sorted({p.array for _, pieces in messages for p in pieces})
    slot = {a: i for i, a in enumerate(arrays)}
    cuts = [[(slot[p.array], _slices(p.src)) for p in pieces] for _, pieces in messages]

    def gather(*shards: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(jnp.concatenate([_to_wire(shards[i][where]).reshape(-1) for i, where in cut])
                     for cut in cuts)

    return _Program(device, gather, arrays, [], [m for m, _ in messages],
                    [_source_struct(plan, a, device, dtypes[a]) for a in arrays])


def _assembly(device: jax.Device, plan: TransferSchedule, dtypes: list[np.dtype],
              kept: Sequence[Piece], messages: list[tuple[int, list[Piece]]]) -> _Program:
    """The receiver's program: each target shard built from the pieces it kept (cut from its
    source shards) and the pieces sent to it (cut from the buffers), every one a new buffer."""
    sources = sorted({p.array for p in kept})
    outputs = sorted(a for a, array in enumerate(plan.arrays) if device.id in array.target)
    # Where each target shard's pieces come from: (dst box, is_sent, input slot, where).
    parts: dict[int, list[tuple[Box, bool, int, Any]]] = defaultdict(list)
    for p in kept:
        parts[p.array].append((p.dst, False, sources.index(p.array), _slices(p.src)))
    sizes = []
    for slot, (_, pieces) in enumerate(messages):
        offset = 0
        for p in pieces:
            size = _volume(p.box)
            parts[p.array].append((p.dst, True, slot, (offset, size, _shape(p.box))))
            offset += size
        sizes.append(offset)
    targets = [(_shape(plan.arrays[a].target[device.id]), dtypes[a], parts[a]) for a in outputs]

    def assemble(*inputs: jax.Array) -> tuple[jax.Array, ...]:
        buffers, shards = inputs[:len(messages)], inputs[len(messages):]

        def value(is_sent: bool, slot: int, where: Any) -> jax.Array:
            if is_sent:
                offset, size, shape = where
                return buffers[slot][offset:offset + size].reshape(shape)
            return _to_wire(shards[slot][where])

        out = []
        for shape, dtype, pieces in targets:
            if len(pieces) == 1:  # the whole shard; a copy even when it is a whole source shard
                shard = jnp.copy(value(*pieces[0][1:]))
            else:  # placed in place: on CPU twice as fast as concatenating slabs
                shard = jnp.zeros(shape, _wire(dtype))
                for dst, *where in pieces:
                    shard = shard.at[_slices(dst)].set(value(*where))
            out.append(_from_wire(shard, dtype))
        return tuple(out)

    wire = [_wire(dtypes[pieces[0].array]) for _, pieces in messages]
    inputs = [jax.ShapeDtypeStruct((size,), dtype, sharding=SingleDeviceSharding(device))
              for size, dtype in zip(sizes, wire, strict=True)]
    inputs += [_source_struct(plan, a, device, dtypes[a]) for a in sources]
    return _Program(device, assemble, sources, [m for m, _ in messages], outputs, inputs)


def _wire(dtype: np.dtype) -> np.dtype:
    """What an array travels as: floats as unsigned integers of their width (bit for bit),
    because XLA's CPU kernels copy bf16 several times slower than uint16."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize in (1, 2, 4):
        return np.dtype(f"uint{8 * dtype.itemsize}")
    return dtype


def _to_wire(x: jax.Array) -> jax.Array:
    wire = _wire(x.dtype)
    return x if wire == x.dtype else jax.lax.bitcast_convert_type(x, wire)


def _from_wire(x: jax.Array, dtype: np.dtype) -> jax.Array:
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def _source_struct(plan: TransferSchedule, a: int, device: jax.Device, dtype: np.dtype
                   ) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(_shape(plan.arrays[a].source[device.id]), dtype,
                                sharding=SingleDeviceSharding(device))


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


def _shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def _volume(box: Box) -> int:
    return int(np.prod(_shape(box), dtype=np.int64))


_scheduled: dict[Any, ScheduledSwitch] = {}
_faster: dict[Any, str] = {}
