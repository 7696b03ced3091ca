"""PyTorch Distributed Checkpoints: a real PyTorch run (4 gloo processes training transformers'
LlamaForCausalLM under FSDP2, or 2-way tensor parallel x 2-way FSDP, see tests/torch_llama.py)
saved with DCP resumes in hotjax on other strategies with torch's logits, Adam moments and next
update; exported back with `hotjax ckpt export-dcp`, torch loads it into the same sharded model.
"""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
import torch_llama
from helpers import python

from hotjax.checkpoint import meta as meta_lib
from hotjax.checkpoint import store
from hotjax.checkpoint.formats import dcp
from hotjax.checkpoint.training import restore_state
from hotjax.cli import main
from hotjax.data import Batch, MiniBatch
from hotjax.errors import UserError
from hotjax.models.hf import config_from_hf, params_to_hf_state
from hotjax.models.llama import abstract_params, bind, param_axes
from hotjax.optim import OptimConfig, make_optimizer
from hotjax.sharding.strategy import Strategy
from hotjax.sharding.table import StrategyTable
from hotjax.train import Trainer

CONFIG = config_from_hf({**torch_llama.CONFIG, "model_type": "llama"})
# torch's AdamW as the torch run has it: constant learning rate, no clipping, norms not decayed.
OPTIM = OptimConfig(lr=torch_llama.LR, b1=torch_llama.BETAS[0], b2=torch_llama.BETAS[1],
                    eps=torch_llama.EPS, weight_decay=torch_llama.WEIGHT_DECAY,
                    clip_norm=float("inf"), warmup_steps=0, min_lr_ratio=1.0, total_steps=10)
STRATEGIES = ("fsdp=8", "data=2,context=4")  # the vocabulary (263) splits over neither
LAYOUTS = ("fsdp", "tp_fsdp")  # tests/torch_llama.py's
DATA = torch_llama.batches()


def _torch(task: str, root: Path) -> None:
    """tests/torch_llama.py's `task` for every layout, in `root / layout`, in one process."""
    python(torch_llama.__file__, task, root, *LAYOUTS)


def _minibatch(ids: np.ndarray) -> MiniBatch:
    tokens = ids.astype(np.int32)
    positions = np.tile(np.arange(tokens.shape[1], dtype=np.int32), (tokens.shape[0], 1))
    return MiniBatch((Batch(tokens, np.ones_like(tokens), positions),))


@jax.jit
def _forward(params, tokens_BxT):
    positions_BxT = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
    return bind(CONFIG, params)(tokens_BxT, jnp.ones_like(tokens_BxT), positions_BxT)


def _logits(params, ids: np.ndarray) -> np.ndarray:
    return np.asarray(_forward(params, jnp.asarray(ids, jnp.int32)))


def _hf(tree) -> dict[str, np.ndarray]:
    return params_to_hf_state(jax.tree.map(np.asarray, tree), CONFIG)


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory) -> Path:
    """The torch runs of every layout, each in its directory `LAYOUT/` of the one returned (its
    DCP checkpoint and reference numbers), imported into a hotjax checkpoint `ck` from the
    command line."""
    root = tmp_path_factory.mktemp("torch")
    _torch("train", root)
    for layout in LAYOUTS:
        directory = root / layout
        (directory / "config.json").write_text(json.dumps({**torch_llama.CONFIG,
                                                           "model_type": "llama"}))
        assert main(["ckpt", "import-dcp", str(directory / "dcp"), str(directory / "ck"),
                     "--config", str(directory / "config.json")]) == 0
    return root


@pytest.fixture(params=LAYOUTS)
def torch_run(request, torch_runs) -> tuple[str, Path]:
    """One layout's torch run: its name and directory (see `torch_runs`)."""
    return request.param, torch_runs / request.param


def _resume(directory: Path, strategy: str, devices):
    table = StrategyTable.single(Strategy.parse(strategy), torch_llama.TOKENS, strategy)
    trainer = Trainer(CONFIG, OPTIM, table, devices)
    record = {"model": CONFIG.to_dict(), "tokenizer": {"identity": "torch"}, "data": {}}
    return trainer, restore_state(directory / "ck", trainer.home, record)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_torch_run_resumes_with_its_logits_moments_and_next_update(torch_run, strategy,
                                                                     devices):
    _, directory = torch_run
    check_resumed(*_resume(directory, strategy, devices), np.load(directory / "ref.npz"))


