"""A checkpoint from a stranger runs no code: every pickle an import reads (DCP `.metadata` and
saved objects, Megatron-Core's `common.pt`, DeepSpeed's and Megatron's `.pt` files) is read as
data, and a crafted one is refused in one line naming the file and what it refers to. The file
names a checkpoint records (DeepSpeed's `latest`, a safetensors index, DCP's rank files,
Megatron's tracker), and the one file a Hugging Face directory holds, stay inside its directory,
symbolic links followed. What a checkpoint holds is read as it is: a weight or moment that is not
a finite number (or becomes none as fp32), a tensor at a shape not the model's, a
hyperparameter that is not a number, each is one line naming it, and nothing is written.
"""

import io
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from helpers import TINY
from safetensors.numpy import save_file

from hotjax.cli import main
from hotjax.models.hf import INDEX_FILE, WEIGHTS_FILE, config_to_hf, hf_tensor_shapes, hf_tensors_of

EMBED = "embedding.word_embeddings.weight"  # Megatron-Core's
RAN = f"{os.mkdir.__module__}.{os.mkdir.__name__}"  # what the payloads call: posix.mkdir


class Payload:
    """What a crafted checkpoint holds: unpickled, it creates the directory `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _refused(argv: list[str], capsys) -> str:
    """stderr of a hotjax command that exits 2 with one line and writes nothing."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("hotjax: error: "), err
    assert not Path(argv[3]).exists()
    return err


def _weights() -> dict[str, torch.Tensor]:
    """The tiny model's tensors (zeros), by Hugging Face name."""
    return {name: torch.zeros(shape) for name, shape in hf_tensor_shapes(TINY).items()}


