"""A training run, the library's entry point: `Run`, built from its parts (a model, a strategy
table, an optimizer, mini-batches) or from a `RunConfig` as `hotjax train` builds it, and
what those parts are made of (`strategy_table`, `planned_table`, `model_config`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import jax
import numpy as np
import optax
from rich.console import Console

from hotjax import bounds, distributed
from hotjax.checkpoint import dirs, store
from hotjax.checkpoint import lock as ckpt_lock
from hotjax.checkpoint import meta as meta_lib
from hotjax.checkpoint import tokenizer as checkpoint_tokenizer
from hotjax.checkpoint.training import restore_state, run_record
from hotjax.config import DEFAULT_MODEL, RunConfig
from hotjax.data import (
    MiniBatch,
    MiniBatches,
    Share,
    Tokenizer,
    cut,
    estimated_lengths,
    load_tokenizer,
    open_corpus,
    typical_rows,
)
from hotjax.data.corpus import Corpus, check_batch
from hotjax.data.held_out import split
from hotjax.data.tokenizer import SpecialTokens
from hotjax.errors import UserError
from hotjax.models import optimizers
from hotjax.models.llama import LlamaConfig, as_trained, preset
from hotjax.optim import OptimConfig
from hotjax.planning import search as plan_lib
from hotjax.planning.measure import local_profile
from hotjax.planning.profile import Profile
from hotjax.sharding.strategy import Strategy
from hotjax.sharding.table import StrategyTable, load_table, parse_table
from hotjax.startup import select_devices
from hotjax.step import TrainState
from hotjax.train import StepMetrics, Trainer

# With no --strategy, every device count trains this hot-switched bucket table, its meshes
# derived from the count (`default_table`); on 8 devices, the file as written.
DEFAULT_TABLE = Path(__file__).parent.parent / "sharding" / "tables" / "default.toml"
AUTO = "auto"  # --strategies auto: a table planned by the cost model
PERPLEXITY_CAP = 700.0  # a loss past this has no float perplexity (exp overflows): inf
NOT_HELD = object()  # `Run(lock=...)` not given: the run takes its `ckpt_dir`'s lock itself


def resumed_config(path: str | Path, **overrides) -> RunConfig:
    """The `RunConfig` that continues the run saved at `path` (a step directory, or a
    checkpoint directory's latest): its model, corpus, tokenizer, batch size, context, seed and
    optimizer settings as recorded, resuming from `path`, with `overrides` (devices, strategy,
    steps, ...) on top. Any device count, mesh or strategy table restores it."""
    step_dir = dirs.find(path)
    meta = meta_lib.read(step_dir)
    data, optim, model = meta.get("data") or {}, meta.get("optimizer") or {}, meta["model"]
    # The checkpoint's own tokenizer, else (saved before checkpoints carried it) its file's path.
    tokenizer = None if checkpoint_tokenizer.carried(step_dir, meta) else data.get("tokenizer")
    scaling = optim.get("loss_scaling", "off")
    settings = {
        "data": data.get("source"), "text_field": data.get("text_field", RunConfig.text_field),
        "data_split": data.get("data_split"),
        "tokenizer": tokenizer,
        "vocab_size": data.get("vocab_size", RunConfig.vocab_size),
        "context": data.get("seq_len", RunConfig.context),
        "long_documents": data.get("long_documents", RunConfig.long_documents),
        "batch_tokens": data.get("batch_tokens"), "batch_sequences": data.get("batch_sequences"),
        "seed": data.get("seed", RunConfig.seed),
        "compute_dtype": model.get("compute_dtype", RunConfig.compute_dtype),
        "attention": model.get("attention", RunConfig.attention),
        "attention_block": model.get("attention_block", RunConfig.attention_block),
        "optimizer": optim.get("name", RunConfig.optimizer),
        "lr": optim.get("lr", RunConfig.lr), "warmup_steps": optim.get("warmup_steps"),
        "steps": optim.get("total_steps", RunConfig.steps),
        **{field: optim.get(saved, getattr(RunConfig, field)) for field, saved in (
            ("schedule", "schedule"), ("decay_steps", "decay_steps"),
            ("min_lr_ratio", "min_lr_ratio"), ("decay_fraction", "decay_fraction"),
            ("weight_decay", "weight_decay"), ("clip_norm", "clip_norm"), ("beta1", "b1"),
            ("beta2", "b2"), ("eps", "eps"))},
        "loss_scale": scaling if scaling != "static" else str(optim["loss_scale"]),
        "initial_loss_scale": optim.get("loss_scale", RunConfig.initial_loss_scale),
        "loss_scale_period": optim.get("loss_scale_period", RunConfig.loss_scale_period),
        "resume_from": str(step_dir)}
    return RunConfig(**{**settings, **overrides})


def strategy_table(run: RunConfig, num_devices: int | None = None) -> StrategyTable:
    """The table `run` names: its `strategies` file, its `strategy` as the one-bucket table of
    `context` tokens, or with neither, the default table on `num_devices` devices
    (`default_table`); checked against `num_devices` when given."""
    if run.strategy and run.strategies:
        raise UserError("--strategy and --strategies both given: pass one of them")
    if run.strategies:
        table = load_table(run.strategies)
    elif run.strategy:
        table = StrategyTable.single(Strategy.parse(run.strategy), run.context,
                                     f"--strategy {run.strategy!r}")
    elif num_devices is None:
        raise UserError("no strategy given: pass a strategy table or a strategy")
    else:
        table = default_table(num_devices)
    if num_devices is not None:
        table.check_devices(num_devices)
    return table


def default_table(num_devices: int) -> StrategyTable:
    """DEFAULT_TABLE's buckets on `num_devices` devices: each keeps its tensor ways up to the
    largest power of two dividing the count and puts the other devices on data, except that a
    balanced bucket puts on context as many as split its rows into balanced chunks (2 a rank),
    and any left on data. On 8 devices this is the file; on one, its buckets each on the one
    device: the same model, run in micro-steps per length."""
    data = load_table(DEFAULT_TABLE).to_dict()
    power = num_devices & -num_devices  # the largest power of two dividing num_devices
    for entry in data["bucket"]:
        tensor = min(entry["mesh"].get("tensor", 1), power)
        rest = num_devices // tensor
        context = math.gcd(rest, entry["max_len"] // 2) if entry.get("balanced") else 1
        entry["mesh"] = {"data": rest // context, "context": context, "tensor": tensor}
        entry["balanced"] = context > 1
    return parse_table(data, f"{DEFAULT_TABLE} on {num_devices} devices")


def planned_table(run: RunConfig, config: LlamaConfig, devices: Sequence[jax.Device],
                  lengths: np.ndarray, console: Console
                  ) -> tuple[StrategyTable, float, plan_lib.Search]:
    """`--strategies auto`: the table `hotjax plan` chooses for this machine's devices (its
    profile measured once and cached), the corpus's estimated lengths and the batch size,
    each bucket checked by XLA's memory analysis on `devices` as the trainer checks it; its
    predicted seconds a step; and the search that priced it (`priced_steps`)."""
    from hotjax.planning.wall import xla_bytes

    if run.strategy:
        raise UserError("--strategy and --strategies both given: pass one of them")
    search, typical = plan_search(run, config, len(devices), lengths, console)
    found = plan_lib.plan_checked(search, typical, run.context,
                                  xla_bytes(config, devices, search.optimizer),
                                  progress=lambda line: console.print(line, markup=False))
    console.print(f"--strategies auto: planned on profile {search.profile.name}, predicted "
                  f"{found.expected_seconds * 1e3:,.1f} ms per step; {found.why}", markup=False)
    return found.table("--strategies auto"), found.expected_seconds, search


def priced_steps(search: plan_lib.Search, trainer: Trainer, lengths: Sequence[np.ndarray],
                 padded: bool = False) -> list[plan_lib.Plan] | None:
    """The cost model's step of `trainer`'s table on each mini-batch's document lengths
    (`MiniBatch.document_lengths`), its micro-steps as the trainer runs them (with `padded`,
    one document a row); None where a bucket does not fit the memory model."""
    table = [(b.max_len, s.layout.strategy) for b, s in zip(trainer.table.buckets,
                                                           trainer.buckets, strict=True)]
    run = [plan_lib.RunAs(rows, s.config.remat, s.accumulate)
           for s, rows in zip(trainer.buckets, trainer.micro_rows, strict=True)]
    plans = [plan_lib.fixed_table(search, docs, table, padded=padded, run=run)
             for docs in lengths]
    return None if any(p is None for p in plans) else plans


def plan_search(run: RunConfig, config: LlamaConfig, num_devices: int, lengths: np.ndarray,
                console: Console, profile: Profile | None = None
                ) -> tuple[plan_lib.Search, np.ndarray]:
    """What `hotjax plan` and `--strategies auto` plan with, alike: the search over
    `num_devices` under `profile` (default: this machine's, measured once and cached) and
    the run's memory budget, and the typical step's sequence lengths from the documents'
    `lengths`, cut to the context and counted by the batch size as training cuts them."""
    profile = profile or local_profile(console)
    budget = run.device_memory if run.device_memory is not None else profile.memory_bytes
    sequences = cut(lengths, run.context, run.long_documents)
    count = run.batch.get("batch_sequences") or max(
        round(run.batch["batch_tokens"] / sequences.mean()), 1)
    search = plan_lib.Search(config, profile, num_devices, int(budget),
                             optimizer=optimizers.named(run.optimizer),
                             fill=plan_lib.Fill(sequences, **run.batch))
    return search, plan_lib.typical_batch(sequences, count)


def model_config(run: RunConfig, model: LlamaConfig, vocab_size: int) -> LlamaConfig:
    """The model as `run` trains it: its vocabulary the tokenizer's (padded), its compute dtype
    and attention kernel the run's. A tokenizer that grows the embedding past this host's
    memory (its ids reaching far) is refused before anything is built."""
    config = as_trained(model, vocab_size, compute_dtype=run.compute_dtype,
                        attention=run.attention, attention_block=run.attention_block)
    embedding, memory = config.vocab_size * config.dim * bounds.PARAM_BYTES, bounds.host_memory()
    if vocab_size > model.vocab_size and embedding > memory:
        source = f"--tokenizer {run.tokenizer}" if run.tokenizer else "--vocab-size"
        raise UserError(f"{source}: {vocab_size:,} token ids make the "
                        f"model's embedding ({config.dim:,} wide) {embedding / 2**30:,.1f} GiB, "
                        f"more than this machine's {memory / 2**30:,.1f} GiB of memory — pass a "
                        f"tokenizer of fewer ids, or a narrower model")
    return config


def optim_config(run: RunConfig) -> OptimConfig:
    """The optimizer, its settings, learning-rate schedule and loss scaling `run` trains with."""
    scaling, scale = run.loss_scaling
    return OptimConfig(name=run.optimizer, lr=run.lr, warmup_steps=run.warmup,
                       total_steps=run.steps, schedule=run.schedule,
                       min_lr_ratio=run.min_lr_ratio, decay_steps=run.decay_steps,
                       decay_fraction=run.decay_fraction, weight_decay=run.weight_decay,
                       b1=run.beta1, b2=run.beta2, eps=run.eps, clip_norm=run.clip_norm,
                       loss_scaling=scaling, loss_scale=scale,
                       loss_scale_period=run.loss_scale_period)


def named_model(name: str) -> LlamaConfig:
    """`--model`: a preset's name, or a JSON file of `LlamaConfig` fields (a model of one's
    own, as `LlamaConfig.to_dict` writes it)."""
    if not name.endswith(".json"):
        return preset(name)
    path = Path(name)
    if not path.is_file():
        raise UserError(f"--model {name}: no such file: give a preset or a model's JSON file")
    fix = "write it with LlamaConfig.to_dict, or give a preset"
    return LlamaConfig.checked(bounds.read_json(path, "model", fix), f"--model {name}", fix)


def _model(run: RunConfig, resume: str | Path | None) -> tuple[str, LlamaConfig]:
    """The model to train, and what to call it: the --model preset or file, or when resuming
    without one, the checkpoint's own (an import of any architecture resumes as it is)."""
    if run.model is None and resume:
        step_dir = dirs.find(resume)
        return f"of {step_dir}", LlamaConfig.checked(
            meta_lib.read(step_dir)["model"], f"{step_dir / meta_lib.META_FILE}: model",
            meta_lib.DAMAGED)
    name = run.model or DEFAULT_MODEL
    return name, named_model(name)


