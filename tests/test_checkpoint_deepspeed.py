"""DeepSpeed checkpoints: a real DeepSpeed run (2 gloo processes training transformers'
LlamaForCausalLM with GQA under ZeRO-1, 2 and 3, see tests/deepspeed_train.py), imported from
its rank files and from `ds_to_universal`'s universal directory, resumes in hotjax with
DeepSpeed's logits, Adam moments and next update; exported with `hotjax ckpt export-universal`
after a hotjax step, DeepSpeed resumes it under ZeRO-2 on 1 and 2 ranks and under ZeRO-3.
"""

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import deepspeed_train
import numpy as np
import pytest
import torch
import torch_llama
from helpers import python
from test_checkpoint_dcp import (
    CONFIG,
    _hf,
    _minibatch,
    check_resumed,
    optax_adam,
    resumed_runs,
)
from test_checkpoint_dcp import OPTIM as TORCH_OPTIM

from hotjax.checkpoint import dirs, store
from hotjax.checkpoint import meta as meta_lib
from hotjax.cli import main

pytest.importorskip("deepspeed")

# DeepSpeed's AdamW as the run has it: constant learning rate, its default clipping at norm 1.
OPTIM = dataclasses.replace(TORCH_OPTIM, clip_norm=1.0)
DATA = torch_llama.batches()
SOURCES = ("ds", "universal")  # the rank files, and ds_to_universal's output


def _deepspeed(task: str, directory: Path) -> None:
    python(deepspeed_train.__file__, task, directory)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> Path:
    """The DeepSpeed runs' directory (`zero{1,2,3}/{ds,universal,ref.npz}`) and the model's
    config.json. Kept in pytest's cache, keyed by the scripts and DeepSpeed's version."""
    import deepspeed

    scripts = b"".join(Path(m.__file__).read_bytes() for m in (deepspeed_train, torch_llama))
    key = hashlib.sha256(scripts + deepspeed.__version__.encode()).hexdigest()[:16]
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    root = Path(cache.mkdir("deepspeed-runs")) if cache else tmp_path_factory.mktemp("cache")
    cached = root / key
    if not (cached / "complete").is_file():
        scratch = tmp_path_factory.mktemp("deepspeed")
        _deepspeed("train", scratch)
        (scratch / "config.json").write_text(json.dumps({**torch_llama.CONFIG,
                                                         "model_type": "llama"}))
        shutil.rmtree(cached, ignore_errors=True)
        shutil.copytree(scratch, cached)
        (cached / "complete").write_text("")
    return cached


def _import(runs: Path, stage: int, source: str, out: Path) -> Path:
    assert main(["ckpt", "import-deepspeed", str(runs / f"zero{stage}" / source), str(out),
                 "--config", str(runs / "config.json")]) == 0
    return out


def _resume(path: Path, strategy: str, devices):
    from hotjax.checkpoint.training import restore_state
    from hotjax.sharding.strategy import Strategy
    from hotjax.sharding.table import StrategyTable
    from hotjax.train import Trainer

    table = StrategyTable.single(Strategy.parse(strategy), torch_llama.TOKENS, strategy)
    trainer = Trainer(CONFIG, OPTIM, table, devices)
    record = {"model": CONFIG.to_dict(), "tokenizer": {"identity": "torch"}, "data": {}}
    return trainer, restore_state(path, trainer.home, record)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("stage", deepspeed_train.STAGES)
def test_a_deepspeed_run_resumes_with_its_logits_moments_and_next_update(runs, stage, source,
                                                                         devices, tmp_path):
    reference = np.load(runs / f"zero{stage}" / "ref.npz")
    trainer, resumed = _resume(_import(runs, stage, source, tmp_path / "ck"), "fsdp=8", devices)
    assert int(reference["step"]) == torch_llama.STEPS
    for name, x in _hf(resumed.state.params).items():  # the fp32 master weights
        np.testing.assert_array_equal(x, reference[f"param/{name}"], err_msg=name)
    check_resumed(trainer, resumed, reference)


