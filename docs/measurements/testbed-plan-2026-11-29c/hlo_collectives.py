"""The collectives XLA:CPU issues in one micro-step of `tiny` (2 layers, 16 rows of 512 tokens)
on two devices, in the entry computation and per turn of the layer loop, beside the latencies
the cost model pays per term at 2 and 4 layers. From the repository's root:

    JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=2 \\
        python docs/measurements/testbed-plan-2026-11-29c/hlo_collectives.py RULES REMAT [list]

`list` prints each collective with the operation it serves.
"""

import collections
import dataclasses
import re
import sys

import jax

from hotjax.models.llama import as_trained, preset
from hotjax.planning.cost import micro_step_time
from hotjax.planning.profile import load_profile
from hotjax.sharding.strategy import Strategy
from hotjax.step import bucket_step

COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-reduce|reduce-scatter|collective-permute|"
                        r"all-to-all)(-start)?\(")
AXIS = {"fsdp": "fsdp", "zero1": "fsdp", "megatron": "tensor", "megatron-sp": "tensor",
        "dp": "data", "context": "context", "ulysses": "context"}
TERMS = ("tensor", "context", "fsdp", "gradients", "stages")


def collectives(text: str):
    """(where, kind, result, op name) of each collective between the two devices."""
    entry = False
    for line in text.splitlines():
        if line and not line[0].isspace():
            entry = line.startswith("ENTRY")
        found = COLLECTIVE.search(line)
        if found and "replica_groups={{0},{1}}" not in line:
            name = re.search(r'op_name="([^"]*)"', line)
            yield ("entry" if entry else "loop", found.group(2), found.group(1),
                   name.group(1) if name else "")


def latencies(config, strategy: Strategy, shape: tuple[int, int]) -> dict:
    """Per term, the latencies the model pays at 2 and 4 layers: its price with a second of
    latency a collective, less its price with none."""
    profile = dataclasses.replace(load_profile("a800-4x8"), platform="cpu")  # CPU's counts
    paid = {}
    for layers in (2, 4):
        layered = dataclasses.replace(config, n_layers=layers)
        times = [micro_step_time(layered, strategy, shape, dataclasses.replace(
            profile, collective_latency=latency)) for latency in (0.0, 1.0)]
        paid[layers] = {t: round(getattr(times[1], t) - getattr(times[0], t), 3) for t in TERMS}
    return paid


rules, remat = sys.argv[1:3]
config = as_trained(preset("tiny"), compute_dtype="bfloat16", remat=remat, n_layers=2,
                    scan_unroll=1)
strategy = Strategy.parse(f"{AXIS[rules]}=2,rules={rules}")
shape = (16, 512)
text = bucket_step(config, strategy, tuple(jax.devices()[:2])).compiled(shape).as_text()
found = list(collectives(text))
print(rules, remat, dict(collections.Counter((where, kind) for where, kind, *_ in found)),
      latencies(config, strategy, shape))
if sys.argv[3:] == ["list"]:
    for where, kind, result, name in found:
        print(f"{where:5} {kind} {result[:90]} {name[-90:]}")
