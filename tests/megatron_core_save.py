"""The Megatron-Core side of tests/test_checkpoint_megatron_core.py: gloo processes on CPU build
Megatron-Core's `GPTModel` as a LLaMA (RMSNorm, SwiGLU, rotary, GQA: 8 query heads in 4 groups,
no biases, the local layer spec), wrap it for Megatron's distributed optimizer (Adam), take two
optimizer steps on random gradients (its forward pass needs CUDA), and save what Megatron-LM's
`--ckpt-format torch_dist` saves, once per format of the distributed optimizer's state
(`distrib_optim_sharding_type`): `DIR/FORMAT/iter_0000002/` (`model`, `optimizer`, `args`,
`iteration` through `dist_checkpointing.save`) and `DIR/FORMAT/latest_checkpointed_iteration.txt`
for FORMAT fully_reshardable (Megatron-LM's --dist-ckpt-optim-fully-reshardable: per-parameter
tensors) and dp_reshardable (its default: the optimizer's flat buckets). Each rank also writes
`DIR/local_{rank}.pt`: its parameters as the modules hold them and its slice of Adam's state of
each, the reference the test compares the imports with.

    python tests/megatron_core_save.py DIR,TP,DP,TIED[,BUCKET]...

one run per argument, one after another in this process. BUCKET, if given, is the gradient
buffer's bucket size in elements (Megatron-LM's --overlap-grad-reduce --ddp-bucket-size BUCKET),
so that the buckets split the parameters.
"""

import argparse
import functools
import os
import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

# A width of 48 (not a multiple of 64) makes the buckets pad the norms' ends.
VOCAB, LAYERS, D, HEADS, GROUPS, FFN, SEQ = 256, 2, 48, 8, 4, 176, 128
FORMATS = ("fully_reshardable", "dp_reshardable")
ITERATION = 2
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 1e-8, 0.1


def _on_cpu() -> None:
    """Megatron-Core places its optimizer's buffers and checks on CUDA by name; a CPU build of
    torch runs the same code with those redirected to the host."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    tensor_type = torch.Tensor.type

    def as_cuda_type(self, *args, **kwargs):  # "torch.FloatTensor" -> "torch.cuda.FloatTensor"
        name = tensor_type(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs else name

    torch.Tensor.type = as_cuda_type
    for factory in ("tensor", "zeros", "empty", "ones", "full"):
        original = getattr(torch, factory)

        @functools.wraps(original)
        def on_host(*args, _original=original, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return _original(*args, **kwargs)

        setattr(torch, factory, on_host)


def _args(tp: int, dp: int, tied: bool, bucket: int | None) -> argparse.Namespace:
    """The fields of Megatron-LM's args that describe this model, as its checkpoints hold them."""
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=D, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        group_query_attention=True, num_query_groups=GROUPS, kv_channels=D // HEADS,
        norm_epsilon=1e-5, rotary_base=10000, untie_embeddings_and_output_weights=not tied,
        seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=VOCAB,
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, data_parallel_size=dp,
        ckpt_format="torch_dist", use_distributed_optimizer=True, params_dtype=torch.float32,
        lr=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS,
        weight_decay=WEIGHT_DECAY, iteration=ITERATION, transformer_impl="local",
        overlap_grad_reduce=bucket is not None, ddp_bucket_size=bucket)


def _run(rank: int, world: int, port: int, out: str, tp: int, tied: bool,
         bucket: int | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tp, 1)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=D, num_attention_heads=HEADS, num_query_groups=GROUPS,
        ffn_hidden_size=FFN, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, params_dtype=torch.float32)
    torch.manual_seed(0)
    model = GPTModel(config=config,
                     transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                     share_embeddings_and_output_weights=tied)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True,
        overlap_grad_reduce=bucket is not None, bucket_size=bucket), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS,
        weight_decay=WEIGHT_DECAY, use_distributed_optimizer=True,
        params_dtype=torch.float32), [ddp])
    # The same gradients on every rank, as a run's all-reduces leave them: replicated
    # parameters (the norms) stay equal across tensor-parallel ranks.
    generator = torch.Generator().manual_seed(1)
    for _ in range(ITERATION):
        ddp.zero_grad_buffer()
        for p in ddp.parameters():
            p.main_grad.copy_(torch.randn(p.main_grad.shape, generator=generator))
        assert optimizer.step()[0]

    for fmt in FORMATS:
        metadata = {"distrib_optim_sharding_type": fmt}
        model_state = model.sharded_state_dict(metadata=metadata)
        state = {"model": model_state,
                 "optimizer": optimizer.sharded_state_dict(model_state, metadata=metadata),
                 "args": _args(tp, world // tp, tied, bucket), "iteration": ITERATION,
                 "checkpoint_version": 3.0}
        iteration = Path(out) / fmt / f"iter_{ITERATION:07d}"
        iteration.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(state, str(iteration), content_metadata=metadata)
        if rank == 0:
            (iteration.parent / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))

    # Each data-parallel rank's optimizer holds a slice of each of its parameters' state, the
    # flattened parameter's elements from `start/NAME` on (or none of it).
    (inner,) = optimizer.chained_optimizers
    local = {}
    for name, p in model.named_parameters():
        local[name] = p.detach().clone()
        if p in inner.model_param_gbuf_map:
            start = inner._get_model_param_range_map(p)["param"].start
            local[f"start/{name}"] = torch.tensor(start)
            for field, x in inner._get_main_param_and_optimizer_states(p).items():
                if field != "step":
                    local[f"{field}/{name}"] = x.detach().clone()
    torch.save(local, Path(out) / f"local_{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    # Forked, the ranks of every run share this process's imports of torch and Megatron-Core
    # (see tests/torch_llama.py), made once its CUDA names lead to the host.
    _on_cpu()
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401

    for run in sys.argv[1:]:
        out, tp, dp, tied, *bucket = run.split(",")
        world = int(tp) * int(dp)
        mp.start_processes(_run, args=(world, _free_port(), out, int(tp), tied == "tied",
                                       int(bucket[0]) if bucket else None),
                           nprocs=world, start_method="fork")