def test_hotjax_train_resumes_a_deepspeed_import_under_tensor_and_fsdp_parallelism(runs,
                                                                                  tmp_path):
    """ZeRO-3 over 2 data-parallel ranks, imported, continues under `hotjax train
    --resume-from` from DeepSpeed's step with its model, on 4 devices as fsdp=2 x tensor=2
    as on one (whose resume the test above checks against DeepSpeed's own numbers)."""
    checkpoint = _import(runs, 3, "ds", tmp_path / "ck")
    resumed = resumed_runs(checkpoint, tmp_path,
                           {"one": ["--devices", "1", "--strategy", "data=1"],
                            "fsdp-tensor": ["--devices", "4", "--strategy", "fsdp=2,tensor=2"]})
    steps = [torch_llama.STEPS + 1, torch_llama.STEPS + 2]
    assert [r["step"] for r in resumed["one"]] == steps == [r["step"] for r in
                                                             resumed["fsdp-tensor"]]
    np.testing.assert_allclose([r["loss"] for r in resumed["fsdp-tensor"]],
                               [r["loss"] for r in resumed["one"]], rtol=0, atol=1e-5)


def test_the_import_records_the_deepspeed_run_and_its_adamw(runs, tmp_path, capsys):
    _import(runs, 2, "ds", tmp_path / "ck")
    printed = capsys.readouterr().out
    assert "step 2, parameters, AdamW moments, hf naming, from deepspeed ZeRO-2" in printed
    meta = meta_lib.read(dirs.find(tmp_path / "ck"))
    assert meta["optimizer"] == {
        "name": "adamw", "source": "torch.optim.AdamW", "loss_scaling": "off", "lr": torch_llama.LR,
        "betas": list(torch_llama.BETAS), "eps": torch_llama.EPS,
        "weight_decay_matrix": torch_llama.WEIGHT_DECAY, "weight_decay_norm": 0.0,
        "clip_norm": 1.0}
    assert meta["written_from"]["foreign"]["data_parallel"] == 2


def test_exported_after_a_hotjax_step_deepspeed_resumes_it_on_any_zero_stage_and_size(
        runs, devices, tmp_path):
    trainer, resumed = _resume(_import(runs, 2, "ds", tmp_path / "ck"), "data=2,context=4",
                               devices)
    state, _, _ = trainer.step(resumed.state, _minibatch(DATA[torch_llama.STEPS]))
    checkpoints = store.Checkpoints(tmp_path / "after")
    record = meta_lib.record(step=3, source="test", items=[], model=CONFIG.to_dict(),
                             optimizer=dataclasses.asdict(OPTIM))
    checkpoints.save(3, state.params, state.opt_state, record, None)
    checkpoints.close()
    assert main(["ckpt", "export-universal", str(tmp_path / "after"),
                 str(tmp_path / "exported")]) == 0
    _deepspeed("load", tmp_path)
    adam = optax_adam(state.opt_state)
    saved = {field: _hf(tree) for field, tree in (("param", state.params), ("exp_avg", adam.mu),
                                                  ("exp_avg_sq", adam.nu))}
    after, _, _ = trainer.step(state, _minibatch(DATA[-1]))  # donates `state`
    for stage, ranks in deepspeed_train.LOADS:
        loaded = np.load(tmp_path / f"loaded-zero{stage}-{ranks}.npz")
        assert loaded["step"] == 3
        for field, arrays in saved.items():
            for name, x in arrays.items():
                np.testing.assert_array_equal(loaded[f"{field}/{name}"], x, err_msg=name)
        for name, x in _hf(after.params).items():
            np.testing.assert_allclose(loaded[f"next/{name}"], x, atol=1e-5, rtol=0,
                                       err_msg=f"ZeRO-{stage} on {ranks} ranks: {name}")


# ---------------------------------------------------------------------------- bad input

def _error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def _rewrite(file: Path, change) -> None:
    """A DeepSpeed .pt file rewritten with `change` applied to what it holds."""
    from hotjax.checkpoint.formats.deepspeed import load_pt

    loaded = load_pt(file)  # memory-mapped: written beside, then renamed over the file
    change(loaded)
    torch.save(loaded, file.with_suffix(".new"))
    file.with_suffix(".new").replace(file)


