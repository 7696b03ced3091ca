"""PyTorch Distributed Checkpoint (DCP) directories to and from hotjax checkpoints, so that a
run moves between a PyTorch trainer (torchtitan, FSDP2, tensor-parallel `DTensor` runs) and
hotjax with its weights, optimizer state and step.

A DCP directory is a `.metadata` file (every tensor's global shape and the chunks each rank
wrote) and per-rank `__R_0.distcp` files. torch's own reader reassembles each tensor whatever
the layout that wrote it; what this module adds is the naming (`pivot.resolve`: a key is
matched by its longest suffix that is a parameter's name, so wrappers and prefixes such as
`model.`, `app.`, `_orig_mod.`, `_checkpoint_wrapped_module.` need no configuration). An import
is a `pivot.TorchState`, an export reads a `pivot.ExportSource`:
- weights: `...{name}`, in Hugging Face LLaMA naming (`model.layers.0.self_attn.q_proj.weight`)
  or torchtitan's (`layers.0.attention.wq.weight`, whose Q/K rows interleave the rotary pairs,
  Meta's convention: converted to Hugging Face's halves on the way in, back on the way out);
- optimizer state: `...state.{name}.{field}` and `.step`, nested or flattened (`get_state_dict`
  with or without `flatten_optimizer_state_dict`), the fields torch's names for the optimizer's
  state (AdamW's `exp_avg`, `exp_avg_sq`; imports read AdamW's); hyperparameters from
  `param_groups` are recorded, not applied: the hotjax run keeps its own optimizer settings.

torch (the `torch` extra) is imported when a function runs. An import reads one tensor at a time
(`dcp.load` of one key) and writes one parameter at a time (`store.Pending`); an export
restores one array at a time, but torch's writer takes the whole state at once, so it holds
the exported tensors (the checkpoint once) before it writes.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hotjax import bounds
from hotjax.checkpoint import meta as meta_lib
from hotjax.checkpoint.formats import torch_load
from hotjax.checkpoint.formats.spec import EMBEDDING, Format, Option, dtype_option
from hotjax.choices import CHECKPOINT_NAMINGS
from hotjax.errors import UserError
from hotjax.models.optimizers import ADAMW, TORCH_SETTINGS, Optimizer, with_torch_state

if TYPE_CHECKING:
    from hotjax.checkpoint.formats.pivot import TorchState
    from hotjax.models.llama import LlamaConfig

NAMINGS = CHECKPOINT_NAMINGS
_GROUP_FIELDS = ("lr", *TORCH_SETTINGS, "weight_decay", "params")
_MAX_DIMS = 8  # a LLaMA's tensors have 1 or 2 dimensions; a claim of more is damage


def _torch() -> tuple[Any, Any]:
    torch = torch_load.need_torch("PyTorch checkpoints")
    import torch.distributed.checkpoint as dcp

    return torch, dcp


# ---------------------------------------------------------------------------- naming

@dataclasses.dataclass(frozen=True)
class _Entry:
    key: str  # the DCP key
    field: str  # "weight", or the optimizer state: exp_avg, exp_avg_sq, step
    hf_name: str
    shape: tuple[int, ...]


def _components(key: str, planner_data: dict[str, Any]) -> list[str]:
    path = planner_data.get(key, (key,))
    from hotjax.checkpoint.formats.pivot import WRAPPERS

    parts = [c for p in path for c in str(p).split(".")]
    return [c for c in parts if c not in WRAPPERS]


def _group_field(parts: list[str]) -> tuple[str, str] | None:
    """(which parameter or group, field) of a param_groups entry worth reading."""
    if "param_groups" not in parts or parts[-1] not in _GROUP_FIELDS:
        return None
    at = len(parts) - 1 - parts[::-1].index("param_groups")
    return ".".join(parts[at + 1:-1]), parts[-1]


# ---------------------------------------------------------------------------- reading

def read_metadata(directory: Path) -> Any:
    """The DCP directory's `.metadata`, read without running any code it names."""
    _torch()
    if not (directory / ".metadata").is_file():
        raise UserError(f"{directory}: holds no .metadata file: not a PyTorch Distributed "
                        f"Checkpoint directory (torch.distributed.checkpoint.save writes one)")
    return torch_load.read_dcp_metadata(directory)


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
    from hotjax.checkpoint.formats.pivot import resolve

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
    from hotjax.checkpoint.formats.pivot import foreign_names

    return {foreign: hf for hf, foreign in foreign_names(config, naming).items()}


