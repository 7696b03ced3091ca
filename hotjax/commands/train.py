"""`hotjax train`: one loop over a `Run` built from the options, with a progress bar and a line
every `--log-every` steps on stderr, evaluations, metric sinks (`hotjax.tracking`), a trace,
checkpoints, stop signals, and a summary on stdout."""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import TYPE_CHECKING

from hotjax.commands import config_file
from hotjax.commands.options import (
    OPTIMIZATION,
    OPTIONS,
    TRACKING,
    add_options,
    add_preempt_signal,
    add_process_options,
    processes,
    run_config,
)
from hotjax.config import RunConfig, shown_bytes
from hotjax.errors import UserError
from hotjax.preemption import Preempted, StopSignals, parse_signal

if TYPE_CHECKING:
    from rich.console import Console

    from hotjax.checkpoint.store import Checkpoints
    from hotjax.data import MiniBatch
    from hotjax.run import Run
    from hotjax.tracking import Sink

SUMMARY_WIDTH = 160  # characters of the summary written to a file or pipe
UNEVEN = 1.05  # data shards' imbalance (busiest over mean work) worth a word in the summary
CHECKPOINTS = ("ckpt_dir", "save_every", "resume_from", "weights_only", "new_schedule",
               "keep_last", "keep_every")


def register(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train", help="train a LLaMA model (default: the small preset on the Python stdlib)")
    train.set_defaults(handler=_train)
    config_file.add_option(train)
    add_options(train, *(name for name in OPTIONS
                         if name not in CHECKPOINTS + TRACKING + OPTIMIZATION))
    add_options(train.add_argument_group("optimizer and learning-rate schedule"), *OPTIMIZATION)
    add_options(train.add_argument_group("evaluation and tracking"), *TRACKING)
    add_process_options(train)
    ckpt = train.add_argument_group("checkpoints")
    add_options(ckpt, *CHECKPOINTS)
    add_preempt_signal(ckpt)


def _train(args: argparse.Namespace) -> None:
    run = run_config(args)  # every option checked before JAX starts
    # Watched before JAX starts its threads, which then inherit the blocked signals.
    with StopSignals(parse_signal(args.preempt_signal)) as stop:
        from hotjax.startup import start_jax

        devices = start_jax(args.devices, processes(args))
        import jax

        from hotjax import distributed

        try:
            train(run, stop=stop, devices=devices)
        except jax.errors.JaxRuntimeError as e:
            lost = distributed.lost_peer(e, jax.process_index(), jax.process_count())
            if lost is None:
                raise
            raise UserError(lost) from None


def train(run: RunConfig, console: Console | None = None, stop: StopSignals | None = None,
          devices=None) -> list[dict]:
    """Trains as `run` says; returns each step's metrics (also written to `metrics_jsonl`).

    Once `stop` has a signal, the run stops after the step under way, saves it (given a
    `ckpt_dir`) and raises `Preempted` with its one line."""
    from hotjax import distributed, tracking
    from hotjax.run import Run

    sinks = tracking.open_sinks(run) if distributed.is_main() else []
    with contextlib.ExitStack() as closing:
        closing.callback(tracking.close, sinks)
        assembled = closing.enter_context(Run.from_config(run, console, devices))
        checkpoints, console = assembled.checkpoints, assembled.console
        _header(assembled, run)
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
            _check_memory(assembled, run.device_memory)
        history, state, stopped = _loop(assembled, run, state, start,
                                        assembled.save if checkpoints else None, stop, sinks)
        if checkpoints and stopped and stopped not in checkpoints.steps():
            assembled.save(stopped, state)
    if history:
        _summary(history)
    if stopped is not None:
        raise Preempted(_stopped_line(run, stopped, checkpoints), speaks=distributed.is_main())
    return history


def _header(assembled: Run, run: RunConfig) -> None:
    """What the run is: its devices, model, corpus, tokenizer, layouts and notes."""
    import jax
    import numpy as np
    from rich.markup import escape

    console, devices, model = assembled.console, assembled.devices, assembled.model
    platform = devices[0].platform
    if platform != "cpu":
        kind = ""
    elif jax.local_device_count() == 1 and jax.process_count() > 1:
        kind = f" (one per process, {jax.process_count()} processes: no accelerator found)"
    else:
        kind = " (simulated: no accelerator found)"
    console.print(f"[bold]hotjax[/] on {len(devices)} {platform} device(s){kind}")
    corpus, tokenizer = assembled.batches.corpus, assembled.tokenizer
    size = ", ".join(f"{v:,} {k.split('_')[1]}" for k, v in run.batch.items())
    console.print(f"model {assembled.name}: {model.num_params() / 1e6:.1f}M params, "
                  f"{model.compute_dtype} compute | corpus {corpus.source}: "
                  f"{corpus.num_documents} documents | tokenizer {tokenizer.identity} "
                  f"({tokenizer.vocab_size} tokens) | {size} per step")
    console.print(escape(assembled.trainer.describe()))
    lengths, context = assembled.lengths, assembled.table.max_len
    beyond = float(np.maximum(lengths - context, 0).sum() / max(lengths.sum(), 1))
    console.print(f"long documents: {beyond:.0%} of the corpus's tokens (estimated) lie "
                  f"past the context of {context} tokens; "
                  + ("truncation drops them (--long-documents split keeps them)"
                     if run.long_documents == "truncate" else "split into context-length pieces"))
    for note in assembled.trainer.notes:
        console.print(escape(f"note: {note}"))


def _stopped_line(run: RunConfig, step: int, checkpoints: Checkpoints | None) -> str:
    where = f"preempted at step {step}"
    if checkpoints is None:
        return f"{where}: nothing saved (no --ckpt-dir); rerun the same command to start again"
    if step == 0:
        return f"{where}: nothing trained, nothing saved; rerun the same command to start"
    saved = checkpoints.directory / str(step)
    rerun = (f"rerun with --resume-from {saved} in place of --resume-from {run.resume_from}"
             if run.resume_from else "rerun the same command")
    return f"{where}: saved {saved}; {rerun} to resume"


def _check_memory(assembled: Run, budget: int) -> None:
    """Every part of the run must fit the per-device budget, as XLA's analysis reports it."""
    from rich.markup import escape

    report = assembled.trainer.check_memory(budget)
    assembled.console.print(escape("per-device memory (XLA): " + ", ".join(
        f"{part} {shown_bytes(used)}" for part, used in report.items())))


def _loop(assembled: Run, run: RunConfig, state, start: int, save, stop,
          sinks: list[Sink]) -> tuple[list[dict], object, int | None]:
    """Runs the steps after `start`, each step's record (its metrics, learning rate, tokens
    seen, seconds, and at --eval-every its evaluation) written to `sinks`: each step's record,
    the last state, and the step after which a stop signal ended the loop (None: it ran to the
    end)."""
    import numpy as np
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from hotjax.data.held_out import take
    from hotjax.optim import OptimConfig
    from hotjax.planning.search import PREDICTION_STEPS, prediction_check
    from hotjax.run import priced_steps
    from hotjax.tracking import Trace
    from hotjax.train import check_finite

    history: list[dict] = []
    # The schedule's rate at each step's update (the optimizer counts updates from 0).
    lr_S = (np.asarray(assembled.optimizer.lr_schedule()(np.arange(start, run.steps)))
            if isinstance(assembled.optimizer, OptimConfig) else None)
    held_out = (take(assembled.minibatches(assembled.held_out), run.eval_tokens)
                if run.evaluates else [])
    trace, tokens_seen = Trace(run.traced, run.tensorboard), 0
    documents: list[np.ndarray] = []  # of the steps that check a plan's prediction
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                        console=assembled.console)
    with progress, contextlib.ExitStack() as tracing:
        tracing.callback(trace.stop)
        task = progress.add_task("train", total=run.steps, completed=start, status="")
        for step in range(start + 1, run.steps + 1):
            if stop is not None and stop.agreed():
                return history, state, step - 1
            trace.before(step)
            batch = assembled.next_batch()
            if assembled.search is not None and len(history) < 1 + PREDICTION_STEPS:
                documents.append(batch.document_lengths())
            started = time.perf_counter()
            state, metrics = assembled.step(state, batch)
            metrics = metrics.fetch()  # printed every step: wait for it
            check_finite(metrics, step)  # before this step is saved or built on
            seconds = time.perf_counter() - started
            tokens_seen += metrics["tokens"]
            record = {"step": step, **metrics, "seconds": seconds,
                      "tokens_per_s": metrics["tokens"] / seconds, "tokens_seen": tokens_seen}
            if lr_S is not None:
                record["lr"] = float(lr_S[step - start - 1])
            traced = trace.after(step)
            if save and (step % (run.save_every or run.steps) == 0 or step == run.steps):
                # The data position is taken after this step's batch, before the next one's.
                record["save_seconds"] = save(step, state)
            if held_out and (step == run.steps or step % (run.eval_every or run.steps) == 0):
                record.update(_evaluation(assembled, state, held_out))
            history.append(record)
            for sink in sinks:
                sink.write(record)
            if assembled.search is not None and len(history) == 1 + PREDICTION_STEPS:
                # The first step (its documents' shapes compile) left out; each other step
                # priced on its own documents, else (a bucket past the memory model) the
                # typical step's price.
                plans = priced_steps(assembled.search, assembled.trainer, documents[1:])
                off = prediction_check([p.seconds for p in plans] if plans else
                                       [assembled.predicted_seconds] * PREDICTION_STEPS,
                                       [r["seconds"] for r in history[1:]])
                if off:
                    progress.console.print(off, markup=False, highlight=False)
            status = _status(metrics, record["tokens_per_s"])
            progress.update(task, advance=1, status=status)
            if step % run.log_every == 0 or step == run.steps:
                progress.console.print(f"step {step:>5}  {status}")
            if "eval_loss" in record:
                progress.console.print(f"step {step:>5}  eval loss {record['eval_loss']:.4f} | "
                                       f"perplexity {record['eval_perplexity']:,.2f} "
                                       f"({record['eval_tokens']:,} held-out tokens)")
            if traced is not None:
                progress.console.print(f"JAX profiler trace of steps {run.trace_steps}: "
                                       f"{traced} (TensorBoard's profile tab, or its "
                                       f".trace.json.gz in Perfetto)")
    return history, state, None


