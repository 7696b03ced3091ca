"""Documents to mini-batches through Grain: each epoch a fresh seeded shuffle, and an iterator
state that resumes exactly.

A mini-batch is data, never layout. It is the next sequences of the shuffled corpus up to
`batch_tokens` real tokens (the sequence that would pass the budget starts the next mini-batch)
or exactly `batch_sequences` sequences; each sequence goes to the first bucket that holds it and
is packed first-fit-decreasing into rows of that bucket's length (`buckets.pack_buckets`). How
many rows each bucket gets therefore changes from step to step; how those rows are cut into
fixed-shape micro-batches is the trainer's business, so no strategy, table, device count or
process count changes which documents a step sees or how they are packed.

The Grain graph is `range(documents) → shuffle(seed) → repeat → read and tokenize` (in
background threads). The iterator's state is the stream position, the documents read ahead and
the pieces of a split document not yet used: it holds nothing about the layout.

A run of several processes reads the stream as one: given a `Share`, a process reads and
tokenizes only the documents at its positions of the stream (every `count`-th), and the token ids
of each round of `ROUND` documents per process are exchanged (`Share.gather`, a collective that
every process calls at the same point). So each process holds the whole mini-batch, as one
process would have read it, having done 1/count of the reading.
"""

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from hotjax import bounds
from hotjax.bounds import host_memory
from hotjax.config import BATCH_HOST_FRACTION
from hotjax.data.buckets import pack_buckets
from hotjax.data.corpus import Corpus
from hotjax.data.packing import LONG_DOCUMENTS, Batch, assemble, to_sequences
from hotjax.data.tokenizer import Tokenizer
from hotjax.errors import UserError

READ_THREADS = 2  # threads reading and tokenizing ahead of the packer
READ_AHEAD = 256  # documents read ahead
PACKING = ("ffd", "none")  # first-fit-decreasing, or one sequence per row (padded)
ROUND = 32  # documents per process read between two exchanges of a run of several processes
# Host bytes per byte of text that a document read back costs: at most one int32 token per
# byte, plus BOS and EOS.
RESTORE_BYTES_PER_BYTE = 4
# Documents a position may name as read ahead: a round per process, for up to 1024 processes
# (each is read again when the position is restored).
MAX_AHEAD = ROUND * 1024


