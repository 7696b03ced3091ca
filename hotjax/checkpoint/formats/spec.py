"""What a checkpoint format declares (`FORMAT` in each module of `checkpoint.formats`): its
commands' names, help and options, how its import finds the model, and its functions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

# How an import finds its model (`checkpoint.model.for_import`): --config, or --model with the
# vocabulary of the checkpoint's embedding ("embedding": the format's `rows` reads it) or the
# preset's own (the checkpoint pads it, and records its model: "recorded").
EMBEDDING, RECORDED = "embedding", "recorded"
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a format's command, as `argparse.add_argument` takes it."""

    flag: str
    help: str
    settings: tuple[tuple[str, Any], ...] = ()  # choices, default, type, action, metavar

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


@dataclasses.dataclass(frozen=True)
class Format:
    name: str  # the commands' suffix
    imports: Callable[..., Any] | None = None  # the import function
    import_help: str = ""
    source_help: str = ""  # what the import reads
    exports: Callable[..., Any] | None = None  # the export function
    export_help: str = ""
    model: str | None = None  # EMBEDDING, RECORDED, or None: the source names its model
    model_help: str = ""  # where the model comes from without --config or --model
    rows: Callable[[Any], int] | None = None  # EMBEDDING: reads the embedding's rows
    tokenizer: bool = True  # the import records a --tokenizer
    import_options: tuple[Option, ...] = ()
    export_options: tuple[Option, ...] = ()


def dtype_option(help: str) -> Option:
    return Option("--dtype", f"{help} (default: %(default)s)",
                  (("choices", DTYPES), ("default", "float32")))

