"""The hot-transfer scheduler (HotSPa's greedy): which device sends which slice of which
array to which device when arrays move from one layout to another. Shapes and layouts only.

The core works on a pure description, so it plans for topologies larger than this machine: for
each array, the index box every device holds before the switch and must hold after it
(`ArraySwitch`). `boxes_from_sharding` and `boxes_from_strategy` build those boxes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections import defaultdict, deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec, Sharding

from hotjax.errors import UserError
from hotjax.sharding.strategy import MESH_AXES, Strategy, ways

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension, in the array's global indices
POLICIES = ("greedy", "first-owner", "round-robin")
# Smaller pieces are not worth a message of their own: the greedy splits a slice among several
# owners only into pieces at least this large.
MIN_PIECE_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class ArraySwitch:
    """One array to move: its global shape, bytes per element, and the index box each device
    (by id) holds before the switch (`source`) and must hold after it (`target`)."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    source: Mapping[int, Box]
    target: Mapping[int, Box]


@dataclasses.dataclass(frozen=True)
class Topology:
    """Which node each device (by id) sits on: given by `nodes` (pairs of device id and node,
    as `of_processes` reads them from a running job), else `d // devices_per_node` (device ids
    numbering devices node-major, as `canonical_devices` orders them: a simulated cluster).
    Bandwidths are per device and direction, in bytes/s; the defaults are the HotSPa paper's
    cluster: NVLink 400 GB/s inside a node, InfiniBand 200 GB/s between nodes."""

    devices_per_node: int
    intra_node_bandwidth: float = 400e9
    inter_node_bandwidth: float = 200e9
    nodes: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of_processes(cls, devices: Sequence[jax.Device], **bandwidths: float) -> Topology:
        """The job's own topology: the devices one process drives form a node (one host)."""
        per_process = defaultdict(int)
        for d in devices:
            per_process[d.process_index] += 1
        return cls(max(per_process.values()), **bandwidths,
                   nodes=tuple(sorted((d.id, d.process_index) for d in devices)))

    @functools.cached_property
    def _node_of(self) -> dict[int, int]:
        return dict(self.nodes)

    def node(self, device: int) -> int:
        if self.nodes:
            return self._node_of[device]
        return device // self.devices_per_node


