"""Strategies: mesh axis sizes over one canonical device order, plus logical-axis rules."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from hotjax.errors import UserError
from hotjax.models.attention import AttentionSharding
from hotjax.models.llama import ACTIVATION_AXES, PARAM_AXES, LlamaConfig

# Outermost to innermost: the innermost axes stay inside a node, where links are fastest, and
# pipeline stages, which exchange only one micro-batch's activations, cross nodes first (as
# Megatron places them).
MESH_AXES = ("stage", "data", "fsdp", "context", "tensor")

# Logical axis -> mesh axes, frozen so that strategies can key caches of compiled steps.
AxisMap = tuple[tuple[str, tuple[str, ...]], ...]


def _axis_map(mapping: Mapping[str, str | Sequence[str] | None], logical_axes: Sequence[str],
              where: str) -> AxisMap:
    if not isinstance(mapping, Mapping):
        raise UserError(f"{where}: expected a table of logical axis -> mesh axes, "
                        f"got {mapping!r}")
    out = []
    for logical, mesh_axes in sorted(mapping.items()):
        if not (mesh_axes is None or isinstance(mesh_axes, str) or (
                isinstance(mesh_axes, Sequence) and all(isinstance(a, str) for a in mesh_axes))):
            raise UserError(f"{where}: {logical!r} maps to {mesh_axes!r}: give a mesh axis name "
                            f"or a list of them")
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
    """Where each logical axis goes: parameters, activations, and for ZeRO-1/2 the gradients and
    optimizer state (which otherwise follow the parameters)."""

    name: str
    params: AxisMap
    activations: AxisMap
    grads: AxisMap | None = None
    optimizer: AxisMap | None = None

    @classmethod
    def from_mappings(cls, name: str, params: Mapping, activations: Mapping,
                      grads: Mapping | None = None, optimizer: Mapping | None = None,
                      where: str = "rules") -> Rules:
        def param_map(mapping: Mapping | None, kind: str) -> AxisMap | None:
            return None if mapping is None else _axis_map(mapping, PARAM_AXES, f"{where}: {kind}")

        return cls(name, param_map(params, "params"),
                   _axis_map(activations, ACTIVATION_AXES, f"{where}: activations"),
                   param_map(grads, "grads"), param_map(optimizer, "optimizer"))

    def mesh_axes_used(self) -> set[str]:
        maps = (self.params, self.activations, self.grads or (), self.optimizer or ())
        return {a for mapping in maps for _, axes in mapping for a in axes}

    def without(self, logical: str) -> Rules:
        """These rules with `logical` left unsplit everywhere."""
        def drop(mapping: AxisMap | None) -> AxisMap | None:
            return None if mapping is None else tuple(p for p in mapping if p[0] != logical)

        return Rules(self.name, drop(self.params), drop(self.activations), drop(self.grads),
                     drop(self.optimizer))


# Rule sets build on each other: dp < fsdp < context < megatron < megatron-sp. Axes of size 1
# drop out of every spec, so one rule set serves any mesh that has a subset of its axes. Every
# one splits the stacked layers over `stage` (pipeline parallelism) when the mesh has it.
_STAGE = {"layers": "stage"}
_DP = {"batch": ("data", "fsdp")}
_FSDP = {**_STAGE, "embed": "fsdp"}
_CONTEXT_FSDP = {**_STAGE, "embed": ("fsdp", "context")}  # the state split over data x context
_CONTEXT = {**_DP, "seq": "context", "inner_seq": "context"}  # K/V go round a ring
# Inside attention only, the sequence's split over context becomes one of the heads.
_ULYSSES = {**_CONTEXT, "attn_heads": "context", "attn_kv_heads": "context"}
_TP_PARAMS = {**_FSDP, "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
              "vocab": "tensor"}
_TP = {**_CONTEXT, "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
_SP = {**_TP, "seq": ("context", "tensor")}  # the residual stream split on tensor as well


def _rules(name: str, params: dict, activations: dict, **zero: dict) -> Rules:
    return Rules.from_mappings(name, params, activations, **zero)


RULE_SETS: dict[str, Rules] = {
    # Data parallel: parameters replicated, the batch split over every data-like axis.
    "dp": _rules("dp", _STAGE, _DP),
    # ZeRO-1: optimizer state split over fsdp; ZeRO-2: gradients too. Compute params replicated.
    "zero1": _rules("zero1", _STAGE, _DP, optimizer=_FSDP),
    "zero2": _rules("zero2", _STAGE, _DP, grads=_FSDP, optimizer=_FSDP),
    # FSDP / ZeRO-3: parameters (hence grads and optimizer state) split on `embed` over fsdp,
    # gathered layer by layer inside the step.
    "fsdp": _rules("fsdp", _FSDP, _DP),
    # Context parallelism: activations split on the sequence; K/V passed round a ring.
    "context": _rules("context", _FSDP, _CONTEXT),
    # ... with only the optimizer state split over fsdp x context (ZeRO-1, as Megatron's
    # distributed optimizer shards it over data x context parallel ranks).
    "context-zero1": _rules("context-zero1", _STAGE, _CONTEXT, optimizer=_CONTEXT_FSDP),
    # ... with parameters, gradients and optimizer state split over fsdp x context (FSDP over
    # the ring's ranks too, as torchtitan's data x context mesh does).
    "context-fsdp": _rules("context-fsdp", _CONTEXT_FSDP, _CONTEXT),
    # DeepSpeed-Ulysses: the sequence split over context outside attention; an all-to-all
    # trades it for a split of the heads, attention runs on whole rows (any kernel, no ring),
    # and an all-to-all trades back. Heads divide by the context size (fewer K/V heads than
    # ranks are gathered whole instead).
    "ulysses": _rules("ulysses", _FSDP, _ULYSSES),
    "ulysses-fsdp": _rules("ulysses-fsdp", _CONTEXT_FSDP, _ULYSSES),
    # Megatron tensor parallelism: attention by heads, the MLP by its hidden axis, embedding and
    # LM head by vocabulary (so full logits are never gathered).
    "megatron": _rules("megatron", _TP_PARAMS, _TP),
    # ... plus Megatron sequence parallelism between the tensor-parallel regions.
    "megatron-sp": _rules("megatron-sp", _TP_PARAMS, _SP),
}
# The default: every parallelism the mesh has, without sequence parallelism.
RULE_SETS["auto"] = dataclasses.replace(RULE_SETS["megatron"], name="auto")
DEFAULT_RULES = "auto"
_INLINE_KEYS = ("params", "activations", "grads", "optimizer")


def _parse_rules(value: str | Mapping[str, Any], where: str) -> Rules:
    if isinstance(value, str):
        if value not in RULE_SETS:
            raise UserError(f"{where}: unknown rule set {value!r}: choose one of "
                            f"{', '.join(RULE_SETS)}, or give an inline table of logical -> "
                            f"mesh axes")
        return RULE_SETS[value]
    if not isinstance(value, Mapping) or not value or set(value) - set(_INLINE_KEYS):
        raise UserError(f"{where}: rules must be a rule-set name or a table with "
                        f"{', '.join(map(repr, _INLINE_KEYS))} (each logical axis -> mesh axes)")
    return Rules.from_mappings("inline", value.get("params", {}), value.get("activations", {}),
                               value.get("grads"), value.get("optimizer"), where)


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A parallelism strategy (HotSPa's DStates): mesh sizes in `MESH_AXES` order + rules."""

    sizes: tuple[int, ...]
    rules: Rules
    # Context parallelism with causal attention: each context rank holds sequence chunks i and
    # 2C-1-i, so every rank has as much of the causal triangle as any other.
    balanced: bool = False
    # Pipeline micro-batches a step's rows are cut into (None without a `stage` axis).
    microbatches: int | None = None

    @classmethod
    def create(cls, mesh: Mapping[str, int], rules: str | Mapping | None = None,
               where: str = "strategy", balanced: bool = False,
               microbatches: int | None = None) -> Strategy:
        unknown = [a for a in mesh if a not in MESH_AXES]
        if unknown:
            raise UserError(f"{where}: unknown mesh axis {unknown[0]!r}: "
                            f"use {', '.join(MESH_AXES)}")
        for axis, size in mesh.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise UserError(f"{where}: mesh axis {axis}={size!r} must be a positive integer")
        sizes = tuple(mesh.get(a, 1) for a in MESH_AXES)
        if not isinstance(balanced, bool):
            raise UserError(f"{where}: balanced={balanced!r} must be true or false")
        stages = mesh.get("stage", 1)
        if microbatches is not None and (not isinstance(microbatches, int)
                                         or isinstance(microbatches, bool) or microbatches < 1):
            raise UserError(f"{where}: microbatches={microbatches!r} must be a positive integer")
        if stages == 1 and microbatches is not None:
            raise UserError(f"{where}: microbatches are a pipeline's: add a stage axis, or drop "
                            f"microbatches")
        if stages > 1:
            microbatches = 2 * stages if microbatches is None else microbatches
            if microbatches < stages:
                raise UserError(f"{where}: microbatches={microbatches} < stage={stages}: a "
                                f"pipeline needs at least one micro-batch per stage (default "
                                f"{2 * stages})")
        strategy = cls(sizes, _parse_rules(DEFAULT_RULES if rules is None else rules, where),
                       balanced, microbatches)
        if balanced and strategy.ring == 1:
            raise UserError(f"{where}: a balanced chunk order needs the sequence split over a "
                            f"context axis larger than 1 (a ring): add one, or drop balanced")
        idle = [f"{a}={n}" for a, n in strategy.axes.items()
                if n > 1 and a not in strategy.rules.mesh_axes_used()]
        if idle:
            raise UserError(f"{where}: mesh axis {idle[0]} is not used by rules "
                            f"{strategy.rules.name!r} (every device would repeat the same work): "
                            f"choose rules that use it, or drop the axis")
        if stages > 1:
            _check_pipeline(strategy, where)
        _check_exchange(strategy, where)
        return strategy

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """From the command line: `"data=2,fsdp=4"`, optionally with `",rules=NAME"` and
        `",balanced=true"`."""
        mesh: dict[str, int] = {}
        rules, balanced, microbatches = None, None, None
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep:
                raise UserError(f"--strategy {text!r}: expected AXIS=SIZE items, "
                                f"like 'data=2,fsdp=4'")
            if key in mesh or (key == "rules" and rules is not None) or (
                    key == "balanced" and balanced is not None) or (
                    key == "microbatches" and microbatches is not None):
                raise UserError(f"--strategy {text!r}: {key!r} is given twice: give it once")
            if key == "rules":
                rules = value.strip()
            elif key == "balanced":
                if value.strip().lower() not in ("true", "false"):
                    raise UserError(f"--strategy {text!r}: balanced must be true or false")
                balanced = value.strip().lower() == "true"
            elif key == "microbatches":
                if not value.strip().isdecimal():
                    raise UserError(f"--strategy {text!r}: microbatches must be a positive "
                                    f"integer")
                microbatches = int(value)
            elif value.strip().isdecimal():
                mesh[key] = int(value)
            else:
                raise UserError(f"--strategy {text!r}: size of {key!r} must be a positive integer")
        if not mesh:
            raise UserError(f"--strategy {text!r}: give at least one mesh axis, e.g. 'data=8'")
        return cls.create(mesh, rules, where=f"--strategy {text!r}", balanced=bool(balanced),
                          microbatches=microbatches)

    @property
    def axes(self) -> dict[str, int]:
        return dict(zip(MESH_AXES, self.sizes, strict=True))

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes)

    def __str__(self) -> str:
        used = "·".join(f"{a}{n}" for a, n in self.axes.items() if n > 1) or "single"
        extra = (", balanced" if self.balanced else "") + (
            f", {self.microbatches} micro-batches" if self.microbatches else "")
        return f"{used} [{self.rules.name}{extra}]"

    @property
    def data_shards(self) -> int:
        """How many device groups split a batch's rows between them (the data-like axes the
        rules put `batch` on), each a contiguous block of rows."""
        return math.prod(ways(self.activation_spec(("batch",)), self.axes))

    @property
    def batch_shards(self) -> int:
        """How many ways a micro-step's rows are split: over the data shards, and within each
        into pipeline micro-batches. Rows per micro-step are a multiple of it."""
        return self.data_shards * (self.microbatches or 1)

    @property
    def stages(self) -> int:
        """Pipeline stages: the stacked layers split over `stage` (1: no pipeline)."""
        return self.axes["stage"]

    @property
    def ring(self) -> int:
        """Devices a context ring passes K/V round: the ways attention's sequence is split
        inside the kernel (`attention_specs`), whichever mesh axes the rules split it over (1:
        no ring)."""
        split = ways(self.attention_specs()[0], self.axes)
        return split[1] if len(split) > 1 else 1

    @property
    def exchange_axes(self) -> tuple[str, ...]:
        """Mesh axes (of size > 1) over which attention trades its sequence split for a head
        split by an all-to-all (Ulysses; the rules' `attn_heads`)."""
        return as_tuple(_part(self.activation_spec(("attn_heads",)), 0))

    def attention_specs(self) -> tuple[PartitionSpec, PartitionSpec]:
        """Queries' and K/V's layout ([B, T, N, H], [B, S, K, H]) inside the attention kernel:
        as the activation rules place them, with the `exchange_axes` moved from the sequence
        to the query heads, and to the K/V heads where `attn_kv_heads` maps them (else K/V
        are gathered whole over them)."""
        exchange = self.exchange_axes

        def inside(heads: str, exchanged: str) -> PartitionSpec:
            spec = self.activation_spec(("batch", "inner_seq", heads, "head_dim"))
            seq = tuple(a for a in as_tuple(_part(spec, 1)) if a not in exchange)
            moved = as_tuple(_part(self.activation_spec((exchanged,)), 0))
            parts = [_part(spec, 0), _joined(seq), _joined((*as_tuple(_part(spec, 2)), *moved)),
                     _part(spec, 3)]
            while parts and parts[-1] is None:
                parts.pop()
            return PartitionSpec(*parts)

        return inside("heads", "attn_heads"), inside("kv_heads", "attn_kv_heads")

    def param_spec(self, axes: Sequence[str | None]) -> PartitionSpec:
        return _spec(axes, self.rules.params, self.axes)

    def grad_spec(self, axes: Sequence[str | None]) -> PartitionSpec:
        return _spec(axes, self.rules.params if self.rules.grads is None else self.rules.grads,
                     self.axes)

    def optimizer_spec(self, axes: Sequence[str | None]) -> PartitionSpec:
        mapping = self.rules.params if self.rules.optimizer is None else self.rules.optimizer
        return _spec(axes, mapping, self.axes)

    def activation_spec(self, axes: Sequence[str | None]) -> PartitionSpec:
        return _spec(axes, self.rules.activations, self.axes)


