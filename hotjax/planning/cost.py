"""The analytic cost model: the time of one bucket's micro-step, for a model, a strategy and a
micro-step shape (rows, tokens per row), on a hardware profile (its memory:
`hotjax.planning.memory`; what a device holds of the micro-step: `hotjax.planning.shares`).

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
  device where the profile measured sizes (`hotjax.planning.profile.Efficiency`); attention at
  the peak x the efficiency of the kernel that runs (`hotjax.models.work.attention_backend`: cuDNN's
  packed layout, the packed or the ring's Pallas kernel, the blockwise kernel), the profile's
  own for that kernel where it has one, else at the query heads per device a tensor split or
  Ulysses leaves and at the length of its rows (outside a ring) where the profile measured
  them (`Profile.attention_at`).
- A collective moving a tensor of `bytes` over a group of n devices takes the profile's latency
  plus factor·bytes / bus bandwidth, with factor 2(n-1)/n for all-reduce, (n-1)/n for
  all-gather and reduce-scatter, 1 for a send (nccl-tests' bus-bandwidth convention); the
  bandwidth is the profile's for that collective, group size, and whether the group spans nodes,
  at the size of the tensor where the profile measured sizes (`Bandwidths.by_bytes`).
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
  arXiv:2205.05198, §4.2.2) each all-reduce but the embedding's (its lookup is summed whole,
  then split) becomes a reduce-scatter, and the activations are all-gathered twice forward and
  four times backward. Counted as XLA compiles them
  (`_tensor_collectives`): remat "full" repeats one reduction, and XLA:CPU reduces each
  projection's input gradient apart (three more tensors, in the same two collectives: one
  latency per collective XLA issues). A vocabulary split over tensor reduces the loss's row
  statistics (`ROW_STATISTICS`); where nothing combines collectives (`UNCOMBINED`), sequence
  parallelism reduces the norms' weight gradients apart. A micro-step's rows lie as attention
  reads them (`hotjax.sharding.strategy.Layout.batch_sharding`), so no split of the residual
  stream gathers token ids, segment ids, positions or rotary tables; tests/test_cost.py checks
  on XLA:CPU that the latencies priced are the collectives the compiled step issues.
- Context parallelism (ring attention): per layer, the forward sends the local K/V chunk c-1
  times round the ring; the backward sends K/V c-1 times and their fp32 gradients c times; a
  recomputed forward sends nothing again; the chunk's token arrays go round once a micro-step
  (each checked against the HLO's collective bytes in tests/test_cost.py, and on XLA:CPU the
  sends against those it issues, one a K or V array). The kernel sends a chunk before
  computing the one it holds, so on GPU the ring hides behind attention: only what exceeds
  the attention time is exposed. XLA:CPU runs each send to completion (`SERIAL_RING`).
- Ulysses (DeepSpeed-Ulysses: Jacobs et al. 2023, arXiv:2309.14509), in the `tensor` term
  with the other collectives of a head split: per layer q, k and v all-to-all'd from the
  sequence split to the head split and the output back, in each forward and transposed in the
  backward, and without remat the saved q, k, v once more (`_exchange`, checked against the
  HLO in tests/test_cost.py), each tensor its own all-to-all (XLA:CPU exchanges the saved
  ones of all layers at once, after the layer loop; priced per layer, as XLA:GPU issues
  them); K/V heads fewer than the ranks are all-gathered whole instead
  and their gradients reduced. An all-to-all moves (n-1)/n of each device's tensor, at the
  profile's all-to-all bandwidth (its all-gather's where it measured none). Attention then
  runs on whole rows, 1/n of the heads each.
- FSDP (ZeRO-3): the weights are all-gathered over the fsdp axes layer by layer in the forward
  pass, and again in the backward under remat (with remat "none" XLA keeps the gathered layers),
  one all-gather per weight array, each paying the profile's latency; the embedding and the
  head are gathered once (nothing recomputes them).
- Gradient reduction (`hotjax.step.ACCUMULATE`): under `local` accumulation each data shard
  keeps its own fp32 partial sum over the leading data axes no gradient is split on
  (`hotjax.sharding.strategy.partial_axes`), and the bucket reduces them once at its end
  (`bucket_reduction_seconds`, as Megatron's and DeepSpeed's data parallelism reduce once per
  optimizer step): a reduce-scatter of the fp32 sums of each array whose scattered layout is
  the home's gradient layout, an all-reduce of the rest (`reduced_bytes`,
  `reduction_home_seconds`). Every micro-step still reduces its
  compute-dtype gradients over the other axes that split its tokens (fsdp under ZeRO-2/3,
  context): a reduce-scatter over those the accumulator is split on, an all-reduce over the
  rest (XLA:CPU: one collective per layer, one for the other weights, one for the target count;
  `UNCOMBINED`). Under `sharded` accumulation the data axes are reduce-scattered every
  micro-step too, into an accumulator split over them.
- Pipeline (`hotjax.models.pipeline`, 1F1B or GPipe by `config.pipeline_schedule`): M + S - 1 ticks
  of each stage's forward and as many of its backward; the S - 1 ticks beyond M are the bubble,
  the same share under both schedules, priced at the layers' work per tick. 1F1B runs all of a
  bucket's micro-steps in one schedule: n micro-steps take n·M + S - 1 ticks, one bubble
  (`MicroStepTime.bucket_seconds`); GPipe pays the bubble every micro-step. 1F1B's transfers
  are priced as XLA compiles them (`_stages`, checked against the HLO's bytes and collectives
  in tests/test_cost.py): each tick sends a micro-batch's activations on a stage and their
  gradient back (a recompute under remat "full" sends nothing again), and hands stage 0's
  input gradient to every stage group for the embedding's gradient; each of the M ticks that
  run the head also hands the last stage's micro-batch to the stage groups sharing the head,
  takes its gradient back (`HEAD_RETURN`); each stage group sums its share of the head's
  weight gradients apart, all-reduced once a schedule. GPipe's: each tick's activations
  forward (again in a stage recomputed under remat "full") and their gradient backward, one
  send each.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from hotjax.errors import UserError
from hotjax.models.attention import block_edge
from hotjax.models.head_loss import loss_chunks
from hotjax.models.llama import LlamaConfig, param_leaves
from hotjax.models.work import attention_backend, attention_kernel
from hotjax.planning.memory import HELD_BYTES, SAVED
from hotjax.planning.profile import Profile
from hotjax.planning.shares import (
    FP32,
    INT32,
    Shares,
    axes_size,
    fitted_strategy,
    shares,
)
from hotjax.sharding.strategy import MESH_AXES, Strategy, scatter_dim, ways
from hotjax.sharding.transfers import TransferSchedule, boxes_from_spec, boxes_from_strategy

# Bumped whenever a change to this model changes what a measured profile's fitted constants
# mean (they are fitted through `micro_step_time`): cached profiles of another version are
# measured again (`hotjax.planning.measure.profile_path`). 2: one gradient reduction per bucket,
# pipelines without whole-stage recompute, the LM head shared by stage groups. 3: 1F1B's one
# schedule per bucket, the embedding inside it. 4: the matmul rate fitted on micro-steps of
# trained size. 5: the elementwise passes priced apart from the matmul rate. 6: attention by
# query heads per device; one latency per collective XLA issues. 7: attention by row length
# (the matmul rate fitted with the fit's short rows' attention at their own rate). 8: the
# collectives outside the layer loop and those XLA:CPU does not combine, each a latency. (9: a
# ring rate by chunk, tried and reverted.) 10: each collective at the bandwidth of its tensor's
# size, all-to-alls measured, the ring's sends as XLA:CPU issues them. 11: switches at the
# rate and fixed cost `jax.device_put` measures (a profile's `switch_gbps`, `switch_latency_ms`).
# 12: a `local` bucket's reduction reduce-scatters the arrays whose scattered layout is the
# home's, and is priced so (`reduced_bytes`).
COST_MODEL_VERSION = 12
# Of each collective's tensor, the bytes moved per device over a group of n (the bus-bandwidth
# convention of nccl-tests): time = latency + factor · bytes / bus bandwidth.
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n, "send": lambda n: 1.0,
    "all-to-all": lambda n: (n - 1) / n}
# The int32 arrays of a context ring's chunk that travel with its K/V (segment ids, positions,
# columns: `hotjax.models.attention.Tokens`).
RING_TOKEN_ARRAYS = 3
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
# Platforms whose compiler combines no collectives: XLA:CPU reduces each layer's gradients
# inside the backward's layer loop as they are ready, the other weights' after it and the
# target count beside them, and a sequence-parallel layer's norm weights' gradients apart
# (read off the HLO of `tiny`'s steps); XLA:GPU's combiners merge them into few.
UNCOMBINED = frozenset({"cpu"})
# The loss over a vocabulary split over tensor reduces three fp32 row statistics (the logits'
# maximum, the sum of their exponentials, the target's logit), an all-reduce each; XLA:CPU
# sends the third in one tuple with the head's input gradient. All-reduces issued, by platform.
ROW_STATISTICS = {"cpu": 2}  # 3 elsewhere
# How 1F1B's ticks that run the head take the micro-batch's gradient back from the stage groups
# sharing it, by platform (read off the HLO of `tiny`'s 1F1B steps): XLA:CPU all-gathers it on
# every stage; XLA:GPU exchanges it (an all-to-all), then sends it on to the last stage.
HEAD_RETURN = {"cpu": ("all-gather",)}  # ("all-to-all", "send") elsewhere
# The scalars a 1F1B tick all-reduces over the stage groups besides its tensors (a predicate
# and an int32, read off the HLO for CPUs and H100s): in a tick that runs the head, and in a
# drain tick. Each costs a latency.
TICK_SCALARS = 2
DRAIN_SCALARS = 2


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


@dataclasses.dataclass(frozen=True)
class _Pricing:
    """What every term of one micro-step's price reads: the model, the strategy fitted to it,
    one device's shares, the profile, and the bytes per element of each kind of array."""

    config: LlamaConfig
    strategy: Strategy  # fitted to the model
    s: Shares
    profile: Profile
    shape: tuple[int, int]
    accumulate: str
    compute: int  # bytes per element in the compute dtype
    held: int  # as XLA holds matmul operands and activations (`HELD_BYTES`)
    wire: int  # as activations cross the wire (`WIDE_WIRE`)
    staged: bool  # a pipeline recomputing whole stages (remat "full")
    forwards: int  # of each layer's matmuls
    attention_forwards: int  # of attention and the elementwise passes

    @property
    def wide(self) -> bool:
        return self.profile.platform in WIDE_WIRE

    @property
    def ring_size(self) -> int:
        """Ranks of the context ring (1 without one)."""
        return axes_size(self.strategy, self.s.ring_axes)

    @property
    def exchange_ranks(self) -> int:
        """Ranks Ulysses' all-to-alls exchange heads over (1 without them)."""
        return axes_size(self.strategy, self.s.exchange_axes)

    def collective(self, name: str, nbytes: float, axes: tuple[str, ...], count: int = 1
                   ) -> float:
        """`count` collectives moving `nbytes` in all over the devices of `axes`, each at the
        bandwidth of its share of the bytes."""
        n = axes_size(self.strategy, axes)
        if n == 1:
            return 0.0
        bandwidth = self.profile.bandwidth(name, n, _crosses_nodes(
            self.strategy, axes, self.profile.devices_per_node), nbytes / count)
        return count * self.profile.collective_latency + BUS_FACTOR[name](n) * nbytes / bandwidth

    def gemms(self, widths: Iterable[tuple[float, float]]) -> float:
        """Seconds per token of GEMMs [tokens, k] x [k, n] of (k, n) `widths`, forward once."""
        tokens = self.s.inner_tokens / self.s.microbatches  # one call's: a micro-batch's rows
        peak, matmul = self.profile.peak_flops, self.profile.matmul
        return sum(2 * k * n / (peak * matmul.at(min(tokens, k, n))) for k, n in widths)


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
    compute = config.dtype.itemsize
    held = HELD_BYTES.get(profile.platform, compute)
    staged = s.stages > 1 and config.remat == "full"
    p = _Pricing(config, fitted_strategy(config, strategy), s, profile, shape, accumulate,
                 compute, held, held if profile.platform in WIDE_WIRE else compute, staged,
                 forwards=1 + (config.remat == "full") + staged,
                 # Remat "dots" saves only the matmuls' outputs: attention and the elementwise
                 # passes run again.
                 attention_forwards=1 + (config.remat != "none") + staged)
    layer_matmuls, head_matmuls = _matmuls(p)
    attention = _attention(p)
    layer_tensor, tensor = _tensor(p)
    ring, overlaps = _ring(p), profile.platform not in SERIAL_RING
    tick, bubble_transfers = _stages(p)
    layer_elementwise, other_elementwise = _elementwise(p)
    per_iteration = (layer_matmuls + attention + layer_tensor + layer_elementwise
                     ) / s.microbatches
    return MicroStepTime(
        matmuls=layer_matmuls + head_matmuls, attention=attention, tensor=tensor,
        context=_exposed(ring, attention, overlaps), fsdp=_fsdp(p), gradients=_gradients(p),
        stages=s.microbatches * tick,
        bubble=(s.stages - 1) * per_iteration + bubble_transfers if s.stages > 1 else 0.0,
        elementwise=layer_elementwise + other_elementwise, ring=ring, ring_overlaps=overlaps,
        overhead=profile.step_overhead,
        one_schedule=s.stages > 1 and config.pipeline_schedule == "1f1b")


