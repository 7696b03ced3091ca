"""The manifest of a foreign shard set: which slice of which logical tensor each rank file holds.

A TP/PP/ZeRO run writes one file per rank (`.npz`, `.safetensors`, or PyTorch `.pt`: tensors
by state-dict name, in its `model` entry if it has one). The manifest (TOML or JSON, the same
keys) describes them geometrically, after Universal Checkpointing's patterns, so that
`checkpoint.formats.foreign` can rebuild every logical tensor and map it to Hugging Face names:

    format = "hotjax-shards/1"
    model = "tiny"                 # a preset; or a table of LlamaConfig fields (with an
                                   # optional `preset` they override); or { hf_config = "x.json" }
    files = "tp{tp}_pp{pp}_dp{dp}.npz"  # one rank file, relative to the manifest; {tp} {pp}
                                   # {dp} are its coordinates, with Python format specs if
                                   # wanted ("mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt");
                                   # every axis larger than 1 appears
    step = 0                       # optional: the step recorded in the checkpoint

    [parallel]
    tp = 2                         # tensor-parallel ranks
    pp = 2                         # pipeline stages
    dp = 2                         # data-parallel ranks (ZeRO partitions of the flat buffers)
    layers_per_stage = [1, 1]      # optional; default: n_layers split evenly

    [[tensor]]                     # one logical tensor (per layer, if its name has {l})
    name = "layers.{l}.qkv"        # its name in the rank files; {l}: the layer index on the
                                   # stage, counted from 0 on every stage
    shape = [128, 64]              # the logical tensor as Hugging Face lays it out: [out, in]
    padded = [128, 64]             # optional: the padded shape the ranks split (e.g. a vocab
                                   # padded to a multiple of tp); trailing padding is stripped
    tp = "shard_nc"                # how tensor-parallel ranks hold it:
                                   #   replicate     every rank the whole tensor (checked equal)
                                   #   shard_v       split on dim 0 (column-parallel, vocab)
                                   #   shard_h       split on dim 1 (row-parallel)
                                   #   shard_nc      dim 0 is sub-parameters of `widths`, each
                                   #                 split over the ranks: rank r holds the r-th
                                   #                 slice of every one, in order (fused QKV
                                   #                 under GQA, fused gate/up)
                                   #   partial_sum   every rank a full-shape addend: summed
                                   #   partial_mean  ... averaged
    widths = [64, 32, 32]          # sub-parameter widths on dim 0; with a list `to`, also
                                   # how the tensor splits into `to` (repeated names are
                                   # concatenated in order: interleaved per-group layouts)
    stage = 0                      # non-layer tensors: the pipeline stage that owns it
                                   # (Unique; -1 is the last) or "all" (each stage a copy,
                                   # checked equal); layer tensors live on their layer's stage
    transpose = false              # true if files store it [in, out]
    to = ["model.layers.{L}.self_attn.q_proj.weight", "model.layers.{L}.self_attn.k_proj.weight",
          "model.layers.{L}.self_attn.v_proj.weight"]   # HF names; {L}: the global layer

    [[flat]]                       # a ZeRO flat buffer: on each (tp, pp) rank the local tensors
    name = "fp32_flat"             # below are flattened and concatenated, padded to a multiple
    align = 8                      # of dp * align elements, and rank dp=d holds the d-th of dp
    tensors = ["embed", "layers.{l}.qkv", "layers.{l}.o", "final_norm"]  # equal parts
                                   # order in the buffer; a run of {l} names repeats for every
                                   # local layer, layer-major; tensors a stage does not own are
                                   # left out of its buffer

Tensors not in a flat buffer are read from each rank file by name (and are the same on every
dp rank: checked). Every inconsistency found names the rank file and the tensor.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

from hotjax import bounds
from hotjax.errors import UserError

FORMAT = "hotjax-shards/1"
PATTERNS = ("replicate", "shard_v", "shard_h", "shard_nc", "partial_sum", "partial_mean")
AXES = ("tp", "pp", "dp")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    padded: tuple[int, ...]
    tp: str
    widths: tuple[int, ...] | None
    stage: int | str | None  # an owning stage, "all", or None for a layer tensor
    to: tuple[str, ...]
    transpose: bool

    @property
    def per_layer(self) -> bool:
        return "{l}" in self.name

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """The shape one tensor-parallel rank stores."""
        shape = list(self.padded)
        if self.tp == "shard_v":
            shape[0] //= tp
        elif self.tp == "shard_h":
            shape[1] //= tp
        elif self.tp == "shard_nc":
            shape[0] = sum(w // tp for w in self.widths or ())
        return tuple(reversed(shape)) if self.transpose else tuple(shape)

    def split(self) -> list[tuple[str, int]]:
        """(target name, width on dim 0) for each piece of the logical tensor."""
        if len(self.to) == 1:
            return [(self.to[0], self.shape[0])]
        return list(zip(self.to, self.widths or (), strict=True))


@dataclasses.dataclass(frozen=True)
class FlatSpec:
    name: str
    tensors: tuple[str, ...]
    align: int


@dataclasses.dataclass(frozen=True)
class Manifest:
    path: Path
    model: str | dict[str, Any]
    files: str
    sizes: dict[str, int]  # tp, pp, dp
    layers_per_stage: tuple[int, ...] | None
    step: int
    tensors: tuple[TensorSpec, ...]
    flats: tuple[FlatSpec, ...]

    def file(self, tp: int, pp: int, dp: int) -> Path:
        return self.path.parent / self.files.format(tp=tp, pp=pp, dp=dp)

    def describe(self) -> dict[str, Any]:
        return {"manifest": str(self.path), "files": self.files, **self.sizes}


def load(path: str | Path) -> Manifest:
    path = Path(path).absolute()
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: manifest not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the manifest ({e})") from None
    try:
        data = (bounds.parse_json(text, str(path), "manifest", "fix it")
                if path.suffix == ".json" else tomllib.loads(text))
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'TOML'} "
                        f"({e})") from None
    return parse(data, path)


def parse(data: dict[str, Any], path: Path) -> Manifest:
    where = str(path)
    _keys(data, {"format", "model", "files", "step", "parallel", "tensor", "flat"}, where)
    if data.get("format") != FORMAT:
        raise UserError(f"{where}: format must be {FORMAT!r}, found {data.get('format')!r}")
    model = data.get("model")
    if not isinstance(model, str | dict):
        raise UserError(f"{where}: model must be a preset name or a table of config fields")
    parallel = data.get("parallel", {})
    _keys(parallel, {*AXES, "layers_per_stage"}, f"{where}: [parallel]")
    sizes = {axis: _positive(parallel.get(axis, 1), f"{where}: parallel.{axis}") for axis in AXES}
    files = data.get("files")
    if not isinstance(files, str) or not files:
        raise UserError(f"{where}: files must be a pattern like 'tp{{tp}}_pp{{pp}}.npz'")
    used = set(re.findall(r"{(\w*)(?::[^{}]*)?}", files))
    if used - set(AXES) or any(sizes[a] > 1 and a not in used for a in AXES):
        raise UserError(f"{where}: files {files!r} must name each rank by {{tp}}, {{pp}}, {{dp}} "
                        f"(every axis larger than 1) and nothing else")
    try:
        files.format(tp=0, pp=0, dp=0)
    except (ValueError, KeyError, IndexError) as e:
        raise UserError(f"{where}: files {files!r} is not a valid pattern ({e})") from None
    if not files.endswith((".npz", ".safetensors", ".pt")):
        raise UserError(f"{where}: files {files!r}: rank files must be .npz, .safetensors or .pt")
    stages = parallel.get("layers_per_stage")
    if stages is not None and (not isinstance(stages, list) or len(stages) != sizes["pp"]):
        raise UserError(f"{where}: parallel.layers_per_stage must list {sizes['pp']} counts")
    entries = data.get("tensor")
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{where}: no [[tensor]] entries: describe every tensor of the rank files")
    tensors = tuple(_tensor(e, i, sizes, where) for i, e in enumerate(entries, 1))
    names = [t.name for t in tensors]
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise UserError(f"{where}: tensor {dup!r} is described twice")
    flats = tuple(_flat(e, i, set(names), where) for i, e in enumerate(data.get("flat", []), 1))
    listed = [n for f in flats for n in f.tensors]
    if len(set(listed)) < len(listed):
        dup = next(n for n in listed if listed.count(n) > 1)
        raise UserError(f"{where}: tensor {dup!r} is listed in flat buffers twice")
    return Manifest(path, model, files, sizes, tuple(stages) if stages else None,
                    _natural(data.get("step", 0), f"{where}: step"), tensors, flats)


def _tensor(entry: Any, i: int, sizes: dict[str, int], where: str) -> TensorSpec:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise UserError(f"{where}: tensor {i} must be a table with a name")
    where = f"{where}: tensor {entry['name']!r}"
    _keys(entry, {"name", "shape", "padded", "tp", "widths", "stage", "to", "transpose"}, where)
    shape = _shape(entry.get("shape"), f"{where}: shape")
    padded = _shape(entry.get("padded", list(shape)), f"{where}: padded")
    if len(padded) != len(shape) or any(p < s for p, s in zip(padded, shape, strict=True)):
        raise UserError(f"{where}: padded {list(padded)} must have shape's rank and be at "
                        f"least {list(shape)}")
    tp, n = entry.get("tp", "replicate"), sizes["tp"]
    if tp not in PATTERNS:
        raise UserError(f"{where}: tp {tp!r} is not a pattern: use {', '.join(PATTERNS)}")
    widths = entry.get("widths")
    if widths is not None:
        widths = tuple(_positive(w, f"{where}: widths") for w in
                       (widths if isinstance(widths, list) else [widths]))
        if sum(widths) != shape[0]:
            raise UserError(f"{where}: widths {list(widths)} sum to {sum(widths)}, not to "
                            f"shape[0] = {shape[0]}")
    dim = {"shard_v": 0, "shard_h": 1}.get(tp)
    if dim is not None and (len(padded) <= dim or padded[dim] % n):
        raise UserError(f"{where}: {tp} splits dim {dim} of {list(padded)} over tp={n}: it "
                        f"must exist and divide evenly (pad it, and give `padded`)")
    if tp == "shard_nc" and (widths is None or padded != shape or any(w % n for w in widths)):
        raise UserError(f"{where}: shard_nc needs widths that each divide by tp={n}, "
                        f"and no padding")
    to = entry.get("to")
    to = (to,) if isinstance(to, str) else tuple(to) if isinstance(to, list) else ()
    if not to or not all(isinstance(t, str) for t in to):
        raise UserError(f"{where}: to must name the Hugging Face tensor(s) it holds")
    if len(to) > 1 and (widths is None or len(widths) != len(to)):
        raise UserError(f"{where}: {len(to)} targets in `to` need as many widths")
    per_layer = "{l}" in entry["name"]
    if any(("{L}" in t) != per_layer for t in to):
        raise UserError(f"{where}: a name with {{l}} maps to names with {{L}}, and only then")
    stage = entry.get("stage")
    if per_layer and stage is not None:
        raise UserError(f"{where}: a layer tensor lives on its layer's stage: drop `stage`")
    if not per_layer:
        if stage is None and sizes["pp"] > 1:
            raise UserError(f"{where}: with pp={sizes['pp']}, give the stage that owns it "
                            f"(0..{sizes['pp'] - 1}, -1 for the last) or \"all\"")
        if stage is None:
            stage = 0
        if stage != "all" and not (isinstance(stage, int) and -sizes["pp"] <= stage
                                   < sizes["pp"]):
            raise UserError(f"{where}: stage {stage!r} is not a stage of pp={sizes['pp']} "
                            f"nor \"all\"")
        if stage != "all":
            stage %= sizes["pp"]
    transpose = entry.get("transpose", False)
    if transpose and len(shape) != 2:
        raise UserError(f"{where}: only 2-D tensors can be stored transposed")
    return TensorSpec(entry["name"], shape, padded, tp, widths, stage, to, bool(transpose))


def _flat(entry: Any, i: int, names: set[str], where: str) -> FlatSpec:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise UserError(f"{where}: flat buffer {i} must be a table with a name")
    where = f"{where}: flat {entry['name']!r}"
    _keys(entry, {"name", "tensors", "align"}, where)
    tensors = entry.get("tensors")
    if not isinstance(tensors, list) or not tensors:
        raise UserError(f"{where}: tensors must list the tensors in the buffer, in order")
    unknown = [t for t in tensors if t not in names]
    if unknown:
        raise UserError(f"{where}: lists {unknown[0]!r}, which no [[tensor]] describes")
    return FlatSpec(entry["name"], tuple(tensors),
                    _positive(entry.get("align", 1), f"{where}: align"))


def _keys(table: Any, allowed: set[str], where: str) -> None:
    if not isinstance(table, dict):
        raise UserError(f"{where}: must be a table")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}: use {', '.join(sorted(allowed))}")


def _positive(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{where}: {value!r} must be a positive integer")
    return value


def _natural(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UserError(f"{where}: {value!r} must be a non-negative integer")
    return value


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: must be a list of dimensions, like [4096, 4096]")
    return tuple(_positive(v, where) for v in value)
