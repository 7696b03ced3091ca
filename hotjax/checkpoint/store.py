"""Universal checkpoints in Orbax: a step's state saved from home, restored onto any layout.

Each step directory (`dirs`) holds the items
- `params`, `opt_state`: arrays in logical form (OCDBT, zarr3): the model's own tree of fp32
  parameters (stacked layers, unfused Q/K/V) and the optimizer state that mirrors it. No
  sharding is stored with them, so a restore always names its targets: shape, dtype and the new
  layout's sharding, on any mesh or device count;
- `meta`: JSON (`checkpoint.meta`), including a fingerprint of every array (`fingerprint`);
- `data`: JSON, the data iterator's position (absent from weights-only checkpoints);
- `tokenizer`: the run's tokenizer file (`tokenizer.json` or `tokenizer.model`), byte for byte,
  where it has one (`checkpoint.tokenizer` reads it back).
Saves are complete or absent; a failed one is said in one line (`failures`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint import checkpoint_managers as keep_policies
from orbax.checkpoint import type_handlers
from orbax.checkpoint.metadata import value as value_metadata

from hotjax import bounds
from hotjax.checkpoint import dirs, failures, fingerprint
from hotjax.checkpoint import lock as ckpt_lock
from hotjax.checkpoint import meta as meta_lib
from hotjax.checkpoint.dirs import (
    DATA,
    META,
    OPT_STATE,
    PARAMS,
    TMP_MARK,
    TOKENIZER,
    array_path,
    check_new_directory,
    find,
    write_atomically,
)
from hotjax.errors import UserError


class Pending:
    """A host array written when its turn comes: `make()` builds it, it is written and
    fingerprinted, then dropped; so that an import holds one array at a time, not a tree."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, make: Callable[[], np.ndarray]):
        self.shape, self.dtype, self.make = tuple(shape), np.dtype(dtype), make
        self.ndim, self.size = len(self.shape), math.prod(self.shape)
        self.fingerprint: int | None = None  # once written


def pending(makers: Any, like: Any) -> Any:
    """A tree of `Pending` arrays: `makers`' functions, shaped and typed as `like`'s leaves."""
    return jax.tree.map(lambda make, s: Pending(s.shape, s.dtype, make), makers, like)


class _OneAtATime(type_handlers.NumpyHandler):
    """Writes host arrays one after another, `Pending` ones made just before: Orbax's own
    handler copies every array first and writes them all at once."""

    def __init__(self) -> None:
        super().__init__(deepcopy_host_arrays=False)

    async def _background_serialize(self, values, infos, args=None) -> None:  # noqa: ANN001
        for value, info, arg in zip(values, infos, args or [None] * len(values), strict=True):
            x = value
            if isinstance(value, Pending):
                x = value.make()
                if x.shape != value.shape or x.dtype != value.dtype:
                    raise AssertionError(f"{info.name}: made {x.shape} {x.dtype}, not "
                                         f"{value.shape} {value.dtype}")
                value.fingerprint = fingerprint.of_host(x)
            await super()._background_serialize([x], [info], [arg])
            del x

    async def _open_and_write(self, value: np.ndarray, tspec: dict[str, Any],
                              ts_context: Any) -> None:
        t = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
        await t.write(value, can_reference_source_data_indefinitely=True).commit


def _array_handler(one_at_a_time: bool = False) -> ocp.PyTreeCheckpointHandler:
    # Without the `_sharding` file Orbax would otherwise write, nothing of the writer's layout
    # is stored with the arrays (restoring from it fails on another device count anyway).
    # Host (numpy) arrays are written and read in the same format: imports and exports.
    failures.report_failed_writes_once()  # for every write and read of arrays
    host = _OneAtATime() if one_at_a_time else type_handlers.NumpyHandler()
    registry = type_handlers.create_type_handler_registry(
        (jax.Array, type_handlers.ArrayHandler(enable_write_sharding_file=False)),
        (np.ndarray, host), *([(Pending, host)] if one_at_a_time else []))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_zarr3=True)


class _FileHandler(ocp.JsonCheckpointHandler):
    """Writes one file of bytes into its item, as Orbax writes JSON: in the save's
    background, committed with the step. Read back as a file, never through Orbax."""

    async def _save_fn(self, x: tuple[str, bytes], directory: Any) -> None:
        if jax.process_index() == 0:
            name, data = x
            (Path(directory) / name).write_bytes(data)