def _matmuls(p: _Pricing) -> tuple[float, float]:
    """Seconds of the layers' matmuls and of the LM head's (forward, backward, recompute)."""
    c, s = p.config, p.s
    D, V = c.dim, c.vocab_size
    query = c.n_heads * c.head_dim / s.head_ways
    kv, mlp = c.n_kv_heads * c.head_dim / s.kv_ways, c.ffn_dim / s.mlp_ways
    down = p.gemms(((mlp, D),))
    layer = p.gemms(((D, query), (D, kv), (D, kv), (query, D), (D, mlp), (D, mlp))) + down
    # A layer's recompute (remat full) skips its down projection: its output only joins the
    # residual stream, whose next value the following layer saved (JAX drops what no gradient
    # reads). Measured on an H200, the 1B model: full over dots cost 30 ms at 8 x 2,048, priced
    # 55 ms recomputing every matmul.
    layers = ((p.forwards + 2) * layer - (c.remat == "full") * down) * s.inner_tokens * s.layers
    head = 3 * s.inner_tokens * p.gemms(((D, V / s.vocab_ways),)) / s.head_pieces
    return layers, head


def _attention(p: _Pricing) -> float:
    """Seconds of attention: the pairs the kernel that runs computes, at its efficiency."""
    c, s, profile = p.config, p.s, p.profile
    seq_len = p.shape[1]
    context, exchange = p.ring_size, p.exchange_ranks
    block, _ = attention_kernel(c, profile.platform, seq_len, context)
    pairs = s.rows * visible_pairs(seq_len, context, p.strategy.balanced, block)
    kernel = attention_backend(c, profile.platform, seq_len, context, profile.compute_capability)
    heads = c.n_heads / (s.head_ways * exchange)  # per device
    # By the row's length where the kernel runs whole rows; a ring's steps ran 512-token rows
    # at the rate of long ones (not at the 1.5 times slower one of 256-token rows alone).
    length = seq_len if context == 1 else None
    return ((p.attention_forwards + 2.5) * 4 * c.head_dim * heads * pairs * s.layers
            / (profile.peak_flops * profile.attention_at(kernel, heads, length)))


