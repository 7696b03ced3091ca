"""One device's part of a micro-step under a strategy: the tokens it computes, the ways each
width is split, its parameter elements in each layout, and the mesh axes each collective runs
over, all read off what the strategy's rules map (no mesh axis is priced by its name but
`stage`). The cost model's time (`hotjax.planning.cost`) and memory (`hotjax.planning.memory`)
price these shares."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from jax.sharding import PartitionSpec

from hotjax.models.llama import LlamaConfig, param_leaves
from hotjax.models.pipeline import head_cut
from hotjax.sharding.strategy import MESH_AXES, Strategy, fit_to_model, partial_axes, ways

FP32, INT32 = 4, 4


@dataclasses.dataclass(frozen=True)
class Shares:
    """One device's part of a micro-step under a strategy: tokens it computes, ways each width
    is split, and parameter elements in each layout."""

    rows: float  # rows per micro-step per device
    tokens: float  # residual-stream tokens per device
    inner_tokens: float  # tokens inside attention and the MLP (more under sequence parallelism)
    head_ways: int
    kv_ways: int
    mlp_ways: int
    vocab_ways: int
    stages: int
    microbatches: int
    head_pieces: int  # ways the stage groups split the head's work (`_head_pieces`)
    layers: int  # layers on this device's stage
    weights: int  # parameter layout
    grad_sum: int  # gradient layout
    moments: int  # optimizer layout, one moment
    layer_weights: int  # this stage's layers as the matmuls read them (compute layout)
    layer_shards: int  # the same layers in the parameter layout
    layer_grad_sum: int  # the same layers in the gradient layout
    other_weights: int  # embedding, head and final norm, compute layout
    other_shards: int  # the same in the parameter layout
    token_axes: tuple[str, ...]  # mesh axes splitting the tokens (gradients reduce over them)
    scatter_axes: tuple[str, ...]  # those the gradient layout is split on (reduce-scattered)
    partial_axes: tuple[str, ...]  # data axes a `local` bucket keeps its partial sums apart on
    gather_axes: tuple[str, ...]  # mesh axes the weights are gathered over (FSDP)
    gathered_layer_arrays: int  # this stage's layers' weight arrays gathered, one all-gather each
    gathered_other_arrays: int  # the embedding's, head's and final norm's
    tensor_axes: tuple[str, ...]  # mesh axes splitting heads or the MLP (tensor parallelism)
    ring_axes: tuple[str, ...]  # mesh axes splitting attention's sequence (a context ring)
    exchange_axes: tuple[str, ...]  # those an all-to-all trades for the heads (Ulysses)
    kv_exchanged: bool  # K/V heads exchanged too (else gathered whole over `exchange_axes`)
    sequence_parallel: bool  # the residual stream split over tensor axes too


def shares(config: LlamaConfig, strategy: Strategy, shape: tuple[int, int]) -> Shares:
    """One device's part of a micro-step on micro-steps of `shape` (rows, tokens per row)."""
    strategy, count, axes = _layout(config, strategy)
    sizes, act = strategy.axes, strategy.activation_spec
    rows, seq_len = shape

    def split(axes: tuple[str | None, ...]) -> int:
        return ways(act(axes), sizes)[-1] if len(act(axes)) == len(axes) else 1

    device_rows = rows / split(("batch",))
    return Shares(
        rows=device_rows, tokens=rows * seq_len / math.prod(
            ways(act(("batch", "seq")), sizes)),
        inner_tokens=rows * seq_len / math.prod(ways(act(("batch", "inner_seq")), sizes)),
        head_ways=split((None, "heads")), kv_ways=split((None, "kv_heads")),
        mlp_ways=split((None, "mlp")), vocab_ways=split((None, "vocab")),
        stages=strategy.stages, microbatches=strategy.microbatches or 1,
        head_pieces=_head_pieces(config, strategy, device_rows, shape),
        layers=config.n_layers // strategy.stages, **count,
        partial_axes=partial_axes(strategy), **axes)


def fitted_strategy(config: LlamaConfig, strategy: Strategy) -> Strategy:
    """`strategy` fitted to the model (`hotjax.sharding.strategy.fit_to_model`), cached."""
    return _layout(config, strategy)[0]


