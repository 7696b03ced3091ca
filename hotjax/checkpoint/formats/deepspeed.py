"""DeepSpeed checkpoints read into hotjax checkpoints, so that a DeepSpeed run resumes in hotjax
with its fp32 weights, AdamW moments and step.

In: a ZeRO checkpoint of any data-parallel size (`engine.save_checkpoint`'s directory, or one
step of it), or a universal directory (Universal Checkpointing's `ds_to_universal` output).
- ZeRO-1/2: `mp_rank_00_model_states.pt` (`param_shapes`: the names and shapes of each
  parameter group) and per rank `zero_pp_rank_{r}_mp_rank_00_optim_states.pt`: rank r's slice
  of each group's flat fp32 master weights and moments, and where each parameter's fragment lies
  in it (`param_slice_mappings`; a rank boundary can fall inside a parameter).
- ZeRO-3: per rank `zero_pp_rank_{r}_mp_rank_00_{model,optim}_states.pt`; rank r's flat
  groups hold the r-th ceil(n/R) elements of every parameter, in `param_shapes` order.
- universal: `zero/{name}/{fp32,exp_avg,exp_avg_sq[,step]}.pt`, whole tensors, and
  `zero/optimizer_state.pt` (param groups; the step under ZeRO-3's layout).
(`formats.universal` writes universal directories.)

Files are read with torch's weights-only loader (`torch_load`), memory-mapped, one parameter at
a time (a rank file is opened again for each parameter it holds a part of, so that its pages
read leave memory with the parameter); the few DeepSpeed classes they pickle are read as plain
records (`allowed.DEEPSPEED`), so DeepSpeed need not be installed.
Names are Hugging Face's, matched by suffix (`pivot.resolve`: wrappers such as `module.`
need no configuration); an import is a `pivot.TorchState`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hotjax import bounds
from hotjax.checkpoint.formats import allowed, torch_load
from hotjax.checkpoint.formats.spec import EMBEDDING, Format
from hotjax.errors import UserError
from hotjax.models.optimizers import ADAMW
from hotjax.paths import inside

if TYPE_CHECKING:
    from hotjax.checkpoint.formats.pivot import TorchState
    from hotjax.models.llama import LlamaConfig

_TAG_BYTES = 4096  # what is read of `latest`: a step directory's name ("global_step2")
MOMENTS = ADAMW.torch_names("import-deepspeed")  # the optimizer state an import reads
FIELDS = ("fp32", *MOMENTS)  # a universal parameter directory's files, besides step.pt
_OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_MODEL_FILE = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
NEEDS_TORCH = "DeepSpeed checkpoints"


def load_pt(file: Path) -> Any:
    """A DeepSpeed .pt file, tensors memory-mapped (read when touched), by torch's weights-only
    loader; DeepSpeed's own classes become `allowed`'s records."""
    if not file.is_file():
        raise UserError(f"{file}: no such file: copy the whole checkpoint directory")
    return torch_load.load(file, allowed.DEEPSPEED, what=NEEDS_TORCH,
                           refused=" ({detail}): not a DeepSpeed checkpoint file hotjax reads",
                           unreadable="unreadable ({error}): the file is truncated or damaged")


def _host(x: Any) -> np.ndarray:
    return x.detach().float().numpy()


# ---------------------------------------------------------------------------- reading

@dataclasses.dataclass(frozen=True)
class _Piece:
    """Elements [start, stop) of one rank's flat group `group`."""

    rank: int
    group: int
    start: int
    stop: int


