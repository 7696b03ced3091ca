"""PyTorch Distributed Checkpoint (DCP) directories to and from hotjax checkpoints, so that a
run moves between a PyTorch trainer (torchtitan, FSDP2, tensor-parallel `DTensor` runs) and
hotjax with its weights, AdamW moments and step.

A DCP directory is a `.metadata` file (every tensor's global shape and the chunks each rank
wrote) and per-rank `__R_0.distcp` files. torch's own reader reassembles each tensor whatever
the layout that wrote it; what this module adds is the naming. A key is matched by its longest
suffix that is a parameter's name, so wrappers and prefixes (`model.`, `app.`, `_orig_mod.`,
`_checkpoint_wrapped_module.`) need no configuration:
- weights: `...{name}`, in Hugging Face LLaMA naming (`model.layers.0.self_attn.q_proj.weight`)
  or torchtitan's (`layers.0.attention.wq.weight`, whose Q/K rows interleave the rotary pairs,
  Meta's convention: converted to Hugging Face's halves on the way in, back on the way out);
- AdamW state: `...state.{name}.exp_avg`, `.exp_avg_sq` and `.step`, nested or flattened
  (`get_state_dict` with or without `flatten_optimizer_state_dict`); hyperparameters from
  `param_groups` are recorded, not applied: the hotjax run keeps its own optimizer settings.

torch is imported here only (the `torch` extra). An import reads one tensor at a time
(`dcp.load` of one key) and writes one parameter at a time (`store.Pending`); an export
restores one array at a time, but torch's writer takes the whole state at once, so it holds
the exported tensors (the checkpoint once) before it writes.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from hotjax.checkpoint import meta as meta_lib
from hotjax.checkpoint import store, untrusted
from hotjax.optim import OptimConfig, make_optimizer
from models import bounds
from models.errors import UserError
from models.hf import LazyTensors, hf_param_makers, hf_tensor_shapes, hf_tensors, param_keys
from models.llama import LlamaConfig, abstract_params, param_axes
from models.options import CHECKPOINT_NAMINGS

NAMINGS = CHECKPOINT_NAMINGS
MOMENTS = ("exp_avg", "exp_avg_sq")  # torch's AdamW names for optax's mu and nu
_STATE_FIELDS = (*MOMENTS, "step")
_GROUP_FIELDS = ("lr", "betas", "eps", "weight_decay", "params")
_WRAPPERS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module"}
BUFFERS = ("rotary_emb.inv_freq", "freqs_cis")  # rotary tables some models persist
HEADS = ("lm_head.weight", "output.weight")  # with tied embeddings, the embedding again
_MAX_DIMS = 8  # a LLaMA's tensors have 1 or 2 dimensions; a claim of more is damage
# Hugging Face module -> torchtitan module, inside `layers.{i}.`
_TORCHTITAN_LAYER = {
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TORCHTITAN_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight",
                   "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
# Our torch.optim.AdamW param_group, as `get_state_dict(flatten_optimizer_state_dict=True)`
# writes it per parameter (the fields besides lr, betas, eps and weight decay).
_ADAMW_FLAGS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                "differentiable": False, "fused": None, "decoupled_weight_decay": True}


def _torch() -> tuple[Any, Any]:
    try:
        import torch
        import torch.distributed.checkpoint as dcp
    except ImportError:
        raise UserError("PyTorch checkpoints need torch: pip install 'hotjax[torch]'") from None
    return torch, dcp


# ---------------------------------------------------------------------------- naming

def foreign_names(config: LlamaConfig, naming: str) -> dict[str, str]:
    """Each Hugging Face tensor name of `config` -> its name under `naming`."""
    names = {}
    for hf in hf_tensor_shapes(config):
        if naming == "hf":
            names[hf] = hf
        elif hf in _TORCHTITAN_TOP:
            names[hf] = _TORCHTITAN_TOP[hf]
        else:
            layer, module = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf).groups()
            names[hf] = f"layers.{layer}.{_TORCHTITAN_LAYER[module]}.weight"
    return names


def _rotary_heads(hf_name: str, config: LlamaConfig) -> int | None:
    """Heads whose rows a torchtitan Q/K weight interleaves; None for other tensors."""
    if hf_name.endswith("self_attn.q_proj.weight"):
        return config.n_heads
    if hf_name.endswith("self_attn.k_proj.weight"):
        return config.n_kv_heads
    return None


def interleaved_to_halves(x: np.ndarray, heads: int) -> np.ndarray:
    """Q/K rows of each head from Meta's rotary pairs (0,1),(2,3).. to Hugging Face's halves."""
    return x.reshape(heads, -1, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def halves_to_interleaved(x: np.ndarray, heads: int) -> np.ndarray:
    return x.reshape(heads, 2, -1, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


@dataclasses.dataclass(frozen=True)
class _Entry:
    key: str  # the DCP key
    field: str  # "weight", or the optimizer state: exp_avg, exp_avg_sq, step
    hf_name: str
    shape: tuple[int, ...]


def _components(key: str, planner_data: dict[str, Any]) -> list[str]:
    path = planner_data.get(key, (key,))
    parts = [c for p in path for c in str(p).split(".")]
    return [c for c in parts if c not in _WRAPPERS]


def resolve(parts: list[str], names: dict[str, str]) -> tuple[str, str] | None:
    """(field, HF name) of a key's components, matched by its longest suffix that names a
    parameter; None if no suffix does."""
    field = "weight"
    if parts[-1] in _STATE_FIELDS and "state" in parts[:-1]:
        field, parts = parts[-1], parts[:-1]
    for start in range(len(parts)):
        name = names.get(".".join(parts[start:]))
        if name is not None:
            return field, name
    return None


def _group_field(parts: list[str]) -> tuple[str, str] | None:
    """(which parameter or group, field) of a param_groups entry worth reading."""
    if "param_groups" not in parts or parts[-1] not in _GROUP_FIELDS:
        return None
    at = len(parts) - 1 - parts[::-1].index("param_groups")
    return ".".join(parts[at + 1:-1]), parts[-1]


# ---------------------------------------------------------------------------- reading

@dataclasses.dataclass(frozen=True)
class TorchState:
    """A DCP checkpoint's LLaMA state, Hugging Face-named, in fp32 numpy, each tensor read
    when it is accessed."""

    naming: str
    weights: Mapping[str, np.ndarray]  # read when accessed (`LazyTensors`)
    moments: dict[str, Mapping[str, np.ndarray]] | None  # exp_avg / exp_avg_sq -> HF tensors
    step: int
    hyperparameters: dict[str, Any]  # from param_groups: what the torch run used


def read_metadata(directory: Path) -> Any:
    """The DCP directory's `.metadata`, read without running any code it names."""
    _torch()
    if not (directory / ".metadata").is_file():
        raise UserError(f"{directory}: holds no .metadata file: not a PyTorch Distributed "
                        f"Checkpoint directory (torch.distributed.checkpoint.save writes one)")
    return untrusted.read_dcp_metadata(directory)


