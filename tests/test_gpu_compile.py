"""Every GPU program hotjax compiles, compiled for eight H100s on this CPU (`hotjax.targets`):
each strategy family's micro-step, a hot switch, LLaMA2-7B's planned buckets, and what must not
fit; XLA:GPU's own memory plan checked against the model's and the device's bytes."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu.attention import BlockSizes, mha
from jax.sharding import SingleDeviceSharding

from hotjax import targets
from hotjax.data.buckets import cut
from hotjax.models.attention import choose_backend
from hotjax.models.llama import abstract_params, layers_unrolled, param_axes, preset
from hotjax.planning import search
from hotjax.planning.memory import micro_step_memory
from hotjax.planning.profile import load_profile
from hotjax.sharding.report import resident_bytes
from hotjax.sharding.strategy import Layout, Strategy, fit_to_model
from hotjax.sharding.switch import ScheduledSwitch
from hotjax.sharding.transfers import Topology, schedule_transfers, sharding_switches
from hotjax.step import bucket_step, step_memory

TRITON = "__gpu$xla.gpu.triton"  # the custom call a Pallas (Triton) kernel compiles to
GB = 1e9
# A model with the small preset's widths (head dimension 32, which Triton's tiles take) and two
# layers: each family compiles in seconds.
SMALL = dataclasses.replace(preset("small"), n_layers=2)
SHAPE = (8, 512)  # rows, tokens per row: four Pallas tiles of 128
LLAMA2_7B = preset("llama2-7b")


@pytest.fixture(scope="module")
def h100() -> tuple[targets.Target, tuple[jax.Device, ...]]:
    target = targets.prepare("h100")
    return target, tuple(targets.devices(target, 8))


FAMILIES = {  # strategy -> the attention kernel it runs on packed GPU rows
    "data=8,rules=dp": "pallas",
    "fsdp=8,rules=fsdp": "pallas",
    "data=2,tensor=4,rules=megatron": "pallas",
    "data=2,tensor=4,rules=megatron-sp": "pallas",
    "data=2,context=4,rules=context,balanced=true": "pallas-ring",
    "stage=2,data=4,microbatches=2,rules=dp": "pallas",
    "stage=2,data=2,tensor=2,microbatches=2,rules=megatron-sp": "pallas",
}


@pytest.mark.parametrize("text", FAMILIES)
def test_every_strategy_family_compiles_for_h100_with_the_kernel_it_chose(h100, text):
    target, devices = h100
    strategy = Strategy.parse(text)
    step = bucket_step(SMALL, strategy, devices)
    ring = step.layout.attention.ring_size
    # Under a ring the kernel tiles a rank's chunk, each half apart when balanced.
    tiled = SHAPE[1] // ring // (2 if ring > 1 and strategy.balanced else 1)
    kernel, _ = choose_backend(SMALL.attention, devices[0].platform, ring=ring > 1,
                               packed=True, seq_len=tiled)
    assert kernel == FAMILIES[text]
    compiled = step.compiled(SHAPE)
    assert (TRITON in compiled.as_text()) == (kernel != "blockwise")
    xla = step_memory(compiled)
    # The arguments (weights in their layout, the fp32 accumulator, the batch) are exact.
    model = micro_step_memory(SMALL, strategy, SHAPE, platform="gpu")
    assert xla["state"] == model.weights + model.grad_sum + model.batch
    assert xla["temp"] > 0 and xla["peak"] < target.memory


def test_a_context_ring_runs_the_ring_step_kernel_for_each_chunk(h100):
    """The ring family's micro-step on H100s: per layer and step of its ring of 4, one Triton
    forward and one backward of the ring step's kernel (`hotjax.models.packed_attention.ring_step`),
    where XLA's blockwise kernel ran before (the layer loop unrolled on a GPU without remat: each
    layer's kernels apart); the micro-step is the family test's, compiled once."""
    _, devices = h100
    step = bucket_step(SMALL, Strategy.parse("data=2,context=4,rules=context,balanced=true"),
                       devices)
    kernels = [line.split('name = "')[1].split('"')[0]
               for line in step.compiled(SHAPE).as_text().splitlines() if TRITON in line]
    calls = 4 * layers_unrolled(SMALL, "gpu")
    assert sorted(kernels) == (["ring_attention_backward"] * calls
                               + ["ring_attention_forward"] * calls)


def test_fp16_with_a_loss_scale_compiles_fp16_matmuls_in_the_bytes_bf16_takes(h100):
    """fp16 enters the micro-step as the compute dtype and the loss scale as its last argument
    (the update that keeps the scale needs the home state, which lives on real devices)."""
    _, devices = h100
    strategy = Strategy.parse("data=2,tensor=4,rules=megatron")
    half = dataclasses.replace(SMALL, compute_dtype="float16")
    fp16, bf16 = (step_memory(bucket_step(c, strategy, devices).compiled(SHAPE))
                  for c in (half, SMALL))
    assert fp16["state"] == bf16["state"]  # 2-byte weights either way, fp32 sums
    text = bucket_step(half, strategy, devices).compiled(SHAPE).as_text()
    assert "f16[" in text and TRITON in text
    model = micro_step_memory(half, strategy, SHAPE, platform="gpu")
    assert fp16["state"] == model.weights + model.grad_sum + model.batch
    # The same arrays in a dtype of the same width: XLA:GPU plans the same bytes within 5 %.
    assert fp16["peak"] == pytest.approx(bf16["peak"], rel=0.05)


def test_a_hot_switch_compiles_one_program_per_sender_and_receiver(h100):
    """The scheduled switch between two buckets' weights (tensor x data to FSDP): each
    receiver's program assembles exactly its shard of the target layout."""
    _, devices = h100
    axes, shapes = param_axes(SMALL), abstract_params(SMALL)
    source, target = (Layout(fit_to_model(Strategy.parse(t), SMALL)[0], devices).param_shardings(
        axes, shapes) for t in ("data=2,tensor=4,rules=megatron", "fsdp=8,rules=fsdp"))
    weights = jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16,
                                                                    sharding=sharding),
                           shapes, source)
    leaves, targets_ = jax.tree.leaves(weights), jax.tree.leaves(target)
    plan = schedule_transfers(sharding_switches(weights, target), Topology.of_processes(devices))
    switch = ScheduledSwitch(plan, {d.id: d for d in devices}, [x.dtype for x in leaves],
                             targets_)
    assemblies = switch._assemblies  # noqa: SLF001 - the compiled programs are what we check
    assert len(assemblies) == 8
    fsdp_shard = SMALL.num_params() * 2 // 8  # every weight splits 8 ways on `embed`
    for program in assemblies:
        stats = program.executable.memory_analysis()
        assert stats.output_size_in_bytes == pytest.approx(fsdp_shard, rel=0.01)
        assert TRITON not in program.executable.as_text()
    sent = sum(p.executable.memory_analysis().output_size_in_bytes for p in switch._gathers)  # noqa: SLF001
    # The senders' buffers hold the bytes the plan moves (XLA:GPU's sizes, measured: 192
    # bytes over in all, a few bytes per buffer).
    assert 0 <= sent - plan.bytes_moved <= 64 * len(switch._destinations)  # noqa: SLF001


