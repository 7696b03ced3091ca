"""Fake foreign checkpoints: random weights (and moments) in each format's real layout and
names, written as the trainer that makes them would (no Megatron or DeepSpeed needed). Tests and
`scripts/bench_ckpt.py` both write their inputs with these; they live in the library, not under
tests/ or scripts/, so that both import them as they import the readers, without path changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import types
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

from hotjax.checkpoint.formats import megatron_core
from hotjax.checkpoint.formats.megatron import (
    EMBED,
    FC1,
    FC2,
    FINAL_NORM,
    HEAD,
    NORMS,
    PROJ,
    QKV,
)

if TYPE_CHECKING:
    from hotjax.models.llama import LlamaConfig

DCP_WRITERS = 4  # torch's writer threads: one .distcp file each
HF_SHARD_BYTES = 1 << 30
MEGATRON_ITERATION = 5


def write_config(directory: Path, config: LlamaConfig) -> Path:
    from hotjax.models.hf import CONFIG_FILE, config_to_hf

    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(config_to_hf(config, "float32")))
    return directory / CONFIG_FILE


def write_hf(directory: Path, config: LlamaConfig) -> None:
    """A Hugging Face LLaMA directory of random fp32 weights of `config`, as `save_pretrained`
    shards it: files of at most `HF_SHARD_BYTES` and an index (one file if they fit)."""
    import numpy as np
    from safetensors.numpy import save_file

    from hotjax.models.hf import INDEX_FILE, WEIGHTS_FILE, hf_tensor_shapes

    write_config(directory, config)
    rng = np.random.default_rng(0)
    shapes = hf_tensor_shapes(config)
    total = sum(4 * math.prod(s) for s in shapes.values())
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        if shards[-1] and size + 4 * math.prod(shape) > HF_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += 4 * math.prod(shape)
    weight_map = {}
    for k, names in enumerate(shards, 1):
        file = WEIGHTS_FILE if len(shards) == 1 else (
            f"model-{k:05d}-of-{len(shards):05d}.safetensors")
        save_file({n: rng.standard_normal(shapes[n], np.float32) for n in names},
                  directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    if len(shards) > 1:
        (directory / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}))


def write_dcp(directory: Path, config: LlamaConfig) -> None:
    """A DCP checkpoint of random weights, AdamW moments and step of `config`, as a torch run
    saves `{"model": model.state_dict(), "optim": optimizer.state_dict()}`."""
    import jax
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp

    from hotjax.models.hf import params_to_hf_state
    from hotjax.models.llama import abstract_params

    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32),
                          abstract_params(config))
    model = {name: torch.from_numpy(x) for name, x in params_to_hf_state(params, config).items()}
    del params
    torch.manual_seed(0)
    # Moments of a real run's scale; exp_avg_sq is never negative.
    optim = {name: {"exp_avg": 1e-3 * torch.randn_like(x), "exp_avg_sq": 1e-6 * torch.rand_like(x),
                    "step": torch.tensor(5.0)} for name, x in model.items()}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model, "optim": {"state": optim}}, no_dist=True,
                 storage_writer=dcp.FileSystemWriter(str(directory), thread_count=DCP_WRITERS))


def write_zero(directory: Path, config: LlamaConfig, dp: int) -> None:
    """ZeRO-2 rank files of random fp32 weights and AdamW moments of `config` over `dp` ranks,
    as DeepSpeed's `engine.save_checkpoint` lays them out: one parameter group, flattened in
    `param_shapes` order and cut into `dp` equal partitions (a boundary can fall inside a
    tensor), each rank's `zero_pp_rank_{r}_mp_rank_00_optim_states.pt` holding its partition's
    fp32 weights and moments and where each parameter's fragment lies in it; and
    `mp_rank_00_model_states.pt` (`param_shapes`, `dp_world_size`; its `module`, which the
    import does not read, left empty)."""
    import torch

    from hotjax.models.hf import hf_tensor_shapes

    @dataclasses.dataclass
    class fragment_address:  # noqa: N801 - pickled under DeepSpeed's own name, which
        numel: int  # needs no DeepSpeed to read
        start: int

    names = ("deepspeed", "deepspeed.utils", "deepspeed.utils.tensor_fragment")
    fakes = {n: types.ModuleType(n) for n in names if n not in sys.modules}
    if names[-1] in fakes:
        fragment_address.__module__, fragment_address.__qualname__ = names[-1], "fragment_address"
        fakes[names[-1]].fragment_address = fragment_address
    else:  # DeepSpeed itself is loaded: its own class
        fragment_address = sys.modules[names[-1]].fragment_address
    shapes = OrderedDict((n, torch.Size(s)) for n, s in hf_tensor_shapes(config).items())
    total = sum(s.numel() for s in shapes.values())
    part = -(-total // dp)
    step = directory / "global_step5"
    step.mkdir(parents=True)
    torch.save({"module": {}, "param_shapes": [shapes], "dp_world_size": dp, "global_steps": 5,
                "ds_config": {}}, step / "mp_rank_00_model_states.pt")
    (directory / "latest").write_text("global_step5")
    generator = torch.Generator().manual_seed(0)
    sys.modules.update(fakes)
    try:
        for rank in range(dp):
            lo, hi, offset = rank * part, min(total, (rank + 1) * part), 0
            mapping = OrderedDict()
            for name, shape in shapes.items():
                a, b = max(lo, offset), min(hi, offset + shape.numel())
                if a < b:
                    mapping[name] = fragment_address(b - a, a - lo)
                offset += shape.numel()
            n = hi - lo
            flat = {"exp_avg": 1e-3 * torch.randn(n, generator=generator),
                    "exp_avg_sq": 1e-6 * torch.rand(n, generator=generator),
                    "step": torch.tensor(5.0)}
            groups = [{"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0,
                       "params": [0]}]
            torch.save({"optimizer_state_dict": {
                "zero_stage": 2, "partition_count": [dp], "param_slice_mappings": [mapping],
                "single_partition_of_fp32_groups": [torch.randn(n, generator=generator)],
                "base_optimizer_state": {"state": {0: flat}, "param_groups": groups}}},
                step / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
            del flat
    finally:
        for name in fakes:
            del sys.modules[name]


def megatron_args(config: LlamaConfig, tp: int, pp: int, rows: int) -> argparse.Namespace:
    """The fields of Megatron-LM's args that describe `config`, as its checkpoints hold them."""
    return argparse.Namespace(
        num_layers=config.n_layers, hidden_size=config.dim, ffn_hidden_size=config.ffn_dim,
        num_attention_heads=config.n_heads, group_query_attention=True,
        num_query_groups=config.n_kv_heads, kv_channels=config.head_dim, norm_epsilon=1e-5,
        rotary_base=10000, untie_embeddings_and_output_weights=not config.tie_embeddings,
        seq_length=config.max_seq_len, max_position_embeddings=config.max_seq_len,
        padded_vocab_size=rows, position_embedding_type="rope", normalization="RMSNorm",
        swiglu=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def padded_vocab(config: LlamaConfig, tp: int) -> int:
    """Megatron's padded vocabulary: a multiple of 128 rows per tensor-parallel rank."""
    return -(-config.vocab_size // (128 * tp)) * 128 * tp


def write_megatron_core(directory: Path, config: LlamaConfig) -> None:
    """A Megatron-Core torch_dist checkpoint of random fp32 weights and per-parameter Adam
    moments of `config` (Megatron-LM's `--dist-ckpt-optim-fully-reshardable`), as
    `dist_checkpointing.save` lays it out: `iter_0000005/` (`.metadata`, `.distcp` files,
    `common.pt`, `metadata.json`) beside `latest_checkpointed_iteration.txt`."""
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp

    rows = padded_vocab(config, 1)
    shapes = megatron_core.tensor_shapes(config, rows, (NORMS[0][0], NORMS[1][0]))
    iteration = directory / f"iter_{MEGATRON_ITERATION:07d}"
    rng = np.random.default_rng(0)
    state = {}
    for key, shape in shapes.items():
        state[key] = torch.from_numpy(rng.standard_normal(shape, np.float32))
        state[f"optimizer.state.exp_avg.{key}"] = 1e-3 * torch.randn(shape)
        state[f"optimizer.state.exp_avg_sq.{key}"] = 1e-6 * torch.rand(shape)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, no_dist=True,
                 storage_writer=dcp.FileSystemWriter(str(iteration), thread_count=DCP_WRITERS))
    groups = [{"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
               "step": MEGATRON_ITERATION}]
    torch.save({"args": megatron_args(config, 1, 1, rows), "iteration": MEGATRON_ITERATION,
                "optimizer": {"optimizer": {"param_groups": groups}}}, iteration / "common.pt")
    (iteration / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (directory / "latest_checkpointed_iteration.txt").write_text(f"{MEGATRON_ITERATION}\n")


def write_megatron(directory: Path, config: LlamaConfig, tp: int, pp: int) -> None:
    """Megatron-LM rank files (`mp_rank_XX_YYY/model_optim_rng.pt`, the torch format) of
    random fp32 weights of `config` over `tp` tensor and `pp` pipeline ranks, as Megatron-Core
    names and splits them (Transformer Engine's fused norms, a padded vocabulary)."""
    import numpy as np
    import torch

    rows = padded_vocab(config, tp)
    D, F, H = config.dim, config.ffn_dim, config.head_dim
    N, K = config.n_heads, config.n_kv_heads
    split = {QKV: ((N + 2 * K) * H // tp, D), PROJ: (D, N * H // tp), FC1: (2 * F // tp, D),
             FC2: (D, F // tp)}
    rng = np.random.default_rng(0)

    def tensor(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape, np.float32))

    for s in range(pp):
        layers = config.n_layers // pp + (s < config.n_layers % pp)
        # Norms are replicated over tensor-parallel ranks (the import checks the copies agree).
        replicated = {f"decoder.layers.{layer}.{name}": tensor((D,))
                      for layer in range(layers) for name in (NORMS[0][0], NORMS[1][0])}
        if s == pp - 1:
            replicated[FINAL_NORM] = tensor((D,))
        for t in range(tp):
            model = {f"decoder.layers.{layer}.{name}": tensor(shape)
                     for layer in range(layers) for name, shape in split.items()}
            if s == 0:
                model[EMBED] = tensor((rows // tp, D))
            if s == pp - 1 and not config.tie_embeddings:
                model[HEAD] = tensor((rows // tp, D))
            file = (directory / f"iter_{MEGATRON_ITERATION:07d}" / f"mp_rank_{t:02d}_{s:03d}"
                    / "model_optim_rng.pt")
            file.parent.mkdir(parents=True)
            torch.save({"args": megatron_args(config, tp, pp, rows),
                        "iteration": MEGATRON_ITERATION, "model": {**model, **replicated}}, file)
            del model
    (directory / "latest_checkpointed_iteration.txt").write_text(f"{MEGATRON_ITERATION}\n")
