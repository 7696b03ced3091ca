"""Hostile or broken input ends in one line: every flag, corpus, model config and checkpoint field
is checked for type, range and depth as it is read, and a claim that the machine cannot hold is
refused at once, before it costs memory."""

import argparse
import dataclasses
import json
import math
import pickle
import random
import resource
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import TINY, capped, capped_hotjax, error, one_line

from hotjax import bounds
from hotjax.checkpoint import meta as meta_lib
from hotjax.checkpoint.formats import deepspeed, megatron, megatron_core
from hotjax.data import ByteTokenizer, MiniBatches, open_corpus
from hotjax.data.corpus import check_batch
from hotjax.data.records import MAX_DOCUMENT_BYTES
from hotjax.errors import UserError
from hotjax.models.fields import MODEL_OPTIONAL, MODEL_REQUIRED, ROPE_DEFAULTS, check_model
from hotjax.models.hf import config_from_hf, config_to_hf, read_json
from hotjax.models.llama import PRESETS, LlamaConfig, RopeScaling
from hotjax.optim import OptimConfig

# A model with every optional field set, Llama 3's rope scaling included.
SCALED = dataclasses.replace(TINY, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 256))
# A capped child (helpers.capped) that never starts JAX runs in ~40 MiB resident; its peak is
# held well under its cap.
PEAK_MIB = 256
# What the readers may allocate over all the fuzzed cases together (each is a few KiB).
FUZZ_GROWTH_MIB = 256


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _nested(depth: int, leaf: Any = 0) -> list:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


# ---------------------------------------------------------------------------- flags

HUGE = str(2**40)


@pytest.mark.parametrize("argv, names", [
    (["train", "--batch-tokens", str(10**12)], ["--batch-tokens", "BATCH_HOST_FRACTION"]),
    (["train", "--batch-sequences", str(10**9), "--context", "4096"],
     ["--batch-sequences", "BATCH_HOST_FRACTION", "at --context 4096"]),
    (["train", "--vocab-size", HUGE], ["--vocab-size", "MAX_VOCAB"]),
    (["train", "--context", HUGE], ["--context", "MAX_SEQ_LEN"]),
    (["train", "--steps", str(2**31)], ["--steps", "MAX_STEP"]),
    (["train", "--devices", HUGE], ["--devices", "MAX_DEVICES"]),
    (["plan", "--batch-tokens", str(10**12)], ["--batch-tokens", "BATCH_HOST_FRACTION"]),
    (["data", "stats", "--vocab-size", HUGE], ["--vocab-size", "MAX_VOCAB"]),
    (["data", "stats", "--context", HUGE], ["--context", "MAX_SEQ_LEN"]),
    (["strategy", "show", "data=8", "--context", HUGE], ["--context", "MAX_SEQ_LEN"]),
])
def test_a_size_flag_past_what_the_machine_holds_is_one_line_naming_flag_and_bound(
        argv, names, capsys):
    err = error(argv, capsys)
    assert all(name in err for name in names), err


def test_a_trillion_token_batch_is_refused_at_once_in_bounded_memory(tmp_path):
    code, err, peak, cpu = capped_hotjax("train", "--batch-tokens", str(10**12), cwd=tmp_path)
    assert code == 2 and "--batch-tokens 1000000000000" in one_line(err)
    assert cpu < 1.0 and peak < PEAK_MIB, (cpu, peak)


def test_a_batch_larger_than_the_whole_corpus_is_refused_naming_both_numbers(tmp_path, capsys):
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps({"text": "x" * 50}) + "\n" for _ in range(10)))
    # Ten documents of 50 bytes: at most 53 tokens each (a token per byte, BOS, EOS, a prefix).
    err = error(["train", "--model", "tiny", "--tokenizer", "bytes", "--data", str(path),
                 "--batch-tokens", "1000"], capsys)
    assert "--batch-tokens 1,000" in err and "at most 530 tokens" in err, err
    corpus = open_corpus(str(path))
    check_batch(corpus, context=512, long_documents="split", batch_tokens=530)
    with pytest.raises(UserError, match="--batch-sequences 11: .* at most 10 sequences"):
        check_batch(corpus, context=512, long_documents="truncate", batch_sequences=11)
    with pytest.raises(UserError, match="at most 20 sequences"):  # split in two at 32 tokens
        check_batch(corpus, context=32, long_documents="split", batch_sequences=21)


