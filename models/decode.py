"""Decoding with a K/V cache: the prompt in one pass, then one token a step in a
`lax.while_loop`, drawn greedily, at a temperature, or from the top-p nucleus, until EOS or
the step limit. The layers are training's own (`hotjax.models.llama.layer`); only attention differs,
reading the cache instead of the row.

Letters as in `hotjax.models.llama`, and S the cache's slots (the longest sequence decoded), P the
prompt's tokens. Slot s holds the token at position s: a query at position p reads slots 0..p,
each row's own written before it attends, so a slot past a row's end is never read.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hotjax.models.attention import accumulating
from hotjax.models.llama import (
    LlamaConfig,
    Params,
    compute_embedding,
    embedded,
    final_logits,
    head_weights,
    layer,
    rope_tables,
)

Array = jax.Array


class Cache(NamedTuple):
    """Each layer's keys and values by slot, [L, B, S, K, H] in the compute dtype."""

    k_LxBxSxKxH: Array
    v_LxBxSxKxH: Array


class Sampling(NamedTuple):
    """How the next token is drawn: `temperature` 0 is greedy (argmax); else from the
    smallest set of most likely tokens holding `top_p` of the probability (1: all)."""

    temperature: float = 0.0
    top_p: float = 1.0


class Generated(NamedTuple):
    tokens_BxS: Array  # the prompt, then the tokens drawn (the first EOS included)
    lengths_B: Array  # each row's tokens
    logits_BxSxV: Array | None  # fp32 logits at each position (`keep_logits`); 0 past a row


def empty_cache(cfg: LlamaConfig, rows: int, slots: int) -> Cache:
    shape = (cfg.n_layers, rows, slots, cfg.n_kv_heads, cfg.head_dim)
    return Cache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))


def forward(cfg: LlamaConfig, params: Params, tokens_BxT: Array, positions_BxT: Array,
            cache: Cache) -> tuple[Array, Cache]:
    """fp32 logits [B, T, V] of `tokens_BxT` at `positions_BxT` (consecutive in each row),
    each reading the cache up to its position; their keys and values written into it first."""
    embed_VxD = compute_embedding(cfg, params["embed"])
    x_BxTxD = embedded(embed_VxD, tokens_BxT)
    cos_BxTxH, sin_BxTxH = rope_tables(cfg, positions_BxT)
    write = jax.vmap(lambda c_SxKxH, x_TxKxH, p: jax.lax.dynamic_update_slice_in_dim(
        c_SxKxH, x_TxKxH.astype(c_SxKxH.dtype), p, axis=0))

    def one_layer(x_BxTxD: Array, weights: tuple) -> tuple[Array, tuple[Array, Array]]:
        w, k_BxSxKxH, v_BxSxKxH = weights

        def attend(q_BxTxNxH: Array, k_BxTxKxH: Array, v_BxTxKxH: Array):
            k_cache = write(k_BxSxKxH, k_BxTxKxH, positions_BxT[:, 0])
            v_cache = write(v_BxSxKxH, v_BxTxKxH, positions_BxT[:, 0])
            return (_cached_attention(q_BxTxNxH, k_cache, v_cache, positions_BxT),
                    (k_cache, v_cache))

        return layer(cfg, x_BxTxD, w, cos_BxTxH, sin_BxTxH, attend)

    x_BxTxD, (k, v) = jax.lax.scan(one_layer, x_BxTxD, (params["layers"], *cache))
    head_DxV = head_weights(cfg, embed_VxD if cfg.tie_embeddings else params["lm_head"])
    return final_logits(cfg, params["final_norm"], head_DxV, x_BxTxD), Cache(k, v)


def _cached_attention(q_BxTxNxH: Array, k_BxSxKxH: Array, v_BxSxKxH: Array,
                      positions_BxT: Array) -> Array:
    """Softmax attention of each query over the slots up to its position."""
    S = k_BxSxKxH.shape[1]
    mask_Bx1xTxS = (jnp.arange(S)[None, None, :] <= positions_BxT[:, :, None])[:, None]
    dtype, wide = q_BxTxNxH.dtype, accumulating(q_BxTxNxH.dtype)
    out_BxTxNxH = jax.nn.dot_product_attention(q_BxTxNxH.astype(wide), k_BxSxKxH.astype(wide),
                                               v_BxSxKxH.astype(wide), mask=mask_Bx1xTxS)
    return out_BxTxNxH.astype(dtype)


