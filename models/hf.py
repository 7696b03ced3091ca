"""Hugging Face LLaMA interop: config.json and safetensors to and from a hotjax `Llama`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from models.errors import UserError
from models.llama import Llama, LlamaConfig, RopeScaling, abstract_params, bind

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = ("float32", "bfloat16", "float16")
_METADATA = {"format": "pt"}  # transformers refuses safetensors files without it

# Stacked hotjax layer param -> (HF name inside layer i, fan-in dims). A linear's HF weight is
# [out, in]; ours keeps the `fan-in` leading dims as its input, so HF = ours.reshape(in, out).T.
# Fan-in 0: stored as is. Both conventions rotate half, so q/k need no permutation.
_LAYER = {
    "attn_norm": ("input_layernorm.weight", 0),
    "wq": ("self_attn.q_proj.weight", 1),
    "wk": ("self_attn.k_proj.weight", 1),
    "wv": ("self_attn.v_proj.weight", 1),
    "wo": ("self_attn.o_proj.weight", 2),
    "mlp_norm": ("post_attention_layernorm.weight", 0),
    "w_gate": ("mlp.gate_proj.weight", 1),
    "w_up": ("mlp.up_proj.weight", 1),
    "w_down": ("mlp.down_proj.weight", 1),
}


def config_from_hf(hf_config: dict[str, Any], compute_dtype: str = "float32") -> LlamaConfig:
    """The hotjax config of a Hugging Face LLaMA config.json; rejects what hotjax cannot run."""
    hf = hf_config
    for field, supported in [("model_type", "llama"), ("hidden_act", "silu"),
                             ("attention_bias", False), ("mlp_bias", False)]:
        if hf.get(field, supported) != supported:
            raise UserError(f"config.json: {field}={hf[field]!r} is not supported "
                            f"(hotjax supports {supported!r})")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in hf]
    if missing:
        raise UserError(f"config.json: lacks {', '.join(missing)}")
    theta, scaling = _rope_from_hf(hf)
    try:
        return LlamaConfig(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            ffn_dim=hf["intermediate_size"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_seq_len=int(hf.get("max_position_embeddings", 2048)),
            compute_dtype=_check_dtype(compute_dtype),
        )
    except ValueError as e:
        raise UserError(f"config.json: {e}") from None


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` with the theta inside; 4.x wrote `rope_theta` and
    # `rope_scaling` (type under "type" or "rope_type"). Like transformers, `rope_scaling` wins.
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UserError("config.json: partial_rotary_factor is not supported (hotjax rotates "
                        "the whole head)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise UserError(f"config.json: rope_type={rope_type!r} is not supported "
                        "(hotjax supports 'default' and 'llama3')")
    try:
        return theta, RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope.get(
                "original_max_position_embeddings", hf.get("max_position_embeddings", 2048))),
        )
    except KeyError as e:
        raise UserError(f"config.json: llama3 rope scaling lacks {e.args[0]!r}") from None


def config_to_hf(cfg: LlamaConfig, torch_dtype: str, *, bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> dict[str, Any]:
    """A config.json for `transformers.LlamaForCausalLM`, weights stored in `torch_dtype`."""
    scaling = None if cfg.rope_scaling is None else {
        "rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        # transformers 5 reads `rope_parameters` and `dtype`; 4.x and most other tools read
        # `rope_theta`, `rope_scaling` and `torch_dtype`. Write both so that every reader agrees.
        "rope_parameters": {"rope_theta": cfg.rope_theta, **(scaling or {"rope_type": "default"})},
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "dtype": _check_dtype(torch_dtype),
        "torch_dtype": torch_dtype,
        # Written even when unknown: absent ids would make transformers assume 1 and 2.
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }


def _check_dtype(name: str) -> str:
    if name not in _DTYPES:
        raise UserError(f"dtype {name!r} is not supported: choose one of {', '.join(_DTYPES)}")
    return name


def _layout(cfg: LlamaConfig) -> Iterator[tuple[str, int | None, str, int]]:
    """(params key, layer index or None, HF name, fan-in dims) per tensor, in HF file order."""
    yield "embed", None, "model.embed_tokens.weight", 0
    for i in range(cfg.n_layers):
        for key, (name, fan_in) in _LAYER.items():
            yield key, i, f"model.layers.{i}.{name}", fan_in
    yield "final_norm", None, "model.norm.weight", 0
    if not cfg.tie_embeddings:
        yield "lm_head", None, "lm_head.weight", 1


def _hf_shape(shape: tuple[int, ...], fan_in: int) -> tuple[int, ...]:
    return shape if not fan_in else (math.prod(shape[fan_in:]), math.prod(shape[:fan_in]))


def hf_tensor_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Each HF LLaMA tensor `cfg` implies, name -> shape, in HF file order."""
    shapes = abstract_params(cfg)
    return {name: _hf_shape(shapes[key].shape if i is None else shapes["layers"][key].shape[1:],
                            fan_in)
            for key, i, name, fan_in in _layout(cfg)}


