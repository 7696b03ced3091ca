"""`hotjax data stats`: a corpus's token lengths, bucket shares and padding, as tables, JSON or
a plot. Registered by `hotjax.cli`; imports neither JAX nor Grain (nor plotting) until needed."""

from __future__ import annotations

import argparse
import json

from hotjax.bounds import MAX_SEQ_LEN, MAX_VOCAB
from hotjax.commands.options import add_options
from hotjax.config import RunConfig, at_least, at_most
from hotjax.data.packing import LONG_DOCUMENTS
from hotjax.errors import UserError

_RUN = RunConfig()  # the defaults `hotjax train` uses


def register(commands: argparse._SubParsersAction) -> None:
    data = commands.add_parser("data", help="look at a corpus the way the trainer will see it")
    actions = data.add_subparsers(dest="data_command", required=True)
    stats = actions.add_parser(
        "stats", help="token-length histogram, bucket shares and padding waste of a corpus")
    stats.set_defaults(handler=_stats)
    add_options(stats, "data", "text_field", "data_split", "tokenizer", "bos_token", "eos_token",
                "pad_token", "vocab_size")
    stats.add_argument("--context", type=int, help="longest sequence in tokens (default: the "
                       f"table's largest bucket, else {_RUN.context})")
    buckets = stats.add_mutually_exclusive_group()
    buckets.add_argument("--strategies", metavar="TABLE.toml",
                         help="take the buckets from a strategy table")
    buckets.add_argument("--buckets", metavar="N,N,...", help="bucket lengths, e.g. 512,2048 "
                         "(default: the context / 8, / 4, / 2 and the context)")
    stats.add_argument("--long-documents", choices=LONG_DOCUMENTS, default=_RUN.long_documents,
                       help="documents over the context: truncate them (as HotSPa does), split "
                       "them into context-length pieces, or stop with an error (default: "
                       "%(default)s, as hotjax train)")
    stats.add_argument("--json", action="store_true", help="print one JSON document instead")
    stats.add_argument("--plot", metavar="OUT.png", help="also save the histograms as a PNG")


def _stats(args: argparse.Namespace) -> None:
    from rich.console import Console

    from hotjax.data import load_tokenizer, open_corpus
    from hotjax.data.stats import corpus_stats, document_lengths
    from hotjax.data.tokenizer import SpecialTokens

    at_least("--vocab-size", args.vocab_size, 1)
    at_most("--vocab-size", args.vocab_size, MAX_VOCAB, "MAX_VOCAB")
    max_lens, context = _buckets(args)
    if args.plot and not _writable(args.plot):
        raise UserError(f"--plot {args.plot}: its directory does not exist: create it or "
                        f"choose another path")
    corpus = open_corpus(args.data, args.text_field, args.data_split)
    tokenizer = load_tokenizer(args.tokenizer, corpus, vocab_size=args.vocab_size,
                               specials=SpecialTokens.of(args))
    console = Console(stderr=True)
    with console.status(f"tokenizing {corpus.num_documents} documents") as status:
        lengths_D = document_lengths(corpus, tokenizer, lambda done: status.update(
            f"tokenizing: {done} of {corpus.num_documents} documents"))
    report = corpus_stats(corpus, tokenizer, lengths_D, context, max_lens, args.long_documents)
    if args.plot:
        _plot(report, args.plot)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        out = Console()
        _print(report, out)
        if args.plot:
            out.print(f"plot saved to {args.plot}")


def _buckets(args: argparse.Namespace) -> tuple[list[int], int]:
    """Bucket lengths and the context, from --strategies, --buckets or --context."""
    if args.context is not None and args.context < 1:
        raise UserError(f"--context {args.context}: pass a positive number of tokens")
    at_most("--context", args.context, MAX_SEQ_LEN, "MAX_SEQ_LEN")
    if args.strategies:
        from hotjax.sharding.table import load_table

        max_lens = [b.max_len for b in load_table(args.strategies).buckets]
    elif args.buckets:
        try:
            max_lens = [int(n) for n in args.buckets.split(",")]
        except ValueError:
            raise UserError(f"--buckets {args.buckets}: give lengths like 512,2048,8192") from None
        if min(max_lens) < 1 or max_lens != sorted(set(max_lens)):
            raise UserError(f"--buckets {args.buckets}: give positive, increasing lengths")
        at_most("--buckets", max_lens[-1], MAX_SEQ_LEN, "MAX_SEQ_LEN")
    else:
        context = args.context or _RUN.context
        return sorted({max(context >> k, 1) for k in range(4)}), context
    if args.context is not None and args.context != max_lens[-1]:
        raise UserError(f"--context {args.context} differs from the largest bucket "
                        f"({max_lens[-1]}), which sets the context: drop --context")
    return max_lens, max_lens[-1]


def _writable(path: str) -> bool:
    from pathlib import Path

    return Path(path).resolve().parent.is_dir()


