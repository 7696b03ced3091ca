"""Text to token ids: a Hugging Face tokenizer.json, a SentencePiece model, raw bytes, or a
byte-level BPE trained on the corpus and cached by the corpus fingerprint; and each as the files
of a Hugging Face directory (`hf_files`). Its BOS, EOS and pad tokens are the ones flags name
(`SpecialTokens`), else those of a `tokenizer_config.json` beside it, else the usual spellings.

A tokenizer file is checked like a model config, for it sizes the model: at most
MAX_TOKENIZER_BYTES, its vocabulary its largest id + 1 within MAX_VOCAB, and any failure of the
libraries that read it (a Rust panic included) one `UserError` line."""

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import sentencepiece
import tokenizers

from hotjax import bounds
from hotjax.bounds import MAX_VOCAB
from hotjax.config import cache_root
from hotjax.data.corpus import Corpus
from hotjax.errors import UserError

BPE_SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2 of a trained BPE
BPE_SAMPLE_CHARS = 8 << 20  # train on about this much text, so training takes seconds
# (BOS, EOS) spellings tried in order on a tokenizer.json that no flag or tokenizer_config.json
# names them for: each of the two is the first of its spellings the vocabulary has.
HF_SPECIALS = (
    ("<s>", "</s>"),
    ("<|begin_of_text|>", "<|end_of_text|>"),
    ("<|endoftext|>", "<|endoftext|>"),
    ("<bos>", "<eos>"),  # Gemma
)
HF_CONFIG = "tokenizer_config.json"  # beside a tokenizer file: its special tokens, by name
# A tokenizer file is parsed whole into the libraries' tables, several times its size; the
# largest real ones (Gemma 3's tokenizer.json, 262k tokens) hold 33 MiB. Larger files are refused
# before they are parsed or size a model.
MAX_TOKENIZER_BYTES = 64 * 2**20
_FIX = "pass a tokenizer.json, a SentencePiece .model, or 'bytes'"
HF_JSON, SENTENCEPIECE_MODEL = "tokenizer.json", "tokenizer.model"  # as Hugging Face names them


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer; `encode` adds no special tokens."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_id(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def identity(self) -> str: ...  # names the vocabulary, e.g. "hf:<sha256[:16]>"

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class SpecialTokens:
    """BOS, EOS and pad as named for a tokenizer file: a token's spelling (`--bos-token`), or
    its id (as a checkpoint records them); None: from the file's `tokenizer_config.json`, else
    the usual spellings (pad: `<pad>`, else id 0)."""

    bos: str | int | None = None
    eos: str | int | None = None
    pad: str | int | None = None

    @classmethod
    def of(cls, options: Any) -> "SpecialTokens":
        """The `--bos-token`, `--eos-token` and `--pad-token` of a `RunConfig` or parsed
        options."""
        return cls(*(getattr(options, f"{name}_token", None) for name in _ROLES))


_ROLES = ("bos", "eos", "pad")


@dataclass(frozen=True)
class TokenizerFile:
    """A tokenizer's own file, byte for byte as loaded: what a checkpoint carries and
    `export-hf` writes."""

    name: str  # HF_JSON or SENTENCEPIECE_MODEL
    data: bytes = field(repr=False)


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then pad, BOS and EOS."""

    vocab_size: int = 259
    pad_id: int = 256
    bos_id: int = 257
    eos_id: int = 258
    identity: str = "bytes"
    file: None = None  # it is its identity: a checkpoint need carry nothing

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer; pad is `<pad>` if the vocabulary has it, else 0."""

    hf: tokenizers.Tokenizer
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    identity: str
    source: str  # the file, for messages
    file: TokenizerFile | None = field(default=None, repr=False, compare=False)
    # The first Rust panic's message: after one, every call is refused without running Rust
    # again, which prints each panic (three lines), caught or not.
    panics: list[str] = field(default_factory=list, repr=False, compare=False)

    def encode(self, text: str) -> list[int]:
        # `encode_batch` lets go of the GIL and `encode` does not: this way Grain's reader
        # threads tokenize in parallel (1.9 vs 3.6 MB/s of code on two cores).
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # A tokenizer that panics mostly panics on every text: the first text goes alone, so
        # that one panic is printed, not one per text of the batch.
        texts = list(texts)
        with _panics_refused(f"tokenizer {self.source} failed on a text", self.panics):
            encodings = [e for part in (texts[:1], texts[1:]) if part
                         for e in self.hf.encode_batch_fast(part, add_special_tokens=False)]
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        with _panics_refused(f"tokenizer {self.source} failed to decode", self.panics):
            return self.hf.decode(list(ids), skip_special_tokens=True)


