"""`hotjax plan`'s search: bucket boundaries and, per bucket, a strategy, rows per micro-step and
remat policy that minimise a step's predicted time (`hotjax.planning.cost`) under a memory budget.

The step it plans for is a typical mini-batch: `batch` sequences at evenly spaced quantiles of
the corpus's sequence lengths (the same plan for the same corpus). Whether a table of buckets
pays over the best single strategy, and the step a run should expect, are priced on
`DRAWN_BATCHES` mini-batches drawn from the corpus as a run's shuffled stream draws them
(`Fill.drawn`), each as the trainer runs the table's micro-steps. The quantiles hold a
batch size's tokens where a stream's mini-batch stops short of them (the sequence that would
pass the budget waits for the next), and smooth away how a few long documents share rows:
against the mean of 32 mini-batches of the training stream, over 22 of the testbed grid's
cells, the typical batch priced the planned table's step 6.1 % off on average (17 % at
most: a bimodal corpus at 16K) and the 64 drawn ones 2.6 % (11 %); the table's gain 3.0 %
and 2.4 % off (docs/measurements/testbed-grid-2026-12-01). For a set of bucket lengths
the sequences are packed first-fit-decreasing into each bucket's rows, as the trainer packs
them; a bucket's cost under a strategy is the sum of its micro-steps (rows / rows per micro-step,
rounded up), each priced at its busiest device: the rows are placed on data shards as the
trainer places them (`hotjax.balance.place`, by estimated work), and a micro-step's attention is
that of the data shard and ring rank with the most (query, key) pairs the kernel computes.
Every kernel hotjax runs on packed rows skips the blocks no document spans (the blockwise kernel
on CPU and round every ring, the packed-attention Pallas kernel on GPU), so those are the pairs
inside each packed document (`hotjax.planning.cost.document_pairs`). With `masked=False` every
row is one causal document, as training on concatenated sequences without masking is.

The search (after Hydraulis' assignment of length ranges to strategies by dynamic programming):
1. candidate strategies: every way to factor the devices over stage, data, fsdp, context and
   tensor that fits the model, with the rule set each combination needs (Megatron tensor
   parallelism with and without sequence parallelism); pipelines with 2S micro-batches;
2. per strategy, bucket length and remat policy: the most rows per micro-step that fit the
   budget beside the home state (the memory model's peak is affine in the rows) and that
   micro-step's predicted time — independent of which sequences the bucket holds;
3. a dynamic program over bucket boundaries (powers of two up to the context) and the strategy
   of the last bucket: a step's cost is its buckets' micro-steps plus the weight switch between
   consecutive buckets (bytes each device lacks over the link bandwidth; the planner prices the
   chosen table's switches exactly in the report), for each home (the table's most sharded
   strategy holds the fp32 state) whose state leaves room for the buckets.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from hotjax.balance import EMPTY, place
from hotjax.choices import REMAT_POLICIES
from hotjax.data.buckets import pack_buckets, typical_rows
from hotjax.data.stats import quantiles
from hotjax.errors import UserError
from hotjax.models.llama import LlamaConfig, param_leaves
from hotjax.models.optimizers import ADAMW, Optimizer
from hotjax.models.work import attention_kernel, training_flops
from hotjax.planning.cost import (
    MicroStepTime,
    bucket_reduction_seconds,
    document_pairs,
    micro_step_time,
    reduction_home_seconds,
    switch_seconds,
    visible_pairs,
)
from hotjax.planning.memory import micro_step_memory
from hotjax.planning.profile import Profile
from hotjax.sharding.report import ACTIVATIONS, most_sharded, resident_bytes
from hotjax.sharding.strategy import (
    ACCUMULATE,
    MESH_AXES,
    RULE_SETS,
    Strategy,
    as_tuple,
    fit_to_model,
    independent_shards,
    ways,
)
from hotjax.sharding.table import Bucket, StrategyTable
from hotjax.train import micro_units

MIN_BUCKET = 512  # the shortest bucket boundary considered
# Plans `plan_checked` makes before it gives up. Each round measures at least one micro-step not
# measured before, or it stops sooner; near a tight wall the model can under-count a dozen
# candidates by a few per cent and find them one a round (the 4K InfiniBand-scaled cell of
# docs/scale-model.md, planned from a corpus sample, took 9).
CHECK_ROUNDS = 32
# A micro-step XLA measured over the budget stays this much over it in the corrected memory
# model (through the model's rounding); one measured within the budget is corrected to exactly
# what XLA measured: any margin there would exclude a strategy the budget holds by less, and a
# memory wall's headroom can be under 1 %.
CORRECTION_MARGIN = 1.001
# Where the memory model finds no plan at all, `plan_checked` has XLA measure the micro-steps
# it puts over the budget by less than this (the model's calibrated error,
# `hotjax.planning.memory`: within about 10 %) before it gives up: the model errs both ways.
NEAR_BUDGET = 1.10
MAX_STAGES = 8
# A table must be predicted this much faster than the best single strategy to be planned, and a
# run's first steps this far off the plan's prediction are reported: the cost model's measured
# error. Across the nine cells of docs/scale-model.md (4K-16K contexts, 3 links) its predicted
# speedup of `auto` over the best static strategy was 0.0-4.0 % off the measured one in eight
# and 8.4 % in the ninth; a smaller predicted gain is within the model's error, and a switch
# for it has lost (0.97x in the unshaped 4K cell).
MARGIN = 1.10
PREDICTION_STEPS = 3  # timed steps, after one of warm-up, whose median checks the prediction
DRAWN_BATCHES = 64  # mini-batches drawn from the corpus to price a plan's step on (`Fill.drawn`)


class NothingFits(UserError):
    """No strategy fits the budget for the context's rows, by the memory model."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """One bucket's plan: sequences of (`low`, `max_len`] tokens under `strategy`, `micro_rows`
    rows per micro-step recomputing by `remat`, `micro_steps` of them per step."""

    low: int
    max_len: int
    strategy: Strategy
    micro_rows: int
    remat: str
    micro_steps: int
    rows: int  # packed rows in a typical step
    sequences: int
    tokens: int
    seconds: float  # the bucket's micro-steps and its one gradient reduction
    peak_bytes: int  # per device, home state included
    imbalance: float = 1.0  # the busiest device's attention over the mean's, summed over steps
    accumulate: str = ACCUMULATE[0]  # how its micro-steps accumulate gradients
    reduction_seconds: float = 0.0  # of `seconds`, the one reduction (`local` accumulation)

    @property
    def run_as(self) -> RunAs:
        return RunAs(self.micro_rows, self.remat, self.accumulate)


@dataclasses.dataclass(frozen=True)
class RunAs:
    """How a bucket's micro-steps run: rows each, remat policy, gradient accumulation."""

    micro_rows: int
    remat: str
    accumulate: str