@functools.lru_cache(maxsize=4096)
def _layout(config: LlamaConfig, strategy: Strategy) -> tuple[Strategy, dict[str, int],
                                                              dict[str, Any]]:
    """What `shares` needs of a strategy whatever the shape: the strategy fitted to the model,
    parameter elements per device in each layout, and the mesh axes each collective runs over,
    read off what the rules map (no mesh axis is priced by its name but `stage`): those that
    split the tokens, that the gradients are scattered over, that the weights are gathered
    over, that split heads or the MLP (tensor parallelism's all-reduces, or with the residual
    stream split over them too, sequence parallelism's gathers and scatters) and that split
    attention's sequence (the ring's K/V sends)."""
    strategy, _ = fit_to_model(strategy, config)
    sizes, act = strategy.axes, strategy.activation_spec
    count = dict.fromkeys(("weights", "grad_sum", "moments", "layer_weights", "layer_shards",
                           "layer_grad_sum", "other_weights", "other_shards"), 0)
    param_mesh_axes, compute_mesh_axes, grad_mesh_axes = set(), set(), set()
    gathered = {"layer": 0, "other": 0}
    for axes, leaf in param_leaves(config):
        n = math.prod(leaf.shape)
        layer = axes[0] == "layers"
        compute = act(axes[1:] if layer else axes)
        placed = {"weights": strategy.param_spec(axes), "grad_sum": strategy.grad_spec(axes),
                  "moments": strategy.optimizer_spec(axes)}
        for key, spec in placed.items():
            count[key] += n // math.prod(ways(spec, sizes))
        prefix = "layer" if layer else "other"
        count[f"{prefix}_weights"] += n // math.prod(ways(compute, sizes)) // (
            strategy.stages if layer else 1)
        count[f"{prefix}_shards"] += n // math.prod(ways(placed["weights"], sizes))
        if layer:
            count["layer_grad_sum"] += n // math.prod(ways(placed["grad_sum"], sizes))
        if _mesh_axes(placed["weights"]) - _mesh_axes(compute) - {"stage"}:
            gathered[prefix] += config.n_layers // strategy.stages if layer else 1
        param_mesh_axes |= _mesh_axes(placed["weights"])
        grad_mesh_axes |= _mesh_axes(placed["grad_sum"])
        compute_mesh_axes |= _mesh_axes(compute)
    token_axes = _mesh_axes(act(("batch", "inner_seq")))
    tensor_axes = _mesh_axes(act(("heads",))) | _mesh_axes(act(("mlp",)))
    q, kv = strategy.attention_specs()
    return strategy, count, {
        "token_axes": _ordered(token_axes),
        "scatter_axes": _ordered(token_axes & grad_mesh_axes),
        "gather_axes": _ordered(param_mesh_axes - compute_mesh_axes - {"stage"}),
        "gathered_layer_arrays": gathered["layer"],
        "gathered_other_arrays": gathered["other"],
        "tensor_axes": _ordered(tensor_axes),
        "ring_axes": _ordered(_mesh_axes(PartitionSpec(*q[1:2]))),
        "exchange_axes": strategy.exchange_axes,
        "kv_exchanged": bool(_mesh_axes(PartitionSpec(*kv[2:3])) & set(strategy.exchange_axes)),
        "sequence_parallel": bool(_mesh_axes(act(("seq",))) & tensor_axes)}


def _head_pieces(config: LlamaConfig, strategy: Strategy, device_rows: float,
                 shape: tuple[int, int]) -> int:
    """How many ways a pipeline's stage groups split the head's work, as the model cuts it:
    GPipe's rows after it where a device's rows divide (`across_stages`), 1F1B's micro-batch
    by rows or tokens where they divide (`hotjax.models.pipeline.head_cut`), else not at all
    (each stage group runs the whole head)."""
    S = strategy.stages
    if S == 1:
        return 1
    if config.pipeline_schedule == "gpipe":
        return S if device_rows % S == 0 else 1
    rows, seq_len = shape
    micro_rows = rows // (strategy.microbatches or 1)
    return S if head_cut(micro_rows, seq_len, S, strategy.data_shards) else 1


def axes_size(strategy: Strategy, axes: tuple[str, ...]) -> int:
    """Devices in a group along `axes` of `strategy`'s mesh."""
    return math.prod(strategy.axes[a] for a in axes)


def _mesh_axes(spec: PartitionSpec) -> set[str]:
    return {a for part in spec if part for a in ((part,) if isinstance(part, str) else part)}


def _ordered(axes: set[str]) -> tuple[str, ...]:
    return tuple(a for a in MESH_AXES if a in axes)
