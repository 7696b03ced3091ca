"""Megatron-Core torch_dist checkpoints: real Megatron-Core runs on CPU
(tests/megatron_core_save.py: a GQA LLaMA, two distributed-optimizer Adam steps) under TP=2,
and under TP=1 · DP=2 (tied embeddings, three buckets), each saved with per-parameter optimizer
state and with the default bucketed state, import to exactly the tensors each rank's modules
and optimizer held; every refusal is one line naming the file and the fix, and writes
nothing."""

import json
import shutil
from pathlib import Path

import megatron.core  # noqa: F401 - the runs need it: missing, this file fails, never skips
import megatron_core_save as run
import numpy as np
import pytest
import torch
from helpers import python

from hotjax.checkpoint import dirs
from hotjax.checkpoint import meta as meta_lib
from hotjax.checkpoint.formats import dcp, pivot
from hotjax.cli import main
from hotjax.models.hf import config_to_hf
from hotjax.models.llama import LlamaConfig

N, K, H, F, D = run.HEADS, run.GROUPS, run.D // run.HEADS, run.FFN, run.D
RUNS = {"tp2": ("2", "1", "untied"), "dp2": ("1", "2", "tied", "20000")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Each run of RUNS in its directory of the one returned: both in one process."""
    root = tmp_path_factory.mktemp("megatron-core")
    python(run.__file__, *(",".join((str(root / name), *flags)) for name, flags in RUNS.items()))
    return root


def _reference(local: dict[str, torch.Tensor], name: str, rank: int, tp: int, field: str):
    """(hotjax parameter, index, value) of one rank's `field` (its weight, or Adam's state) of
    module tensor `name`: Megatron splits query groups, heads, MLP columns and vocabulary rows
    over tensor-parallel ranks."""
    x = local[field + name].numpy()
    parts = name.split(".")
    if name.startswith("decoder.layers."):
        layer, module = int(parts[2]), ".".join(parts[3:])
        if module == "input_layernorm.weight":
            yield "attn_norm", (layer,), x
        elif module == "pre_mlp_layernorm.weight":
            yield "mlp_norm", (layer,), x
        elif module == "self_attention.linear_qkv.weight":  # its groups: N/K queries, k, v
            per = K // tp
            groups = x.reshape(per, N // K + 2, H, D)
            for j in range(per):
                g = rank * per + j
                for i in range(N // K):
                    yield "wq", (layer, slice(None), g * (N // K) + i), groups[j, i].T
                yield "wk", (layer, slice(None), g), groups[j, -2].T
                yield "wv", (layer, slice(None), g), groups[j, -1].T
        elif module == "self_attention.linear_proj.weight":
            heads = slice(rank * N // tp, (rank + 1) * N // tp)
            yield "wo", (layer, heads), x.T.reshape(N // tp, H, D)
        elif module == "mlp.linear_fc1.weight":  # this rank's gate rows, then its up rows
            columns = (layer, slice(None), slice(rank * F // tp, (rank + 1) * F // tp))
            yield "w_gate", columns, x[:F // tp].T
            yield "w_up", columns, x[F // tp:].T
        else:
            yield "w_down", (layer, slice(rank * F // tp, (rank + 1) * F // tp)), x.T
    elif name == "decoder.final_layernorm.weight":
        yield "final_norm", (), x
    else:
        rows = slice(rank * run.VOCAB // tp, (rank + 1) * run.VOCAB // tp)
        if name == "embedding.word_embeddings.weight":
            yield "embed", (rows,), x
        else:
            yield "lm_head", (slice(None), rows), x.T


def _check(tree, locals_, tp: int, field: str = "") -> int:
    compared = 0
    for rank in range(tp):
        for name in (n for n in locals_[rank] if "/" not in n):
            for param, index, value in _reference(locals_[rank], name, rank, tp, field):
                array = tree[param] if param in tree else tree["layers"][param]
                np.testing.assert_array_equal(np.asarray(array)[index], value,
                                              err_msg=f"{field}{name} -> {param}{index}")
                compared += value.size
    return compared


def _locals(directory: Path, tp: int, dp: int) -> list[dict[str, torch.Tensor]]:
    """Each tensor-parallel rank's parameters and Adam's state of each (`exp_avg/NAME`, ...),
    whole: a data-parallel rank holds a slice of the state (ranks count tensor ranks first)."""
    files = [torch.load(directory / f"local_{r}.pt") for r in range(tp * dp)]
    out = []
    for t in range(tp):
        mine = files[t::tp]
        merged = {n: x for n, x in mine[0].items() if "/" not in n}
        for name, p in list(merged.items()):
            for field in ("exp_avg", "exp_avg_sq"):
                flat = torch.full((p.numel(),), float("nan"))
                for f in (f for f in mine if f"start/{name}" in f):
                    start, x = int(f[f"start/{name}"]), f[f"{field}/{name}"]
                    flat[start:start + x.numel()] = x
                merged[f"{field}/{name}"] = flat.reshape(p.shape)
        out.append(merged)
    return out


@pytest.mark.parametrize("fmt", run.FORMATS)
def test_a_tp2_run_imports_to_its_modules_weights_and_its_optimizers_moments(fmt, runs,
                                                                             tmp_path, capsys):
    assert main(["ckpt", "import-megatron-core", str(runs / "tp2" / fmt),
                 str(tmp_path / "ck")]) == 0
    assert "step 2, parameters, AdamW moments" in capsys.readouterr().out
    config, _, params, step, state = pivot.read_for_export(tmp_path / "ck")
    assert (config.n_heads, config.n_kv_heads, config.ffn_dim, config.vocab_size,
            config.tie_embeddings) == (N, K, F, run.VOCAB, False)
    locals_ = _locals(runs / "tp2", 2, 1)
    total = sum(x.numel() for r in locals_ for n, x in r.items() if "/" not in n)
    assert _check(params, locals_, 2) == total
    assert _check(state["exp_avg"], locals_, 2, "exp_avg/") == total
    assert _check(state["exp_avg_sq"], locals_, 2, "exp_avg_sq/") == total
    assert step == run.ITERATION
    meta = meta_lib.read(dirs.find(tmp_path / "ck"))
    assert meta["optimizer"] == {
        "name": "adamw", "source": "torch.optim.AdamW", "loss_scaling": "off", "lr": run.LR,
        "eps": run.EPS, "betas": list(run.BETAS), "weight_decay_matrix": run.WEIGHT_DECAY,
        "weight_decay_norm": 0.0}


def test_a_data_parallel_run_with_bucketed_optimizer_state_imports_its_moments(runs, tmp_path,
                                                                              capsys):
    """Three buckets, each split between two data-parallel ranks, the norms padded to 64."""
    iteration = runs / "dp2" / "dp_reshardable" / f"iter_{run.ITERATION:07d}"
    assert main(["ckpt", "import-megatron-core", str(iteration), str(tmp_path / "ck")]) == 0
    assert "step 2, parameters, AdamW moments" in capsys.readouterr().out
    config, _, params, step, state = pivot.read_for_export(tmp_path / "ck")
    assert config.tie_embeddings and "lm_head" not in params and step == 2
    locals_ = _locals(runs / "dp2", 1, 2)
    total = sum(x.numel() for n, x in locals_[0].items() if "/" not in n)
    assert _check(params, locals_, 1) == total
    assert _check(state["exp_avg"], locals_, 1, "exp_avg/") == total
    assert _check(state["exp_avg_sq"], locals_, 1, "exp_avg_sq/") == total
    assert main(["ckpt", "import-megatron-core", str(iteration), str(tmp_path / "weights"),
                 "--weights-only"]) == 0
    assert "parameters only" in capsys.readouterr().out
    _, _, params, step, state = pivot.read_for_export(tmp_path / "weights")
    assert step is None and state is None and _check(params, locals_, 1) == total


# ---------------------------------------------------------------------------- bad input

def _error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and err.startswith("hotjax: error: "), err
    assert not Path(argv[3]).exists()
    return err


def _copy(runs: Path, tmp_path: Path, fmt: str = "fully_reshardable", name: str = "tp2"
          ) -> Path:
    iteration = tmp_path / "mc" / f"iter_{run.ITERATION:07d}"
    shutil.copytree(runs / name / fmt / iteration.name, iteration)
    shutil.copy(runs / name / fmt / "latest_checkpointed_iteration.txt", iteration.parent)
    return iteration


def _with_args(iteration: Path, **changes) -> None:
    """common.pt with its args' fields changed, or without args if no change is given."""
    common = torch.load(iteration / "common.pt", weights_only=False)
    for field, value in changes.items():
        setattr(common["args"], field, value)
    if not changes:
        del common["args"]
    torch.save(common, iteration / "common.pt")


