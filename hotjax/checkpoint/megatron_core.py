"""Megatron-Core `torch_dist` checkpoints (Megatron-LM's default `--ckpt-format`) read into
hotjax checkpoints: the weights and, where saved per parameter, Adam's moments and step.

An iteration directory (`iter_0000100/`, named by the root's `latest_checkpointed_iteration.txt`)
is a PyTorch Distributed Checkpoint (`.metadata`, `__R_I.distcp`) beside `common.pt` (the run's
args, its iteration, the optimizer's param groups) and `metadata.json` (the backend). Its tensors
are global, whatever tensor, pipeline or data parallelism wrote them:
- a layer's tensors are stacked on a leading layer axis, each pipeline stage writing its layers
  at their global index; names are those of Transformer Engine's spec whatever the spec (the
  local spec saves `input_layernorm` as `self_attention.linear_qkv.layer_norm_weight`);
- `linear_qkv` holds the query groups in order, each its query heads, then its key head, then
  its value head; `linear_fc1` holds every gate row, then every up row;
- the embedding and output layer keep the vocabulary padding, which is stripped here.
Adam's state is read where it is kept per parameter, `optimizer.state.{param,exp_avg,exp_avg_sq}
.{model key}` (`--dist-ckpt-optim-fully-reshardable`, or a non-distributed optimizer, whose
master weights are `fp32_param`), and from the distributed optimizer's default `dp_reshardable`
buckets (`_Buckets`: the layout is rebuilt from the model and checked against the chunks each
data-parallel rank wrote).

Each parameter is written as soon as it is made (`store.Pending`), from a tensor read when the
first of its parameters is made and dropped after the last: peak host memory is a few tensors,
whatever the checkpoint's size.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import io
import json
import pickle
import re
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hotjax.checkpoint import dcp, megatron, store
from hotjax.checkpoint.megatron import EMBED, FC1, FC2, FINAL_NORM, HEAD, NORMS, PROJ, QKV
from models.errors import UserError
from models.llama import LlamaConfig, abstract_params

BACKEND = "torch_dist"
LAYERS = "decoder.layers."
_STATE = re.compile(r"(?:chained_\d+\.)?optimizer\.state\.(param|fp32_param|exp_avg|exp_avg_sq)"
                    r"\.(.+)")
_MASTER = ("param", "fp32_param")  # the distributed optimizer's name, the plain one's
_MOE = ("experts", "router", "shared_experts")
_BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_.+"
                     r"\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)")
# The distributed optimizer's param groups (lr, betas, step), one object per model-parallel rank.
_GROUPS = re.compile(r"optimizer\.distributed\.dp_group_idx_\d+\.optimizer/shard_.+")
_ALIGN = 64  # a bucket's parameters start at multiples of 64 elements


# ---------------------------------------------------------------------------- common.pt

class _Opaque:
    """An object of a class this reader does not build (an enum or config of Megatron's, a
    torch dtype): its pickled arguments and state are kept, its code never runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


_PLAIN = {("collections", "OrderedDict"): OrderedDict, ("argparse", "Namespace"):
          argparse.Namespace, **{("builtins", t.__name__): t for t in (set, frozenset, slice,
                                                                       complex)}}


class _CommonUnpickler(pickle.Unpickler):
    """Megatron's args hold its own classes (`AttnBackend`, ...), which torch's weights-only
    loader refuses: these become `_Opaque`, and tensors None; only plain data is built."""

    def find_class(self, module: str, name: str) -> Any:
        return _PLAIN.get((module, name)) or type(name, (_Opaque,), {"origin": module})

    def persistent_load(self, pid: Any) -> None:
        return None


