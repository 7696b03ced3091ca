"""Megatron-LM LLaMA checkpoints: the manifest (`checkpoint.manifest`) of a directory of
`mp_rank_*/model_optim_rng.pt` rank files, derived from the files themselves, and their import
through `formats.foreign` (`hotjax ckpt import-shards --format megatron`, `formats.shards`).

Megatron-Core's GPT model with LLaMA's options (`--position-embedding-type rope --normalization
RMSNorm --swiglu --group-query-attention --disable-bias-linear`), saved in the torch format:
each rank file's `model` entry is its state dict, a stage's layers numbered from 0. The fused
QKV holds, group by group, a query group's heads then its key head then its value head, tensor
parallelism splitting the groups; the fused fc1 holds a rank's gate rows then its up rows; the
vocabulary is padded so that it splits evenly, and the padding is stripped.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hotjax import bounds
from hotjax.checkpoint.formats import foreign
from hotjax.checkpoint.manifest import FORMAT, Manifest, parse
from hotjax.errors import UserError
from hotjax.paths import inside

if TYPE_CHECKING:
    from hotjax.models.llama import LlamaConfig

FILE = "model_optim_rng.pt"
TRACKER = "latest_checkpointed_iteration.txt"
TRACKER_BYTES = 64  # the tracker holds an iteration number or "release", and a newline
EMBED = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
HEAD = "output_layer.weight"
QKV = "self_attention.linear_qkv.weight"
PROJ = "self_attention.linear_proj.weight"
FC1 = "mlp.linear_fc1.weight"
FC2 = "mlp.linear_fc2.weight"
# A layer's two norms: fused into the next linear (Transformer Engine's spec) or apart ("local").
NORMS = (("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
         ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"))
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# Settings the weights' shapes do not reveal: (args field, accepts its value, what hotjax needs).
_NEEDS = (
    ("position_embedding_type", lambda v: v in (None, "rope"), "'rope'"),
    ("normalization", lambda v: v in (None, "RMSNorm"), "'RMSNorm'"),
    ("swiglu", lambda v: v in (None, True), "set (--swiglu)"),
    ("rotary_interleaved", lambda v: not v, "unset: hotjax rotates halves"),
    ("rotary_percent", lambda v: v in (None, 1.0), "1.0: hotjax rotates the whole head"),
    ("rotary_seq_len_interpolation_factor", lambda v: v in (None, 1), "unset"),
    ("apply_layernorm_1p", lambda v: not v, "unset: hotjax's norms scale by their weight"),
    ("num_experts", lambda v: not v, "unset: mixture-of-experts models are not supported"),
)


def derive_manifest(directory: str | Path, config: LlamaConfig | None = None, *,
                    vocab_size_padded: int | None = None) -> Manifest:
    """The manifest of the Megatron checkpoint at `directory` (its root, which names the latest
    iteration, or one iteration's directory) for the model `config` (default: the one the rank
    files' `args` record). The padded vocabulary is the files' unless `vocab_size_padded`."""
    iteration = iteration_directory(Path(directory).absolute())
    tp, pp, files = _rank_files(iteration)

    def file(t: int, s: int) -> Path:
        return iteration.parent / files.format(tp=t, pp=s)

    first = foreign.pt_file(file(0, 0))
    first = first if isinstance(first, dict) else {}
    args = first.get("args")
    if isinstance(args, argparse.Namespace):
        _check_args(args, file(0, 0), tp, pp)
    elif "model0" in first:
        raise UserError(f"{file(0, 0)}: holds model0, model1, ...: interleaved pipeline "
                        f"checkpoints are not supported")
    ranks = {(t, s): foreign.pt_tensors(file(t, s)) for t in range(tp) for s in range(pp)}
    if vocab_size_padded is None:
        if EMBED not in ranks[(0, 0)]:
            raise UserError(f"{file(0, 0)}: lacks tensor {EMBED}: the first stage holds the "
                            f"embedding")
        vocab_size_padded = ranks[(0, 0)][EMBED].shape[0] * tp
    # The files' own checks name a disagreement first; the args are compared after them.
    config = config or model_of(args, file(0, 0), vocab_size_padded, None, checked=True)
    if config.vocab_size > vocab_size_padded:
        raise UserError(f"{file(0, 0)}: tensor {EMBED}: the padded vocabulary of "
                        f"{vocab_size_padded} rows is smaller than the config's vocab_size "
                        f"{config.vocab_size}")
    if config.n_kv_heads % tp:
        raise UserError(f"{file(0, 0)}: tensor decoder.layers.0.{QKV}: the config's "
                        f"{config.n_kv_heads} query groups do not split over tp={tp}")
    per_stage = [_local_layers(file(0, s), ranks[(0, s)]) for s in range(pp)]
    if sum(per_stage) != config.n_layers:
        raise UserError(f"{iteration}: the rank files hold {sum(per_stage)} layers "
                        f"({' + '.join(map(str, per_stage))} over pp={pp}), but the config has "
                        f"n_layers={config.n_layers}")
    model_of(args, file(0, 0), vocab_size_padded, config, checked=True)
    stage = next((s for s in range(pp) if per_stage[s]), 0)
    norms = [_norm(file(0, stage), ranks[(0, stage)], fused, local) for fused, local in NORMS]
    # Tied, the last stage of a pipeline keeps a copy of the embedding as its output layer.
    known = {EMBED, FINAL_NORM, *((HEAD,) if not config.tie_embeddings or pp > 1 else ())}
    layer_known = {QKV, PROJ, FC1, FC2, *norms}
    for (t, s), tensors in ranks.items():
        for name in tensors:
            layer = _LAYER.fullmatch(name)
            if name.endswith("_extra_state") or (layer[2] in layer_known if layer else
                                                 name in known):
                continue
            if name == HEAD:
                raise UserError(f"{file(t, s)}: holds tensor {HEAD}, but the config ties the "
                                f"embeddings: untie them (tie_word_embeddings false)")
            raise UserError(f"{file(t, s)}: holds tensor {name}, which a Megatron LLaMA lacks "
                            f"(biases, LayerNorm, QK norms, MoE and learned positions are not "
                            f"supported)")
    step = first.get("iteration", 0)
    return parse({"format": FORMAT, "model": config.to_dict(), "files": files,
                  "step": step if isinstance(step, int) and step >= 0 else 0,
                  "parallel": {"tp": tp, "pp": pp, "layers_per_stage": per_stage},
                  "tensor": _tensors(config, vocab_size_padded, norms)}, iteration)


def import_megatron(directory: str | Path, out: str | Path, *, config: LlamaConfig | None = None,
                    workers: int | None = None) -> Path:
    """Converts the Megatron checkpoint at `directory` into a weights-only checkpoint at `out`
    (`derive_manifest` reads the layout; `config` defaults to the files' `args`)."""
    from hotjax.checkpoint import dirs

    dirs.check_new_directory(out)
    manifest = derive_manifest(directory, config)
    layout = {"format": "megatron", "directory": str(manifest.path), "files": manifest.files,
              "tp": manifest.sizes["tp"], "pp": manifest.sizes["pp"]}
    return foreign.import_manifest(
        manifest, out, workers, layout=layout,
        source=f"import-shards --format megatron {Path(directory).absolute()}")


def iteration_directory(directory: Path) -> Path:
    """`directory`, or the iteration its `latest_checkpointed_iteration.txt` names."""
    if not directory.is_dir():
        raise UserError(f"{directory}: no such directory")
    tracker = directory / TRACKER
    if not tracker.is_file():
        return directory
    try:
        with tracker.open("rb") as f:
            raw = f.read(TRACKER_BYTES + 1)
    except OSError as e:
        raise UserError(f"{tracker}: unreadable ({e.strerror})") from None
    text = raw.decode("ascii", errors="replace").strip()
    if len(raw) > TRACKER_BYTES or not (text == "release" or (text.isascii() and text.isdigit())):
        raise UserError(f"{tracker}: holds {bounds.show(text)}, neither an iteration number "
                        f"(0 to {bounds.MAX_STEP:,}) nor 'release': the checkpoint is damaged")
    if text != "release" and int(text) > bounds.MAX_STEP:
        raise UserError(f"{tracker}: names iteration {bounds.show(int(text))}, past "
                        f"{bounds.MAX_STEP:,} (MAX_STEP): the checkpoint is damaged")
    iteration = inside(directory, text if text == "release" else
                                 f"iter_{int(text):07d}", tracker)
    if not iteration.is_dir():
        raise UserError(f"{tracker}: names iteration {text}, but {iteration} is missing")
    return iteration


# Megatron's args for the fields of `LlamaConfig`, for messages.
_ARG_NAMES = {"vocab_size": "the embedding's rows", "dim": "args.hidden_size",
              "n_layers": "args.num_layers", "n_heads": "args.num_attention_heads",
              "n_kv_heads": "args.num_query_groups", "ffn_dim": "args.ffn_hidden_size",
              "head_dim": "args.kv_channels", "rope_theta": "args.rotary_base",
              "rope_scaling": "args' rope scaling", "norm_eps": "args.norm_epsilon",
              "max_seq_len": "args.max_position_embeddings"}


def config_from_args(args: argparse.Namespace, file: Path, vocab_size: int) -> LlamaConfig:
    """The model Megatron's `args` describe, with `vocab_size` rows of vocabulary, every value
    checked (`LlamaConfig.checked`)."""
    from hotjax.models.llama import LlamaConfig

    missing = [f for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
               if getattr(args, f, None) is None]
    if missing:
        raise UserError(f"{file}: args lack {', '.join(missing)}: pass --config (an HF "
                        f"config.json) or --model (a preset)")
    heads = args.num_attention_heads
    groups = getattr(args, "num_query_groups", None) if getattr(
        args, "group_query_attention", False) else None
    scaling = ({"factor": getattr(args, "rope_scaling_factor", 8.0)}
               if getattr(args, "use_rope_scaling", False) else None)
    fields = {"vocab_size": vocab_size, "dim": args.hidden_size, "n_layers": args.num_layers,
              "n_heads": heads, "n_kv_heads": heads if groups is None else groups,
              "ffn_dim": args.ffn_hidden_size, "head_dim": getattr(args, "kv_channels", None),
              "rope_theta": getattr(args, "rotary_base", 10000), "rope_scaling": scaling,
              "norm_eps": getattr(args, "norm_epsilon", 1e-5),
              "tie_embeddings": not getattr(args, "untie_embeddings_and_output_weights", False),
              "max_seq_len": getattr(args, "max_position_embeddings", None)
              or getattr(args, "seq_length", None) or 4096,
              "compute_dtype": "float32"}
    return LlamaConfig.checked(fields, str(file), "its args describe no LLaMA hotjax can build: "
                               "pass --config (an HF config.json) or --model (a preset)",
                               _ARG_NAMES)


def model_of(args: Any, file: Path, rows: int, config: LlamaConfig | None, *,
             checked: bool = False) -> LlamaConfig:
    """`config` (the caller's: `checkpoint.model.for_import`), checked against the run's `args`
    where recorded, or else the model those args describe, with `rows` rows of vocabulary (the
    padded embedding's); `checked`: the args were checked already."""
    recorded = isinstance(args, argparse.Namespace)
    if recorded and not checked:
        check_args(args, file)
    if config is not None:
        if recorded:
            check_config(config, args, file, rows)
        return config
    if not recorded:
        raise UserError(f"{file}: records no Megatron args to read the model from: pass "
                        f"--config (an HF config.json) or --model (a preset)")
    return config_from_args(args, file, rows)


def check_args(args: argparse.Namespace, file: Path) -> None:
    """The run's args describe a LLaMA as hotjax computes it (the settings shapes do not show)."""
    for field, accepts, need in _NEEDS:
        value = getattr(args, field, None)
        if not accepts(value):
            raise UserError(f"{file}: args.{field} is {value!r}: hotjax imports Megatron LLaMAs "
                            f"with it {need}")


def _check_args(args: argparse.Namespace, file: Path, tp: int, pp: int) -> None:
    check_args(args, file)
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if vpp not in (None, 1):
        raise UserError(f"{file}: args.virtual_pipeline_model_parallel_size is {vpp!r}: "
                        f"interleaved pipeline checkpoints are not supported")
    for field, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        value = getattr(args, field, size)
        if value != size:
            raise UserError(f"{file}: args.{field} is {value}, but the rank directories make "
                            f"it {size}: is a rank directory missing?")


def check_config(config: LlamaConfig, args: argparse.Namespace, file: Path,
                  vocab_size: int) -> None:
    """The caller's config has the shape the run's args record: equal tensor shapes can hide
    a different split of heads into groups."""
    try:
        recorded = config_from_args(args, file, vocab_size)
    except UserError:
        return  # args too sparse to compare: the tensors' shapes are still checked
    for field in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                  "tie_embeddings"):
        if getattr(recorded, field) != getattr(config, field):
            raise UserError(f"{file}: its args make {field}={getattr(recorded, field)}, but the "
                            f"config has {field}={getattr(config, field)}")


def _rank_files(iteration: Path) -> tuple[int, int, str]:
    """tp, pp and the rank files' pattern, relative to the iteration's parent; checks that every
    rank's file is there."""
    found = [m for child in iteration.iterdir()
             if child.is_dir() and (m := _RANK_DIR.fullmatch(child.name))]
    staged = {m[2] is not None for m in found}
    if not found or len(staged) > 1:
        what = "no" if not found else "both mp_rank_XX and mp_rank_XX_YYY"
        raise UserError(f"{iteration}: holds {what} rank directories: pass a Megatron "
                        f"checkpoint (its root or an iteration's directory, of mp_rank_XX/ or, "
                        f"with pipeline stages, mp_rank_XX_YYY/ directories)")
    tp = 1 + max(int(m[1]) for m in found)
    pp = 1 + max(int(m[2] or 0) for m in found)
    rank = "mp_rank_{tp:02d}_{pp:03d}" if staged == {True} else "mp_rank_{tp:02d}"
    for t in range(tp):
        for s in range(pp):
            directory = iteration / rank.format(tp=t, pp=s)
            if not directory.is_dir():
                raise UserError(f"{directory}: missing: the rank directories imply tp={tp} "
                                f"pp={pp}, and this rank's is absent")
            if not (directory / FILE).is_file():
                raise UserError(f"{directory / FILE}: not found")
            inside(iteration, f"{directory.name}/{FILE}", iteration)  # a link?
    escaped = iteration.name.replace("{", "{{").replace("}", "}}")
    return tp, pp, f"{escaped}/{rank}/{FILE}"


def _local_layers(file: Path, tensors: dict[str, Any]) -> int:
    """How many layers a stage holds, checked to be numbered 0, 1, ..."""
    layers = {int(m[1]) for name in tensors if (m := _LAYER.fullmatch(name))}
    if layers != set(range(len(layers))):
        raise UserError(f"{file}: holds layers {sorted(layers)}, but Megatron numbers a stage's "
                        f"layers from 0 without gaps")
    return len(layers)


def _norm(file: Path, tensors: dict[str, Any], fused: str, local: str) -> str:
    for name in (fused, local):
        if f"decoder.layers.0.{name}" in tensors:
            return name
    raise UserError(f"{file}: lacks tensor decoder.layers.0.{fused} (or, with the local spec, "
                    f"decoder.layers.0.{local})")


def _tensors(config: LlamaConfig, vocab_size_padded: int,
             norms: list[str]) -> list[dict[str, Any]]:
    """The manifest's [[tensor]] entries of a Megatron-Core LLaMA."""
    V, D, F, H = config.vocab_size, config.dim, config.ffn_dim, config.head_dim
    N, K = config.n_heads, config.n_kv_heads
    layer, hf = "decoder.layers.{l}.", "model.layers.{L}."
    qkv = [f"{hf}self_attn.{x}_proj.weight" for x in "qkv"]
    vocab = {"shape": [V, D], "padded": [vocab_size_padded, D], "tp": "shard_v"}
    tensors = [
        {"name": EMBED, **vocab, "stage": 0, "to": "model.embed_tokens.weight"},
        {"name": layer + norms[0], "shape": [D], "to": hf + "input_layernorm.weight"},
        # Query groups in order, each [its N/K query heads; its key head; its value head]: one
        # rank holds whole groups, so tp splits the interleaved tensor on dim 0.
        {"name": layer + QKV, "shape": [(N + 2 * K) * H, D], "tp": "shard_v",
         "widths": [N // K * H, H, H] * K, "to": qkv * K},
        {"name": layer + PROJ, "shape": [D, N * H], "tp": "shard_h",
         "to": hf + "self_attn.o_proj.weight"},
        {"name": layer + norms[1], "shape": [D], "to": hf + "post_attention_layernorm.weight"},
        {"name": layer + FC1, "shape": [2 * F, D], "tp": "shard_nc", "widths": [F, F],
         "to": [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]},
        {"name": layer + FC2, "shape": [D, F], "tp": "shard_h", "to": hf + "mlp.down_proj.weight"},
        {"name": FINAL_NORM, "shape": [D], "stage": -1, "to": "model.norm.weight"},
    ]
    if not config.tie_embeddings:
        tensors.append({"name": HEAD, **vocab, "stage": -1, "to": "lm_head.weight"})
    return tensors
