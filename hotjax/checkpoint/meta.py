"""A checkpoint's JSON metadata: what wrote it and for which model, data and tokenizer.

Free of JAX and Orbax, so `inspect` and the shard importer's workers stay light. The record:

    format          "hotjax-checkpoint/1"
    hotjax_version  the writer's version
    step            the optimizer steps taken
    source          "train", "import-hf <dir>" or "import-shards <manifest>"
    items           the array items present: ["params", "opt_state"] or ["params"] (weights only)
    model           `LlamaConfig.to_dict()`
    tokenizer       {identity, vocab_size, bos_id, eos_id, pad_id}, or null when unknown
    seed            the run's seed: it initialised the parameters and orders the data
    data            what the data position refers to: {source, seq_len, batch_tokens, seed}
    optimizer       the `OptimConfig` fields (its `name`: an entry of `hotjax.models.optimizers`;
                    absent: AdamW), or an import's {name, source, loss_scaling, torch
                    hyperparameters}; null for weights only
    strategy_table  the run's strategy table, home included, as `StrategyTable.to_dict()` writes it
                    (`hotjax.sharding.table.parse_table` loads it back), or null
    written_from    the layout that wrote it (for `inspect` only; restore never reads it)
    run             the options of the `hotjax train` that wrote it, every one's final value
                    (`RunConfig`'s fields; `inspect` prints them as a --config file), or null
    fingerprints    {item: {array path: uint32}}: see `checkpoint.fingerprint`; one for every array
    fingerprint_version  how they were summed (`FINGERPRINT_VERSION`); absent: 1
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hotjax import bounds
from hotjax.errors import UserError
from hotjax.models import fields
from hotjax.models.optimizers import DEFAULT, OPTIMIZERS, SCHEDULE, SCHEDULES
from hotjax.version import __version__

FORMAT = "hotjax-checkpoint/1"
META_FILE = Path("meta") / "metadata"  # where Orbax's JSON handler puts the `meta` item
DATA_FILE = Path("data") / "metadata"
# `fingerprint`'s sums: 1, the bits alone (absent from the metadata); 2, the dtype too.
FINGERPRINT_VERSION = 2
REQUIRED = ("format", "step", "items", "model", "fingerprints")
PARAMS = "params"
# The array items a checkpoint may hold (`store.PARAMS`, `store.OPT_STATE`): each names a
# directory of the step, so no other name is ever read.
ITEMS = (PARAMS, "opt_state")
_TEXT_LIMIT = 8192  # a source names a path (4096 bytes at most on Linux) and a command
DAMAGED = "the checkpoint is damaged: resume from another checkpoint"
# Fields that change neither the parameters' shapes nor their meaning.
_NOT_ARCHITECTURE = ("vocab_size", "compute_dtype", "remat", "attention", "attention_block",
                     "max_seq_len", "scan_unroll")


def record(*, step: int, source: str, items: list[str], model: dict[str, Any],
           seed: int | None = None, tokenizer: dict[str, Any] | None = None,
           data: dict[str, Any] | None = None,
           optimizer: dict[str, Any] | None = None, strategy_table: dict[str, Any] | None = None,
           written_from: dict[str, Any] | None = None,
           fingerprints: dict[str, dict[str, int]] | None = None,
           run: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"format": FORMAT, "hotjax_version": __version__, "step": step, "source": source,
            "items": items, "model": model, "seed": seed, "tokenizer": tokenizer, "data": data,
            "optimizer": optimizer, "strategy_table": strategy_table,
            "written_from": written_from, "run": run, "fingerprints": fingerprints or {}}


def tokenizer_record(tokenizer: Any) -> dict[str, Any]:
    return {k: getattr(tokenizer, k)
            for k in ("identity", "vocab_size", "bos_id", "eos_id", "pad_id")}


def layout_record(layout: Any) -> dict[str, Any]:
    """The writer's layout, for `inspect`: strategy, mesh and devices."""
    from hotjax.sharding.table import strategy_dict

    devices = layout.mesh.devices.flat
    first = next(iter(devices))
    return {"strategy": str(layout.strategy),
            **strategy_dict(layout.strategy),
            "devices": int(layout.mesh.devices.size), "platform": first.platform,
            "processes": len({d.process_index for d in layout.mesh.devices.flat})}


def read_json(file: Path, what: str) -> dict[str, Any]:
    """A JSON object of the checkpoint, within `bounds.MAX_JSON_BYTES` and depth."""
    if not file.is_file():
        raise UserError(f"{file}: not found: the checkpoint lacks its {what}; it was not "
                        f"written by hotjax, or was damaged: resume from another checkpoint")
    value = bounds.read_json(file, what, DAMAGED)
    if not isinstance(value, dict):
        raise UserError(f"{file}: {what} is not a JSON object: the checkpoint is damaged")
    return value


