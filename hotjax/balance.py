"""Work balance across data shards: where a bucket's packed rows run, so that every data shard of
every micro-step has about the same work.

A bucket's rows all have the same length, so their matmuls cost the same; their attention does
not. The blockwise kernel computes only the block pairs something in them can see
(`hotjax.models.attention.visible_blocks`): a row holding one 8K document computes the whole causal
triangle, a row of sixteen 512-token documents a sixteenth of it. Cut in order into micro-batches
and split over data shards by position, one shard can draw the long documents and the other the
short ones, and every micro-step waits for the slower (WLB-LLM, OSDI'25, measured an imbalance
of 1.44 on 7B at 128K with ordinary packing).

`place` keeps the rows and changes only where they run: rows sorted by estimated work are cut
into micro-steps of similar rows (the heaviest together, the padding rows with the lightest),
and within a micro-step each row goes to the least loaded shard that has room — longest
processing time first. The loss is a sum over positions, so it does not change.

The imbalance of a placement is the time the shards' synchronised micro-steps take against a
perfectly even split: the sum over micro-steps of the busiest shard's work, over the sum of
the mean shard's (1.0: even). Where one row outweighs the rest (one long document among short
ones), no placement reaches 1.0 and the metrics say so.

Shards need not meet every micro-step. Where a bucket accumulates each data shard's gradients
apart and nothing else is split over the shards (`hotjax.sharding.strategy.independent_shards`: data
parallelism, with tensor, context or pipeline parallelism inside each shard), they exchange
nothing until the bucket's one gradient reduction, and each device runs its micro-steps as
fast as it can. Then only each shard's total over the bucket counts, and placement balances
those totals: heaviest row first to the shard with the least work so far, which has freedom
even with one row per shard per micro-step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hotjax.models.attention import Tokens, block_edge, visible_blocks
from hotjax.models.llama import LlamaConfig
from hotjax.models.work import attention_kernel, training_flops

EMPTY = -1  # a padding row's slot in a placement: no row of the batch


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a bucket's rows run: `order[k]` is the row in slot k (`EMPTY`: a padding row) of
    micro-steps of `micro_rows` rows, each cut over `shards` data shards by position."""

    order: np.ndarray
    before: float  # imbalance in row order
    after: float  # imbalance in `order`
    mean_work: float  # the mean shard's estimated FLOPs, summed over micro-steps


def row_work(segment_ids_BxT: np.ndarray, positions_BxT: np.ndarray, config: LlamaConfig,
             platform: str, seq_shards: int = 1) -> np.ndarray:
    """[B] estimated FLOPs of each row's training micro-step: the matmuls by tokens (every
    slot is computed, padding included) and attention by the block pairs the kernel that runs
    on `platform` computes (`hotjax.models.work.attention_kernel`; rows split into `seq_shards`
    chunks): both the blockwise kernel and the packed-attention Pallas kernel on GPU skip the
    blocks no document spans."""
    B, T = segment_ids_BxT.shape
    block, skips_documents = attention_kernel(config, platform, T, seq_shards)
    edge = block_edge(T // seq_shards, block)
    columns = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    if not skips_documents:  # a kernel skipping only above the diagonal: the whole triangle
        segment_ids_BxT, positions_BxT = np.ones_like(segment_ids_BxT), columns
    tokens = Tokens(segment_ids_BxT, positions_BxT, columns)
    blocks_B = visible_blocks(tokens, tokens, edge, edge).sum(axis=(1, 2))
    per_token, per_pair = training_flops(config)
    return per_token * T + per_pair * edge * edge * blocks_B.astype(np.float64)


def imbalance(work_S: np.ndarray, micro_rows: int, shards: int, per_bucket: bool = False
              ) -> float:
    """The busiest shard's work over the mean shard's, for slots of `work_S` in order (a
    multiple of `micro_rows`) cut over `shards` shards: summed over micro-steps of the
    busiest of each (shards that meet every micro-step), or with `per_bucket` the busiest
    shard's total over the bucket (shards that meet once, at its end)."""
    per_shard_MxK = work_S.reshape(-1, shards, micro_rows // shards).sum(axis=-1)
    mean = per_shard_MxK.mean(axis=1).sum()
    busiest = per_shard_MxK.sum(axis=0).max() if per_bucket else per_shard_MxK.max(axis=1).sum()
    return float(busiest / mean) if mean else 1.0


def place(work_R: np.ndarray, micro_rows: int, shards: int, pad_work: float = 0.0,
          per_bucket: bool = False) -> Placement:
    """A placement of rows of estimated `work_R` in micro-steps of `micro_rows` rows over
    `shards` data shards (padding rows, added to fill the last micro-step, cost `pad_work`).
    Shards that meet every micro-step: micro-steps of similar rows, each row to its
    micro-step's least loaded shard with room. With `per_bucket` (shards that meet only at
    the bucket's end, `hotjax.sharding.strategy.independent_shards`): each row, heaviest first, to
    the shard with the least work so far over the whole bucket that has room, each shard's
    rows then in its slots of the micro-steps in turn."""
    rows = len(work_R)
    slots = rows + (-rows % micro_rows)
    padded = np.concatenate([work_R, np.full(slots - rows, pad_work)])
    in_order = np.concatenate([np.arange(rows), np.full(slots - rows, EMPTY)])
    before = imbalance(padded, micro_rows, shards, per_bucket)
    mean_work = float(padded.sum() / shards)
    per_shard = micro_rows // shards
    if shards == 1:
        return Placement(in_order, before, before, mean_work)
    heaviest = np.argsort(-padded, kind="stable")
    order = np.empty(slots, dtype=np.int64)
    groups = [heaviest] if per_bucket else [heaviest[start:start + micro_rows]
                                            for start in range(0, slots, micro_rows)]
    room = slots // shards if per_bucket else per_shard
    for g, group in enumerate(groups):
        load, filled = np.zeros(shards), np.zeros(shards, dtype=np.int64)
        for slot in group:
            shard = min((s for s in range(shards) if filled[s] < room), key=lambda s: load[s])
            k = filled[shard]  # the shard's k-th row: micro-step k // per_shard with per_bucket
            step, within = (k // per_shard, k % per_shard) if per_bucket else (g, k)
            order[step * micro_rows + shard * per_shard + within] = in_order[slot]
            load[shard] += padded[slot]
            filled[shard] += 1
    after = imbalance(np.where(order == EMPTY, pad_work, padded[np.maximum(order, 0)]),
                      micro_rows, shards, per_bucket)
    if after > before:  # LPT is a heuristic: never worse than the rows as they came
        return Placement(in_order, before, before, mean_work)
    return Placement(order, before, after, mean_work)
