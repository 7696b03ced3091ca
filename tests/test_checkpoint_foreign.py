"""Foreign shard sets: a TP=2 · PP=2 · ZeRO dp=2 run's rank files, made here from a known model,
import to exactly its arrays; every inconsistency names the rank file and the tensor."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import TINY
from safetensors.numpy import save_file

from hotjax.checkpoint import store
from hotjax.checkpoint.formats import foreign, shards
from hotjax.checkpoint.manifest import load as load_manifest
from hotjax.cli import main
from hotjax.errors import UserError
from hotjax.models.hf import params_to_hf_state
from hotjax.models.llama import abstract_params, init_params

TP, PP, DP, ALIGN = 2, 2, 2, 16
V, D, F, H = TINY.vocab_size, TINY.dim, TINY.ffn_dim, TINY.head_dim
Q, KV = TINY.n_heads * H, TINY.n_kv_heads * H
V_PAD = 264  # the vocabulary padded to a multiple of 8, as Megatron pads to tp * 128

# Megatron-style names; fused QKV and gate/up; the embedding and head split by vocabulary.
TENSORS = [
    {"name": "embed", "shape": [V, D], "padded": [V_PAD, D], "tp": "shard_v", "stage": 0,
     "to": "model.embed_tokens.weight"},
    {"name": "layers.{l}.attn_norm", "shape": [D], "to": "model.layers.{L}.input_layernorm.weight"},
    {"name": "layers.{l}.qkv", "shape": [Q + 2 * KV, D], "tp": "shard_nc", "widths": [Q, KV, KV],
     "to": [f"model.layers.{{L}}.self_attn.{x}_proj.weight" for x in "qkv"]},
    {"name": "layers.{l}.o", "shape": [D, Q], "tp": "shard_h",
     "to": "model.layers.{L}.self_attn.o_proj.weight"},
    {"name": "layers.{l}.mlp_norm", "shape": [D], "tp": "partial_mean",
     "to": "model.layers.{L}.post_attention_layernorm.weight"},
    {"name": "layers.{l}.fc1", "shape": [2 * F, D], "tp": "shard_nc", "widths": [F, F],
     "to": ["model.layers.{L}.mlp.gate_proj.weight", "model.layers.{L}.mlp.up_proj.weight"]},
    {"name": "layers.{l}.fc2", "shape": [D, F], "tp": "shard_h", "transpose": True,
     "to": "model.layers.{L}.mlp.down_proj.weight"},
    {"name": "final_norm", "shape": [D], "tp": "partial_sum", "stage": -1,
     "to": "model.norm.weight"},
    {"name": "head", "shape": [V, D], "padded": [V_PAD, D], "tp": "shard_v", "stage": -1,
     "to": "lm_head.weight"},
]
FLAT = ["embed", "layers.{l}.qkv", "layers.{l}.o", "layers.{l}.fc1", "layers.{l}.fc2", "head"]


def _logical(params) -> dict[str, np.ndarray]:
    """The foreign run's logical tensors, padding included, per layer for layer tensors."""
    hf = params_to_hf_state(params, TINY)
    rng = np.random.default_rng(1)
    out = {}
    for name, hf_name in (("embed", "model.embed_tokens.weight"), ("head", "lm_head.weight")):
        pad = rng.normal(size=(V_PAD - V, D)).astype(np.float32)  # garbage, to be stripped
        out[name] = np.concatenate([hf[hf_name], pad])
    out["final_norm"] = hf["model.norm.weight"]
    for i in range(TINY.n_layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.attn_norm"] = hf[p + "input_layernorm.weight"]
        out[f"layers.{i}.qkv"] = np.concatenate([hf[p + f"self_attn.{x}_proj.weight"]
                                                 for x in "qkv"])
        out[f"layers.{i}.o"] = hf[p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.mlp_norm"] = hf[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.fc1"] = np.concatenate([hf[p + "mlp.gate_proj.weight"],
                                                 hf[p + "mlp.up_proj.weight"]])
        out[f"layers.{i}.fc2"] = hf[p + "mlp.down_proj.weight"]
    return out


def _local(spec: dict, x: np.ndarray, t: int) -> np.ndarray:
    """What tensor-parallel rank t stores of logical tensor x (UCP's patterns, forwards)."""
    pattern = spec.get("tp", "replicate")
    if pattern == "shard_v":
        x = np.split(x, TP)[t]
    elif pattern == "shard_h":
        x = np.split(x, TP, axis=1)[t]
    elif pattern == "shard_nc":
        subs = np.split(x, np.cumsum(spec["widths"])[:-1])
        x = np.concatenate([np.split(sub, TP)[t] for sub in subs])
    elif pattern == "partial_sum":
        x = x / 2  # the ranks' addends: x/2 + x/2 == x exactly
    elif pattern == "partial_mean":
        x = x * (2.0 * t)  # addends 0 and 2x: (0 + 2x) / 2 == x exactly
    return np.ascontiguousarray(x.T if spec.get("transpose") else x)


def write_shard_set(directory: Path, suffix: str, params) -> Path:
    """Rank files tp{t}_pp{s}_dp{d}: direct tensors plus a ZeRO flat buffer, and a manifest."""
    logical = _logical(params)
    specs = {spec["name"]: spec for spec in TENSORS}
    rng = np.random.default_rng(2)
    for t in range(TP):
        for s in range(PP):
            layer = s  # one layer per stage
            owned = [n for n in specs if "{l}" in n or specs[n]["stage"] % PP == s]
            local = {n.replace("{l}", "0"): _local(specs[n], logical[n.replace("{l}", str(layer))],
                                                   t) for n in owned}
            flat_names = [n.replace("{l}", "0") for n in FLAT if n in owned]
            flat = np.concatenate([local.pop(n).ravel() for n in flat_names])
            pad = -flat.size % (DP * ALIGN)
            flat = np.concatenate([flat, rng.normal(size=pad).astype(np.float32)])
            for d, part in enumerate(np.split(flat, DP)):
                tensors = {**local, "fp32_flat": part}
                file = directory / f"tp{t}_pp{s}_dp{d}.{suffix}"
                if suffix == "npz":
                    np.savez(file, **tensors)
                else:
                    save_file(tensors, file)
    manifest = {"format": "hotjax-shards/1", "model": "tiny",
                "files": f"tp{{tp}}_pp{{pp}}_dp{{dp}}.{suffix}", "step": 7,
                "parallel": {"tp": TP, "pp": PP, "dp": DP},
                "tensor": TENSORS, "flat": [{"name": "fp32_flat", "align": ALIGN,
                                              "tensors": FLAT}]}
    if suffix == "npz":
        path = directory / "manifest.toml"
        path.write_text(_toml(manifest))
    else:
        path = directory / "manifest.json"
        path.write_text(json.dumps(manifest, indent=1))
    return path


def _toml(manifest: dict) -> str:
    value = json.dumps  # TOML's strings, numbers, booleans and arrays read as JSON's here
    lines = [f"{k} = {value(v)}" for k, v in manifest.items() if not isinstance(v, dict | list)]
    lines += ["[parallel]"] + [f"{k} = {v}" for k, v in manifest["parallel"].items()]
    for table in ("tensor", "flat"):
        for entry in manifest[table]:
            lines += [f"[[{table}]]"] + [f"{k} = {value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(np.asarray, init_params(TINY, seed=3))


def _restored(path: Path):
    targets = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), abstract_params(TINY))
    return store.restore(path, {store.PARAMS: targets})


