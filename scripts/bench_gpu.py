"""On one GPU: the packed-attention kernel checked and timed beside the others, a 1B-class
LLaMA's MFU, and the machine's measured profile beside the shipped H100 one.

    python scripts/bench_gpu.py PART [--json] [--quick]

Parts, each its own process (a failure or a hang in one loses nothing of the others):

- `check`: the packed-attention Pallas kernel (`hotjax.models.packed_attention`) under each of its
  backwards (`packed`: two-loop, `packed-fa2`: FA2's one pass, `packed-fa2-split`: its dQ
  apart) and one step of the ring's kernel pair over the whole row run for real, forward and
  backward, against the dense reference (every score materialised, float32, highest matmul
  precision) on packed rows with GQA, in float32 and bfloat16; and three training steps of the
  `small` model (float32, packed rows, `--attention auto`, so the Pallas kernel) on the GPU
  against the same steps on the host's CPU (the blockwise kernel).
- `cudnn`: cuDNN's packed attention (`hotjax.models.cudnn_attention`) against the same reference,
  with GQA, padding and a row past its document cap (the fallback); the versions that ran.
- `kernels`: forward + backward of one row of documents of about 256 and about 2,048 tokens and
  of one document, at 8K and 32K, LLaMA-3-8B's attention shape (32 query heads, 8 K/V heads,
  128 wide; and 64 wide), bfloat16: the Pallas kernel under its two-loop backward (`packed`)
  and its FA2 backwards (`packed-fa2`, `packed-fa2-split`; with `--fa2-tiles` also under
  those tiles, named `packed-fa2:QxW,warps,stages`); cuDNN's packed layout under the row's
  own document cap; one step of the ring's Pallas kernel pair with the row as both its query
  and its K/V chunk (the issue's "ring step within 1.2x of the packed kernel on the same
  block"); cuDNN's plain causal attention on the one-document row; with
  `--blockwise` the blockwise XLA kernel. TFLOP/s counts the (query, key) pairs the documents
  need, as the cost model does.
- `mfu`: a Llama-3.2-1B-shaped model (16 layers, 2048 wide, vocabulary 128,256, tied
  embeddings) trained by hotjax's own `Trainer` on one GPU, bf16, 16,384 tokens a step of rows
  of 2,048 and of 8,192 tokens (three documents a row): model FLOPs (`hotjax.models.work`, recompute
  not counted) per second over the GPU's dense bf16 peak, attention counted as 3.5 forwards
  (hotjax's cost model) and as 3 (MaxText's and PaLM's convention). `--model 8b-width-4`:
  four layers of Llama-3-8B's width instead; `--seq-lens`, `--remat`, `--scan-unroll` as
  named; `--trace`: two more steps under JAX's profiler, their kernels summed by name and by kind.
- `profile`: `hotjax plan --measure`'s measurement on this GPU, beside `h100-1x8.toml`.
- `calibrate`: the cost model against this GPU. The profile is measured as `profile` does; then
  the 1B model's gradient micro-step (the bucket step the trainer runs, no optimizer) at 16,384
  tokens in rows of 2,048 and 8,192, and one row of 32,768, each under every remat policy, each
  in a process of its own (so the allocator's peak is that step's): its median seconds, XLA's
  memory plan and the bytes the allocator really held at the peak, beside the cost model's
  time (under the shipped profile and under the one just measured) and memory
  (`hotjax.planning.memory.micro_step_memory`). Rows are whole causal documents, as the cost
  model's worst case.

Hardware: whatever GPU JAX sees; every figure is reported with its device name. `--quick` runs
each part at toy sizes on any platform (on CPU the Pallas kernel in its interpreter; no cuDNN),
a smoke test of the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

from hotjax.choices import ATTENTION_BACKENDS  # free of JAX: the parser's choices
from hotjax.targets import quiet_plugin_without_a_driver

# On a GPU machine this does nothing; without a driver (`--quick` on a CPU) the CUDA plugin
# stays unloaded, so it prints nothing.
quiet_plugin_without_a_driver()

PARTS = ("check", "cudnn", "kernels", "mfu", "profile", "calibrate")
# calibrate: (rows, tokens) of the micro-steps timed, full size and --quick.
CALIBRATE_SHAPES = {False: ((8, 2048), (2, 8192), (1, 32768)),
                    True: ((4, 128),)}
# The shipped profile whose dense bf16 peak a GPU shares (an H200 computes as an H100).
PEAK_PROFILES = {"H100": "h100-1x8", "H200": "h100-1x8", "A100": "a800-4x8", "A800": "a800-4x8"}
KERNEL_SHAPE = {"heads": 32, "kv_heads": 8, "head_dim": 128}
# What `kernels` times (`--kernels` picks among them; `--fa2-tiles` adds tiled variants).
KERNEL_NAMES = ("packed", "packed-two-loop", "packed-fa2", "packed-fa2-split", "ring-step",
                "ring-step-fa2-split", "cudnn-packed", "cudnn", "blockwise")
ONE_B = {"vocab_size": 128256, "dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8,
         "ffn_dim": 8192, "head_dim": 64, "tie_embeddings": True, "rope_theta": 500000.0}
# mfu's models: the 1B shape, and four layers of Llama-3-8B's width (its micro-step's matmuls
# are the 8B's own, the vocabulary's share of FLOPs larger).
MFU_MODELS = {"1b": ONE_B,
              "8b-width-4": {"vocab_size": 128256, "dim": 4096, "n_layers": 4, "n_heads": 32,
                             "n_kv_heads": 8, "ffn_dim": 14336, "head_dim": 128,
                             "tie_embeddings": False, "rope_theta": 500000.0}}


def _device():
    import jax

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    return (gpus or jax.devices())[0]


def _peak_tflops(kind: str) -> float | None:
    """The dense bf16 peak of a GPU named `kind` (`device_kind`), from the shipped profiles."""
    from hotjax.planning.profile import load_profile

    name = next((v for k, v in PEAK_PROFILES.items() if k in kind), None)
    return load_profile(name).peak_flops / 1e12 if name else None


def _document_pairs(segment_ids_BxT) -> int:
    """(query, key) pairs the document-causal mask keeps: n(n+1)/2 per document (id > 0)."""
    import numpy as np

    return sum(int(np.sum(n * (n + 1) // 2)) for n in
               (np.bincount(row[row > 0]) for row in segment_ids_BxT))


def _timed(fn, inputs, repeats: int) -> tuple[float, float, object]:
    """First call's seconds (compile), median of `repeats` later calls, and the result."""
    import jax

    started = time.perf_counter()
    result = jax.block_until_ready(fn(*inputs))
    first = time.perf_counter() - started
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append(time.perf_counter() - started)
    return first, statistics.median(times), result


