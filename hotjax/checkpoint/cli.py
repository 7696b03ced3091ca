"""`hotjax ckpt`: inspect a checkpoint, import and export Hugging Face weights, PyTorch
Distributed Checkpoints and DeepSpeed's (universal) checkpoints, import Megatron-Core's
torch_dist checkpoints and foreign shard sets.
(Training saves and resumes through `hotjax train --ckpt-dir / --resume-from`.)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hotjax import start_jax
from models.options import CHECKPOINT_NAMINGS


def register(commands: argparse._SubParsersAction) -> None:
    ckpt = commands.add_parser("ckpt", help="inspect, import and export checkpoints")
    sub = ckpt.add_subparsers(dest="ckpt_command", required=True)

    inspect = sub.add_parser("inspect", help="step, sizes, arrays, metadata and the layout that "
                             "wrote a checkpoint")
    inspect.add_argument("path", help="a step directory, or a checkpoint directory (its latest)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(handler=_inspect)

    import_hf = sub.add_parser("import-hf", help="a Hugging Face LLaMA directory to a "
                               "weights-only checkpoint")
    import_hf.add_argument("hf_dir")
    import_hf.add_argument("out", help="a new checkpoint directory")
    import_hf.add_argument("--tokenizer", help="the tokenizer to record (default: the "
                           "directory's tokenizer.json, if any)")
    import_hf.set_defaults(handler=_import_hf)

    export_hf = sub.add_parser("export-hf", help="a checkpoint's parameters to a Hugging Face "
                               "LLaMA directory")
    export_hf.add_argument("path", help="a step directory, or a checkpoint directory")
    export_hf.add_argument("out", help="a new directory")
    export_hf.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                           default="float32", help="weights' dtype (default: %(default)s)")
    export_hf.set_defaults(handler=_export_hf)

    import_dcp = sub.add_parser("import-dcp", help="a PyTorch Distributed Checkpoint "
                                "(torchtitan, FSDP2, DTensor) to a checkpoint that resumes its "
                                "training: weights, AdamW moments and step")
    import_dcp.add_argument("dcp_dir", help="the directory torch.distributed.checkpoint.save "
                            "wrote (.metadata and *.distcp)")
    import_dcp.add_argument("out", help="a new checkpoint directory")
    _model_flags(import_dcp, "(default: config.json beside the checkpoint)",
                 "its vocabulary size read from the checkpoint")
    import_dcp.add_argument("--naming", choices=CHECKPOINT_NAMINGS,
                            help="the tensors' names (default: detected)")
    import_dcp.add_argument("--tokenizer", help="the tokenizer to record")
    import_dcp.set_defaults(handler=_import_dcp)

    export_dcp = sub.add_parser("export-dcp", help="a checkpoint to a PyTorch Distributed "
                                "Checkpoint that torch loads into any sharding of the model")
    export_dcp.add_argument("path", help="a step directory, or a checkpoint directory")
    export_dcp.add_argument("out", help="a new directory")
    export_dcp.add_argument("--naming", choices=CHECKPOINT_NAMINGS, default="hf",
                            help="the tensors' names (default: %(default)s)")
    export_dcp.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                            default="float32", help="weights' dtype; AdamW moments stay "
                            "float32 (default: %(default)s)")
    export_dcp.set_defaults(handler=_export_dcp)

    import_ds = sub.add_parser("import-deepspeed", help="a DeepSpeed checkpoint (ZeRO-1/2/3 "
                               "rank files of any data-parallel size, or a universal directory) "
                               "to a checkpoint that resumes its training: fp32 weights, AdamW "
                               "moments and step")
    import_ds.add_argument("ds_dir", help="the directory engine.save_checkpoint wrote (or one "
                           "step of it), or ds_to_universal's output")
    import_ds.add_argument("out", help="a new checkpoint directory")
    _model_flags(import_ds, "(default: config.json beside the checkpoint)",
                 "its vocabulary size read from the checkpoint")
    import_ds.add_argument("--tokenizer", help="the tokenizer to record")
    import_ds.set_defaults(handler=_import_deepspeed)

    import_mc = sub.add_parser("import-megatron-core", help="a Megatron-Core torch_dist "
                               "checkpoint (Megatron-LM's default format, of any TP/PP/DP) to a "
                               "checkpoint: weights, and Adam's moments and step where saved "
                               "per parameter")
    import_mc.add_argument("mc_dir", help="the checkpoint's root (latest_checkpointed_iteration"
                           ".txt names the iteration) or one iteration's directory")
    import_mc.add_argument("out", help="a new checkpoint directory")
    _model_flags(import_mc, "(default: the model the checkpoint's args record)",
                 "with its vocabulary (the checkpoint's padding rows are dropped)")
    import_mc.add_argument("--weights-only", action="store_true", help="leave the optimizer "
                           "state out (needed for the distributed optimizer's default "
                           "dp_reshardable format)")
    import_mc.add_argument("--tokenizer", help="the tokenizer to record")
    import_mc.set_defaults(handler=_import_megatron_core)

    export_universal = sub.add_parser("export-universal", help="a checkpoint to a universal "
                                      "directory that DeepSpeed resumes (load_universal) under "
                                      "any ZeRO stage and data-parallel size")
    export_universal.add_argument("path", help="a step directory, or a checkpoint directory")
    export_universal.add_argument("out", help="a new directory")
    export_universal.set_defaults(handler=_export_universal)

    shards = sub.add_parser("import-shards", help="per-rank files of a TP/PP/ZeRO run to a "
                            "weights-only checkpoint: described by a manifest, or Megatron-LM's")
    shards.add_argument("source", help="a .toml or .json manifest (format: "
                        "hotjax.checkpoint.manifest); with --format megatron, a Megatron "
                        "checkpoint directory (its root or one iteration's)")
    shards.add_argument("out", help="a new checkpoint directory")
    shards.add_argument("--format", choices=("manifest", "megatron"), default="manifest",
                        help="megatron: mp_rank_XX[_YYY]/model_optim_rng.pt files, their "
                        "manifest derived from the files (default: %(default)s)")
    _model_flags(shards, "(--format megatron; default: the model the rank files' args record)",
                 "with its vocabulary (the files' padding rows are dropped)")
    shards.add_argument("--workers", type=int, help="conversion processes (default: one per "
                        "core, at most 8)")
    shards.set_defaults(handler=_import_shards)


def _inspect(args: argparse.Namespace) -> None:
    start_jax(1)
    from hotjax.checkpoint.convert import describe

    info = describe(args.path)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print(info)


def _import_hf(args: argparse.Namespace) -> None:
    start_jax(1)
    from hotjax.checkpoint.convert import import_hf

    print(f"wrote {import_hf(args.hf_dir, args.out, args.tokenizer)}")


def _export_hf(args: argparse.Namespace) -> None:
    start_jax(1)
    from hotjax.checkpoint.convert import export_hf

    print(f"wrote {export_hf(args.path, args.out, args.dtype)}")


def _model_flags(parser: argparse.ArgumentParser, config_default: str, model_help: str) -> None:
    parser.add_argument("--config", help=f"the model's Hugging Face config.json {config_default}")
    parser.add_argument("--model", help=f"a model preset instead, {model_help}")


def _import_dcp(args: argparse.Namespace) -> None:
    start_jax(1)
    from hotjax.checkpoint import dcp
    from hotjax.checkpoint.convert import model_config

    directory = Path(args.dcp_dir)
    config = model_config(args.config, args.model, beside=directory,
                          vocab_size=lambda: dcp.embedding_rows(directory))
    step_dir = dcp.import_dcp(directory, args.out, config, naming=args.naming,
                              tokenizer=_tokenizer(args))
    _report_import(step_dir, "torch")


def _import_deepspeed(args: argparse.Namespace) -> None:
    start_jax(1)
    from hotjax.checkpoint import deepspeed
    from hotjax.checkpoint.convert import model_config

    directory = Path(args.ds_dir)
    config = model_config(args.config, args.model, beside=directory,
                          vocab_size=lambda: deepspeed.embedding_rows(directory))
    step_dir = deepspeed.import_deepspeed(directory, args.out, config, tokenizer=_tokenizer(args))
    _report_import(step_dir, "DeepSpeed")


def _import_megatron_core(args: argparse.Namespace) -> None:
    start_jax(1)
    from hotjax.checkpoint import megatron_core
    from hotjax.checkpoint.convert import model_config
    from models.llama import preset

    directory = Path(args.mc_dir)
    # A preset's vocabulary is the real one; the checkpoint's embedding holds it padded.
    config = model_config(args.config, args.model, beside=directory,
                          vocab_size=lambda: preset(args.model).vocab_size) if (
        args.config or args.model) else None
    step_dir = megatron_core.import_megatron_core(directory, args.out, config=config,
                                                  weights_only=args.weights_only,
                                                  tokenizer=_tokenizer(args))
    _report_import(step_dir, "Megatron-Core")


def _tokenizer(args: argparse.Namespace) -> Any:
    from hotjax.data import load_tokenizer

    return load_tokenizer(args.tokenizer, None) if args.tokenizer else None


def _report_import(step_dir: Path, trainer: str) -> None:
    """What an import of a PyTorch run wrote, and the run's AdamW settings it recorded."""
    from hotjax.checkpoint import meta as meta_lib

    meta = meta_lib.read(step_dir)
    what = ("parameters, AdamW moments" if "opt_state" in meta["items"]
            else "parameters only (no optimizer state saved)")
    foreign = meta["written_from"]["foreign"]
    print(f"wrote {step_dir}: step {meta['step']}, {what}, {foreign['naming']} naming"
          + (f", from {foreign['format']}" if trainer != "torch" else ""))
    optimizer = meta.get("optimizer") or {}
    found = {k: v for k, v in optimizer.items() if k not in ("source", "loss_scaling")}
    if found:
        def show(v: Any) -> str:
            if isinstance(v, list | tuple):
                return "/".join(map(show, v))
            return f"{v:g}" if isinstance(v, int | float) else str(v)

        print(f"the {trainer} run's AdamW: " + ", ".join(f"{k} {show(v)}"
                                                        for k, v in found.items())
              + " (a hotjax run resumes with its own optimizer settings)")


