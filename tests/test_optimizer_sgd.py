"""SGD with momentum, added as one entry of `hotjax.models.optimizers.OPTIMIZERS`: its updates equal
torch.optim.SGD's (momentum, weight decay on matrices only), and its torch form goes out and
comes back through DCP, read by torch's own SGD on the way (the generic optimizer tests of
tests/test_optimizers.py cover its state, memory and resume)."""

import jax
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import TINY

from hotjax.checkpoint import meta as meta_lib
from hotjax.checkpoint import store
from hotjax.checkpoint.formats.dcp import export_dcp, import_dcp
from hotjax.checkpoint.formats.pivot import ExportSource
from hotjax.data import Batch, MiniBatch
from hotjax.models.optimizers import SGD
from hotjax.optim import OptimConfig, make_optimizer
from hotjax.sharding.strategy import Strategy
from hotjax.sharding.table import StrategyTable
from hotjax.train import Trainer

SETTINGS = dict(name="sgd", lr=0.1, b1=0.9, weight_decay=0.05, clip_norm=float("inf"),
                warmup_steps=1, total_steps=8, schedule="constant")


def test_three_updates_equal_torchs_sgd():
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(4, 3)).astype(np.float32),
              "norm": rng.normal(size=(3,)).astype(np.float32)}
    grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}
             for _ in range(3)]
    optim = OptimConfig(**SETTINGS)
    tx = make_optimizer(optim, {"w": ("embed", "mlp"), "norm": ("norm",)})
    state, ours = tx.init(params), dict(params)
    for g in grads:
        updates, state = tx.update(g, state, ours)
        ours = jax.tree.map(lambda p, u: p + u, ours, updates)

    theirs = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    lr = [float(optim.lr_schedule()(step)) for step in range(3)]
    sgd = torch.optim.SGD([{"params": [theirs["w"]], "weight_decay": SETTINGS["weight_decay"]},
                           {"params": [theirs["norm"]], "weight_decay": 0.0}],
                          lr=lr[0], momentum=SETTINGS["b1"])
    for step, g in enumerate(grads):
        for group in sgd.param_groups:
            group["lr"] = lr[step]
        for k, p in theirs.items():
            p.grad = torch.tensor(g[k])
        sgd.step()
    for k in params:
        np.testing.assert_allclose(ours[k], theirs[k].detach().numpy(), rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def trained(devices, tmp_path_factory):
    """Two steps of SGD on the tiny model, saved as a hotjax checkpoint."""
    table = StrategyTable.single(Strategy.parse("data=1"), 64, "data=1")
    trainer = Trainer(TINY, OptimConfig(**SETTINGS), table, devices[:1])
    rng = np.random.default_rng(1)
    state = trainer.init(seed=0)
    for _ in range(2):
        tokens = rng.integers(0, TINY.vocab_size, (2, 64)).astype(np.int32)
        positions = np.tile(np.arange(64, dtype=np.int32), (2, 1))
        state, _, _ = trainer.step(state, MiniBatch((Batch(tokens, np.ones_like(tokens),
                                                           positions),)))
    directory = tmp_path_factory.mktemp("sgd")
    checkpoints = store.Checkpoints(directory)
    record = meta_lib.record(step=2, source="test", items=[], model=TINY.to_dict(),
                             tokenizer={"identity": "bytes"},
                             optimizer={**SETTINGS, "clip_norm": None})
    checkpoints.save(2, state.params, state.opt_state, record, None)
    checkpoints.close()
    return directory / "2", jax.tree.map(np.array, state)


def test_its_torch_form_goes_out_through_dcp_and_comes_back(trained, tmp_path):
    path, state = trained
    source = ExportSource.of(path)
    assert source.step == 2 and source.state_fields == ("momentum_buffer",)
    out = export_dcp(path, tmp_path / "dcp")

    # torch reads it: the momentum buffers and the param group as torch.optim.SGD writes them.
    metadata = dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata
    buffers = [k for k in metadata if k.endswith(".momentum_buffer")]
    assert len(buffers) == len([k for k in metadata if k.startswith("model.")])
    groups = {k.rsplit(".", 1)[1] for k in metadata if k.startswith("optim.param_groups.")}
    assert {"momentum", "dampening", "nesterov", "weight_decay", "lr"} <= groups
    assert "betas" not in groups

    back = import_dcp(out, tmp_path / "back", TINY)
    restored = ExportSource.of(back)
    assert restored.step == 2 and restored.optim.optimizer is SGD
    assert restored.optim.b1 == pytest.approx(SETTINGS["b1"])
    ours = dict(ExportSource.of(path).arrays("momentum_buffer"))
    for key, x in restored.arrays("momentum_buffer"):
        np.testing.assert_allclose(x, ours[key], rtol=0, atol=0)
    assert np.abs(ours["embed"]).max() > 0  # the momentum is there to compare
