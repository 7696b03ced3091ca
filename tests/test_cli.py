"""`hotjax train` as a user runs it: one mini-batch whatever the layout, resumes across layouts,
and one-line errors."""

import json

import numpy as np
import pytest
from helpers import error, hotjax_error, write_table

from hotjax.cli import main
from hotjax.config import memory_size

# A tiny model on byte tokens in fp32, over pieces of the standard library of mixed lengths.
TINY_RUN = ["train", "--model", "tiny", "--tokenizer", "bytes", "--batch-tokens", "2048",
            "--compute-dtype", "float32", "--log-every", "1", "--seed", "11"]
BUCKETS = (64, 128, 256)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """Documents of 10 to 400 bytes, so that every bucket gets sequences (and a few split)."""
    from hotjax.data import open_corpus

    rng = np.random.default_rng(0)
    text = "".join(open_corpus(None).read(i) for i in range(20))
    starts = rng.integers(0, len(text) - 400, size=600)
    lengths = rng.integers(10, 400, size=600)
    path = tmp_path_factory.mktemp("corpus") / "mixed.jsonl"
    path.write_text("".join(json.dumps({"text": text[s:s + n]}) + "\n"
                            for s, n in zip(starts, lengths, strict=True)))
    return str(path)


def _table(tmp_path, name: str, *meshes: str, rules: tuple[str, ...] = ()) -> str:
    buckets = [{"max_len": n, "mesh": mesh} for n, mesh in zip(BUCKETS, meshes, strict=True)]
    for bucket, rule in zip(buckets, rules, strict=False):
        bucket["rules"] = rule
    return str(write_table(tmp_path / f"{name}.toml", *buckets))


def _train(tmp_path, corpus: str, *flags: str) -> list[dict]:
    metrics = tmp_path / f"metrics-{len(list(tmp_path.iterdir()))}.jsonl"
    assert main([*TINY_RUN, "--data", corpus, *flags, "--metrics-jsonl", str(metrics)]) == 0
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, corpus) -> list[dict]:
    """The reference: the same buckets, every one on a single device."""
    tmp = tmp_path_factory.mktemp("one")
    table = _table(tmp, "single", "data = 1", "data = 1", "data = 1")
    return _train(tmp, corpus, "--steps", "3", "--devices", "1", "--strategies", table)


def _layouts(tmp_path) -> dict[str, list[str]]:
    return {
        "hot table": ["--strategies", _table(
            tmp_path, "hot", "data = 8", "data = 2, fsdp = 2, tensor = 2",
            "context = 4, tensor = 2", rules=("dp", "megatron", "megatron"))],
        "every bucket data=8": ["--strategies", _table(
            tmp_path, "dp", "data = 8", "data = 8", "data = 8")],
        "one strategy fsdp=8": ["--strategy", "fsdp=8", "--context", str(BUCKETS[-1])],
        # HotSPa's LLaMA2-7B table in shape (8 data; 2 data, 2 tensor, 2 stages; 4 tensor, 2
        # stages), at short lengths.
        "pipeline table": ["--strategies", _table(
            tmp_path, "pipeline", "data = 8", "data = 2, tensor = 2, stage = 2",
            "tensor = 4, stage = 2")],
    }


@pytest.mark.parametrize("layout", ["hot table", "every bucket data=8", "one strategy fsdp=8",
                                    "pipeline table"])
def test_every_layout_trains_on_the_same_minibatches_with_the_same_losses(layout, tmp_path,
                                                                           corpus, one_device):
    records = _train(tmp_path, corpus, "--steps", "3", *_layouts(tmp_path)[layout])
    # The same documents: real tokens and sequences per step do not depend on the layout ...
    assert [r["tokens"] for r in records] == [r["tokens"] for r in one_device]
    assert [r["sequences"] for r in records] == [r["sequences"] for r in one_device]
    assert all(r["tokens"] <= 2048 for r in records)
    # ... and with document masking neither do the losses, whatever the rows' packing.
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in one_device],
                               rtol=0, atol=1e-5)


def test_a_table_run_records_its_buckets_micro_steps_and_padding(tmp_path, corpus):
    records = _train(tmp_path, corpus, "--steps", "2", *_layouts(tmp_path)["hot table"])
    for r in records:
        buckets = r["buckets"]
        assert r["tokens"] == sum(b["tokens"] for b in buckets) > 0
        assert r["slots"] == sum(b["micro_steps"] * b["micro_rows"] * b["max_len"]
                                 for b in buckets)
        assert r["padding"] == pytest.approx(1 - r["tokens"] / r["slots"])
        for b in buckets:
            # Only the last micro-step of a bucket may carry empty rows.
            assert (b["micro_steps"] - 1) * b["micro_rows"] < b["rows"] <= (
                b["micro_steps"] * b["micro_rows"])
            assert b["compute_s"] is None  # not timed unless --bucket-timings
    assert {b["max_len"] for r in records for b in r["buckets"]} == set(BUCKETS)


