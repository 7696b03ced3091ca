"""`--target`: programs compiled for a GPU this machine lacks. Targets are named or read from a
file, `strategy show --memory` and `plan` report XLA:GPU's per-device bytes of the very programs
compiled here, and without JAX's CUDA plugin the flag is one line saying what to install."""

import dataclasses
import json

import pytest
from helpers import ROOT, python, table

from hotjax import targets
from hotjax.cli import main
from hotjax.config import RunConfig
from hotjax.errors import UserError
from hotjax.models.llama import preset
from hotjax.planning.profile import ALLOCATOR_FRACTION
from hotjax.run import model_config
from hotjax.sharding.report import resident_bytes
from hotjax.sharding.table import load_table
from hotjax.step import bucket_step, step_memory

STDLIB = ROOT / "docs" / "stdlib-lengths.json"
GiB, MiB = 2**30, 2**20
# Each shipped config's device_memory_size and device_description_str.
SHIPPED = {"h100": (84929347584, "NVIDIA H100 80GB HBM3"),
           "a100": (84929347584, "NVIDIA A100-SXM4-80GB"),
           "a800": (84929347584, "NVIDIA A800-SXM4-80GB")}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_each_shipped_target_is_named_with_its_memory_and_device(name):
    target = targets.Target.named(name.upper())  # names are case-insensitive
    assert (target.name, target.memory, target.description) == (name, *SHIPPED[name])


def test_a_target_config_file_is_read_and_a_bad_name_or_file_is_one_line(tmp_path):
    own = tmp_path / "my-gpu.txtpb"
    own.write_text((targets.SHIPPED / "h100.txtpb").read_text().replace(
        "device_memory_size: 84929347584", "device_memory_size: 42949672960"))
    target = targets.Target.named(str(own))
    assert (target.name, target.memory, target.description) == (
        "my-gpu", 40 * GiB, "NVIDIA H100 80GB HBM3")
    with pytest.raises(UserError, match=r"^--target h200: neither a known GPU \(a100, a800, "
                       r"h100\) nor a target config file") as bad:
        targets.Target.named("h200")
    assert "\n" not in str(bad.value)
    (tmp_path / "notes.txtpb").write_text("just notes\n")
    with pytest.raises(UserError, match="holds no gpu_device_info.*not a GPU target config"):
        targets.Target.named(str(tmp_path / "notes.txtpb"))


@pytest.mark.parametrize("command", [["strategy", "show", "data=8", "--model", "tiny"],
                                     ["plan", "--model", "tiny", "--lengths", str(STDLIB)]])