@dataclasses.dataclass
class DeepSpeedCheckpoint:
    """What a DeepSpeed checkpoint holds, read lazily: each parameter's shape, and its fp32
    weight and AdamW moments one at a time (`tensor`)."""

    path: Path  # the step directory
    layout: str  # "ZeRO-1", "ZeRO-2", "ZeRO-3" or "universal"
    shapes: dict[str, tuple[int, ...]]  # DeepSpeed's parameter names
    step: int | None  # AdamW's; None: no optimizer state
    hyperparameters: dict[str, Any]
    dp: int  # the data-parallel size that wrote it (0: a universal directory has none)
    _pieces: dict[str, list[_Piece]] = dataclasses.field(default_factory=dict)
    _files: list[Path] = dataclasses.field(default_factory=list)  # per rank: its optimizer file
    _saved_flat: frozenset[str] = frozenset()  # universal ones saved flat (ZeRO-3's converter)

    def tensor(self, name: str, field: str) -> np.ndarray:
        """Parameter `name`'s `field` (fp32, exp_avg, exp_avg_sq), whole, fp32."""
        shape = self.shapes[name]
        if self.layout == "universal":
            file = self.path / "zero" / name / f"{field}.pt"
            loaded = load_pt(file)
            x = loaded.get("param") if isinstance(loaded, dict) else loaded
            # Read as saved, never reshaped by its element count: a transposed moment would be.
            flat = name in self._saved_flat
            saved = (math.prod(shape),) if flat else shape
            if not hasattr(x, "shape") or tuple(x.shape) != saved:
                raise UserError(f"{file}: holds {_describe(x)}, but {name} has shape "
                                f"{list(saved)}{' (flat)' if flat else ''}: the universal "
                                f"directory is damaged: rerun ds_to_universal")
            return _host(x).reshape(shape)
        # The rank files this parameter lies in, opened (memory-mapped) for it alone: pages
        # of a file kept open would stay in the process's memory once read.
        states = {r: _optimizer_state(self._files[r]) for r in {p.rank for p in self._pieces[name]}}
        parts = [_host(self._flat(states[p.rank], p.group, field)[p.start:p.stop])
                 for p in self._pieces[name]]
        return np.concatenate(parts).reshape(shape)

    def _flat(self, state: dict[str, Any], group: int, field: str) -> Any:
        if field == "fp32":
            key = "fp32_flat_groups" if self.layout == "ZeRO-3" else (
                "single_partition_of_fp32_groups")
            return state[key][group]
        return _base_state(state)["state"][group][field]


def _describe(x: Any) -> str:
    return f"a tensor of shape {list(x.shape)}" if hasattr(x, "shape") else (
        f"a {type(x).__name__}")


def _base_state(state: dict[str, Any]) -> dict[str, Any]:
    base = state.get("base_optimizer_state") or state.get("optimizer_state_dict") or {}
    return base if isinstance(base, dict) else {}


def step_directory(directory: Path) -> Path:
    """The step directory of a DeepSpeed checkpoint given as its root (its `latest` or
    `latest_universal` names the step) or as the step directory itself."""
    for latest in ("latest_universal", "latest"):
        if (directory / latest).is_file():
            with open(directory / latest, "rb") as f:  # a tag: a short name
                tag = f.read(_TAG_BYTES).decode(errors="replace").strip()
            step = inside(directory, tag, directory / latest)
            if not step.is_dir():
                raise UserError(f"{directory / latest}: names step {tag!r}, which "
                                f"{directory} lacks: copy the whole checkpoint directory")
            return step
    return directory


def read_deepspeed(directory: str | Path) -> DeepSpeedCheckpoint:
    """The checkpoint in `directory` (a ZeRO checkpoint or a universal directory), checked to
    be complete and consistent before any tensor is read."""
    directory = step_directory(Path(directory).absolute())
    if not directory.is_dir():
        raise UserError(f"{directory}: no such directory")
    _refuse_unsupported(directory)
    if (directory / "zero").is_dir():
        return _read_universal(directory)
    model_files = {m.group(1): f for f in sorted(directory.iterdir())
                   if (m := _MODEL_FILE.fullmatch(f.name))}
    if not model_files:
        raise UserError(f"{directory}: holds no mp_rank_00_model_states.pt, "
                        f"zero_pp_rank_0_mp_rank_00_model_states.pt or zero/ directory: not a "
                        f"DeepSpeed checkpoint (pass the directory save_checkpoint wrote, or one "
                        f"step of it)")
    zero3 = None not in model_files
    first = directory / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if zero3
                         else "mp_rank_00_model_states.pt")
    model = load_pt(first)
    if not isinstance(model, dict) or "param_shapes" not in model:
        raise UserError(f"{first}: holds no param_shapes: not a model-states file of "
                        f"DeepSpeed's ZeRO")
    dp = int(model.get("dp_world_size") or 1)
    groups = model["param_shapes"]
    groups = groups if isinstance(groups, list) else [groups]
    shapes = {n: tuple(int(d) for d in s) for g in groups for n, s in g.items()}
    files = _optim_files(directory, dp, first)
    if zero3:
        for r in range(dp):
            name = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
            if not (directory / name).is_file():
                raise UserError(f"{directory / name}: missing, though {first} records "
                                f"dp_world_size {dp}: copy every rank's files")
    states = [_optimizer_state(f) for f in files]
    stage = int(states[0].get("zero_stage", 3 if zero3 else 1))
    if zero3 != (stage == 3):
        raise UserError(f"{files[0]}: a ZeRO-{stage} optimizer file beside "
                        f"{first.name}: the files come from different runs")
    pieces = (_zero3_pieces if zero3 else _zero12_pieces)(groups, states, files, dp, first)
    return DeepSpeedCheckpoint(directory, f"ZeRO-{stage}", shapes, _step(states, files),
                               _hyperparameters(states[0], groups, files[0]), dp, pieces,
                               files)


