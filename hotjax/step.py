"""The compiled pieces of a training step: the loss, one bucket's gradient micro-step, and the
home state with its single update.

A bucket's micro-step adds one micro-step's rows's fp32 gradients, loss sum and target count to an
accumulator held in the bucket's own layout (`Accumulator`); the home applies one update from
the accumulated sums, divided by the mini-batch's real target count. Each piece is compiled once
per (config, strategy, devices, accumulation, shape) and cached here, so trainers built again
(by tests, benchmarks, a resumed run) reuse it.

How a bucket accumulates (`ACCUMULATE`), as Megatron's and DeepSpeed's data parallelism do:
- `local`: each data shard adds its own, unreduced gradients to its own fp32 partial sum, and
  the bucket's end reduces the partial sums once, straight into the home's gradient layout
  (reduce-scattered where the home splits an array as the scatter would, else all-reduced).
  The partials are one stacked array `[data shards, ...]` split over the data axes; the
  micro-step is a `vmap` over that axis (`spmd_axis_name`), so XLA computes each shard's
  gradients where its rows are and never adds them up inside a micro-step. The data axes are
  the leading mesh axes that split the rows and that no gradient is split on
  (`partial_axes`): `data` under every rule set, `fsdp` too under dp and ZeRO-1.
- `sharded`: the gradients are reduce-scattered every micro-step into an accumulator split
  further over those axes (ZeRO-2): a data shard's share of the fp32 sum instead of all of it,
  for buckets where a whole partial sum does not fit.
Axes the gradient layout is split on already (fsdp under ZeRO-2 and ZeRO-3) reduce-scatter
every micro-step either way, as FSDP does; so do the context and tensor axes.

Under a 1F1B pipeline a bucket's micro-steps run as one compiled call, one pipeline schedule over
all their micro-batches (`BucketStep.calls`, `chain_inputs`): one fill and one drain per bucket.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hotjax.data import Batch
from hotjax.errors import UserError
from hotjax.models.attention import choose_backend
from hotjax.models.head_loss import NO_TARGET
from hotjax.models.llama import (
    LlamaConfig,
    Params,
    abstract_params,
    init_params,
    loss_and_gradients,
    param_axes,
)
from hotjax.models.pipeline import filled_microbatches
from hotjax.optim import OptimConfig, loss_scale, make_optimizer, skipped_steps
from hotjax.sharding.strategy import (
    ACCUMULATE,
    Layout,
    Rules,
    Strategy,
    as_tuple,
    fit_to_model,
    partial_axes,
    scatter_dim,
    ways,
)

BATCH_KEYS = ("tokens", "segment_ids", "positions", "targets")
SCALE = jax.ShapeDtypeStruct((), jnp.float32)


class TrainState(NamedTuple):
    step: jax.Array
    params: Params  # fp32 master weights
    opt_state: optax.OptState


class Accumulator(NamedTuple):
    """Sums over the micro-steps seen so far: fp32 gradients, loss and target count (each
    with a leading axis of data shards while they are a `local` bucket's partial sums)."""

    grads: Params
    loss_sum: jax.Array
    targets: jax.Array


def document_cap(segment_ids_BxT: np.ndarray) -> int:
    """The most documents (runs of one non-zero segment id) any row holds, rounded up to a
    power of two (at least 2) so that few caps compile: a micro-step's `attention_documents`."""
    seg = segment_ids_BxT
    starts = (seg > 0) & (seg != np.pad(seg, ((0, 0), (1, 0)))[:, :-1])
    most = int(starts.sum(axis=1).max(initial=0))
    return max(2, 1 << (most - 1).bit_length())


def next_token_targets(tokens_BxT: np.ndarray, segment_ids_BxT: np.ndarray) -> np.ndarray:
    """Each position's next token, or `NO_TARGET` where the next token does not continue the
    same document (the last token of a document, padding). Made on the host, before any
    reordering of the sequence, so the loss is a per-position sum whatever the token order."""
    targets_BxT = np.full_like(tokens_BxT, NO_TARGET)
    next_segment_BxT1 = segment_ids_BxT[:, 1:]
    continues_BxT1 = (next_segment_BxT1 == segment_ids_BxT[:, :-1]) & (next_segment_BxT1 > 0)
    targets_BxT[:, :-1] = np.where(continues_BxT1, tokens_BxT[:, 1:], NO_TARGET)
    return targets_BxT


def balanced_order(seq_len: int, ways: int) -> np.ndarray:
    """Column order giving context rank i the chunks i and 2*ways-1-i of the sequence."""
    chunks = np.arange(seq_len).reshape(2 * ways, -1)
    return np.concatenate([chunks[j] for i in range(ways) for j in (i, 2 * ways - 1 - i)])


def micro_step_inputs(layout: Layout, batch: Batch, micro_rows: int,
                      order: np.ndarray | None = None) -> list[dict[str, np.ndarray]]:
    """A bucket's rows as host arrays of `micro_rows` rows each, ready to place under `layout`:
    targets made, columns in the strategy's order. Rows run in `order` (a multiple of
    `micro_rows` row indices, -1 for an empty row: `hotjax.balance.place`), else as they come
    with empty rows at the end of the last."""
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
        columns = balanced_order(seq_len, strategy.ring)
        arrays = {k: v[:, columns] for k, v in arrays.items()}
    if order is None:
        order = np.concatenate([np.arange(rows), np.full(-rows % micro_rows, -1)])
    # One empty row after the last: index -1 takes it.
    arrays = {k: np.pad(v, ((0, 1), (0, 0)), constant_values=NO_TARGET if k == "targets"
                        else 0)[order] for k, v in arrays.items()}
    return [{k: v[start:start + micro_rows] for k, v in arrays.items()}
            for start in range(0, len(order), micro_rows)]


def chain_inputs(micro: list[dict[str, np.ndarray]], chain: int, data_shards: int,
                 microbatches: int) -> dict[str, np.ndarray]:
    """A pipeline bucket's micro-steps as the rows of one schedule of `chain` x `microbatches`
    micro-batches (empty micro-steps added up to `chain`). A micro-step's data shard holds its
    rows as [rows per micro-batch, micro-batch] (`hotjax.models.pipeline` takes every M-th row); in
    the chain each data shard holds all micro-steps' rows the same way, micro-step k's micro-batch
    m becoming micro-batch k·M + m, so that the micro-batches holding rows come first."""
    empty = {k: np.full_like(v, NO_TARGET if k == "targets" else 0)
             for k, v in micro[0].items()}
    steps = micro + [empty] * (chain - len(micro))

    def chained(key: str) -> np.ndarray:
        x_KxRxT = np.stack([arrays[key] for arrays in steps])
        K, R, T = x_KxRxT.shape
        x = x_KxRxT.reshape(K, data_shards, R // (data_shards * microbatches), microbatches, T)
        return x.transpose(1, 2, 0, 3, 4).reshape(K * R, T)

    return {k: chained(k) for k in micro[0]}


def step_memory(compiled: jax.stages.Compiled) -> dict[str, int]:
    """Per-device bytes of a compiled program, as XLA reports them (`memory_analysis`).

    `state` is what its arguments occupy; `peak` adds XLA's temporaries and any outputs not
    written in place of a donated argument.
    """
    stats = compiled.memory_analysis()
    fresh_outputs = stats.output_size_in_bytes - stats.alias_size_in_bytes
    return {"state": stats.argument_size_in_bytes, "temp": stats.temp_size_in_bytes,
            "peak": stats.argument_size_in_bytes + stats.temp_size_in_bytes + fresh_outputs}


def _per_device_bytes(shapes: Params, shardings: Params) -> int:
    sizes = jax.tree.map(lambda s, sh: math.prod(sh.shard_shape(s.shape)) * s.dtype.itemsize,
                         shapes, shardings)
    return sum(jax.tree.leaves(sizes))


class BucketStep:
    """One bucket's strategy on devices: its layouts, and its gradient micro-step
    `(compute params, accumulator, micro-step inputs, loss scale) -> accumulator` compiled once per
    shape, accumulating as `accumulate` says (`ACCUMULATE`)."""

    def __init__(self, config: LlamaConfig, strategy: Strategy, devices: Sequence[jax.Device],
                 accumulate: str = "local"):
        if accumulate not in ACCUMULATE:
            raise UserError(f"accumulate {accumulate!r}: choose one of {', '.join(ACCUMULATE)}")
        self.config = config
        fitted, self.notes = fit_to_model(strategy, config)
        self.layout = Layout(fitted, devices)
        ring = self.layout.attention.ring_size > 1
        kernel, why = choose_backend(config.attention, devices[0].platform, ring=ring,
                                     packed=True)
        # Whether a micro-step's kernel may depend on its rows' documents (cuDNN's packed
        # layout, sized by them): then each document cap compiles its own micro-step.
        self.by_documents = devices[0].platform == "gpu" and not ring and \
            config.attention in ("auto", "cudnn")
        if why:
            self.notes += (f"{fitted}: attention {config.attention} asked for, {kernel} runs: "
                           f"{why}",)
        axes, shapes = param_axes(config), abstract_params(config)
        self.param_shardings = self.layout.param_shardings(axes, shapes)  # compute weights
        self.partial = partial_axes(fitted)
        self.accumulate = accumulate if self.partial else "sharded"
        mesh, replicated = self.layout.mesh, self.layout.replicated
        # The gradient layout (ZeRO-2 reduce-scatters into a split one).
        self.grad_shardings = self.layout.param_shardings(axes, shapes, fitted.grad_spec)
        if self.accumulate == "local":
            # Inside the micro-step's vmap the rows' data axes are the mapped axis.
            self.inner = Layout(dataclasses.replace(fitted, rules=_without_batch_axes(
                fitted.rules, self.partial)), devices)
            self.shards = math.prod(mesh.shape[a] for a in self.partial)
            per_shard = NamedSharding(mesh, P(self.partial))
            self.acc_shardings = Accumulator(
                jax.tree.map(lambda s: NamedSharding(mesh, P(self.partial, *s.spec)),
                             self.grad_shardings), per_shard, per_shard)
        else:
            self.inner, self.shards = self.layout, 1
            self.acc_shardings = Accumulator(
                jax.tree.map(functools.partial(_split_further, axes=self.partial),
                             self.grad_shardings, shapes), replicated, replicated)
        self._zeros = jax.jit(lambda: _zeros(config, self.shards),
                              out_shardings=self.acc_shardings)
        self._compiled: dict[tuple[int, int, int, int], jax.stages.Compiled] = {}
        self._reduce: dict[tuple, Callable[[Accumulator], Accumulator]] = {}

    def zeros(self) -> Accumulator:
        return self._zeros()

    @property
    def chains(self) -> bool:
        """Whether a bucket's micro-steps run as one pipeline schedule (1F1B: one fill and one
        drain per bucket) rather than one each."""
        return self.layout.pipeline is not None and self.config.pipeline_schedule == "1f1b"

    def documents(self, arrays: dict[str, np.ndarray]) -> int:
        """The document cap a micro-step's host arrays compile for (0: the kernel does not
        depend on it)."""
        return document_cap(arrays["segment_ids"]) if self.by_documents else 0

    def is_compiled(self, shape: tuple[int, int], chain: int = 1, documents: int = 0) -> bool:
        """Whether `compiled(shape, chain, documents)` would return at once."""
        return (*shape, chain, documents) in self._compiled

    def compiled(self, shape: tuple[int, int], chain: int = 1,
                 documents: int = 0) -> jax.stages.Compiled:
        """The micro-step for micro-steps of `shape` (rows, length), or under a 1F1B pipeline
        for `chain` of them in one schedule (`chain_inputs` lays them out), whose rows hold at
        most `documents` documents each (0: not known; see `documents`); the accumulator is
        donated."""
        key = (*shape, chain, documents)
        if key not in self._compiled:
            rows = shape[0]
            if rows % self.layout.batch_shards:
                raise UserError(f"micro-steps of {rows} rows do not split over the "
                                f"{self.layout.batch_shards} batch shards of "
                                f"{self.layout.strategy}: use a multiple of "
                                f"{self.layout.batch_shards}")
            config = dataclasses.replace(self.config, attention_documents=documents)
            step = functools.partial(_micro_step, config=config, layout=self.inner,
                                     partial=self.partial if self.shards > 1 else (),
                                     chain=chain)
            batch = {k: jax.ShapeDtypeStruct((chain * rows, shape[1]), jnp.int32)
                     for k in BATCH_KEYS}
            jitted = jax.jit(step, in_shardings=(
                self.param_shardings, self.acc_shardings,
                {k: self.layout.batch_sharding for k in BATCH_KEYS}, self.layout.replicated),
                out_shardings=self.acc_shardings, donate_argnums=1)
            compute = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, self.config.dtype),
                                   abstract_params(self.config))
            self._compiled[key] = jitted.lower(
                compute, _accumulator_shapes(self.config, self.shards), batch, SCALE).compile()
        return self._compiled[key]

    def calls(self, micro: list[dict[str, np.ndarray]]) -> list[tuple[int, dict[str, np.ndarray]]]:
        """How a bucket's micro-steps run, as (chain, host arrays) per compiled call: one call
        each, or under 1F1B all in one schedule (`chain_inputs`), its length rounded up to a
        power of two so that few lengths compile (the empty micro-steps past the bucket's
        rows are not computed)."""
        if not self.chains or len(micro) == 1:
            return [(1, arrays) for arrays in micro]
        chain = 1 << (len(micro) - 1).bit_length()
        return [(chain, chain_inputs(micro, chain, self.layout.data_shards,
                                     self.layout.strategy.microbatches))]

    def reducer(self, shardings: Accumulator) -> Callable[[Accumulator], Accumulator]:
        """The bucket's end, compiled once per target: its sums into `shardings` (the home's
        gradient layout), the data shards' partial sums added up (one reduction) or the
        accumulator moved there as it is."""
        key = tuple(jax.tree.leaves(shardings))
        if key not in self._reduce:
            self._reduce[key] = jax.jit(self._reduction(shardings) if self.shards > 1
                                        else lambda a: a, out_shardings=shardings)
        return self._reduce[key]

    def _reduction(self, shardings: Accumulator) -> Callable[[Accumulator], Accumulator]:
        """The partial sums reduced over the partial axes: each array reduce-scattered where
        its scattered layout is the home's (`scatter_dim`: half an all-reduce's bytes, and
        nothing moves after), else all-reduced (XLA then lays it out as the home's)."""
        mesh, partial = self.layout.mesh, self.partial
        specs, tree = jax.tree.flatten(self.grad_shardings)
        shapes = jax.tree.leaves(abstract_params(self.config))
        scatters = [scatter_dim(shape.shape, sharding.spec, partial, self.shards,
                                lambda spec, target=target, shape=shape:
                                NamedSharding(mesh, spec).is_equivalent_to(target,
                                                                           len(shape.shape)))
                    for sharding, shape, target in zip(specs, shapes,
                                                       jax.tree.leaves(shardings.grads),
                                                       strict=True)]

        def reduce(acc: Accumulator) -> Accumulator:
            grads = [jax.lax.psum(x[0], partial) if scatter is None else
                     jax.lax.psum_scatter(x[0], partial, scatter_dimension=scatter[0],
                                          tiled=True)
                     for x, scatter in zip(jax.tree.leaves(acc.grads), scatters, strict=True)]
            return Accumulator(jax.tree.unflatten(tree, grads),
                               jax.lax.psum(acc.loss_sum[0], partial),
                               jax.lax.psum(acc.targets[0], partial))

        out = [s.spec if scatter is None else scatter[1]
               for s, scatter in zip(specs, scatters, strict=True)]
        return jax.shard_map(
            reduce, mesh=mesh,
            in_specs=(jax.tree.map(lambda s: s.spec, self.acc_shardings),),
            out_specs=Accumulator(jax.tree.unflatten(tree, out), P(), P()))

    def reduce(self, acc: Accumulator, shardings: Accumulator) -> Accumulator:
        return self.reducer(shardings)(acc)

    def peak_bytes(self, shape: tuple[int, int]) -> int:
        """XLA's per-device peak of one micro-step: weights, accumulator, batch, temporaries."""
        return step_memory(self.compiled(shape))["peak"]

    def abstract_accumulator(self) -> Accumulator:
        """The accumulator as `jax.ShapeDtypeStruct`s on its shardings (what `reducer`'s
        functions take, to lower without arrays)."""
        return jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                     sharding=sharding),
                            _accumulator_shapes(self.config, self.shards), self.acc_shardings)

    def accumulator_bytes(self) -> int:
        """Per-device bytes of the fp32 gradient sum (partial sums, under `local`)."""
        return _per_device_bytes(_accumulator_shapes(self.config, self.shards).grads,
                                 self.acc_shardings.grads)

    @property
    def reduction(self) -> str:
        """How the bucket's gradients are reduced, in words."""
        if self.accumulate == "local":
            return f"gradients reduced over {'·'.join(self.partial)} once per bucket"
        batch = self.layout.strategy.activation_spec(("batch",))
        over = "·".join(as_tuple(batch[0] if len(batch) else None))
        return (f"gradients reduce-scattered over {over} every micro-step" if over
                else "no data-parallel gradient reduction")

    def place(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """A micro-step's host arrays on its devices. Every process holds the same rows and
        builds its own devices' shards from them: across processes `jax.device_put` would
        first check that they agree, a collective that makes the data shards meet before
        every micro-step (`hotjax.sharding.strategy.independent_shards`)."""
        sharding = self.layout.batch_sharding
        return {k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index])
                for k, v in arrays.items()}

    def place_scale(self, scale: jax.Array) -> jax.Array:
        return jax.device_put(scale, self.layout.replicated)


