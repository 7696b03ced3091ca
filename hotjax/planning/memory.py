"""The cost model's memory: the per-device bytes of one bucket's micro-step at its peak, for a
model, a strategy and a micro-step shape (rows, tokens per row), as XLA on a platform plans it.
Letters as in `hotjax.models.llama` and `hotjax.planning.cost`; each row one causal document.

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

from hotjax.models.head_loss import loss_chunks
from hotjax.models.llama import LlamaConfig, layers_unrolled
from hotjax.models.pipeline import in_flight
from hotjax.planning.shares import FP32, INT32, axes_size, shares
from hotjax.sharding.strategy import Strategy

BATCH_ARRAYS = 4  # tokens, segment ids, positions, targets
# Bytes per element XLA holds matmul operands and activations in, where it widens the compute
# dtype: XLA:CPU runs bf16 and fp16 dots in fp32. Elsewhere: the compute dtype's size.
HELD_BYTES = {"cpu": 4}
# Per token of one layer, the arrays of each width kept for the backward pass, by remat policy:
# (residual stream D, MLP hidden F, query-wide N·H, K/V-wide K·H).
SAVED = {"none": (6, 6, 3, 2), "dots": (2, 2, 1, 2), "full": (1, 0, 0, 0)}


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
# From this many tokens a device in a loss chunk, with the vocabulary whole on each device,
# XLA:CPU holds one fp32 logits-sized array more there: the logits' product with the one-hot
# before its reduction, beside the logits and their gradient. Measured on 2 devices (2 layers
# of `small`'s widths, fp32, remat full): under data parallelism none at 3,584 tokens and one at
# 4,096 (8K vocabulary), one at 7,168 (4K), none at 2,048 (16K); the same from 4,096 under
# ZeRO-1 and the FSDP rings, none under megatron-sp (vocabulary split) at 8,192.
HEAD_PHASE_LONG = {"cpu": 4096}


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
    grad_sum = s.grad_sum if accumulate == "local" else s.grad_sum / axes_size(strategy,
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
    head_rows = s.head_pieces * (M if S > 1 and not gpipe else 1)
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
    long_chunk = s.vocab_ways == 1 and s.inner_tokens / head_rows / chunks >= HEAD_PHASE_LONG.get(
        platform, float("inf"))
    head_phase = ((chunk_arrays / chunks + long_chunk / chunks + compute / FP32) * logits
                  + head_residual * s.inner_tokens / head_rows * D * held)
    working = max(layers_phase, head_phase)
    return MicroStepMemory(
        weights=s.weights * compute, grad_sum=round(grad_sum * FP32) + 2 * FP32,
        batch=round(s.inner_tokens * BATCH_ARRAYS * INT32) + FP32, read_weights=round(read_bytes),
        gradients=round(gradients), activations=round(activations), working=round(working))