def _print(report: dict, console) -> None:
    from rich.table import Table

    c, t = report["corpus"], report["tokens"]
    summary = Table(title=f"corpus {c['source']}", show_header=False)
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    lengths = report["lengths"]
    for name, value in (
        ("documents", f"{c['documents']:,} ({c['empty']:,} empty)"),
        ("not UTF-8 (decoded with U+FFFD)", f"{c['replaced']:,}"),
        ("binary files skipped", f"{c['binary_skipped']:,}"),
        ("text", f"{c['bytes'] / 1e6:,.1f} MB"),
        ("tokenizer", f"{report['tokenizer']['identity']} "
                      f"({report['tokenizer']['vocab_size']:,} tokens)"),
        ("tokens (with BOS and EOS)", f"{t['documents']:,}"),
        ("document length p50 / p90 / p99",
         f"{lengths['p50']:,} / {lengths['p90']:,} / {lengths['p99']:,}"),
        ("longest document", f"{lengths['max']:,}"),
        (f"sequences ({report['long_documents']} at {report['context']:,})",
         f"{t['sequences']:,} holding {t['in_sequences']:,} tokens"),
        ("tokens lost to truncation",
         f"{t['truncated']:,} ({t['truncated'] / t['documents']:.1%})"),
    ):
        summary.add_row(name, value)
    console.print(summary)

    histogram = Table(title="document lengths in tokens")
    for column in ("length", "documents", "%", "tokens", "%", ""):
        histogram.add_column(column, justify="left" if not column else "right")
    documents = sum(h["documents"] for h in report["histogram"])
    for h in report["histogram"]:
        share = h["tokens"] / t["documents"]
        over = " *" if h["min"] > report["context"] else ""
        histogram.add_row(f"{h['min']:,}–{h['max']:,}{over}", f"{h['documents']:,}",
                          f"{h['documents'] / documents:.1%}", f"{h['tokens']:,}", f"{share:.1%}",
                          "█" * round(share * 20))
    histogram.caption = "* longer than the context"
    console.print(histogram)

    buckets = Table(title="buckets (sequences packed first-fit-decreasing within each)")
    for column in ("max_len", "sequences", "tokens", "token share", "rows", "padding"):
        buckets.add_column(column, justify="right")
    for b in report["buckets"]:
        padded = b["rows"] * b["max_len"]
        buckets.add_row(f"{b['max_len']:,}", f"{b['sequences']:,}", f"{b['tokens']:,}",
                        f"{b['token_share']:.1%}", f"{b['rows']:,}",
                        f"{b['padding'] / padded:.1%}" if padded else "–")
    console.print(buckets)

    layouts = Table(title="padding waste of each layout (whole corpus)")
    for column in ("layout", "rows", "padded tokens", "padding", "attention cost"):
        layouts.add_column(column, justify="left" if column == "layout" else "right")
    for lay in report["layouts"]:
        layouts.add_row(lay["name"], f"{lay['rows']:,}", f"{lay['padded_tokens']:,}",
                        f"{lay['waste']:.1%}", f"{lay['attention']:.2f}×")
    layouts.caption = "attention cost: rows × length², relative to packing to the context"
    console.print(layouts)


def _plot(report: dict, path: str) -> None:
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    histogram, context = report["histogram"], report["context"]
    lows = [h["min"] for h in histogram]
    fig, (count_ax, token_ax, waste_ax) = plt.subplots(
        1, 3, figsize=(15, 4.5), gridspec_kw={"width_ratios": [2, 2, 1.6]})
    for ax, key, label in ((count_ax, "documents", "documents"),
                           (token_ax, "tokens", "tokens (with BOS and EOS)")):
        ax.bar(lows, [h[key] for h in histogram], width=lows, align="edge",
               color="tab:blue", edgecolor="white")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("document length in tokens (power-of-two bins)")
        ax.set_ylabel(label)
        ax.set_title(f"{label.split(' (')[0]} by document length")
        for b in report["buckets"]:
            ax.axvline(b["max_len"], color="tab:orange", linestyle="--", linewidth=1)
        ax.axvline(context, color="tab:red", linewidth=1.5, label=f"context {context:,}")
        ax.plot([], [], color="tab:orange", linestyle="--", label="bucket boundaries")
        ax.legend(loc="upper left", fontsize=8)
    names = [lay["name"] for lay in report["layouts"]]
    waste = [100 * lay["waste"] for lay in report["layouts"]]
    bars = waste_ax.bar([textwrap.fill(n, 10) for n in names], waste,
                        color=["tab:gray", "tab:green", "tab:purple"])
    waste_ax.bar_label(bars, fmt="%.1f%%")
    waste_ax.set_ylabel("padding, % of row tokens")
    waste_ax.set_title("padding waste")
    waste_ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{report['corpus']['source']} — {report['tokens']['documents']:,} tokens, "
                 f"{report['tokenizer']['identity']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
