"""Measures the devices this run sees into a hardware profile (`hotjax.planning.profile`):
matmul and attention throughput, and the bus bandwidth of each collective by group size, inside a
node and across nodes (a node is one process: its devices share a host, or an NVLink domain).

- Peak: the FLOP/s of a plain matmul in the model's compute dtype (or of any faster rate below).
- Matmul efficiency and step overhead: fitted on a real micro-step. A data-parallel gradient
  micro-step of the model is timed on two micro-batches, one `FIT_ROWS` times the other's rows;
  the matmul rate is chosen at which `hotjax.planning.cost.micro_step_time` gives the difference of
  the two times, and what the smaller step takes beyond its priced work is the overhead every
  micro-step pays (dispatch, small ops, processes waiting for each other). The cost model
  prices matmuls, attention, elementwise passes and collectives and nothing else, so what the
  step also does in proportion to its tokens beyond those (XLA's copies) is folded into the
  matmul rate. Fitted on one step, the overhead would be too: on two pinned processes (tens of
  milliseconds a step) that made the `tiny` model's matmuls look 20 times slower than they are.
  The two micro-batches hold as many tokens per process as trained micro-steps do (on CPU
  2,048 and 8,192, in rows of 128 that leave attention little, split over its devices): per
  token, a step is slower when its activations leave the caches. Fitted on 128 and 512 tokens
  per device, `small`'s widths in fp32 on two pinned processes ran 17-21 % slower than
  predicted at 8,192 tokens per device under data, FSDP and context parallelism (29 % under
  tensor parallelism).
- Attention efficiency: the model's attention kernel, forward and backward, on causal rows of
  its heads (on CPU the rate per pair hardly depends on the head width: with the `tiny` model's
  8-wide heads, rows timed with 32-wide ones made attention look 3 times faster than it runs),
  counting its work as the cost model does, over the peak; again with the heads each split of
  the devices leaves (1/2, 1/4, ... of them: tensor parallelism, Ulysses), whose rate differs
  (XLA:CPU's blockwise kernel ran `tiny`'s rows 20-25 % faster per head with 4 of its 8 heads
  than with all, at 1,024 to 8,192 tokens); and with all heads on the shorter rows trained and
  fitted on (`Workload.attention_lengths`), as many tokens a run: on one pinned core the
  blockwise kernel ran `tiny`'s rows of 128 and 256 tokens (one block each) at 8.5-9.0
  GFLOP/s and those of 512 to 8,192 at 13.1-13.3. Priced at the longer rows' rate, the fit
  steps' attention left a third of its time to the matmul rate, which then priced every
  512-token row 10-25 % high.
- Elementwise bandwidth: the model's own elementwise work of one layer (its two norms, two
  residual adds, the rotary embedding of q and k, SwiGLU's activation), forward and backward,
  each op a kernel of its own as the matmuls between them make it in a step, over a micro-step's
  tokens per device; the bytes `hotjax.planning.cost.ELEMENTWISE` counts for it over its time.
  Measured before the matmul rate is fitted, so that the rate no longer carries this work.
- Collectives: all-reduce, all-gather, reduce-scatter, a ring `ppermute` (send) and an
  all-to-all on groups of 2, 4, ... devices, every group at once; bus bandwidth as nccl-tests and
  `hotjax.planning.cost` count it, and again on the widest groups with tensors a quarter and a
  sixteenth the size (`SIZE_SHARES`: a step's sends and exchanges are often smaller than the
  reference tensor, and gloo's rate depends on the size: between two processes on a shaped
  link it sent 512 KiB at 0.79 of the link and 4 MiB at 0.53, all-gathered them at 1.0 and
  0.73, and all-reduced both at 1.0), after the latency: what each of a chain of `CHAIN` small
  all-reduces costs (over gloo between processes, some milliseconds: a process waiting for its peer
  sleeps). Groups of consecutive devices lie inside a node, strided ones span nodes. With one
  process no group spans nodes: the inter tables repeat the intra ones.
- Switch rate: `jax.device_put` of arrays split over all the devices, put whole on each, at
  two sizes: the rate the bytes each device lacks move at and what every switch costs besides
  (across processes JAX moves them by its own transfers, not gloo's collectives: between two
  processes on a link shaped to 7.7 MB/s each way the weights' 11.3 MB switches took 1.48-1.72
  s, 1.47 s at the link's rate; one 4 MiB put measured 0.70 of the link, gloo's ring send of 4
  MiB 0.53).
- Memory: what the runtime lets a device allocate, or on XLA:CPU (which says nothing) the
  host's memory shared by its devices.

Everything runs on all the given devices at once, as a training step does: on simulated CPU
devices that share a few cores, each device's rate is its share of the machine. Each figure is
the median of a few timed runs after one that compiles and warms up; the attention kernel and
the micro-step are timed in alternating rounds, so that load which drifts shifts them alike.
Under several processes each times its own runs and all take process 0's figures.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import statistics
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hotjax import distributed
from hotjax.config import cache_root
from hotjax.data import Batch
from hotjax.errors import UserError
from hotjax.models.attention import DEFAULT_BLOCK, AttentionSharding, attention
from hotjax.models.llama import LlamaConfig, as_trained, init_params, preset, rope_tables
from hotjax.models.llama import _rms_norm as rms_norm  # the model's own ops, timed alone
from hotjax.models.llama import _rotate as rotate
from hotjax.planning.cost import (
    BUS_FACTOR,
    COST_MODEL_VERSION,
    layer_elementwise_bytes,
    micro_step_time,
    visible_pairs,
)
from hotjax.planning.memory import HELD_BYTES
from hotjax.planning.profile import (
    COLLECTIVES,
    GIGA,
    OPTIONAL_COLLECTIVES,
    TERA,
    GiB,
    Profile,
    parse_profile,
    profile_toml,
)
from hotjax.sharding.strategy import Strategy, canonical_devices
from hotjax.step import bucket_step, micro_step_inputs

SIGNIFICANT = 4  # digits kept of each measured figure: the repeats scatter more than that
FIT_ROWS = 4  # the larger fitted micro-step's rows, per the smaller one's
CHAIN = 8  # dependent all-reduces timed in one program for the latency
MEASURED = (*COLLECTIVES, *OPTIONAL_COLLECTIVES)
# The switches timed, in `Workload.message_bytes` each device lacks, each of as many arrays as
# a model's weights are (`switch_rate`).
SWITCH_SIZES = (1, 4)
SWITCH_ARRAYS = 16
SIZE_SHARES = (16, 4)  # each collective also timed on tensors of message_bytes / these
LATENCY_BYTES = 4096  # each one's tensor


@dataclasses.dataclass(frozen=True)
class Workload:
    """What is timed, per device: a matmul [tokens, width] x [width, out]; attention forward
    and backward over causal rows of (rows, tokens) of the model's heads, and with all heads
    over rows of each of `attention_lengths` tokens (as many tokens in all); a
    data-parallel micro-step on (rows, tokens) of the model per process (its devices split the
    rows) and on `FIT_ROWS` times the rows;
    each collective on a tensor of `message_bytes`; `repeats` timed runs of each."""

    matmul: tuple[int, int, int]
    attention: tuple[int, int]
    step: tuple[int, int]
    message_bytes: int
    repeats: int
    attention_lengths: tuple[int, ...] = ()


# Sizes of the models each platform trains: the `small` preset's on CPU, LLaMA2-7B's on
# accelerators; under `quick` (a smoke test of seconds) smaller ones.
WORKLOADS = {
    ("cpu", False): Workload((4096, 256, 688), (1, 1024), (16, 128), 4 * 2**20, 5,
                             (128, 256, 512)),
    ("cpu", True): Workload((1024, 256, 688), (1, 256), (1, 128), 2**20, 2, (128,)),
    ("accelerator", False): Workload((8192, 4096, 11008), (1, 4096), (1, 4096), 64 * 2**20, 10),
    ("accelerator", True): Workload((2048, 4096, 4096), (1, 2048), (1, 1024), 16 * 2**20, 3),
}
# The model whose micro-step fits the matmul efficiency, when the caller names none: what the
# platform trains (4 of LLaMA2-7B's layers: its widths, compiled in seconds).
REFERENCE_MODELS = {("cpu", False): ("small", 0), ("cpu", True): ("tiny", 0),
                    ("accelerator", False): ("llama2-7b", 4), ("accelerator", True): ("tiny", 0)}


def measure_profile(devices: Sequence[jax.Device], *, model: LlamaConfig | None = None,
                    quick: bool = False, progress: Callable[[str], None] | None = None
                    ) -> Profile:
    """The profile of `devices` (every process's, under `hotjax launch`), measured in
    `model`'s compute dtype, its matmul efficiency fitted on `model`'s micro-step (None: a
    model of the platform's, in the trainer's default dtype). `quick`: small sizes and few
    repeats (seconds; for tests). `progress` is told what is measured next (a rich
    `Status.update`, say)."""
    devices = canonical_devices(devices)
    platform, nodes, per_node = _layout(devices)
    kind = ("cpu" if platform == "cpu" else "accelerator", quick)
    work = WORKLOADS[kind]
    model = model or reference_model(*REFERENCE_MODELS[kind])
    intra_sizes = _group_sizes(per_node)
    inter_sizes = _group_sizes(len(devices)) if nodes > 1 else ()
    total = 3 + len(MEASURED) * (len(intra_sizes) + len(inter_sizes) + len(SIZE_SHARES))
    # The tensor sizes are timed on the widest groups, across nodes where there are nodes.
    widest = ("inter", inter_sizes[-1]) if inter_sizes else ("intra", intra_sizes[-1])
    done = 0

    def announce(what: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(f"[{done}/{total}] {what}")

    dtype = model.dtype
    announce(f"compute: {dtype.name} matmul, attention, a micro-step of {model.n_layers} layers x "
         f"{model.dim} on {len(devices)} devices")
    strategy = Strategy.parse(f"data={len(devices)},rules=dp")
    attention_cases = _attention_cases(model, work, len(devices))
    attention_shapes = list(dict.fromkeys(attention_cases.values()))
    # The step's rows are per process: its devices share the host's caches (8 simulated devices
    # each given 8,192 tokens of `small` held 16 GiB of logits in one process).
    step_rows = max(1, work.step[0] // per_node)
    shapes = [(rows * step_rows * len(devices), work.step[1]) for rows in (1, FIT_ROWS)]
    # The processes arrive from work of their own (a memory wall's compiles, a plan) and may
    # have drifted apart by more than gloo waits for the first collective.
    distributed.together("measuring the profile")
    references = [MicroStepRun(model, strategy, tuple(devices), shape) for shape in shapes]
    # Attention is timed on its own: interleaved with the larger step (8,192 tokens per device
    # on CPU) the kernel ran 2.3 times slower on two pinned processes than it runs in training
    # steps, and the fit below prices the steps' attention at its rate.
    elementwise_tokens = step_rows * work.step[1]
    matmul_s, elementwise_s, *attention_s = timed_in_rounds(
        [matmul_runner(devices, dtype, work.matmul),
         elementwise_runner(devices, model, elementwise_tokens),
         *(attention_runner(devices, dtype, shape) for shape in attention_shapes)], work.repeats)
    steps_s = timed_in_rounds([r.run for r in references], work.repeats)
    attention_s = dict(zip(attention_shapes, attention_s, strict=True))
    tokens, width, out = work.matmul
    figures = {"matmul": 2 * tokens * width * out / matmul_s,
               **{name: attention_flops(shape, platform) / attention_s[shape]
                  for name, shape in attention_cases.items()},
               "elementwise": elementwise_bytes(model, elementwise_tokens, platform)
               / elementwise_s,
               "memory": device_memory_bytes(devices)}
    announce(f"latency: {CHAIN} all-reduces of {LATENCY_BYTES} bytes in a row")
    latency = collective_latency(devices, work.repeats)
    for name in MEASURED:
        for side, sizes in (("intra", intra_sizes), ("inter", inter_sizes)):
            for group in sizes:
                announce(f"{name} over groups of {group} "
                     f"({'across' if side == 'inter' else 'inside'} nodes)")
                figures[f"{name} {side} {group}"] = bus_bandwidth(
                    devices, name, group, side == "inter", work, latency)
        for share in SIZE_SHARES:
            announce(f"{name} of {work.message_bytes // share} bytes over groups of {widest[1]}")
            figures[f"{name} bytes {share}"] = bus_bandwidth(
                devices, name, widest[1], widest[0] == "inter", work, latency,
                work.message_bytes // share)
    announce(f"a switch: jax.device_put of split arrays whole onto {len(devices)} devices")
    figures["switch"], figures["switch latency"] = switch_rate(devices, work)
    figures = _agreed(figures | {"latency": latency, "small step": steps_s[0],
                                 "large step": steps_s[1]})
    source = (f"measured on {len(devices)} {platform} devices ({devices[0].device_kind}) in "
              f"{nodes} process(es), {dtype.name}, jax {jax.__version__}"
              + (", quick" if quick else "") + f"; matmul efficiency and step overhead fitted "
              f"on data-parallel micro-steps of {step_rows} and {FIT_ROWS * step_rows} x "
              f"{work.step[1]} tokens per device of a {model.n_layers}-layer, {model.dim}-wide "
              f"model")
    bandwidths = _bandwidths(figures, intra_sizes, inter_sizes, widest, work.message_bytes)
    profile = functools.partial(_profile, figures, bandwidths,
                                (platform, nodes, per_node), source)
    return profile(*fitted_step(profile(figures["matmul"]), model, strategy, shapes,
                                (figures["small step"], figures["large step"])))


def _layout(devices: Sequence[jax.Device]) -> tuple[str, int, int]:
    """The platform of `devices`, its nodes (processes) and devices per node, checked."""
    if len(devices) < 2:
        raise UserError(f"measuring a profile needs at least 2 devices to time collectives "
                        f"between, and {len(devices)} is in use: use more devices")
    nodes = len({d.process_index for d in devices})
    per_node = len(devices) // nodes
    if per_node * nodes != len(devices):
        raise UserError(f"{len(devices)} devices over {nodes} processes: give every process "
                        f"the same number of devices")
    return devices[0].platform, nodes, per_node


def _bandwidths(figures: dict[str, float], intra_sizes: tuple[int, ...],
                inter_sizes: tuple[int, ...], widest: tuple[str, int], message_bytes: int
                ) -> dict[str, dict[str, Any]]:
    """The profile's collectives table: per collective, side and group size, its bus GB/s;
    and by tensor bytes its share of the `widest` group's bandwidth at `message_bytes`."""
    bandwidths = {}
    for name in MEASURED:
        tables: dict[str, Any] = {
            side: {str(group): _rounded(figures[f"{name} {side} {group}"] / GIGA)
                   for group in sizes}
            for side, sizes in (("intra", intra_sizes), ("inter", inter_sizes))}
        if not inter_sizes:  # one node: no group spans nodes, the cost model asks for none
            tables["inter"] = tables["intra"]
        if not intra_sizes:  # one device per node: every group spans nodes
            tables["intra"] = tables["inter"]
        reference = figures[f"{name} {widest[0]} {widest[1]}"]
        tables["by_bytes"] = {
            **{str(message_bytes // share): _rounded(figures[f"{name} bytes {share}"] / reference)
               for share in sorted(SIZE_SHARES, reverse=True)},
            str(message_bytes): 1.0}
        bandwidths[name] = tables
    return bandwidths


def _profile(figures: dict[str, float], bandwidths: dict[str, dict[str, Any]],
             layout: tuple[str, int, int], source: str, matmul_flops: float,
             overhead: float = 0.0) -> Profile:
    """The profile measured, with the model's matmuls at `matmul_flops` and each micro-step's
    `overhead` seconds: the fastest rate measured is the peak, each efficiency a share of it."""
    platform, nodes, per_node = layout
    by_heads, by_length = ({int(key.split()[1]): value for key, value in figures.items()
                            if key.startswith("attention ") and key.endswith(unit)}
                           for unit in (" heads", " tokens"))
    peak = max(figures["matmul"], *by_heads.values(), *by_length.values(), matmul_flops)
    send = bandwidths["send"]
    return parse_profile({
        "name": f"measured-{platform}-{nodes}x{per_node}", "platform": platform,
        "nodes": nodes, "devices_per_node": per_node,
        # What the allocator hands a process, measured: no further fraction of it.
        "device": {"peak_tflops": _rounded(peak / TERA),
                   "memory_gib": _rounded(figures["memory"] / GiB), "allocator_fraction": 1,
                   "elementwise_gbps": _rounded(figures["elementwise"] / GIGA),
                   **_if_positive("step_overhead_ms", overhead * 1e3)},
        "efficiency": {"matmul": _rounded(matmul_flops / peak),
                       "attention": _rounded(by_heads[max(by_heads)] / peak),
                       **({"attention_by_heads": {str(h): _rounded(rate / peak)
                                                  for h, rate in sorted(by_heads.items())}}
                          if len(by_heads) > 1 else {}),
                       **({"attention_by_length": {str(n): _rounded(rate / peak)
                                                   for n, rate in sorted(by_length.items())}}
                          if by_length else {})},
        # The links as the transfer scheduler sees them: what a device sends while every
        # device of the largest group sends too.
        "links": {"intra_node_gbps": send["intra"][max(send["intra"], key=int)],
                  "inter_node_gbps": send["inter"][max(send["inter"], key=int)],
                  **_if_positive("latency_us", figures["latency"] * 1e6),
                  "switch_gbps": _rounded(figures["switch"] / GIGA),
                  **_if_positive("switch_latency_ms", figures["switch latency"] * 1e3)},
        "collectives": bandwidths}, source)


def reference_model(name: str, layers: int = 0) -> LlamaConfig:
    """A preset as training builds it (its vocabulary padded), cut to `layers` (0: all)."""
    config = preset(name)
    return as_trained(config, n_layers=layers or config.n_layers)


def fitted_step(profile: Profile, model: LlamaConfig, strategy: Strategy,
                shapes: Sequence[tuple[int, int]], seconds: Sequence[float]
                ) -> tuple[float, float]:
    """(matmul FLOP/s, overhead seconds) at which `hotjax.planning.cost` prices `model`'s
    micro-steps of the two `shapes` under `strategy` at `seconds`, everything else as `profile`
    prices it: the rate from the difference of the two, the overhead from what the smaller one
    leaves. Where the difference leaves the matmuls no time (timing noise), the rate from the larger
    step alone and no overhead; where not even that, `profile`'s plain matmul rate."""
    at_peak = [micro_step_time(model, strategy, shape,
                               dataclasses.replace(profile, matmul_efficiency=1.0,
                                                   matmul_by_size=()))
               for shape in shapes]
    left = [t - (p.seconds - p.matmuls) for t, p in zip(seconds, at_peak, strict=True)]
    work = [p.matmuls * profile.peak_flops for p in at_peak]  # FLOPs
    if left[1] - left[0] > 0:
        rate = (work[1] - work[0]) / (left[1] - left[0])
        overhead = left[0] - work[0] / rate
        if overhead >= 0:
            return rate, overhead
    if left[1] > 0:
        return work[1] / left[1], 0.0
    return profile.peak_flops * profile.matmul_efficiency, 0.0


def causal_batch(rows: int, seq_len: int, vocab_size: int, seed: int = 0) -> Batch:
    """Random tokens, each row one document filling it (the worst case the cost model
    prices)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab_size, size=(rows, seq_len), dtype=np.int32)
    positions = np.tile(np.arange(seq_len, dtype=np.int32), (rows, 1))
    return Batch(tokens, np.ones((rows, seq_len), np.int32), positions)


class MicroStepRun:
    """A bucket's gradient micro-step compiled for micro-steps of `shape` (rows, tokens),
    its weights and one micro-step's rows in place, ready to time."""

    def __init__(self, config: LlamaConfig, strategy: Strategy,
                 devices: tuple[jax.Device, ...], shape: tuple[int, int]):
        step = bucket_step(config, strategy, devices)
        self.notes = step.notes
        (arrays,) = micro_step_inputs(step.layout, causal_batch(*shape, config.vocab_size),
                                      shape[0])
        self.compiled = step.compiled(shape, documents=step.documents(arrays))
        self.params = jax.jit(lambda: jax.tree.map(lambda p: p.astype(config.dtype),
                                                   init_params(config, 0)),
                              out_shardings=step.param_shardings)()
        self.batch, self.scale = step.place(arrays), step.place_scale(jnp.ones((), jnp.float32))
        self.acc = step.zeros()

    def run(self) -> None:
        """One micro-step, waited for (the accumulator is donated and replaced)."""
        self.acc = jax.block_until_ready(self.compiled(self.params, self.acc, self.batch,
                                                       self.scale))


def timed_in_rounds(runs: Sequence[Callable[[], None]], repeats: int) -> list[float]:
    """Each run's median seconds over `repeats` rounds, each round calling every run once in
    turn, after a round that compiles and warms them: load that drifts slows all of them alike."""
    for run in runs:
        run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, seconds in zip(runs, times, strict=True):
            started = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - started)
    return [statistics.median(seconds) for seconds in times]


def matmul_runner(devices: Sequence[jax.Device], dtype: jnp.dtype,
                  shape: tuple[int, int, int]) -> Callable[[], None]:
    """A [tokens, width] x [width, out] matmul in `dtype` on every device at once."""
    tokens, width, out = shape
    split = NamedSharding(Mesh(np.asarray(devices, dtype=object), ("devices",)),
                          PartitionSpec("devices"))
    count = len(devices)
    x, w = _filled(((count, tokens, width), (count, width, out)), dtype, split)
    product = jax.jit(lambda x, w: jnp.einsum("btd,bdf->btf", x, w), out_shardings=split)
    return lambda: jax.block_until_ready(product(x, w))


def attention_runner(devices: Sequence[jax.Device], dtype: jnp.dtype,
                     shape: tuple[int, int, int, int, int]) -> Callable[[], None]:
    """The model's attention kernel, forward and backward, on `shape`'s causal rows per device,
    every device at once."""
    rows, tokens, heads, kv_heads, head_dim = shape
    count = len(devices)
    mesh = Mesh(np.asarray(devices, dtype=object), ("devices",))
    by_row = PartitionSpec("devices")
    split = NamedSharding(mesh, by_row)
    layout = AttentionSharding(mesh, by_row, by_row)
    B = count * rows
    q, k, v, cotangent = _filled(((B, tokens, heads, head_dim), (B, tokens, kv_heads, head_dim),
                                  (B, tokens, kv_heads, head_dim), (B, tokens, heads, head_dim)),
                                 dtype, split)
    segment_ids, positions = jax.jit(lambda: (
        jnp.ones((B, tokens), jnp.int32),
        jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (B, tokens))),
        out_shardings=(split, split))()

    def loss(q, k, v, cotangent, segment_ids, positions):
        out = attention(q, k, v, segment_ids, positions, sharding=layout)
        return jnp.sum((out * cotangent).astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return lambda: jax.block_until_ready(grads(q, k, v, cotangent, segment_ids, positions))


def attention_flops(shape: tuple[int, int, int, int, int], platform: str) -> float:
    """The work of `attention_runner` per device as `hotjax.planning.cost` counts it: 4·N·H
    FLOPs per visible (query, key) pair forward and 2.5 times that backward, over the kernel's
    blocks."""
    rows, tokens, heads, _, head_dim = shape
    block = DEFAULT_BLOCK.get(platform, DEFAULT_BLOCK["gpu"])
    return 3.5 * 4 * head_dim * heads * rows * visible_pairs(tokens, 1, False, block)


def elementwise_runner(devices: Sequence[jax.Device], config: LlamaConfig,
                       tokens: int) -> Callable[[], None]:
    """One layer's elementwise work (`elementwise_bytes`), forward and backward, on `tokens`
    per device in `config`'s widths and compute dtype, every device at once: each op behind an
    optimization barrier, as the matmuls between them are in a step (XLA would fuse the lot)."""
    count, D, F, H = len(devices), config.dim, config.ffn_dim, config.head_dim
    split = NamedSharding(Mesh(np.asarray(devices, dtype=object), ("devices",)),
                          PartitionSpec("devices"))
    T = count * tokens
    x, gate, up, q, k, cotangent = _filled(
        ((T, D), (T, F), (T, F), (T, config.n_heads, H), (T, config.n_kv_heads, H), (T, D)),
        config.dtype, split)
    cos, sin = rope_tables(config, jnp.arange(T, dtype=jnp.int32)[None] % 4096)
    cos, sin = jax.device_put((cos[0], sin[0]), split)
    norm = jnp.ones((D,), config.dtype)
    barrier = jax.lax.optimization_barrier

    # Every array an argument: one spanning several processes cannot be closed over.
    def loss(x, gate, up, q, k, cos, sin, cotangent):
        h = barrier(rms_norm(x, norm, config.norm_eps))
        q, k = barrier(rotate(q[None], cos[None], sin[None])), barrier(
            rotate(k[None], cos[None], sin[None]))
        x = barrier(x + h)
        h = barrier(rms_norm(x, norm, config.norm_eps))
        hidden = barrier(jax.nn.silu(gate) * up)
        x = barrier(x + h)
        return sum(jnp.sum(a.astype(jnp.float32)) for a in (x * cotangent, hidden, q, k))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    return lambda: jax.block_until_ready(grads(x, gate, up, q, k, cos, sin, cotangent))


def elementwise_bytes(config: LlamaConfig, tokens: int, platform: str) -> float:
    """The bytes `elementwise_runner` moves per device as `hotjax.planning.cost` counts them
    (a layer's passes, run forward once, without remat's saved results)."""
    held = HELD_BYTES.get(platform, config.dtype.itemsize)
    return layer_elementwise_bytes(dataclasses.replace(config, remat="dots"), tokens, tokens,
                                   (1, 1, 1), 1, held)


def collective_latency(devices: Sequence[jax.Device], repeats: int) -> float:
    """Seconds each of `CHAIN` dependent all-reduces of `LATENCY_BYTES` over all `devices`
    takes, in one program (a step's collectives come in a row, between other work)."""
    mesh = Mesh(np.asarray(devices, dtype=object), ("group",))
    spec = PartitionSpec("group")

    def chain(x: jax.Array) -> jax.Array:
        for _ in range(CHAIN):
            x = jax.lax.psum(x, "group") * 0.5  # dependent: no two combine
        return x

    run = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=spec, out_specs=spec))
    (x,) = _filled(((len(devices) * LATENCY_BYTES // 4,),), jnp.float32,
                   NamedSharding(mesh, spec))
    (seconds,) = timed_in_rounds([lambda: jax.block_until_ready(run(x))], repeats)
    return seconds / CHAIN


def bus_bandwidth(devices: Sequence[jax.Device], collective: str, group: int,
                  across_nodes: bool, work: Workload, latency: float = 0.0,
                  nbytes: int | None = None) -> float:
    """Bytes/s per device of `collective` over groups of `group` devices, every group at once,
    on a tensor of `nbytes` per device (None: the workload's): consecutive devices (inside a
    node) or strided ones (each group spanning nodes); the time beyond `latency` (where that
    leaves at least half of it)."""
    count = len(devices)
    grid = np.asarray(devices, dtype=object)
    grid = (grid.reshape(group, count // group).T if across_nodes
            else grid.reshape(count // group, group))
    mesh = Mesh(grid, ("groups", "group"))
    spec = PartitionSpec(("groups", "group"))
    elements = (nbytes or work.message_bytes) // 4 // group * group  # fp32, a multiple of group
    # The tensor as the cost model sizes it: the whole one, before a reduce-scatter and after
    # an all-gather.
    local = elements // group if collective == "all-gather" else elements
    ring = [(i, (i + 1) % group) for i in range(group)]
    body = {"all-reduce": lambda x: jax.lax.psum(x, "group"),
            "all-gather": lambda x: jax.lax.all_gather(x, "group", tiled=True),
            "reduce-scatter": lambda x: jax.lax.psum_scatter(x, "group", tiled=True),
            "send": lambda x: jax.lax.ppermute(x, "group", ring),
            "all-to-all": lambda x: jax.lax.all_to_all(x, "group", 0, 0, tiled=True)}[collective]
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                check_vma=False))
    (x,) = _filled(((count * local,),), jnp.float32, NamedSharding(mesh, spec))
    (seconds,) = timed_in_rounds([lambda: jax.block_until_ready(run(x))], work.repeats)
    return BUS_FACTOR[collective](group) * elements * 4 / max(seconds - latency, seconds / 2)


def switch_rate(devices: Sequence[jax.Device], work: Workload) -> tuple[float, float]:
    """A hot switch as the trainer makes it (`jax.device_put` between layouts): bytes/s per
    device and the seconds every switch costs besides its bytes. `SWITCH_ARRAYS` fp32 arrays
    split over all `devices` are put whole on each, so that each device lacks all but its own
    pieces (as the weights lack in a switch from a split home into a replicated layout):
    `SWITCH_SIZES` times `work.message_bytes` from each other device, the rate and the fixed
    cost fitted through the two times (a rate alone, the larger's, where noise leaves them no
    slope)."""
    mesh = Mesh(np.asarray(devices, dtype=object), ("all",))
    whole = NamedSharding(mesh, PartitionSpec())
    lacking = [(len(devices) - 1) * work.message_bytes * k for k in SWITCH_SIZES]
    split = NamedSharding(mesh, PartitionSpec("all"))
    trees = [_filled(((work.message_bytes * k // 4 * len(devices) // SWITCH_ARRAYS,),)
                     * SWITCH_ARRAYS, jnp.float32, split) for k in SWITCH_SIZES]
    small, large = timed_in_rounds(
        [functools.partial(lambda x: jax.block_until_ready(jax.device_put(x, whole)), tree)
         for tree in trees], work.repeats)
    if large <= small:
        return lacking[1] / large, 0.0
    rate = (lacking[1] - lacking[0]) / (large - small)
    return rate, max(small - lacking[0] / rate, 0.0)


def device_memory_bytes(devices: Sequence[jax.Device]) -> int:
    """Bytes per device: what the runtime lets one allocate (`memory_stats`' bytes_limit), or
    where it says nothing (XLA:CPU) this host's memory shared by its devices."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    try:
        stats = local[0].memory_stats()
    except (NotImplementedError, RuntimeError):
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // len(local)


def _filled(shapes: tuple[tuple[int, ...], ...], dtype: jnp.dtype, sharding: NamedSharding
            ) -> tuple[jax.Array, ...]:
    """Random arrays, each shard drawn on the host of the process that holds it: nothing to
    compile (a generator jitted for each shape took half a second apiece on CPU)."""
    rng = np.random.default_rng(0)

    def shard(shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
        piece = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))
        return rng.standard_normal(piece, dtype=np.float32).astype(dtype)

    return tuple(jax.make_array_from_callback(shape, sharding, functools.partial(shard, shape))
                 for shape in shapes)


def _agreed(figures: dict[str, float]) -> dict[str, float]:
    """Process 0's figures, on every process: each times its own runs, and all must plan
    alike."""
    if jax.process_count() == 1:
        return figures
    from jax.experimental import multihost_utils

    values = multihost_utils.broadcast_one_to_all(np.asarray(list(figures.values()), np.float32))
    return dict(zip(figures, map(float, values), strict=True))


def _attention_cases(model: LlamaConfig, work: Workload, devices: int
                     ) -> dict[str, tuple[int, int, int, int, int]]:
    """The attention runs a profile times, by figure: on the workload's rows with all query
    heads and with each split's ("attention 4 heads"); with all heads on rows of each of its
    lengths, as many tokens ("attention 128 tokens"; the reference rows among them)."""
    rows, tokens = work.attention
    H, KV, D = model.n_heads, model.n_kv_heads, model.head_dim
    cases = {f"attention {h} heads": (rows, tokens, h, max(1, KV * h // H), D)
             for h in _head_splits(model, devices)}
    if work.attention_lengths:
        cases |= {f"attention {n} tokens": (max(1, rows * tokens // n), n, H, KV, D)
                  for n in (tokens, *work.attention_lengths)}
    return cases


def _head_splits(model: LlamaConfig, devices: int) -> tuple[int, ...]:
    """The query heads per device the splits of `devices` devices leave the model (all of them
    first), where the split divides the heads."""
    return tuple(model.n_heads // g for g in (1, *_group_sizes(devices)) if model.n_heads % g == 0)


def _group_sizes(count: int) -> tuple[int, ...]:
    """Powers of two from 2 up to `count` that divide it, and `count` itself."""
    sizes = {2**i for i in range(1, count.bit_length()) if count % 2**i == 0}
    return tuple(sorted(sizes | {count})) if count > 1 else ()


def _rounded(x: float) -> float:
    return float(f"{x:.{SIGNIFICANT}g}")


def _if_positive(key: str, value: float) -> dict[str, float]:
    """{key: value} rounded, or nothing where it rounds to 0 (the profile's default)."""
    return {key: _rounded(value)} if _rounded(value) > 0 else {}


def profile_path() -> Path:
    """Where this machine's measured profile is cached: per kind and count of devices and
    processes, and per cost-model version (a profile's constants are fitted through the model,
    so another version's are not read)."""
    devices = jax.devices()
    kind = re.sub(r"[^A-Za-z0-9]+", "-", devices[0].device_kind).strip("-").lower()
    return (cache_root() / "profiles" / f"cost-model-v{COST_MODEL_VERSION}"
            / f"{kind}-{len(devices)}x{jax.process_count()}.toml")


def local_profile(console, measure: bool = False, quick: bool = False):
    """This machine's profile: measured once per kind and count of devices, then read from the
    cache (`$HOTJAX_CACHE/profiles`); `measure` measures again (`quick`: at small sizes, see
    `measure_profile`). In a run of several processes,
    process 0's cache decides for all (their hosts' caches may differ), so that all measure
    together or all plan with process 0's profile."""
    devices = jax.devices()
    path = profile_path()
    cached = path.read_text() if path.exists() and not measure and distributed.is_main() else ""
    if jax.process_count() > 1:
        cached = distributed.from_process_0(cached)
    if cached:
        try:
            return parse_profile(tomllib.loads(cached), str(path))
        except tomllib.TOMLDecodeError as e:
            raise UserError(f"{path}: not valid TOML ({e}): delete it to measure again") from None
    console.print(f"measuring {len(devices)} {devices[0].device_kind} devices once "
                  f"(saved to {path})")
    with console.status("measuring") as status:
        profile = measure_profile(devices, quick=quick, progress=status.update)
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(".tmp")
        scratch.write_text(profile_toml(profile))
        scratch.replace(path)
    return profile
