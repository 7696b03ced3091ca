"""Megatron-LM LLaMA checkpoints: a TP=2 · PP=2 set of `model_optim_rng.pt` rank files, laid out
here as Megatron-Core lays them out (fused QKV under GQA, fused gate/up, padded vocabulary, bf16)
from a known model, imports to exactly its arrays, the same as a hand-written manifest of the
same files; every inconsistency names the rank file and the tensor."""

import argparse
import dataclasses
import enum
import json
import random
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import TINY

from hotjax.checkpoint import model, store
from hotjax.checkpoint.formats import foreign, megatron, shards
from hotjax.checkpoint.manifest import load as load_manifest
from hotjax.cli import main
from hotjax.errors import UserError
from hotjax.models.hf import config_to_hf, hf_tensor_shapes, params_to_hf_state
from hotjax.models.llama import LlamaConfig, abstract_params, init_params

# GQA (8 query heads in 4 groups), an odd vocabulary, two layers on each of two stages.
CONFIG = dataclasses.replace(TINY, n_layers=4)
TP, PP, ITERATION = 2, 2, 5
V, D, F, H = CONFIG.vocab_size, CONFIG.dim, CONFIG.ffn_dim, CONFIG.head_dim
N, K = CONFIG.n_heads, CONFIG.n_kv_heads
V_PAD = 512  # Megatron pads to a multiple of 128 * tp
LAYERS = CONFIG.n_layers // PP
ITER_DIR = f"iter_{ITERATION:07d}"
ARGS = dict(num_layers=CONFIG.n_layers, hidden_size=D, ffn_hidden_size=F, num_attention_heads=N,
            group_query_attention=True, num_query_groups=K, kv_channels=H, norm_epsilon=1e-5,
            rotary_base=10000, untie_embeddings_and_output_weights=True, seq_length=1024,
            max_position_embeddings=1024, padded_vocab_size=V_PAD, position_embedding_type="rope",
            normalization="RMSNorm", swiglu=True, tensor_model_parallel_size=TP,
            pipeline_model_parallel_size=PP, params_dtype=torch.bfloat16)

# A layer's norms under Transformer Engine's spec (fused into the linears that follow them) and
# under the local one.
NORMS = {"te": ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"),
         "local": ("input_layernorm.weight", "pre_mlp_layernorm.weight")}


@pytest.fixture(scope="module")
def params():
    """A model whose weights bf16 holds exactly, as a bf16 Megatron run's would be."""
    def bf16_exact(x):
        return np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32)

    return jax.tree.map(bf16_exact, init_params(CONFIG, seed=4))


@pytest.fixture(scope="module")
def garbage():
    """The padding rows of the embedding and the output layer: never imported."""
    rng = np.random.default_rng(5)
    return {name: rng.normal(size=(V_PAD - V, D)).astype(ml_dtypes.bfloat16).astype(np.float32)
            for name in ("embed", "head")}


def _rank_state(hf: dict[str, np.ndarray], garbage: dict, t: int, s: int, spec: str) -> dict:
    """Megatron-Core's state dict of tensor rank t on pipeline stage s."""
    def tensor(x):
        return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16)

    def vocab_slice(name, rows):
        return tensor(np.split(np.concatenate([hf[name], rows]), TP)[t])

    groups = K // TP  # the query groups rank t holds
    state: dict = {}
    if s == 0:
        state["embedding.word_embeddings.weight"] = vocab_slice("model.embed_tokens.weight",
                                                                garbage["embed"])
    for local in range(LAYERS):
        hf_layer, layer = f"model.layers.{s * LAYERS + local}.", f"decoder.layers.{local}."
        q = hf[hf_layer + "self_attn.q_proj.weight"].reshape(K, N // K * H, D)
        k = hf[hf_layer + "self_attn.k_proj.weight"].reshape(K, H, D)
        v = hf[hf_layer + "self_attn.v_proj.weight"].reshape(K, H, D)
        qkv = np.concatenate([q, k, v], axis=1)[t * groups:(t + 1) * groups]
        gate, up = (np.split(hf[hf_layer + f"mlp.{x}_proj.weight"], TP)[t] for x in ("gate", "up"))
        state.update({
            layer + NORMS[spec][0]: tensor(hf[hf_layer + "input_layernorm.weight"]),
            layer + "self_attention.linear_qkv.weight": tensor(qkv.reshape(-1, D)),
            layer + "self_attention.linear_qkv._extra_state": None,
            layer + "self_attention.core_attention._extra_state": None,
            layer + "self_attention.linear_proj.weight":
                tensor(np.split(hf[hf_layer + "self_attn.o_proj.weight"], TP, axis=1)[t]),
            layer + "self_attention.linear_proj._extra_state": None,
            layer + NORMS[spec][1]: tensor(hf[hf_layer + "post_attention_layernorm.weight"]),
            layer + "mlp.linear_fc1.weight": tensor(np.concatenate([gate, up])),
            layer + "mlp.linear_fc2.weight":
                tensor(np.split(hf[hf_layer + "mlp.down_proj.weight"], TP, axis=1)[t]),
        })
    if s == PP - 1:
        state["decoder.final_layernorm.weight"] = tensor(hf["model.norm.weight"])
        state["output_layer.weight"] = vocab_slice("lm_head.weight", garbage["head"])
        state["output_layer._extra_state"] = None
    return state


def _rank_file(root: Path, t: int, s: int) -> Path:
    return root / ITER_DIR / f"mp_rank_{t:02d}_{s:03d}" / "model_optim_rng.pt"


def write_megatron(root: Path, params, garbage, spec: str = "te") -> Path:
    """A Megatron checkpoint root: the tracker file and one iteration's rank files."""
    hf = params_to_hf_state(params, CONFIG)
    for t in range(TP):
        for s in range(PP):
            file = _rank_file(root, t, s)
            file.parent.mkdir(parents=True)
            model = _rank_state(hf, garbage, t, s, spec)
            rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                   "torch_rng_state": torch.get_rng_state()}  # as Megatron saves it by default
            torch.save({"args": argparse.Namespace(**ARGS), "iteration": ITERATION,
                        "checkpoint_version": 3.0, "model": model, "rng_state": [rng]}, file)
    (root / "latest_checkpointed_iteration.txt").write_text(f"{ITERATION}\n")
    return root


