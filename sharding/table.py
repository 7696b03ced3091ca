"""Strategy tables: which strategy runs each length bucket, read from TOML and validated once."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from models.errors import UserError
from models.options import REMAT_POLICIES
from sharding.strategy import Strategy


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Sequences of up to `max_len` tokens run under `strategy`, as micro-batches of
    `micro_rows` rows, recomputing activations by `remat` (None: chosen by the trainer)."""

    max_len: int
    strategy: Strategy
    micro_rows: int | None = None
    remat: str | None = None


@dataclasses.dataclass(frozen=True)
class StrategyTable:
    buckets: tuple[Bucket, ...]
    source: str = "<table>"

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
        for i, bucket in enumerate(self.buckets, 1):
            used = bucket.strategy.num_devices
            if used != num_devices:
                where = (self.source if len(self.buckets) == 1
                         else f"{self.source}: bucket {i} (max_len {bucket.max_len})")
                raise UserError(f"{where}: mesh {bucket.strategy} uses {used} devices but "
                                f"{num_devices} are in use: make its sizes multiply to "
                                f"{num_devices}, or pass --devices {used}")

    @classmethod
    def single(cls, strategy: Strategy, max_len: int, source: str) -> StrategyTable:
        return cls((Bucket(max_len, strategy),), source)


def parse_table(data: dict[str, Any], source: str) -> StrategyTable:
    """A table from its TOML form: `[[bucket]]` entries with `max_len`, `mesh` and `rules`."""
    entries = data.get("bucket")
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{source}: no [[bucket]] entries: add at least one with max_len and mesh")
    unknown_top = set(data) - {"bucket"}
    if unknown_top:
        raise UserError(f"{source}: unknown key {sorted(unknown_top)[0]!r}: a table holds "
                        f"[[bucket]] entries only")
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
        mesh = entry.get("mesh")
        if not isinstance(mesh, dict) or not mesh:
            raise UserError(f"{where}: mesh must be a table like {{ data = 8 }}")
        micro_rows = entry.get("micro_rows")
        if micro_rows is not None and (not isinstance(micro_rows, int)
                                       or isinstance(micro_rows, bool) or micro_rows < 1):
            raise UserError(f"{where}: micro_rows must be a positive integer, got {micro_rows!r}")
        remat = entry.get("remat")
        if remat is not None and remat not in REMAT_POLICIES:
            raise UserError(f"{where}: remat {remat!r}: choose one of "
                            f"{', '.join(map(repr, REMAT_POLICIES))}")
        strategy = Strategy.create(mesh, entry.get("rules"), where, entry.get("balanced", False),
                                   entry.get("microbatches"))
        buckets.append(Bucket(max_len, strategy, micro_rows, remat))
    return StrategyTable(tuple(buckets), source)


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
