"""The data layer: corpus scanning, tokenizers, packing and resumable batches."""

import hashlib
import itertools
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
    Batch,
    ByteTokenizer,
    PackedBatches,
    Tokenizer,
    assemble,
    load_tokenizer,
    open_corpus,
    pack_rows,
    stdlib_files,
)
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


def specials(tokenizer: Tokenizer) -> tuple[int, int, int, int]:
    return tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.vocab_size


def sha16(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()[:16]


@pytest.fixture
def text_corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    """40 documents of up to 29 characters; two are empty and some are longer than a row."""
    texts = random_texts(40, 30, seed=1)
    texts[3] = texts[17] = ""
    files = {f"doc{i:03}.txt": t.encode() for i, t in enumerate(texts)}
    return write_files(tmp_path / "corpus", files), texts


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
    message = f"tokenizer {path} has no BOS/EOS special tokens: expected one of <s>/</s>, "
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
    assert batch.real_tokens == 9
    assert batch.tokens.dtype == batch.segment_ids.dtype == batch.positions.dtype == np.int32


def segments(batch: Batch) -> list[tuple[int, ...]]:
    """The documents in a batch, after checking each row's layout against its segment ids."""
    found = []
    for tokens_T, segment_ids_T, positions_T in zip(
        batch.tokens, batch.segment_ids, batch.positions, strict=True
    ):
        used = int(np.count_nonzero(segment_ids_T))
        assert not segment_ids_T[used:].any()  # padding only at the end
        assert (tokens_T[used:] == PAD).all() and not positions_T[used:].any()
        starts = np.flatnonzero(np.diff(segment_ids_T[:used], prepend=0))
        assert segment_ids_T[starts].tolist() == list(range(1, len(starts) + 1))
        for start, stop in itertools.pairwise([*starts.tolist(), used]):
            assert positions_T[start:stop].tolist() == list(range(stop - start))
            found.append(tuple(tokens_T[start:stop].tolist()))
    return found


def test_an_epoch_of_batches_holds_every_document_once(text_corpus) -> None:
    root, texts = text_corpus
    expected = sorted(byte_sequence(t, 16) for t in texts if t)
    batches = PackedBatches(open_corpus(str(root)), ByteTokenizer(), 16, 64, seed=0)
    found, real = [], 0
    while real < sum(map(len, expected)):
        batch = next(batches)
        assert batch.tokens.shape == (4, 16)
        found += segments(batch)
        real += batch.real_tokens
    assert sorted(found) == expected
    assert batches.get_state() == {"epoch": 0, "cursor": len(texts), "carry": []}


def test_batches_follow_the_seeded_permutation(tmp_path: Path) -> None:
    texts = [f"{i:02} is a document longer than a row" for i in range(12)]
    root = write_files(tmp_path, {f"{i:02}.txt": t.encode() for i, t in enumerate(texts)})
    corpus = open_corpus(str(root))
    order = np.random.default_rng((7, 0)).permutation(12)
    batches = PackedBatches(corpus, ByteTokenizer(), 8, 32, seed=7)
    # Every document fills a row, so rows take documents in permutation order.
    for first in (0, 4):
        np.testing.assert_array_equal(
            next(batches).tokens, [byte_sequence(texts[i], 8) for i in order[first : first + 4]]
        )
    other = next(PackedBatches(corpus, ByteTokenizer(), 8, 32, seed=8))
    assert not np.array_equal(other.tokens[0], byte_sequence(texts[order[0]], 8))


def test_batches_emit_the_fullest_rows_and_carry_the_rest(tmp_path: Path) -> None:
    # Texts in visiting order; with BOS and EOS their sequences are 7, 6, 4, 4, 8, 8 long.
    texts = ["aaaaa", "bbbb", "cc", "dd", "eeeeee", "ffffff"]
    order = np.random.default_rng((0, 0)).permutation(6)
    files = {f"{doc}.txt": texts[k].encode() for k, doc in enumerate(order)}
    corpus = open_corpus(str(write_files(tmp_path, files)))
    batches = PackedBatches(corpus, ByteTokenizer(), 10, 20, seed=0)

    def row(*ks: int) -> list[int]:
        tokens = [t for k in ks for t in byte_sequence(texts[k], 10)]
        return tokens + [PAD] * (10 - len(tokens))

    # Window 7+6+4+4 packs as [7] [6 4] [4]: the two fullest rows go out, the last 4 waits.
    np.testing.assert_array_equal(next(batches).tokens, [row(1, 2), row(0)])
    # Window 4+8+8 packs as [8] [8] [4]; the 4 waits again, then ends the epoch alone.
    np.testing.assert_array_equal(next(batches).tokens, [row(4), row(5)])
    assert batches.get_state() == {"epoch": 0, "cursor": 6, "carry": [int(order[3])]}
    np.testing.assert_array_equal(next(batches).tokens, [row(3), row()])


def test_same_seed_gives_identical_batches(text_corpus) -> None:
    corpus = open_corpus(str(text_corpus[0]))
    a, b = (PackedBatches(corpus, ByteTokenizer(), 16, 64, seed=3) for _ in range(2))
    for _ in range(40):  # past the first epoch
        x, y = next(a), next(b)
        for name in ("tokens", "segment_ids", "positions"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))
    assert a.get_state()["epoch"] >= 1


def test_saved_state_gives_identical_next_batches(text_corpus) -> None:
    corpus = open_corpus(str(text_corpus[0]))
    stream = PackedBatches(corpus, ByteTokenizer(), 16, 64, seed=5)
    states, tokens = [], []
    for _ in range(40):
        states.append(json.loads(json.dumps(stream.get_state())))
        tokens.append(next(stream).tokens)
    assert any(s["carry"] for s in states) and states[-1]["epoch"] >= 1
    for k in range(len(states) - 3):
        resumed = PackedBatches(corpus, ByteTokenizer(), 16, 64, seed=5)
        resumed.set_state(states[k])
        for j in range(3):
            np.testing.assert_array_equal(next(resumed).tokens, tokens[k + j])


def test_batch_smaller_than_a_row_is_a_user_error(text_corpus) -> None:
    corpus = open_corpus(str(text_corpus[0]))
    with pytest.raises(
        UserError, match=re.escape("batch_tokens (8) must be at least seq_len (16)")
    ):
        PackedBatches(corpus, ByteTokenizer(), 16, 8, seed=0)
