"""`hotjax launch --link`: rates parse strictly; an 8 MB all-reduce between two processes over a
shaped link takes the time its bytes take at the rate each way; the namespaces go with the
launcher, and one left by a launcher killed outright goes at the next launch."""

import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from hotjax import launch, link
from hotjax.errors import UserError

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
    reason="--link needs root and iproute2")

MB = 1e6
ALL_REDUCE = 8 * 2**20  # bytes of float32 per process
# Each process joins, then times 3 all-reduces of 8 MB between the two (after one to compile).
CHILD = f"""
import sys, time, jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
jax.config.update("jax_cpu_collectives_implementation", "gloo")
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
jax.distributed.initialize(args["--coordinator"], int(args["--num-processes"]),
                           int(args["--process-id"]))
mesh = Mesh(np.array(jax.devices()), ("i",))
n = {ALL_REDUCE} // 4
local = jax.device_put(np.ones((1, n), np.float32), jax.local_devices()[0])
x = jax.make_array_from_single_device_arrays((2, n), NamedSharding(mesh, P("i")), [local])
reduce = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "i"), mesh=mesh, in_specs=P("i"),
                               out_specs=P("i")))
reduce(x).block_until_ready()
times = []
for _ in range(3):
    t = time.perf_counter(); reduce(x).block_until_ready(); times.append(time.perf_counter() - t)
print("all-reduce s", min(times))
"""


@pytest.mark.parametrize("text, rate", [("50MB/s", 50e6), ("400Mbit", 50e6), ("1.5GB/s", 1.5e9),
                                        ("80Mbit/s", 10e6), ("20 kB/s", 20e3), ("512B/s", 512)])
def test_rates_parse(text, rate):
    assert link.parse_rate(text) == pytest.approx(rate)


@pytest.mark.parametrize("text", ["fast", "50", "50MB", "-5MB/s", "0MB/s", "50 mb/s", "1e3MB/s",
                                  "50MiB/s", ""])
def test_bad_rates_are_one_line(text):
    with pytest.raises(UserError) as raised:
        link.parse_rate(text)
    assert "\n" not in str(raised.value) and "50MB/s" in str(raised.value)


def test_a_bad_profile_link_is_one_line():
    with pytest.raises(UserError, match="a800-4x8:intra") as raised:
        link.resolve("a800-4x8:sideways", 2, 1)
    assert "\n" not in str(raised.value)


def _all_reduce_s(rate: float | None) -> tuple[float, str]:
    out = io.StringIO()
    assert launch.run([sys.executable, "-c", CHILD], 2, 1, out=out, link=rate) == 0
    times = [float(t) for t in re.findall(r"all-reduce s ([\d.e-]+)", out.getvalue())]
    assert len(times) == 2, out.getvalue()
    return max(times), out.getvalue()


def test_an_all_reduce_over_a_shaped_link_takes_its_bytes_at_the_rate():
    """A ring all-reduce of S bytes between 2 processes sends S/2 each way twice (reduce-scatter,
    all-gather): S from each process while it receives S, both at the rate (a link shared by
    both directions, as the loopback was, takes twice as long)."""
    rate = 20 * MB
    shaped, output = _all_reduce_s(rate)
    first = output.splitlines()[0]
    assert re.search(r"over a link shaped to 20\.0 MB/s each way \(tc tbf on each process's "
                     r"cable to a switch; network namespaces hotjax-\d+-[0-9a-f]+-\*\)",
                     first), first
    expected = ALL_REDUCE / rate
    assert shaped == pytest.approx(expected, rel=0.25)
    unshaped, _ = _all_reduce_s(None)
    assert unshaped < shaped / 3
    assert not [n for n in link.namespaces() if n.startswith("hotjax-")]