# ---------------------------------------------------------------------------- corpora

def test_a_200_mb_jsonl_line_is_refused_naming_file_line_and_bound_in_bounded_memory(tmp_path):
    path = tmp_path / "long.jsonl"
    with path.open("wb") as f:
        f.write(b'{"text": "short"}\n{"text": "')
        for _ in range(200):
            f.write(b"a" * 2**20)
        f.write(b'"}\n')
    code, err, peak, _ = capped_hotjax("data", "stats", "--data", str(path), "--tokenizer", "bytes",
                                 cwd=tmp_path)
    line = one_line(err)
    assert code == 2 and f"{path}:2: a line longer than" in line, line
    assert f"{MAX_DOCUMENT_BYTES:,} bytes" in line and "MAX_DOCUMENT_BYTES" in line
    assert peak < PEAK_MIB, peak


@pytest.mark.parametrize("name, content, expect", [
    ("a.jsonl", b'{"text": "ok"}\n{"text": 5}\n', "{path}:2: no 'text' string field"),
    ("a.jsonl", b'{"text": "ok"}\n{"text": "a", "x": ' + b"[" * 10**5 + b"]" * 10**5 + b"}\n",
     "{path}:2: nests deeper"),
    ("a.jsonl", b'{"text": "a", "n": ' + b"9" * 5000 + b"}\n", "{path}:1: not valid JSON"),
    ("a.json", b'[{"text": ' + b"[" * 10**5 + b"]" * 10**5 + b"}]", "{path}: nests deeper"),
    ("a.jsonl", b'{"text": "\\ud800"}\n', "{path}:1: its text holds a lone surrogate"),
    ("a.txt", b"a" * (MAX_DOCUMENT_BYTES + 1),
     f"{{path}}: a document of {MAX_DOCUMENT_BYTES + 1:,} bytes, past the"),
])
def test_a_broken_corpus_record_is_one_line_naming_the_file(name, content, expect, tmp_path):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(UserError) as caught:
        open_corpus(str(path))
    assert str(caught.value).startswith(expect.format(path=path)), caught.value
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------------------- model configs

def _hf_dir(tmp_path: Path, text: str) -> Path:
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(text)
    return directory


def _hf_text(**changes: Any) -> str:
    return json.dumps({**config_to_hf(TINY, "float32"), **changes})


@pytest.mark.parametrize("text, expect", [
    (_hf_text(num_hidden_layers=10**8), "num_hidden_layers is 100000000, outside 1 to 4,096"),
    (_hf_text(hidden_size="64"), "hidden_size is '64', not a whole number"),
    (_hf_text(vocab_size=True), "vocab_size is True, not a whole number"),
    (_hf_text(num_attention_heads=0), "num_attention_heads is 0, outside 1 to"),
    (_hf_text(num_key_value_heads=3), "num_attention_heads (8) is not a multiple of "
     "num_key_value_heads (3)"),
    (_hf_text(intermediate_size=2**63), "intermediate_size is 9223372036854775808, outside 1"),
    (_hf_text(rms_norm_eps=math.nan), "rms_norm_eps is nan, not a finite number"),
    (_hf_text(rope_scaling={"rope_type": "llama3", "factor": "8", "low_freq_factor": 1,
                            "high_freq_factor": 4}), "rope_scaling.factor is '8', not a number"),
    (_hf_text(rope_scaling=[1]), "rope_scaling is a list of 1, not an object"),
    (_hf_text(hidden_size=2**16, intermediate_size=2**18, num_hidden_layers=2**9,
              num_attention_heads=2**9, num_key_value_heads=2**9, head_dim=128),
     "the model's largest parameter alone would take 32,768.0 GiB"),
    ('{"vocab_size": ' + "[" * 10**5 + "]" * 10**5 + "}", "nests deeper than 64 levels"),
    ("[1, 2]", "config.json is a list of 2, not an object"),
])
def test_a_hostile_hf_config_json_is_refused_in_one_line_before_memory_grows(
        text, expect, tmp_path, capsys):
    before = _peak_mib()
    err = error(["ckpt", "import-hf", str(_hf_dir(tmp_path, text)), str(tmp_path / "out")],
                capsys)
    assert expect in err and "config.json" in err, err
    assert _peak_mib() - before < 100  # 10^8 layers once grew to 4.8 GB
    assert not (tmp_path / "out").exists()


