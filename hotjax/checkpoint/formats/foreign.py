"""Import of foreign shard sets: per-rank files of a TP/PP/ZeRO run (`.npz`, `.safetensors` or
PyTorch `.pt`), described by a manifest (format: `checkpoint.manifest`; `formats.megatron`
derives one), rebuilt into logical tensors and written as a checkpoint (`formats.shards`).

The parent reads only the files' headers, checks them against the manifest and plans one task
per logical tensor (per layer); worker processes read the slices, reassemble and cross-check
them, and return Hugging Face-named tensors, from which `hotjax.models.hf.hf_param_makers` makes
each parameter as the checkpoint writes it: the workers convert the tensors in the order the
parameters need them, a few ahead, so that the parent holds a few tensors at a time, not the
checkpoint. Workers import neither JAX nor Orbax. Every inconsistency names the rank
file and the tensor.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
import os
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from hotjax.checkpoint.formats import allowed, torch_load
from hotjax.checkpoint.manifest import Manifest, TensorSpec
from hotjax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of a tensor in a rank file (the whole tensor if start is None)."""

    file: str
    tensor: str
    start: int | None = None
    stop: int | None = None


@dataclasses.dataclass(frozen=True)
class Location:
    """One rank's copy of a local tensor: segments read, concatenated and reshaped."""

    label: str  # the local tensor's name, e.g. layers.0.qkv
    segments: tuple[Segment, ...]
    shape: tuple[int, ...]

    def __str__(self) -> str:
        first = self.segments[0]
        inside = f" (in flat buffer {first.tensor})" if first.start is not None else ""
        return f"{first.file}: tensor {self.label}{inside}"


@dataclasses.dataclass(frozen=True)
class Task:
    """One logical tensor: each tensor-parallel rank's copies (the first is read, the others
    compared with it), and the HF tensors it becomes."""

    spec: TensorSpec
    label: str
    to: tuple[str, ...]
    ranks: tuple[tuple[Location, ...], ...]
    nbytes: int


# ---------------------------------------------------------------------------- rank files

_open: dict[str, Any] = {}  # per process: path -> an open safetensors handle, zip file or .pt


