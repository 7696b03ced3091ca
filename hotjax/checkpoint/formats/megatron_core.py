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
buckets (`megatron_dist.Buckets`: the layout is rebuilt from the model and checked against the
chunks each data-parallel rank wrote). The optimizer's fp32 weights are checked against the
model's own as they are read: Megatron-Core 0.16.1 saves a several-bucket run's fully
reshardable state wrong, and such a checkpoint is refused rather than imported.

Each parameter is written as soon as it is made (`store.Pending`), from a tensor read when the
first of its parameters is made and dropped after the last: peak host memory is a few tensors,
whatever the checkpoint's size.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hotjax import bounds
from hotjax.checkpoint.formats import dcp, megatron
from hotjax.checkpoint.formats.megatron import EMBED, FC1, FC2, FINAL_NORM, HEAD, NORMS, PROJ, QKV
from hotjax.checkpoint.formats.megatron_dist import (
    BUCKET,
    LAYERS,
    Buckets,
    distributed_groups,
    read_common,
)
from hotjax.checkpoint.formats.spec import RECORDED, Format, Option
from hotjax.errors import UserError
from hotjax.models.optimizers import ADAMW

if TYPE_CHECKING:
    from hotjax.models.llama import LlamaConfig

BACKEND = "torch_dist"
_STATE = re.compile(r"(?:chained_\d+\.)?optimizer\.state\.(param|fp32_param|exp_avg|exp_avg_sq)"
                    r"\.(.+)")
_MASTER = ("param", "fp32_param")  # the distributed optimizer's name, the plain one's
_MOE = ("experts", "router", "shared_experts")
MOMENTS = ADAMW.torch_names("import-megatron-core")  # Adam's state, as Megatron names it too


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
    damaged = "the checkpoint is damaged"
    recorded = bounds.mapping(bounds.read_json(file, "metadata", damaged),
                              "metadata.json", str(file), damaged)
    backend = bounds.text(recorded.get("sharded_backend"), "sharded_backend", str(file),
                          damaged, limit=64)
    for field in ("sharded_backend_version", "common_backend_version"):
        if field in recorded:
            bounds.whole(recorded[field], field, 0, 2**31 - 1, str(file), damaged)
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
    return _rows(tensors, iteration / ".metadata")


