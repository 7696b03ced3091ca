"""hotjax's own checkpoints, read and kept as untrusted files: nothing outside `--ckpt-dir` is
ever written or deleted, whatever a step entry links to; every file a restore or an export reads
lies inside the checkpoint; every array is checked against the model before a byte of it is read
and against its fingerprint after; and an export appears whole or not at all."""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from helpers import TINY, TINY_RUN, capped, capped_hotjax, error, one_line

from hotjax.checkpoint import dirs, store
from hotjax.checkpoint import meta as meta_lib
from hotjax.errors import UserError
from hotjax.models.llama import abstract_params, param_axes
from hotjax.optim import OptimConfig, make_optimizer

STEP = 2
OPTIM = OptimConfig()


def _outside(root: Path) -> dict[str, str]:
    """What lies outside a checkpoint directory: files a deletion through a link would take."""
    (root / "elsewhere" / "sub").mkdir(parents=True)
    (root / "elsewhere" / "precious").write_text("kept")
    (root / "elsewhere" / "sub" / "precious").write_text("kept")
    (root / "precious").write_text("kept")
    return _files(root)


def _files(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): f.read_text() for f in root.rglob("precious")}


def _save(checkpoints: store.Checkpoints, step: int) -> None:
    checkpoints.save(step, {"w": jnp.ones(3)}, {"m": jnp.ones(3)}, {}, None)


@pytest.mark.parametrize("target", ["../elsewhere", ".."])
def test_a_step_entry_linked_outside_is_refused_at_start_and_nothing_outside_is_deleted(
        target, tmp_path, monkeypatch):
    """`ck/1 -> ../elsewhere` (or `-> ..`): Orbax's parallel deleter, used where half the
    cores are more than one, followed it when --keep-last removed step 1."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    before = _outside(tmp_path)
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "1").symlink_to(target)
    with pytest.raises(UserError) as caught:
        checkpoints = store.Checkpoints(ck, keep_last=1)
        _save(checkpoints, 2)
        checkpoints.close()
    assert str(caught.value) == (
        f"--ckpt-dir {ck}: its entry 1 is a symbolic link, not a step directory hotjax wrote: "
        f"remove it or choose another --ckpt-dir (nothing was deleted)")
    assert _files(tmp_path) == before


def test_train_with_a_linked_step_entry_in_its_ckpt_dir_stops_at_its_start_in_one_line(
        tmp_path, capsys):
    before = _outside(tmp_path)
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "1").symlink_to("../elsewhere")
    err = error([*TINY_RUN, "--ckpt-dir", str(ck)], capsys)
    assert err == (f"hotjax: error: --ckpt-dir {ck}: its entry 1 is a symbolic link, not a "
                   f"step directory hotjax wrote: remove it or choose another --ckpt-dir "
                   f"(nothing was deleted)")
    assert _files(tmp_path) == before


def test_orbax_never_deletes_through_a_step_entry_link_that_passed_the_check(
        tmp_path, monkeypatch):
    """A link that came past `check_steps` (planted between the check and the deletion):
    Orbax's deleter refuses it rather than follow it, on a machine of 128 cores."""
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(dirs, "check_steps", lambda directory: None)
    before = _outside(tmp_path)
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "1").symlink_to("../elsewhere")
    checkpoints = store.Checkpoints(ck, keep_last=1)
    with pytest.raises(OSError, match="symbolic link"):
        _save(checkpoints, 2)
    assert _files(tmp_path) == before


# ---------------------------------------------------------------------------- reading

def _optimizer():
    return make_optimizer(OPTIM, param_axes(TINY))


def _targets() -> dict:
    """What a resume restores: the tiny model's parameters and AdamW state, on the host."""
    params = abstract_params(TINY)
    return {store.PARAMS: params, store.OPT_STATE: jax.eval_shape(_optimizer().init, params)}


def _write(ck: Path, params, opt_state, **changes) -> Path:
    """A checkpoint of these arrays at step 2, fingerprinted as hotjax (or a forger) does."""
    record = meta_lib.record(step=STEP, source="test", items=[store.PARAMS, store.OPT_STATE],
                             model=TINY.to_dict(), optimizer=dataclasses.asdict(OPTIM))
    return store.save_items(ck, {store.PARAMS: params, store.OPT_STATE: opt_state},
                            {**record, **changes})


@pytest.fixture(scope="module")
def state():
    """The tiny model's parameters and AdamW state after two updates, on the host."""
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32),
                          abstract_params(TINY))
    opt_state = jax.tree.map(np.asarray, _optimizer().init(params))
    return params, _with_count(opt_state, STEP)


def _with_count(opt_state, count: int):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: np.asarray(count, x.dtype) if dirs.array_path(p).endswith("count") else x,
        opt_state)


