"""`hotjax plan`: a strategy table chosen by the cost model for a model, a cluster and a corpus,
with a report of what each bucket is predicted to cost beside the best single strategy."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from hotjax.config import RunConfig, at_least, memory_size, positive
from models.errors import UserError

_RUN = RunConfig()


def register(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="choose buckets and a strategy per bucket with the "
                               "cost model, and write them as a strategy table")
    plan.set_defaults(handler=_plan)
    plan.add_argument("--model", default="small", help="model preset (default: %(default)s)")
    profiles = plan.add_mutually_exclusive_group()
    profiles.add_argument("--profile", help="hardware profile: a shipped one (a800-4x8, "
                          "h100-1x8) or a .toml file (default: this machine's, measured once "
                          "and cached)")
    profiles.add_argument("--measure", action="store_true", help="measure this machine's "
                          "devices now (matmuls, attention, collectives) and cache the profile")
    plan.add_argument("--devices", type=int, help="devices to plan for (default: all of the "
                      "profile's)")
    memory = plan.add_mutually_exclusive_group()
    memory.add_argument("--device-memory", type=memory_size, metavar="SIZE",
                        help="memory budget per device, like 80GiB (a bare number is MiB; "
                        "default: what the profile's allocator gives of its device memory)")
    memory.add_argument("--memory-gib", type=float, help="the same in GiB (the older form)")
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--lengths", metavar="STATS.json", help="the document lengths of a "
                        "corpus, as `hotjax data stats --json` saves them")
    source.add_argument("--data", help="a corpus to tokenize (as for `hotjax train`; default: "
                        "stdlib)")
    plan.add_argument("--tokenizer", help="with --data: as for `hotjax train`")
    plan.add_argument("--vocab-size", type=int, default=_RUN.vocab_size,
                      help="with --data and no --tokenizer: the BPE trained on the corpus")
    plan.add_argument("--context", type=int, default=_RUN.context,
                      help="longest sequence in tokens (default: %(default)s)")
    plan.add_argument("--long-documents", choices=("truncate", "split"), default="truncate",
                      help="documents over the context: truncate them (as HotSPa does) or "
                      "split them into context-length pieces (default: %(default)s)")
    plan.add_argument("--batch-sequences", type=int, default=512,
                      help="sequences per step (default: %(default)s, the paper's)")
    plan.add_argument("--max-buckets", type=int, default=4,
                      help="at most this many buckets (default: %(default)s)")
    plan.add_argument("--compare", metavar="TABLE.toml", action="append", default=[],
                      help="also predict this table's step (repeatable)")
    plan.add_argument("--out", metavar="TABLE.toml", help="write the table here")
    plan.add_argument("--json", action="store_true", help="print the report as JSON")
    from hotjax.cli import add_process_options

    add_process_options(plan)  # --measure across processes, under `hotjax launch`


def _plan(args: argparse.Namespace) -> None:
    from hotjax import start_jax
    from hotjax.cli import processes

    for flag, value in (("--context", args.context), ("--max-buckets", args.max_buckets),
                        ("--devices", args.devices), ("--vocab-size", args.vocab_size)):
        at_least(flag, value, 1)
    positive("--memory-gib", args.memory_gib)
    start_jax(None, processes(args))
    from rich.console import Console

    from hotjax import distributed
    from hotjax import plan as planning
    from hotjax.data.buckets import cut
    from models.llama import padded_vocab, preset
    from sharding.profile import load_profile

    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise UserError(f"--out {args.out}: its directory does not exist: create it or choose "
                        f"another path")
    main = distributed.is_main()  # under `hotjax launch`, process 0 reports and writes
    console = Console(stderr=True, quiet=not main)
    profile = load_profile(args.profile) if args.profile else local_profile(console,
                                                                            args.measure)
    devices = args.devices or profile.num_devices
    budget = int(args.device_memory * 2**20 if args.device_memory
                 else args.memory_gib * 2**30 if args.memory_gib else profile.memory_bytes)
    documents, described, vocab = _document_lengths(args, console)
    # The model as training builds it: the tokenizer's vocabulary, padded to split evenly.
    config = preset(args.model)
    config = dataclasses.replace(config, vocab_size=padded_vocab(vocab or config.vocab_size))
    lengths = planning.typical_batch(cut(documents, args.context, args.long_documents),
                                     args.batch_sequences)
    with console.status("searching"):
        search = planning.Search(config, profile, devices, budget)
        found = planning.plan(search, lengths, args.context, args.max_buckets)
        compared = planning.baselines(search, lengths, args.context)
        for path in args.compare:
            from sharding.table import load_table

            table = load_table(path)
            compared[f"table {path}"] = planning.fixed_table(
                search, lengths, [(b.max_len, b.strategy) for b in table.buckets])
    report = planning.report(found, compared, lengths, {
        "model": args.model, "profile": profile.name, "devices": devices,
        "memory_gib": budget / 2**30, "context": args.context, "lengths": described,
        "batch_sequences": args.batch_sequences, "long_documents": args.long_documents})
    if not main:
        return
    if args.out:
        header = (f"Planned by `hotjax plan` for {args.model} on {devices} devices of "
                  f"{profile.name} ({budget / 2**30:.0f} GiB each), context {args.context}, "
                  f"{args.batch_sequences} sequences of {described} per step: predicted "
                  f"{found.seconds:.3f} s per step.")
        Path(args.out).write_text(found.table().toml(header))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        out = Console(width=None if sys.stdout.isatty() else 120)  # piped: tables unwrapped
        planning.print_report(report, out)
        if args.out:
            out.print(f"table written to {args.out}", markup=False)


def profile_path() -> Path:
    """Where this machine's measured profile is cached: per kind and count of devices and
    processes, and per cost-model version (a profile's constants are fitted through the model,
    so another version's are not read)."""
    import re

    import jax

    from hotjax import cache_root
    from sharding.cost import COST_MODEL_VERSION

    devices = jax.devices()
    kind = re.sub(r"[^A-Za-z0-9]+", "-", devices[0].device_kind).strip("-").lower()
    return (cache_root() / "profiles" / f"cost-model-v{COST_MODEL_VERSION}"
            / f"{kind}-{len(devices)}x{jax.process_count()}.toml")


def local_profile(console, measure: bool = False):
    """This machine's profile: measured once per kind and count of devices, then read from the
    cache (`$HOTJAX_CACHE/profiles`); `measure` measures again. In a run of several processes,
    process 0's cache decides for all (their hosts' caches may differ), so that all measure
    together or all plan with process 0's profile."""
    import tomllib

    import jax

    from hotjax import distributed
    from hotjax.measure import measure_profile, profile_toml
    from sharding.profile import parse_profile

    devices = jax.devices()
    path = profile_path()
    cached = path.read_text() if path.exists() and not measure and distributed.is_main() else ""
    if jax.process_count() > 1:
        cached = distributed.from_process_0(cached)
    if cached:
        try:
            return parse_profile(tomllib.loads(cached), str(path))
        except tomllib.TOMLDecodeError as e:
            raise UserError(f"{path}: not valid TOML ({e}): delete it to measure again") from None
    console.print(f"measuring {len(devices)} {devices[0].device_kind} devices once "
                  f"(saved to {path})")
    with console.status("measuring") as status:
        profile = measure_profile(devices, progress=status.update)
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(".tmp")
        scratch.write_text(profile_toml(profile))
        scratch.replace(path)
    return profile


def _document_lengths(args: argparse.Namespace, console):
    """Document lengths in tokens (BOS and EOS included), where they came from, and the
    tokenizer's vocabulary (None if the report does not say)."""
    import numpy as np

    if args.lengths:
        try:
            stats = json.loads(Path(args.lengths).read_text())
            found = np.asarray(stats["quantiles"], np.int64)
        except FileNotFoundError:
            raise UserError(f"--lengths {args.lengths}: no such file") from None
        except (OSError, ValueError, KeyError, TypeError):
            raise UserError(f"--lengths {args.lengths}: not a report of `hotjax data stats "
                            f"--json`: save one with it") from None
        vocab = stats.get("tokenizer", {}).get("vocab_size")
        return found, f"{stats.get('corpus', {}).get('source', args.lengths)}", vocab
    from hotjax.data import load_tokenizer, open_corpus
    from hotjax.data.stats import document_lengths

    corpus = open_corpus(args.data)
    tokenizer = load_tokenizer(args.tokenizer, corpus, vocab_size=args.vocab_size)
    with console.status(f"tokenizing {corpus.num_documents} documents"):
        found = document_lengths(corpus, tokenizer)
    return found[found > 0], corpus.source, tokenizer.vocab_size
