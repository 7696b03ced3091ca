"""The examples a user starts from: a training script of one's own, its run built from parts
(a model of its own, a table and an optax optimizer made in Python), equals `hotjax train` given
the same parts as files; and a checkpoint written on 8 devices resumes on 4 under another
strategy with the uninterrupted run's losses."""

import concurrent.futures
import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, SUBPROCESS_TIMEOUT_S, environment, load_file, python, records

from hotjax.cli import main

# Byte tokens in fp32, over the example's hot-switched two-bucket table on 8 devices.
FLAGS = ["--tokenizer", "bytes", "--batch-tokens", "2048", "--compute-dtype", "float32",
         "--seed", "5", "--steps", "4", "--warmup-steps", "2"]


def _example():
    """examples/train_llama.py as a module: its model, table and optimizer."""
    return load_file("examples/train_llama.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """`hotjax train`, given the example's model and table as files, and the example script on
    the same flags, side by side, each saving steps 2 and 4; then the restore example from the
    command's step 2 onto 4 devices."""
    tmp = tmp_path_factory.mktemp("examples")
    example = _example()
    (tmp / "model.json").write_text(json.dumps(example.model().to_dict()))
    (tmp / "table.toml").write_text(example.strategy_table(8).toml())
    corpus = tmp / "corpus.jsonl"
    from hotjax.data import open_corpus

    rng = np.random.default_rng(3)
    text = "".join(open_corpus(None).read(i) for i in range(20))
    starts, lengths = rng.integers(0, len(text) - 300, 400), rng.integers(10, 300, 400)
    corpus.write_text("".join(json.dumps({"text": text[s:s + n]}) + "\n"
                              for s, n in zip(starts, lengths, strict=True)))
    flags = [*FLAGS, "--data", str(corpus)]
    script = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "train_llama.py"), *flags, "--devices", "8",
         "--ckpt-dir", "ck-script", "--save-every", "2", "--eval-data", str(corpus),
         "--eval-every", "2", "--eval-batches", "1"],
        cwd=tmp, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Meanwhile `hotjax train` in this process, whose compiled steps the evaluation below reuses.
    assert main(["train", *flags, "--model", str(tmp / "model.json"), "--strategies",
                 str(tmp / "table.toml"), "--ckpt-dir", str(tmp / "ck"), "--save-every", "2",
                 "--metrics-jsonl", str(tmp / "cli.jsonl")]) == 0
    cli_run = records(tmp / "cli.jsonl")
    out, err = script.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    assert script.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    example_run = records(out)
    restored = records(python(ROOT / "examples" / "restore_on_new_mesh.py", tmp / "ck" / "2",
                              "--devices", "4", "--strategy", "fsdp=2,tensor=2", cwd=tmp,
                              devices=4).stdout)
    evaluations = [r for r in example_run if "eval_loss" in r]
    example_run = [r for r in example_run if "loss" in r]
    return {"cli": cli_run, "example": example_run, "restored": restored,
            "evaluations": evaluations, "corpus": str(corpus), "tmp": tmp}


def test_the_training_script_equals_hotjax_train(runs):
    cli, example = runs["cli"], runs["example"]
    assert [r["step"] for r in example] == [r["step"] for r in cli] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in example], [r["loss"] for r in cli],
                               rtol=0, atol=1e-5)
    assert cli[-1]["loss"] < cli[0]["loss"]
    assert any(r["switched_mib"] > 0 for r in example)  # the two buckets hot-switched


def test_the_script_evaluates_between_steps(runs):
    evaluations = runs["evaluations"]
    assert [r["step"] for r in evaluations] == [2, 4]
    assert evaluations[1]["eval_loss"] < evaluations[0]["eval_loss"]


def test_evaluate_gives_the_loss_a_step_reports_and_updates_nothing(runs, tmp_path):
    """In this process: `Run.evaluate` on the next mini-batch equals the loss the training step
    on it reports (both of the weights before the update), and leaves the state as it was."""
    import jax

    import hotjax

    tmp = runs["tmp"]
    config = hotjax.RunConfig(model=str(tmp / "model.json"), tokenizer="bytes",
                              batch_tokens=2048, compute_dtype="float32", seed=5, steps=4,
                              strategies=str(tmp / "table.toml"), data=runs["corpus"])
    with hotjax.Run.from_config(config) as run:
        state = run.init()
        batch = run.next_batch()
        before = jax.tree.map(np.asarray, state.params)
        evaluated = run.evaluate(state, batch)
        after = jax.tree.map(np.asarray, state.params)
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                        jax.tree.leaves(after), strict=True))
        state, metrics = run.step(state, batch)
    np.testing.assert_allclose(evaluated["loss"], metrics["loss"], rtol=0, atol=1e-5)
    assert evaluated["targets"] == metrics["targets"]
    assert metrics["loss"] == pytest.approx(runs["cli"][0]["loss"], abs=1e-5)


def test_a_checkpoint_from_8_devices_resumes_on_4_under_another_strategy(runs):
    restored, uninterrupted = runs["restored"], runs["cli"]
    assert [r["step"] for r in restored] == [3, 4]
    np.testing.assert_allclose([r["loss"] for r in restored],
                               [r["loss"] for r in uninterrupted[2:]], rtol=0, atol=1e-5)


def test_an_example_with_no_step_left_to_train_says_why(runs):
    """Each example resumed at its last step trains nothing, and says so rather than exiting
    in silence."""
    tmp = runs["tmp"]
    script = [ROOT / "examples" / "train_llama.py", *FLAGS, "--data", runs["corpus"],
              "--devices", "8", "--ckpt-dir", "ck-script"]
    restore = [ROOT / "examples" / "restore_on_new_mesh.py", tmp / "ck" / "4", "--devices", "4",
               "--strategy", "fsdp=2,tensor=2"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda args: python(*args[0], cwd=tmp, devices=args[1]),
                             ((script, 8), (restore, 4))))
    for run in done:
        assert run.stdout == ""
        assert "step 4 reached: nothing to train (--steps 4)" in run.stderr, run.stderr[-2000:]
