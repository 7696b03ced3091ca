"""What a strategy does to a model: each parameter's placement, per-device state bytes and the
activation layout. Arithmetic on shapes only: no devices needed."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

from hotjax.errors import UserError
from hotjax.models.attention import DEFAULT_BLOCK, choose_backend
from hotjax.models.cudnn_attention import CUDNN_TOKENS_PER_DOCUMENT, cudnn_packed_support
from hotjax.models.llama import LlamaConfig, abstract_params, param_axes
from hotjax.models.optimizers import ADAMW, Optimizer
from hotjax.models.pipeline import bubble, in_flight
from hotjax.sharding.strategy import Strategy, fit_to_model, partial_axes, ways

# Where activations are constrained in the model, by their logical axes.
ACTIVATIONS = {
    "residual stream": ("batch", "seq", "embed"),
    "attention queries / output": ("batch", "inner_seq", "heads", "head_dim"),
    "attention keys / values": ("batch", "inner_seq", "kv_heads", "head_dim"),
    "MLP hidden": ("batch", "inner_seq", "mlp"),
    "logits": ("batch", "inner_seq", "vocab"),
    # Inside the attention kernel, the heads an all-to-all splits for the sequence (Ulysses).
    "attention heads for the sequence": ("attn_heads",),
    "attention K/V heads for the sequence": ("attn_kv_heads",),
}
FP32 = 4


def state_bytes(strategy: Strategy, config: LlamaConfig,
                optimizer: Optimizer = ADAMW) -> dict[str, int]:
    """Per-device bytes of the model state a home `strategy` keeps: fp32 `params`, the fp32
    gradient sum (`grads`) and the state `optimizer` declares (`optimizer`), step counters left
    out. The one count of them: `strategy show`, the trainer's and the planner's choice of home
    and the cost model all read it."""
    fitted, _ = fit_to_model(strategy, config)
    sizes = fitted.axes
    flat_shapes = _flatten(abstract_params(config))
    totals = {"params": 0, "grads": 0, "optimizer": 0}
    for name, axes in _flatten(param_axes(config)).items():
        shape = flat_shapes[name].shape
        specs = {"params": fitted.param_spec(axes), "grads": fitted.grad_spec(axes),
                 "optimizer": fitted.optimizer_spec(axes)}
        for kind, spec in specs.items():
            pieces = ways(spec, sizes)
            if any(size % n for size, n in zip(shape, pieces, strict=False)):
                raise UserError(f"{strategy}: parameter {name} {shape} does not split as "
                                f"{tuple(spec)}: choose mesh sizes that divide it")
            # The optimizer's arrays of the weight's shape split as `spec`; others (Adafactor's
            # row and column statistics) are replicated, as the home lays them out.
            arrays = optimizer.state_shapes(shape) if kind == "optimizer" else [shape]
            totals[kind] += sum(FP32 * math.prod(a) // (math.prod(pieces) if a == shape else 1)
                                for a in arrays)
    return totals


@functools.lru_cache(maxsize=4096)  # the planner prices tens of thousands of tables
def resident_bytes(config: LlamaConfig, strategy: Strategy,
                   optimizer: Optimizer = ADAMW) -> int:
    """Per-device bytes that stay while buckets run, under the home `strategy`: fp32 weights,
    the optimizer's state and the fp32 gradient sum (step counters left out)."""
    return sum(state_bytes(strategy, config, optimizer).values())


def most_sharded(strategies: Iterable[Strategy], config: LlamaConfig,
                 optimizer: Optimizer = ADAMW) -> Strategy:
    """The strategy holding the fewest `resident_bytes` per device (the first of equals): the
    home of a table that names none, for the trainer and the planner alike."""
    return min(strategies, key=lambda s: resident_bytes(config, s, optimizer))


