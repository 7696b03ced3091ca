"""Hardware profiles: what a cluster offers a cost model, read from small TOML files.

A profile gives each device's peak matmul rate and memory, how devices group into nodes, the
share of peak the kernels reach (`efficiency`), and the bus bandwidth of each collective by group
size, inside one node and across nodes. Measured values are written into the same format, so a
calibrated profile is a file like the shipped ones (`sharding/profiles/*.toml`).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from models.errors import UserError
from sharding.planner import Topology

PROFILES = Path(__file__).parent / "profiles"
# Collectives by name: a ring all-reduce, its two halves, and one point-to-point send (pipeline
# stage transfers, ring attention's K/V). Time = bytes moved per device / bus bandwidth (see
# `sharding.cost`).
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "send")
_TOP_KEYS = ("name", "platform", "nodes", "devices_per_node", "device", "efficiency", "links",
             "collectives")
TERA, GIGA, GiB = 1e12, 1e9, 2**30


@dataclasses.dataclass(frozen=True)
class Bandwidths:
    """Bus bandwidth (bytes/s per device) of one collective, by group size: `intra` for groups
    inside one node, `inter` for groups that span nodes."""

    intra: tuple[tuple[int, float], ...]
    inter: tuple[tuple[int, float], ...]

    def at(self, group: int, crosses_nodes: bool) -> float:
        """The bandwidth of a group of `group` devices; a size not listed takes the nearest
        listed one (by ratio; the smaller on a tie)."""
        table = self.inter if crosses_nodes else self.intra
        _, bandwidth = min(table, key=lambda entry: (abs(math.log(entry[0] / group)), entry[0]))
        return bandwidth


@dataclasses.dataclass(frozen=True)
class Profile:
    """A cluster: `nodes` x `devices_per_node` devices of `peak_flops` (dense, compute dtype) and
    `memory_bytes` each, running on JAX platform `platform`."""

    name: str
    platform: str
    nodes: int
    devices_per_node: int
    peak_flops: float
    memory_bytes: int
    matmul_efficiency: float  # share of peak the model's matmuls reach
    attention_efficiency: float  # share of peak the attention kernel reaches
    intra_node_bandwidth: float  # bytes/s per device and direction (the switch planner's links)
    inter_node_bandwidth: float
    collectives: tuple[tuple[str, Bandwidths], ...]  # (name, bandwidths) for each of COLLECTIVES
    source: str = "<profile>"

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def bandwidth(self, collective: str, group: int, crosses_nodes: bool) -> float:
        """Bytes/s per device of `collective` over `group` devices."""
        return dict(self.collectives)[collective].at(group, crosses_nodes)

    def topology(self) -> Topology:
        """The links as the switch planner sees them."""
        return Topology(devices_per_node=self.devices_per_node,
                        intra_node_bandwidth=self.intra_node_bandwidth,
                        inter_node_bandwidth=self.inter_node_bandwidth)


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (`a800-4x8`, `h100-1x8`) or a TOML file by path."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = PROFILES / f"{name_or_path}.toml"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        shipped = ", ".join(sorted(p.stem for p in PROFILES.glob("*.toml")))
        raise UserError(f"hardware profile not found: {path}: pass a .toml file or one of "
                        f"{shipped}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read hardware profile {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML ({e}): fix the syntax") from None
    return parse_profile(data, str(path))


def parse_profile(data: Mapping[str, Any], source: str) -> Profile:
    """A profile from its TOML form, validated: every field present, every number positive."""
    _known(data, _TOP_KEYS, source)
    device = _table(data, "device", source, ("peak_tflops", "memory_gib"))
    efficiency = _table(data, "efficiency", source, ("matmul", "attention"))
    links = _table(data, "links", source, ("intra_node_gbps", "inter_node_gbps"))
    for field in ("matmul", "attention"):
        if efficiency[field] > 1:
            raise UserError(f"{source}: efficiency.{field} = {efficiency[field]} is a share of "
                            f"peak: give a number in (0, 1]")
    platform = data.get("platform")
    if platform not in ("cpu", "gpu", "tpu"):
        raise UserError(f"{source}: platform = {platform!r}: give the JAX platform, one of "
                        f"'cpu', 'gpu', 'tpu'")
    nodes = _count(data, "nodes", source)
    collectives = data.get("collectives")
    if not isinstance(collectives, Mapping):
        raise UserError(f"{source}: no [collectives] tables: add [collectives.NAME] for each of "
                        f"{', '.join(COLLECTIVES)}")
    _known(collectives, COLLECTIVES, f"{source}: collectives")
    return Profile(
        name=str(data.get("name", Path(source).stem)), platform=platform, nodes=nodes,
        devices_per_node=_count(data, "devices_per_node", source),
        peak_flops=device["peak_tflops"] * TERA, memory_bytes=int(device["memory_gib"] * GiB),
        matmul_efficiency=efficiency["matmul"], attention_efficiency=efficiency["attention"],
        intra_node_bandwidth=links["intra_node_gbps"] * GIGA,
        inter_node_bandwidth=links["inter_node_gbps"] * GIGA,
        collectives=tuple((name, _bandwidths(collectives, name, source)) for name in COLLECTIVES),
        source=source)


def _bandwidths(collectives: Mapping[str, Any], name: str, source: str) -> Bandwidths:
    where = f"{source}: collectives.{name}"
    entry = collectives.get(name)
    if not isinstance(entry, Mapping):
        raise UserError(f"{where}: missing: add [collectives.{name}] with intra and inter "
                        f"tables of group size = GB/s")
    _known(entry, ("intra", "inter"), where)
    return Bandwidths(*(_by_size(entry.get(side), f"{where}.{side}") for side in ("intra",
                                                                                  "inter")))


def _by_size(table: Any, where: str) -> tuple[tuple[int, float], ...]:
    if not isinstance(table, Mapping) or not table:
        raise UserError(f"{where}: give a table of group size = GB/s, like {{ 2 = 200, 8 = 180 }}")
    entries = []
    for size, gbps in table.items():
        if not size.isdecimal() or int(size) < 2:
            raise UserError(f"{where}: group size {size!r} must be an integer of at least 2")
        entries.append((int(size), _positive(gbps, f"{where}.{size}") * GIGA))
    return tuple(sorted(entries))


def _table(data: Mapping[str, Any], key: str, source: str, fields: tuple[str, ...]
           ) -> dict[str, float]:
    table = data.get(key)
    if not isinstance(table, Mapping):
        raise UserError(f"{source}: no [{key}] table: add one with {', '.join(fields)}")
    _known(table, fields, f"{source}: {key}")
    return {field: _positive(table.get(field), f"{source}: {key}.{field}") for field in fields}


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise UserError(f"{where} = {value!r}: give a positive number")
    return float(value)


def _count(data: Mapping[str, Any], key: str, source: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{source}: {key} = {value!r}: give a positive integer")
    return value


def _known(table: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(table) - set(keys))
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}: use {', '.join(keys)}")