@dataclass(frozen=True)
class SentencePieceTokenizer:
    """A SentencePiece model (LLaMA style: BOS 1, EOS 2); pad is 0 if the model has none."""

    sp: sentencepiece.SentencePieceProcessor
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    identity: str
    file: TokenizerFile | None = field(default=None, repr=False, compare=False)

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode(list(ids))


def load_tokenizer(
    path: str | None,
    corpus: Corpus | None,
    vocab_size: int = 8192,
    cache_dir: Path | None = None,
    specials: SpecialTokens = SpecialTokens(),
) -> Tokenizer:
    """Load `path` ('bytes', `*.json`, `*.model`), or with None train a BPE on `corpus`;
    `specials` name a file's special tokens."""
    named = next((f"--{role}-token" for role in _ROLES if getattr(specials, role) is not None
                  and isinstance(getattr(specials, role), str)), None)
    if named and path in ("bytes", None):
        raise UserError(f"{named}: names a token of a tokenizer file; the "
                        f"{path or 'trained BPE'} tokenizer has its own — drop {named}, or "
                        f"pass a tokenizer.json or .model")
    if path == "bytes":
        return ByteTokenizer()
    if path is None:
        if corpus is None:
            raise ValueError("load_tokenizer needs a corpus to train a tokenizer on")
        return train_bpe(corpus, vocab_size, cache_dir or default_cache_dir())
    file = Path(path)
    if not file.is_file():
        raise UserError(f"tokenizer file not found: {path} — {_FIX}")
    if file.suffix not in (".json", ".model"):
        raise UserError(f"unknown tokenizer file type: {path} — {_FIX}")
    size = file.stat().st_size
    if size > MAX_TOKENIZER_BYTES:
        raise UserError(f"tokenizer {file}: {size:,} bytes, past the {MAX_TOKENIZER_BYTES:,} "
                        f"bytes a tokenizer file may hold (MAX_TOKENIZER_BYTES; real ones hold "
                        f"at most ~33 MiB) — pass a tokenizer of fewer tokens")
    if file.suffix == ".json":
        return _load_hf(file, specials)
    return _load_sentencepiece(file, specials)


def default_cache_dir() -> Path:
    """Where trained tokenizers are kept: `$HOTJAX_CACHE/tokenizers`."""
    return cache_root() / "tokenizers"


def train_bpe(corpus: Corpus, vocab_size: int, cache_dir: Path) -> HFTokenizer:
    """A byte-level BPE trained on a fixed sample of `corpus`, cached by its fingerprint."""
    if corpus.pretokenized:
        raise UserError(f"--data {corpus.source} holds token ids: pass the --tokenizer that "
                        f"made them (none is trained on ids)")
    minimum = 256 + len(BPE_SPECIALS)
    if vocab_size < minimum:
        raise UserError(f"vocab size {vocab_size} is too small — a byte-level BPE needs {minimum}")
    path = cache_dir / f"bpe-{vocab_size}-{corpus.fingerprint}.json"
    if not path.is_file():
        hf = tokenizers.Tokenizer(tokenizers.models.BPE())
        hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(BPE_SPECIALS),
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(_sample(corpus), trainer=trainer)
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        hf.save(str(tmp))
        os.replace(tmp, path)
    return _load_hf(path)


def _sample(corpus: Corpus) -> Iterator[str]:
    """Documents in a fixed shuffled order until about BPE_SAMPLE_CHARS of text."""
    total = 0
    for i in np.random.default_rng(0).permutation(corpus.num_documents):
        if total >= BPE_SAMPLE_CHARS:
            return
        text = corpus.read(int(i))
        total += len(text)
        yield text


