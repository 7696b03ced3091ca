"""What a training micro-step computes, counted once for the trainer's balancer
(`hotjax.balance`) and the planner's cost model (`hotjax.planning.cost`) alike: FLOPs per token
of the matmuls and per (query, key) pair of attention, and which attention kernel's blocks a
packed row computes on a platform.

- Matmuls: 2 FLOPs per weight per token forward and 4 backward (Kaplan et al. 2020, "Scaling
  laws", §2.1: C = 6N per token).
- Attention: 4·N·H FLOPs per visible (query, key) pair forward (QK^T and PV), 2.5x that
  backward (FlashAttention-2's five matmuls against two: Dao 2023, arXiv:2307.08691).
"""

from __future__ import annotations

from hotjax.models.attention import DEFAULT_BLOCK, PALLAS_BLOCK, choose_backend
from hotjax.models.cudnn_attention import workspace_bytes
from hotjax.models.llama import LlamaConfig
from hotjax.models.packed_attention import block_for, default_backward

MATMUL_TRAINING = 6  # FLOPs per weight and token, forward and backward
ATTENTION_TRAINING = 3.5  # attention forward and backward, in forwards


def layer_weights(config: LlamaConfig) -> int:
    """Weights one layer multiplies each token by: Q, K, V and O, and the MLP's three."""
    D, H = config.dim, config.head_dim
    return D * H * (2 * config.n_heads + 2 * config.n_kv_heads) + 3 * D * config.ffn_dim


def training_flops(config: LlamaConfig) -> tuple[float, float]:
    """FLOPs of a training step (forward and backward, nothing recomputed) per token of the
    matmuls (every layer and the LM head) and per (query, key) pair attention computes."""
    per_token = MATMUL_TRAINING * (config.n_layers * layer_weights(config)
                                   + config.dim * config.vocab_size)
    per_pair = ATTENTION_TRAINING * 4 * config.n_heads * config.head_dim * config.n_layers
    return per_token, per_pair


def attention_kernel(config: LlamaConfig, platform: str, seq_len: int, context: int
                     ) -> tuple[int, bool]:
    """The block edge of the attention kernel a packed row of `seq_len` runs on `platform`
    under a ring of `context` devices (`hotjax.models.attention.choose_backend`), and whether it
    skips the blocks no document spans: both kernels do, the packed-attention Pallas kernel on GPU
    (`hotjax.models.packed_attention.computed_blocks`) and the blockwise kernel elsewhere and round
    every ring."""
    if platform == "gpu" and context == 1 and seq_len % PALLAS_BLOCK == 0:
        return block_for(config.dtype, config.head_dim, seq_len), True
    return config.attention_block or DEFAULT_BLOCK.get(platform, DEFAULT_BLOCK["gpu"]), True


def attention_backend(config: LlamaConfig, platform: str, seq_len: int, context: int,
                      capability: int | None = None) -> str:
    """The attention kernel rows of `seq_len` tokens, one causal document each (the cost
    model's worst case), run on `platform` under a ring of `context` devices, as
    `hotjax.models.attention.choose_backend` picks it for `config.attention` with the installed JAX;
    "pallas-fa2" for the packed Pallas kernel under its FA2-form backward (`default_backward`),
    which runs at its own speed. `capability`: the GPU's compute capability (major), None when
    not known."""
    ring = context > 1
    kernel, _ = choose_backend(
        config.attention, platform, ring=ring, packed=True,
        seq_len=seq_len // context if ring else seq_len, dtype=config.dtype, documents=1,
        workspace=workspace_bytes(1, seq_len, 1, config.n_heads, config.head_dim),
        capability=capability, head_dim=config.head_dim)
    if kernel == "pallas" and default_backward(config.dtype, config.head_dim) != "two-loop":
        return "pallas-fa2"
    return kernel
