"""The pivot: the torch-side state every PyTorch format (DCP, DeepSpeed, Megatron-Core) converts
through, in both directions, and torch's names for a LLaMA's tensors.

The contract a format keeps:
- An import reads its files into a `TorchState`: the weights under Hugging Face names
  (`hotjax.models.hf`), fp32 numpy, each read when it is accessed (`LazyTensors`), so that host
  memory holds one tensor at a time; the optimizer's per-weight state by torch's names, shaped as
  the weights (`hotjax.models.optimizers`: AdamW's `exp_avg`, `exp_avg_sq`), or None for weights
  only; the optimizer's step; and the torch run's hyperparameters, recorded and never applied (the
  hotjax run keeps its own). `save_torch_state` writes it as a hotjax checkpoint that resumes on
  any strategy. A format whose tensors are not Hugging Face's (Megatron-Core's fused ones)
  builds hotjax's parameter trees itself, leaves `store.Pending`, and calls `save_trees`.
- An export opens the hotjax checkpoint with `ExportSource.of`: its model (vocabulary padding
  cut), the optimizer that wrote it (refused in one line where its state has no torch names),
  the step (None: weights only), and `arrays(field)`: each parameter (`field` "params") or each
  per-weight state field (by its torch name), restored on the host one at a time, which the
  format converts and writes before the next.
- Names: a key is matched by its longest suffix that is a parameter's name (`resolve`), so
  wrappers and prefixes need no configuration; `foreign_names` gives Hugging Face's or
  torchtitan's name of each tensor, whose Q/K rows interleave the rotary pairs (Meta's
  convention: `interleaved_to_halves` on the way in, `halves_to_interleaved` on the way out).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from hotjax import bounds
from hotjax.checkpoint import dirs, model, store
from hotjax.checkpoint import meta as meta_lib
from hotjax.errors import UserError
from hotjax.models import optimizers
from hotjax.models.hf import hf_param_makers, hf_tensor_shapes, param_keys
from hotjax.models.llama import LlamaConfig, abstract_params, param_axes
from hotjax.models.optimizers import ADAMW, DEFAULT, TORCH_SETTINGS, TORCH_STATE, Optimizer
from hotjax.optim import OptimConfig, make_optimizer

WRAPPERS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module"}
BUFFERS = ("rotary_emb.inv_freq", "freqs_cis")  # rotary tables some models persist
HEADS = ("lm_head.weight", "output.weight")  # with tied embeddings, the embedding again
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


def rotary_heads(hf_name: str, config: LlamaConfig) -> int | None:
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


def resolve(parts: list[str], names: dict[str, str],
            state_fields: tuple[str, ...] = (*TORCH_STATE, "step")
            ) -> tuple[str, str] | None:
    """(field, HF name) of a key's components, matched by its longest suffix that names a
    parameter (`names`: foreign name -> HF name); field is "weight", or one of `state_fields`
    under a `state` component. None if no suffix names a parameter."""
    field = "weight"
    if parts[-1] in state_fields and "state" in parts[:-1]:
        field, parts = parts[-1], parts[:-1]
    for start in range(len(parts)):
        name = names.get(".".join(parts[start:]))
        if name is not None:
            return field, name
    return None


def hyperparameters(values: dict[tuple[str, str], Any], names: dict[str, str],
                    where: str | Path) -> dict[str, Any]:
    """lr, the optimizer's settings (betas, eps, momentum: `TORCH_SETTINGS`), and weight decay
    of matrices and of norm scales, as the torch run's
    param_groups give them (`values`: (group, or parameter's name, field) -> value; groups
    nested or flattened per parameter), checked (`checked_hyperparameters`) as read from
    `where`."""
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
        hf_name = resolve([c for c in fqn.split(".") if c not in WRAPPERS], names)
        if hf_name is None:
            continue
        kind = "norm" if hf_name[1].endswith("norm.weight") else "matrix"
        for field in ("lr", *TORCH_SETTINGS):
            if field in group:
                out.setdefault(field, group[field])
        if "weight_decay" in group:
            out.setdefault(f"weight_decay_{kind}", group["weight_decay"])
    return checked_hyperparameters(out, where)


def checked_hyperparameters(found: dict[str, Any], where: str | Path) -> dict[str, Any]:
    """A torch run's hyperparameters as a checkpoint records them (and a resumed run's
    optimizer is built from them): lr, eps and the weight decays finite numbers, betas a pair
    of them, the clipping norm one above 0; a one-element tensor counts as its number."""
    damaged = "the checkpoint is damaged"
    out: dict[str, Any] = {}
    for field, value in found.items():
        value = _number(value)
        if field != "betas":
            out[field] = bounds.real(value, field, str(where), damaged,
                                     low=0.0 if field == "clip_norm" else -math.inf)
            continue
        if not (isinstance(value, list | tuple) and len(value) == 2):
            raise UserError(f"{where}: betas is {bounds.show(value)}, not a pair of numbers: "
                            f"{damaged}")
        out[field] = [bounds.real(_number(b), "betas", str(where), damaged, low=-math.inf)
                      for b in value]
    return out


def _number(value: Any) -> Any:
    """A one-element tensor or numpy scalar as a Python number (torch keeps lr a tensor under
    some schedulers); anything else as it is."""
    if isinstance(value, np.generic) or (hasattr(value, "numel") and hasattr(value, "item")
                                         and value.numel() == 1):
        return value.item()
    return value


# ---------------------------------------------------------------------------- import

@dataclasses.dataclass(frozen=True)
class TorchState:
    """A PyTorch run's LLaMA state, Hugging Face-named, in fp32 numpy, each tensor read when it
    is accessed."""

    naming: str  # how the checkpoint named the tensors ("hf", "torchtitan")
    weights: Mapping[str, np.ndarray]
    moments: dict[str, Mapping[str, np.ndarray]] | None  # torch state name -> HF tensors
    step: int
    hyperparameters: dict[str, Any]  # from the param groups: what the torch run used
    optimizer: Optimizer = ADAMW  # whose state `moments` holds


def optimizer_state(config: LlamaConfig, optimizer: Optimizer, moments: dict[str, Any],
                    step: int) -> Any:
    """hotjax's optimizer state (loss scaling off) holding a torch run's per-weight state
    (`moments`, by torch's names, trees shaped as the parameters) and step."""
    tx = make_optimizer(OptimConfig(name=optimizer.name), param_axes(config))
    shapes = jax.eval_shape(tx.init, abstract_params(config))
    kind = getattr(optax, optimizer.optax_state)
    count = np.asarray(step, np.int32)

    def fill(node: Any) -> Any:
        if isinstance(node, kind):
            counted = {"count": count} if "count" in node._fields else {}
            return node._replace(**counted, **{field: moments[name]
                                               for name, field in optimizer.torch})
        if isinstance(node, optax.ScaleByScheduleState):
            return optax.ScaleByScheduleState(count)
        raise AssertionError(f"unexpected optimizer state {type(node).__name__}")

    return jax.tree.map(fill, shapes, is_leaf=lambda n: isinstance(
        n, kind | optax.ScaleByScheduleState | jax.ShapeDtypeStruct))


def save_torch_state(out: str | Path, torch_state: TorchState, config: LlamaConfig, *,
                     source: str, foreign: dict[str, Any], tokenizer: Any = None) -> Path:
    """A hotjax checkpoint of a PyTorch run's state: weights, and its optimizer state and step
    if it has them; the run's hyperparameters are recorded."""
    checkpoint = foreign.get("checkpoint") or source

    def tree(tensors: Mapping[str, np.ndarray], field: str) -> Any:
        return store.pending(hf_param_makers(tensors, config, where=f"{checkpoint}: {field}"),
                             abstract_params(config))

    moments = None if torch_state.moments is None else {
        f: tree(m, f"{f} of") for f, m in torch_state.moments.items()}
    return save_trees(out, config, tree(torch_state.weights, "tensor"), moments,
                      torch_state.step, torch_state.hyperparameters, source=source,
                      foreign=foreign, tokenizer=tokenizer, optimizer=torch_state.optimizer)


def save_trees(out: str | Path, config: LlamaConfig, params: Any, moments: dict[str, Any] | None,
               step: int, hyperparameters: dict[str, Any], *, source: str,
               foreign: dict[str, Any], tokenizer: Any = None,
               optimizer: Optimizer = ADAMW) -> Path:
    """A hotjax checkpoint of a PyTorch run's parameters and, unless None, its optimizer's
    per-weight state (`moments`: torch's names -> trees shaped as `params`) and step;
    `hyperparameters` are recorded, not applied. Leaves may be `store.Pending`, made one at a
    time as written."""
    bounds.whole(step, "its step", 0, bounds.MAX_STEP, source, "the checkpoint is damaged")
    items = {store.PARAMS: params}
    record = None
    if moments is not None:
        items[store.OPT_STATE] = optimizer_state(config, optimizer, moments, step)
        record = {"name": optimizer.name, "source": optimizer.torch_class, "loss_scaling": "off",
                  **hyperparameters}
    meta = meta_lib.record(
        step=step, source=source, items=list(items), model=config.to_dict(),
        optimizer=record, tokenizer=meta_lib.tokenizer_record(tokenizer) if tokenizer else None,
        written_from={"foreign": foreign})
    return store.save_items(out, items, meta, tokenizer)


# ---------------------------------------------------------------------------- export

def _state_path(shapes: Any, name: str) -> str:
    """Where in an optimizer state tree (`shapes`) the one optax state of class `name` lies."""
    kind = getattr(optax, name)
    (path,) = [dirs.array_path(p) for p, n in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda n: isinstance(n, kind))[0] if isinstance(n, kind)]
    return path


