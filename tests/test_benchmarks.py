"""Every benchmark script runs: each once with `--quick --json`, in its own process on 8 simulated
CPU devices, and its report holds real numbers that agree where they must (losses across
strategies and methods, scheduled switches against `jax.device_put`)."""

import json
import math
import tomllib

import numpy as np
import pytest
from helpers import ROOT, python

from hotjax.planning.profile import parse_profile

LOSS_TOLERANCE = 1e-4  # float32 compute: only the summation order differs


def run_quick(script: str, *flags: str) -> dict:
    """The script's JSON report from `--quick --json`, after checking it exited cleanly."""
    return json.loads(python(f"scripts/{script}.py", "--quick", "--json", *flags).stdout)


def positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def test_bench_strategies() -> None:
    report = run_quick("bench_strategies")
    results = report["results"]
    assert len(results) == 6 and report["machine"]["devices"] == 8  # 3 strategies x 2 lengths
    for r in results:
        assert r["status"] == "ok", r
        memory = r["memory_bytes"]
        assert 0 < memory["resident"] < memory["peak"] and memory["step"] > 0
        assert positive(r["step_s"]) and positive(r["tokens_per_s"]) and r["rows_run"] >= r["rows"]
    for seq_len in {r["seq_len"] for r in results}:
        losses = [r["loss"] for r in results if r["seq_len"] == seq_len]
        assert max(losses) - min(losses) < LOSS_TOLERANCE, (seq_len, losses)


def test_bench_switch() -> None:
    report = run_quick("bench_switch")
    assert len(report["pairs"]) == 2
    for pair in report["pairs"]:
        assert pair["equal"], pair
        assert pair["bytes_moved"] > 0 and pair["messages"] > 0
        assert pair["max_send"] >= pair["lower_bound"] > 0
        assert positive(pair["executor_s"]) and positive(pair["device_put_s"])


def test_bench_switch_across_two_processes() -> None:
    report = run_quick("bench_switch", "--processes", "2")
    assert report["machine"]["processes"] == 2 and len(report["pairs"]) == 2
    for pair in report["pairs"]:
        assert pair["equal"], pair  # every process's shards after device_put
        greedy, first = pair["greedy"], pair["first-owner"]
        assert greedy["bytes_moved"] == first["bytes_moved"] > 0
        assert greedy["inter_node_bytes"] <= first["inter_node_bytes"]
        assert greedy["estimated_s"] <= first["estimated_s"]
        assert positive(pair["device_put_s"])
    # data2·tensor4 -> fsdp2·context4: each process holds all it needs, and only same-node
    # sending finds it there.
    assert report["pairs"][0]["greedy"]["inter_node_bytes"] == 0
    assert report["pairs"][0]["first-owner"]["inter_node_bytes"] > 0


def test_bench_data() -> None:
    report = run_quick("bench_data")
    assert len(report["pipeline"]) == 2
    for r in report["pipeline"].values():
        assert 0 < r["real_tokens"] <= r["batches"] * report["batch_tokens"]
        assert positive(r["tokens_per_s"])
    trainer = report["trainer"]
    assert 0 < trainer["real_tokens"] <= trainer["steps"] * report["batch_tokens"]
    assert positive(trainer["tokens_per_s"]) and positive(report["ratio"])


def test_bench_ckpt() -> None:
    report = run_quick("bench_ckpt")
    assert report["state_bytes"] > 0 and report["disk_bytes"] > 0
    assert positive(report["save"]["seconds"]) and report["save"]["blocked_s"] >= 0
    assert set(report["restore"]) == {"same mesh", "new mesh", "new device count"}
    assert all(positive(r["seconds"]) for r in report["restore"].values())
    assert positive(report["training"]["step_s"])
    dcp = report["dcp"]
    assert dcp["bytes"] > 0 and dcp["export"]["bytes"] > 0 and dcp["files"] > 1
    assert all(positive(x) for way in ("import", "export") for x in dcp[way].values())
    assert positive(dcp["disk_read_gb_s"]) and positive(dcp["import_vs_disk_read"])


