"""The ring's kernel without its sends (`AttentionSharding(..., sends=False)`, which lived at
commit ef5a0f9 only: check that commit out to run this), forward and backward, on two pinned
processes: kernel calls tiling 128, 512 and 2,048 tokens, each device holding 1,024, 4,096 or
8,192 tokens (`tiny`'s heads, bfloat16), five timed rounds after one that compiles.

    git checkout ef5a0f9 && python docs/measurements/testbed-plan-2026-12-01/ring_kernel_by_rows.py
"""

import argparse
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    for flag in ("--coordinator", "--num-processes", "--process-id"):
        parser.add_argument(flag)
    args = parser.parse_args()
    if args.process_id is None:
        from hotjax import launch

        return launch.run([sys.executable, __file__], 2, 1)
    from hotjax.startup import start_jax

    start_jax(None, (args.coordinator, int(args.num_processes), int(args.process_id), 60))
    import jax
    import jax.numpy as jnp

    from hotjax.models.llama import preset
    from hotjax.planning import measure

    c = preset("tiny")
    shapes = list(dict.fromkeys(
        (max(1, tokens // (2 * chunk)), 4 * chunk, c.n_heads, c.n_kv_heads, c.head_dim)
        for chunk in (128, 512, 2048) for tokens in (1024, 4096, 8192)))
    runs = [measure.ring_runner(jax.devices(), jnp.bfloat16, s) for s in shapes]
    seconds = measure.timed_in_rounds(runs, 5)
    if args.process_id == "0":
        for s, t in zip(shapes, seconds, strict=True):
            rate = measure.ring_flops(s, "cpu") / t / 1e9
            print(f"chunk {s[1] // 4:5d} rows {s[0]:3d} tokens/device {s[0] * s[1] // 2:5d}: "
                  f"{t * 1e3:8.1f} ms {rate:6.2f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
