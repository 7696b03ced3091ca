"""Device check for the FA2 backward: correctness against dense, then timings beside two-loop."""
import json, os, sys, time
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "scripts")]
import jax, jax.numpy as jnp, numpy as np
from bench_attention import make_row
from bench_gpu import _document_pairs, _grad_step, _qkv, _time_kernel, packed_by
from models.attention import dense_attention
from models.work import ATTENTION_TRAINING

out = open(os.path.join(os.environ.get("OUT", "/tmp"), "fa2.jsonl"), "w")
def emit(d):
    line = json.dumps(d); print(line, flush=True); out.write(line + "\n"); out.flush()

emit({"device": jax.devices()[0].device_kind, "jax": jax.__version__})
T = 1024
for dtype, H in (("float32", 64), ("bfloat16", 128)):
    rows = [make_row("packed", T, doc, seed) for seed, doc in enumerate((T // 8, T // 3))]
    seg = jnp.asarray(np.concatenate([r[0] for r in rows])); pos = jnp.asarray(np.concatenate([r[1] for r in rows]))
    q, k, v, ct = _qkv(2, T, 8, 2, H, jnp.dtype(dtype))
    with jax.default_matmul_precision("highest"):
        (_, ro), rg = _grad_step(lambda q, k, v: dense_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), seg, pos), ct)(q, k, v)
    for name in ("packed", "packed-fa2"):
        try:
            (_, o), g = _grad_step(packed_by(name, seg, False), ct)(q, k, v)
            emit({"check": name, "dtype": dtype, "H": H, "err": [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))) for a, b in zip((o, *g), (ro, *rg))],
                  "ref": [float(jnp.max(jnp.abs(b))) for b in (ro, *rg)]})
        except Exception as e:
            emit({"check": name, "dtype": dtype, "error": str(e)[:500]})

N, K, H, T = 32, 8, 128, 8192
q, k, v, ct = _qkv(1, T, N, K, H, jnp.bfloat16)
extra = sys.argv[1:]
for doc in (2048, 8192, 256):
    seg_np, _ = make_row("packed" if doc < T else "causal", T, doc)
    seg = jnp.asarray(seg_np); pairs = _document_pairs(seg_np)
    for name in ["packed", "packed-fa2"] + (extra if doc == 2048 else []):
        r = _time_kernel(_grad_step(packed_by(name, seg, False), ct), (q, k, v), 5, ATTENTION_TRAINING * 4 * N * H * pairs)
        emit({"doc": doc, "kernel": name, **r})