def test_bench_mixed() -> None:
    report = run_quick("bench_mixed", "--bucket-timings")
    methods = report["methods"]
    assert set(methods) == {"hot", "auto", "a", "a0", "b", "c"}
    steps = report["warmup"] + report["steps"]
    hot = methods["hot"]["losses"]
    for name, m in methods.items():
        assert len(m["losses"]) == steps
        assert all(math.isfinite(x) for x in m["losses"])
        assert max(abs(x - y) for x, y in zip(m["losses"], hot, strict=True)) < LOSS_TOLERANCE
        assert 0 <= m["padding"] < 1, name
        assert max(m["memory_bytes"].values()) <= report["device_memory"] * 2**20
        assert positive(m["step_s"]) and positive(m["tokens_per_s"])
        # The same documents: the same real tokens every step.
        assert [s["tokens"] for s in m["steps"]] == [s["tokens"] for s in methods["a"]["steps"]]
    assert report["max_loss_difference"] < LOSS_TOLERANCE
    # One document per row pads at least as much as packing them. One strategy switches nothing;
    # the table switches in every step that runs a bucket whose strategy is not its home's.
    assert methods["b"]["padding"] >= methods["a"]["padding"]
    assert all(s["switched_bytes"] == 0 for m in ("a", "a0", "b", "c")
               for s in methods[m]["steps"])
    # Balance moves rows between data shards and micro-steps, never worsening the estimate;
    # without it the rows run in packing order. The cost model prices every method.
    for m in methods.values():
        assert all(1 <= s["imbalance"] <= s["imbalance_before"] for s in m["steps"])
        assert positive(m["predicted_s"])
        # Each step's prediction is its buckets' (those it ran: an empty one costs nothing)
        # and its switches; every bucket that ran was timed.
        for s in m["steps"]:
            assert s["predicted_s"] == pytest.approx(
                sum(b["predicted_s"] for b in s["buckets"]) + s["predicted_switch_s"])
            assert all(positive(b["compute_s"]) and b["switch_s"] >= 0
                       and positive(b["predicted_s"]) for b in s["buckets"])
    assert all(s["imbalance"] == s["imbalance_before"] for s in methods["a0"]["steps"])
    np.testing.assert_allclose(methods["a0"]["losses"], methods["a"]["losses"], rtol=0,
                               atol=1e-5)
    strategy = {b["max_len"]: b["strategy"] for b in methods["hot"]["buckets"]}
    for step in methods["hot"]["steps"]:
        away = any(strategy[b["max_len"]] != methods["hot"]["home"] for b in step["buckets"])
        assert (step["switched_bytes"] > 0) == away, step
    assert all(positive(v) for v in report["ratios"].values())
    # (a) is the measured best of the candidates that fit (per CPU second on simulated
    # devices): each one timed on the first mini-batch and priced by the cost model.
    candidates = report["candidates"]
    fitting = [c for c in candidates if c["status"] == "fits"]
    assert len(candidates) == 2 and fitting
    for c in fitting:
        assert all(positive(c[k]) for k in ("step_s", "cpu_s", "predicted_s", "tokens_per_s"))
    best = max(fitting, key=lambda c: c["tokens_per_cpu_s"])
    assert [c["chosen"] for c in candidates] == [c is best for c in candidates]
    assert report["static_strategy"] == best["strategy"] == methods["a"]["home"]


@pytest.mark.parametrize("script", sorted(p.stem for p in (ROOT / "scripts").glob("bench_*.py")))
def test_every_benchmark_is_tested(script: str) -> None:
    assert f"test_{script}" in globals(), f"scripts/{script}.py has no test here: add one"


def test_bench_auto() -> None:
    """`hotjax train` under the default table and under `--strategies auto` trains the same
    mini-batches to the same losses; both are timed and priced by the cost model."""
    report = run_quick("bench_auto")
    default, auto = report["methods"]["default"], report["methods"]["auto"]
    assert report["same_tokens"] and len(auto["losses"]) == report["steps"] == 3
    assert report["max_loss_difference"] < LOSS_TOLERANCE
    assert report["auto_over_default"] == pytest.approx(auto["step_s"] / default["step_s"])
    assert report["no_worse"] == (report["auto_over_default"] <= 1)
    assert len(default["buckets"]) == 3  # the default table's
    for r in (default, auto):
        assert positive(r["step_s"]) and positive(r["tokens_per_s"]) and positive(r["predicted_s"])
        buckets = sum(b["predicted_s"] for b in r["buckets"])
        assert r["predicted_s"] >= buckets * (1 - 1e-9)  # the buckets' micro-steps + switches
    assert report["planned_line"].startswith("--strategies auto: planned on profile")
    assert report["trainers"]["auto"].startswith("home ")