def _load_hf(file: Path, specials: SpecialTokens = SpecialTokens()) -> HFTokenizer:
    # A Rust panic inside `tokenizers` becomes one UserError line below, but Rust's hook prints
    # it first, with a backtrace of hundreds of lines per panicking thread when this is set.
    os.environ["RUST_BACKTRACE"] = "0"
    with _panics_refused(f"cannot load tokenizer {file}", []):
        try:
            hf = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises plain Exception for unreadable or corrupt files
            raise UserError(f"cannot load tokenizer {file}: {_first_line(e)} — {_FIX}") from None
        ids = hf.get_vocab(with_added_tokens=True).values()
    data = file.read_bytes()
    vocab_size = _vocabulary(file, max(ids))
    usual = {"bos": [bos for bos, _ in HF_SPECIALS], "eos": [eos for _, eos in HF_SPECIALS],
             "pad": ["<pad>"]}
    bos_id, eos_id, pad_id = _special_ids(file, specials, vocab_size, hf.token_to_id, usual)
    return HFTokenizer(hf=hf, vocab_size=vocab_size, bos_id=bos_id, eos_id=eos_id,
                       pad_id=pad_id, identity=f"hf:{_sha(data)}", source=str(file),
                       file=TokenizerFile(HF_JSON, data))


def _load_sentencepiece(file: Path, specials: SpecialTokens) -> SentencePieceTokenizer:
    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=str(file))
    except (OSError, RuntimeError) as e:
        raise UserError(f"cannot load tokenizer {file}: {_first_line(e)} — {_FIX}") from e
    data = file.read_bytes()
    vocab_size = _vocabulary(file, sp.get_piece_size() - 1)

    def piece_id(piece: str) -> int | None:
        found = sp.piece_to_id(piece)  # the unknown token's id for a piece it lacks
        return found if sp.id_to_piece(found) == piece else None

    own = zip(_ROLES, (sp.bos_id(), sp.eos_id(), sp.pad_id()), strict=True)
    usual = {role: [sp.id_to_piece(i)] if i >= 0 else [] for role, i in own}
    bos_id, eos_id, pad_id = _special_ids(file, specials, vocab_size, piece_id, usual)
    return SentencePieceTokenizer(sp=sp, vocab_size=vocab_size, bos_id=bos_id, eos_id=eos_id,
                                  pad_id=pad_id, identity=f"sentencepiece:{_sha(data)}",
                                  file=TokenizerFile(SENTENCEPIECE_MODEL, data))


def _special_ids(file: Path, specials: SpecialTokens, vocab_size: int,
                 token_id: Callable[[str], int | None],
                 usual: dict[str, list[str]]) -> tuple[int, int, int]:
    """BOS, EOS and pad ids of the tokenizer `file`: each as `specials` names it, else as the
    tokenizer_config.json beside the file names it, else the first of its `usual` spellings
    the vocabulary has (pad: else id 0). A named token the vocabulary lacks is refused."""
    config = _config_specials(file.parent / HF_CONFIG)
    found = []
    for role in _ROLES:
        flag, given = f"--{role}-token", getattr(specials, role)
        if isinstance(given, int):  # a checkpoint's record
            if not 0 <= given < vocab_size:
                raise UserError(f"tokenizer {file}: {role} id {given} is not one of its "
                                f"{vocab_size:,} ids — {flag} names its token")
            found.append(given)
            continue
        name, source = ((given, flag) if given is not None else
                        (config.get(role), f"the {role}_token of {file.parent / HF_CONFIG}"))
        if name is not None:
            token = token_id(name)
            if token is None:
                raise UserError(f"tokenizer {file} has no token {name!r} ({source}) — name "
                                f"one of its tokens with {flag}")
            found.append(token)
            continue
        token = next((t for t in map(token_id, usual[role]) if t is not None), None)
        if token is None and role != "pad":
            tried = ", ".join(dict.fromkeys(usual[role])) or "none"
            raise UserError(f"tokenizer {file} has no {role.upper()} token (tried {tried}; no "
                            f"{HF_CONFIG} beside it names one) — name it with {flag}")
        found.append(0 if token is None else token)
    return found[0], found[1], found[2]


