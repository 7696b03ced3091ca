"""Attention's rate by row length on one pinned core, with `tiny`'s heads: does the blockwise
kernel run the fit steps' 128-token rows slower per counted FLOP than the profile's 1,024?

    JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=1 taskset -c 0 python attention_by_length.py \\
        > attention_by_length.json
"""

import json
import sys

import jax
import jax.numpy as jnp

from hotjax.planning.measure import (
    attention_flops,
    attention_runner,
    reference_model,
    timed_in_rounds,
)

model = reference_model("tiny")
heads = (model.n_heads, model.n_kv_heads, model.head_dim)
shapes = [(16, 128), (64, 128), (8, 256), (8, 512), (1, 1024), (2, 2048), (1, 8192)]
runs = [attention_runner(jax.devices()[:1], jnp.bfloat16, (rows, tokens, *heads))
        for rows, tokens in shapes]
rates = []
for (rows, tokens), seconds in zip(shapes, timed_in_rounds(runs, 5), strict=True):
    flops = attention_flops((rows, tokens, *heads), "cpu")
    rates.append({"rows": rows, "tokens": tokens, "s": seconds, "gflops": flops / seconds / 1e9})
    print(f"{rows:3d} x {tokens:5d}: {seconds * 1e3:8.2f} ms {flops / seconds / 1e9:6.2f} GFLOP/s",
          file=sys.stderr)
print(json.dumps(rates))
