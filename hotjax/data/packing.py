"""Documents to fixed-shape batches of packed rows, with segment ids for document masking.

Each document becomes one sequence, `[bos] + tokens + [eos]` truncated to the row length, and
several sequences share a row; no token attends across a segment boundary.
"""

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hotjax.data.corpus import Corpus
from hotjax.data.tokenizer import Tokenizer
from hotjax.errors import UserError

READ_CHUNK = 64  # documents read and tokenized together


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


def pack_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """First-fit-decreasing: document indices per row, longest first, ties by index."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        if not 0 < lengths[i] <= seq_len:
            raise ValueError(f"document {i} has length {lengths[i]}, not in 1..{seq_len}")
        row = next((r for r, space in enumerate(free) if space >= lengths[i]), len(rows))
        if row == len(rows):
            rows.append([])
            free.append(seq_len)
        rows[row].append(i)
        free[row] -= lengths[i]
    return rows


def to_sequence(ids: list[int], tokenizer: Tokenizer, seq_len: int) -> np.ndarray:
    """One document as a training sequence: BOS, its tokens, EOS, truncated to seq_len."""
    return np.array([tokenizer.bos_id, *ids, tokenizer.eos_id][:seq_len], np.int32)


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


class PackedBatches(Iterator[Batch]):
    """Endless batches of `batch_tokens // seq_len` packed rows, same for the same seed.

    Each epoch visits documents in a seeded permutation. A batch takes the documents carried
    over from the last batch plus new ones until they hold a full batch of tokens, packs them
    first-fit-decreasing, emits the fullest rows and carries the other rows' documents on; the
    last batch of an epoch is padded with empty rows. Documents with no tokens are dropped.
    """

    def __init__(
        self, corpus: Corpus, tokenizer: Tokenizer, seq_len: int, batch_tokens: int, seed: int
    ) -> None:
        if seq_len < 1 or batch_tokens < seq_len:
            raise UserError(
                f"batch_tokens ({batch_tokens}) must be at least seq_len ({seq_len}), which must "
                f"be positive — raise batch_tokens or lower seq_len"
            )
        self.corpus, self.tokenizer, self.seed = corpus, tokenizer, seed
        self.seq_len, self.rows = seq_len, batch_tokens // seq_len
        self.set_state({"epoch": 0, "cursor": 0, "carry": []})

    def get_state(self) -> dict:
        """Where the next batch starts: epoch, documents of the permutation taken, carried docs."""
        cursor = self._read_pos - len(self._ahead)
        return {"epoch": self._epoch, "cursor": cursor, "carry": [i for i, _ in self._carry]}

    def set_state(self, state: dict) -> None:
        """Continue exactly where `get_state` was called."""
        self._epoch = int(state["epoch"])
        self._order = self._permutation(self._epoch)
        self._read_pos = int(state["cursor"])
        self._ahead: deque[tuple[int, np.ndarray]] = deque()
        carry = [int(i) for i in state["carry"]]
        self._carry = list(zip(carry, self._tokenize(carry), strict=True))

    def __next__(self) -> Batch:
        window = self._fill_window()
        if not window:
            self.set_state({"epoch": self._epoch + 1, "cursor": 0, "carry": []})
            window = self._fill_window()
            if not window:
                raise UserError(f"empty corpus: no document of {self.corpus.source} has tokens")
        packed = pack_rows([len(seq_T) for _, seq_T in window], self.seq_len)
        fill = [sum(len(window[i][1]) for i in row) for row in packed]
        by_fill = sorted(range(len(packed)), key=lambda r: -fill[r])
        emit = [packed[r] for r in by_fill[: self.rows]]
        self._carry = [window[i] for r in by_fill[self.rows :] for i in packed[r]]
        rows = [[window[i][1] for i in row] for row in emit]
        return assemble(rows, self.rows, self.seq_len, self.tokenizer.pad_id)

    def _fill_window(self) -> list[tuple[int, np.ndarray]]:
        """The carried documents plus new ones until a batch's worth of tokens or epoch end."""
        window, self._carry = self._carry, []
        tokens = sum(len(seq_T) for _, seq_T in window)
        while tokens < self.rows * self.seq_len:
            if not self._ahead:
                if self._read_pos == len(self._order):
                    break
                chunk = [int(i) for i in self._order[self._read_pos : self._read_pos + READ_CHUNK]]
                self._read_pos += len(chunk)
                self._ahead.extend(zip(chunk, self._tokenize(chunk), strict=True))
            doc = self._ahead.popleft()
            if len(doc[1]):
                window.append(doc)
                tokens += len(doc[1])
        return window

    def _tokenize(self, docs: list[int]) -> list[np.ndarray]:
        """Sequences of the given documents; empty documents give empty arrays."""
        texts = [self.corpus.read(i) for i in docs]
        ids = self.tokenizer.encode_batch(texts)
        return [
            to_sequence(doc_ids, self.tokenizer, self.seq_len) if doc_ids else np.zeros(0, np.int32)
            for doc_ids in ids
        ]

    def _permutation(self, epoch: int) -> np.ndarray:
        # (seed, epoch) seeds a fresh stream per epoch, never shared between two seeds.
        return np.random.default_rng((self.seed, epoch)).permutation(self.corpus.num_documents)