def _with_moe_tensor(iteration: Path) -> None:
    """The checkpoint saved again by torch DCP with one expert's weight beside the model's."""
    metadata = dcp.read_metadata(iteration)
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
             for k, v in metadata.state_dict_metadata.items() if hasattr(v, "properties")}
    dcp.load(iteration, state)
    state["decoder.layers.mlp.experts.local_experts.0.linear_fc1.weight"] = torch.zeros(2, 8, 8)
    for file in iteration.glob("*distcp"):
        file.unlink()
    (iteration / ".metadata").unlink()
    torch.distributed.checkpoint.save(
        state, storage_writer=torch.distributed.checkpoint.FileSystemWriter(str(iteration)),
        no_dist=True)


def _config(tmp_path: Path, ffn_dim: int) -> Path:
    config = LlamaConfig(vocab_size=run.VOCAB, dim=D, n_layers=run.LAYERS, n_heads=N,
                         n_kv_heads=K, ffn_dim=ffn_dim, head_dim=H, tie_embeddings=False,
                         compute_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(config, "float32")))
    return tmp_path / "config.json"


@pytest.mark.parametrize("case", ["no metadata.json", "another backend", "missing distcp",
                                  "shape disagrees", "no args", "mixture of experts",
                                  "buckets in another order", "pipeline-parallel buckets",
                                  "optimizer state saved wrong"])
