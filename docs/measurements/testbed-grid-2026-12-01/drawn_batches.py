"""Each grid cell's best table and best single strategy (by the cost model, on the cell's own
profile and wall, checked by XLA as the cell planned them), priced three ways: on the typical
batch of quantiles the planner searches on, on the `DRAWN_BATCHES` mini-batches it now draws
from its sample of the corpus (`hotjax.planning.search.Fill.drawn`), and on the first
`STREAM` mini-batches the training stream makes with the cell's seed (`MiniBatches`, whose
first after the warm-up the cell timed): the cost model's price of the steps a run takes,
within 0-7 % of the measured ones in every cell. The sample is the one `--strategies auto`
plans on (`estimated_lengths`), so the tables may differ from those the cells ran. Each
table's gain over the single strategy and its step, and which of the two `plan` keeps under
MARGIN by each.
Regenerate the corpora into $CORPORA (default /tmp/cells) first:

    python scripts/lognormal_corpus.py $CORPORA/lognormal.jsonl --median 2000 --sigma 1.2
    python scripts/lognormal_corpus.py $CORPORA/bimodal.jsonl --median 600 --sigma 0.6 \
        --mix 0.15:24000:0.5
    python docs/measurements/testbed-grid-2026-12-01/drawn_batches.py CELL.json ...
"""

import argparse
import json
import os
import sys
import tomllib
from pathlib import Path

import numpy as np

from hotjax.startup import simulate_cpu_devices

simulate_cpu_devices(2)

import jax  # noqa: E402
from rich.console import Console  # noqa: E402

from hotjax.commands.options import add_options  # noqa: E402
from hotjax.config import RunConfig  # noqa: E402
from hotjax.data import MiniBatches, estimated_lengths, load_tokenizer, open_corpus  # noqa: E402
from hotjax.errors import UserError  # noqa: E402
from hotjax.models.llama import as_trained  # noqa: E402
from hotjax.planning import search as plan_lib  # noqa: E402
from hotjax.planning.profile import parse_profile  # noqa: E402
from hotjax.planning.wall import xla_bytes  # noqa: E402
from hotjax.run import named_model, plan_search  # noqa: E402

STREAM = 32


def on(search, plan, batches) -> float:
    """`plan`'s mean step over `batches`, its micro-steps as planned."""
    table = [(b.max_len, b.strategy) for b in plan.buckets]
    run = [b.run_as for b in plan.buckets]
    return float(np.mean([plan_lib.fixed_table(search, x, table, run=run).seconds
                          for x in batches]))


def main(files: list[str]) -> None:
    parser = argparse.ArgumentParser()
    add_options(parser, "data", "tokenizer")
    tokenizer_name = parser.parse_args([]).tokenizer
    console = Console(stderr=True, quiet=True)
    corpora, rows = {}, []
    for name in files:
        d = json.loads(Path(name).read_text())
        path = os.path.join(os.environ.get("CORPORA", "/tmp/cells"), os.path.basename(d["corpus"]))
        if path not in corpora:
            corpus = open_corpus(path)
            corpora[path] = corpus, load_tokenizer(tokenizer_name, corpus)
        corpus, tokenizer = corpora[path]
        if tokenizer.identity != d["tokenizer"]:
            print(name, "tokenizer differs:", tokenizer.identity, d["tokenizer"])
            continue
        model = d["model"]["preset"] if isinstance(d["model"], dict) else d["model"]
        config = as_trained(named_model(model), tokenizer.vocab_size, compute_dtype="float32")
        stream = MiniBatches(corpus, tokenizer, [d["context"]], batch_tokens=d["batch_tokens"],
                             seed=d["seed"])
        timed = [next(stream).document_lengths() for _ in range(STREAM)]
        profile = parse_profile(tomllib.loads(d["profile_toml"]), "cell")
        run = RunConfig(context=d["context"], batch_tokens=d["batch_tokens"],
                        device_memory=d["wall"]["budget_bytes"])
        lengths = estimated_lengths(corpus, tokenizer)
        search, typical = plan_search(run, config, 2, lengths, console, profile)
        try:
            plan_lib.plan_checked(search, typical, d["context"], xla_bytes(config, jax.devices()))
        except UserError as e:  # the corpus sample's longest documents, not the cell's
            print(f"{'/'.join(name.split('/')[-2:])}: {e}", flush=True)
            continue
        table = plan_lib.fastest(search, typical, d["context"], 4)
        single = plan_lib.fastest(search, typical, d["context"], 1)
        prices = {kind: (on(search, single, batches) / on(search, table, batches),
                         on(search, table, batches))
                  for kind, batches in (("typical", [typical]), ("drawn", search.drawn),
                                        ("stream", timed))}
        keeps = {kind: "table" if prices[kind][0] > plan_lib.MARGIN else "single"
                 for kind in ("typical", "drawn", "stream")}
        cell = "/".join(name.split("/")[-2:])
        rows.append({"cell": cell, "table": " | ".join(f"<={b.max_len} {b.strategy}"
                                                        for b in table.buckets),
                     "single": str(single.buckets[0].strategy),
                     **{f"{k}_gain": g for k, (g, _) in prices.items()},
                     **{f"{k}_table_s": s for k, (_, s) in prices.items()},
                     **{f"keeps_by_{k}": v for k, v in keeps.items()}})
        r = rows[-1]
        print(f"{cell}\n    table {r['table']} vs {r['single']}: gain typical "
              f"{r['typical_gain']:.3f}, drawn {r['drawn_gain']:.3f}, stream "
              f"{r['stream_gain']:.3f}; table's step typical {r['typical_table_s']:.2f} s, drawn "
              f"{r['drawn_table_s']:.2f}, stream {r['stream_table_s']:.2f}; keeps by typical "
              f"{r['keeps_by_typical']}, drawn {r['keeps_by_drawn']}, stream "
              f"{r['keeps_by_stream']}", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
