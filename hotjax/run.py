"""A training run: corpus, tokenizer, model and strategy chosen from options, then the step loop."""

from __future__ import annotations

import dataclasses
import json
import time
import tomllib
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from hotjax import distributed
from hotjax import plan as plan_lib
from hotjax.checkpoint import meta as meta_lib
from hotjax.checkpoint import store
from hotjax.checkpoint.training import restore_state, run_record
from hotjax.config import DEFAULT_MODEL, RunConfig
from hotjax.data import (
    MiniBatches,
    Share,
    cut,
    estimated_lengths,
    load_tokenizer,
    open_corpus,
    typical_rows,
)
from hotjax.optim import OptimConfig
from hotjax.preemption import Preempted, StopSignals
from hotjax.train import Trainer
from models.errors import UserError
from models.llama import LlamaConfig, padded_vocab, preset
from sharding.strategy import Strategy
from sharding.table import StrategyTable, load_table, parse_table

# With no --strategy, 8 devices (8 simulated ones on a CPU-only machine) train under this
# hot-switched bucket table; other device counts use data parallelism at --context.
DEFAULT_TABLE = Path(__file__).parent.parent / "sharding" / "tables" / "default.toml"
DEFAULT_TABLE_DEVICES = 8
UNEVEN = 1.05  # data shards' imbalance (busiest over mean work) worth a word in the summary
AUTO = "auto"  # --strategies auto: a table planned by the cost model


def strategy_table(run: RunConfig, num_devices: int) -> StrategyTable:
    if run.strategy and run.strategies:
        raise UserError("--strategy and --strategies both given: pass one of them")
    if run.strategies:
        table = load_table(run.strategies)
    elif run.strategy is None and num_devices == DEFAULT_TABLE_DEVICES:
        table = load_table(DEFAULT_TABLE)
    else:
        spec = run.strategy or f"data={num_devices},rules=dp"
        table = StrategyTable.single(Strategy.parse(spec), run.context, f"--strategy {spec!r}")
    table.check_devices(num_devices)
    return table


def planned_table(run: RunConfig, config: LlamaConfig, num_devices: int, lengths: np.ndarray,
                  console: Console) -> StrategyTable:
    """`--strategies auto`: the table `hotjax plan` chooses for this machine's devices (its
    profile measured once and cached), the corpus's estimated lengths and the batch size."""
    if run.strategy:
        raise UserError("--strategy and --strategies both given: pass one of them")
    search, typical = auto_search(run, config, num_devices, lengths, console)
    found = plan_lib.plan(search, typical, run.context)
    console.print(f"--strategies auto: planned on profile {search.profile.name}, predicted "
                  f"{found.seconds * 1e3:,.1f} ms per step")
    return parse_table(tomllib.loads(found.toml()), "--strategies auto")


def auto_search(run: RunConfig, config: LlamaConfig, num_devices: int, lengths: np.ndarray,
                console: Console) -> tuple[plan_lib.Search, np.ndarray]:
    """What `--strategies auto` plans with: the search over this machine's devices under its
    cached profile and the memory budget, and the typical step's sequence lengths."""
    from hotjax.plan_cli import local_profile

    profile = local_profile(console)
    budget = (run.device_memory * 2**20 if run.device_memory is not None
              else profile.memory_bytes)
    sequences = cut(lengths, run.context, run.long_documents)
    count = run.batch.get("batch_sequences") or max(
        round(run.batch["batch_tokens"] / sequences.mean()), 1)
    search = plan_lib.Search(config, profile, num_devices, int(budget))
    return search, plan_lib.typical_batch(sequences, count)


def model_config(run: RunConfig, model: LlamaConfig, vocab_size: int) -> LlamaConfig:
    """The model as `run` trains it: its vocabulary the tokenizer's (padded), its compute dtype
    and attention kernel the run's."""
    return dataclasses.replace(model, vocab_size=padded_vocab(vocab_size),
                               compute_dtype=run.compute_dtype, attention=run.attention,
                               attention_block=run.attention_block)


def _model(run: RunConfig, resume: str | Path | None) -> tuple[str, LlamaConfig]:
    """The model to train, and what to call it: the --model preset, or when resuming without
    one, the checkpoint's own (an import of any architecture resumes as it is)."""
    if run.model is None and resume:
        step_dir = store.find(resume)
        return f"of {step_dir}", LlamaConfig.from_dict(meta_lib.read(step_dir)["model"])
    name = run.model or DEFAULT_MODEL
    return name, preset(name)


def select_devices(count: int | None) -> list[jax.Device]:
    available = jax.devices()
    if count is None:
        return available
    if not 1 <= count <= len(available):
        raise UserError(f"--devices {count}: {len(available)} {available[0].platform} devices "
                        f"are available: pass a number from 1 to {len(available)}")
    return available[:count]


