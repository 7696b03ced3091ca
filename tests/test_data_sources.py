"""Data as users have it, trained on as given: a record's text under another field, a
tokenizer's special tokens under other names, a saved Hugging Face dataset or one in the local
Hugging Face cache, pre-tokenized ids.
Each trains the tiny model a step or two on one device and compares its losses with the same
text given the plain way."""

import json
from pathlib import Path

import pytest
from helpers import TINY_RUN, records

from hotjax.cli import main

# Documents of a few lengths, so that a mini-batch packs several into a row.
TEXTS = [f"def f{i}(x):\n    return x * {i} + {'y' * (i % 7)}\n" for i in range(120)]
ONE_DEVICE = ("--devices", "1", "--strategy", "data=1", "--steps", "2")


def train(tmp: Path, *flags: str) -> list[float]:
    """The losses of `hotjax train` of the tiny model on one device with `flags`."""
    metrics = tmp / f"metrics-{len(list(tmp.glob('metrics-*')))}.jsonl"
    assert main([*TINY_RUN, *ONE_DEVICE, *flags, "--metrics-jsonl", str(metrics)]) == 0
    return [r["loss"] for r in records(metrics) if "loss" in r]


def jsonl(path: Path, field: str, texts: list[str] = TEXTS) -> str:
    path.write_text("".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)))
    return str(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """The losses of TEXTS as a JSONL of `text` records, byte tokens."""
    tmp = tmp_path_factory.mktemp("reference")
    return train(tmp, "--data", jsonl(tmp / "text.jsonl", "text"))


def test_a_record_field_named_by_text_field_trains_as_text(tmp_path, reference) -> None:
    losses = train(tmp_path, "--data", jsonl(tmp_path / "content.jsonl", "content"),
                   "--text-field", "content")
    assert len(losses) == 2 and losses == reference


def bracket_tokenizer(directory: Path) -> Path:
    """A byte-level tokenizer.json whose special tokens are spelled [PAD], [BOS], [EOS]."""
    import tokenizers

    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                           use_regex=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    hf.add_special_tokens(["[PAD]", "[BOS]", "[EOS]"])  # ids 256, 257, 258
    directory.mkdir(exist_ok=True)
    hf.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def test_special_tokens_come_from_tokenizer_config_or_flags(tmp_path) -> None:
    from hotjax.data.tokenizer import SpecialTokens, load_tokenizer

    bare = bracket_tokenizer(tmp_path / "bare")
    configured = bracket_tokenizer(tmp_path / "configured")
    (configured.parent / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"__type": "AddedToken", "content": "[BOS]"}, "eos_token": "[EOS]",
        "pad_token": "[PAD]"}))
    flags = SpecialTokens("[BOS]", "[EOS]", "[PAD]")
    for tokenizer in (load_tokenizer(str(configured), None),
                      load_tokenizer(str(bare), None, specials=flags)):
        assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (257, 258, 256)
    # Flags win over the file's config.
    swapped = load_tokenizer(str(configured), None, specials=SpecialTokens(eos="[PAD]"))
    assert (swapped.bos_id, swapped.eos_id) == (257, 256)


def test_a_tokenizer_with_bracket_specials_trains_by_config_as_by_flags(tmp_path) -> None:
    data = jsonl(tmp_path / "text.jsonl", "text")
    bare = bracket_tokenizer(tmp_path / "bare")
    configured = bracket_tokenizer(tmp_path / "configured")
    (configured.parent / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]"}))
    by_config = train(tmp_path, "--data", data, "--tokenizer", str(configured))
    by_flags = train(tmp_path, "--data", data, "--tokenizer", str(bare), "--bos-token", "[BOS]",
                     "--eos-token", "[EOS]", "--pad-token", "[PAD]")
    assert len(by_config) == 2 and by_config == by_flags


@pytest.mark.parametrize("flags, expected", [
    ((), "has no BOS token (tried <s>, <|begin_of_text|>, <|endoftext|>, <bos>; no "
         "tokenizer_config.json beside it names one) — name it with --bos-token"),
    (("--bos-token", "[BOS]"), "has no EOS token (tried </s>, <|end_of_text|>, <|endoftext|>, "
                               "<eos>; no tokenizer_config.json beside it names one) — name it "
                               "with --eos-token"),
    (("--bos-token", "[CLS]"), "has no token '[CLS]' (--bos-token) — name one of its tokens "
                               "with --bos-token"),
])
def test_a_missing_special_token_is_one_line_naming_its_flag(flags, expected, tmp_path,
                                                              capsys) -> None:
    from helpers import error

    tokenizer = bracket_tokenizer(tmp_path / "bare")
    message = error([*TINY_RUN[:3], "--tokenizer", str(tokenizer), *TINY_RUN[5:], *ONE_DEVICE,
                     "--data", jsonl(tmp_path / "text.jsonl", "text"), *flags], capsys)
    assert message == f"hotjax: error: tokenizer {tokenizer} {expected}"


def saved_dataset(directory: Path, field: str, texts: list[str] = TEXTS) -> str:
    """TEXTS as a Hugging Face DatasetDict saved to disk: split train, and a small one."""
    import datasets

    rows = {"id": list(range(len(texts))), field: texts}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                          "validation": datasets.Dataset.from_dict(
                              {k: v[:3] for k, v in rows.items()})}).save_to_disk(str(directory))
    return str(directory)


