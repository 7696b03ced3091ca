"""Strategy tables: which strategy runs each length bucket, and which holds the model state.

One form on disk serves every writer and reader: `hotjax plan --out`, `--strategies auto`,
the record each checkpoint keeps and `hotjax ckpt inspect` all write `StrategyTable.toml()` (or
its `to_dict()`, the same data), and `parse_table` / `load_table` read any of them back into an
equal table, home included:

    home = { mesh = { fsdp = 8 }, rules = "fsdp" }   # optional: default, the most sharded

    [[bucket]]
    max_len = 1024
    mesh = { data = 4, tensor = 2 }
    rules = "megatron"          # a rule set's name, or an inline table (params, activations, ...)
    micro_rows = 8              # rows per micro-step (gradient accumulation); default: fitted
    remat = "dots"              # default: fitted to the memory budget
    balanced = true             # context parallelism's load-balanced chunk order
    microbatches = 4            # a pipeline's micro-batches per micro-step (with a stage axis)
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any

from hotjax.choices import REMAT_POLICIES
from hotjax.errors import UserError
from hotjax.sharding.strategy import RULE_SETS, Rules, Strategy


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Sequences of up to `max_len` tokens run under `strategy`, as micro-steps of
    `micro_rows` rows, recomputing activations by `remat` (None: chosen by the trainer)."""

    max_len: int
    strategy: Strategy
    micro_rows: int | None = None
    remat: str | None = None


@dataclasses.dataclass(frozen=True)
class StrategyTable:
    """Buckets by increasing `max_len`, and the `home` strategy that keeps the fp32 master
    weights and optimizer state between them (None: the most sharded bucket's, chosen by
    `hotjax.planning.cost.most_sharded`). `source` names where the table came from, for errors."""

    buckets: tuple[Bucket, ...]
    source: str = dataclasses.field(default="<table>", compare=False)
    home: Strategy | None = None

    @property
    def strategies(self) -> list[Strategy]:
        return [b.strategy for b in self.buckets]

    @property
    def max_len(self) -> int:
        return self.buckets[-1].max_len

    def bucket_for(self, length: int) -> Bucket:
        for bucket in self.buckets:
            if length <= bucket.max_len:
                return bucket
        raise UserError(f"{self.source}: a sequence of {length} tokens is longer than the "
                        f"largest bucket ({self.max_len}): add a bucket or truncate the data")

    def check_devices(self, num_devices: int) -> None:
        named = [(self.source if len(self.buckets) == 1
                  else f"{self.source}: bucket {i} (max_len {bucket.max_len})", bucket.strategy)
                 for i, bucket in enumerate(self.buckets, 1)]
        if self.home is not None:
            named.append((f"{self.source}: home", self.home))
        for where, strategy in named:
            used = strategy.num_devices
            if used != num_devices:
                raise UserError(f"{where}: mesh {strategy} uses {used} devices but "
                                f"{num_devices} are in use: make its sizes multiply to "
                                f"{num_devices}, or pass --devices {used}")

    @classmethod
    def single(cls, strategy: Strategy, max_len: int, source: str) -> StrategyTable:
        return cls((Bucket(max_len, strategy),), source)

    def to_dict(self) -> dict[str, Any]:
        """The table's TOML form as data (what a checkpoint records): `parse_table` reads it
        back into an equal table."""
        out: dict[str, Any] = {} if self.home is None else {"home": strategy_dict(self.home)}
        out["bucket"] = [{"max_len": b.max_len, **strategy_dict(b.strategy),
                          **({"micro_rows": b.micro_rows} if b.micro_rows is not None else {}),
                          **({"remat": b.remat} if b.remat is not None else {})}
                         for b in self.buckets]
        return out

    def toml(self, header: str = "") -> str:
        """The table as TOML, one line per key as people write tables, `header` as comments."""
        data = self.to_dict()
        lines = [f"# {line}" for line in header.splitlines()]
        if "home" in data:
            lines.append(f"home = {_inline(data['home'])}")
        for bucket in data["bucket"]:
            lines += ["", "[[bucket]]", *(f"{k} = {_inline(v)}" for k, v in bucket.items())]
        return "\n".join(lines).lstrip("\n") + "\n"


