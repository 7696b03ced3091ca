"""Strategies: mesh axis sizes over one canonical device order, plus logical-axis rules."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from hotjax.errors import UserError
from models.llama import ACTIVATION_AXES, PARAM_AXES

# Outermost to innermost: the innermost axes stay inside a node, where links are fastest.
MESH_AXES = ("data", "fsdp", "context", "tensor")

# Logical axis -> mesh axes, frozen so that strategies can key caches of compiled steps.
AxisMap = tuple[tuple[str, tuple[str, ...]], ...]


def _axis_map(mapping: Mapping[str, str | Sequence[str] | None], logical_axes: Sequence[str],
              where: str) -> AxisMap:
    out = []
    for logical, mesh_axes in sorted(mapping.items()):
        if logical not in logical_axes:
            raise UserError(f"{where}: unknown logical axis {logical!r}: use "
                            f"{', '.join(logical_axes)}")
        if mesh_axes is None:
            mesh_axes = ()
        elif isinstance(mesh_axes, str):
            mesh_axes = (mesh_axes,)
        mesh_axes = tuple(mesh_axes)
        unknown = [a for a in mesh_axes if a not in MESH_AXES]
        if unknown:
            raise UserError(f"{where}: unknown mesh axis {unknown[0]!r} for {logical!r}: "
                            f"use {', '.join(MESH_AXES)}")
        out.append((logical, mesh_axes))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Rules:
    """Where each logical axis goes, for parameters and for activations."""

    name: str
    params: AxisMap
    activations: AxisMap

    @classmethod
    def from_mappings(cls, name: str, params: Mapping, activations: Mapping,
                      where: str = "rules") -> Rules:
        return cls(name, _axis_map(params, PARAM_AXES, f"{where}: params"),
                   _axis_map(activations, ACTIVATION_AXES, f"{where}: activations"))

    def mesh_axes_used(self) -> set[str]:
        return {a for _, axes in self.params + self.activations for a in axes}


_BATCH = {"batch": ("data", "fsdp")}

RULE_SETS: dict[str, Rules] = {
    # Data parallel: parameters replicated, the batch split over every data-like axis.
    "dp": Rules.from_mappings("dp", params={}, activations=_BATCH),
    # FSDP / ZeRO-3: parameters (hence grads and optimizer state) split on `embed` over `fsdp`,
    # gathered per layer inside the step; the batch split as in dp.
    "fsdp": Rules.from_mappings("fsdp", params={"embed": "fsdp"}, activations=_BATCH),
}
DEFAULT_RULES = "fsdp"


def _parse_rules(value: str | Mapping[str, Any], where: str) -> Rules:
    if isinstance(value, str):
        if value not in RULE_SETS:
            raise UserError(f"{where}: unknown rule set {value!r}: choose one of "
                            f"{', '.join(RULE_SETS)}, or give an inline table of logical -> "
                            f"mesh axes")
        return RULE_SETS[value]
    if not isinstance(value, Mapping) or not value or set(value) - {"params", "activations"}:
        raise UserError(f"{where}: rules must be a rule-set name or a table with 'params' and "
                        f"'activations' (each logical axis -> mesh axes)")
    return Rules.from_mappings("inline", value.get("params", {}), value.get("activations", {}),
                               where)


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A parallelism strategy (HotSPa's DStates): mesh sizes in `MESH_AXES` order + rules."""

    sizes: tuple[int, ...]
    rules: Rules

    @classmethod
    def create(cls, mesh: Mapping[str, int], rules: str | Mapping | None = None,
               where: str = "strategy") -> Strategy:
        unknown = [a for a in mesh if a not in MESH_AXES]
        if unknown:
            raise UserError(f"{where}: unknown mesh axis {unknown[0]!r}: "
                            f"use {', '.join(MESH_AXES)}")
        for axis, size in mesh.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise UserError(f"{where}: mesh axis {axis}={size!r} must be a positive integer")
        sizes = tuple(mesh.get(a, 1) for a in MESH_AXES)
        strategy = cls(sizes, _parse_rules(DEFAULT_RULES if rules is None else rules, where))
        idle = [f"{a}={n}" for a, n in strategy.axes.items()
                if n > 1 and a not in strategy.rules.mesh_axes_used()]
        if idle:
            raise UserError(f"{where}: mesh axis {idle[0]} is not used by rules "
                            f"{strategy.rules.name!r} (every device would repeat the same work): "
                            f"choose rules that use it, or drop the axis")
        return strategy

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """From the command line: `"data=2,fsdp=4"`, optionally with `",rules=NAME"`."""
        mesh: dict[str, int] = {}
        rules = None
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep:
                raise UserError(f"--strategy {text!r}: expected AXIS=SIZE items, "
                                f"like 'data=2,fsdp=4'")
            if key in mesh or (key == "rules" and rules is not None):
                raise UserError(f"--strategy {text!r}: {key!r} is given twice: give it once")
            if key == "rules":
                rules = value.strip()
            elif value.strip().isdecimal():
                mesh[key] = int(value)
            else:
                raise UserError(f"--strategy {text!r}: size of {key!r} must be a positive integer")
        if not mesh:
            raise UserError(f"--strategy {text!r}: give at least one mesh axis, e.g. 'data=8'")
        return cls.create(mesh, rules, where=f"--strategy {text!r}")

    @property
    def axes(self) -> dict[str, int]:
        return dict(zip(MESH_AXES, self.sizes, strict=True))

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes)

    def __str__(self) -> str:
        used = "·".join(f"{a}{n}" for a, n in self.axes.items() if n > 1) or "single"
        return f"{used} [{self.rules.name}]"