def test_the_shared_validator_knows_every_field_of_llama_config():
    fields = dataclasses.fields(LlamaConfig)
    required = tuple(f.name for f in fields if f.default is dataclasses.MISSING)
    optional = tuple(f.name for f in fields if f.default is not dataclasses.MISSING)
    assert (required, optional) == (MODEL_REQUIRED, MODEL_OPTIONAL)
    assert dataclasses.asdict(RopeScaling()) == ROPE_DEFAULTS
    for config in PRESETS.values():  # every real model passes (unsized: some exceed a laptop)
        assert check_model(config.to_dict(), "preset", "", fits_host=False)
    for config in (TINY, SCALED):
        assert LlamaConfig.checked(config.to_dict(), "preset", "") == config


# ---------------------------------------------------------------------------- Megatron-Core

def _megatron_root(tmp_path: Path, tracker: bytes, metadata: str | None = None) -> Path:
    root = tmp_path / "mc"
    (root / "iter_0000100").mkdir(parents=True)
    (root / megatron.TRACKER).write_bytes(tracker)
    (root / "iter_0000100" / "metadata.json").write_text(
        metadata or json.dumps({"sharded_backend": "torch_dist"}))
    return root


@pytest.mark.parametrize("tracker, metadata, expect", [
    (b"-5\n", None, "holds '-5', neither an iteration number"),
    (b"9" * 100, None, "neither an iteration number"),
    (b"99999999999", None, "past 2,147,483,647 (MAX_STEP)"),
    (b"100", "[1]", "metadata.json is a list of 1, not an object"),
    (b"100", '{"sharded_backend": 5}', "sharded_backend is 5, not a string"),
    (b"100", '{"sharded_backend": "torch_dist", "sharded_backend_version": -1}',
     "sharded_backend_version is -1, outside 0 to"),
    (b"100", "[" * 10**5 + "]" * 10**5, "nests deeper than 64 levels (MAX_JSON_DEPTH)"),
])
def test_a_hostile_megatron_core_tracker_or_metadata_json_isone_line(
        tracker, metadata, expect, tmp_path, capsys):
    root = _megatron_root(tmp_path, tracker, metadata)
    err = error(["ckpt", "import-megatron-core", str(root), str(tmp_path / "out")], capsys)
    assert expect in err, err
    assert str(root / (megatron.TRACKER if metadata is None else "iter_0000100")) in err


def _megatron_args(**changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{
        "hidden_size": 64, "num_layers": 2, "ffn_hidden_size": 176, "num_attention_heads": 8,
        "group_query_attention": True, "num_query_groups": 4, "kv_channels": 8,
        "rotary_base": 10000, "norm_epsilon": 1e-5, "max_position_embeddings": 1024,
        "untie_embeddings_and_output_weights": True, **changes})


