"""The PyTorch side of tests/test_checkpoint_dcp.py: four gloo processes on CPU run
`transformers.LlamaForCausalLM` sharded as a real trainer shards it, and either
- `train`: take two AdamW steps, save model and optimizer with DCP (`dcp/`), and write to
  `ref.npz` the reference numbers: the full parameters and moments after step 2, the logits of
  an evaluation batch, and the parameters after a third step; or
- `load`: load a DCP checkpoint (one hotjax exported, `exported/`) into the same sharded model
  and optimizer, and write the logits, parameters and moments it then holds to `loaded.npz`;
each layout in its own directory `ROOT/LAYOUT`, one after another in one process.

Layouts: `fsdp` (FSDP2 over 4 ranks) and `tp_fsdp` (2-way tensor parallel x 2-way FSDP). The
`fsdp` run saves `{"model": ..., "optim": ...}` with nested optimizer state; `tp_fsdp` saves as
torchtitan does, the model's keys at the top and the optimizer flattened under "optimizer".

    python tests/torch_llama.py train|load ROOT LAYOUT...
"""

import os
import socket
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from transformers import LlamaConfig, LlamaForCausalLM

WORLD = 4
# GQA (4 query heads, 2 K/V heads) and an odd vocabulary.
CONFIG = {"vocab_size": 263, "hidden_size": 64, "intermediate_size": 160,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False}
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 1e-8, 0.1
ROWS, TOKENS, STEPS = 4, 32, 2


def batches() -> np.ndarray:
    """Token ids [STEPS + 2, ROWS, TOKENS]: the steps' batches, a third step's, and an
    evaluation batch."""
    return np.random.default_rng(7).integers(0, CONFIG["vocab_size"], (STEPS + 2, ROWS, TOKENS))


def _model(layout: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, int, int]:
    """The sharded model and its optimizer; this rank's data-parallel index and size."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="eager"))
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        dp = mesh
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], {
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()})
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    matrices = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": WEIGHT_DECAY},
                                   {"params": norms, "weight_decay": 0.0}],
                                  lr=LR, betas=BETAS, eps=EPS)
    return model, optimizer, dp.get_local_rank(), dp.size()


def _step(model, optimizer, ids: np.ndarray, dp_rank: int, dp_size: int) -> None:
    rows = torch.from_numpy(np.array_split(ids, dp_size)[dp_rank])
    model(input_ids=rows, labels=rows).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(model, optimizer) -> dict[str, np.ndarray]:
    """Parameters and moments, whole, on every rank."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    params, optim = get_state_dict(model, optimizer, options=options)
    out = {f"param/{n}": p.detach().numpy() for n, p in params.items()}
    for name, state in optim["state"].items():
        for field in ("exp_avg", "exp_avg_sq", "step"):
            out[f"{field}/{name}"] = state[field].detach().numpy()
    return out


def _logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids)).logits.numpy()


def _run(rank: int, task: str, layout: str, directory: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model, optimizer, dp_rank, dp_size = _model(layout)
    data = batches()
    directory = Path(directory)
    if task == "train":
        for step in range(STEPS):
            _step(model, optimizer, data[step], dp_rank, dp_size)
        flat = layout == "tp_fsdp"
        params, optim = get_state_dict(model, optimizer, options=StateDictOptions(
            flatten_optimizer_state_dict=flat))
        state = {**params, "optimizer": optim} if flat else {"model": params, "optim": optim}
        dcp.save(state, checkpoint_id=str(directory / "dcp"))
        reference = {**_full(model, optimizer), "logits": _logits(model, data[-1])}
        _step(model, optimizer, data[STEPS], dp_rank, dp_size)
        reference.update({f"next/{k.split('/', 1)[1]}": v
                          for k, v in _full(model, optimizer).items() if k.startswith("param/")})
        if rank == 0:
            np.savez(directory / "ref.npz", **reference)
    else:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        params, optim = get_state_dict(model, optimizer, options=options)
        state = {"model": params, "optim": optim}
        dcp.load(state, checkpoint_id=str(directory / "exported"))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)
        loaded = {**_full(model, optimizer), "logits": _logits(model, data[-1])}
        if rank == 0:
            np.savez(directory / "loaded.npz", **loaded)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    task, root, *layouts = sys.argv[1:]
    torch.set_num_threads(1)
    # Forked, the ranks share this process's imports of torch and transformers: a quarter of
    # the CPU time of spawning four processes that import them again (and the layouts share
    # one process's).
    for layout in layouts:
        mp.start_processes(_run, args=(task, layout, str(Path(root) / layout), _free_port()),
                           nprocs=WORLD, start_method="fork")