def embedding_rows(directory: str | Path) -> int:
    """The vocabulary size of a DCP checkpoint, read from its embedding's shape."""
    directory = Path(directory).absolute()
    metadata = read_metadata(directory)
    ends = (".embed_tokens.weight", "tok_embeddings.weight")
    for key, info in metadata.state_dict_metadata.items():
        parts = _components(key, metadata.planner_data or {})
        if ".".join(parts).endswith(ends) and "state" not in parts:
            return claimed_shape(info.size, key, directory / ".metadata")[0]
    raise UserError(f"{directory / '.metadata'}: holds no embedding (embed_tokens or "
                    f"tok_embeddings): not a LLaMA checkpoint, or saved without its model")


def claimed_shape(size: Any, key: str, where: Path) -> tuple[int, ...]:
    """A tensor's global shape as a checkpoint's metadata claims it, before anything is sized
    by it: a few whole numbers, whose elements (as fp32) fit this host's memory, since an
    import reads a tensor whole."""
    damaged = "the checkpoint is damaged"
    if not isinstance(size, tuple | list) or not 1 <= len(size) <= _MAX_DIMS:
        raise UserError(f"{where}: tensor {key} has shape {bounds.show(size)}, not 1 to "
                        f"{_MAX_DIMS} dimensions: {damaged}")
    shape = tuple(bounds.whole(n, f"a dimension of {key}", 0, bounds.MAX_COUNT, str(where),
                               damaged) for n in size)
    elements, memory = math.prod(shape), bounds.host_memory()
    if elements * bounds.PARAM_BYTES > memory:
        raise UserError(f"{where}: tensor {key} claims {elements:,} elements, more than this "
                        f"machine's {memory / 2**30:,.1f} GiB of memory holds as fp32: {damaged}")
    return shape