@pytest.mark.parametrize("changes, expect", [
    ({"hidden_size": "64"}, "args.hidden_size is '64', not a whole number"),
    ({"num_attention_heads": 0}, "args.num_attention_heads is 0, outside 1 to"),
    ({"num_layers": 10**8}, "args.num_layers is 100000000, outside 1 to 4,096"),
    ({"kv_channels": -1}, "args.kv_channels is -1, outside 1 to"),
    ({"norm_epsilon": math.inf}, "args.norm_epsilon is inf, not a finite number"),
    ({"rotary_base": [10000]}, "args.rotary_base is a list of 1, not a number"),
])
def test_hostile_megatron_args_are_one_line_naming_the_arg(changes, expect, tmp_path):
    file = tmp_path / "common.pt"
    assert megatron.config_from_args(_megatron_args(), file, 259) == dataclasses.replace(
        TINY, compute_dtype="float32", max_seq_len=1024, head_dim=8)
    with pytest.raises(UserError) as caught:
        megatron.config_from_args(_megatron_args(**changes), file, 259)
    assert str(caught.value).startswith(f"{file}: {expect}") and "\n" not in str(caught.value)


# ---------------------------------------------------------------------------- DCP

def test_a_dcp_checkpoint_claiming_a_tensor_of_10_to_the_15_elements_is_refused_at_once(
        tmp_path, capsys):
    import torch
    import torch.distributed.checkpoint as torch_dcp

    directory = tmp_path / "dcp"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        torch_dcp.save({"model.embed_tokens.weight": torch.zeros(4, 64)},
                       storage_writer=torch_dcp.FileSystemWriter(str(directory)), no_dist=True)
    metadata = pickle.loads((directory / ".metadata").read_bytes())  # written just above
    metadata.state_dict_metadata["model.embed_tokens.weight"].size = torch.Size([10**15, 64])
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    before = _peak_mib()
    err = error(["ckpt", "import-dcp", str(directory), str(tmp_path / "out"), "--model",
                 "tiny"], capsys)
    assert f"{directory / '.metadata'}: tensor model.embed_tokens.weight claims " \
           f"64,000,000,000,000,000 elements" in err, err
    assert _peak_mib() - before < 100


# ---------------------------------------------------------------------------- hotjax's own

def _record(model: LlamaConfig = TINY) -> dict[str, Any]:
    """The metadata a training run writes, as `meta.record` makes it."""
    return meta_lib.record(
        step=3, source="train", items=["params", "opt_state"], model=model.to_dict(), seed=11,
        tokenizer={"identity": "bytes", "vocab_size": 259, "bos_id": 257, "eos_id": 258,
                   "pad_id": 256},
        data={"source": "corpus.jsonl", "seq_len": 256, "long_documents": "split",
              "batch_tokens": 2048, "tokenizer": "bytes", "vocab_size": 8192, "seed": 11},
        optimizer={**dataclasses.asdict(OptimConfig()), "betas": [0.9, 0.95]},
        strategy_table={"bucket": [{"max_len": 256, "mesh": {"data": 8}}]},
        written_from={"strategy": "data=8", "devices": 8},
        fingerprints={"params": {"embed": 12, "layers/wq": 2**32 - 1}, "opt_state": {}})


def _step_dir(tmp_path: Path, text: str) -> Path:
    step_dir = tmp_path / "ckpt" / "3"
    (step_dir / "meta").mkdir(parents=True, exist_ok=True)
    (step_dir / meta_lib.META_FILE).write_text(text)
    return step_dir


@pytest.mark.parametrize("changes, expect", [
    ({"step": -5}, "step is -5, outside 0 to 2,147,483,647"),
    ({"items": ["params", "../../elsewhere"]}, "items is a list of 2, not a list of distinct"),
    ({"model": {**TINY.to_dict(), "n_layers": 10**8}}, "n_layers is 100000000, outside 1 to"),
    ({"fingerprints": {"params": {"embed": -1}}}, "the fingerprint of 'embed' is -1"),
    ({"data": {"seq_len": "256"}}, "data.seq_len is '256', not a whole number"),
    ({"tokenizer": {"identity": "bytes", "vocab_size": 0}}, "tokenizer.vocab_size is 0"),
    ({"optimizer": {"lr": math.nan}}, "optimizer.lr is nan, not a finite number"),
])
def test_hotjax_checkpoint_metadata_out_of_range_is_refused_inone_line(
        changes, expect, tmp_path, capsys):
    step_dir = _step_dir(tmp_path, json.dumps({**_record(), **changes}))
    assert meta_lib.read(_step_dir(tmp_path / "valid", json.dumps(_record())))["step"] == 3
    # Resuming reads it first: step -5 no longer resumes and trains past --steps.
    err = error(["train", "--resume-from", str(step_dir)], capsys)
    assert f"{step_dir / meta_lib.META_FILE}: " in err and expect in err, err


