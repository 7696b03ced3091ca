"""A checkpoint's own tokenizer: the file its step carries (`store` writes it with the step),
read back for a resume, an export or an import's record, and checked against the metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hotjax.checkpoint import meta as meta_lib
from hotjax.checkpoint.dirs import TOKENIZER
from hotjax.data.tokenizer import (
    HF_JSON,
    SENTENCEPIECE_MODEL,
    ByteTokenizer,
    SpecialTokens,
    Tokenizer,
    load_tokenizer,
)
from hotjax.errors import UserError


def carried(step_dir: Path, meta: dict[str, Any]) -> Tokenizer | None:
    """The tokenizer the checkpoint at `step_dir` was written with: the byte tokenizer, or the
    file it carries; None when it records none, or was written before checkpoints carried
    their tokenizer's file. A file that is not the one the metadata names is refused."""
    saved = meta.get("tokenizer")
    if not saved:
        return None
    if saved["identity"] == ByteTokenizer.identity:
        return ByteTokenizer()
    found = [step_dir / TOKENIZER / name for name in (HF_JSON, SENTENCEPIECE_MODEL)
             if (step_dir / TOKENIZER / name).is_file()]
    if not found:
        return None
    # The ids the run chose (by flags, or a tokenizer_config.json the checkpoint lacks).
    ids = SpecialTokens(*(saved.get(f"{role}_id") for role in ("bos", "eos", "pad")))
    tokenizer = load_tokenizer(str(found[0]), None, specials=ids)
    if tokenizer.identity != saved["identity"]:
        raise UserError(f"{found[0]}: tokenizer {tokenizer.identity}, not the "
                        f"{saved['identity']} its metadata records: {meta_lib.DAMAGED}")
    return tokenizer


def beside(directory: Path) -> Tokenizer | None:
    """The tokenizer of a Hugging Face directory: its tokenizer.json, else its
    tokenizer.model, else None."""
    for name in (HF_JSON, SENTENCEPIECE_MODEL):
        if (directory / name).is_file():
            return load_tokenizer(str(directory / name), None)
    return None


def for_resume(step_dir: Path, given: str | None) -> Tokenizer | None:
    """The tokenizer that continues the checkpoint at `step_dir`: its own; `given`
    (--tokenizer) only where it is the same one, or where the checkpoint carries none (None:
    load `given`, or the recorded one). Never a new tokenizer for the model's ids."""
    meta = meta_lib.read(step_dir)
    own = carried(step_dir, meta)
    if own is None:
        if given is None and meta.get("tokenizer") is None:
            raise UserError(f"{step_dir}: records no tokenizer, and a new one would give its "
                            f"model's ids other meanings: pass the --tokenizer it was trained "
                            f"with")
        return None
    if given is not None:
        theirs = load_tokenizer(given, None)
        if theirs.identity != own.identity:
            raise UserError(f"--tokenizer {given} ({theirs.identity}) is not the tokenizer "
                            f"{step_dir} was trained with ({own.identity}, "
                            f"{_where(step_dir, own)}): drop --tokenizer to use the "
                            f"checkpoint's own")
    return own


def _where(step_dir: Path, tokenizer: Tokenizer) -> str:
    """Where the checkpoint's tokenizer is, for a message."""
    file = getattr(tokenizer, "file", None)
    return "bytes" if file is None else str(step_dir / TOKENIZER / file.name)
