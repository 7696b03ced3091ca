"""The checkpoint formats hotjax converts to and from, each one module of this package exposing
one `spec.Format` (`FORMAT`); `hotjax ckpt import-NAME` and `export-NAME` are built from them
(`commands.ckpt`). Adding a format is its module, one entry in `MODULES`, and its test.

The pivot. Every PyTorch format converts through one form (`pivot`): an import reads its files
into a `pivot.TorchState` — the weights under Hugging Face LLaMA names (`hotjax.models.hf`), fp32
numpy, each read when it is accessed, the optimizer's per-weight state by torch's names (AdamW's
`exp_avg`, `exp_avg_sq`) shaped as the weights or None, the step, and the torch run's
hyperparameters, recorded, never applied — and `pivot.save_torch_state` writes it as a hotjax
checkpoint (a format whose tensors are fused, as Megatron-Core's, builds the parameter trees
itself and calls `pivot.save_trees`); an export reads a `pivot.ExportSource`, one array at a
time. Hugging Face directories are the pivot's weights as files (`hf`); foreign shard sets are
rebuilt into Hugging Face-named tensors (`foreign`, from a manifest or Megatron's rank files).

Every torch file is loaded by `torch_load`, the one place that unpickles, which builds only what
`allowed` lists.

A format's functions: an import `(source, out, **options)`, with `config=` (the model, resolved
by `checkpoint.model.for_import`) where the format says how the model is found, and
`tokenizer=` (a loaded tokenizer, or None) where it records one; an export `(path, out,
**options)`; both return what they wrote. The format modules import neither JAX nor torch when
loaded (their functions do, when called): the command line is built from them before JAX starts.
"""

from __future__ import annotations

import importlib

from hotjax.checkpoint.formats.spec import Format

# The format modules, in the order `hotjax ckpt` lists their commands.
MODULES = (
    "hotjax.checkpoint.formats.hf",
    "hotjax.checkpoint.formats.dcp",
    "hotjax.checkpoint.formats.deepspeed",
    "hotjax.checkpoint.formats.universal",
    "hotjax.checkpoint.formats.megatron_core",
    "hotjax.checkpoint.formats.shards",
)


def every() -> tuple[Format, ...]:
    """Each format, its module imported now (without JAX or torch)."""
    return tuple(importlib.import_module(name).FORMAT for name in MODULES)