@dataclasses.dataclass(frozen=True)
class Plan:
    """A strategy table priced: each bucket, and per bucket its switches, the weights into
    its layout (from the previous bucket that runs, or home) and its gradients home (0 where
    the bucket has no rows)."""

    buckets: tuple[Choice, ...]
    home: Strategy
    weights_in: tuple[float, ...]
    gradients_home: tuple[float, ...]
    why: str = ""  # why this table over the best single strategy, or the reverse (`plan`)
    # The step priced on each of the drawn mini-batches (`Fill.drawn`); empty where the search
    # knows no corpus to draw from.
    drawn_seconds: tuple[float, ...] = ()

    @property
    def switch_seconds(self) -> float:
        return sum(self.weights_in) + sum(self.gradients_home)

    def bucket_parts(self) -> list[tuple[float, float, float]]:
        """Per bucket, the prices a trainer's bucket timings are set beside: its micro-steps,
        the weights into it, its gradients home (its one reduction and their switch)."""
        return [(b.seconds - b.reduction_seconds, weights, b.reduction_seconds + home)
                for b, weights, home in zip(self.buckets, self.weights_in, self.gradients_home,
                                            strict=True)]

    @property
    def seconds(self) -> float:
        """The typical batch's step."""
        return sum(b.seconds for b in self.buckets) + self.switch_seconds

    @property
    def expected_seconds(self) -> float:
        """The step a run should expect: the drawn mini-batches' mean, else the typical one."""
        return float(np.mean(self.drawn_seconds)) if self.drawn_seconds else self.seconds

    def table(self, source: str = "hotjax plan") -> StrategyTable:
        """The plan as the strategy table `hotjax train --strategies` runs, home included."""
        return StrategyTable(tuple(Bucket(b.max_len, b.strategy, b.micro_rows, b.remat)
                                   for b in self.buckets), source, self.home)


def typical_batch(lengths: np.ndarray, batch: int) -> np.ndarray:
    """`batch` sequence lengths at evenly spaced quantiles of `lengths`."""
    if batch < 1:
        raise UserError(f"--batch-sequences {batch}: plan for at least one sequence")
    lengths = np.asarray(lengths)
    if not (lengths > 0).any():
        raise UserError("no sequence has tokens: plan for a corpus that has some")
    return np.asarray(quantiles(lengths[lengths > 0], batch))


def candidate_strategies(config: LlamaConfig, devices: int) -> list[Strategy]:
    """Every strategy over `devices` that fits `config`: each way to factor the devices over
    the mesh axes under each rule set of `RULE_SETS` that uses all of its axes (a context ring
    with the balanced chunk order), each placement once. Two candidates place alike when every
    parameter, gradient, optimizer state and activation splits over the same device groups
    (`placement`); of those the earliest rule set on the outermost mesh axes stays (`data=2`
    under dp, not `fsdp=2` under dp or zero1). A rule set added to `RULE_SETS` is planned."""
    best: dict[tuple, tuple[tuple, Strategy]] = {}
    for sizes in _factorings(devices, len(MESH_AXES)):
        mesh = {a: n for a, n in zip(MESH_AXES, sizes, strict=True) if n > 1} or {"data": 1}
        if mesh.get("stage", 1) > MAX_STAGES:
            continue
        for rank, rules in enumerate(RULE_SETS):
            fitted = _candidate(mesh, rules, config)
            if fitted is None:
                continue
            key, preference = placement(fitted, config), (rank, tuple(-n for n in sizes))
            if key not in best or preference < best[key][0]:
                best[key] = (preference, fitted)
    found = [strategy for _, strategy in best.values()]
    return sorted(found, key=lambda s: (s.sizes, list(RULE_SETS).index(s.rules.name)))


