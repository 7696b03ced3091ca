"""The model a checkpoint holds, resolved in one place for every import and export.

- A hotjax checkpoint records its model (`saved`).
- A foreign checkpoint's model comes from the command line (`for_import`): `--config`, a Hugging
  Face config.json; or `--model`, a preset, whose vocabulary is the checkpoint's where its
  embedding holds the real one (DCP, DeepSpeed) and the preset's where the embedding is padded
  (Megatron's); else, for a format that records its model (Megatron's args), that record, read
  by the importer (None here); else the config.json beside the checkpoint.
- A manifest names its model itself (`from_manifest`), in the same three forms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hotjax.checkpoint import meta as meta_lib
from hotjax.errors import UserError
from hotjax.models.hf import CONFIG_FILE, config_from_hf, read_json
from hotjax.models.llama import LlamaConfig, preset


def saved(meta: dict[str, Any], step_dir: Path) -> LlamaConfig:
    """The model a hotjax checkpoint records (its `meta`), checked to fit this host."""
    return LlamaConfig.checked(meta["model"], f"{step_dir / meta_lib.META_FILE}: model",
                               meta_lib.DAMAGED)


def _preset(name: str, vocab_size: int, where: str, fix: str) -> LlamaConfig:
    # The vocabulary may be a checkpoint's claim: checked before the model is sized by it.
    return LlamaConfig.checked({**preset(name).to_dict(), "vocab_size": vocab_size,
                                "compute_dtype": "float32"}, where, fix)


def for_import(config_json: str | Path | None, model: str | None, *, beside: Path,
               rows: Callable[[], int] | None, recorded: bool = False) -> LlamaConfig | None:
    """The model a foreign checkpoint at `beside` holds: its Hugging Face config.json
    (`config_json`), or the preset `model` with `rows()` rows of vocabulary (the checkpoint's
    embedding; None: the preset's own, the checkpoint's rows being padding); with neither, None
    where the checkpoint `recorded` its model (its importer reads it), else the config.json
    beside it."""
    if config_json is not None and model is not None:
        raise UserError("--config and --model both name the model: pass one")
    if model is not None:
        vocab = preset(model).vocab_size if rows is None else rows()
        return _preset(model, vocab, f"{beside} (with --model {model})",
                       "pass the checkpoint's own --config")
    if config_json is None and recorded:
        return None
    file = Path(config_json) if config_json is not None else beside / CONFIG_FILE
    if not file.is_file():
        raise UserError(f"{file}: no such config.json: pass the model's Hugging Face config "
                        f"with --config, or a preset with --model")
    return config_from_hf(read_json(file))


def from_manifest(spec: str | dict[str, Any], path: Path) -> LlamaConfig:
    """A manifest's model (`spec`, the manifest at `path`): a preset, config fields over an
    optional preset, or a Hugging Face config.json beside the manifest."""
    if isinstance(spec, str):
        return dataclasses.replace(preset(spec), compute_dtype="float32")
    if "hf_config" in spec:
        return config_from_hf(read_json(path.parent / spec["hf_config"]))
    fields = {k: v for k, v in spec.items() if k != "preset"}
    base = preset(spec["preset"]).to_dict() if "preset" in spec else {}
    return LlamaConfig.checked({**base, **fields, "compute_dtype": "float32"},
                               f"{path}: model", "fix the manifest's model")
