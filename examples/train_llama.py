"""Train a LLaMA model with hotjax from your own loop.

    python examples/train_llama.py --model tiny --steps 20 --devices 8

`hotjax train` is this loop plus a progress bar; here the loop is yours: what it logs, when it
saves, what else it does between steps. With no --strategy, 8 devices (8 simulated CPUs on a
machine without an accelerator) run the default hot-switched table; `--strategies auto` plans
one for this machine.
"""

import argparse
import itertools
import json
import time

import hotjax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="model preset (default: %(default)s)")
    parser.add_argument("--devices", type=int, default=8)
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument("--strategy", help='one strategy, e.g. "fsdp=8"')
    layout.add_argument("--strategies", help="a strategy table (.toml), or auto")
    parser.add_argument("--data", help="a corpus (default: the Python standard library)")
    parser.add_argument("--tokenizer", help="tokenizer.json, or bytes (default: a trained BPE)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--compute-dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt-dir", help="save here every --save-every steps and at the end")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--eval-data", help="held-out documents: their loss every --eval-every "
                        "steps")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-batches", type=int, default=2)
    args = parser.parse_args()

    hotjax.start_jax(args.devices)  # before anything starts JAX
    config = hotjax.RunConfig(
        model=args.model, devices=args.devices, strategy=args.strategy,
        strategies=args.strategies, data=args.data, tokenizer=args.tokenizer, steps=args.steps,
        batch_tokens=args.batch_tokens, compute_dtype=args.compute_dtype, seed=args.seed,
        ckpt_dir=args.ckpt_dir)

    with hotjax.Run(config) as run:
        state, start = run.initial_state()  # resumes from --ckpt-dir's latest if it has one
        # The same held-out mini-batches at every evaluation (this run's tokenizer and buckets).
        held_out = (list(itertools.islice(run.minibatches(args.eval_data), args.eval_batches))
                    if args.eval_data else [])
        smoothed = None
        for step in range(start + 1, args.steps + 1):
            began = time.perf_counter()
            state, metrics = run.step(state)  # all buckets, one optimizer update
            seconds = time.perf_counter() - began
            loss = metrics["loss"]
            smoothed = loss if smoothed is None else 0.9 * smoothed + 0.1 * loss
            print(json.dumps({"step": step, "loss": loss, "smoothed_loss": smoothed,
                              "tokens_per_s": metrics["tokens"] / seconds,
                              "padding": metrics["padding"],
                              "switched_mib": metrics["switched_bytes"] / 2**20}), flush=True)
            if held_out and (step % args.eval_every == 0 or step == args.steps):
                results = [run.evaluate(state, batch) for batch in held_out]  # no update
                loss = sum(r["loss"] * r["targets"] for r in results) / sum(
                    r["targets"] for r in results)
                print(json.dumps({"step": step, "eval_loss": loss}), flush=True)
            if args.ckpt_dir and (step % args.save_every == 0 or step == args.steps):
                run.save(step, state)


if __name__ == "__main__":
    main()