def _plain(source: Path | io.BytesIO, where: Path) -> Any:
    """The plain content of a `torch.save` file or stream, no code of its classes run."""
    try:
        with zipfile.ZipFile(source) as archive:
            pkl = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
            return _CommonUnpickler(archive.open(pkl)).load()
    except (zipfile.BadZipFile, StopIteration, pickle.UnpicklingError, EOFError, ValueError,
            TypeError, AttributeError) as e:
        raise UserError(f"{where}: not a readable torch.save file ({type(e).__name__}): the "
                        f"checkpoint is damaged") from None


def read_common(file: Path) -> dict[str, Any]:
    """`common.pt`'s plain content: args, iteration, the optimizer's param groups."""
    if not file.is_file():
        raise UserError(f"{file}: missing: copy the whole checkpoint directory")
    loaded = _plain(file, file)
    return loaded if isinstance(loaded, dict) else {}


# ---------------------------------------------------------------------------- reading

def iteration_directory(directory: str | Path) -> Path:
    """The torch_dist iteration `directory` is or names, checked to be one."""
    iteration = megatron.iteration_directory(Path(directory).absolute())
    file = iteration / "metadata.json"
    if not file.is_file():
        legacy = any(p.name.startswith("mp_rank_") for p in iteration.iterdir())
        fix = ("a legacy torch-format checkpoint: import it with hotjax ckpt import-shards "
               "--format megatron" if legacy else "pass the directory Megatron's --ckpt-format "
               "torch_dist wrote (its root or one iteration's)")
        raise UserError(f"{iteration}: holds no metadata.json, so it is not a Megatron-Core "
                        f"torch_dist checkpoint: {fix}")
    try:
        backend = json.loads(file.read_text()).get("sharded_backend")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        raise UserError(f"{file}: not a JSON object naming the sharded_backend: the checkpoint "
                        f"is damaged") from None
    if backend != BACKEND:
        raise UserError(f"{file}: sharded_backend is {backend!r}, not {BACKEND!r}: hotjax reads "
                        f"torch_dist; convert with Megatron (load it and save with "
                        f"--ckpt-format torch_dist)")
    return iteration