def _tensor(p: _Pricing) -> tuple[float, float]:
    """Seconds of a head split's collectives: the layers' alone (a pipeline's bubble repeats
    them), and with the embedding's and the head's and Ulysses' exchanges."""
    c, s = p.config, p.s
    activation = s.inner_tokens * c.dim * p.wire
    # Each layer's all-reduces (under sequence parallelism, reduce-scatters) and all-gathers.
    reductions, issued, all_gathers = _tensor_collectives(p.profile.platform, c.remat, p.staged)
    reduce = "all-reduce" if p.wide or not s.sequence_parallel else "reduce-scatter"
    # The embedding's partial lookups are summed whole, then split (`hotjax.models.llama.embedded`).
    embedding = p.collective("all-reduce", activation, s.tensor_axes)
    gather = (p.collective("all-gather", activation, s.tensor_axes) if s.sequence_parallel
              else 0.0)
    # Where nothing combines them, sequence parallelism reduces the norms' weight gradients on
    # their own: a layer's two together, the final norm's apart (`UNCOMBINED`).
    apart = s.sequence_parallel and p.profile.platform in UNCOMBINED
    norms = p.collective("all-reduce", 2 * c.dim * FP32, s.tensor_axes) if apart else 0.0
    final_norm = p.collective("all-reduce", c.dim * FP32, s.tensor_axes) if apart else 0.0
    layers = s.layers * (p.collective(reduce, reductions * activation, s.tensor_axes, issued)
                         + all_gathers * gather + norms)
    # The embedding's reduction, the LM head's input gradient (fp32, from the fp32 logits; all
    # chunks' at once) and, with the vocabulary split, the loss's row statistics in each of its
    # chunks (`ROW_STATISTICS`, `hotjax.models.head_loss.loss_chunks`); under sequence
    # parallelism three gathers about them.
    chunks = loss_chunks(*p.shape, c.vocab_size)
    head = p.collective(reduce, s.inner_tokens * c.dim * FP32, s.tensor_axes)
    statistics = (p.collective("all-reduce", 3 * s.inner_tokens * FP32, s.tensor_axes,
                               ROW_STATISTICS.get(p.profile.platform, 3) * chunks)
                  if s.vocab_ways > 1 else 0.0)
    return layers, (layers + embedding + head + statistics + final_norm + 3 * gather
                    + s.layers * _exchange(p))