def _without_batch_axes(rules: Rules, axes: tuple[str, ...]) -> Rules:
    activations = tuple((logical, tuple(a for a in mesh_axes if a not in axes))
                        if logical == "batch" else (logical, mesh_axes)
                        for logical, mesh_axes in rules.activations)
    return dataclasses.replace(rules, activations=activations)


def _split_further(sharding: NamedSharding, shape: jax.ShapeDtypeStruct,
                   axes: tuple[str, ...]) -> NamedSharding:
    """`sharding` with its largest dimension that divides evenly split over `axes` as well
    (unchanged where none does, or without `axes`)."""
    mesh = sharding.mesh
    n = math.prod(mesh.shape[a] for a in axes)
    if n == 1:
        return sharding
    parts = list(sharding.spec) + [None] * (len(shape.shape) - len(sharding.spec))
    pieces = ways(P(*parts), mesh.shape)
    sizes = [size // k for size, k in zip(shape.shape, pieces, strict=True)]
    for dim in sorted(range(len(sizes)), key=lambda d: -sizes[d]):
        if sizes[dim] % n == 0:
            parts[dim] = (*as_tuple(parts[dim]), *axes)
            return NamedSharding(mesh, P(*parts))
    return sharding


def _zeros(config: LlamaConfig, shards: int = 1) -> Accumulator:
    lead = (shards,) if shards > 1 else ()
    grads = jax.tree.map(lambda s: jnp.zeros((*lead, *s.shape), jnp.float32),
                         abstract_params(config))
    return Accumulator(grads, jnp.zeros(lead, jnp.float32), jnp.zeros(lead, jnp.int32))


@functools.cache
def _accumulator_shapes(config: LlamaConfig, shards: int = 1) -> Accumulator:
    return jax.eval_shape(functools.partial(_zeros, config, shards))


def _micro_step(params: Params, acc: Accumulator, batch: dict[str, jax.Array],
                scale: jax.Array, *, config: LlamaConfig, layout: Layout,
                partial: tuple[str, ...], chain: int) -> Accumulator:
    # The backward pass runs on the loss per token slot times the loss scale: the size loss
    # scales are tuned for (a mean loss), so small fp16 gradients do not underflow. The fp32
    # gradients are then unscaled back to those of the summed loss.
    slots = batch["tokens"].size // chain
    filled = None
    if layout.pipeline is not None and config.pipeline_schedule == "1f1b":
        # Counted over every data shard's rows, so that each runs as many micro-batches.
        filled = filled_microbatches(batch["segment_ids"], layout.pipeline[1] * chain)

    def shard_gradients(params: Params, rows: dict[str, jax.Array]
                        ) -> tuple[Params, tuple[jax.Array, jax.Array]]:
        return loss_and_gradients(config, params, rows, layout, scale / slots,
                                  chain, filled)

    if partial:
        # Each data shard's rows (a contiguous block) and its own gradients, never added up.
        shards = math.prod(layout.mesh.shape[a] for a in partial)
        rows = {k: v.reshape(shards, -1, *v.shape[1:]) for k, v in batch.items()}
        grads, (total, count) = jax.vmap(shard_gradients, in_axes=(None, 0),
                                         spmd_axis_name=partial)(params, rows)
    else:
        grads, (total, count) = shard_gradients(params, batch)
    unscale = slots / scale
    return Accumulator(
        jax.tree.map(lambda a, g: a + g.astype(jnp.float32) * unscale, acc.grads, grads),
        acc.loss_sum + total, acc.targets + count)


class Home:
    """The home layout: fp32 master weights and optimizer state (which never move), the
    compute-dtype copy each step starts from, the gradient sum, and the one update."""

    def __init__(self, config: LlamaConfig, optim: OptimConfig, strategy: Strategy,
                 devices: Sequence[jax.Device], tx: optax.GradientTransformation | None = None):
        """`tx`: an optimizer of one's own in place of `optim`'s (which then only records)."""
        self.config, self.optim = config, optim
        strategy, self.notes = fit_to_model(strategy, config)
        self.layout = Layout(strategy, devices)
        axes, shapes = param_axes(config), abstract_params(config)
        self.tx = tx or make_optimizer(optim, axes)
        params = self.layout.param_shardings(axes, shapes)
        moments = self.layout.param_shardings(axes, shapes, strategy.optimizer_spec)
        replicated = self.layout.replicated
        # Optimizer state of a parameter's shape is laid out like it (or split further under
        # ZeRO-1/2); the rest (step counters, Adafactor's row and column statistics) replicated.
        opt = optax.tree_map_params(
            self.tx, lambda s, sharding, p: sharding if s.shape == p.shape else replicated,
            jax.eval_shape(self.tx.init, shapes), moments, shapes,
            transform_non_params=lambda _: replicated)
        self.state_shardings = TrainState(replicated, params, opt)
        self.acc_shardings = Accumulator(
            self.layout.param_shardings(axes, shapes, strategy.grad_spec), replicated, replicated)
        self.no_scale = jax.device_put(jnp.ones((), jnp.float32), replicated)
        dtype = config.dtype
        self.cast = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype), p),
                            out_shardings=params)
        self.add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b),
                           out_shardings=self.acc_shardings, donate_argnums=0)
        self.apply = jax.jit(functools.partial(_apply, tx=self.tx), donate_argnums=0,
                             out_shardings=(self.state_shardings, replicated))

        def fresh(seed: int) -> TrainState:
            params = init_params(config, seed)
            return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params))

        # Compiled once per seed (a Home is cached, so a trainer built again reuses it).
        self._init = jax.jit(fresh, static_argnums=0, out_shardings=self.state_shardings)

    def init(self, seed: int) -> TrainState:
        return self._init(seed)

    def loss_scale(self, state: TrainState) -> jax.Array:
        """What this step multiplies the loss by (1 without loss scaling)."""
        scale = loss_scale(state.opt_state)
        return self.no_scale if scale is None else scale

    @functools.cached_property
    def _state_shapes(self) -> TrainState:
        return jax.eval_shape(lambda: self.init(0))

    def abstract_state(self) -> TrainState:
        """The state as `jax.ShapeDtypeStruct`s on the home shardings (restore targets)."""
        return jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                     sharding=sharding),
                            self._state_shapes, self.state_shardings)

    def state_bytes(self) -> int:
        """Per-device bytes of the fp32 parameters and optimizer state."""
        return _per_device_bytes(self._state_shapes, self.state_shardings)

    def resident_bytes(self) -> int:
        """Per-device bytes that stay on every device while a bucket runs: the state and the
        fp32 gradient sum."""
        return self.state_bytes() + _per_device_bytes(_accumulator_shapes(self.config),
                                                      self.acc_shardings)


