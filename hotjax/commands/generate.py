"""`hotjax generate`: a checkpoint's model continues a prompt, its parameters laid out by a
strategy of one's choice; the text drawn goes to stdout, alone. The decoding is
`hotjax.models.decode`'s."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

from hotjax.errors import UserError

DEFAULT_STRATEGY = "data=1"
SLOTS = 64  # prompts and caches are sized in steps of this many tokens, so compiles are reused


def register(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser(
        "generate", help="continue a prompt with a checkpoint's model (greedy, temperature, "
        "top-p)")
    generate.set_defaults(handler=_generate)
    generate.add_argument("--checkpoint", "--ckpt-dir", dest="checkpoint", required=True,
                          metavar="DIR", help="a step directory, or a checkpoint directory "
                          "(its latest complete step)")
    generate.add_argument("--prompt", required=True, help="the text to continue")
    generate.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                          help="stop after N tokens, or at the end of a document (default: "
                          "%(default)s)")
    generate.add_argument("--temperature", type=float, default=0.0, metavar="T",
                          help="0 takes the likeliest token each step (greedy); above 0, "
                          "draws from the softmax of logits / T (default: %(default)s)")
    generate.add_argument("--top-p", type=float, default=1.0, metavar="P",
                          help="with a temperature, draw from the likeliest tokens holding "
                          "this share of the probability (default: %(default)s, all)")
    generate.add_argument("--seed", type=int, default=0, help="the draws' seed (default: "
                          "%(default)s)")
    generate.add_argument("--strategy", default=DEFAULT_STRATEGY, metavar="SPEC",
                          help='how the parameters lie over devices, as training\'s --strategy '
                          'takes it, e.g. "tensor=2,rules=megatron" (default: %(default)s, '
                          "one device)")
    generate.add_argument("--tokenizer", metavar="PATH", help="the tokenizer the checkpoint "
                          "was trained with, for a checkpoint that does not carry its own")


def _check(args: argparse.Namespace) -> None:
    """The options, before JAX starts."""
    from hotjax.config import at_least

    if not args.prompt:
        raise UserError("--prompt is empty: give the text to continue")
    at_least("--max-new-tokens", args.max_new_tokens, 1)
    at_least("--seed", args.seed, 0)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature {args.temperature}: pass 0 (greedy) or a positive "
                        f"number")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p {args.top_p}: pass a share of the probability above 0, at "
                        f"most 1")


def _generate(args: argparse.Namespace) -> None:
    _check(args)
    from hotjax.startup import start_jax

    devices = start_jax(None)
    import jax
    import numpy as np

    from hotjax.checkpoint import dirs, model
    from hotjax.checkpoint import meta as meta_lib
    from hotjax.models.decode import Sampling, generate

    step_dir = dirs.find(args.checkpoint)
    meta = meta_lib.read(step_dir)
    config = model.saved(meta, step_dir)
    tokenizer = _tokenizer(step_dir, meta, args.tokenizer)
    ids = [tokenizer.bos_id, *tokenizer.encode(args.prompt)]
    total = len(ids) + args.max_new_tokens
    if total > config.max_seq_len:
        raise UserError(f"--prompt of {len(ids) - 1} tokens and --max-new-tokens "
                        f"{args.max_new_tokens} make {total} tokens, past the model's "
                        f"{config.max_seq_len}: shorten the prompt or lower --max-new-tokens")
    params = _restore(step_dir, config, args.strategy, devices)
    prompt = np.zeros((1, _rounded(len(ids))), np.int32)
    prompt[0, :len(ids)] = ids
    started = time.perf_counter()
    out = generate(config, params, prompt, np.array([len(ids)], np.int32),
                   jax.random.key(args.seed), Sampling(args.temperature, args.top_p),
                   max_new_tokens=args.max_new_tokens, eos_id=tokenizer.eos_id,
                   vocab=tokenizer.vocab_size, slots=_rounded(max(prompt.shape[1], total)))
    drawn = np.asarray(out.tokens_BxS[0, len(ids):int(out.lengths_B[0])]).tolist()
    seconds = time.perf_counter() - started
    ended = bool(drawn) and drawn[-1] == tokenizer.eos_id
    print(tokenizer.decode(drawn[:-1] if ended else drawn), flush=True)
    print(f"hotjax: {len(drawn)} tokens in {seconds:.1f} s"
          + (", the end of a document" if ended else ""), file=sys.stderr)


def _rounded(tokens: int) -> int:
    return -(-tokens // SLOTS) * SLOTS


def _tokenizer(step_dir: Path, meta: dict[str, Any], given: str | None) -> Any:
    """The checkpoint's own tokenizer, or `given` where it carries none (or the same one)."""
    from hotjax.checkpoint.tokenizer import carried
    from hotjax.data import load_tokenizer

    own = carried(step_dir, meta)
    if given is None:
        if own is None:
            raise UserError(f"{step_dir}: carries no tokenizer file: pass the --tokenizer it "
                            f"was trained with")
        return own
    theirs = load_tokenizer(given, None)
    recorded = (meta.get("tokenizer") or {}).get("identity")
    if recorded is not None and theirs.identity != recorded:
        raise UserError(f"--tokenizer {given} ({theirs.identity}) is not the tokenizer "
                        f"{step_dir} was trained with ({recorded}): pass that one")
    return theirs


def _restore(step_dir: Path, config: Any, spec: str, devices: list) -> Any:
    """The checkpoint's parameters (fp32, no optimizer state), laid out by the strategy `spec`
    on its first devices."""
    import jax

    from hotjax.checkpoint import store
    from hotjax.models.llama import abstract_params, param_axes
    from hotjax.sharding.strategy import Layout, Strategy, fit_to_model

    strategy, _ = fit_to_model(Strategy.parse(spec), config)
    if strategy.num_devices > len(devices):
        raise UserError(f"--strategy {spec!r} uses {strategy.num_devices} devices but "
                        f"{len(devices)} {devices[0].platform} devices are available: choose a "
                        f"smaller mesh")
    layout = Layout(strategy, devices[:strategy.num_devices])
    shapes = abstract_params(config)
    shardings = layout.param_shardings(param_axes(config), shapes)
    targets = jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                    sharding=sharding),
                           shapes, shardings)
    return store.restore(step_dir, {store.PARAMS: targets}).arrays[store.PARAMS]