def _ring(p: _Pricing) -> float:
    """Seconds of the ring's sends, hidden or not: per layer K and V c-1 times forward and
    again backward, and their fp32 gradients c times; once a micro-step the token arrays that
    travel with each chunk (`RING_TOKEN_ARRAYS`, c-1 times: the same in every layer, so sent
    once). Where nothing combines collectives (`UNCOMBINED`) each array is a send of its own,
    priced at its own size (XLA:CPU: 8 sends a layer and 3 a micro-step on a ring of 2, 20
    and 9 on a ring of 4); elsewhere each transfer is one send of a tuple."""
    c, s = p.config, p.s
    context = p.ring_size
    if context == 1:
        return 0.0
    tokens = s.rows * p.shape[1] / context  # a rank's chunk
    kv = 2 * tokens * c.n_kv_heads * c.head_dim / s.kv_ways
    apart = p.profile.platform in UNCOMBINED
    send = functools.partial(p.collective, "send", axes=s.ring_axes, count=2 if apart else 1)
    token_arrays = p.collective("send", RING_TOKEN_ARRAYS * tokens * INT32, s.ring_axes,
                                RING_TOKEN_ARRAYS if apart else 1)
    return (s.layers * (2 * (context - 1) * send(kv * p.wire) + context * send(kv * FP32))
            + (context - 1) * token_arrays)