@pytest.mark.parametrize("suffix", ["npz", "safetensors"])
def test_tp2_pp2_zero_shard_set_imports_to_exactly_the_original_arrays(suffix, tmp_path,
                                                                        params):
    manifest = write_shard_set(tmp_path, suffix, params)
    if suffix == "npz":  # through the API, and (safetensors) through the command line
        shards.import_shards(manifest, tmp_path / "out", workers=2)
    else:
        assert main(["ckpt", "import-shards", str(manifest), str(tmp_path / "out"),
                     "--workers", "2"]) == 0
    restored = _restored(tmp_path / "out")
    assert restored.meta["step"] == 7 and restored.meta["items"] == ["params"]
    assert restored.meta["written_from"]["foreign"]["tp"] == TP
    same = jax.tree.map(np.array_equal, restored.arrays[store.PARAMS], params)
    assert all(jax.tree.leaves(same)), same


def test_tensors_read_in_any_order_equal_those_converted_ahead_by_workers(tmp_path, params):
    # Workers convert tasks in the order the import reads them, a few ahead; a read out of that
    # order starts its task at once; a task's other tensors wait until they are read.
    from hotjax.models.hf import hf_read_order

    manifest = write_shard_set(tmp_path, "npz", params)
    order = hf_read_order(TINY)
    with foreign.Converted(_plan(manifest), 1) as converted:
        inline = {name: converted.read(name) for name in order}
    with foreign.Converted(_plan(manifest), 2, order) as converted:
        ahead = {name: converted.read(name) for name in order[::-1]}
    assert inline.keys() == ahead.keys() == set(params_to_hf_state(params, TINY))
    assert all(np.array_equal(inline[name], ahead[name]) for name in order)