class Piece(NamedTuple):
    """A slice of array `arrays[array]`: `box` in global indices, `src` the same slice inside the
    sender's source shard, `dst` inside the receiver's target shard."""

    array: int
    box: Box
    src: Box
    dst: Box
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One fused message: every piece `sender` sends `receiver`. In `TransferSchedule.kept`, where
    sender and receiver are one device, the pieces it already holds and copies locally."""

    sender: int
    receiver: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclasses.dataclass(frozen=True)
class TransferSchedule:
    """A scheduled switch. `sent`/`received` hold every device of the switch (0 if idle); the
    `_inter_node` maps count the part of those bytes that crosses a node boundary.

    `lower_bound` is the least max per-device send of any single-hop plan (see `lower_bound`).
    `estimated_seconds` models each device's link as full duplex with separate intra- and
    inter-node bandwidths: a device's send time is intra bytes / intra bw + inter bytes / inter bw,
    likewise its receive time, and the switch takes as long as the slowest device's larger of the
    two (all messages in flight at once; latency and the assembly copies ignored).
    """

    arrays: tuple[ArraySwitch, ...]
    topology: Topology
    policy: str
    transfers: tuple[Transfer, ...]
    kept: tuple[Transfer, ...]
    sent: Mapping[int, int]
    received: Mapping[int, int]
    sent_inter_node: Mapping[int, int]
    received_inter_node: Mapping[int, int]
    lower_bound: int
    plan_seconds: float

    @property
    def bytes_moved(self) -> int:
        return sum(self.sent.values())

    @property
    def max_send(self) -> int:
        return max(self.sent.values(), default=0)

    @property
    def estimated_seconds(self) -> float:
        intra, inter = self.topology.intra_node_bandwidth, self.topology.inter_node_bandwidth

        def seconds(total: int, crossing: int) -> float:
            return (total - crossing) / intra + crossing / inter

        return max((max(seconds(self.sent[d], self.sent_inter_node[d]),
                        seconds(self.received[d], self.received_inter_node[d]))
                    for d in self.sent), default=0.0)

    def summary(self) -> dict[str, Any]:
        return {"policy": self.policy, "arrays": len(self.arrays), "messages": len(self.transfers),
                "bytes_moved": self.bytes_moved,
                "inter_node_bytes": sum(self.sent_inter_node.values()),
                "max_send": self.max_send, "lower_bound": self.lower_bound,
                "estimated_s": self.estimated_seconds, "plan_s": self.plan_seconds}


def schedule_transfers(arrays: Sequence[ArraySwitch], topology: Topology, policy: str = "greedy",
                min_piece_bytes: int = MIN_PIECE_BYTES) -> TransferSchedule:
    """Plan moving `arrays` from their source to their target boxes.

    Each array is cut into the grid of intersections of its source and target partitions. A
    receiver that already holds a slice keeps it. Otherwise the sender is chosen by `policy`:
    "greedy" (HotSPa) takes an owner on the receiver's node if there is one, and among those the
    owner that has sent the fewest bytes so far, slices largest first; where a node's owners of a
    slice outnumber its receivers there, each receiver's slice is split among them (pieces of at
    least `min_piece_bytes`), so replicas share the sending. "first-owner" always takes the
    lowest-id owner; "round-robin" takes the owners of each slice in turn. All pieces of one
    (sender, receiver) pair are fused into one `Transfer`.
    """
    if policy not in POLICIES:
        raise UserError(f"unknown sender policy {policy!r}: choose one of {', '.join(POLICIES)}")
    started = time.perf_counter()
    arrays = tuple(arrays)
    cells: list[tuple[int, Box, tuple[int, ...], list[int]]] = []  # array, box, owners, needy
    kept: dict[int, list[tuple[int, Box]]] = defaultdict(list)
    demand: dict[tuple[int, ...], int] = defaultdict(int)  # owner set -> bytes it must send
    for a, array in enumerate(arrays):
        for box, owners, receivers in _cells(array):
            needy = [r for r in receivers if r not in owners]
            for r in receivers:
                if r in owners:
                    kept[r].append((a, box))
            if needy:
                cells.append((a, box, owners, needy))
                demand[owners] += _volume(box) * array.itemsize * len(needy)
    chosen = _choose_senders(cells, arrays, topology, policy, min_piece_bytes)

    devices = sorted({d for array in arrays for d in (*array.source, *array.target)})
    sent, received = dict.fromkeys(devices, 0), dict.fromkeys(devices, 0)
    sent_inter, received_inter = dict.fromkeys(devices, 0), dict.fromkeys(devices, 0)
    messages: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for sender, receiver, a, box in chosen:
        piece = _piece(arrays[a], a, box, sender, receiver)
        messages[sender, receiver].append(piece)
        sent[sender] += piece.nbytes
        received[receiver] += piece.nbytes
        if topology.node(sender) != topology.node(receiver):
            sent_inter[sender] += piece.nbytes
            received_inter[receiver] += piece.nbytes
    transfers = tuple(Transfer(s, r, tuple(sorted(pieces, key=lambda p: (p.array, p.box))))
                      for (s, r), pieces in sorted(messages.items()))
    kept_transfers = tuple(Transfer(r, r, tuple(_piece(arrays[a], a, box, r, r)
                                                for a, box in sorted(slices)))
                           for r, slices in sorted(kept.items()))
    return TransferSchedule(arrays, topology, policy, transfers, kept_transfers, sent, received,
                      sent_inter, received_inter, lower_bound(demand),
                      time.perf_counter() - started)


def lower_bound(demand: Mapping[tuple[int, ...], int]) -> int:
    """The least max per-device send of any single-hop plan, given the bytes each owner set must
    send (`demand[owners]`: slices held by exactly the devices `owners`, summed once per receiver
    that lacks them).

    In a single-hop plan every byte a receiver lacks goes to it straight from a device that holds
    it in the source layout; the scheduler's schedules are of this kind. Take any family G of owner
    sets and let N(G) be the devices in them: every byte demanded by G must be sent by devices of
    N(G), so one of them sends at least D(G) / |N(G)|. That is a sound bound for every G; this
    returns its maximum over G (rounded up: sends are whole bytes), found exactly by Dinkelbach's
    iteration, each step a max-closure min cut. By max-flow/min-cut it equals the optimum of the
    relaxation that may split slices among owners at byte granularity, so no single-hop plan,
    however finely it cuts, sends less from its busiest device. (A relay plan, forwarding data a
    device received during the switch, is not covered: it is not a plan of this kind.)
    """
    groups = [(owners, nbytes) for owners, nbytes in demand.items() if nbytes]
    if not groups:
        return 0
    num, den = sum(n for _, n in groups), len({d for owners, _ in groups for d in owners})
    while True:
        chosen = _densest_groups(groups, num, den)
        total = sum(groups[g][1] for g in chosen)
        senders = len({d for g in chosen for d in groups[g][0]})
        if not chosen or total * den <= num * senders:
            return -(-num // den)
        num, den = total, senders


def boxes_from_sharding(sharding: Sharding, shape: Sequence[int]) -> dict[int, Box]:
    """Each device's index box of an array of `shape` under a JAX sharding."""
    shape = tuple(shape)
    return {device.id: tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape,
                                                                               strict=True))
            for device, index in sharding.devices_indices_map(shape).items()}