@dataclasses.dataclass(frozen=True)
class ExportSource:
    """A checkpoint to export: its model (vocabulary padding past the recorded tokenizer's size
    left out), the optimizer settings it was written with and the optimizer's step (None:
    weights only); its arrays are restored one at a time (`arrays`), so that an export holds
    one."""

    step_dir: Path
    config: LlamaConfig
    optim: OptimConfig
    step: int | None
    _state: str | None  # where the per-weight state lies in `opt_state` (`1/0`)
    _axes: dict[str, tuple[str, ...]]  # each parameter's logical axes, by key
    _like: dict[str, dict[str, jax.ShapeDtypeStruct]]  # item -> each array's, by name

    @classmethod
    def of(cls, path: str | Path) -> ExportSource:
        step_dir = dirs.find(path)
        meta = meta_lib.read(step_dir)
        config = model.saved(meta, step_dir)
        optim = saved_optimizer(meta)
        state = step = None
        like = {store.PARAMS: store.by_name(abstract_params(config))}
        if store.OPT_STATE in meta["items"]:
            optim.optimizer.torch_names(str(step_dir))  # a torch form, or a refusal
            tx = make_optimizer(optim, param_axes(config))
            shapes = jax.eval_shape(tx.init, abstract_params(config))
            state = _state_path(shapes, optim.optimizer.optax_state)
            counter = f"{_state_path(shapes, optim.optimizer.counter)}/count"
            like[store.OPT_STATE] = store.by_name(shapes)
            ((_, count),) = store.restore_each(step_dir, store.OPT_STATE, {
                counter: like[store.OPT_STATE][counter]})
            step = int(count)
        axes = {dirs.array_path(p): a for p, a in jax.tree_util.tree_flatten_with_path(
            param_axes(config), is_leaf=lambda a: isinstance(a, tuple))[0]}
        config = dataclasses.replace(config, vocab_size=meta_lib.real_vocab(meta))
        return cls(step_dir, config, optim, step, state, axes, like)

    @property
    def state_fields(self) -> tuple[str, ...]:
        """The optimizer's per-weight state fields by torch's names (none: weights only)."""
        return () if self.step is None else self.optim.optimizer.torch_names(str(self.step_dir))

    def arrays(self, field: str) -> Iterator[tuple[str, np.ndarray]]:
        """(parameter key, array) of every parameter (`field` "params") or every parameter's
        optimizer state `field` (a torch name: "exp_avg"), each restored on the host when its
        turn comes, vocabulary trimmed."""
        item, prefix = store.PARAMS, ""
        if field != store.PARAMS:
            optax_field = dict(self.optim.optimizer.torch)[field]
            item, prefix = store.OPT_STATE, f"{self._state}/{optax_field}/"
        names = [prefix + k for k in param_keys(self.config)]
        like = self._like[item]
        for name, x in store.restore_each(self.step_dir, item, {n: like[n] for n in names}):
            key = name.removeprefix(prefix)
            yield key, store.trim(x, self._axes[key], self.config.vocab_size)


