"""Hugging Face LLaMA directories (config.json, *.safetensors: the pivot's weights as files) to
and from weights-only checkpoints."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from hotjax.checkpoint import meta as meta_lib
from hotjax.checkpoint.formats.spec import Format, dtype_option
from hotjax.errors import UserError


def import_hf(hf_dir: str | Path, out: str | Path, *, tokenizer: Any = None) -> Path:
    """A weights-only checkpoint of a Hugging Face LLaMA directory, at step 0, carrying the
    tokenizer (loaded, else the directory's tokenizer.json or tokenizer.model if any)."""
    from hotjax.checkpoint import dirs, store
    from hotjax.checkpoint import tokenizer as checkpoint_tokenizer
    from hotjax.models.hf import (
        CONFIG_FILE,
        config_from_hf,
        hf_param_makers,
        hf_tensors_of,
        read_json,
    )
    from hotjax.models.llama import abstract_params

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
    import jax

    from hotjax.checkpoint import dirs, model, store
    from hotjax.checkpoint import tokenizer as checkpoint_tokenizer
    from hotjax.data.tokenizer import hf_files
    from hotjax.models.hf import param_keys, write_hf_directory
    from hotjax.models.llama import abstract_params, param_axes

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


FORMAT = Format(
    "hf", imports=import_hf, import_help="a Hugging Face LLaMA directory to a weights-only "
    "checkpoint", source_help="the directory (config.json, *.safetensors)",
    exports=export_hf, export_help="a checkpoint's parameters to a Hugging Face LLaMA directory",
    export_options=(dtype_option("weights' dtype"),))