def _rows(tensors: dict[str, Any], where: Path) -> int:
    """The embedding's rows, its claimed shape checked before anything is sized by it."""
    if EMBED not in tensors:
        raise UserError(f"{where}: lacks tensor {EMBED}: not a Megatron GPT checkpoint")
    return dcp.claimed_shape(tensors[EMBED].size, EMBED, where)[0]


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
        if (bucket := BUCKET.fullmatch(key)) or weights_only and key.startswith(
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
    if any(f in state for f in MOMENTS):
        fields.update({f: state.get(f, {}) for f in MOMENTS})
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
    steps = [_number(group["step"], "a param group's step", where, low=-1.0,
                     high=bounds.MAX_STEP + 1.0)
             for groups in _find(common.get("optimizer"), "param_groups")
             for group in _groups(groups) if "step" in group]
    if not steps:
        return None
    if any(s != steps[0] for s in steps):
        raise UserError(f"{where}: its param groups are at Adam steps "
                        f"{sorted(set(steps))[:4]}: they must agree")
    return int(steps[0])


def _groups(groups: Any) -> list[dict]:
    return [g for g in groups if isinstance(g, dict)] if isinstance(groups, list | tuple) else []


def _number(value: Any, what: str, where: Path, low: float = -math.inf,
            high: float = math.inf) -> float:
    return bounds.real(value, what, str(where), "the checkpoint is damaged", low=low, high=high)


def _find(node: Any, field: str) -> Iterator[Any]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from [value] if key == field else _find(value, field)
    elif isinstance(node, list | tuple):
        for value in node:
            yield from _find(value, field)


def _hyperparameters(common: dict[str, Any], where: Path) -> dict[str, Any]:
    """lr, betas and eps of the run's param groups, the weight decay of matrices and of norms
    (Megatron's no-decay group, `wd_mult` 0, holds norms and biases), and the clipping norm."""
    groups = [g for gs in _find(common.get("optimizer"), "param_groups") for g in _groups(gs)]
    out: dict[str, Any] = {}
    if groups:
        first = groups[0]
        out.update({f: _number(first[f], f, where) for f in ("lr", "eps") if f in first})
        if "betas" in first:
            betas = first["betas"]
            if not (isinstance(betas, list | tuple) and len(betas) == 2):
                raise UserError(f"{where}: betas is {bounds.show(betas)}, not a pair of "
                                f"numbers: the checkpoint is damaged")
            out["betas"] = [_number(b, "betas", where) for b in betas]
        decays = [_number(g.get("weight_decay", 0.0), "weight_decay", where)
                  * _number(g.get("wd_mult", 1.0), "wd_mult", where) for g in groups]
        out["weight_decay_matrix"], out["weight_decay_norm"] = max(decays), min(decays)
    clip = getattr(common.get("args"), "clip_grad", None)
    if isinstance(clip, int | float) and not isinstance(clip, bool) and 0 < clip < math.inf:
        out["clip_norm"] = float(clip)
    return out


class _Unfused:
    """hotjax parameters made one at a time from the Megatron tensors they come from: a tensor
    is read (fp32) when the first of its parameters is made, and dropped once the last one is,
    so that host memory holds a few tensors at a time, never the checkpoint. A tensor with a
    value that is not a finite number is refused, named with `where`."""

    def __init__(self, config: LlamaConfig, expected: dict[str, tuple], where: Path):
        self.config, self.expected, self.where = config, expected, where
        self._read: dict[tuple, dict[tuple, np.ndarray]] = {}  # source -> its parameters left

    def pending(self, field: str, reads: dict[str, Any]) -> Any:
        """The params tree of `store.Pending` leaves, each made from the tensor `reads[model
        key]()` returns (a model tensor, or Adam's `field` of it)."""
        from hotjax.checkpoint import store
        from hotjax.models.llama import abstract_params

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
        from hotjax.models.hf import NOT_FINITE

        if source not in self._read:
            x = read()
            field, key = source
            bounds.finite(x, f"{self.where}: {'tensor' if field == 'weight' else field + ' of'} "
                          f"{key}", NOT_FINITE)
            self._read[source] = dict(_unfuse(key, x, self.config))
        parts = self._read[source]
        value = np.ascontiguousarray(parts.pop(path))
        if not parts:
            del self._read[source]
        return value


def _master(read: Any, iteration: Path, info: Any, key: str, where: Path) -> np.ndarray:
    """The optimizer's fp32 copy of model tensor `key` (`read()`), refused unless the model's
    own weights are that copy rounded to their dtype, as Megatron keeps them after every step:
    Megatron-Core 0.16.1's fully reshardable save of a run whose gradient buffer has several
    buckets writes every element of its optimizer state wrong, and this is how it shows."""
    import torch

    master = read()
    model = _read_tensor(iteration, info, key)
    rounded = torch.from_numpy(master).to(info.properties.dtype).to(torch.float32).numpy()
    wrong = int(np.count_nonzero(rounded != model))
    if wrong:
        raise UserError(f"{where}: the optimizer's fp32 copy of {key} is not the model's "
                        f"weights ({wrong:,} of {model.size:,} elements differ): its optimizer "
                        f"state was saved wrong (Megatron-Core 0.16's fully reshardable save "
                        f"of a run with several gradient buckets does this): pass "
                        f"--weights-only, or save with the default dp_reshardable format")
    return master


def _read_tensor(iteration: Path, info: Any, key: str) -> np.ndarray:
    """One checkpoint tensor, whole, in fp32."""
    import torch

    loaded = {key: torch.empty(tuple(info.size), dtype=info.properties.dtype)}
    dcp.load(iteration, loaded)
    return loaded.pop(key).to(torch.float32).numpy()


def import_megatron_core(directory: str | Path, out: str | Path, *,
                         config: LlamaConfig | None = None, weights_only: bool = False,
                         tokenizer: Any = None) -> Path:
    """A hotjax checkpoint of the torch_dist checkpoint at `directory` (its root or one
    iteration's): weights, and Adam's moments and step where saved per parameter (unless
    `weights_only`); `config` defaults to the model the run's args record."""
    from hotjax.checkpoint import dirs
    from hotjax.checkpoint.formats import pivot

    dirs.check_new_directory(out)
    iteration = iteration_directory(directory)
    where = iteration / ".metadata"
    metadata, tensors = _tensors(iteration)
    common = read_common(iteration / "common.pt")
    rows = _rows(tensors, where)
    config = megatron.model_of(common.get("args"), iteration / "common.pt", rows, config)
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
        buckets = Buckets(iteration, tensors, bucketed, config, expected, norms,
                           common.get("args"), where)
        common = {**common, "optimizer": [common.get("optimizer"),
                                          *distributed_groups(iteration, metadata)]}
    moment_fields = [f for f in MOMENTS if f in state or buckets]
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
            found = {k: functools.partial(buckets.read, "param" if field == "weight" else field,
                                          k) for k in expected}
        else:
            found = {k: functools.partial(_read_tensor, iteration, tensors[key], key)
                     for k, key in sources[field].items()}
        if field == "weight" and (buckets is not None or "param" in state):
            # The optimizer's fp32 copy, checked against the model's own weights.
            return {k: functools.partial(_master, read, iteration, tensors[k], k, where)
                    for k, read in found.items()}
        return found

    unfused = _Unfused(config, expected, iteration)
    trees = {field: unfused.pending(field, reads(field)) for field in ("weight", *moment_fields)}
    iteration_number = common.get("iteration")
    if iteration_number is not None:
        iteration_number = bounds.whole(iteration_number, "iteration", 0, bounds.MAX_STEP,
                                        str(iteration / "common.pt"), "the checkpoint is damaged")
    foreign = {"format": f"megatron-core {BACKEND}", "naming": "megatron-core",
               "checkpoint": str(iteration), "iteration": iteration_number}
    moments = {f: trees[f] for f in moment_fields} or None
    return pivot.save_trees(
        out, config, trees["weight"], moments,
        step if moments else (iteration_number or 0),
        _hyperparameters(common, iteration / "common.pt"),
        source=f"import-megatron-core {iteration}", foreign=foreign, tokenizer=tokenizer)


FORMAT = Format(
    "megatron-core", imports=import_megatron_core, import_help="a Megatron-Core torch_dist "
    "checkpoint (Megatron-LM's default format, of any TP/PP/DP) to a checkpoint: weights, and "
    "Adam's moments and step where saved per parameter",
    source_help="the checkpoint's root (latest_checkpointed_iteration.txt names the iteration) "
    "or one iteration's directory",
    model=RECORDED, model_help="the model the checkpoint's args record",
    import_options=(Option("--weights-only", "leave the optimizer state out (needed for the "
                           "distributed optimizer's default dp_reshardable format)",
                           (("action", "store_true"),)),))