def read(step_dir: Path) -> dict[str, Any]:
    """The metadata of a step directory, every field that restore, resume, export and inspect
    read checked for type and range."""
    file = step_dir / META_FILE
    meta = read_json(file, "metadata")
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        raise UserError(f"{file}: lacks {', '.join(missing)}: not a hotjax checkpoint, or "
                        f"damaged: resume from another checkpoint")
    if meta["format"] != FORMAT:
        raise UserError(f"{file}: format {bounds.show(meta['format'])} is not {FORMAT!r}: "
                        f"written by another version of hotjax "
                        f"({bounds.show(meta.get('hotjax_version', '?'))})")
    _check(meta, str(file))
    return meta


def _check(meta: dict[str, Any], where: str) -> None:
    bounds.whole(meta["step"], "step", 0, bounds.MAX_STEP, where, DAMAGED)
    items = meta["items"]
    if not (isinstance(items, list) and all(isinstance(i, str) and i in ITEMS for i in items)
            and PARAMS in items and len(set(items)) == len(items)):
        raise UserError(f"{where}: items is {bounds.show(items)}, not a list of distinct "
                        f"{' and '.join(ITEMS)} with {PARAMS}: {DAMAGED}")
    # Sized against this host where a parameter is built (`LlamaConfig.checked`), not here:
    # `inspect` reads the metadata of checkpoints too large for the machine it runs on.
    fields.check_model(meta["model"], f"{where}: model", DAMAGED, fits_host=False)
    bounds.whole(meta.get("fingerprint_version", 1), "fingerprint_version", 1,
                 FINGERPRINT_VERSION, where, DAMAGED)
    fingerprints = bounds.mapping(meta["fingerprints"], "fingerprints", where, DAMAGED)
    for item, arrays in fingerprints.items():
        if item not in items:
            raise UserError(f"{where}: fingerprints name item {bounds.show(item)}, which items "
                            f"lack: {DAMAGED}")
        for path, value in bounds.mapping(arrays, f"fingerprints.{item}", where,
                                          DAMAGED).items():
            bounds.whole(value, f"the fingerprint of {bounds.show(path)}", 0, 2**32 - 1, where,
                         DAMAGED)
    for field in ("source", "hotjax_version"):
        if meta.get(field) is not None:
            bounds.text(meta[field], field, where, DAMAGED, limit=_TEXT_LIMIT)
    if meta.get("seed") is not None:
        bounds.whole(meta["seed"], "seed", 0, 2**32 - 1, where, DAMAGED)
    for field in ("strategy_table", "written_from", "run"):
        if meta.get(field) is not None:
            bounds.mapping(meta[field], field, where, DAMAGED)
    _check_fields(meta.get("tokenizer"), "tokenizer", _TOKENIZER, where)
    if meta.get("tokenizer") is not None and "identity" not in meta["tokenizer"]:
        raise UserError(f"{where}: tokenizer lacks its identity: {DAMAGED}")
    _check_fields(meta.get("data"), "data", _DATA, where)
    _check_fields(meta.get("optimizer"), "optimizer", _OPTIMIZER, where)
    optimizer = meta.get("optimizer") or {}
    if optimizer.get("loss_scaling") == "static" and "loss_scale" not in optimizer:
        raise UserError(f"{where}: optimizer has static loss scaling but no loss_scale: "
                        f"{DAMAGED}")
    for field, choices, default in (("name", OPTIMIZERS, DEFAULT),
                                    ("schedule", SCHEDULES, SCHEDULE)):
        chosen = optimizer.get(field, default)
        if chosen not in choices:
            raise UserError(f"{where}: optimizer.{field} is {bounds.show(chosen)}, not one of "
                            f"{', '.join(choices)}: written by a newer hotjax, or {DAMAGED}")
    betas = optimizer.get("betas")
    if betas is not None and not (isinstance(betas, list) and len(betas) == 2):
        raise UserError(f"{where}: optimizer.betas is {bounds.show(betas)}, not a pair of "
                        f"numbers: {DAMAGED}")
    for beta in betas or ():
        bounds.real(beta, "optimizer.betas", where, DAMAGED, low=-math.inf)


# What the known fields of a record hold: ("whole", low, high), ("real", exclusive low[, and
# +inf]) or ("text",); others are not read, and null is absent.
_Spec = dict[str, tuple]
_TOKENIZER: _Spec = {"identity": ("text",), "vocab_size": ("whole", 1, bounds.MAX_VOCAB),
                     **dict.fromkeys(("bos_id", "eos_id", "pad_id"),
                                     ("whole", 0, bounds.MAX_VOCAB))}