def _detect(keys: Iterable[list[str]], config: LlamaConfig, naming: str | None) -> str:
    keys = list(keys)
    found = {n: sum(resolve(k, _inverse(config, n)) is not None for k in keys) for n in NAMINGS}
    best = naming or max(NAMINGS, key=lambda n: found[n])
    if not found[best]:
        which = f"{naming} naming" if naming else "Hugging Face or torchtitan naming"
        sample = ", ".join(".".join(k) for k in keys[:3])
        raise UserError(f"no tensor is named as a LLaMA weight in {which} (keys such as "
                        f"{sample}): pass the right --naming, or the --config of the model the "
                        f"checkpoint holds")
    return best


def _inverse(config: LlamaConfig, naming: str) -> dict[str, str]:
    return {foreign: hf for hf, foreign in foreign_names(config, naming).items()}


def read_dcp(directory: str | Path, config: LlamaConfig, naming: str | None = None) -> TorchState:
    """The weights, AdamW moments and step of the DCP checkpoint in `directory`, checked
    against `config`; every problem names the checkpoint and the tensor."""
    torch, _ = _torch()
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    directory = Path(directory).absolute()
    metadata = read_metadata(directory)
    planner_data = metadata.planner_data or {}
    parts = {key: _components(key, planner_data) for key in metadata.state_dict_metadata}
    tensors = {k: v for k, v in metadata.state_dict_metadata.items()
               if isinstance(v, TensorStorageMetadata)}
    naming = _detect((parts[k] for k in tensors), config, naming)
    entries = _entries(tensors, parts, config, naming, directory / ".metadata")
    expected = hf_tensor_shapes(config)
    has_state = any(e.field != "weight" for e in entries.values())
    check_files(directory, metadata, {e.key for e in entries.values()})
    groups = {key: _group_field(parts[key]) for key in metadata.state_dict_metadata
              if key not in tensors}
    groups = {key: g for key, g in groups.items() if g is not None}
    # The steps and param groups are read now (small); weights and moments one tensor at a
    # time, when the checkpoint is written.
    state: dict[str, Any] = {e.key: torch.empty(e.shape, dtype=tensors[e.key].properties.dtype)
                             for e in entries.values() if e.field == "step"}
    state.update(dict.fromkeys(groups))
    load(directory, state)

    def field(name: str) -> LazyTensors:
        def read(hf_name: str) -> np.ndarray:
            entry = entries[name, hf_name]
            one = {entry.key: torch.empty(entry.shape,
                                          dtype=tensors[entry.key].properties.dtype)}
            load(directory, one)
            x = one.pop(entry.key).to(torch.float32).numpy()
            heads = _rotary_heads(hf_name, config)
            return interleaved_to_halves(x, heads) if naming == "torchtitan" and heads else x

        return LazyTensors(expected, read)

    weights = field("weight")
    moments, step = None, 0
    if has_state:
        moments = {f: field(f) for f in MOMENTS}
        steps = {n: float(state[entries["step", n].key].reshape(())) for n in expected}
        first = next(iter(expected))
        odd = next((n for n in expected if steps[n] != steps[first]), None)
        if odd is not None:
            raise UserError(f"{directory / '.metadata'}: {entries['step', odd].key} is "
                            f"{steps[odd]:g} but {entries['step', first].key} is "
                            f"{steps[first]:g}: AdamW steps must agree")
        step = int(bounds.real(steps[first], f"{entries['step', first].key}",
                               str(directory / ".metadata"), "the checkpoint is damaged",
                               low=-1.0, high=bounds.MAX_STEP + 1.0))
    return TorchState(naming, weights, moments, step,
                      hyperparameters({g: state[k] for k, g in groups.items()},
                                       _inverse(config, naming)))


