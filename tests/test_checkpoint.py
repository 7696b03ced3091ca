"""Universal checkpoints in one process: restore onto any layout and dtype, async saves that
donated steps cannot disturb, what is kept, `inspect`, Hugging Face round trips, bad inputs."""

import ast
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, hotjax, small_corpus, trainer

from hotjax.checkpoint import dirs, fingerprint, formats, store
from hotjax.checkpoint import meta as meta_lib
from hotjax.checkpoint.formats import fakes, hf
from hotjax.checkpoint.formats.spec import Format
from hotjax.checkpoint.lock import LOCK_FILE
from hotjax.checkpoint.training import restore_state
from hotjax.cli import main
from hotjax.data import Batch, MiniBatch
from hotjax.errors import UserError
from hotjax.models.hf import load_hf_checkpoint
from hotjax.models.llama import PRESETS, LlamaConfig, abstract_params
from hotjax.optim import OptimConfig
from hotjax.train import Trainer

OPTIM = OptimConfig(lr=3e-3, warmup_steps=2, total_steps=4)
# As tests/test_cli.py runs it, so that compiled steps are shared through the cache.
TINY_RUN = ["train", "--model", "tiny", "--tokenizer", "bytes", "--context", "256",
            "--batch-tokens", "2048", "--compute-dtype", "float32", "--log-every", "1",
            "--steps", "4"]


def _trainer(strategy: str, devices, config=TINY) -> Trainer:
    """A single strategy over rows of 64 tokens; its home holds the state in that strategy."""
    return trainer(strategy, devices, config=config, optim=OPTIM)


def _batch() -> MiniBatch:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, TINY.vocab_size, (8, 64)).astype(np.int32)
    positions = np.tile(np.arange(64, dtype=np.int32), (8, 1))
    return MiniBatch((Batch(tokens, np.ones_like(tokens), positions),))


def _host(tree):
    return jax.tree.map(np.array, tree)  # copies, never views of device buffers


def _save(directory: Path, home, state, step: int) -> Path:
    checkpoints = store.Checkpoints(directory)
    record = meta_lib.record(step=step, source="test", items=[], model=home.config.to_dict())
    checkpoints.save(step, state.params, state.opt_state, record, {"epoch": 0})
    checkpoints.close()
    return directory / str(step)


@pytest.fixture(scope="module")
def fsdp_checkpoint(devices, tmp_path_factory):
    """A state after one update, saved from an fsdp=8 home layout; and a host copy of it."""
    trainer = _trainer("data=8,rules=dp", devices)
    state, _, _ = trainer.step(trainer.init(seed=0), _batch())
    home = _trainer("fsdp=8", devices).home
    state = jax.device_put(state, home.state_shardings, may_alias=False)
    return _save(tmp_path_factory.mktemp("fsdp"), home, state, 1), _host(state)


@pytest.mark.parametrize("strategy,count", [("data=2,fsdp=2", 4), ("data=8,rules=dp", 8),
                                            ("data=1", 1)])
def test_restore_onto_another_mesh_gives_the_saved_arrays(strategy, count, devices,
                                                          fsdp_checkpoint):
    path, host = fsdp_checkpoint
    targets = _trainer(strategy, devices[:count]).home.abstract_state()
    restored = store.restore(path, {"params": targets.params, "opt_state": targets.opt_state})
    for item, saved in (("params", host.params), ("opt_state", host.opt_state)):
        for x, t, want in zip(jax.tree.leaves(restored.arrays[item]),
                              jax.tree.leaves(getattr(targets, item)), jax.tree.leaves(saved),
                              strict=True):
            assert x.sharding == t.sharding
            np.testing.assert_array_equal(np.asarray(x), want)
    assert restored.data == {"epoch": 0}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_restore_in_half_precision_casts_the_fp32_master_weights(dtype, devices,
                                                                 fsdp_checkpoint):
    path, host = fsdp_checkpoint
    targets = _trainer("data=2,fsdp=2", devices[:4]).home.abstract_state().params
    half = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, dtype, sharding=t.sharding),
                        targets)
    restored = store.restore(path, {"params": half}).arrays["params"]
    for x, want in zip(jax.tree.leaves(restored), jax.tree.leaves(host.params), strict=True):
        assert x.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(x), want.astype(dtype))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_training_resumes_computing_in_half_precision(dtype, devices, fsdp_checkpoint):
    path, _ = fsdp_checkpoint
    record = {"model": TINY.to_dict(), "tokenizer": {"identity": "x"}, "data": {}}
    losses = {}
    for compute in ("float32", dtype):
        trainer = _trainer("data=8,rules=dp", devices,
                           dataclasses.replace(TINY, compute_dtype=compute))
        # The checkpoint's run trained on another schedule; the precision is what is tested.
        resumed = restore_state(path, trainer.home, record, new_schedule=True)
        assert resumed.step == 1
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(resumed.state.params))
        losses[compute] = trainer.train_step(resumed.state, _batch())[1]["loss"]
    assert losses[dtype] == pytest.approx(losses["float32"], abs=2e-2)


