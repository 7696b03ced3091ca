"""What `hotjax train` reports (`hotjax.tracking`, `hotjax.data.held_out`): held-out evaluations
in its records, the learning rate, tokens seen and step time in every record, TensorBoard event
files holding the records' numbers, Weights & Biases, the summary on stdout and the progress on
stderr, and a JAX profiler trace of the steps asked for."""

import contextlib
import io
import json
import math
import sys
import types

import numpy as np
import optax
import pytest
from helpers import TINY_RUN, error, records

from hotjax.cli import main, run_config

LR, WARMUP, STEPS, EVAL_TOKENS = 1e-3, 2, 3, 1024
RUN = [*TINY_RUN, "--devices", "1", "--strategy", "data=1", "--steps", str(STEPS),
       "--lr", str(LR), "--warmup-steps", str(WARMUP)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """200 documents of 300 bytes of Python."""
    from hotjax.data import open_corpus

    text = "".join(open_corpus(None).read(i) for i in range(20))
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text[i:i + 300]}) + "\n"
                            for i in range(0, 300 * 200, 300)))
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus) -> types.SimpleNamespace:
    """One run evaluating every 2 steps on a held-out split, into a metrics file and TensorBoard,
    tracing step 2, saving its last step: its argv, records, stdout and stderr."""
    tmp = tmp_path_factory.mktemp("run")
    argv = [*RUN, "--data", corpus, "--eval-every", "2", "--eval-tokens", str(EVAL_TOKENS),
            "--metrics-jsonl", str(tmp / "run.jsonl"), "--tensorboard", str(tmp / "tb"),
            "--trace-steps", "2:2", "--ckpt-dir", str(tmp / "ck")]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()[-3000:]
    return types.SimpleNamespace(argv=argv, records=records(tmp / "run.jsonl"),
                                 stdout=out.getvalue(), stderr=err.getvalue(), tb=tmp / "tb")


def test_the_held_out_split_is_fixed_bounded_and_left_out_of_training(corpus):
    from hotjax.data import ByteTokenizer, open_corpus
    from hotjax.data.held_out import split

    whole = open_corpus(corpus)
    training, held_out = split(whole, ByteTokenizer(), EVAL_TOKENS)
    again = split(whole, ByteTokenizer(), EVAL_TOKENS)[1]
    np.testing.assert_array_equal(held_out.spans_Dx3, again.spans_Dx3)
    # 300 bytes and BOS, EOS a document: the fewest holding 1024 tokens are 4.
    assert held_out.num_documents == 4 and training.num_documents == 196
    spans = {tuple(s) for s in whole.spans_Dx3}
    kept, held = ({tuple(s) for s in c.spans_Dx3} for c in (training, held_out))
    assert kept | held == spans and not kept & held
    assert training.fingerprint != whole.fingerprint
    # At most a tenth of the documents, however many tokens are asked for.
    assert split(whole, ByteTokenizer(), 10**9)[1].num_documents == 20


def test_evaluations_are_the_held_out_loss_of_the_weights_by_the_python_api(trained):
    """At --eval-every and the last step, eval_loss is the loss of the step's weights on the
    held-out rows, computed here from the saved weights by the model alone; perplexity is its
    exponential."""
    import jax

    from hotjax.data.held_out import take
    from hotjax.models.head_loss import token_loss
    from hotjax.models.llama import bind
    from hotjax.run import Run
    from hotjax.step import next_token_targets

    evaluated = [r for r in trained.records if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [2, 3]
    for r in evaluated:
        assert r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]), rel=1e-12)
    with Run.from_config(run_config(trained.argv)) as run:
        state, step = run.initial_state()  # the last step, saved
        batches = take(run.minibatches(run.held_out), EVAL_TOKENS)
        params = jax.tree.map(np.asarray, state.params)
        total = count = 0.0
        for batch in (b for minibatch in batches for b in minibatch.buckets):
            logits = bind(run.model, params)(batch.tokens, batch.segment_ids, batch.positions)
            loss, targets = token_loss(logits, next_token_targets(batch.tokens,
                                                                  batch.segment_ids))
            total, count = total + float(loss), count + float(targets)
    assert step == STEPS and run.batches.corpus.num_documents == 196  # trained without them
    assert evaluated[-1]["eval_tokens"] == sum(b.real_tokens for b in batches) >= EVAL_TOKENS
    assert evaluated[-1]["eval_loss"] == pytest.approx(total / count, abs=1e-5)


