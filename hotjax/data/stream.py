"""Documents to mini-batches of bucketed, packed rows, through Grain: each epoch a fresh seeded
shuffle, each process its own share, and an iterator state that resumes exactly.

The Grain graph is `range(documents) → shuffle(seed) → [process::processes] → repeat → read and
tokenize` (in background threads), then a `DatasetIterator` of our own that fills a window of
documents, splits it by length into buckets, packs each bucket first-fit-decreasing and keeps
each bucket's fullest rows. Sequences left over fill the room in a longer bucket's rows, and
what still finds none is carried to the next mini-batch: nothing is dropped. An epoch's carry is
drained before the next epoch starts, so every document of a process's share is in exactly one
mini-batch per epoch.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import grain
import numpy as np

from hotjax.data.buckets import bucket_of, estimated_lengths, plan_rows
from hotjax.data.corpus import Corpus
from hotjax.data.packing import (
    LONG_DOCUMENTS,
    Batch,
    assemble,
    first_fit,
    pack_rows,
    to_sequences,
)
from hotjax.data.tokenizer import Tokenizer
from hotjax.errors import UserError

READ_THREADS = 2  # threads reading and tokenizing ahead of the packer
READ_AHEAD = 256  # documents read ahead


@dataclass(frozen=True)
class BucketStats:
    """One bucket of one mini-batch: its fixed shape and what filled it."""

    max_len: int
    rows: int
    sequences: int
    real_tokens: int

    @property
    def padding_tokens(self) -> int:
        return self.rows * self.max_len - self.real_tokens


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer step's data: a Batch of [rows, max_len] per bucket, shortest first."""

    buckets: tuple[Batch, ...]
    stats: tuple[BucketStats, ...]
    epoch: int  # the epoch its documents come from
    carried: int  # sequences waiting for the next mini-batch

    @property
    def real_tokens(self) -> int:
        return sum(s.real_tokens for s in self.stats)

    @property
    def padding_tokens(self) -> int:
        return sum(s.padding_tokens for s in self.stats)


_Piece = tuple[int, int, np.ndarray]  # (document, piece of it, sequence)


class _Iterator(grain.DatasetIterator):
    # Grain's __del__ closes the iterator, even one whose __init__ raised (a UserError about
    # its options) before `DatasetIterator.__init__` ran: then there is nothing to close.
    _closed = True


