"""`hotjax ckpt`: inspect a checkpoint, and import and export it in the formats of
`checkpoint.formats` (Hugging Face, PyTorch DCP, DeepSpeed, Megatron, shard sets), one command
each. (Training saves and resumes through `hotjax train --ckpt-dir / --resume-from`.)"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

from hotjax.checkpoint import formats
from hotjax.checkpoint.formats.spec import EMBEDDING, RECORDED, Format, Option
from hotjax.startup import start_jax


def register(commands: argparse._SubParsersAction) -> None:
    ckpt = commands.add_parser("ckpt", help="inspect, import and export checkpoints")
    sub = ckpt.add_subparsers(dest="ckpt_command", required=True)

    inspect = sub.add_parser("inspect", help="step, sizes, arrays, metadata and the layout that "
                             "wrote a checkpoint")
    inspect.add_argument("path", help="a step directory, or a checkpoint directory (its latest)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(handler=_inspect)
    for fmt in formats.every():
        if fmt.imports:
            parser = sub.add_parser(f"import-{fmt.name}", help=fmt.import_help)
            parser.add_argument("source", help=fmt.source_help)
            parser.add_argument("out", help="a new checkpoint directory")
            if fmt.model:
                parser.add_argument("--config", help=f"the model's Hugging Face config.json "
                                    f"(default: {fmt.model_help})")
                vocabulary = ("its vocabulary size read from the checkpoint"
                              if fmt.model == EMBEDDING else "with its vocabulary (the "
                              "checkpoint's padding rows are dropped)")
                parser.add_argument("--model", help=f"a model preset instead, {vocabulary}")
            if fmt.tokenizer:
                parser.add_argument("--tokenizer", help="the tokenizer to record"
                                    + (" (default: the directory's tokenizer.json, if any)"
                                       if fmt.model is None else ""))
            _options(parser, fmt.import_options)
            parser.set_defaults(handler=functools.partial(_import, fmt))
        if fmt.exports:
            parser = sub.add_parser(f"export-{fmt.name}", help=fmt.export_help)
            parser.add_argument("path", help="a step directory, or a checkpoint directory")
            parser.add_argument("out", help="a new directory")
            _options(parser, fmt.export_options)
            parser.set_defaults(handler=functools.partial(_export, fmt))


def _options(parser: argparse.ArgumentParser, options: tuple[Option, ...]) -> None:
    for option in options:
        parser.add_argument(option.flag, help=option.help, **dict(option.settings))


def _inspect(args: argparse.Namespace) -> None:
    start_jax(1)
    from hotjax.checkpoint.describe import describe

    info = describe(args.path)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print(info)


def _import(fmt: Format, args: argparse.Namespace) -> None:
    start_jax(1)
    from hotjax.checkpoint import model

    options = {o.dest: getattr(args, o.dest) for o in fmt.import_options}
    source = Path(args.source)
    if fmt.model:
        rows = fmt.rows if fmt.model == EMBEDDING else None
        options["config"] = model.for_import(
            args.config, args.model, beside=source, recorded=fmt.model == RECORDED,
            rows=None if rows is None else functools.partial(rows, source))
    if fmt.tokenizer:
        from hotjax.data import load_tokenizer

        options["tokenizer"] = load_tokenizer(args.tokenizer, None) if args.tokenizer else None
    _report_import(fmt.imports(source, args.out, **options))


def _export(fmt: Format, args: argparse.Namespace) -> None:
    start_jax(1)
    options = {o.dest: getattr(args, o.dest) for o in fmt.export_options}
    print(f"wrote {fmt.exports(args.path, args.out, **options)}")


def _report_import(step_dir: Path) -> None:
    """What an import wrote; of a foreign run's state, its optimizer and the settings recorded."""
    from hotjax.checkpoint import meta as meta_lib
    from hotjax.models.optimizers import DEFAULT, named

    meta = meta_lib.read(step_dir)
    foreign = (meta.get("written_from") or {}).get("foreign") or {}
    if "naming" not in foreign:  # weights converted by name: nothing more to say
        print(f"wrote {step_dir}")
        return
    optimizer = meta.get("optimizer") or {}
    label = named(optimizer.get("name", DEFAULT)).label
    what = (f"parameters, {label} moments" if "opt_state" in meta["items"]
            else "parameters only (no optimizer state saved)")
    print(f"wrote {step_dir}: step {meta['step']}, {what}, {foreign['naming']} naming, "
          f"from {foreign['format']}")
    found = {k: v for k, v in optimizer.items() if k not in ("name", "source", "loss_scaling")}
    if found:
        def show(v: Any) -> str:
            if isinstance(v, list | tuple):
                return "/".join(map(show, v))
            return f"{v:g}" if isinstance(v, int | float) else str(v)

        print(f"the {foreign['format']} run's {label}: " + ", ".join(
            f"{k} {show(v)}" for k, v in found.items())
              + " (a hotjax run resumes with its own optimizer settings)")


def _print_table(record: dict[str, Any] | None, console: Any) -> None:
    """The run's strategy table as the TOML `hotjax train --strategies` loads."""
    from rich.markup import escape

    from hotjax.errors import UserError
    from hotjax.sharding.table import parse_table

    if record is None:
        console.print("[bold]strategy table[/]: none recorded")
        return
    try:
        text = parse_table(record, "the recorded table").toml()
    except UserError:  # written by an older hotjax, in another form
        text = str(record)
    console.print("[bold]strategy table[/] (TOML, as --strategies loads it):")
    console.print(escape(text.rstrip()))


def _print_run(options: dict[str, Any] | None, console: Any) -> None:
    """The options of the run that wrote it, as the file `hotjax train --config` reads."""
    from rich.markup import escape

    from hotjax.commands import config_file

    if options is None:
        console.print("[bold]run options[/]: none recorded")
        return
    console.print("[bold]run options[/] (TOML, as --config reads them):")
    console.print(escape(config_file.toml(options).rstrip()))


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
    _print_run(info.get("run"), console)
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
