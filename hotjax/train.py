"""One strategy's training step: the loss over real tokens, the jitted update, its sharded state."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hotjax.data import Batch
from hotjax.errors import UserError
from hotjax.optim import OptimConfig, make_optimizer
from models.llama import LlamaConfig, Params, abstract_params, bind, init_params, param_axes
from sharding.strategy import Layout, Strategy, fit_to_model

BATCH_KEYS = ("tokens", "segment_ids", "positions", "targets")
NO_TARGET = -1


class TrainState(NamedTuple):
    step: jax.Array
    params: Params  # fp32 master weights
    opt_state: optax.OptState


def next_token_targets(tokens_BxT: np.ndarray, segment_ids_BxT: np.ndarray) -> np.ndarray:
    """Each position's next token, or `NO_TARGET` where the next token does not continue the
    same document (the last token of a document, padding). Made on the host, before any
    reordering of the sequence, so the loss is a per-position sum whatever the token order."""
    targets_BxT = np.full_like(tokens_BxT, NO_TARGET)
    next_segment_BxT1 = segment_ids_BxT[:, 1:]
    continues_BxT1 = (next_segment_BxT1 == segment_ids_BxT[:, :-1]) & (next_segment_BxT1 > 0)
    targets_BxT[:, :-1] = np.where(continues_BxT1, tokens_BxT[:, 1:], NO_TARGET)
    return targets_BxT


def token_loss(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed cross-entropy over positions with a target, and their number."""
    logits_BxTxV = logits_BxTxV.astype(jnp.float32)
    # A one-hot contraction rather than a gather: with the vocabulary split over `tensor` each
    # rank reduces its own slice, so full logits are never gathered (vocab-parallel CE). The
    # one-hot of NO_TARGET is all zeros, and those positions are masked out below.
    target_BxTxV = jax.nn.one_hot(targets_BxT, logits_BxTxV.shape[-1], dtype=jnp.float32)
    target_logit_BxT = jnp.sum(logits_BxTxV * target_BxTxV, axis=-1)
    nll_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1) - target_logit_BxT
    valid_BxT = targets_BxT != NO_TARGET
    return jnp.sum(jnp.where(valid_BxT, nll_BxT, 0.0)), jnp.sum(valid_BxT)


def balanced_order(seq_len: int, ways: int) -> np.ndarray:
    """Column order giving context rank i the chunks i and 2*ways-1-i of the sequence."""
    chunks = np.arange(seq_len).reshape(2 * ways, -1)
    return np.concatenate([chunks[j] for i in range(ways) for j in (i, 2 * ways - 1 - i)])


def _step(state: TrainState, batch: dict[str, jax.Array], *, config: LlamaConfig,
          tx: optax.GradientTransformation, layout: Layout, grad_shardings: Params
          ) -> tuple[TrainState, dict]:
    def loss_fn(params: Params) -> tuple[jax.Array, jax.Array]:
        model = bind(config, params)
        logits = model(batch["tokens"], batch["segment_ids"], batch["positions"], layout.constrain)
        total, count = token_loss(logits, batch["targets"])
        return total / jnp.maximum(count, 1), count

    (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grads = jax.lax.with_sharding_constraint(grads, grad_shardings)  # ZeRO-2 reduce-scatters
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "targets": count}
    return TrainState(state.step + 1, params, opt_state), metrics


