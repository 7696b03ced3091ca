"""The collectives of a compiled 1F1B micro-step of `small` (4 layers, bf16, two micro-batches
of 8 x 256 tokens), counted by (in the entry computation, kind, result type).

    python collectives.py REPO cpu|gpu REMAT STRATEGY    # e.g. . gpu none stage=2

REPO: the checkout whose tests/test_cost.py parses the HLO. `gpu` compiles for H100s without one.
"""

import collections
import sys

from hotjax import simulate_cpu_devices

simulate_cpu_devices(8)

import jax  # noqa: E402  (after the simulated devices are set)

from hotjax import targets  # noqa: E402
from hotjax.models.llama import as_trained, preset  # noqa: E402
from hotjax.sharding.strategy import Strategy  # noqa: E402
from hotjax.step import bucket_step  # noqa: E402

sys.path.insert(0, f"{sys.argv[1]}/tests")
import test_cost  # noqa: E402

platform, remat, text = sys.argv[2:5]
config = as_trained(preset("small"), compute_dtype="bfloat16", remat=remat, n_layers=4)
strategy = Strategy.parse(f"{text},microbatches=2")
n = strategy.num_devices
devices = (tuple(jax.devices()[:n]) if platform == "cpu"
           else tuple(targets.devices(targets.prepare("h100"), n)))
hlo = bucket_step(config, strategy, devices).compiled((8, 256)).as_text()
counted = collections.Counter((entry, op, result[:90])
                              for entry, result, op, _ in test_cost._collectives(hlo))
for key, count in sorted(counted.items()):
    print(count, key)
print("bus", {k: v for k, v in test_cost._bus_bytes(hlo, 2).items() if k != "dtypes"})