def test_fingerprints_agree_on_every_layout_on_device_and_on_the_host(devices,
                                                                    fsdp_checkpoint):
    _, host = fsdp_checkpoint
    expected = fingerprint.of_tree(host.params)  # numpy, on the host
    for strategy in ("fsdp=8", "data=8,rules=dp"):
        shardings = _trainer(strategy, devices).home.state_shardings.params
        leaves = jax.tree.leaves(jax.device_put(host.params, shardings))
        on_device = jax.device_get(fingerprint._on_devices(leaves))  # as on accelerators
        assert [int(v) for v in on_device] == list(expected.values())
    changed = jax.tree.map(np.copy, host.params)
    changed["layers"]["wq"][1, 2, 3, 4] += 1e-6
    assert fingerprint.of_tree(changed)["layers/wq"] != expected["layers/wq"]


def test_async_save_is_not_disturbed_by_the_donated_steps_after_it(devices, tmp_path):
    # The step donates its state. Orbax copies to host before `save` returns.
    trainer = _trainer("data=8,rules=dp", devices)
    batch = _batch()
    state, _, _ = trainer.step(trainer.init(seed=0), batch)
    host = _host(state)
    checkpoints = store.Checkpoints(tmp_path)
    record = meta_lib.record(step=1, source="test", items=[], model=TINY.to_dict())
    checkpoints.save(1, state.params, state.opt_state, record, None)
    for _ in range(3):  # donate the saved buffers while the write may still run
        state, _, _ = trainer.step(state, batch)
    checkpoints.close()
    targets = trainer.home.abstract_state()
    restored = store.restore(tmp_path, {"params": targets.params})
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b),
                        restored.arrays["params"], host.params)
    assert all(jax.tree.leaves(same))


def test_keeps_the_last_n_and_every_kth_step(tmp_path):
    checkpoints = store.Checkpoints(tmp_path, keep_last=2, keep_every=3)
    tree = {"w": jnp.ones(4)}
    record = meta_lib.record(step=0, source="test", items=[], model=TINY.to_dict())
    for step in range(1, 8):
        checkpoints.save(step, tree, {"count": jnp.zeros((), jnp.int32)}, record, None)
    checkpoints.close()
    assert dirs.steps(tmp_path) == [3, 6, 7]


def test_latest_never_names_a_partial_checkpoint(devices, tmp_path, fsdp_checkpoint):
    path, _ = fsdp_checkpoint
    shutil.copytree(path, tmp_path / "4")
    partial = tmp_path / "5.orbax-checkpoint-tmp-1234"  # a save killed before its rename
    shutil.copytree(path, partial)
    (partial / "meta" / "metadata").unlink()
    assert dirs.latest(tmp_path) == tmp_path / "4"
    assert dirs.find(tmp_path) == tmp_path / "4"
    with pytest.raises(UserError, match="incomplete checkpoint"):
        dirs.find(partial)