def _refuse_unsupported(directory: Path) -> None:
    """One-line errors for what hotjax does not read: pipeline- or tensor-parallel DeepSpeed,
    mixture of experts."""
    for file in sorted(directory.iterdir()):
        if re.fullmatch(r"layer_\d+-model_\d+-model_states\.pt|layer_\d+-model_states\.pt",
                        file.name):
            raise UserError(f"{file}: a pipeline-parallel DeepSpeed checkpoint (PipelineModule "
                            f"layer files), which hotjax does not read: save it again from a run "
                            f"without pipeline parallelism")
        if "expert" in file.name and file.name.endswith(".pt"):
            raise UserError(f"{file}: a mixture-of-experts DeepSpeed checkpoint, which hotjax "
                            f"does not read: hotjax trains dense LLaMA models")
        m = _MODEL_FILE.fullmatch(file.name) or _OPTIM_FILE.fullmatch(file.name)
        if m and int(m.group(2)) > 0:
            raise UserError(f"{file}: a tensor-parallel DeepSpeed checkpoint (model-parallel "
                            f"rank {int(m.group(2))}), which hotjax does not read: merge it "
                            f"with ds_to_universal and import the universal directory")


def _optim_files(directory: Path, dp: int, model_file: Path) -> list[Path]:
    found = {int(m.group(1)): f for f in directory.iterdir()
             if (m := _OPTIM_FILE.fullmatch(f.name))}
    if not found:
        raise UserError(f"{directory}: holds no zero_pp_rank_*_optim_states.pt: a ZeRO "
                        f"checkpoint saved without its optimizer (or not ZeRO), which hotjax "
                        f"does not read: save with ZeRO stage 1, 2 or 3")
    missing = next((r for r in range(dp) if r not in found), None)
    if missing is not None:
        name = re.sub(r"rank_\d+_mp", f"rank_{missing}_mp", found[min(found)].name)
        raise UserError(f"{directory / name}: missing, though {model_file.name} records "
                        f"dp_world_size {dp}: copy every rank's files")
    extra = max(found)
    if extra >= dp:
        raise UserError(f"{found[extra]}: data-parallel rank {extra}, but {model_file} records "
                        f"dp_world_size {dp}: the directory mixes files of runs of different "
                        f"sizes; keep one run's files")
    return [found[r] for r in range(dp)]


def _optimizer_state(file: Path) -> dict[str, Any]:
    loaded = load_pt(file)
    state = loaded.get("optimizer_state_dict") if isinstance(loaded, dict) else None
    if not isinstance(state, dict):
        raise UserError(f"{file}: holds no optimizer_state_dict: not a ZeRO optimizer file")
    return state


def _partitions(state: dict[str, Any], file: Path, dp: int) -> None:
    counts = state.get("partition_count", dp)
    for count in counts if isinstance(counts, list) else [counts]:
        if int(count) != dp:
            raise UserError(f"{file}: partitioned over {int(count)} ranks, but the model-states "
                            f"file records dp_world_size {dp}: the files come from different "
                            f"runs; keep one run's files")