@ocp.args.register_with_handler(_FileHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class _FileSave(ocp.args.CheckpointArgs):
    item: tuple[str, bytes]  # the file's name and its bytes


def _handlers(items: tuple[str, ...] = (PARAMS, OPT_STATE, META, DATA, TOKENIZER),
              one_at_a_time: bool = False) -> dict[str, Any]:
    return {item: ocp.JsonCheckpointHandler() if item in (META, DATA)
            else _FileHandler() if item == TOKENIZER
            else _array_handler(one_at_a_time) for item in items}


def _tokenizer_args(tokenizer: Any) -> dict[str, Any]:
    """The `tokenizer` item's save of `tokenizer`'s own file, if it has one (a tokenizer
    that is its identity, "bytes", has none)."""
    file = getattr(tokenizer, "file", None)
    return {} if file is None else {TOKENIZER: _FileSave((file.name, file.data))}


class Checkpoints:
    """A directory of step checkpoints: asynchronous saves, what to keep, the latest one."""

    def __init__(self, directory: str | Path, *, keep_last: int | None = 3,
                 keep_every: int | None = None):
        self.directory = ckpt_lock.writable(directory)  # one line, before Orbax's traceback
        keep: list[Any] = [keep_policies.LatestN(keep_last)]
        if keep_every:
            keep.append(keep_policies.EveryNSteps(keep_every))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=keep_policies.AnyPreservationPolicy(keep),
            cleanup_tmp_directories=True, enable_async_checkpointing=_async_saves(),
            save_root_metadata=False,
            # One thread: Orbax's parallel deleter (its default where half the cores are more
            # than one) lists a step through a link to another directory and deletes what is
            # there. Its one-thread deletion refuses a link; `save` refuses one first.
            num_deletion_threads=1,
            # Made by the caller: a directory that cannot be made fails the save at once.
            # Made in the background, its writers would wait for it until Orbax's barrier
            # timeout, and at exit the process would wait for them.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_handlers=_handlers())
        self._saving: tuple[int, int] | None = None  # the step being written, and its bytes
        self._identity = _identity(self.directory)  # to tell it was removed or replaced

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def remove_partial(self) -> None:
        """Removes what an unfinished save left (Orbax's `<step>.orbax-checkpoint-tmp*`)."""
        for partial in self.directory.glob(f"*{TMP_MARK}*"):
            shutil.rmtree(partial, ignore_errors=True)

    def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any],
             data: dict[str, Any] | None, tokenizer: Any = None) -> float:
        """Starts writing one step, `tokenizer`'s file with it; returns the seconds the caller
        was held up.

        Orbax copies every array to host before it returns (its device-to-host transfer is
        synchronous unless a transfer byte limit is set, which we never set), and writes in
        a background thread; so the caller may donate these arrays to its next step at once
        (the step donates its state). On CPU the host copy is a view, and JAX refuses to reuse
        a donated buffer that a view still holds.
        """
        started = time.perf_counter()
        # Host copies, made here in the main thread: Orbax's own threads then never touch the
        # devices while the next step runs (on XLA:CPU that interleaving hung steps). Arrays
        # spread over several processes go to Orbax as they are: each process writes its
        # shards.
        if all(x.is_fully_addressable for x in jax.tree.leaves((params, opt_state))):
            params, opt_state = jax.device_get((params, opt_state))
        meta = {**meta, "step": step, "items": [PARAMS, OPT_STATE],
                "fingerprint_version": fingerprint.VERSION,
                "fingerprints": fingerprint.of_items({PARAMS: params, OPT_STATE: opt_state})}
        args = {PARAMS: ocp.args.PyTreeSave(params), OPT_STATE: ocp.args.PyTreeSave(opt_state),
                META: ocp.args.JsonSave(meta), **_tokenizer_args(tokenizer)}
        if data is not None:
            args[DATA] = ocp.args.JsonSave(data)
        self.wait()  # the previous save, written in the background, may have failed
        with self._writing():
            self._saving = (step, sum(x.nbytes for x in jax.tree.leaves((params, opt_state))))
            if self._vanished():  # else Orbax would make it anew, without the earlier steps
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT),
                                        str(self.directory))
            dirs.check_steps(self.directory)  # a link made since: the save would delete it
            self._manager.save(step, args=ocp.args.Composite(**args), force=True)
        return time.perf_counter() - started

    def wait(self) -> None:
        with self._writing():
            self._manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.wait()
        except BaseException:
            with contextlib.suppress(Exception):  # the failure was said: close all the same
                self._manager.close()
            raise
        self._manager.close()

    def _vanished(self) -> bool:
        return self._identity is not None and _identity(self.directory) != self._identity

    def _remove_failed_save(self) -> None:
        """Removes a failed save's partial directory once nothing writes into it any more:
        one item's failure ends the save while the others' writes may still be landing."""
        with contextlib.suppress(Exception):  # the same failure, raised again
            self._manager.wait_until_finished()
        for _ in range(PARTIAL_SETTLE_TRIES):
            self.remove_partial()
            time.sleep(PARTIAL_SETTLE_S)
            if not any(self.directory.glob(f"*{TMP_MARK}*")):
                return

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Turns a save's failed write (a full disk, a quota, a read-only file system, a
        permission, the directory removed) into one line: the directory, the cause and what
        to do, with the space a checkpoint needs when space ran out; the partial save is
        removed, the complete ones stay."""
        try:
            yield
        except Exception as e:
            vanished = self._vanished()
            code = failures.write_errno(e)
            if (code is None and not vanished) or self._saving is None:
                raise
            step, size = self._saving
            self._saving = None
            where = f"--ckpt-dir {self.directory}: saving step {step} failed"
            if vanished:
                raise UserError(f"{where}: the directory vanished (removed or moved while the "
                                f"run wrote to it): rerun with a --ckpt-dir that nothing else "
                                f"removes") from None
            self._remove_failed_save()
            kept = self.steps()
            needs = ""
            if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                free = (shutil.disk_usage(self.directory).free
                        if self.directory.is_dir() else 0)
                needs = (f": a checkpoint needs about {size / 2**20:,.1f} MiB and "
                         f"{free / 2**20:,.1f} MiB is free there")
            raise UserError(
                f"{where} ({os.strerror(code)}){needs}: {ckpt_lock.advice(code)}"
                + (f"; the checkpoints of steps {', '.join(map(str, kept))} are intact"
                   if kept else "")) from None


# A failed save's partial directory is removed, then checked after this long for writes that
# were still landing, this many times at the most.
PARTIAL_SETTLE_S = 0.2
PARTIAL_SETTLE_TRIES = 10


def _identity(directory: Path) -> tuple[int, int] | None:
    """The directory's device and inode (None: it is not there)."""
    try:
        found = directory.stat()
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _async_saves() -> bool:
    """Write in the background, except over simulated CPU devices: there the writer's own
    programs and the next step's collectives, enqueued from two threads, can deadlock (seen
    here as a step that never finished)."""
    return not (jax.default_backend() == "cpu" and jax.device_count() > 1)


