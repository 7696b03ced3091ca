"""What a training run is asked to do: the options of `hotjax train`, as one frozen record.

Free of JAX imports, so the command line can read its defaults before JAX starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from pathlib import Path

from hotjax.bounds import MAX_SEQ_LEN, MAX_STEP, MAX_VOCAB, host_memory
from hotjax.errors import UserError
from hotjax.models.optimizers import (
    BETA1,
    BETA2,
    CLIP_NORM,
    DECAY_FRACTION,
    EPS,
    LR,
    MIN_LR_RATIO,
    OPTIMIZERS,
    SCHEDULE,
    SCHEDULES,
    WARMUP_STEPS,
    WEIGHT_DECAY,
)
from hotjax.models.optimizers import DEFAULT as DEFAULT_OPTIMIZER

DEFAULT_BATCH_TOKENS = 8192
DEFAULT_MODEL = "small"
DEFAULT_WARMUP_STEPS = WARMUP_STEPS  # the optimizer's own default (`hotjax.models.optimizers`)
DEFAULT_EVAL_TOKENS = 16384
# Host bytes one token of a mini-batch costs in the data pipeline (`hotjax.data.stream`): its
# int32 id in a tokenized sequence (4); the packed rows' int32 tokens, segment ids and
# positions (12), doubled for padding (24); and those rows again as arrays of CPU devices,
# which live in host memory (24): 52, rounded up.
BATCH_HOST_BYTES_PER_TOKEN = 64
# The share of host memory a mini-batch may take: the model, its optimizer state, compiled
# programs, documents read ahead and the tokenizer need the rest.
BATCH_HOST_FRACTION = 0.25
# More devices than any job's (TPU pods hold 8,960 chips); a simulated CPU device costs host
# memory and a thread.
MAX_DEVICES = 2**16


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: str | None = None  # a preset; None: the checkpoint's model when resuming, else small
    strategy: str | None = None  # "data=2,fsdp=4"; default: the default table on every count
    strategies: str | None = None  # a TOML strategy table, or "auto" (planned)
    devices: int | None = None
    data: str | None = None  # default: the Python standard library
    text_field: str = "text"  # the field of a record (JSON, Parquet, a dataset) holding its text
    data_split: str | None = None  # a saved DatasetDict's split; default: train
    tokenizer: str | None = None  # default: a byte-level BPE trained on the corpus, cached
    # A tokenizer file's special tokens by spelling; default: its tokenizer_config.json's.
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    vocab_size: int = 8192
    context: int = 512
    steps: int = 30
    seed: int = 0
    batch_tokens: int | None = None  # real tokens per step (default 8192 unless sequences)
    batch_sequences: int | None = None  # or sequences per step
    long_documents: str = "split"  # into context-length pieces, or "truncate"
    compute_dtype: str = "bfloat16"
    loss_scale: str | None = None  # "dynamic", "off" or a static scale; None: dynamic for fp16
    initial_loss_scale: float = 2.0**15
    loss_scale_period: int = 2000
    remat: str | None = None  # for buckets whose table names none; None: fit to device_memory
    attention: str = "auto"  # the kernel: auto, blockwise, dense, cudnn, pallas
    attention_block: int = 0  # the blockwise kernel's block edge (0: the platform's default)
    optimizer: str = DEFAULT_OPTIMIZER  # an entry of `hotjax.models.optimizers.OPTIMIZERS`
    lr: float = LR
    warmup_steps: int | None = None  # default: DEFAULT_WARMUP_STEPS, or --steps if fewer
    schedule: str = SCHEDULE  # the learning rate's shape: `hotjax.models.optimizers.SCHEDULES`
    decay_steps: int | None = None  # the horizon: where the rate reaches its minimum; --steps
    min_lr_ratio: float = MIN_LR_RATIO
    decay_fraction: float = DECAY_FRACTION  # WSD: the share after the warmup that decays
    weight_decay: float = WEIGHT_DECAY
    clip_norm: float = CLIP_NORM
    beta1: float = BETA1
    beta2: float = BETA2
    eps: float = EPS
    metrics_jsonl: str | None = None
    log_every: int = 10
    eval_data: str | None = None  # held-out documents; default: a split of `data` (`evaluates`)
    eval_every: int | None = None  # evaluate every N steps and at the last
    eval_tokens: int = DEFAULT_EVAL_TOKENS  # real tokens per evaluation, and the split's size
    tensorboard: str | None = None  # a directory for TensorBoard event files
    wandb: str | None = None  # a Weights & Biases project
    trace_steps: str | None = None  # "A:B": a JAX profiler trace of steps A to B
    device_memory: int | None = None  # bytes per device the compiled steps must fit in
    bucket_timings: bool = False  # wait for each bucket to time it (a host sync per bucket)
    balance: bool = True  # place rows on data shards by estimated work (`hotjax.balance`)
    ckpt_dir: str | None = None  # save here, and resume from its latest complete checkpoint
    save_every: int | None = None  # default: save the last step only
    resume_from: str | None = None  # a step directory, or a checkpoint directory's latest
    weights_only: bool = False  # resume the checkpoint's weights alone: a fresh optimizer, step 0
    new_schedule: bool = False  # resume onto another learning-rate schedule than the checkpoint's
    keep_last: int = 3
    keep_every: int | None = None  # also keep every step that is a multiple of this

    def __post_init__(self) -> None:
        for flag, value, low in (("--steps", self.steps, 1), ("--seed", self.seed, 0),
                                 ("--vocab-size", self.vocab_size, 1),
                                 ("--context", self.context, 1),
                                 ("--batch-tokens", self.batch_tokens, 1),
                                 ("--batch-sequences", self.batch_sequences, 1),
                                 ("--loss-scale-period", self.loss_scale_period, 1),
                                 ("--attention-block", self.attention_block, 0),
                                 ("--log-every", self.log_every, 1),
                                 ("--eval-every", self.eval_every, 1),
                                 ("--eval-tokens", self.eval_tokens, 1),
                                 ("--save-every", self.save_every, 1),
                                 ("--keep-last", self.keep_last, 1),
                                 ("--keep-every", self.keep_every, 1),
                                 ("--decay-steps", self.decay_steps, 1)):
            at_least(flag, value, low)
        if self.seed >= 2**32:
            raise UserError(f"--seed {self.seed}: choose a seed from 0 to 2**32 - 1")
        for flag, value, high, bound in (
                ("--steps", self.steps, MAX_STEP, "MAX_STEP: steps count in int32"),
                ("--devices", self.devices, MAX_DEVICES, "MAX_DEVICES"),
                ("--vocab-size", self.vocab_size, MAX_VOCAB, "MAX_VOCAB"),
                ("--context", self.context, MAX_SEQ_LEN, "MAX_SEQ_LEN"),
                ("--attention-block", self.attention_block, MAX_SEQ_LEN, "MAX_SEQ_LEN"),
                ("--loss-scale-period", self.loss_scale_period, MAX_STEP, "MAX_STEP"),
                ("--warmup-steps", self.warmup_steps, MAX_STEP, "MAX_STEP"),
                ("--decay-steps", self.decay_steps, MAX_STEP, "MAX_STEP")):
            at_most(flag, value, high, bound)
        fits_host_memory(self.batch_tokens, self.batch_sequences, self.context)
        for flag, value in (("--lr", self.lr), ("--initial-loss-scale", self.initial_loss_scale),
                            ("--device-memory", self.device_memory), ("--eps", self.eps)):
            positive(flag, value)
        self._check_optimizer()
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise UserError(f"--warmup-steps {self.warmup_steps}: warm up within the run: give "
                            f"0 to --steps ({self.steps})")
        if self.weights_only and not (self.resume_from or self.ckpt_dir):
            raise UserError("--weights-only needs a checkpoint: pass --resume-from")
        if self.new_schedule and not (self.resume_from or self.ckpt_dir):
            raise UserError("--new-schedule needs a checkpoint to resume: pass --resume-from")
        if self.save_every and not self.ckpt_dir:
            raise UserError("--save-every needs --ckpt-dir: pass the directory to save into")
        self.loss_scaling  # noqa: B018 - a static --loss-scale is checked here, at the edge
        self.traced  # noqa: B018 - and --trace-steps

    def _check_optimizer(self) -> None:
        """The optimizer's and the schedule's settings, each in its range."""
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"--optimizer {self.optimizer}: choose one of "
                            f"{', '.join(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise UserError(f"--schedule {self.schedule}: choose one of {', '.join(SCHEDULES)}")
        within = "from 0 up to, not including, 1"
        for flag, value, ok, fix in (
                ("--beta1", self.beta1, 0 <= self.beta1 < 1, within),
                ("--beta2", self.beta2, 0 <= self.beta2 < 1, within),
                ("--weight-decay", self.weight_decay, 0 <= self.weight_decay < math.inf,
                 "0 or more"),
                ("--min-lr-ratio", self.min_lr_ratio, 0 <= self.min_lr_ratio <= 1,
                 "from 0 to 1 (the rate at the horizon over the peak --lr)"),
                ("--decay-fraction", self.decay_fraction, 0 <= self.decay_fraction <= 1,
                 "from 0 to 1 (WSD: the share of the steps after the warmup that decay)")):
            if not ok:
                raise UserError(f"{flag} {value}: pass a number {fix}")
        if not self.clip_norm > 0:  # inf: no clipping
            raise UserError(f"--clip-norm {self.clip_norm}: pass a gradient norm above 0 (inf: "
                            f"no clipping)")
        if self.decay_steps is not None and self.decay_steps < self.warmup:
            raise UserError(f"--decay-steps {self.decay_steps}: the horizon counts the warmup: "
                            f"pass at least --warmup-steps ({self.warmup})")

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates on held-out data (`eval_data`, else a split of `data`)."""
        return self.eval_every is not None or self.eval_data is not None

    @property
    def traced(self) -> tuple[int, int] | None:
        """--trace-steps A:B as (A, B): the first and last step traced."""
        if self.trace_steps is None:
            return None
        found = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", self.trace_steps)
        first, last = (int(found[1]), int(found[2])) if found else (0, 0)
        if not 1 <= first <= last <= self.steps:
            raise UserError(f"--trace-steps {self.trace_steps}: give the first and last step "
                            f"traced as A:B, 1 <= A <= B <= --steps ({self.steps}), e.g. 3:5")
        return first, last

    @property
    def loss_scaling(self) -> tuple[str, float]:
        """("off" | "dynamic" | "static", the initial or static scale)."""
        if self.loss_scale is None:
            return ("dynamic" if self.compute_dtype == "float16" else "off",
                    self.initial_loss_scale)
        if self.loss_scale in ("dynamic", "off"):
            return self.loss_scale, self.initial_loss_scale
        try:
            scale = float(self.loss_scale)
        except ValueError:
            scale = math.nan
        if not (math.isfinite(scale) and scale > 0):
            raise UserError(f"--loss-scale {self.loss_scale}: give dynamic, off or a number "
                            f"above 0 (a static scale)")
        return "static", scale

    @property
    def warmup(self) -> int:
        """The learning rate's warmup steps."""
        return (min(DEFAULT_WARMUP_STEPS, self.steps) if self.warmup_steps is None
                else self.warmup_steps)

    @property
    def batch(self) -> dict[str, int]:
        """The mini-batch size: real tokens, or sequences."""
        if self.batch_sequences is not None:
            return {"batch_sequences": self.batch_sequences}
        return {"batch_tokens": self.batch_tokens or DEFAULT_BATCH_TOKENS}


