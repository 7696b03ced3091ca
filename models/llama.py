"""LLaMA in Flax NNX: every parameter carries logical axis names; layers are stacked and scanned.

Letters: B batch rows, T tokens, D model width, V vocabulary, N query heads, K K/V heads, H head
dim, F MLP width, L layers. Training's forward pass and decoding (`hotjax.models.decode`) share the
pieces: `compute_embedding`, `embedded`, `rope_tables`, `layer`, `head_weights`, `final_logits`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from hotjax.choices import ATTENTION_BACKENDS, REMAT_POLICIES
from hotjax.errors import UserError
from hotjax.models.attention import AttentionSharding, accumulating, attention
from hotjax.models.fields import check_model
from hotjax.models.head_loss import head_loss
from hotjax.models.pipeline import SCHEDULES, filled_microbatches, gpipe, one_f_one_b

Array = jax.Array
# Logical axis names: strategies map these to mesh axes. `seq` is the residual stream's
# sequence axis, `inner_seq` the one inside attention and the MLP (when split, keys and values
# go round a ring). `attn_heads` and `attn_kv_heads` name mesh axes of `inner_seq` that only
# the attention kernel trades for a split of its query and K/V heads (Ulysses' all-to-all).
PARAM_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "norm")
ACTIVATION_AXES = ("batch", "seq", "inner_seq", "embed", "heads", "kv_heads", "head_dim", "mlp",
                   "vocab", "attn_heads", "attn_kv_heads",
                   "stages")  # stages: a pipeline's stage buffer, always on `stage`
Constrain = Callable[[Array, tuple[str | None, ...]], Array]


class Placement(Protocol):
    """How a strategy lays the model out (`hotjax.sharding.strategy.Layout` is one)."""

    def constrain(self, x: Array, axes: tuple[str | None, ...]) -> Array:
        """`x` with the sharding its logical axes map to."""
        ...

    @property
    def attention(self) -> AttentionSharding:
        """Where attention runs, per device."""
        ...

    @property
    def pipeline(self) -> tuple[int, int] | None:
        """(stages, micro-batches) when the layers run as a pipeline, else None."""
        ...

    def across_stages(self, x: Array, axes: tuple[str | None, ...]) -> Array:
        """`x` laid out as `constrain` does, with its rows split over the pipeline's stages as
        well (where they divide): the work after a pipeline, shared by its stage groups."""
        ...

    @property
    def data_shards(self) -> int:
        """How many contiguous blocks of a batch's rows the data-like axes split it into."""
        ...


def _no_constraint(x: Array, _axes: tuple[str | None, ...]) -> Array:
    return x


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling for long contexts (HF `rope_type="llama3"`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int | None = None  # defaults to dim // n_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 4096
    compute_dtype: str = "bfloat16"
    remat: str = "none"  # one of REMAT_POLICIES
    attention: str = "auto"  # one of ATTENTION_BACKENDS
    attention_block: int = 0  # the blockwise kernel's block edge (0: the platform's default)
    # The most documents a row of the step holds, a power of two (0: not known); set per
    # compiled micro-step by `hotjax.step.BucketStep`: cuDNN's packed layout is sized by it.
    attention_documents: int = 0
    pipeline_schedule: str = "1f1b"  # one of hotjax.models.pipeline.SCHEDULES, under `stage`
    # Layers per iteration of the layer scan (`layers_unrolled`); 0: the platform's choice.
    scan_unroll: int = 0

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.remat not in REMAT_POLICIES:
            raise UserError(f"remat {self.remat!r}: choose one of {', '.join(REMAT_POLICIES)}")
        if self.attention not in ATTENTION_BACKENDS:
            raise UserError(f"attention {self.attention!r}: choose one of "
                            f"{', '.join(ATTENTION_BACKENDS)}")
        if self.pipeline_schedule not in SCHEDULES:
            raise UserError(f"pipeline_schedule {self.pipeline_schedule!r}: choose one of "
                            f"{', '.join(SCHEDULES)}")
        if self.attention_block < 0:
            raise UserError(f"attention_block {self.attention_block}: give a positive block "
                            f"edge, or 0 for the platform's default")
        if self.scan_unroll < 0:
            raise UserError(f"scan_unroll {self.scan_unroll}: give the layers per scan "
                            f"iteration ({self.n_layers} unrolls the loop whole), or 0 for the "
                            f"platform's choice")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.compute_dtype)

    def num_params(self) -> int:
        d, h = self.dim, self.head_dim
        attn = d * h * (2 * self.n_heads + 2 * self.n_kv_heads)
        layer = attn + 3 * d * self.ffn_dim + 2 * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.n_layers * layer + d + head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        d = dict(d)
        if isinstance(d.get("remat"), bool):  # written before remat had policies
            d["remat"] = "full" if d["remat"] else "none"
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)

    @classmethod
    def checked(cls, fields: dict[str, Any], where: str, fix: str,
                names: dict[str, str] | None = None) -> LlamaConfig:
        """A config from fields read from a file (untrusted): every field checked for type
        and range, and the model for fitting this host, before anything is built; one
        `UserError` line, naming `where` and the field (as `names` calls it), otherwise."""
        return cls.from_dict(check_model(fields, where, fix, names))


