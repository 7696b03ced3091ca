"""What does a hot switch cost? For every ordered pair of a strategy table's strategies: the
transfer scheduler's bytes, max per-device send and lower bound, its planning time, and the planned
executor's time beside `jax.device_put`'s, measured side by side on the model's parameters.

    python scripts/bench_switch.py [--json] [--quick] [--table TABLE.toml] [--model tiny|small]
                                   [--devices N] [--processes N]

Every scheduled switch's result is checked against `device_put`'s, bit for bit. On a CPU-only
machine it runs on 8 simulated devices (`--devices N`: N); `--devices-per-node` puts node
boundaries between them for the transfer scheduler (the executor's timings do not depend on
it). Times are medians of `--repeats` runs after one untimed run that compiles. `--quick`:
the `tiny` model, two strategies of the table (two switches), two repeats (a smoke test).

`--processes N` runs the benchmark as N processes joined by JAX's runtime, as `hotjax launch`
starts them (on CPU, 8/N simulated devices each), so every switch crosses a real process
boundary. There the scheduler's executor does not run (its transfers stay within a process):
`jax.device_put` is timed, its result checked shard by shard, and the scheduler's two sender
choices, same-node-first (greedy) and first-owner, are compared by the bytes their plans send
across the boundary and their estimated seconds at the topology's bandwidths.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

from quick_option import in_one_line  # beside this script

from hotjax.targets import quiet_plugin_without_a_driver

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before JAX is imported, below
quiet_plugin_without_a_driver()  # no CUDA plugin's lines on a machine without a driver

# The 3-bucket table, for 8 devices.
DEFAULT_TABLE = {"bucket": [{"max_len": 256, "mesh": {"data": 8}},
                            {"max_len": 1024, "mesh": {"data": 2, "tensor": 4}},
                            {"max_len": 4096, "mesh": {"fsdp": 2, "context": 4}}]}
# Its two buckets that hold sharded weights: from data=8, which holds everything everywhere,
# no switch moves a byte.
QUICK_TABLE = {"bucket": DEFAULT_TABLE["bucket"][1:]}
QUICK = {"model": "tiny", "repeats": 2}


def bench_pair(values, source, target, topology, repeats: int) -> dict:
    import jax
    import numpy as np

    from hotjax.sharding.switch import scheduled_switch, switch

    src = jax.device_put(values, source)
    started = time.perf_counter()
    planned = scheduled_switch(src, target, topology)
    build_s = time.perf_counter() - started
    equal = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(
        jax.tree.leaves(switch(src, target, "scheduled", topology)),
        jax.tree.leaves(switch(src, target, "device_put")), strict=True))

    def once(method: str) -> float:
        started = time.perf_counter()
        jax.block_until_ready(switch(src, target, method, topology))
        return time.perf_counter() - started

    seconds: dict[str, list[float]] = {"scheduled": [], "device_put": []}
    for _ in range(repeats):  # alternating, so both see the same machine
        for method in seconds:
            seconds[method].append(once(method))
    plan = planned.plan
    return {**plan.summary(), "pieces": sum(len(t.pieces) for t in plan.transfers),
            "equal": equal, "build_s": build_s,
            "executor_s": statistics.median(seconds["scheduled"]),
            "device_put_s": statistics.median(seconds["device_put"]),
            "executor_runs_s": seconds["scheduled"], "device_put_runs_s": seconds["device_put"]}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document to stdout (the table goes to stderr)")
    parser.add_argument("--table", help="a strategy table (TOML); default: the built-in one")
    parser.add_argument("--model", default="small", choices=("tiny", "small"))
    parser.add_argument("--dtype", default=None, help="of the switched params (default: the "
                                                      "model's compute dtype)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--devices", type=int, help="use N devices: on CPU, N simulated ones "
                        "(split over --processes), on accelerators the first N (default: 8 "
                        "simulated CPUs, or all accelerators)")
    parser.add_argument("--devices-per-node", type=int, default=None,
                        help="simulated node size for the transfer scheduler (default: all "
                        "local devices)")
    parser.add_argument("--quick", action="store_true", help="a smoke test of seconds: the "
                        "tiny model, two strategies of the default table, two repeats")
    parser.add_argument("--processes", type=int, default=1, help="run as this many processes "
                        "and measure switches across their boundary (default: %(default)s)")
    for flag in ("--coordinator", "--num-processes", "--process-id", "--report"):
        parser.add_argument(flag, help=argparse.SUPPRESS)  # set for the launched processes
    args = parser.parse_args(argv)
    if args.quick:  # its settings, under any flag given
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.devices is not None:
        from hotjax.config import at_least

        at_least("--devices", args.devices, args.processes)
        if args.coordinator is None:  # a launched process has its share set by the launch
            os.environ["JAX_NUM_CPU_DEVICES"] = str(args.devices)
    if args.processes > 1 and args.coordinator is None:
        return _launch(sys.argv[1:] if argv is None else argv, args)
    if args.coordinator is not None:
        from hotjax import distributed

        distributed.initialize(args.coordinator, int(args.num_processes), int(args.process_id))

    import jax
    import numpy as np

    from hotjax.compile_cache import enable_compilation_cache
    from hotjax.models.llama import abstract_params, param_axes, preset
    from hotjax.sharding.strategy import Layout, fit_to_model
    from hotjax.sharding.table import load_table, parse_table
    from hotjax.sharding.transfers import Topology
    from hotjax.startup import select_devices

    enable_compilation_cache()
    devices = jax.devices() if args.processes > 1 else select_devices(args.devices)
    if args.table:
        table = load_table(args.table)
    else:
        table = parse_table(QUICK_TABLE if args.quick else DEFAULT_TABLE, "built-in table")
    table.check_devices(len(devices))
    config = preset(args.model)
    if args.model == "tiny":
        config = dataclasses.replace(config, vocab_size=256)  # splits over every mesh size
    dtype = np.dtype(args.dtype or config.compute_dtype)
    processes = args.processes > 1
    topology = (Topology.of_processes(devices) if processes
                else Topology(args.devices_per_node or len(devices)))
    rng = np.random.default_rng(0)
    values = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(dtype),
                          abstract_params(config))
    layouts = {str(s): Layout(fit_to_model(s, config)[0], devices) for s in table.strategies}
    shardings = {name: layout.param_shardings(param_axes(config), abstract_params(config))
                 for name, layout in layouts.items()}
    measure = bench_across_processes if processes else bench_pair
    pairs = []
    for source, target in itertools.permutations(shardings, 2):
        pairs.append({"source": source, "target": target,
                      **measure(values, shardings[source], shardings[target], topology,
                                args.repeats)})
    report = {
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "jax": jax.__version__,
                    "device_kind": devices[0].device_kind,
                    "devices": f"{len(devices)} {devices[0].platform}",
                    "devices_per_node": topology.devices_per_node,
                    "processes": jax.process_count()},
        "model": args.model, "params": config.num_params(), "dtype": str(dtype),
        "param_bytes": config.num_params() * dtype.itemsize, "table": table.source,
        "repeats": args.repeats, "pairs": pairs,
    }
    from rich.console import Console

    # With --json the table goes to stderr; into a file or a pipe, rich would wrap it at 80.
    console = Console(stderr=args.json or processes, width=150, quiet=jax.process_index() > 0)
    (_print_across_processes if processes else _print)(report, console)
    if args.report and jax.process_index() == 0:
        Path(args.report).write_text(json.dumps(report, indent=1))
    elif args.json and not processes:
        print(json.dumps(report, indent=1))
    return 0 if all(p["equal"] for p in pairs) else 1


def _launch(argv: list[str], args: argparse.Namespace) -> int:
    """This benchmark as `args.processes` processes; process 0's report printed here."""
    import tempfile

    from hotjax import launch

    cpu_devices = int(os.environ["JAX_NUM_CPU_DEVICES"])
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        code = launch.run([sys.executable, str(Path(__file__).resolve()), *argv, "--report",
                           str(report)], args.processes,
                          max(cpu_devices // args.processes, 1), out=sys.stderr)
        if code == 0 and args.json:
            print(report.read_text())
    return code


def bench_across_processes(values, source, target, topology, repeats: int) -> dict:
    """One switch whose layouts span several processes: `jax.device_put` timed and checked on
    every local shard, and the plans of both sender choices on the job's topology."""
    import jax
    import numpy as np

    from hotjax.sharding.switch import switch
    from hotjax.sharding.transfers import schedule_transfers, sharding_switches

    src = jax.device_put(values, source)
    moved = switch(src, target, "device_put")
    equal = all(np.array_equal(np.asarray(shard.data), value[shard.index])
                for x, value in zip(jax.tree.leaves(moved), jax.tree.leaves(values), strict=True)
                for shard in x.addressable_shards)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(switch(src, target, "device_put"))
        seconds.append(time.perf_counter() - started)
    arrays = sharding_switches(src, target)
    plans = {policy: schedule_transfers(arrays, topology, policy)
             for policy in ("greedy", "first-owner")}
    return {"equal": equal, "device_put_s": statistics.median(seconds),
            "device_put_runs_s": seconds,
            **{policy: plan.summary()
               for policy, plan in plans.items()}}


def _print(report: dict, console: Console) -> None:
    from rich.table import Table

    m = report["machine"]
    table = Table(title=f"hot switches of {report['model']} ({report['params'] / 1e6:.1f}M params, "
                        f"{report['dtype']}, {report['param_bytes'] / 2**20:.1f} MiB) on "
                        f"{m['devices']} devices, {m['devices_per_node']} a node "
                        f"({m['cpus']} CPUs); medians of {report['repeats']}")
    columns = ("source", "target", "moved MiB", "inter-node", "max send", "bound", "msgs",
               "plan ms", "build s", "executor ms", "device_put ms", "ratio")
    for column in columns:
        table.add_column(column, justify="left" if column in ("source", "target") else "right")
    mib = 2**20
    for p in report["pairs"]:
        table.add_row(_short(p["source"]), _short(p["target"]), f"{p['bytes_moved'] / mib:.2f}",
                      f"{p['inter_node_bytes'] / mib:.2f}", f"{p['max_send'] / mib:.2f}",
                      f"{p['lower_bound'] / mib:.2f}", str(p["messages"]),
                      f"{p['plan_s'] * 1e3:.1f}", f"{p['build_s']:.1f}",
                      f"{p['executor_s'] * 1e3:.1f}", f"{p['device_put_s'] * 1e3:.1f}",
                      f"{p['executor_s'] / p['device_put_s']:.2f}"
                      + ("" if p["equal"] else " [red]WRONG[/]"))
    console.print(table)
    console.print("inter-node, max send and bound (the lower bound on the max send) in MiB; "
                  "plan ms: the transfer scheduler alone; build s: scheduling and compiling the "
                  "executor's "
                  "programs; ratio: executor / device_put (WRONG: its result differs from "
                  "device_put's)")
    console.print(f"hardware: {m['devices']} devices ({m['device_kind']}), {m['cpus']} CPUs, "
                  f"{m['processor']}, python {m['python']}, jax {m['jax']}", highlight=False)


def _print_across_processes(report: dict, console: Console) -> None:
    from rich.table import Table

    m = report["machine"]
    table = Table(title=f"hot switches of {report['model']} ({report['params'] / 1e6:.1f}M params, "
                        f"{report['dtype']}, {report['param_bytes'] / 2**20:.1f} MiB) across "
                        f"{m['processes']} processes of {m['devices_per_node']} {m['device_kind']}"
                        f" devices ({m['cpus']} CPUs); medians of {report['repeats']}")
    columns = ("source", "target", "moved MiB", "across, same-node-first", "across, first-owner",
               "est. µs, same-node-first", "est. µs, first-owner", "device_put ms")
    for column in columns:
        table.add_column(column, justify="left" if column in ("source", "target") else "right")
    mib = 2**20
    for p in report["pairs"]:
        greedy, first = p["greedy"], p["first-owner"]
        table.add_row(_short(p["source"]), _short(p["target"]),
                      f"{greedy['bytes_moved'] / mib:.2f}",
                      f"{greedy['inter_node_bytes'] / mib:.2f}",
                      f"{first['inter_node_bytes'] / mib:.2f}",
                      f"{greedy['estimated_s'] * 1e6:.1f}", f"{first['estimated_s'] * 1e6:.1f}",
                      f"{p['device_put_s'] * 1e3:.1f}" + ("" if p["equal"] else " [red]WRONG[/]"))
    console.print(table)
    console.print("across: MiB the plan sends from one process to another; est. µs: the plan's "
                  "time at 400 GB/s within a process and 200 GB/s between them (the paper's "
                  "NVLink and InfiniBand); device_put ms: measured (WRONG: a shard differs). "
                  "The scheduler's executor runs within one process, so it is not timed here.")
    console.print(f"hardware: {m['devices']} devices ({m['device_kind']}), {m['cpus']} CPUs, "
                  f"{m['processor']}, python {m['python']}, jax {m['jax']}", highlight=False)


def _short(strategy: str) -> str:
    return strategy.removesuffix(" [auto]")


if __name__ == "__main__":
    sys.exit(in_one_line("bench_switch", main))
