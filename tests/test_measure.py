"""Measuring the devices into a hardware profile: every figure positive, the TOML written reads
back to the same profile (the benchmark that sets the cost model's predictions beside measured
micro-steps is tested in test_benchmarks_planner.py)."""

import dataclasses
import tomllib

import pytest
from helpers import positive

from hotjax.planning.cost import micro_step_time
from hotjax.planning.measure import (
    FIT_ROWS,
    fitted_step,
    measure_profile,
    reference_model,
)
from hotjax.planning.profile import (
    COLLECTIVES,
    OPTIONAL_COLLECTIVES,
    load_profile,
    parse_profile,
    profile_toml,
)
from hotjax.sharding.strategy import Strategy


@pytest.fixture(scope="module")
def measured(devices):
    return measure_profile(devices, quick=True)


def test_measured_profile_has_positive_figures_for_every_collective_and_group(measured, devices):
    assert measured.platform == "cpu" and measured.nodes == 1
    assert measured.devices_per_node == len(devices) == 8
    assert positive(measured.peak_flops) and measured.memory_bytes > 0
    assert 0 < measured.matmul_efficiency <= 1 and 0 < measured.attention_efficiency <= 1
    assert measured.step_overhead >= 0 and positive(measured.collective_latency)
    assert positive(measured.elementwise_bandwidth)
    assert positive(measured.intra_node_bandwidth) and positive(measured.inter_node_bandwidth)
    # One node: its switches move at the rate measured, with their fixed cost; those that
    # would span nodes at the link's.
    assert positive(measured.switch_bandwidth) and measured.switch_latency >= 0
    assert measured.switch_seconds(2**20, False) == pytest.approx(
        measured.switch_latency + 2**20 / measured.switch_bandwidth)
    assert measured.switch_seconds(2**20, True) == 2**20 / measured.inter_node_bandwidth
    assert [name for name, _ in measured.collectives] == [*COLLECTIVES, *OPTIONAL_COLLECTIVES]
    for _, bandwidths in measured.collectives:
        assert [size for size, _ in bandwidths.intra] == [2, 4, 8]
        assert all(positive(bw) for _, bw in bandwidths.intra)
        assert bandwidths.inter == bandwidths.intra  # one process: one node
        # Timed again on the widest groups with a sixteenth and a quarter of the 1 MiB tensor,
        # each a share of the bandwidth at the reference size.
        assert [size for size, _ in bandwidths.by_bytes] == [2**16, 2**18, 2**20]
        assert dict(bandwidths.by_bytes)[2**20] == 1.0
        assert all(positive(share) for _, share in bandwidths.by_bytes)
        widest = bandwidths.intra[-1][1]
        for size, share in bandwidths.by_bytes:
            assert bandwidths.at(8, False, size) == pytest.approx(widest * share)


def test_attention_is_measured_and_priced_at_the_heads_each_device_runs(measured):
    """The kernel's rate with all of `tiny`'s 8 heads and with those each split of 8 devices
    leaves; a tensor split and Ulysses are priced at their heads' rate, data parallelism at
    all heads' (the same pairs and heads per device otherwise)."""
    by_heads = dict(measured.attention_by_heads)
    assert sorted(by_heads) == [1, 2, 4, 8] and by_heads[8] == measured.attention_efficiency
    assert all(0 < share <= 1 for share in by_heads.values())
    model, shape = reference_model("tiny"), (2, 256)
    data = micro_step_time(model, Strategy.parse("data=2,rules=dp"), shape, measured).attention
    # (strategy, query heads per device, its work per device over data=2's)
    for split, heads, work in (("tensor=2,rules=megatron", 4, 1.0),
                               ("context=4,rules=ulysses", 2, 0.5)):
        priced = micro_step_time(model, Strategy.parse(split), shape, measured).attention
        assert priced == pytest.approx(data * work * by_heads[8] / by_heads[heads])


