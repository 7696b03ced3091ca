"""One grid cell planned from the corpus sample `--strategies auto` plans on, under the cell's
own profile and wall, with `plan_checked`'s line per micro-step XLA measures, the rounds it
took and the plan. The 4K InfiniBand-scaled log-normal cell (wall 0.21 GiB) found no plan
while `plan_checked` stopped after 8 rounds; pass a round limit to see that again:

    python scripts/lognormal_corpus.py /tmp/cells/lognormal.jsonl --median 2000 --sigma 1.2
    python docs/measurements/testbed-grid-2026-12-01/checked_rounds.py \\
        docs/measurements/testbed-grid-2026-11-29c/\\
bench_mixed-a800-4x8_inter-4096-32768-lognormal.json [ROUNDS]
"""

import argparse
import json
import os
import sys
import time
import tomllib
from pathlib import Path

from hotjax.startup import simulate_cpu_devices

simulate_cpu_devices(2)

import jax  # noqa: E402
from rich.console import Console  # noqa: E402

from hotjax.commands.options import add_options  # noqa: E402
from hotjax.config import RunConfig  # noqa: E402
from hotjax.data import estimated_lengths, load_tokenizer, open_corpus  # noqa: E402
from hotjax.errors import UserError  # noqa: E402
from hotjax.models.llama import as_trained  # noqa: E402
from hotjax.planning import search as plan_lib  # noqa: E402
from hotjax.planning.profile import parse_profile  # noqa: E402
from hotjax.planning.wall import xla_bytes  # noqa: E402
from hotjax.run import named_model, plan_search  # noqa: E402


def main(cell: str, rounds: int | None) -> None:
    d = json.loads(Path(cell).read_text())
    parser = argparse.ArgumentParser()
    add_options(parser, "data", "tokenizer")
    corpus = open_corpus(os.path.join(os.environ.get("CORPORA", "/tmp/cells"),
                                      os.path.basename(d["corpus"])))
    tokenizer = load_tokenizer(parser.parse_args([]).tokenizer, corpus)
    config = as_trained(named_model(d["model"]["preset"]), tokenizer.vocab_size,
                        compute_dtype="float32")
    profile = parse_profile(tomllib.loads(d["profile_toml"]), "cell")
    run = RunConfig(context=d["context"], batch_tokens=d["batch_tokens"],
                    device_memory=d["wall"]["budget_bytes"])
    search, typical = plan_search(run, config, 2, estimated_lengths(corpus, tokenizer),
                                  Console(stderr=True, quiet=True), profile)
    if rounds is not None:
        plan_lib.CHECK_ROUNDS = rounds
    made, planned = [], plan_lib.plan
    plan_lib.plan = lambda *a, **k: made.append(1) or planned(*a, **k)
    start = time.perf_counter()
    try:
        found = plan_lib.plan_checked(search, typical, d["context"],
                                      xla_bytes(config, jax.devices()), progress=print)
    except UserError as e:
        print(f"{len(made)} plans made, {time.perf_counter() - start:.0f} s: {e}")
        return
    print(f"{len(made)} plans made, {time.perf_counter() - start:.0f} s: {found.why}")
    for b in found.buckets:
        print(f"    <={b.max_len} {b.strategy}: {b.micro_rows} rows, remat {b.remat}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