def describe(strategy: Strategy, config: LlamaConfig, platform: str = "cpu",
             optimizer: Optimizer = ADAMW) -> dict[str, Any]:
    """The placement of every parameter and activation, per-device bytes of the state (its
    optimizer's as `optimizer` declares it), and the attention kernel that runs on `platform`
    (a JAX platform name: cpu, gpu, tpu)."""
    fitted, notes = fit_to_model(strategy, config)
    sizes = fitted.axes
    totals = state_bytes(strategy, config, optimizer)
    flat_shapes = _flatten(abstract_params(config))
    params = []
    for name, axes in _flatten(param_axes(config)).items():
        specs = {"params": fitted.param_spec(axes), "grads": fitted.grad_spec(axes),
                 "optimizer": fitted.optimizer_spec(axes)}
        params.append({"name": name, "shape": list(flat_shapes[name].shape), "axes": list(axes),
                       "spec": _spec_text(specs["params"]),
                       "zero": {k: _spec_text(v) for k, v in specs.items() if k != "params"
                                and v != specs["params"]}})
    return {"strategy": str(strategy), "mesh": {a: n for a, n in sizes.items() if n > 1},
            "rules": fitted.rules.name, "notes": list(notes), "params": params,
            "optimizer": optimizer.name, "bytes_per_device": totals,
            "batch_shards": fitted.batch_shards,
            "pipeline": _pipeline(fitted, config),
            "gradients": _gradients(fitted, totals["grads"]),
            "activations": {k: _spec_text(fitted.activation_spec(v))
                            for k, v in ACTIVATIONS.items()},
            "attention": _attention(fitted, config, platform)}


def _pipeline(strategy: Strategy, config: LlamaConfig) -> dict[str, Any] | None:
    """Stages, layers and micro-batches of a pipeline; its schedule (per bucket or per
    micro-step), bubble (of one micro-step, and of a bucket of four) and the
    micro-batches a stage holds in flight; and what each device sends per token of a
    micro-step's rows: to the next stage (forward activations, then as many gradient bytes
    back) and, under 1F1B, from the last stage to the groups sharing the head, and back."""
    S, M = strategy.stages, strategy.microbatches
    if S == 1:
        return None
    data = math.prod(ways(strategy.activation_spec(("batch", "seq")), strategy.axes))
    itemsize = 2 if config.compute_dtype in ("bfloat16", "float16") else 4
    schedule = config.pipeline_schedule
    # Every tick moves each stage's slot (a micro-batch of rows/M) one stage on.
    sent = 2 * (M + S - 1) * config.dim * itemsize / (M * data)
    head = 2 * (S - 1) / S * config.dim * itemsize / data if schedule == "1f1b" else 0.0
    # 1F1B runs all of a bucket's micro-steps in one schedule: n of them, n·M + S - 1 ticks.
    per = "bucket" if schedule == "1f1b" else "micro-step"
    return {"stages": S, "layers_per_stage": config.n_layers // S, "microbatches": M,
            "schedule": schedule, "schedule_per": per, "iterations": M + S - 1,
            "bubble": bubble(S, M),
            "bubble_four_micro_steps": bubble(S, 4 * M if per == "bucket" else M),
            "in_flight": in_flight(S, M, schedule), "stage_bytes_per_token": sent,
            "head_bytes_per_token": head}


def _gradients(strategy: Strategy, grad_bytes: int) -> dict[str, Any]:
    """How a bucket under `strategy` accumulates its gradients (`ACCUMULATE`): the axes its
    data shards keep partial sums apart on, and per mode the fp32 sum each device holds and
    the reductions over those axes a step makes."""
    partial = partial_axes(strategy)
    n = math.prod(strategy.axes[a] for a in partial)
    return {"partial_axes": list(partial),
            "local": {"accumulator_bytes": grad_bytes,
                      "reductions": "once per bucket" if partial else "none"},
            "sharded": {"accumulator_bytes": grad_bytes // n,
                        "reductions": "every micro-step" if partial else "none"}}


def _attention(strategy: Strategy, config: LlamaConfig, platform: str) -> dict[str, Any]:
    ring = strategy.ring  # K/V go round the ranks splitting the sequence inside attention
    choose = functools.partial(choose_backend, config.attention, platform, ring=ring > 1,
                               packed=True, dtype=config.dtype)
    kernel, note = choose()
    # A micro-step whose rows hold long documents (one per 1,024 tokens or fewer) may take
    # another kernel: cuDNN's packed layout, where it runs.
    long_documents, _ = choose(seq_len=CUDNN_TOKENS_PER_DOCUMENT * 2, documents=2)
    unused = (cudnn_packed_support(config.dtype, None)
              if platform == "gpu" and ring == 1 and config.attention == "auto" else None)
    return {"requested": config.attention, "kernel": kernel, "note": note, "ring": ring,
            "long_documents_kernel": long_documents, "cudnn_packed_unused": unused,
            "balanced": strategy.balanced,
            "block": config.attention_block or DEFAULT_BLOCK.get(platform, DEFAULT_BLOCK["gpu"])}


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _spec_text(spec) -> str:
    return "(" + ", ".join("·".join(p) if isinstance(p, tuple) else str(p) for p in spec) + ")" \
        if len(spec) else "replicated"
