"""Measuring the devices into a hardware profile: every figure positive, the TOML written reads
back to the same profile, and the benchmark that sets the cost model's predictions beside
measured micro-steps runs and reports real numbers."""

import dataclasses
import math
import tomllib

import pytest
from test_benchmarks import positive, run_quick

from hotjax.measure import measure_profile, profile_toml
from sharding.profile import COLLECTIVES, load_profile, parse_profile


@pytest.fixture(scope="module")
def measured(devices):
    return measure_profile(devices, quick=True)


def test_measured_profile_has_positive_figures_for_every_collective_and_group(measured, devices):
    assert measured.platform == "cpu" and measured.nodes == 1
    assert measured.devices_per_node == len(devices) == 8
    assert positive(measured.peak_flops) and measured.memory_bytes > 0
    assert 0 < measured.matmul_efficiency <= 1 and 0 < measured.attention_efficiency <= 1
    assert positive(measured.intra_node_bandwidth) and positive(measured.inter_node_bandwidth)
    assert [name for name, _ in measured.collectives] == list(COLLECTIVES)
    for _, bandwidths in measured.collectives:
        assert [size for size, _ in bandwidths.intra] == [2, 4, 8]
        assert all(positive(bw) for _, bw in bandwidths.intra)
        assert bandwidths.inter == bandwidths.intra  # one process: one node


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


def test_bench_plan():
    report = run_quick("bench_plan")
    assert report["machine"]["devices"] == 8
    profile = parse_profile(tomllib.loads(report["profile"]["toml"]), "bench_plan")
    assert positive(profile.peak_flops) and positive(report["profile"]["measure_s"])
    timed = report["time"]
    assert len(timed["results"]) == 2 * 2  # strategies x row lengths
    for r in timed["results"]:
        assert positive(r["predicted_s"]) and positive(r["measured_s"]), r
        assert r["predicted_s"] == pytest.approx(sum(r["terms_s"].values()))
        assert r["relative_error"] == pytest.approx(
            abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"])
    assert -1 <= timed["spearman"] <= 1 and math.isfinite(timed["median_relative_error"])
    assert isinstance(timed["meets_targets"], bool)
    memory = report["memory"]
    assert memory["model"]["layers"] == 2 and len(memory["results"]) == 2
    for r in memory["results"]:
        assert r["xla_bytes"] > 0 and r["predicted_bytes"] > 0
        # The cost model's own tolerance on LLaMA2-7B widths (tests/test_cost.py).
        assert r["relative_error"] <= 0.15, r
