"""The `hotjax` command line. JAX is imported only after the device count is settled.

Each command group lives beside what it drives and registers itself here through
`register(commands)`, which adds a subparser whose `handler` default takes the parsed args.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import typing
from collections.abc import Sequence

from hotjax import SIMULATED_CPU_DEVICES, start_jax
from hotjax.config import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_MODEL,
    DEFAULT_WARMUP_STEPS,
    RunConfig,
    memory_size,
)
from hotjax.distributed import HEARTBEAT_TIMEOUT_S
from hotjax.preemption import REQUEUE_EXIT, Preempted, StopSignals, parse_signal
from hotjax.targets import quiet_plugin_without_a_driver
from models.errors import UserError
from models.options import ATTENTION_BACKENDS, REMAT_POLICIES

# Modules with a `register(commands)` function, each adding one command group.
COMMAND_MODULES: tuple[str, ...] = ("hotjax.strategy_cli", "hotjax.data.cli", "hotjax.planning.cli",
                                    "hotjax.checkpoint.cli", "hotjax.launch")
_RUN = RunConfig()  # the defaults


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


PROCESS_OPTIONS = ("coordinator", "num_processes", "process_id", "heartbeat_timeout")
SIGNAL_OPTIONS = ("preempt_signal",)


def processes(args: argparse.Namespace) -> tuple[str | None, int | None, int | None, int]:
    return tuple(getattr(args, k) for k in PROCESS_OPTIONS)


def _register_train(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train", help="train a LLaMA model (default: the small preset on the Python stdlib)")
    train.set_defaults(handler=_train)
    train.add_argument("--model", help=f"model preset (default: the checkpoint's model when "
                       f"resuming, else {DEFAULT_MODEL})")
    layout = train.add_mutually_exclusive_group()
    layout.add_argument("--strategy", help='mesh and rules, e.g. "data=2,fsdp=4" or '
                        '"fsdp=8,rules=fsdp" (default: data parallel over all devices)')
    layout.add_argument("--strategies", metavar="TABLE.toml", help="a strategy table, or "
                        "'auto': planned for this machine's devices by `hotjax plan`'s cost "
                        "model (measured once, cached)")
    train.add_argument("--devices", type=int, help="use N devices; on CPU, N simulated ones "
                       f"(default: all accelerators, or {SIMULATED_CPU_DEVICES} simulated CPUs)")
    train.add_argument("--data", help="a directory of text files, a .jsonl with a 'text' field, "
                       "or a text file (default: the Python standard library's .py files)")
    train.add_argument("--tokenizer", help="tokenizer.json, a SentencePiece .model, or 'bytes' "
                       "(default: a byte-level BPE trained on the corpus and cached)")
    train.add_argument("--vocab-size", type=int, default=_RUN.vocab_size,
                       help="vocabulary of the BPE trained when no --tokenizer is given")
    train.add_argument("--context", type=int, default=_RUN.context,
                       help="row length in tokens with --strategy (a table sets its own)")
    train.add_argument("--steps", type=int, default=_RUN.steps)
    train.add_argument("--seed", type=int, default=_RUN.seed)
    size = train.add_mutually_exclusive_group()
    size.add_argument("--batch-tokens", type=int, help="real tokens per optimizer step: the "
                      f"next documents up to this many (default: {DEFAULT_BATCH_TOKENS})")
    size.add_argument("--batch-sequences", type=int, help="or sequences per optimizer step")
    train.add_argument("--long-documents", choices=("truncate", "split"),
                       default=_RUN.long_documents, help="documents longer than the context: "
                       "truncated (as HotSPa) or split into context-length pieces")
    train.add_argument("--compute-dtype", choices=("bfloat16", "float16", "float32"),
                       default=_RUN.compute_dtype, help="matmul dtype over fp32 master weights "
                       "(default: %(default)s; float16 scales the loss)")
    train.add_argument("--loss-scale", metavar="dynamic|off|SCALE",
                       help="loss scaling: dynamic (the default with float16: halved on "
                       "overflow, doubled after --loss-scale-period good steps), off (the "
                       "default otherwise), or a number for a static scale")
    train.add_argument("--initial-loss-scale", type=float, default=_RUN.initial_loss_scale,
                       metavar="SCALE", help="where a dynamic scale starts (default: 2^15)")
    train.add_argument("--loss-scale-period", type=int, default=_RUN.loss_scale_period,
                       metavar="N", help="finite steps after which a dynamic scale doubles "
                       "(default: %(default)s)")
    train.add_argument("--remat", choices=REMAT_POLICIES, help="what each layer recomputes in "
                       "the backward pass: nothing, all but its weight matmuls' outputs (dots), "
                       "or everything (full); for table buckets that name none (default: the "
                       "cheapest that fits --device-memory, else none)")
    train.add_argument("--attention", choices=ATTENTION_BACKENDS, default=_RUN.attention,
                       help="attention kernel (default: %(default)s: the fastest correct one "
                       "for the platform; dense is the reference)")
    train.add_argument("--attention-block", type=int, default=_RUN.attention_block,
                       metavar="TOKENS", help="block edge of the blockwise attention kernel "
                       "(default: the platform's)")
    train.add_argument("--lr", type=float, default=_RUN.lr, help="peak learning rate")
    train.add_argument("--warmup-steps", type=int, help="linear warmup, 0 to --steps "
                       f"(default: {DEFAULT_WARMUP_STEPS}, or --steps if fewer)")
    train.add_argument("--metrics-jsonl", metavar="PATH", help="one JSON object per step")
    train.add_argument("--log-every", type=int, default=_RUN.log_every,
                       help="print a line every N steps")
    train.add_argument("--device-memory", type=memory_size, metavar="SIZE",
                       help="per-device memory budget, like 80GiB or 512MiB (a bare number is "
                       "MiB): the model state and every compiled step must fit, as XLA's memory "
                       "analysis reports them; micro-steps are sized to it")
    train.add_argument("--bucket-timings", action="store_true", help="time each bucket's "
                       "compute and switches (waits for the devices after each bucket)")
    train.add_argument("--balance", action=argparse.BooleanOptionalAction, default=_RUN.balance,
                       help="place each bucket's rows on data shards so that their estimated "
                       "work is equal (default: on; --no-balance: in packing order)")
    add_process_options(train)
    ckpt = train.add_argument_group("checkpoints")
    ckpt.add_argument("--ckpt-dir", metavar="DIR", help="save checkpoints here; resume from "
                      "the latest complete one in it")
    ckpt.add_argument("--save-every", type=int, metavar="N",
                      help="save every N steps (default: the last step only)")
    ckpt.add_argument("--resume-from", metavar="PATH", help="resume from this checkpoint: a "
                      "step directory, or a checkpoint directory (its latest)")
    ckpt.add_argument("--keep-last", type=int, default=_RUN.keep_last, metavar="N",
                      help="keep the newest N checkpoints (default: %(default)s)")
    ckpt.add_argument("--keep-every", type=int, metavar="K",
                      help="also keep every checkpoint whose step is a multiple of K")
    ckpt.add_argument("--preempt-signal", metavar="SIGNAL", help="a signal that stops the run "
                      "as SIGTERM and SIGINT do (finish the step, save, exit "
                      f"{REQUEUE_EXIT}), e.g. USR1 for SLURM's --signal=USR1@60")


def run_config(argv: Sequence[str]) -> RunConfig:
    """The run `hotjax train` with these arguments (starting with "train") makes."""
    return _run_config(_parser().parse_args(argv))


def _run_config(args: argparse.Namespace) -> RunConfig:
    return RunConfig(**{k: v for k, v in vars(args).items()
                        if k not in ("command", "handler", *PROCESS_OPTIONS,
                                     *SIGNAL_OPTIONS)})


def _train(args: argparse.Namespace) -> None:
    run = _run_config(args)  # every option checked before JAX starts
    # Watched before JAX starts its threads, which then inherit the blocked signals.
    with StopSignals(parse_signal(args.preempt_signal)) as stop:
        start_jax(args.devices, processes(args))
        import jax

        from hotjax import distributed
        from hotjax.run import train

        try:
            train(run, stop=stop)
        except jax.errors.JaxRuntimeError as e:
            lost = distributed.lost_peer(e, jax.process_index(), jax.process_count())
            if lost is None:
                raise
            raise UserError(lost) from None


class _Parser(argparse.ArgumentParser):
    """argparse, its errors (an unknown flag, `--steps abc`) in hotjax's one-line form."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"hotjax: error: {message}: see {self.prog} --help\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hotjax", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    _register_train(commands)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "target", None) is None:
        quiet_plugin_without_a_driver()
    try:
        code = args.handler(args)  # an exit code, or None for success
    except UserError as e:
        print(f"hotjax: error: {e}", file=sys.stderr)
        return 2
    except Preempted as e:
        if e.speaks:
            print(f"hotjax: {e}", file=sys.stderr)
        return REQUEUE_EXIT
    except KeyboardInterrupt:
        print("hotjax: interrupted", file=sys.stderr)
        return 130
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