# One row a step: the row's length, not their count, is what must fit.
LONG_ROW = ["--devices", "1", "--strategy", "data=1", "--context", "2048", "--steps", "2",
            "--batch-tokens", "2048"]


@pytest.fixture(scope="module")
def long_rows(tmp_path_factory, corpus) -> list[dict]:
    """The reference: a row of 2048 tokens packed with many documents, on one device."""
    return _train(tmp_path_factory.mktemp("long"), corpus, *LONG_ROW)


@pytest.mark.parametrize("flags, remat", [
    (["--device-memory", "1GiB"], "none"),  # the cheapest policy that fits the budget
    (["--remat", "full"], "full"),
    (["--remat", "dots", "--attention-block", "512"], "dots"),
])
def test_a_long_row_fits_one_device_and_remat_changes_no_loss(tmp_path, corpus, long_rows,
                                                              flags, remat):
    records = _train(tmp_path, corpus, *LONG_ROW, *flags)
    assert {b["remat"] for r in records for b in r["buckets"]} == {remat}
    assert [r["tokens"] for r in records] == [r["tokens"] for r in long_rows]
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in long_rows],
                               rtol=0, atol=1e-5)


# fp16 rounds each activation to 11 significant bits (relative error up to 2^-11 = 4.9e-4) and
# the weights to fp16 at every step; matmuls and the loss accumulate in fp32, so over 20 steps
# the losses (about 5) stay within 1e-3 of fp32's: measured, within 2e-4. The test runs 10
# steps, its steps under the hot table being slow on simulated devices: a loss scale not
# undone, or gradients that overflow, show from the first update.
FP16_TOLERANCE = 1e-3
FP16_STEPS = 10


@pytest.fixture(scope="module")
def fp32_steps(tmp_path_factory, corpus) -> list[dict]:
    """FP16_STEPS steps in fp32 on one device: the reference fp16 runs track."""
    return _train(tmp_path_factory.mktemp("fp32"), corpus, "--steps", str(FP16_STEPS),
                  "--devices", "1", "--strategy", "data=1", "--context", str(BUCKETS[-1]))


@pytest.mark.parametrize("layout", ["one device", "hot table"])
def test_float16_with_loss_scaling_tracks_float32(tmp_path, corpus, fp32_steps, layout):
    where = (["--devices", "1", "--strategy", "data=1", "--context", str(BUCKETS[-1])]
             if layout == "one device" else _layouts(tmp_path)["hot table"])
    records = _train(tmp_path, corpus, "--steps", str(FP16_STEPS), "--compute-dtype", "float16",
                     *where)
    assert {r["loss_scale"] for r in records} == {2.0**15}  # dynamic, from 2^15, no overflow
    assert not any(r["skipped"] for r in records)
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in fp32_steps],
                               rtol=0, atol=FP16_TOLERANCE)


def test_a_resumed_float16_run_keeps_its_loss_scale_and_equals_the_uninterrupted(tmp_path,
                                                                                 corpus):
    # A scale that grows every 2 good steps from 2^20 soon overflows: steps are skipped and
    # the scale halves and grows again, all of which the checkpoint at step 3 must carry.
    fp16 = ["--compute-dtype", "float16", "--initial-loss-scale", str(2.0**20),
            "--loss-scale-period", "2", *_layouts(tmp_path)["hot table"]]
    ckpt = tmp_path / "ckpt"
    uninterrupted = _train(tmp_path, corpus, "--steps", "8", *fp16, "--ckpt-dir", str(ckpt),
                           "--save-every", "3")
    assert any(r["skipped"] for r in uninterrupted[3:]) and not all(
        r["skipped"] for r in uninterrupted)
    assert len({r["loss_scale"] for r in uninterrupted}) > 2
    resumed = _train(tmp_path, corpus, "--steps", "8", *fp16, "--resume-from", str(ckpt / "3"))
    for key in ("loss_scale", "skipped", "skipped_steps"):
        assert [r[key] for r in resumed] == [r[key] for r in uninterrupted[3:]], key
    np.testing.assert_allclose([r["loss"] for r in resumed],
                               [r["loss"] for r in uninterrupted[3:]], rtol=0, atol=1e-5)
    # Resuming it in bf16 (no loss scale in the optimizer state) is refused, in one line.
    assert main([*TINY_RUN, "--data", corpus, "--steps", "8", "--compute-dtype", "bfloat16",
                 *_layouts(tmp_path)["hot table"], "--resume-from", str(ckpt / "3")]) == 2