def _hf(directory: Path, weights: dict[str, np.ndarray]) -> Path:
    """A Hugging Face directory of the tiny model holding `weights` in one safetensors file."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config_to_hf(TINY, "float32")))
    save_file(weights, directory / WEIGHTS_FILE)
    return directory


def _universal(directory: Path) -> Path:
    """A universal DeepSpeed directory of the tiny model: zero weights and AdamW moments at
    step 3, and its optimizer's param groups."""
    zero = directory / "zero"
    for name, shape in hf_tensor_shapes(TINY).items():
        (zero / name).mkdir(parents=True)
        for field in ("fp32", "exp_avg", "exp_avg_sq"):
            torch.save({"cat_dim": 0, "param": torch.zeros(shape)}, zero / name / f"{field}.pt")
        torch.save(torch.tensor(3.0), zero / name / "step.pt")
    torch.save({"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8}]},
               zero / "optimizer_state.pt")
    return directory


def _save_dcp(directory: Path, state: dict) -> Path:
    torch_dcp.save(state, storage_writer=torch_dcp.FileSystemWriter(str(directory)),
                   no_dist=True)
    return directory


def _megatron_core(root: Path) -> Path:
    """A torch_dist iteration directory named by `root`'s tracker, its .metadata real."""
    iteration = root / "iter_0000002"
    _save_dcp(iteration, {EMBED: torch.zeros(8, 4)})
    (iteration / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    return iteration


def test_the_payload_runs_its_code_under_a_plain_unpickler(tmp_path):
    pickle.loads(pickle.dumps(Payload(tmp_path / "ran")))
    assert (tmp_path / "ran").is_dir()


@pytest.mark.parametrize("case", ["dcp metadata", "dcp saved object", "megatron-core metadata",
                                  "megatron-core common.pt", "deepspeed .pt", "megatron .pt"])
def test_a_crafted_pickle_runs_no_code_and_is_one_line_naming_the_file_and_the_global(
        case, tmp_path, capsys):
    marker, source, out = tmp_path / "ran", tmp_path / "ck", str(tmp_path / "out")
    source.mkdir()
    payload = Payload(marker)
    if case == "dcp metadata":
        (source / ".metadata").write_bytes(pickle.dumps(payload))
        argv = ["import-dcp", str(source), out, "--model", "tiny"]
        expect = [f"{source / '.metadata'}: refers to {RAN}, which a checkpoint's metadata never"]
    elif case == "dcp saved object":
        group = {"lr": payload, "weight_decay": 0.0, "params": list(hf_tensor_shapes(TINY))}
        _save_dcp(source, {"model": _weights(), "optim": {"param_groups": [group]}})
        argv = ["import-dcp", str(source), out, "--model", "tiny"]
        expect = [f"{source / '__0_0.distcp'}: torch's weights-only loader refuses saved "
                  f"object optim.param_groups.0.lr (refers to {RAN})"]
    elif case == "megatron-core metadata":
        iteration = _megatron_core(source)
        (iteration / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": payload}))
        argv = ["import-megatron-core", str(source), out]
        expect = [f"{iteration / '.metadata'}: refers to {RAN}"]
    elif case == "megatron-core common.pt":
        iteration = _megatron_core(source)
        torch.save({"args": payload, "iteration": 2}, iteration / "common.pt")
        argv = ["import-megatron-core", str(source), out]
        expect = [f"{iteration / 'common.pt'}: refers to {RAN}, which a Megatron checkpoint "
                  f"never holds"]
    elif case == "deepspeed .pt":
        torch.save({"param_shapes": payload}, source / "mp_rank_00_model_states.pt")
        argv = ["import-deepspeed", str(source), out, "--model", "tiny"]
        expect = [f"{source / 'mp_rank_00_model_states.pt'}: torch's weights-only loader "
                  f"refuses it (refers to {RAN})"]
    else:
        rank = source / "iter_0000002" / "mp_rank_00"
        rank.mkdir(parents=True)
        (source / "latest_checkpointed_iteration.txt").write_text("2")
        torch.save({"args": payload}, rank / "model_optim_rng.pt")
        argv = ["import-shards", str(source), out, "--format", "megatron", "--model", "tiny"]
        expect = [f"{rank / 'model_optim_rng.pt'}: torch's weights-only loader refuses it: "
                  f"refers to {RAN}"]
    err = _refused(["ckpt", *argv], capsys)
    assert all(e in err for e in expect), err
    assert not marker.exists()


def test_a_damaged_or_foreign_dcp_metadata_is_one_line(tmp_path, capsys):
    source = _save_dcp(tmp_path / "ck", {"model": _weights()})
    real = (source / ".metadata").read_bytes()

    class Persistent(pickle.Pickler):
        def persistent_id(self, obj):
            return "storage" if obj == "tensor" else None

    stream = io.BytesIO()
    Persistent(stream).dump(["tensor"])
    for data, expect in ((real[: len(real) // 2], "unreadable (UnpicklingError"),
                         (stream.getvalue(), "holds a persistent id"),
                         (pickle.dumps({"model": 1}), "holds no DCP metadata")):
        (source / ".metadata").write_bytes(data)
        err = _refused(["ckpt", "import-dcp", str(source), str(tmp_path / "out"), "--model",
                        "tiny"], capsys)
        assert f"{source / '.metadata'}: {expect}" in err, err


def _dcp_in_another_place(tmp_path: Path, link: bool) -> tuple[Path, str]:
    """A real DCP checkpoint whose rank file lies outside its directory: named so in .metadata
    (`../outside.distcp`), or linked there."""
    source = _save_dcp(tmp_path / "ck", {"model": _weights()})
    (source / "__0_0.distcp").rename(tmp_path / "outside.distcp")
    name = "__0_0.distcp" if link else "../outside.distcp"
    if link:
        (source / name).symlink_to(tmp_path / "outside.distcp")
    else:
        with open(source / ".metadata", "rb") as f:
            metadata = pickle.load(f)  # noqa: S301 - written by this test
        for info in metadata.storage_data.values():
            info.relative_path = name
        (source / ".metadata").write_bytes(pickle.dumps(metadata))
    return source, name


@pytest.mark.parametrize("case", ["deepspeed latest", "deepspeed latest absolute",
                                  "safetensors index", "safetensors file link", "dcp rank file",
                                  "dcp rank file link", "megatron-core iteration link"])
def test_a_file_name_read_from_a_checkpoint_never_leads_outside_it(case, tmp_path, capsys):
    out = str(tmp_path / "out")
    if case.startswith("deepspeed"):
        source, outside = tmp_path / "ds", tmp_path / "outside"
        source.mkdir()
        outside.mkdir()
        torch.save({"param_shapes": [{"model.norm.weight": [64]}]},
                   outside / "mp_rank_00_model_states.pt")
        name = str(outside) if case.endswith("absolute") else "../outside"
        (source / "latest").write_text(name)
        argv, where = ["import-deepspeed", str(source), out, "--model", "tiny"], source / "latest"
    elif case == "safetensors index":  # the shards, if read, would import
        source = tmp_path / "hf"
        source.mkdir()
        (source / "config.json").write_text(json.dumps(config_to_hf(TINY, "float32")))
        save_file({n: t.numpy() for n, t in _weights().items()}, tmp_path / "x.safetensors")
        name = "../x.safetensors"
        (source / INDEX_FILE).write_text(json.dumps(
            {"weight_map": dict.fromkeys(hf_tensor_shapes(TINY), name)}))
        argv, where = ["import-hf", str(source), out], source / INDEX_FILE
    elif case == "safetensors file link":  # the file linked to, if read, would import
        source = _hf(tmp_path / "hf", {n: t.numpy() for n, t in _weights().items()})
        (source / WEIGHTS_FILE).rename(tmp_path / "x.safetensors")
        (source / WEIGHTS_FILE).symlink_to(tmp_path / "x.safetensors")
        name = WEIGHTS_FILE
        argv, where = ["import-hf", str(source), out], source / WEIGHTS_FILE
    elif case.startswith("dcp"):  # the rank file, if read, would import
        source, name = _dcp_in_another_place(tmp_path, link=case.endswith("link"))
        argv, where = ["import-dcp", str(source), out, "--model", "tiny"], source / ".metadata"
    else:
        source = tmp_path / "mc"
        source.mkdir()
        iteration = _megatron_core(tmp_path / "elsewhere")
        (source / iteration.name).symlink_to(iteration)
        (source / "latest_checkpointed_iteration.txt").write_text("2")
        argv, where = ["import-megatron-core", str(source), out], (
            source / "latest_checkpointed_iteration.txt")
        name = iteration.name
    err = _refused(["ckpt", *argv], capsys)
    assert f"{where}: names {name!r}, which leads outside {source}" in err, err


def test_a_hugging_face_cache_snapshot_still_reads_its_linked_blobs(tmp_path):
    repo = tmp_path / "models--tiny"
    snapshot, blob = repo / "snapshots" / "abc123", repo / "blobs" / "f00d"
    snapshot.mkdir(parents=True)
    blob.parent.mkdir()
    weights = {n: np.full(t.shape, 0.5, np.float32) for n, t in _weights().items()}
    save_file(weights, blob)
    (snapshot / "model-00001-of-00001.safetensors").symlink_to("../../blobs/f00d")
    (snapshot / INDEX_FILE).write_text(json.dumps(
        {"weight_map": dict.fromkeys(weights, "model-00001-of-00001.safetensors")}))
    tensors = hf_tensors_of(snapshot)
    assert set(tensors) == set(weights)
    np.testing.assert_array_equal(tensors["model.norm.weight"], weights["model.norm.weight"])


def test_a_pickled_object_that_unpacks_to_gigabytes_is_refused_before_it_is_read(
        tmp_path, capsys):
    """A `common.pt` of a few KiB whose compressed pickle claims 100 MiB (a compression bomb):
    refused from the archive's directory, never decompressed."""
    import zipfile

    from hotjax.checkpoint.formats.torch_load import MAX_OBJECT_BYTES

    source = tmp_path / "ck"
    iteration = _megatron_core(source)
    with zipfile.ZipFile(iteration / "common.pt", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"\0" * (100 * 2**20))
    assert (iteration / "common.pt").stat().st_size < 2**20 < MAX_OBJECT_BYTES < 100 * 2**20
    err = _refused(["ckpt", "import-megatron-core", str(source), str(tmp_path / "out")], capsys)
    assert (f"{iteration / 'common.pt'}: its content unpacks to {100 * 2**20:,} bytes, more "
            f"than any checkpoint's pickled objects ({MAX_OBJECT_BYTES:,}") in err, err


def test_an_index_that_is_not_an_object_is_one_line(tmp_path, capsys):
    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config_to_hf(TINY, "float32")))
    (source / INDEX_FILE).write_text("[1, 2]")
    err = _refused(["ckpt", "import-hf", str(source), str(tmp_path / "out")], capsys)
    assert f"{source / INDEX_FILE}: lacks a weight_map" in err, err


@pytest.mark.parametrize("step", [float("nan"), -3.0, 2.5, "two"])
def test_a_deepspeed_adam_step_that_is_no_step_count_is_one_line(step, tmp_path):
    from hotjax.checkpoint.formats.deepspeed import _step_number
    from hotjax.errors import UserError

    with pytest.raises(UserError, match=r"rank0\.pt: group 0's AdamW step is .*, not a whole "
                                        r"number from 0 to 2,147,483,647: the checkpoint is"):
        _step_number(step, tmp_path / "rank0.pt", 0)
    assert _step_number(torch.tensor(7.0), tmp_path / "rank0.pt", 0) == 7.0


NOT_FINITE = ("the checkpoint is damaged or was saved after its run diverged: import one saved "
              "before (nothing was written)")
UP = "model.layers.1.mlp.up_proj.weight"  # 176 x 64


@pytest.mark.parametrize("case", ["safetensors nan", "safetensors float64 past fp32",
                                  "universal moment inf", "dcp nan"])
def test_a_weight_or_moment_that_is_not_a_finite_number_is_one_line_naming_it(
        case, tmp_path, capsys):
    out = str(tmp_path / "out")
    weights = {n: t.numpy() for n, t in _weights().items()}
    if case.startswith("safetensors"):
        if case.endswith("nan"):
            weights[UP][3, 5] = np.nan
            weights[UP][7, 1] = np.nan
            expect = "2 of its 11,264 values not finite (2 NaN)"
        else:  # finite in the file, infinite as the fp32 a hotjax parameter is
            weights[UP] = weights[UP].astype(np.float64)
            weights[UP][0, 0] = 1e300
            expect = ("1 of its 11,264 values not finite (1 infinite, 1 of them "
                      "finite in float64 but past float32's range)")
        source = _hf(tmp_path / "hf", weights)
        argv, what = ["import-hf", str(source), out], f"tensor {UP}"
    elif case.startswith("universal"):
        source = _universal(tmp_path / "ds")
        moment = torch.zeros(64)
        moment[9] = torch.inf
        torch.save({"cat_dim": 0, "param": moment},
                   source / "zero" / "model.norm.weight" / "exp_avg_sq.pt")
        argv = ["import-deepspeed", str(source), out, "--model", "tiny"]
        what = "exp_avg_sq of model.norm.weight"
        expect = "1 of its 64 values not finite (1 infinite)"
    else:
        tensors = _weights()
        tensors[UP][0, :] = torch.nan
        source = _save_dcp(tmp_path / "ck", {"model": tensors})
        argv = ["import-dcp", str(source), out, "--model", "tiny"]
        what, expect = f"tensor {UP}", "64 of its 11,264 values not finite (64 NaN)"
    err = _refused(["ckpt", *argv], capsys)
    assert f"{source}: {what}: {expect}" in err and err.endswith(NOT_FINITE), err


def test_a_moment_saved_at_another_shape_is_refused_not_reshaped(tmp_path, capsys):
    """A transposed moment holds the weight's element count: reshaped, it would import."""
    source = _universal(tmp_path / "ds")
    file = source / "zero" / "model.layers.0.mlp.down_proj.weight" / "exp_avg.pt"
    torch.save({"cat_dim": 0, "param": torch.zeros(176, 64)}, file)
    err = _refused(["ckpt", "import-deepspeed", str(source), str(tmp_path / "out"), "--model",
                    "tiny"], capsys)
    assert err.endswith(f"{file}: holds a tensor of shape [176, 64], but "
                        f"model.layers.0.mlp.down_proj.weight has shape [64, 176]: the universal "
                        f"directory is damaged: rerun ds_to_universal"), err


@pytest.mark.parametrize("groups, expect", [
    ([{"lr": 1e-3, "betas": ("0.9", "0.95")}], "betas is '0.9', not a number"),
    ([{"lr": 1e-3, "betas": 0.9}], "betas is 0.9, not a pair of numbers"),
    ([{"lr": "fast"}], "lr is 'fast', not a number"),
    ([{"lr": 1e-3, "eps": float("nan")}], "eps is nan, not a finite number"),
])
def test_an_optimizer_hyperparameter_that_is_not_a_number_is_one_line(groups, expect, tmp_path,
                                                                       capsys):
    source = _universal(tmp_path / "ds")
    optimizer = source / "zero" / "optimizer_state.pt"
    torch.save({"param_groups": groups}, optimizer)
    err = _refused(["ckpt", "import-deepspeed", str(source), str(tmp_path / "out"), "--model",
                    "tiny"], capsys)
    assert err.endswith(f"{optimizer}: {expect}: the checkpoint is damaged"), err


def test_a_dcp_runs_hyperparameters_are_checked_as_numbers(tmp_path, capsys):
    group = {"lr": 1e-3, "betas": (0.9, "b"), "weight_decay": 0.0,
             "params": list(hf_tensor_shapes(TINY))}
    source = _save_dcp(tmp_path / "ck", {"model": _weights(), "optim": {"param_groups": [group]}})
    err = _refused(["ckpt", "import-dcp", str(source), str(tmp_path / "out"), "--model",
                    "tiny"], capsys)
    assert err.endswith(f"{source / '.metadata'}: betas is 'b', not a number: the checkpoint is "
                        f"damaged"), err
