"""Documents to fixed-shape rows: training sequences, first-fit-decreasing packing, and the
document-masked layout (segment ids, positions) the model reads.

Each document becomes `[bos] + tokens + [eos]`, truncated to the context, split into
context-length pieces, or refused; several sequences share a row, and no token attends across a
segment boundary.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hotjax.data.tokenizer import Tokenizer
from hotjax.errors import UserError

LONG_DOCUMENTS = ("truncate", "split", "error")  # what to do with a document over the context


@dataclass(frozen=True)
class Batch:
    """Packed rows, all [rows, seq_len] int32. Segment 0 is padding; segments 1.. are the
    row's documents in order; positions restart at 0 in each document and are 0 in padding."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray

    @property
    def real_tokens(self) -> int:
        """How many tokens are not padding."""
        return int(np.count_nonzero(self.segment_ids))

    @property
    def sequences(self) -> int:
        """How many sequences (documents or their pieces) the rows hold."""
        return int(self.segment_ids.max(axis=1, initial=0).sum())


def to_sequences(
    ids: Sequence[int], tokenizer: Tokenizer, context: int, long_documents: str = "truncate"
) -> list[np.ndarray]:
    """One document as training sequences: BOS, its tokens, EOS, then if longer than `context`
    cut to it ("truncate", as HotSPa does), cut into context-length pieces ("split"), or a
    UserError ("error"). A document with no tokens gives no sequence."""
    if not ids:
        return []
    seq = np.array([tokenizer.bos_id, *ids, tokenizer.eos_id], np.int32)
    if len(seq) <= context or long_documents == "truncate":
        return [seq[:context]]
    if long_documents == "split":
        return [seq[start:start + context] for start in range(0, len(seq), context)]
    raise UserError(f"a document of {len(seq)} tokens (with BOS and EOS) is longer than the "
                    f"largest bucket ({context}) — add a bucket of at least {len(seq)} tokens, "
                    f"or truncate or split long documents (--long-documents)")


def pack_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """First-fit-decreasing: document indices per row, longest first, ties by index. Each
    length goes to the first row with room for it, or opens a new row.

    A max-tree over the rows' free space finds that row in O(log rows), so packing a whole
    corpus stays fast.
    """
    for i, length in enumerate(lengths):
        if not 0 < length <= seq_len:
            raise ValueError(f"document {i} has length {length}, not in 1..{seq_len}")
    # Documents of the row's whole length come first and each fills a row no other enters:
    # their rows are made at once (a corpus split at the context is mostly such pieces).
    rows: list[list[int]] = [[i] for i, length in enumerate(lengths) if length == seq_len]
    rest = [i for i, length in enumerate(lengths) if length < seq_len]
    # At most one row per document: leaves beyond the rows opened so far are all free.
    size = 1 << max(len(rest) - 1, 0).bit_length()
    tree = [0] * size + [seq_len] * len(rest) + [-1] * (size - len(rest))
    for node in range(size - 1, 0, -1):
        tree[node] = max(tree[2 * node], tree[2 * node + 1])
    full = len(rows)
    for i in sorted(rest, key=lambda i: (-lengths[i], i)):
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= lengths[i] else 2 * node + 1
        row = full + node - size
        if row == len(rows):
            rows.append([])
        rows[row].append(i)
        tree[node] -= lengths[i]
        while node > 1:
            node //= 2
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
    return rows


def assemble(rows: list[list[np.ndarray]], num_rows: int, seq_len: int, pad_id: int) -> Batch:
    """Lay out `rows` of sequences into a Batch of `num_rows` rows; missing rows are padding."""
    tokens_RxT = np.full((num_rows, seq_len), pad_id, np.int32)
    segment_ids_RxT = np.zeros((num_rows, seq_len), np.int32)
    positions_RxT = np.zeros((num_rows, seq_len), np.int32)
    for r, row in enumerate(rows):
        start = 0
        for segment, seq_T in enumerate(row, start=1):
            stop = start + len(seq_T)
            tokens_RxT[r, start:stop] = seq_T
            segment_ids_RxT[r, start:stop] = segment
            positions_RxT[r, start:stop] = np.arange(len(seq_T))
            start = stop
    return Batch(tokens_RxT, segment_ids_RxT, positions_RxT)
