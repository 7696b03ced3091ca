"""Hostile tokenizer files and Parquet corpora end in one line: a tokenizer is sized by its
largest id and bounded like a model config, its library's panics caught; a Parquet row group is
sized from its footer and its rows' lengths before its text is read."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers
from helpers import capped_hotjax, one_line

from hotjax import bounds
from hotjax.config import RunConfig
from hotjax.data import MiniBatches, load_tokenizer, open_corpus
from hotjax.data.records import MAX_BLOCK_BYTES, MAX_DOCUMENT_BYTES
from hotjax.data.tokenizer import MAX_TOKENIZER_BYTES
from hotjax.errors import UserError
from hotjax.models.llama import PRESETS
from hotjax.run import model_config

# A capped child (helpers.capped) that never starts JAX runs in ~100 MiB resident with pyarrow
# and tokenizers loaded; a hostile file may not raise it much.
PEAK_MIB = 256


def _word_level(path: Path, vocab: dict[str, int], split: str | None = None) -> Path:
    """A tokenizer.json of whole words with LLaMA's specials; `split`: a regular expression
    its pre-tokenizer splits on instead of whitespace."""
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **vocab}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {token: i for i, token in enumerate(vocab)}, unk_token="[UNK]"))
    hf.pre_tokenizer = (tokenizers.pre_tokenizers.Whitespace() if split is None else
                        tokenizers.pre_tokenizers.Split(tokenizers.Regex(split), "isolated"))
    saved = json.loads(hf.to_str())  # its ids written here: `save` walks every id up to the top
    saved["model"]["vocab"] = vocab
    path.write_text(json.dumps(saved))
    return path


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


# ---------------------------------------------------------------------------- tokenizers

def test_a_tokenizer_whose_ids_skip_some_has_a_row_for_its_largest_id(tmp_path):
    # Five tokens, the last with id 100,000: sized by its count, the model had 128 rows, and
    # training read past them (loss NaN from step 1, exit 0).
    tokenizer = load_tokenizer(str(_word_level(tmp_path / "t.json", {"a": 3, "b": 100_000})),
                               None)
    assert tokenizer.vocab_size == 100_001
    assert tokenizer.encode("a b") == [3, 100_000]
    model = model_config(RunConfig(), PRESETS["tiny"], tokenizer.vocab_size)
    assert model.vocab_size >= 100_001


def test_a_token_id_past_max_vocab_is_refused_naming_it_and_the_bound(tmp_path):
    # Once an OverflowError traceback, when packing cast the id to int32.
    path = _word_level(tmp_path / "t.json", {"a": 3_000_000_000})
    with pytest.raises(UserError) as caught:
        load_tokenizer(str(path), None)
    message = str(caught.value)
    assert message.startswith(f"tokenizer {path}: its largest token id is 3,000,000,000, past "
                              f"the {bounds.MAX_VOCAB:,} rows"), message
    assert "MAX_VOCAB" in message and "\n" not in message


@pytest.mark.parametrize("name", ["tokenizer.json", "m.model"])
def test_a_tokenizer_file_past_its_bound_is_refused_before_it_is_parsed(name, tmp_path):
    # A 207 MB tokenizer.json grew the tiny model to 4.1 B parameters: RESOURCE_EXHAUSTED.
    path = tmp_path / name
    with path.open("wb") as f:  # sparse: the bound is read from its size, never its bytes
        f.truncate(MAX_TOKENIZER_BYTES + 1)
    with pytest.raises(UserError) as caught:
        load_tokenizer(str(path), None)
    assert str(caught.value) == (
        f"tokenizer {path}: {MAX_TOKENIZER_BYTES + 1:,} bytes, past the "
        f"{MAX_TOKENIZER_BYTES:,} bytes a tokenizer file may hold (MAX_TOKENIZER_BYTES; real "
        f"ones hold at most ~33 MiB) — pass a tokenizer of fewer tokens")


def test_a_tokenizer_growing_the_embedding_past_host_memory_is_refused(monkeypatch):
    monkeypatch.setattr(bounds, "host_memory", lambda: 2**30)
    run = RunConfig(tokenizer="wide.json")
    with pytest.raises(UserError, match=r"^--tokenizer wide.json: 4,195,328 token ids make the "
                                        r"model's embedding \(64 wide\) 1.0 GiB, more than this "
                                        r"machine's 1.0 GiB of memory — pass a tokenizer"):
        model_config(run, PRESETS["tiny"], 2**22 + 1024)
    model_config(run, PRESETS["tiny"], 2**21)  # half a GiB fits


def test_a_tokenizer_that_panics_is_one_line_without_a_backtrace(tmp_path):
    # A pre-tokenizer regex that backtracks without end: Rust panics (a BaseException, missed by
    # `except Exception`) on every text, and printed ~8,600 lines of backtraces with them.
    path = _word_level(tmp_path / "t.json", {"a": 3}, split="(a|a)+$")
    data = _jsonl(tmp_path / "d.jsonl", ["a" * 40 + "b"] * 50)
    done = capped_hotjax("data", "stats", "--data", data, "--tokenizer", path, cwd=tmp_path,
                         env={"RUST_BACKTRACE": "1"})
    line = one_line(done.stderr)
    assert done.code == 2 and line.startswith(
        f"hotjax: error: tokenizer {path} failed on a text: Onig: Regex search error: "
        f"retry-limit-in-match over — fix the tokenizer"), line
    # Rust's hook prints the one panic in three lines before it; no backtrace.
    assert len(done.stderr.splitlines()) <= 5 and "stack backtrace" not in done.stderr
    tokenizer = load_tokenizer(str(path), None)
    stream = MiniBatches(open_corpus(str(data)), tokenizer, [64], batch_tokens=256)
    with pytest.raises(UserError, match=rf"^{data}:\d+: tokenizer {path} failed on a text"):
        next(iter(stream))
    with pytest.raises(UserError, match="failed on a text"):  # refused without Rust, now
        tokenizer.encode("b")


# ---------------------------------------------------------------------------- Parquet

def test_a_parquet_cell_bomb_is_refused_from_its_footer_in_bounded_memory(tmp_path):
    # A 27 KB file of one 300 MiB row group (one 1 MiB array written 300 times: built in
    # 80 MiB). Each was read whole before it was sized: a 600 MB cell took 2.9 GB.
    path = tmp_path / "bomb.parquet"
    cell = pa.array(["a" * 2**20])
    pq.write_table(pa.table({"text": pa.chunked_array([cell] * 300)}), path,
                   use_dictionary=False, compression="zstd")
    done = capped_hotjax("data", "stats", "--data", path, "--tokenizer", "bytes", cwd=tmp_path)
    line = one_line(done.stderr)
    assert done.code == 2 and line.startswith(
        f"hotjax: error: {path} (row group 0): its 'text' column decompresses to "), line
    assert f"past the {MAX_BLOCK_BYTES:,} bytes of a row group" in line
    assert "MAX_BLOCK_BYTES" in line and "row_group_size" in line
    assert done.peak_mib < PEAK_MIB, done.peak_mib


def test_a_parquet_dictionary_bomb_is_refused_before_its_rows_are_read(tmp_path):
    # 300 rows of one 1 MiB value, dictionary-encoded: its footer claims 1 MiB, its rows hold
    # 300 MiB (a 1,000-row one took 7.4 GB and was read, exit 0).
    path = tmp_path / "bomb.parquet"
    cell = pa.DictionaryArray.from_arrays(pa.array(np.zeros(300, np.int32)),
                                          pa.array(["a" * 2**20]))
    pq.write_table(pa.table({"text": cell}), path, compression="zstd", store_schema=False)
    assert pq.ParquetFile(path).schema_arrow.field("text").type == pa.string()
    done = capped_hotjax("data", "stats", "--data", path, "--tokenizer", "bytes", cwd=tmp_path)
    line = one_line(done.stderr)
    assert done.code == 2 and line.startswith(
        f"hotjax: error: {path} (row group 0): its 300 rows hold 314,572,800 bytes of text, "
        f"past the {MAX_BLOCK_BYTES:,} bytes"), line
    assert done.peak_mib < PEAK_MIB, done.peak_mib


def test_a_parquet_row_past_max_document_bytes_is_refused_naming_it(tmp_path):
    path = tmp_path / "long.parquet"
    pq.write_table(pa.table({"text": ["short", "a" * (MAX_DOCUMENT_BYTES + 1)]}), path)
    with pytest.raises(UserError) as caught:
        open_corpus(str(path))
    assert str(caught.value).startswith(
        f"{path} (row group 0, row 1): a document of {MAX_DOCUMENT_BYTES + 1:,} bytes, past "
        f"the {MAX_DOCUMENT_BYTES:,} bytes one document may hold (MAX_DOCUMENT_BYTES)")


def test_invalid_utf8_in_a_parquet_string_column_is_replaced_and_counted(tmp_path):
    # Arrow does not check a string column's UTF-8: reading its rows as Python strings was a
    # UnicodeDecodeError traceback.
    raw = pa.array([b"ok", b"caf\xe9", None], pa.binary())
    text = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers(), raw.null_count)
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": text}), path)
    corpus = open_corpus(str(path))
    assert [corpus.read(i) for i in range(3)] == ["ok", "caf\ufffd", ""]
    assert (corpus.stats.replaced, corpus.stats.empty, corpus.stats.bytes) == (1, 1, 8)
