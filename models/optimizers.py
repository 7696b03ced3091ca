"""The optimizers a run trains with, each declaring its state: the fp32 arrays it keeps per
weight (what the home's memory, `strategy show` and the planner count) and their names in
torch's optimizers (what the torch checkpoint formats read and write). Adding an optimizer is
one entry in `OPTIMIZERS`.

Free of JAX imports (optax is imported when an optimizer is built), so the command line offers
the choices before JAX starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from models.errors import UserError

# The defaults of every run's optimizer settings (`hotjax.optim.OptimConfig`, `RunConfig`).
LR = 1e-3
WARMUP_STEPS = 10
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
    # torch's name of each per-weight state field -> the optax state's field; () : its state
    # has no torch form, and torch exports refuse it
    torch: tuple[tuple[str, str], ...] = ()
    torch_class: str | None = None  # as a torch checkpoint's record names the optimizer
    torch_flags: tuple[tuple[str, Any], ...] = ()  # its param_group's other fields in torch

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
                            f"export-hf), or train with --optimizer adamw or lion")
        return tuple(name for name, _ in self.torch)


ADAMW = Optimizer(
    "adamw", "AdamW", _adamw, ("b1", "b2", "eps", "weight_decay"), copies=2,
    optax_state="ScaleByAdamState", torch=(("exp_avg", "mu"), ("exp_avg_sq", "nu")),
    torch_class="torch.optim.AdamW",
    # as `get_state_dict(flatten_optimizer_state_dict=True)` writes torch.optim.AdamW's group
    torch_flags=(("amsgrad", False), ("maximize", False), ("foreach", None),
                 ("capturable", False), ("differentiable", False), ("fused", None),
                 ("decoupled_weight_decay", True)))
LION = Optimizer(
    "lion", "Lion", _lion, ("b1", "b2", "weight_decay"), copies=1,
    optax_state="ScaleByLionState", torch=(("exp_avg", "mu"),), torch_class="Lion")
ADAFACTOR = Optimizer(
    "adafactor", "Adafactor", _adafactor, ("weight_decay",), copies=0, factored=True,
    optax_state="FactoredState")
OPTIMIZERS = {o.name: o for o in (ADAMW, LION, ADAFACTOR)}
DEFAULT = ADAMW.name


def named(name: str) -> Optimizer:
    """The optimizer called `name`, or a one-line refusal listing the choices."""
    if name not in OPTIMIZERS:
        raise UserError(f"optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]