@dataclass(frozen=True)
class Share:
    """This process's part of the reading: the stream positions `i` with `i % count == index`.
    `gather(vector)` returns every process's vector, process 0's first (a collective)."""

    index: int
    count: int
    gather: Callable[[np.ndarray], list[np.ndarray]]


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer step's data: each bucket's packed rows `[rows, max_len]`, shortest bucket
    first. A bucket holds exactly the rows its sequences need, possibly none."""

    buckets: tuple[Batch, ...]
    epoch: int = 0  # the epoch of its first sequence

    @property
    def max_lens(self) -> tuple[int, ...]:
        return tuple(b.tokens.shape[1] for b in self.buckets)

    @property
    def real_tokens(self) -> int:
        return sum(b.real_tokens for b in self.buckets)

    @property
    def sequences(self) -> int:
        return sum(b.sequences for b in self.buckets)

    def document_lengths(self) -> np.ndarray:
        """The tokens of each document (or piece of one) in its rows, bucket by bucket."""
        counts = [np.unique(row[row > 0], return_counts=True)[1]
                  for batch in self.buckets for row in batch.segment_ids]
        return np.concatenate([np.zeros(0, np.int64), *counts]).astype(np.int64)


_Piece = tuple[int, int, int, np.ndarray]  # (read index, document, piece of it, sequence)


class _Iterator(grain.DatasetIterator):
    # Grain's __del__ closes the iterator, even one whose __init__ raised (a UserError about
    # its options) before `DatasetIterator.__init__` ran: then there is nothing to close.
    _closed = True


class MiniBatches(_Iterator):
    """Endless mini-batches of `corpus`, the same for the same seed and batch size."""

    def __init__(
        self,
        corpus: Corpus,
        tokenizer: Tokenizer,
        max_lens: Sequence[int],
        *,
        batch_tokens: int | None = None,
        batch_sequences: int | None = None,
        long_documents: str = "truncate",
        packing: str = "ffd",
        seed: int = 0,
        read_threads: int = READ_THREADS,
        share: Share | None = None,
    ) -> None:
        self.max_lens = tuple(int(m) for m in max_lens)
        _check(self.max_lens, batch_tokens, batch_sequences, long_documents, packing, seed)
        self.corpus, self.tokenizer, self.long_documents = corpus, tokenizer, long_documents
        self.seed, self.packing = seed, packing
        self.context = self.max_lens[-1]
        self.batch_tokens, self.batch_sequences = batch_tokens, batch_sequences
        self.share = share
        read = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=READ_AHEAD)
        documents = (grain.MapDataset.range(corpus.num_documents).shuffle(seed=seed).repeat()
                     .map_with_index(self._read_share).to_iter_dataset(read))
        super().__init__(iter(documents))
        self._read = 0  # documents taken from the stream into `_pending`, over all epochs
        self._ahead: deque[tuple[int, list[np.ndarray]]] = deque()  # read, not yet taken
        self._pending: list[_Piece] = []  # sequences taken but not yet in a mini-batch

    def get_state(self) -> dict:
        """A JSON-serialisable position: the next mini-batch starts here."""
        return {"read": self._read,
                "ahead": [doc for doc, _ in self._ahead],
                "pending": [[i, doc, piece] for i, doc, piece, _ in self._pending],
                "documents": self._parent.get_state(), "check": self._identity()}

    def set_state(self, state: dict) -> None:
        """Continue exactly where `get_state` was called (in this or another iterator)."""
        _check_position(state)
        if state["check"] != self._identity():
            saved = str(state["check"])[:300]  # as written, or a stranger's text of any size
            raise UserError(f"data iterator state was saved for {saved}, but this "
                            f"iterator is {self._identity()}: resume with the same corpus, "
                            f"tokenizer, seed, context, long-document handling and batch size")
        ahead, pending = state.get("ahead", []), state["pending"]
        self._check_documents([*ahead, *{doc for _, doc, _ in pending}])
        self._parent.set_state(dict(state["documents"]))
        self._read = int(state["read"])
        # Documents read ahead are read again here, by every process: at most a round of them.
        self._ahead = deque(self._sequences(doc) for doc in ahead)
        pieces = {doc: self._sequences(doc)[1] for _, doc, _ in pending}
        odd = next(((doc, piece) for _, doc, piece in pending if piece >= len(pieces[doc])),
                    None)
        if odd is not None:
            raise UserError(f"the data position names piece {odd[1]} of document {odd[0]}, "
                            f"which has {len(pieces[odd[0]])}: resume with the checkpoint's "
                            f"corpus, tokenizer and context")
        self._pending = [(i, doc, piece, pieces[doc][piece]) for i, doc, piece in pending]

    def _check_documents(self, docs: list[int]) -> None:
        """The documents a position names exist, and read back fit a share of host memory."""
        count = self.corpus.num_documents
        bad = next((doc for doc in docs if not 0 <= doc < count), None)
        if bad is not None:
            raise UserError(f"the data position names document {bad}, but {self.corpus.source}"
                            f" has {count}: resume with the checkpoint's corpus")
        cost = int(self.corpus.sizes_D[docs].sum()) * RESTORE_BYTES_PER_BYTE if docs else 0
        if cost > host_memory() * BATCH_HOST_FRACTION:
            raise UserError(f"the data position names {len(docs):,} documents to read again, "
                            f"about {cost / 2**30:,.1f} GiB of tokens, past "
                            f"{BATCH_HOST_FRACTION:.0%} of this machine's memory: the "
                            f"checkpoint is damaged: resume from another checkpoint")

    def __next__(self) -> MiniBatch:
        chosen: list[_Piece] = []
        tokens, unproductive = 0, 0
        while self.batch_sequences is None or len(chosen) < self.batch_sequences:
            if not self._pending:
                if not self._ahead:
                    self._read_round()
                doc, pieces = self._ahead.popleft()
                self._pending = [(self._read, doc, k, seq) for k, seq in enumerate(pieces)]
                self._read += 1
                unproductive = 0 if pieces else unproductive + 1
                if unproductive > self.corpus.num_documents:
                    raise UserError(f"no document of {self.corpus.source} has tokens: use "
                                    f"another corpus")
                continue
            length = len(self._pending[0][3])
            if chosen and self.batch_tokens is not None and tokens + length > self.batch_tokens:
                break
            chosen.append(self._pending.pop(0))
            tokens += length
        sequences = [seq for *_, seq in chosen]
        lengths = [len(seq) for seq in sequences]
        rows = (pack_buckets(lengths, self.max_lens) if self.packing == "ffd"
                else _one_per_row(lengths, self.max_lens))
        batches = tuple(assemble([[sequences[i] for i in row] for row in bucket_rows],
                                 len(bucket_rows), max_len, self.tokenizer.pad_id)
                        for bucket_rows, max_len in zip(rows, self.max_lens, strict=True))
        return MiniBatch(batches, epoch=chosen[0][0] // self.corpus.num_documents)

    def _read_round(self) -> None:
        """The next document (one process), or the next round of documents, each process
        reading its share and receiving the others'."""
        if self.share is None or self.share.count == 1:
            self._ahead.append(next(self._parent))
            return
        count = self.share.count
        first = self._read + len(self._ahead)
        docs = [next(self._parent) for _ in range(ROUND * count)]
        mine = [pieces for position, (_, pieces) in enumerate(docs, first)
                if position % count == self.share.index]
        theirs = [_unpack(vector) for vector in self.share.gather(_packed(mine))]
        for position, (doc, _) in enumerate(docs, first):
            self._ahead.append((doc, theirs[position % count].pop(0)))

    def _read_share(self, position: int, doc: int) -> tuple[int, list[np.ndarray] | None]:
        """The document at `position` of the stream if it is this process's to read."""
        if self.share is None or position % self.share.count == self.share.index:
            return self._sequences(doc)
        return int(doc), None

    def _sequences(self, doc: int) -> tuple[int, list[np.ndarray]]:
        """Document `doc` read, tokenized and cut into sequences (in Grain's reader threads)."""
        doc = int(doc)
        try:
            ids = self.corpus.encode(doc, self.tokenizer)
            return doc, to_sequences(ids, self.tokenizer, self.context, self.long_documents)
        except UserError as e:
            raise UserError(f"{self.corpus.describe(doc)}: {e}") from None

    def _identity(self) -> dict:
        batch = (["tokens", self.batch_tokens] if self.batch_tokens is not None
                 else ["sequences", self.batch_sequences])
        return {"corpus": self.corpus.fingerprint, "tokenizer": self.tokenizer.identity,
                "seed": self.seed, "context": self.context,
                "long_documents": self.long_documents, "batch": batch}