def _entries(tensors: dict[str, Any], parts: dict[str, list[str]], config: LlamaConfig,
             naming: str, where: Path) -> dict[tuple[str, str], _Entry]:
    """Each tensor the model needs, by (field, Hugging Face name): checked to be there once, at
    its shape, with AdamW state for every weight or for none; other tensors refused unless they
    are rotary tables (or, tied, the head's copy of the embedding)."""
    names = _inverse(config, naming)
    expected = hf_tensor_shapes(config)
    entries: dict[tuple[str, str], _Entry] = {}
    for key, info in tensors.items():
        found = resolve(parts[key], names)
        if found is None:
            tied_head = config.tie_embeddings and ".".join(parts[key]).endswith(HEADS)
            if not (key.endswith(BUFFERS) or tied_head) and parts[key][-1] in ("weight", "bias"):
                raise UserError(f"{where}: holds tensor {key}, which a LLaMA of this config "
                                f"lacks in {naming} naming: pass the --config the checkpoint "
                                f"was trained with (or its --naming)")
            continue
        field, hf_name = found
        if (field, hf_name) in entries:
            raise UserError(f"{where}: tensors {entries[field, hf_name].key} and {key} are both "
                            f"{field} of {hf_name}: the checkpoint holds two models")
        shape = tuple(info.size)
        want = () if field == "step" else expected[hf_name]
        if shape != want and not (field == "step" and math.prod(shape) == 1):
            raise UserError(f"{where}: tensor {key} has shape {list(shape)}, but the model "
                            f"needs {list(want)}: pass the --config it was trained with")
        entries[field, hf_name] = _Entry(key, field, hf_name, shape)

    foreign = foreign_names(config, naming)
    missing = [n for n in expected if ("weight", n) not in entries]
    if missing:
        raise UserError(f"{where}: lacks the weight {foreign[missing[0]]}"
                        f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}: not a "
                        f"checkpoint of this model (or saved without its model state)")
    if any(e.field != "weight" for e in entries.values()):
        for field in _STATE_FIELDS:
            absent = [n for n in expected if (field, n) not in entries]
            if absent:
                raise UserError(f"{where}: holds AdamW state but no {field} for "
                                f"{foreign[absent[0]]}: the optimizer state is incomplete "
                                f"(saved from another optimizer?)")
    return entries


def load(directory: Path, state: dict[str, Any], planner: Any = None) -> None:
    """`dcp.load` of the DCP directory into `state` (tensors allocated at their global shapes,
    filled in place; or whatever `planner`, a torch `LoadPlanner`, asks for), whatever wrote
    it, running no code it holds (saved objects are read as plain data); a failure is one line
    naming the directory."""
    _, dcp = _torch()
    from torch.distributed.checkpoint.api import CheckpointException

    metadata = read_metadata(directory)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=untrusted.dcp_reader(directory, metadata),
                     planner=untrusted.dcp_planner(directory) if planner is None else planner,
                     no_dist=True)
    # torch's CheckpointException, which wraps each rank's error, is a BaseException.
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
        if isinstance(cause, UserError):
            raise cause from None
        raise UserError(f"{directory}: reading its tensors failed ({type(cause).__name__}: "
                        f"{meta_lib.first_line(cause)}): the checkpoint is truncated or "
                        f"damaged") from None


def check_files(directory: Path, metadata: Any, keys: set[str]) -> None:
    """Every byte range `.metadata` places the tensors `keys` in exists: a missing or truncated
    rank file is named with a tensor it holds before anything is read."""
    sizes: dict[str, int | None] = {}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn not in keys:
            continue
        file = directory / info.relative_path
        if info.relative_path not in sizes:
            sizes[info.relative_path] = file.stat().st_size if file.is_file() else None
        size = sizes[info.relative_path]
        if size is None:
            raise UserError(f"{file}: missing, though {directory / '.metadata'} places tensor "
                            f"{index.fqn} there: copy the whole checkpoint directory")
        if info.offset + info.length > size:
            raise UserError(f"{file}: holds {size} bytes, but tensor {index.fqn} lies at bytes "
                            f"{info.offset}..{info.offset + info.length}: the file is truncated")


