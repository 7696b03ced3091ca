"""Hugging Face LLaMA directories to and from weights-only checkpoints, and what `inspect` shows.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from hotjax.checkpoint import dirs, model, store
from hotjax.checkpoint import meta as meta_lib
from hotjax.checkpoint import tokenizer as checkpoint_tokenizer
from hotjax.data.tokenizer import hf_files
from models.errors import UserError
from models.hf import (
    CONFIG_FILE,
    config_from_hf,
    hf_param_makers,
    hf_tensors_of,
    param_keys,
    read_json,
    write_hf_directory,
)
from models.llama import abstract_params, param_axes


def import_hf(hf_dir: str | Path, out: str | Path, *, tokenizer: Any = None) -> Path:
    """A weights-only checkpoint of a Hugging Face LLaMA directory, at step 0, carrying the
    tokenizer (loaded, else the directory's tokenizer.json or tokenizer.model if any)."""
    dirs.check_new_directory(out)
    hf_dir = Path(hf_dir).absolute()
    if not hf_dir.is_dir():
        raise UserError(f"{hf_dir}: no such checkpoint directory")
    config = config_from_hf(read_json(hf_dir / CONFIG_FILE))
    params = store.pending(hf_param_makers(hf_tensors_of(hf_dir), config,
                                           where=f"{hf_dir}: tensor"), abstract_params(config))
    tokenizer = tokenizer or checkpoint_tokenizer.beside(hf_dir)
    record = meta_lib.record(
        step=0, source=f"import-hf {hf_dir}", items=[store.PARAMS], model=config.to_dict(),
        tokenizer=meta_lib.tokenizer_record(tokenizer) if tokenizer else None)
    return store.save_weights(out, params, record, tokenizer)


def export_hf(path: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """A Hugging Face LLaMA directory of a checkpoint's parameters, in `dtype`, with its
    tokenizer's files where it carries one (`AutoTokenizer` loads them) and the BOS and EOS
    ids to generate with. Vocabulary padding past the recorded tokenizer's size is left out,
    so the two agree."""
    out = dirs.check_new_directory(out)
    step_dir = dirs.find(path)
    meta = meta_lib.read(step_dir)
    config = model.saved(meta, step_dir)
    vocab = meta_lib.real_vocab(meta)
    axes = {dirs.array_path(p): a for p, a in jax.tree_util.tree_flatten_with_path(
        param_axes(config), is_leaf=lambda a: isinstance(a, tuple))[0]}
    like = store.by_name(abstract_params(config))
    arrays = ((key, store.trim(x, axes[key], vocab)) for key, x in store.restore_each(
        step_dir, store.PARAMS, {key: like[key] for key in param_keys(config)}))
    tokenizer = meta.get("tokenizer") or {}
    ids = {"bos_token_id": tokenizer.get("bos_id"), "eos_token_id": tokenizer.get("eos_id")}
    own = checkpoint_tokenizer.carried(step_dir, meta)
    files = hf_files(own, config.max_seq_len) if own else {}
    if tokenizer:
        files["generation_config.json"] = json.dumps(
            {**ids, "pad_token_id": tokenizer.get("pad_id")}, indent=2).encode()

    def write(scratch: Path) -> None:
        write_hf_directory(scratch, dataclasses.replace(config, vocab_size=vocab), arrays,
                           dtype, **ids)
        for name, data in files.items():
            (scratch / name).write_bytes(data)

    return dirs.write_atomically(out, write)


def describe(path: str | Path) -> dict[str, Any]:
    """A checkpoint's step, metadata, sizes and arrays (shape and dtype), read without
    loading any array."""
    step_dir = dirs.find(path)
    meta = meta_lib.read(step_dir)
    items = {}
    for item in meta["items"]:
        arrays = store.saved_arrays(step_dir, item)
        items[item] = {
            "disk_bytes": sum(f.stat().st_size for f in (step_dir / item).rglob("*")
                              if f.is_file()),
            "bytes": sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in arrays.values()),
            "arrays": {name: {"shape": list(a.shape), "dtype": str(a.dtype)}
                       for name, a in arrays.items()}}
    siblings = dirs.steps(step_dir.parent)
    return {"path": str(step_dir), "step": meta["step"],
            "steps_in_directory": siblings,
            **{k: v for k, v in meta.items() if k not in ("step", "fingerprints")},
            "data_position": meta_lib.read_data(step_dir), "arrays": items}
