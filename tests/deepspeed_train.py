"""The DeepSpeed side of tests/test_checkpoint_deepspeed.py: gloo processes on CPU train
`transformers.LlamaForCausalLM` (tests/torch_llama.py's model, data and AdamW) with DeepSpeed's
ZeRO, and either
- `train DIR`: on 2 ranks, for ZeRO stages 1, 2 and 3, take two AdamW steps and save
  (`DIR/zero{stage}/ds`), convert that with DeepSpeed's own `ds_to_universal`
  (`DIR/zero{stage}/universal`), and write to `DIR/zero{stage}/ref.npz` the reference numbers:
  the full fp32 parameters and moments after step 2, the logits of the evaluation batch, and
  the parameters after a third step; or
- `load DIR`: resume the universal checkpoint `DIR/exported` (one hotjax wrote) with
  `load_universal` under ZeRO-2 on 2 ranks and on 1 rank and under ZeRO-3 on 2 ranks, and write
  to `DIR/loaded-zero{stage}-{ranks}.npz` the parameters, moments and step it then holds, and
  the parameters after one more step, on the evaluation batch of tests/torch_llama.py's data.

    python tests/deepspeed_train.py train|load DIR
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch_llama import (  # noqa: E402
    BETAS,
    CONFIG,
    EPS,
    LR,
    ROWS,
    STEPS,
    WEIGHT_DECAY,
    _free_port,
    batches,
)

STAGES = (1, 2, 3)
LOADS = ((2, 2), (2, 1), (3, 2))  # (ZeRO stage, ranks) that resume hotjax's export


def _deepspeed():
    import deepspeed.comm.torch

    # Its CPU accelerator compiles a shared-memory collective with g++ at start (~30 s); gloo's
    # own collectives serve these tiny tensors. (The module from sys.modules: the attribute
    # `deepspeed.comm.torch` is the torch package, which deepspeed.comm imports over it.)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    return deepspeed


def _engine(stage: int, ranks: int, universal: bool = False):
    deepspeed = _deepspeed()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="eager"))
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    matrices = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    config = {
        "train_micro_batch_size_per_gpu": ROWS // ranks, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": stage}, "steps_per_print": 10**6,
        "checkpoint": {"load_universal": universal}}
    engine, *_ = deepspeed.initialize(
        model=model, config=config,
        model_parameters=[{"params": matrices, "weight_decay": WEIGHT_DECAY},
                          {"params": norms, "weight_decay": 0.0}])
    return engine


def _step(engine, ids: np.ndarray) -> None:
    rank, ranks = engine.global_rank, engine.world_size
    rows = torch.from_numpy(np.array_split(ids, ranks)[rank])
    loss = engine(input_ids=rows, labels=rows).loss
    engine.backward(loss)
    engine.step()


def _full(engine, prefix: str = "") -> dict[str, np.ndarray]:
    """fp32 parameters (and, without a prefix, moments and step), whole, on every rank."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    optimizer = engine.optimizer
    if hasattr(optimizer, "_hp_optimizer_states_linked"):
        # ZeRO-1/2 link the moments of every parameter group after the first group's first
        # step, when the later groups have none yet: link them again.
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, p in engine.module.named_parameters():
        out[f"{prefix or 'param'}/{name}"] = safe_get_full_fp32_param(p).numpy().copy()
        if not prefix:
            for field in ("exp_avg", "exp_avg_sq"):
                out[f"{field}/{name}"] = safe_get_full_optimizer_state(p, field).numpy().copy()
    if not prefix:
        states = optimizer.optimizer.state.values()
        out["step"] = np.asarray(float(next(iter(states))["step"]))
    return out


def _logits(engine, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return engine(input_ids=torch.from_numpy(ids)).logits.numpy()


def _train(rank: int, directory: Path) -> None:
    import torch.distributed as dist

    data = batches()
    for stage in STAGES:
        out = directory / f"zero{stage}"
        engine = _engine(stage, 2)
        for step in range(STEPS):
            _step(engine, data[step])
        engine.save_checkpoint(str(out / "ds"))
        reference = {**_full(engine), "logits": _logits(engine, data[-1])}
        _step(engine, data[STEPS])
        reference.update(_full(engine, "next"))
        if rank == 0:
            np.savez(out / "ref.npz", **reference)
            _universal(out)
        dist.barrier()


def _universal(out: Path) -> None:
    """DeepSpeed's own converter, as `python -m deepspeed.checkpoint.ds_to_universal` runs it."""
    import argparse
    import contextlib
    import io

    from deepspeed.checkpoint import ds_to_universal

    tag = (out / "ds" / "latest").read_text().strip()
    args = argparse.Namespace(input_folder=str(out / "ds" / tag),
                              output_folder=str(out / "universal" / tag),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                              strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(args)


def _load(rank: int, directory: Path, stage: int, ranks: int) -> None:
    engine = _engine(stage, ranks, universal=True)
    engine.load_checkpoint(str(directory / "exported"))
    # DeepSpeed 0.19.8's ZeRO-3 universal loader gives every parameter group the same step
    # tensor, which AdamW then advances once per group and step: give each group its own.
    for state in engine.optimizer.optimizer.state.values():
        state["step"] = state["step"].clone()
    loaded = _full(engine)
    _step(engine, batches()[-1])
    loaded.update(_full(engine, "next"))
    if rank == 0:
        np.savez(directory / f"loaded-zero{stage}-{ranks}.npz", **loaded)


def _run(rank: int, task: str, directory: str, port: int, ranks: int, stage: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks))
    torch.set_num_threads(1)
    _deepspeed().init_distributed("gloo", verbose=False)
    if task == "train":
        _train(rank, Path(directory))
    else:
        _load(rank, Path(directory), stage, ranks)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    task, directory = sys.argv[1:3]
    torch.set_num_threads(1)
    _deepspeed()
    # Imported once, forked: the model, and what a rank's first `deepspeed.initialize` imports
    # (its optimizer check loads the Muon optimizer, which loads torch's inductor; seconds).
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    runs = [(2, 0)] if task == "train" else [(ranks, stage) for stage, ranks in LOADS]
    for ranks, stage in runs:
        mp.start_processes(_run, args=(task, directory, _free_port(), ranks, stage),
                           nprocs=ranks, start_method="fork")