def train(run: RunConfig, console: Console | None = None,
          stop: StopSignals | None = None) -> list[dict]:
    """Trains as `run` says; returns each step's metrics (also written to `metrics_jsonl`).

    Once `stop` has a signal, the run stops after the step under way, saves it (given a
    `ckpt_dir`) and raises `Preempted` with its one line."""
    # One process speaks for a run of several: process 0 prints and writes the metrics.
    console = console or Console(stderr=True, quiet=not distributed.is_main())
    if run.metrics_jsonl and not Path(run.metrics_jsonl).parent.is_dir():
        raise UserError(f"--metrics-jsonl {run.metrics_jsonl}: its directory does not exist: "
                        f"create it or choose another path")
    devices = select_devices(run.devices)
    platform = devices[0].platform
    if platform != "cpu":
        kind = ""
    elif jax.local_device_count() == 1 and jax.process_count() > 1:
        kind = f" (one per process, {jax.process_count()} processes: no accelerator found)"
    else:
        kind = " (simulated: no accelerator found)"
    console.print(f"[bold]hotjax[/] on {len(devices)} {platform} device(s){kind}")

    table = None if run.strategies == AUTO else strategy_table(run, len(devices))
    resume = run.resume_from or (run.ckpt_dir and store.latest(run.ckpt_dir))
    model_name, model = _model(run, resume)
    scaling, scale = run.loss_scaling  # checked before the slow set-up
    corpus = open_corpus(run.data)
    tokenizer = load_tokenizer(run.tokenizer, corpus, vocab_size=run.vocab_size)
    config = model_config(run, model, tokenizer.vocab_size)
    lengths = estimated_lengths(corpus, tokenizer)
    if table is None:
        table = planned_table(run, config, len(devices), lengths, console)
    optim = OptimConfig(lr=run.lr, warmup_steps=run.warmup, total_steps=run.steps,
                        loss_scaling=scaling, loss_scale=scale,
                        loss_scale_period=run.loss_scale_period)
    # Each process reads its share of the documents; all then hold the same mini-batches.
    share = (Share(jax.process_index(), jax.process_count(), distributed.gather)
             if jax.process_count() > 1 else None)
    batches = MiniBatches(corpus, tokenizer, [b.max_len for b in table.buckets], **run.batch,
                          long_documents=run.long_documents, seed=run.seed, share=share)
    typical = typical_rows(cut(lengths, table.max_len, run.long_documents),
                           [b.max_len for b in table.buckets], **run.batch)
    trainer = Trainer(config, optim, table, devices, device_memory=run.device_memory,
                      typical_rows=typical, remat=run.remat, timings=run.bucket_timings,
                      balance=run.balance)
    size = ", ".join(f"{v:,} {k.split('_')[1]}" for k, v in run.batch.items())
    console.print(f"model {model_name}: {config.num_params() / 1e6:.1f}M params, "
                  f"{config.compute_dtype} compute | corpus {corpus.source}: "
                  f"{corpus.num_documents} documents | tokenizer {tokenizer.identity} "
                  f"({tokenizer.vocab_size} tokens) | {size} per step")
    console.print(escape(trainer.describe()))
    beyond = float(np.maximum(lengths - table.max_len, 0).sum() / max(lengths.sum(), 1))
    console.print(f"long documents: {beyond:.0%} of the corpus's tokens (estimated) lie past the "
                  f"context of {table.max_len} tokens; "
                  + ("truncation drops them (--long-documents split keeps them)"
                     if run.long_documents == "truncate" else "split into context-length pieces"))
    for note in trainer.notes:
        console.print(escape(f"note: {note}"))

    home = trainer.home
    run_meta = run_record(home, tokenizer=tokenizer, seed=run.seed, table=table,
                          data={"source": corpus.source, "seq_len": table.max_len,
                                "long_documents": run.long_documents, **run.batch})
    checkpoints = (store.Checkpoints(run.ckpt_dir, keep_last=run.keep_last,
                                     keep_every=run.keep_every) if run.ckpt_dir else None)
    if stop is not None and checkpoints:
        stop.on_abort = checkpoints.remove_partial
    stopped = None
    try:
        started = time.perf_counter()
        if resume:
            resumed = restore_state(resume, home, run_meta)
            state, start = resumed.state, resumed.step
            if resumed.data is not None:
                batches.set_state(resumed.data)
            console.print(f"resumed from {resumed.path} (step {start})")
        else:
            state, start = trainer.init(run.seed), 0
        if checkpoints and any(s > start for s in checkpoints.steps()):
            raise UserError(f"--ckpt-dir {checkpoints.directory}: holds step "
                            f"{max(checkpoints.steps())}, past the step resumed from ({start}): "
                            f"saving there would overwrite it: choose another --ckpt-dir")
        if start >= run.steps:
            console.print(f"step {start} reached: nothing to train (--steps {run.steps})")
            return []
        trainer.prepare()
        console.print(f"initialised and compiled in {time.perf_counter() - started:.1f} s")
        if run.device_memory is not None:
            _check_memory(trainer.memory(), run.device_memory, console)

        def save(step: int, state) -> float:
            return checkpoints.save(step, state.params, state.opt_state, run_meta,
                                    batches.get_state())

        history, state, stopped = _loop(run, trainer, state, batches, console, start,
                                        save if checkpoints else None, stop)
        if checkpoints and stopped and stopped not in checkpoints.steps():
            save(stopped, state)
    finally:
        if checkpoints:
            checkpoints.close()  # waits for the last save to commit
    if history:
        _summary(history, console)
    if stopped is not None:
        raise Preempted(_stopped_line(run, stopped, checkpoints), speaks=distributed.is_main())
    return history


