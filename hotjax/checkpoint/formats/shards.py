"""Foreign shard sets as weights-only checkpoints (`hotjax ckpt import-shards`): per-rank files
of a TP/PP/ZeRO run described by a manifest (`checkpoint.manifest`), or Megatron-LM's rank
files, whose manifest `formats.megatron` derives; `formats.foreign` rebuilds the tensors."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hotjax.checkpoint.formats import foreign, megatron
from hotjax.checkpoint.formats.spec import RECORDED, Format, Option
from hotjax.checkpoint.manifest import load as load_manifest
from hotjax.errors import UserError

if TYPE_CHECKING:
    from hotjax.models.llama import LlamaConfig


def import_shards(source: str | Path, out: str | Path, *, format: str = "manifest",
                  config: LlamaConfig | None = None, workers: int | None = None) -> Path:
    """The shard set the manifest `source` describes, or (`format` "megatron") the Megatron
    checkpoint directory `source`, as a weights-only checkpoint at `out`."""
    from hotjax.checkpoint import dirs

    if workers is not None and workers < 1:
        raise UserError(f"--workers {workers}: pass a positive number of processes")
    if format == "megatron":
        return megatron.import_megatron(source, out, config=config, workers=workers)
    if config is not None:
        raise UserError("--config and --model go with --format megatron: a manifest names "
                        "its model itself")
    dirs.check_new_directory(out)
    manifest = load_manifest(source)
    return foreign.import_manifest(manifest, out, workers, source=f"import-shards {manifest.path}",
                                   layout=manifest.describe())


FORMAT = Format(
    "shards", imports=import_shards, import_help="per-rank files of a TP/PP/ZeRO run to a "
    "weights-only checkpoint: described by a manifest, or Megatron-LM's",
    source_help="a .toml or .json manifest (format: hotjax.checkpoint.manifest); with --format "
    "megatron, a Megatron checkpoint directory (its root or one iteration's)",
    model=RECORDED, model_help="with --format megatron, the model the rank files' args record",
    tokenizer=False,
    import_options=(
        Option("--format", "megatron: mp_rank_XX[_YYY]/model_optim_rng.pt files, their manifest "
               "derived from the files (default: %(default)s)",
               (("choices", ("manifest", "megatron")), ("default", "manifest"))),
        Option("--workers", "conversion processes (default: one per core, at most 8)",
               (("type", int),))))