def test_inspect_shows_step_arrays_metadata_and_the_writing_layout(run_checkpoint, capsys):
    directory = run_checkpoint
    assert main(["ckpt", "inspect", str(directory), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 4 and info["steps_in_directory"] == [2, 4]
    assert info["written_from"]["mesh"] == {"data": 8} and info["written_from"]["devices"] == 8
    assert info["strategy_table"]["bucket"][0]["mesh"] == {"data": 8}
    assert info["tokenizer"]["identity"] == "bytes"
    assert info["data_position"] is not None
    params = info["arrays"]["params"]["arrays"]
    vocab = info["model"]["vocab_size"]
    assert params["embed"] == {"shape": [vocab, 64], "dtype": "float32"}
    assert params["layers/wk"]["shape"] == [2, 64, 4, 8]  # stacked layers, unfused K
    assert info["arrays"]["opt_state"]["bytes"] > 2 * info["arrays"]["params"]["bytes"]
    assert main(["ckpt", "inspect", str(directory / "2")]) == 0
    assert "data8" in capsys.readouterr().out


def test_hugging_face_round_trip_and_training_from_the_import(devices, tmp_path,
                                                               fsdp_checkpoint):
    path, host = fsdp_checkpoint
    hf.export_hf(path, tmp_path / "hf")
    model = load_hf_checkpoint(tmp_path / "hf")
    assert model.config.vocab_size == TINY.vocab_size
    hf.import_hf(tmp_path / "hf", tmp_path / "ck")
    targets = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype),
                           abstract_params(TINY))
    restored = store.restore(tmp_path / "ck", {"params": targets})
    assert restored.meta["items"] == ["params"] and restored.meta["step"] == 0
    same = jax.tree.map(np.array_equal, restored.arrays["params"], host.params)
    assert all(jax.tree.leaves(same))
    # A run whose vocabulary is padded for tensor ranks starts from the import at step 0:
    # padding rows zero, a fresh optimizer state, the data from its beginning.
    padded = dataclasses.replace(TINY, vocab_size=384)
    record = {"model": padded.to_dict(), "tokenizer": {"identity": "bytes"}, "data": {}}
    resumed = restore_state(tmp_path / "ck", _trainer("fsdp=8", devices, padded).home, record)
    assert resumed.step == 0 and resumed.data is None
    embed = np.asarray(resumed.state.params["embed"])
    np.testing.assert_array_equal(embed[:TINY.vocab_size], host.params["embed"])
    assert not embed[TINY.vocab_size:].any()
    assert not any(np.asarray(x).any() for x in jax.tree.leaves(resumed.state.opt_state))


def test_vocabulary_padding_is_dropped_on_export_and_restored_as_zeros(devices, tmp_path):
    padded = dataclasses.replace(TINY, vocab_size=384)  # 259 tokens, padded for tensor ranks
    params = jax.tree.map(np.asarray, jax.tree.map(
        lambda s: np.random.default_rng(0).normal(size=s.shape).astype(np.float32),
        abstract_params(padded)))
    record = meta_lib.record(step=0, source="test", items=[], model=padded.to_dict(),
                             tokenizer={"identity": "bytes", "vocab_size": 259, "bos_id": 257,
                                        "eos_id": 258, "pad_id": 256})
    store.save_weights(tmp_path / "ck", params, record)
    hf.export_hf(tmp_path / "ck", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 259
    wider = dataclasses.replace(TINY, vocab_size=512)
    shardings = _trainer("fsdp=8", devices, wider).home.state_shardings.params
    targets = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                           abstract_params(wider), shardings)
    embed = store.restore(tmp_path / "ck", {"params": targets},
                          vocab=(384, 512)).arrays["params"]["embed"]
    np.testing.assert_array_equal(np.asarray(embed)[:384], params["embed"])
    assert not np.asarray(embed)[384:].any()


# ---------------------------------------------------------------------------- bad inputs

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> list[str]:
    """TINY_RUN on a small corpus: each run's start measures it in a moment."""
    return [*TINY_RUN, "--data", str(small_corpus(tmp_path_factory.mktemp("corpus")))]


@pytest.fixture(scope="module")
def run_checkpoint(tiny_run, tmp_path_factory) -> Path:
    """A training run's checkpoint directory (steps 2 and 4, data=8)."""
    directory = tmp_path_factory.mktemp("run") / "ck"
    assert main([*tiny_run, "--strategy", "data=8", "--ckpt-dir", str(directory),
                 "--save-every", "2"]) == 0
    return directory


def _digest(directory: Path) -> str:
    """The checkpoints' bytes (the lock file, which each run rewrites, aside)."""
    h = hashlib.sha256()
    for file in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != LOCK_FILE):
        h.update(str(file).encode() + file.read_bytes())
    return h.hexdigest()


