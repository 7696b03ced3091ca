"""Hugging Face LLaMA interop: config.json and safetensors to and from a hotjax `Llama`."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from hotjax import bounds
from hotjax.errors import UserError
from hotjax.models.llama import Llama, LlamaConfig, abstract_params, bind
from hotjax.paths import inside

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


# config.json's names for the fields of `LlamaConfig`, for messages.
_HF_NAMES = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
             "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
             "ffn_dim": "intermediate_size", "head_dim": "head_dim", "rope_theta": "rope_theta",
             "rope_scaling": "rope_scaling", "norm_eps": "rms_norm_eps",
             "tie_embeddings": "tie_word_embeddings", "max_seq_len": "max_position_embeddings"}
_FIX = "fix the model's config.json"
# What to do about a checkpoint whose weights or moments are not all finite numbers.
NOT_FINITE = ("the checkpoint is damaged or was saved after its run diverged: import one saved "
              "before (nothing was written)")


def config_from_hf(hf_config: Any, compute_dtype: str = "float32") -> LlamaConfig:
    """The hotjax config of a Hugging Face LLaMA config.json; rejects what hotjax cannot run,
    and every field of the wrong type or out of range (`LlamaConfig.checked`)."""
    hf = bounds.mapping(hf_config, "config.json", "config.json", "pass a JSON object")
    for field, supported in [("model_type", "llama"), ("hidden_act", "silu"),
                             ("attention_bias", False), ("mlp_bias", False)]:
        if hf.get(field, supported) != supported:
            raise UserError(f"config.json: {field}={bounds.show(hf[field])} is not supported "
                            f"(hotjax supports {supported!r})")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in hf]
    if missing:
        raise UserError(f"config.json: lacks {', '.join(missing)}")
    theta, scaling = _rope_from_hf(hf)
    kv_heads = hf.get("num_key_value_heads")
    fields = {"vocab_size": hf["vocab_size"], "dim": hf["hidden_size"],
              "n_layers": hf["num_hidden_layers"], "n_heads": hf["num_attention_heads"],
              "n_kv_heads": hf["num_attention_heads"] if kv_heads is None else kv_heads,
              "ffn_dim": hf["intermediate_size"], "head_dim": hf.get("head_dim"),
              "rope_theta": theta, "rope_scaling": scaling,
              "norm_eps": hf.get("rms_norm_eps", 1e-6),
              "tie_embeddings": hf.get("tie_word_embeddings", False),
              "max_seq_len": hf.get("max_position_embeddings", 2048),
              "compute_dtype": _check_dtype(compute_dtype)}
    return LlamaConfig.checked(fields, "config.json", _FIX, _HF_NAMES)


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """rope_theta and the llama3 scaling fields, unchecked (`LlamaConfig.checked` checks)."""
    # transformers 5 writes `rope_parameters` with the theta inside; 4.x wrote `rope_theta` and
    # `rope_scaling` (type under "type" or "rope_type"). Like transformers, `rope_scaling` wins.
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope = bounds.mapping(rope, "rope_scaling", "config.json", _FIX)
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UserError("config.json: partial_rotary_factor is not supported (hotjax rotates "
                        "the whole head)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise UserError(f"config.json: rope_type={bounds.show(rope_type)} is not supported "
                        "(hotjax supports 'default' and 'llama3')")
    lacks = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in rope]
    if lacks:
        raise UserError(f"config.json: llama3 rope scaling lacks {lacks[0]!r}")
    return theta, {
        **{k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor")},
        "original_max_position_embeddings": rope.get(
            "original_max_position_embeddings", hf.get("max_position_embeddings", 2048))}


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


def _of_param(key: str, cfg: LlamaConfig) -> Iterator[tuple[int | None, str, int]]:
    """(layer index or None, HF name, fan-in dims) of each HF tensor of hotjax parameter `key`."""
    layer = key.removeprefix("layers/")
    for k, i, name, fan_in in _layout(cfg):
        if k == layer and (i is None) == (layer == key):
            yield i, name, fan_in


def hf_tensors(key: str, x: np.ndarray, cfg: LlamaConfig) -> Iterator[tuple[str, np.ndarray]]:
    """The HF LLaMA tensors (C-contiguous, x's dtype) of one hotjax parameter `key` (`embed`,
    `layers/wq`, ...; stacked layers give one tensor per layer)."""
    for i, name, fan_in in _of_param(key, cfg):
        t = x if i is None else x[i]
        yield name, np.ascontiguousarray(t.reshape(_hf_shape(t.shape, fan_in)[::-1]).T
                                         if fan_in else t)


def hf_read_order(cfg: LlamaConfig) -> list[str]:
    """The HF tensor names in the order `hf_param_makers`' leaves read them when made in the
    order JAX flattens the tree (sorted keys), as a checkpoint writes it: by parameter, then
    by layer."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]
    return [name for path, _ in leaves
            for _, name, _ in _of_param("/".join(k.key for k in path), cfg)]


