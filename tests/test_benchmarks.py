"""Every benchmark script runs: each once with `--quick --json`, in its own process on 8 simulated
CPU devices, and its report holds real numbers that agree where they must (losses across
strategies and methods, scheduled switches against `jax.device_put`). Those that plan or price
with the cost model are in tests/test_benchmarks_planner.py: two files, run side by side."""

import json

import numpy as np
import pytest
from helpers import LOSS_TOLERANCE, ROOT, load_file, positive, python, run_quick


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


def test_bench_switch_on_the_devices_its_table_names(tmp_path) -> None:
    """`--devices N` runs on N devices: a table of four, its two switches checked."""
    table = tmp_path / "four.toml"
    table.write_text('[[bucket]]\nmax_len = 256\nmesh = { data = 2, tensor = 2 }\n\n'
                     '[[bucket]]\nmax_len = 1024\nmesh = { fsdp = 2, context = 2 }\n')
    report = run_quick("bench_switch", "--devices", "4", "--table", str(table))
    assert report["machine"]["devices"] == "4 cpu" and len(report["pairs"]) == 2
    assert all(pair["equal"] and pair["bytes_moved"] > 0 for pair in report["pairs"])


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



@pytest.mark.parametrize("script", sorted(p.stem for p in (ROOT / "scripts").glob("bench_*.py")))
def test_every_benchmark_is_tested(script: str) -> None:
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_benchmarks*.py"))
    assert f"def test_{script}(" in tests, f"scripts/{script}.py has no test: add one"




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
    """Its check and kernel parts at toy sizes on CPU: the packed-attention kernel under each of
    its backwards and a ring step over the row under each of its own (Pallas' interpreter)
    against the dense reference, and the tiles the packed kernel computes."""
    kernels = ("packed", "packed-fa2", "packed-fa2-split", "ring-step", "ring-step-fa2-split")
    check = run_quick("bench_gpu", "check")
    cases = check["kernel"]
    assert [(c["kernel"], c["dtype"]) for c in cases] == [
        ({"packed": "packed-two-loop"}.get(kernel, kernel), dtype)
        for dtype in ("float32", "bfloat16") for kernel in kernels]
    for case in cases:
        bound = 1e-5 if case["dtype"] == "float32" else 0.1
        assert max(case["max_abs_error"].values()) < bound, case
    assert check["steps"]["max_rel_diff"] < 1e-6 and len(check["steps"]["cpu"]) == 3
    rows = run_quick("bench_gpu", "kernels")["results"]
    assert [(r["doc_len"], r["kernel"]) for r in rows] == [
        (doc_len, kernel) for doc_len in (64, 512) for kernel in kernels]
    assert all(row["status"] == "ok" and positive(row["step_ms"]) for row in rows)
    packed = [row for row in rows if row["kernel"] == "packed"]
    for row in packed:  # a row of 64-token documents computes fewer tiles than one document
        assert 0 < row["blocks"] < row["total_blocks"]
    assert packed[0]["blocks"] < packed[1]["blocks"]


def test_bench_gpu_calibrate() -> None:
    """The calibration at toy sizes on CPU: each remat policy's micro-step timed in a process
    of its own, beside the cost model's seconds under the profile just measured (exactly the
    model's price under the profile the report holds) and bytes; XLA's plan shrinks as the
    policy saves less."""
    from hotjax.planning.cost import micro_step_time
    from hotjax.sharding.strategy import Strategy

    bench = load_file("scripts/bench_gpu.py")
    report = run_quick("bench_gpu", "calibrate")
    assert report["profile"]["platform"] == "cpu" and positive(report["profile"]["matmul_tflops"])
    measured = bench._profile_from(report["profile"])
    rows = {r["remat"]: r for r in report["results"]}
    assert set(rows) == {"none", "dots", "full"}
    for r in rows.values():
        assert r["status"] == "ok", r
        config = bench._calibration_model(True, r["remat"], "cpu")
        shape = (r["rows"], r["seq_len"])
        assert r["predicted_s"]["measured"] == pytest.approx(micro_step_time(
            config, Strategy.parse("data=1,rules=dp"), shape, measured).seconds, rel=1e-9)
        # The profile and the step are timed in different processes while the other test
        # worker runs (0.45 of the price seen so): a wide guard, against wrong units.
        assert 0.25 < r["step_s"] / r["predicted_s"]["measured"] < 4, r
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



def test_lognormal_corpus(tmp_path, capsys) -> None:
    """`scripts/lognormal_corpus.py` cuts a corpus's joined text, in order and losing nothing
    but the tail, into documents of log-normal lengths within the bounds, and --data reads
    them back."""
    from hotjax.data import open_corpus

    script = load_file("scripts/lognormal_corpus.py")
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
    # Bimodal: a quarter of the documents from a second log-normal 8x longer, the rest as
    # before; the text is still the source's, in order.
    mixed = tmp_path / "mixed.jsonl"
    assert script.main([str(mixed), "--data", str(source), "--median", "100", "--sigma", "0.3",
                        "--mix", "0.25:800:0.3", "--seed", "1"]) == 0
    docs = [json.loads(line)["text"] for line in mixed.read_text().splitlines()]
    assert joined.startswith("".join(docs))
    lengths = np.asarray([len(d) for d in docs])
    long = lengths > 283  # the geometric mean of the two medians, 3.5 sigmas from either
    assert 0.25 * 0.75 < long.mean() < 0.25 * 1.25  # of about 400 draws
    assert 100 * 0.9 < np.median(lengths[~long]) < 100 * 1.1
    assert 800 * 0.85 < np.median(lengths[long]) < 800 * 1.15
    capsys.readouterr()
    for name, bad, problem in (("docs.txt", [], "name the output .jsonl"),
                               ("docs.jsonl", ["--mix", "1.5:800"], "--mix 1.5:800: give"),
                               ("docs.jsonl", ["--mix", "0.2"], "--mix 0.2: give")):
        assert script.main([str(tmp_path / name), "--data", str(source), *bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and problem in err


def test_bench_gpu_refuses_an_unknown_kernel_name() -> None:
    """`--kernels` names what `kernels` times: a name it does not know is one line, exit 2."""
    done = python("scripts/bench_gpu.py", "kernels", "--kernels", "packed,bogus", ok=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--kernels: unknown bogus: choose from packed," in done.stderr.splitlines()[-1]


@pytest.mark.parametrize(("argv", "line"), [
    (("scripts/bench_switch.py", "--quick", "--table", "missing.toml"),
     "bench_switch: error: strategy table not found: missing.toml: pass an existing .toml file"),
    (("scripts/bench_switch.py", "--quick", "--devices", "2"),
     "bench_switch: error: built-in table: bucket 1 (max_len 1024): mesh data2·tensor4 [auto] "
     "uses 8 devices but 2 are in use: make its sizes multiply to 2, or pass --devices 8"),
    (("scripts/bench_ckpt.py", "--quick", "--model", "nope"),
     "bench_ckpt: error: unknown model preset 'nope': choose one of tiny,")])
def test_a_benchmark_given_bad_input_exits_2_with_one_line(argv, line) -> None:
    """The benchmarks that end without `quick_option.report` end as it does on bad input."""
    done = python(*argv, ok=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1].startswith(line), done.stderr[-2000:]
    assert done.stderr.count("error:") == 1, done.stderr[-2000:]