def test_every_record_has_the_learning_rate_tokens_seen_and_step_time(trained):
    schedule = optax.warmup_cosine_decay_schedule(0.0, LR, WARMUP, STEPS, LR * 0.1)
    assert [r["step"] for r in trained.records] == [1, 2, 3]
    for r in trained.records:
        assert r["lr"] == pytest.approx(float(schedule(r["step"])), rel=1e-6)
        assert r["seconds"] > 0
    assert [r["tokens_seen"] for r in trained.records] == list(
        np.cumsum([r["tokens"] for r in trained.records]))


def test_tensorboard_event_files_hold_the_records_numbers(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trained.tb))
    events.Reload()
    for tag in ("loss", "lr", "tokens_seen", "seconds", "eval_loss", "eval_perplexity"):
        written = [(e.step, e.value) for e in events.Scalars(tag)]
        expected = [(r["step"], r[tag]) for r in trained.records if tag in r]
        assert [s for s, _ in written] == [s for s, _ in expected], tag
        np.testing.assert_allclose([v for _, v in written], [v for _, v in expected],
                                   rtol=1e-6, err_msg=tag)


def test_the_summary_goes_to_stdout_and_the_progress_to_stderr(trained):
    assert "training summary" in trained.stdout and "eval loss" in trained.stdout
    assert f"{trained.records[-1]['eval_loss']:.4f}" in trained.stdout
    assert "step     1  loss" not in trained.stdout and "compiled" not in trained.stdout
    assert "step     1  loss" in trained.stderr and "step     2  eval loss" in trained.stderr
    assert "training summary" not in trained.stderr


def test_trace_steps_write_a_jax_profiler_trace(trained):
    (run,) = (trained.tb / "plugins" / "profile").iterdir()
    assert list(run.glob("*.xplane.pb")) and list(run.glob("*.trace.json.gz"))
    # The console wraps long lines at its width: compare words.
    assert f"JAX profiler trace of steps 2:2: {trained.tb}" in " ".join(trained.stderr.split())


@pytest.mark.parametrize("flags, line", [
    (["--wandb", "proj"], "--wandb proj: wandb is not installed: pip install hotjax[wandb]"),
    (["--trace-steps", "3:2"], "--trace-steps 3:2: give the first and last step traced as "
     "A:B, 1 <= A <= B <= --steps (3), e.g. 3:5"),
    (["--trace-steps", "2:9"], "--trace-steps 2:9: give the first and last step traced as "
     "A:B, 1 <= A <= B <= --steps (3), e.g. 3:5"),
])
def test_a_missing_wandb_or_steps_not_traceable_are_one_line(flags, line, corpus, monkeypatch,
                                                             capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    assert error([*RUN, "--data", corpus, *flags], capsys) == f"hotjax: error: {line}"


def test_wandb_offline_logs_each_record_at_its_step(tmp_path, monkeypatch):
    """Only where wandb is installed (not in hotjax[test]: a large package)."""
    pytest.importorskip("wandb")
    from hotjax.tracking import WeightsAndBiases

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WeightsAndBiases("hotjax-test", {"lr": LR})
    for step, loss in ((1, 5.5), (2, 4.25)):
        sink.write({"step": step, "loss": loss, "buckets": [], "lr": LR})
    logged = dict(sink.run.summary)
    sink.close()
    assert (logged["loss"], logged["lr"], logged["_step"]) == (4.25, LR, 2)
    (written,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")  # kept here, to sync later
    assert written.stat().st_size > 0
