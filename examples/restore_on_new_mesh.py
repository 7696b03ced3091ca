"""Restore a hotjax checkpoint onto another mesh, strategy or device count, and train on.

    python examples/restore_on_new_mesh.py runs/ck/20 --devices 4 --strategy "fsdp=2,tensor=2"

Checkpoints hold every array whole and in logical form (no mesh in them), so any layout reads
them: the state is laid out in the new run's home strategy and the mini-batches continue where
the saved run's stopped. The run's data settings (corpus, tokenizer, batch size, seed) are read
from the checkpoint, so the continued run sees the data the saved one would have.
"""

import argparse
import json
import sys

import hotjax
from hotjax.commands.options import add_options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a step directory, or a checkpoint directory")
    add_options(parser, "devices", "strategy", devices=4)  # the new layout
    parser.add_argument("--steps", type=int, help="train up to this step (default: the saved "
                        "run's last; its learning-rate schedule ends there either way)")
    args = parser.parse_args()

    devices = hotjax.start_jax(args.devices)
    # The saved run's model, data, tokenizer, batch, seed and optimizer; the new layout.
    config = hotjax.resumed_config(args.checkpoint, strategy=args.strategy)
    steps = args.steps or config.steps
    with hotjax.Run.from_config(config, devices=devices) as run:
        state, start = run.restore(args.checkpoint)
        if start >= steps:
            print(f"step {start} reached: nothing to train (--steps {steps})", file=sys.stderr)
        for step in range(start + 1, steps + 1):
            state, metrics = run.step(state)
            print(json.dumps({"step": step, "loss": metrics["loss"]}), flush=True)


if __name__ == "__main__":
    main()
