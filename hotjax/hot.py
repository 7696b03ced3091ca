"""Hot switching: each length bucket runs under its own strategy over one set of parameters.

The fp32 master weights and Adam state live in the home layout and never move. For each bucket,
in the planned order, the compute-dtype weights are switched into the bucket's layout, its rows
run forward and backward, and the fp32 gradients are switched home and summed. One optimizer
update then uses the sum over the whole mini-batch divided by its real target count, so the
update is the one a single strategy computes on the same data (HotSPa's lossless property).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from hotjax.data import MiniBatch
from hotjax.optim import OptimConfig
from hotjax.train import BATCH_KEYS, Trainer, TrainState, place_batch, token_loss
from models.llama import LlamaConfig, Params, abstract_params, bind, param_axes
from sharding.planner import SwitchPlan, Topology, plan_switch, strategy_switches
from sharding.strategy import Layout, Strategy, canonical_devices, fit_to_model
from sharding.switch import local_topology, switch
from sharding.table import StrategyTable


class BucketStep:
    """One bucket's strategy: its layout, and its gradient step compiled per batch shape."""

    def __init__(self, config: LlamaConfig, strategy: Strategy, devices: Sequence[jax.Device]):
        self.config = config
        fitted, self.notes = fit_to_model(strategy, config)
        self.layout = Layout(fitted, devices)
        axes, shapes = param_axes(config), abstract_params(config)
        self.param_shardings = self.layout.param_shardings(axes, shapes)
        self.grad_shardings = self.layout.param_shardings(axes, shapes, fitted.grad_spec)
        self._compiled: dict[tuple[int, int], jax.stages.Compiled] = {}

    def compiled(self, shape: tuple[int, int]) -> jax.stages.Compiled:
        if shape not in self._compiled:
            def grads(params: Params, batch: dict[str, jax.Array]):
                def loss_sum(params: Params) -> tuple[jax.Array, jax.Array]:
                    model = bind(self.config, params)
                    logits = model(batch["tokens"], batch["segment_ids"], batch["positions"],
                                   self.layout.constrain)
                    return token_loss(logits, batch["targets"])

                (total, count), g = jax.value_and_grad(loss_sum, has_aux=True)(params)
                return jax.tree.map(lambda x: x.astype(jnp.float32), g), total, count

            compute = jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, self.config.dtype),
                abstract_params(self.config))
            batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in BATCH_KEYS}
            scalar = self.layout.replicated
            jitted = jax.jit(grads, in_shardings=(self.param_shardings,
                                                  {k: self.layout.batch_sharding for k in batch}),
                             out_shardings=(self.grad_shardings, scalar, scalar))
            self._compiled[shape] = jitted.lower(compute, batch).compile()
        return self._compiled[shape]


@dataclasses.dataclass
class BucketMetrics:
    max_len: int
    tokens: int
    compute_s: float
    switch_s: float
    switched_bytes: int