def _restored(path: Path, config: LlamaConfig = CONFIG):
    targets = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype),
                           abstract_params(config))
    return store.restore(path, {store.PARAMS: targets})


def _same(a, b) -> bool:
    return all(jax.tree.leaves(jax.tree.map(np.array_equal, a, b)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, params, garbage) -> Path:
    return write_megatron(tmp_path_factory.mktemp("megatron"), params, garbage)


def test_megatron_tp2_pp2_imports_to_exactly_the_original_arrays(checkpoint, tmp_path, params):
    config = tmp_path / "config.json"  # the model as Hugging Face describes it
    config.write_text(json.dumps(config_to_hf(CONFIG, "bfloat16")))
    assert main(["ckpt", "import-shards", "--format", "megatron", str(checkpoint),
                 str(tmp_path / "out"), "--config", str(config), "--workers", "2"]) == 0
    restored = _restored(tmp_path / "out")
    assert restored.meta["step"] == ITERATION
    layout = restored.meta["written_from"]["foreign"]
    assert (layout["format"], layout["tp"], layout["pp"]) == ("megatron", TP, PP)
    assert _same(restored.arrays[store.PARAMS], params)


def _hand_written_manifest(root: Path) -> Path:
    """The same files described by hand, as `checkpoint.manifest` documents."""
    layer, hf = "decoder.layers.{l}.", "model.layers.{L}."
    qkv = [f"{hf}self_attn.{x}_proj.weight" for x in "qkv"]
    value = json.dumps  # TOML's strings, numbers and arrays read as JSON's here
    text = f"""
format = "hotjax-shards/1"
model = {{ preset = "tiny", n_layers = {CONFIG.n_layers} }}
files = "{ITER_DIR}/mp_rank_{{tp:02d}}_{{pp:03d}}/model_optim_rng.pt"
step = {ITERATION}

[parallel]
tp = {TP}
pp = {PP}

[[tensor]]
name = "embedding.word_embeddings.weight"
shape = [{V}, {D}]
padded = [{V_PAD}, {D}]
tp = "shard_v"
stage = 0
to = "model.embed_tokens.weight"

[[tensor]]
name = "{layer}self_attention.linear_qkv.layer_norm_weight"
shape = [{D}]
to = "{hf}input_layernorm.weight"

[[tensor]]
name = "{layer}self_attention.linear_qkv.weight"
shape = [{(N + 2 * K) * H}, {D}]
tp = "shard_v"
widths = {value([N // K * H, H, H] * K)}
to = {value(qkv * K)}

[[tensor]]
name = "{layer}self_attention.linear_proj.weight"
shape = [{D}, {N * H}]
tp = "shard_h"
to = "{hf}self_attn.o_proj.weight"

[[tensor]]
name = "{layer}mlp.linear_fc1.layer_norm_weight"
shape = [{D}]
to = "{hf}post_attention_layernorm.weight"

[[tensor]]
name = "{layer}mlp.linear_fc1.weight"
shape = [{2 * F}, {D}]
tp = "shard_nc"
widths = [{F}, {F}]
to = ["{hf}mlp.gate_proj.weight", "{hf}mlp.up_proj.weight"]

[[tensor]]
name = "{layer}mlp.linear_fc2.weight"
shape = [{D}, {F}]
tp = "shard_h"
to = "{hf}mlp.down_proj.weight"

[[tensor]]
name = "decoder.final_layernorm.weight"
shape = [{D}]
stage = -1
to = "model.norm.weight"

[[tensor]]
name = "output_layer.weight"
shape = [{V}, {D}]
padded = [{V_PAD}, {D}]
tp = "shard_v"
stage = -1
to = "lm_head.weight"
"""
    path = root / "manifest.toml"
    path.write_text(text)
    return path


def _converted(manifest) -> dict[str, np.ndarray]:
    """Every HF tensor the manifest's shard set holds, converted in this process."""
    shapes = hf_tensor_shapes(CONFIG)
    with foreign.Converted(foreign.plan(manifest, CONFIG.n_layers, shapes), 1) as converted:
        return {name: converted.read(name) for name in shapes}


def test_a_hand_written_manifest_of_the_same_files_imports_the_same_tensors(checkpoint, tmp_path,
                                                                            params):
    manifest = _hand_written_manifest(checkpoint)
    shapes = hf_tensor_shapes(CONFIG)
    by_hand = _converted(load_manifest(manifest))
    derived = megatron.derive_manifest(checkpoint, CONFIG)
    assert derived.sizes == {"tp": TP, "pp": PP, "dp": 1} and derived.step == ITERATION
    from_files = _converted(derived)
    assert by_hand.keys() == from_files.keys() == shapes.keys()
    assert all(np.array_equal(by_hand[name], from_files[name]) for name in shapes)
    out = shards.import_shards(manifest, tmp_path / "out", workers=1)
    restored = _restored(out)
    assert restored.meta["step"] == ITERATION
    assert _same(restored.arrays[store.PARAMS], params)


def test_the_model_is_read_from_megatrons_args_when_no_config_is_given(checkpoint, tmp_path,
                                                                       params, garbage):
    manifest = megatron.derive_manifest(checkpoint)
    config = model.from_manifest(manifest.model, manifest.path)
    assert config == dataclasses.replace(CONFIG, vocab_size=V_PAD)  # the padding becomes vocabulary
    out = megatron.import_megatron(checkpoint / ITER_DIR, tmp_path / "out", workers=1)
    imported = _restored(out, config).arrays[store.PARAMS]
    assert np.array_equal(imported["embed"], np.concatenate([params["embed"], garbage["embed"]]))
    assert np.array_equal(imported["lm_head"],  # ours is [D, V]
                          np.concatenate([params["lm_head"], garbage["head"].T], axis=1))
    assert _same(imported["layers"], params["layers"])
    assert np.array_equal(imported["final_norm"], params["final_norm"])


def test_the_local_spec_with_separate_norms_reads_the_same(tmp_path, params, garbage):
    root = write_megatron(tmp_path, params, garbage, spec="local")
    shapes = hf_tensor_shapes(CONFIG)
    tensors = _converted(megatron.derive_manifest(root, CONFIG))
    expected = params_to_hf_state(params, CONFIG)
    assert all(np.array_equal(tensors[name], expected[name]) for name in shapes)


def _truncate_qkv(root: Path) -> tuple[Path, str]:
    file, name = _rank_file(root, 1, 0), "decoder.layers.1.self_attention.linear_qkv.weight"
    saved = torch.load(file, weights_only=False)
    saved["model"][name] = saved["model"][name][:-H]
    torch.save(saved, file)
    return file, name


class AttnBackend(enum.Enum):  # as newer Megatron's args hold: an enum of its own
    auto = 5


def _pickle_enum(root: Path) -> tuple[Path, str]:
    """Args holding a class of Megatron's own, which torch's weights-only loader refuses."""
    file = _rank_file(root, 0, 1)
    saved = torch.load(file, weights_only=False)
    saved["args"].attention_backend = AttnBackend.auto
    torch.save(saved, file)
    return file, "AttnBackend"


@pytest.mark.parametrize("case", ["missing rank", "wrong qkv shape", "n_layers disagrees",
                                  "refused pickle"])
def test_bad_input_is_one_line_naming_the_file_and_tensor_and_nothing_is_written(
        case, tmp_path, params, garbage):
    root = write_megatron(tmp_path / "megatron", params, garbage)
    config, names = CONFIG, []
    if case == "missing rank":
        shutil.rmtree(_rank_file(root, 1, 1).parent)
        names = [_rank_file(root, 1, 1).parent]
    elif case == "wrong qkv shape":
        names = list(_truncate_qkv(root))
    elif case == "refused pickle":
        names = list(_pickle_enum(root))
    else:
        config = dataclasses.replace(CONFIG, n_layers=3)
        names = [root / ITER_DIR, "n_layers=3", "4 layers"]
    with pytest.raises(UserError) as e:
        megatron.import_megatron(root, tmp_path / "out", config=config, workers=1)
    message = str(e.value)
    assert "\n" not in message and all(str(name) in message for name in names), message
    assert not (tmp_path / "out").exists()
