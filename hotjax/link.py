"""A shaped link for `hotjax launch --link`: each process runs in a network namespace of its
own, plugged into a switch (a bridge in one more namespace) by a virtual cable (a veth pair)
that carries at most a given rate each way (tc tbf at both of its ends), as a cluster node's
network card does: a process sending while it receives gets the whole rate both ways. The
coordinator and gloo's collectives alike cross it.

The rate is given as such (`50MB/s`, `400Mbit`) or as a shipped profile's link scaled to this
machine (`a800-4x8:intra`): the cluster's bandwidth times this machine's matmul rate per device
over the cluster's, so that compute and network keep the cluster's ratio.

Until 2026-12-02 the processes shared one namespace whose loopback was shaped: one device for
both directions, so a collective sending both ways at once (an all-reduce, a ring's sends, an
all-to-all) got half the rate each way, and more whenever the ranks' sends did not coincide.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

from hotjax.errors import UserError

PREFIX = "hotjax"
# The token bucket's size: what a transfer after a pause moves at once, beyond the rate. A real
# link has no such credit, so it is the smallest that keeps the rate: three of the loopback's
# 64 KiB packets (a bucket of one stalls the link for good). tbf's usual 10 ms of the rate gave
# each collective after compute 1.6 MB for free at 161 MB/s, and made 2 MB all-reduces there run
# 20 % faster than back-to-back ones. Measured here with one TCP stream: 161 MB/s at a rate of
# 161 MB/s, 996 MB/s at 1 GB/s.
BURST = 192 * 1024
_UNITS = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9}
_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*([kKMG]?)(B/s|bit(?:/s)?)")
_OURS = re.compile(rf"{PREFIX}-(\d+)-[0-9a-f]+(?:-\d+)?")  # a switch's, or a process's
# The switched network's addresses: process i at SUBNET.(i + 1). Each launch's namespaces are
# its own, so launches side by side reuse them.
SUBNET = "10.77.0"
MAX_PROCESSES = 250
# The cables' MTU: the loopback's, so that a shaped link moves packets of the size an unshaped
# one (loopback) does.
MTU = 65535


def parse_rate(text: str) -> float:
    """Bytes per second from `50MB/s`, `1.5GB/s`, `400Mbit` or `400Mbit/s` (decimal units)."""
    match = _RATE.fullmatch(text.strip())
    value = float(match.group(1)) * _UNITS[match.group(2)] if match else 0.0
    if value <= 0:
        raise UserError(f"--link {text!r}: give a positive rate like 50MB/s, 400Mbit or "
                        f"1.5GB/s, or a profile's link like a800-4x8:intra")
    return value / 8 if match.group(3).startswith("bit") else value


def describe_rate(rate: float) -> str:
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if rate >= size:
            return f"{rate / size:.1f} {unit}"
    return f"{rate:.0f} B/s"


def resolve(spec: str, processes: int, devices_per_process: int,
            cores: set[int] | None = None) -> tuple[float, str]:
    """The rate `--link spec` asks for, and how it was derived (empty for a plain rate);
    `cores`: one process's share of this machine's (None: all), where its rate is timed."""
    if ":" not in spec:
        return parse_rate(spec), ""
    from hotjax.planning.profile import load_profile

    name, _, side = spec.partition(":")
    if side not in ("intra", "inter"):
        raise UserError(f"--link {spec}: name the profile's link, {name}:intra (inside a node) "
                        f"or {name}:inter (between nodes)")
    profile = load_profile(name)
    bandwidth = profile.intra_node_bandwidth if side == "intra" else profile.inter_node_bandwidth
    local, source, fitted = local_matmul_rate(processes, devices_per_process, cores)
    # Like for like: a fitted profile's model matmul rate against the cluster's (its peak's
    # share the model's matmuls reach); one large GEMM's rate, near peak, against its peak.
    cluster = profile.peak_flops * (profile.matmul_efficiency if fitted else 1.0)
    rate = bandwidth * local / cluster
    return rate, (f"{profile.name} {side}-node {bandwidth / 1e9:g} GB/s x (this machine's "
                  f"{local / 1e9:.1f} GFLOP/s / {cluster / 1e12:.1f} TFLOP/s per device: "
                  f"{source}) = {describe_rate(rate)}")


def local_matmul_rate(processes: int, devices_per_process: int,
                      cores: set[int] | None = None) -> tuple[float, str, bool]:
    """FLOP/s of one device of this launch's cluster, where it comes from, and whether it is a
    model's matmul rate (fitted) rather than a large GEMM's: the cached profile measured under
    the same launch (`hotjax launch ... -- plan --measure`) when there is one, else a bfloat16
    JAX matmul timed on one process's share of the cores."""
    from hotjax.config import cache_root
    from hotjax.planning.cost import COST_MODEL_VERSION

    devices = processes * devices_per_process
    cached = (cache_root() / "profiles" / f"cost-model-v{COST_MODEL_VERSION}"
              / f"cpu-{devices}x{processes}.toml")
    with contextlib.suppress(OSError, tomllib.TOMLDecodeError, KeyError, TypeError):
        data = tomllib.loads(cached.read_text())
        return (data["device"]["peak_tflops"] * 1e12 * data["efficiency"]["matmul"],
                f"model matmuls, cached profile {cached.name}", True)
    cores = sorted(cores or os.sched_getaffinity(0))
    timed = subprocess.run(
        [sys.executable, "-c", _MATMUL], capture_output=True, text=True, check=False,
        env={**os.environ, "JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"},
        preexec_fn=lambda: os.sched_setaffinity(0, cores))
    if timed.returncode != 0:
        raise UserError(f"timing this machine's matmul rate failed: "
                        f"{(timed.stderr.strip().splitlines() or ['no output'])[-1]}")
    rate = float(timed.stdout.split()[-1]) / devices_per_process  # its devices share the cores
    return rate, (f"a 1024^3 bfloat16 JAX matmul timed on {len(cores)} pinned "
                  f"core{'s' * (len(cores) > 1)}, against the cluster's peak"), False