def test_attention_is_measured_and_priced_at_the_row_length_each_kernel_call_runs(measured):
    """The kernel's rate with all heads on the workload's 256-token rows and on 128-token rows
    (the rows the matmul rate is fitted on); a micro-step is priced at its rows' rate, a
    context ring at the reference rate."""
    by_length = dict(measured.attention_by_length)
    assert sorted(by_length) == [128, 256] and by_length[256] == measured.attention_efficiency
    assert all(0 < share <= 1 for share in by_length.values())
    flat = dataclasses.replace(measured, attention_by_length=())
    model = reference_model("tiny")
    for split, length, rate in (("data=2,rules=dp", 128, by_length[128]),
                                ("tensor=2,rules=megatron", 128, by_length[128]),
                                ("data=2,rules=dp", 256, by_length[256]),
                                ("context=2,rules=context", 128, measured.attention_efficiency)):
        strategy = Strategy.parse(split)
        priced = micro_step_time(model, strategy, (2, length), measured).attention
        at_reference = micro_step_time(model, strategy, (2, length), flat).attention
        assert priced == pytest.approx(at_reference * measured.attention_efficiency / rate)
    assert by_length[128] != measured.attention_efficiency  # the case above tells them apart


def test_profile_toml_reads_back_to_the_same_profile(measured, tmp_path):
    text = profile_toml(measured)
    assert parse_profile(tomllib.loads(text), measured.source) == measured
    path = tmp_path / "measured.toml"
    path.write_text(text)
    assert dataclasses.replace(load_profile(path), source=measured.source) == measured


@pytest.mark.parametrize("name", ["a800-4x8", "h100-1x8"])
def test_profile_toml_reads_back_shipped_profiles(name):
    shipped = load_profile(name)
    assert parse_profile(tomllib.loads(profile_toml(shipped)), shipped.source) == shipped


def test_fit_recovers_the_matmul_rate_and_the_overhead_of_every_micro_step(measured):
    """Two micro-steps priced at a known matmul rate and overhead are fitted back to both: the
    overhead is not folded into the rate (as a fit on one step would)."""
    model = reference_model("tiny")
    strategy = Strategy.parse("data=8,rules=dp")
    truth = dataclasses.replace(measured, matmul_efficiency=0.3, step_overhead=0.05)
    shapes = [(8, 128), (8 * FIT_ROWS, 128)]
    seconds = [micro_step_time(model, strategy, shape, truth).seconds for shape in shapes]
    rate, overhead = fitted_step(dataclasses.replace(measured, step_overhead=0.0), model,
                                 strategy, shapes, seconds)
    assert rate == pytest.approx(0.3 * measured.peak_flops, rel=1e-9)
    assert overhead == pytest.approx(0.05, rel=1e-9)


def test_a_measured_profile_prices_the_elementwise_work_apart_from_the_matmuls(measured):
    """The measured elementwise bandwidth prices a micro-step's norms, residual adds, SwiGLU and
    loss as bytes over it (the profile's TOML carries it); the fit leaves it out of the matmul
    rate: the same step times fit a slower matmul rate where the elementwise work is not
    priced."""
    model = reference_model("tiny")
    strategy = Strategy.parse("data=8,rules=dp")
    shape = (8, 128)
    time = micro_step_time(model, strategy, shape, measured)
    assert positive(time.elementwise)
    assert "elementwise_gbps" in tomllib.loads(profile_toml(measured))["device"]
    shapes = [shape, (8 * FIT_ROWS, 128)]
    seconds = [micro_step_time(model, strategy, s, measured).seconds for s in shapes]
    rate, _ = fitted_step(measured, model, strategy, shapes, seconds)
    unpriced, _ = fitted_step(dataclasses.replace(measured, elementwise_bandwidth=0.0), model,
                              strategy, shapes, seconds)
    assert rate == pytest.approx(measured.matmul.flat * measured.peak_flops, rel=1e-6)
    assert unpriced < rate