def param_keys(cfg: LlamaConfig) -> list[str]:
    """The hotjax parameters as `hf_tensors` names them: `embed`, `layers/wq`, ..."""
    return [f"layers/{k}" if isinstance(v, dict) else k
            for k, v in abstract_params(cfg).items()
            for k in (v if isinstance(v, dict) else [k])]


def params_to_hf_state(params: dict[str, Any], cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """HF LLaMA tensors (C-contiguous, params' dtype) of a hotjax pure-dict params tree."""
    host = jax.tree.map(np.asarray, params)
    state = dict(t for key in param_keys(cfg) for t in hf_tensors(
        key, host["layers"][key[7:]] if key.startswith("layers/") else host[key], cfg))
    return {name: state[name] for name in hf_tensor_shapes(cfg)}  # HF file order


class LazyTensors(Mapping[str, np.ndarray]):
    """Tensors by name whose shapes are known up front, each read by `read(name)` when it is
    accessed (and not kept)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], read: Callable[[str], np.ndarray]):
        self.shapes, self._read = shapes, read

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.shapes:
            raise KeyError(name)
        return self._read(name)

    def __contains__(self, name: object) -> bool:  # Mapping's own would read the tensor
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def hf_param_makers(tensors: Mapping[str, np.ndarray], cfg: LlamaConfig, *,
                    where: str = "tensor") -> dict[str, Any]:
    """The hotjax params tree, each leaf a function that reads and converts its HF tensors
    (fp32 numpy; a stacked layer parameter filled layer by layer): names and shapes are
    checked against `cfg` at once (a `LazyTensors` without reading any), tensors read when a
    leaf is made, so that a whole tree is never held; a tensor with a value that is not a
    finite fp32 number is refused as `{where} {name}` (`where`: the checkpoint and field)."""
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
    found = tensors.shapes if isinstance(tensors, LazyTensors) else {
        name: tensors[name].shape for name in expected}
    parts: dict[str, list[tuple[str, int]]] = {}
    for key, i, name, fan_in in _layout(cfg):
        shape = shapes[key].shape if i is None else shapes["layers"][key].shape[1:]
        if tuple(found[name]) != _hf_shape(shape, fan_in):
            raise UserError(f"tensor {name}: config.json implies shape "
                            f"{_hf_shape(shape, fan_in)}, found {tuple(found[name])}")
        parts.setdefault(key if i is None else f"layers/{key}", []).append((name, fan_in))

    def make(key: str) -> np.ndarray:
        stacked = key.startswith("layers/")
        out = np.empty((shapes["layers"][key[7:]] if stacked else shapes[key]).shape, np.float32)
        for i, (name, fan_in) in enumerate(parts[key]):
            target = out[i] if stacked else out
            x = tensors[name]
            with np.errstate(over="ignore"):  # an overflowing cast is refused just below
                target[...] = x.T.reshape(target.shape) if fan_in else x
            bounds.finite(target, f"{where} {name}", NOT_FINITE, x)
            del x
        return out

    makers = {key: functools.partial(make, key) for key in parts}
    return {**{k: m for k, m in makers.items() if not k.startswith("layers/")},
            "layers": {k[7:]: m for k, m in makers.items() if k.startswith("layers/")}}


def hf_state_to_params(tensors: Mapping[str, np.ndarray], cfg: LlamaConfig, *,
                       where: str = "tensor") -> dict[str, Any]:
    """The hotjax params tree (fp32 numpy) of HF LLaMA tensors, checked against `cfg`."""
    return jax.tree.map(lambda make: make(), hf_param_makers(tensors, cfg, where=where))


def _some(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def _tensor_files(files: dict[str, Path]) -> LazyTensors:
    """The tensors of a (possibly sharded) safetensors checkpoint, `files` naming the file of
    each: shapes read from the headers, each tensor from disk when it is accessed."""
    shapes = {}
    for file in sorted(set(files.values())):
        try:
            with safe_open(file, framework="numpy") as f:
                shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys()  # noqa: SIM118
                               if files.get(n) == file})
        except SafetensorError as e:
            raise UserError(f"{file}: not a readable safetensors file ({e})") from None

    def read(name: str) -> np.ndarray:
        with safe_open(files[name], framework="numpy") as f:
            return f.get_tensor(name)

    return LazyTensors({n: shapes[n] for n in files if n in shapes}, read)


def read_json(file: Path) -> Any:
    """A JSON file of a Hugging Face directory, within `bounds.MAX_JSON_BYTES` and depth."""
    if not file.is_file():
        raise UserError(f"{file}: not found")
    return bounds.read_json(file, "JSON", f"fix {file.name}")


def hf_tensors_of(path: Path) -> LazyTensors:
    """The tensors of the Hugging Face directory `path`, read when accessed."""
    single, index = path / WEIGHTS_FILE, path / INDEX_FILE
    # A Hugging Face cache links a snapshot's files to its repository's blobs/.
    hub = path.parent.parent if path.parent.name == "snapshots" else path
    if single.is_file():
        inside(path, WEIGHTS_FILE, single, within=hub)  # a link may lead out
        try:
            with safe_open(single, framework="numpy") as f:
                return _tensor_files(dict.fromkeys(f.keys(), single))
        except SafetensorError as e:
            raise UserError(f"{single}: not a readable safetensors file ({e})") from None
    if index.is_file():
        found = read_json(index)
        weight_map = found.get("weight_map") if isinstance(found, dict) else None
        if not isinstance(weight_map, dict):
            raise UserError(f"{index}: lacks a weight_map")
        files = {name: inside(path, file, index, within=hub) for name, file in weight_map.items()}
        absent = sorted({f.name for f in files.values() if not f.is_file()})
        if absent:
            raise UserError(f"{index}: names missing shard file(s) {_some(absent)}")
        return _tensor_files(files)
    raise UserError(f"{path}: holds neither {WEIGHTS_FILE} nor {INDEX_FILE} "
                    "(hotjax reads safetensors checkpoints only)")


def load_hf_checkpoint(path: str | os.PathLike, dtype: str = "float32") -> Llama:
    """A `Llama` from a Hugging Face LLaMA directory: fp32 params, matmuls in `dtype`."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: no such checkpoint directory")
    cfg = config_from_hf(read_json(path / CONFIG_FILE), compute_dtype=dtype)
    params = hf_state_to_params(hf_tensors_of(path), cfg, where=f"{path}: tensor")
    return bind(cfg, jax.tree.map(jnp.asarray, params))  # no random init of what we overwrite