def test_bench_plan() -> None:
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
    (hot,) = report["tables"]["results"]  # one table of two buckets
    assert [b["max_len"] for b in hot["table"]] == [64, 256]
    assert positive(hot["predicted_s"]) and positive(hot["measured_s"]), hot
    assert hot["predicted_s"] == pytest.approx(
        sum(b["predicted_s"] for b in hot["table"]) + hot["switch_predicted_s"])
    memory = report["memory"]
    assert memory["model"]["layers"] == 4 and len(memory["results"]) == 2
    for r in memory["results"]:
        assert r["xla_bytes"] > 0 and r["predicted_bytes"] > 0
        # The cost model's own tolerance on LLaMA2-7B widths (tests/test_cost.py).
        assert r["relative_error"] <= 0.15, r


def test_bench_memory() -> None:
    report = run_quick("bench_memory")
    assert report["compile_only"] and report["machine"]["devices"] == 8
    results = report["results"]
    strategies = {r["strategy"] for r in results}
    assert len(strategies) == 2 and len(results) == 3 * len(strategies)
    for r in results:
        assert r["step_peak_bytes"] > 0 and r["resident_bytes"] > 0
        assert r["total_bytes"] == r["step_peak_bytes"] + r["resident_bytes"]
        assert positive(r["compile_s"])
        assert r["predicted_peak_bytes"] > 0  # the cost model's, beside XLA's
        assert r["xla_over_predicted"] == r["step_peak_bytes"] / r["predicted_peak_bytes"]
    for strategy in strategies:
        peak = {r["remat"]: r["step_peak_bytes"] for r in results if r["strategy"] == strategy}
        assert set(peak) == {"none", "dots", "full"}
        # Recomputing more keeps less for the backward pass.
        assert peak["full"] < peak["none"] and peak["dots"] <= peak["none"], (strategy, peak)
        # The home's state does not depend on what the micro-step recomputes.
        assert len({r["resident_bytes"] for r in results if r["strategy"] == strategy}) == 1


def test_bench_attention() -> None:
    report = run_quick("bench_attention")
    cases = {c["name"]: c for c in report["cases"]}
    assert set(cases) == {"packed", "causal"}
    for c in cases.values():
        assert positive(c["dense_s"]) and positive(c["blockwise_s"]) and positive(c["speedup"])
        assert c["max_abs_diff"] < LOSS_TOLERANCE, c
        # The kernel skips blocks: those of other documents, and those above the diagonal.
        assert 0 < c["blocks"] < c["total_blocks"], c
    assert cases["packed"]["blocks"] < cases["causal"]["blocks"]
    ring = {r["name"]: r for r in report["ring"]}
    assert set(ring) == {"packed", "causal"}
    for r in ring.values():
        assert len(r["balanced"]) == len(r["unbalanced"]) == r["ways"]
        assert min(r["balanced"]) > 0 and min(r["unbalanced"]) > 0
        # Every pair is computed by one rank, however the row is split (the quick blocks are the
        # kernel's own and fit in half a chunk).
        assert sum(r["balanced"]) == sum(r["unbalanced"]) == cases[r["name"]]["blocks"], r
    # A causal row split in order leaves the last rank most of the work; balanced chunks share it.
    causal = ring["causal"]
    assert causal["balanced_ratio"] < causal["unbalanced_ratio"]
    assert causal["balanced_ratio"] <= 1.2


def test_bench_gpu() -> None:
    """Its check and kernel parts at toy sizes on CPU: the packed-attention kernel and a ring
    step over the row (Pallas' interpreter) against the dense reference, and the tiles the
    packed kernel computes."""
    check = run_quick("bench_gpu", "check")
    cases = check["kernel"]
    assert [(c["kernel"], c["dtype"]) for c in cases] == [
        (kernel, dtype) for dtype in ("float32", "bfloat16", "bfloat16")
        for kernel in ("packed", "ring-step")]
    for case in cases:
        bound = 1e-5 if case["dtype"] == "float32" else 0.1
        assert max(case["max_abs_error"].values()) < bound, case
    assert check["steps"]["max_rel_diff"] < 1e-6 and len(check["steps"]["cpu"]) == 3
    rows = run_quick("bench_gpu", "kernels")["results"]
    assert [(r["doc_len"], r["kernel"]) for r in rows] == [
        (64, "packed"), (64, "ring-step"), (512, "packed"), (512, "ring-step")]
    assert all(row["status"] == "ok" and positive(row["step_ms"]) for row in rows)
    packed = [row for row in rows if row["kernel"] == "packed"]
    for row in packed:  # a row of 64-token documents computes fewer tiles than one document
        assert 0 < row["blocks"] < row["total_blocks"]
    assert packed[0]["blocks"] < packed[1]["blocks"]