def _candidate(mesh: dict[str, int], rules: str, config: LlamaConfig) -> Strategy | None:
    """`rules` on `mesh` fitted to `config` (balanced where it has a ring), or None where it
    leaves a mesh axis idle, replicates heads, pads widths (they waste the devices) or splits
    a weight unevenly (the trainer could not place it)."""
    for balanced in (True, False):
        try:
            strategy = Strategy.create(mesh, rules, balanced=balanced)
        except UserError:
            continue
        try:
            fitted, notes = fit_to_model(strategy, config)
        except UserError:
            return None
        return fitted if not notes and _splits_weights(fitted, config) else None
    return None


def placement(strategy: Strategy, config: LlamaConfig) -> tuple:
    """What `strategy` does to `config`'s arrays, free of names: for every parameter (its
    weights, gradient and optimizer state) and activation, the device groups each dimension is
    split over, as (stride, size) runs of the canonical device order; and the pipeline."""
    sizes = strategy.axes
    stride = {a: math.prod(sizes[b] for b in MESH_AXES[i + 1:]) for i, a in enumerate(MESH_AXES)}

    def groups(spec) -> tuple:
        out = []
        for part in spec:
            runs: list[tuple[int, int]] = []
            for axis in as_tuple(part):
                if runs and runs[-1][0] == stride[axis] * sizes[axis]:  # contiguous: one run
                    runs[-1] = (stride[axis], runs[-1][1] * sizes[axis])
                else:
                    runs.append((stride[axis], sizes[axis]))
            out.append(tuple(runs))
        return tuple(out)

    params = tuple((groups(strategy.param_spec(axes)), groups(strategy.grad_spec(axes)),
                    groups(strategy.optimizer_spec(axes)))
                   for axes, _ in param_leaves(config))
    activations = tuple(groups(strategy.activation_spec(axes)) for axes in ACTIVATIONS.values())
    return params, activations, strategy.balanced, strategy.microbatches


def _splits_weights(strategy: Strategy, config: LlamaConfig) -> bool:
    """Whether every weight, its gradient and its optimizer state split evenly under
    `strategy` (a vocabulary of 259 rows does not split over tensor=2)."""
    for names, leaf in param_leaves(config):
        shape = leaf.shape
        for spec in (strategy.param_spec(names), strategy.grad_spec(names),
                     strategy.optimizer_spec(names)):
            if any(n % pieces for n, pieces in zip(shape, ways(spec, strategy.axes),
                                                   strict=False)):
                return False
    return True