@pytest.fixture(scope="module")
def saved(state, tmp_path_factory) -> Path:
    """A valid checkpoint directory of `state` (step 2)."""
    ck = tmp_path_factory.mktemp("saved") / "ck"
    _write(ck, *state)
    return ck


def _copy(saved: Path, tmp_path: Path) -> Path:
    """A copy of `saved`'s step directory to damage."""
    shutil.copytree(saved, tmp_path / "ck")
    return tmp_path / "ck" / str(STEP)


def _refused_by_restore(path: Path) -> str:
    with pytest.raises(UserError) as caught:
        store.restore(path, _targets())
    assert "\n" not in str(caught.value)
    return str(caught.value)


def _refused_by_export(path: Path, tmp_path: Path, capsys) -> str:
    """`ckpt export-hf`: one line, exit 2, and nothing written."""
    out = tmp_path / "hf"
    err = error(["ckpt", "export-hf", str(path), str(out)], capsys)
    assert not out.exists() and not any(tmp_path.glob(".hf.tmp-*"))
    return err


def test_the_valid_checkpoint_restores_and_exports(saved, state, tmp_path, capsys):
    restored = store.restore(saved, _targets())
    np.testing.assert_array_equal(restored.arrays[store.PARAMS]["embed"], state[0]["embed"])
    from hotjax.cli import main

    assert main(["ckpt", "export-hf", str(saved), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()


def _data_files(step_dir: Path) -> list[Path]:
    return sorted((step_dir / store.PARAMS).rglob("d/*"), key=lambda f: -f.stat().st_size)


@pytest.mark.parametrize("reader", ["restore", "export"])
def test_a_data_file_linked_to_a_file_outside_is_refused_before_it_is_read(
        reader, saved, tmp_path, capsys):
    step_dir = _copy(saved, tmp_path)
    data = _data_files(step_dir)[0]
    outside = tmp_path / "outside"
    outside.write_bytes(data.read_bytes())  # the same bytes: only the link gives it away
    data.unlink()
    data.symlink_to(outside)
    err = (_refused_by_restore(step_dir) if reader == "restore"
           else _refused_by_export(step_dir, tmp_path, capsys))
    assert f"{data}: leads outside {step_dir}: " in err and "nothing outside was read" in err
    assert outside.read_bytes() == data.read_bytes()


def test_a_step_linked_outside_its_checkpoint_directory_is_refused(saved, tmp_path):
    shutil.copytree(saved / str(STEP), tmp_path / "elsewhere")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "3").symlink_to(tmp_path / "elsewhere")
    err = _refused_by_restore(tmp_path / "ck")
    assert f"{tmp_path / 'ck' / '3'}: leads outside {tmp_path / 'ck'}: " in err


def test_a_pipe_in_place_of_a_data_file_is_refused_without_waiting_on_it(saved, tmp_path):
    step_dir = _copy(saved, tmp_path)
    data = _data_files(step_dir)[0]
    data.unlink()
    os.mkfifo(data)
    assert f"{data}: not a file or a directory" in _refused_by_restore(step_dir)


def _without_fingerprint(step_dir: Path, item: str, name: str) -> None:
    file = step_dir / meta_lib.META_FILE
    meta = json.loads(file.read_text())
    del meta["fingerprints"][item][name]
    file.write_text(json.dumps(meta))


@pytest.mark.parametrize("reader", ["restore", "export"])
def test_an_array_without_a_fingerprint_is_refused_not_skipped(reader, saved, tmp_path,
                                                               capsys):
    step_dir = _copy(saved, tmp_path)
    _without_fingerprint(step_dir, store.PARAMS, "layers/wq")
    err = (_refused_by_restore(step_dir) if reader == "restore"
           else _refused_by_export(step_dir, tmp_path, capsys))
    assert (f"{step_dir / store.PARAMS}: array layers/wq has no fingerprint in "
            f"{step_dir / meta_lib.META_FILE}: ") in err


def _permuted(params, opt_state):
    wq = params["layers"]["wq"]
    return {**params, "layers": {**params["layers"], "wq": wq.reshape(wq.shape[::-1])}}, opt_state


def _as_int32(params, opt_state):
    return {**params, "embed": params["embed"].view(np.int32)}, opt_state


def _as_float64(params, opt_state):
    return {**params, "embed": params["embed"].astype(np.float64)}, opt_state


def _count_minus_5(params, opt_state):
    return params, _with_count(opt_state, -5)


HOSTILE_ARRAYS = {
    "a permuted shape of the same size": (_permuted, store.PARAMS, "array layers/wq has shape "
                                          "(8, 8, 64, 2) but this run needs (2, 64, 8, 8)"),
    "float32 bits stored as int32": (_as_int32, store.PARAMS,
                                     "array embed is stored as int32, not float32"),
    "float64": (_as_float64, store.PARAMS, "array embed is stored as float64, not float32"),
    "a step counter of -5 under step 2": (_count_minus_5, store.OPT_STATE,
                                          "counts -5 updates, but the checkpoint's metadata is "
                                          "of step 2"),
}


# Each case through each reader of its item: a restore reads both, export-hf the parameters alone.
READERS = [(case, reader) for case, (_, item, _) in HOSTILE_ARRAYS.items()
           for reader in ("restore", "export") if reader == "restore" or item == store.PARAMS]


@pytest.mark.parametrize(("case", "reader"), READERS)
def test_an_array_unlike_the_models_is_refused_in_one_line(case, reader, state, tmp_path,
                                                           capsys):
    """Each written and fingerprinted as hotjax writes, as a forger would."""
    change, item, expect = HOSTILE_ARRAYS[case]
    step_dir = _write(tmp_path / "ck", *change(*state))
    err = (_refused_by_restore(step_dir) if reader == "restore"
           else _refused_by_export(step_dir, tmp_path, capsys))
    assert f"{step_dir / item}: " in err and expect in err, err


def _rewrite_zarr(item_dir: Path, name: str, **changes) -> None:
    """Array `name`'s zarr metadata inside the item's OCDBT database, with `changes`: what a
    forger writes with TensorStore (the array's data left as the fill value)."""
    spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{item_dir}/",
                                           "path": name.replace("/", ".") + "/"}}
    metadata = ts.open(spec).result().spec().to_json()["metadata"]
    ts.open({**spec, "metadata": {**metadata, **changes}}, create=True,
            delete_existing=True).result()


