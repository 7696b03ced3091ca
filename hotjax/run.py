"""A training run: corpus, tokenizer, model, strategy table and trainer assembled from a
`RunConfig` (`Run`, the library's entry point), and `hotjax train`'s loop over it (`train`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from hotjax import distributed
from hotjax.checkpoint import lock as ckpt_lock
from hotjax.checkpoint import meta as meta_lib
from hotjax.checkpoint import store
from hotjax.checkpoint.training import restore_state, run_record
from hotjax.config import DEFAULT_MODEL, RunConfig
from hotjax.data import (
    MiniBatch,
    MiniBatches,
    Share,
    cut,
    estimated_lengths,
    load_tokenizer,
    open_corpus,
    typical_rows,
)
from hotjax.data.corpus import check_batch
from hotjax.optim import OptimConfig
from hotjax.planning import search as plan_lib
from hotjax.planning.measure import local_profile
from hotjax.planning.profile import Profile
from hotjax.preemption import Preempted, StopSignals
from hotjax.step import TrainState
from hotjax.train import Trainer
from models.errors import UserError
from models.llama import LlamaConfig, as_trained, preset
from sharding.strategy import Strategy
from sharding.table import StrategyTable, load_table

# With no --strategy, 8 devices (8 simulated ones on a CPU-only machine) train under this
# hot-switched bucket table; other device counts use data parallelism at --context.
DEFAULT_TABLE = Path(__file__).parent.parent / "sharding" / "tables" / "default.toml"
DEFAULT_TABLE_DEVICES = 8
UNEVEN = 1.05  # data shards' imbalance (busiest over mean work) worth a word in the summary
AUTO = "auto"  # --strategies auto: a table planned by the cost model


def resumed_config(path: str | Path, **overrides) -> RunConfig:
    """The `RunConfig` that continues the run saved at `path` (a step directory, or a
    checkpoint directory's latest): its model, corpus, tokenizer, batch size, context, seed and
    optimizer settings as recorded, resuming from `path`, with `overrides` (devices, strategy,
    steps, ...) on top. Any device count, mesh or strategy table restores it."""
    step_dir = store.find(path)
    meta = meta_lib.read(step_dir)
    data, optim, model = meta.get("data") or {}, meta.get("optimizer") or {}, meta["model"]
    tokenizer = data.get("tokenizer") or (
        "bytes" if (meta.get("tokenizer") or {}).get("identity") == "bytes" else None)
    scaling = optim.get("loss_scaling", "off")
    settings = {
        "data": data.get("source"), "tokenizer": tokenizer,
        "vocab_size": data.get("vocab_size", RunConfig.vocab_size),
        "context": data.get("seq_len", RunConfig.context),
        "long_documents": data.get("long_documents", RunConfig.long_documents),
        "batch_tokens": data.get("batch_tokens"), "batch_sequences": data.get("batch_sequences"),
        "seed": data.get("seed", RunConfig.seed),
        "compute_dtype": model.get("compute_dtype", RunConfig.compute_dtype),
        "attention": model.get("attention", RunConfig.attention),
        "attention_block": model.get("attention_block", RunConfig.attention_block),
        "lr": optim.get("lr", RunConfig.lr), "warmup_steps": optim.get("warmup_steps"),
        "steps": optim.get("total_steps", RunConfig.steps),
        "loss_scale": scaling if scaling != "static" else str(optim["loss_scale"]),
        "initial_loss_scale": optim.get("loss_scale", RunConfig.initial_loss_scale),
        "loss_scale_period": optim.get("loss_scale_period", RunConfig.loss_scale_period),
        "resume_from": str(step_dir)}
    return RunConfig(**{**settings, **overrides})


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
    search, typical = plan_search(run, config, num_devices, lengths, console)
    found = plan_lib.plan(search, typical, run.context)
    console.print(f"--strategies auto: planned on profile {search.profile.name}, predicted "
                  f"{found.seconds * 1e3:,.1f} ms per step")
    return found.table("--strategies auto")


def plan_search(run: RunConfig, config: LlamaConfig, num_devices: int, lengths: np.ndarray,
                console: Console, profile: Profile | None = None
                ) -> tuple[plan_lib.Search, np.ndarray]:
    """What `hotjax plan` and `--strategies auto` plan with, alike: the search over
    `num_devices` under `profile` (default: this machine's, measured once and cached) and
    the run's memory budget, and the typical step's sequence lengths from the documents'
    `lengths`, cut to the context and counted by the batch size as training cuts them."""
    profile = profile or local_profile(console)
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
    return as_trained(model, vocab_size, compute_dtype=run.compute_dtype,
                      attention=run.attention, attention_block=run.attention_block)


def _model(run: RunConfig, resume: str | Path | None) -> tuple[str, LlamaConfig]:
    """The model to train, and what to call it: the --model preset, or when resuming without
    one, the checkpoint's own (an import of any architecture resumes as it is)."""
    if run.model is None and resume:
        step_dir = store.find(resume)
        return f"of {step_dir}", LlamaConfig.checked(
            meta_lib.read(step_dir)["model"], f"{step_dir / meta_lib.META_FILE}: model",
            meta_lib.DAMAGED)
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


class Run:
    """A training run assembled from a `RunConfig`: the devices, corpus, tokenizer, model,
    strategy table, trainer and mini-batches that `hotjax train` uses. `hotjax train` is one
    loop over it; your own loop drives it the same way:

        with Run(RunConfig(model="tiny", steps=100)) as run:
            state, step = run.initial_state()       # fresh, or resumed as the config says
            for step in range(step + 1, run.config.steps + 1):
                state, metrics = run.step(state)    # one optimizer update over all buckets
                if step % 50 == 0:
                    run.save(step, state)           # into run.config.ckpt_dir

    A state restored from a checkpoint (`restore`, or `initial_state` with `resume_from` or a
    `ckpt_dir` holding one) is laid out in this run's home strategy, whatever mesh wrote it.
    JAX must have been started first (`hotjax.start_jax`), for the device count and the
    compilation cache. `console` gets the run's header (default: stderr, process 0 only).
    A `ckpt_dir` is this run's alone until `close` (a second run there stops at its start)."""

    def __init__(self, config: RunConfig, console: Console | None = None):
        self.config = run = config
        self.console = console = console or Console(stderr=True, quiet=not distributed.is_main())
        self.checkpoints: store.Checkpoints | None = None
        # Before anything slow: a checkpoint directory that takes files, and no other run's.
        self._lock = ckpt_lock.hold(run.ckpt_dir) if run.ckpt_dir else None
        try:
            self._assemble(run, console)
        except BaseException:
            self._release()
            raise

    def _assemble(self, run: RunConfig, console: Console) -> None:
        self.devices = devices = select_devices(run.devices)
        platform = devices[0].platform
        if platform != "cpu":
            kind = ""
        elif jax.local_device_count() == 1 and jax.process_count() > 1:
            kind = f" (one per process, {jax.process_count()} processes: no accelerator found)"
        else:
            kind = " (simulated: no accelerator found)"
        console.print(f"[bold]hotjax[/] on {len(devices)} {platform} device(s){kind}")

        table = None if run.strategies == AUTO else strategy_table(run, len(devices))
        self.resume_path = run.resume_from or (run.ckpt_dir and store.latest(run.ckpt_dir))
        self.model_name, model = _model(run, self.resume_path)
        scaling, scale = run.loss_scaling  # checked before the slow set-up
        self.corpus = corpus = open_corpus(run.data)
        check_batch(corpus, context=table.max_len if table else run.context,
                    long_documents=run.long_documents, **run.batch)
        self.tokenizer = tokenizer = load_tokenizer(run.tokenizer, corpus,
                                                    vocab_size=run.vocab_size)
        self.model = model_config(run, model, tokenizer.vocab_size)
        self.lengths = lengths = estimated_lengths(corpus, tokenizer)
        if table is None:
            table = planned_table(run, self.model, len(devices), lengths, console)
        self.optim = OptimConfig(lr=run.lr, warmup_steps=run.warmup, total_steps=run.steps,
                                 loss_scaling=scaling, loss_scale=scale,
                                 loss_scale_period=run.loss_scale_period)
        # Each process reads its share of the documents; all then hold the same mini-batches.
        share = (Share(jax.process_index(), jax.process_count(), distributed.gather)
                 if jax.process_count() > 1 else None)
        max_lens = [b.max_len for b in table.buckets]
        self.batches = MiniBatches(corpus, tokenizer, max_lens, **run.batch,
                                   long_documents=run.long_documents, seed=run.seed, share=share)
        typical = typical_rows(cut(lengths, table.max_len, run.long_documents), max_lens,
                               **run.batch)
        self.trainer = Trainer(self.model, self.optim, table, devices,
                               device_memory=run.device_memory, typical_rows=typical,
                               remat=run.remat, timings=run.bucket_timings, balance=run.balance)
        # The table as it runs: its home is the trainer's, chosen or given.
        self.table = dataclasses.replace(table, home=self.trainer.home.layout.strategy)
        self.record = run_record(self.trainer.home, tokenizer=tokenizer, seed=run.seed,
                                 table=self.table,
                                 data={"source": corpus.source, "seq_len": table.max_len,
                                       "long_documents": run.long_documents, **run.batch,
                                       "tokenizer": run.tokenizer,
                                       "vocab_size": run.vocab_size})
        self.checkpoints = (store.Checkpoints(run.ckpt_dir, keep_last=run.keep_last,
                                              keep_every=run.keep_every)
                            if run.ckpt_dir else None)
        size = ", ".join(f"{v:,} {k.split('_')[1]}" for k, v in run.batch.items())
        console.print(f"model {self.model_name}: {self.model.num_params() / 1e6:.1f}M params, "
                      f"{self.model.compute_dtype} compute | corpus {corpus.source}: "
                      f"{corpus.num_documents} documents | tokenizer {tokenizer.identity} "
                      f"({tokenizer.vocab_size} tokens) | {size} per step")
        console.print(escape(self.trainer.describe()))
        beyond = float(np.maximum(lengths - table.max_len, 0).sum() / max(lengths.sum(), 1))
        console.print(f"long documents: {beyond:.0%} of the corpus's tokens (estimated) lie "
                      f"past the context of {table.max_len} tokens; "
                      + ("truncation drops them (--long-documents split keeps them)"
                         if run.long_documents == "truncate"
                         else "split into context-length pieces"))
        for note in self.trainer.notes:
            console.print(escape(f"note: {note}"))

    def init(self, seed: int | None = None) -> TrainState:
        """A fresh state in the home strategy (default seed: the config's)."""
        return self.trainer.init(self.config.seed if seed is None else seed)

    def restore(self, path: str | Path) -> tuple[TrainState, int]:
        """The state saved at `path` (a step directory, or a checkpoint directory's latest) on
        this run's devices and home strategy, and its step; the mini-batches continue where
        that run's were."""
        resumed = restore_state(path, self.trainer.home, self.record)
        if resumed.data is not None:
            self.batches.set_state(resumed.data)
        self.console.print(f"resumed from {resumed.path} (step {resumed.step})")
        return resumed.state, resumed.step

    def initial_state(self) -> tuple[TrainState, int]:
        """Where training starts: the checkpoint `resume_from` names, else the latest in
        `ckpt_dir`, else a fresh state at step 0."""
        if self.resume_path:
            return self.restore(self.resume_path)
        return self.init(), 0

    def compile(self) -> None:
        """Compile every bucket's step now (else the first step does)."""
        self.trainer.prepare()

    def next_batch(self) -> MiniBatch:
        """The next mini-batch: its sequences packed into rows per bucket."""
        return next(self.batches)

    def step(self, state: TrainState, batch: MiniBatch | None = None
             ) -> tuple[TrainState, dict]:
        """One optimizer update on `batch` (default: the next mini-batch); `state` is donated.
        The metrics are plain numbers: loss, grad_norm, tokens, padding, imbalance, and per
        bucket what ran and what moved."""
        return self.trainer.train_step(state, self.next_batch() if batch is None else batch)

    def evaluate(self, state: TrainState, batch: MiniBatch) -> dict:
        """The loss of `state` on `batch` without updating it (forward only, every bucket
        under its strategy): loss, targets, tokens."""
        return self.trainer.evaluate(state, batch)

    def minibatches(self, data: str | None = None, seed: int | None = None) -> MiniBatches:
        """Mini-batches of another corpus (held-out data, say) as this run makes its own: its
        tokenizer, buckets, batch size and long-document handling (default: this run's corpus
        and seed)."""
        run = self.config
        corpus = self.corpus if data is None else open_corpus(data)
        return MiniBatches(corpus, self.tokenizer, [b.max_len for b in self.table.buckets],
                           **run.batch, long_documents=run.long_documents,
                           seed=run.seed if seed is None else seed)

    def save(self, step: int, state: TrainState) -> float:
        """Saves `state` as step `step` into `ckpt_dir` (written in the background, atomic: a
        step is complete or absent), with the data position; returns the seconds it blocked."""
        if self.checkpoints is None:
            raise UserError("saving needs a checkpoint directory: set ckpt_dir (--ckpt-dir)")
        return self.checkpoints.save(step, state.params, state.opt_state, self.record,
                                     self.batches.get_state())

    def close(self) -> None:
        """Waits for the last save to commit; then the checkpoint directory is free."""
        try:
            if self.checkpoints:
                self.checkpoints.close()
        finally:
            self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, failed: type[BaseException] | None, *exc) -> None:
        if failed is None:
            self.close()
            return
        # The run's own failure is the one to report: its save failing again as it closes
        # (the same full disk) says nothing more.
        with contextlib.suppress(Exception):
            self.close()


def train(run: RunConfig, console: Console | None = None,
          stop: StopSignals | None = None) -> list[dict]:
    """Trains as `run` says; returns each step's metrics (also written to `metrics_jsonl`).

    Once `stop` has a signal, the run stops after the step under way, saves it (given a
    `ckpt_dir`) and raises `Preempted` with its one line."""
    if run.metrics_jsonl and not Path(run.metrics_jsonl).parent.is_dir():
        raise UserError(f"--metrics-jsonl {run.metrics_jsonl}: its directory does not exist: "
                        f"create it or choose another path")
    with Run(run, console) as assembled:
        checkpoints, console = assembled.checkpoints, assembled.console
        if stop is not None and checkpoints:
            stop.on_abort = checkpoints.remove_partial
        started = time.perf_counter()
        state, start = assembled.initial_state()
        if checkpoints and any(s > start for s in checkpoints.steps()):
            raise UserError(f"--ckpt-dir {checkpoints.directory}: holds step "
                            f"{max(checkpoints.steps())}, past the step resumed from ({start}): "
                            f"saving there would overwrite it: choose another --ckpt-dir")
        if start >= run.steps:
            console.print(f"step {start} reached: nothing to train (--steps {run.steps})")
            return []
        assembled.compile()
        console.print(f"initialised and compiled in {time.perf_counter() - started:.1f} s")
        if run.device_memory is not None:
            _check_memory(assembled.trainer.memory(), run.device_memory, console)
        history, state, stopped = _loop(assembled, state, start,
                                        assembled.save if checkpoints else None, stop)
        if checkpoints and stopped and stopped not in checkpoints.steps():
            assembled.save(stopped, state)
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


def _loop(assembled: Run, state, start, save, stop) -> tuple[list[dict], object, int | None]:
    """Runs the steps after `start`: each step's metrics, the last state, and the step after
    which a stop signal ended the loop (None: it ran to the end)."""
    run, console = assembled.config, assembled.console
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
                batch = assembled.next_batch()
                started = time.perf_counter()
                state, metrics = assembled.step(state, batch)
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