def canonical_devices(devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """Node-major device order: every strategy's mesh is a reshape of this one list."""
    devices = jax.devices() if devices is None else devices
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def _spec(axes: Sequence[str | None], mapping: AxisMap, mesh: Mesh) -> PartitionSpec:
    lookup = dict(mapping)
    taken: set[str] = set()
    parts: list[Any] = []
    for logical in axes:
        # A mesh axis shards at most one dimension; size-1 axes are left out of the spec.
        mesh_axes = tuple(a for a in lookup.get(logical, ())
                          if a not in taken and mesh.shape[a] > 1)
        taken.update(mesh_axes)
        parts.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1
                     else mesh_axes)
    while parts and parts[-1] is None:
        parts.pop()
    return PartitionSpec(*parts)


class Layout:
    """A strategy placed on devices: the mesh, and shardings for parameters and activations."""

    def __init__(self, strategy: Strategy, devices: Sequence[jax.Device]):
        if strategy.num_devices != len(devices):
            mesh = "·".join(f"{a}={n}" for a, n in strategy.axes.items() if n > 1) or "size 1"
            raise UserError(f"mesh {mesh} uses {strategy.num_devices} devices but "
                            f"{len(devices)} are in use: make the sizes multiply to "
                            f"{len(devices)}, or use --devices {strategy.num_devices}")
        self.strategy = strategy
        grid = np.asarray(canonical_devices(devices), dtype=object).reshape(strategy.sizes)
        self.mesh = Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))

    def param_spec(self, axes: Sequence[str | None]) -> PartitionSpec:
        return _spec(axes, self.strategy.rules.params, self.mesh)

    def activation_spec(self, axes: Sequence[str | None]) -> PartitionSpec:
        return _spec(axes, self.strategy.rules.activations, self.mesh)

    def param_shardings(self, axes_tree: Any, shapes: Any, ) -> Any:
        """NamedShardings for a tree of logical axes; every split dimension must divide."""
        def one(path: tuple, axes: tuple[str, ...], shape: jax.ShapeDtypeStruct) -> NamedSharding:
            spec = self.param_spec(axes)
            for dim, (size, part) in enumerate(zip(shape.shape, spec, strict=False)):
                ways = math.prod(self.mesh.shape[a] for a in _as_tuple(part))
                if size % ways:
                    name = "/".join(str(getattr(k, "key", k)) for k in path)
                    raise UserError(f"parameter {name} dimension {dim} ({axes[dim]}={size}) does "
                                    f"not split {ways} ways under {self.strategy}: choose sizes "
                                    f"that divide it")
            return NamedSharding(self.mesh, spec)

        return jax.tree_util.tree_map_with_path(one, axes_tree, shapes,
                                                is_leaf=lambda x: isinstance(x, tuple))

    def constrain(self, x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
        """The activation-sharding hook handed to the model."""
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, self.activation_spec(axes)))

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.activation_spec(("batch", "seq")))

    @property
    def batch_shards(self) -> int:
        """How many ways the rows of a batch are split; row counts must be a multiple of it."""
        part = self.activation_spec(("batch",))
        return math.prod(self.mesh.shape[a] for a in _as_tuple(part[0] if part else None))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


def _as_tuple(part: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if part is None:
        return ()
    return (part,) if isinstance(part, str) else tuple(part)