def _fsdp(p: _Pricing) -> float:
    """Seconds of FSDP's weight all-gathers: the layers' once without remat, again in the
    backward with; the embedding's and the head's once (no recompute gathers them again)."""
    s, gather = p.s, functools.partial(p.collective, "all-gather", axes=p.s.gather_axes)
    layers = gather(s.layer_weights * p.compute, count=s.gathered_layer_arrays)
    others = (gather(s.other_weights * p.compute, count=s.gathered_other_arrays)
              if s.gathered_other_arrays else 0.0)
    return (1 if p.config.remat == "none" else 2) * layers + others


def _gradients(p: _Pricing) -> float:
    """Seconds of a micro-step's gradient reduction over the axes that split its tokens."""
    s, weights = p.s, (p.s.layer_weights + p.s.other_weights) * p.compute
    # Where nothing combines collectives, one reduction per layer, one for the other weights
    # and one for the target count (`UNCOMBINED`).
    issued = s.layers + 2 if p.profile.platform in UNCOMBINED else 1
    kept_apart = s.partial_axes if p.accumulate == "local" else ()
    scatter = s.scatter_axes + (s.partial_axes if p.accumulate == "sharded" else ())
    rest = tuple(a for a in s.token_axes if a not in scatter and a not in kept_apart)
    scattered = weights / axes_size(p.strategy, scatter)
    return (p.collective("reduce-scatter", weights, scatter, issued)
            + p.collective("all-reduce", scattered, rest, issued))