def _stopped_line(run: RunConfig, step: int, checkpoints: store.Checkpoints | None) -> str:
    where = f"preempted at step {step}"
    if checkpoints is None:
        return f"{where}: nothing saved (no --ckpt-dir); rerun the same command to start again"
    if step == 0:
        return f"{where}: nothing trained, nothing saved; rerun the same command to start"
    saved = checkpoints.directory / str(step)
    rerun = (f"rerun with --resume-from {saved} in place of --resume-from {run.resume_from}"
             if run.resume_from else "rerun the same command")
    return f"{where}: saved {saved}; {rerun} to resume"


def _check_memory(report: dict[str, int], budget_mib: float, console: Console) -> None:
    """Every part of the run must fit the per-device budget, as XLA's analysis reports it."""
    for part, used in report.items():
        mib = used / 2**20
        if mib > budget_mib:
            raise UserError(f"--device-memory {budget_mib}: the {part} needs {mib:,.1f} MiB per "
                            f"device: use a more sharded strategy for it, or a larger budget")
    console.print(escape("per-device memory (XLA): " + ", ".join(
        f"{part} {used / 2**20:,.1f} MiB" for part, used in report.items())))


def _loop(run, trainer, state, batches, console, start, save, stop
          ) -> tuple[list[dict], object, int | None]:
    """Runs the steps after `start`: each step's metrics, the last state, and the step after
    which a stop signal ended the loop (None: it ran to the end)."""
    history: list[dict] = []
    sink = (open(run.metrics_jsonl, "w")  # noqa: SIM115
            if run.metrics_jsonl and distributed.is_main() else None)
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                        console=console)
    try:
        with progress:
            task = progress.add_task("train", total=run.steps, completed=start, status="")
            for step in range(start + 1, run.steps + 1):
                if stop is not None and stop.agreed():
                    return history, state, step - 1
                batch = next(batches)
                started = time.perf_counter()
                state, metrics = trainer.train_step(state, batch)
                seconds = time.perf_counter() - started
                loss, tokens = metrics["loss"], metrics["tokens"]
                record = {"step": step, **metrics, "seconds": seconds,
                          "tokens_per_s": tokens / seconds}
                if save and (step % (run.save_every or run.steps) == 0 or step == run.steps):
                    # The data position is taken after this step's batch, before the next one's.
                    record["save_seconds"] = save(step, state)
                history.append(record)
                if sink:
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
                status = (f"loss {loss:.4f} | {record['tokens_per_s']:,.0f} tok/s | "
                          f"padding {metrics['padding']:.0%}")
                if metrics["imbalance_before"] > 1:  # data shards of unequal work
                    status += (f" | imbalance {metrics['imbalance']:.2f}"
                               + (f" (from {metrics['imbalance_before']:.2f})"
                                  if metrics["imbalance"] < metrics["imbalance_before"] else ""))
                if metrics.get("skipped"):
                    status += (f" | update skipped: gradients overflowed at loss scale "
                               f"{metrics['loss_scale']:g}")
                progress.update(task, advance=1, status=status)
                if step % run.log_every == 0 or step == run.steps:
                    progress.console.print(f"step {step:>5}  {status}")
    finally:
        if sink:
            sink.close()
    return history, state, None


def _summary(history: list[dict], console: Console) -> None:
    steady = history[1:] or history
    table = Table(title="training summary")
    for column in ("steps", "first loss", "last loss", "real tokens", "padding",
                   "tokens/s (after step 1)"):
        table.add_column(column, justify="right")
    tokens_per_s = sum(r["tokens"] for r in steady) / sum(r["seconds"] for r in steady)
    tokens = sum(r["tokens"] for r in history)
    padding = 1 - tokens / sum(r["slots"] for r in history)
    table.add_row(str(len(history)), f"{history[0]['loss']:.4f}", f"{history[-1]['loss']:.4f}",
                  f"{tokens:,}", f"{padding:.1%}", f"{tokens_per_s:,.0f}")
    console.print(table)
    imbalance = np.mean([r["imbalance"] for r in history])
    if imbalance > UNEVEN:
        before = np.mean([r["imbalance_before"] for r in history])
        console.print(f"data shards: the busiest did {imbalance:.2f}x the mean's estimated work "
                      f"per step (rows in packing order: {before:.2f}x); rows this unequal (a "
                      f"long document filling a row beside rows of short ones) cannot even "
                      f"out over the shards: more rows per micro-step (--device-memory), or "
                      f"context parallelism for the longest bucket, spread them")

