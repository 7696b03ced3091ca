"""`--config FILE.toml` or `FILE.yaml`: a command's options read from a TOML or YAML file, its
keys the options' names (`lr = 3e-4` or `lr: 3e-4`, `batch-tokens` or `batch_tokens`), flat or in
sections of any name ([optimizer], or a mapping `optimizer:`); the flags given on the command
line override it. Each value is checked as its flag's would be."""

from __future__ import annotations

import argparse
import difflib
import json
import tomllib
from pathlib import Path
from typing import Any

from hotjax.bounds import MAX_JSON_BYTES
from hotjax.commands.options import EXCLUSIVE
from hotjax.errors import UserError

# Not `config`: `hotjax ckpt import-hf --config` names a model's config.json.
DEST = "config_file"


def add_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", dest=DEST, metavar="FILE.toml|FILE.yaml", help="read the "
                        "options from this TOML file (lr = 3e-4, batch-tokens = 4096, flat or "
                        "in [sections]) or YAML file (.yaml/.yml: lr: 3e-4, flat or in one "
                        "level of mappings; null leaves an option at its default), each key an "
                        "option's name; flags given override it; `hotjax ckpt inspect` prints "
                        "a run's as a TOML file")


def read(path: str, command: argparse.ArgumentParser) -> dict[str, Any]:
    """The options `path` sets, by their destination in `command`'s arguments, each converted
    and checked as its flag's value is."""
    actions = {a.dest: a for a in command._actions  # every option the command takes
               if a.option_strings and a.dest not in (argparse.SUPPRESS, "help", DEST)}
    found: dict[str, Any] = {}
    for key, value in _options(path).items():
        dest = key.replace("-", "_")
        if dest not in actions:
            close = difflib.get_close_matches(dest, actions, n=1)
            hint = f"did you mean {_name(close[0])}? " if close else ""
            raise UserError(f"{path}: unknown option {key!r}: {hint}(`{command.prog} --help` "
                            f"lists them)")
        if dest in found:
            raise UserError(f"{path}: option {_name(dest)} given twice: keep one")
        found[dest] = _value(actions[dest], value, f"{path}: {key} = {value!r}")
    for pair in EXCLUSIVE:
        if set(pair) <= set(found):
            raise UserError(f"{path}: {_name(pair[0])} and {_name(pair[1])} both given: keep one")
    return found


def flags_win(args: argparse.Namespace, found: dict[str, Any]) -> argparse.Namespace:
    """`args` parsed with the file's options `found` as defaults, less those of the file whose
    `EXCLUSIVE` partner a flag gave (`--batch-sequences` on the command line drops the file's
    batch-tokens)."""
    for pair in EXCLUSIVE:
        for own, other in (pair, pair[::-1]):
            if own in found and other not in found and getattr(args, other, None) is not None:
                setattr(args, own, None)
    return args


def toml(options: dict[str, Any]) -> str:
    """`options` (a run's, as a checkpoint records them) as the file `--config` reads: one
    `name = value` line each, those unset (null) left out."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return json.dumps(v) if isinstance(v, str) else repr(v)  # repr(inf): TOML's inf

    return "".join(f"{_name(k)} = {value(v)}\n" for k, v in options.items() if v is not None)


def _options(path: str) -> dict[str, Any]:
    """The file's keys and values, sections flattened; a YAML null is no value."""
    table = _table(path)
    flat: dict[str, Any] = {}
    for key, value in table.items():
        for inner, item in (value.items() if isinstance(value, dict) else ((key, value),)):
            if isinstance(item, dict):
                raise UserError(f"{path}: {key}.{inner}: options sit at the top or in one "
                                f"level of sections")
            if not isinstance(inner, str):
                raise UserError(f"{path}: key {inner!r} is not an option's name: write the "
                                f"option's name")
            if inner in flat:
                raise UserError(f"{path}: option {inner!r} given twice: keep one")
            if item is not None:
                flat[inner] = item
    return flat


def _table(path: str) -> dict[Any, Any]:
    """The TOML or YAML (by its suffix) file's top-level table, read only if at most
    MAX_JSON_BYTES."""
    form = "YAML" if Path(path).suffix.lower() in (".yaml", ".yml") else "TOML"
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_JSON_BYTES + 1)
    except OSError as e:
        raise UserError(f"--config {path}: {e.strerror or e}: give a {form} file of "
                        f"options") from None
    if len(raw) > MAX_JSON_BYTES:
        raise UserError(f"--config {path}: over {MAX_JSON_BYTES:,} bytes (MAX_JSON_BYTES), more "
                        f"than any file of options: give a {form} file of options")
    try:
        text = raw.decode()
        table = tomllib.loads(text) if form == "TOML" else _yaml(text)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, ValueError) as e:
        reason = " ".join(str(e).split())
        raise UserError(f"--config {path}: not {form}: {reason}") from None
    if not isinstance(table, dict):
        raise UserError(f"--config {path}: holds a {type(table).__name__}, not a mapping of "
                        f"options: write one `name: value` a line")
    return table


def _yaml(text: str) -> Any:
    """YAML text as plain values (`yaml.safe_load`: no tags that build objects), a key given
    twice refused as TOML refuses it; an empty file is an empty table. Its errors as
    ValueError."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            mapping = super().construct_mapping(node, deep)
            keys = [self.construct_object(key, deep) for key, _ in node.value]
            for at, key in enumerate(keys):
                if key in keys[:at]:
                    raise ValueError(f"key {key!r} given twice (line "
                                     f"{node.value[at][0].start_mark.line + 1}): keep one")
            return mapping

    try:
        value = yaml.load(text, Loader)  # noqa: S506 (a SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        raise ValueError(f"{e.problem} (line {mark.line + 1}, column {mark.column + 1})"
                         if mark else e.problem) from None
    except yaml.YAMLError as e:
        raise ValueError(" ".join(str(e).split())) from None
    except RecursionError:
        raise ValueError("it nests too deep") from None
    return {} if value is None else value


def _value(action: argparse.Action, value: Any, where: str) -> Any:
    """`value` as the flag of `action` would read it from the command line."""
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise UserError(f"{where}: give true or false")
        return value
    convert = action.type or str
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise UserError(f"{where}: give a {_kind(convert)}")
    try:
        converted = convert(str(value))
    except argparse.ArgumentTypeError as e:
        raise UserError(f"{where}: {e}") from None
    except ValueError:
        raise UserError(f"{where}: give a {_kind(convert)}") from None
    if action.choices is not None and converted not in action.choices:
        raise UserError(f"{where}: choose one of {', '.join(map(str, action.choices))}")
    return converted


def _kind(convert: Any) -> str:
    return {int: "whole number", float: "number", str: "string"}.get(convert, "value")


def _name(dest: str) -> str:
    return dest.replace("_", "-")
