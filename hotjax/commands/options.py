"""Every option a training run takes, defined once: `hotjax train`, `hotjax plan`, `hotjax
strategy show`, the benchmarks and the examples add them from here and read them back into a
`RunConfig` (`run_config`). Free of JAX: parsing comes before JAX starts."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from hotjax.choices import ATTENTION_BACKENDS, REMAT_POLICIES
from hotjax.config import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_MODEL,
    DEFAULT_WARMUP_STEPS,
    RunConfig,
    memory_size,
)
from hotjax.data.held_out import HELD_OUT_SHARE
from hotjax.data.hf_datasets import DEFAULT_SPLIT
from hotjax.distributed import HEARTBEAT_TIMEOUT_S
from hotjax.models.optimizers import OPTIMIZERS, SCHEDULES
from hotjax.preemption import REQUEUE_EXIT
from hotjax.startup import SIMULATED_CPU_DEVICES

_RUN = RunConfig()  # the defaults

# A `RunConfig` field -> its flag and argparse keywords.
OPTIONS: dict[str, dict[str, Any]] = {
    "model": {"help": "model preset, or a JSON file of LlamaConfig fields (default: "
              f"{DEFAULT_MODEL}; resuming, the checkpoint's model)"},
    "strategy": {"help": 'mesh and rules, e.g. "data=2,fsdp=4" or "fsdp=8,rules=fsdp" '
                 "(default, on any N devices: the hot-switched table "
                 "sharding/tables/default.toml, each bucket's tensor ways capped at the largest "
                 "power of two dividing N and the other devices on data, or on context for its "
                 "balanced bucket where they split its rows; 8 devices run the file as written, "
                 "1 device its three buckets on that device)"},
    "strategies": {"metavar": "TABLE.toml", "help": "a strategy table, or 'auto': planned for "
                   "this machine's devices by `hotjax plan`'s cost model (measured once, "
                   "cached)"},
    "devices": {"type": int, "help": "use N devices; on CPU, N simulated ones (default: all "
                f"accelerators, or {SIMULATED_CPU_DEVICES} simulated CPUs)"},
    "data": {"help": "stdlib, shakespeare, a directory or glob ('src/**/*.py') of text files, "
             "a text file, .jsonl/.json records, .parquet, a directory a Hugging Face "
             "dataset was saved to (save_to_disk), hf:OWNER/NAME[:SPLIT] of the local Hugging "
             "Face cache (read offline), or token ids of the --tokenizer: a .npy (1-D, each "
             "document followed by its EOS) or an .array_record file (a record per document, "
             "its ids as little-endian int32) (default: stdlib, the Python standard library's "
             ".py files)"},
    "text_field": {"default": _RUN.text_field, "metavar": "FIELD",
                   "help": "the field of a record (.jsonl, .json, .parquet, a dataset's row) "
                   "that holds its text (default: %(default)s)"},
    "data_split": {"metavar": "SPLIT", "help": "the split of a saved DatasetDict or an hf: "
                   f"dataset to read (default: {DEFAULT_SPLIT})"},
    "tokenizer": {"help": "tokenizer.json, a SentencePiece .model, or 'bytes' (default: a "
                  "byte-level BPE trained on the corpus and cached)"},
    **{f"{role}_token": {"metavar": "TOKEN", "help": f"the {what} token of the --tokenizer "
                         f"file, by its spelling (default: as its tokenizer_config.json names "
                         f"it, else {usual})"}
       for role, what, usual in (("bos", "beginning-of-document", "<s>, <|begin_of_text|>, "
                                  "<|endoftext|> or <bos>"),
                                 ("eos", "end-of-document", "</s>, <|end_of_text|>, "
                                  "<|endoftext|> or <eos>"),
                                 ("pad", "padding", "<pad>, else id 0"))},
    "vocab_size": {"type": int, "default": _RUN.vocab_size,
                   "help": "vocabulary of the BPE trained when no --tokenizer is given"},
    "context": {"type": int, "default": _RUN.context,
                "help": "row length in tokens with --strategy (a table sets its own; default: "
                "%(default)s)"},
    "steps": {"type": int, "default": _RUN.steps, "metavar": "N",
              "help": "optimizer steps to train to, counted from the run's start (a resume "
              "continues to the same N; default: %(default)s)"},
    "seed": {"type": int, "default": _RUN.seed, "help": "initialises the parameters and "
             "orders the data (default: %(default)s)"},
    "batch_tokens": {"type": int, "help": "real tokens per optimizer step: the next documents "
                     f"up to this many (default: {DEFAULT_BATCH_TOKENS})"},
    "batch_sequences": {"type": int, "help": "or sequences per optimizer step"},
    "long_documents": {"choices": ("truncate", "split"), "default": _RUN.long_documents,
                       "help": "documents longer than the context: truncated (as HotSPa) or "
                       "split into context-length pieces (default: %(default)s)"},
    "compute_dtype": {"choices": ("bfloat16", "float16", "float32"),
                      "default": _RUN.compute_dtype, "help": "matmul dtype over fp32 master "
                      "weights (default: %(default)s; float16 scales the loss)"},
    "loss_scale": {"metavar": "dynamic|off|SCALE", "help": "loss scaling: dynamic (the default "
                   "with float16: halved on overflow, doubled after --loss-scale-period good "
                   "steps), off (the default otherwise), or a number for a static scale"},
    "initial_loss_scale": {"type": float, "default": _RUN.initial_loss_scale,
                           "metavar": "SCALE", "help": "where a dynamic scale starts "
                           "(default: 2^15)"},
    "loss_scale_period": {"type": int, "default": _RUN.loss_scale_period, "metavar": "N",
                          "help": "finite steps after which a dynamic scale doubles "
                          "(default: %(default)s)"},
    "remat": {"choices": REMAT_POLICIES, "help": "what each layer recomputes in the backward "
              "pass: nothing, all but its weight matmuls' outputs (dots), or everything "
              "(full); for table buckets that name none (default: the cheapest that fits "
              "--device-memory, else none)"},
    "attention": {"choices": ATTENTION_BACKENDS, "default": _RUN.attention,
                  "help": "attention kernel (default: %(default)s: the fastest correct one "
                  "for the platform; dense is the reference)"},
    "attention_block": {"type": int, "default": _RUN.attention_block, "metavar": "TOKENS",
                        "help": "block edge of the blockwise attention kernel (default: the "
                        "platform's)"},
    # The optimizer, its settings and its learning rate's schedule (`OPTIMIZATION`).
    "optimizer": {"choices": tuple(OPTIMIZERS), "default": _RUN.optimizer,
                  "help": "the optimizer (default: %(default)s)"},
    "lr": {"type": float, "default": _RUN.lr, "help": "peak learning rate, reached at the "
           "warmup's end (default: %(default)s)"},
    "warmup_steps": {"type": int, "metavar": "N", "help": "linear warmup from 0, 0 to --steps "
                     f"(default: {DEFAULT_WARMUP_STEPS}, or --steps if fewer)"},
    "schedule": {"choices": tuple(SCHEDULES), "default": _RUN.schedule,
                 "help": "the learning rate after the warmup: down to --min-lr-ratio at the "
                 "horizon (--decay-steps) by a cosine or a line, constant, or WSD (warmup, "
                 "stable, decay: held, then a line over the last --decay-fraction of the "
                 "steps; default: %(default)s)"},
    "decay_steps": {"type": int, "metavar": "N", "help": "the schedule's horizon: the step "
                    "where the rate reaches its minimum, the warmup counted (default: --steps;"
                    " past it the rate stays there)"},
    "min_lr_ratio": {"type": float, "default": _RUN.min_lr_ratio, "metavar": "R",
                     "help": "the rate at the horizon over the peak --lr, 0 to 1 (default: "
                     "%(default)s)"},
    "decay_fraction": {"type": float, "default": _RUN.decay_fraction, "metavar": "F",
                       "help": "--schedule wsd: the share of the steps after the warmup that "
                       "decay, 0 to 1 (default: %(default)s)"},
    "weight_decay": {"type": float, "default": _RUN.weight_decay, "metavar": "W",
                     "help": "decoupled weight decay of the matrices (not the norm scales), "
                     "times the learning rate (default: %(default)s)"},
    "clip_norm": {"type": float, "default": _RUN.clip_norm, "metavar": "NORM",
                  "help": "clip the gradients' global norm to this (inf: no clipping; "
                  "default: %(default)s)"},
    "beta1": {"type": float, "default": _RUN.beta1, "metavar": "B1",
              "help": "AdamW's and Lion's first moment decay, 0 to below 1 (default: "
              "%(default)s; Adafactor has its own)"},
    "beta2": {"type": float, "default": _RUN.beta2, "metavar": "B2",
              "help": "AdamW's second moment decay (Lion's update interpolation), 0 to "
              "below 1 (default: %(default)s)"},
    "eps": {"type": float, "default": _RUN.eps, "help": "AdamW's epsilon, above 0 (default: "
            "%(default)s)"},
    "metrics_jsonl": {"metavar": "PATH", "help": "one JSON object per step: its loss, learning "
                      "rate (lr), tokens seen, seconds, ... and any evaluation (eval_loss)"},
    "log_every": {"type": int, "default": _RUN.log_every, "help": "print a line every N steps"},
    "eval_data": {"metavar": "PATH", "help": "held-out documents (as --data takes them) whose "
                  "loss and perplexity are measured every --eval-every steps (default: a "
                  "held-out split of --data, left out of training)"},
    "eval_every": {"type": int, "metavar": "N", "help": "evaluate every N steps and at the "
                   "last, forward only (default: no evaluation; with --eval-data, the last "
                   "step's)"},
    "eval_tokens": {"type": int, "default": _RUN.eval_tokens, "metavar": "N",
                    "help": "real tokens each evaluation reads, the same every time (at least "
                    "a mini-batch); the held-out split holds this many (at most "
                    f"{HELD_OUT_SHARE * 100:.0f}%% of the documents; default: %(default)s)"},
    "tensorboard": {"metavar": "DIR", "help": "write the metrics as TensorBoard event files "
                    "here (pip install hotjax[tensorboard])"},
    "wandb": {"metavar": "PROJECT", "help": "log the metrics to this Weights & Biases project "
              "(pip install hotjax[wandb]; WANDB_MODE=offline keeps them local)"},
    "trace_steps": {"aliases": ("--profile-steps",), "metavar": "A:B",
                    "help": "write a JAX profiler trace of steps A to B "
                    "into the --tensorboard DIR (else ./trace), for TensorBoard's profile tab "
                    "or Perfetto (its .trace.json.gz)"},
    "device_memory": {"type": memory_size, "metavar": "SIZE", "help": "per-device memory "
                      "budget, like 80GiB or 512MiB (a bare number is MiB): the model state "
                      "and every compiled step must fit, as XLA's memory analysis reports "
                      "them; micro-steps are sized to it"},
    "bucket_timings": {"action": "store_true", "help": "time each bucket's micro-steps, "
                       "the weights into it and its gradients home (waits for the devices after "
                       "each part)"},
    "balance": {"action": argparse.BooleanOptionalAction, "default": _RUN.balance,
                "help": "place each bucket's rows on data shards so that their estimated work "
                "is equal (default: on; --no-balance: in packing order)"},
    "ckpt_dir": {"metavar": "DIR", "help": "save checkpoints here; resume from the latest "
                 "complete one in it"},
    "save_every": {"type": int, "metavar": "N",
                   "help": "save every N steps (default: the last step only)"},
    "resume_from": {"metavar": "PATH", "help": "resume from this checkpoint: a step "
                    "directory, or a checkpoint directory (its latest)"},
    "weights_only": {"action": "store_true", "help": "resume the checkpoint's weights alone: a "
                     "fresh optimizer (another optimizer's checkpoint too), from step 0 and the "
                     "data's beginning"},
    "new_schedule": {"action": "store_true", "help": "resume onto this run's learning-rate "
                     "schedule where it differs from the checkpoint's (--steps, --lr, "
                     "--schedule, ...: else refused)"},
    "keep_last": {"type": int, "default": _RUN.keep_last, "metavar": "N",
                  "help": "keep the newest N checkpoints (default: %(default)s)"},
    "keep_every": {"type": int, "metavar": "K",
                   "help": "also keep every checkpoint whose step is a multiple of K"},
}
assert set(OPTIONS) == {f.name for f in dataclasses.fields(RunConfig)}
# Options of which a command takes one at most.
EXCLUSIVE = (("strategy", "strategies"), ("batch_tokens", "batch_sequences"))
# The options of the data a run reads, and of the model it builds, as one list each.
DATA = ("data", "text_field", "data_split", "tokenizer", "bos_token", "eos_token", "pad_token",
        "vocab_size", "context", "long_documents", "batch_tokens", "batch_sequences")
MODEL = ("model", "compute_dtype", "attention", "attention_block", "remat")
# The optimizer, its settings and the learning rate's schedule.
OPTIMIZATION = ("optimizer", "lr", "warmup_steps", "schedule", "decay_steps", "min_lr_ratio",
                "decay_fraction", "weight_decay", "clip_norm", "beta1", "beta2", "eps")
# What a training run reports besides its progress: evaluations, metrics files and a trace.
TRACKING = ("metrics_jsonl", "log_every", "eval_data", "eval_every", "eval_tokens",
            "tensorboard", "wandb", "trace_steps")


def add_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *names: str,
                **defaults: Any) -> None:
    """Adds the options of these `RunConfig` fields, in order (those of an `EXCLUSIVE` pair
    both given in one group); `defaults` change a default (`model="tiny"`)."""
    groups: dict[tuple[str, str], Any] = {}
    for name in names:
        pair = next((p for p in EXCLUSIVE if name in p and set(p) <= set(names)), None)
        target = parser
        if pair is not None:
            target = groups.get(pair) or groups.setdefault(
                pair, parser.add_mutually_exclusive_group())
        keywords = dict(OPTIONS[name])
        if name in defaults:
            keywords["default"] = defaults[name]
        target.add_argument("--" + name.replace("_", "-"), *keywords.pop("aliases", ()),
                            **keywords)


def run_config(args: argparse.Namespace, **fields: Any) -> RunConfig:
    """The `RunConfig` of the parsed options (every one checked before JAX starts), with
    `fields` on top."""
    names = {f.name for f in dataclasses.fields(RunConfig)}
    return RunConfig(**{**{k: v for k, v in vars(args).items() if k in names}, **fields})


def add_process_options(command: argparse.ArgumentParser) -> None:
    """The options that make a command one of several processes (`hotjax launch` passes them;
    `processes(args)` reads them back for `start_jax`)."""
    group = command.add_argument_group("several processes (hotjax launch passes these)")
    group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    group.add_argument("--num-processes", type=int, metavar="N")
    group.add_argument("--process-id", type=int, metavar="I")
    group.add_argument("--heartbeat-timeout", type=int, default=HEARTBEAT_TIMEOUT_S, metavar="S",
                       help="stop when another process has been silent this long "
                       "(default: %(default)s s)")


def processes(args: argparse.Namespace) -> tuple[str | None, int | None, int | None, int]:
    """What `add_process_options` read, as `start_jax` takes it."""
    return (args.coordinator, args.num_processes, args.process_id, args.heartbeat_timeout)


def add_preempt_signal(command: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    command.add_argument("--preempt-signal", metavar="SIGNAL", help="a signal that stops the "
                         "run as SIGTERM and SIGINT do (finish the step, save, exit "
                         f"{REQUEUE_EXIT}), e.g. USR1 for SLURM's --signal=USR1@60")