def _plan(manifest: Path):
    from hotjax.models.hf import hf_tensor_shapes

    return foreign.plan(load_manifest(manifest), TINY.n_layers, hf_tensor_shapes(TINY))


def _one_line(e: pytest.ExceptionInfo, *names: str) -> str:
    message = str(e.value)
    assert "\n" not in message
    for name in names:
        assert str(name) in message, message
    return message


def _rewrite(file: Path, name: str, value: np.ndarray) -> None:
    tensors = dict(np.load(file))
    tensors[name] = value
    np.savez(file, **tensors)


def test_manifest_with_wrong_shapes_names_the_manifest_and_tensor(tmp_path, params):
    manifest = write_shard_set(tmp_path, "npz", params)
    swapped = f"widths = [{KV}, {Q}, {KV}]"  # Q and K swapped: the same sum, wrong shapes
    manifest.write_text(manifest.read_text().replace(f"widths = [{Q}, {KV}, {KV}]", swapped))
    with pytest.raises(UserError) as e:
        _plan(manifest)
    _one_line(e, manifest, "layers.{l}.qkv", "q_proj", f"({Q}, {D})")


def test_rank_file_with_a_wrong_shape_names_the_file_and_tensor(tmp_path, params):
    manifest = write_shard_set(tmp_path, "npz", params)
    bad = tmp_path / "tp1_pp0_dp1.npz"
    _rewrite(bad, "layers.0.attn_norm", np.ones(D - 1, np.float32))
    with pytest.raises(UserError) as e:
        _plan(manifest)
    _one_line(e, bad, "layers.0.attn_norm", f"({D},)")


def test_replicas_that_differ_name_the_file_and_tensor(tmp_path, params):
    manifest = write_shard_set(tmp_path, "npz", params)
    bad = tmp_path / "tp1_pp1_dp0.npz"
    _rewrite(bad, "layers.0.mlp_norm", np.full(D, 3.0, np.float32))
    with pytest.raises(UserError) as e, foreign.Converted(_plan(manifest), 1) as converted:
        converted.read("model.layers.1.post_attention_layernorm.weight")  # stage 1's layer 0
    _one_line(e, bad, "layers.0.mlp_norm")


def test_flat_buffer_that_does_not_hold_its_tensors_names_the_file(tmp_path, params):
    manifest = write_shard_set(tmp_path, "npz", params)
    manifest.write_text(manifest.read_text().replace('"layers.{l}.fc2", ', ""))
    with pytest.raises(UserError) as e:
        _plan(manifest)
    _one_line(e, tmp_path / "tp0_pp0_dp0.npz", "fp32_flat")


def test_missing_rank_file_is_named_and_nothing_is_written(tmp_path, params):
    manifest = write_shard_set(tmp_path, "safetensors", params)
    (tmp_path / "tp1_pp1_dp1.safetensors").unlink()
    with pytest.raises(UserError) as e:
        shards.import_shards(manifest, tmp_path / "out", workers=1)
    _one_line(e, tmp_path / "tp1_pp1_dp1.safetensors")
    assert not (tmp_path / "out").exists()


def test_an_existing_output_is_never_overwritten(tmp_path, params):
    manifest = write_shard_set(tmp_path, "npz", params)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UserError) as e:
        shards.import_shards(manifest, out, workers=1)
    _one_line(e, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