def _qkv(B: int, T: int, N: int, K: int, H: int, dtype, seed: int = 0):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (B, T, N, H), jnp.float32).astype(dtype),
            jax.random.normal(keys[1], (B, T, K, H), jnp.float32).astype(dtype),
            jax.random.normal(keys[2], (B, T, K, H), jnp.float32).astype(dtype),
            jax.random.normal(keys[3], (B, T, N, H), jnp.float32).astype(dtype))


def _grad_step(attend, cotangent):
    import jax
    import jax.numpy as jnp

    def loss(q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32)), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def check(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_attention import make_row

    from hotjax.models.attention import dense_attention
    from hotjax.models.packed_attention import block_for

    device = _device()
    interpret = device.platform != "gpu"
    T = 256 if args.quick else 2048
    kernel_cases = []
    # Quick (Pallas' interpreter, which runs the same code at any head dim): no H=128 case.
    cases = (("float32", 64), ("bfloat16", 64)) + ((("bfloat16", 128),) if not args.quick else ())
    for dtype, H in cases:
        rows = [make_row("packed", T, doc, seed) for seed, doc in enumerate((T // 8, T // 3))]
        seg = jnp.asarray(np.concatenate([r[0] for r in rows]))
        pos = jnp.asarray(np.concatenate([r[1] for r in rows]))
        q, k, v, ct = _qkv(2, T, 8, 2, H, jnp.dtype(dtype))
        with jax.default_matmul_precision("highest"):
            ref = _grad_step(lambda q, k, v, seg=seg, pos=pos: dense_attention(
                q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), seg,
                pos), ct)
            (_, ref_out), ref_grads = jax.block_until_ready(ref(q, k, v))
        block = block_for(jnp.dtype(dtype), H, T)
        for kernel, attend in (
                *((name, packed_by(name, seg, interpret))
                  for name in ("packed-two-loop", "packed-fa2", "packed-fa2-split")),
                ("ring-step", ring_step_on_row(seg, pos, block, interpret=interpret)),
                ("ring-step-fa2-split", ring_step_on_row(seg, pos, block, interpret=interpret,
                                                         backward="fa2-split"))):
            (_, out), grads = jax.block_until_ready(_grad_step(attend, ct)(q, k, v))
            errors = {name: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)))
                      for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads),
                                            (ref_out, *ref_grads), strict=True)}
            scale = {name: float(jnp.max(jnp.abs(b))) for name, b in
                     zip(("out", "dq", "dk", "dv"), (ref_out, *ref_grads), strict=True)}
            kernel_cases.append({"kernel": kernel, "dtype": dtype, "shape": [2, T, 8, 2, H],
                                 "max_abs_error": errors, "max_abs_reference": scale})
            print(json.dumps(kernel_cases[-1]), file=sys.stderr, flush=True)
    return {"device": device.device_kind, "kernel": kernel_cases, "steps": _steps_vs_cpu(args)}


def packed_by(name: str, seg, interpret: bool):
    """The packed kernel a bench name asks for: `packed` under its default backward
    (`default_backward`), `packed-two-loop`, `packed-fa2` and `packed-fa2-split` under those
    backwards, the FA2 ones at `backward_tiles`' tiles or at the tiles after a colon
    (`packed-fa2:QxW,warps,stages`)."""
    from hotjax.models.packed_attention import packed_attention

    backward, _, tiles = name.removeprefix("packed").removeprefix("-").partition(":")
    return lambda q, k, v: packed_attention(
        q, k, v, seg, backward=backward or None, tiles=_tiles(tiles) if tiles else None,
        interpret=interpret)


def _tiles(text: str):
    """FA2 backward tiles written `QxW,warps,stages`."""
    from hotjax.models.packed_attention import Tiles

    edges, warps, stages = text.split(",")
    query, key = edges.split("x")
    return Tiles(int(query), int(key), int(warps), int(stages))