def test_a_stopped_launcher_leaves_no_namespace_and_a_stale_one_goes_at_the_next_launch():
    """Its processes are pinned as without --link; SIGTERM to the launcher ends them and it."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid no longer alive, as a launcher killed outright leaves
    stale = f"hotjax-{dead.pid}-abc123"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    started = ("import os, time; print('up', *sorted(os.sched_getaffinity(0)), flush=True); "
               "time.sleep(300)")
    launcher = subprocess.Popen([sys.executable, "-c", (
        "import sys; from hotjax import launch; "
        f"sys.exit(launch.run([sys.executable, '-c', {started!r}], 2, 1, link=20e6))")],
        stdout=subprocess.PIPE, text=True)
    lines = [launcher.stdout.readline() for _ in range(3)]
    assert sum("up" in line for line in lines) == 2, lines
    # Pinned through `ip netns exec`, which execs the program in the pinned process.
    pinned = sorted(line.split()[2:] for line in lines if "up" in line)
    assert pinned == sorted([str(c) for c in sorted(share)] for share in launch.core_shares(2))
    ours = [n for n in link.namespaces() if n.startswith(f"hotjax-{launcher.pid}-")]
    switch = next(n for n in ours if n.count("-") == 2)
    assert sorted(ours) == [switch, f"{switch}-0", f"{switch}-1"]
    assert stale not in link.namespaces()
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(30) == 128 + signal.SIGTERM
    time.sleep(0.1)
    assert not [n for n in link.namespaces() if n.startswith("hotjax-")]


def test_a_profile_link_scales_by_the_cached_profile_of_the_same_launch(tmp_path, monkeypatch):
    """a800-4x8's 25 GB/s between nodes x (this machine's 1e11 x 0.5 FLOP/s per device / the
    A800's 312e12 x 0.52) = 7.7 MB/s."""
    monkeypatch.setenv("HOTJAX_CACHE", str(tmp_path))
    from hotjax.planning.cost import COST_MODEL_VERSION

    cached = tmp_path / "profiles" / f"cost-model-v{COST_MODEL_VERSION}" / "cpu-2x2.toml"
    cached.parent.mkdir(parents=True)
    cached.write_text("[device]\npeak_tflops = 0.1\n[efficiency]\nmatmul = 0.5\n")
    rate, how = link.resolve("a800-4x8:inter", 2, 1)
    assert rate == pytest.approx(25e9 * 0.05e12 / (312e12 * 0.52))
    assert how == ("a800-4x8 inter-node 25 GB/s x (this machine's 50.0 GFLOP/s / 162.2 TFLOP/s "
                   "per device: model matmuls, cached profile cpu-2x2.toml) = 7.7 MB/s")


def test_without_tc_nothing_starts(monkeypatch, capsys):
    monkeypatch.setattr(link.shutil, "which", lambda tool: None if tool == "tc" else tool)
    with pytest.raises(UserError, match=r"--link needs iproute2's tc, not found") as raised:
        launch.run([sys.executable, "-c", "raise SystemExit(3)"], 2, 1, link=20e6)
    assert "\n" not in str(raised.value) and capsys.readouterr().out == ""


def test_each_process_has_its_own_namespace_address_and_host_name_on_one_switch():
    """Three processes: a switch and three namespaces, in each this machine's host name naming
    that process's address (gloo binds to and announces it); all gone on leaving."""
    with link.shaped_network(20e6, 3) as network:
        assert network.nodes == tuple(f"{network.switch}-{i}" for i in range(3))
        assert set(network.nodes) | {network.switch} <= set(link.namespaces())
        for node, address in zip(network.nodes, network.addresses, strict=True):
            named = subprocess.run(["ip", "netns", "exec", node, "getent", "hosts",
                                    socket.gethostname()], capture_output=True, text=True)
            assert named.stdout.split()[0] == address
            shaped = subprocess.run(["ip", "netns", "exec", node, "tc", "qdisc", "show", "dev",
                                     "eth0"], capture_output=True, text=True).stdout
            assert "tbf" in shaped and "rate 160Mbit" in shaped, shaped
    assert not [n for n in link.namespaces() if n.startswith(network.switch)]
    assert not any(os.path.exists(f"/etc/netns/{n}") for n in network.nodes)