def read_dcp(directory: str | Path, config: LlamaConfig, naming: str | None = None) -> TorchState:
    """The weights, the optimizer's per-weight state (whichever optimizer's torch names it
    holds) and step of the DCP checkpoint in `directory`, checked against `config`; every
    problem names the checkpoint and the tensor."""
    torch, _ = _torch()
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from hotjax.checkpoint.formats.pivot import (
        TorchState,
        hyperparameters,
        interleaved_to_halves,
        rotary_heads,
    )
    from hotjax.models.hf import LazyTensors, hf_tensor_shapes

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
            heads = rotary_heads(hf_name, config)
            return interleaved_to_halves(x, heads) if naming == "torchtitan" and heads else x

        return LazyTensors(expected, read)

    weights = field("weight")
    moments, step, optimizer = None, 0, ADAMW
    if has_state:
        optimizer = _optimizer(entries, directory / ".metadata")
        moments = {f: field(f) for f in optimizer.torch_names(str(directory))}
    first = next(iter(expected))
    if has_state and ("step", first) in entries:  # torch's SGD keeps no step: 0
        steps = {n: float(state[entries["step", n].key].reshape(())) for n in expected}
        odd = next((n for n in expected if steps[n] != steps[first]), None)
        if odd is not None:
            raise UserError(f"{directory / '.metadata'}: {entries['step', odd].key} is "
                            f"{steps[odd]:g} but {entries['step', first].key} is "
                            f"{steps[first]:g}: {optimizer.label} steps must agree")
        step = int(bounds.real(steps[first], f"{entries['step', first].key}",
                               str(directory / ".metadata"), "the checkpoint is damaged",
                               low=-1.0, high=bounds.MAX_STEP + 1.0))
    return TorchState(naming, weights, moments, step,
                      hyperparameters({g: state[k] for k, g in groups.items()},
                                      _inverse(config, naming), directory / ".metadata"),
                      optimizer)


def _optimizer(entries: dict[tuple[str, str], _Entry], where: Path) -> Optimizer:
    """The optimizer whose torch state the checkpoint holds, by the state's names."""
    return with_torch_state({e.field for e in entries.values()
                             if e.field not in ("weight", "step")}, str(where))