class BucketedBatches(_Iterator):
    """Endless mini-batches of this process's share of `corpus`, the same for the same seed.

    A mini-batch is `batch_tokens` padded tokens, or about `batch_sequences` sequences, over all
    processes; each process reads and packs 1/`process_count` of it. Sequences go to the first
    bucket of `max_lens` that holds them (or, if its rows are full, a longer one). Bucket b
    always has `rows[b]` rows (planned from the corpus, see `hotjax.data.buckets`, unless
    given): a multiple of `row_multiples[b]`, so that they split evenly over this process's
    share of the batch shards of bucket b's strategy (the trainer knows that number).
    """

    def __init__(
        self,
        corpus: Corpus,
        tokenizer: Tokenizer,
        max_lens: Sequence[int],
        *,
        batch_tokens: int | None = None,
        batch_sequences: int | None = None,
        rows: Sequence[int] | None = None,
        row_multiples: int | Sequence[int] = 1,
        long_documents: str = "truncate",
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        read_threads: int = READ_THREADS,
    ) -> None:
        self.max_lens = tuple(int(m) for m in max_lens)
        multiples = ((row_multiples,) * len(self.max_lens) if isinstance(row_multiples, int)
                     else tuple(row_multiples))
        _check(self.max_lens, multiples, long_documents, seed, process_index, process_count)
        self.corpus, self.tokenizer, self.long_documents = corpus, tokenizer, long_documents
        self.seed, self.process = seed, (process_index, process_count)
        self.context = self.max_lens[-1]
        self._target_tokens, self._target_sequences = _share_of_batch(
            batch_tokens, batch_sequences, process_count, self.context)
        self._batch = (["tokens", batch_tokens] if batch_tokens is not None
                       else ["sequences", batch_sequences])
        if rows is None:
            lengths = (estimated_lengths(corpus, tokenizer, self.context, long_documents)
                       if len(self.max_lens) > 1 else ())
            rows = plan_rows(lengths, self.max_lens, multiples, batch_tokens=self._target_tokens,
                             batch_sequences=self._target_sequences)
        self.rows = tuple(int(r) for r in rows)
        if len(self.rows) != len(self.max_lens) or min(self.rows) < 1:
            raise UserError(f"rows {list(self.rows)}: give a positive row count for each of the "
                            f"{len(self.max_lens)} buckets")
        if self._target_tokens is not None:
            # The window holds a mini-batch's capacity; packing loses some, which is carried.
            self._target_tokens = sum(r * m for r, m in zip(self.rows, self.max_lens, strict=True))

        share = grain.MapDataset.range(corpus.num_documents).shuffle(seed=seed)
        share = share[process_index::process_count]
        self._epoch_length = len(share)
        if not self._epoch_length:
            raise UserError(f"{process_count} processes share {corpus.num_documents} documents "
                            f"of {corpus.source}: process {process_index} gets none — use fewer "
                            f"processes or a larger corpus")
        read = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=READ_AHEAD)
        documents = share.repeat().map(self._sequences).to_iter_dataset(read)
        super().__init__(iter(documents))
        self._epoch, self._taken, self._carry = 0, 0, []

    def get_state(self) -> dict:
        """A JSON-serialisable position: the next mini-batch starts here."""
        return {
            "epoch": self._epoch,
            "taken": self._taken,  # documents of this epoch's share read so far
            "carry": [[doc, piece] for doc, piece, _ in self._carry],
            "documents": self._parent.get_state(),
            "check": self._identity(),
        }

    def set_state(self, state: dict) -> None:
        """Continue exactly where `get_state` was called (in this or another iterator)."""
        if state["check"] != self._identity():
            raise UserError(f"data iterator state was saved for {state['check']}, but this "
                            f"iterator is {self._identity()}: resume with the same corpus, seed, "
                            f"buckets, batch size and process count")
        self._parent.set_state(dict(state["documents"]))
        self._epoch, self._taken = int(state["epoch"]), int(state["taken"])
        pieces: dict[int, list[np.ndarray]] = {}
        for doc, _ in state["carry"]:
            if doc not in pieces:
                pieces[doc] = self._sequences(doc)[1]
        self._carry = [(doc, piece, pieces[doc][piece]) for doc, piece in state["carry"]]

    def __next__(self) -> MiniBatch:
        window = self._fill()
        if not window:  # the epoch is over and fully emitted
            self._epoch, self._taken = self._epoch + 1, 0
            window = self._fill()
            if not window:
                raise UserError(f"no document of process {self.process[0]}'s share of "
                                f"{self.corpus.source} has tokens — use another corpus")
        by_bucket: list[list[int]] = [[] for _ in self.max_lens]
        for w, (_, _, seq) in enumerate(window):
            by_bucket[bucket_of(len(seq), self.max_lens)].append(w)
        length = [len(seq) for _, _, seq in window]
        batches, stats = [], []
        waiting: list[int] = []  # sequences that found no room in a smaller bucket's rows
        for max_len, num_rows, own in zip(self.max_lens, self.rows, by_bucket, strict=True):
            packed = [[own[j] for j in row] for row in pack_rows([length[w] for w in own],
                                                                    max_len)]
            packed.sort(key=lambda row: -sum(length[w] for w in row))  # fullest first, stable
            rows = packed[:num_rows] + [[] for _ in range(num_rows - len(packed))]
            left = [w for row in packed[num_rows:] for w in row]
            # Shorter sequences fill the room left in this bucket's rows: it is paid for anyway.
            free = [max_len - sum(length[w] for w in row) for row in rows]
            for w, r in zip(waiting, first_fit([length[w] for w in waiting], free), strict=True):
                (rows[r] if r >= 0 else left).append(w)
            waiting = sorted(left)
            batches.append(assemble([[window[w][2] for w in row] for row in rows], num_rows,
                                    max_len, self.tokenizer.pad_id))
            stats.append(BucketStats(max_len, num_rows, sum(map(len, rows)),
                                     sum(length[w] for row in rows for w in row)))
        self._carry = [window[w] for w in waiting]
        return MiniBatch(tuple(batches), tuple(stats), self._epoch, len(self._carry))

    def _fill(self) -> list[_Piece]:
        """The carried sequences plus new documents until a mini-batch's worth, or epoch end."""
        window, self._carry = self._carry, []
        tokens = sum(len(seq) for _, _, seq in window)
        while self._taken < self._epoch_length and (
            tokens < self._target_tokens if self._target_tokens is not None
            else len(window) < self._target_sequences
        ):
            doc, pieces = next(self._parent)
            self._taken += 1
            window += [(doc, k, seq) for k, seq in enumerate(pieces)]
            tokens += sum(map(len, pieces))
        return window

    def _sequences(self, doc: int) -> tuple[int, list[np.ndarray]]:
        """Document `doc` read, tokenized and cut into sequences (in Grain's reader threads)."""
        doc = int(doc)
        ids = self.tokenizer.encode(self.corpus.read(doc))
        try:
            return doc, to_sequences(ids, self.tokenizer, self.context, self.long_documents)
        except UserError as e:
            raise UserError(f"{self.corpus.describe(doc)}: {e}") from None

    def _identity(self) -> dict:
        return {"corpus": self.corpus.fingerprint, "seed": self.seed,
                "max_lens": list(self.max_lens), "rows": list(self.rows), "batch": self._batch,
                "process": list(self.process), "long_documents": self.long_documents}


