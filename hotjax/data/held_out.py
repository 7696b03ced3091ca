"""Held-out data: documents split off a training corpus (the same ones for every run of it,
whatever the seed), and the fixed mini-batches an evaluation reads."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from hotjax.data.corpus import Corpus
from hotjax.data.tokenizer import Tokenizer
from hotjax.errors import UserError

if TYPE_CHECKING:
    from hotjax.data.stream import MiniBatch

HELD_OUT_SHARE = 0.1  # of a corpus's documents, the most a split holds out
SPLIT_SEED = 0x5EED  # the documents' order for splitting: not the run's --seed


def split(corpus: Corpus, tokenizer: Tokenizer, tokens: int) -> tuple[Corpus, Corpus]:
    """`corpus` as (training documents, held-out documents): in a fixed pseudo-random order,
    the first documents holding `tokens` tokens (BOS and EOS included), at most HELD_OUT_SHARE
    of them, are held out; the rest train. Only the held-out documents are read."""
    count = corpus.num_documents
    most = int(count * HELD_OUT_SHARE)
    if most < 1:
        raise UserError(f"--eval-every: {corpus.source} has {count} document(s), too few to "
                        f"hold {HELD_OUT_SHARE:.0%} out for evaluation: pass --eval-data")
    order_N = np.random.default_rng(SPLIT_SEED).permutation(count)
    held, found = 0, 0
    while held < most and found < tokens:
        found += len(corpus.encode(int(order_N[held]), tokenizer)) + 2
        held += 1
    return (corpus.subset(np.sort(order_N[held:]), "training"),
            corpus.subset(np.sort(order_N[:held]), "held-out"))


def take(batches: Iterable[MiniBatch], tokens: int) -> list[MiniBatch]:
    """The first mini-batches of `batches` up to `tokens` real tokens (at least one), read
    once: none from a second pass over the documents."""
    taken: list[MiniBatch] = []
    for batch in batches:
        if taken and batch.epoch > 0:
            break
        taken.append(batch)
        if sum(b.real_tokens for b in taken) >= tokens:
            break
    return taken