def at_least(flag: str, value: int | None, low: int) -> None:
    """A whole-number option (None: not given) is `low` or more."""
    if value is not None and value < low:
        need = "a positive number" if low == 1 else f"{low} or more"
        raise UserError(f"{flag} {value}: pass {need}")


def at_most(flag: str, value: int | None, high: int, bound: str) -> None:
    """A whole-number option (None: not given) is `high` or less (`bound` names the limit)."""
    if value is not None and value > high:
        raise UserError(f"{flag} {value}: pass at most {high:,} ({bound})")


def fits_host_memory(batch_tokens: int | None, batch_sequences: int | None,
                     context: int) -> None:
    """A mini-batch of `batch_tokens` real tokens, or of `batch_sequences` sequences of up to
    `context` tokens, fits BATCH_HOST_FRACTION of this machine's memory in the data
    pipeline: refused at once, before any is read."""
    if batch_sequences is not None:
        flag, value, tokens = "--batch-sequences", batch_sequences, batch_sequences * context
    else:
        flag, value = "--batch-tokens", batch_tokens or DEFAULT_BATCH_TOKENS
        tokens = max(value, context)  # a mini-batch holds at least one row of the context
    memory = host_memory()
    budget = int(memory * BATCH_HOST_FRACTION) // BATCH_HOST_BYTES_PER_TOKEN
    if tokens > budget:
        most = budget if batch_sequences is None else budget // context
        raise UserError(f"{flag} {value}: a mini-batch of {tokens:,} tokens would take "
                        f"{tokens * BATCH_HOST_BYTES_PER_TOKEN / 2**30:,.1f} GiB of host "
                        f"memory, past {BATCH_HOST_FRACTION:.0%} of this machine's "
                        f"{memory / 2**30:,.1f} GiB (BATCH_HOST_FRACTION): pass at most "
                        f"{most:,}" + (f" at --context {context}" if batch_sequences else ""))