def boxes_from_spec(spec: PartitionSpec, mesh_sizes: Mapping[str, int],
                    device_ids: Sequence[int], shape: Sequence[int]) -> dict[int, Box]:
    """Each device's index box of an array of `shape` placed by `spec` over a mesh of
    `mesh_sizes` (outermost axis first) laid over `device_ids` in canonical order — what
    `NamedSharding` gives, for devices that need not exist here."""
    names, sizes = tuple(mesh_sizes), tuple(mesh_sizes.values())
    grid = np.asarray(device_ids, dtype=np.int64).reshape(sizes)
    parts = [_mesh_axes(spec[dim] if dim < len(spec) else None) for dim in range(len(shape))]
    boxes = {}
    for coords in np.ndindex(*sizes):
        at = dict(zip(names, coords, strict=True))
        box = []
        for n, axes in zip(shape, parts, strict=True):
            pieces, index = 1, 0
            for axis in axes:  # the first mesh axis of a dimension is the major one
                pieces, index = pieces * mesh_sizes[axis], index * mesh_sizes[axis] + at[axis]
            box.append((n * index // pieces, n * (index + 1) // pieces))
        boxes[int(grid[coords])] = tuple(box)
    return boxes


def boxes_from_strategy(strategy: Strategy, device_ids: Sequence[int], axes: Sequence[str | None],
                        shape: Sequence[int], kind: str = "param") -> dict[int, Box]:
    """Each device's box of an array with logical `axes` under `strategy`'s `kind` placement
    ("param", "grad" or "optimizer"), the mesh laid over `device_ids` as `Layout` lays it."""
    spec = getattr(strategy, f"{kind}_spec")(axes)
    for dim, (size, pieces) in enumerate(zip(shape, ways(spec, strategy.axes), strict=False)):
        if size % pieces:
            raise UserError(f"dimension {dim} ({axes[dim]}={size}) does not split {pieces} ways "
                            f"under {strategy}: choose sizes that divide it")
    return boxes_from_spec(spec, dict(zip(MESH_AXES, strategy.sizes, strict=True)), device_ids,
                           shape)


def strategy_switches(axes_tree: Any, shapes_tree: Any, source: Strategy, target: Strategy,
                      device_ids: Sequence[int], itemsize: int | None = None,
                      source_kind: str = "param", target_kind: str = "param"
                      ) -> list[ArraySwitch]:
    """A tree (e.g. `param_axes(cfg)`, `abstract_params(cfg)`) switched from `source` to
    `target` over `device_ids`; `itemsize` overrides the shapes' dtypes (2 for bf16 params)."""
    axes = jax.tree.leaves(axes_tree, is_leaf=lambda x: isinstance(x, tuple))
    leaves = jax.tree_util.tree_leaves_with_path(shapes_tree)
    return [ArraySwitch(jax.tree_util.keystr(path, simple=True, separator="/"), tuple(leaf.shape),
                        itemsize or np.dtype(leaf.dtype).itemsize,
                        boxes_from_strategy(source, device_ids, names, leaf.shape, source_kind),
                        boxes_from_strategy(target, device_ids, names, leaf.shape, target_kind))
            for names, (path, leaf) in zip(axes, leaves, strict=True)]


def sharding_switches(tree: Any, target_shardings: Any) -> list[ArraySwitch]:
    """A tree of arrays (or `jax.ShapeDtypeStruct`s with shardings) switched to
    `target_shardings`, a tree of the same structure."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    targets = jax.tree.leaves(target_shardings, is_leaf=lambda x: isinstance(x, Sharding))
    return [ArraySwitch(jax.tree_util.keystr(path, simple=True, separator="/"), tuple(leaf.shape),
                        np.dtype(leaf.dtype).itemsize,
                        boxes_from_sharding(leaf.sharding, leaf.shape),
                        boxes_from_sharding(target, leaf.shape))
            for (path, leaf), target in zip(leaves, targets, strict=True)]


# --- the scheduler's parts --------------------------------------------------------------------


def _cells(array: ArraySwitch) -> Iterator[tuple[Box, tuple[int, ...], tuple[int, ...]]]:
    """The array's slices on the common refinement of source and target boxes, each with the
    devices that hold it (owners) and those that must hold it (receivers)."""
    devices = sorted({*array.source, *array.target})
    bit = {d: 1 << i for i, d in enumerate(devices)}
    for boxes in (array.source, array.target):
        for d, box in boxes.items():
            if len(box) != len(array.shape) or any(
                    not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, array.shape, strict=True)):
                raise ValueError(f"{array.name}: box {box} of device {d} is not inside shape "
                                 f"{array.shape}")
    # Per dimension: the cut points of every box, and for each interval between two cuts the
    # devices (as bit masks) whose source or target box spans it.
    dims = []
    for dim, n in enumerate(array.shape):
        cuts = sorted({0, n, *(b[dim][k] for boxes in (array.source, array.target)
                                for b in boxes.values() for k in (0, 1))})
        at = {c: i for i, c in enumerate(cuts)}
        masks = []
        for boxes in (array.source, array.target):
            mask = [0] * (len(cuts) - 1)
            for d, box in boxes.items():
                for i in range(at[box[dim][0]], at[box[dim][1]]):
                    mask[i] |= bit[d]
            masks.append(mask)
        dims.append([((cuts[i], cuts[i + 1]), masks[0][i], masks[1][i])
                     for i in range(len(cuts) - 1)])
    everyone = (sum(bit[d] for d in array.source), sum(bit[d] for d in array.target))
    members: dict[int, tuple[int, ...]] = {}

    def of(mask: int) -> tuple[int, ...]:
        if mask not in members:
            members[mask] = tuple(d for d in devices if mask & bit[d])
        return members[mask]

    for cell in itertools.product(*dims):
        owners, receivers = everyone
        for _, src, dst in cell:
            owners, receivers = owners & src, receivers & dst
        if not receivers:
            continue
        box = tuple(interval for interval, _, _ in cell)
        if not owners:
            raise ValueError(f"{array.name}: devices {of(receivers)} need slice {box}, which no "
                             f"device holds in the source layout")
        yield box, of(owners), of(receivers)


def _choose_senders(cells: list[tuple[int, Box, tuple[int, ...], list[int]]],
                    arrays: tuple[ArraySwitch, ...], topology: Topology, policy: str,
                    min_piece_bytes: int) -> list[tuple[int, int, int, Box]]:
    """(sender, receiver, array, box) for every slice a receiver lacks."""
    if policy == "first-owner":
        return [(owners[0], r, a, box) for a, box, owners, needy in cells for r in needy]
    if policy == "round-robin":
        turn: dict[tuple[int, ...], int] = defaultdict(int)
        chosen = []
        for a, box, owners, needy in cells:
            for r in needy:
                chosen.append((owners[turn[owners] % len(owners)], r, a, box))
                turn[owners] += 1
        return chosen
    pieces = []  # (bytes, order, array, box, receiver, candidate senders)
    order = itertools.count()
    for a, box, owners, needy in cells:
        pullers: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for r in needy:
            near = tuple(o for o in owners if topology.node(o) == topology.node(r))
            pullers[near or owners].append(r)
        itemsize = arrays[a].itemsize
        for candidates, receivers in pullers.items():
            ways_ = min(len(candidates) // len(receivers),
                        _volume(box) * itemsize // max(min_piece_bytes, 1))
            for part in _split(box, ways_):
                nbytes = _volume(part) * itemsize
                pieces.extend((nbytes, next(order), a, part, r, candidates) for r in receivers)
    pieces.sort(key=lambda p: (-p[0], p[1]))  # largest first (LPT), ties in a stable order
    sent: dict[int, int] = defaultdict(int)
    chosen = []
    for nbytes, _, a, box, r, candidates in pieces:
        sender = min(candidates, key=lambda o: (sent[o], o))
        sent[sender] += nbytes
        chosen.append((sender, r, a, box))
    return chosen


def _split(box: Box, ways_: int) -> list[Box]:
    """`box` cut into up to `ways_` near-equal pieces along its outermost dimension that has room
    (the outermost keeps each piece's rows contiguous in the shard)."""
    if ways_ <= 1 or not box:
        return [box]
    extents = [hi - lo for lo, hi in box]
    fits = [d for d, n in enumerate(extents) if n >= ways_]
    dim = fits[0] if fits else int(np.argmax(extents))
    ways_ = min(ways_, extents[dim])
    lo, n = box[dim][0], extents[dim]
    return [box[:dim] + ((lo + n * i // ways_, lo + n * (i + 1) // ways_),) + box[dim + 1:]
            for i in range(ways_)]


def _piece(array: ArraySwitch, a: int, box: Box, sender: int, receiver: int) -> Piece:
    return Piece(a, box, _within(box, array.source[sender]), _within(box, array.target[receiver]),
                 _volume(box) * array.itemsize)


def _within(box: Box, outer: Box) -> Box:
    return tuple([(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, outer, strict=True)])


def _volume(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def _mesh_axes(part: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if part is None:
        return ()
    return (part,) if isinstance(part, str) else tuple(part)


def _densest_groups(groups: list[tuple[tuple[int, ...], int]], num: int, den: int) -> list[int]:
    """The owner sets G maximising den·D(G) - num·|N(G)| (a max-closure problem), by a min cut:
    source -> set g (capacity den·D_g) -> each of its devices (unbounded) -> sink (num)."""
    devices = sorted({d for owners, _ in groups for d in owners})
    source, sink = 0, 1 + len(groups) + len(devices)
    node = {d: 1 + len(groups) + i for i, d in enumerate(devices)}
    unbounded = den * sum(n for _, n in groups) + 1
    capacity: dict[int, dict[int, int]] = defaultdict(dict)

    def edge(u: int, v: int, c: int) -> None:
        capacity[u][v] = c
        capacity[v].setdefault(u, 0)

    for g, (owners, nbytes) in enumerate(groups):
        edge(source, 1 + g, den * nbytes)
        for d in owners:
            edge(1 + g, node[d], unbounded)
    for d in devices:
        edge(node[d], sink, num)
    while True:  # Edmonds-Karp: shortest augmenting paths until none is left
        parent = {source: source}
        queue = deque([source])
        while queue and sink not in parent:
            u = queue.popleft()
            for v, c in capacity[u].items():
                if c > 0 and v not in parent:
                    parent[v] = u
                    queue.append(v)
        if sink not in parent:
            return [g for g in range(len(groups)) if 1 + g in parent]  # the source side
        path, v = [], sink
        while v != source:
            path.append((parent[v], v))
            v = parent[v]
        flow = min(capacity[u][v] for u, v in path)
        for u, v in path:
            capacity[u][v] -= flow
            capacity[v][u] += flow