@pytest.fixture(scope="module")
def stream(tmp_path_factory) -> MiniBatches:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": "abc" * i}) + "\n" for i in range(1, 40)))
    return MiniBatches(open_corpus(str(path)), ByteTokenizer(), (16, 64), batch_tokens=256,
                       long_documents="split")


@pytest.mark.parametrize("change, expect", [
    ({"read": -1}, "read is -1, outside 0 to"),
    ({"ahead": [0] * 40000}, "ahead is a list of 40000, not a list of at most 32,768"),
    ({"ahead": [10**6]}, "names document 1000000, but"),
    ({"pending": [[3, 32, 99]]}, "names piece 99 of document 32, which has 2"),
    ({"pending": [[3, "32", 1]]}, "a pending piece's number is '32'"),
    ({"documents": {"next_index": None}}, "documents.next_index is None"),
])
def test_a_hostile_data_position_is_refused_inone_line(stream, change, expect):
    next(stream)
    state = {**stream.get_state(), "pending": [[3, 32, 1]]}
    stream.set_state(state)  # a valid position: document 32 has two pieces at context 64
    with pytest.raises(UserError) as caught:
        stream.set_state({**state, **change})
    assert expect in str(caught.value) and "\n" not in str(caught.value), caught.value


# ---------------------------------------------------------------------------- fuzz

_HOSTILE_JSON = ["null", "true", "false", "0", "-1", "-5", str(10**18), str(2**63), "NaN",
                 "Infinity", "-Infinity", "1.5", "1e309", '""', json.dumps("x" * 10**5), '"32"',
                 "[]", "[1, 2, 3]", "{}", '{"a": 1}', "[" * 10**5 + "]" * 10**5, "9" * 5000]