def _stages(p: _Pricing) -> tuple[float, float]:
    """Seconds of a pipeline's transfers in each of the M ticks that run every stage forward
    and backward, and in its bubble: under 1F1B S - 1 ticks that only fill and as many that
    only drain (the module docstring)."""
    s, c, stage = p.s, p.config, ("stage",)
    if s.stages == 1:
        return 0.0, 0.0
    micro_batch = s.tokens / s.microbatches * c.dim * p.wire  # one device's activations
    if c.pipeline_schedule == "gpipe":
        tick = (p.forwards + 1) * p.collective("send", micro_batch, stage)
        return tick, (s.stages - 1) * tick
    # Forward and back, a send each (one of a tuple where the compiler combines them).
    sends = p.collective("send", 2 * micro_batch, stage, 2 if p.profile.platform in UNCOMBINED
                         else 1)
    handed = (p.collective("all-to-all", micro_batch, stage)
              + sum(p.collective(name, micro_batch, stage)
                    for name in HEAD_RETURN.get(p.profile.platform, ("all-to-all", "send"))))
    latency = p.profile.collective_latency
    tick = (sends + p.collective("all-reduce", micro_batch, stage) + handed
            + TICK_SCALARS * latency)
    # The micro-batches holding tokens, agreed once a schedule over data shards splitting rows.
    agreed = axes_size(p.strategy, s.token_axes) > 1
    fill_and_drain = (p.collective("send", 2 * micro_batch, stage, 2)
                      + p.collective("all-reduce", micro_batch, stage) + DRAIN_SCALARS * latency)
    # Once a schedule the stage groups' fp32 sums of the head's weight gradients, the loss and
    # the target count: in the last drain tick's all-reduce where that one is fp32 too (XLA
    # combines all-reduces of one element type), else one of their own.
    head = (c.dim + c.dim * c.vocab_size / s.vocab_ways + 1) * FP32
    head_sums = (p.collective("all-reduce", micro_batch + head, stage)
                 - p.collective("all-reduce", micro_batch, stage) if p.wire == FP32
                 else p.collective("all-reduce", head, stage))
    return tick, (s.stages - 1) * fill_and_drain + head_sums + agreed * latency


def _elementwise(p: _Pricing) -> tuple[float, float]:
    """Seconds of the layers' elementwise passes, and of the loss's and the accumulator's."""
    c, s, rate = p.config, p.s, p.profile.elementwise_bandwidth
    if not rate:
        return 0.0, 0.0
    layers = s.layers * layer_elementwise_bytes(
        c, s.tokens, s.inner_tokens, (s.head_ways, s.kv_ways, s.mlp_ways),
        p.attention_forwards, p.held) / rate
    accumulated = s.grad_sum / (axes_size(p.strategy, s.partial_axes)
                                if p.accumulate == "sharded" else 1)
    other = (ELEMENTWISE.logits * FP32 * s.inner_tokens * c.vocab_size / s.vocab_ways
             / s.head_pieces
             + accumulated * (ELEMENTWISE.accumulator * FP32 + p.compute)) / rate
    return layers, other


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
    """Seconds of a `local` bucket's one gradient reduction (0 under `sharded`, or without
    partial axes), whatever its home: the data shards' fp32 partial sums reduce-scattered over
    the axes they were kept apart on where an array can be (`reduced_bytes`), all-reduced
    where it cannot. An array the home does not lay out as scattered is all-reduced instead:
    the rest of that price is its way home (`reduction_home_seconds`)."""
    if accumulate != "local":
        return 0.0
    n, crosses = _partial_group(config, strategy, profile)
    if n == 1:
        return 0.0
    scattered, whole = reduced_bytes(config, strategy)
    return (_reduction(profile, "reduce-scatter", scattered, n, crosses)
            + _reduction(profile, "all-reduce", whole, n, crosses))