def _zero12_pieces(groups: list[dict], states: list[dict], files: list[Path], dp: int,
                   model_file: Path) -> dict[str, list[_Piece]]:
    """Each parameter's fragments, rank by rank, from every rank's `param_slice_mappings`."""
    pieces: dict[str, list[_Piece]] = {n: [] for g in groups for n in g}
    for rank, (state, file) in enumerate(zip(states, files, strict=True)):
        _partitions(state, file, dp)
        mappings = state.get("param_slice_mappings")
        flats = state.get("single_partition_of_fp32_groups")
        if mappings is None or flats is None or len(mappings) != len(groups):
            raise UserError(f"{file}: holds {len(mappings or [])} parameter groups' slices, but "
                            f"{model_file} has {len(groups)}: the files come from different runs")
        for g, mapping in enumerate(mappings):
            for name, address in mapping.items():
                if name not in pieces:
                    raise UserError(f"{file}: holds a slice of {name}, which {model_file}'s "
                                    f"param_shapes lacks: the files come from different runs")
                stop = address.start + address.numel
                if stop > flats[g].numel():
                    raise UserError(f"{file}: {name}'s slice ends at {stop}, past its flat "
                                    f"group's {flats[g].numel()} elements: the file is damaged")
                pieces[name].append(_Piece(rank, g, address.start, stop))
    for g in groups:
        for name, shape in g.items():
            held = sum(p.stop - p.start for p in pieces[name])
            if held != math.prod(shape):
                raise UserError(f"{files[0].parent}: the ranks' slices of {name} hold {held} "
                                f"elements, but param_shapes gives it {list(shape)}: a rank file "
                                f"comes from another run or the checkpoint is damaged")
    return pieces


def _zero3_pieces(groups: list[dict], states: list[dict], files: list[Path], dp: int,
                  model_file: Path) -> dict[str, list[_Piece]]:
    """Each parameter's partitions: rank r's flat groups hold the r-th ceil(n/dp) elements of
    every parameter in `param_shapes` order (the last partition zero-padded)."""
    sizes = [[int(x.numel()) for x in s.get("fp32_flat_groups") or []] for s in states]
    for state, file in zip(states, files, strict=True):
        _partitions(state, file, dp)
    per_rank = [sum(s) for s in sizes]
    need = sum(math.ceil(math.prod(shape) / dp) for g in groups for shape in g.values())
    for rank, (have, file) in enumerate(zip(per_rank, files, strict=True)):
        if have != need or sizes[rank] != sizes[0]:
            raise UserError(f"{file}: its flat groups hold {have} elements, but {model_file}'s "
                            f"param_shapes over dp_world_size {dp} need {need} per rank: the "
                            f"files come from different runs or the checkpoint is damaged")
    bounds = np.cumsum([0, *sizes[0]])
    pieces: dict[str, list[_Piece]] = {}
    offset = 0
    for g in groups:
        for name, shape in g.items():
            numel = math.prod(shape)
            part = math.ceil(numel / dp)
            group = int(np.searchsorted(bounds, offset, side="right")) - 1
            start = offset - int(bounds[group])
            pieces[name] = [_Piece(r, group, start, start + min(part, numel - r * part))
                            for r in range(dp) if numel - r * part > 0]
            offset += part
    return pieces


def _step(states: list[dict], files: list[Path]) -> int | None:
    """AdamW's step, the same in every group of every rank; None without AdamW moments."""
    steps = {}
    for state, file in zip(states, files, strict=True):
        for group, entry in (_base_state(state).get("state") or {}).items():
            if not all(k in entry for k in (*MOMENTS, "step")):
                return None
            steps[file, group] = _step_number(entry["step"], file, group)
    if not steps:
        return None
    (first, s0), *rest = steps.items()
    odd = next(((k, s) for k, s in rest if s != s0), None)
    if odd is not None:
        raise UserError(f"{odd[0][0]}: group {odd[0][1]} is at AdamW step {odd[1]:g} but "
                        f"{first[0].name}'s group {first[1]} at {s0:g}: the files come from "
                        f"different steps")
    return int(s0)


def _step_number(value: Any, file: Path, group: Any) -> float:
    """A group's AdamW step (a number or a one-element tensor), a whole number in range."""
    try:
        step = float(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):  # a tensor of several
        step = math.nan
    if not (math.isfinite(step) and step == int(step) and 0 <= step <= bounds.MAX_STEP):
        raise UserError(f"{file}: group {bounds.show(group)}'s AdamW step is "
                        f"{bounds.show(value)}, not a whole number from 0 to {bounds.MAX_STEP:,}: "
                        f"the checkpoint is damaged")
    return step