def strategy_dict(strategy: Strategy) -> dict[str, Any]:
    """A strategy as a table's entries write it: mesh, rules, balanced, microbatches."""
    return {"mesh": {a: n for a, n in strategy.axes.items() if n > 1} or {"data": 1},
            "rules": _rules_value(strategy.rules),
            **({"balanced": True} if strategy.balanced else {}),
            **({"microbatches": strategy.microbatches} if strategy.microbatches else {})}


def _rules_value(rules: Rules) -> str | dict[str, Any]:
    """A rule set by its name where it is one, else its mappings in full (an inline table)."""
    if RULE_SETS.get(rules.name) == rules:
        return rules.name
    return {kind: {logical: list(axes) for logical, axes in mapping}
            for kind in ("params", "activations", "grads", "optimizer")
            if (mapping := getattr(rules, kind)) is not None}


def _inline(value: Any) -> str:
    """A TOML value on one line: an inline table, an array, a string (JSON's escapes are TOML's
    basic string's), a boolean or a number."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_inline(v)}" for k, v in value.items()) + " }" \
            if value else "{}"
    if isinstance(value, list):
        return "[" + ", ".join(map(_inline, value)) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else str(value)


def _parse_strategy(entry: dict[str, Any], where: str) -> Strategy:
    mesh = entry.get("mesh")
    if not isinstance(mesh, dict) or not mesh:
        raise UserError(f"{where}: mesh must be a table like {{ data = 8 }}")
    return Strategy.create(mesh, entry.get("rules"), where, entry.get("balanced", False),
                           entry.get("microbatches"))


def parse_table(data: dict[str, Any], source: str) -> StrategyTable:
    """A table from its TOML form: `[[bucket]]` entries with `max_len`, `mesh` and `rules`,
    and optionally a `home`."""
    entries = data.get("bucket")
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{source}: no [[bucket]] entries: add at least one with max_len and mesh")
    unknown_top = set(data) - {"bucket", "home"}
    if unknown_top:
        raise UserError(f"{source}: unknown key {sorted(unknown_top)[0]!r}: a table holds "
                        f"[[bucket]] entries and a home")
    home = data.get("home")
    if home is not None:
        if not isinstance(home, dict) or set(home) - {"mesh", "rules", "balanced",
                                                      "microbatches"}:
            raise UserError(f"{source}: home must be a table with mesh and rules, like "
                            f"home = {{ mesh = {{ fsdp = 8 }}, rules = \"fsdp\" }}")
        home = _parse_strategy(home, f"{source}: home")
    buckets = []
    for i, entry in enumerate(entries, 1):
        where = f"{source}: bucket {i}"
        if not isinstance(entry, dict):
            raise UserError(f"{where}: each bucket must be a table: write [[bucket]] entries "
                            f"with max_len and mesh")
        unknown = set(entry) - {"max_len", "mesh", "rules", "balanced", "micro_rows", "remat",
                                "microbatches"}
        if unknown:
            raise UserError(f"{where}: unknown key {sorted(unknown)[0]!r}: "
                            f"use max_len, mesh, rules, balanced, micro_rows, remat, "
                            f"microbatches")
        max_len = entry.get("max_len")
        if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
            raise UserError(f"{where}: max_len must be a positive integer, got {max_len!r}")
        if buckets and max_len <= buckets[-1].max_len:
            raise UserError(f"{where}: max_len {max_len} is not larger than bucket {i - 1}'s "
                            f"{buckets[-1].max_len}: list buckets by increasing max_len, "
                            f"without overlap")
        micro_rows = entry.get("micro_rows")
        if micro_rows is not None and (not isinstance(micro_rows, int)
                                       or isinstance(micro_rows, bool) or micro_rows < 1):
            raise UserError(f"{where}: micro_rows must be a positive integer, got {micro_rows!r}")
        remat = entry.get("remat")
        if remat is not None and remat not in REMAT_POLICIES:
            raise UserError(f"{where}: remat {remat!r}: choose one of "
                            f"{', '.join(map(repr, REMAT_POLICIES))}")
        buckets.append(Bucket(max_len, _parse_strategy(entry, where), micro_rows, remat))
    return StrategyTable(tuple(buckets), source, home)


def load_table(path: str | Path) -> StrategyTable:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"strategy table not found: {path}: pass an existing .toml file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read strategy table {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML ({e}): fix the syntax") from None
    return parse_table(data, str(path))