def check_resumed(trainer, resumed, reference) -> None:
    """A torch run resumed in hotjax (`restore_state`) has the run's logits on the evaluation
    batch, its Adam moments and step exactly, and after one step on the run's third batch, the
    run's third update: the reference numbers in `reference` (tests/torch_llama.py's)."""
    assert resumed.step == torch_llama.STEPS
    state = resumed.state
    np.testing.assert_allclose(_logits(state.params, DATA[-1]), reference["logits"],
                               atol=1e-4, rtol=1e-4)
    adam = optax_adam(state.opt_state)
    assert int(adam.count) == torch_llama.STEPS
    for field, tree in (("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):
        for name, x in _hf(tree).items():
            np.testing.assert_array_equal(x, reference[f"{field}/{name}"], err_msg=name)
    state, _, _ = trainer.step(state, _minibatch(DATA[torch_llama.STEPS]))
    for name, x in _hf(state.params).items():
        np.testing.assert_allclose(x, reference[f"next/{name}"], atol=1e-5, rtol=0,
                                   err_msg=name)


def optax_adam(opt_state):
    import optax

    (adam,) = [n for n in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(
        n, optax.ScaleByAdamState)) if isinstance(n, optax.ScaleByAdamState)]
    return adam


def test_exported_after_a_hotjax_step_torch_loads_it_into_the_sharded_model(torch_runs,
                                                                           devices):
    """Each layout's run, a step later in hotjax, exported and loaded into that layout's model
    (torch loads them all in one process)."""
    states = {}
    for layout in LAYOUTS:
        directory = torch_runs / layout
        trainer, resumed = _resume(directory, STRATEGIES[0], devices)
        state, _, _ = trainer.step(resumed.state, _minibatch(DATA[torch_llama.STEPS]))
        checkpoints = store.Checkpoints(directory / "after")
        record = meta_lib.record(step=3, source="test", items=[], model=CONFIG.to_dict(),
                                 optimizer=dataclasses.asdict(OPTIM))
        checkpoints.save(3, state.params, state.opt_state, record, None)
        checkpoints.close()
        assert main(["ckpt", "export-dcp", str(directory / "after"),
                     str(directory / "exported")]) == 0
        states[layout] = state
    _torch("load", torch_runs)
    for layout, state in states.items():
        loaded = np.load(torch_runs / layout / "loaded.npz")
        np.testing.assert_allclose(loaded["logits"], _logits(state.params, DATA[-1]),
                                   atol=1e-4, rtol=1e-4, err_msg=layout)
        adam = optax_adam(state.opt_state)
        for field, tree in (("param", state.params), ("exp_avg", adam.mu),
                            ("exp_avg_sq", adam.nu)):
            for name, x in _hf(tree).items():
                np.testing.assert_array_equal(loaded[f"{field}/{name}"], x,
                                              err_msg=f"{layout}: {name}")
                assert loaded[f"step/{name}"] == 3


def _rope_scores(q_w: np.ndarray, k_w: np.ndarray, x: np.ndarray, interleaved: bool):
    """Attention scores [heads, T, T] of one layer's Q/K weights with rotary embeddings, the way
    Hugging Face applies them (halves) or the way torchtitan does (complex pairs)."""
    hd, T = CONFIG.head_dim, x.shape[0]
    q = torch.from_numpy(x @ q_w.T).view(T, -1, hd)
    k = torch.from_numpy(x @ k_w.T).view(T, -1, hd)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    freqs = 1.0 / (CONFIG.rope_theta ** (torch.arange(0, hd, 2).double() / hd))
    angles = torch.outer(torch.arange(T).double(), freqs)  # [T, hd/2]
    if interleaved:
        turn = torch.polar(torch.ones_like(angles), angles)[:, None]
        q, k = (torch.view_as_real(torch.view_as_complex(t.double().reshape(T, -1, hd // 2, 2))
                                   * turn).flatten(2) for t in (q, k))
    else:
        cos, sin = (torch.cat([f(angles)] * 2, -1)[:, None] for f in (torch.cos, torch.sin))
        half = hd // 2

        def rotate(t):
            return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

        q, k = rotate(q.double()), rotate(k.double())
    return torch.einsum("qhd,khd->hqk", q, k).numpy()


# Reads the hotjax import alone, whichever layout the torch run had: one layout's.
@pytest.mark.parametrize("torch_run", LAYOUTS[:1], indirect=True)
def test_torchtitan_naming_round_trips_and_its_rotary_layout_gives_the_same_attention(torch_run,
                                                                                     tmp_path):
    _, directory = torch_run
    assert main(["ckpt", "export-dcp", str(directory / "ck"), str(tmp_path / "tt"),
                 "--naming", "torchtitan"]) == 0
    reader = torch_dcp.FileSystemReader(str(tmp_path / "tt"))
    keys = reader.read_metadata().state_dict_metadata
    assert "layers.1.attention.wq.weight" in keys and "output.weight" in keys
    assert "optimizer.state.layers.0.feed_forward.w1.weight.exp_avg" in keys
    weights = {k: torch.empty(keys[k].size) for k in ("layers.0.attention.wq.weight",
                                                      "layers.0.attention.wk.weight")}
    torch_dcp.load(weights, storage_reader=reader, no_dist=True)
    reference = np.load(directory / "ref.npz")
    x = np.random.default_rng(0).normal(size=(12, CONFIG.dim)).astype(np.float32)
    hf = _rope_scores(reference["param/model.layers.0.self_attn.q_proj.weight"],
                      reference["param/model.layers.0.self_attn.k_proj.weight"], x, False)
    titan = _rope_scores(weights["layers.0.attention.wq.weight"].numpy(),
                         weights["layers.0.attention.wk.weight"].numpy(), x, True)
    np.testing.assert_allclose(titan, hf, rtol=1e-6, atol=1e-6)
    # ...and back: detected as torchtitan's, the same arrays as the first import.
    assert main(["ckpt", "import-dcp", str(tmp_path / "tt"), str(tmp_path / "back"),
                 "--config", str(directory / "config.json")]) == 0
    first, back = (_host_state(p) for p in (directory / "ck", tmp_path / "back"))
    same = jax.tree.map(np.array_equal, first, back)
    assert all(jax.tree.leaves(same)), same


def _host_state(path: Path) -> dict:
    """A checkpoint's parameters and optimizer state, as numpy arrays."""
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype),
                          abstract_params(CONFIG))
    opt_state = jax.eval_shape(make_optimizer(OPTIM, param_axes(CONFIG)).init, params)
    return store.restore(path, {store.PARAMS: params, store.OPT_STATE: opt_state}).arrays


# ---------------------------------------------------------------------------- bad input

def _save_torch(directory: Path, state: dict) -> Path:
    torch_dcp.save(state, storage_writer=torch_dcp.FileSystemWriter(str(directory)),
                   no_dist=True)
    return directory


@pytest.fixture(scope="module")
def weights() -> dict:
    """The torch model's weights, as torch tensors by Hugging Face name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**torch_llama.CONFIG))
    return {name: x.detach().clone() for name, x in model.state_dict().items()}


def _error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_bad_torch_checkpoints_are_one_line_errors_naming_the_tensor_and_write_nothing(
        weights, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**torch_llama.CONFIG, "model_type": "llama"}))

    def rejected(name: str, state: dict, *words: str) -> None:
        source = _save_torch(tmp_path / name, state)
        out = tmp_path / f"{name}-out"
        err = _error(["ckpt", "import-dcp", str(source), str(out), "--config", str(config)],
                     capsys)
        assert all(w in err for w in words), err
        assert not out.exists()

    missing = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    rejected("missing", {"model": missing}, "lacks the weight model.layers.1.mlp.up_proj.weight")
    wrong = {**weights, "model.norm.weight": torch.zeros(65)}
    rejected("shape", {"model": wrong}, "model.model.norm.weight", "[65]", "[64]")
    extra = {**weights, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}
    rejected("extra", {"model": extra}, "model.model.layers.0.self_attn.q_proj.bias", "lacks")
    state = {name: {"exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.zeros_like(w),
                    "step": torch.tensor(2.0)} for name, w in weights.items()}
    state["lm_head.weight"]["step"] = torch.tensor(3.0)
    rejected("steps", {"model": weights, "optim": {"state": state}},
             "optim.state.lm_head.weight.step is 3", "must agree")
    del state["lm_head.weight"]["exp_avg_sq"]
    rejected("partial", {"model": weights, "optim": {"state": state}},
             "no exp_avg_sq for lm_head.weight")
    err = _error(["ckpt", "import-dcp", str(tmp_path), str(tmp_path / "x"), "--config",
                  str(config)], capsys)
    assert "no .metadata" in err and not (tmp_path / "x").exists()


def test_a_truncated_or_damaged_torch_checkpoint_is_refused(weights, tmp_path, capsys):
    source = _save_torch(tmp_path / "dcp", {"model": weights})
    (shard,) = source.glob("*.distcp")
    data = shard.read_bytes()
    err = _error(["ckpt", "import-dcp", str(source), str(tmp_path / "out"), "--model", "tiny"],
                 capsys)
    assert "has shape [160, 64], but the model needs [176, 64]" in err  # tiny's is another
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**torch_llama.CONFIG, "model_type": "llama"}))
    argv = ["ckpt", "import-dcp", str(source), str(tmp_path / "out"), "--config", str(config)]
    shard.write_bytes(data[: len(data) // 2])
    err = _error(argv, capsys)
    assert f"{shard}: holds {len(data) // 2} bytes, but tensor model.model" in err, err
    shard.write_bytes(data[:200] + bytes(len(data) - 200))  # the same size, zeros inside
    err = _error(argv, capsys)
    assert "truncated or damaged" in err and str(source) in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("torch_run", LAYOUTS[:1], indirect=True)
def test_export_refuses_an_existing_output_and_leaves_it_untouched(torch_run, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep").write_text("x")
    err = _error(["ckpt", "export-dcp", str(torch_run[1] / "ck"), str(out)], capsys)
    assert "exists" in err and (out / "keep").read_text() == "x"
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_read_dcp_reports_the_torch_hyperparameters(torch_run):
    state = dcp.read_dcp(torch_run[1] / "dcp", CONFIG)
    assert state.step == torch_llama.STEPS and state.naming == "hf"
    assert state.hyperparameters == {
        "lr": torch_llama.LR, "betas": list(torch_llama.BETAS), "eps": torch_llama.EPS,
        "weight_decay_matrix": torch_llama.WEIGHT_DECAY, "weight_decay_norm": 0.0}
    with pytest.raises(UserError, match="embed_tokens.weight, which .* lacks in torchtitan"):
        dcp.read_dcp(torch_run[1] / "dcp", dataclasses.replace(CONFIG, n_layers=3),
                     naming="torchtitan")


def resumed_runs(checkpoint: Path, tmp_path: Path,
                 layouts: dict[str, list[str]]) -> dict[str, list[dict]]:
    """Each layout's metrics, step by step, of `hotjax train --resume-from checkpoint` for two
    steps on a corpus of random words; no --model: the run trains the checkpoint's."""
    corpus = tmp_path / "corpus.jsonl"
    rng = np.random.default_rng(0)
    corpus.write_text("".join(json.dumps({"text": "".join(map(chr, rng.integers(97, 123, n)))})
                              + "\n" for n in rng.integers(20, 60, 200)))
    runs = {}
    for name, layout in layouts.items():
        metrics = tmp_path / f"{name}.jsonl"
        assert main(["train", "--resume-from", str(checkpoint), "--data", str(corpus),
                     "--tokenizer", "bytes", "--context", "64", "--batch-tokens", "1024",
                     "--compute-dtype", "float32", "--steps", str(torch_llama.STEPS + 2),
                     "--log-every", "1", "--metrics-jsonl", str(metrics), *layout]) == 0
        runs[name] = [json.loads(line) for line in metrics.read_text().splitlines()]
    return runs


@pytest.mark.parametrize("torch_run", LAYOUTS[:1], indirect=True)
def test_hotjax_train_resumes_the_torch_run_with_its_model_on_any_layout(torch_run, tmp_path):
    """No --model: the run takes the checkpoint's (a non-preset architecture), starts at torch's
    step, and trains the same on 8 devices as on one."""
    runs = resumed_runs(torch_run[1] / "ck", tmp_path,
                        {"one": ["--devices", "1", "--strategy", "data=1"],
                         "fsdp": ["--strategy", "fsdp=8"]})
    assert [r["step"] for r in runs["one"]] == [3, 4] == [r["step"] for r in runs["fsdp"]]
    np.testing.assert_allclose([r["loss"] for r in runs["fsdp"]],
                               [r["loss"] for r in runs["one"]], rtol=0, atol=1e-5)
