"""The collectives one micro-step of `tiny` (2 layers, 16 rows of 512 tokens, bf16) issues on two
devices, compiled for CPUs or for H100s, beside the latencies the cost model pays for it: the
entry computation's once, the layer loop's once per layer. From the repository's root:

    JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=2 python \\
        docs/measurements/testbed-plan-2026-11-29e/issued_vs_priced.py cpu|gpu RULES:REMAT ...
"""

import collections
import dataclasses
import re
import sys

import jax

from hotjax import targets
from hotjax.models.llama import as_trained, preset
from hotjax.planning.cost import TERMS, micro_step_time
from hotjax.planning.profile import load_profile
from hotjax.sharding.strategy import Strategy
from hotjax.step import bucket_step

COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-reduce|reduce-scatter|collective-permute|"
                        r"all-to-all)(-start)?\(")
AXIS = {"fsdp": "fsdp", "zero1": "fsdp", "zero2": "fsdp", "megatron": "tensor",
        "megatron-sp": "tensor", "dp": "data", "context": "context", "ulysses": "context",
        "context-fsdp": "context", "context-zero1": "context"}


def issued(text: str) -> collections.Counter:
    """Collectives between devices, by where they sit (the entry computation or a loop)."""
    where, entry = collections.Counter(), False
    for line in text.splitlines():
        if line and not line[0].isspace():
            entry = line.startswith("ENTRY")
        if COLLECTIVE.search(line) and "replica_groups={{0},{1}}" not in line:
            where["entry" if entry else "loop"] += 1
    return where


platform, *cases = sys.argv[1:]
for case in cases:
    rules, remat = case.split(":")
    config = as_trained(preset("tiny"), compute_dtype="bfloat16", remat=remat, n_layers=2,
                        scan_unroll=1)
    strategy = Strategy.parse(f"{AXIS[rules]}=2,rules={rules}")
    shape = (16, 512)
    devices = (tuple(jax.devices()[:2]) if platform == "cpu"
               else tuple(targets.devices(targets.prepare("h100"), 2)))
    where = issued(bucket_step(config, strategy, devices).compiled(shape).as_text())
    profile = dataclasses.replace(load_profile("a800-4x8"), platform=platform)
    times = [micro_step_time(config, strategy, shape,
                             dataclasses.replace(profile, collective_latency=latency))
             for latency in (0.0, 1.0)]
    paid = {k: round(getattr(times[1], k) - getattr(times[0], k), 3) for k in TERMS
            if getattr(times[1], k) != getattr(times[0], k)}
    print(f"{platform} {rules:13} {remat:4} issued {where['entry'] + 2 * where['loop']:3} "
          f"({where['entry']} outside the layer loop, {where['loop']} a layer)  "
          f"priced {sum(paid.values()):4.0f} {paid}", flush=True)
