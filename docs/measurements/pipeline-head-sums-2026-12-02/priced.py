"""Pipeline buckets of LLaMA-3-8B and LLaMA-2-7B priced on the shipped `a800-4x8` profile:
per strategy the stage transfers, the bubble, one micro-step and a bucket of four (JSON)."""

import json
import sys

from hotjax.models.llama import as_trained, preset
from hotjax.planning.cost import micro_step_time
from hotjax.planning.profile import load_profile
from hotjax.sharding.strategy import Strategy

CASES = (("stage=4,data=8,microbatches=8", (8, 4096)),
         ("stage=4,tensor=8,microbatches=8", (8, 4096)),
         ("stage=2,tensor=8,data=2,microbatches=4", (4, 8192)))
profile = load_profile("a800-4x8")
priced = {}
for model in ("llama3-8b", "llama2-7b"):
    config = as_trained(preset(model), remat="full")
    for text, shape in CASES:
        time = micro_step_time(config, Strategy.parse(text), shape, profile)
        priced[f"{model} {text} {shape}"] = {
            "stages": time.stages, "bubble": time.bubble, "micro_step": time.seconds,
            "bucket_of_4": time.bucket_seconds([1.0] * 4)}
json.dump(priced, sys.stdout, indent=1)
