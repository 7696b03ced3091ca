"""XLA's memory analysis for planning: a declared memory wall, and the check of a plan.

A memory wall is the per-device budget under which the longest rows of a run fit no strategy
that keeps them whole, while some strategy that splits them along the sequence fits.

HotSPa's premise is such a wall: LLaMA2-7B's 32K-token rows fit no 80 GB A800 whole, so a
static strategy must split every row over context or sequence parallelism, and the short
majority pays for it. A machine with room to spare (a CPU host) has no wall; a benchmark that
should measure what hot switching wins declares one with `--device-memory`, which the trainer
enforces as always, by XLA's memory analysis of each compiled micro-step beside the home state.

The wall is found the same way: for every candidate strategy over the devices
(`hotjax.planning.search.candidate_strategies`), every remat policy and both gradient
accumulations (the trainer tries them all), XLA's peak of a micro-step of one row per batch
shard at the row length, plus the strategy's resident state as its own home
(`hotjax.sharding.report.resident_bytes`). Strategies whose residual stream and attention keep rows
whole (data, FSDP/ZeRO, Megatron without sequence parallelism, pipelines) set the ceiling:
the budget lies below the least of their peaks, halfway down to the least peak of a strategy
that splits rows (a context ring, sequence parallelism).

The planner's memory model is calibrated within about 10 % at LLaMA2-7B widths; near a wall,
or on a small model whose fixed costs it does not count, that is not enough. `xla_bytes`
checks a plan's buckets as the trainer will (`hotjax.planning.search.plan_checked`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax

from hotjax.choices import REMAT_POLICIES
from hotjax.errors import UserError
from hotjax.models.llama import LlamaConfig
from hotjax.models.optimizers import ADAMW, Optimizer
from hotjax.sharding.report import resident_bytes
from hotjax.sharding.strategy import ACCUMULATE, Strategy, partial_axes, ways
from hotjax.step import bucket_step

if TYPE_CHECKING:
    from hotjax.planning.search import Choice


@dataclasses.dataclass(frozen=True)
class Fit:
    """A strategy's least per-device bytes for one row per batch shard, its own home state
    included, and the remat policy and accumulation that reach it."""

    strategy: Strategy
    whole_rows: bool
    peak_bytes: int
    remat: str
    accumulate: str


@dataclasses.dataclass(frozen=True)
class Wall:
    budget_bytes: int
    row_length: int
    fits: tuple[Fit, ...]  # least peak first

    @property
    def ceiling(self) -> Fit:
        """The whole-row strategy that needs least: the budget lies below it."""
        return min((f for f in self.fits if f.whole_rows), key=lambda f: f.peak_bytes)

    @property
    def floor(self) -> Fit:
        """The row-splitting strategy that needs least: the budget lies above it."""
        return min((f for f in self.fits if not f.whole_rows), key=lambda f: f.peak_bytes)


def keeps_whole_rows(strategy: Strategy) -> bool:
    """Whether every device holds whole rows: the residual stream and attention's sequence
    unsplit (no context ring, no sequence parallelism)."""
    seq = ways(strategy.activation_spec((None, "seq")), strategy.axes)
    return strategy.ring == 1 and math.prod(seq) == 1


def least_peak(config: LlamaConfig, strategy: Strategy, row_length: int,
               devices: Sequence[jax.Device]) -> Fit:
    """`strategy`'s least bytes per device for one row of `row_length` per batch shard."""
    best = None
    accumulations = ACCUMULATE if partial_axes(strategy) else ACCUMULATE[:1]
    for policy in REMAT_POLICIES:
        for accumulate in accumulations:
            bucket = bucket_step(dataclasses.replace(config, remat=policy), strategy,
                                 tuple(devices), accumulate)
            peak = bucket.peak_bytes((bucket.layout.batch_shards, row_length)) + \
                resident_bytes(config, strategy)
            if best is None or peak < best.peak_bytes:
                best = Fit(strategy, keeps_whole_rows(strategy), peak, policy, accumulate)
    return best


def memory_wall(config: LlamaConfig, row_length: int, devices: Sequence[jax.Device],
                strategies: Sequence[Strategy] | None = None,
                progress: Callable[[str], None] = lambda line: None) -> Wall:
    """The budget between the least peak of the strategies that keep rows of `row_length`
    whole and the least of those that split them (`strategies`: default, every candidate over
    `devices`)."""
    from hotjax.planning.search import candidate_strategies

    strategies = strategies or candidate_strategies(config, len(devices))
    fits = []
    for strategy in strategies:
        progress(f"memory wall: compiling {strategy} at {row_length} tokens per row")
        fits.append(least_peak(config, strategy, row_length, devices))
    fits.sort(key=lambda f: f.peak_bytes)
    whole = [f for f in fits if f.whole_rows]
    split = [f for f in fits if not f.whole_rows]
    if not whole or not split:
        raise UserError(f"no memory wall over {len(devices)} devices: it needs strategies that "
                        f"keep rows whole and strategies that split them: use at least 2 "
                        f"devices")
    if split[0].peak_bytes >= whole[0].peak_bytes:
        raise UserError(f"no memory wall at {row_length} tokens per row: {whole[0].strategy} "
                        f"keeps them whole in {whole[0].peak_bytes / 2**20:,.0f} MiB, no more "
                        f"than {split[0].strategy} splitting them needs "
                        f"({split[0].peak_bytes / 2**20:,.0f} MiB): use longer rows or a wider "
                        f"model")
    budget = (whole[0].peak_bytes + split[0].peak_bytes) // 2
    return Wall(budget, row_length, tuple(fits))


def xla_bytes(config: LlamaConfig, devices: Sequence[jax.Device], optimizer: Optimizer = ADAMW
              ) -> Callable[[Choice, Strategy], int]:
    """What `hotjax.planning.search.plan_checked` checks a planned bucket by: its compiled
    micro-step's per-device peak (XLA's memory analysis) beside the home's resident state, as
    the trainer checks it before it trains."""
    def measured(choice: Choice, home: Strategy) -> int:
        bucket = bucket_step(dataclasses.replace(config, remat=choice.remat), choice.strategy,
                             tuple(devices))
        return bucket.peak_bytes((choice.micro_rows, choice.max_len)) + resident_bytes(
            config, home, optimizer)

    return measured