_HOSTILE = [None, True, False, 0, -1, -5, 10**18, 2**63, math.nan, math.inf, -math.inf, 1.5, "",
            "x" * 10**5, "32", [], [1, 2, 3], {}, {"a": 1}, _nested(10**5), 10**5000,
            {"a": _nested(10**5)}]


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into nested dicts and lists."""
    found = [prefix] if prefix else []
    items = (value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, list) else ())
    for key, child in items:
        found += _paths(child, (*prefix, key))
    return found


def _mutated(rng: random.Random, record: Any, hostile: Any) -> Any:
    """`record` (a deep copy) with a random field set to `hostile`, deleted, or one added."""
    record = json.loads(json.dumps(record))
    *parent_path, key = rng.choice(_paths(record))
    parent = record
    for k in parent_path:
        parent = parent[k]
    move = rng.random()
    if move < 0.1 and isinstance(parent, dict):
        del parent[key]
    elif move < 0.2 and isinstance(parent, dict):
        parent["unknown_field"] = hostile
    else:
        parent[key] = hostile
    return record


def _expect_clean_or_one_line(read: Callable[[], Any], case: str) -> None:
    try:
        read()
    except UserError as e:
        assert str(e) and "\n" not in str(e), (case, str(e))
    except Exception as e:  # noqa: BLE001 - any other exception is the failure reported
        pytest.fail(f"{case}: {type(e).__name__}: {str(e)[:300]}")


def test_fuzzed_metadata_and_configs_end_clean_or_in_one_line_within_bounded_memory(tmp_path):
    rng = random.Random(32)
    before = _peak_mib()
    hf_record = config_to_hf(SCALED, "float32")
    fields = SCALED.to_dict()
    common = tmp_path / "common.pt"
    root = _megatron_root(tmp_path, b"100")
    for case in range(120):
        text = rng.choice(_HOSTILE_JSON)
        # hotjax's own metadata, and an HF config.json, with a field's JSON text replaced.
        record = _mutated(rng, _record(SCALED), "__hostile__")
        step_dir = _step_dir(tmp_path / str(case), json.dumps(record).replace(
            '"__hostile__"', text))
        _expect_clean_or_one_line(lambda d=step_dir: meta_lib.read(d),
                                  f"meta {str(record)[:300]} {text[:20]}")
        config = tmp_path / str(case) / "config.json"
        config.write_text(json.dumps(_mutated(rng, hf_record, "__hostile__")).replace(
            '"__hostile__"', text))
        _expect_clean_or_one_line(lambda f=config: config_from_hf(read_json(f)),
                                  f"config.json {config.read_text()[:200]}")
        # Megatron-Core's tracker and metadata.json.
        (root / megatron.TRACKER).write_bytes(rng.choice(
            [text.encode()[:100], b"100", b"release", rng.randbytes(rng.randrange(1, 80))]))
        (root / "iter_0000100" / "metadata.json").write_text(json.dumps(_mutated(
            rng, {"sharded_backend": "torch_dist", "sharded_backend_version": 1},
            "__hostile__")).replace('"__hostile__"', text))
        _expect_clean_or_one_line(lambda: megatron_core.iteration_directory(root),
                                  f"megatron-core {text[:20]}")
    for _ in range(len(_HOSTILE) * 6):
        hostile = rng.choice(_HOSTILE)
        shown = bounds.show(hostile)
        hf = {**hf_record, rng.choice(list(hf_record)): hostile}
        _expect_clean_or_one_line(lambda hf=hf: config_from_hf(hf), f"config_from_hf {shown}")
        model = {**fields, rng.choice(list(fields)): hostile}
        _expect_clean_or_one_line(lambda m=model: LlamaConfig.checked(m, "fuzz", "fix it"),
                                  f"LlamaConfig.checked {shown}")
        args = _megatron_args(**{rng.choice(list(vars(_megatron_args()))): hostile})
        _expect_clean_or_one_line(lambda a=args: megatron.config_from_args(a, common, 259),
                                  f"config_from_args {shown}")
        # A torch run's param groups (a DeepSpeed universal directory's: no parameters named),
        # whose values may also be arrays.
        value = rng.choice([hostile, np.zeros(3), np.float32(2.0)])
        group = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
        field = rng.choice([*group, "betas.0", "clip_grad"])
        if field == "betas.0":
            group["betas"] = [value, 0.95]
        elif field != "clip_grad":
            group[field] = value
        state = {"param_groups": [group], "clip_grad": value if field == "clip_grad" else 1.0}
        _expect_clean_or_one_line(
            lambda s=state: deepspeed._hyperparameters(s, [], tmp_path / "optimizer_state.pt"),
            f"param group {field} {bounds.show(value)}")
    # Tensors as an import casts them to fp32: NaN, infinities and float64 past fp32's range.
    for dtype in (np.float64, np.float32, np.float16):
        for value in (0.0, math.nan, math.inf, -math.inf, 1e300, -1e39, 7e4):
            source = np.full((3, 5), 0.5, dtype)
            with np.errstate(over="ignore"):
                source[rng.randrange(3), rng.randrange(5)] = value
                x = source.astype(np.float32)
            _expect_clean_or_one_line(lambda x=x, s=source: bounds.finite(x, "fuzz", "fix", s),
                                      f"finite {dtype.__name__} {value}")
    assert _peak_mib() - before < FUZZ_GROWTH_MIB


# A child reading each fuzzed tokenizer or Parquet file named in argv[2]'s JSON list, one line
# per case into argv[1]: "start" first, so that a child that dies names the case.
_READ_EACH = """
import json, sys
from hotjax.data import load_tokenizer, open_corpus
from hotjax.errors import UserError
out = open(sys.argv[1], "w", buffering=1)
for case in json.load(open(sys.argv[2])):
    out.write("start " + case + "\\n")
    try:
        if case.endswith(".parquet"):
            corpus = open_corpus(case)
            [corpus.read(i) for i in range(corpus.num_documents)]
        else:
            tokenizer = load_tokenizer(case, None)
            tokenizer.decode(tokenizer.encode_batch(["hello world", "\\u00e9" * 50 + " a b"])[1])
        out.write("ok\\n")
    except UserError as e:
        out.write("user " + json.dumps(str(e)) + "\\n")
    except BaseException as e:
        out.write("fail " + json.dumps(f"{type(e).__name__}: {str(e)[:300]}") + "\\n")
