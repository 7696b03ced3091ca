"""Hugging Face interop: hotjax and transformers compute the same logits from the same files."""

import dataclasses
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import python
from safetensors.numpy import load_file, save_file

from hotjax.errors import UserError
from hotjax.models.hf import config_from_hf, config_to_hf, load_hf_checkpoint, save_hf_checkpoint
from hotjax.models.llama import Llama, LlamaConfig, RopeScaling, init_model

TOL = 1e-4  # max |logit diff| between hotjax and transformers, both in fp32
TOKENS_BxT = np.random.default_rng(0).integers(0, 251, (2, 24))
CFG = LlamaConfig(vocab_size=251, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=160,
                  rope_theta=50000.0, norm_eps=1e-5, max_seq_len=128, compute_dtype="float32")
# Scaling starts at wavelengths over 16 / 4 tokens, well inside the 24 tokens we feed.
LLAMA3 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=16)
VARIANTS = {
    "untied": CFG,
    "tied": dataclasses.replace(CFG, tie_embeddings=True),
    "llama3": dataclasses.replace(CFG, rope_scaling=LLAMA3),
}


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def transformers(torch):
    return pytest.importorskip("transformers")


def _hf_model(torch, transformers, variant: str):
    """A random `LlamaForCausalLM` built from transformers' own config, norms perturbed."""
    rope = {"rope_type": "default", "rope_theta": 50000.0}
    if variant == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 50000.0, **dataclasses.asdict(LLAMA3)}
    config = transformers.LlamaConfig(
        vocab_size=251, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=variant == "tied",
        initializer_range=0.15,  # logits of order 1, so that TOL is a real test
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def _random_model(cfg: LlamaConfig, seed: int) -> Llama:
    """`init_model`, every weight redrawn (norms too) so that every mapping is exercised."""
    model = init_model(cfg, seed)
    rng = np.random.default_rng(seed)

    def redraw(path: tuple, x: jax.Array) -> jax.Array:
        noise = rng.standard_normal(x.shape, np.float32)
        is_norm = "norm" in jax.tree_util.keystr(path)
        return jnp.asarray(1 + 0.2 * noise if is_norm else 0.15 * noise)

    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(redraw,
                                                                     nnx.to_pure_dict(state)))
    nnx.update(model, state)
    return model


@nnx.jit
def _logits(model: Llama, tokens_BxT: jax.Array) -> jax.Array:
    return model(tokens_BxT)  # compiled once per config, shared by the tests


def _params(model: Llama) -> dict:
    return nnx.to_pure_dict(nnx.state(model))


def _torch_logits(torch, model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS_BxT)).logits.float().numpy()


def _max_diff(a: jax.Array | np.ndarray, b: jax.Array | np.ndarray) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


@pytest.mark.parametrize("variant", VARIANTS)
def test_loaded_transformers_checkpoint_gives_transformers_logits(variant, tmp_path, torch,
                                                                    transformers):
    reference = _hf_model(torch, transformers, variant)
    reference.save_pretrained(tmp_path, safe_serialization=True)

    model = load_hf_checkpoint(tmp_path)

    assert model.config == VARIANTS[variant]
    assert _max_diff(_logits(model, TOKENS_BxT), _torch_logits(torch, reference)) <= TOL


@pytest.mark.parametrize("variant, max_shard_bytes",
                         [("untied", 40_000), ("tied", None), ("llama3", None)])
def test_saved_checkpoint_gives_hotjax_logits_in_transformers(variant, max_shard_bytes, tmp_path,
                                                              torch, transformers):
    cfg = VARIANTS[variant]
    model = _random_model(cfg, seed=1)

    save_hf_checkpoint(model, tmp_path, max_shard_bytes=max_shard_bytes)
    reference, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path,
                                                                    output_loading_info=True)

    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 if max_shard_bytes else shards == ["model.safetensors"]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert reference.config.rope_parameters["rope_theta"] == cfg.rope_theta
    assert reference.config.rope_parameters["rope_type"] == ("llama3" if cfg.rope_scaling
                                                             else "default")
    assert _max_diff(_logits(model, TOKENS_BxT), _torch_logits(torch, reference.eval())) <= TOL


def test_llama3_scaling_changes_the_test_logits():
    model = _random_model(VARIANTS["llama3"], seed=1)
    unscaled = init_model(CFG, seed=1)
    nnx.update(unscaled, nnx.state(model))

    assert _max_diff(_logits(model, TOKENS_BxT), _logits(unscaled, TOKENS_BxT)) > 100 * TOL