_DATA: _Spec = {"source": ("text",), "text_field": ("text",), "data_split": ("text",),
                "tokenizer": ("text",),
                "long_documents": ("text",),
                "seq_len": ("whole", 1, bounds.MAX_SEQ_LEN),
                "batch_tokens": ("whole", 1, bounds.MAX_COUNT),
                "batch_sequences": ("whole", 1, bounds.MAX_COUNT),
                "vocab_size": ("whole", 1, bounds.MAX_VOCAB), "seed": ("whole", 0, 2**32 - 1)}
_OPTIMIZER: _Spec = {"name": ("text",), "source": ("text",), "loss_scaling": ("text",),
                     "schedule": ("text",), "warmup_steps": ("whole", 0, bounds.MAX_STEP),
                     "total_steps": ("whole", 1, bounds.MAX_STEP),
                     "decay_steps": ("whole", 1, bounds.MAX_STEP),
                     "loss_scale_period": ("whole", 1, bounds.MAX_STEP),
                     "loss_scale": ("real", 0.0),
                     "clip_norm": ("real", 0.0, math.inf),  # inf: no clipping
                     **dict.fromkeys(("lr", "min_lr_ratio", "decay_fraction", "weight_decay",
                                      "b1", "b2", "eps", "momentum",
                                      "weight_decay_matrix", "weight_decay_norm"),
                                     ("real", -math.inf))}


def _check_fields(record: Any, name: str, spec: _Spec, where: str) -> None:
    if record is None:
        return
    for field, value in bounds.mapping(record, name, where, DAMAGED).items():
        kind, *limits = spec.get(field, ("any",))
        what = f"{name}.{field}"
        if value is None or kind == "any":
            continue
        if kind == "whole":
            bounds.whole(value, what, *limits, where, DAMAGED)
        elif kind == "real":
            if value not in limits[1:]:
                bounds.real(value, what, where, DAMAGED, low=limits[0])
        else:
            bounds.text(value, what, where, DAMAGED, limit=_TEXT_LIMIT)


def read_data(step_dir: Path) -> dict[str, Any] | None:
    """The data iterator's position a checkpoint holds (a JSON object of bounded size and
    depth; `MiniBatches.set_state` checks its fields)."""
    file = step_dir / DATA_FILE
    return read_json(file, "data position") if file.parent.exists() else None


def check_model(meta: dict[str, Any], model: dict[str, Any], where: Path) -> None:
    """Raises unless `model` (a `LlamaConfig.to_dict()`) has the checkpoint's architecture.

    Vocabulary sizes may differ by padding only: rows past the tokenizer's vocabulary are
    never targets, and restore pads or trims them.
    """
    saved = meta["model"]
    differ = [k for k in model if k not in _NOT_ARCHITECTURE and saved.get(k) != model[k]]
    if differ:
        ours = ", ".join(f"{k}={saved.get(k)}" for k in differ[:4])
        theirs = ", ".join(f"{k}={model[k]}" for k in differ[:4])
        raise UserError(f"{where}: the checkpoint's model has {ours} but this run's has "
                        f"{theirs}: pass the --model it was written with")
    real = real_vocab(meta)
    if model["vocab_size"] != saved["vocab_size"] and model["vocab_size"] < real:
        raise UserError(f"{where}: the checkpoint's vocabulary has {real} tokens but this run's "
                        f"model has {model['vocab_size']} rows: use the checkpoint's tokenizer")


def real_vocab(meta: dict[str, Any]) -> int:
    """Rows that hold real tokens; the rest of `model.vocab_size` is padding."""
    tokenizer = meta.get("tokenizer") or {}
    return int(tokenizer.get("vocab_size") or meta["model"]["vocab_size"])


def check_run(meta: dict[str, Any], *, tokenizer: dict[str, Any],
              data: dict[str, Any] | None, where: Path) -> None:
    """Raises unless the checkpoint's tokenizer is this run's and the data position in it means
    the same in this run (`data` None: the data starts afresh)."""
    saved = meta.get("tokenizer")
    if saved and saved["identity"] != tokenizer["identity"]:
        raise UserError(f"{where}: written with tokenizer {saved['identity']} but this run "
                        f"uses {tokenizer['identity']}: pass the checkpoint's --tokenizer")
    saved_data = meta.get("data")
    if saved_data and data is not None:
        for key, flag in (("source", "--data"), ("seq_len", "--context"),
                          ("batch_tokens", "--batch-tokens"),
                          ("batch_sequences", "--batch-sequences"),
                          ("long_documents", "--long-documents"), ("seed", "--seed")):
            if saved_data.get(key) != data.get(key):
                raise UserError(f"{where}: its data position is for {key}={saved_data.get(key)!r}"
                                f" but this run has {data.get(key)!r}: pass {flag} as the "
                                f"checkpoint's run did")


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