def sample(logits_BxV: Array, key: Array, sampling: Sampling) -> Array:
    """The next token of each row [B], as `sampling` says."""
    greedy_B = jnp.argmax(logits_BxV, axis=-1)
    scaled_BxV = logits_BxV / jnp.maximum(sampling.temperature, 1e-6)
    sorted_BxV = jnp.sort(scaled_BxV, axis=-1)[:, ::-1]
    p_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    # A token is in the nucleus while the likelier ones hold less than top_p: the likeliest
    # always is.
    inside_BxV = jnp.cumsum(p_BxV, axis=-1) - p_BxV < sampling.top_p
    cutoff_Bx1 = jnp.min(jnp.where(inside_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
    nucleus_BxV = jnp.where(scaled_BxV >= cutoff_Bx1, scaled_BxV, -jnp.inf)
    drawn_B = jax.random.categorical(key, nucleus_BxV, axis=-1)
    return jnp.where(sampling.temperature > 0, drawn_B, greedy_B).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "slots", "keep_logits"))
def generate(cfg: LlamaConfig, params: Params, prompt_BxP: Array, lengths_B: Array, key: Array,
             sampling: Sampling, *, max_new_tokens: Array | int, eos_id: Array | int,
             vocab: Array | int, slots: int, keep_logits: bool = False) -> Generated:
    """Each row's prompt (its first `lengths_B` tokens of `prompt_BxP`) continued by up to
    `max_new_tokens`, a row ending at its first EOS, within `slots` tokens in all; only ids
    below `vocab` (the tokenizer's: the embedding's rows past it are padding) are drawn.
    `slots` should hold the longest prompt and `max_new_tokens` more: drawing stops when a row
    has filled them. `keep_logits`: also every position's logits, as the training forward
    gives them."""
    B, P = prompt_BxP.shape
    logits_BxPxV, cache = forward(cfg, params, prompt_BxP,
                                  jnp.broadcast_to(jnp.arange(P), (B, P)),
                                  empty_cache(cfg, B, slots))
    V = logits_BxPxV.shape[-1]
    real_V = jnp.arange(V) < vocab
    rows_B = jnp.arange(B)
    tokens_BxS = jnp.zeros((B, slots), jnp.int32).at[:, :P].set(prompt_BxP)
    kept = (jnp.zeros((B, slots, V), jnp.float32).at[:, :P].set(logits_BxPxV)
            if keep_logits else None)

    def draws_more(state: tuple) -> Array:
        step, _, lengths_B, done_B = state[:4]
        # A row with no slot left ends them all: past it the cache would be overwritten.
        return (step < max_new_tokens) & ~jnp.all(done_B) & jnp.all(done_B | (lengths_B < slots))

    def draw(state: tuple) -> tuple:
        step, tokens_BxS, lengths_B, done_B, logits_BxV, cache, key, kept = state
        key, now = jax.random.split(key)
        next_B = sample(jnp.where(real_V, logits_BxV, -jnp.inf), now, sampling)
        at_B = jnp.where(done_B, slots - 1, lengths_B)  # a finished row writes nothing
        tokens_BxS = tokens_BxS.at[rows_B, at_B].set(
            jnp.where(done_B, tokens_BxS[rows_B, at_B], next_B))
        logits_Bx1xV, cache = forward(cfg, params, next_B[:, None], at_B[:, None], cache)
        if kept is not None:
            kept = kept.at[rows_B, at_B].set(logits_Bx1xV[:, 0])
        return (step + 1, tokens_BxS, lengths_B + ~done_B, done_B | (next_B == eos_id),
                logits_Bx1xV[:, 0], cache, key, kept)

    last_BxV = logits_BxPxV[rows_B, lengths_B - 1]
    state = (0, tokens_BxS, lengths_B, jnp.zeros(B, bool), last_BxV, cache, key, kept)
    _, tokens_BxS, lengths_B, _, _, _, _, kept = jax.lax.while_loop(draws_more, draw, state)
    if kept is not None:  # past a row's end: a padded prompt's, or a finished row's writes
        kept = jnp.where((jnp.arange(slots) < lengths_B[:, None])[..., None], kept, 0)
    return Generated(tokens_BxS, lengths_B, kept)
