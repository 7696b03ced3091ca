"""`hotjax ckpt`: inspect a checkpoint, import and export Hugging Face weights, import foreign
shard sets. (Training saves and resumes through `hotjax train --ckpt-dir / --resume-from`.)"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hotjax.cli import start_jax


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

    shards = sub.add_parser("import-shards", help="per-rank files of a TP/PP/ZeRO run, "
                            "described by a manifest, to a weights-only checkpoint")
    shards.add_argument("manifest", help="a .toml or .json manifest (format: "
                        "hotjax.checkpoint.manifest)")
    shards.add_argument("out", help="a new checkpoint directory")
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


def _import_shards(args: argparse.Namespace) -> None:
    from models.errors import UserError

    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers {args.workers}: pass a positive number of processes")
    start_jax(1)
    from hotjax.checkpoint.foreign import import_shards

    print(f"wrote {import_shards(args.manifest, args.out, args.workers)}")


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
    line("strategy table", info.get("strategy_table"))
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