class HotTrainer:
    """A strategy table's buckets over one model state kept in the home strategy."""

    def __init__(self, config: LlamaConfig, optim: OptimConfig, table: StrategyTable,
                 devices: Sequence[jax.Device], home: Strategy | None = None,
                 switch_method: str = "auto", topology: Topology | None = None):
        """`switch_method`: "plan" (the planner's fused transfers), "device_put" (JAX's own
        resharding) or "auto" (whichever measures faster, per pair of layouts)."""
        self.config, self.table = config, table
        self.topology = topology or local_topology()
        self.switch = functools.partial(switch, method=switch_method, topology=self.topology)
        self.buckets = [BucketStep(config, b.strategy, devices) for b in table.buckets]
        self.home = Trainer(config, optim, home or most_sharded(table, config), devices)
        self.notes = tuple(dict.fromkeys(n for b in self.buckets for n in b.notes))
        home_params = self.home.state_shardings.params
        self.home_grads = self.home.grad_shardings
        dtype = config.dtype
        self._cast = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype), p),
                             out_shardings=home_params)
        self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b),
                            out_shardings=self.home_grads, donate_argnums=0)
        self._apply = jax.jit(
            functools.partial(_apply, tx=self.home.tx), donate_argnums=0,
            out_shardings=(self.home.state_shardings, self.home.layout.replicated))
        # The planner's view of every switch a step can make: compute weights from home or a
        # bucket into a bucket, and each bucket's fp32 gradients home (-1 stands for home).
        n = len(self.buckets)
        self.weight_plans = {(a, b): self._plan(a, b, "param", config.dtype.itemsize)
                             for a in range(-1, n) for b in range(n) if a != b}
        self.grad_plans = {b: self._plan(b, -1, "grad", 4) for b in range(n)}
        self.order = best_order({k: p.estimated_seconds for k, p in self.weight_plans.items()}, n)

    def _plan(self, source: int, target: int, kind: str, itemsize: int) -> SwitchPlan:
        strategies = [self.buckets[i].layout.strategy if i >= 0 else self.home.layout.strategy
                      for i in (source, target)]
        ids = [d.id for d in canonical_devices(self.home.layout.mesh.devices.flat)]
        arrays = strategy_switches(param_axes(self.config), abstract_params(self.config),
                                   *strategies, ids, itemsize, source_kind=kind,
                                   target_kind=kind)
        return plan_switch(arrays, self.topology)

    def init(self, seed: int) -> TrainState:
        return self.home.init(seed)

    def row_multiples(self) -> list[int]:
        """Each bucket's rows must split evenly over its strategy's batch shards."""
        return [b.layout.batch_shards for b in self.buckets]

    def train_step(self, state: TrainState, minibatch: MiniBatch) -> tuple[TrainState, dict]:
        """`step`, with the per-bucket report folded into the metrics as plain numbers."""
        state, metrics, buckets = self.step(state, minibatch)
        return state, {**metrics, "tokens": minibatch.real_tokens,
                       "buckets": [dataclasses.asdict(b) for b in buckets]}

    def prepare(self, minibatch: MiniBatch) -> None:
        """Compile every bucket's step for this mini-batch's shapes ahead of the first update."""
        for bucket, batch in zip(self.buckets, minibatch.buckets, strict=True):
            rows, seq_len = batch.tokens.shape
            bucket.compiled((rows + -rows % bucket.layout.batch_shards, seq_len))

    def memory(self, minibatch: MiniBatch) -> dict[str, int]:
        """Per-device bytes, by XLA: the home state, and each bucket's step on top of it."""
        from hotjax.train import step_memory

        home = self.home.state_bytes()
        report = {"home state": home}
        for bucket, spec, batch in zip(self.buckets, self.table.buckets, minibatch.buckets,
                                       strict=True):
            rows, seq_len = batch.tokens.shape
            compiled = bucket.compiled((rows + -rows % bucket.layout.batch_shards, seq_len))
            report[f"bucket {spec.max_len} ({bucket.layout.strategy})"] = (
                home + step_memory(compiled)["peak"])
        return report

    def describe(self) -> str:
        order = " -> ".join(str(self.table.buckets[i].strategy) for i in self.order)
        return f"home {self.home.layout.strategy}; bucket order {order}"

    def step(self, state: TrainState, minibatch: MiniBatch
             ) -> tuple[TrainState, dict, list[BucketMetrics]]:
        """One optimizer update over all buckets of `minibatch`. `state` is donated."""
        compute = self._cast(state.params)
        grads, total, count, report, previous = None, 0.0, 0, [], -1
        for i in self.order:
            bucket, batch = self.buckets[i], minibatch.buckets[i]
            started = time.perf_counter()
            compute = jax.block_until_ready(self.switch(compute, bucket.param_shardings))
            moved = self.weight_plans[previous, i].bytes_moved + self.grad_plans[i].bytes_moved
            previous = i
            switched = time.perf_counter()
            arrays = place_batch(bucket.layout, batch)
            g, loss_sum, n = bucket.compiled(arrays["tokens"].shape)(compute, arrays)
            g = jax.block_until_ready(g)
            computed = time.perf_counter()
            g = jax.block_until_ready(self.switch(g, self.home_grads))
            grads = g if grads is None else self._add(grads, g)
            total, count = total + float(loss_sum), count + int(n)
            report.append(BucketMetrics(
                self.table.buckets[i].max_len, batch.real_tokens, computed - switched,
                (switched - started) + (time.perf_counter() - computed), moved))
        state, grad_norm = self._apply(state, grads, jnp.float32(max(count, 1)))
        return state, {"loss": total / max(count, 1), "grad_norm": float(grad_norm),
                       "targets": count}, report


def _apply(state: TrainState, grad_sums: Params, count: jax.Array, *,
           tx: optax.GradientTransformation) -> tuple[TrainState, jax.Array]:
    grads = jax.tree.map(lambda g: g / count, grad_sums)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return (TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state),
            optax.global_norm(grads))


def most_sharded(table: StrategyTable, config: LlamaConfig) -> Strategy:
    """The table's strategy holding the fewest bytes of model state per device (the first
    of equals): the home of the fp32 master weights and the optimizer state."""
    from sharding.report import describe

    def state_bytes(strategy: Strategy) -> int:
        b = describe(strategy, config)["bytes_per_device"]
        return b["params"] + b["optimizer"]

    return min(table.strategies, key=state_bytes)


def best_order(costs: dict[tuple[int, int], float], n: int, home: int = -1) -> list[int]:
    """The bucket order with the least total cost of switching the compute weights from home
    through every bucket (`costs[(a, b)]`, with `home` as the start)."""
    def total(order: tuple[int, ...]) -> float:
        return sum(costs[pair] for pair in zip((home, *order[:-1]), order, strict=True))

    return list(min(itertools.permutations(range(n)), key=total))

