"""Data as users have it, trained on as given: a record's text under another field, a
tokenizer's special tokens under other names, a saved Hugging Face dataset, pre-tokenized ids.
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