def _export_dcp(args: argparse.Namespace) -> None:
    start_jax(1)
    from hotjax.checkpoint.dcp import export_dcp

    print(f"wrote {export_dcp(args.path, args.out, naming=args.naming, dtype=args.dtype)}")


def _export_universal(args: argparse.Namespace) -> None:
    start_jax(1)
    from hotjax.checkpoint.universal import export_universal

    print(f"wrote {export_universal(args.path, args.out)}")


def _import_shards(args: argparse.Namespace) -> None:
    from models.errors import UserError

    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers {args.workers}: pass a positive number of processes")
    if args.format == "manifest" and (args.config or args.model):
        raise UserError("--config and --model go with --format megatron: a manifest names its "
                        "model itself")
    start_jax(1)
    if args.format == "manifest":
        from hotjax.checkpoint.foreign import import_shards

        print(f"wrote {import_shards(args.source, args.out, args.workers)}")
        return
    from hotjax.checkpoint.convert import model_config
    from hotjax.checkpoint.megatron import import_megatron
    from models.llama import preset

    # A preset's vocabulary is the real one; the files' embedding holds it padded.
    config = model_config(args.config, args.model, beside=Path(args.source),
                          vocab_size=lambda: preset(args.model).vocab_size) if (
        args.config or args.model) else None
    print(f"wrote {import_megatron(args.source, args.out, config=config, workers=args.workers)}")