def _chunked(rows: int, width: int) -> dict:
    """zarr metadata changes: chunks (and their inner chunks) of `rows` x `width`."""
    inner = {"name": "sharding_indexed", "configuration": {
        "chunk_shape": [rows, width], "codecs": [{"name": "bytes"}],
        "index_codecs": [{"name": "bytes"}, {"name": "crc32c"}]}}
    return {"chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [rows, width]}},
            "codecs": [inner]}


# A restore in a fresh process, whose address space is capped: an array claiming terabytes
# fails there (std::bad_alloc aborted it before), not on the machine.
RESTORE = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
           "from test_checkpoint_hostile import _targets\n"
           "from hotjax.checkpoint import store\n"
           "from hotjax.errors import UserError\n"
           "try:\n    store.restore(sys.argv[1], _targets())\n"
           "except UserError as e:\n"
           "    sys.exit(print(f'hotjax: error: {e}', file=sys.stderr) or 2)\n")
ONE_DEVICE = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}

HOSTILE_METADATA = {
    "a claimed shape of 2^34 rows": ({"shape": [2**34, TINY.dim]},
                                     f"array embed has shape ({2**34}, {TINY.dim}) but this run "
                                     f"needs ({TINY.vocab_size}, {TINY.dim})"),
    "chunks of 2^28 rows": (_chunked(2**28, TINY.dim),
                            f"array embed of shape ({TINY.vocab_size}, {TINY.dim}) is stored "
                            f"in chunks of ({2**28}, {TINY.dim}), larger than itself"),
}


@pytest.mark.parametrize("reader", ["restore", "export"])
@pytest.mark.parametrize("case", HOSTILE_METADATA)
def test_array_metadata_claiming_huge_shapes_or_chunks_is_one_line_before_a_byte_is_read(
        case, reader, saved, tmp_path):
    changes, expect = HOSTILE_METADATA[case]
    step_dir = _copy(saved, tmp_path)
    _rewrite_zarr(step_dir / store.PARAMS, "embed", **changes)
    done = (capped(RESTORE, step_dir, cwd=tmp_path, env=ONE_DEVICE) if reader == "restore"
            else capped_hotjax("ckpt", "export-hf", step_dir, tmp_path / "hf", cwd=tmp_path,
                               env=ONE_DEVICE))
    assert done.code == 2, done.stderr[-2000:]
    err = one_line(done.stderr)
    assert f"{step_dir / store.PARAMS}: {expect}" in err, err
    assert not (tmp_path / "hf").exists()


def test_an_export_to_a_place_it_cannot_write_is_one_line_before_any_work(saved, tmp_path,
                                                                          capsys):
    (tmp_path / "file").write_text("a file, not a directory")
    for out, expect in ((tmp_path / "file" / "hf", f"{tmp_path / 'file'} is not a writable "
                         f"directory (nothing was written)"),
                        (tmp_path / "file", "exists and is not an empty directory")):
        err = error(["ckpt", "export-hf", str(saved), str(out)], capsys)
        assert f"{out}: " in err and expect in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