def test_bad_input_is_one_line_naming_the_problem_and_its_fix_and_nothing_is_written(
        case, runs, tmp_path, capsys):
    # Megatron-Core 0.16.1 saves the three-bucket DP=2 run's fully reshardable state wrong.
    iteration = _copy(runs, tmp_path, "dp_reshardable" if "buckets" in case else
                      "fully_reshardable", "dp2" if case == "optimizer state saved wrong"
                      else "tp2")
    extra, expect = [], []
    if case == "no metadata.json":
        (iteration / "metadata.json").unlink()
        expect = ["holds no metadata.json", "torch_dist"]
    elif case == "another backend":
        (iteration / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
        expect = ["sharded_backend is 'zarr'", "--ckpt-format torch_dist"]
    elif case == "missing distcp":
        (iteration / "__1_0.distcp").unlink()
        expect = [str(iteration / "__1_0.distcp"), "missing", "copy the whole"]
    elif case == "shape disagrees":  # a config with a wider MLP than the run's
        _with_args(iteration)
        extra = ["--config", str(_config(tmp_path, ffn_dim=F + 16))]
        expect = [f"decoder.layers.mlp.linear_fc1.weight has shape [2, 352, {D}]", "--config"]
    elif case == "no args":
        _with_args(iteration)
        expect = ["records no Megatron args", "--config"]
    elif case == "buckets in another order":  # Transformer Engine's: linear_proj comes first
        _with_args(iteration, transformer_impl="transformer_engine")
        expect = ["buckets of rank 0", "transformer_engine layer spec", "--weights-only"]
    elif case == "optimizer state saved wrong":
        expect = ["the optimizer's fp32 copy of", "elements differ", "--weights-only"]
    elif case == "pipeline-parallel buckets":
        _with_args(iteration, pipeline_model_parallel_size=2)
        expect = ["pipeline parallelism 2", "--weights-only"]
    else:
        _with_moe_tensor(iteration)
        expect = ["experts", "mixture-of-experts"]
    err = _error(["ckpt", "import-megatron-core", str(iteration.parent), str(tmp_path / "out"),
                  *extra], capsys)
    assert all(e in err for e in expect), err