def _check_pipeline(strategy: Strategy, where: str) -> None:
    """Pipeline stages need the rules to split the stacked layers over `stage` (a stage holds
    its block of layers) and nothing else over it (inside a stage every other axis works as
    without a pipeline)."""
    rules = strategy.rules
    maps = (("params", rules.params), ("grads", rules.grads), ("optimizer", rules.optimizer))
    for kind, mapping in maps:
        if mapping is None:
            continue
        lookup = dict(mapping)
        if "stage" not in lookup.get("layers", ()):
            raise UserError(f"{where}: rules {rules.name!r} do not split the stacked layers over "
                            f"stage in {kind}: map layers to stage (every built-in rule set "
                            f"does)")
        other = next((k for k, axes in mapping if k != "layers" and "stage" in axes), None)
        if other:
            raise UserError(f"{where}: rules {rules.name!r} split {other} over stage in {kind}: "
                            f"only the stacked layers go over stage")
    used = next((k for k, axes in rules.activations if "stage" in axes), None)
    if used:
        raise UserError(f"{where}: rules {rules.name!r} split activation axis {used} over "
                        f"stage: a pipeline's activations move between stages, map them to "
                        f"other axes")


def _check_exchange(strategy: Strategy, where: str) -> None:
    """An all-to-all trades the sequence's split for the heads': `attn_heads` may map only
    mesh axes that split `inner_seq`, and `attn_kv_heads` only those of `attn_heads`."""
    rules = strategy.rules
    seq = set(as_tuple(_part(strategy.activation_spec((None, "inner_seq")), 1)))
    for logical, allowed, of in (("attn_heads", seq, "inner_seq"),
                                 ("attn_kv_heads", set(strategy.exchange_axes), "attn_heads")):
        extra = [a for a in as_tuple(_part(strategy.activation_spec((logical,)), 0))
                 if a not in allowed]
        if extra:
            raise UserError(f"{where}: rules {rules.name!r} map {logical} to {extra[0]}, which "
                            f"does not split {of}: an all-to-all trades the sequence's split "
                            f"for the heads', so map {extra[0]} to {of} too, or drop it")