def _tensors(iteration: Path) -> tuple[Any, dict[str, Any]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.read_metadata(iteration)
    return metadata, {k: v for k, v in metadata.state_dict_metadata.items()
                      if isinstance(v, TensorStorageMetadata)}


def embedding_rows(directory: str | Path) -> int:
    """The padded vocabulary of a torch_dist checkpoint, read from its embedding's shape."""
    iteration = iteration_directory(directory)
    _, tensors = _tensors(iteration)
    if EMBED not in tensors:
        raise UserError(f"{iteration / '.metadata'}: lacks tensor {EMBED}: not a Megatron "
                        f"GPT checkpoint")
    return int(tensors[EMBED].size[0])


def model_config(iteration: Path, common: dict[str, Any], rows: int,
                 config: LlamaConfig | None) -> LlamaConfig:
    """`config`, checked against the run's args, or else the model those args describe."""
    file = iteration / "common.pt"
    args = common.get("args")
    if isinstance(args, argparse.Namespace):
        megatron.check_args(args, file)
        if config is not None:
            megatron.check_config(config, args, file, rows)
    if config is not None:
        return config
    if not isinstance(args, argparse.Namespace):
        raise UserError(f"{file}: records no Megatron args, and the tensors' shapes do not "
                        f"give the heads, the rotary base or the norm epsilon: pass --config "
                        f"(an HF config.json) or --model (a preset)")
    return megatron.config_from_args(args, file, rows)


def tensor_shapes(config: LlamaConfig, rows: int, norms: tuple[str, str]) -> dict[str, tuple]:
    """Each model tensor's global shape in the checkpoint, by its key."""
    L, D, F, H = config.n_layers, config.dim, config.ffn_dim, config.head_dim
    N, K = config.n_heads, config.n_kv_heads
    shapes = {EMBED: (rows, D), FINAL_NORM: (D,),
              LAYERS + QKV: (L, (N + 2 * K) * H, D), LAYERS + PROJ: (L, D, N * H),
              LAYERS + FC1: (L, 2 * F, D), LAYERS + FC2: (L, D, F),
              LAYERS + norms[0]: (L, D), LAYERS + norms[1]: (L, D)}
    if not config.tie_embeddings:
        shapes[HEAD] = (rows, D)
    return shapes


def _unfuse(key: str, x: np.ndarray, config: LlamaConfig) -> Iterator[tuple[tuple, np.ndarray]]:
    """(hotjax parameter path, its value) of one global Megatron tensor, as views of `x`."""
    L, D, V = config.n_layers, config.dim, config.vocab_size
    N, K, H = config.n_heads, config.n_kv_heads, config.head_dim
    name = key.removeprefix(LAYERS)
    if key == EMBED:
        yield ("embed",), x[:V]
    elif key == HEAD:
        yield ("lm_head",), x[:V].T
    elif key == FINAL_NORM:
        yield ("final_norm",), x
    elif name == QKV:  # [L, K groups, (N/K query heads, k, v), H, D]
        groups = x.reshape(L, K, N // K + 2, H, D)
        yield ("layers", "wq"), groups[:, :, :-2].reshape(L, N, H, D).transpose(0, 3, 1, 2)
        yield ("layers", "wk"), groups[:, :, -2].transpose(0, 3, 1, 2)
        yield ("layers", "wv"), groups[:, :, -1].transpose(0, 3, 1, 2)
    elif name == PROJ:
        yield ("layers", "wo"), x.reshape(L, D, N, H).transpose(0, 2, 3, 1)
    elif name == FC1:
        gate, up = np.split(x, 2, axis=1)
        yield ("layers", "w_gate"), gate.transpose(0, 2, 1)
        yield ("layers", "w_up"), up.transpose(0, 2, 1)
    elif name == FC2:
        yield ("layers", "w_down"), x.transpose(0, 2, 1)
    else:  # a norm: the first of each pair comes before attention
        yield ("layers", "attn_norm" if name in NORMS[0] else "mlp_norm"), x


def _norms(tensors: dict[str, Any], where: Path) -> tuple[str, str]:
    found = []
    for pair in NORMS:
        name = next((n for n in pair if LAYERS + n in tensors), None)
        if name is None:
            raise UserError(f"{where}: lacks tensor {LAYERS}{pair[0]} (or {LAYERS}{pair[1]}): "
                            f"not a Megatron LLaMA")
        found.append(name)
    return found[0], found[1]


def _classify(tensors: dict[str, Any], expected: dict[str, tuple], weights_only: bool,
              where: Path) -> tuple[dict[str, dict[str, str]], dict[str, re.Match]]:
    """Adam's per-parameter tensors by field and model key, and the distributed optimizer's
    bucket tensors; every other tensor is a model tensor hotjax knows, or refused."""
    state: dict[str, dict[str, str]] = {}
    buckets: dict[str, re.Match] = {}
    for key in tensors:
        if key in expected:
            continue
        found = _STATE.fullmatch(key)
        if found and found[2] in expected:
            field = "param" if found[1] in _MASTER else found[1]
            state.setdefault(field, {})[found[2]] = key
            continue
        model_key = found[2] if found else key
        if (bucket := _BUCKET.fullmatch(key)) or weights_only and key.startswith(
                ("optimizer.", "chained_")) and not found:
            buckets[key] = bucket
            continue
        if key.startswith(("optimizer.", "chained_")) and not found:
            raise UserError(f"{where}: holds tensor {key}: optimizer state hotjax does not read "
                            f"(several chained optimizers' buckets, or another optimizer's): "
                            f"pass --weights-only, or save with Megatron-LM's "
                            f"--dist-ckpt-optim-fully-reshardable")
        if any(f".{part}." in f".{model_key}." for part in _MOE):
            raise UserError(f"{where}: holds tensor {key}: a mixture-of-experts model, which "
                            f"hotjax does not import: hotjax trains dense LLaMA models")
        if model_key == HEAD:
            raise UserError(f"{where}: holds tensor {key}, but the config ties the embeddings: "
                            f"untie them (tie_word_embeddings false)")
        raise UserError(f"{where}: holds tensor {key}, which a Megatron LLaMA lacks (biases, "
                        f"LayerNorm, QK norms, MoE, multi-token prediction and learned "
                        f"positions are not supported)")
    return state, buckets


def _check_shapes(tensors: dict[str, Any], expected: dict[str, tuple],
                  state: dict[str, dict[str, str]], config: LlamaConfig, where: Path) -> None:
    """Every model tensor, and Adam's state of each if it has any, is there at its shape."""
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise UserError(f"{where}: lacks tensor {missing[0]}"
                        f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}: not a "
                        f"checkpoint of this model (pass the --config it was trained with)")
    if config.vocab_size > expected[EMBED][0]:
        raise UserError(f"{where}: tensor {EMBED}: the padded vocabulary of "
                        f"{expected[EMBED][0]} rows is smaller than the config's vocab_size "
                        f"{config.vocab_size}")
    fields = {"weight": dict(zip(expected, expected, strict=True)), **state}
    if any(f in state for f in dcp.MOMENTS):
        fields.update({f: state.get(f, {}) for f in dcp.MOMENTS})
    for key, shape in expected.items():
        for field, keys in fields.items():
            if key not in keys:
                raise UserError(f"{where}: holds Adam's state but no {field} of {key}: the "
                                f"optimizer state is incomplete (pass --weights-only)")
            have = tuple(tensors[keys[key]].size)
            if have != shape:
                raise UserError(f"{where}: tensor {keys[key]} has shape {list(have)}, but the "
                                f"model needs {list(shape)}: pass the --config it was trained "
                                f"with")


def _step(common: dict[str, Any], where: Path) -> int | None:
    """Adam's step: every param group of every optimizer in `common.pt` (and the distributed
    optimizer's, saved beside the tensors) holds it."""
    steps = [group["step"] for groups in _find(common.get("optimizer"), "param_groups")
             for group in groups if isinstance(group, dict) and "step" in group]
    if not steps:
        return None
    if any(float(s) != float(steps[0]) for s in steps):
        raise UserError(f"{where}: its param groups are at Adam steps "
                        f"{sorted({float(s) for s in steps})}: they must agree")
    return int(float(steps[0]))


def _find(node: Any, field: str) -> Iterator[Any]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from [value] if key == field else _find(value, field)
    elif isinstance(node, list | tuple):
        for value in node:
            yield from _find(value, field)


def _hyperparameters(common: dict[str, Any]) -> dict[str, Any]:
    """lr, betas and eps of the run's param groups, the weight decay of matrices and of norms
    (Megatron's no-decay group, `wd_mult` 0, holds norms and biases), and the clipping norm."""
    groups = [g for gs in _find(common.get("optimizer"), "param_groups") for g in gs
              if isinstance(g, dict)]
    out: dict[str, Any] = {}
    if groups:
        first = groups[0]
        out.update({f: float(first[f]) for f in ("lr", "eps") if f in first})
        if "betas" in first:
            out["betas"] = [float(b) for b in first["betas"]]
        decays = [float(g.get("weight_decay", 0.0)) * float(g.get("wd_mult", 1.0))
                  for g in groups]
        out["weight_decay_matrix"], out["weight_decay_norm"] = max(decays), min(decays)
    clip = getattr(common.get("args"), "clip_grad", None)
    if isinstance(clip, int | float) and clip > 0:
        out["clip_norm"] = float(clip)
    return out


def _ranges_planner(ranges: list[tuple[str, int, Any]], objects: dict[str, Any],
                    where: Path) -> Any:
    """A torch DCP load planner that fills each 1-D tensor of `ranges` (fqn, start, tensor)
    with the elements from `start` on of the checkpoint's 1-D tensor `fqn`, reading those
    alone, and sets each key of `objects` to the plain content of that saved object."""
    import torch
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class Ranges(DefaultLoadPlanner):
        def create_local_plan(self) -> Any:
            items = list(super().create_local_plan().items)  # the objects
            for i, (fqn, start, tensor) in enumerate(ranges):
                chunk = ChunkStorageMetadata(torch.Size([start]), tensor.size())
                for item in create_read_items_for_chunk_list(
                        fqn, self.metadata.state_dict_metadata[fqn], [chunk]):
                    index = dataclasses.replace(item.dest_index, index=i)  # which range
                    items.append(dataclasses.replace(item, dest_index=index))
            return LoadPlan(items)

        def resolve_tensor(self, read_item: Any) -> Any:
            tensor = ranges[read_item.dest_index.index][2]
            return narrow_tensor_by_index(tensor, read_item.dest_offsets, read_item.lengths)

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            objects[read_item.dest_index.fqn] = _plain(value, where)

    return Ranges(flatten_state_dict=False)


# Where tensor parallelism splits a model tensor (a layer's, for stacked ones); norms are whole
# on every rank, and fc1 holds a rank's gate rows then its up rows.
_SPLIT = {EMBED: 0, HEAD: 0, LAYERS + QKV: 0, LAYERS + PROJ: 1, LAYERS + FC2: 1}


class _Buckets:
    """Adam's state where the distributed optimizer keeps it by default (`dp_reshardable`):
    each tensor-parallel rank's optimizer (`dp_group_idx_{rank}`, pipeline parallelism aside)
    keeps its parameters' fp32 copy and moments in the flat buckets of its gradient buffer, the
    module's parameters in reverse `named_parameters` order, each starting at a multiple of 64
    elements, a bucket closing after the parameter that reaches the bucket size; one checkpoint
    tensor per bucket and field holds the bucket without its end padding, written by each
    data-parallel rank as one chunk per parameter part and per padding. The order is the model's
    (`args.transformer_impl`: the local spec puts a layer's input norm first, Transformer
    Engine's fuses it into linear_qkv after linear_proj); the bucket sizes are the tensors', and
    every parameter's bounds are checked against the chunks before anything is read."""

    def __init__(self, iteration: Path, tensors: dict[str, Any], found: dict[str, re.Match],
                 config: LlamaConfig, expected: dict[str, tuple], norms: tuple[str, str],
                 args: Any, where: Path):
        self.iteration, self.config, self.expected = iteration, config, expected
        fix = "pass --weights-only, or save with Megatron-LM's --dist-ckpt-optim-fully-reshardable"
        if not isinstance(args, argparse.Namespace):
            raise UserError(f"{iteration / 'common.pt'}: records no Megatron args, which place "
                            f"the distributed optimizer's buckets (tensor parallelism, layer "
                            f"spec): {fix}")
        pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
        vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
        impl = getattr(args, "transformer_impl", "transformer_engine")
        self.tp = tp = getattr(args, "tensor_model_parallel_size", 1) or 1
        if pp != 1 or vpp not in (None, 1) or impl not in ("local", "transformer_engine"):
            raise UserError(f"{where}: holds the distributed optimizer's dp_reshardable buckets "
                            f"of a run with pipeline parallelism {pp}, virtual stages {vpp} and "
                            f"transformer_impl {impl!r}: hotjax reads them without pipeline "
                            f"parallelism, under the local or Transformer Engine spec: {fix}")
        sizes: dict[tuple[int, int], int] = {}
        fields: dict[tuple[int, int], set[str]] = {}
        self.keys: dict[tuple[int, int, str], str] = {}
        for key, match in found.items():
            rank, buffer, bucket, field = int(match[1]), int(match[2]), int(match[3]), match[4]
            if buffer != 0 or rank >= tp:
                raise UserError(f"{where}: holds tensor {key}: the buckets of a second gradient "
                                f"buffer (mixed parameter dtypes) or of a model-parallel rank "
                                f"beyond tensor parallelism {tp}: {fix}")
            sizes[rank, bucket] = int(tensors[key].size[0])
            fields.setdefault((rank, bucket), set()).add(field)
            self.keys[rank, bucket, field] = key
        self.dtype = next(tensors[k].properties.dtype for k in found)
        self.place: list[dict[tuple[str, int | None], tuple[int, int, tuple]]] = []
        for rank in range(tp):
            count = sum(1 for r, _ in sizes if r == rank)
            if any((rank, b) not in sizes or fields[rank, b] != {"param", *dcp.MOMENTS}
                   for b in range(count)) or count == 0:
                raise UserError(f"{where}: the distributed optimizer's buckets of rank {rank} "
                                f"are incomplete (each needs its param, exp_avg and exp_avg_sq): "
                                f"copy the whole checkpoint directory, or pass --weights-only")
            order = self._order(norms, impl == "local")
            self.place.append(self._layout(order, [sizes[rank, b] for b in range(count)],
                                           tensors, rank, impl, where, fix))

    def _order(self, norms: tuple[str, str], local: bool) -> list[tuple[str, int | None, tuple]]:
        """(model key, layer, shape on one rank) of a rank's parameters, `named_parameters`'s
        order: embedding, each layer's, final norm, output layer."""
        c, tp = self.config, self.tp
        D, F, H, N, K = c.dim, c.ffn_dim, c.head_dim, c.n_heads, c.n_kv_heads
        rows = self.expected[EMBED][0] // tp
        attention = [(LAYERS + norms[0], (D,)), (LAYERS + PROJ, (D, N * H // tp))]
        layer = [*(attention if local else attention[::-1]),
                 (LAYERS + QKV, ((N + 2 * K) * H // tp, D)), (LAYERS + norms[1], (D,)),
                 (LAYERS + FC1, (2 * F // tp, D)), (LAYERS + FC2, (D, F // tp))]
        return [(EMBED, None, (rows, D)),
                *[(key, i, shape) for i in range(c.n_layers) for key, shape in layer],
                (FINAL_NORM, None, (D,)), *([] if c.tie_embeddings else [(HEAD, None, (rows, D))])]

    def _layout(self, order: list[tuple[str, int | None, tuple]], sizes: list[int],
                tensors: dict[str, Any], rank: int, impl: str, where: Path,
                fix: str) -> dict[tuple[str, int | None], tuple[int, int, tuple]]:
        """(bucket, start, shape) of each parameter of `rank`, checked against the chunks."""
        place, spans, bucket, start = {}, [[] for _ in sizes], 0, 0
        for key, layer, shape in reversed(order):
            end = start + int(np.prod(shape))
            if bucket == len(sizes) or end > sizes[bucket]:
                break
            place[key, layer] = (bucket, start, shape)
            spans[bucket].append((start, end))
            start = -(-end // _ALIGN) * _ALIGN
            if sizes[bucket] in (end, start):  # the bucket closes, its end padding not saved
                bucket, start = bucket + 1, 0
        problem = len(place) != len(order) or bucket != len(sizes)
        for b in range(len(sizes)):
            chunks = tensors[self.keys[rank, b, "param"]].chunks
            problem = problem or not _chunks_fit(chunks, spans[b])
        if problem:
            raise UserError(f"{where}: the distributed optimizer's buckets of rank {rank} "
                            f"({len(sizes)} of {sizes} elements) do not hold this model's "
                            f"parameters in the order of Megatron-Core's {impl} layer spec at "
                            f"their chunks' bounds: {fix}")
        return place

    def read(self, field: str, model_key: str) -> np.ndarray:
        """Adam's `field` ('param' for the fp32 weights) of a model tensor, at its global
        shape: every rank's part of every layer, read from its bucket."""
        import torch

        out = np.empty(self.expected[model_key], np.float32)
        split = model_key in _SPLIT or model_key == LAYERS + FC1
        layers = range(self.config.n_layers) if model_key.startswith(LAYERS) else [None]
        parts = []
        for rank in range(self.tp if split else 1):
            for layer in layers:
                bucket, start, shape = self.place[rank][model_key, layer]
                tensor = torch.empty(int(np.prod(shape)), dtype=self.dtype)
                parts.append((self.keys[rank, bucket, field], start, tensor, rank, layer, shape))
        dcp.load(self.iteration, {}, _ranges_planner([p[:3] for p in parts], {},
                                                     self.iteration))
        for _, _, tensor, rank, layer, shape in parts:
            x = tensor.to(torch.float32).numpy().reshape(shape)
            target = out if layer is None else out[layer]
            if model_key == LAYERS + FC1:  # this rank's gate rows, then its up rows
                half, F = shape[0] // 2, self.config.ffn_dim
                target[rank * half:(rank + 1) * half] = x[:half]
                target[F + rank * half:F + (rank + 1) * half] = x[half:]
            elif split:
                axis = _SPLIT[model_key]
                n = shape[axis]
                index = (slice(None),) * axis + (slice(rank * n, (rank + 1) * n),)
                target[index] = x
            else:
                target[...] = x
        return out


def _chunks_fit(chunks: list[Any], spans: list[tuple[int, int]]) -> bool:
    """Every parameter's span starts a chunk, and no chunk crosses a span's bounds (a chunk
    outside every span is padding)."""
    starts = {int(c.offsets[0]) for c in chunks}
    lefts = [a for a, _ in spans]
    if any(a not in starts for a in lefts):
        return False
    for c in chunks:
        a, b = int(c.offsets[0]), int(c.offsets[0]) + int(c.sizes[0])
        i = bisect.bisect_right(lefts, a) - 1
        if i >= 0 and a < spans[i][1]:
            if b > spans[i][1]:
                return False
        elif i + 1 < len(lefts) and b > lefts[i + 1]:
            return False
    return True


class _Unfused:
    """hotjax parameters made one at a time from the Megatron tensors they come from: a tensor
    is read (fp32) when the first of its parameters is made, and dropped once the last one is,
    so that host memory holds a few tensors at a time, never the checkpoint."""

    def __init__(self, config: LlamaConfig, expected: dict[str, tuple]):
        self.config, self.expected = config, expected
        self._read: dict[tuple, dict[tuple, np.ndarray]] = {}  # source -> its parameters left

    def pending(self, field: str, reads: dict[str, Any]) -> Any:
        """The params tree of `store.Pending` leaves, each made from the tensor `reads[model
        key]()` returns (a model tensor, or Adam's `field` of it)."""
        shapes = abstract_params(self.config)
        tree: dict[str, Any] = {}
        for model_key, read in reads.items():
            # Shapes only: a broadcast scalar is a view of the tensor without its memory.
            proxy = np.broadcast_to(np.float32(0), self.expected[model_key])
            for path, _ in _unfuse(model_key, proxy, self.config):
                node = tree
                for part in path[:-1]:
                    node = node.setdefault(part, {})
                like = shapes[path[0]] if len(path) == 1 else shapes[path[0]][path[1]]
                node[path[-1]] = store.Pending(like.shape, np.float32, functools.partial(
                    self._take, (field, model_key), read, path))
        return tree

    def _take(self, source: tuple[str, str], read: Any, path: tuple) -> np.ndarray:
        if source not in self._read:
            self._read[source] = dict(_unfuse(source[1], read(), self.config))
        parts = self._read[source]
        value = np.ascontiguousarray(parts.pop(path))
        if not parts:
            del self._read[source]
        return value


def _read_tensor(iteration: Path, info: Any, key: str) -> np.ndarray:
    """One checkpoint tensor, whole, in fp32."""
    import torch

    loaded = {key: torch.empty(tuple(info.size), dtype=info.properties.dtype)}
    dcp.load(iteration, loaded)
    return loaded.pop(key).to(torch.float32).numpy()


def _distributed_groups(iteration: Path, metadata: Any) -> list[Any]:
    """The distributed optimizer's saved param groups (its step, lr, betas), if any."""
    objects: dict[str, Any] = {}
    keys = [k for k in metadata.state_dict_metadata if _GROUPS.fullmatch(k)]
    if keys:
        dcp.load(iteration, {k: io.BytesIO() for k in keys},
                 _ranges_planner([], objects, iteration / ".metadata"))
    return list(objects.values())


def import_megatron_core(directory: str | Path, out: str | Path, *,
                         config: LlamaConfig | None = None, weights_only: bool = False,
                         tokenizer: Any = None) -> Path:
    """A hotjax checkpoint of the torch_dist checkpoint at `directory` (its root or one
    iteration's): weights, and Adam's moments and step where saved per parameter (unless
    `weights_only`); `config` defaults to the model the run's args record."""
    store.check_new_directory(out)
    iteration = iteration_directory(directory)
    where = iteration / ".metadata"
    metadata, tensors = _tensors(iteration)
    common = read_common(iteration / "common.pt")
    if EMBED not in tensors:
        raise UserError(f"{where}: lacks tensor {EMBED}: not a Megatron GPT checkpoint")
    rows = int(tensors[EMBED].size[0])
    config = model_config(iteration, common, rows, config)
    norms = _norms(tensors, where)
    expected = tensor_shapes(config, rows, norms)
    state, bucketed = _classify(tensors, expected, weights_only, where)
    if weights_only:
        state, bucketed = {f: keys for f, keys in state.items() if f == "param"}, {}
    _check_shapes(tensors, expected, state, config, where)
    buckets = None
    if bucketed:
        if state:
            raise UserError(f"{where}: holds Adam's state both per parameter and in the "
                            f"distributed optimizer's buckets: pass --weights-only")
        buckets = _Buckets(iteration, tensors, bucketed, config, expected, norms,
                           common.get("args"), where)
        common = {**common, "optimizer": [common.get("optimizer"),
                                          *_distributed_groups(iteration, metadata)]}
    moment_fields = [f for f in dcp.MOMENTS if f in state or buckets]
    step = _step(common, iteration / "common.pt") if moment_fields else None
    if moment_fields and step is None:
        raise UserError(f"{iteration / 'common.pt'}: its optimizer's param groups record no "
                        f"step, though the checkpoint holds Adam's moments: copy the whole "
                        f"checkpoint directory, or pass --weights-only")
    # Master weights where the optimizer keeps them (fp32 under a bf16 run), else the model's.
    sources = {"weight": {k: state.get("param", {}).get(k, k) for k in expected},
               **{f: state[f] for f in moment_fields if f in state}}
    dcp.check_files(iteration, metadata, {k for keys in sources.values() for k in keys.values()}
                    | set(bucketed))

    def reads(field: str) -> dict[str, Any]:
        if buckets is not None:
            return {k: functools.partial(buckets.read, "param" if field == "weight" else field,
                                         k) for k in expected}
        return {k: functools.partial(_read_tensor, iteration, tensors[key], key)
                for k, key in sources[field].items()}

    unfused = _Unfused(config, expected)
    trees = {field: unfused.pending(field, reads(field)) for field in ("weight", *moment_fields)}
    iteration_number = common.get("iteration")
    foreign = {"format": f"megatron-core {BACKEND}", "naming": "megatron-core",
               "checkpoint": str(iteration), "iteration": iteration_number
               if isinstance(iteration_number, int) else None}
    moments = {f: trees[f] for f in moment_fields} or None
    return dcp.save_trees(
        out, config, trees["weight"], moments,
        step if moments else (iteration_number if isinstance(iteration_number, int) else 0),
        _hyperparameters(common), source=f"import-megatron-core {iteration}", foreign=foreign,
        tokenizer=tokenizer)