def test_training_lowers_the_loss(tmp_path, corpus):
    records = _train(tmp_path, corpus, "--steps", "8", "--warmup-steps", "2", "--lr", "1e-2",
                     "--strategy", "data=8", "--context", "256")
    assert [r["step"] for r in records] == list(range(1, 9))
    # From uniform guesses over the 259 byte tokens padded to 384 embedding rows, to well below.
    assert records[0]["loss"] == pytest.approx(np.log(384), abs=0.05)
    assert records[-1]["loss"] < records[0]["loss"] - 1.0


def test_a_table_run_resumes_on_fewer_devices_under_another_table(tmp_path, corpus):
    ckpt = tmp_path / "ckpt"
    uninterrupted = _train(tmp_path, corpus, "--steps", "4", *_layouts(tmp_path)["hot table"],
                           "--ckpt-dir", str(ckpt), "--save-every", "2")
    four = _table(tmp_path, "four", "data = 4", "data = 2, tensor = 2", "fsdp = 2, context = 2",
                  rules=("dp", "megatron", "context"))
    resumed = _train(tmp_path, corpus, "--steps", "4", "--devices", "4", "--strategies", four,
                     "--resume-from", str(ckpt / "2"))
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["tokens"] for r in resumed] == [r["tokens"] for r in uninterrupted[2:]]
    np.testing.assert_allclose([r["loss"] for r in resumed],
                               [r["loss"] for r in uninterrupted[2:]], rtol=0, atol=1e-5)


def test_a_home_strategy_that_cannot_hold_the_state_is_refused(tmp_path, capsys):
    table = _table(tmp_path, "hot", "data = 8", "data = 2, tensor = 4", "data = 2, tensor = 4",
                   rules=("dp", "megatron-sp", "megatron-sp"))
    # The tiny model's fp32 state is 0.4 MiB per device even in the most sharded layout.
    assert main([*TINY_RUN, "--steps", "1", "--strategies", table,
                 "--device-memory", "0.1"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("hotjax: error: --device-memory 0.1 MiB: the home state needs 0.")
    assert "use a more sharded strategy" in error


def _bad_inputs(tmp_path) -> dict[str, tuple[list[str], str]]:
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{ this is not a tokenizer")
    return {
        "mesh": (["--strategy", "data=3"], "make its sizes multiply to 8"),
        "preset": (["--model", "llama5"], "unknown model preset 'llama5'"),
        "data path": (["--data", str(tmp_path / "missing")], str(tmp_path / "missing")),
        "empty corpus": (["--data", str(empty)], str(empty)),
        "tokenizer": (["--data", str(broken), "--tokenizer", str(broken)], str(broken)),
        "batch": (["--tokenizer", "bytes", "--strategy", "data=8", "--context", "512",
                   "--batch-tokens", "256"], "raise --batch-tokens or lower the context"),
        "micro rows": (["--tokenizer", "bytes", "--strategies", _micro_rows_table(tmp_path)],
                       "micro_rows 3 does not split over the 8 batch shards"),
        "loss scale": (["--compute-dtype", "float16", "--loss-scale", "often"],
                       "--loss-scale often: give dynamic, off or a number"),
        "remat": (["--tokenizer", "bytes", "--strategies", _remat_table(tmp_path)],
                  "remat 'most': choose one of 'none', 'dots', 'full'"),
    }


def _remat_table(tmp_path) -> str:
    return str(write_table(tmp_path / "remat.toml",
                           {"max_len": 64, "mesh": "data = 8", "remat": "most"}))


def _micro_rows_table(tmp_path) -> str:
    return str(write_table(tmp_path / "micro.toml",
                           {"max_len": 64, "mesh": "data = 8", "micro_rows": 3}))


@pytest.mark.parametrize("case", ["mesh", "preset", "data path", "empty corpus", "tokenizer",
                                  "batch", "micro rows", "loss scale", "remat"])
def test_bad_input_is_one_line_without_traceback(case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    flags, expected = _bad_inputs(tmp_path)[case]
    line = error(["train", "--model", "tiny", *flags], capsys)  # a later flag wins
    assert expected in line, line


def test_bad_input_is_one_line_in_a_new_process_too(tmp_path):
    """What a fresh process prints as JAX starts (its plugins' lines) comes before the one."""
    flags, expected = _bad_inputs(tmp_path)["mesh"]
    assert expected in hotjax_error("train", "--model", "tiny", *flags, cwd=tmp_path)


@pytest.mark.parametrize("text, mib", [("1024", 1024), ("1GiB", 1024), ("80GiB", 81920),
                                       ("0.5GiB", 512), ("80GB", 80e9 / 2**20),
                                       ("512 MiB", 512), ("2TiB", 2 * 2**20)])
def test_memory_sizes_take_a_unit_and_a_bare_number_is_mib(text, mib):
    assert memory_size(text) == round(mib * 2**20)  # bytes inside