def canonical_devices(devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """Node-major device order: every strategy's mesh is a reshape of this one list."""
    devices = jax.devices() if devices is None else devices
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def _spec(axes: Sequence[str | None], mapping: AxisMap, sizes: Mapping[str, int]
          ) -> PartitionSpec:
    return _spec_of(tuple(axes), mapping, tuple(sizes.items()))


# A plan asks for the same few arrays' specs under the same ~90 strategies again and again (a
# search prices thousands of tables).
@functools.lru_cache(maxsize=65536)
def _spec_of(axes: tuple[str | None, ...], mapping: AxisMap,
             mesh: tuple[tuple[str, int], ...]) -> PartitionSpec:
    sizes = dict(mesh)
    lookup = {"stages": ("stage",), **dict(mapping)}  # a pipeline's stage buffer
    taken: set[str] = set()
    parts: list[Any] = []
    for logical in axes:
        # A mesh axis shards at most one dimension; size-1 axes are left out of the spec.
        mesh_axes = tuple(a for a in lookup.get(logical, ()) if a not in taken and sizes[a] > 1)
        taken.update(mesh_axes)
        parts.append(_joined(mesh_axes))
    while parts and parts[-1] is None:
        parts.pop()
    return PartitionSpec(*parts)


def _part(spec: PartitionSpec, dim: int) -> str | tuple[str, ...] | None:
    return spec[dim] if len(spec) > dim else None


def _joined(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def ways(spec: PartitionSpec, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """How many pieces each dimension of an array under `spec` is cut into."""
    return tuple(math.prod(sizes[a] for a in as_tuple(part)) for part in spec)


# How a bucket accumulates gradients over its micro-steps (`hotjax.step`): each data shard's
# partial sum reduced once per bucket, or reduce-scattered every micro-step into a split sum.
ACCUMULATE = ("local", "sharded")


def partial_axes(strategy: Strategy) -> tuple[str, ...]:
    """The mesh axes over which a bucket can keep each data shard's gradients apart, to reduce
    them once per bucket (`hotjax.step.ACCUMULATE`): the leading axes (of size > 1) that split
    the rows and that no gradient is split on."""
    batch = strategy.activation_spec(("batch",))
    rules = strategy.rules
    grad_axes = {a for _, axes in (rules.grads or rules.params) for a in axes}
    axes = []
    for axis in as_tuple(batch[0] if len(batch) else None):
        if axis in grad_axes:
            break
        axes.append(axis)
    return tuple(axes)


def scatter_dim(shape: Sequence[int], spec: PartitionSpec, partial: tuple[str, ...],
                pieces: int, lands: Callable[[PartitionSpec], bool]
                ) -> tuple[int, PartitionSpec] | None:
    """Where a `local` bucket's partial gradient sums of an array of `shape` (laid out by `spec`
    within each data shard) are reduce-scattered over the `pieces` shards of its `partial`
    axes: a dimension `spec` leaves whole that splits evenly, the largest first, whose
    scattered layout `lands` exactly on the home's (nothing moves after it), as (dimension,
    scattered spec). None where no dimension does: the sums are all-reduced, then laid out as
    the home's. A reduce-scatter moves half an all-reduce's bytes; XLA:GPU finds it itself
    where the layouts agree, XLA:CPU does not."""
    parts = list(spec) + [None] * (len(shape) - len(spec))
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if parts[dim] is None and shape[dim] % pieces == 0:
            scattered = PartitionSpec(*parts[:dim], _joined(partial), *parts[dim + 1:])
            if lands(scattered):
                return dim, scattered
    return None


def independent_shards(strategy: Strategy, accumulate: str = "local") -> bool:
    """Whether a bucket's data shards run its micro-steps without meeting: under `local`
    accumulation over every mesh axis that splits the rows (`partial_axes`: no weight nor
    gradient split over them), each shard keeps its own partial sum and exchanges nothing until
    the bucket's one gradient reduction. Their work then balances over the bucket, not over
    each micro-step (`hotjax.balance.place`)."""
    return (accumulate == "local" and strategy.data_shards > 1
            and math.prod(strategy.axes[a] for a in partial_axes(strategy))
            == strategy.data_shards)


def fit_to_model(strategy: Strategy, config: LlamaConfig) -> tuple[Strategy, tuple[str, ...]]:
    """The strategy adapted to the model's head counts, and notes on what was adapted.

    With GQA and `tensor` larger than the K/V head count, each K/V head is replicated over
    `tensor / n_kv_heads` ranks, as Megatron does; likewise over the ranks of a Ulysses
    all-to-all (`attn_heads`), where K/V are then gathered whole, not exchanged.
    """
    if config.n_layers % strategy.stages:
        raise UserError(f"{strategy}: {config.n_layers} layers do not split into "
                        f"{strategy.stages} pipeline stages: choose a stage count that divides "
                        f"{config.n_layers}")
    q, _ = strategy.attention_specs()
    axes = as_tuple(_part(q, 2))  # those splitting the heads inside the attention kernel
    n = math.prod(strategy.axes[a] for a in axes)
    if n == 1:
        return strategy, ()
    names, size = "·".join(f"{a}={strategy.axes[a]}" for a in axes), "·".join(axes)
    if config.n_heads % n:
        raise UserError(f"{strategy}: {config.n_heads} attention heads do not split over "
                        f"{names}: choose a {size} size that divides {config.n_heads}")
    if config.n_kv_heads % n == 0:
        return strategy, ()
    if n % config.n_kv_heads:
        raise UserError(f"{strategy}: {config.n_kv_heads} K/V heads neither split over nor "
                        f"replicate evenly across {names}: choose a {size} size that "
                        f"divides or is a multiple of {config.n_kv_heads}")
    note = (f"{config.n_kv_heads} K/V heads < {names}: each K/V head is replicated over "
            f"{n // config.n_kv_heads} {size} ranks")
    rules = strategy.rules.without("kv_heads").without("attn_kv_heads")
    return dataclasses.replace(strategy, rules=rules), (note,)


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

    def param_shardings(self, axes_tree: Any, shapes: Any,
                        spec: Callable[[Sequence[str | None]], PartitionSpec] | None = None) -> Any:
        """NamedShardings for a tree of logical axes (by default the parameters' placement; pass
        `strategy.grad_spec` or `optimizer_spec` for ZeRO); every split dimension must divide."""
        spec = spec or self.strategy.param_spec

        def one(path: tuple, axes: tuple[str, ...], shape: jax.ShapeDtypeStruct) -> NamedSharding:
            placement = spec(axes)
            for dim, (size, pieces) in enumerate(zip(shape.shape, ways(placement, self.mesh.shape),
                                                     strict=False)):
                if size % pieces:
                    name = "/".join(str(getattr(k, "key", k)) for k in path)
                    raise UserError(f"parameter {name} dimension {dim} ({axes[dim]}={size}) does "
                                    f"not split {pieces} ways under {self.strategy}: choose sizes "
                                    f"that divide it")
            return NamedSharding(self.mesh, placement)

        return jax.tree_util.tree_map_with_path(one, axes_tree, shapes,
                                                is_leaf=lambda x: isinstance(x, tuple))

    def constrain(self, x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
        """The activation-sharding hook handed to the model."""
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, self.strategy.activation_spec(axes)))

    def across_stages(self, x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
        """`x` as `constrain` lays it out, its rows (the leading axis, `batch`) split over the
        pipeline's stages as well where they divide: what follows a pipeline (the final norm,
        the LM head, the loss) then runs on a share of the rows in each stage group."""
        spec = list(self.strategy.activation_spec(axes)) or [None]
        rows = math.prod(ways(PartitionSpec(spec[0]), self.mesh.shape))
        stages = self.strategy.stages
        if stages > 1 and x.shape[0] % (rows * stages) == 0:
            spec[0] = (*as_tuple(spec[0]), "stage")
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(*spec)))

    @property
    def attention(self) -> AttentionSharding:
        """Where attention runs: per device, queries and K/V as `Strategy.attention_specs`
        places them, the sequence on a ring where it stays split."""
        return AttentionSharding(self.mesh, *self.strategy.attention_specs(),
                                 self.strategy.balanced)

    @property
    def batch_sharding(self) -> NamedSharding:
        """Where a micro-step's rows (tokens, segment ids, positions, targets) lie: split as
        attention and the loss read them, the sequence split as inside attention (`inner_seq`).
        Sequence parallelism splits the residual stream over tensor too, but rows laid out so
        would be gathered at every use: the rotary tables built from them, the segment ids
        and positions for attention, the tokens for the vocabulary-parallel embedding, the
        targets for the loss (15 all-gathers outside the layer loop of a 2-layer megatron-sp
        step on XLA:CPU)."""
        return NamedSharding(self.mesh, self.strategy.activation_spec(("batch", "inner_seq")))

    @property
    def pipeline(self) -> tuple[int, int] | None:
        """(stages, micro-batches) of a pipeline, or None."""
        return (self.strategy.stages, self.strategy.microbatches) if self.strategy.stages > 1 \
            else None

    @property
    def batch_shards(self) -> int:
        """How many ways the rows of a batch are split (over data-like axes, and into pipeline
        micro-batches); row counts must be a multiple of it."""
        return self.strategy.batch_shards

    @property
    def data_shards(self) -> int:
        """How many devices' groups split a batch's rows between them, each a contiguous block
        of rows (pipeline micro-batches are cut within each)."""
        return self.strategy.data_shards

    @property
    def seq_shards(self) -> int:
        """How many ways each row is split along the sequence; row lengths must divide by it."""
        return math.prod(ways(self.strategy.activation_spec((None, "seq")), self.mesh.shape))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


def as_tuple(part: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if part is None:
        return ()
    return (part,) if isinstance(part, str) else tuple(part)
