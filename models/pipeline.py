"""Pipeline parallelism in SPMD form: the stacked layers split into S stages, a micro-step's rows
into M micro-batches, all stages at work at once. Two schedules (`SCHEDULES`): 1F1B, the
default, and GPipe, kept for comparison.

The layers `[L, ...]` are viewed as `[S, L/S, ...]`, their leading axis split over the mesh's
`stage` axis, so each stage's devices hold a contiguous block of L/S layers. Each tick runs
every stage on its own slot of a buffer `[S, rows, T, D]` (a `vmap` over stages,
`spmd_axis_name="stage"`, so each stage's devices compute only their own) and then shifts the
buffer one stage on (a collective permute between neighbouring stages).

GPipe (`gpipe`): a `lax.scan` of M + S - 1 forward ticks, the backward pass being the scan's own
in reverse; a stage keeps what its layers' remat policy saves for every tick (under remat
"full", `remat_stages`, each tick's stage input, the stage recomputed).

1F1B (`one_f_one_b`): the forward and the backward interleaved in one schedule, each stage's
backward taken explicitly (`jax.vjp`). Stage s runs micro-batch m forward at tick m + s and
backward at tick m + 2S - 2 - s; the first stage embeds its micro-batch, and the last runs the
final norm, the LM head and the loss on its micro-batch between the two (rows, or tokens,
shared by all stage groups), so its backward starts in the same tick. S - 1 forward-only ticks,
one tick of both per micro-batch run, S - 1 backward-only ticks: the same (M + S - 1)(F + B) as
GPipe for M micro-batches, and the same bubble, but a stage holds the residuals of at most
2S - 1 micro-batches in flight (ring slots in the loop's carry) rather than all M + S - 1
ticks', and nothing per micro-batch beyond its int32 rows. So the trainer runs a whole bucket
(every micro-step's micro-batches) as one schedule, and the number run is a traced count
(`filled_microbatches`): the micro-batches past the last holding a token cost no tick. What a
residual is follows the layers' remat policy, as in GPipe (under "full", the stage input; the
stage recomputed in its backward). The weights a stage's backward reads are not copied into the
slots: they are the stage's own, passed again. The weight gradients are summed in fp32; each
stage group keeps its own sums of the head's (and of the loss), all-reduced once after the
schedule rather than in every tick that runs the head (a V x D all-reduce a micro-batch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array
# (head weights, x [B, T, D], targets [B, T]) -> (loss sum, target count)
Head = Callable[[Any, Array, Array], tuple[Array, Array]]
# (embedding weights, tokens [B, T]) -> x [B, T, D]
Embed = Callable[[Array, Array], Array]
SCHEDULES = ("1f1b", "gpipe")


def bubble(stages: int, microbatches: int) -> float:
    """The share of stage-ticks that compute nothing useful (either schedule)."""
    return (stages - 1) / (microbatches + stages - 1)


def in_flight(stages: int, microbatches: int, schedule: str = "1f1b") -> int:
    """Micro-batches' residuals a stage holds at once: 1F1B's ring slots, or GPipe's ticks."""
    return 2 * stages - 1 if schedule == "1f1b" else microbatches + stages - 1