def _evaluation(assembled: Run, state, held_out: list[MiniBatch]) -> dict:
    """The held-out loss and perplexity of `state` (no update), as a record's eval_ fields."""
    started = time.perf_counter()
    result = assembled.evaluate(state, held_out)
    return {"eval_loss": result["loss"], "eval_perplexity": result["perplexity"],
            "eval_tokens": result["tokens"], "eval_seconds": time.perf_counter() - started}


def _status(metrics: dict, tokens_per_s: float) -> str:
    status = (f"loss {metrics['loss']:.4f} | {tokens_per_s:,.0f} tok/s | "
              f"padding {metrics['padding']:.0%}")
    if metrics["imbalance_before"] > 1:  # data shards of unequal work
        status += (f" | imbalance {metrics['imbalance']:.2f}"
                   + (f" (from {metrics['imbalance_before']:.2f})"
                      if metrics["imbalance"] < metrics["imbalance_before"] else ""))
    if metrics.get("skipped"):
        status += (f" | update skipped: gradients overflowed at loss scale "
                   f"{metrics['loss_scale']:g}")
    return status


def _summary(history: list[dict]) -> None:
    """The run's table and notes, on stdout (progress went to stderr): `hotjax train > log`
    keeps them."""
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    from hotjax import distributed

    console = Console(quiet=not distributed.is_main())
    if not console.is_terminal:
        console.width = max(console.width, SUMMARY_WIDTH)  # a file: the table unwrapped
    steady = history[1:] or history
    evaluated = [r for r in history if "eval_loss" in r]
    table = Table(title="training summary")
    for column in ("steps", "first loss", "last loss", "real tokens", "padding",
                   "tokens/s (after step 1)",
                   *(("eval loss", "eval perplexity") if evaluated else ())):
        table.add_column(column, justify="right")
    tokens_per_s = sum(r["tokens"] for r in steady) / sum(r["seconds"] for r in steady)
    tokens = sum(r["tokens"] for r in history)
    padding = 1 - tokens / sum(r["slots"] for r in history)
    table.add_row(str(len(history)), f"{history[0]['loss']:.4f}", f"{history[-1]['loss']:.4f}",
                  f"{tokens:,}", f"{padding:.1%}", f"{tokens_per_s:,.0f}",
                  *((f"{evaluated[-1]['eval_loss']:.4f}",
                     f"{evaluated[-1]['eval_perplexity']:,.2f}") if evaluated else ()))
    console.print(table)
    imbalance = np.mean([r["imbalance"] for r in history])
    if imbalance > UNEVEN:
        before = np.mean([r["imbalance_before"] for r in history])
        console.print(f"data shards: the busiest did {imbalance:.2f}x the mean's estimated work "
                      f"per step (rows in packing order: {before:.2f}x); rows this unequal (a "
                      f"long document filling a row beside rows of short ones) cannot even "
                      f"out over the shards: more rows per micro-step (--device-memory), or "
                      f"context parallelism for the longest bucket, spread them")