def _apply(state: TrainState, acc: Accumulator, *, tx: optax.GradientTransformation
           ) -> tuple[TrainState, dict[str, jax.Array]]:
    count = jnp.maximum(acc.targets, 1).astype(jnp.float32)
    scale = loss_scale(state.opt_state)  # the micro-steps have unscaled the gradients
    grads = jax.tree.map(lambda g: g / count, acc.grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    state = TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state)
    metrics = {"loss": acc.loss_sum / count, "grad_norm": optax.tree.norm(grads),
               "targets": acc.targets}
    skipped = skipped_steps(opt_state)
    if skipped is not None:
        metrics |= {"loss_scale": scale, "skipped": skipped[0], "skipped_steps": skipped[1]}
    return state, metrics


@functools.cache
def bucket_step(config: LlamaConfig, strategy: Strategy, devices: tuple[jax.Device, ...],
                accumulate: str = "local") -> BucketStep:
    """One BucketStep (and so one set of compiled micro-steps) per (config, strategy, devices,
    accumulation)."""
    return BucketStep(config, strategy, devices, accumulate)


@functools.cache
def home(config: LlamaConfig, optim: OptimConfig, strategy: Strategy,
         devices: tuple[jax.Device, ...], tx: optax.GradientTransformation | None = None
         ) -> Home:
    """One Home (and so one compiled update) per (config, optimizer, strategy, devices)."""
    return Home(config, optim, strategy, devices, tx)