def reduction_home_seconds(config: LlamaConfig, strategy: Strategy, home: Strategy,
                           profile: Profile, accumulate: str = "local") -> float:
    """What a `local` bucket's reduction costs beyond `bucket_reduction_seconds` under `home`:
    the arrays that could be reduce-scattered but whose scattered layout is not `home`'s
    gradient layout are all-reduced (then laid out as the home's), the all-reduce's price
    beyond the reduce-scatter's."""
    if accumulate != "local":
        return 0.0
    n, crosses = _partial_group(config, strategy, profile)
    if n == 1:
        return 0.0
    rest = reduced_bytes(config, strategy)[0] - reduced_bytes(config, strategy, home)[0]
    if rest <= 0:
        return 0.0
    return max(0.0, _reduction(profile, "all-reduce", rest, n, crosses)
               - _reduction(profile, "reduce-scatter", rest, n, crosses))


def _partial_group(config: LlamaConfig, strategy: Strategy, profile: Profile
                   ) -> tuple[int, bool]:
    """The size of a bucket's partial group (`partial_axes`), and whether it spans nodes."""
    s = shares(config, strategy, (1, 1))  # the layouts alone: any shape
    fitted = fitted_strategy(config, strategy)
    return (axes_size(strategy, s.partial_axes),
            _crosses_nodes(fitted, s.partial_axes, profile.devices_per_node))


def _reduction(profile: Profile, collective: str, nbytes: float, n: int,
               crosses: bool) -> float:
    """One reduction of `nbytes` per device over `n` devices (`BUS_FACTOR`)."""
    if not nbytes:
        return 0.0
    return profile.collective_latency + BUS_FACTOR[collective](n) * nbytes / profile.bandwidth(
        collective, n, crosses, nbytes)


@functools.lru_cache(maxsize=4096)
def reduced_bytes(config: LlamaConfig, strategy: Strategy, home: Strategy | None = None
                  ) -> tuple[float, float]:
    """Per device, the fp32 bytes of a `local` bucket's partial sums its one reduction
    reduce-scatters, and those it all-reduces, as `hotjax.step.BucketStep` compiles it: an
    array is scattered where `scatter_dim` finds it a dimension whose scattered layout is the
    home's gradient layout (without `home`: wherever it finds a dimension at all)."""
    fitted = fitted_strategy(config, strategy)
    partial = shares(config, strategy, (1, 1)).partial_axes
    pieces = axes_size(fitted, partial)
    sizes = dict(zip(MESH_AXES, fitted.sizes, strict=True))
    ids = list(range(fitted.num_devices))
    target = None if home is None else fitted_strategy(config, home)
    scattered = whole = 0.0
    for axes, leaf in param_leaves(config):
        spec = fitted.grad_spec(axes)
        per_device = math.prod(leaf.shape) * FP32 / math.prod(ways(spec, sizes))
        if target is None or target.num_devices != fitted.num_devices:
            found = scatter_dim(leaf.shape, spec, partial, pieces,
                                lambda _, anywhere=target is None: anywhere)
        else:
            want = boxes_from_strategy(target, ids, axes, leaf.shape, "grad")
            found = scatter_dim(leaf.shape, spec, partial, pieces,
                                lambda scattered, shape=leaf.shape, want=want:
                                boxes_from_spec(scattered, sizes, ids, shape) == want)
        if found:
            scattered += per_device
        else:
            whole += per_device
    return scattered, whole