def _headers(file: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each tensor's shape and dtype, read from the file's header alone (a .pt file's pickle,
    its tensors memory-mapped, not read)."""
    if not file.is_file():
        raise UserError(f"{file}: rank file not found (the manifest's `files` names it)")
    try:
        if file.suffix == ".pt":
            return {n: (tuple(x.shape), _torch_dtype(x.dtype))
                    for n, x in pt_tensors(file).items()}
        if file.suffix == ".safetensors":
            with safe_open(file, framework="numpy") as f:
                return {n: (tuple(f.get_slice(n).get_shape()),
                            _st_dtype(f.get_slice(n).get_dtype())) for n in f.keys()}  # noqa: SIM118
        with zipfile.ZipFile(file) as z:
            out = {}
            for member in z.namelist():
                with z.open(member) as f:
                    shape, dtype, _ = _npy_header(f)
                out[member.removesuffix(".npy")] = (shape, dtype)
            return out
    except (SafetensorError, zipfile.BadZipFile, ValueError, OSError) as e:
        raise UserError(f"{file}: not a readable {file.suffix} file ({e})") from None


def _st_dtype(name: str) -> np.dtype:
    import ml_dtypes  # numpy has no bfloat16

    return np.dtype({"F64": np.float64, "F32": np.float32, "F16": np.float16,
                     "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32,
                     "I16": np.int16, "I8": np.int8, "U8": np.uint8}[name])


def pt_file(file: str | Path) -> Any:
    """A PyTorch file's top-level object, cached per process, tensors memory-mapped. Loaded
    with torch's weights-only unpickler, which besides tensors and plain containers may build
    only Megatron's `args` (an argparse.Namespace) and the numpy arrays of its saved RNG
    state."""
    key = str(file)
    if key in _open:
        return _open[key]
    loaded = torch_load.load(
        Path(file), allowed.MEGATRON_RANK_FILE, what=".pt files",
        refused=": {detail} (hotjax loads tensors, plain containers, numpy arrays and "
        "argparse.Namespace only)", unreadable="not a readable .pt file ({error})")
    return _open.setdefault(key, loaded)


def pt_tensors(file: str | Path) -> dict[str, Any]:
    """A .pt file's tensors by state-dict name: its `model` entry (Megatron's layout), or its
    top level if that is the state dict; other entries (`_extra_state` and the like) skipped."""
    import torch

    loaded = pt_file(file)
    state = loaded.get("model") if isinstance(loaded, dict) else None
    state = state if isinstance(state, dict) else loaded
    if not isinstance(state, dict):
        raise UserError(f"{file}: holds a {type(state).__name__}, not a state dict of tensors")
    return {n: x for n, x in state.items() if isinstance(n, str) and isinstance(x, torch.Tensor)}


def _torch_dtype(dtype: Any) -> np.dtype:
    import torch

    return _numpy(torch.empty(0, dtype=dtype)).dtype


def _numpy(x: Any) -> np.ndarray:
    """A torch tensor's data as numpy (sharing memory); bfloat16 as ml_dtypes'."""
    import torch

    if x.dtype == torch.bfloat16:
        import ml_dtypes

        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def _npy_header(f: Any) -> tuple[tuple[int, ...], np.dtype, bool]:
    version = np.lib.format.read_magic(f)
    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
            else np.lib.format.read_array_header_2_0)
    shape, fortran, dtype = read(f)
    return tuple(shape), dtype, fortran


def _read(segment: Segment) -> np.ndarray:
    file = segment.file
    try:
        if file.endswith(".pt"):
            x = pt_tensors(file)[segment.tensor]
            return _numpy(x if segment.start is None else x.reshape(-1)[segment.start:segment.stop])
        if file.endswith(".safetensors"):
            handle = _open.get(file) or _open.setdefault(file, safe_open(file, framework="numpy"))
            if segment.start is None:
                return handle.get_tensor(segment.tensor)
            return handle.get_slice(segment.tensor)[segment.start:segment.stop]
        archive = _open.get(file) or _open.setdefault(file, zipfile.ZipFile(file))
        with archive.open(segment.tensor + ".npy") as f:
            shape, dtype, fortran = _npy_header(f)
            if segment.start is None:
                count = math.prod(shape)
                data = np.frombuffer(f.read(count * dtype.itemsize), dtype, count)
                return data.reshape(shape, order="F" if fortran else "C")
            f.seek(segment.start * dtype.itemsize, os.SEEK_CUR)
            count = segment.stop - segment.start
            return np.frombuffer(f.read(count * dtype.itemsize), dtype, count)
    except (SafetensorError, zipfile.BadZipFile, ValueError, OSError, KeyError) as e:
        raise UserError(f"{file}: tensor {segment.tensor}: unreadable ({e})") from None


def _read_location(location: Location) -> np.ndarray:
    parts = [_read(s) for s in location.segments]
    data = parts[0] if len(parts) == 1 else np.concatenate(parts)
    if data.size != math.prod(location.shape):
        raise UserError(f"{location}: holds {data.size} elements, the manifest implies "
                        f"{location.shape}")
    return data.reshape(location.shape)


# ---------------------------------------------------------------------------- planning

def plan(manifest: Manifest, n_layers: int, hf_shapes: dict[str, tuple[int, ...]]) -> list[Task]:
    """Every task of the import, checked against the rank files' headers and the model."""
    tp, pp, dp = (manifest.sizes[a] for a in ("tp", "pp", "dp"))
    per_stage = manifest.layers_per_stage or ((n_layers // pp,) * pp if n_layers % pp == 0
                                              else None)
    if per_stage is None or sum(per_stage) != n_layers:
        raise UserError(f"{manifest.path}: {n_layers} layers do not split over pp={pp} as "
                        f"given: set parallel.layers_per_stage")
    first_layer = [sum(per_stage[:s]) for s in range(pp)]
    _check_targets(manifest, n_layers, hf_shapes)
    files = {(t, s, d): manifest.file(t, s, d)
             for t in range(tp) for s in range(pp) for d in range(dp)}
    headers = {str(file): _headers(file) for file in files.values()}
    flat = _flat_locations(manifest, per_stage, files, headers)

    def location(spec: TensorSpec, t: int, s: int, d: int, local: str) -> Location:
        if (t, s, local) in flat:
            return flat[(t, s, local)]
        file, shape = files[(t, s, d)], spec.local_shape(tp)
        found = headers[str(file)].get(local)
        if found is None:
            raise UserError(f"{file}: lacks tensor {local}, which the manifest places on rank "
                            f"tp={t} pp={s} dp={d}")
        if found[0] != shape:
            raise UserError(f"{file}: tensor {local} has shape {found[0]}, but the manifest "
                            f"implies {shape} ({spec.tp} of {list(spec.padded)} over tp={tp})")
        return Location(local, (Segment(str(file), local),), shape)

    tasks = []
    for spec in manifest.tensors:
        # (stages holding it, its name in their files, its global layer)
        if spec.per_layer:
            instances = [([s], spec.name.replace("{l}", str(layer)), first_layer[s] + layer)
                         for s in range(pp) for layer in range(per_stage[s])]
        else:
            instances = [(list(range(pp)) if spec.stage == "all" else [spec.stage], spec.name,
                          None)]
        for stages, local, layer in instances:
            ranks = tuple(tuple(location(spec, t, s, d, local) for s in stages
                                for d in ([0] if (t, s, local) in flat else range(dp)))
                          for t in range(tp))
            first = ranks[0][0].segments[0]
            itemsize = headers[first.file][first.tensor][1].itemsize
            tasks.append(Task(spec, local if layer is None else f"{local} (layer {layer})",
                              tuple(name.replace("{L}", str(layer)) for name in spec.to),
                              ranks, math.prod(spec.padded) * itemsize))
    return tasks


def _check_targets(manifest: Manifest, n_layers: int,
                   hf_shapes: dict[str, tuple[int, ...]]) -> None:
    """Every HF tensor of the model comes from exactly one manifest tensor, at its shape."""
    made: dict[str, str] = {}
    for spec in manifest.tensors:
        widths: dict[str, int] = {}
        for name, width in spec.split():
            widths[name] = widths.get(name, 0) + width
        for layer in range(n_layers) if spec.per_layer else [None]:
            for name, width in widths.items():
                target = name.replace("{L}", str(layer))
                where = f"{manifest.path}: tensor {spec.name!r}"
                if target in made and made[target] != spec.name:
                    raise UserError(f"{where}: maps to {target}, as tensor {made[target]!r} "
                                    f"does: each target must come from one tensor")
                made[target] = spec.name
                if target not in hf_shapes:
                    raise UserError(f"{where}: maps to {target}, which the model lacks")
                shape = (width, *spec.shape[1:])
                if shape != hf_shapes[target]:
                    raise UserError(f"{where}: gives {target} the shape {shape}, but the model "
                                    f"needs {hf_shapes[target]}: fix its shape or widths")
    missing = [name for name in hf_shapes if name not in made]
    if missing:
        raise UserError(f"{manifest.path}: no tensor maps to {', '.join(missing[:3])}"
                        f"{' ...' if len(missing) > 3 else ''}: describe every model tensor")


def _flat_locations(manifest: Manifest, per_stage: Sequence[int], files: dict,
                    headers: dict) -> dict[tuple[int, int, str], Location]:
    """Where each local tensor of each (tp, pp) rank sits in the ZeRO flat buffers."""
    tp, pp, dp = (manifest.sizes[a] for a in ("tp", "pp", "dp"))
    specs = {spec.name: spec for spec in manifest.tensors}
    out = {}
    for flat in manifest.flats:
        for t in range(tp):
            for s in range(pp):
                parts = []
                for d in range(dp):
                    found = headers[str(files[(t, s, d)])].get(flat.name)
                    if found is None or len(found[0]) != 1:
                        what = "lacks" if found is None else "has a non-1-D"
                        raise UserError(f"{files[(t, s, d)]}: {what} flat buffer {flat.name}")
                    parts.append(found[0][0])
                odd = next((d for d in range(dp) if parts[d] != parts[0]), None)
                if odd is not None:
                    raise UserError(f"{files[(t, s, odd)]}: flat buffer {flat.name} holds "
                                    f"{parts[odd]} elements but {files[(t, s, 0)]} holds "
                                    f"{parts[0]}: ZeRO partitions must be equal")
                order = [(local, specs[name].local_shape(tp))
                         for local, name in _flat_order(flat.tensors, specs, s, per_stage[s])]
                needed, total = sum(math.prod(shape) for _, shape in order), parts[0] * dp
                if not needed <= total < needed + dp * flat.align:
                    raise UserError(f"{files[(t, s, 0)]}: flat buffer {flat.name} holds "
                                    f"{total} elements over dp={dp}, but its tensors need "
                                    f"{needed} plus under {dp * flat.align} of padding: the "
                                    f"manifest's tensor list or shapes do not match the file")
                offset = 0
                for local, shape in order:
                    size = math.prod(shape)
                    segments = _segments(files, t, s, parts[0], flat.name, offset, size)
                    out[(t, s, local)] = Location(local, segments, shape)
                    offset += size
    return out


def _flat_order(names: Sequence[str], specs: dict[str, TensorSpec], stage: int,
                layers: int) -> list[tuple[str, str]]:
    """(local name, manifest name) of one stage's buffer, in order: each run of {l} names
    repeated layer-major, tensors of other stages left out."""
    order: list[tuple[str, str]] = []
    run: list[str] = []
    for name in [*names, ""]:
        if "{l}" in name:
            run.append(name)
            continue
        order += [(n.replace("{l}", str(layer)), n) for layer in range(layers) for n in run]
        run = []
        if name and specs[name].stage in ("all", stage):
            order.append((name, name))
    return order


def _segments(files: dict, t: int, s: int, part: int, name: str, offset: int,
              size: int) -> tuple[Segment, ...]:
    segments, position, end = [], offset, offset + size
    while position < end:
        d = position // part
        stop = min(end, (d + 1) * part)
        segments.append(Segment(str(files[(t, s, d)]), name, position - d * part,
                                stop - d * part))
        position = stop
    return tuple(segments)


# ---------------------------------------------------------------------------- conversion

def convert(task: Task, target: str) -> np.ndarray:
    """HF tensor `target` of one logical tensor, rebuilt from its ranks, in memory of its own:
    the rank files read are closed (a memory-mapped file's pages that were read stay resident
    while it is open)."""
    try:
        x = _rebuild(task, target)
        return np.ascontiguousarray(x) if x.flags.owndata else np.array(x, order="C")
    finally:
        for handle in _open.values():
            if isinstance(handle, zipfile.ZipFile):
                handle.close()
        _open.clear()


def _rebuild(task: Task, target: str) -> np.ndarray:
    spec = task.spec
    pieces = []
    for copies in task.ranks:
        first = _read_location(copies[0])
        for other in copies[1:]:
            if not np.array_equal(_read_location(other), first, equal_nan=True):
                raise UserError(f"{other} differs from its copy in {copies[0].segments[0].file},"
                                f" though the manifest says they are replicas")
        if pieces and first.dtype != pieces[0].dtype:
            raise UserError(f"{copies[0]} is {first.dtype}, but tp rank 0's copy in "
                            f"{task.ranks[0][0].segments[0].file} is {pieces[0].dtype}")
        pieces.append(first.T if spec.transpose else first)
    whole = _merge(spec, pieces, task)
    whole = whole[tuple(slice(0, n) for n in spec.shape)]  # strip padding
    parts, start = [], 0
    for (_, width), to in zip(spec.split(), task.to, strict=True):
        if to == target:
            parts.append(whole[start:start + width])
        start += width
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def _merge(spec: TensorSpec, pieces: list[np.ndarray], task: Task) -> np.ndarray:
    if spec.tp == "shard_v":
        return np.concatenate(pieces, axis=0)
    if spec.tp == "shard_h":
        return np.concatenate(pieces, axis=1)
    if spec.tp == "shard_nc":
        n = len(pieces)
        subs, start = [], 0
        for width in spec.widths or ():
            subs += [p[start:start + width // n] for p in pieces]
            start += width // n
        return np.concatenate(subs, axis=0)
    if spec.tp == "replicate":
        for t, piece in enumerate(pieces[1:], 1):
            if not np.array_equal(piece, pieces[0], equal_nan=True):
                raise UserError(f"{task.ranks[t][0]} differs from tp rank 0's copy in "
                                f"{task.ranks[0][0].segments[0].file}, though the manifest says "
                                f"tp replicates it")
        return pieces[0]
    total = np.sum(np.stack(pieces), axis=0, dtype=pieces[0].dtype)
    return total if spec.tp == "partial_sum" else total / np.asarray(len(pieces), total.dtype)


class Converted:
    """The Hugging Face-named tensors of `tasks`, each converted when it is read (`read`), from
    its task's rank files, and not kept: so an import holds a few tensors, not the checkpoint.
    (A task's other tensors, the K and V of a fused QKV, are rebuilt when they are read rather
    than kept until then: the parameters are written one after another, so that they would
    wait for a whole stacked parameter.) With `workers` > 1, that many processes convert the
    next tensors ahead, in the order `order` names them. A context manager: leaving it ends
    the processes."""

    def __init__(self, tasks: list[Task], workers: int, order: Sequence[str] = ()):
        self._tasks = tasks
        self._task_of = {name: i for i, task in enumerate(tasks) for name in task.to}
        self._order = iter(order)
        self._ahead: dict[str, concurrent.futures.Future] = {}  # name -> its conversion
        # Spawned, not forked: the parent may hold JAX's threads, which fork does not survive.
        self._pool = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn")) if workers > 1 else None
        self._workers = workers

    def __enter__(self) -> Converted:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def read(self, name: str) -> np.ndarray:
        if self._pool is None:
            return convert(self._tasks[self._task_of[name]], name)
        self._start(name)  # at once if read out of order
        self._fill()
        x = self._ahead.pop(name).result()
        self._fill()
        return x

    def _start(self, name: str) -> None:
        if name not in self._ahead:
            self._ahead[name] = self._pool.submit(convert, self._tasks[self._task_of[name]],
                                                  name)

    def _fill(self) -> None:
        # Names read out of `order` may leave conversions here unread: they take the places of
        # prefetched ones, so that memory stays bounded either way.
        while len(self._ahead) < self._workers:
            name = next(self._order, None)
            if name is None:
                return
            self._start(name)


def import_manifest(manifest: Manifest, out: str | Path, workers: int | None, *, source: str,
                    layout: dict[str, Any]) -> Path:
    """Converts the shard set `manifest` describes (hand-written or derived) into a
    weights-only checkpoint at `out`, recording `source` and the `layout` that wrote it."""
    from hotjax.checkpoint import meta as meta_lib
    from hotjax.checkpoint import model, store
    from hotjax.models.hf import LazyTensors, hf_param_makers, hf_read_order, hf_tensor_shapes
    from hotjax.models.llama import abstract_params

    config = model.from_manifest(manifest.model, manifest.path)
    shapes = hf_tensor_shapes(config)
    tasks = plan(manifest, config.n_layers, shapes)
    record = meta_lib.record(step=manifest.step, source=source, items=[store.PARAMS],
                             model=config.to_dict(), written_from={"foreign": layout})
    # Each parameter is made as it is written, from tensors converted as it reads them.
    with Converted(tasks, workers or min(os.cpu_count() or 1, 8, len(tasks)),
                   hf_read_order(config)) as converted:
        tensors = LazyTensors(shapes, converted.read)
        params = store.pending(hf_param_makers(tensors, config, where=f"{manifest.path}: tensor"),
                               abstract_params(config))
        return store.save_weights(out, params, record)