class Exported(NamedTuple):
    config: LlamaConfig
    optim: OptimConfig
    params: Any
    step: int | None  # None: weights only
    state: dict[str, Any] | None  # torch state name -> a tree shaped as `params`


def read_for_export(path: str | Path) -> Exported:
    """What an export reads of a checkpoint, whole, on the host (`ExportSource` gives it one
    array at a time)."""
    source = ExportSource.of(path)

    def tree(field: str) -> dict[str, Any]:
        out: dict[str, Any] = {"layers": {}}
        for key, x in source.arrays(field):
            (out["layers"] if key.startswith("layers/") else out)[key.removeprefix("layers/")] = x
        return out

    state = {f: tree(f) for f in source.state_fields} if source.step is not None else None
    return Exported(source.config, source.optim, tree(store.PARAMS), source.step, state)


def saved_optimizer(meta: dict[str, Any]) -> OptimConfig:
    """The optimizer settings a checkpoint was written with (and so its state's layout); an
    import's are the torch run's, at a constant learning rate."""
    saved = meta.get("optimizer") or {}
    name = saved.get("name", DEFAULT)  # written before optimizers were named: AdamW
    if saved.get("source"):  # an import
        return OptimConfig(name=name, lr=saved.get("lr", OptimConfig.lr),
                           weight_decay=saved.get("weight_decay_matrix",
                                                  OptimConfig.weight_decay),
                           warmup_steps=0, min_lr_ratio=1.0,
                           **optimizers.named(name).from_torch_group(saved))
    fields = {f.name for f in dataclasses.fields(OptimConfig)}
    return OptimConfig(**{k: v for k, v in saved.items() if k in fields})
