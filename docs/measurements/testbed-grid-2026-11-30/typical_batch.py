"""Each grid cell's `auto` plan for a typical batch of evenly spaced quantiles (what the planner
uses: "quantiles") and of each stratum's mean (the alternative tried: "means"), on the cell's
own profile and wall, checked by XLA as the cell planned it, and each plan's price on the cell's
timed mini-batches. Regenerate the corpora into $CORPORA (default /tmp/cells) first:

    python scripts/lognormal_corpus.py $CORPORA/lognormal.jsonl --median 2000 --sigma 1.2
    python scripts/lognormal_corpus.py $CORPORA/bimodal.jsonl --median 600 --sigma 0.6 \
        --mix 0.15:24000:0.5
    python docs/measurements/testbed-grid-2026-11-30/typical_batch.py CELL.json ...
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
from hotjax.data import MiniBatches, load_tokenizer, open_corpus  # noqa: E402
from hotjax.data.buckets import cut  # noqa: E402
from hotjax.models.llama import as_trained  # noqa: E402
from hotjax.planning import search as plan_lib  # noqa: E402
from hotjax.planning.profile import parse_profile  # noqa: E402
from hotjax.planning.wall import xla_bytes  # noqa: E402
from hotjax.run import named_model, plan_search  # noqa: E402


def stratum_means(lengths: np.ndarray, batch: int) -> np.ndarray:
    """`batch` lengths: the sorted lengths split into equal strata, each stratum's mean."""
    ordered = np.sort(lengths).astype(float)
    edges = np.arange(batch + 1) * len(ordered) / batch
    tokens = np.interp(edges, np.arange(len(ordered) + 1),
                       np.concatenate([[0.0], np.cumsum(ordered)]))
    return np.maximum(np.rint(np.diff(tokens) / np.diff(edges)), 1).astype(int)


def main(files: list[str]) -> None:
    parser = argparse.ArgumentParser()
    add_options(parser, "data", "tokenizer")
    tokenizer_name = parser.parse_args([]).tokenizer
    console = Console(stderr=True, quiet=True)
    corpora = {}
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
        lengths = [next(stream).document_lengths() for _ in range(d["warmup"] + d["steps"])]
        profile = parse_profile(tomllib.loads(d["profile_toml"]), "cell")
        run = RunConfig(context=d["context"], batch_tokens=d["batch_tokens"],
                        device_memory=d["wall"]["budget_bytes"])
        search, quantiles = plan_search(run, config, 2, np.concatenate(lengths), console,
                                        profile)
        sequences = cut(np.concatenate(lengths), d["context"], "truncate")
        means = stratum_means(sequences, len(quantiles))
        print(f"{'/'.join(name.split('/')[-2:])}: typical tokens {quantiles.sum()} (quantiles), "
              f"{means.sum()} (means); a mini-batch's "
              f"{np.mean([x.sum() for x in lengths]):.0f}")

        def pairs(batch: np.ndarray) -> str:  # the sum of squared lengths, and the longest
            return f"{(batch.astype(float) ** 2).sum() / 1e6:.0f}M pairs (longest {batch.max()})"

        print(f"    mini-batches: {', '.join(pairs(x) for x in lengths)}; typical batch: "
              f"{pairs(quantiles)} (quantiles), {pairs(means)} (means)")
        tables = {}
        for kind, typical in (("quantiles", quantiles), ("means", means)):
            found = plan_lib.plan_checked(search, typical, d["context"],
                                          xla_bytes(config, jax.devices()))
            table = [(b.max_len, b.strategy) for b in found.buckets]
            timed = [plan_lib.fixed_table(search, x, table) for x in lengths[d["warmup"]:]]
            tables[kind] = " | ".join(f"<={high} {s}" for high, s in table)
            priced = (f"{np.mean([t.seconds for t in timed]):.2f} s" if all(timed) else "-")
            print(f"    {kind:9s} {tables[kind]}: typical step {found.seconds:.2f} s, the timed "
                  f"steps {priced} ({found.why.split(':')[0]})")
        print(f"    same table: {tables['quantiles'] == tables['means']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
