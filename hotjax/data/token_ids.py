"""Pre-tokenized corpora: a `.npy` of token ids that the tokenizer never reads again.

The layout: one 1-D integer array, the documents' ids one after another, each document ending
with the tokenizer's EOS id (so the file's last id is the EOS, which `index` takes as the
separator); `--tokenizer` names the tokenizer that made them, for its vocabulary, BOS, EOS and pad.
Read memory-mapped (`numpy.load`, never a pickle), a document's ids at a time.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hotjax.data import records
from models.errors import UserError

SUFFIX = ".npy"
_FIX = ("save the ids with numpy.save as one 1-D integer array, each document followed by the "
        "tokenizer's EOS id")


@dataclass(frozen=True)
class TokenFile:
    """A `.npy` of ids, memory-mapped, and the EOS id that ends each of its documents."""

    ids_T: np.ndarray
    eos_id: int

    def document(self, a: int, b: int, tokenizer) -> list[int]:
        """Ids [a, b) (a document, without its EOS), checked against `tokenizer`."""
        if tokenizer.eos_id != self.eos_id:
            raise UserError(f"its documents end with id {self.eos_id}, but the tokenizer's EOS "
                            f"is {tokenizer.eos_id} — pass the --tokenizer that made the ids")
        ids = self.ids_T[a:b]
        if len(ids) and (int(ids.max()) >= tokenizer.vocab_size or int(ids.min()) < 0):
            raise UserError(f"holds ids outside 0 to {tokenizer.vocab_size - 1}, the tokenizer's"
                            f" — pass the --tokenizer that made the ids")
        return ids.tolist()


def open_ids(path: Path) -> TokenFile:
    """The ids of `path`, memory-mapped, refused unless one 1-D integer array ending with its
    separator."""
    try:
        ids_T = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise UserError(f"cannot read token ids {path}: {str(e)[:200]} — {_FIX}") from None
    if not isinstance(ids_T, np.ndarray) or ids_T.ndim != 1 or ids_T.dtype.kind not in "iu":
        raise UserError(f"{path}: holds {getattr(ids_T, 'dtype', type(ids_T).__name__)} of shape "
                        f"{getattr(ids_T, 'shape', '?')}, not one 1-D array of integer ids — "
                        f"{_FIX}")
    if not len(ids_T):
        raise UserError(f"{path}: holds no ids — {_FIX}")
    return TokenFile(ids_T, int(ids_T[-1]))


def index(path: Path) -> records.Found:
    """The documents of the `.npy` at `path`: the ids up to each EOS (the file's last id), each
    at most MAX_DOCUMENT_BYTES ids."""
    tokens = open_ids(path)
    ends_N = np.flatnonzero(tokens.ids_T == tokens.eos_id)
    starts_N = np.concatenate([[0], ends_N[:-1] + 1])
    sizes_N = (ends_N - starts_N).astype(np.int64)
    if sizes_N.max() > records.MAX_DOCUMENT_BYTES:
        doc = int(np.argmax(sizes_N))
        raise UserError(f"{path} (document {doc}): {int(sizes_N[doc]):,} ids, past the "
                        f"{records.MAX_DOCUMENT_BYTES:,} one document may hold "
                        f"(MAX_DOCUMENT_BYTES) — split the document")
    spans_Nx3 = np.stack([np.zeros_like(starts_N), starts_N, ends_N], axis=1).astype(np.int64)
    return records.Found("tokens", spans_Nx3, sizes_N, 0)
