"""The checkpoint formats hotjax converts, one row each: `hotjax ckpt import-NAME` and
`export-NAME` are built from this table (`commands.ckpt`). Adding a format is one module (its
import and/or export function), one row here, and its test.

An import function is called `(source, out, **options)`, with `config=` (the model, resolved by
`checkpoint.model.for_import`) where the row says how the model is found, and `tokenizer=` (a
loaded tokenizer, or None) where the row records one; an export function `(path, out,
**options)`. Both return what they wrote. Free of JAX imports: the command line is built from
the table before JAX starts; a row names its module, imported when its command runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models.options import CHECKPOINT_NAMINGS

# How an import finds its model (`checkpoint.model.for_import`): --config, or --model with the
# vocabulary of the checkpoint's embedding ("embedding": the row's `rows` function reads it) or
# the preset's own (the checkpoint pads it, and records its model: "recorded").
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
    module: str  # hotjax.checkpoint.<module> holds its functions
    imports: str | None = None  # the import function's name
    import_help: str = ""
    source_help: str = ""  # what the import reads
    exports: str | None = None  # the export function's name
    export_help: str = ""
    model: str | None = None  # EMBEDDING, RECORDED, or None: the source names its model
    model_help: str = ""  # where the model comes from without --config or --model
    rows: str | None = None  # EMBEDDING: the function reading the embedding's rows
    tokenizer: bool = True  # the import records a --tokenizer
    import_options: tuple[Option, ...] = ()
    export_options: tuple[Option, ...] = ()


def _dtype(help: str) -> Option:
    return Option("--dtype", f"{help} (default: %(default)s)",
                  (("choices", DTYPES), ("default", "float32")))


FORMATS = (
    Format("hf", "convert",
           imports="import_hf", import_help="a Hugging Face LLaMA directory to a weights-only "
           "checkpoint", source_help="the directory (config.json, *.safetensors)",
           exports="export_hf", export_help="a checkpoint's parameters to a Hugging Face LLaMA "
           "directory", export_options=(_dtype("weights' dtype"),)),
    Format("dcp", "dcp",
           imports="import_dcp", import_help="a PyTorch Distributed Checkpoint (torchtitan, "
           "FSDP2, DTensor) to a checkpoint that resumes its training: weights, AdamW moments "
           "and step", source_help="the directory torch.distributed.checkpoint.save wrote "
           "(.metadata and *.distcp)",
           exports="export_dcp", export_help="a checkpoint to a PyTorch Distributed Checkpoint "
           "that torch loads into any sharding of the model",
           model=EMBEDDING, model_help="config.json beside the checkpoint",
           rows="embedding_rows",
           import_options=(Option("--naming", "the tensors' names (default: detected)",
                                  (("choices", CHECKPOINT_NAMINGS),)),),
           export_options=(Option("--naming", "the tensors' names (default: %(default)s)",
                                  (("choices", CHECKPOINT_NAMINGS), ("default", "hf"))),
                           _dtype("weights' dtype; the optimizer's state stays float32"))),
    Format("deepspeed", "deepspeed",
           imports="import_deepspeed", import_help="a DeepSpeed checkpoint (ZeRO-1/2/3 rank "
           "files of any data-parallel size, or a universal directory) to a checkpoint that "
           "resumes its training: fp32 weights, AdamW moments and step",
           source_help="the directory engine.save_checkpoint wrote (or one step of it), or "
           "ds_to_universal's output",
           model=EMBEDDING, model_help="config.json beside the checkpoint",
           rows="embedding_rows"),
    Format("universal", "universal",
           exports="export_universal", export_help="a checkpoint to a universal directory that "
           "DeepSpeed resumes (load_universal) under any ZeRO stage and data-parallel size"),
    Format("megatron-core", "megatron_core",
           imports="import_megatron_core", import_help="a Megatron-Core torch_dist checkpoint "
           "(Megatron-LM's default format, of any TP/PP/DP) to a checkpoint: weights, and "
           "Adam's moments and step where saved per parameter",
           source_help="the checkpoint's root (latest_checkpointed_iteration.txt names the "
           "iteration) or one iteration's directory",
           model=RECORDED, model_help="the model the checkpoint's args record",
           import_options=(Option("--weights-only", "leave the optimizer state out (needed "
                                  "for the distributed optimizer's default dp_reshardable "
                                  "format)", (("action", "store_true"),)),)),
    Format("shards", "megatron",
           imports="import_shards", import_help="per-rank files of a TP/PP/ZeRO run to a "
           "weights-only checkpoint: described by a manifest, or Megatron-LM's",
           source_help="a .toml or .json manifest (format: hotjax.checkpoint.manifest); with "
           "--format megatron, a Megatron checkpoint directory (its root or one iteration's)",
           model=RECORDED, model_help="with --format megatron, the model the rank files' args "
           "record", tokenizer=False,
           import_options=(
               Option("--format", "megatron: mp_rank_XX[_YYY]/model_optim_rng.pt files, their "
                      "manifest derived from the files (default: %(default)s)",
                      (("choices", ("manifest", "megatron")), ("default", "manifest"))),
               Option("--workers", "conversion processes (default: one per core, at most 8)",
                      (("type", int),)))),
)