def _fa2_tiles(text: str) -> list[str]:
    """`--fa2-tiles` checked, as the names `kernels` reports under both FA2 backwards."""
    _tiles(text)
    return [f"packed-fa2:{text}", f"packed-fa2-split:{text}"]


def _steps_vs_cpu(args) -> dict:
    import jax
    from bench_strategies import synthetic_batch

    from hotjax.data import MiniBatch
    from hotjax.models.llama import as_trained, preset
    from hotjax.optim import OptimConfig
    from hotjax.sharding.strategy import Strategy
    from hotjax.sharding.table import Bucket, StrategyTable
    from hotjax.train import Trainer

    model = preset("tiny" if args.quick else "small")
    config = as_trained(model, compute_dtype="float32")
    seq_len, rows = (128, 2) if args.quick else (512, 4)
    batch = synthetic_batch(rows, seq_len, model.vocab_size)
    table = StrategyTable((Bucket(seq_len, Strategy.parse("data=1"), rows),), "data=1")
    optim = OptimConfig(warmup_steps=1, total_steps=5)
    losses = {}
    for name, device in (("gpu", _device()), ("cpu", jax.devices("cpu")[0])):
        with jax.default_matmul_precision("highest"):
            trainer = Trainer(config, optim, table, (device,))
            state = trainer.init(seed=0)
            losses[name] = []
            for _ in range(3):
                state, metrics, _ = trainer.step(state, MiniBatch((batch,)))
                losses[name].append(float(metrics["loss"]))
            losses[name + "_notes"] = list(trainer.notes)
            print(name, losses[name], file=sys.stderr, flush=True)
    losses["max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in
                                 zip(losses["gpu"], losses["cpu"], strict=True))
    return losses