def save_weights(directory: str | Path, params: Any, meta: dict[str, Any],
                 tokenizer: Any = None) -> Path:
    """Writes a weights-only checkpoint (`params` + `meta`, and `tokenizer`'s file) at
    `meta['step']`, synchronously."""
    return save_items(directory, {PARAMS: params}, meta, tokenizer)


def save_items(directory: str | Path, items: dict[str, Any], meta: dict[str, Any],
               tokenizer: Any = None) -> Path:
    """Writes a checkpoint of host arrays (`params`, and `opt_state` for one that resumes an
    optimizer) at `meta['step']`, and `tokenizer`'s file, synchronously; complete or absent,
    as every save. Leaves may be `Pending`: each is made, written and dropped in turn, so that
    host memory holds one array (and its encoded copy) at a time, whatever the checkpoint's
    size."""
    directory = check_new_directory(directory)
    items = {item: jax.tree.map(lambda x: x if isinstance(x, Pending) else np.asarray(x), tree,
                                is_leaf=lambda x: isinstance(x, Pending))
             for item, tree in items.items()}
    step = meta["step"]
    meta = {**meta, "items": list(items), "fingerprint_version": fingerprint.VERSION}
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False,
                                           save_root_metadata=False)
    args = {item: ocp.args.PyTreeSave(tree) for item, tree in items.items()}
    args.update(_tokenizer_args(tokenizer))

    def write(scratch: Path) -> None:
        with ocp.CheckpointManager(scratch, options=options, item_handlers=_handlers(
                (*args, META), one_at_a_time=True)) as manager:
            manager.save(step, args=ocp.args.Composite(
                **args, **{META: ocp.args.JsonSave({**meta, "fingerprints": {}})}), force=True)
        # Fingerprints are known once every array was made and written: the metadata that
        # Orbax wrote without them is replaced before the checkpoint appears.
        prints = {item: {array_path(p): x.fingerprint if isinstance(x, Pending)
                         else fingerprint.of_host(x)
                         for p, x in jax.tree_util.tree_flatten_with_path(
                             tree, is_leaf=lambda x: isinstance(x, Pending))[0]}
                  for item, tree in items.items()}
        (scratch / str(step) / meta_lib.META_FILE).write_text(
            json.dumps({**meta, "fingerprints": prints}))

    write_atomically(directory, write)
    return directory / str(step)


