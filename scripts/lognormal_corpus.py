"""Cut a corpus into documents of log-normal lengths, as a .jsonl file of `{"text": ...}` records.

Pretraining corpora have long-tailed document lengths whose bulk of tokens sits in short
documents; the standard library's `.py` files do not (at an 8K context most of their tokens are
in files longer than half the context, each of which fills a row on its own). Megatron-LM's
dynamic context-parallelism example draws sequence lengths from a log-normal distribution; this
script does the same to real text: it reads the source corpus's documents in order, joins them
with newlines and cuts the stream into pieces whose lengths in characters are drawn from
log-normal(ln MEDIAN, SIGMA), clipped to [MIN, MAX]. Feed the file to any `--data`.
`--mix SHARE:MEDIAN[:SIGMA]` draws that share of the documents from a second log-normal
instead: a bimodal corpus, as HotSPa's mix of CommonCrawl's short pages and GitHub's long files.

    python scripts/lognormal_corpus.py lognormal.jsonl --median 2000 --sigma 1.2
    python scripts/lognormal_corpus.py bimodal.jsonl --median 600 --sigma 0.6 --mix 0.15:24000:0.5
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

# A log-normal component of the lengths: (share of the documents, median, sigma).
Component = tuple[float, float, float]


def pieces(texts: Iterator[str], rng: np.random.Generator, components: list[Component],
           lo: int, hi: int) -> Iterator[str]:
    """The joined `texts` cut into consecutive pieces whose lengths are drawn from the mixture
    of log-normal `components` (the last piece, shorter than its draw, is dropped)."""
    buffer, start = "", 0  # what is not yet cut: buffer[start:]
    want = _draw(rng, components, lo, hi)
    for text in texts:
        buffer = buffer[start:] + text + "\n"  # one copy a document, not one a piece
        start = 0
        while len(buffer) - start >= want:
            yield buffer[start:start + want]
            start += want
            want = _draw(rng, components, lo, hi)


def _draw(rng: np.random.Generator, components: list[Component], lo: int, hi: int) -> int:
    # One component draws nothing to choose it: the same seed cuts the same corpus as before.
    which = rng.choice(len(components), p=[c[0] for c in components]) if len(components) > 1 else 0
    _, median, sigma = components[which]
    return int(np.clip(rng.lognormal(np.log(median), sigma), lo, hi))


def mixture(args: argparse.Namespace) -> list[Component]:
    """The length distribution the flags give: the main log-normal, less the share `--mix`
    gives its second one."""
    if args.median <= 0 or args.sigma < 0:
        raise UserError("--median must be positive and --sigma not negative")
    if args.mix is None:
        return [(1.0, args.median, args.sigma)]
    fields = args.mix.split(":")
    try:
        share, median, sigma = (*map(float, fields), args.sigma)[:3]
    except ValueError:
        share = median = sigma = -1.0
    if not 2 <= len(fields) <= 3 or not 0 < share < 1 or median <= 0 or sigma < 0:
        raise UserError(f"--mix {args.mix}: give SHARE:MEDIAN[:SIGMA], a share between 0 and 1 "
                        f"of the documents drawn from a second log-normal, like 0.15:24000:0.5")
    return [(1 - share, args.median, args.sigma), (share, median, sigma)]


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
    parser.add_argument("--mix", metavar="SHARE:MEDIAN[:SIGMA]",
                        help="draw this share of the documents from a second log-normal of this "
                        "median (and sigma; default --sigma): a bimodal corpus")
    parser.add_argument("--min", type=int, default=32, help="shortest document (characters)")
    parser.add_argument("--max", type=int, default=200_000, help="longest document (characters)")
    parser.add_argument("--documents", type=int, default=20_000,
                        help="documents to write at most (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    components = mixture(args)
    if not 0 < args.min <= args.max or args.documents < 1:
        raise UserError("--documents must be positive, and 0 < --min <= --max")
    if args.out.suffix != ".jsonl":
        raise UserError(f"{args.out}: name the output .jsonl, the records format --data reads")
    corpus = open_corpus(args.data)
    texts = (corpus.read(i) for i in range(corpus.num_documents))
    rng = np.random.default_rng(args.seed)
    lengths = []
    with args.out.open("w") as f:
        for piece in pieces(texts, rng, components, args.min, args.max):
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