def positive(flag: str, value: float | None) -> None:
    """A real-valued option (None: not given) is finite and above 0: `nan` and `inf` parse as
    floats, and neither trains."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise UserError(f"{flag} {value}: pass a finite number above 0")


# Memory sizes on the command line, in bytes: binary units, and the decimal ones GPU makers
# quote. Inside, memory is bytes; units are read here and shown by `shown_bytes`.
MEMORY_UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
                "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def memory_size(text: str) -> int:
    """An argparse type: a memory size such as `80GiB`, `512MiB` or `80GB` (a bare number is
    MiB), in bytes."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", text)
    unit = (found[2] or "MiB") if found else None
    if unit not in MEMORY_UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a memory size: give a positive number with a unit, like 80GiB, "
            f"512MiB or 80GB (a bare number is MiB)")
    size = round(float(found[1]) * MEMORY_UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a memory size above 0")
    return size


def shown_bytes(size: float) -> str:
    """A memory size for people: MiB below a GiB, else GiB."""
    return f"{size / 2**20:,.1f} MiB" if size < 2**30 else f"{size / 2**30:,.2f} GiB"


def cache_root() -> Path:
    """Where hotjax keeps trained tokenizers and compiled programs: `$HOTJAX_CACHE`."""
    return Path(os.environ.get("HOTJAX_CACHE", "~/.cache/hotjax")).expanduser()