def test_bad_deepspeed_checkpoints_are_one_line_errors_naming_the_file_and_write_nothing(
        runs, tmp_path, capsys):
    def rejected(stage: int, source: str, damage, *words: str) -> None:
        copy = tmp_path / f"copy-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(runs / f"zero{stage}" / source, copy)
        step = copy / "global_step2" if (copy / "global_step2").is_dir() else copy
        damage(step)
        out = tmp_path / "out"
        err = _error(["ckpt", "import-deepspeed", str(copy), str(out), "--config",
                      str(runs / "config.json")], capsys)
        assert err.startswith("hotjax: error: ") and all(w in err for w in words), err
        assert not out.exists()

    optim_1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rejected(2, "ds", lambda d: (d / optim_1).unlink(), f"{optim_1}: missing",
             "dp_world_size 2")
    rejected(3, "ds", lambda d: (d / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink(),
             "zero_pp_rank_1_mp_rank_00_model_states.pt: missing")

    def dp(size: int):
        return lambda d: _rewrite(sorted(d.glob("*model_states.pt"))[0],  # rank 0's
                                  lambda m: m.update(dp_world_size=size))

    rejected(1, "ds", dp(1), optim_1, "data-parallel rank 1", "dp_world_size 1")
    rejected(3, "ds", dp(3), "zero_pp_rank_2_mp_rank_00_optim_states.pt: missing")

    def shapes(d: Path) -> None:
        for file in d.glob("*model_states.pt"):
            _rewrite(file, lambda m: m["param_shapes"][0].update(
                {"lm_head.weight": torch.Size([262, 64])}))

    rejected(2, "ds", shapes, "slices of lm_head.weight hold 16832 elements",
             "param_shapes gives it [262, 64]")
    rejected(3, "ds", shapes, "zero_pp_rank_0_mp_rank_00_optim_states.pt: its flat groups",
             "dp_world_size 2")
    up = "model.layers.1.mlp.up_proj.weight"
    rejected(1, "universal", lambda d: (d / "zero" / up / "exp_avg_sq.pt").unlink(),
             f"zero/{up}: lacks exp_avg_sq.pt")
    rejected(2, "ds", lambda d: (d / "layer_01-model_00-model_states.pt").write_bytes(b""),
             "layer_01-model_00-model_states.pt: a pipeline-parallel DeepSpeed checkpoint")
    rejected(2, "ds", lambda d: (d / "expert_0_mp_rank_00_model_states.pt").write_bytes(b""),
             "expert_0_mp_rank_00_model_states.pt: a mixture-of-experts")
    rejected(2, "ds", lambda d: shutil.copy(d / optim_1, d / optim_1.replace("mp_rank_00",
                                                                           "mp_rank_01")),
             "a tensor-parallel DeepSpeed checkpoint")
    err = _error(["ckpt", "import-deepspeed", str(runs / "zero2" / "ds"), str(tmp_path / "x"),
                  "--model", "tiny"], capsys)
    assert "has shape [160, 64], but the model needs [176, 64]" in err, err
    assert not (tmp_path / "x").exists()


def test_a_zero2_import_holds_a_few_tensors_at_a_time_not_the_rank_files(tmp_path):
    # Measured against the same import of a 2-layer model, which starts the same readers: the
    # growth is a few of our largest (stacked) parameters (a stacked one and its layers, for
    # the weights and each moment: 0.34 GB here); keeping every rank file open, its pages once
    # read stayed in memory, and the import grew by 1.4 times the checkpoint (0.94 GB).
    from test_checkpoint import import_growth

    from hotjax.checkpoint.formats import fakes  # ZeRO-2: random weights and moments
    from hotjax.models.hf import config_to_hf

    def write(directory: Path, model) -> list:
        fakes.write_zero(directory, model, dp=4)
        (directory / "config.json").write_text(json.dumps(config_to_hf(model, "float32")))
        return ["import-deepspeed", directory]

    growth, nbytes, largest = import_growth(tmp_path, write)
    assert growth < 8 * largest < nbytes, (growth, largest, nbytes)