def saved_arrays(step_dir: Path, item: str) -> dict[str, jax.ShapeDtypeStruct]:
    """Shape and dtype of every array of one item, read from Orbax's metadata alone."""
    return {name: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype)
            for name, m in _saved(step_dir, item).items()}


def _saved(step_dir: Path, item: str) -> dict[str, Any]:
    """Orbax's metadata of each array of one item (shape, dtype, chunks), by name: Orbax's tree
    of names (`_METADATA`, JSON within `bounds.MAX_JSON_BYTES`) and each array's own zarr
    metadata, never a byte of an array."""
    item_dir = step_dir / item
    if not item_dir.is_dir():
        raise UserError(f"{item_dir}: not found: the checkpoint lacks its {item}")
    tree_file = item_dir / "_METADATA"
    if tree_file.is_file() and tree_file.stat().st_size > bounds.MAX_JSON_BYTES:
        raise UserError(f"{tree_file}: over {bounds.MAX_JSON_BYTES:,} bytes (MAX_JSON_BYTES), "
                        f"more than any checkpoint's tree of arrays: {meta_lib.DAMAGED}")
    handler = _array_handler()
    try:
        leaves = jax.tree_util.tree_flatten_with_path(handler.metadata(item_dir).tree)[0]
        found = {array_path(p): m for p, m in leaves}
        for name, m in found.items():
            if not isinstance(m, value_metadata.ArrayMetadata):
                raise UserError(f"{item_dir}: {name} is a {type(m).__name__}, not an array: "
                                f"{meta_lib.DAMAGED}")
            np.dtype(m.dtype)  # a type numpy knows
        return found
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many types
        raise UserError(f"{item_dir}: the metadata of its arrays is unreadable "
                        f"({meta_lib.first_line(e)[:300]}): {meta_lib.DAMAGED}") from None
    finally:
        handler.close()


# How hotjax stores a floating array: fp32 (the master weights and the optimizer's moments),
# whatever dtype a run computes in or restores into.
STORED_FLOAT = np.dtype(np.float32)


def _checked(step_dir: Path, item: str, like: Mapping[str, Any], prints: Mapping[str, int], *,
             vocab: tuple[int, int] | None = None,
             every: bool = False) -> dict[str, jax.ShapeDtypeStruct]:
    """The saved shape and dtype of each array `like` names (each with a `.shape` and a
    `.dtype`), checked before a byte of any is read: it is there (and, with `every`, nothing
    else is), has a fingerprint in `prints`, the shape `like` gives it (the saved vocabulary
    `vocab[0]` allowed where `like` has `vocab[1]`), its dtype (`STORED_FLOAT` where `like` is
    floating), and chunks no larger than itself."""
    item_dir = step_dir / item
    saved = _saved(step_dir, item)
    missing = [n for n in like if n not in saved]
    extra = sorted(set(saved) - set(like)) if every else []
    if missing or extra:
        which = (f"lacks {', '.join(missing[:3])}" if missing
                 else f"holds {', '.join(extra[:3])}, which this run lacks")
        raise UserError(f"{item_dir}: {which}: written for another model or optimizer")
    out = {}
    for name, t in like.items():
        m = saved[name]
        shape, dtype, target = tuple(int(n) for n in m.shape), np.dtype(m.dtype), tuple(t.shape)
        resized = vocab is not None and len(shape) == len(target) and all(
            a == b or (a, b) == vocab for a, b in zip(shape, target, strict=True))
        if shape != target and not resized:
            raise UserError(f"{item_dir}: array {name} has shape {shape} but this run needs "
                            f"{target}: written for another model")
        wanted = STORED_FLOAT if jnp.issubdtype(t.dtype, jnp.floating) else np.dtype(t.dtype)
        if dtype != wanted:
            raise UserError(f"{item_dir}: array {name} is stored as {dtype}, not {wanted}: "
                            f"{meta_lib.DAMAGED}")
        for chunk in _chunks(m):
            if len(chunk) != len(shape) or any(
                    c > max(n, 1) for c, n in zip(chunk, shape, strict=True)):
                raise UserError(f"{item_dir}: array {name} of shape {shape} is stored in chunks "
                                f"of {tuple(chunk)}, larger than itself: {meta_lib.DAMAGED}")
        if name not in prints:
            raise UserError(f"{item_dir}: array {name} has no fingerprint in "
                            f"{step_dir / meta_lib.META_FILE}: {meta_lib.DAMAGED}")
        out[name] = jax.ShapeDtypeStruct(shape, dtype)
    return out