_LLAMA3_ROPE = RopeScaling(8.0, 1.0, 4.0, 8192)

PRESETS: dict[str, LlamaConfig] = {
    # Tests: compiles in seconds on CPU; GQA and an odd vocabulary on purpose.
    "tiny": LlamaConfig(vocab_size=259, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=176,
                        max_seq_len=1024),
    # The CPU demo: ~12M parameters with the default 8k tokenizer.
    "small": LlamaConfig(vocab_size=8192, dim=256, n_layers=8, n_heads=8, n_kv_heads=4,
                         ffn_dim=688, max_seq_len=4096),
    "llama2-7b": LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                             ffn_dim=11008, max_seq_len=4096),
    "llama2-13b": LlamaConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40,
                              ffn_dim=13824, max_seq_len=4096),
    "llama2-70b": LlamaConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                              ffn_dim=28672, max_seq_len=4096),
    "llama3-8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             ffn_dim=14336, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                             max_seq_len=8192),
    # HotSPa's "32B" (SOSP'24 §7): GPT-2 tokenizer padded to 30592, 32K context.
    "hotspa-32b": LlamaConfig(vocab_size=30592, dim=6656, n_layers=60, n_heads=64,
                              n_kv_heads=64, ffn_dim=17920, max_seq_len=32768),
}


