"""What one small collective costs on the pinned testbed, by kind and size: chains of 1 and of 8
dependent all-reduces, all-gathers, reduce-scatters, sends (`ppermute` round the ring) and
all-to-alls of 4 KiB and 64 KiB per device over two pinned processes (gloo over loopback), each
timed 40 times; the fastest, the 25th percentile, the median, the 75th and the slowest, in ms.

    python docs/measurements/testbed-plan-2026-11-30/collective_latency.py
"""

import argparse
import statistics
import sys
import time

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "send", "all-to-all")
SIZES = (4096, 65536)  # bytes per device
CHAINS = (1, 8)
REPEATS = 40


def measure(devices: int) -> dict[str, list[float]]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh, spec = Mesh(np.asarray(jax.devices()), ("g",)), PartitionSpec("g")
    ring = [(i, (i + 1) % devices) for i in range(devices)]
    bodies = {  # each keeps the shape, so that the next depends on it
        "all-reduce": lambda x: jax.lax.psum(x, "g") * 0.5,
        "all-gather": lambda x: jax.lax.all_gather(x, "g", tiled=True)[: x.shape[0]] * 0.5,
        "reduce-scatter": lambda x: jnp.tile(jax.lax.psum_scatter(x, "g", tiled=True),
                                             devices) * 0.5,
        "send": lambda x: jax.lax.ppermute(x, "g", ring) * 0.5,
        "all-to-all": lambda x: jax.lax.all_to_all(x.reshape(devices, -1), "g", 0, 0,
                                                   tiled=True).reshape(-1) * 0.5,
    }
    found = {}
    for size in SIZES:
        for kind in KINDS:
            for chain in CHAINS:
                def run(x, body=bodies[kind], chain=chain):
                    for _ in range(chain):
                        x = body(x)
                    return x

                step = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=spec, out_specs=spec,
                                             check_vma=False))
                x = jax.device_put(jnp.ones((devices * size // 4,), jnp.float32),
                                   NamedSharding(mesh, spec))
                jax.block_until_ready(step(x))
                seconds = []
                for _ in range(REPEATS):
                    start = time.perf_counter()
                    jax.block_until_ready(step(x))
                    seconds.append(time.perf_counter() - start)
                ordered = sorted(seconds)
                found[f"{kind} {size} B x{chain}"] = [
                    1e3 * v for v in (ordered[0], ordered[REPEATS // 4],
                                      statistics.median(ordered), ordered[3 * REPEATS // 4],
                                      ordered[-1])]
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    for flag in ("--coordinator", "--num-processes", "--process-id"):
        parser.add_argument(flag)
    args = parser.parse_args()
    if args.process_id is None:  # the launcher: two pinned processes of one device each
        from hotjax import launch

        return launch.run([sys.executable, __file__], 2, 1)
    from hotjax.startup import start_jax

    start_jax(None, (args.coordinator, int(args.num_processes), int(args.process_id), 30))
    found = measure(int(args.num_processes))
    if args.process_id == "0":
        print(f"{'collective, bytes a device, chain':36s} {'min':>8s} {'p25':>8s} {'median':>8s} "
              f"{'p75':>8s} {'max':>8s}  (ms)")
        for name, values in found.items():
            print(f"{name:36s} " + " ".join(f"{v:8.3f}" for v in values), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