def hyperparameters(values: dict[tuple[str, str], Any], names: dict[str, str]) -> dict[str, Any]:
    """lr, betas, eps, and weight decay of matrices and of norm scales, as the torch run's
    param_groups give them (groups nested or flattened per parameter)."""
    per_param: dict[str, dict[str, Any]] = {}
    nested: dict[str, dict[str, Any]] = {}
    for (owner, field), value in values.items():
        if owner.isdigit() or owner == "":
            nested.setdefault(owner, {})[field] = value
        else:
            per_param.setdefault(owner, {})[field] = value
    for group in nested.values():
        for fqn in group.get("params") or []:
            per_param[str(fqn)] = group
    out: dict[str, Any] = {}
    for fqn, group in per_param.items():
        hf_name = resolve([c for c in fqn.split(".") if c not in _WRAPPERS], names)
        if hf_name is None:
            continue
        kind = "norm" if hf_name[1].endswith("norm.weight") else "matrix"
        for field in ("lr", "betas", "eps"):
            if field in group:
                out.setdefault(field, group[field])
        if "weight_decay" in group:
            out.setdefault(f"weight_decay_{kind}", group["weight_decay"])
    if "betas" in out:
        out["betas"] = [float(b) for b in out["betas"]]
    return out


# ---------------------------------------------------------------------------- import

def adam_state(config: LlamaConfig, moments: dict[str, Any], step: int) -> Any:
    """hotjax's optimizer state (loss scaling off) holding torch AdamW's moments and step."""
    tx = make_optimizer(OptimConfig(), param_axes(config))
    shapes = jax.eval_shape(tx.init, abstract_params(config))
    count = np.asarray(step, np.int32)

    def fill(node: Any) -> Any:
        if isinstance(node, optax.ScaleByAdamState):
            return optax.ScaleByAdamState(count, moments["exp_avg"], moments["exp_avg_sq"])
        if isinstance(node, optax.ScaleByScheduleState):
            return optax.ScaleByScheduleState(count)
        raise AssertionError(f"unexpected optimizer state {type(node).__name__}")

    return jax.tree.map(fill, shapes, is_leaf=lambda n: isinstance(
        n, optax.ScaleByAdamState | optax.ScaleByScheduleState | jax.ShapeDtypeStruct))


def import_dcp(directory: str | Path, out: str | Path, config: LlamaConfig, *,
               naming: str | None = None, tokenizer: Any = None) -> Path:
    """A hotjax checkpoint of the DCP checkpoint in `directory`: parameters, and when the
    torch run saved them its AdamW moments and step, so that training resumes there on any
    strategy; weights only otherwise."""
    store.check_new_directory(out)
    directory = Path(directory).absolute()
    torch_state = read_dcp(directory, config, naming)
    return save_torch_state(out, torch_state, config, source=f"import-dcp {directory}",
                            foreign={"format": "torch-dcp", "naming": torch_state.naming,
                                     "checkpoint": str(directory)}, tokenizer=tokenizer)


def save_torch_state(out: str | Path, torch_state: TorchState, config: LlamaConfig, *,
                     source: str, foreign: dict[str, Any], tokenizer: Any = None) -> Path:
    """A hotjax checkpoint of a PyTorch run's state (from DCP or DeepSpeed): weights, and its
    AdamW moments and step if it has them; the run's hyperparameters are recorded."""
    def tree(tensors: Mapping[str, np.ndarray]) -> Any:
        return store.pending(hf_param_makers(tensors, config), abstract_params(config))

    moments = None if torch_state.moments is None else {
        f: tree(m) for f, m in torch_state.moments.items()}
    return save_trees(out, config, tree(torch_state.weights), moments,
                      torch_state.step, torch_state.hyperparameters, source=source,
                      foreign=foreign, tokenizer=tokenizer)