def _check_position(state: Any) -> None:
    """A position read from a checkpoint holds what `set_state` reads, of the right types and
    ranges (`MiniBatches._check_documents` checks its documents against the corpus)."""
    where, fix = "the data position", "the checkpoint is damaged: resume from another one"
    state = bounds.mapping(state, "the position", where, fix)
    bounds.mapping(state.get("check"), "check", where, fix)
    bounds.whole(state.get("read"), "read", 0, bounds.MAX_COUNT, where, fix)
    ahead, pending = state.get("ahead", []), state.get("pending")
    if not isinstance(ahead, list) or len(ahead) > MAX_AHEAD:
        raise UserError(f"{where}: ahead is {bounds.show(ahead)}, not a list of at most "
                        f"{MAX_AHEAD:,} documents (MAX_AHEAD): {fix}")
    for doc in ahead:
        bounds.whole(doc, "a document read ahead", 0, bounds.MAX_COUNT, where, fix)
    if not isinstance(pending, list):
        raise UserError(f"{where}: pending is {bounds.show(pending)}, not a list: {fix}")
    for entry in pending:
        if not (isinstance(entry, list) and len(entry) == 3):
            raise UserError(f"{where}: a pending piece is {bounds.show(entry)}, not [read, "
                            f"document, piece]: {fix}")
        for value in entry:
            bounds.whole(value, "a pending piece's number", 0, bounds.MAX_COUNT, where, fix)
    documents = bounds.mapping(state.get("documents"), "documents", where, fix)
    bounds.whole(documents.get("next_index"), "documents.next_index", 0, bounds.MAX_COUNT,
                 where, fix)


def _packed(documents: list[list[np.ndarray]]) -> np.ndarray:
    """Documents' sequences as one int32 vector: the number of documents, each one's number of
    sequences, every sequence's length, then the tokens."""
    sequences = [seq for pieces in documents for seq in pieces]
    header = [len(documents), *(len(p) for p in documents), *(len(q) for q in sequences)]
    return np.concatenate([np.array(header, np.int32), *sequences]).astype(np.int32)


def _unpack(vector: np.ndarray) -> list[list[np.ndarray]]:
    """The documents `_packed` wrote (any padding after them ignored)."""
    count = int(vector[0])
    pieces = [int(p) for p in vector[1:1 + count]]
    lengths = [int(n) for n in vector[1 + count:1 + count + sum(pieces)]]
    ends = np.cumsum([1 + count + len(lengths), *lengths])
    sequences = [vector[a:b] for a, b in zip(ends[:-1], ends[1:], strict=True)]
    starts = np.cumsum([0, *pieces])
    return [sequences[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


def _one_per_row(lengths: Sequence[int], max_lens: Sequence[int]) -> list[list[list[int]]]:
    """Each sequence alone in a row of its bucket (the padded, unpacked layout)."""
    rows: list[list[list[int]]] = [[] for _ in max_lens]
    for i, length in enumerate(lengths):
        rows[next(b for b, m in enumerate(max_lens) if length <= m)].append([i])
    return rows


def _check(max_lens: tuple[int, ...], batch_tokens: int | None, batch_sequences: int | None,
           long_documents: str, packing: str, seed: int) -> None:
    if not max_lens or min(max_lens) < 1 or list(max_lens) != sorted(set(max_lens)):
        raise UserError(f"bucket lengths {list(max_lens)}: give positive, increasing lengths")
    if (batch_tokens is None) == (batch_sequences is None):
        raise UserError("give the mini-batch size as batch_tokens or batch_sequences, not both")
    if batch_tokens is not None and batch_tokens < max_lens[-1]:
        raise UserError(f"batch_tokens ({batch_tokens}) must be at least the longest bucket's "
                        f"length ({max_lens[-1]}): raise --batch-tokens or lower the context")
    if batch_sequences is not None and batch_sequences < 1:
        raise UserError(f"batch_sequences ({batch_sequences}) must be positive")
    if long_documents not in LONG_DOCUMENTS:
        raise UserError(f"long documents {long_documents!r}: choose one of "
                        f"{', '.join(LONG_DOCUMENTS)}")
    if packing not in PACKING:
        raise UserError(f"packing {packing!r}: choose one of {', '.join(PACKING)}")
    if not 0 <= seed < 2**32:
        raise UserError(f"seed {seed}: choose a seed from 0 to 2**32 - 1")