"""


def _clean_or_one_line_each(child: str, cases: list[str], tmp_path: Path,
                            env: dict[str, str]):
    """Runs `child` (`_READ_EACH`, `_RESTORE_EACH`) over `cases` in a capped process, and
    asserts that it survived them all, each a clean read or one line, with no traceback."""
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    done = capped(child, tmp_path / "results.txt", tmp_path / "cases.json", cwd=tmp_path,
                  env=env)
    lines = (tmp_path / "results.txt").read_text().splitlines()
    assert done.code == 0, (done.code, lines[-1:], done.stderr[-2000:])
    outcomes = [line for line in lines if not line.startswith("start ")]
    assert len(outcomes) == len(cases)
    failed = [(cases[k], line) for k, line in enumerate(outcomes) if not line.startswith(
        ("ok", "user "))]
    assert not failed, failed[:5]
    assert all("\n" not in json.loads(line[5:]) for line in outcomes if line.startswith("user"))
    assert "Traceback" not in done.stderr
    return done


def _flipped(rng: random.Random, raw: bytes, start: int = 0, end: int | None = None) -> bytes:
    """`raw` with one to four bytes in [start, end) set to random values, or cut there."""
    data = bytearray(raw)
    end = len(data) if end is None else end
    if rng.random() < 0.15:
        return bytes(data[:rng.randrange(start, end)])
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(start, end)] = rng.choice([0, 0x7F, 0x80, 0xFF, rng.randrange(256)])
    return bytes(data)


def test_fuzzed_tokenizers_and_parquet_footers_end_clean_or_in_one_line_in_a_capped_child(
        tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece

    from hotjax.data import train_bpe

    rng = random.Random(45)
    words = [f"w{i} the fox {i * 7 % 13}" for i in range(300)]
    (tmp_path / "t.txt").write_text("\n".join(words))
    bpe = train_bpe(open_corpus(str(tmp_path / "t.txt")), 300, tmp_path / "bpe").source
    sentencepiece.SentencePieceTrainer.train(input=str(tmp_path / "t.txt"), vocab_size=40,
                                             model_prefix=str(tmp_path / "m"), minloglevel=2)
    pq.write_table(pa.table({"id": list(range(12)), "text": words[:11] + [None]}),
                   tmp_path / "base.parquet", row_group_size=5)
    parquet = (tmp_path / "base.parquet").read_bytes()
    footer = int.from_bytes(parquet[-8:-4], "little")
    cases: list[str] = []

    def case(suffix: str, raw: bytes) -> None:
        path = tmp_path / "cases" / f"{len(cases)}{suffix}"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(raw)
        cases.append(str(path))

    record = json.loads(Path(bpe).read_text())
    for _ in range(100):  # a field of the tokenizer.json replaced, deleted or added
        case(".json", json.dumps(_mutated(rng, record, "__hostile__")).replace(
            '"__hostile__"', rng.choice(_HOSTILE_JSON)).encode())
    for _ in range(40):
        case(".json", _flipped(rng, Path(bpe).read_bytes()))
        case(".model", _flipped(rng, (tmp_path / "m.model").read_bytes()))
    for _ in range(150):  # the footer, its length and magic; then anywhere
        case(".parquet", _flipped(rng, parquet, len(parquet) - 8 - footer, len(parquet)))
    for _ in range(50):
        case(".parquet", _flipped(rng, parquet, 4))
    done = _clean_or_one_line_each(_READ_EACH, cases, tmp_path, env={"RUST_BACKTRACE": "1"})
    assert "stack backtrace" not in done.stderr
    assert done.peak_mib < PEAK_MIB + FUZZ_GROWTH_MIB, done.peak_mib


# A child restoring (and inspecting) each fuzzed hotjax checkpoint named in argv[2]'s JSON list,
# as `_READ_EACH` reads tokenizers: TensorStore reads the arrays in C++, where a claim it
# cannot allocate would abort the process rather than raise.
_RESTORE_EACH = """
import json, sys
from hotjax.checkpoint import describe, store
from hotjax.errors import UserError
from hotjax.models.llama import abstract_params, preset
out = open(sys.argv[1], "w", buffering=1)
targets = {"params": abstract_params(preset("tiny"))}
for case in json.load(open(sys.argv[2])):
    out.write("start " + case + "\\n")
    try:
        describe.describe(case)
        store.restore(case, targets)
        out.write("ok\\n")
    except UserError as e:
        out.write("user " + json.dumps(str(e)) + "\\n")
    except BaseException as e:
        out.write("fail " + json.dumps(f"{type(e).__name__}: {str(e)[:300]}") + "\\n")