def save_trees(out: str | Path, config: LlamaConfig, params: Any, moments: dict[str, Any] | None,
               step: int, hyperparameters: dict[str, Any], *, source: str,
               foreign: dict[str, Any], tokenizer: Any = None) -> Path:
    """A hotjax checkpoint of a PyTorch run's parameters and, unless None, its AdamW moments
    (exp_avg and exp_avg_sq, trees shaped as `params`) and step; `hyperparameters` are
    recorded, not applied. Leaves may be `store.Pending`, made one at a time as written."""
    bounds.whole(step, "its step", 0, bounds.MAX_STEP, source, "the checkpoint is damaged")
    items = {store.PARAMS: params}
    optimizer = None
    if moments is not None:
        items[store.OPT_STATE] = adam_state(config, moments, step)
        optimizer = {"source": "torch.optim.AdamW", "loss_scaling": "off", **hyperparameters}
    record = meta_lib.record(
        step=step, source=source, items=list(items), model=config.to_dict(),
        optimizer=optimizer, tokenizer=meta_lib.tokenizer_record(tokenizer) if tokenizer else None,
        written_from={"foreign": foreign})
    return store.save_items(out, items, record)


# ---------------------------------------------------------------------------- export

def export_dcp(path: str | Path, out: str | Path, *, naming: str = "hf",
               dtype: str = "float32") -> Path:
    """A DCP directory of a checkpoint's parameters (in `dtype`) and, if it has one, its AdamW
    state (fp32), under `naming`, that `torch.distributed.checkpoint.load` reads into any
    sharding of the same model. Hugging Face naming nests them as `{"model": ..., "optim":
    ...}`; torchtitan's puts the model at the top and the optimizer under "optimizer". The
    optimizer state is flattened per parameter, as `get_state_dict(..., options=
    StateDictOptions(flatten_optimizer_state_dict=True))` gives it. Vocabulary padding past
    the recorded tokenizer's size is left out, as in `export-hf`."""
    torch, dcp = _torch()
    out = store.check_new_directory(out)
    source = ExportSource.of(path)
    config, optim, step = source.config, source.optim, source.step
    names = foreign_names(config, naming)

    def tensors(field: str, as_dtype: Any) -> dict[str, Any]:
        # torch's DCP writer takes the whole state at once: each array is converted to torch
        # tensors as it is restored, and only those are kept.
        out = {}
        for key, x in source.arrays(field):
            for hf_name, t in hf_tensors(key, x, config):
                heads = _rotary_heads(hf_name, config)
                if naming == "torchtitan" and heads:
                    t = halves_to_interleaved(t, heads)
                out[names[hf_name]] = torch.from_numpy(np.ascontiguousarray(t)).to(as_dtype)
            del x
        return out

    model = tensors(store.PARAMS, getattr(torch, dtype))
    state: dict[str, Any] = {"model": model} if naming == "hf" else dict(model)
    if step is not None:
        lr = float(optim.schedule()(step))
        flat: dict[str, Any] = {}
        for field, moment in zip(MOMENTS, ("mu", "nu"), strict=True):
            flat.update({f"state.{name}.{field}": x
                         for name, x in tensors(moment, torch.float32).items()})
        for hf_name, name in names.items():
            flat[f"state.{name}.step"] = torch.tensor(float(step))
            decay = 0.0 if hf_name.endswith("norm.weight") else optim.weight_decay
            group = {"lr": lr, "betas": (optim.b1, optim.b2), "eps": optim.eps,
                     "weight_decay": decay, **_ADAMW_FLAGS}
            flat.update({f"param_groups.{name}.{k}": v for k, v in group.items()})
        state["optim" if naming == "hf" else "optimizer"] = flat

    def save(scratch: Path) -> None:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(scratch)), no_dist=True)

    return store.write_atomically(out, save)