def test_a_saved_dataset_trains_as_the_same_text_in_jsonl(tmp_path, reference) -> None:
    losses = train(tmp_path, "--data", saved_dataset(tmp_path / "saved", "content"),
                   "--text-field", "content")
    assert len(losses) == 2 and losses == reference


def test_pretokenized_ids_train_as_the_same_text_tokenized(tmp_path, reference) -> None:
    import numpy as np

    from hotjax.data import ByteTokenizer

    eos = ByteTokenizer().eos_id
    ids = np.concatenate([[*t.encode(), eos] for t in TEXTS]).astype(np.uint16)
    np.save(tmp_path / "ids.npy", ids)
    losses = train(tmp_path, "--data", str(tmp_path / "ids.npy"))
    assert len(losses) == 2 and losses == reference


def test_pretokenized_ids_of_another_tokenizer_are_one_line(tmp_path, capsys) -> None:
    import numpy as np
    from helpers import error

    np.save(tmp_path / "ids.npy", np.tile(np.array([5, 6, 7, 2], np.int32), 2000))  # EOS 2
    message = error([*TINY_RUN, *ONE_DEVICE, "--data", str(tmp_path / "ids.npy")], capsys)
    assert message.endswith("its documents end with id 2, but the tokenizer's EOS is 258 — "
                            "pass the --tokenizer that made the ids")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """TEXTS as `datasets.load_dataset("someone/tiny")` leaves a Parquet repository in the
    local Hugging Face cache, made without the network: the same Parquet builder preparing
    the same Arrow files (splits train and validation) under someone___tiny/default/0.0.0/
    <commit>. `datasets` read its cache directory when imported, so it is patched too."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    cache = tmp_path / "hf" / "datasets"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    files = {}
    for split, texts in (("train", TEXTS), ("validation", TEXTS[:3])):
        files[split] = str(tmp_path / f"{split}.parquet")
        pq.write_table(pa.table({"id": list(range(len(texts))), "content": texts}),
                       files[split])
    builder = Parquet(cache_dir=str(cache), dataset_name="tiny", config_id="default",
                      hash="0123456789abcdef0123456789abcdef01234567", data_files=files)
    builder.repo_id = "someone/tiny"  # the hub's repository, whose files these stand for
    builder._cache_dir = builder._build_cache_dir()
    builder.download_and_prepare()
    return cache


def test_a_dataset_in_the_hugging_face_cache_trains_as_the_same_text_in_jsonl(
        tmp_path, reference, hub_cache) -> None:
    losses = train(tmp_path, "--data", "hf:someone/tiny", "--text-field", "content")
    assert len(losses) == 2 and losses == reference
    from hotjax.data import open_corpus

    validation = open_corpus("hf:someone/tiny:validation", text_field="content")
    assert [validation.read(i) for i in range(3)] == TEXTS[:3]
    assert validation.stats == open_corpus("hf:someone/tiny", "content", "validation").stats


@pytest.mark.parametrize("data, expected", [
    ("hf:someone/other", "not in the local Hugging Face cache ({cache}) — load it once online "
     "(python -c \"import datasets; datasets.load_dataset('someone/other')\"), or set HF_HOME "
     "to the cache that holds it"),
    ("hf:someone/tiny:test", "no split 'test' (splits: train, validation) — name one: "
     "hf:someone/tiny:SPLIT"),
    ("hf:a/b/c", "give hf:OWNER/NAME or hf:OWNER/NAME:SPLIT, a dataset's name on the Hugging "
     "Face hub"),
])
def test_a_dataset_not_in_the_hugging_face_cache_is_one_line(data, expected, hub_cache,
                                                             capsys) -> None:
    from helpers import error

    message = error([*TINY_RUN, *ONE_DEVICE, "--data", data, "--text-field", "content"], capsys)
    assert message == f"hotjax: error: --data {data}: {expected.format(cache=hub_cache)}"


def token_records(path: Path, documents: list[list[int]]) -> str:
    """Each document's ids as one record of an ArrayRecord file, little-endian int32."""
    import numpy as np
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(path), "group_size:16")
    for ids in documents:
        writer.write(np.asarray(ids, "<i4").tobytes())
    writer.close()
    return str(path)


def test_array_record_token_ids_train_as_the_same_text_tokenized(tmp_path, reference) -> None:
    data = token_records(tmp_path / "ids.array_record", [list(t.encode()) for t in TEXTS])
    losses = train(tmp_path, "--data", data)
    assert len(losses) == 2 and losses == reference


@pytest.mark.parametrize("write, expected", [
    (lambda path: token_records(path, [[5, 6, 7, 8]] * 999 + [[7, 300]]),
     "{path} (record 999): holds ids outside 0 to 258, the tokenizer's — pass the --tokenizer "
     "that made the ids"),
    (lambda path: path.write_bytes(b"\0" * 64),
     "{path}: holds no records, or is not an ArrayRecord file — write one record per "
     "document, its ids as little-endian int32 bytes (numpy.asarray(ids, '<i4').tobytes())"),
])
def test_bad_array_record_token_ids_are_one_line(write, expected, tmp_path, capsys) -> None:
    from helpers import error

    path = tmp_path / "ids.array_record"
    write(path)
    message = error([*TINY_RUN, *ONE_DEVICE, "--data", str(path)], capsys)
    assert message == f"hotjax: error: {expected.format(path=path)}"
