"""Pipeline parallelism in SPMD form (GPipe): the stacked layers split into S stages, a step's
rows into M micro-batches, and all stages at work at once.

The layers `[L, ...]` are viewed as `[S, L/S, ...]`, their leading axis split over the mesh's
`stage` axis, so each stage's devices hold a contiguous block of L/S layers. A buffer
`[S, rows, T, D]` holds the micro-batch each stage works on. Each of the M + S - 1 iterations of
a `lax.scan` shifts the buffer one stage down (stage 0 takes the next micro-batch; XLA turns the
shift into a collective permute between neighbouring stages), runs every stage on its slot (a
`vmap` over stages, `spmd_axis_name="stage"`, so each stage's devices compute only their own),
and collects the micro-batch the last stage finished. In the first and last S - 1 iterations
some stages work on nothing that reaches the output: the bubble, (S - 1) / (M + S - 1) of the
stage-iterations. The backward pass is the scan's own, run in reverse. What a stage keeps for
it follows the layers' remat policy: every iteration's activations as the policy saves them, or
under `remat_stages` (the "full" policy) only each iteration's stage input, the stage's layers
recomputed in the backward pass.

After the pipeline every stage group holds its output; the model then gives each group a share
of the rows for the final norm, LM head and loss (`Placement.across_stages`), so that work is
done once per row rather than once per stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array


def bubble(stages: int, microbatches: int) -> float:
    """The share of stage-iterations that compute nothing useful."""
    return (stages - 1) / (microbatches + stages - 1)


def gpipe(block: Callable[[Array, Any, Any], Array], x_BxTxD: Array, stacked: Any, rows: Any,
          stages: int, microbatches: int, constrain: Callable[[Array, tuple], Array],
          remat_stages: bool = False) -> Array:
    """`block(x, layer weights, rows)` applied for every layer of `stacked` (leading axis L),
    as a pipeline of `stages` stages over `microbatches` micro-batches. `rows` is a tree of
    per-row arrays [B, T, ...] (segment ids, positions, rotary tables) each block reads.
    `remat_stages`: keep only each stage's input per iteration and recompute its layers."""
    S, M = stages, microbatches
    B = x_BxTxD.shape[0]

    def split(a: Array) -> Array:
        # Micro-batch m holds rows m, m + M, m + 2M, ...: each data shard's rows stay on it.
        return a.reshape(B // M, M, *a.shape[1:]).swapaxes(0, 1)

    inputs_MxBxTxD = split(x_BxTxD)
    rows_M = jax.tree.map(split, rows)
    staged = jax.tree.map(lambda w: w.reshape(S, w.shape[0] // S, *w.shape[1:]), stacked)

    def stage(layers: Any, x: Array, stage_rows: Any) -> Array:
        return jax.lax.scan(lambda x, w: (block(x, w, stage_rows), None), x, layers)[0]

    if remat_stages:
        stage = jax.checkpoint(stage, prevent_cse=False)
    all_stages = jax.vmap(stage, spmd_axis_name="stage")
    stage_index_S = jnp.arange(S)

    def on_stages(a: Array) -> Array:
        return constrain(a, ("stages", "batch", "seq", *(None,) * (a.ndim - 3)))

    def iteration(carry: tuple[Array, Array], i: Array) -> tuple[tuple[Array, Array], None]:
        state_SxBxTxD, outputs_MxBxTxD = carry
        shifted = jnp.roll(state_SxBxTxD, 1, axis=0)
        shifted = on_stages(shifted.at[0].set(inputs_MxBxTxD[jnp.minimum(i, M - 1)]))
        # Stage s works on micro-batch i - s (clipped: outside 0..M-1 it is bubble).
        current_S = jnp.clip(i - stage_index_S, 0, M - 1)
        stage_rows = jax.tree.map(lambda r: on_stages(r[current_S]), rows_M)
        state_SxBxTxD = on_stages(all_stages(staged, shifted, stage_rows))
        done = i - (S - 1)  # the micro-batch the last stage finished, if any
        slot = jnp.clip(done, 0, M - 1)
        finished = jnp.where(done >= 0, state_SxBxTxD[S - 1], outputs_MxBxTxD[slot])
        return (state_SxBxTxD, outputs_MxBxTxD.at[slot].set(finished)), None

    start = (on_stages(jnp.zeros((S, *inputs_MxBxTxD.shape[1:]), x_BxTxD.dtype)),
             jnp.zeros_like(inputs_MxBxTxD))
    (_, outputs_MxBxTxD), _ = jax.lax.scan(iteration, start, jnp.arange(M + S - 1))
    return outputs_MxBxTxD.swapaxes(0, 1).reshape(x_BxTxD.shape)