def _tensor_collectives(platform: str, remat: str, staged: bool) -> tuple[int, int, int]:
    """Per layer, the activations all-reduced (reduce-scattered under sequence parallelism), in
    how many collectives, and the all-gathers sequence parallelism adds, as XLA compiles a
    Megatron step (read off the HLO for H100s and for CPUs): two reductions forward and two
    backward, one more where remat "full" (or a pipeline stage's recompute) repeats the
    forward; the sequence-parallel backward gathers its activations four times (XLA gathers
    them again rather than keep them gathered). XLA:CPU (`WIDE_WIRE`) reduces each projection's
    input gradient apart: q, k and v, gate and up, five tensors where XLA:GPU sums first and
    reduces two, in the same two collectives (tuples)."""
    issued = 4 + (remat == "full") + staged
    return issued + 3 * (platform in WIDE_WIRE), issued, 6 + 2 * staged


def _exchange(p: _Pricing) -> float:
    """Seconds of one layer's Ulysses all-to-alls (read off the HLO, XLA:CPU): q, k, v to the
    head split and the output back, in each forward and transposed backward; without remat
    the backward exchanges the saved q, k, v again. K/V heads fewer than the ranks are
    gathered whole instead, once a forward, and their gradients reduced once."""
    s, config, forwards, collective, wire = (p.s, p.config, p.attention_forwards, p.collective,
                                             p.wire)
    axes = s.exchange_axes
    q = s.inner_tokens * config.n_heads * config.head_dim / s.head_ways * wire
    kv = 2 * s.inner_tokens * config.n_kv_heads * config.head_dim / s.kv_ways * wire
    exchanged = q + kv * s.kv_exchanged
    tensors = 3 if s.kv_exchanged else 1  # q, k, v: one all-to-all each
    seconds = ((forwards + 1 + (config.remat == "none"))
               * collective("all-to-all", exchanged, axes, tensors)
               + (forwards + 1) * collective("all-to-all", q, axes))
    if s.kv_exchanged:
        return seconds
    whole = kv * p.exchange_ranks
    return (seconds + forwards * collective("all-gather", whole, axes)
            + collective("all-reduce" if p.wide else "reduce-scatter", whole, axes))


def _exposed(ring: float, attention: float, overlaps: bool) -> float:
    """The ring's seconds not hidden behind attention."""
    return max(0.0, ring - attention) if overlaps else ring


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
    bytes any device lacks, at the rate a switch over the devices moves
    (`Profile.switch_seconds`: measured, or the slower link they span; the transfer scheduler
    plans the exact transfers: `step_seconds`)."""
    if source == target:
        return 0.0
    devices = max(source.num_devices, target.num_devices)
    lacking = np.zeros(devices, dtype=np.int64)
    for before, after in zip(_param_boxes(config, source, devices),
                             _param_boxes(config, target, devices), strict=True):
        overlap = np.maximum(0, np.minimum(before[..., 1], after[..., 1])
                             - np.maximum(before[..., 0], after[..., 0])).prod(axis=-1)
        lacking += (after[..., 1] - after[..., 0]).prod(axis=-1) - overlap
    return profile.switch_seconds(float(lacking.max() * config.dtype.itemsize),
                                  devices > profile.devices_per_node)


@functools.lru_cache(maxsize=1024)
def _param_boxes(config: LlamaConfig, strategy: Strategy, devices: int) -> list[np.ndarray]:
    """[devices, dims, 2] each device's index box (start, stop per dimension) of each parameter
    under `strategy`, the mesh laid over devices 0 to `devices` - 1."""
    ids = list(range(devices))
    found = []
    for axes, leaf in param_leaves(config):
        boxes = boxes_from_strategy(strategy, ids, axes, leaf.shape)
        found.append(np.asarray([boxes[d] for d in ids], np.int64).reshape(
            devices, len(leaf.shape), 2))
    return found


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


