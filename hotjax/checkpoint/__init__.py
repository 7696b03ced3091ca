"""Universal checkpoints: Orbax state in logical form that resumes on any layout (`store`, laid
out on disk by `dirs`, described by `meta`), and the formats it converts to and from, one row
each in `formats` (`cli` builds `hotjax ckpt` from it): Hugging Face (`convert`), the PyTorch
formats through their common torch-side state (`torch_state`: DCP, DeepSpeed, Megatron-Core),
and foreign per-rank shard sets (`foreign`, `megatron`). `model` resolves the model of each.

Import the submodules themselves: this package imports nothing, so that the shard importer's
worker processes start without JAX.
"""
