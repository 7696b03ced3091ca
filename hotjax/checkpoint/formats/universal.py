"""hotjax checkpoints written as Universal Checkpointing's universal directories, which DeepSpeed
resumes with `"checkpoint": {"load_universal": true}` and `engine.load_checkpoint(dir)` under any
ZeRO stage and data-parallel size, fp32 weights, optimizer state and step included (an export
of a `pivot.ExportSource`).

The layout is `ds_to_universal`'s (`formats.deepspeed` reads it): `latest_universal` naming
`global_step{N}`, which holds `zero/{name}/{fp32,step}.pt` and the optimizer's state by torch's
names (AdamW's `exp_avg.pt`, `exp_avg_sq.pt`) per parameter under Hugging Face names,
`zero/optimizer_state.pt`, and the model-states files DeepSpeed's loader opens (for ZeRO-1/2 and
for ZeRO-3). One parameter is held in host memory at a time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hotjax.checkpoint.formats import torch_load
from hotjax.checkpoint.formats.deepspeed import NEEDS_TORCH
from hotjax.checkpoint.formats.spec import Format

# The DeepSpeed release whose file layout this writes (its loader checks for one).
FORMAT_VERSION = "0.19.8"


def export_universal(path: str | Path, out: str | Path) -> Path:
    """A universal directory of the hotjax checkpoint at `path`. The optimizer's lr, betas and
    eps go into its param groups; each of DeepSpeed's groups keeps its own weight decay."""
    torch = torch_load.need_torch(NEEDS_TORCH)
    from hotjax.checkpoint import dirs, store
    from hotjax.checkpoint.formats.pivot import ExportSource
    from hotjax.models.hf import hf_tensor_shapes, hf_tensors

    out = dirs.check_new_directory(out)
    source = ExportSource.of(path)
    config, optim, step = source.config, source.optim, source.step or 0
    tag = f"global_step{step}"
    # A weights-only checkpoint resumes as a fresh optimizer of its record: zero state at step 0.
    moments = source.state_fields or optim.optimizer.torch_names(str(source.step_dir))

    def write(scratch: Path) -> None:
        zero = scratch / tag / "zero"
        zero.mkdir(parents=True)
        # One array restored, converted and saved at a time.
        for field in ("fp32", *moments):
            zeros = source.step is None and field != "fp32"
            for key, x in source.arrays(store.PARAMS if zeros or field == "fp32" else field):
                for name, t in hf_tensors(key, x, config):
                    (zero / name).mkdir(exist_ok=True)
                    t = np.ascontiguousarray(np.zeros_like(t) if zeros else t, np.float32)
                    torch.save({"cat_dim": 0, "param": torch.from_numpy(t)},
                               zero / name / f"{field}.pt")
                    if field == "fp32":
                        torch.save(torch.tensor(float(step)), zero / name / "step.pt")
                del x
        group = {"lr": float(optim.lr_schedule()(step)), "betas": (optim.b1, optim.b2),
                 **({"eps": optim.eps} if "eps" in optim.optimizer.settings else {}),
                 "params": []}
        shapes = dict(hf_tensor_shapes(config))
        # DeepSpeed pairs the saved param groups with its own, one to one (zip): one per
        # parameter covers any grouping; ZeRO-3 reads the first group and the step of state 0.
        torch.save({"ds_version": FORMAT_VERSION, "param_groups": [group] * len(shapes),
                    "optimizer_state_dict": {"state": {0: {"step": torch.tensor(float(step))}},
                                             "param_groups": [group]}},
                   zero / "optimizer_state.pt")
        model_states = {"module": {}, "buffer_names": [], "optimizer": None,
                        "param_shapes": [{n: torch.Size(s) for n, s in shapes.items()}],
                        "frozen_param_shapes": {}, "shared_params": {},
                        "lr_scheduler": None, "skipped_steps": 0, "global_steps": step,
                        "global_samples": 0, "dp_world_size": 1, "mp_world_size": 1,
                        "ds_version": FORMAT_VERSION}
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
            torch.save(model_states, scratch / tag / name)
        (scratch / "latest_universal").write_text(tag)

    return dirs.write_atomically(out, write)


FORMAT = Format(
    "universal", exports=export_universal, export_help="a checkpoint to a universal directory "
    "that DeepSpeed resumes (load_universal) under any ZeRO stage and data-parallel size")