class Run:
    """A training run: a model trained under a strategy table by an optimizer on mini-batches,
    built from its parts,

        run = hotjax.Run(model, table, optax.adamw(1e-3), batches, tokenizer=tokenizer)

    or from a `RunConfig`, as `hotjax train` builds it (`Run.from_config`). Your loop drives it:

        with hotjax.Run.from_config(hotjax.RunConfig(model="tiny", ckpt_dir="ck")) as run:
            state, step = run.initial_state()       # fresh, or resumed as the config says
            for step in range(step + 1, 101):
                state, metrics = run.step(state)    # returns at once; metrics["loss"] waits
                if step % 50 == 0:
                    run.save(step, state)           # into ckpt_dir

    Building a run from parts is cheap; the heavy steps are its methods, or happen on first
    use: `trainer` (each bucket's step, sized to `device_memory` by compiling it; built on
    first use), `compile()` (every bucket's step, else the first step compiles), and the state
    on the devices: `init()`, `restore(path)`, `initial_state()`.

    `model` is the model as trained (`model_config`: the tokenizer's vocabulary, padded; the
    compute dtype); `optimizer` is hotjax's AdamW (`OptimConfig`) or any optax optimizer;
    `batches` any iterable of `MiniBatch`es over the table's buckets (a `MiniBatches` saves and
    restores its position with the checkpoints). `device_memory` is bytes per device;
    `switch_method` how weights and gradients move between strategies (`Trainer`'s). A state
    restored from a checkpoint is laid out in this run's home strategy, whatever mesh wrote it.
    JAX must have been started first (`hotjax.start_jax`, which also gives the `devices`;
    default: all). A `ckpt_dir` is this run's alone until `close` (a second run there stops at
    its start); `lock` is that hold when already taken (`from_config` takes it first: None
    in every process of a run but process 0)."""

    def __init__(self, model: LlamaConfig, table: StrategyTable,
                 optimizer: OptimConfig | optax.GradientTransformation,
                 batches: Iterable[MiniBatch], *, tokenizer: Tokenizer | None = None,
                 devices: Sequence[jax.Device] | None = None, seed: int = 0,
                 device_memory: int | None = None, remat: str | None = None,
                 typical_rows: Sequence[float] | None = None, balance: bool = True,
                 bucket_timings: bool = False, switch_method: str = "auto",
                 ckpt_dir: str | Path | None = None,
                 keep_last: int | None = 3, keep_every: int | None = None,
                 resume_from: str | Path | None = None, data: dict | None = None,
                 name: str = "of your own", console: Console | None = None,
                 lock: ckpt_lock.Lock | None | object = NOT_HELD):
        # Process 0 alone holds a run's lock: another process's hold is None, already taken.
        self._lock = (ckpt_lock.hold(ckpt_dir) if ckpt_dir else None) if lock is NOT_HELD \
            else lock
        try:
            self.model, self.optimizer, self.batches = model, optimizer, batches
            self.tokenizer = tokenizer or getattr(batches, "tokenizer", None)
            self.devices = list(devices or jax.devices())
            self.seed, self.name = seed, name
            self.console = console or Console(stderr=True, quiet=not distributed.is_main())
            self._given = table
            self._trainer_options = {"device_memory": device_memory, "remat": remat,
                                     "typical_rows": typical_rows, "balance": balance,
                                     "timings": bucket_timings, "switch_method": switch_method}
            self._data = data if data is not None else _data_record(batches, table)
            self._iterator = iter(batches)
            self.lengths: np.ndarray | None = None  # the corpus's estimated, when known
            self.checkpoints = (store.Checkpoints(ckpt_dir, keep_last=keep_last,
                                                  keep_every=keep_every) if ckpt_dir else None)
            self.resume_path = resume_from or (ckpt_dir and dirs.latest(ckpt_dir))
        except BaseException:
            self._release()
            raise

    @classmethod
    def from_config(cls, config: RunConfig, console: Console | None = None,
                    devices: Sequence[jax.Device] | None = None) -> Run:
        """The run `hotjax train` makes of `config`: corpus, tokenizer (a BPE trained on the
        corpus and cached when none is named), model, strategy table (planned, measuring this
        machine once, for `strategies="auto"`), optimizer and mini-batches, assembled here;
        `devices` default to `config.devices`' first, else all."""
        run = config
        console = console or Console(stderr=True, quiet=not distributed.is_main())
        # Before anything slow: a checkpoint directory that takes files, and no other run's.
        lock = ckpt_lock.hold(run.ckpt_dir) if run.ckpt_dir else None
        try:
            devices = list(devices or select_devices(run.devices))
            table = None if run.strategies == AUTO else strategy_table(run, len(devices))
            resume = run.resume_from or (run.ckpt_dir and dirs.latest(run.ckpt_dir))
            name, model = _model(run, resume)
            optim = optim_config(run)  # checked before the slow set-up
            corpus = open_corpus(run.data, run.text_field, run.data_split)
            held_out = (open_corpus(run.eval_data, run.text_field, run.data_split)
                        if run.eval_data else None)
            check_batch(corpus, context=table.max_len if table else run.context,
                        long_documents=run.long_documents, **run.batch)
            # A resume continues the checkpoint's tokenizer: never a new one for its ids.
            own = resume and checkpoint_tokenizer.for_resume(dirs.find(resume), run.tokenizer)
            tokenizer = own or load_tokenizer(run.tokenizer, corpus, vocab_size=run.vocab_size,
                                              specials=SpecialTokens.of(run))
            model = model_config(run, model, tokenizer.vocab_size)
            if run.evaluates and held_out is None:  # documents the training never sees
                corpus, held_out = split(corpus, tokenizer, run.eval_tokens)
            lengths = estimated_lengths(corpus, tokenizer)
            predicted = search = None
            if table is None:
                table, predicted, search = planned_table(run, model, devices, lengths, console)
            # Each process reads its share of the documents; all then hold the same batches.
            share = (Share(jax.process_index(), jax.process_count(), distributed.gather)
                     if jax.process_count() > 1 else None)
            max_lens = [b.max_len for b in table.buckets]
            batches = MiniBatches(corpus, tokenizer, max_lens, **run.batch,
                                  long_documents=run.long_documents, seed=run.seed, share=share)
            typical = typical_rows(cut(lengths, table.max_len, run.long_documents), max_lens,
                                   **run.batch)
            data = {"source": corpus.source, "text_field": run.text_field,
                    "data_split": run.data_split,
                    "seq_len": table.max_len,
                    "long_documents": run.long_documents, **run.batch,
                    "tokenizer": run.tokenizer, "vocab_size": run.vocab_size}
            made = cls(model, table, optim, batches, tokenizer=tokenizer, devices=devices,
                       seed=run.seed, device_memory=run.device_memory, remat=run.remat,
                       typical_rows=typical, balance=run.balance,
                       bucket_timings=run.bucket_timings, ckpt_dir=run.ckpt_dir,
                       keep_last=run.keep_last, keep_every=run.keep_every,
                       resume_from=resume, data=data, name=name, console=console, lock=lock)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        made.lengths, made.held_out = lengths, held_out
        made.weights_only, made.new_schedule, made.config = (run.weights_only,
                                                             run.new_schedule, run)
        made.predicted_seconds, made.search = predicted, search
        return made

    @functools.cached_property
    def trainer(self) -> Trainer:
        """The trainer (built on first use: sizing micro-steps to `device_memory` compiles)."""
        return Trainer(self.model, self.optimizer, self._given, self.devices,
                       **self._trainer_options)

    @property
    def table(self) -> StrategyTable:
        """The table as it runs and is recorded: as written, its home the trainer's, chosen or
        given (not fitted to the model: a GQA model's replicated K/V heads are the trainer's
        business, not the table's)."""
        return dataclasses.replace(self._given, home=self.trainer.home_strategy)

    @functools.cached_property
    def record(self) -> dict:
        """What each checkpoint of this run records beside its arrays."""
        record = run_record(self.trainer.home, tokenizer=self.tokenizer, seed=self.seed,
                            table=self.table, data=self._data,
                            run=self.config and dataclasses.asdict(self.config))
        if not isinstance(self.optimizer, OptimConfig):
            record["optimizer"] = {"source": "optax", "loss_scaling": "off"}
        return record

    def init(self, seed: int | None = None) -> TrainState:
        """A fresh state in the home strategy (default seed: the run's)."""
        return self.trainer.init(self.seed if seed is None else seed)

    weights_only = False  # `initial_state` restores the checkpoint's weights alone
    new_schedule = False  # and onto a learning-rate schedule other than the checkpoint's
    config: RunConfig | None = None  # the options it was built from (`from_config`)
    predicted_seconds: float | None = None  # a planned table's step (`--strategies auto`)
    search: plan_lib.Search | None = None  # and what priced it (`priced_steps`)

    def restore(self, path: str | Path, weights_only: bool = False,
                new_schedule: bool = False) -> tuple[TrainState, int]:
        """The state saved at `path` (a step directory, or a checkpoint directory's latest) on
        this run's devices and home strategy, and its step; mini-batches that keep a position
        continue where that run's were. `weights_only`: its weights alone, a fresh optimizer
        at step 0; `new_schedule`: onto this run's learning-rate schedule where it differs
        from the checkpoint's (else refused)."""
        resumed = restore_state(path, self.trainer.home, self.record, weights_only=weights_only,
                                new_schedule=new_schedule)
        if resumed.data is not None and hasattr(self.batches, "set_state"):
            self.batches.set_state(resumed.data)
        self.console.print(f"resumed from {resumed.path} (step {resumed.step})")
        return resumed.state, resumed.step

    def initial_state(self) -> tuple[TrainState, int]:
        """Where training starts: the checkpoint `resume_from` names, else the latest in
        `ckpt_dir`, else a fresh state at step 0."""
        if self.resume_path:
            return self.restore(self.resume_path, self.weights_only, self.new_schedule)
        return self.init(), 0

    def compile(self) -> None:
        """Compile every bucket's step now (else the first step does)."""
        self.trainer.prepare()

    def next_batch(self) -> MiniBatch:
        """The next mini-batch: its sequences packed into rows per bucket."""
        return next(self._iterator)

    def step(self, state: TrainState, batch: MiniBatch | None = None
             ) -> tuple[TrainState, StepMetrics]:
        """One optimizer update on `batch` (default: the next mini-batch); `state` is donated.
        Returns at once: the metrics are read, waiting for the step, when first asked for
        (`metrics["loss"]`, `metrics.fetch()`); meanwhile the next step can be queued."""
        return self.trainer.step_async(state, self.next_batch() if batch is None else batch)

    def evaluate(self, state: TrainState, batches: MiniBatch | Iterable[MiniBatch]) -> dict:
        """The loss of `state` on one mini-batch or several (the mean over all their targets)
        without updating it (forward only, every bucket under its strategy): loss, perplexity,
        targets, tokens."""
        results = [self.trainer.evaluate(state, batch) for batch in
                   ((batches,) if isinstance(batches, MiniBatch) else batches)]
        targets = sum(r["targets"] for r in results)
        loss = sum(r["loss"] * r["targets"] for r in results) / targets
        return {"loss": loss, "perplexity": math.exp(loss) if loss < PERPLEXITY_CAP else math.inf,
                "targets": targets, "tokens": sum(r["tokens"] for r in results)}

    held_out: Corpus | None = None  # from a config that evaluates: its held-out documents

    def minibatches(self, data: str | Corpus | None = None, seed: int | None = None
                    ) -> MiniBatches:
        """Mini-batches of another corpus (held-out data, say: a path or a `Corpus`) as this
        run's `MiniBatches` make theirs: its tokenizer, buckets, batch size and long-document
        handling (default: this run's corpus and seed)."""
        own = self.batches
        if not isinstance(own, MiniBatches):
            raise UserError("minibatches() makes mini-batches as the run's own MiniBatches "
                            "do: build this run with a MiniBatches, or make them yourself")
        corpus = own.corpus if data is None else (
            data if isinstance(data, Corpus) else open_corpus(data, own.corpus.text_field))
        return MiniBatches(corpus, own.tokenizer, own.max_lens, batch_tokens=own.batch_tokens,
                           batch_sequences=own.batch_sequences,
                           long_documents=own.long_documents,
                           seed=own.seed if seed is None else seed)

    def save(self, step: int, state: TrainState) -> float:
        """Saves `state` as step `step` into `ckpt_dir` (written in the background, atomic: a
        step is complete or absent), with the data position; returns the seconds it blocked."""
        if self.checkpoints is None:
            raise UserError("saving needs a checkpoint directory: set ckpt_dir (--ckpt-dir)")
        position = self.batches.get_state() if hasattr(self.batches, "get_state") else None
        return self.checkpoints.save(step, state.params, state.opt_state, self.record,
                                     position, self.tokenizer)

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


def _data_record(batches: Iterable[MiniBatch], table: StrategyTable) -> dict:
    """What a checkpoint records of the data: a `MiniBatches`' corpus, context, long
    documents and batch size (nothing of another iterable)."""
    if not isinstance(batches, MiniBatches):
        return {}
    size = ({"batch_sequences": batches.batch_sequences} if batches.batch_sequences
            else {"batch_tokens": batches.batch_tokens})
    return {"source": batches.corpus.source, "seq_len": table.max_len,
            "long_documents": batches.long_documents, **size}
