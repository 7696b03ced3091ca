"""Cut a corpus into documents of log-normal lengths, as a .jsonl file of `{"text": ...}` records.

Pretraining corpora have long-tailed document lengths whose bulk of tokens sits in short
documents; the standard library's `.py` files do not (at an 8K context most of their tokens are
in files longer than half the context, each of which fills a row on its own). Megatron-LM's
dynamic context-parallelism example draws sequence lengths from a log-normal distribution; this
script does the same to real text: it reads the source corpus's documents in order, joins them
with newlines and cuts the stream into pieces whose lengths in characters are drawn from
log-normal(ln MEDIAN, SIGMA), clipped to [MIN, MAX]. Feed the file to any `--data`.

    python scripts/lognormal_corpus.py lognormal.jsonl --median 2000 --sigma 1.2
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from hotjax.data import open_corpus
from hotjax.errors import UserError


def pieces(texts: Iterator[str], rng: np.random.Generator, median: float, sigma: float,
           lo: int, hi: int) -> Iterator[str]:
    """The joined `texts` cut into consecutive pieces of log-normal lengths (the last piece,
    shorter than its draw, is dropped)."""
    buffer, start = "", 0  # what is not yet cut: buffer[start:]
    want = _draw(rng, median, sigma, lo, hi)
    for text in texts:
        buffer = buffer[start:] + text + "\n"  # one copy a document, not one a piece
        start = 0
        while len(buffer) - start >= want:
            yield buffer[start:start + want]
            start += want
            want = _draw(rng, median, sigma, lo, hi)


def _draw(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(np.clip(rng.lognormal(np.log(median), sigma), lo, hi))


def main(argv: list[str] | None = None) -> int:
    try:
        return write(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def write(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the .jsonl file to write")
    parser.add_argument("--data", help="the source corpus, as hotjax's --data (default: stdlib)")
    parser.add_argument("--median", type=float, default=2000.0,
                        help="median document length in characters (default: %(default)s)")
    parser.add_argument("--sigma", type=float, default=1.2,
                        help="log-normal sigma (default: %(default)s)")
    parser.add_argument("--min", type=int, default=32, help="shortest document (characters)")
    parser.add_argument("--max", type=int, default=200_000, help="longest document (characters)")
    parser.add_argument("--documents", type=int, default=20_000,
                        help="documents to write at most (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.median <= 0 or args.sigma < 0 or not 0 < args.min <= args.max or args.documents < 1:
        raise UserError("--median and --documents must be positive, --sigma not negative, and "
                        "0 < --min <= --max")
    if args.out.suffix != ".jsonl":
        raise UserError(f"{args.out}: name the output .jsonl, the records format --data reads")
    corpus = open_corpus(args.data)
    texts = (corpus.read(i) for i in range(corpus.num_documents))
    rng = np.random.default_rng(args.seed)
    lengths = []
    with args.out.open("w") as f:
        for piece in pieces(texts, rng, args.median, args.sigma, args.min, args.max):
            f.write(json.dumps({"text": piece}) + "\n")
            lengths.append(len(piece))
            if len(lengths) == args.documents:
                break
    if not lengths:
        raise UserError(f"{args.data or 'stdlib'}: too little text for one document of "
                        f"{args.min}+ characters")
    sizes = np.asarray(lengths)
    order = np.sort(sizes)
    half_mass = order[np.searchsorted(np.cumsum(order), sizes.sum() / 2)]
    print(f"{args.out}: {len(sizes):,} documents, {sizes.sum():,} characters; length median "
          f"{int(np.median(sizes)):,}, mean {int(sizes.mean()):,}, max {sizes.max():,}; half the "
          f"characters are in documents up to {int(half_mass):,}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