@functools.cache
def _planned() -> dict[tuple[int, int], tuple[search.Choice, str, int]]:
    """The paper's hand tables for LLaMA2-7B on 8 GPUs, as hotjax plans their buckets on the
    H100 profile: (context, max_len) -> (bucket, its gradient accumulation, home bytes)."""
    from simulate_hotspa import LENGTHS, PAPER, paper_strategy

    documents = np.asarray(json.loads(LENGTHS.read_text())["quantiles"], np.int64)
    profile = load_profile("h100-1x8")
    planner = search.Search(LLAMA2_7B, profile, 8, profile.memory_bytes)
    planned = {}
    for context in (16384, 32768):
        lengths = search.typical_batch(cut(documents, context, "truncate"), 512)
        table = [(high, fit_to_model(paper_strategy(*sizes), LLAMA2_7B)[0])
                 for high, sizes in PAPER[("llama2-7b", 8, context)]["c1"]]
        home = min(resident_bytes(LLAMA2_7B, s) for _, s in table)
        for bucket in search.fixed_table(planner, lengths, table).buckets:
            micro = planner.micro_step(bucket.strategy, bucket.max_len, home, bucket.rows)
            assert (micro.rows, micro.remat) == (bucket.micro_rows, bucket.remat)
            planned[(context, bucket.max_len)] = (bucket, micro.accumulate, home)
    return planned


@pytest.mark.parametrize(("context", "max_len"), [(16384, 4096), (16384, 16384),
                                                  (32768, 4096), (32768, 16384),
                                                  (32768, 32768)])
def test_llama2_7b_planned_buckets_fit_an_h100_as_xla_gpu_plans_them(h100, context, max_len):
    """The paper's tables for 8 GPUs (<DP, TP, PP>: 16K: (8,1,1) to 4K, (2,2,2) to 16K; 32K:
    those and (1,4,2) to 32K), each bucket at the rows and remat policy hotjax plans for it,
    beside the home state: within the H100's memory by XLA:GPU's own count."""
    target, devices = h100
    bucket, accumulate, home = _planned()[(context, max_len)]
    config = dataclasses.replace(LLAMA2_7B, remat=bucket.remat)
    step = bucket_step(config, bucket.strategy, devices, accumulate)
    xla = step_memory(step.compiled((bucket.micro_rows, max_len)))
    assert home + xla["peak"] <= target.memory
    model = micro_step_memory(config, bucket.strategy, (bucket.micro_rows, max_len), "gpu",
                              accumulate)
    assert xla["state"] == model.weights + model.grad_sum + model.batch


def test_a_bucket_that_cannot_fit_exceeds_an_h100_by_xla_gpus_count(h100):
    """The negative control: LLaMA2-7B data-parallel without remat, a 32K row per device (its
    layer loop a scan: unrolled, as a GPU runs it, it exceeds the memory as well and compiles
    32 layers instead of one)."""
    target, devices = h100
    config = dataclasses.replace(LLAMA2_7B, remat="none", scan_unroll=1)
    xla = step_memory(bucket_step(config, Strategy.parse("data=8,rules=dp"), devices)
                      .compiled((8, 32768)))
    assert xla["peak"] > target.memory


def test_a_pallas_kernel_with_tiles_beyond_shared_memory_fails_to_compile(h100):
    """Real GPU limits surface at compile time: tiles of 1024 x 1024 need more than an H100's
    228 KiB of shared memory per block, the default 128 tiles compile."""
    _, devices = h100
    on_gpu = SingleDeviceSharding(devices[0])
    qkv = [jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16, sharding=on_gpu)] * 3

    def attention(blocks: int) -> jax.stages.Compiled:
        sizes = BlockSizes(block_q=blocks, block_k=blocks)
        return jax.jit(functools.partial(mha, segment_ids=None, causal=True,
                                         block_sizes=sizes)).lower(*qkv).compile()

    assert TRITON in attention(128).as_text()
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        attention(1024)