def _entries(tensors: dict[str, Any], parts: dict[str, list[str]], config: LlamaConfig,
             naming: str, where: Path) -> dict[tuple[str, str], _Entry]:
    """Each tensor the model needs, by (field, Hugging Face name): checked to be there once, at
    its shape, with AdamW state for every weight or for none; other tensors refused unless they
    are rotary tables (or, tied, the head's copy of the embedding)."""
    from hotjax.checkpoint.formats.pivot import BUFFERS, HEADS, foreign_names, resolve
    from hotjax.models.hf import hf_tensor_shapes

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
        optimizer = _optimizer(entries, where)
        stepped = optimizer.torch_counts or any(e.field == "step" for e in entries.values())
        for field in (*optimizer.torch_names(str(where)), *(("step",) if stepped else ())):
            absent = [n for n in expected if (field, n) not in entries]
            if absent:
                raise UserError(f"{where}: holds {optimizer.label} state but no {field} for "
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
            dcp.load(state, storage_reader=torch_load.dcp_reader(directory, metadata),
                     planner=torch_load.dcp_planner(directory) if planner is None else planner,
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


# ---------------------------------------------------------------------------- import

def import_dcp(directory: str | Path, out: str | Path, config: LlamaConfig, *,
               naming: str | None = None, tokenizer: Any = None) -> Path:
    """A hotjax checkpoint of the DCP checkpoint in `directory`: parameters, and when the
    torch run saved them its AdamW moments and step, so that training resumes there on any
    strategy; weights only otherwise."""
    from hotjax.checkpoint import dirs
    from hotjax.checkpoint.formats.pivot import save_torch_state

    dirs.check_new_directory(out)
    directory = Path(directory).absolute()
    torch_state = read_dcp(directory, config, naming)
    return save_torch_state(out, torch_state, config, source=f"import-dcp {directory}",
                            foreign={"format": "torch-dcp", "naming": torch_state.naming,
                                     "checkpoint": str(directory)}, tokenizer=tokenizer)


# ---------------------------------------------------------------------------- export

def export_dcp(path: str | Path, out: str | Path, *, naming: str = "hf",
               dtype: str = "float32") -> Path:
    """A DCP directory of a checkpoint's parameters (in `dtype`) and, if it has one, its
    optimizer state (fp32, by torch's names: refused for an optimizer torch does not name),
    under `naming`, that `torch.distributed.checkpoint.load` reads into any sharding of the same
    model. Hugging Face naming nests them as `{"model": ..., "optim": ...}`; torchtitan's puts
    the model at the top and the optimizer under "optimizer". The optimizer state is flattened
    per parameter, as `get_state_dict(..., options=StateDictOptions(
    flatten_optimizer_state_dict=True))` gives it. Vocabulary padding past the recorded
    tokenizer's size is left out, as in `export-hf`."""
    torch, dcp = _torch()
    from hotjax.checkpoint import dirs
    from hotjax.checkpoint.formats.pivot import (
        ExportSource,
        foreign_names,
        halves_to_interleaved,
        rotary_heads,
    )
    from hotjax.models.hf import hf_tensors

    out = dirs.check_new_directory(out)
    source = ExportSource.of(path)
    config, optim, step = source.config, source.optim, source.step
    names = foreign_names(config, naming)

    def tensors(field: str, as_dtype: Any) -> dict[str, Any]:
        # torch's DCP writer takes the whole state at once: each array is converted to torch
        # tensors as it is restored, and only those are kept.
        out = {}
        for key, x in source.arrays(field):
            for hf_name, t in hf_tensors(key, x, config):
                heads = rotary_heads(hf_name, config)
                if naming == "torchtitan" and heads:
                    t = halves_to_interleaved(t, heads)
                out[names[hf_name]] = torch.from_numpy(np.ascontiguousarray(t)).to(as_dtype)
            del x
        return out

    model = tensors("params", getattr(torch, dtype))
    state: dict[str, Any] = {"model": model} if naming == "hf" else dict(model)
    if step is not None:
        lr = float(optim.lr_schedule()(step))
        flat: dict[str, Any] = {}
        for field in source.state_fields:
            flat.update({f"state.{name}.{field}": x
                         for name, x in tensors(field, torch.float32).items()})
        declared = optim.optimizer
        for hf_name, name in names.items():
            flat[f"state.{name}.step"] = torch.tensor(float(step))
            decay = 0.0 if hf_name.endswith("norm.weight") else optim.weight_decay
            group = {"lr": lr, "weight_decay": decay, **declared.torch_group(optim)}
            flat.update({f"param_groups.{name}.{k}": v for k, v in group.items()})
        state["optim" if naming == "hf" else "optimizer"] = flat

    def save(scratch: Path) -> None:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(scratch)), no_dist=True)

    return dirs.write_atomically(out, save)


FORMAT = Format(
    "dcp", imports=import_dcp, import_help="a PyTorch Distributed Checkpoint (torchtitan, FSDP2, "
    "DTensor) to a checkpoint that resumes its training: weights, AdamW moments and step",
    source_help="the directory torch.distributed.checkpoint.save wrote (.metadata and *.distcp)",
    exports=export_dcp, export_help="a checkpoint to a PyTorch Distributed Checkpoint that torch "
    "loads into any sharding of the model",
    model=EMBEDDING, model_help="config.json beside the checkpoint", rows=embedding_rows,
    import_options=(Option("--naming", "the tensors' names (default: detected)",
                           (("choices", NAMINGS),)),),
    export_options=(Option("--naming", "the tensors' names (default: %(default)s)",
                           (("choices", NAMINGS), ("default", "hf"))),
                    dtype_option("weights' dtype; the optimizer's state stays float32")))
