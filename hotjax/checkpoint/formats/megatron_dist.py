"""Reading Megatron-Core's torch_dist files beyond plain tensors: `common.pt` (its pickled args
and param groups, read without running any code they name), ranges of 1-D checkpoint
tensors read alone, and Adam's state where the distributed optimizer keeps it by default, in
`dp_reshardable` flat buckets (`Buckets`). `formats.megatron_core` imports with them.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import io
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hotjax.checkpoint.formats import dcp, torch_load
from hotjax.checkpoint.formats.megatron import EMBED, FC1, FC2, FINAL_NORM, HEAD, PROJ, QKV
from hotjax.errors import UserError
from hotjax.models.optimizers import ADAMW

if TYPE_CHECKING:
    from hotjax.models.llama import LlamaConfig

LAYERS = "decoder.layers."
BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_.+"
                    r"\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)")
# The distributed optimizer's param groups (lr, betas, step), one object per model-parallel rank.
_GROUPS = re.compile(r"optimizer\.distributed\.dp_group_idx_\d+\.optimizer/shard_.+")
_ALIGN = 64  # a bucket's parameters start at multiples of 64 elements
MOMENTS = ADAMW.torch_names("import-megatron-core")  # a bucket's Adam state, besides `param`


# ---------------------------------------------------------------------------- common.pt

def read_common(file: Path) -> dict[str, Any]:
    """`common.pt`'s plain content: args, iteration, the optimizer's param groups."""
    if not file.is_file():
        raise UserError(f"{file}: missing: copy the whole checkpoint directory")
    loaded = torch_load.read_torch_save(file, file)
    return loaded if isinstance(loaded, dict) else {}


# ---------------------------------------------------------------------------- buckets

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
            objects[read_item.dest_index.fqn] = torch_load.read_torch_save(value, where)

    return Ranges(flatten_state_dict=False)


# Where tensor parallelism splits a model tensor (a layer's, for stacked ones); norms are whole
# on every rank, and fc1 holds a rank's gate rows then its up rows.
_SPLIT = {EMBED: 0, HEAD: 0, LAYERS + QKV: 0, LAYERS + PROJ: 1, LAYERS + FC2: 1}


class Buckets:
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
            if any((rank, b) not in sizes or fields[rank, b] != {"param", *MOMENTS}
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


def distributed_groups(iteration: Path, metadata: Any) -> list[Any]:
    """The distributed optimizer's saved param groups (its step, lr, betas), if any."""
    objects: dict[str, Any] = {}
    keys = [k for k in metadata.state_dict_metadata if _GROUPS.fullmatch(k)]
    if keys:
        dcp.load(iteration, {k: io.BytesIO() for k in keys},
                 _ranges_planner([], objects, iteration / ".metadata"))
    return list(objects.values())
