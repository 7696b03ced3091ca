"""The model's named choices, free of JAX imports so the command line can offer them before JAX
starts: attention kernels and rematerialisation policies."""

# "auto": the fastest correct kernel for the platform (see
# `hotjax.models.attention.choose_backend`); "dense" materialises every score and is the reference
# the others are tested against.
ATTENTION_BACKENDS = ("auto", "blockwise", "dense", "cudnn", "pallas")
# What each layer keeps for the backward pass: everything; the outputs of its weight matmuls
# (the rest, attention included, recomputed: MaxText's "minimal", Megatron's selective
# recompute); or only its input (the whole layer recomputed).
REMAT_POLICIES = ("none", "dots", "full")
# How a PyTorch checkpoint names a LLaMA's tensors: Hugging Face's transformers, or torchtitan's
# (Meta's original names, rotary pairs interleaved in the Q/K rows).
CHECKPOINT_NAMINGS = ("hf", "torchtitan")