def _config_specials(path: Path) -> dict[str, str]:
    """The special tokens a Hugging Face `tokenizer_config.json` names, if there is one: its
    `bos_token`, `eos_token` and `pad_token`, each a string or an object with a `content`
    string (how `transformers` writes an AddedToken); a null is absent."""
    if not path.is_file():
        return {}
    fix = "fix the file, or name the tokens with --bos-token, --eos-token and --pad-token"
    config = bounds.mapping(bounds.read_json(path, "tokenizer config", fix), "the file",
                            str(path), fix)
    found = {}
    for role in _ROLES:
        value = config.get(f"{role}_token")
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None:
            found[role] = bounds.text(value, f"{role}_token", str(path), fix)
    return found


def _vocabulary(file: Path, largest: int) -> int:
    """The embedding rows `file`'s ids need: its largest id + 1, not its count of tokens (ids
    may skip some), at most MAX_VOCAB."""
    if largest >= MAX_VOCAB:
        raise UserError(f"tokenizer {file}: its largest token id is {largest:,}, past the "
                        f"{MAX_VOCAB:,} rows a model's vocabulary may hold (MAX_VOCAB) — pass a "
                        f"tokenizer whose ids are under {MAX_VOCAB:,}")
    return largest + 1


@contextlib.contextmanager
def _panics_refused(what: str, panics: list[str]) -> Iterator[None]:
    """A Rust panic inside `tokenizers` (pyo3's PanicException: a BaseException, missed by
    `except Exception`, and importable by no name) as one UserError line. `panics` keeps the
    first; once it holds one, the block is refused without being run."""
    if not panics:
        try:
            yield
            return
        except BaseException as e:
            if type(e).__name__ != "PanicException":
                raise
            panics.append(_first_line(e))
    raise UserError(f"{what}: {panics[0]} — fix the tokenizer (a pre-tokenizer's regular "
                    f"expression that backtracks without end is one cause), or pass "
                    f"another") from None


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def hf_files(tokenizer: Tokenizer, model_max_length: int) -> dict[str, bytes]:
    """`tokenizer` as the files of a Hugging Face directory, which `AutoTokenizer` loads: its
    own file, byte for byte (the byte tokenizer written as a byte-level tokenizer.json of the
    same ids), `tokenizer_config.json` and `special_tokens_map.json`. It gives hotjax's ids,
    adding no BOS: a training sequence starts with one, so a prompt should too."""
    own = tokenizer.file if isinstance(tokenizer, HFTokenizer | SentencePieceTokenizer) else None
    if own is None and not isinstance(tokenizer, ByteTokenizer):
        raise UserError(f"tokenizer {tokenizer.identity} has no file to write: pass a "
                        f"tokenizer.json or a SentencePiece .model")
    own = own or TokenizerFile(HF_JSON, _byte_level().to_str().encode())
    if own.name == HF_JSON:
        hf = tokenizers.Tokenizer.from_str(own.data.decode())
        token, unk = hf.id_to_token, getattr(hf.model, "unk_token", None)
        cls = "PreTrainedTokenizerFast"
    else:
        sp = tokenizer.sp
        token, unk = sp.id_to_piece, sp.id_to_piece(sp.unk_id()) if sp.unk_id() >= 0 else None
        cls = "LlamaTokenizer"
    specials = {"bos_token": token(tokenizer.bos_id), "eos_token": token(tokenizer.eos_id),
                "pad_token": token(tokenizer.pad_id), "unk_token": unk}
    specials = {k: v for k, v in specials.items() if v is not None}
    config = {"tokenizer_class": cls, **specials, "model_max_length": model_max_length,
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False}
    return {own.name: own.data, "tokenizer_config.json": _json(config),
            "special_tokens_map.json": _json(specials)}


def _byte_level() -> tokenizers.Tokenizer:
    """`ByteTokenizer` in `tokenizers`: byte b is id b (GPT-2's printable character for each
    byte, merged never), then <pad>, <s>, </s> at 256, 257, 258."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    others = iter(range(256, 512))
    chars = [chr(b) if b in printable else chr(next(others)) for b in range(256)]
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: b for b, c in enumerate(chars)},
                                                    merges=[]))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                           use_regex=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    hf.add_special_tokens(list(BPE_SPECIALS))
    return hf


def _json(value: dict) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()