def _micro_batches(a: Array, microbatches: int) -> Array:
    """[B, ...] as [M, B/M, ...]: micro-batch m holds rows m, m + M, m + 2M, ..., so each data
    shard's rows stay on it."""
    return a.reshape(a.shape[0] // microbatches, microbatches, *a.shape[1:]).swapaxes(0, 1)


def _rows_back(a_MxB: Array) -> Array:
    return a_MxB.swapaxes(0, 1).reshape(-1, *a_MxB.shape[2:])


def _staged(stacked: Any, stages: int) -> Any:
    return jax.tree.map(lambda w: w.reshape(stages, w.shape[0] // stages, *w.shape[1:]), stacked)


def gpipe(block: Callable[[Array, Any, Any], Array], x_BxTxD: Array, stacked: Any, rows: Any,
          stages: int, microbatches: int, constrain: Callable[[Array, tuple], Array],
          remat_stages: bool = False) -> Array:
    """`block(x, layer weights, rows)` applied for every layer of `stacked` (leading axis L),
    as a pipeline of `stages` stages over `microbatches` micro-batches. `rows` is a tree of
    per-row arrays [B, T, ...] (segment ids, positions, rotary tables) each block reads.
    `remat_stages`: keep only each stage's input per tick and recompute its layers."""
    S, M = stages, microbatches
    inputs_MxBxTxD = _micro_batches(x_BxTxD, M)
    rows_M = jax.tree.map(lambda r: _micro_batches(r, M), rows)
    staged = _staged(stacked, S)

    stage = _stage(block, remat_stages)
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
    return _rows_back(outputs_MxBxTxD)


def _stage(block: Callable[[Array, Any, Any], Array], remat_stages: bool
           ) -> Callable[[Any, Array, Any], Array]:
    """One stage: `block` over its layers (recomputed in the backward under `remat_stages`)."""
    def stage(layers: Any, x: Array, stage_rows: Any) -> Array:
        return jax.lax.scan(lambda x, w: (block(x, w, stage_rows), None), x, layers)[0]

    return jax.checkpoint(stage, prevent_cse=False) if remat_stages else stage


class _Carry(NamedTuple):
    sent: Array  # [S, rows, T, D]: each stage's last forward output, for the next stage
    returned: Array  # [S, rows, T, D]: each stage's last input gradient, for the one before
    slots: list[Array]  # [S, 2S - 1, ...]: the residuals of the micro-batches in flight
    d_staged: Any  # [S, L/S, ...]: the stages' weight gradients (fp32 sums)
    d_head: Any
    d_embed: Array  # [V, D]: the embedding's gradient (fp32 sum)
    total: Array
    count: Array


def filled_microbatches(segment_ids_BxT: Array, microbatches: int) -> Array:
    """How many of the `microbatches` micro-batches of these rows (`_micro_batches`) the
    schedule must run: up to the last that holds a token (rows past it are empty)."""
    holds_M = jnp.any(_micro_batches(segment_ids_BxT, microbatches) > 0,
                      axis=tuple(range(1, segment_ids_BxT.ndim + 1)))
    return jnp.max(jnp.where(holds_M, jnp.arange(1, microbatches + 1), 0))


def one_f_one_b(block: Callable[[Array, Any, Any], Array], head: Head, embed: Embed,
                prepare: Callable[[Any], Any], stacked: Any, head_params: Any,
                embed_params: Array, rows: dict[str, Array], stages: int, microbatches: int,
                constrain: Callable[[Array, tuple], Array], seed: Array, filled: Array,
                row_shards: int = 1, remat_stages: bool = False
                ) -> tuple[tuple[Array, Array], Any, Any, Array]:
    """The 1F1B schedule (module docstring) over `microbatches` micro-batches of `rows`
    (`tokens`, `targets` and what `prepare` turns into the rows each block reads), of which the
    first `filled` (a traced count) run: `embed(embed_params, tokens)` into the first stage,
    `block` over `stacked`'s layers, then `head(head params, x, targets)`, a loss sum and a
    target count (its work is per token), shared by the stage groups (`head_cut`: the rows
    of a micro-batch lie in `row_shards` blocks, one a data shard). Returns the loss sum and
    count over the filled micro-batches, and the fp32 gradients of `seed` times the loss sum
    for `stacked`, `head_params` and `embed_params`."""
    S, M = stages, microbatches
    slots = in_flight(S, M)
    rows_M = jax.tree.map(lambda r: _micro_batches(r, M), rows)
    staged = _staged(stacked, S)
    run_stage = _stage(block, remat_stages)
    stage_S = jnp.arange(S)
    pullback: dict[str, Any] = {}  # how a stage's backward rebuilds its pullback (static)

    def on_stages(a: Array) -> Array:
        return constrain(a, ("stages", "batch", "seq", *(None,) * (a.ndim - 3)))

    def forward(w: Any, x: Array, r: Any) -> tuple[Array, list[Array]]:
        y, pull = jax.vjp(lambda w, x: run_stage(w, x, r), w, x)
        leaves, pullback["tree"] = jax.tree.flatten(pull)
        shared = jax.tree.leaves((w, r))
        # The weights and rows it reads are passed again to the backward, not kept per slot.
        pullback["shared"] = tuple(next((i for i, s in enumerate(shared) if leaf is s), -1)
                                   for leaf in leaves)
        return y, [leaf for leaf, i in zip(leaves, pullback["shared"], strict=True) if i < 0]

    def backward(w: Any, r: Any, kept: list[Array], g: Array) -> tuple[Any, Array]:
        shared, kept = jax.tree.leaves((w, r)), iter(kept)
        leaves = [shared[i] if i >= 0 else next(kept) for i in pullback["shared"]]
        return jax.tree.unflatten(pullback["tree"], leaves)(g)

    forward_S = jax.vmap(forward, spmd_axis_name="stage")
    backward_S = jax.vmap(backward, spmd_axis_name="stage")
    read_S = jax.vmap(lambda ring, slot: ring[slot], spmd_axis_name="stage")
    prepare_S = jax.vmap(prepare, spmd_axis_name="stage")

    def of_stages(micro_S: Array) -> Any:  # the rows each stage's blocks read
        picked = {k: on_stages(rows_M[k][jnp.clip(micro_S, 0, M - 1)])
                  for k in rows_M if k not in ("tokens", "targets")}
        return prepare_S(picked)

    def add(total: Any, part: Any, valid: Array | bool = True) -> Any:
        return jax.tree.map(lambda a, g: a + jnp.where(valid, g, 0).astype(jnp.float32),
                            total, part)

    def tick(t: Array, c: _Carry, forwards: bool, backwards: bool) -> _Carry:
        returned_S = jnp.zeros_like(c.returned)
        if forwards:  # stage s runs micro-batch t - s forward; the first embeds it
            x_S = on_stages(jnp.roll(c.sent, 1, axis=0).at[0].set(
                embed(embed_params, rows_M["tokens"][jnp.minimum(t, M - 1)])))
            sent, kept = forward_S(staged, x_S, of_stages(t - stage_S))
            c = c._replace(sent=on_stages(sent), slots=[
                ring.at[:, t % slots].set(k) for ring, k in zip(c.slots, kept, strict=True)])
        if forwards and backwards:  # the last stage's micro-batch through the head and loss
            last = t - (S - 1)
            totals, pull, counts = jax.vjp(
                lambda p, y: head_S(p, y, rows_M["targets"][last]), head_params_S,
                c.sent[S - 1], has_aux=True)
            d_head, dy = pull(jnp.broadcast_to(seed, totals.shape).astype(totals.dtype))
            returned_S = returned_S.at[S - 1].set(dy)
            c = c._replace(d_head=add(c.d_head, d_head), total=c.total + totals,
                           count=c.count + counts)
        if backwards:  # stage s runs micro-batch t - 2S + 2 + s backward
            micro_S = t - (2 * S - 2) + stage_S
            g_S = on_stages(jnp.where((stage_S == S - 1)[:, None, None, None], returned_S,
                                      jnp.roll(c.returned, -1, axis=0)))
            kept = [read_S(ring, (micro_S + stage_S) % slots) for ring in c.slots]
            d_w, d_x = backward_S(staged, of_stages(micro_S), kept, g_S)
            valid_S = (micro_S >= 0) & (micro_S < filled)
            first = jnp.clip(micro_S[0], 0, M - 1)
            _, pull_embed = jax.vjp(lambda e: embed(e, rows_M["tokens"][first]), embed_params)
            c = c._replace(
                returned=on_stages(d_x),
                d_staged=jax.tree.map(lambda a, g: a + jnp.where(
                    valid_S.reshape(S, *(1,) * (g.ndim - 1)), g, 0).astype(jnp.float32),
                    c.d_staged, d_w),
                d_embed=add(c.d_embed, pull_embed(d_x[0])[0], valid_S[0]))
        return c

    # The head's work shared by the stage groups (`_shared_head`), each keeping its own sums of
    # the head's weight gradients, the loss and the count: reduced once after the schedule,
    # not in every tick that runs the head.
    cut = head_cut(*rows_M["targets"].shape[1:], S, row_shards)
    pieces = 1 if cut is None else S
    head_S = _shared_head(head, cut, S, row_shards)
    head_params_S = jax.tree.map(lambda w: jnp.broadcast_to(w, (pieces, *w.shape)), head_params)
    x_S = on_stages(jnp.zeros((S, *rows_M["tokens"].shape[1:], embed_params.shape[-1]),
                              embed_params.dtype))
    _, kept = jax.eval_shape(forward_S, staged, x_S, of_stages(stage_S))
    fp32_zeros = functools.partial(jax.tree.map, lambda w: jnp.zeros(w.shape, jnp.float32))
    c = _Carry(
        sent=x_S, returned=x_S,
        slots=[jnp.zeros((S, slots, *k.shape[1:]), k.dtype) for k in kept],
        d_staged=fp32_zeros(staged), d_head=fp32_zeros(head_params_S),
        d_embed=fp32_zeros(embed_params),
        total=jnp.zeros((pieces,), jnp.float32), count=jnp.zeros((pieces,), jnp.int32))
    # S - 1 ticks forward only, one of both for each filled micro-batch, S - 1 backward only:
    # one fill and one drain, however many micro-batches run. Loops of static length (ticks
    # past the filled micro-batches skipped by a `cond`): in a loop of traced length XLA holds
    # a tick's fresh residuals beside the ring's instead of writing them in place.
    def middle(i: Array, c: _Carry) -> _Carry:
        return jax.lax.cond(i < filled, lambda c: tick(S - 1 + i, c, True, True), lambda c: c, c)

    c = jax.lax.fori_loop(0, S - 1, lambda t, c: tick(t, c, True, False), c)
    c = jax.lax.fori_loop(0, M, middle, c)
    c = jax.lax.fori_loop(0, S - 1, lambda i, c: tick(filled + S - 1 + i, c, False, True), c)
    d_stacked = jax.tree.map(lambda g, w: g.reshape(w.shape), c.d_staged, stacked)
    d_head = jax.tree.map(lambda g: g.sum(axis=0), c.d_head)
    return (c.total.sum(), c.count.sum()), d_stacked, d_head, c.d_embed


def head_cut(rows: int, tokens: int, stages: int, row_shards: int) -> str | None:
    """How the stage groups share the head's work on a micro-batch of `rows` x `tokens` (its
    work is per token): by `rows` where each of the `row_shards` blocks of rows divides among
    them, else by `tokens` where they divide, else not at all (None)."""
    if stages == 1:
        return None
    if rows % (stages * row_shards) == 0:
        return "rows"
    return "tokens" if tokens % stages == 0 else None


def _shared_head(head: Head, cut: str | None, stages: int, row_shards: int
                 ) -> Callable[[Any, Array, Array], tuple[Array, Array]]:
    """`head` on a micro-batch cut `cut` (`head_cut`) into a piece per stage group, the head's
    weights given broadcast `[pieces, ...]`: per piece the loss sum and the target count
    `[pieces]`, so the weights' gradients `[pieces, ...]` stay on their stage group. Each data
    shard's block of rows is cut in S contiguous runs, one a stage group; cut by tokens, each
    row first into S rows of T/S tokens."""
    if cut is None:
        return lambda p, x, targets: jax.tree.map(
            lambda a: a[None], head(jax.tree.map(lambda w: w[0], p), x, targets))
    S = stages

    def pieces(a: Array) -> Array:
        if cut == "tokens":
            a = a.reshape(a.shape[0] * S, a.shape[1] // S, *a.shape[2:])
        a = a.reshape(row_shards, S, a.shape[0] // (row_shards * S), *a.shape[1:])
        return a.swapaxes(0, 1).reshape(S, -1, *a.shape[3:])

    on_pieces = jax.vmap(head, spmd_axis_name="stage")
    return lambda p, x, targets: on_pieces(p, pieces(x), pieces(targets))
