"""Universal checkpoints: Orbax state in logical form that resumes on any layout (`store`, laid
out on disk by `dirs`, described by `meta`, shown by `describe`); `model` resolves the model of
each. The formats it converts to and from are a wing of their own, `formats`, one module each
(`commands.ckpt` builds `hotjax ckpt` from them), every PyTorch format through one pivot.

Import the submodules themselves: this package imports nothing, so that the shard importer's
worker processes start without JAX.
"""
