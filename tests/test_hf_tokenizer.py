"""A checkpoint carries its tokenizer: `export-hf` writes it as transformers loads it (the same
ids, the same logits), `import-hf` takes it back, and a resume continues it, never a new one."""

import dataclasses
import email
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import error

from hotjax.checkpoint import dirs, store
from hotjax.checkpoint import meta as meta_lib
from hotjax.checkpoint.formats import hf
from hotjax.checkpoint.tokenizer import carried
from hotjax.cli import main
from hotjax.data import ByteTokenizer
from hotjax.errors import UserError
from hotjax.models.hf import load_hf_checkpoint
from hotjax.models.llama import PRESETS, abstract_params

TOL = 1e-4  # max |logit diff| between hotjax and transformers, both in fp32 (as tests/test_hf.py)
TEXT = "def parse(header):\n    return header.split(': ', 1)  # naïve — \U0001F642\n"
CORPUS = str(Path(email.__file__).parent / "*.py")
# A BPE trained on the corpus (no --tokenizer), on the tiny model, two steps saved at step 2.
RUN = ["train", "--model", "tiny", "--data", CORPUS, "--vocab-size", "400", "--context", "256",
       "--batch-tokens", "2048", "--compute-dtype", "float32", "--strategy", "data=8"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The step directory of a run that trained its own BPE (cached in a HOTJAX_CACHE of its
    own, which is then removed: the checkpoint alone holds the tokenizer)."""
    root = tmp_path_factory.mktemp("trained")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOTJAX_CACHE", str(root / "cache"))
        assert main([*RUN, "--steps", "2", "--ckpt-dir", str(root / "ck"),
                     "--save-every", "2"]) == 0
    for file in (root / "cache").rglob("bpe-*.json"):
        file.unlink()
    return root / "ck" / "2"


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exported") / "hf"
    assert main(["ckpt", "export-hf", str(trained), str(out)]) == 0
    return out


def _own(step_dir: Path):
    return carried(step_dir, meta_lib.read(step_dir))


def test_export_hf_loads_in_transformers_with_hotjax_ids_and_logits(trained, exported):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ours = _own(trained)
    assert ours.identity.startswith("hf:") and ours.vocab_size > 259  # the run's trained BPE

    theirs = transformers.AutoTokenizer.from_pretrained(exported)
    ids = ours.encode(TEXT)
    assert theirs(TEXT)["input_ids"] == ids
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (
        ours.bos_id, ours.eos_id, ours.pad_id)
    assert theirs.decode(ids) == ours.decode(ids)
    generation = json.loads((exported / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (ours.bos_id, ours.eos_id)

    model = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    tokens_1xT = np.array([[ours.bos_id, *ids]])
    with torch.no_grad():
        reference = model(torch.from_numpy(tokens_1xT)).logits.numpy()
    logits = np.asarray(load_hf_checkpoint(exported)(jax.numpy.asarray(tokens_1xT)))
    assert reference.shape == (1, len(ids) + 1, ours.vocab_size)
    assert np.abs(logits - reference).max() <= TOL


def test_resume_from_the_import_of_an_export_keeps_its_tokenizer_and_vocabulary(
        trained, exported, tmp_path):
    imported = hf.import_hf(exported, tmp_path / "imported")
    ours = _own(trained)
    assert _own(imported).encode(TEXT) == ours.encode(TEXT)
    # No --tokenizer, and the default --vocab-size (8192): the import's tokenizer all the same.
    flags = [flag for flag in RUN if flag not in ("--vocab-size", "400", "--model", "tiny")]
    assert main([*flags, "--steps", "1", "--resume-from", str(imported),
                 "--ckpt-dir", str(tmp_path / "ck"), "--save-every", "1"]) == 0
    resumed = dirs.latest(tmp_path / "ck")
    meta, before = meta_lib.read(resumed), meta_lib.read(trained)
    assert meta["model"]["vocab_size"] == before["model"]["vocab_size"]
    assert meta["tokenizer"] == meta_lib.read(imported)["tokenizer"]
    assert meta["tokenizer"]["vocab_size"] == ours.vocab_size
    again = _own(resumed)
    assert again.identity == _own(imported).identity
    assert again.encode(TEXT) == ours.encode(TEXT)


def test_resume_of_a_ckpt_dir_without_tokenizer_continues_its_own(trained, tmp_path,
                                                                   monkeypatch):
    directory = tmp_path / "ck"
    shutil.copytree(trained, directory / "2")
    monkeypatch.setenv("HOTJAX_CACHE", str(tmp_path / "cache"))  # no BPE cached anywhere
    flags = [flag for flag in RUN if flag not in ("--vocab-size", "400")]
    # One step past the checkpoint's last (its schedule ended at 2), on a schedule to 3.
    assert main([*flags, "--steps", "3", "--new-schedule", "--ckpt-dir", str(directory)]) == 0
    assert meta_lib.read(directory / "3")["tokenizer"] == meta_lib.read(trained)["tokenizer"]
    assert not list((tmp_path / "cache").rglob("bpe-*.json"))  # nothing trained


def test_resume_with_another_tokenizer_is_refused_in_one_line_naming_both(trained, capsys):
    err = error([*RUN, "--steps", "3", "--tokenizer", "bytes", "--resume-from", str(trained)],
                capsys)
    own = _own(trained).identity
    assert "--tokenizer bytes (bytes)" in err
    assert f"({own}, {trained / 'tokenizer' / 'tokenizer.json'})" in err
    assert "drop --tokenizer" in err


def test_export_of_a_byte_tokenizer_checkpoint_gives_the_byte_ids_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=259)
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract_params(config))
    bytes_ = ByteTokenizer()
    store.save_weights(tmp_path / "ck", params, meta_lib.record(
        step=0, source="test", items=[store.PARAMS], model=config.to_dict(),
        tokenizer=meta_lib.tokenizer_record(bytes_)))
    hf.export_hf(tmp_path / "ck", tmp_path / "hf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs(TEXT)["input_ids"] == bytes_.encode(TEXT)
    assert theirs.bos_token_id == bytes_.bos_id
    assert theirs.decode(bytes_.encode(TEXT)) == TEXT
    # Imported back, it is a tokenizer.json of the same ids, carried by the import.
    imported = hf.import_hf(tmp_path / "hf", tmp_path / "imported")
    assert _own(imported).encode(TEXT) == bytes_.encode(TEXT)
    assert (imported / "tokenizer" / "tokenizer.json").is_file()


def test_a_carried_tokenizer_that_is_not_the_recorded_one_is_refused(trained, tmp_path):
    step_dir = tmp_path / "2"
    shutil.copytree(trained, step_dir)
    file = step_dir / "tokenizer" / "tokenizer.json"
    text = json.loads(file.read_text())
    text["added_tokens"][0]["content"] = "<PAD>"
    file.write_text(json.dumps(text))
    with pytest.raises(UserError, match="not the hf:.* its metadata records"):
        _own(step_dir)