def _largest_data_file(step_dir: Path) -> Path:
    return max((step_dir / "params").rglob("d/*"), key=lambda p: p.stat().st_size)


def _truncate(step_dir: Path) -> tuple[Path, str]:
    file = _largest_data_file(step_dir)
    file.write_bytes(file.read_bytes()[:1000])
    return step_dir / "params", "truncated or damaged"


def _corrupt(step_dir: Path) -> tuple[Path, str]:
    file = _largest_data_file(step_dir)
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0x5A for b in data[middle:middle + 64])
    file.write_bytes(bytes(data))
    return step_dir / "params", "damaged"


def _no_metadata(step_dir: Path) -> tuple[Path, str]:
    (step_dir / "meta" / "metadata").unlink()
    return step_dir / "meta" / "metadata", "lacks its metadata"


def _llama2_7b(step_dir: Path) -> tuple[Path, str]:
    file = step_dir / "meta" / "metadata"
    meta = json.loads(file.read_text())
    meta["model"] = PRESETS["llama2-7b"].to_dict()
    file.write_text(json.dumps(meta))
    return file, "dim=4096"


def _wrong_shape(step_dir: Path) -> tuple[Path, str]:
    meta = json.loads((step_dir / "meta" / "metadata").read_text())
    other = LlamaConfig.from_dict({**meta["model"], "ffn_dim": 128})  # the metadata says 176
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract_params(other))
    fabricated = step_dir.parent.parent / "fabricated"
    store.save_weights(fabricated, params, {**meta, "step": int(step_dir.name)})
    shutil.rmtree(step_dir)
    shutil.move(fabricated / step_dir.name, step_dir)
    return step_dir / "params", "layers/w_down has shape (2, 128, 64)"


def _other_tokenizer(step_dir: Path) -> tuple[Path, str]:
    file = step_dir / "meta" / "metadata"
    meta = json.loads(file.read_text())
    meta["tokenizer"]["identity"] = "hf:0123456789abcdef"
    file.write_text(json.dumps(meta))
    return file, "tokenizer hf:0123456789abcdef"


BAD = {"truncated": _truncate, "corrupted": _corrupt, "missing metadata": _no_metadata,
       "llama2-7b into tiny": _llama2_7b, "wrong array shape": _wrong_shape,
       "another tokenizer": _other_tokenizer}


