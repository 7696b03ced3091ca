"""The rings of a bench_plan run priced again on the run's own profile, with and without its
`attention_ring_by_chunk` table (cost model 9, at commit ef5a0f9 only: check it out to run
this): the same measured steps, the two models side by side (signed error, %).

    python docs/measurements/testbed-plan-2026-12-01/reprice_rings.py \
        docs/measurements/testbed-plan-2026-12-01/bench_plan-cost-model-9-none.json
"""

import dataclasses
import json
import sys
import tomllib
from pathlib import Path

from hotjax.models.llama import as_trained, preset
from hotjax.planning.cost import micro_step_time
from hotjax.planning.profile import parse_profile
from hotjax.sharding.strategy import Strategy

run = json.loads(Path(sys.argv[1]).read_text())
profile = parse_profile(tomllib.loads(run["profile"]["toml"]), "run")
without = dataclasses.replace(profile, attention_ring_by_chunk=())
config = as_trained(preset("tiny"), compute_dtype="bfloat16")
for result in run["time"]["results"]:
    name = result["strategy"]
    if "context" not in name or "ulysses" in name:
        continue
    rules = name.split("[")[1].split(",")[0].rstrip("]")
    strategy = Strategy.parse(f"context=2,rules={rules},balanced=true")
    shape, measured = (result["rows"], result["seq_len"]), result["measured_s"]
    by_chunk, reference = (micro_step_time(config, strategy, shape, p).seconds / measured - 1
                           for p in (profile, without))
    print(f"{name:36s} {shape[1]:5d} measured {measured:.3f} s  by chunk {100 * by_chunk:+5.1f}  "
          f"at the reference rate {100 * reference:+5.1f}")