"""


def test_fuzzed_orbax_metadata_of_hotjax_checkpoints_end_clean_or_in_one_line_in_a_capped_child(
        tmp_path):
    """hotjax's own checkpoints: each array's zarr metadata (shape, dtype, chunks, codecs),
    Orbax's tree of arrays, the OCDBT manifests and data files, fuzzed."""
    import shutil

    import jax
    import tensorstore as ts

    from hotjax.checkpoint import store
    from hotjax.models.llama import abstract_params

    rng = random.Random(46)
    normal = np.random.default_rng(0).normal
    params = jax.tree.map(lambda s: normal(size=s.shape).astype(np.float32),
                          abstract_params(TINY))
    base = store.save_weights(tmp_path / "base", params, meta_lib.record(
        step=0, source="test", items=["params"], model=TINY.to_dict()))
    item = base / "params"
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result()
    zarr = {key.decode(): json.loads(kv.read(key).result().value)
            for key in kv.list().result() if key.endswith(b"/zarr.json")}
    huge = [2**28, 2**34, 2**62, 0, -1]
    cases: list[str] = []

    def case(write: Callable[[Path], None]) -> None:
        path = tmp_path / "cases" / str(len(cases))
        shutil.copytree(base, path)
        write(path / "params")
        cases.append(str(path))

    def put(key: str, raw: bytes) -> Callable[[Path], None]:
        """Writes `raw` at `key`: a file of the item, or an entry of its OCDBT database."""
        if "/zarr.json" not in key:
            return lambda copy: (copy / key).write_bytes(raw)
        return lambda copy: ts.KvStore.open({"driver": "ocdbt", "base": f"file://{copy}/"}
                                            ).result().write(key, raw).result()

    for _ in range(60):  # a field of an array's zarr.json replaced, deleted or added
        key = rng.choice(list(zarr))
        hostile = rng.choice([*_HOSTILE_JSON[:-2], json.dumps([rng.choice(huge)] * 2),
                              json.dumps(rng.choice(["int32", "float64", "bool", "uint8",
                                                     "complex64", "bfloat16", "string"]))])
        case(put(key, json.dumps(_mutated(rng, zarr[key], "__hostile__")).replace(
            '"__hostile__"', hostile).encode()))
    for _ in range(20):  # an array's zarr.json, its bytes flipped
        key = rng.choice(list(zarr))
        case(put(key, _flipped(rng, json.dumps(zarr[key]).encode())))
    files = ["manifest.ocdbt", "ocdbt.process_0/manifest.ocdbt", "_METADATA",
             *(str(f.relative_to(item)) for f in item.rglob("d/*"))]
    for _ in range(60):  # Orbax's and OCDBT's files, their bytes flipped
        file = rng.choice(files)
        case(put(file, _flipped(rng, (item / file).read_bytes())))
    _clean_or_one_line_each(_RESTORE_EACH, cases, tmp_path,
                            env={"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"})
