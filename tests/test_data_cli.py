"""`hotjax data stats` as a user runs it: numbers that add up, a readable plot, one-line errors."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import error, python, records, write_table
from test_data import write_files

from hotjax.cli import main

# Byte tokens: a document of n characters is a sequence of n + 2 (BOS, EOS).
LENGTHS = [3, 8, 10, 14, 30, 40, 62, 100, 0]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    files = {f"{i}.txt": b"x" * n for i, n in enumerate(LENGTHS)}
    return write_files(tmp_path / "corpus", files)


def stats(capsys, *flags: str) -> dict:
    assert main(["data", "stats", "--tokenizer", "bytes", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_stats_account_for_every_token(corpus, capsys) -> None:
    report = stats(capsys, "--data", str(corpus), "--buckets", "16,64",
                   "--long-documents", "truncate")
    documents = np.array([n + 2 for n in LENGTHS if n])  # 5, 10, 12, 16, 32, 42, 64, 102
    sequences = np.minimum(documents, 64)
    assert report["corpus"]["documents"] == 9 and report["corpus"]["empty"] == 1
    assert report["tokens"] == {"documents": int(documents.sum()), "sequences": 8,
                                "in_sequences": int(sequences.sum()), "truncated": 38}
    assert [(h["min"], h["documents"], h["tokens"]) for h in report["histogram"]] == [
        (4, 1, 5), (8, 2, 22), (16, 1, 16), (32, 2, 74), (64, 2, 166)]
    b16, b64 = report["buckets"]
    assert (b16["sequences"], b16["tokens"], b16["rows"]) == (4, 43, 3)  # [16] [12] [10 5]
    assert (b64["sequences"], b64["tokens"], b64["rows"]) == (4, 202, 4)
    assert b16["token_share"] + b64["token_share"] == pytest.approx(1)
    layouts = {lay["name"]: lay for lay in report["layouts"]}
    assert layouts["pad to max"]["padded_tokens"] == 8 * 64
    assert layouts["packed to context"]["rows"] == 4  # [64] [64] [42 16 5] [32 12 10]
    assert layouts["bucketed"]["padded_tokens"] == 3 * 16 + 4 * 64
    assert list(layouts) == ["pad to max", "packed to context", "bucketed"]
    for lay in layouts.values():
        assert lay["waste"] == pytest.approx(1 - 245 / lay["padded_tokens"])
    assert layouts["packed to context"]["attention"] == 1.0


def test_split_documents_lose_no_token(corpus, capsys) -> None:
    report = stats(capsys, "--data", str(corpus), "--context", "64", "--long-documents", "split")
    assert report["tokens"]["in_sequences"] == report["tokens"]["documents"]
    assert report["tokens"]["sequences"] == 9 and report["tokens"]["truncated"] == 0
    assert [b["max_len"] for b in report["buckets"]] == [8, 16, 32, 64]


def test_stats_and_train_count_the_same_tokens_by_default(corpus, tmp_path, capsys) -> None:
    """By default both split documents over the context: a step of every token the stats
    count reads the whole corpus once (documents of 102 tokens at a context of 64)."""
    report = stats(capsys, "--data", str(corpus), "--context", "64")
    total = sum(n + 2 for n in LENGTHS if n)
    assert report["long_documents"] == "split"
    assert report["tokens"]["in_sequences"] == total == 283
    metrics = tmp_path / "metrics.jsonl"
    assert main(["train", "--model", "tiny", "--tokenizer", "bytes", "--data", str(corpus),
                 "--devices", "1", "--strategy", "data=1", "--context", "64", "--steps", "1",
                 "--batch-tokens", str(total), "--compute-dtype", "float32",
                 "--metrics-jsonl", str(metrics)]) == 0
    assert records(metrics)[-1]["tokens_seen"] == total


def test_buckets_come_from_the_strategy_table(corpus, tmp_path, capsys) -> None:
    table = write_table(tmp_path / "table.toml", {"max_len": 32, "mesh": "data = 8"},
                        {"max_len": 128, "mesh": "data = 2, fsdp = 4"})
    report = stats(capsys, "--data", str(corpus), "--strategies", str(table))
    assert [b["max_len"] for b in report["buckets"]] == [32, 128] and report["context"] == 128


def test_tables_and_plot(corpus, tmp_path, capsys) -> None:
    plot = tmp_path / "lengths.png"
    assert main(["data", "stats", "--data", str(corpus), "--tokenizer", "bytes", "--context",
                 "64", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    for title in ("corpus", "document lengths in tokens", "buckets", "padding waste"):
        assert title in out
    assert f"plot saved to {plot}" in " ".join(out.split())  # rich may wrap a long path
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 20_000


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--data", "{tmp}/missing"], "corpus not found: {tmp}/missing"),
        (["--data", "{tmp}/empty"], "no text files in corpus {tmp}/empty"),
        (["--tokenizer", "{tmp}/nope.json"], "tokenizer file not found: {tmp}/nope.json"),
        (["--buckets", "64,16"], "--buckets 64,16: give positive, increasing lengths"),
        (["--buckets", "16,64", "--context", "32"], "--context 32 differs from the largest"),
        (["--context", "16", "--long-documents", "error"],
         "{tmp}/corpus/4.txt: a document of 32 tokens (with BOS and EOS) is longer than"),
        (["--plot", "{tmp}/no/such/dir/x.png"], "--plot {tmp}/no/such/dir/x.png: its directory"),
    ],
)
def test_bad_input_is_one_line(flags, expected, corpus, tmp_path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    flags = [f.format(tmp=tmp_path) for f in flags]
    if "--data" not in flags:
        flags += ["--data", str(corpus)]
    if "--tokenizer" not in flags:
        flags += ["--tokenizer", "bytes"]
    line = error(["data", "stats", *flags], capsys)
    assert expected.format(tmp=tmp_path) in line, line


def test_the_data_layer_imports_neither_jax_nor_grain_until_iterated() -> None:
    # JAX fixes the CPU device count when imported, so `hotjax train` must set it first.
    code = ("import sys, hotjax.data, hotjax.commands.data, hotjax.data.stats; "
            "print(sorted({'jax', 'grain'} & set(sys.modules)))")
    assert python("-c", code, timeout=60).stdout.strip() == "[]"
