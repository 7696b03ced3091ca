"""`hotjax train --config FILE.toml` or `FILE.yaml`: the file's options under the flags given,
every option's final value in each checkpoint, `ckpt inspect` printing them as a file `--config`
reads back; a resume onto another learning-rate schedule refused in one line unless
`--new-schedule`."""

import json

import pytest
from helpers import TINY_RUN, error, records

from hotjax.cli import main, run_config
from hotjax.commands import config_file

ONE_DEVICE = ("--devices", "1", "--strategy", "data=1")
# Sections of any name, dashes or underscores; --steps 2 on the command line overrides steps.
FILE = """\
steps = 6
weight-decay = 0.05

[optimizer]
lr = 3e-3
schedule = "linear"
warmup_steps = 1
min-lr-ratio = 0.5
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A two-step run of FILE with --steps 2, saved at step 2: its directory."""
    tmp = tmp_path_factory.mktemp("config")
    (tmp / "run.toml").write_text(FILE)
    assert main([*TINY_RUN, *ONE_DEVICE, "--config", str(tmp / "run.toml"), "--steps", "2",
                 "--ckpt-dir", str(tmp / "ckpt"), "--metrics-jsonl", str(tmp / "m.jsonl")]) == 0
    return tmp


def test_a_config_files_options_are_the_runs_under_the_flags_and_its_checkpoint_records_them(
        trained, capsys):
    # Linear from 3e-3 after one warmup step down to half of it at the horizon, --steps 2.
    assert [r["lr"] for r in records(trained / "m.jsonl")] == pytest.approx([3e-3, 1.5e-3])
    capsys.readouterr()
    assert main(["ckpt", "inspect", str(trained / "ckpt"), "--json"]) == 0
    run = json.loads(capsys.readouterr().out)["run"]
    assert {k: run[k] for k in ("steps", "lr", "schedule", "warmup_steps", "min_lr_ratio",
                                "weight_decay", "model", "beta2")} == {
        "steps": 2, "lr": 3e-3, "schedule": "linear", "warmup_steps": 1, "min_lr_ratio": 0.5,
        "weight_decay": 0.05, "model": "tiny", "beta2": 0.95}
    # Printed as a --config file, which reads back to the same run.
    assert main(["ckpt", "inspect", str(trained / "ckpt")]) == 0
    printed = capsys.readouterr().out
    text = printed[printed.index("run options"):].split("\n", 1)[1].split("arrays")[0]
    assert 'schedule = "linear"\n' in text and "weight-decay = 0.05\n" in text
    (trained / "printed.toml").write_text(text.rsplit("\n", 1)[0])
    assert vars(run_config(["train", "--config", str(trained / "printed.toml")])) == run


def test_a_resume_onto_another_schedule_is_refused_in_one_line_unless_new_schedule(
        trained, capsys):
    resume = [*TINY_RUN, *ONE_DEVICE, "--config", str(trained / "run.toml"),
              "--resume-from", str(trained / "ckpt")]
    line = error([*resume, "--steps", "3"], capsys)
    assert "this run's learning-rate schedule is not the checkpoint's: decay_steps 3 (the " \
           "checkpoint's 2): pass the checkpoint's values" in line, line
    assert "--new-schedule" in line
    metrics = trained / "resumed.jsonl"
    assert main([*resume, "--steps", "3", "--new-schedule", "--metrics-jsonl",
                 str(metrics)]) == 0
    # Step 3 on the new horizon: from 3e-3 at step 1 down to 1.5e-3 at step 3.
    assert [(r["step"], r["lr"]) for r in records(metrics)] == [(3, pytest.approx(1.5e-3))]


