"""The optimizer a run trains with (AdamW, Lion or Adafactor: `hotjax.models.optimizers` declares
each), with linear warmup and a decay (cosine, linear, none or WSD:
`hotjax.models.optimizers.SCHEDULES`), after global-norm clipping; for fp16 compute, behind a loss
scale that skips the updates whose gradients overflowed."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from hotjax.errors import UserError
from hotjax.models.llama import Params
from hotjax.models.optimizers import (
    BETA1,
    BETA2,
    CLIP_NORM,
    DECAY_FRACTION,
    DEFAULT,
    EPS,
    LR,
    MIN_LR_RATIO,
    SCHEDULE,
    SCHEDULES,
    WARMUP_STEPS,
    WEIGHT_DECAY,
    Optimizer,
    named,
)

LOSS_SCALING = ("off", "dynamic", "static")
# Overflowed steps in a row after which Optax applies the update anyway (so that a run gone
# to NaN shows it): a dynamic scale has halved from 2^15 to below 2^-80 by then.
MAX_SKIPPED_IN_A_ROW = 100


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: str = DEFAULT  # an entry of `hotjax.models.optimizers.OPTIMIZERS`
    lr: float = LR
    warmup_steps: int = WARMUP_STEPS
    total_steps: int = 200
    schedule: str = SCHEDULE  # an entry of `hotjax.models.optimizers.SCHEDULES`
    min_lr_ratio: float = MIN_LR_RATIO
    decay_steps: int | None = None  # the horizon, where the rate reaches its minimum: total_steps
    decay_fraction: float = DECAY_FRACTION  # WSD's
    weight_decay: float = WEIGHT_DECAY
    b1: float = BETA1
    b2: float = BETA2
    eps: float = EPS
    clip_norm: float = CLIP_NORM
    # Loss scaling (for fp16 compute): "dynamic" starts at `loss_scale`, halves it on overflow
    # and doubles it after `loss_scale_period` steps without one; "static" keeps it.
    loss_scaling: str = "off"
    loss_scale: float = 2.0**15
    loss_scale_period: int = 2000

    def __post_init__(self) -> None:
        named(self.name)
        if self.schedule not in SCHEDULES:
            raise UserError(f"schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if self.loss_scaling not in LOSS_SCALING:
            raise UserError(f"loss scaling {self.loss_scaling!r}: choose one of "
                            f"{', '.join(LOSS_SCALING)}")
        if not self.loss_scale > 0 or self.loss_scale_period < 1:
            raise UserError(f"loss scale {self.loss_scale} every {self.loss_scale_period} steps:"
                            f" give a positive scale and a period of at least one step")

    @property
    def optimizer(self) -> Optimizer:
        """What the optimizer is and what state it keeps."""
        return named(self.name)

    @property
    def shape(self) -> dict[str, object]:
        """What decides the learning rate at every step: the schedule's name, peak, warmup,
        horizon and minimum (and WSD's decay fraction)."""
        warmup = min(self.warmup_steps, self.total_steps)
        shape = {"schedule": self.schedule, "lr": self.lr, "warmup_steps": warmup}
        if self.schedule != "constant":
            shape |= {"decay_steps": self.decay_steps or self.total_steps,
                      "min_lr_ratio": self.min_lr_ratio}
        if self.schedule == "wsd":
            shape["decay_fraction"] = self.decay_fraction
        return shape

    def lr_schedule(self) -> optax.Schedule:
        """The `schedule` shape (`hotjax.models.optimizers.SCHEDULES`): linear warmup to `lr`, then
        down to `lr * min_lr_ratio` at the horizon, `decay_steps` (default `total_steps`)."""
        warmup = min(self.warmup_steps, self.total_steps)
        curve = SCHEDULES[self.schedule](self.lr, self.lr * self.min_lr_ratio, warmup,
                                         self.decay_steps or self.total_steps,
                                         self.decay_fraction)
        # Counted from 1, so that the first update is not a zero-learning-rate no-op.
        return lambda count: curve(count + 1)


def make_optimizer(cfg: OptimConfig, axes: Params) -> optax.GradientTransformation:
    """Weight decay applies to matrices, not to norm scales (found by their `norm` axis)."""
    decay_mask = jax.tree.map(lambda a: "norm" not in a, axes,
                              is_leaf=lambda x: isinstance(x, tuple))
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        cfg.optimizer.build(cfg.lr_schedule(), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, mask=decay_mask),
    )
    if cfg.loss_scaling == "off":
        return tx
    # Optax leaves the inner state untouched on a step whose gradients are not finite.
    return optax.chain(loss_scale_keeper(cfg), optax.apply_if_finite(tx, MAX_SKIPPED_IN_A_ROW))


class LossScaleState(NamedTuple):
    loss_scale: jax.Array  # fp32: what the loss is multiplied by before the backward pass
    good_steps: jax.Array  # int32: finite steps since the scale last changed


def loss_scale_keeper(cfg: OptimConfig) -> optax.GradientTransformation:
    """Keeps the loss scale beside the optimizer state (so checkpoints carry it). It reads the
    gradients, already unscaled, and passes them on: when any is not finite a dynamic scale
    halves; after `loss_scale_period` finite steps in a row it doubles."""
    def init(params: Params) -> LossScaleState:
        del params
        return LossScaleState(jnp.asarray(cfg.loss_scale, jnp.float32), jnp.zeros((), jnp.int32))

    def update(updates, state: LossScaleState, params=None):
        del params
        if cfg.loss_scaling == "static":
            return updates, state
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(u)) for u in jax.tree.leaves(updates)]))
        grow = finite & (state.good_steps + 1 >= cfg.loss_scale_period)
        scale = jnp.where(finite, jnp.where(grow, 2 * state.loss_scale, state.loss_scale),
                          state.loss_scale / 2)
        good = jnp.where(finite & ~grow, state.good_steps + 1, 0)
        return updates, LossScaleState(scale, good)

    return optax.GradientTransformation(init, update)


def loss_scale(opt_state: optax.OptState) -> jax.Array | None:
    """The current loss scale held in an optimizer state (None: no loss scaling)."""
    return optax.tree_utils.tree_get(opt_state, "loss_scale")


def skipped_steps(opt_state: optax.OptState) -> tuple[jax.Array, jax.Array] | None:
    """Whether the last update was skipped for a non-finite gradient, and how many were."""
    last_finite = optax.tree_utils.tree_get(opt_state, "last_finite")
    if last_finite is None:
        return None
    return ~last_finite, optax.tree_utils.tree_get(opt_state, "total_notfinite")