class PackedBatches(_Iterator):
    """Endless batches of `batch_tokens // seq_len` packed rows of `seq_len` tokens: the
    one-bucket case of `BucketedBatches`, for the single-strategy trainer."""

    def __init__(self, corpus: Corpus, tokenizer: Tokenizer, seq_len: int, batch_tokens: int,
                 seed: int, *, long_documents: str = "truncate", process_index: int = 0,
                 process_count: int = 1) -> None:
        super().__init__(BucketedBatches(
            corpus, tokenizer, [seq_len], batch_tokens=batch_tokens, seed=seed,
            long_documents=long_documents, process_index=process_index,
            process_count=process_count))
        self.rows = self._parent.rows[0]

    def get_state(self) -> dict:
        return self._parent.get_state()

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state)

    def __next__(self) -> Batch:
        return next(self._parent).buckets[0]


def _check(max_lens: tuple[int, ...], multiples: tuple[int, ...], long_documents: str,
           seed: int, process_index: int, process_count: int) -> None:
    if not max_lens or min(max_lens) < 1 or list(max_lens) != sorted(set(max_lens)):
        raise UserError(f"bucket lengths {list(max_lens)}: give positive, increasing lengths")
    if len(multiples) != len(max_lens) or min(multiples) < 1:
        raise UserError(f"row multiples {list(multiples)}: give a positive multiple for each of "
                        f"the {len(max_lens)} buckets")
    if long_documents not in LONG_DOCUMENTS:
        raise UserError(f"long documents {long_documents!r}: choose one of "
                        f"{', '.join(LONG_DOCUMENTS)}")
    if not 0 <= seed < 2**32:
        raise UserError(f"seed {seed}: choose a seed from 0 to 2**32 - 1")
    if not 0 <= process_index < process_count:
        raise UserError(f"process {process_index} of {process_count}: the index must be from 0 "
                        f"to {process_count - 1}")


def _share_of_batch(batch_tokens: int | None, batch_sequences: int | None, process_count: int,
                    context: int) -> tuple[int | None, int | None]:
    """This process's part of the mini-batch: (tokens, None) or (None, sequences)."""
    if (batch_tokens is None) == (batch_sequences is None):
        raise UserError("give the mini-batch size as batch_tokens or batch_sequences, not both")
    total = batch_tokens if batch_tokens is not None else batch_sequences
    name = "batch_tokens" if batch_tokens is not None else "batch_sequences"
    if total % process_count:
        raise UserError(f"{name} ({total}) does not split over {process_count} processes: make "
                        f"it a multiple of {process_count}")
    share = total // process_count
    if batch_tokens is not None and share < context:
        per = " per process" if process_count > 1 else ""
        raise UserError(f"batch_tokens ({share}{per}) must be at least the longest bucket's "
                        f"length ({context}) — raise batch_tokens or lower the context")
    if share < 1:
        raise UserError(f"{name} ({total}) must be positive")
    return (share, None) if batch_tokens is not None else (None, share)