@pytest.mark.parametrize("case", BAD)
@pytest.mark.parametrize("flag", ["--resume-from", "--ckpt-dir"])
def test_bad_checkpoint_is_one_line_naming_the_file_and_nothing_is_overwritten(
        case, flag, tiny_run, run_checkpoint, tmp_path, capsys):
    directory = tmp_path / "ck"
    shutil.copytree(run_checkpoint, directory)
    named, words = BAD[case](directory / "4")
    before = _digest(directory)
    target = directory / "4" if flag == "--resume-from" else directory
    assert main([*tiny_run, "--steps", "6", "--new-schedule", "--strategy", "data=8", flag,
                 str(target)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines()
              if line.startswith("hotjax: error:")]
    assert len(errors) == 1 and str(named) in errors[0] and words in errors[0], errors
    assert _digest(directory) == before


@pytest.mark.parametrize("argv,expected", [
    (["--save-every", "2"], "--save-every needs --ckpt-dir"),
    (["--strategy", "data=8", "--context", "128", "--resume-from", "{ckpt}"],
     "seq_len=256 but this run has 128"),
    (["--resume-from", "/nonexistent/ck"], "/nonexistent/ck"),
    (["--ckpt-dir", "{tmp}", "--keep-last", "0"], "--keep-last 0"),
])
def test_bad_checkpoint_flags_are_one_line_errors(argv, expected, tmp_path, tiny_run,
                                                  run_checkpoint, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{ckpt}", str(run_checkpoint))
            for a in argv]
    assert main([*tiny_run, *argv]) == 2
    assert expected in capsys.readouterr().err


def test_a_newer_checkpoint_in_ckpt_dir_is_never_overwritten(tiny_run, run_checkpoint, tmp_path,
                                                             capsys):
    directory = tmp_path / "ck"
    shutil.copytree(run_checkpoint, directory)
    before = _digest(directory)
    assert main([*tiny_run, "--strategy", "data=8", "--resume-from", str(directory / "2"),
                 "--ckpt-dir", str(directory)]) == 2
    assert "holds step 4" in capsys.readouterr().err
    assert _digest(directory) == before


@pytest.mark.parametrize("argv,expected", [
    (["ckpt", "inspect", "{tmp}"], "holds no complete checkpoint"),
    (["ckpt", "export-hf", "{ckpt}", "{ckpt}"], "is not an empty directory"),
    (["ckpt", "import-hf", "{tmp}/none", "{tmp}/out"], "no such checkpoint directory"),
    (["ckpt", "import-shards", "{tmp}/none.toml", "{tmp}/out"], "manifest not found"),
    (["ckpt", "import-shards", "{tmp}/none.toml", "{tmp}/out", "--workers", "0"],
     "--workers 0: pass a positive number of processes"),
    (["ckpt", "import-shards", "{tmp}/none.toml", "{tmp}/out", "--model", "tiny"],
     "--config and --model go with --format megatron"),
])
def test_ckpt_command_errors_are_one_line(argv, expected, tmp_path, run_checkpoint, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{ckpt}", str(run_checkpoint))
            for a in argv]
    assert main(argv) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("hotjax: error:") and expected in errors[0]


@pytest.mark.parametrize("fmt", formats.every(), ids=lambda f: f.name)
def test_each_format_is_a_command_running_its_modules_functions(fmt, capsys):
    for kind, function in (("import", fmt.imports), ("export", fmt.exports)):
        if function is None:
            continue
        assert callable(function)
        with pytest.raises(SystemExit) as done:
            main(["ckpt", f"{kind}-{fmt.name}", "--help"])
        assert done.value.code == 0
        shown = capsys.readouterr().out
        assert all(o.flag in shown
                   for o in (fmt.import_options if kind == "import" else fmt.export_options))


def test_a_format_is_one_module_in_the_formats_list():
    """Adding a format is its module and one entry in `formats.MODULES`: the list names exactly
    the modules of the folder that declare a `FORMAT`, each a `Format` of its own name whose
    functions are the module's own; loading them starts neither JAX nor torch."""
    folder = Path(formats.__file__).parent
    declaring = {f"{formats.__name__}.{f.stem}" for f in folder.glob("*.py")
                 if any(isinstance(node, ast.Assign) and [t.id for t in node.targets
                                                          if isinstance(t, ast.Name)] == ["FORMAT"]
                        for node in ast.parse(f.read_text()).body)}
    assert set(formats.MODULES) == declaring and len(formats.MODULES) == len(declaring)
    names = [f.name for f in formats.every()]
    assert len(set(names)) == len(names)
    for module_name, fmt in zip(formats.MODULES, formats.every(), strict=True):
        assert isinstance(fmt, Format) and (fmt.imports or fmt.exports)
        assert all(f.__module__ == module_name for f in (fmt.imports, fmt.exports, fmt.rows)
                   if f is not None)
    code = ("import sys; from hotjax.checkpoint import formats; formats.every(); "
            "print(sorted({'jax', 'torch', 'orbax'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]"


def test_ckpt_errors_exit_2_without_a_traceback_in_a_new_process(tmp_path):
    result = hotjax("ckpt", "inspect", tmp_path / "missing", ok=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (f"hotjax: error: {tmp_path / 'missing'}: no such "
                                     f"checkpoint directory")


# The model the imports' memory is measured on: 32 layers, the largest parameter (w_gate,
# stacked) a fifth of the weights.
MEMORY_MODEL = LlamaConfig(vocab_size=512, dim=384, n_layers=32, n_heads=6, n_kv_heads=6,
                           ffn_dim=1024, compute_dtype="float32")


def _peak_bytes(tmp_path: Path, *args: str | Path) -> int:
    """`hotjax *args` in a fresh process; its peak RSS, bytes."""
    file = tmp_path / "peak"
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    done = subprocess.run([sys.executable, "-m", "hotjax.peak", file, *map(str, args)], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return int(file.read_text())


def test_import_and_export_hf_hold_one_parameter_at_a_time_not_the_checkpoint(tmp_path):
    # 32 layers: the largest parameter (w_gate, stacked) is a fifth of the checkpoint; reading
    # and writing whole trees held three times the checkpoint at the peak.
    from safetensors.numpy import save_file

    from hotjax.models.hf import CONFIG_FILE, WEIGHTS_FILE, config_to_hf, hf_tensor_shapes

    config = MEMORY_MODEL
    hf = tmp_path / "hf"
    hf.mkdir()
    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal(shape, np.float32)
               for name, shape in hf_tensor_shapes(config).items()}
    nbytes = sum(x.nbytes for x in tensors.values())
    largest = abstract_params(config)["layers"]["w_gate"]
    largest_bytes = largest.size * 4
    save_file(tensors, hf / WEIGHTS_FILE, metadata={"format": "pt"})
    del tensors
    (hf / CONFIG_FILE).write_text(json.dumps(config_to_hf(config, "float32")))

    imported = _peak_bytes(tmp_path, "ckpt", "import-hf", hf, tmp_path / "ck")
    resting = _peak_bytes(tmp_path, "ckpt", "inspect", tmp_path / "ck")
    exported = _peak_bytes(tmp_path, "ckpt", "export-hf", tmp_path / "ck", tmp_path / "out")
    for peak in (imported, exported):
        assert peak - resting < 4 * largest_bytes < nbytes, (peak - resting, nbytes)
    assert load_hf_checkpoint(tmp_path / "out").config.n_layers == 32


def import_growth(tmp_path: Path, write) -> tuple[int, int, int]:
    """How much more an import's peak RSS is for MEMORY_MODEL than for its 2-layer version
    (which starts the same readers), the full checkpoint's bytes on disk, and the bytes of our
    largest parameter. `write(directory, model)` writes the checkpoint there and returns the
    `hotjax ckpt` arguments that import it (without the output directory)."""
    peaks, nbytes = {}, 0
    for layers in (2, MEMORY_MODEL.n_layers):
        source = tmp_path / str(layers)
        argv = write(source, dataclasses.replace(MEMORY_MODEL, n_layers=layers))
        peaks[layers] = _peak_bytes(tmp_path, "ckpt", *argv, tmp_path / f"ck-{layers}")
        nbytes = sum(f.stat().st_size for f in source.rglob("*") if f.is_file())
    largest = abstract_params(MEMORY_MODEL)["layers"]["w_gate"].size * 4
    return peaks[MEMORY_MODEL.n_layers] - peaks[2], nbytes, largest


@pytest.mark.parametrize("source", ["megatron-core", "megatron"])
def test_megatron_imports_hold_a_few_tensors_at_a_time_not_the_checkpoint(source, tmp_path):
    # The growth is a few of the largest tensors, of the Megatron checkpoint (a torch_dist
    # checkpoint's stacked fc1, gate and up together, which torch's DCP reader holds three
    # times while reading it) or of ours (w_gate); filling the whole output before writing
    # held the checkpoint once. (torch alone is 0.24 GB, in both imports.)
    def write(directory: Path, model: LlamaConfig) -> list:
        if source == "megatron-core":
            fakes.write_megatron_core(directory, model)
            return ["import-megatron-core", directory]
        fakes.write_megatron(directory, model, tp=2, pp=2)
        return ["import-shards", "--format", "megatron", directory, "--workers", "1"]

    growth, nbytes, w_gate = import_growth(tmp_path, write)
    largest, times = (2 * w_gate, 5) if source == "megatron-core" else (w_gate, 4)
    assert growth < times * largest < nbytes, (growth, largest, nbytes)


def test_a_checkpoint_resumes_under_other_execution_fields_not_another_architecture(tmp_path):
    """How the layers run (remat, kernel, dtype, the layer loop unrolled) is the run's choice;
    the shapes and meaning of the parameters are the checkpoint's."""
    meta = {"model": TINY.to_dict(), "data": {}}
    ran = dataclasses.replace(TINY, remat="full", attention="dense", compute_dtype="bfloat16",
                              scan_unroll=TINY.n_layers)
    meta_lib.check_model(meta, ran.to_dict(), tmp_path)
    with pytest.raises(UserError, match="n_layers=2 but this run's has n_layers=3"):
        meta_lib.check_model(meta, dataclasses.replace(TINY, n_layers=3).to_dict(), tmp_path)