# Best of 5 timings of a 1024 x 1024 x 1024 matmul, compiled and warmed up first.
_MATMUL = """
import time, jax, jax.numpy as jnp
a = jnp.ones((1024, 1024), jnp.bfloat16)
f = jax.jit(lambda a: a @ a)
f(a).block_until_ready()
best = float("inf")
for _ in range(5):
    t = time.perf_counter(); f(a).block_until_ready(); best = min(best, time.perf_counter() - t)
print(2 * 1024**3 / best)
"""


def check_tools() -> None:
    """Shaping a link needs root (namespaces, qdiscs) and iproute2's `ip` and `tc`."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise UserError(f"--link needs iproute2's {' and '.join(missing)}, not found: install "
                        f"iproute2 or drop --link")
    if os.geteuid() != 0:
        raise UserError("--link needs root (network namespaces, a bridge and qdiscs): run as "
                        "root or drop --link")


def namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


def stale_namespaces() -> list[str]:
    """hotjax's namespaces whose launcher (the pid in their name) is gone: it was killed
    outright, with no time to remove its own."""
    return [name for name in namespaces()
            if (m := _OURS.fullmatch(name)) and not Path(f"/proc/{m.group(1)}").exists()]


def remove_stale() -> list[str]:
    stale = stale_namespaces()
    for name in stale:
        _remove(name)
    return stale


@dataclasses.dataclass(frozen=True)
class Network:
    """A launch's switched network: the switch's namespace, each process's namespace and its
    address there (process i runs under `ip netns exec nodes[i]`)."""

    switch: str
    nodes: tuple[str, ...]
    addresses: tuple[str, ...]


@contextlib.contextmanager
def shaped_network(rate: float, processes: int) -> Iterator[Network]:
    """`processes` namespaces, each with a cable to one switch carrying at most `rate` bytes/s
    each way, removed on leaving however the block ends. In each, this machine's host name
    names the process's own address (`/etc/netns/NAME/hosts`, which `ip netns exec` puts in
    place of `/etc/hosts`): gloo binds to and announces the address its host name has."""
    check_tools()
    if not 1 <= processes <= MAX_PROCESSES:
        raise UserError(f"--link: {processes} processes; a shaped link takes 1 to "
                        f"{MAX_PROCESSES}")
    remove_stale()
    switch = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
    network = Network(switch, tuple(f"{switch}-{i}" for i in range(processes)),
                      tuple(f"{SUBNET}.{i + 1}" for i in range(processes)))
    shaping = ("tbf", "rate", f"{int(rate * 8)}bit", "burst", str(BURST), "latency", "400ms")
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "switch", "type", "bridge")
        for name in ("lo", "switch"):
            _ip("-n", switch, "link", "set", name, "up")
        for i, (node, address) in enumerate(zip(network.nodes, network.addresses, strict=True)):
            _ip("netns", "add", node)
            _name_host(node, address)
            _plug(switch, f"port{i}", node, address, shaping)
        yield network
    finally:
        for name in (*network.nodes, switch):
            _remove(name)


def _hosts(namespace: str) -> Path:
    return Path("/etc/netns") / namespace / "hosts"


def _name_host(namespace: str, address: str) -> None:
    """This machine's host name names `address` inside `namespace`."""
    try:
        _hosts(namespace).parent.mkdir(parents=True, exist_ok=True)
        _hosts(namespace).write_text(f"{address} {socket.gethostname()}\n127.0.0.1 localhost\n")
    except OSError as e:
        raise UserError(f"--link: cannot write {_hosts(namespace)} ({e.strerror}): a shaped "
                        f"link needs /etc/netns writable, or drop --link") from e


def _plug(switch: str, port: str, node: str, address: str, shaping: tuple[str, ...]) -> None:
    """A cable from the switch's `port` to `node`'s eth0 (at `address`), shaped at both ends:
    what the process sends, and what the switch sends it."""
    _ip("-n", switch, "link", "add", port, "mtu", str(MTU), "type", "veth", "peer", "name",
        "eth0", "mtu", str(MTU), "netns", node)
    _ip("-n", switch, "link", "set", port, "master", "switch", "up")
    _ip("-n", node, "addr", "add", f"{address}/24", "dev", "eth0")
    for name in ("lo", "eth0"):
        _ip("-n", node, "link", "set", name, "up")
    for namespace, device in ((node, "eth0"), (switch, port)):
        _ip("netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", *shaping)


def _remove(name: str) -> None:
    subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
    shutil.rmtree(_hosts(name).parent, ignore_errors=True)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise UserError(f"--link: `ip {' '.join(args)}` failed: "
                        f"{(done.stderr.strip().splitlines() or ['no output'])[0]}")
