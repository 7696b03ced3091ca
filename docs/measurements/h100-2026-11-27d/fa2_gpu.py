"""The FA2 backward checked against dense attention, then timed beside the two-loop one (run
from the repository root at commit 1bcf0bc; extra `packed-fa2:QxW,warps,stages` names time
more tiles on the 2,048-token documents)."""

import json
import os
import sys

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "scripts")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_attention import make_row  # noqa: E402
from bench_gpu import _document_pairs, _grad_step, _qkv, _time_kernel, packed_by  # noqa: E402

from models.attention import dense_attention  # noqa: E402
from models.work import ATTENTION_TRAINING  # noqa: E402

out = open(os.path.join(os.environ.get("OUT", "/tmp"), "fa2.jsonl"), "w")  # noqa: SIM115


def emit(found: dict) -> None:
    line = json.dumps(found)
    print(line, flush=True)
    out.write(line + "\n")
    out.flush()


def errors(T: int = 1024) -> None:
    for dtype, H in (("float32", 64), ("bfloat16", 128)):
        rows = [make_row("packed", T, doc, seed) for seed, doc in enumerate((T // 8, T // 3))]
        seg = jnp.asarray(np.concatenate([r[0] for r in rows]))
        pos = jnp.asarray(np.concatenate([r[1] for r in rows]))
        q, k, v, ct = _qkv(2, T, 8, 2, H, jnp.dtype(dtype))
        with jax.default_matmul_precision("highest"):
            (_, ref_out), ref_grads = _grad_step(lambda q, k, v, seg=seg, pos=pos: dense_attention(
                *(x.astype(jnp.float32) for x in (q, k, v)), seg, pos), ct)(q, k, v)
        want = (ref_out, *ref_grads)
        for name in ("packed", "packed-fa2"):
            try:
                (_, got_out), got_grads = _grad_step(packed_by(name, seg, False), ct)(q, k, v)
                emit({"check": name, "dtype": dtype, "H": H,
                      "err": [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)))
                              for a, b in zip((got_out, *got_grads), want, strict=True)],
                      "ref": [float(jnp.max(jnp.abs(b))) for b in want]})
            except Exception as e:  # noqa: BLE001
                emit({"check": name, "dtype": dtype, "error": str(e)[:500]})


def timings(extra: list[str], N: int = 32, K: int = 8, H: int = 128, T: int = 8192) -> None:
    q, k, v, ct = _qkv(1, T, N, K, H, jnp.bfloat16)
    for doc in (2048, 8192, 256):
        seg_np, _ = make_row("packed" if doc < T else "causal", T, doc)
        seg, pairs = jnp.asarray(seg_np), _document_pairs(seg_np)
        for name in ["packed", "packed-fa2"] + (extra if doc == 2048 else []):
            step = _grad_step(packed_by(name, seg, False), ct)
            emit({"doc": doc, "kernel": name, **_time_kernel(
                step, (q, k, v), 5, ATTENTION_TRAINING * 4 * N * H * pairs)})


emit({"device": jax.devices()[0].device_kind, "jax": jax.__version__})
errors()
timings(sys.argv[1:])
