"""A training run: corpus, tokenizer, model and strategy chosen from options, then the step loop."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from hotjax.config import RunConfig
from hotjax.data import PackedBatches, load_tokenizer, open_corpus
from hotjax.errors import UserError
from hotjax.optim import OptimConfig
from hotjax.train import get_trainer
from models.llama import padded_vocab, preset
from sharding.strategy import Strategy
from sharding.table import StrategyTable, load_table


def strategy_table(run: RunConfig, num_devices: int) -> StrategyTable:
    if run.strategy and run.strategies:
        raise UserError("--strategy and --strategies both given: pass one of them")
    if run.strategies:
        table = load_table(run.strategies)
        if len(table.buckets) > 1:
            raise UserError(f"{table.source}: {len(table.buckets)} buckets, but this version "
                            f"trains under one strategy (hot switching between buckets is not "
                            f"built yet): use a table with one [[bucket]], or --strategy")
    else:
        spec = run.strategy or f"data={num_devices},rules=dp"
        table = StrategyTable.single(Strategy.parse(spec), run.context, f"--strategy {spec!r}")
    table.check_devices(num_devices)
    return table


def select_devices(count: int | None) -> list[jax.Device]:
    available = jax.devices()
    if count is None:
        return available
    if not 1 <= count <= len(available):
        raise UserError(f"--devices {count}: {len(available)} {available[0].platform} devices "
                        f"are available: pass a number from 1 to {len(available)}")
    return available[:count]


def train(run: RunConfig, console: Console | None = None) -> list[dict]:
    """Trains as `run` says; returns each step's metrics (also written to `metrics_jsonl`)."""
    console = console or Console(stderr=True)
    if run.steps < 1:
        raise UserError(f"--steps {run.steps}: train for at least one step")
    if run.metrics_jsonl and not Path(run.metrics_jsonl).parent.is_dir():
        raise UserError(f"--metrics-jsonl {run.metrics_jsonl}: its directory does not exist: "
                        f"create it or choose another path")
    devices = select_devices(run.devices)
    platform = devices[0].platform
    console.print(f"[bold]hotjax[/] on {len(devices)} {platform} device(s)"
                  + (" (simulated: no accelerator found)" if platform == "cpu" else ""))

    table = strategy_table(run, len(devices))
    seq_len = table.max_len
    model = preset(run.model)
    corpus = open_corpus(run.data)
    tokenizer = load_tokenizer(run.tokenizer, corpus, vocab_size=run.vocab_size)
    config = dataclasses.replace(model, vocab_size=padded_vocab(tokenizer.vocab_size),
                                 compute_dtype=run.compute_dtype)
    optim = OptimConfig(lr=run.lr, warmup_steps=run.warmup_steps, total_steps=run.steps)
    strategy = table.buckets[0].strategy
    trainer = get_trainer(config, optim, strategy, tuple(devices))
    batches = PackedBatches(corpus, tokenizer, seq_len=seq_len, batch_tokens=run.batch_tokens,
                            seed=run.seed)
    console.print(f"model {run.model}: {config.num_params() / 1e6:.1f}M params, "
                  f"{config.compute_dtype} compute | corpus {corpus.source}: "
                  f"{corpus.num_documents} documents | tokenizer {tokenizer.identity} "
                  f"({tokenizer.vocab_size} tokens) | strategy {strategy} | "
                  f"{batches.rows} rows x {seq_len} tokens per step")

    started = time.perf_counter()
    state = trainer.init(run.seed)
    first = trainer.batch_arrays(next(batches))
    trainer.compiled(first["tokens"].shape)
    console.print(f"initialised and compiled in {time.perf_counter() - started:.1f} s")

    history = _loop(run, trainer, state, first, batches, console)
    _summary(history, console)
    return history


def _loop(run, trainer, state, first, batches, console) -> list[dict]:
    history: list[dict] = []
    sink = open(run.metrics_jsonl, "w") if run.metrics_jsonl else None  # noqa: SIM115
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                        console=console)
    try:
        with progress:
            task = progress.add_task("train", total=run.steps, status="")
            arrays, batch = first, None
            for step in range(1, run.steps + 1):
                if arrays is None:
                    batch = next(batches)
                    arrays = trainer.batch_arrays(batch)
                tokens = int((arrays["segment_ids"] > 0).sum())
                started = time.perf_counter()
                state, metrics = trainer.step(state, arrays)
                loss = float(metrics["loss"])  # waits for the step
                seconds = time.perf_counter() - started
                record = {"step": step, "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                          "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
                history.append(record)
                if sink:
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
                status = f"loss {loss:.4f} | {record['tokens_per_s']:,.0f} tok/s"
                progress.update(task, advance=1, status=status)
                if step % run.log_every == 0 or step == run.steps:
                    progress.console.print(f"step {step:>5}  {status}")
                arrays = None
    finally:
        if sink:
            sink.close()
    return history


def _summary(history: list[dict], console: Console) -> None:
    steady = history[1:] or history
    table = Table(title="training summary")
    for column in ("steps", "first loss", "last loss", "tokens", "tokens/s (after step 1)"):
        table.add_column(column, justify="right")
    tokens_per_s = sum(r["tokens"] for r in steady) / sum(r["seconds"] for r in steady)
    table.add_row(str(len(history)), f"{history[0]['loss']:.4f}", f"{history[-1]['loss']:.4f}",
                  f"{sum(r['tokens'] for r in history):,}", f"{tokens_per_s:,.0f}")
    console.print(table)

