"""The optimizers a run trains with, each declaring its state: the fp32 arrays it keeps per
weight (what the home's memory, `strategy show` and the planner count), which optax state
counts its steps, and its torch form (what the torch checkpoint formats read and write: the
state's names, the param group's fields, the class). Adding an optimizer is its builder and
one entry in `OPTIMIZERS`; every reader and writer works from the entry.

Free of JAX imports (optax is imported when an optimizer is built), so the command line offers
the choices before JAX starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from hotjax.errors import UserError

# The defaults of every run's optimizer settings (`hotjax.optim.OptimConfig`, `RunConfig`).
LR = 1e-3
WARMUP_STEPS = 10
WEIGHT_DECAY = 0.1
CLIP_NORM = 1.0  # of the gradients' global norm
BETA1, BETA2 = 0.9, 0.95
EPS = 1e-5  # as LLaMA 2 (Touvron et al. 2023, §2.2)
SCHEDULE = "cosine"
MIN_LR_RATIO = 0.1  # the rate at the decay's end, over the peak
DECAY_FRACTION = 0.2  # WSD: the share of the steps after the warmup that decay
# optax.adafactor's: a weight whose two largest dimensions are both this long keeps its second
# moment as row and column statistics.
FACTOR_MIN = 128


def _adamw(schedule: Any, b1: float, b2: float, eps: float, weight_decay: float,
           mask: Any) -> Any:
    import optax

    return optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask)


def _lion(schedule: Any, b1: float, b2: float, eps: float, weight_decay: float,
          mask: Any) -> Any:
    import optax

    del eps
    return optax.lion(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=mask)


def _adafactor(schedule: Any, b1: float, b2: float, eps: float, weight_decay: float,
               mask: Any) -> Any:
    import optax

    del b1, b2, eps  # its own decay schedule and epsilon: AdamW's values do not carry over
    return optax.adafactor(schedule, weight_decay_rate=weight_decay, weight_decay_mask=mask)


def _sgd(schedule: Any, b1: float, b2: float, eps: float, weight_decay: float,
         mask: Any) -> Any:
    import optax

    del b2, eps
    # As torch.optim.SGD: weight decay added to the gradient before the momentum (--beta1).
    return optax.chain(optax.add_decayed_weights(weight_decay, mask),
                       optax.sgd(schedule, momentum=b1))


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """One optimizer: how it is built, what state it keeps per weight, how torch names it."""

    name: str  # as --optimizer and a checkpoint's record name it
    label: str  # as messages name it
    # (schedule, b1, b2, eps, weight_decay, decay mask) -> an optax transformation
    build: Callable[..., Any]
    settings: tuple[str, ...]  # the `OptimConfig` fields it reads besides lr and its schedule
    copies: int  # full-size fp32 copies of each weight its state keeps
    factored: bool = False  # Adafactor: second moments as row and column statistics instead
    optax_state: str = ""  # the optax state class holding its per-weight state
    # The optax state class whose `count` is the step (its own state's, or the schedule's:
    # "" is `optax_state`); a checkpoint's step is read there.
    step_state: str = ""
    # torch's name of each per-weight state field -> the optax state's field; () : its state
    # has no torch form, and torch exports refuse it
    torch: tuple[tuple[str, str], ...] = ()
    torch_class: str | None = None  # as a torch checkpoint's record names the optimizer
    # Its param_group's fields in torch besides lr and weight_decay -> the settings (`b1`,
    # `b2`, `eps`) each holds: one, or a pair (Adam's betas); exports write them, imports read
    # them back.
    torch_settings: tuple[tuple[str, tuple[str, ...]], ...] = ()
    torch_flags: tuple[tuple[str, Any], ...] = ()  # its param_group's other fields in torch
    # Whether torch keeps a per-weight `step` in its state (SGD keeps none; hotjax's exports
    # write one all the same, which torch's SGD ignores, so that a re-import knows the step).
    torch_counts: bool = True

    @property
    def counter(self) -> str:
        """The optax state class whose `count` is the step."""
        return self.step_state or self.optax_state

    def torch_group(self, settings: Any) -> dict[str, Any]:
        """Its torch param group's fields from `settings` (an `OptimConfig`), lr and weight
        decay aside."""
        return {name: getattr(settings, fields[0]) if len(fields) == 1 else
                tuple(getattr(settings, f) for f in fields)
                for name, fields in self.torch_settings} | dict(self.torch_flags)

    def from_torch_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """The settings (`b1`, `b2`, `eps`) a torch param group's fields give, those it has."""
        found: dict[str, Any] = {}
        for name, fields in self.torch_settings:
            if name in group:
                values = group[name] if len(fields) > 1 else [group[name]]
                found.update(zip(fields, values, strict=True))
        return found

    def state_shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The fp32 arrays its state keeps for one weight of `shape` (step counters aside)."""
        if not self.factored:
            return [tuple(shape)] * self.copies
        order = sorted(range(len(shape)), key=lambda i: shape[i])  # stable, as optax's argsort
        if len(shape) < 2 or shape[order[-2]] < FACTOR_MIN:
            return [(1,), (1,), tuple(shape)]  # optax's placeholders, and the whole moment
        row = tuple(n for i, n in enumerate(shape) if i != order[-1])
        column = tuple(n for i, n in enumerate(shape) if i != order[-2])
        return [row, column, (1,)]

    def torch_names(self, what: str) -> tuple[str, ...]:
        """Its per-weight state fields as torch names them, or a one-line refusal that names
        `what` needs them."""
        if not self.torch:
            raise UserError(f"{what}: the checkpoint's optimizer {self.label} keeps state torch's "
                            f"optimizers do not name: export its weights alone (hotjax ckpt "
                            f"export-hf), or train with --optimizer "
                            f"{' or '.join(o.name for o in OPTIMIZERS.values() if o.torch)}")
        return tuple(name for name, _ in self.torch)


ADAMW = Optimizer(
    "adamw", "AdamW", _adamw, ("b1", "b2", "eps", "weight_decay"), copies=2,
    optax_state="ScaleByAdamState", torch=(("exp_avg", "mu"), ("exp_avg_sq", "nu")),
    torch_class="torch.optim.AdamW", torch_settings=(("betas", ("b1", "b2")), ("eps", ("eps",))),
    # as `get_state_dict(flatten_optimizer_state_dict=True)` writes torch.optim.AdamW's group
    torch_flags=(("amsgrad", False), ("maximize", False), ("foreach", None),
                 ("capturable", False), ("differentiable", False), ("fused", None),
                 ("decoupled_weight_decay", True)))
LION = Optimizer(
    "lion", "Lion", _lion, ("b1", "b2", "weight_decay"), copies=1,
    optax_state="ScaleByLionState", torch=(("exp_avg", "mu"),), torch_class="Lion",
    torch_settings=(("betas", ("b1", "b2")),))
ADAFACTOR = Optimizer(
    "adafactor", "Adafactor", _adafactor, ("weight_decay",), copies=0, factored=True,
    optax_state="FactoredState")
SGD = Optimizer(
    "sgd", "SGD with momentum", _sgd, ("b1", "weight_decay"), copies=1,
    optax_state="TraceState", step_state="ScaleByScheduleState",
    torch=(("momentum_buffer", "trace"),), torch_class="torch.optim.SGD",
    torch_settings=(("momentum", ("b1",)),),
    torch_flags=(("dampening", 0.0), ("nesterov", False), ("maximize", False),
                 ("foreach", None), ("differentiable", False), ("fused", None)),
    torch_counts=False)
OPTIMIZERS = {o.name: o for o in (ADAMW, LION, ADAFACTOR, SGD)}
# Every per-weight state field torch's optimizers name, and every param group field holding a
# setting, for the readers that find them.
TORCH_STATE = tuple(sorted({name for o in OPTIMIZERS.values() for name, _ in o.torch}))
TORCH_SETTINGS = tuple(sorted({name for o in OPTIMIZERS.values()
                               for name, _ in o.torch_settings}))
DEFAULT = ADAMW.name


def _cosine(peak: float, end: float, warmup: int, horizon: int, fraction: float) -> Any:
    import optax

    del fraction
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(horizon, warmup + 1), end)


def _linear(peak: float, end: float, warmup: int, horizon: int, fraction: float) -> Any:
    import optax

    del fraction
    return _after_warmup(peak, warmup, optax.linear_schedule(peak, end,
                                                             max(horizon - warmup, 1)))


def _constant(peak: float, end: float, warmup: int, horizon: int, fraction: float) -> Any:
    import optax

    del end, horizon, fraction
    return _after_warmup(peak, warmup, optax.constant_schedule(peak))


def _wsd(peak: float, end: float, warmup: int, horizon: int, fraction: float) -> Any:
    import optax

    decaying = max(round(fraction * (horizon - warmup)), 1)
    stable = max(horizon - warmup - decaying, 0)
    return _after_warmup(peak, warmup, optax.join_schedules(
        [optax.constant_schedule(peak), optax.linear_schedule(peak, end, decaying)], [stable]))


def _after_warmup(peak: float, warmup: int, after: Any) -> Any:
    """Linear warmup from 0 to `peak` over `warmup` steps, then `after` (counted from 0)."""
    import optax

    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


# The learning rate's shapes (--schedule), each (peak, end, warmup, horizon, WSD's decay
# fraction) -> an optax schedule over update counts: linear warmup to the peak, then to `end`
# (the peak times --min-lr-ratio) at the horizon (--decay-steps) by a cosine, a line, not at all
# (constant), or (WSD: warmup, stable, decay) held at the peak until a line over the last
# `fraction` of the steps after the warmup. Adding a shape is one entry.
SCHEDULES = {"cosine": _cosine, "linear": _linear, "constant": _constant, "wsd": _wsd}


def with_torch_state(fields: set[str], where: str) -> Optimizer:
    """The optimizer whose torch state is exactly `fields` (torch's names of a checkpoint's
    per-weight state, `step` aside), or a one-line refusal naming `where`."""
    torch_forms = [o for o in OPTIMIZERS.values() if o.torch]
    found = [o for o in torch_forms if set(o.torch_names(where)) == fields]
    if not found:
        known = "; ".join(f"{o.label}: {', '.join(o.torch_names(where))}" for o in torch_forms)
        raise UserError(f"{where}: holds optimizer state {', '.join(sorted(fields))}, which none "
                        f"of hotjax's optimizers keeps ({known}): import its weights alone")
    return found[0]


def named(name: str) -> Optimizer:
    """The optimizer called `name`, or a one-line refusal listing the choices."""
    if name not in OPTIMIZERS:
        raise UserError(f"optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]