def test_bench_gpu_calibrate() -> None:
    """The calibration at toy sizes on CPU: each remat policy's micro-step timed in a process
    of its own, beside the cost model's seconds (under the profile just measured, within a
    factor of two here) and bytes; XLA's plan shrinks as the policy saves less."""
    report = run_quick("bench_gpu", "calibrate")
    assert report["profile"]["platform"] == "cpu" and positive(report["profile"]["matmul_tflops"])
    rows = {r["remat"]: r for r in report["results"]}
    assert set(rows) == {"none", "dots", "full"}
    for r in rows.values():
        assert r["status"] == "ok", r
        assert 0.5 < r["step_s"] / r["predicted_s"]["measured"] < 2, r
        assert positive(r["predicted_bytes"]) and r["peak_bytes_in_use"] is None  # CPU: none
    peaks = [rows[p]["xla_bytes"]["peak"] for p in ("none", "dots", "full")]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]


def test_bench_gpu_calibrate_refuses_a_profile_that_is_no_report(tmp_path) -> None:
    """A `--profile` file missing, or not a `profile --json` report: one line, exit 1."""
    bad = tmp_path / "profile.json"
    bad.write_text(json.dumps({"device": "x", "platform": "gpu"}))
    for given, cause in ((tmp_path / "none.json", "FileNotFoundError"), (bad, "KeyError")):
        done = python("scripts/bench_gpu.py", "calibrate", "--quick", "--profile", given,
                      ok=False)
        assert done.returncode == 1 and "Traceback" not in done.stderr
        (line,) = [x for x in done.stderr.splitlines() if x.startswith("bench_gpu:")]
        assert f"--profile {given}: {cause}" in line and line.endswith("--json` report")


def test_simulate_hotspa() -> None:
    report = run_quick("simulate_hotspa")
    [row] = report["rows"]
    seconds = row["seconds"]
    assert (row["model"], row["devices"], row["context"]) == ("llama2-7b", 8, 16384)
    assert row["sequences"] == 512 and row["tokens"] > 0
    # The plan is the fastest of the tables the search could choose; masking and packing
    # never cost more than concatenating without masking, or padding one sequence per row.
    assert seconds["static, masked"] >= seconds["plan"] * (1 - 1e-3)
    assert seconds["static, masked"] <= seconds["static, no masking"] <= seconds["static, padded"]
    # The paper's tables fit the 72 GiB JAX is given of an 80 GiB A800 here only because their
    # data=8 bucket can split its fp32 gradient sum over data (a whole one per device does not
    # fit beside replicated weights); the plan is at least as fast as either.
    for table in ("paper c1", "paper c2"):
        assert seconds[table] is not None and seconds[table] >= seconds["plan"] * (1 - 1e-3)


def test_lognormal_corpus(tmp_path, capsys) -> None:
    """`scripts/lognormal_corpus.py` cuts a corpus's joined text, in order and losing nothing
    but the tail, into documents of log-normal lengths within the bounds, and --data reads
    them back."""
    import importlib.util

    from hotjax.data import open_corpus

    spec = importlib.util.spec_from_file_location("lognormal_corpus",
                                                  ROOT / "scripts" / "lognormal_corpus.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    source = tmp_path / "src"
    source.mkdir()
    texts = [f"{i:03d} " + "".join(chr(97 + (i * j) % 26) for j in range(4000)) for i in range(30)]
    for i, text in enumerate(texts):
        (source / f"{i:03d}.txt").write_text(text)
    out = tmp_path / "docs.jsonl"
    assert script.main([str(out), "--data", str(source), "--median", "300", "--sigma", "0.8",
                        "--min", "50", "--max", "2000", "--seed", "1"]) == 0
    docs = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    joined = "".join(t + "\n" for t in texts)
    assert joined.startswith("".join(docs)) and len(joined) - len("".join(docs)) <= 2000
    lengths = np.asarray([len(d) for d in docs])
    assert lengths.min() >= 50 and lengths.max() <= 2000
    assert 300 * 0.8 < np.median(lengths) < 300 * 1.25  # about 400 draws of median 300
    corpus = open_corpus(str(out))
    assert [corpus.read(i) for i in range(corpus.num_documents)] == docs
    capsys.readouterr()
    assert script.main([str(tmp_path / "docs.txt"), "--data", str(source)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
