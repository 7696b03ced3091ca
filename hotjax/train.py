"""The trainer: a strategy table's buckets over one model state kept in the home strategy.

A single `--strategy` is the one-bucket table whose home is that strategy, on the same path.
For each mini-batch, the fp32 master weights are cast to the compute dtype once; then, bucket by
bucket in the planned order (empty buckets skipped), the weights are hot-switched into the
bucket's layout, its rows run as micro-steps of one fixed shape (as many micro-steps as this
mini-batch needs, each data shard's gradients accumulated in its own fp32 partial sum, or in a
split sum where those do not fit; under 1F1B all of them in one pipeline schedule:
`hotjax.step`), and the sums are reduced once into the home's
layout and added. One optimizer update then divides by the mini-batch's real target count,
so the update is the one a single strategy computes on the same data (HotSPa's lossless
property). Nothing waits for the devices inside a step unless per-bucket timings are asked for.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np
import optax

from hotjax.balance import Placement, place, row_work
from hotjax.choices import REMAT_POLICIES
from hotjax.config import shown_bytes
from hotjax.data import Batch, MiniBatch
from hotjax.distributed import together
from hotjax.errors import UserError
from hotjax.models.llama import LlamaConfig, abstract_params, bind, param_axes
from hotjax.models.optimizers import ADAMW
from hotjax.optim import OptimConfig
from hotjax.sharding.report import most_sharded
from hotjax.sharding.strategy import Strategy, canonical_devices, independent_shards
from hotjax.sharding.switch import already_laid_out, job_topology, switch
from hotjax.sharding.table import StrategyTable
from hotjax.sharding.transfers import (
    Topology,
    TransferSchedule,
    schedule_transfers,
    strategy_switches,
)
from hotjax.step import (
    ACCUMULATE,
    BATCH_KEYS,
    Accumulator,
    BucketStep,
    TrainState,
    bucket_step,
    home,
    micro_step_inputs,
)

MAX_MICRO_UNITS = 64  # rows per batch shard in a micro-step sized to memory, at the most


@dataclasses.dataclass
class BucketMetrics:
    """One bucket of one step: what ran, what moved, and (when timed) how long it took."""

    max_len: int
    rows: int
    micro_steps: int
    micro_rows: int
    remat: str
    tokens: int
    slots: int  # token slots computed: micro_steps x micro_rows x max_len
    switched_bytes: int
    imbalance_before: float  # busiest over mean data shard's estimated work, rows in order
    imbalance: float  # the same, rows where they ran (`hotjax.balance`)
    shard_flops: float  # the mean data shard's estimated FLOPs
    # When timed: its micro-steps; the weights into its layout; its gradients into the home's
    # (the one reduction of `local` accumulation, or their switch) and added to the step's.
    compute_s: float | None = None
    switch_s: float | None = None
    gradients_s: float | None = None


class Trainer:
    """A strategy table's buckets over one model state kept in the home strategy."""

    def __init__(self, config: LlamaConfig, optim: OptimConfig | optax.GradientTransformation,
                 table: StrategyTable,
                 devices: Sequence[jax.Device], *, home_strategy: Strategy | None = None,
                 device_memory: int | None = None,
                 typical_rows: Sequence[float] | None = None, remat: str | None = None,
                 switch_method: str = "auto", topology: Topology | None = None,
                 balance: bool = True, timings: bool = False):
        """`optim`: hotjax's AdamW, or an optax optimizer of one's own.
        `device_memory`: bytes per device that micro-steps are sized to (None: one row per
        batch shard); `typical_rows`, the rows a typical mini-batch puts in each bucket
        (`hotjax.data.typical_rows`), bounds them, so that a sparse bucket does not compute
        mostly empty rows. `remat`: the policy of buckets whose table entry names none (None:
        the cheapest that fits `device_memory`, or none without a budget). `switch_method`:
        "scheduled" (the transfer scheduler's fused messages), "device_put" (JAX's own
        resharding) or "auto" (whichever measures faster, per pair of layouts). `balance`: place
        each bucket's rows so that its data shards have equal estimated work (`hotjax.balance`;
        off: in order).
        `timings`: wait for each part of each bucket to report its seconds (`BucketMetrics`:
        a host synchronisation per part)."""
        self.config, self.table, self.timings = config, table, timings
        self.balance = balance
        self.topology = topology or job_topology()
        devices = tuple(devices)
        processes = len({d.process_index for d in devices})
        spanning = ()
        if processes > 1 and switch_method != "device_put":
            # The scheduler's executor sends its messages within one process.
            if switch_method == "scheduled":
                raise UserError(f"scheduled switches run within one process and this run spans "
                                f"{processes}: use the device_put or auto switch method")
            switch_method = "device_put"
            spanning = (f"switches between layouts run as jax.device_put: the run spans "
                        f"{processes} processes, and the scheduler's executor works within one",)
        self.switch = functools.partial(switch, method=switch_method, topology=self.topology)
        # One's own optax optimizer is counted as AdamW (two fp32 copies of each weight).
        declared = optim.optimizer if isinstance(optim, OptimConfig) else ADAMW
        home_strategy = (home_strategy or table.home
                         or most_sharded(table.strategies, config, declared))
        self.home_strategy = home_strategy  # as given or chosen, before fitting to the model
        self.home = (home(config, optim, home_strategy, devices)
                     if isinstance(optim, OptimConfig)
                     else home(config, OptimConfig(), home_strategy, devices, optim))
        state = self.home.state_bytes()
        if device_memory is not None and state > device_memory:
            # Before any bucket is compiled: no micro-step fits beside this state.
            raise UserError(f"--device-memory {shown_bytes(device_memory)}: the home state "
                            f"needs {shown_bytes(state)} per device: use a more sharded "
                            f"strategy for it, or a larger budget")
        fitted = [self._fit(i, devices, remat, device_memory, typical_rows)
                  for i in range(len(table.buckets))]
        self.buckets = [bucket for bucket, _ in fitted]
        self.micro_rows = [rows for _, rows in fitted]
        self.notes = tuple(dict.fromkeys(n for b in self.buckets for n in b.notes)) + spanning
        # The transfer schedule of every switch a step can make: compute weights from home or
        # a bucket into a bucket, and each bucket's fp32 gradients home (-1 stands for home).
        n = len(self.buckets)
        self.weight_transfers = {(a, b): self._schedule(a, b, "param", config.dtype.itemsize)
                             for a in range(-1, n) for b in range(n) if a != b}
        self.grad_transfers = {b: self._schedule(b, -1, "grad", 4) for b in range(n)}
        self._forwards: dict[tuple[int, tuple[int, int]], object] = {}
        self.order = best_order({k: t.estimated_seconds
                                 for k, t in self.weight_transfers.items()}, n)

    def _schedule(self, source: int, target: int, kind: str, itemsize: int) -> TransferSchedule:
        strategies = [self.buckets[i].layout.strategy if i >= 0 else self.home.layout.strategy
                      for i in (source, target)]
        ids = [d.id for d in canonical_devices(self.home.layout.mesh.devices.flat)]
        arrays = strategy_switches(param_axes(self.config), abstract_params(self.config),
                                   *strategies, ids, itemsize, source_kind=kind,
                                   target_kind=kind)
        return schedule_transfers(arrays, self.topology)

    def _fit(self, i: int, devices: tuple[jax.Device, ...], remat: str | None,
             device_memory: int | None, typical_rows: Sequence[float] | None
             ) -> tuple[BucketStep, int]:
        """Bucket i's compiled step and rows per micro-step. Its remat policy is the table's,
        else `remat`, else with a memory budget the cheapest policy whose smallest
        micro-step fits (recomputing more only when less does not fit), else none."""
        spec = self.table.buckets[i]
        named = spec.remat or remat
        policies = (named,) if named else REMAT_POLICIES if device_memory else ("none",)
        # Partial sums reduced once per bucket where they fit, else a sharded accumulator.
        for policy, accumulate in itertools.product(policies, ACCUMULATE):
            bucket = bucket_step(dataclasses.replace(self.config, remat=policy), spec.strategy,
                                 devices, accumulate)
            rows, fits = self._micro_rows(i, bucket, device_memory, typical_rows)
            if fits:
                break
        return bucket, rows

    def _micro_rows(self, i: int, bucket: BucketStep, device_memory: int | None,
                    typical_rows: Sequence[float] | None) -> tuple[int, bool]:
        """Bucket i's rows per micro-step under `bucket`'s compiled step, and whether they fit
        `device_memory`: the table's rows, else the most that fit by XLA's memory analysis
        (under 1F1B one row per micro-batch and data shard), else one row per batch shard (the
        fewest empty rows)."""
        spec = self.table.buckets[i]
        shards = bucket.layout.batch_shards
        available = None if device_memory is None else (device_memory
                                                         - self.home.resident_bytes())

        def peak(units: int) -> int:
            return bucket.peak_bytes((units * shards, spec.max_len))

        if spec.micro_rows is not None:
            if spec.micro_rows % shards:
                raise UserError(f"{self.table.source}: bucket {i + 1} (max_len {spec.max_len}): "
                                f"micro_rows {spec.micro_rows} does not split over the {shards} "
                                f"batch shards of {bucket.layout.strategy}: use a multiple of "
                                f"{shards}")
            return spec.micro_rows, available is None or peak(spec.micro_rows // shards) <= \
                available
        if available is None:
            return shards, True
        if bucket.chains:
            # A 1F1B bucket runs all its micro-steps in one schedule: the smallest micro-batches
            # (one row per data shard) hold the least and leave the smallest bubble.
            return shards, peak(1) <= available
        filled = None if typical_rows is None else typical_rows[i]
        # Peak memory grows linearly with the rows: fit the line through one and two units of
        # `shards` rows, size the micro-step within it (`micro_units`), then step down until
        # XLA agrees.
        one = peak(1)
        if one > available or micro_units(filled, shards, MAX_MICRO_UNITS) == 1:
            return shards, one <= available
        per_unit = max(peak(2) - one, 1)
        units = micro_units(filled, shards, 1 + int((available - one) // per_unit))
        while units > 1 and peak(units) > available:
            units -= 1
        return units * shards, True

    def init(self, seed: int) -> TrainState:
        return self.home.init(seed)

    def prepare(self) -> None:
        """Compile every bucket's micro-step ahead of the first update (in parallel: compiling
        releases the GIL)."""
        shapes = [(r, b.max_len) for r, b in zip(self.micro_rows, self.table.buckets,
                                                 strict=True)]
        with concurrent.futures.ThreadPoolExecutor(len(self.buckets)) as pool:
            list(pool.map(lambda bs: bs[0].compiled(bs[1]), zip(self.buckets, shapes,
                                                                  strict=True)))
        together("compiled the buckets")

    def memory(self) -> dict[str, int]:
        """Per-device bytes, by XLA: the home state, and while each bucket runs, the home state,
        the gradient sum and the bucket's micro-step."""
        report = {"home state": self.home.state_bytes()}
        resident = self.home.resident_bytes()
        for bucket, spec, rows in zip(self.buckets, self.table.buckets, self.micro_rows,
                                      strict=True):
            name = f"bucket {spec.max_len} ({bucket.layout.strategy}, {rows} rows)"
            report[name] = resident + bucket.peak_bytes((rows, spec.max_len))
        return report

    def check_memory(self, budget: int) -> dict[str, int]:
        """`memory()`, after checking that every part fits `budget` bytes per device."""
        report = self.memory()
        for part, used in report.items():
            if used > budget:
                raise UserError(f"{self.table.source}: --device-memory {shown_bytes(budget)}: "
                                f"the {part} needs {shown_bytes(used)} per device: use a more "
                                f"sharded strategy for it, or a larger budget")
        return report

    def describe(self) -> str:
        order = " -> ".join(f"{self.table.buckets[i].max_len}: {self.buckets[i].layout.strategy}"
                            for i in self.order)
        micro = ", ".join(f"{r} x {b.max_len} (remat {s.config.remat}; {s.reduction})"
                          for r, b, s in zip(
            self.micro_rows, self.table.buckets, self.buckets, strict=True))
        return f"home {self.home.layout.strategy}; buckets {order}; micro-steps {micro}"

    def step(self, state: TrainState, minibatch: MiniBatch
             ) -> tuple[TrainState, dict[str, jax.Array], list[BucketMetrics]]:
        """One optimizer update over all buckets of `minibatch`. `state` is donated; the
        metrics are device scalars (reading them waits for the step)."""
        if not minibatch.real_tokens:
            raise UserError("an empty mini-batch: it holds no tokens to train on")
        if minibatch.max_lens != tuple(b.max_len for b in self.table.buckets):
            raise UserError(f"mini-batch buckets {list(minibatch.max_lens)} are not the table's "
                            f"{[b.max_len for b in self.table.buckets]}: make the data with the "
                            f"table's bucket lengths")
        compute = self.home.cast(state.params)
        scale = self.home.loss_scale(state)  # one for the whole mini-batch
        total: Accumulator | None = None
        report, previous = [], -1
        for i in self.order:
            batch, bucket, rows = minibatch.buckets[i], self.buckets[i], self.micro_rows[i]
            if not batch.tokens.shape[0]:
                continue  # nothing of this length this step: no switch, no compute
            placement = self._place(bucket, batch, rows)
            micro = micro_step_inputs(bucket.layout, batch, rows,
                                  placement.order if self.balance else None)
            started = time.perf_counter()
            moved = 0
            if not already_laid_out(compute, bucket.param_shardings):
                compute = self.switch(compute, bucket.param_shardings)
                moved += self.weight_transfers[previous, i].bytes_moved
            previous = i
            switched = self._wait(compute)
            acc, bucket_scale = bucket.zeros(), bucket.place_scale(scale)
            # Placed while the previous call computes; a 1F1B pipeline's in one schedule.
            for chain, arrays in bucket.calls(micro):
                shape = (rows, batch.tokens.shape[1])
                documents = bucket.documents(arrays)
                fresh = not bucket.is_compiled(shape, chain, documents)
                step = bucket.compiled(shape, chain, documents)
                if fresh:
                    together(f"compiled {shape} x {chain}")
                acc = step(compute, acc, bucket.place(arrays), bucket_scale)
            computed = self._wait(acc)
            if bucket.acc_shardings.grads != bucket.grad_shardings:
                # Partial or further-split sums: reduced into the home's layout at once.
                acc = bucket.reduce(acc, self.home.acc_shardings)
            else:
                if not already_laid_out(acc.grads, self.home.acc_shardings.grads):
                    moved += self.grad_transfers[i].bytes_moved
                acc = Accumulator(self.switch(acc.grads, self.home.acc_shardings.grads),
                                  *self.switch((acc.loss_sum, acc.targets),
                                               self.home.acc_shardings[1:]))
            total = acc if total is None else self.home.add(total, acc)
            timed = self.timings and self._wait(total)
            report.append(BucketMetrics(
                batch.tokens.shape[1], batch.tokens.shape[0], len(micro), rows,
                bucket.config.remat, batch.real_tokens,
                len(micro) * rows * batch.tokens.shape[1], moved, placement.before,
                placement.after if self.balance else placement.before, placement.mean_work,
                computed - switched if timed else None,
                switched - started if timed else None, timed - computed if timed else None))
        state, metrics = self.home.apply(state, total)
        self._wait(state)  # timed: the update inside its own step, not the next's first bucket
        return state, metrics, report

    def evaluate(self, state: TrainState, minibatch: MiniBatch) -> dict:
        """The loss of `state`'s weights on `minibatch`, nothing updated: every bucket's rows
        under its own strategy, forward only (the loss a training step on `minibatch` would
        report). Returns plain numbers: loss, targets and tokens."""
        if not minibatch.real_tokens:
            raise UserError("an empty mini-batch: it holds no tokens to evaluate on")
        compute = self.home.cast(state.params)
        sums = []
        for i in self.order:
            batch, bucket, rows = minibatch.buckets[i], self.buckets[i], self.micro_rows[i]
            if not batch.tokens.shape[0]:
                continue
            if not already_laid_out(compute, bucket.param_shardings):
                compute = self.switch(compute, bucket.param_shardings)
            loss = self._forward(i, (rows, batch.tokens.shape[1]))
            sums += [loss(compute, bucket.place(arrays))
                     for arrays in micro_step_inputs(bucket.layout, batch, rows)]
        total, targets = (sum(float(x) for x in column) for column in zip(*sums, strict=True))
        return {"loss": total / targets, "targets": int(targets),
                "tokens": minibatch.real_tokens}

    def _forward(self, i: int, shape: tuple[int, int]):
        """Bucket i's summed loss and target count on one micro-step's rows, compiled once per
        shape."""
        key = (i, shape)
        if key not in self._forwards:
            bucket = self.buckets[i]
            layout, config = bucket.layout, bucket.config

            def loss(params, batch):
                # The training step's fused head and loss, forward only: chunked logits.
                return bind(config, params).loss(batch["tokens"], batch["segment_ids"],
                                                 batch["positions"], batch["targets"], 1.0,
                                                 layout)

            self._forwards[key] = jax.jit(loss, in_shardings=(
                bucket.param_shardings, {k: layout.batch_sharding for k in BATCH_KEYS}))
        return self._forwards[key]

    def _place(self, bucket: BucketStep, batch: Batch, micro_rows: int) -> Placement:
        """Where `batch`'s rows run on `bucket`'s data shards: equal estimated work."""
        layout = bucket.layout
        work_R = row_work(batch.segment_ids, batch.positions, bucket.config,
                          layout.mesh.devices.flat[0].platform, layout.seq_shards)
        empty = row_work(np.zeros_like(batch.segment_ids[:1]),
                         np.zeros_like(batch.positions[:1]), bucket.config,
                         layout.mesh.devices.flat[0].platform, layout.seq_shards)[0]
        return place(work_R, micro_rows, layout.data_shards, empty,
                     per_bucket=independent_shards(layout.strategy, bucket.accumulate))

    def _wait(self, tree) -> float:
        """With timings on, wait for `tree` to be computed in every process; the time now
        either way. Each timed part so ends with the slowest process's: a process that finished
        its micro-steps first would otherwise wait for its peers inside the bucket's gradient
        reduction, and count their compute as the reduction's (2 pinned CPU processes: a
        ZeRO-1 bucket's reduction read 1.17-1.19x its price, timed alone 1.00-1.03x)."""
        if self.timings:
            jax.block_until_ready(tree)
            together("timed")
        return time.perf_counter()

    def train_step(self, state: TrainState, minibatch: MiniBatch) -> tuple[TrainState, dict]:
        """`step`, with its metrics as plain numbers (this waits for the step)."""
        state, metrics = self.step_async(state, minibatch)
        return state, metrics.fetch()

    def step_async(self, state: TrainState, minibatch: MiniBatch
                   ) -> tuple[TrainState, StepMetrics]:
        """`step`, returning at once: its metrics are read, waiting for the step, when asked."""
        state, metrics, buckets = self.step(state, minibatch)
        return state, StepMetrics(metrics, minibatch, buckets)


class StepMetrics(Mapping):
    """One step's metrics: device scalars until first read, then plain numbers (`fetch`, or
    any key, waits for the step). Loss, grad_norm, targets, tokens, padding, imbalance, the
    loss scale under fp16, and per bucket what ran and what moved."""

    def __init__(self, device: dict[str, jax.Array], minibatch: MiniBatch,
                 buckets: list[BucketMetrics]):
        self.device, self.buckets = device, buckets
        self._tokens, self._sequences = minibatch.real_tokens, minibatch.sequences
        self._fetched: dict | None = None

    def fetch(self) -> dict:
        """The metrics as plain numbers (waits for the step the first time)."""
        if self._fetched is None:
            self._fetched = self._read()
        return self._fetched

    def __getitem__(self, key: str):
        return self.fetch()[key]

    def __iter__(self):
        return iter(self.fetch())

    def __len__(self) -> int:
        return len(self.fetch())

    def _read(self) -> dict:
        metrics, buckets = self.device, self.buckets
        slots = sum(b.slots for b in buckets)
        weights = [b.shard_flops for b in buckets]  # each bucket's imbalance by its work
        scaling = {"loss_scale": float(metrics["loss_scale"]),
                   "skipped": bool(metrics["skipped"]),
                   "skipped_steps": int(metrics["skipped_steps"])} if "skipped" in metrics else {}
        return {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                **scaling, "targets": int(metrics["targets"]), "tokens": self._tokens,
                "sequences": self._sequences, "slots": slots,
                "padding": 1 - self._tokens / slots,
                "switched_bytes": sum(b.switched_bytes for b in buckets),
                "imbalance_before": float(np.average(
                    [b.imbalance_before for b in buckets], weights=weights)),
                "imbalance": float(np.average([b.imbalance for b in buckets], weights=weights)),
                "buckets": [dataclasses.asdict(b) for b in buckets]}


def check_finite(metrics: Mapping, step: int) -> None:
    """Ends training at a step (its `metrics` read) whose loss or gradient norm is not a finite
    number, unless loss scaling skipped its update (an fp16 overflow, retried at a lower
    scale): its state is worth neither another step nor a checkpoint."""
    loss, norm = metrics["loss"], metrics["grad_norm"]
    if metrics.get("skipped") or (math.isfinite(loss) and math.isfinite(norm)):
        return
    raise UserError(f"step {step}: the loss is {loss:g} and the gradient norm {norm:g}: training "
                    f"diverged, and nothing of this step was saved: lower --lr (or raise "
                    f"--warmup-steps) and resume from the last checkpoint")


def micro_units(rows: float | None, shards: int, fit: int) -> int:
    """Units of `shards` rows a micro-step holds in a bucket where a typical mini-batch fills
    `rows` rows and `fit` units fit the memory: no more than those rows fill in whole units (at
    least one; None: MAX_MICRO_UNITS), so that a micro-step computes no row the mini-batches
    leave empty, and the rows spread evenly over the fewest micro-steps that hold them (42 rows
    over 8 shards: two of 24, not of 40). The trainer sizes its micro-steps by it, and the
    planner its buckets (`hotjax.planning.search`)."""
    if rows is None:
        return max(1, min(fit, MAX_MICRO_UNITS))
    most = max(1, min(fit, int(rows // shards)))
    steps = max(1, math.ceil(rows / (most * shards)))
    return max(1, math.ceil(rows / shards / steps))


def best_order(costs: dict[tuple[int, int], float], n: int, home: int = -1) -> list[int]:
    """The bucket order with the least total cost of switching the compute weights from home
    through every bucket (`costs[(a, b)]`, with `home` as the start)."""
    def total(order: tuple[int, ...]) -> float:
        return sum(costs[pair] for pair in zip((home, *order[:-1]), order, strict=True))

    return list(min(itertools.permutations(range(n)), key=total))
