"""A run whose numbers stop being numbers stops: the first step whose loss or gradient norm is
not finite ends it in one line naming the step (exit 2), and no state of it or after it is
saved over the finite checkpoints before it; fp16 loss scaling's skipped steps go on."""

import math

import pytest
from helpers import one_line, records
from test_preemption import RUN, corpus  # noqa: F401 - corpus: a fixture

from hotjax.checkpoint import dirs
from hotjax.cli import main
from hotjax.errors import UserError
from hotjax.train import check_finite

# A learning rate that makes step 1's update take the weights past fp32's range by step 2 or 3.
DIVERGING = ["--lr", "1e30", "--warmup-steps", "0", "--steps", "4"]


def test_a_diverging_run_stops_at_its_first_non_finite_step_and_saves_nothing_of_it(
        tmp_path, capsys):
    ck, metrics = tmp_path / "ck", tmp_path / "run.jsonl"
    assert main([*RUN, *DIVERGING, "--ckpt-dir", str(ck), "--save-every", "1",
                 "--metrics-jsonl", str(metrics)]) == 2
    line = one_line(capsys.readouterr().err)
    finite = [r["step"] for r in records(metrics)]
    bad = len(finite) + 1
    assert finite and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
                          for r in records(metrics))
    assert line.startswith(f"hotjax: error: step {bad}: the loss is "), line
    assert line.endswith("training diverged, and nothing of this step was saved: lower --lr "
                         "(or raise --warmup-steps) and resume from the last checkpoint"), line
    assert dirs.steps(ck) == finite  # the finite steps, and no later one


@pytest.mark.parametrize("loss, grad_norm, shown", [
    (math.nan, 1.0, "the loss is nan and the gradient norm 1"),
    (2.5, math.inf, "the loss is 2.5 and the gradient norm inf"),
])
def test_a_non_finite_loss_or_gradient_norm_is_one_line_naming_the_step(loss, grad_norm, shown):
    with pytest.raises(UserError, match=f"^step 7: {shown}: training diverged"):
        check_finite({"loss": loss, "grad_norm": grad_norm}, 7)


def test_a_step_that_loss_scaling_skipped_is_no_divergence():
    check_finite({"loss": 2.5, "grad_norm": math.inf, "skipped": True}, 7)
    check_finite({"loss": 2.5, "grad_norm": 0.5}, 7)