def _print_table(record: dict[str, Any] | None, console: Any) -> None:
    """The run's strategy table as the TOML `hotjax train --strategies` loads."""
    from rich.markup import escape

    from models.errors import UserError
    from sharding.table import parse_table

    if record is None:
        console.print("[bold]strategy table[/]: none recorded")
        return
    try:
        text = parse_table(record, "the recorded table").toml()
    except UserError:  # written by an older hotjax, in another form
        text = str(record)
    console.print("[bold]strategy table[/] (TOML, as --strategies loads it):")
    console.print(escape(text.rstrip()))


def _print(info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)

    def line(label: str, value: Any) -> None:
        console.print(f"[bold]{label}[/]: {escape(str(value))}")

    console.print(f"[bold]{escape(info['path'])}[/]: step {info['step']} "
                  f"({escape(info['source'])}, hotjax {info.get('hotjax_version')})")
    line("complete steps in its directory", info["steps_in_directory"])
    line("model", ", ".join(f"{k}={v}" for k, v in info["model"].items()))
    line("tokenizer", info.get("tokenizer"))
    line("written from", info.get("written_from") or "unknown")
    _print_table(info.get("strategy_table"), console)
    line("data", info.get("data"))
    line("data position", info.get("data_position"))
    line("optimizer", info.get("optimizer"))
    table = Table(title="arrays")
    for column in ("item", "array", "shape", "dtype"):
        table.add_column(column)
    for item, content in info["arrays"].items():
        for name, array in content["arrays"].items():
            table.add_row(item, name, "x".join(map(str, array["shape"])) or "scalar",
                          array["dtype"])
    console.print(table)
    for item, content in info["arrays"].items():
        console.print(f"{item}: {len(content['arrays'])} arrays, {content['bytes'] / 2**20:.2f} "
                      f"MiB in memory, {content['disk_bytes'] / 2**20:.2f} MiB on disk")