def test_bf16_checkpoint_holds_the_bf16_rounding_of_the_weights(tmp_path, torch, transformers):
    model = _random_model(CFG, seed=2)

    save_hf_checkpoint(model, tmp_path, dtype="bfloat16")
    loaded = load_hf_checkpoint(tmp_path, dtype="bfloat16")

    assert {x.dtype.name for x in load_file(tmp_path / "model.safetensors").values()} == {
        "bfloat16"}
    assert loaded.config == dataclasses.replace(CFG, compute_dtype="bfloat16")
    for want, got in zip(jax.tree.leaves(_params(model)), jax.tree.leaves(_params(loaded)),
                         strict=True):
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(got, want.astype(jnp.bfloat16).astype(jnp.float32))
    # bf16 weights and matmuls (8 significant bits) stay within a few percent of the fp32 model.
    fp32_model_logits = _logits(model, TOKENS_BxT)
    assert _max_diff(_logits(loaded, TOKENS_BxT), fp32_model_logits) <= 0.05 * float(
        jnp.abs(fp32_model_logits).max())
    # transformers reads the same bf16 values: in fp32 both sides agree to fp32 rounding.
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    fp32_logits = _logits(load_hf_checkpoint(tmp_path), TOKENS_BxT)
    assert _max_diff(fp32_logits, _torch_logits(torch, reference.eval())) <= TOL


def test_config_round_trips_through_config_json():
    for cfg in VARIANTS.values():
        assert config_from_hf(config_to_hf(cfg, "bfloat16")) == cfg


def test_transformers_4_and_5_rope_forms_read_alike():
    base = {"vocab_size": 251, "hidden_size": 64, "intermediate_size": 160,
            "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-5}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    v4 = {**base, "rope_theta": 50000.0, "rope_scaling": {"type": "llama3", **scaling}}
    v5 = {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 50000.0, **scaling}}

    assert config_from_hf(v4) == config_from_hf(v5) == VARIANTS["llama3"]


@pytest.mark.parametrize("field, value", [
    ("attention_bias", True), ("mlp_bias", True), ("hidden_act", "gelu"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
])
def test_unsupported_config_is_a_user_error_naming_the_field(field, value):
    hf_config = {**config_to_hf(CFG, "float32"), field: value}
    with pytest.raises(UserError, match="yarn" if field == "rope_parameters" else field):
        config_from_hf(hf_config)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("saved")
    save_hf_checkpoint(init_model(CFG), path)
    return path


def test_missing_directory_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no_such_dir"):
        load_hf_checkpoint(tmp_path / "no_such_dir")


def test_missing_config_json_is_a_user_error(saved, tmp_path):
    shutil.copy(saved / "model.safetensors", tmp_path)
    with pytest.raises(UserError, match="config.json"):
        load_hf_checkpoint(tmp_path)


def _corrupt(saved: Path, tmp_path: Path, name: str, fix) -> Path:
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    tensors = load_file(saved / "model.safetensors")
    fix(tensors, name)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return tmp_path


def test_tensor_of_wrong_shape_is_a_user_error_naming_it(saved, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"  # [K*H, D] = [16, 64]
    path = _corrupt(saved, tmp_path, name, lambda t, n: t.update({n: t[n][:8]}))
    with pytest.raises(UserError, match=rf"{name}: .*\(16, 64\), found \(8, 64\)"):
        load_hf_checkpoint(path)


def test_missing_tensor_is_a_user_error_naming_it(saved, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    path = _corrupt(saved, tmp_path, name, lambda t, n: t.pop(n))
    with pytest.raises(UserError, match=name):
        load_hf_checkpoint(path)


def test_models_and_sharding_never_import_the_trainer():
    """Layers point one way: models <- sharding <- hotjax; the model needs no HF code. Beside
    themselves they load the package's face (`hotjax/__init__`, free of JAX) and the ground
    floor, nothing of the trainer."""
    code = ("import sys, hotjax.models.llama; assert 'hotjax.models.hf' not in sys.modules; "
            "import hotjax.models.hf, hotjax.sharding.strategy, hotjax.sharding.table, "
            "hotjax.sharding.switch; allowed = {'models', 'sharding', 'config', 'startup', "
            "'version', 'errors', 'bounds', 'paths', 'choices'}; "
            "above = [m for m in sys.modules if m.startswith('hotjax.') "
            "and m.split('.')[1] not in allowed]; assert not above, above")
    python("-c", code)