def kernels(args) -> dict:
    import jax.numpy as jnp
    import numpy as np
    from bench_attention import make_row

    from hotjax.models.attention import _cudnn
    from hotjax.models.attention import attention as blockwise_or_auto
    from hotjax.models.cudnn_attention import cudnn_packed_attention
    from hotjax.models.packed_attention import (
        block_for,
        computed_blocks,
        default_backward,
        packed_attention,
    )
    from hotjax.models.work import ATTENTION_TRAINING
    from hotjax.step import document_cap

    device = _device()
    on_gpu = device.platform == "gpu"
    N, K = (4, 2) if args.quick else (KERNEL_SHAPE["heads"], KERNEL_SHAPE["kv_heads"])
    head_dims = args.head_dims or ((64,) if args.quick else (128, 64))
    lengths = args.kernel_lens or ((512,) if args.quick else (8192, 32768))
    repeats = 2 if args.quick else 3
    dtype = jnp.bfloat16
    results = []

    def attend_by(name: str, seg, pos):
        if name.startswith("packed"):
            return packed_by(name, seg, interpret=not on_gpu)
        if name == "cudnn-packed":
            cap = document_cap(np.asarray(seg))
            return lambda q, k, v: cudnn_packed_attention(
                q, k, v, seg, max_docs=cap, fallback=lambda q, k, v, s: packed_attention(
                    q, k, v, s, interpret=not on_gpu))
        if name == "cudnn":
            return _cudnn
        if name.startswith("ring-step"):  # ring-step, ring-step-fa2-split
            return ring_step_on_row(seg, pos, block_for(dtype, head_dim[0], seg.shape[1]),
                                    interpret=not on_gpu,
                                    backward=name.partition("ring-step-")[2] or "two-loop")
        return lambda q, k, v: blockwise_or_auto(q, k, v, seg, pos, backend="blockwise")

    head_dim = [0]  # the head dim of the case being timed, for attend_by's ring step
    for H in head_dims:
        head_dim[0] = H
        for T in lengths:
            q, k, v, ct = _qkv(1, T, N, K, H, dtype)
            docs = (64, T) if args.quick else (256, 2048, T)
            for doc in docs:
                seg_np, pos_np = make_row("packed" if doc < T else "causal", T, doc)
                seg, pos = jnp.asarray(seg_np), jnp.asarray(pos_np)
                pairs = _document_pairs(seg_np)
                # "packed" runs its default backward; the two-loop one apart where it is not.
                names = (["packed", *(["packed-two-loop"] if default_backward(dtype, H)
                                      != "two-loop" else []), "packed-fa2", "packed-fa2-split",
                          *(name for pair in args.fa2_tiles for name in pair), "ring-step",
                          "ring-step-fa2-split"]
                         + (["cudnn-packed"] if on_gpu else []))
                if on_gpu and H == 128:
                    names += ["cudnn"] if doc == T else []
                    names += ["blockwise"] if args.blockwise and T <= 8192 and doc == 2048 \
                        else []
                if args.kernels:  # the names asked for, each with its tiles' variants
                    names = [name for name in names if name.partition(":")[0] in args.kernels]
                for name in names:
                    entry = {"head_dim": H, "seq_len": T, "doc_len": doc, "kernel": name,
                             "pairs": pairs, "causal_pairs": T * (T + 1) // 2}
                    if name.startswith("packed"):
                        edge = block_for(dtype, H, T)
                        entry["blocks"] = int(np.sum(computed_blocks(seg_np, edge)))
                        entry["total_blocks"] = (T // edge) ** 2
                    entry |= _time_kernel(_grad_step(attend_by(name, seg, pos), ct), (q, k, v),
                                          repeats, ATTENTION_TRAINING * 4 * N * H * pairs)
                    results.append(entry)
                    print(json.dumps(entry), file=sys.stderr, flush=True)
    return {"device": device.device_kind, "versions": _versions(),
            "shape": {"heads": N, "kv_heads": K, "head_dims": head_dims, "dtype": "bfloat16"},
            "repeats": repeats, "results": results}


def ring_step_on_row(seg, pos, block: int, interpret: bool, backward: str = "two-loop"):
    """Attention over a row by one step of the ring's Pallas kernel pair, the row as both the
    queries' chunk and the K/V chunk held (`hotjax.models.packed_attention.ring_step`), its backward
    from that step's own log-sum-exp: what a ring step costs on the block the packed kernel
    computes whole, as a differentiable function of (q, k, v)."""
    import jax
    import jax.numpy as jnp

    from hotjax.models.attention import Tokens, visible_blocks
    from hotjax.models.packed_attention import ring_step, ring_step_backward

    columns = jnp.broadcast_to(jnp.arange(seg.shape[1], dtype=jnp.int32), seg.shape)
    tokens = Tokens(seg.astype(jnp.int32), pos.astype(jnp.int32), columns)
    visible = visible_blocks(tokens, tokens, block, block)
    mask = (tokens[:2], tokens[:2], visible)

    @jax.custom_vjp
    def attend(q, k, v):
        out, _ = ring_step(q, k, v, *mask, block=block, interpret=interpret)
        return out.astype(q.dtype)

    def forward(q, k, v):
        out, lse = ring_step(q, k, v, *mask, block=block, interpret=interpret)
        return out.astype(q.dtype), (q, k, v, out, lse)

    def grads(saved, dout):
        q, k, v, out, lse = saved
        delta = jnp.einsum("btnh,btnh->bnt", out, dout.astype(jnp.float32))
        dq, dk, dv = ring_step_backward(q, k, v, *mask, lse, delta, dout.astype(q.dtype),
                                        block=block, backward=backward, interpret=interpret)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    attend.defvjp(forward, grads)
    return attend


def _time_kernel(step, inputs, repeats: int, flops: float) -> dict:
    """A kernel's forward + backward timed: its seconds and rate, or what it failed of."""
    try:
        first, median, _ = _timed(step, inputs, repeats)
    except Exception as e:  # noqa: BLE001  (a kernel that will not run is a result)
        return {"status": "failed", "error": f"{type(e).__name__}: "
                f"{str(e).splitlines()[0][:300] if str(e) else ''}"}
    return {"status": "ok", "first_s": first, "step_ms": median * 1e3,
            "useful_tflops": flops / median / 1e12}


def _versions() -> dict:
    """What ran: JAX's packages, cuDNN, and whether JAX's packed K/V offsets honour GQA."""
    from importlib import metadata

    from hotjax.models.cudnn_attention import gqa_offsets_fixed

    found = {}
    for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax",
                 "nvidia-cudnn-cu12", "nvidia-cudnn-cu13"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        found["cudnn"] = check_cudnn_version()
    except Exception as e:  # noqa: BLE001  (no cuDNN here is a fact to record)
        found["cudnn"] = f"{type(e).__name__}: {e}"[:200]
    found["gqa_offsets_fixed"] = gqa_offsets_fixed()
    return found


def cudnn(args) -> dict:
    """cuDNN's packed attention (`hotjax.models.cudnn_attention`) against the dense reference,
    forward and the three gradients, on packed rows with GQA and padding: under its own document cap
    and under one the rows overflow (so the fallback runs); padding's outputs and gradients."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_attention import make_row

    from hotjax.models.attention import dense_attention
    from hotjax.models.cudnn_attention import cudnn_packed_attention
    from hotjax.models.packed_attention import packed_attention
    from hotjax.step import document_cap

    device = _device()
    T = 256 if args.quick else 2048
    cases = []
    rows = [make_row("packed", T, doc, seed) for seed, doc in enumerate((T // 8, T // 3))]
    seg_np = np.concatenate([r[0] for r in rows])
    seg_np[:, -T // 16:] = 0  # padding at the end of each row
    seg, pos = jnp.asarray(seg_np), jnp.asarray(np.concatenate([r[1] for r in rows]))
    for dtype, H, cap in (("bfloat16", 128, document_cap(seg_np)), ("bfloat16", 64, 0),
                          ("float16", 64, document_cap(seg_np)), ("bfloat16", 64, 3)):
        q, k, v, ct = _qkv(2, T, 8, 2, H, jnp.dtype(dtype))
        ours = _grad_step(lambda q, k, v, cap=cap: cudnn_packed_attention(
            q, k, v, seg, max_docs=cap,
            fallback=lambda q, k, v, s: packed_attention(q, k, v, s)), ct)
        with jax.default_matmul_precision("highest"):
            ref = _grad_step(lambda q, k, v: dense_attention(
                q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), seg,
                pos), ct)
            (_, ref_out), ref_grads = jax.block_until_ready(ref(q, k, v))
        case = {"dtype": dtype, "shape": [2, T, 8, 2, H], "max_docs": cap or "default",
                "documents": int(((seg_np > 0) & (seg_np != np.pad(seg_np, ((0, 0), (1, 0)))[
                    :, :-1])).sum(axis=1).max())}
        try:
            (_, out), grads = jax.block_until_ready(ours(q, k, v))
        except Exception as e:  # noqa: BLE001  (a kernel that will not run is a result)
            case["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            cases.append(case)
            print(json.dumps(case), file=sys.stderr, flush=True)
            continue
        pad = seg_np == 0
        names = ("out", "dq", "dk", "dv")
        case |= {"max_abs_error": {n: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)))
                                   for n, a, b in zip(names, (out, *grads), (ref_out, *ref_grads),
                                                      strict=True)},
                 "max_abs_reference": {n: float(jnp.max(jnp.abs(b)))
                                       for n, b in zip(names, (ref_out, *ref_grads), strict=True)},
                 "max_abs_at_padding": {n: float(np.max(np.abs(np.asarray(a, np.float32)[pad])))
                                        for n, a in zip(names, (out, *grads), strict=True)}}
        cases.append(case)
        print(json.dumps(case), file=sys.stderr, flush=True)
    return {"device": device.device_kind, "versions": _versions(), "check": cases}


def mfu(args) -> dict:
    import tempfile

    from bench_strategies import TRACED_STEPS, bench_one, synthetic_batch

    from hotjax.models.llama import LlamaConfig, as_trained, preset
    from hotjax.models.work import training_flops
    from hotjax.optim import OptimConfig
    from hotjax.sharding.strategy import Strategy

    device = _device()
    model = preset("tiny") if args.quick else LlamaConfig(**MFU_MODELS[args.model])
    config = as_trained(model, compute_dtype="bfloat16" if device.platform == "gpu"
                        else "float32", attention=args.attention, remat=args.remat,
                        scan_unroll=args.scan_unroll)
    per_token, per_pair = training_flops(config)
    per_pair_3 = per_pair * 3 / 3.5  # attention counted as 3 forwards (MaxText, PaLM)
    batch_tokens = 1024 if args.quick else args.batch_tokens
    peak = _peak_tflops(device.device_kind)
    results = []
    for seq_len in ((128, 512) if args.quick else args.seq_lens):
        batch = synthetic_batch(max(batch_tokens // seq_len, 1), seq_len, model.vocab_size)
        pairs = _document_pairs(batch.segment_ids)
        entry = {"seq_len": seq_len, "rows": batch.tokens.shape[0],
                 "real_tokens": batch.real_tokens, "pairs": pairs}
        with tempfile.TemporaryDirectory() as traced:
            try:
                entry |= bench_one(config, OptimConfig(warmup_steps=1, total_steps=8),
                                   Strategy.parse("data=1"), batch, (device,), 3, [],
                                   trace_dir=traced if args.trace else None)
                flops = per_token * batch.real_tokens + per_pair * pairs
                entry["model_tflops"] = flops / entry["step_s"] / 1e12
                entry["mfu"] = entry["model_tflops"] / peak if peak else None
                flops_3 = per_token * batch.real_tokens + per_pair_3 * pairs
                entry["mfu_attention_3"] = flops_3 / entry["step_s"] / 1e12 / peak \
                    if peak else None
                entry["attention_share"] = per_pair * pairs / flops
                stats = device.memory_stats() or {}  # the allocator's peak, this process's
                entry["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
                if args.trace:
                    entry["kernels"] = kernel_breakdown(traced, TRACED_STEPS)
            except Exception as e:  # noqa: BLE001
                entry |= {"status": "failed", "error": f"{type(e).__name__}: "
                          f"{str(e).splitlines()[0][:300] if str(e) else ''}"}
        results.append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k != "notes"}), file=sys.stderr,
              flush=True)
    return {"device": device.device_kind, "versions": _versions(), "peak_tflops": peak,
            "attention": args.attention, "model": "tiny" if args.quick else args.model,
            "remat": args.remat, "scan_unroll": args.scan_unroll, "params": config.num_params(),
            "results": results}


def kernel_breakdown(trace_dir: str, steps: int, top: int = 40) -> dict:
    """Where a traced step's device time went: the kernels of JAX's profiler trace under
    `trace_dir` summed by name (per step), the `top` longest, and their sums by kind (matmul,
    attention, the rest of XLA's fusions, copies). On a machine without a device plane (CPU),
    the planes found and nothing else."""
    from collections import defaultdict

    import jax

    (path,) = Path(trace_dir).rglob("*.xplane.pb")
    planes = list(jax.profiler.ProfileData.from_file(str(path)).planes)
    devices = [p for p in planes if p.name.startswith("/device:")]
    if not devices:
        return {"planes": [p.name for p in planes]}
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    every = list(devices[0].lines)
    # The kernels are on the streams' lines; the derived ones (XLA's modules and ops, steps)
    # repeat them.
    lines = [line for line in every if line.name.startswith("Stream")] or [
        line for line in every if line.name not in ("XLA Modules", "XLA Ops", "Steps")]
    for line in lines:
        for event in line.events:
            by_name[event.name][0] += 1
            by_name[event.name][1] += event.duration_ns / 1e6
    kinds: dict[str, float] = defaultdict(float)
    for name, (_, ms) in by_name.items():
        kinds[_kernel_kind(name)] += ms / steps
    longest = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"plane": devices[0].name, "lines": [line.name for line in every],
            "lines_summed": [line.name for line in lines], "steps": steps,
            "busy_ms_per_step": sum(ms for _, ms in by_name.values()) / steps,
            "by_kind_ms_per_step": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top": [{"name": name[:160], "kind": _kernel_kind(name), "calls": calls // steps,
                     "ms_per_step": ms / steps} for name, (calls, ms) in longest]}


def _kernel_kind(name: str) -> str:
    """A GPU kernel's kind by its name: cuBLAS/CUTLASS matmuls, cuDNN or Triton attention,
    copies and memsets, and XLA's own fusions (elementwise and reductions) for the rest."""
    lowered = name.lower()
    if any(k in lowered for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul")):
        return "matmul"
    if any(k in lowered for k in ("cudnn", "fmha", "flash", "attention", "_forward_kernel",
                                  "_backward_kernel")):
        return "attention"
    if "memcpy" in lowered or "memset" in lowered or "copy" in lowered:
        return "copy"
    return "fusion"


def profile(args) -> dict:
    """The compute half of `hotjax plan --measure` (which also times collectives, so asks for
    two devices) on this one device: its matmul and attention rates, and the matmul
    efficiency and step overhead fitted on micro-steps of 4 of LLaMA2-7B's layers."""
    return _measured_profile(_device(), args.quick)


def _measured_profile(device, quick: bool) -> dict:
    """`profile`'s report: the matmul and attention rates, and the matmul rate and step overhead
    fitted on the reference model's micro-steps, of `device`."""
    from hotjax.planning import measure
    from hotjax.planning.profile import parse_profile
    from hotjax.sharding.strategy import Strategy

    kind = ("cpu" if device.platform == "cpu" else "accelerator", quick)
    work = measure.WORKLOADS[kind]
    model = measure.reference_model(*measure.REFERENCE_MODELS[kind])
    devices, dtype = (device,), model.dtype
    strategy = Strategy.parse("data=1,rules=dp")
    attention_shape = (*work.attention, model.n_heads, model.n_kv_heads, model.head_dim)
    shapes = [(rows * work.step[0], work.step[1]) for rows in (1, measure.FIT_ROWS)]
    references = [measure.MicroStepRun(model, strategy, devices, shape) for shape in shapes]
    (matmul_s,) = measure.timed_in_rounds([measure.matmul_runner(devices, dtype, work.matmul)],
                                          work.repeats)
    attention_s, *steps_s = measure.timed_in_rounds(
        [measure.attention_runner(devices, dtype, attention_shape),
         *(r.run for r in references)], work.repeats)
    tokens, width, out = work.matmul
    matmul = 2 * tokens * width * out / matmul_s
    attention = measure.attention_flops(attention_shape, device.platform) / attention_s
    peak = max(matmul, attention)
    shipped = _shipped_h100()
    base = shipped | {"device": shipped["device"] | {"peak_tflops": peak / 1e12},
                      "efficiency": {"matmul": 1.0, "attention": attention / peak},
                      "platform": device.platform}
    fitted, overhead = measure.fitted_step(parse_profile(base, "bench_gpu"), model, strategy,
                                           shapes, tuple(steps_s))
    return {"device": device.device_kind, "platform": device.platform, "dtype": dtype.name,
            "model": f"{model.n_layers} layers x {model.dim}", "step_shapes": shapes,
            "matmul_tflops": matmul / 1e12, "attention_tflops": attention / 1e12,
            "fitted_matmul_tflops": fitted / 1e12, "step_overhead_ms": overhead * 1e3,
            "steps_s": steps_s, "measured_efficiency": {
                "matmul": fitted / peak, "attention": attention / peak},
            "h100_shipped": {k: shipped[k] for k in ("device", "efficiency")}}


def _shipped_h100() -> dict:
    """The shipped H100 profile's TOML, as a dict to change."""
    import tomllib

    from hotjax.planning.profile import PROFILES

    return tomllib.loads((PROFILES / "h100-1x8.toml").read_text())


def _profile_from(found: dict):
    """The profile `found` (`profile`'s report) measured: the shipped H100 one's links and
    memory with the fitted matmul rate, attention rate and step overhead, as shares of the
    shipped peak the device shares (or of the fastest rate measured, elsewhere)."""
    from hotjax.planning.profile import parse_profile

    shipped = _shipped_h100()
    rates = (found["fitted_matmul_tflops"], found["matmul_tflops"], found["attention_tflops"])
    peak = _peak_tflops(found["device"]) or max(rates)
    overhead = found["step_overhead_ms"]
    return parse_profile(shipped | {
        "name": f"measured on {found['device']}", "platform": found["platform"],
        "device": shipped["device"] | {"peak_tflops": peak} | (
            {"step_overhead_ms": overhead} if overhead > 0 else {}),
        "efficiency": {"matmul": found["fitted_matmul_tflops"] / peak,
                       "attention": found["attention_tflops"] / peak}}, "bench_gpu")


def _calibration_model(quick: bool, remat: str, platform: str):
    from hotjax.models.llama import LlamaConfig, as_trained, preset

    model = preset("tiny") if quick else LlamaConfig(**ONE_B)
    return as_trained(model, remat=remat,
                      compute_dtype="bfloat16" if platform == "gpu" else "float32")


def calibrate(args) -> dict:
    """The profile (measured, or `--profile`'s report), then each (shape, remat policy) timed,
    each in a process of its own: this one never opens the device, whose allocator would keep
    what it took from the others."""
    from hotjax.choices import REMAT_POLICIES
    from hotjax.errors import UserError
    from hotjax.models.work import training_flops
    from hotjax.planning.cost import micro_step_time
    from hotjax.planning.memory import micro_step_memory
    from hotjax.planning.profile import load_profile
    from hotjax.sharding.strategy import Strategy

    found = _child(args, "profile") if not args.profile else None
    if found is not None and "error" in found:
        raise SystemExit(f"bench_gpu: measuring the profile failed: {found['error']}")
    try:
        found = found or json.loads(Path(args.profile).read_text())
        measured, kind, platform = _profile_from(found), found["device"], found["platform"]
    except (OSError, ValueError, KeyError, TypeError, UserError) as e:
        raise SystemExit(f"bench_gpu: --profile {args.profile}: {type(e).__name__}: {e}: give "
                         f"a `bench_gpu.py profile --json` report") from None
    shipped = load_profile("h100-1x8")
    peak = _peak_tflops(kind)
    strategy = Strategy.parse("data=1,rules=dp")
    rows = []
    for shape in CALIBRATE_SHAPES[args.quick]:
        for remat in REMAT_POLICIES:
            row = _child(args, f"{shape[0]},{shape[1]},{remat}")
            config = _calibration_model(args.quick, remat, platform)
            if row.get("status") == "ok":
                per_token, per_pair = training_flops(config)
                flops = per_token * shape[0] * shape[1] + per_pair * shape[0] * (
                    shape[1] * (shape[1] + 1) // 2)
                row |= {"model_tflops": flops / row["step_s"] / 1e12,
                        "mfu": flops / row["step_s"] / 1e12 / peak if peak else None}
            row |= {"rows": shape[0], "seq_len": shape[1], "remat": remat,
                    "predicted_bytes": micro_step_memory(config, strategy, shape,
                                                         platform).peak,
                    "predicted_s": {
                        name: micro_step_time(config, strategy, shape, p).seconds
                        for name, p in (("shipped", shipped), ("measured", measured))}}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    config = _calibration_model(args.quick, "none", platform)
    return {"device": kind, "profile": found, "params": config.num_params(),
            "peak_tflops": peak, "dtype": config.dtype.name, "results": rows}


def _child(args, one: str) -> dict:
    """`calibrate --one ONE` in a process of its own: its JSON line, or what it died of."""
    import subprocess

    done = subprocess.run([sys.executable, __file__, "calibrate", "--one", one,
                           *(["--quick"] if args.quick else [])],
                          capture_output=True, text=True, timeout=300, check=False)
    try:
        return json.loads(done.stdout.splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"status": "failed", "error": f"exit {done.returncode}: "
                f"{(done.stderr.strip().splitlines() or [''])[-1][:300]}"}


def _calibrate_one(args) -> dict:
    """`--one profile`: the profile's measurement. `--one ROWS,TOKENS,REMAT`: one micro-step
    timed, and the allocator's peak after it."""
    from hotjax.planning import measure
    from hotjax.planning.profile import set_allocator_fraction
    from hotjax.sharding.strategy import Strategy
    from hotjax.step import step_memory

    set_allocator_fraction()  # as `hotjax train` gives JAX's allocator the GPU
    device = _device()
    if args.one == "profile":
        return _measured_profile(device, args.quick)
    rows, tokens, remat = args.one.split(",")
    shape = (int(rows), int(tokens))
    config = _calibration_model(args.quick, remat, device.platform)
    try:
        run = measure.MicroStepRun(config, Strategy.parse("data=1,rules=dp"), (device,), shape)
        (seconds,) = measure.timed_in_rounds([run.run], 2 if args.quick else 5)
    except Exception as e:  # noqa: BLE001  (a step that will not fit is a result)
        return {"status": "failed", "error": f"{type(e).__name__}: "
                f"{str(e).splitlines()[0][:300] if str(e) else ''}"}
    stats = device.memory_stats() or {}
    return {"status": "ok", "step_s": seconds, "xla_bytes": step_memory(run.compiled),
            "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
            "bytes_limit": stats.get("bytes_limit"), "notes": list(run.notes)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=PARTS)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--quick", action="store_true", help="toy sizes, any platform")
    parser.add_argument("--batch-tokens", type=int, default=16384,
                        help="mfu: tokens a step (default: %(default)s)")
    parser.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS,
                        help="mfu: the attention kernel asked for (default: %(default)s)")
    parser.add_argument("--model", default="1b", choices=sorted(MFU_MODELS),
                        help="mfu: the model's shape (default: %(default)s)")
    parser.add_argument("--seq-lens", type=lambda text: [int(n) for n in text.split(",")],
                        default=[2048, 8192], help="mfu: row lengths, comma-separated "
                        "(default: 2048,8192)")
    parser.add_argument("--remat", default="none", help="mfu: the remat policy "
                        "(default: %(default)s)")
    parser.add_argument("--scan-unroll", type=int, default=0, help="mfu: layers per iteration "
                        "of the layer scan; the model's layer count unrolls it; 0: the "
                        "platform's choice (default: 0)")
    parser.add_argument("--trace", action="store_true", help="mfu: trace two more steps and "
                        "report the kernels they ran, summed by name and kind")
    parser.add_argument("--blockwise", action="store_true",
                        help="kernels: also time the blockwise XLA kernel")
    parser.add_argument("--fa2-tiles", type=_fa2_tiles, action="append", default=[],
                        metavar="QxW,WARPS,STAGES", help="kernels: also time the packed "
                        "kernel's FA2 backwards at these tiles (repeatable), e.g. 64x128,8,2")
    parser.add_argument("--kernels", type=lambda text: set(text.split(",")),
                        help="kernels: time only these kernels, comma-separated (e.g. "
                        "packed,packed-fa2-split,cudnn-packed; default: all)")
    parser.add_argument("--kernel-lens", type=lambda text: [int(n) for n in text.split(",")],
                        help="kernels: row lengths, comma-separated (default: 8192,32768)")
    parser.add_argument("--head-dims", type=lambda text: [int(n) for n in text.split(",")],
                        help="kernels: head dims, comma-separated (default: 128,64)")
    parser.add_argument("--profile", help="calibrate: a `profile --json` report to predict "
                        "with, instead of measuring one")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # calibrate's child: ROWS,TOKENS,REMAT
    args = parser.parse_args(argv)
    if args.kernels and (unknown := args.kernels - set(KERNEL_NAMES)):
        parser.error(f"--kernels: unknown {', '.join(sorted(unknown))}: choose from "
                     f"{', '.join(KERNEL_NAMES)}")
    if args.one:
        print(json.dumps(_calibrate_one(args), default=str))
        return 0
    started = time.perf_counter()
    found = {"check": check, "cudnn": cudnn, "kernels": kernels, "mfu": mfu, "profile": profile,
             "calibrate": calibrate}[args.part](args)
    found["seconds"] = time.perf_counter() - started
    print(json.dumps(found, indent=1, default=str) if args.json else _table(args.part, found))
    return 0


def _table(part: str, found: dict) -> str:
    lines = [f"{part} on {found['device']} ({found['seconds']:.0f} s)"]
    if part == "kernels":
        lines.append(f"{'H':>4} {'T':>6} {'doc':>5} {'kernel':>21} {'ms':>9} {'TFLOP/s':>8}"
                     f"  blocks")
        for r in found["results"]:
            ms = f"{r['step_ms']:9.2f}" if r.get("status") == "ok" else f"{'failed':>9}"
            tf = f"{r['useful_tflops']:8.1f}" if r.get("status") == "ok" else " " * 8
            blocks = (f"{r['blocks']}/{r['total_blocks']}" if "blocks" in r else "")
            lines.append(f"{r['head_dim']:>4} {r['seq_len']:>6} {r['doc_len']:>5} "
                         f"{r['kernel']:>21} {ms} {tf}  {blocks}")
    elif part == "mfu":
        for r in found["results"]:
            lines.append(f"T={r['seq_len']}: " + (
                f"{r['step_s'] * 1e3:.0f} ms/step, {r['tokens_per_s']:,.0f} tok/s, "
                f"{r['model_tflops']:.0f} TFLOP/s, MFU {r['mfu']:.1%} (attention as 3.5 "
                f"forwards), {r['mfu_attention_3']:.1%} (as 3); attention "
                f"{r['attention_share']:.1%} of the FLOPs"
                if r.get("status") == "ok" and r.get("mfu") is not None else
                r.get("error", r.get("status", ""))))
            kernels = r.get("kernels", {})
            if "by_kind_ms_per_step" in kernels:
                lines.append(f"  device busy {kernels['busy_ms_per_step']:.1f} ms/step: "
                             + ", ".join(f"{kind} {ms:.1f}" for kind, ms
                                         in kernels["by_kind_ms_per_step"].items()))
    elif part == "calibrate":
        GB = 1e9
        lines.append(f"{'rows x T':>10} {'remat':>5} {'ms':>8} {'pred ms':>15} {'ratio':>11}"
                     f" {'held GB':>8} {'XLA GB':>7} {'model GB':>8} {'model/held':>10} {'MFU':>6}")
        for r in found["results"]:
            shape = f"{r['rows']} x {r['seq_len']}"
            pred = r["predicted_s"]
            pred_ms = f"{pred['measured'] * 1e3:7.1f}/{pred['shipped'] * 1e3:7.1f}"
            if r.get("status") != "ok":
                lines.append(f"{shape:>10} {r['remat']:>5} {'failed':>8} {pred_ms:>15} "
                             f"{'':>11} {'':>8} {'':>7} {r['predicted_bytes'] / GB:8.1f}  "
                             f"{r.get('error', '')[:60]}")
                continue
            ratio = f"{r['step_s'] / pred['measured']:.2f}/{r['step_s'] / pred['shipped']:.2f}"
            held = r.get("peak_bytes_in_use")
            lines.append(
                f"{shape:>10} {r['remat']:>5} {r['step_s'] * 1e3:8.1f} {pred_ms:>15} "
                f"{ratio:>11} {held / GB if held else float('nan'):8.1f} "
                f"{r['xla_bytes']['peak'] / GB:7.1f} {r['predicted_bytes'] / GB:8.1f} "
                f"{r['predicted_bytes'] / held if held else float('nan'):10.2f} "
                f"{r['mfu'] if r.get('mfu') is not None else float('nan'):6.1%}")
        lines.append("pred ms and ratio: under the profile measured here / the shipped h100-1x8")
    else:
        lines.append(json.dumps({k: v for k, v in found.items() if k != "measured_toml"},
                                default=str)[:4000])
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