def _hyperparameters(state: dict[str, Any], groups: list[dict], where: Path) -> dict[str, Any]:
    """lr, betas, eps and the clipping norm; and, where the groups' parameters are known
    (group g holds param_shapes' group g), the weight decay of matrices and of norm scales;
    checked as read from `where` (`pivot.checked_hyperparameters`)."""
    from hotjax.checkpoint.formats import pivot

    values: dict[tuple[str, str], Any] = {}
    found = _base_state(state).get("param_groups") or state.get("param_groups") or []
    param_groups = [g if isinstance(g, dict) else {} for g in found] if isinstance(
        found, list | tuple) else []
    for g, group in enumerate(param_groups):
        for field in ("lr", "betas", "eps", "weight_decay"):
            if field in group:
                values[str(g), field] = group[field]
        values[str(g), "params"] = list(groups[g]) if g < len(groups) else []
    out = pivot.hyperparameters(values, {n: n for g in groups for n in g}, where)
    if not groups and param_groups:  # a universal directory's groups name no parameters
        out.update({f: param_groups[0][f] for f in ("lr", "eps", "betas")
                    if f in param_groups[0]})
    clip = state.get("clip_grad")
    if clip is not None and not (isinstance(clip, int | float) and clip == 0):  # 0: no clipping
        out["clip_norm"] = clip
    return pivot.checked_hyperparameters(out, where)


def _read_universal(directory: Path) -> DeepSpeedCheckpoint:
    zero = directory / "zero"
    names = sorted(p.name for p in zero.iterdir() if p.is_dir())
    if not names:
        raise UserError(f"{zero}: holds no parameter directories: the universal directory is "
                        f"empty or damaged")
    with_state = [n for n in names if any((zero / n / f"{f}.pt").is_file() for f in MOMENTS)]
    need = FIELDS if with_state else FIELDS[:1]
    for name in names:
        lacking = [f for f in need if not (zero / name / f"{f}.pt").is_file()]
        if lacking:
            why = " (others hold AdamW moments)" if with_state else ""
            raise UserError(f"{zero / name}: lacks {lacking[0]}.pt, which every parameter of "
                            f"this universal checkpoint needs{why}: rerun ds_to_universal, or "
                            f"copy the whole directory")
    # ZeRO-3's converter writes flat tensors: their shapes are in the model-states files it
    # copies beside zero/.
    recorded = {}
    model_file = next((f for f in sorted(directory.glob("*model_states.pt"))
                       if _MODEL_FILE.fullmatch(f.name)), None)
    if model_file is not None:
        groups = load_pt(model_file).get("param_shapes") or []
        recorded = {n: tuple(int(d) for d in s) for g in groups for n, s in g.items()}
    shapes, flat = {}, set()
    for name in names:
        x = load_pt(zero / name / "fp32.pt")
        x = x.get("param") if isinstance(x, dict) else x
        if not hasattr(x, "shape"):
            raise UserError(f"{zero / name / 'fp32.pt'}: holds {_describe(x)}, not a tensor: "
                            f"the universal directory is damaged")
        shape = tuple(x.shape)
        shapes[name] = recorded.get(name, shape) if len(shape) == 1 else shape
        if shapes[name] != shape:
            flat.add(name)
    optimizer = {}
    if (zero / "optimizer_state.pt").is_file():
        optimizer = load_pt(zero / "optimizer_state.pt")
        if not isinstance(optimizer, dict):
            raise UserError(f"{zero / 'optimizer_state.pt'}: holds {_describe(optimizer)}, not "
                            f"DeepSpeed's optimizer state: the universal directory is damaged")
    step = _universal_step(zero, names, optimizer) if with_state else None
    return DeepSpeedCheckpoint(directory, "universal", shapes, step,
                               _hyperparameters(optimizer, [], zero / "optimizer_state.pt"), 0,
                               _saved_flat=frozenset(flat))


def _universal_step(zero: Path, names: list[str], optimizer: dict[str, Any]) -> int:
    """The step of each parameter's step.pt (ZeRO-1/2's converter writes them), or else the
    one ZeRO-3's optimizer_state.pt holds."""
    steps = {n: float(load_pt(zero / n / "step.pt")) for n in names
             if (zero / n / "step.pt").is_file()}
    if steps:
        first, s0 = next(iter(steps.items()))
        missing = next((n for n in names if n not in steps), None)
        if missing is not None:
            raise UserError(f"{zero / missing}: lacks step.pt, which {zero / first} has: copy "
                            f"the whole universal directory")
        odd = next((n for n, s in steps.items() if s != s0), None)
        if odd is not None:
            raise UserError(f"{zero / odd / 'step.pt'}: step {steps[odd]:g}, but "
                            f"{zero / first / 'step.pt'} holds {s0:g}: AdamW steps must agree")
        return int(s0)
    state = (optimizer.get("optimizer_state_dict") or {}).get("state") or {}
    first = next(iter(state.values()), {})
    if "step" not in first:
        raise UserError(f"{zero}: its parameters hold AdamW moments but no step (no step.pt, "
                        f"and no step in optimizer_state.pt): copy the whole universal directory")
    return int(float(first["step"]))