def params_to_hf_state(params: dict[str, Any], cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """HF LLaMA tensors (C-contiguous, params' dtype) of a hotjax pure-dict params tree."""
    host = jax.tree.map(np.asarray, params)
    state = {}
    for key, i, name, fan_in in _layout(cfg):
        x = host[key] if i is None else host["layers"][key][i]
        state[name] = np.ascontiguousarray(x.reshape(_hf_shape(x.shape, fan_in)[::-1]).T
                                           if fan_in else x)
    return state


def hf_state_to_params(tensors: Mapping[str, np.ndarray], cfg: LlamaConfig) -> dict[str, Any]:
    """The hotjax params tree (fp32 numpy) of HF LLaMA tensors, checked against `cfg`."""
    expected = [name for _, _, name, _ in _layout(cfg)]
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise UserError(f"checkpoint lacks {len(missing)} tensor(s) that config.json implies: "
                        f"{_some(missing)}")
    known = {*expected, "lm_head.weight"}  # some tied checkpoints keep a copy of the embedding
    unexpected = [name for name in tensors
                  if name not in known and not name.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise UserError(f"checkpoint has {len(unexpected)} tensor(s) that a LLaMA with this "
                        f"config.json lacks: {_some(unexpected)}")
    shapes = abstract_params(cfg)
    params: dict[str, Any] = {}
    layers: dict[str, list[np.ndarray]] = {key: [] for key in _LAYER}
    for key, i, name, fan_in in _layout(cfg):
        shape = shapes[key].shape if i is None else shapes["layers"][key].shape[1:]
        x = tensors[name]
        if x.shape != _hf_shape(shape, fan_in):
            raise UserError(f"tensor {name}: config.json implies shape "
                            f"{_hf_shape(shape, fan_in)}, found {x.shape}")
        x = x.astype(np.float32, copy=False)
        x = np.ascontiguousarray(x.T.reshape(shape) if fan_in else x)
        if i is None:
            params[key] = x
        else:
            layers[key].append(x)
    params["layers"] = {key: np.stack(xs) for key, xs in layers.items()}
    return params


def _some(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


class _TensorFiles(Mapping[str, np.ndarray]):
    """The tensors of a (possibly sharded) safetensors checkpoint, read from disk on access."""

    def __init__(self, files: dict[str, Path]):
        self._files = files  # tensor name -> the file that holds it

    def __getitem__(self, name: str) -> np.ndarray:
        with safe_open(self._files[name], framework="numpy") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise UserError(f"{file}: not found")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{file}: not valid JSON ({e})") from None


def _tensor_files(path: Path) -> _TensorFiles:
    single, index = path / WEIGHTS_FILE, path / INDEX_FILE
    if single.is_file():
        try:
            with safe_open(single, framework="numpy") as f:
                return _TensorFiles(dict.fromkeys(f.keys(), single))
        except SafetensorError as e:
            raise UserError(f"{single}: not a readable safetensors file ({e})") from None
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{index}: lacks a weight_map")
        files = {name: path / file for name, file in weight_map.items()}
        absent = sorted({f.name for f in files.values() if not f.is_file()})
        if absent:
            raise UserError(f"{index}: names missing shard file(s) {_some(absent)}")
        return _TensorFiles(files)
    raise UserError(f"{path}: holds neither {WEIGHTS_FILE} nor {INDEX_FILE} "
                    "(hotjax reads safetensors checkpoints only)")


def load_hf_checkpoint(path: str | os.PathLike, dtype: str = "float32") -> Llama:
    """A `Llama` from a Hugging Face LLaMA directory: fp32 params, matmuls in `dtype`."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such checkpoint directory")
    cfg = config_from_hf(_read_json(path / CONFIG_FILE), compute_dtype=dtype)
    params = hf_state_to_params(_tensor_files(path), cfg)
    return bind(cfg, jax.tree.map(jnp.asarray, params))  # no random init of what we overwrite


def _shards(tensors: dict[str, np.ndarray], max_bytes: int | None) -> list[dict[str, np.ndarray]]:
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, x in tensors.items():
        if max_bytes is not None and shards[-1] and size + x.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += x.nbytes
    return shards


def save_hf_checkpoint(model: Llama, path: str | os.PathLike, dtype: str = "float32",
                       max_shard_bytes: int | None = None, *, bos_token_id: int | None = None,
                       eos_token_id: int | None = None) -> None:
    """Write `model` as a Hugging Face LLaMA directory, weights in `dtype`, sharded when they
    exceed `max_shard_bytes`; `transformers.LlamaForCausalLM.from_pretrained` loads it."""
    cfg = model.config
    np_dtype = jnp.dtype(_check_dtype(dtype))
    params = nnx.to_pure_dict(nnx.state(model))
    tensors = {name: x.astype(np_dtype) for name, x in params_to_hf_state(params, cfg).items()}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # As save_pretrained does: a stale single file would shadow new shards, and vice versa.
    for stale in [*path.glob("model-*-of-*.safetensors"), path / WEIGHTS_FILE, path / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, path / WEIGHTS_FILE, metadata=_METADATA)
    else:
        weight_map = {}
        for k, shard in enumerate(shards, 1):
            file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, path / file, metadata=_METADATA)
            weight_map.update(dict.fromkeys(shard, file))
        index = {"metadata": {"total_size": sum(x.nbytes for x in tensors.values())},
                 "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    hf_config = config_to_hf(cfg, dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    (path / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