def _chunks(m: Any) -> list[tuple[int, ...]]:
    """The chunk shapes an array is read in: TensorStore's read chunk, and zarr's shard and
    inner chunk."""
    storage = m.storage
    zarr = storage.zarr_metadata if storage is not None else None
    found = [storage.chunk_shape if storage is not None else None,
             getattr(zarr, "chunk_shape", None), getattr(zarr, "inner_chunk_shape", None)]
    return [tuple(int(c) for c in chunk) for chunk in found if chunk is not None]


def _fingerprints(meta: dict[str, Any], item: str) -> tuple[dict[str, int], int]:
    """An item's fingerprints in `meta`, and their version (`meta.FINGERPRINT_VERSION`)."""
    return meta["fingerprints"].get(item, {}), meta.get("fingerprint_version", 1)


def _check_count(item_dir: Path, name: str, x: Any, step: int) -> None:
    """An optimizer's step counter (a `count` of `opt_state`) counts the updates of the
    metadata's `step`: all of them, or under loss scaling (Optax's `inner_state`) those whose
    gradients were finite."""
    if item_dir.name != OPT_STATE or name.rsplit("/", 1)[-1] != "count":
        return
    count = int(np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x))
    skips = "/inner_state/" in f"/{name}/"
    if not (0 <= count <= step if skips else count == step):
        raise UserError(f"{item_dir}: array {name} counts {count} updates, but the checkpoint's "
                        f"metadata is of step {step}: {meta_lib.DAMAGED}")


class Restored(NamedTuple):
    path: Path  # the step directory
    meta: dict[str, Any]
    arrays: dict[str, Any]  # item -> tree, on the targets' shardings and dtypes
    data: dict[str, Any] | None


@dataclasses.dataclass(frozen=True)
class _Read:
    """How one array is read: at the target's shape and sharding, in its saved dtype."""

    name: str
    stored: jax.ShapeDtypeStruct
    args: type_handlers.ArrayRestoreArgs
    saved: tuple[int, ...]  # its shape in the checkpoint

    @property
    def exact(self) -> bool:
        """Read at its saved shape (not padded or trimmed): its fingerprint holds."""
        return self.saved == self.stored.shape


def by_name(tree: Any) -> dict[str, Any]:
    """A tree's leaves by name (`array_path`): what `restore_each` takes."""
    return {array_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def restore_each(path: str | Path, item: str,
                 like: Mapping[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """The arrays `like` names (`layers/wq`, `1/0/mu/embed`), each with the shape and dtype it
    should have (`jax.ShapeDtypeStruct`), restored one at a time on the host, checked against
    them before any is read and against their fingerprints after: the others are Orbax
    placeholders, not read, so that an export holds one array."""
    step_dir = find(path)
    meta = meta_lib.read(step_dir)
    prints, version = _fingerprints(meta, item)
    _checked(step_dir, item, like, prints)
    return _each(step_dir, item, list(like), prints, version, meta["step"])


def _each(step_dir: Path, item: str, names: list[str], prints: Mapping[str, int], version: int,
          step: int) -> Iterator[tuple[str, np.ndarray]]:
    saved = _saved_tree(step_dir, item)
    for name in names:
        def only(make: Callable[[Any], Any], name: str = name) -> Any:
            return jax.tree_util.tree_map_with_path(
                lambda keys, m: make(m) if array_path(keys) == name else ocp.PLACEHOLDER, saved)

        args = ocp.args.PyTreeRestore(
            item=only(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype)),
            restore_args=only(lambda m: type_handlers.RestoreArgs(restore_type=np.ndarray,
                                                                  dtype=m.dtype)))
        try:
            with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**_handlers((item,)))) as c:
                out = c.restore(step_dir, args=ocp.args.Composite(**{item: args}))[item]
        except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many types
            raise UserError(failures.read_failure(e, step_dir)) from None
        (x,) = [x for p, x in jax.tree_util.tree_flatten_with_path(out)[0]
                if array_path(p) == name]
        if fingerprint.of_host(x, version=version) != prints[name]:
            raise UserError(f"{step_dir / item}: array {name} does not match its fingerprint: "
                            f"the checkpoint is damaged: resume from another one")
        _check_count(step_dir / item, name, x, step)
        yield name, x