_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def save_hf_checkpoint(model: Llama, path: str | os.PathLike, dtype: str = "float32",
                       max_shard_bytes: int | None = None, *, bos_token_id: int | None = None,
                       eos_token_id: int | None = None) -> None:
    """Write `model` as a Hugging Face LLaMA directory, weights in `dtype`, sharded when they
    exceed `max_shard_bytes`; `transformers.LlamaForCausalLM.from_pretrained` loads it."""
    params = nnx.to_pure_dict(nnx.state(model))
    leaves = ((key, params["layers"][key[7:]] if key.startswith("layers/") else params[key])
              for key in param_keys(model.config))
    write_hf_directory(path, model.config, leaves, dtype, max_shard_bytes,
                       bos_token_id=bos_token_id, eos_token_id=eos_token_id)


def write_hf_directory(path: str | os.PathLike, cfg: LlamaConfig,
                       params: Iterable[tuple[str, Any]], dtype: str = "float32",
                       max_shard_bytes: int | None = None, *, bos_token_id: int | None = None,
                       eos_token_id: int | None = None) -> None:
    """A Hugging Face LLaMA directory of `cfg`'s parameters, given one at a time as (key,
    array) for every key of `param_keys` in any order: each is converted and written where the
    safetensors headers (laid out up front) place its tensors, then dropped, so that host memory
    holds one parameter at a time. Weights in `dtype`, in files of at most `max_shard_bytes`."""
    np_dtype = jnp.dtype(_check_dtype(dtype))
    shapes = hf_tensor_shapes(cfg)
    sizes = {name: math.prod(shape) * np_dtype.itemsize for name, shape in shapes.items()}
    shards: list[list[str]] = [[]]
    size = 0
    for name in shapes:  # HF file order, as save_pretrained shards
        if max_shard_bytes is not None and shards[-1] and size + sizes[name] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += sizes[name]
    files = [WEIGHTS_FILE] if len(shards) == 1 else [
        f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # As save_pretrained does: a stale single file would shadow new shards, and vice versa.
    for stale in [*path.glob("model-*-of-*.safetensors"), path / WEIGHTS_FILE, path / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    where: dict[str, tuple[Any, int]] = {}  # tensor -> (open file, its data's offset)
    opened = []
    try:
        for file, names in zip(files, shards, strict=True):
            header, offset = {}, 0
            for name in names:
                header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shapes[name]),
                                "data_offsets": [offset, offset + sizes[name]]}
                offset += sizes[name]
            text = json.dumps({"__metadata__": _METADATA, **header}).encode()
            text += b" " * (-len(text) % 8)  # as safetensors pads, so that data is aligned
            f = open(path / file, "wb")  # noqa: SIM115 - closed below, all together
            opened.append(f)
            f.write(len(text).to_bytes(8, "little") + text)
            f.truncate(8 + len(text) + offset)
            where.update({name: (f, 8 + len(text) + header[name]["data_offsets"][0])
                          for name in names})
        written = set()
        for key, x in params:
            for name, t in hf_tensors(key, np.asarray(x), cfg):
                f, at = where[name]
                f.seek(at)
                # As bytes: a buffer of bfloat16 (ml_dtypes) is refused.
                f.write(np.ascontiguousarray(t.astype(np_dtype, copy=False)).view(np.uint8))
                written.add(name)
        if written != set(shapes):
            raise AssertionError(f"parameters missing: {_some(sorted(set(shapes) - written))}")
    finally:
        for f in opened:
            f.close()
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {name: file for file, names in zip(files, shards, strict=True)
                                for name in names}}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    hf_config = config_to_hf(cfg, dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    (path / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