@pytest.mark.parametrize("text, expect", [
    ("weight_decy = 0.1", "unknown option 'weight_decy': did you mean weight-decay?"),
    ("[opt]\nbeta2 = 1.0", "--beta2 1.0: pass a number from 0 up to, not including, 1"),
    ("weight-decay = -0.1", "--weight-decay -0.1: pass a number 0 or more"),
    ("steps = 2.5", "steps = 2.5: give a whole number"),
    ("schedule = 'cosin'", "schedule = 'cosin': choose one of cosine, linear, constant, wsd"),
    ("batch-tokens = 64\nbatch-sequences = 2", "batch-tokens and batch-sequences both given"),
    ("lr = ", "not TOML"),
])
def test_a_bad_config_file_is_one_line(text, expect, tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    line = error(["train", "--config", str(path)], capsys)
    assert expect in line, line


def test_a_flag_drops_the_files_option_it_excludes(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("batch-tokens = 4096\nlr = 0.01\n")
    run = run_config(["train", "--config", str(path), "--batch-sequences", "4"])
    assert (run.batch_tokens, run.batch_sequences, run.lr) == (None, 4, 0.01)
    assert config_file.toml({"lr": 0.01, "data": None, "balance": True}) == \
        "lr = 0.01\nbalance = true\n"


# FILE in YAML: a section as a mapping, 3e-3 as YAML 1.1 reads it (a string the flag converts).
YAML_FILE = """\
steps: 6
weight-decay: 0.05
data: null  # left at its default
optimizer:
  lr: 3e-3
  schedule: linear
  warmup_steps: 1
  min-lr-ratio: 0.5
"""


def test_a_yaml_config_file_is_the_run_its_toml_twin_is_and_round_trips(tmp_path):
    (tmp_path / "run.toml").write_text(FILE)
    (tmp_path / "run.yaml").write_text(YAML_FILE)
    run = vars(run_config(["train", "--config", str(tmp_path / "run.toml"), "--steps", "2"]))
    assert vars(run_config(["train", "--config", str(tmp_path / "run.yaml"), "--steps",
                            "2"])) == run
    # Every option's value written as YAML (as a checkpoint records them) reads back the same.
    import yaml

    (tmp_path / "dumped.yml").write_text(yaml.safe_dump(run))
    assert vars(run_config(["train", "--config", str(tmp_path / "dumped.yml")])) == run


@pytest.mark.parametrize("text, expect", [
    ("weight_decy: 0.1", "unknown option 'weight_decy': did you mean weight-decay?"),
    ("opt:\n  beta2: 1.0", "--beta2 1.0: pass a number from 0 up to, not including, 1"),
    ("steps: 2.5", "steps = 2.5: give a whole number"),
    ("schedule: [cosine]", "schedule = ['cosine']: give a string"),
    ("lr: 1\nlr: 2", "not YAML: key 'lr' given twice (line 2): keep one"),
    ("lr: [", "not YAML: expected the node content, but found '<stream end>' (line 2, column 1)"),
    ("- lr", "holds a list, not a mapping of options"),
    ("a:\n  b:\n    lr: 1", "a.b: options sit at the top or in one level of sections"),
    ("lr: !!python/object/apply:os.system [echo]", "not YAML: could not determine a "
     "constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.system'"),
])
def test_a_bad_yaml_config_file_is_one_line(text, expect, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(text + "\n")
    line = error(["train", "--config", str(path)], capsys)
    assert expect in line, line


@pytest.mark.parametrize("flags, expect", [
    (["--decay-steps", "5", "--warmup-steps", "8"], "--decay-steps 5: the horizon counts the "
     "warmup: pass at least --warmup-steps (8)"),
    (["--beta1", "-0.1"], "--beta1 -0.1: pass a number from 0 up to"),
    (["--min-lr-ratio", "2"], "--min-lr-ratio 2.0: pass a number from 0 to 1"),
    (["--clip-norm", "0"], "--clip-norm 0.0: pass a gradient norm above 0"),
    (["--eps", "0"], "--eps 0.0: pass a finite number above 0"),
    (["--new-schedule"], "--new-schedule needs a checkpoint"),
])
def test_bad_optimizer_flags_are_one_line(flags, expect, capsys):
    line = error(["train", *flags], capsys)
    assert expect in line, line


def test_profile_steps_is_trace_steps_other_name():
    """`--profile-steps A:B`, as other trainers call it, is `--trace-steps A:B`."""
    assert run_config(["train", "--profile-steps", "3:4"]).trace_steps == "3:4"
    assert run_config(["train", "--trace-steps", "3:4"]).trace_steps == "3:4"