class Trainer:
    """Model state laid out under one strategy, and its train step compiled per batch shape."""

    def __init__(self, config: LlamaConfig, optim: OptimConfig, strategy: Strategy,
                 devices: Sequence[jax.Device]):
        self.config, self.optim = config, optim
        strategy, self.notes = fit_to_model(strategy, config)
        self.layout = Layout(strategy, devices)
        self._compiled: dict[tuple[int, int], jax.stages.Compiled] = {}
        axes, shapes = param_axes(config), abstract_params(config)
        self.tx = make_optimizer(optim, axes)
        params = self.layout.param_shardings(axes, shapes)
        self.grad_shardings = self.layout.param_shardings(axes, shapes, strategy.grad_spec)
        moments = self.layout.param_shardings(axes, shapes, strategy.optimizer_spec)
        # Optimizer moments are laid out like their parameter (or split further under ZeRO-1/2);
        # step counters are replicated.
        opt = optax.tree_map_params(self.tx, lambda _, s: s, jax.eval_shape(self.tx.init, shapes),
                                    moments, transform_non_params=lambda _: self.layout.replicated)
        self.state_shardings = TrainState(self.layout.replicated, params, opt)

    def init(self, seed: int) -> TrainState:
        def fresh() -> TrainState:
            params = init_params(self.config, seed)
            return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params))

        return jax.jit(fresh, out_shardings=self.state_shardings)()

    def batch_arrays(self, batch: Batch) -> dict[str, jax.Array]:
        return place_batch(self.layout, batch)

    def step(self, state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict]:
        """One optimizer update. `state` is donated: use the returned one."""
        return self.compiled(batch["tokens"].shape)(state, batch)

    def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        """One update from host data; metrics as Python numbers (this waits for the step)."""
        state, metrics = self.step(state, self.batch_arrays(batch))
        return state, {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                       "tokens": batch.real_tokens}

    def prepare(self, batch: Batch) -> None:
        """Compile the step for this batch's shape (rows padded as `batch_arrays` pads them)
        ahead of the first update."""
        rows, seq_len = batch.tokens.shape
        self.compiled((rows + -rows % self.layout.batch_shards, seq_len))

    def state_bytes(self) -> int:
        """Per-device bytes of the fp32 parameters and optimizer state in this layout."""
        shapes = jax.eval_shape(lambda: self.init(0))
        return sum(math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
                   for leaf, sharding in zip(jax.tree.leaves(shapes),
                                             jax.tree.leaves(self.state_shardings), strict=True))

    def memory(self, batch: Batch) -> dict[str, int]:
        """Per-device bytes of this strategy's compiled step, by XLA."""
        rows, seq_len = batch.tokens.shape
        compiled = self.compiled((rows + -rows % self.layout.batch_shards, seq_len))
        return {f"step ({self.layout.strategy})": step_memory(compiled)["peak"]}

    def compiled(self, shape: tuple[int, int]) -> jax.stages.Compiled:
        """The AOT-compiled step for one batch shape, built once."""
        if shape not in self._compiled:
            step = functools.partial(_step, config=self.config, tx=self.tx, layout=self.layout,
                                     grad_shardings=self.grad_shardings)
            batch_shardings = {k: self.layout.batch_sharding for k in BATCH_KEYS}
            jitted = jax.jit(step, in_shardings=(self.state_shardings, batch_shardings),
                             out_shardings=(self.state_shardings, self.layout.replicated),
                             donate_argnums=0)
            abstract_batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in BATCH_KEYS}
            self._compiled[shape] = jitted.lower(jax.eval_shape(lambda: self.init(0)),
                                                 abstract_batch).compile()
        return self._compiled[shape]


def place_batch(layout: Layout, batch: Batch) -> dict[str, jax.Array]:
    """The batch on devices, its rows padded with empty rows to split evenly."""
    strategy = layout.strategy
    rows, seq_len = batch.tokens.shape
    chunks = layout.seq_shards * (2 if strategy.balanced else 1)
    if seq_len % chunks:
        raise UserError(f"rows of {seq_len} tokens do not split into {chunks} chunks along "
                        f"the sequence under {strategy}: use a row length that is a "
                        f"multiple of {chunks}")
    arrays = {"tokens": batch.tokens, "segment_ids": batch.segment_ids,
              "positions": batch.positions,
              "targets": next_token_targets(batch.tokens, batch.segment_ids)}
    if strategy.balanced:
        # Attention masks by document positions, so any column order computes the same.
        order = balanced_order(seq_len, strategy.seq_ways("context"))
        arrays = {k: v[:, order] for k, v in arrays.items()}
    pad = -rows % layout.batch_shards
    return {k: jax.device_put(np.pad(v, ((0, pad), (0, 0)), constant_values=NO_TARGET
                                     if k == "targets" else 0), layout.batch_sharding)
            for k, v in arrays.items()}


@functools.cache
def get_trainer(config: LlamaConfig, optim: OptimConfig, strategy: Strategy,
                devices: tuple[jax.Device, ...]) -> Trainer:
    """One trainer (and so one set of compiled steps) per (config, strategy, devices)."""
    return Trainer(config, optim, strategy, devices)


def step_memory(compiled: jax.stages.Compiled) -> dict[str, int]:
    """Per-device bytes of a compiled step, as XLA reports them (`memory_analysis`).

    `state` is what the donated train state occupies (the arguments, batch included); `peak`
    adds XLA's temporaries and any outputs not written in place of a donated argument.
    """
    stats = compiled.memory_analysis()
    fresh_outputs = stats.output_size_in_bytes - stats.alias_size_in_bytes
    return {"state": stats.argument_size_in_bytes, "temp": stats.temp_size_in_bytes,
            "peak": stats.argument_size_in_bytes + stats.temp_size_in_bytes + fresh_outputs}