def test_without_the_extra_target_says_what_to_install_in_one_line(monkeypatch, capsys,
                                                                    command):
    monkeypatch.setattr(targets, "available", lambda: False)
    assert main([*command, "--target", "h100"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hotjax: error: --target h100: ")
    assert "pip install 'hotjax[gpu-compile]'" in err


def test_strategy_show_memory_for_h100_prints_xla_gpu_peaks_of_the_compiled_step(capsys):
    two = table("fsdp-long")
    argv = ["strategy", "show", str(two), "--model", "tiny", "--memory", "--policies", "full",
            "--target", "h100"]
    assert main([*argv, "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    h100 = targets.prepare("h100")
    config = model_config(RunConfig(model="tiny"), preset("tiny"), preset("tiny").vocab_size)
    # The first bucket's micro-step for its config, strategy and shape: the command's, if it
    # compiled that one (steps are cached by what they compile), else compiled here apart.
    first_step = bucket_step(dataclasses.replace(config, remat="full"),
                             load_table(two).buckets[0].strategy, tuple(targets.devices(h100, 8)))
    expected = step_memory(first_step.compiled((8, 256)))
    first = reports[0]
    assert first["attention"]["kernel"] == "pallas"  # the GPU's kernel, not the CPU's
    assert first["target"]["step_peak_bytes"] == {"full": expected["peak"]}
    assert first["activation_bytes"]["full"] == expected["peak"] - expected["state"]
    for report in reports:
        memory = report["target"]
        assert (memory["name"], memory["devices"], memory["memory_bytes"]) == ("h100", 8,
                                                                              h100.memory)
        assert memory["fits"] == {"full": memory["step_peak_bytes"]["full"]
                                  + memory["home_bytes"] <= h100.memory}
    # As text: the same peaks, said to be XLA:GPU's for eight H100s compiled here.
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("per XLA:GPU for 8 NVIDIA H100 80GB HBM3, compiled on this machine "
                     "without one") == 2
    assert f"fits {h100.memory / GiB:.1f} GiB" in out
    for report in reports:
        assert f"{report['target']['step_peak_bytes']['full'] / MiB:,.1f} MiB" in out


def test_plan_for_h100_compiles_each_bucket_and_reports_whether_it_fits(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    argv = ["plan", "--model", "tiny", "--target", "h100", "--lengths", str(STDLIB),
            "--context", "2048", "--batch-sequences", "64", "--max-buckets", "2"]
    assert main([*argv, "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    h100 = targets.prepare("h100")
    # Without --profile or --device-memory: the H100 node's profile, the H100's memory (the
    # allocator's share of it, as a profile's).
    assert report["profile"] == "h100-1x8" and report["devices"] == 8
    assert report["memory_gib"] == pytest.approx(h100.memory * ALLOCATOR_FRACTION / GiB)
    assert report["target"] == {"name": "h100", "device": "NVIDIA H100 80GB HBM3",
                                "memory_bytes": h100.memory}
    planned_table = load_table(out)
    vocab = json.loads(STDLIB.read_text())["tokenizer"]["vocab_size"]
    config = model_config(RunConfig(model="tiny"), preset("tiny"), vocab)
    home = resident_bytes(config, planned_table.home)
    planned = report["plan"]["buckets"]
    assert len(planned) == len(planned_table.buckets) >= 1
    for bucket, entry in zip(planned_table.buckets, planned, strict=True):
        xla = entry["xla_gpu"]
        devices = tuple(targets.devices(h100, bucket.strategy.num_devices))
        step = bucket_step(dataclasses.replace(config, remat=bucket.remat), bucket.strategy,
                           devices, xla["accumulate"])
        peak = step_memory(step.compiled((bucket.micro_rows, bucket.max_len)))["peak"]
        assert (xla["step_peak_bytes"], xla["home_bytes"]) == (peak, home)
        assert xla["peak_gib"] == pytest.approx((peak + home) / GiB)
        assert xla["fits"] == (peak + home <= report["memory_gib"] * GiB)
        assert xla["fits"]  # the tiny model fits an H100 many times over
    # As text: the column beside the cost model's peak, and what it was compiled for.
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "fits, per" in text and "XLA:GPU" in text
    flat = " ".join(text.split())
    assert ("each bucket's micro-step compiled for NVIDIA H100 80GB HBM3 on this machine "
            "without one") in flat
    for entry in planned:
        assert f"{entry['xla_gpu']['peak_gib']:.1f} yes" in flat


def test_bench_memory_for_h100_reports_xla_gpu_peaks_beside_the_cost_model():
    done = python(ROOT / "scripts" / "bench_memory.py", "--quick", "--json", "--target", "h100",
                  "--strategies", "fsdp=8,rules=fsdp", "--policies", "full")
    report = json.loads(done.stdout)
    assert report["machine"]["platform"] == "gpu" and report["machine"]["devices"] == 8
    assert report["target"]["device"] == "NVIDIA H100 80GB HBM3"
    assert report["device_memory_gib"] == report["target"]["memory_bytes"] / GiB
    [result] = report["results"]
    assert result["xla_over_predicted"] == result["step_peak_bytes"] / result[
        "predicted_peak_bytes"]
    assert result["fits"] and "Compiled by XLA:GPU for 8 NVIDIA H100 80GB HBM3" in done.stderr
