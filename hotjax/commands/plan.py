"""`hotjax plan`: a strategy table chosen by the cost model for a model, a cluster and a corpus,
with a report of what each bucket is predicted to cost beside the best single strategy (and with
`--target`, whether each bucket fits as XLA:GPU compiles it, without a GPU)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hotjax import bounds
from hotjax.commands.options import (
    DATA,
    MODEL,
    add_options,
    add_process_options,
    processes,
    run_config,
)
from hotjax.config import DEFAULT_MODEL, at_least, positive, shown_bytes
from hotjax.errors import UserError

if TYPE_CHECKING:
    import numpy as np

    from hotjax.planning.search import Choice, Plan


def register(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="choose buckets and a strategy per bucket with the "
                               "cost model, and write them as a strategy table")
    plan.set_defaults(handler=_plan)
    profiles = plan.add_mutually_exclusive_group()
    profiles.add_argument("--profile", help="hardware profile: a shipped one (a800-4x8, "
                          "h100-1x8) or a .toml file (default: this machine's, measured once "
                          "and cached)")
    profiles.add_argument("--measure", action="store_true", help="measure this machine's "
                          "devices now (matmuls, attention, collectives) and cache the profile")
    plan.add_argument("--quick-measure", action="store_true", help="with --measure: small "
                      "sizes and few repeats (seconds; a smoke test of the measurement, whose "
                      "profile plans roughly)")
    plan.add_argument("--target", metavar="GPU|FILE", help="also compile each planned bucket's "
                      "micro-step for this GPU (h100, a100, a800, or an XLA target config file; "
                      "no GPU needed) and report whether it fits by XLA:GPU's memory analysis; "
                      "the budget defaults to the GPU's memory, the profile to the shipped one "
                      "of that GPU")
    plan.add_argument("--devices", type=int, help="devices to plan for (default: all of the "
                      "profile's)")
    # The run `hotjax train --strategies auto` makes with the same options: planned alike.
    add_options(plan, *MODEL, *DATA, "device_memory", "optimizer")
    plan.add_argument("--memory-gib", type=float, help="--device-memory in GiB (the older "
                      "form)")
    plan.add_argument("--lengths", metavar="STATS.json", help="instead of --data: the document "
                      "lengths of a corpus, as `hotjax data stats --json` saves them")
    plan.add_argument("--max-buckets", type=int, default=4,
                      help="at most this many buckets (default: %(default)s)")
    plan.add_argument("--compare", metavar="TABLE.toml", action="append", default=[],
                      help="also predict this table's step (repeatable)")
    plan.add_argument("--out", metavar="TABLE.toml", help="write the table here")
    plan.add_argument("--json", action="store_true", help="print the report as JSON")
    add_process_options(plan)  # --measure across processes, under `hotjax launch`


def _plan(args: argparse.Namespace) -> None:
    from hotjax.startup import start_jax

    target, memory = _target_and_memory(args)  # checked before JAX starts
    run = run_config(args, devices=None, device_memory=memory)
    start_jax(None, processes(args))
    from rich.console import Console

    from hotjax import distributed
    from hotjax.planning import search as planning
    from hotjax.planning.measure import local_profile
    from hotjax.planning.profile import load_profile
    from hotjax.run import model_config, named_model, plan_search

    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise UserError(f"--out {args.out}: its directory does not exist: create it or choose "
                        f"another path")
    main = distributed.is_main()  # under `hotjax launch`, process 0 reports and writes
    console = Console(stderr=True, quiet=not main)
    documents, described, vocab = _document_lengths(args)  # checked before the measuring
    profile = (load_profile(args.profile) if args.profile else _target_profile(target)
               if target is not None else local_profile(console, args.measure,
                                                         quick=args.quick_measure))
    devices = args.devices or profile.num_devices
    model = named_model(run.model or DEFAULT_MODEL)
    config = model_config(run, model, vocab or model.vocab_size)
    with console.status("searching"):
        search, lengths = plan_search(run, config, devices, documents, console, profile)
        found = planning.plan(search, lengths, run.context, args.max_buckets)
        compared = planning.baselines(search, lengths, run.context)
        for path in args.compare:
            from hotjax.sharding.table import load_table

            table = load_table(path)
            compared[f"table {path}"] = planning.fixed_table(
                search, lengths, [(b.max_len, b.strategy) for b in table.buckets])
    budget = search.budget
    report = _report(found, compared, lengths, {
        "model": run.model or DEFAULT_MODEL, "profile": profile.name, "devices": devices,
        "memory_gib": budget / 2**30, "context": run.context, "lengths": described,
        "batch_sequences": len(lengths), **run.batch,
        "long_documents": run.long_documents})
    if target is not None:
        with console.status(f"compiling each bucket's micro-step for {target.description}"):
            _compile_for_target(report, found, search, target)
    if not main:
        return
    if args.out:
        header = (f"Planned by `hotjax plan` for {run.model or DEFAULT_MODEL} on {devices} "
                  f"devices of {profile.name} ({shown_bytes(budget)} each), context {run.context}, "
                  f"{len(lengths)} sequences of {described} per step: predicted "
                  f"{found.expected_seconds:.3f} s per step.")
        Path(args.out).write_text(found.table().toml(header))
    _print(args, report, target, budget)


def _target_and_memory(args: argparse.Namespace):
    """The options checked: the `--target` GPU prepared (None without one), and the device
    memory to plan within (None: the profile's)."""
    from hotjax import targets

    for flag, value in (("--max-buckets", args.max_buckets), ("--devices", args.devices)):
        at_least(flag, value, 1)
    positive("--memory-gib", args.memory_gib)
    if args.memory_gib and args.device_memory:
        raise UserError("--device-memory and --memory-gib both given: pass one of them")
    if args.lengths and args.data:
        raise UserError("--lengths and --data both given: pass one of them")
    target = targets.prepare(args.target)  # before JAX starts: it runs on the CPU
    if args.quick_measure and not args.measure:
        raise UserError("--quick-measure: it sizes a measurement: add --measure")
    if target is not None and args.measure:
        raise UserError(f"--target {args.target} --measure: a target is compiled for, not "
                        f"measured: plan with --profile (or without, the target's own)")
    memory = args.device_memory or (round(args.memory_gib * 2**30) if args.memory_gib else None)
    if memory is None and target is not None:
        from hotjax.planning.profile import allocator_fraction

        # What JAX's allocator hands a hotjax process of the target's memory, as a profile's.
        memory = round(target.memory * allocator_fraction("gpu"))
    return target, memory


def _print(args: argparse.Namespace, report: dict, target, budget: int) -> None:
    """The plan's report: JSON, or its tables."""
    from rich.console import Console

    if args.json:
        print(json.dumps(report, indent=1))
        return
    out = Console(width=None if sys.stdout.isatty() else 120)  # piped: tables unwrapped
    _tables(report, out)
    if target is not None:
        out.print(f"fits, per XLA:GPU: each bucket's micro-step compiled for "
                  f"{report['target']['device']} on this machine without one; its peak "
                  f"beside the home's state against {shown_bytes(budget)}",
                  markup=False, highlight=False)
    if args.out:
        out.print(f"table written to {args.out}", markup=False)


def _target_profile(target):
    """The shipped profile of `target`'s GPU (`h100` plans for `h100-1x8`)."""
    from hotjax.planning.profile import PROFILES, load_profile

    found = sorted(PROFILES.glob(f"{target.name}-*.toml"))
    if not found:
        names = ", ".join(sorted(p.stem for p in PROFILES.glob("*.toml")))
        raise UserError(f"--target {target.name}: no shipped profile of that GPU ({names}): "
                        f"name its cluster with --profile")
    return load_profile(found[0].stem)


def _compile_for_target(report: dict, found, search, target) -> None:
    """Each planned bucket's micro-step compiled for `target` (the trainer's accumulation:
    partial sums where they fit, else sharded), its XLA:GPU peak per device beside the home's
    state and against the plan's budget, added to the report's buckets."""
    import dataclasses

    from hotjax import targets
    from hotjax.sharding.strategy import ACCUMULATE
    from hotjax.step import bucket_step, step_memory

    home = search.resident[found.home]
    for choice, entry in zip(found.buckets, report["plan"]["buckets"], strict=True):
        devices = tuple(targets.devices(target, choice.strategy.num_devices))
        config = dataclasses.replace(search.config, remat=choice.remat)
        for accumulate in ACCUMULATE:
            step = bucket_step(config, choice.strategy, devices, accumulate)
            peak = step_memory(step.compiled((choice.micro_rows, choice.max_len)))["peak"]
            if peak + home <= search.budget:
                break
        entry["xla_gpu"] = {"peak_gib": (peak + home) / 2**30, "step_peak_bytes": peak,
                            "home_bytes": home, "accumulate": accumulate,
                            "fits": peak + home <= search.budget}
    report["target"] = {"name": target.name, "device": target.description,
                        "memory_bytes": target.memory}


def _document_lengths(args: argparse.Namespace):
    """Document lengths in tokens (BOS and EOS included), where they came from, and the
    tokenizer's vocabulary (None if the report does not say)."""
    import numpy as np

    if args.lengths:
        try:
            if not Path(args.lengths).is_file():
                raise UserError(f"--lengths {args.lengths}: no such file")
            stats = bounds.read_json(Path(args.lengths), "lengths report",
                                     "save one with `hotjax data stats --json`")
            found = np.asarray(stats["quantiles"], np.int64)
        except (OSError, ValueError, KeyError, TypeError):
            raise UserError(f"--lengths {args.lengths}: not a report of `hotjax data stats "
                            f"--json`: save one with it") from None
        vocab = stats.get("tokenizer", {}).get("vocab_size")
        return found, f"{stats.get('corpus', {}).get('source', args.lengths)}", vocab
    from hotjax.data import estimated_lengths, load_tokenizer, open_corpus
    from hotjax.data.tokenizer import SpecialTokens

    corpus = open_corpus(args.data, args.text_field, args.data_split)
    tokenizer = load_tokenizer(args.tokenizer, corpus, vocab_size=args.vocab_size,
                               specials=SpecialTokens.of(args))
    # Estimated from a sample, as `hotjax train` estimates them for `--strategies auto`.
    return estimated_lengths(corpus, tokenizer), corpus.source, tokenizer.vocab_size


def _report(found: Plan, compared: dict[str, Plan | None], lengths: np.ndarray,
            setting: dict) -> dict:
    """The plan and its comparisons as plain data."""
    tokens = int(lengths.sum())

    def bucket(b: Choice) -> dict:
        return {"low": b.low, "max_len": b.max_len, "strategy": str(b.strategy),
                "micro_rows": b.micro_rows, "remat": b.remat, "micro_steps": b.micro_steps,
                "rows": b.rows, "sequences": b.sequences, "token_share": b.tokens / tokens,
                "seconds": b.seconds, "imbalance": b.imbalance,
                "peak_gib": b.peak_bytes / 2**30}

    def summary(p: Plan | None) -> dict | None:
        return None if p is None else {
            "seconds": p.seconds, "switch_seconds": p.switch_seconds,
            "speedup_of_plan": p.seconds / found.seconds,
            "buckets": [bucket(b) for b in p.buckets]}

    drawn = {"drawn_seconds": list(found.drawn_seconds),
             "expected_seconds": found.expected_seconds} if found.drawn_seconds else {}
    return {**setting, "plan": {**summary(found), "home": str(found.home), "why": found.why,
                                **drawn},
            "compared": {name: summary(p) for name, p in compared.items()}}


def _tables(data: dict, console) -> None:
    """The plan's buckets and its predicted step beside the compared ones, as tables."""
    from rich.markup import escape
    from rich.table import Table

    plan = data["plan"]
    table = Table(title=f"plan for {data['model']} on {data['devices']} devices of "
                        f"{data['profile']} ({data['memory_gib']:.0f} GiB each), context "
                        f"{data['context']:,}, {data['batch_sequences']} sequences of "
                        f"{data['lengths']} per step")
    compiled = "target" in data  # `hotjax plan --target`: each bucket compiled for a GPU
    for column in ("lengths", "strategy", "micro_rows", "remat", "micro-steps", "tokens",
                   "predicted s", "peak GiB", *(("fits, per XLA:GPU",) if compiled else ())):
        table.add_column(column, justify="left" if column in ("lengths", "strategy",
                                                               "remat") else "right")
    for b in plan["buckets"]:
        xla = b.get("xla_gpu")
        table.add_row(f"({b['low']:,}, {b['max_len']:,}]", escape(b["strategy"]),
                      f"{b['micro_rows']} x {b['max_len']:,}", b["remat"],
                      str(b["micro_steps"]), f"{b['token_share']:.1%}", f"{b['seconds']:.3f}",
                      f"{b['peak_gib']:.1f}", *((f"{xla['peak_gib']:.1f} "
                                                  + ("yes" if xla["fits"] else "[red]no[/]"),)
                                                 if compiled else ()))
    console.print(table)
    steps = Table(title="predicted step time")
    for column in ("", "seconds", "switches s", "vs the plan"):
        steps.add_column(column, justify="left" if not column else "right")
    steps.add_row(escape(f"the plan (home {plan['home']})"), f"{plan['seconds']:.3f}",
                  f"{plan['switch_seconds']:.3f}", "1.00x")
    if "drawn_seconds" in plan:
        drawn = plan["drawn_seconds"]
        steps.add_row(f"the plan on {len(drawn)} drawn mini-batches: mean (fastest-slowest)",
                      f"{plan['expected_seconds']:.3f} ({min(drawn):.3f}-{max(drawn):.3f})", "",
                      "")
    for name, p in data["compared"].items():
        if p is None:
            steps.add_row(escape(name), "does not fit", "", "")
        else:
            steps.add_row(escape(f"{name}: " + " | ".join(b["strategy"] for b in p["buckets"])),
                          f"{p['seconds']:.3f}", f"{p['switch_seconds']:.3f}",
                          f"{p['speedup_of_plan']:.2f}x")
    console.print(steps)
    if plan["why"]:
        console.print(escape(f"planned: {plan['why']}"))
