"""The optimizer: AdamW with linear warmup and cosine decay, after global-norm clipping."""

from __future__ import annotations

import dataclasses

import jax
import optax

from models.llama import Params


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    warmup_steps: int = 20
    total_steps: int = 200
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-5  # as LLaMA 2 (Touvron et al. 2023, §2.2)
    clip_norm: float = 1.0

    def schedule(self) -> optax.Schedule:
        """Linear warmup to `lr`, cosine decay to `lr * min_lr_ratio` by `total_steps`."""
        warmup = min(self.warmup_steps, self.total_steps)
        curve = optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=self.lr, warmup_steps=warmup,
            decay_steps=max(self.total_steps, warmup + 1), end_value=self.lr * self.min_lr_ratio)
        # Counted from 1, so that the first update is not a zero-learning-rate no-op.
        return lambda count: curve(count + 1)


def make_optimizer(cfg: OptimConfig, axes: Params) -> optax.GradientTransformation:
    """Weight decay applies to matrices, not to norm scales (found by their `norm` axis)."""
    decay_mask = jax.tree.map(lambda a: "norm" not in a, axes,
                              is_leaf=lambda x: isinstance(x, tuple))
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(cfg.schedule(), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                    weight_decay=cfg.weight_decay, mask=decay_mask),
    )