def _factorings(n: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0
            for rest in _factorings(n // d, parts - 1)]


@dataclasses.dataclass(frozen=True)
class _MicroStep:
    rows: int
    remat: str
    accumulate: str
    time: MicroStepTime  # every row one causal document
    reduction: float  # the bucket's one gradient reduction, seconds
    peak_bytes: int  # without the home state
    steps: int  # micro-steps the bucket's rows take

    @property
    def seconds(self) -> float:
        return self.time.bucket_seconds([1.0] * self.steps) + self.reduction


@dataclasses.dataclass(frozen=True, eq=False)
class Fill:
    """What a run's mini-batches fill, bucket by bucket, as the trainer counts it
    (`hotjax.data.typical_rows`): a sample of the sequence lengths it trains on (cut to the
    context as training cuts them) and its batch size, in tokens or in sequences."""

    lengths_N: np.ndarray
    batch_tokens: int | None = None
    batch_sequences: int | None = None

    def drawn(self, count: int = DRAWN_BATCHES, seed: int = 0) -> list[np.ndarray]:
        """`count` mini-batches' sequence lengths as a run's shuffled stream draws them: the
        sample's sequences in a random order, as many as the batch size holds (by tokens: up
        to the sequence that would pass it, and at least one)."""
        rng = np.random.default_rng(seed)
        batches = []
        for _ in range(count):
            order = rng.permutation(len(self.lengths_N))
            if self.batch_sequences is not None:
                taken = order[:self.batch_sequences]
            else:
                tokens = np.cumsum(self.lengths_N[order])
                taken = order[:max(1, int(np.searchsorted(tokens, self.batch_tokens, "right")))]
            batches.append(self.lengths_N[taken])
        return batches

    def rows(self, low: int, high: int) -> float:
        """Rows a mini-batch fills in the bucket (`low`, `high`], whatever the other buckets
        (each bucket is packed on its own)."""
        top = max(high, int(self.lengths_N.max()))
        return typical_rows(self.lengths_N, [low, high, top], batch_tokens=self.batch_tokens,
                            batch_sequences=self.batch_sequences)[1]


class Search:
    """The costs the dynamic program combines, each computed once. `fill`: what the run's
    mini-batches fill, which bounds a bucket's rows per micro-step (None: the typical batch's
    own rows)."""

    def __init__(self, config: LlamaConfig, profile: Profile, devices: int,
                 budget_bytes: int, strategies: Sequence[Strategy] | None = None,
                 optimizer: Optimizer = ADAMW, fill: Fill | None = None):
        if devices > profile.num_devices:
            raise UserError(f"{devices} devices: profile {profile.name} has "
                            f"{profile.num_devices}: plan for at most that many")
        self.config, self.profile, self.budget = config, profile, budget_bytes
        self.devices, self.optimizer = devices, optimizer  # its state stays home
        self.strategies = list(strategies or candidate_strategies(config, devices))
        if not self.strategies:
            raise UserError(f"no strategy over {devices} devices fits the model's shapes: "
                            f"plan for another device count")
        self.resident = {s: resident_bytes(config, s, optimizer) for s in self.strategies}
        self._lines: dict[tuple[Strategy, int, str], tuple[int, int, int] | None] = {}
        # XLA's measured over the model's predicted micro-step bytes, where a plan was checked
        # (`plan_checked`), by (strategy, bucket length, remat policy); and those above 1 by
        # (strategy, bucket length), carried to the strategy's micro-steps not measured yet at
        # that length and longer: where the model under-counts a strategy's arrays it does so
        # under every remat policy, and more as rows grow (XLA:CPU's extra logits-sized array
        # appears from a length on), so one measurement spares a check of each.
        self.corrections: dict[tuple[Strategy, int, str], float] = {}
        self.under_counted: dict[tuple[Strategy, int], float] = {}
        self._time: dict[tuple[Strategy, int, str, int], MicroStepTime] = {}
        self._reductions: dict[tuple[Strategy, str], float] = {}
        self._pairs: dict[tuple, np.ndarray] = {}
        self._placed: dict[tuple, tuple[np.ndarray, float]] = {}
        self.fill, self._filled = fill, {}
        self._rows: dict[tuple, list[list[int]]] = {}

    @functools.cached_property
    def drawn(self) -> list[np.ndarray]:
        """The mini-batches `plan` prices a step on (`Fill.drawn`); none without a `fill`."""
        return self.fill.drawn() if self.fill is not None else []

    def packed(self, lengths: np.ndarray, low: int, high: int) -> list[list[int]]:
        """The sequences of `lengths` in the bucket (`low`, `high`], packed into rows as the
        trainer packs them (first-fit-decreasing): each row the indices of its sequences. A
        search packs the same bucket for every strategy it prices there."""
        key = (lengths.tobytes(), lengths.dtype.str, low, high)
        if key not in self._rows:
            members = [n for n in range(len(lengths)) if low < lengths[n] <= high]
            self._rows[key] = [[members[n] for n in row] for row in pack_buckets(
                [int(lengths[n]) for n in members], [high])[0]]
        return self._rows[key]

    def filled(self, low: int, high: int, rows: int) -> float:
        """Rows the run's mini-batches fill in the bucket (`low`, `high`], where the typical
        batch packs `rows`."""
        if self.fill is None:
            return rows
        if (low, high) not in self._filled:
            self._filled[low, high] = self.fill.rows(low, high)
        return self._filled[low, high]

    def micro_step(self, strategy: Strategy, max_len: int, home_bytes: int, rows: int,
                   filled: float | None = None) -> _MicroStep | None:
        """The quickest way to run `rows` rows of `max_len` under `strategy` beside
        `home_bytes` of home state: for each remat policy and gradient accumulation
        (`ACCUMULATE`), micro-steps of as many rows as fit and as the run's mini-batches fill
        (`filled` rows, default `rows`; the trainer's rule, `micro_units`), the pair whose
        micro-steps and bucket reduction take least in all."""
        best = None
        for remat, accumulate in itertools.product(REMAT_POLICIES, ACCUMULATE):
            line = self._memory_line(strategy, max_len, remat, accumulate)
            if line is None:
                continue
            shards, first, per_shard = line
            room = self.budget - home_bytes - first
            if room < 0:
                continue
            most = micro_units(rows if filled is None else filled, shards,
                               1 + int(room // max(per_shard, 1)))
            # A 1F1B pipeline runs a bucket's micro-steps in one schedule: the smallest
            # micro-batches may beat the largest (a smaller bubble).
            for blocks in {most, 1} if strategy.stages > 1 else (most,):
                found = self._micro_step_of(strategy, max_len, remat, accumulate, blocks * shards,
                                            first + (blocks - 1) * per_shard, rows)
                if best is None or found.seconds < best.seconds:
                    best = found
        return best

    def micro_step_as_run(self, strategy: Strategy, max_len: int, run: RunAs, rows: int
                          ) -> _MicroStep | None:
        """`rows` rows of `max_len` in micro-steps of `run.micro_rows` rows, whatever the
        budget (None where the rows cannot split as `strategy` needs)."""
        line = self._memory_line(strategy, max_len, run.remat, run.accumulate)
        if line is None:
            return None
        shards, first, per_shard = line
        units = max(run.micro_rows // shards, 1)
        return self._micro_step_of(strategy, max_len, run.remat, run.accumulate,
                                   run.micro_rows, first + (units - 1) * per_shard, rows)

    def _micro_step_of(self, strategy: Strategy, max_len: int, remat: str, accumulate: str,
                       micro_rows: int, peak_bytes: int, rows: int) -> _MicroStep:
        key = (strategy, max_len, remat, accumulate, micro_rows)
        if key not in self._time:
            config = dataclasses.replace(self.config, remat=remat)
            self._time[key] = micro_step_time(config, strategy, (micro_rows, max_len),
                                              self.profile, accumulate)
        reduction = (strategy, accumulate)
        if reduction not in self._reductions:
            self._reductions[reduction] = bucket_reduction_seconds(self.config, strategy,
                                                                   self.profile, accumulate)
        return _MicroStep(micro_rows, remat, accumulate, self._time[key],
                          self._reductions[reduction], peak_bytes, math.ceil(rows / micro_rows))

    def _memory_line(self, strategy: Strategy, max_len: int, remat: str, accumulate: str
                     ) -> tuple[int, int, int] | None:
        """(rows a micro-step takes at least, its peak bytes, bytes per such rows more): the
        memory model is affine in the rows. None where the rows cannot split as needed."""
        key = (strategy, max_len, remat, accumulate)
        if key not in self._lines:
            config = dataclasses.replace(self.config, remat=remat)
            shards = strategy.batch_shards
            ring = strategy.ring * (2 if strategy.balanced else 1)
            if max_len % ring:
                self._lines[key] = None
            else:
                one, two = (micro_step_memory(config, strategy, (k * shards, max_len),
                                              self.profile.platform, accumulate).peak
                             for k in (1, 2))
                scale = self._scale(strategy, max_len, remat)
                self._lines[key] = (shards, math.ceil(one * scale),
                                    math.ceil((two - one) * scale))
        return self._lines[key]

    def correct(self, choice: Choice, home_bytes: int, measured_bytes: int) -> None:
        """Scale the memory model of `choice`'s strategy, bucket and remat policy by what XLA
        measured of its micro-step (`measured_bytes`, beside `home_bytes` of home state)
        against what the model predicted, for the plans made from now on."""
        key = (choice.strategy, choice.max_len, choice.remat)
        ratio = (measured_bytes - home_bytes) / max(choice.peak_bytes - home_bytes, 1)
        margin = CORRECTION_MARGIN if measured_bytes > self.budget else 1.0
        self.corrections[key] = self._scale(*key) * ratio * margin
        at = (choice.strategy, choice.max_len)
        self.under_counted[at] = max(self.under_counted.get(at, 1.0), self.corrections[key])
        self._lines.clear()

    def _scale(self, strategy: Strategy, max_len: int, remat: str) -> float:
        """What the memory model's micro-step bytes are scaled by (`correct`)."""
        if (strategy, max_len, remat) in self.corrections:
            return self.corrections[strategy, max_len, remat]
        return max((scale for (s, length), scale in self.under_counted.items()
                    if s == strategy and length <= max_len), default=1.0)

    def near_budget(self, max_len: int) -> list[Choice]:
        """Micro-steps of one row per batch shard at `max_len`, each strategy beside its own
        home state under each remat policy, that the memory model puts over the budget by less
        than its error (NEAR_BUDGET) and that XLA has not measured (`correct`)."""
        found = []
        for strategy, remat in itertools.product(self.strategies, REMAT_POLICIES):
            line = self._memory_line(strategy, max_len, remat, ACCUMULATE[0])
            if line is None or (strategy, max_len, remat) in self.corrections:
                continue
            shards, first, _ = line
            peak = first + self.resident[strategy]
            if self.budget < peak <= self.budget * NEAR_BUDGET:
                found.append(Choice(0, max_len, strategy, shards, remat, 1, shards, 0, 0, 0.0,
                                    peak))
        return found

    def bucket(self, lengths: np.ndarray, rows: list[list[int]], low: int, max_len: int,
               strategy: Strategy, home_bytes: int, masked: bool = True,
               run: RunAs | None = None) -> Choice | None:
        """The bucket (`low`, `max_len`] of the typical batch under `strategy`: its quickest
        micro-steps, or those of `run` (the micro-steps a trainer has compiled)."""
        micro = (self.micro_step(strategy, max_len, home_bytes, len(rows),
                                 self.filled(low, max_len, len(rows))) if run is None
                 else self.micro_step_as_run(strategy, max_len, run, len(rows)))
        if micro is None:
            return None
        shares, imbalance = self._attention_shares(lengths, rows, max_len, strategy, micro.rows,
                                                   masked, micro.accumulate)
        seconds = micro.time.bucket_seconds(shares) + (micro.reduction if len(shares) else 0.0)
        return Choice(low, max_len, strategy, micro.rows, micro.remat, micro.steps, len(rows),
                      sum(len(r) for r in rows), int(sum(lengths[i] for r in rows for i in r)),
                      seconds, micro.peak_bytes + home_bytes, imbalance, micro.accumulate,
                      micro.reduction if len(shares) else 0.0)

    def _attention_shares(self, lengths: np.ndarray, rows: list[list[int]], max_len: int,
                          strategy: Strategy, micro_rows: int, masked: bool,
                          accumulate: str = "local") -> tuple[np.ndarray, float]:
        """Per micro-step, the attention pairs of the busiest device (data shard and ring
        rank) over those of rows that are one causal document each; and the busiest device's
        pairs over the mean device's, summed over the micro-steps. The rows are placed on data
        shards as the trainer places them. Data shards that meet only at the bucket's end
        (`independent_shards`) wait for the busiest one's total: each micro-step is priced at
        an even part of it (a ring's ranks still meet every micro-step)."""
        steps = math.ceil(len(rows) / micro_rows)
        context = strategy.ring
        block, skips = attention_kernel(self.config, self.profile.platform, max_len, context)
        if not rows:  # nothing of the bucket's lengths: no micro-step
            return np.ones(0), 1.0
        if not (masked and skips):
            return np.ones(steps), 1.0
        shards = math.prod(ways(strategy.activation_spec(("batch",)), strategy.axes))
        documents = tuple(tuple(int(lengths[i]) for i in row) for row in rows)
        key = (documents, max_len, context, strategy.balanced, block)
        if key not in self._pairs:
            self._pairs[key] = document_pairs(documents, max_len, context, strategy.balanced,
                                              block)
        pairs_RxC = self._pairs[key]
        per_bucket = independent_shards(strategy, accumulate)
        placed = (*key, micro_rows, shards, per_bucket)
        if placed not in self._placed:
            per_token, per_pair = training_flops(self.config)
            order = place(per_token * max_len + per_pair * pairs_RxC.sum(axis=1), micro_rows,
                          shards, per_token * max_len, per_bucket).order
            self._placed[placed] = (order, pairs_RxC.shape[1])
        order, ranks = self._placed[placed]
        slots_SxC = np.where((order == EMPTY)[:, None], 0.0, pairs_RxC[np.maximum(order, 0)])
        devices_MxDxC = slots_SxC.reshape(steps, shards, -1, ranks).sum(axis=2)
        if per_bucket:  # each shard's micro-steps, each at its busiest ring rank, in turn
            busiest_M = np.full(steps, devices_MxDxC.max(axis=2).sum(axis=0).max() / steps)
        else:
            busiest_M = devices_MxDxC.max(axis=(1, 2))
        whole = micro_rows // shards * visible_pairs(max_len, context, strategy.balanced, block)
        mean = devices_MxDxC.mean(axis=(1, 2)).sum()
        return busiest_M / whole, float(busiest_M.sum() / mean) if mean else 1.0

    def switch_seconds(self, source: Strategy, target: Strategy) -> float:
        """A weight switch's time (`hotjax.planning.cost.switch_seconds`; the planner's exact
        plan goes in the report)."""
        return switch_seconds(self.config, source, target, self.profile)


def boundaries(lengths: np.ndarray, context: int) -> list[int]:
    """Candidate bucket lengths: powers of two from MIN_BUCKET below the context, and it."""
    found = [1 << k for k in range(MIN_BUCKET.bit_length() - 1, context.bit_length())
             if (1 << k) < context]
    return [*found, context]


def plan_checked(search: Search, lengths: np.ndarray, context: int,
                 measured: Callable[[Choice, Strategy], int], max_buckets: int = 4,
                 progress: Callable[[str], None] = lambda line: None) -> Plan:
    """`plan`, every bucket of it then checked by `measured(choice, home)`: the per-device
    bytes of its compiled micro-step beside the home's state, by XLA's memory analysis, as
    the trainer checks them (`hotjax.planning.wall.xla_bytes`). Where a bucket exceeds the
    budget the memory model is corrected for it (`Search.correct`) and the plan made again,
    so that what is planned is what trains. Where the model finds no plan at all, the
    micro-steps at the context it puts just over the budget (`Search.near_budget`) are
    measured and the model corrected by them, either way, before the plan is made again.
    Each micro-step is measured once; the rounds stop when one measures nothing new.
    `progress` gets a line per micro-step measured."""
    seen: dict[tuple, int] = {}

    def check(choice: Choice, home: Strategy) -> int:
        key = (choice.strategy, choice.max_len, choice.micro_rows, choice.remat,
               choice.accumulate, home)
        if key not in seen:
            seen[key] = used = measured(choice, home)
            progress(f"checking the plan by XLA: {choice.strategy} at {choice.max_len} tokens, "
                     f"{choice.micro_rows} rows, remat {choice.remat}: {used / 2**20:,.1f} MiB "
                     f"(model {choice.peak_bytes / 2**20:,.1f}, budget "
                     f"{search.budget / 2**20:,.1f})")
        return seen[key]

    rounds = 0
    while rounds < CHECK_ROUNDS:
        rounds, known = rounds + 1, len(seen)
        try:
            found = plan(search, lengths, context, max_buckets)
        except NothingFits:
            near = search.near_budget(context)
            if not near:
                raise
            for choice in near:
                home_bytes = search.resident[choice.strategy]
                search.correct(choice, home_bytes, check(choice, choice.strategy))
            continue
        home_bytes = resident_bytes(search.config, found.home, search.optimizer)
        over = [(b, used) for b in found.buckets if b.rows
                and (used := check(b, found.home)) > search.budget]
        for choice, used in over:  # a choice's peak holds its plan's home state
            search.correct(choice, home_bytes, used)
        if not over:
            return found
        if len(seen) == known:  # the corrected model planned only what XLA measured before
            break
    raise UserError(f"no plan whose buckets fit {search.budget / 2**30:.2f} GiB per device by "
                    f"XLA's memory analysis after {rounds} corrections of the memory "
                    f"model: raise the memory budget, or name the strategies (--strategies "
                    f"TABLE.toml)")


def plan(search: Search, lengths: np.ndarray, context: int, max_buckets: int = 4,
         masked: bool = True) -> Plan:
    """The table for the typical batch `lengths`, of at most `max_buckets` buckets: the fastest
    where it is predicted more than MARGIN faster than the best single strategy, else that
    strategy alone (a smaller gain is within the cost model's error). The two are weighed on
    the search's drawn mini-batches where it has them (`Search.drawn`), else on the typical
    batch; `why` says which, and the plan carries its drawn steps' prices."""
    if lengths.max() > context:
        raise UserError(f"a sequence of {lengths.max()} tokens exceeds the context {context}: "
                        f"truncate or split the lengths first")
    table = _drawn(search, fastest(search, lengths, context, max_buckets, masked), masked)
    if len(table.buckets) == 1:
        return dataclasses.replace(table, why=f"one strategy, {table.buckets[0].strategy}: "
                                              f"no table of buckets is predicted faster")
    single = fastest(search, lengths, context, 1, masked, required=False)
    if single is None:
        return dataclasses.replace(table, why=f"a table of {len(table.buckets)} buckets: no "
                                              f"single strategy fits the budget")
    single = _drawn(search, single, masked)
    gain, alone = single.expected_seconds / table.expected_seconds, single.buckets[0].strategy
    on = (f"on {len(table.drawn_seconds)} drawn mini-batches" if table.drawn_seconds
          else "on the typical batch")
    if gain > MARGIN:
        return dataclasses.replace(table, why=f"a table of {len(table.buckets)} buckets: "
                                              f"predicted {gain:.3f}x the best single strategy "
                                              f"({alone}) {on}, past the cost model's error "
                                              f"({MARGIN:.2f}x)")
    return dataclasses.replace(single, why=f"one strategy, {alone}: the best table of buckets "
                                           f"is predicted only {gain:.3f}x as fast {on}, "
                                           f"within the cost model's error ({MARGIN:.2f}x)")


def _drawn(search: Search, found: Plan, masked: bool) -> Plan:
    """`found` with its step priced on each of the search's drawn mini-batches, its buckets'
    micro-steps as planned (none where the search has no drawn batches)."""
    table = [(b.max_len, b.strategy) for b in found.buckets]
    run = [b.run_as for b in found.buckets]
    priced = [fixed_table(search, batch, table, masked, run=run) for batch in search.drawn]
    if not priced or any(p is None for p in priced):
        return found
    return dataclasses.replace(found, drawn_seconds=tuple(p.seconds for p in priced))


def prediction_check(predicted_s: Sequence[float], measured_s: Sequence[float]) -> str | None:
    """One line where a run's first steps (`measured_s`, seconds each) are off what the cost
    model predicts for each one's own documents (`predicted_s`, one per step) by more than its
    error (MARGIN, either way; the median of the steps' ratios), else None. Each step is held
    to its own price, not to the typical step's the plan printed: at long contexts a
    mini-batch's few longest documents carry much of its attention (16K rows of a log-normal
    corpus on two CPU processes: the typical step priced 22.2 s, two steps of one run 26 and
    37 s, each within 10 % of its own price)."""
    ratio = float(np.median([m / p for m, p in zip(measured_s, predicted_s, strict=True)]))
    if 1 / MARGIN <= ratio <= MARGIN:
        return None
    return (f"--strategies auto: steps took {np.median(measured_s) * 1e3:,.1f} ms (median of "
            f"{len(measured_s)}), {ratio:.2f}x what the cost model predicts for their "
            f"documents ({np.median(predicted_s) * 1e3:,.1f} ms), past its error "
            f"({MARGIN:.2f}x): the plan may not be the fastest here; time a single --strategy "
            f"against it")


def fastest(search: Search, lengths: np.ndarray, context: int, max_buckets: int,
            masked: bool = True, required: bool = True) -> Plan | None:
    """The fastest table for the typical batch `lengths`, of at most `max_buckets` buckets
    (None, or with `required` one line, where nothing fits the budget)."""
    cuts = boundaries(lengths, context)
    homes = sorted(set(search.resident.values()))
    best: Plan | None = None
    for home_bytes in homes:
        found = _best_for_home(search, lengths, cuts, home_bytes, max_buckets, masked)
        if found is not None and (best is None or found.seconds < best.seconds):
            best = found
    if best is None and required:
        raise NothingFits(f"no strategy over {search.devices} devices fits "
                        f"{search.budget / 2**30:.1f} GiB per device for rows of {context} "
                        f"tokens: raise the memory budget, or plan for more devices")
    return best


def _best_for_home(search: Search, lengths: np.ndarray, cuts: list[int], home_bytes: int,
                   max_buckets: int, masked: bool) -> Plan | None:
    """The best table whose most sharded strategy holds `home_bytes` of state: every bucket's
    strategy holds at least that much, and one holds exactly that (the home). The program
    weighs the buckets' micro-steps; the switches, milliseconds beside a step's seconds at
    these sizes, are added to the tables it finds."""
    # reach[e][(buckets used, whether the home is among them)]: the cheapest buckets covering
    # lengths up to cuts[e - 1] (reach[0]: nothing yet), as (seconds, choices).
    reach: list[dict[tuple[int, bool], tuple[float, tuple[Choice, ...]]]] = [
        {(0, False): (0.0, ())}, *({} for _ in cuts)]
    for end, high in enumerate(cuts, 1):
        for begin in range(end):
            low = cuts[begin - 1] if begin else 0
            rows = search.packed(lengths, low, high)
            if not reach[begin] or (not rows and end < len(cuts)):
                continue
            choices = [c for s in search.strategies if search.resident[s] >= home_bytes
                       and (c := search.bucket(lengths, rows, low, high, s, home_bytes, masked))]
            fastest = min(choices, key=lambda c: c.seconds, default=None)
            homes = [c for c in choices if search.resident[c.strategy] == home_bytes]
            at_home = min(homes, key=lambda c: c.seconds, default=None)
            for (used, has_home), (seconds, chosen) in list(reach[begin].items()):
                if used == max_buckets:
                    continue
                for choice in (fastest, at_home):
                    if choice is None:
                        continue
                    key = (used + 1, has_home or choice is at_home)
                    total = seconds + choice.seconds
                    if key not in reach[end] or total < reach[end][key][0]:
                        reach[end][key] = (total, (*chosen, choice))
    tables = [chosen for (_, has_home), (_, chosen) in reach[-1].items() if has_home]
    if not tables:
        return None
    return min((_as_plan(search, chosen) for chosen in tables), key=lambda p: p.seconds)


def _as_plan(search: Search, chosen: Sequence[Choice]) -> Plan:
    """Buckets with their switches: the weights from home through each bucket in turn, and
    each bucket's fp32 gradients home (in the reverse direction, twice the bytes of bf16;
    a `local` bucket's arrays that its reduction cannot scatter into the home's layout are
    all-reduced instead: `reduction_home_seconds`)."""
    home = most_sharded([c.strategy for c in chosen], search.config, search.optimizer)
    widen = 4 / search.config.dtype.itemsize
    weights, gradients, previous = [], [], home
    for c in chosen:
        weights.append(search.switch_seconds(previous, c.strategy) if c.rows else 0.0)
        gradients.append(widen * search.switch_seconds(c.strategy, home)
                         + reduction_home_seconds(search.config, c.strategy, home,
                                                  search.profile, c.accumulate)
                         if c.rows else 0.0)
        previous = c.strategy if c.rows else previous
    return Plan(tuple(chosen), home, tuple(weights), tuple(gradients))


def fixed_table(search: Search, lengths: np.ndarray, table: Sequence[tuple[int, Strategy]],
                masked: bool = True, packed: bool = True, padded: bool = False,
                run: Sequence[RunAs] | None = None) -> Plan | None:
    """A given table's predicted step (None if a bucket does not fit): (max_len, strategy)
    pairs by increasing length. Rows are packed first-fit-decreasing, or with `packed=False`
    filled end to end (sequences concatenated and cut at the row length), or with `padded`
    one sequence per row. Its strategies need not be among the search's candidates. `run`,
    one per bucket: price the micro-steps a trainer has compiled instead of the quickest
    that fit."""
    home_bytes = min(resident_bytes(search.config, s, search.optimizer) for _, s in table)
    choices, low = [], 0
    for i, (high, strategy) in enumerate(table):
        members = [n for n in range(len(lengths)) if low < lengths[n] <= high]
        if padded:
            rows = [[n] for n in members]
        elif packed:
            rows = search.packed(lengths, low, high)
        else:
            tokens = sum(int(lengths[n]) for n in members)
            rows = [[] for _ in range(math.ceil(tokens / high))]
        choice = search.bucket(lengths, rows, low, high, strategy, home_bytes, masked,
                               None if run is None else run[i])
        if choice is None:
            return None
        choices.append(choice)
        low = high
    return _as_plan(search, choices)


def baselines(search: Search, lengths: np.ndarray, context: int) -> dict[str, Plan | None]:
    """The best single strategy with document-masked packing (every sequence packed into rows
    of the context), and the same strategy's step on concatenated sequences without masking
    (full causal attention over every row), as Megatron-LM trains."""
    whole = [(context, s) for s in search.strategies]
    found = [p for t in whole if (p := fixed_table(search, lengths, [t])) is not None]
    if not found:
        return {}
    best = min(found, key=lambda p: p.seconds)
    table = [(context, best.buckets[0].strategy)]
    return {"best single strategy, document-masked packing": best,
            "the same, concatenated without masking (Megatron-LM)": fixed_table(
                search, lengths, table, masked=False, packed=False)}