def preset(name: str) -> LlamaConfig:
    if name not in PRESETS:
        raise UserError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def padded_vocab(vocab_size: int, multiple: int = 128) -> int:
    """The embedding rows for a tokenizer's vocabulary, rounded up (as Megatron does) so the
    vocabulary splits evenly over tensor-parallel ranks; the extra rows are never targets."""
    return -(-vocab_size // multiple) * multiple


def as_trained(config: LlamaConfig, vocab_size: int | None = None, **fields) -> LlamaConfig:
    """`config` as training builds it: its embedding holds `vocab_size` (default: its own)
    padded by `padded_vocab`, and `fields` (compute dtype, attention kernel, ...) replaced.
    `hotjax train`, `hotjax plan`, `strategy show`, the profile measurement and the benchmarks
    all size the model through this one function."""
    return dataclasses.replace(config, vocab_size=padded_vocab(vocab_size or config.vocab_size),
                               **fields)


def _param(init: Array, axes: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(init, out_sharding=axes, eager_sharding=False)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float = 0.02) -> Array:
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class Layers(nnx.Module):
    """All transformer blocks, each parameter stacked along a leading `layers` axis."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        L, D, N, K, H, F = (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                            cfg.ffn_dim)
        self.attn_norm = _param(jnp.ones((L, D)), ("layers", "norm"))
        self.wq = _param(_normal(rngs, (L, D, N, H)), ("layers", "embed", "heads", "head_dim"))
        self.wk = _param(_normal(rngs, (L, D, K, H)), ("layers", "embed", "kv_heads", "head_dim"))
        self.wv = _param(_normal(rngs, (L, D, K, H)), ("layers", "embed", "kv_heads", "head_dim"))
        self.wo = _param(_normal(rngs, (L, N, H, D)), ("layers", "heads", "head_dim", "embed"))
        self.mlp_norm = _param(jnp.ones((L, D)), ("layers", "norm"))
        self.w_gate = _param(_normal(rngs, (L, D, F)), ("layers", "embed", "mlp"))
        self.w_up = _param(_normal(rngs, (L, D, F)), ("layers", "embed", "mlp"))
        self.w_down = _param(_normal(rngs, (L, F, D)), ("layers", "mlp", "embed"))


class Llama(nnx.Module):
    """Decoder-only LLaMA. fp32 parameters; matmuls in `config.compute_dtype`."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.config = config
        V, D = config.vocab_size, config.dim
        self.embed = _param(_normal(rngs, (V, D)), ("vocab", "embed"))
        self.layers = Layers(config, rngs=rngs)
        self.final_norm = _param(jnp.ones((D,)), ("norm",))
        if not config.tie_embeddings:
            self.lm_head = _param(_normal(rngs, (D, V)), ("embed", "vocab"))

    def __call__(
        self,
        tokens_BxT: Array,
        segment_ids_BxT: Array | None = None,
        positions_BxT: Array | None = None,
        placement: Placement | None = None,
    ) -> Array:
        """Logits [B, T, V] in fp32. Tokens attend only within their segment (document);
        `placement` lays the activations out (None: one device, or XLA's choice)."""
        x_BxTxD, head_DxV, on_rows = self._trunk(tokens_BxT, segment_ids_BxT, positions_BxT,
                                                 placement)
        return final_logits(self.config, self.final_norm[...], head_DxV, x_BxTxD, on_rows,
                            platform_of(placement))

    def loss(self, tokens_BxT: Array, segment_ids_BxT: Array, positions_BxT: Array,
             targets_BxT: Array, seed: Array, placement: Placement | None = None
             ) -> tuple[Array, Array]:
        """The summed cross-entropy against `targets` and the target count, the head and the
        loss fused (`hotjax.models.head_loss`): gradients are those of `seed` x the sum."""
        x_BxTxD, head_DxV, on_rows = self._trunk(tokens_BxT, segment_ids_BxT, positions_BxT,
                                                 placement)
        return final_loss(self.config, self.final_norm[...], head_DxV, x_BxTxD, targets_BxT,
                          seed, on_rows, platform_of(placement))

    def _trunk(self, tokens_BxT: Array, segment_ids_BxT: Array | None,
               positions_BxT: Array | None, placement: Placement | None
               ) -> tuple[Array, Array, Constrain]:
        """The residual stream after the last layer, the LM head in its compute layout, and
        the layout the work after the layers takes."""
        cfg = self.config
        B, T = tokens_BxT.shape
        constrain = _no_constraint if placement is None else placement.constrain
        block = _block(cfg, placement, packed=segment_ids_BxT is not None)
        if segment_ids_BxT is None:
            segment_ids_BxT = jnp.ones((B, T), jnp.int32)
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        embed_VxD = compute_embedding(cfg, self.embed[...], constrain)
        x_BxTxD = embedded(embed_VxD, tokens_BxT, constrain)
        stacked = nnx.to_pure_dict(nnx.state(self.layers))
        rows = (segment_ids_BxT, positions_BxT, *rope_tables(cfg, positions_BxT))
        pipeline = None if placement is None else placement.pipeline
        on_rows = constrain  # the activations after the layers
        if pipeline is None:
            x_BxTxD, _ = jax.lax.scan(lambda x, w: (block(x, w, rows), None), x_BxTxD, stacked,
                                      unroll=layers_unrolled(cfg, platform_of(placement)))
        else:
            # A forward pass alone (evaluation) runs GPipe's forward ticks; training under 1F1B
            # goes through `loss_and_gradients`.
            x_BxTxD = gpipe(block, x_BxTxD, stacked, rows, *pipeline, constrain=constrain,
                            remat_stages=cfg.remat == "full")
            # Every stage group holds the pipeline's output: each takes its share of the rows
            # through the final norm, the LM head and the loss, instead of all of them.
            on_rows = placement.across_stages
        head_DxV = head_weights(cfg, embed_VxD if cfg.tie_embeddings else self.lm_head[...],
                                constrain)
        return x_BxTxD, head_DxV, on_rows


def compute_embedding(cfg: LlamaConfig, embed_VxD: Array,
                      constrain: Constrain = _no_constraint) -> Array:
    # Weights are constrained to their compute layout: the activation rules applied to their
    # axes, i.e. gathered over `fsdp` and still split over `tensor` (ZeRO-3's all-gather).
    return constrain(embed_VxD.astype(cfg.dtype), ("vocab", "embed"))


def embedded(embed_VxD: Array, tokens_BxT: Array, constrain: Constrain = _no_constraint
             ) -> Array:
    """The tokens' embeddings in the residual stream's layout. Looked up where the tokens lie
    (as attention reads the rows) before the stream's split: a vocabulary split over tensor
    then sums the ranks' partial lookups once (Megatron's vocabulary-parallel embedding; under
    sequence parallelism an all-reduce, then each rank keeps its part), where a lookup straight
    into a sequence split gathers the token ids first."""
    looked_up = constrain(jnp.take(embed_VxD, tokens_BxT, axis=0), ("batch", "inner_seq", "embed"))
    return constrain(looked_up, ("batch", "seq", "embed"))


def head_weights(cfg: LlamaConfig, weights: Array, constrain: Constrain = _no_constraint
                 ) -> Array:
    """The LM head [D, V] in its compute layout, from `lm_head` or, with tied embeddings, from
    the embedding already in its compute layout."""
    return weights.T if cfg.tie_embeddings else constrain(weights.astype(cfg.dtype),
                                                          ("embed", "vocab"))


def layers_unrolled(cfg: LlamaConfig, platform: str | None) -> int:
    """Layers per iteration of the layer scan: the config's, else on a GPU under remat "none"
    all of them, else one. Unrolled, the loop no longer slices each layer's weights and saved
    activations out of stacks (on one H100, bf16, 8,192 tokens: a step of the 1B shape 182 ->
    155 ms, XLA's temporary memory 24.4 -> 13.0 GiB, 800 copies a step gone; compile 4 -> 38 s).
    Under remat "dots" or "full" the scan stays: unrolled, a 32K row of the 1B shape under "dots"
    asked 50 GiB more and did not fit where the scan ran (`docs/measurements/h100-2026-11-27c`)."""
    if cfg.scan_unroll:
        return min(cfg.scan_unroll, cfg.n_layers)
    platform = platform or jax.default_backend()
    return cfg.n_layers if platform == "gpu" and cfg.remat == "none" else 1


def platform_of(placement: Placement | None) -> str | None:
    """The platform a placement's devices are (a compile target's too); None: JAX's default."""
    return None if placement is None else placement.attention.mesh.devices.flat[0].platform


def final_logits(cfg: LlamaConfig, final_norm_D: Array, head_DxV: Array, x_BxTxD: Array,
                 on_rows: Constrain = _no_constraint, platform: str | None = None) -> Array:
    """The final norm and the LM head, laid out by `on_rows`: fp32 logits [B, T, V]."""
    x_BxTxD, head_DxV = _head_inputs(cfg, final_norm_D, head_DxV, x_BxTxD, on_rows, platform)
    logits_BxTxV = jnp.einsum("btd,dv->btv", x_BxTxD, head_DxV,
                              preferred_element_type=jnp.float32)
    return on_rows(logits_BxTxV, ("batch", "inner_seq", "vocab"))


def final_loss(cfg: LlamaConfig, final_norm_D: Array, head_DxV: Array, x_BxTxD: Array,
               targets_BxT: Array, seed: Array, on_rows: Constrain = _no_constraint,
               platform: str | None = None) -> tuple[Array, Array]:
    """The final norm, the LM head and the cross-entropy fused (`hotjax.models.head_loss`): the loss
    sum against `targets` and the target count, gradients those of `seed` x the sum."""
    x_BxTxD, head_DxV = _head_inputs(cfg, final_norm_D, head_DxV, x_BxTxD, on_rows, platform)
    return head_loss(x_BxTxD, head_DxV, targets_BxT, seed, on_rows)


def _head_inputs(cfg: LlamaConfig, final_norm_D: Array, head_DxV: Array, x_BxTxD: Array,
                 on_rows: Constrain, platform: str | None) -> tuple[Array, Array]:
    """The final norm's output and the head, laid out and in the dtype the head's matmul
    takes on `platform`."""
    x_BxTxD = on_rows(x_BxTxD, ("batch", "seq", "embed"))
    x_BxTxD = _rms_norm(x_BxTxD, final_norm_D.astype(cfg.dtype), cfg.norm_eps)
    wide = accumulating(cfg.dtype, platform)
    return x_BxTxD.astype(wide), head_DxV.astype(wide)


def _block(cfg: LlamaConfig, placement: Placement | None, packed: bool) -> Callable:
    """One transformer block `(x, one layer's weights, rows) -> x`, under the remat policy."""
    constrain = _no_constraint if placement is None else placement.constrain
    attend = functools.partial(
        attention, backend=cfg.attention, block=cfg.attention_block, packed=packed,
        documents=cfg.attention_documents,
        sharding=None if placement is None else placement.attention)

    def block(x_BxTxD: Array, w: dict[str, Array], rows: tuple[Array, ...]) -> Array:
        segment_ids_BxT, positions_BxT, cos_BxTxH, sin_BxTxH = rows
        x_BxTxD, _ = layer(cfg, x_BxTxD, w, cos_BxTxH, sin_BxTxH, lambda q, k, v: (
            attend(q, k, v, segment_ids_BxT, positions_BxT), None), constrain)
        return x_BxTxD

    return _rematerialised(block, cfg.remat)


def layer(cfg: LlamaConfig, x_BxTxD: Array, w: dict[str, Array], cos_BxTxH: Array,
          sin_BxTxH: Array, attend: Callable[[Array, Array, Array], tuple[Array, Any]],
          constrain: Constrain = _no_constraint) -> tuple[Array, Any]:
    """One transformer block over one layer's fp32 weights `w`, and what `attend` returned
    beside its output. `attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH) -> (out_BxTxNxH, extra)` is the
    attention: training's over the row (no extra), decoding's over its K/V cache (the cache)."""
    layer_axes = {k: axes[1:] for k, axes in param_axes(cfg)["layers"].items()}
    # Re-stated on entry: the backward pass slices saved activations out of the scan's
    # stack, and without it the partitioner can lose their batch sharding.
    x_BxTxD = constrain(x_BxTxD, ("batch", "seq", "embed"))
    w = {k: constrain(v.astype(cfg.dtype), layer_axes[k]) for k, v in w.items()}
    h = _rms_norm(x_BxTxD, w["attn_norm"], cfg.norm_eps)
    out_BxTxD, extra = _attention(h, w, cos_BxTxH, sin_BxTxH, attend, constrain)
    x_BxTxD = constrain(x_BxTxD + out_BxTxD, ("batch", "seq", "embed"))
    h = _rms_norm(x_BxTxD, w["mlp_norm"], cfg.norm_eps)
    x_BxTxD = x_BxTxD + _mlp(h, w, constrain)
    return constrain(x_BxTxD, ("batch", "seq", "embed")), extra


def _rematerialised(block: Callable, policy: str) -> Callable:
    if policy == "none":
        return block
    saved = (None if policy == "full"
             else jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return jax.checkpoint(block, policy=saved, prevent_cse=False)


def _rms_norm(x: Array, weight: Array, eps: float) -> Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_frequencies(cfg: LlamaConfig) -> Array:
    """Inverse frequencies [head_dim/2], with Llama-3 scaling when configured."""
    H = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(cfg: LlamaConfig, positions_BxT: Array) -> tuple[Array, Array]:
    """cos and sin [B, T, head_dim] for the rotate-half convention (as Hugging Face)."""
    angles_BxTxh = positions_BxT[..., None].astype(jnp.float32) * rope_frequencies(cfg)
    angles_BxTxH = jnp.concatenate([angles_BxTxh, angles_BxTxh], axis=-1)
    return jnp.cos(angles_BxTxH).astype(cfg.dtype), jnp.sin(angles_BxTxH).astype(cfg.dtype)


def _rotate(x_BxTxNxH: Array, cos_BxTxH: Array, sin_BxTxH: Array) -> Array:
    half = x_BxTxNxH.shape[-1] // 2
    rotated = jnp.concatenate([-x_BxTxNxH[..., half:], x_BxTxNxH[..., :half]], axis=-1)
    return x_BxTxNxH * cos_BxTxH[:, :, None] + rotated * sin_BxTxH[:, :, None]


def _attention(x_BxTxD: Array, w: dict[str, Array], cos_BxTxH: Array, sin_BxTxH: Array,
               attend: Callable[[Array, Array, Array], tuple[Array, Any]],
               constrain: Constrain) -> tuple[Array, Any]:
    q_BxTxNxH = jnp.einsum("btd,dnh->btnh", x_BxTxD, w["wq"])
    k_BxTxKxH = jnp.einsum("btd,dkh->btkh", x_BxTxD, w["wk"])
    v_BxTxKxH = jnp.einsum("btd,dkh->btkh", x_BxTxD, w["wv"])
    q_BxTxNxH = constrain(_rotate(q_BxTxNxH, cos_BxTxH, sin_BxTxH),
                          ("batch", "inner_seq", "heads", "head_dim"))
    k_BxTxKxH = constrain(_rotate(k_BxTxKxH, cos_BxTxH, sin_BxTxH),
                          ("batch", "inner_seq", "kv_heads", "head_dim"))
    v_BxTxKxH = constrain(v_BxTxKxH, ("batch", "inner_seq", "kv_heads", "head_dim"))
    out_BxTxNxH, extra = attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH)
    out_BxTxNxH = constrain(out_BxTxNxH, ("batch", "inner_seq", "heads", "head_dim"))
    return jnp.einsum("btnh,nhd->btd", out_BxTxNxH, w["wo"]), extra


def _mlp(x_BxTxD: Array, w: dict[str, Array], constrain: Constrain) -> Array:
    gate_BxTxF = jnp.einsum("btd,df->btf", x_BxTxD, w["w_gate"])
    up_BxTxF = jnp.einsum("btd,df->btf", x_BxTxD, w["w_up"])
    hidden_BxTxF = constrain(jax.nn.silu(gate_BxTxF) * up_BxTxF, ("batch", "inner_seq", "mlp"))
    return jnp.einsum("btf,fd->btd", hidden_BxTxF, w["w_down"])


def init_model(config: LlamaConfig, seed: int = 0) -> Llama:
    """A freshly initialised model (unsharded)."""
    return Llama(config, rngs=nnx.Rngs(params=seed))


# The functional view used by the trainer: parameters as a plain nested dict of arrays, the
# same tree that checkpoints and the Hugging Face mapping use.
Params = dict[str, Any]


@functools.cache
def _abstract(config: LlamaConfig) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(nnx.eval_shape(lambda: init_model(config)))


def param_axes(config: LlamaConfig) -> Params:
    """Each parameter's logical axis names, e.g. `('layers', 'embed', 'mlp')`."""
    nested: Params = {}
    for path, var in nnx.to_flat_state(_abstract(config)[1]):
        *outer, name = path
        node = nested
        for key in outer:
            node = node.setdefault(key, {})
        node[name] = tuple(var.out_sharding)
    return nested


def param_leaves(config: LlamaConfig) -> list[tuple[tuple[str, ...], jax.ShapeDtypeStruct]]:
    """Each parameter's logical axes and abstract array, in the trees' leaf order."""
    return list(_leaves(config))


@functools.cache
def _leaves(config: LlamaConfig) -> tuple[tuple[tuple[str, ...], jax.ShapeDtypeStruct], ...]:
    """`param_leaves`, built once per config: the planner asks for them in its inner loops."""
    axes = jax.tree.leaves(param_axes(config), is_leaf=lambda x: isinstance(x, tuple))
    return tuple(zip(axes, jax.tree.leaves(abstract_params(config)), strict=True))


def abstract_params(config: LlamaConfig) -> Params:
    """Each parameter as a `jax.ShapeDtypeStruct` (fp32 master weights)."""
    return nnx.to_pure_dict(_abstract(config)[1])


def init_params(config: LlamaConfig, seed: int = 0) -> Params:
    """Fresh parameters; under `jit` with sharded outputs they are created in place."""
    return nnx.to_pure_dict(nnx.state(init_model(config, seed)))


def bind(config: LlamaConfig, params: Params) -> Llama:
    """The `Llama` module over `params` (works on traced arrays inside `jit`)."""
    graphdef, state = _abstract(config)
    state = jax.tree.map(lambda v: v, state)  # a fresh copy: replace_by_pure_dict mutates
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def loss_and_gradients(config: LlamaConfig, params: Params, rows: dict[str, Array],
                       placement: Placement | None, seed: Array, chain: int = 1,
                       filled: Array | None = None) -> tuple[Params, tuple[Array, Array]]:
    """The loss sum and target count of `rows` (`tokens`, `segment_ids`, `positions`,
    `targets`) and the gradients of `seed` times the loss sum: by autodiff of the model, or
    under a 1F1B pipeline by the schedule itself, which embeds, runs the head and the loss
    inside, over `chain` micro-steps' micro-batches at once (`chain` x the strategy's),
    the first `filled` of them (default: up to the last holding a token; the trainer lays a
    chain's rows out so that the micro-batches holding tokens come first)."""
    pipeline = None if placement is None else placement.pipeline
    if pipeline is None or config.pipeline_schedule == "gpipe":
        def scaled(params: Params) -> tuple[Array, tuple[Array, Array]]:
            total, count = bind(config, params).loss(
                rows["tokens"], rows["segment_ids"], rows["positions"], rows["targets"], seed,
                placement)
            return total * seed, (total, count)

        (_, sums), grads = jax.value_and_grad(scaled, has_aux=True)(params)
        return grads, sums
    cfg, constrain = config, placement.constrain
    stages, microbatches = pipeline[0], pipeline[1] * chain
    if filled is None:
        filled = filled_microbatches(rows["segment_ids"], microbatches)
    tied = cfg.tie_embeddings
    # The embedding's cast and layout have the identity as their gradient: the schedule's fp32
    # sum is the embedding's gradient as it stands.
    embed_VxD = compute_embedding(cfg, params["embed"], constrain)

    def head(p: Params, x_BxTxD: Array, targets_BxT: Array) -> tuple[Array, Array]:
        head_DxV = head_weights(cfg, p["head"], constrain)
        return final_loss(cfg, p["final_norm"], head_DxV, x_BxTxD, targets_BxT, seed,
                          constrain, platform_of(placement))

    def block_rows(r: dict[str, Array]) -> tuple[Array, ...]:
        return (r["segment_ids"], r["positions"], *rope_tables(cfg, r["positions"]))

    head_params = {"final_norm": params["final_norm"],
                   "head": embed_VxD if tied else params["lm_head"]}
    sums, d_layers, d_head, d_embed_VxD = one_f_one_b(
        _block(cfg, placement, packed=True), head,
        lambda e, tokens_BxT: embedded(e, tokens_BxT, constrain), block_rows,
        params["layers"], head_params, embed_VxD, rows, stages, microbatches,
        constrain=constrain, seed=seed, filled=filled, row_shards=placement.data_shards,
        remat_stages=cfg.remat == "full")
    if tied:
        d_embed_VxD = d_embed_VxD + d_head["head"]
    grads = {"embed": d_embed_VxD, "layers": d_layers, "final_norm": d_head["final_norm"]}
    return (grads if tied else grads | {"lm_head": d_head["head"]}), sums