def _saved_tree(step_dir: Path, item: str) -> Any:
    """The tree of one item's array metadata, as Orbax saved it (`_saved` checked it)."""
    handler = _array_handler()
    try:
        return handler.metadata(step_dir / item).tree
    finally:
        handler.close()


def trim(x: np.ndarray, axes: tuple[str, ...], vocab: int) -> np.ndarray:
    """`x` without the vocabulary rows past `vocab` (`axes`: its logical axes)."""
    return x[tuple(slice(0, vocab) if a == "vocab" else slice(None) for a in axes)]


def restore(path: str | Path, targets: Mapping[str, Any], *,
            vocab: tuple[int, int] | None = None) -> Restored:
    """Restores the items in `targets`: trees of `jax.ShapeDtypeStruct`, onto their shardings,
    or as numpy arrays on the host where a target has no sharding.

    Every array is checked against its target before any is read (`_checked`), read in its
    stored dtype, checked against its fingerprint, then cast to the target's. `vocab=(saved,
    target)` lets dimensions of the saved vocabulary size be padded with zeros or trimmed to
    the target's (padding rows only: see `meta.check_model`).
    """
    step_dir = find(path)
    meta = meta_lib.read(step_dir)
    absent = [item for item in targets if item not in meta["items"]]
    if absent:
        raise UserError(f"{step_dir}: holds no {', '.join(absent)} (a weights-only checkpoint)")
    reads = {item: _reads(step_dir, item, target, vocab, _fingerprints(meta, item)[0])
             for item, target in targets.items()}
    args = {item: ocp.args.PyTreeRestore(item=jax.tree.map(lambda r: r.stored, tree),
                                         restore_args=jax.tree.map(lambda r: r.args, tree))
            for item, tree in reads.items()}
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**_handlers(tuple(args)))) as c:
            out = c.restore(step_dir, args=ocp.args.Composite(**args))
    except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many types
        raise UserError(failures.read_failure(e, step_dir)) from None
    arrays = {}
    for item, target in targets.items():
        _check_fingerprints(step_dir / item, out[item], reads[item], *_fingerprints(meta, item))
        for r, x in zip(jax.tree.leaves(reads[item]), jax.tree.leaves(out[item]), strict=True):
            _check_count(step_dir / item, r.name, x, meta["step"])
        arrays[item] = jax.tree.map(lambda x, t: x if x.dtype == t.dtype else x.astype(t.dtype),
                                    out[item], target)
    return Restored(step_dir, meta, arrays, meta_lib.read_data(step_dir))


def _reads(step_dir: Path, item: str, target: Any, vocab: tuple[int, int] | None,
           prints: Mapping[str, int]) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    like = {array_path(p): t for p, t in leaves}
    stored = _checked(step_dir, item, like, prints, vocab=vocab, every=True)
    reads = []
    for name, t in like.items():
        s = stored[name]
        exact = s.shape == t.shape
        if t.sharding is None and not exact:
            raise UserError(f"{step_dir / item}: array {name} has shape {s.shape}; resizing it "
                            f"to {t.shape} needs a device target")
        args = (type_handlers.RestoreArgs(restore_type=np.ndarray, dtype=s.dtype)
                if t.sharding is None else
                type_handlers.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape,
                                               dtype=s.dtype, strict=exact))
        reads.append(_Read(name, jax.ShapeDtypeStruct(t.shape, s.dtype, sharding=t.sharding),
                           args, s.shape))
    return jax.tree_util.tree_unflatten(treedef, reads)


def _check_fingerprints(item_dir: Path, tree: Any, reads: Any, expected: Mapping[str, int],
                        version: int) -> None:
    """Every array read whole against its fingerprint: a padded one as its saved part; a
    trimmed one cannot be (its rows past the target were never read)."""
    pairs = []
    for r, x in zip(jax.tree.leaves(reads), jax.tree.leaves(tree), strict=True):
        if all(a <= b for a, b in zip(r.saved, r.stored.shape, strict=True)):
            pairs.append((r, x if r.exact else x[tuple(slice(0, n) for n in r.saved)]))
    found = fingerprint.values([x for _, x in pairs], version=version)
    for (r, _), value in zip(pairs, found, strict=True):
        if value != expected[r.name]:
            raise UserError(f"{item_dir}: array {r.name} does not match its fingerprint: the "
                            f"checkpoint is damaged: resume from another one")