@dataclasses.dataclass(frozen=True)
class ExportSource:
    """A checkpoint to export: its model (vocabulary padding past the recorded tokenizer's size
    left out), the optimizer it was written with and AdamW's step (None: weights only); its
    arrays are restored one at a time (`arrays`), so that an export holds one."""

    step_dir: Path
    config: LlamaConfig
    optim: OptimConfig
    step: int | None
    _adam: str | None  # where AdamW's state lies in `opt_state` (`1/0`)
    _axes: dict[str, tuple[str, ...]]  # each parameter's logical axes, by key

    @classmethod
    def of(cls, path: str | Path) -> ExportSource:
        step_dir = store.find(path)
        meta = meta_lib.read(step_dir)
        config = LlamaConfig.checked(meta["model"], f"{step_dir / meta_lib.META_FILE}: model",
                                     meta_lib.DAMAGED)
        optim = _saved_optimizer(meta)
        adam = step = None
        if store.OPT_STATE in meta["items"]:
            tx = make_optimizer(optim, param_axes(config))
            shapes = jax.eval_shape(tx.init, abstract_params(config))
            (adam,) = [store.array_path(p) for p, n in jax.tree_util.tree_flatten_with_path(
                shapes, is_leaf=_is_adam)[0] if _is_adam(n)]
            ((_, count),) = store.restore_each(step_dir, store.OPT_STATE, [f"{adam}/count"])
            step = int(count)
        axes = {store.array_path(p): a for p, a in jax.tree_util.tree_flatten_with_path(
            param_axes(config), is_leaf=lambda a: isinstance(a, tuple))[0]}
        config = dataclasses.replace(config, vocab_size=meta_lib.real_vocab(meta))
        return cls(step_dir, config, optim, step, adam, axes)

    def arrays(self, field: str) -> Iterator[tuple[str, np.ndarray]]:
        """(parameter key, array) of every parameter (`field` "params") or AdamW moment ("mu",
        "nu"), each restored on the host when its turn comes, vocabulary trimmed."""
        item, prefix = (store.PARAMS, "") if field == store.PARAMS else (
            store.OPT_STATE, f"{self._adam}/{field}/")
        keys = param_keys(self.config)
        for name, x in store.restore_each(self.step_dir, item, [prefix + k for k in keys]):
            key = name.removeprefix(prefix)
            yield key, store.trim(x, self._axes[key], self.config.vocab_size)


def read_for_export(path: str | Path) -> tuple[LlamaConfig, OptimConfig, Any, Any]:
    """A checkpoint's model, the optimizer it was written with, its parameters and its AdamW
    state (`optax.ScaleByAdamState`, or None for a weights-only checkpoint), whole, on the
    host (`ExportSource` gives them one at a time)."""
    source = ExportSource.of(path)

    def tree(field: str) -> dict[str, Any]:
        out: dict[str, Any] = {"layers": {}}
        for key, x in source.arrays(field):
            (out["layers"] if key.startswith("layers/") else out)[key.removeprefix("layers/")] = x
        return out

    adam = None if source.step is None else optax.ScaleByAdamState(
        np.asarray(source.step, np.int32), tree("mu"), tree("nu"))
    return source.config, source.optim, tree(store.PARAMS), adam


def _is_adam(node: Any) -> bool:
    return isinstance(node, optax.ScaleByAdamState)


def _saved_optimizer(meta: dict[str, Any]) -> OptimConfig:
    """The optimizer a checkpoint was written with (its hyperparameters and state layout)."""
    saved = meta.get("optimizer") or {}
    if saved.get("source") == "torch.optim.AdamW":  # an import: the state of our default
        return OptimConfig(lr=saved.get("lr", OptimConfig.lr),
                           b1=saved.get("betas", [OptimConfig.b1])[0],
                           b2=saved.get("betas", [0, OptimConfig.b2])[1],
                           eps=saved.get("eps", OptimConfig.eps),
                           weight_decay=saved.get("weight_decay_matrix",
                                                  OptimConfig.weight_decay),
                           warmup_steps=0, min_lr_ratio=1.0)
    fields = {f.name for f in dataclasses.fields(OptimConfig)}
    return OptimConfig(**{k: v for k, v in saved.items() if k in fields})
