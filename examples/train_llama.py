"""Train a LLaMA model of your own with hotjax, from your own loop.

    python examples/train_llama.py --steps 20 --devices 8

The run is built from parts, each written here in Python: a model (`model`, not one of the
presets), a strategy table (`strategy_table`: short rows data parallel, long rows hot-switched
to FSDP x tensor parallelism), an optax optimizer (`optimizer`: hotjax's own AdamW, spelled in
optax; change it freely), a tokenizer and mini-batches. `hotjax train` is this loop plus a
progress bar, and trains the same given the same parts as files (`--model model.json
--strategies table.toml`); here the loop is yours: what it logs, when it saves, what it
evaluates between steps.
"""

import argparse
import itertools
import json
import sys
import time

import jax
import optax

import hotjax
from hotjax.commands.options import add_options
from hotjax.data import MiniBatches, load_tokenizer, open_corpus
from hotjax.models.llama import LlamaConfig, as_trained
from hotjax.sharding.strategy import Strategy
from hotjax.sharding.table import Bucket, StrategyTable


def model() -> LlamaConfig:
    """A model of this script's own (not a preset): 6 query heads share 2 key/value heads."""
    return LlamaConfig(vocab_size=259, dim=96, n_layers=2, n_heads=6, n_kv_heads=2,
                       ffn_dim=256, max_seq_len=1024)


def strategy_table(devices: int) -> StrategyTable:
    """Rows of up to 128 tokens data parallel over every device; up to 256, hot-switched to
    two ways each of data, FSDP and tensor parallelism (on 8 devices; else data parallel)."""
    long = ("data=2,fsdp=2,tensor=2,rules=megatron" if devices == 8
            else f"data={devices},rules=dp")
    return StrategyTable((Bucket(128, Strategy.parse(f"data={devices},rules=dp")),
                          Bucket(256, Strategy.parse(long))), "examples/train_llama.py")


def optimizer(lr: float, warmup_steps: int, steps: int) -> optax.GradientTransformation:
    """AdamW after clipping the global norm to 1, its learning rate warmed up linearly then
    decayed by a cosine to a tenth, weight decay on matrices only (not on norm scales)."""
    curve = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps,
                                               max(steps, warmup_steps + 1), lr * 0.1)

    def decayed(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "norm" not in jax.tree_util.keystr(path), params)

    # Counted from 1, as hotjax's: the first update is not a zero-learning-rate no-op.
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(lambda count: curve(count + 1), b1=0.9, b2=0.95, eps=1e-5,
                                   weight_decay=0.1, mask=decayed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(parser, "devices", "data", "tokenizer", "vocab_size", "batch_tokens",
                "compute_dtype", "seed", "steps", "lr", "warmup_steps", "ckpt_dir", "save_every",
                devices=8, batch_tokens=4096, steps=20, warmup_steps=2, save_every=10)
    parser.add_argument("--eval-data", help="held-out documents: their loss every --eval-every "
                        "steps")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-batches", type=int, default=2)
    args = parser.parse_args()

    devices = hotjax.start_jax(args.devices)  # before any JAX operation
    table = strategy_table(len(devices))
    corpus = open_corpus(args.data)
    tokenizer = load_tokenizer(args.tokenizer, corpus, vocab_size=args.vocab_size)
    batches = MiniBatches(corpus, tokenizer, [b.max_len for b in table.buckets],
                          batch_tokens=args.batch_tokens, long_documents="split", seed=args.seed)
    # The embedding holds the tokenizer's vocabulary (padded); matmuls in the compute dtype.
    trained = as_trained(model(), tokenizer.vocab_size, compute_dtype=args.compute_dtype)

    with hotjax.Run(trained, table, optimizer(args.lr, args.warmup_steps, args.steps), batches,
                    tokenizer=tokenizer, devices=devices, seed=args.seed,
                    ckpt_dir=args.ckpt_dir) as run:
        state, start = run.initial_state()  # resumes from --ckpt-dir's latest if it has one
        if start >= args.steps:
            print(f"step {start} reached: nothing to train (--steps {args.steps})",
                  file=sys.stderr)
        # The same held-out mini-batches at every evaluation (this run's tokenizer and buckets).
        held_out = (list(itertools.islice(run.minibatches(args.eval_data), args.eval_batches))
                    if args.eval_data else [])
        smoothed = None
        for step in range(start + 1, args.steps + 1):
            began = time.perf_counter()
            state, metrics = run.step(state)  # all buckets, one optimizer update; at once
            loss = metrics["loss"]  # waits for the step
            seconds = time.perf_counter() - began
            smoothed = loss if smoothed is None else 0.9 * smoothed + 0.1 * loss
            print(json.dumps({"step": step, "loss": loss, "smoothed_loss": smoothed,
                              "tokens_per_s": metrics["tokens"] / seconds,
                              "padding": metrics["padding"],
                              "switched_mib": metrics["switched_bytes"] / 2**20}), flush=True)
            if held_out and (step % args.eval_every == 0 or step == args.steps):
                loss = run.evaluate(state, held_out)["loss"]  # over all of them; no update
                print(json.dumps({"step": step, "eval_loss": loss}), flush=True)
            if args.ckpt_dir and (step % args.save_every == 0 or step == args.steps):
                run.save(step, state)


if __name__ == "__main__":
    main()
