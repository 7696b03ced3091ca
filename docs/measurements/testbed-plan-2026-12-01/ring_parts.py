"""The balanced context ring's attention on the pinned testbed, taken apart: forward and
backward of one layer's ring attention (`tiny`'s heads, bfloat16, two ranks, 8,192 tokens a
device) at rows of 512, 2,048 and 8,192 tokens, (a) as it trains, (b) with every K/V send
replaced by the peer's chunk made on the spot (the same kernels over the same visible blocks,
nothing sent), and (c) the ring's sends alone, in the order the ring issues them. Where the
sends run to completion beside nothing, (a) = (b) + (c). Medians of 15 runs, ms.

    python docs/measurements/testbed-plan-2026-12-01/ring_parts.py [--link a800-4x8:inter]
"""

import argparse
import statistics
import sys
import time

LENGTHS = (512, 2048, 8192)
TOKENS = 8192  # a device's, as bench_plan's micro-steps
REPEATS = 15


def timed(run) -> float:
    run()
    seconds = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return 1e3 * statistics.median(seconds)


def measure() -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from hotjax.models import attention as attention_lib
    from hotjax.models.attention import AttentionSharding, Tokens, attention
    from hotjax.models.llama import preset

    config = preset("tiny")
    N, K, H = config.n_heads, config.n_kv_heads, config.head_dim
    mesh = Mesh(np.asarray(jax.devices()), ("context",))
    spec = PartitionSpec(None, "context")
    split = NamedSharding(mesh, spec)
    layout = AttentionSharding(mesh, spec, spec, balanced=True)
    sent = attention_lib._rotate

    def made_here(tree, shard):
        """The peer's chunk without sending it: the same K/V values, the peer's columns (on
        two ranks of balanced chunks a quarter-row's bit apart)."""
        if isinstance(tree, tuple) and len(tree) == 3 and isinstance(tree[2], Tokens):
            k, v, tokens = tree
            column = jnp.bitwise_xor(tokens.column, tokens.column.shape[1] // 2)
            return k, v, Tokens(tokens.segment, column, column)
        return tree

    found = []
    for length in LENGTHS:
        rows = 2 * TOKENS // length
        quarter = length // 4
        laid_out = np.concatenate([np.arange(0, quarter), np.arange(3 * quarter, length),
                                   np.arange(quarter, 3 * quarter)]).astype(np.int32)
        rng = np.random.default_rng(0)
        q, k, v, cotangent = (
            jax.device_put(rng.standard_normal((rows, length, n, H), np.float32)
                           .astype(jnp.bfloat16), split) for n in (N, K, K, N))
        segments = jax.device_put(np.ones((rows, length), np.int32), split)
        positions = jax.device_put(np.tile(laid_out, (rows, 1)), split)

        def loss(q, k, v, cotangent, segments, positions):
            out = attention(q, k, v, segments, positions, sharding=layout)
            return jnp.sum((out * cotangent).astype(jnp.float32))

        def runner(arrays=(q, k, v, cotangent, segments, positions), loss=loss):
            grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            return lambda: jax.block_until_ready(grads(*arrays))

        ring = timed(runner())
        attention_lib._rotate = made_here
        try:
            alone = timed(runner())
        finally:
            attention_lib._rotate = sent

        chunk_kv = (rows, length // 2, K, H)
        ring_perm = [(0, 1), (1, 0)]

        def sends(k, v, segments, positions, ring_perm=ring_perm):
            # Forward: K/V and the three token arrays once; backward: again, and the fp32
            # K/V gradients after each of the two chunks (each send waits on the one before).
            arrays = (k, v, segments, positions, positions)
            for _ in range(2):
                arrays = tuple(jax.lax.ppermute(x, "context", ring_perm) for x in arrays)
            grads = (arrays[0].astype(jnp.float32), arrays[1].astype(jnp.float32))
            for _ in range(2):
                grads = tuple(jax.lax.ppermute(x, "context", ring_perm) for x in grads)
            return grads[0].astype(jnp.bfloat16) + arrays[0], grads[1].astype(jnp.bfloat16)

        chain = jax.jit(jax.shard_map(sends, mesh=mesh, in_specs=spec, out_specs=spec,
                                      check_vma=False))
        arrays = (k, v, segments, positions)
        only_sends = timed(lambda chain=chain, arrays=arrays: jax.block_until_ready(
            chain(*arrays)))
        kv_bytes = 2 * int(np.prod(chunk_kv))
        found.append({"row_tokens": length, "rows": rows, "ring_ms": ring,
                      "no_sends_ms": alone, "sends_alone_ms": only_sends,
                      "exposed_ms": ring - alone,
                      "kv_bytes_each": kv_bytes, "sent_bytes": 2 * 2 * kv_bytes
                      + 2 * 4 * kv_bytes + 2 * 3 * 4 * rows * length // 2})
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--link")
    for flag in ("--coordinator", "--num-processes", "--process-id"):
        parser.add_argument(flag)
    args = parser.parse_args()
    if args.process_id is None:  # the launcher: two pinned processes of one device each
        from hotjax import launch, link

        rate = None
        if args.link:
            rate, how = link.resolve(args.link, 2, 1)
            print(f"link {args.link}: {link.describe_rate(rate)} {how}", flush=True)
        return launch.run([sys.executable, __file__], 2, 1, link=rate)
    from hotjax.startup import start_jax

    start_jax(None, (args.coordinator, int(args.num_processes), int(args.process_id), 60))
    import json

    found = measure()
    if args.process_id == "0":
        print(f"{'row':>6s} {'rows':>5s} {'ring':>9s} {'no sends':>9s} {'exposed':>9s} "
              f"{'sends alone':>11s}  (ms, one layer, forward and backward)")
        for r in found:
            print(f"{r['row_tokens']:6d} {r['rows']:5d} {r['ring_ms']:9.1f} "
                  f"{r['no_sends_ms']:9.1f} {r['exposed_ms']:9.1f} {r['sends_alone_ms']:11.1f}")
        print(json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
