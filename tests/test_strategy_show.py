"""`hotjax strategy show`: each parameter's placement and per-device state bytes, before a run."""

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import write_table

from hotjax.cli import main
from hotjax.models.llama import PRESETS, padded_vocab

FP32 = 4
# As `strategy show` (and `hotjax train`) builds them: vocabularies padded to 128s.
TINY, SMALL = (dataclasses.replace(PRESETS[n], vocab_size=padded_vocab(PRESETS[n].vocab_size))
               for n in ("tiny", "small"))  # both: 8 query heads, 4 K/V heads


def _show(capsys, *args: str) -> list[dict]:
    assert main(["strategy", "show", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _specs(report: dict) -> dict[str, str]:
    return {p["name"]: p["spec"] for p in report["params"]}


def _sizes(config) -> tuple[int, int]:
    """(matrix elements, norm-scale elements), counted from the model's shapes."""
    V, D, L, N, K, H, F = (config.vocab_size, config.dim, config.n_layers, config.n_heads,
                           config.n_kv_heads, config.head_dim, config.ffn_dim)
    embed_and_head = 2 * V * D
    attention = D * N * H + 2 * D * K * H + N * H * D  # wq, wk, wv, wo
    mlp = 3 * D * F  # w_gate, w_up, w_down
    return embed_and_head + L * (attention + mlp), (2 * L + 1) * D


def test_megatron_splits_heads_mlp_and_vocab_over_tensor(capsys):
    [report] = _show(capsys, "data=2,tensor=4,rules=megatron", "--model", "small")
    assert report["strategy"] == "data2·tensor4 [megatron]"
    assert report["mesh"] == {"data": 2, "tensor": 4} and report["notes"] == []
    specs = _specs(report)
    assert specs["layers/wq"] == "(None, None, tensor)"  # (layers, embed, heads, head_dim)
    assert specs["layers/wk"] == "(None, None, tensor)"  # 4 K/V heads, one per tensor rank
    assert specs["layers/wo"] == "(None, tensor)"  # (layers, heads, head_dim, embed)
    assert specs["layers/w_gate"] == specs["layers/w_up"] == "(None, None, tensor)"
    assert specs["layers/w_down"] == "(None, tensor)"  # (layers, mlp, embed)
    assert specs["embed"] == "(tensor)" and specs["lm_head"] == "(None, tensor)"
    assert specs["final_norm"] == specs["layers/attn_norm"] == "replicated"
    assert all(p["zero"] == {} for p in report["params"])
    # Every matrix is split 4 ways, norm scales nowhere; the data axis copies everything.
    matrices, norms = _sizes(SMALL)
    params = FP32 * (matrices // 4 + norms)
    assert report["bytes_per_device"] == {"params": params, "grads": params,
                                          "optimizer": 2 * params}
    assert report["activations"]["residual stream"] == "(data)"
    assert report["activations"]["logits"] == "(data, None, tensor)"


def test_zero1_replicates_params_and_grads_and_splits_adam_moments(capsys):
    [report] = _show(capsys, "fsdp=8,rules=zero1", "--model", "tiny")
    assert report["strategy"] == "fsdp8 [zero1]"
    specs = _specs(report)
    assert set(specs.values()) == {"replicated"}
    zero = {p["name"]: p["zero"] for p in report["params"]}
    assert zero["layers/wq"] == {"optimizer": "(None, fsdp)"}  # split on `embed`
    assert zero["layers/w_down"] == {"optimizer": "(None, None, fsdp)"}
    assert zero["lm_head"] == {"optimizer": "(fsdp)"}
    assert zero["final_norm"] == {}  # no `embed` axis: stays whole
    matrices, norms = _sizes(TINY)
    assert report["bytes_per_device"] == {
        "params": FP32 * (matrices + norms), "grads": FP32 * (matrices + norms),
        "optimizer": 2 * FP32 * (matrices // 8 + norms)}


def test_a_table_gives_one_report_per_bucket_in_bucket_order(capsys, tmp_path):
    table = write_table(tmp_path / "table.toml",
                        {"max_len": 256, "mesh": "data = 8", "rules": "dp"},
                        {"max_len": 1024, "mesh": "fsdp = 8", "rules": "fsdp", "micro_rows": 16})
    short, long = _show(capsys, str(table), "--model", "tiny")
    assert (short["strategy"], long["strategy"]) == ("data8 [dp]", "fsdp8 [fsdp]")
    assert _specs(short)["layers/wq"] == "replicated"
    assert _specs(long)["layers/wq"] == "(None, fsdp)"
    matrices, norms = _sizes(TINY)
    assert short["bytes_per_device"]["params"] == FP32 * (matrices + norms)
    assert long["bytes_per_device"]["params"] == FP32 * (matrices // 8 + norms)
    # Both split rows 8 ways; the second bucket's micro-batches are the table's 16 rows.
    assert [(r["batch_shards"], r["micro_rows"]) for r in (short, long)] == [(8, None), (8, 16)]


def test_the_attention_kernel_and_its_ring_are_reported(capsys):
    [ring] = _show(capsys, "context=4,tensor=2,balanced=true", "--model", "tiny",
                   "--context", "1024")
    assert ring["attention"] == {"requested": "auto", "kernel": "blockwise", "note": None,
                                 "ring": 4, "balanced": True, "block": 256,
                                 "long_documents_kernel": "blockwise",
                                 "cudnn_packed_unused": None,
                                 "ring_blocks": [9, 9, 9, 9]}  # 36 causal blocks of 128
    [forced] = _show(capsys, "data=8", "--model", "tiny", "--attention", "cudnn")
    assert (forced["attention"]["kernel"], forced["attention"]["note"], forced["attention"][
        "ring"]) == ("blockwise", "cudnn needs a GPU", 1)


def test_memory_reports_activation_bytes_per_remat_policy(capsys):
    [report] = _show(capsys, "data=2,tensor=4,rules=megatron-sp", "--model", "tiny",
                     "--context", "512", "--memory")
    memory = report["activation_bytes"]
    assert (memory["rows"], memory["max_len"]) == (2, 512)  # one row per batch shard
    assert 0 < memory["full"] < memory["dots"] < memory["none"]


def test_kv_heads_fewer_than_tensor_are_replicated_with_a_note(capsys):
    # `small`, not `tiny`: tiny's 259-token vocabulary does not split over tensor (see below).
    [report] = _show(capsys, "tensor=8", "--model", "small")
    assert report["notes"] == ["4 K/V heads < tensor=8: each K/V head is replicated over 2 "
                               "tensor ranks"]
    specs = _specs(report)
    assert specs["layers/wk"] == specs["layers/wv"] == "replicated"
    assert specs["layers/wq"] == "(None, None, tensor)"
    assert report["activations"]["attention keys / values"] == "replicated"


def test_the_table_names_the_strategy_every_parameter_and_the_state_bytes(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # at rich's default 80, 'layers/attn_norm' is cut short
    assert main(["strategy", "show", "fsdp=8,rules=zero1", "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "fsdp8 [zero1] on tiny" in out  # the rule set in brackets, not read as rich markup
    for name in ("embed", "final_norm", "layers/attn_norm", "layers/wq", "layers/wk",
                 "layers/wv", "layers/wo", "layers/mlp_norm", "layers/w_gate", "layers/w_up",
                 "layers/w_down", "lm_head"):
        assert name in out
    matrices, norms = _sizes(TINY)
    assert f"AdamW state {2 * FP32 * (matrices // 8 + norms) / 2**20:,.1f} MiB" in out
    # ZeRO-1 keeps fp32 weights and their gradient sum whole, the moments split 8 ways.
    state = FP32 * (2 * (matrices + norms) + 2 * (matrices // 8 + norms))
    assert "home fsdp8 [zero1] (the most sharded): " in out
    assert f"{state / 2**20:,.1f} MiB per device" in out


def test_a_table_shows_the_home_it_names(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    table = write_table(tmp_path / "table.toml",
                        {"max_len": 256, "mesh": "data = 8", "rules": "dp"},
                        home={"mesh": "fsdp = 8", "rules": "fsdp"})
    assert main(["strategy", "show", str(table), "--model", "tiny"]) == 0
    matrices, norms = _sizes(TINY)
    state = FP32 * 4 * (matrices // 8 + norms)  # weights, gradient sum, two moments
    assert (f"home fsdp8 [fsdp] (the table names it): fp32 weights, gradient sum and AdamW's "
            f"state stay there, {state / 2**20:,.1f} MiB per device") in capsys.readouterr().out


@pytest.mark.parametrize("strategy, model, expected", [
    ("tensor=3", "small", "8 attention heads do not split over tensor=3"),
    ("data=2,rules=bogus", "small", "unknown rule set 'bogus'"),
], ids=["heads", "rules"])
def test_bad_input_is_one_error_line_and_exit_code_2(strategy, model, expected, capsys):
    assert main(["strategy", "show", strategy, "--model", model, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    errors = captured.err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("hotjax: error:"), captured.err
    assert expected in errors[0]


@pytest.mark.parametrize("jax_fixed, long_documents, unused", [
    (True, "cudnn", None), (False, "pallas", "places packed K/V wrongly under GQA")])
def test_a_gpu_report_names_the_kernel_of_long_documents(monkeypatch, jax_fixed,
                                                        long_documents, unused):
    import hotjax.models.cudnn_attention as cudnn_attention
    from hotjax.models.llama import as_trained
    from hotjax.sharding.report import describe
    from hotjax.sharding.strategy import Strategy

    monkeypatch.setattr(cudnn_attention, "gqa_offsets_fixed", lambda: jax_fixed)
    config = as_trained(TINY, compute_dtype="bfloat16")
    attention = describe(Strategy.parse("data=8"), config, "gpu")["attention"]
    assert (attention["kernel"], attention["long_documents_kernel"]) == ("pallas", long_documents)
    assert unused is None and attention["cudnn_packed_unused"] is None or \
        unused in attention["cudnn_packed_unused"]
    ring = describe(Strategy.parse("context=8"), config, "gpu")["attention"]
    assert (ring["kernel"], ring["long_documents_kernel"]) == ("pallas-ring", "pallas-ring")


def test_every_bucket_of_a_table_is_titled_with_the_model(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    table = Path(__file__).parents[1] / "sharding" / "tables" / "default.toml"
    assert main(["strategy", "show", str(table), "--model", "tiny"]) == 0
    titles = [line for line in capsys.readouterr().out.splitlines() if "bucket <=" in line]
    assert len(titles) == 3 and all(line.rstrip().endswith("on tiny") for line in titles)
