"""The analytic cost model: the time of one bucket's micro-step and its per-device memory, for a
model, a strategy and a micro-step shape (rows, tokens per row), on a hardware profile.

Letters as in `hotjax.models.llama`, plus t tensor ways, c context ring size, S stages, M pipeline
micro-batches. Each row is one causal document (a bucket's worst case); counts are per device.

Time (seconds per micro-step; `MicroStepTime` keeps each term):
- Matmuls: 2 FLOPs per weight per token forward, 4 backward (Kaplan et al. 2020, "Scaling laws",
  §2.1: C = 6N per token); a rematerialised forward (remat "full", and a pipeline stage's
  checkpoint under remat "full") adds 2 more, less the down projection in a layer's recompute
  (its output only joins the residual stream, and JAX drops what no gradient reads: checked
  in the HLO by tests/test_cost.py). The layers' work divides by S; after a pipeline
  each stage group takes 1/S of the rows through the LM head.
- Attention: 4·N·H FLOPs per visible (query, key) pair forward, 2.5x that backward
  (FlashAttention-2's five matmuls against two: Dao 2023, arXiv:2307.08691), counted over the
  blocks the kernel that runs computes (`hotjax.models.work.attention_kernel`): on GPU a packed row
  runs the packed-attention Pallas kernel (tiles of `hotjax.models.packed_attention.block_for`), on
  CPU and round every context ring the blockwise kernel; both skip the blocks above the causal
  diagonal and those no document spans (`document_pairs`). `micro_step_time` prices every row as one
  causal document (the worst case); `MicroStepTime.with_attention` reprices it at the busiest
  device's pairs, which the planner finds by placing a bucket's packed rows on data shards as
  the trainer does. A context ring waits for its busiest rank (rank c-1 in row order; every
  rank alike with `balanced` chunks on causal rows, not on packed ones).
- Matmuls at the profile's peak x its matmul efficiency, by each GEMM's smallest dimension per
  device where the profile measured sizes (`hotjax.planning.profile.MatmulEfficiency`); attention at
  the peak x the efficiency of the kernel that runs (`hotjax.models.work.attention_backend`: cuDNN's
  packed layout, the packed or the ring's Pallas kernel, the blockwise kernel), the profile's
  own for that kernel where it has one (`Profile.attention_at`).
- A collective moving a tensor of `bytes` over a group of n devices takes the profile's latency
  plus factor·bytes / bus bandwidth, with factor 2(n-1)/n for all-reduce, (n-1)/n for
  all-gather and reduce-scatter, 1 for a send (nccl-tests' bus-bandwidth convention); the
  bandwidth is the profile's for that collective, group size, and whether the group spans nodes.
- Elementwise work (the norms, residual adds, rotary embedding, SwiGLU's activation, the
  loss's softmax over the vocabulary, the gradient accumulator's add): memory-bound, priced as
  the bytes its passes move (`ELEMENTWISE`: each array of a width read or written once between
  the kernels that fuse them) over the profile's elementwise bandwidth. Each width is priced on
  the tokens that carry it on a device: the residual stream's on `Shares.tokens`, so that
  Megatron without sequence parallelism repeats its norms and residual adds on every tensor
  rank (whole) while sequence parallelism, data, context and FSDP split them; the MLP's, the
  heads' and the vocabulary's on the inner tokens, split by the tensor ways of their width. A
  recomputed forward (remat) repeats the forward passes. Without the profile's bandwidth
  (`elementwise_gbps`) the term is 0, and a fitted matmul rate carries that work instead.
- Each micro-step also costs the profile's fixed overhead (dispatch, small ops, waits).
- Tensor parallelism (Megatron-LM: Shoeybi et al. 2019, arXiv:1909.08053, §3): per layer two
  all-reduces of the [rows, T, D] activations forward and two backward, plus one at the
  embedding and one (fp32) at the LM head; with sequence parallelism (Korthikanti et al. 2022,
  arXiv:2205.05198, §4.2.2) each all-reduce becomes a reduce-scatter, and the activations are
  all-gathered twice forward and four times backward. Counted as XLA compiles them
  (`_tensor_collectives`): remat "full" repeats one reduction, and XLA:CPU reduces each
  projection's input gradient apart.
- Context parallelism (ring attention): per layer, the forward sends the local K/V chunk c-1
  times round the ring; the backward sends K/V c-1 times and their fp32 gradients c times; a
  recomputed forward sends nothing again (each checked against the HLO's collective bytes in
  tests/test_cost.py). The kernel sends a chunk before computing the one it holds, so on GPU
  the ring hides behind attention: only what exceeds the attention time is exposed. XLA:CPU
  runs each send to completion (`SERIAL_RING`).
- Ulysses (DeepSpeed-Ulysses: Jacobs et al. 2023, arXiv:2309.14509), in the `tensor` term
  with the other collectives of a head split: per layer q, k and v all-to-all'd from the
  sequence split to the head split and the output back, in each forward and transposed in the
  backward, and without remat the saved q, k, v once more (`_exchange`, checked against the
  HLO in tests/test_cost.py); K/V heads fewer than the ranks are all-gathered whole instead
  and their gradients reduced. An all-to-all moves (n-1)/n of each device's tensor, at the
  profile's all-gather bandwidth. Attention then runs on whole rows, 1/n of the heads each.
- FSDP (ZeRO-3): the weights are all-gathered over the fsdp axes layer by layer in the forward
  pass, and again in the backward under remat (with remat "none" XLA keeps the gathered layers),
  one all-gather per weight array, each paying the profile's latency.
- Gradient reduction (`hotjax.step.ACCUMULATE`): under `local` accumulation each data shard
  keeps its own fp32 partial sum over the leading data axes no gradient is split on
  (`hotjax.sharding.strategy.partial_axes`), and the bucket reduces them once at its end
  (`bucket_reduction_seconds`: an all-reduce of the fp32 sums, as Megatron's and DeepSpeed's
  data parallelism reduce once per optimizer step). Every micro-step still reduces its
  compute-dtype gradients over the other axes that split its tokens (fsdp under ZeRO-2/3,
  context): a reduce-scatter over those the accumulator is split on, an all-reduce over the
  rest. Under `sharded` accumulation the data axes are reduce-scattered every micro-step too,
  into an accumulator split over them.
- Pipeline (`hotjax.models.pipeline`, 1F1B or GPipe by `config.pipeline_schedule`): M + S - 1 ticks
  of each stage's forward and as many of its backward, each sending a micro-batch's activations to
  the next stage forward (again in a stage recomputed under remat "full"), and their gradient
  backward; the S - 1 ticks beyond M are the bubble, the same share under both schedules, priced
  at the layers' work per tick. 1F1B also sends each micro-batch from the last stage to the
  stage groups sharing its head, and its gradient back, and runs all of a bucket's micro-steps
  in one schedule: n micro-steps take n·M + S - 1 ticks, one bubble
  (`MicroStepTime.bucket_seconds`); GPipe pays the bubble every micro-step.

Memory (bytes per device at the micro-step's peak; `MicroStepMemory` keeps each term):
- Arguments, exactly: the compute-dtype weights in the parameter layout, the fp32 accumulator in
  the gradient layout (a data shard's part of it under `sharded` accumulation), the
  micro-step's four int32 arrays.
- The weights as the matmuls read them, beyond the arguments: gathered over fsdp and, where XLA
  widens the compute dtype (XLA:CPU runs bf16 dots in fp32: `HELD_BYTES`), widened. With remat
  "none" XLA keeps every layer's so from the forward pass for the backward; under remat, one
  layer's at a time.
- Weight gradients: the layer loop stacks them (reduce-scattered first under fsdp), unless it
  is unrolled (`UNROLLED_WORKING`: a GPU under remat "none"); a pipeline
  carries its stage's gradient sum through the ticks, in and out of each (1F1B its head's and
  embedding's too, in fp32, beside each tick's gradients).
- Activations saved for the backward pass: per layer and token, `SAVED` arrays of each width by
  remat policy, for each micro-batch a pipeline stage holds (`hotjax.models.pipeline.in_flight`:
  GPipe every one of its M + S - 1 ticks', with the scan's carry, the stage slot and the M finished
  micro-batches; 1F1B at most 2S - 1, beside a carry of two stage slots:
  nothing grows with the micro-batches a schedule runs); under remat "full" a pipeline keeps only
  those micro-batches' stage inputs and recomputes one micro-batch's layers at a time. Under 1F1B
  the head's logits are one micro-batch's.
- The backward pass's working set (`WORKING`): activation gradients, a layer's gradients or its
  recomputed activations; or, where more, the head's phase at the end of the forward pass
  (`HEAD_PHASE`: the loss's gradient with respect to the logits in the compute dtype, a chunk's
  fp32 logits: a narrow model with a wide vocabulary on long rows).
Which arrays exist and how many was read off XLA's buffer assignment of the compiled micro-step, and
the counts calibrated against its memory analysis on LLaMA2-7B widths (XLA:CPU, 8 devices;
tests/test_cost.py checks six strategies): with remat "none", data, fsdp, tensor and context
strategies within 7 % at 2, 4 and 32 layers, pipelines within 8 % at 32 layers (1F1B, M = 2 and 8)
and 14 % at 2 layers per stage (one layer per stage XLA plans 15-30 % leaner); remat "dots" and
"full" within 10 % at 2 and 4 layers and 2 % at 32, outside pipelines (a pipeline under remat is not
calibrated: over-predicted by 25-50 % at 32 layers). A 1F1B pipeline (stage=2, tensor=4 at 4 layers,
its bucket in one schedule) within 2 % at M = 2 and 8; GPipe's terms were fitted at M = 2 and
over-predict by 24 % at M = 8, where XLA plans 1F1B a third leaner than GPipe.
`hotjax.sharding.report.resident_bytes` is what stays besides: the home's fp32 weights, the
optimizer's state and the gradient sum.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from hotjax.errors import UserError
from hotjax.models.attention import block_edge
from hotjax.models.head_loss import loss_chunks
from hotjax.models.llama import LlamaConfig, layers_unrolled, param_leaves
from hotjax.models.pipeline import in_flight
from hotjax.models.work import attention_backend, attention_kernel
from hotjax.planning.profile import Profile
from hotjax.sharding.strategy import MESH_AXES, Strategy, fit_to_model, partial_axes, ways
from hotjax.sharding.transfers import TransferSchedule, boxes_from_strategy

# Bumped whenever a change to this model changes what a measured profile's fitted constants
# mean (they are fitted through `micro_step_time`): cached profiles of another version are
# measured again (`hotjax.planning.measure.profile_path`). 2: one gradient reduction per bucket,
# pipelines without whole-stage recompute, the LM head shared by stage groups. 3: 1F1B's one
# schedule per bucket, the embedding inside it. 4: the matmul rate fitted on micro-steps of
# trained size. 5: the elementwise passes priced apart from the matmul rate.
COST_MODEL_VERSION = 5
FP32, INT32 = 4, 4
BATCH_ARRAYS = 4  # tokens, segment ids, positions, targets
# Of each collective's tensor, the bytes moved per device over a group of n (the bus-bandwidth
# convention of nccl-tests): time = latency + factor · bytes / bus bandwidth.
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n, "send": lambda n: 1.0,
    "all-to-all": lambda n: (n - 1) / n}
# Collectives a profile does not measure, priced at the bandwidth of one it does: an all-to-all
# moves (n-1)/n of each device's tensor over every link at once, as an all-gather does.
PRICED_AS = {"all-to-all": "all-gather"}
# Bytes per element XLA holds matmul operands and activations in, where it widens the compute
# dtype: XLA:CPU runs bf16 and fp16 dots in fp32. Elsewhere: the compute dtype's size.
HELD_BYTES = {"cpu": 4}
# Platforms whose compiled steps send activations at `HELD_BYTES` (what a collective next to a
# widened dot carries) and reduce-scatter them as an all-reduce and a slice: XLA's SPMD
# partitioner emits the latter, and the GPU pipeline fuses it back into a reduce-scatter
# (checked in the HLO of `tiny`'s Megatron steps, bf16: for an H100 bf16 all-reduces,
# all-gathers and reduce-scatters; on XLA:CPU only fp32 all-reduces and all-gathers). Priced
# as a reduce-scatter, a sequence-parallel step on two processes over a 20 MB/s link came out
# 65-71 % short of the measured one.
WIDE_WIRE = frozenset({"cpu"})
# Platforms whose ring attention does not overlap its sends with the attention it computes:
# XLA:CPU runs a collective-permute to completion before the next op. On two processes over a
# 20 MB/s link the ring's measured cost was the whole of its sends whatever the attention.
SERIAL_RING = frozenset({"cpu"})
# Per token of one layer, the arrays of each width kept for the backward pass, by remat policy:
# (residual stream D, MLP hidden F, query-wide N·H, K/V-wide K·H).
SAVED = {"none": (6, 6, 3, 2), "dots": (2, 2, 1, 2), "full": (1, 0, 0, 0)}


@dataclasses.dataclass(frozen=True)
class Passes:
    """Elementwise passes per token of one layer, by width (residual stream D, MLP hidden F,
    query-wide N·H, K/V-wide K·H): arrays of that width read or written once each."""

    forward: tuple[int, int, int, int]
    backward: tuple[int, int, int, int]
    logits: int  # per token at the head, fp32 vocabulary-wide
    accumulator: int  # per gradient element a micro-step: the fp32 sum read and written


# Counted by the kernels XLA fuses between a layer's matmuls. Forward: two norms (x read, h
# written: 2 D each), two residual adds (two read, one written: 3 D each), the rotary embedding
# of q and k (2 each), SwiGLU (gate and up read, hidden written: 3 F). Backward: each norm's
# gradient reads x and its output's gradient and adds into the stream's (4 D), each residual
# add's gradient passes the stream's on (3 D), SwiGLU's reads gate, up and the hidden gradient
# and writes two (5 F), the rotary's is its forward's. The loss: the fp32 logits written, read
# by the log-sum-exp, read and written again for their gradient. The accumulator: its fp32 sum
# read and written (the gradient's compute-dtype read counted beside it).
ELEMENTWISE = Passes(forward=(10, 3, 2, 2), backward=(14, 5, 2, 2), logits=4, accumulator=2)


@dataclasses.dataclass(frozen=True)
class PlatformScale:
    """Where one XLA backend plans other bytes than the counts above (fitted on XLA:CPU)."""

    gathered: float = 1.0  # FSDP's gathered weights kept for the backward (remat "none")
    stash: float = 1.0  # a 1F1B pipeline's in-flight activations (remat "none")
    stage_gradients: float = 1.0  # a 1F1B pipeline's carried gradient sums (remat "none")


# XLA:GPU against the model (LLaMA2-7B widths, 4 layers, 8 H100s compiled without a GPU:
# tests/test_cost.py). Data, tensor and context strategies plan within 8 % of it unscaled. Two
# differ: FSDP without remat keeps about two thirds of the gathered weights XLA:CPU keeps (the
# model over-predicted by 14 %; the cause not isolated), and a 1F1B pipeline without remat
# under-predicted by half: XLA:GPU's buffer assignment holds the schedule's activation stash both
# as the tick loop's carry and as the result of the conditional that writes it (two buffers
# where XLA:CPU updates one in place), some of it in fp32, and likewise the carried gradient
# sums. Fitted on M = 2 and 4, stage=2 with tensor=4 and with data=2·tensor=2: within 2 %.
# Pipelines under remat are not scaled (the model over-predicts them by 4-8 % on GPU).
PLATFORM_SCALE = {"gpu": PlatformScale(gathered=0.65, stash=2.9, stage_gradients=1.7)}
# The layer loop unrolled (`hotjax.models.llama.layers_unrolled`: a GPU under remat "none"): no
# stacked gradients (each layer's reaches the accumulator as it is made) and a working set of
# about half the scan's, without its logits-sized arrays. Fitted on XLA:GPU's plans for H100s
# (LLaMA2-7B widths, 4 layers, 8 x 1,024 tokens): model / XLA data 1.05, fsdp 0.93, megatron
# 1.14 (its replicated residual stream saved less than counted), megatron-sp 0.99, context with
# tensor 1.00; the scan's model was 1.23-1.49 over the same unrolled plans.
UNROLLED_WORKING = 0.5


@dataclasses.dataclass(frozen=True)
class Working:
    """The backward pass's working set at its peak: copies of one layer's (and the embedding's
    and head's) gradients in the compute dtype (outside a pipeline), activation gradients per
    token (widths as in `SAVED`), and layers recomputed at once. No logits: the fused head
    (`hotjax.models.head_loss`) consumed them in the forward pass."""

    gradients: int
    widths: tuple[int, int, int, int]
    recomputed: int


WORKING = {"none": Working(1, (4, 2, 1, 0), 0),
           "dots": Working(0, (0, 1, 1, 0), 1),
           "full": Working(0, (0, 1, 1, 0), 1)}
# XLA:GPU's plan of the backward holds about this many fp32 logits-sized arrays' worth more than
# the counts above, by remat policy: fitted on LLaMA2-7B's widths when the head's backward still
# held the fp32 logits, and unchanged (within 1 %) since the fused head no longer does: the
# bytes are real, their cause not isolated (tests/test_cost.py).
WORKING_LOGITS = {"gpu": {"none": 3, "dots": 2, "full": 2}}
# The head's phase, at the end of the forward pass, beside everything the layers saved: the
# loss's gradient with respect to the logits, whole, in the compute dtype
# (`hotjax.models.head_loss`), and per chunk of the loss some fp32 logits-sized arrays, and
# residual-stream arrays per token. On XLA:CPU one chunk array and four residual arrays: a
# 256-wide, 8K-vocabulary model (2 layers, fp32) on 2K-token rows, whose peak this phase is, within
# 3 % under tensor + sequence parallelism (remat "full") and data parallelism ("dots")
# (tests/test_cost.py).
HEAD_PHASE = {"cpu": (1, 4)}  # platform: (fp32 logits-sized arrays per chunk, residual arrays)


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
    gathered_arrays: int  # weight arrays gathered apart, one all-gather each (a layer's per layer)
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

    return Shares(
        rows=rows / split(("batch",)), tokens=rows * seq_len / math.prod(
            ways(act(("batch", "seq")), sizes)),
        inner_tokens=rows * seq_len / math.prod(ways(act(("batch", "inner_seq")), sizes)),
        head_ways=split((None, "heads")), kv_ways=split((None, "kv_heads")),
        mlp_ways=split((None, "mlp")), vocab_ways=split((None, "vocab")),
        stages=strategy.stages, microbatches=strategy.microbatches or 1,
        layers=config.n_layers // strategy.stages, **count,
        partial_axes=partial_axes(strategy), **axes)


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
    gathered_arrays = 0
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
            gathered_arrays += config.n_layers // strategy.stages if layer else 1
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
        "gathered_arrays": gathered_arrays,
        "tensor_axes": _ordered(tensor_axes),
        "ring_axes": _ordered(_mesh_axes(PartitionSpec(*q[1:2]))),
        "exchange_axes": strategy.exchange_axes,
        "kv_exchanged": bool(_mesh_axes(PartitionSpec(*kv[2:3])) & set(strategy.exchange_axes)),
        "sequence_parallel": bool(_mesh_axes(act(("seq",))) & tensor_axes)}


@dataclasses.dataclass(frozen=True)
class MicroStepMemory:
    """Per-device bytes of one micro-step at its peak, as XLA plans it."""

    weights: int  # compute-dtype weights, parameter layout (argument)
    grad_sum: int  # fp32 gradient accumulator, its loss sum and count (argument, donated)
    batch: int  # the micro-step's int32 arrays and the loss scale (argument)
    read_weights: int  # weights as the matmuls read them, beyond the arguments
    gradients: int  # weight gradients before they reach the accumulator
    activations: int  # kept for the backward pass, every pipeline micro-batch in flight
    working: int  # the backward pass's working set at its peak

    @property
    def peak(self) -> int:
        return sum(dataclasses.astuple(self))


def micro_step_memory(config: LlamaConfig, strategy: Strategy, shape: tuple[int, int],
                      platform: str = "gpu", accumulate: str = "local") -> MicroStepMemory:
    """The per-device peak of a bucket's gradient micro-step on micro-steps of `shape`, as
    XLA on `platform` ("cpu", "gpu", "tpu") plans it, accumulating as `accumulate` says."""
    s = shares(config, strategy, shape)
    grad_sum = s.grad_sum if accumulate == "local" else s.grad_sum / _size(strategy,
                                                                            s.partial_axes)
    compute = config.dtype.itemsize
    held = HELD_BYTES.get(platform, compute)
    D, F, V = config.dim, config.ffn_dim, config.vocab_size
    query, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim

    def per_token(widths: tuple[int, int, int, int], tokens: float, inner: float) -> float:
        residual, mlp, q, k = widths
        return held * (tokens * residual * D + inner * (
            mlp * F / s.mlp_ways + q * query / s.head_ways + k * kv / s.kv_ways))

    # With remat "none" XLA keeps every layer's gathered (and widened) weights from the forward
    # pass for the backward; under remat it gathers one layer at a time.
    kept = config.remat == "none"
    layers_read = s.layer_weights if kept else (
        s.layer_shards + (s.layer_weights - s.layer_shards) / s.layers)
    read = layers_read + s.other_weights
    owned = s.layer_shards + s.other_shards
    read_bytes = read * held if held != compute else (read - owned) * compute
    scale = PLATFORM_SCALE.get(platform, PlatformScale())
    if kept and s.gather_axes:
        read_bytes *= scale.gathered
    M, S = s.microbatches, s.stages
    tokens, inner = s.tokens / M, s.inner_tokens / M  # one pipeline micro-batch (M = 1: all)
    activations = s.layers * per_token(SAVED[config.remat], tokens, inner)
    gpipe = config.pipeline_schedule == "gpipe"
    kept = in_flight(S, M, config.pipeline_schedule)
    if S > 1 and config.remat == "full":  # the stage inputs held; layers recomputed
        activations += (kept + (not gpipe) * 2) * tokens * D * held
    elif S > 1 and gpipe:  # every tick's activations as the policy saves them, and its carry
        activations = kept * (activations + (M + 1) * tokens * D * held)
    elif S > 1:  # the micro-batches in flight, and the carry (held once)
        activations = kept * activations + 2 * tokens * D * held
    # 1F1B runs the head inside the schedule, one micro-batch at a time.
    head_rows = _head_share(s, config.pipeline_schedule) * (M if S > 1 and not gpipe else 1)
    # A pipeline carries its stage's gradient sum through the iterations at the matmuls' width,
    # into and out of each one; otherwise the layer loop stacks them in the accumulator's layout.
    # 1F1B's carry holds the head's and the embedding's gradient sums too, in fp32, and each
    # tick's weight gradients and their masked sum beside them (read off XLA's plan, as the
    # rest).
    gradients = (s.layer_grad_sum * compute if S == 1
                 else 2 * s.layer_weights * held if gpipe
                 else 2 * (FP32 + held) * s.layer_weights + (FP32 + held) * s.other_weights)
    if S > 1 and not gpipe and config.remat == "none":
        activations *= scale.stash
        gradients *= scale.stage_gradients
    work = WORKING[config.remat]
    logits = s.inner_tokens * V / s.vocab_ways * FP32 / head_rows
    unrolled = S == 1 and layers_unrolled(config, platform) >= config.n_layers
    layers_phase = (work.gradients * (S == 1) * (s.layer_weights / s.layers + s.other_weights)
                    * compute + (not unrolled) * WORKING_LOGITS.get(platform, {}).get(
                        config.remat, 0) * logits
                    + per_token(work.widths, tokens, inner)
                    + work.recomputed * per_token(SAVED["none"], tokens, inner))
    if unrolled:
        gradients, layers_phase = 0, UNROLLED_WORKING * layers_phase
    chunk_arrays, head_residual = HEAD_PHASE.get(platform, (1, 0))
    chunks = loss_chunks(max(shape[0] // (M if S > 1 and not gpipe else 1), 1), shape[1], V)
    head_phase = ((chunk_arrays / chunks + compute / FP32) * logits
                  + head_residual * s.inner_tokens / head_rows * D * held)
    working = max(layers_phase, head_phase)
    return MicroStepMemory(
        weights=s.weights * compute, grad_sum=round(grad_sum * FP32) + 2 * FP32,
        batch=round(s.tokens * BATCH_ARRAYS * INT32) + FP32, read_weights=round(read_bytes),
        gradients=round(gradients), activations=round(activations), working=round(working))


# The terms a micro-step's seconds sum (`MicroStepTime`'s fields of those names).
TERMS = ("matmuls", "attention", "tensor", "context", "elementwise", "fsdp", "gradients",
         "stages", "bubble", "overhead")


@dataclasses.dataclass(frozen=True)
class MicroStepTime:
    """Seconds of one micro-step, per term; `seconds` is their sum (overlap already taken)."""

    matmuls: float
    attention: float
    tensor: float  # tensor/sequence-parallel collectives
    context: float  # ring K/V traffic not hidden behind attention
    fsdp: float  # weight all-gathers
    gradients: float  # gradient reduce-scatter / all-reduce
    stages: float  # pipeline stage transfers
    bubble: float
    elementwise: float = 0.0  # norms, residuals, rotary, SwiGLU, the loss, the accumulator
    ring: float = 0.0  # all the ring's K/V traffic, of which `context` is exposed (not summed)
    ring_overlaps: bool = True  # the ring's sends run beside attention (`SERIAL_RING`)
    overhead: float = 0.0  # what every micro-step costs whatever its size (the profile's)
    # A 1F1B pipeline runs a bucket's micro-steps in one schedule: one bubble for all of them.
    one_schedule: bool = False

    @property
    def seconds(self) -> float:
        return self._seconds(self.attention, self.context)

    @functools.cached_property
    def _fixed(self) -> float:
        """The terms but attention and the exposed ring, which an attention share changes."""
        return sum(getattr(self, k) for k in TERMS if k not in ("attention", "context"))

    def _seconds(self, attention: float, context: float) -> float:
        """The terms' sum with `attention` and exposed ring `context` in place of the
        micro-step's own (the planner sums millions: no copies)."""
        return self._fixed + attention + context

    def terms(self) -> dict[str, float]:
        """The seconds that add up to `seconds`, by name (`ring` and `one_schedule` are not)."""
        return {k: getattr(self, k) for k in TERMS}

    def bucket_seconds(self, shares: Sequence[float]) -> float:
        """A bucket's micro-steps, one per entry of `shares` (the busiest device's attention
        share of each: `with_attention`); under one schedule the bubble is paid once."""
        attention, ring, overlaps = self.attention, self.ring, self.ring_overlaps
        seconds = sum(self._seconds(attention * share, _exposed(ring, attention * share, overlaps))
                      for share in shares)
        return seconds - self.bubble * (len(shares) - 1) if self.one_schedule and len(shares) \
            else seconds

    def with_attention(self, share: float) -> MicroStepTime:
        """The micro-step with `share` of its priced attention pairs on the busiest device (its
        packed documents' pairs over whole causal rows'): less attention hides less ring."""
        attention = self.attention * share
        return dataclasses.replace(self, attention=attention,
                                   context=_exposed(self.ring, attention, self.ring_overlaps))


def micro_step_time(config: LlamaConfig, strategy: Strategy, shape: tuple[int, int],
                    profile: Profile, accumulate: str = "local") -> MicroStepTime:
    """Seconds of a bucket's gradient micro-step on micro-steps of `shape` on `profile`,
    accumulating as `accumulate` says (under `local`, without the bucket's one reduction:
    `bucket_reduction_seconds`)."""
    if strategy.num_devices > profile.num_devices:
        raise UserError(f"{strategy} uses {strategy.num_devices} devices but profile "
                        f"{profile.name} has {profile.num_devices}: choose a smaller strategy "
                        f"or a larger profile")
    s = shares(config, strategy, shape)
    fitted = _layout(config, strategy)[0]
    compute = config.dtype.itemsize
    D, H, N, K, F, V = (config.dim, config.head_dim, config.n_heads, config.n_kv_heads,
                        config.ffn_dim, config.vocab_size)
    S, M = s.stages, s.microbatches
    staged = S > 1 and config.remat == "full"  # a pipeline recomputing whole stages
    forwards = 1 + (config.remat == "full") + staged  # of each layer's matmuls
    # Of attention and the elementwise passes: remat "dots" saves only the matmuls' outputs.
    attention_forwards = 1 + (config.remat != "none") + staged

    def gemms(widths: Iterable[tuple[float, float]]) -> float:
        """Seconds per token of GEMMs [tokens, k] x [k, n] of (k, n) `widths`, forward once."""
        tokens = s.inner_tokens / M  # one call's rows: a pipeline micro-batch's
        return sum(2 * k * n / (profile.peak_flops * profile.matmul.at(min(tokens, k, n)))
                   for k, n in widths)

    query, kv, mlp = N * H / s.head_ways, K * H / s.kv_ways, F / s.mlp_ways
    down = gemms(((mlp, D),))
    layer = gemms(((D, query), (D, kv), (D, kv), (query, D), (D, mlp), (D, mlp))) + down
    # A layer's recompute (remat full) skips its down projection: its output only joins the
    # residual stream, whose next value the following layer saved (JAX drops what no gradient
    # reads). Measured on an H200, the 1B model: full over dots cost 30 ms at 8 x 2,048, priced
    # 55 ms recomputing every matmul.
    layer_matmuls = ((forwards + 2) * layer - (config.remat == "full") * down) * (
        s.inner_tokens * s.layers)
    head_matmuls = 3 * s.inner_tokens * gemms(((D, V / s.vocab_ways),)) / _head_share(
        s, config.pipeline_schedule)
    context, exchange = _size(fitted, s.ring_axes), _size(fitted, s.exchange_axes)
    block, _ = attention_kernel(config, profile.platform, shape[1], context)
    pairs = s.rows * visible_pairs(shape[1], context, fitted.balanced, block)
    kernel = attention_backend(config, profile.platform, shape[1], context,
                               profile.compute_capability)
    attention = ((attention_forwards + 2.5) * 4 * H * N / (s.head_ways * exchange) * pairs
                 * s.layers / (profile.peak_flops * profile.attention_at(kernel)))

    def collective(name: str, nbytes: float, axes: tuple[str, ...], count: int = 1) -> float:
        """`count` collectives moving `nbytes` in all over the devices of `axes`."""
        n = math.prod(fitted.axes[a] for a in axes)
        if n == 1:
            return 0.0
        bandwidth = profile.bandwidth(PRICED_AS.get(name, name), n,
                                      _crosses_nodes(fitted, axes, profile.devices_per_node))
        return count * profile.collective_latency + BUS_FACTOR[name](n) * nbytes / bandwidth

    wide = profile.platform in WIDE_WIRE
    wire = HELD_BYTES.get(profile.platform, compute) if wide else compute
    activation = s.inner_tokens * D * wire
    # Each layer's all-reduces (under sequence parallelism, reduce-scatters) and all-gathers.
    reductions, all_gathers = _tensor_collectives(profile.platform, config.remat, staged)
    reduce = "all-reduce" if wide or not s.sequence_parallel else "reduce-scatter"
    reduction = collective(reduce, activation, s.tensor_axes)
    gather = collective("all-gather", activation, s.tensor_axes) if s.sequence_parallel else 0.0
    layer_tensor = s.layers * (reductions * reduction + all_gathers * gather)
    # The embedding's reduction, the LM head's input gradient (fp32, from the fp32 logits), and
    # under sequence parallelism three gathers about them.
    tensor = layer_tensor + reduction + collective(
        reduce, s.inner_tokens * D * FP32, s.tensor_axes) + 3 * gather + s.layers * _exchange(
        s, config, attention_forwards, collective, wire, exchange,
        "all-reduce" if wide else "reduce-scatter")

    chunk_kv = 2 * s.rows * shape[1] / context * K * H / s.kv_ways
    ring = s.layers * (2 * (context - 1) * collective("send", chunk_kv * wire, s.ring_axes)
                       + context * collective("send", chunk_kv * FP32, s.ring_axes))
    overlaps = profile.platform not in SERIAL_RING

    weights = (s.layer_weights + s.other_weights) * compute
    gathers = 1 if config.remat == "none" else 2
    fsdp = gathers * collective("all-gather", weights, s.gather_axes, s.gathered_arrays)
    kept_apart = s.partial_axes if accumulate == "local" else ()
    scatter = s.scatter_axes + (s.partial_axes if accumulate == "sharded" else ())
    rest = tuple(a for a in s.token_axes if a not in scatter and a not in kept_apart)
    scattered = weights / _size(fitted, scatter)
    gradients = (collective("reduce-scatter", weights, scatter)
                 + collective("all-reduce", scattered, rest))

    stage_send = collective("send", s.tokens / M * D * wire, ("stage",))
    head_sends = 2 * (config.pipeline_schedule == "1f1b")  # to the head's groups and back
    stages = (forwards + 1 + head_sends) * M * stage_send if S > 1 else 0.0

    rate = profile.elementwise_bandwidth
    held = HELD_BYTES.get(profile.platform, compute)
    layer_elementwise = s.layers * layer_elementwise_bytes(
        config, s.tokens, s.inner_tokens, (s.head_ways, s.kv_ways, s.mlp_ways),
        attention_forwards, held) / rate if rate else 0.0
    accumulated = s.grad_sum / (_size(fitted, s.partial_axes) if accumulate == "sharded" else 1)
    other_elementwise = (ELEMENTWISE.logits * FP32 * s.inner_tokens * V / s.vocab_ways
                         / _head_share(s, config.pipeline_schedule)
                         + accumulated * (ELEMENTWISE.accumulator * FP32 + compute)
                         ) / rate if rate else 0.0
    per_iteration = (layer_matmuls + attention + layer_tensor + stages + layer_elementwise) / M
    return MicroStepTime(
        matmuls=layer_matmuls + head_matmuls, attention=attention, tensor=tensor,
        context=_exposed(ring, attention, overlaps), fsdp=fsdp, gradients=gradients,
        stages=stages, bubble=(S - 1) * per_iteration if S > 1 else 0.0,
        elementwise=layer_elementwise + other_elementwise, ring=ring, ring_overlaps=overlaps,
        overhead=profile.step_overhead, one_schedule=S > 1 and config.pipeline_schedule == "1f1b")


def layer_elementwise_bytes(config: LlamaConfig, tokens: float, inner_tokens: float,
                            ways: tuple[int, int, int], forwards: int, itemsize: int) -> float:
    """Bytes one layer's elementwise passes (`ELEMENTWISE`) move on a device that holds
    `tokens` of the residual stream and `inner_tokens` inside attention and the MLP, its query
    heads, K/V heads and MLP split `ways`, its forward run `forwards` times, in arrays of
    `itemsize` bytes per element."""
    head_ways, kv_ways, mlp_ways = ways
    elements = (tokens * config.dim, inner_tokens * config.ffn_dim / mlp_ways,
                inner_tokens * config.n_heads * config.head_dim / head_ways,
                inner_tokens * config.n_kv_heads * config.head_dim / kv_ways)
    # Without remat the backward reads the elementwise results it saved, beyond the matmuls'
    # outputs (`SAVED`'s arrays past remat "dots"'): each written forward and read backward.
    saved = [2 * max(0, kept - dots) for kept, dots in zip(SAVED[config.remat], SAVED["dots"],
                                                           strict=True)]
    return itemsize * sum((forwards * f + b + s) * n for f, b, s, n in zip(
        ELEMENTWISE.forward, ELEMENTWISE.backward, saved, elements, strict=True))


def bucket_reduction_seconds(config: LlamaConfig, strategy: Strategy, profile: Profile,
                             accumulate: str = "local") -> float:
    """Seconds of a `local` bucket's one gradient reduction: the data shards' fp32 partial sums
    all-reduced over the axes they were kept apart on (0 under `sharded`, or without them)."""
    s = shares(config, strategy, (1, 1))  # the layouts alone: any shape
    n = _size(strategy, s.partial_axes)
    if accumulate != "local" or n == 1:
        return 0.0
    fitted = _layout(config, strategy)[0]
    crosses = _crosses_nodes(fitted, s.partial_axes, profile.devices_per_node)
    return profile.collective_latency + 2 * (n - 1) / n * s.grad_sum * FP32 / profile.bandwidth(
        "all-reduce", n, crosses)


def _tensor_collectives(platform: str, remat: str, staged: bool) -> tuple[int, int]:
    """Per layer, the activation all-reduces (reduce-scatters under sequence parallelism) and
    the all-gathers sequence parallelism adds, as XLA compiles a Megatron step (read off the HLO
    for H100s and for CPUs): two reductions forward and two backward, one more where remat
    "full" (or a pipeline stage's recompute) repeats the forward; the sequence-parallel backward
    gathers its activations four times (XLA gathers them again rather than keep them gathered).
    XLA:CPU (`WIDE_WIRE`) reduces each projection's input gradient apart: q, k and v, gate and
    up, five reductions where XLA:GPU sums first and reduces two."""
    reductions = 4 + (remat == "full") + staged + 3 * (platform in WIDE_WIRE)
    return reductions, 6 + 2 * staged


def _exchange(s: Shares, config: LlamaConfig, forwards: int, collective: Callable,
              wire: int, ranks: int, reduce: str) -> float:
    """Seconds of one layer's Ulysses all-to-alls (read off the HLO, XLA:CPU): q, k, v to the
    head split and the output back, in each forward and transposed backward; without remat
    the backward exchanges the saved q, k, v again. K/V heads fewer than the ranks are
    gathered whole instead, once a forward, and their gradients reduced once."""
    axes = s.exchange_axes
    q = s.inner_tokens * config.n_heads * config.head_dim / s.head_ways * wire
    kv = 2 * s.inner_tokens * config.n_kv_heads * config.head_dim / s.kv_ways * wire
    exchanged = q + kv * s.kv_exchanged
    seconds = ((forwards + 1 + (config.remat == "none")) * collective("all-to-all", exchanged, axes)
               + (forwards + 1) * collective("all-to-all", q, axes))
    if s.kv_exchanged:
        return seconds
    whole = kv * ranks
    return (seconds + forwards * collective("all-gather", whole, axes)
            + collective(reduce, whole, axes))


def _exposed(ring: float, attention: float, overlaps: bool) -> float:
    """The ring's seconds not hidden behind attention."""
    return max(0.0, ring - attention) if overlaps else ring


def _head_share(s: Shares, schedule: str) -> int:
    """How many ways a pipeline's stage groups split the head's work (`across_stages`): GPipe's
    rows after it where they divide, 1F1B's micro-batch rows, or else their tokens."""
    if s.stages > 1 and (schedule == "1f1b" or s.rows % s.stages == 0):
        return s.stages
    return 1


def _size(strategy: Strategy, axes: tuple[str, ...]) -> int:
    return math.prod(strategy.axes[a] for a in axes)


def document_pairs(documents_R: Sequence[Sequence[int]], seq_len: int, context: int,
                   balanced: bool, block: int) -> np.ndarray:
    """[R, context] (query, key) pairs each ring rank's blockwise kernel computes, summed over
    the ring's steps, for rows of `seq_len` holding documents of the given lengths end to end
    from column 0 (the rest padding): the block pairs some document spans, below the diagonal
    (as `hotjax.models.attention.visible_blocks` lists them), whole. With `balanced`, rank r holds
    chunks r and 2c-1-r of 2c."""
    pieces = context * (2 if balanced else 1)
    edge = block_edge(seq_len // pieces, block)
    firsts = np.arange(seq_len // edge) * edge  # each block's first column
    blocks_RxB = np.zeros((len(documents_R), len(firsts)))
    for r, lengths in enumerate(documents_R):
        if not len(lengths):
            continue
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        # A block sees back to the first block of the document its first token is in (later
        # documents in it start in it); a block of padding sees nothing.
        first = starts[np.searchsorted(starts, firsts, side="right") - 1] // edge
        blocks_RxB[r] = np.where(firsts < sum(lengths), np.arange(len(firsts)) - first + 1, 0)
    per_piece = blocks_RxB.reshape(len(documents_R), pieces, -1).sum(axis=-1) * edge * edge
    return per_piece[:, :context] + per_piece[:, ::-1][:, :context] if balanced else per_piece


def visible_pairs(seq_len: int, context: int, balanced: bool, block: int) -> float:
    """(query, key) pairs the attention kernel computes for one causal row on the busiest rank
    of a context ring of `context` devices: whole blocks below the diagonal, every block on it."""
    def diagonal(length: int) -> float:
        edge = block_edge(length, block)
        blocks = length // edge
        return edge * edge * blocks * (blocks + 1) / 2

    if balanced:  # chunks i and 2c-1-i: 2c-1 whole half-chunks and two diagonals per rank
        half = seq_len // (2 * context)
        return (2 * context - 1) * half * half + 2 * diagonal(half)
    chunk = seq_len // context  # the last rank sees every earlier chunk
    return (context - 1) * chunk * chunk + diagonal(chunk)


# Every ordered pair of the ~90 strategies over 8 devices, for a few models: a search prices
# each pair many times.
@functools.lru_cache(maxsize=65536)
def switch_seconds(config: LlamaConfig, source: Strategy, target: Strategy,
                   profile: Profile) -> float:
    """A weight switch's time from `source`'s layout to `target`'s: the most compute-dtype
    bytes any device lacks, over the slower link the devices span (the transfer scheduler
    plans the exact transfers: `step_seconds`)."""
    if source == target:
        return 0.0
    devices = max(source.num_devices, target.num_devices)
    ids = list(range(devices))
    lacking = np.zeros(devices)
    for axes, leaf in param_leaves(config):
        before = boxes_from_strategy(source, ids, axes, leaf.shape)
        after = boxes_from_strategy(target, ids, axes, leaf.shape)
        for d in ids:
            overlap = math.prod(max(0, min(x1, y1) - max(x0, y0))
                                for (x0, x1), (y0, y1) in zip(before[d], after[d], strict=True))
            lacking[d] += (math.prod(b - a for a, b in after[d]) - overlap) * config.dtype.itemsize
    bandwidth = (profile.inter_node_bandwidth if devices > profile.devices_per_node
                 else profile.intra_node_bandwidth)
    return float(lacking.max()) / bandwidth


def step_seconds(micro_steps: Iterable[tuple[MicroStepTime, int]],
                 switches: Iterable[TransferSchedule] = ()) -> float:
    """One optimizer step: each bucket's micro-steps (`MicroStepTime.bucket_seconds`), plus
    each hot switch as the transfer scheduler estimates it (plan it on `Profile.topology()`)."""
    return (sum(time.bucket_seconds([1.0] * count) for time, count in micro_steps)
            + sum(plan.estimated_seconds for plan in switches))


def _crosses_nodes(strategy: Strategy, axes: tuple[str, ...], devices_per_node: int) -> bool:
    """Whether a group along `axes` spans nodes: devices number node-major over the mesh, so
    the group holding device 0 reaches id sum((size-1)·stride)."""
    sizes = strategy.axes
    stride = {a: math.prod(sizes[b] for b in MESH_AXES[i + 1:]) for i, a in enumerate(MESH_AXES)}
    return sum((sizes[a] - 1) * stride[a] for a in axes) >= devices_per_node


def _mesh_axes(spec: PartitionSpec) -> set[str]:
    return {a for part in spec if part for a in ((part,) if isinstance(part, str) else part)}


def _ordered(axes: set[str]) -> tuple[str, ...]:
    return tuple(a for a in MESH_AXES if a in axes)
