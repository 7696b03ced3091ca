"""Checkpoints of a training run: restoring a step onto the run's own layout, and what each
save records about the run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from hotjax.checkpoint import dirs, store
from hotjax.checkpoint import meta as meta_lib
from hotjax.errors import UserError
from hotjax.models.optimizers import DEFAULT
from hotjax.optim import OptimConfig
from hotjax.step import Home, TrainState


class Resumed(NamedTuple):
    path: Path  # the step directory
    state: TrainState
    step: int
    data: dict[str, Any] | None  # the data iterator's position; None: start the data afresh


def run_record(home: Home, *, tokenizer: Any, data: dict[str, Any], seed: int,
               table: Any, run: dict[str, Any] | None = None) -> dict[str, Any]:
    """What every checkpoint of this run records beside its arrays (`meta.record`); `run`:
    the options it was built from (`RunConfig`'s fields)."""
    return meta_lib.record(
        step=0, source="train", items=[store.PARAMS, store.OPT_STATE],
        model=home.config.to_dict(), seed=seed, tokenizer=meta_lib.tokenizer_record(tokenizer),
        data={**data, "seed": seed}, optimizer=dataclasses.asdict(home.optim),
        strategy_table=table.to_dict(),
        written_from=meta_lib.layout_record(home.layout), run=run)


def restore_state(path: str | Path, home: Home, record: dict[str, Any], *,
                  weights_only: bool = False, new_schedule: bool = False) -> Resumed:
    """The state saved at `path`, laid out in `home`, after checking that it fits the run
    described by `record` (from `run_record`). A weights-only checkpoint (an import), or any
    checkpoint restored `weights_only`, starts at step 0 with a fresh optimizer state and the
    data from its beginning. Another optimizer's state is refused, and so is a learning-rate
    schedule other than the checkpoint's unless `new_schedule`."""
    step_dir = dirs.find(path)
    meta = meta_lib.read(step_dir)
    where = step_dir / meta_lib.META_FILE
    meta_lib.check_model(meta, record["model"], where)
    targets = home.abstract_state()
    saved_vocab, vocab = meta["model"]["vocab_size"], home.config.vocab_size
    resize = (saved_vocab, vocab) if saved_vocab != vocab else None
    weights_only = weights_only or store.OPT_STATE not in meta["items"]
    # Weights alone start the data afresh: only the tokenizer must be the checkpoint's.
    meta_lib.check_run(meta, tokenizer=record["tokenizer"],
                       data=None if weights_only else record["data"], where=where)
    saved = (meta.get("optimizer") or {}).get("name", DEFAULT)  # unnamed: before Lion, AdamW
    if not weights_only and saved != home.optim.name:
        raise UserError(f"{where}: its optimizer state is {saved}'s but this run trains with "
                        f"{home.optim.name}: pass --optimizer {saved}, or restore its weights "
                        f"alone (--weights-only) to start {home.optim.name} afresh")
    saved_scaling = (meta.get("optimizer") or {}).get("loss_scaling", "off")
    if not weights_only and (saved_scaling == "off") != (home.optim.loss_scaling == "off"):
        raise UserError(f"{where}: its optimizer state was saved with loss scaling "
                        f"{saved_scaling} but this run's is {home.optim.loss_scaling}: resume "
                        f"with the checkpoint's --compute-dtype or --loss-scale")
    if not (weights_only or new_schedule):
        check_schedule(meta.get("optimizer") or {}, home.optim, where)
    items = {store.PARAMS: targets.params}
    if not weights_only:
        items[store.OPT_STATE] = targets.opt_state
    restored = store.restore(step_dir, items, vocab=resize)
    params = restored.arrays[store.PARAMS]
    if weights_only:
        opt_state = jax.jit(home.tx.init, out_shardings=home.state_shardings.opt_state)(params)
        step, data = 0, None
    else:
        opt_state, step, data = restored.arrays[store.OPT_STATE], int(meta["step"]), restored.data
    step_array = jax.device_put(jnp.asarray(step, jnp.int32), home.state_shardings.step)
    return Resumed(step_dir, TrainState(step_array, params, opt_state), step, data)


def check_schedule(saved: dict[str, Any], optim: OptimConfig, where: Path) -> None:
    """Raises, naming the fields, unless `optim`'s learning-rate schedule is the one the
    checkpoint's optimizer record `saved` trained on (fields it lacks: their defaults then)."""
    if "source" in saved:  # an import's, or an optax optimizer's: no hotjax schedule to keep
        return
    known = {f.name for f in dataclasses.fields(OptimConfig)}
    theirs = OptimConfig(name=optim.name, **{k: v for k, v in saved.items()
                                             if k in known and k != "name"}).shape
    ours = optim.shape
    differ = [f"{k} {ours.get(k, '-')} (the checkpoint's {theirs.get(k, '-')})"
              for k in {**theirs, **ours} if ours.get(k) != theirs.get(k)]
    if differ:
        raise UserError(f"{where}: this run's learning-rate schedule is not the checkpoint's: "
                        f"{', '.join(differ)}: pass the checkpoint's values (--steps, --lr, "
                        f"--schedule, ...), or --new-schedule to continue on this run's")