# ---------------------------------------------------------------------------- import

def embedding_rows(directory: str | Path) -> int:
    """The vocabulary size of a DeepSpeed checkpoint, read from its embedding's shape."""
    checkpoint = read_deepspeed(directory)
    for name, shape in checkpoint.shapes.items():
        if name.endswith("embed_tokens.weight") and shape:
            return int(shape[0])
    raise UserError(f"{checkpoint.path}: holds no embed_tokens.weight: not a Hugging Face "
                    f"LLaMA checkpoint")


def read_state(checkpoint: DeepSpeedCheckpoint, config: LlamaConfig) -> TorchState:
    """The checkpoint's weights and AdamW state under Hugging Face names, checked against
    `config`."""
    from hotjax.checkpoint.formats import pivot
    from hotjax.models.hf import LazyTensors, hf_tensor_shapes

    names = pivot.foreign_names(config, "hf")
    expected = hf_tensor_shapes(config)
    found: dict[str, str] = {}  # HF name -> DeepSpeed name
    for name, shape in checkpoint.shapes.items():
        parts = [c for c in name.split(".") if c not in ("module", "_orig_mod")]
        resolved = pivot.resolve(parts, {n: n for n in names})
        where = checkpoint.path / "zero" / name if checkpoint.layout == "universal" else (
            checkpoint.path)
        if resolved is None:
            if not name.endswith(pivot.BUFFERS) and not (
                    config.tie_embeddings and name.endswith(pivot.HEADS)):
                raise UserError(f"{where}: holds parameter {name}, which a LLaMA of this config "
                                f"lacks: pass the --config the run trained")
            continue
        hf_name = resolved[1]
        if shape != expected[hf_name]:
            raise UserError(f"{where}: parameter {name} has shape {list(shape or [])}, but the "
                            f"model needs {list(expected[hf_name])}: pass the --config the run "
                            f"trained")
        found[hf_name] = name
    missing = [n for n in expected if n not in found]
    if missing:
        raise UserError(f"{checkpoint.path}: lacks parameter {missing[0]}"
                        f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}: not a "
                        f"checkpoint of this model (pass its --config)")

    def read(field: str) -> LazyTensors:  # each tensor when the import writes it
        return LazyTensors(expected, lambda hf: checkpoint.tensor(found[hf], field))

    moments = None if checkpoint.step is None else {f: read(f) for f in MOMENTS}
    return pivot.TorchState("hf", read("fp32"), moments, checkpoint.step or 0,
                      checkpoint.hyperparameters)


def import_deepspeed(directory: str | Path, out: str | Path, config: LlamaConfig, *,
                     tokenizer: Any = None) -> Path:
    """A hotjax checkpoint of a DeepSpeed checkpoint: its fp32 master weights, AdamW moments
    and step, so that training resumes there on any strategy."""
    from hotjax.checkpoint import dirs
    from hotjax.checkpoint.formats import pivot

    dirs.check_new_directory(out)
    checkpoint = read_deepspeed(directory)
    state = read_state(checkpoint, config)
    return pivot.save_torch_state(
        out, state, config, source=f"import-deepspeed {checkpoint.path}",
        foreign={"format": f"deepspeed {checkpoint.layout}", "naming": "hf",
                 "data_parallel": checkpoint.dp or None, "checkpoint": str(checkpoint.path)},
        tokenizer=tokenizer)


FORMAT = Format(
    "deepspeed", imports=import_deepspeed, import_help="a DeepSpeed checkpoint (ZeRO-1/2/3 rank "
    "files of any data-parallel size, or a universal directory) to a checkpoint that resumes its "
    "training: fp32 weights, AdamW moments and step",
    source_help="the directory engine.save_checkpoint wrote (or one step of it), or "
    "ds_to_universal's output",
    model=EMBEDDING, model_help="config.json beside the checkpoint", rows=embedding_rows)
