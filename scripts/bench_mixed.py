"""The headline: real tokens/s of a hot-switched strategy table against static strategies, on
the same mini-batches of mixed-length documents, under a per-device memory budget.

    python scripts/bench_mixed.py [--json] [--steps 2] [--device-memory MiB] [--table T.toml]

A mini-batch is the next documents of the shuffled corpus, in order, up to `--batch-tokens`
real tokens (each document BOS + tokens + EOS, truncated to the context). Every method gets
exactly those documents, laid out its own way in rows sized once to hold every mini-batch of
the run (fixed shapes compile once), and builds its batches from the same token arrays:
  hot     the table: each length bucket's rows under its own strategy, switched between;
  (a)     the best single strategy that fits the longest bucket (of `--candidates` whose
          memory fits, the fastest on one micro-step of real rows; by CPU time on simulated
          devices), documents packed first-fit-decreasing into full-context rows;
  (b)     that strategy, one document per full-context row, padded;
  (c)     the table's buckets and rows, every bucket under that one strategy.
The memory budget is enforced with XLA's memory analysis of every compiled micro-step (its
planned peak, plus the home state and gradient sum that stay resident beside it); a bucket
holding more rows than fit runs them as several micro-steps of equal shape, whose gradients
accumulate before the one update, as a static trainer with gradient accumulation would. All
four run on `HotTrainer` (one optimizer update per mini-batch); its table repeats a bucket
once per micro-step, since the trainer runs each table bucket as one compiled call. Reported:
median wall and CPU seconds per step, real tokens/s, the ratios hot/a, hot/b, hot/c and c/a,
and per bucket the trainer's own tokens, compute, switch seconds and bytes switched.
On simulated CPU devices the timings compare methods on this machine only (DESIGN §8).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hotjax.cli import start_jax  # noqa: E402  (imports no JAX: the device count comes first)
from models.errors import UserError  # noqa: E402

MiB = 2**20
CONTEXT = 4096
# Real tokens per mini-batch (at most): about 3 full-context rows, so that a default run takes
# minutes on 2 cores.
BATCH_TOKENS = 12288
# The budget, per device. On `tiny` in fp32 one 4096-token row needs ~3.7 GiB on one device
# (attention materialises 8 heads x 4096^2 fp32 probabilities per layer on CPU, kept for the
# backward pass), so data=8, which must hold a whole row per device, does not fit, while an
# 8-way sharded strategy holds two such rows in ~0.95 GiB. 8 devices x 1 GiB also stays within
# a 24 GiB host's memory.
DEVICE_MEMORY_MIB = 1024
# The table's shorter buckets; the longest (the context) takes the best single strategy.
SHORT_BUCKETS = ((512, "data=8,rules=dp"), (2048, "data=2,tensor=4,rules=megatron-sp"))
CANDIDATES = "; ".join((
    "data=8,rules=dp", "tensor=8,rules=megatron-sp",
    "fsdp=2,context=4,rules=context,balanced=true", "context=8,rules=context,balanced=true",
    "data=2,tensor=4,rules=megatron-sp",
))
MAX_MICRO_STEPS = 9  # the trainer searches all orders of its buckets: 9! is still quick
READ_CHUNK = 64  # documents tokenized at once
METHODS = ("hot", "a", "b", "c")
DESCRIBE = {"hot": "hot-switched table", "a": "one strategy, packed to context",
            "b": "one strategy, padded to context", "c": "one strategy, the table's buckets"}


@dataclasses.dataclass(frozen=True)
class Part:
    """One bucket of a method: `rows` rows of `max_len` tokens under `strategy`, run as
    `micro_steps` compiled calls of `rows // micro_steps` rows each."""

    max_len: int
    strategy: object  # sharding.strategy.Strategy
    rows: int
    micro_steps: int = 1

    @property
    def micro_rows(self) -> int:
        return self.rows // self.micro_steps


# -- documents and mini-batches -------------------------------------------------------------

def sequences(corpus, tokenizer, context: int, seed: int) -> Iterator[np.ndarray]:
    """Training sequences (BOS, tokens, EOS; truncated to the context) of the corpus in a
    seeded shuffled order."""
    from hotjax.data import to_sequences

    order = np.random.default_rng(seed).permutation(corpus.num_documents)
    for start in range(0, len(order), READ_CHUNK):
        texts = [corpus.read(int(i)) for i in order[start:start + READ_CHUNK]]
        for ids in tokenizer.encode_batch(texts):
            yield from to_sequences(ids, tokenizer, context, "truncate")


def pack_buckets(lengths: Sequence[int], parts: Sequence[Part]) -> list[list[list[int]]] | None:
    """Sequence indices per row of each bucket, as `BucketedBatches` packs a window: each
    bucket first-fit-decreasing, its fullest rows kept, what is left filling room in longer
    buckets' rows. None if a sequence finds no room."""
    from hotjax.data import bucket_of, pack_rows
    from hotjax.data.packing import first_fit

    max_lens = [p.max_len for p in parts]
    by_bucket: list[list[int]] = [[] for _ in parts]
    for i, n in enumerate(lengths):
        by_bucket[bucket_of(n, max_lens)].append(i)
    waiting: list[int] = []
    packed_buckets = []
    for part, own in zip(parts, by_bucket, strict=True):
        packed = [[own[j] for j in row] for row in pack_rows([lengths[i] for i in own],
                                                             part.max_len)]
        packed.sort(key=lambda row: -sum(lengths[i] for i in row))
        rows = packed[:part.rows] + [[] for _ in range(part.rows - len(packed))]
        left = [i for row in packed[part.rows:] for i in row]
        free = [part.max_len - sum(lengths[i] for i in row) for row in rows]
        for i, r in zip(waiting, first_fit([lengths[i] for i in waiting], free), strict=True):
            (rows[r] if r >= 0 else left).append(i)
        waiting = sorted(left)
        packed_buckets.append(rows)
    return None if waiting else packed_buckets


def draw_minibatches(stream: Iterator[np.ndarray], count: int, tokens: int
                     ) -> list[list[np.ndarray]]:
    """`count` mini-batches: the next sequences in stream order up to `tokens` real tokens;
    the sequence that would pass it starts the next mini-batch. No method shapes the mix."""
    minibatches, seq = [], next(stream)
    for _ in range(count):
        chosen, total = [], 0
        while total + len(seq) <= tokens:
            chosen.append(seq)
            total += len(seq)
            seq = next(stream)
        minibatches.append(chosen)
    return minibatches


def rows_needed(minibatches: Sequence[Sequence[np.ndarray]], max_lens: Sequence[int]
                ) -> dict[str, list[int]]:
    """The rows each method needs to hold every mini-batch: per bucket of the table (hot and
    (c)), packed into full-context rows (a), one row per sequence (b)."""
    from hotjax.data import bucket_of, pack_rows

    needs = {"table": [0] * len(max_lens), "a": [0], "b": [0]}
    for seqs in minibatches:
        lengths = [len(s) for s in seqs]
        for b, max_len in enumerate(max_lens):
            own = [n for n in lengths if bucket_of(n, max_lens) == b]
            needs["table"][b] = max(needs["table"][b], len(pack_rows(own, max_len)))
        needs["a"][0] = max(needs["a"][0], len(pack_rows(lengths, max_lens[-1])))
        needs["b"][0] = max(needs["b"][0], len(seqs))
    return needs


def layouts(seqs: Sequence[np.ndarray], plans: dict[str, list[Part]]
            ) -> dict[str, list[list[list[int]]]]:
    """Each method's rows of sequence indices: hot and (c) share the table's bucketed packing,
    (a) packs into full-context rows, (b) gives each sequence a row."""
    from hotjax.data import pack_rows

    lengths = [len(s) for s in seqs]
    bucketed = pack_buckets(lengths, plans["hot"])
    packed = pack_rows(lengths, plans["a"][0].max_len)
    if bucketed is None or len(packed) > plans["a"][0].rows or len(seqs) > plans["b"][0].rows:
        raise RuntimeError("a mini-batch does not fit the rows sized for it")
    return {"hot": bucketed, "c": bucketed, "a": [packed], "b": [[[i] for i in range(len(seqs))]]}


def method_minibatch(seqs: Sequence[np.ndarray], rows: list[list[list[int]]],
                     parts: Sequence[Part], pad_id: int):
    """The method's MiniBatch: one Batch per micro-step, bucket by bucket."""
    from hotjax.data import Batch, MiniBatch, assemble

    micro = []
    for part, bucket_rows in zip(parts, rows, strict=True):
        batch = assemble([[seqs[i] for i in row] for row in bucket_rows], part.rows,
                         part.max_len, pad_id)
        for k in range(part.micro_steps):
            cut = slice(k * part.micro_rows, (k + 1) * part.micro_rows)
            micro.append(Batch(batch.tokens[cut], batch.segment_ids[cut], batch.positions[cut]))
    return MiniBatch(tuple(micro), (), epoch=0, carried=0)


# -- memory ----------------------------------------------------------------------------------

def per_device_bytes(shapes, shardings) -> int:
    """Bytes one device holds of a tree of arrays laid out by `shardings` (the gradient sum;
    `Trainer.state_bytes` counts the params and optimizer state)."""
    import jax

    sizes = jax.tree.map(lambda s, sh: math.prod(sh.shard_shape(s.shape)) * s.dtype.itemsize,
                         shapes, shardings)
    return sum(jax.tree.leaves(sizes))


class Memory:
    """The budget, checked on compiled micro-steps: XLA's peak of the step plus what stays
    resident beside it (the home strategy's fp32 params and Adam moments, the gradient sum)."""

    def __init__(self, budget: int, config, optim, devices):
        self.budget, self.config, self.optim, self.devices = budget, config, optim, devices
        self._steps: dict = {}

    def step(self, strategy):
        from hotjax.hot import BucketStep

        if strategy not in self._steps:
            self._steps[strategy] = BucketStep(self.config, strategy, self.devices)
        return self._steps[strategy]

    def resident(self, home) -> int:
        from hotjax.train import get_trainer
        from models.llama import abstract_params

        trainer = get_trainer(self.config, self.optim, home, tuple(self.devices))
        return trainer.state_bytes() + per_device_bytes(abstract_params(self.config),
                                                        trainer.grad_shardings)

    def peak(self, strategy, rows: int, max_len: int) -> int:
        from hotjax.train import step_memory

        return step_memory(self.step(strategy).compiled((rows, max_len)))["peak"]

    def max_rows(self, strategy, max_len: int, upto: int, home) -> int | None:
        """The most rows (a multiple of the batch shards, not past `upto` rounded up to one)
        that one micro-step of `strategy` holds within the budget; None if not even one batch
        shard's rows fit. Peaks grow about linearly in rows: the fewest rows are measured, the
        most estimated to fit are compiled and checked, then fewer until they fit."""
        shards = self.step(strategy).layout.batch_shards
        resident = self.resident(home)
        smallest = self.peak(strategy, shards, max_len)
        if smallest + resident > self.budget:
            return None
        rows = shards * max(1, min(-(-upto // shards), (self.budget - resident) // smallest))
        while rows > shards and self.peak(strategy, rows, max_len) + resident > self.budget:
            rows -= shards
        return rows

    def fit(self, strategy, max_len: int, upto: int, home) -> tuple[int, int]:
        """`strategy`'s batch shards and `max_rows`, or a UserError if nothing fits."""
        most = self.max_rows(strategy, max_len, upto, home)
        if most is None:
            raise UserError(f"bucket {max_len} under {strategy}: one batch shard's rows need "
                            f"more than {self.budget / MiB:,.0f} MiB per device: raise "
                            f"--device-memory or choose a more sharded strategy")
        return self.step(strategy).layout.batch_shards, most


def split(rows: int, shards: int, most: int) -> int:
    """The fewest equal micro-steps of a multiple of `shards` rows, at most `most` each."""
    return next(k for k in range(-(-rows // most), rows + 1)
                if rows % k == 0 and rows // k % shards == 0)


# -- the run -----------------------------------------------------------------------------

def timed(fn: Callable, *args) -> tuple[object, float, float]:
    """`fn(*args)` once it is ready, its wall seconds, and the CPU seconds this process spent
    on it. On a shared machine CPU seconds are the steadier measure of work: other processes'
    load lengthens the wall time, not this process's CPU time."""
    import jax

    wall, cpu = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - wall, time.process_time() - cpu


def choose_strategy(candidates, memory: Memory, probe_rows: Callable[[int], object],
                    context: int, rows: int, console) -> tuple[object, list[dict]]:
    """The fastest candidate whose micro-step fits the budget at the context: by real tokens
    per second of one micro-step on real packed rows, per CPU second on simulated devices."""
    import jax

    report = []
    for strategy in candidates:
        entry = {"strategy": str(strategy)}
        try:
            micro_rows = memory.max_rows(strategy, context, rows, strategy)
        except UserError as e:
            report.append(entry | {"status": "invalid", "error": str(e)})
            continue
        entry["peak_bytes"] = memory.peak(strategy, memory.step(strategy).layout.batch_shards,
                                          context)
        entry["resident_bytes"] = memory.resident(strategy)
        if micro_rows is None:
            report.append(entry | {"status": "over budget"})
            console.print(f"candidate {strategy}: over budget "
                          f"({(entry['peak_bytes'] + entry['resident_bytes']) / MiB:,.0f} MiB "
                          f"for {memory.step(strategy).layout.batch_shards} row(s))",
                          markup=False)
            continue
        peak = memory.peak(strategy, micro_rows, context)
        step = memory.step(strategy)
        batch = probe_rows(micro_rows)
        arrays = step.batch_arrays(batch)
        compute = jax.device_put(
            jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), _compute_shapes(memory.config)),
            step.param_shardings)
        # One run: on CPU a first run costs no more than the next ones (measured).
        _, wall, cpu = timed(step.compiled(arrays["tokens"].shape), compute, arrays)
        entry |= {"status": "fits", "micro_rows": micro_rows, "micro_peak_bytes": peak,
                  "wall_s": wall, "cpu_s": cpu, "tokens_per_s": batch.real_tokens / wall,
                  "tokens_per_cpu_s": batch.real_tokens / cpu}
        console.print(f"candidate {strategy}: {micro_rows} rows/micro-step, peak "
                      f"{(peak + entry['resident_bytes']) / MiB:,.0f} MiB, "
                      f"{entry['tokens_per_s']:,.0f} tokens/s, "
                      f"{entry['tokens_per_cpu_s']:,.0f} tokens/CPU-s", markup=False)
        report.append(entry)
    speed = "tokens_per_cpu_s" if memory.devices[0].platform == "cpu" else "tokens_per_s"
    fitting = [(e[speed], s) for e, s in zip(report, candidates, strict=True)
               if e["status"] == "fits"]
    if not fitting:
        raise UserError(f"no candidate strategy fits {memory.budget / MiB:,.0f} MiB per device "
                        f"at {context} tokens: raise --device-memory or add candidates")
    best = max(fitting, key=lambda f: f[0])[1]
    for e in report:
        e["chosen"] = e["strategy"] == str(best)
    return best, report


def _compute_shapes(config):
    import jax

    from models.llama import abstract_params

    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, config.dtype),
                        abstract_params(config))


def split_parts(parts: list[Part], memory: Memory, home, round_up: bool = False
                ) -> list[Part]:
    """Each part split into the fewest equal micro-steps that fit the budget; if that takes
    too many for the trainer and `round_up` allows, rows rounded up to whole micro-steps."""
    out, fallback = [], []
    for p in parts:
        shards, most = memory.fit(p.strategy, p.max_len, p.rows, home)
        out.append(dataclasses.replace(p, micro_steps=split(p.rows, shards, most)))
        rows = -(-p.rows // most) * most
        fallback.append(dataclasses.replace(p, rows=rows, micro_steps=rows // most))
    if round_up and sum(p.micro_steps for p in out) > MAX_MICRO_STEPS:
        out = fallback
    if sum(p.micro_steps for p in out) > MAX_MICRO_STEPS:
        raise UserError(f"{sum(p.micro_steps for p in out)} micro-steps per mini-batch (more "
                        f"than {MAX_MICRO_STEPS}): lower --batch-tokens or raise "
                        f"--device-memory")
    return out


def micro_table(parts: Sequence[Part], source: str):
    from sharding.table import Bucket, StrategyTable

    # Buckets repeat for micro-steps: the trainer runs them as given, in its planned order.
    return StrategyTable(tuple(Bucket(p.max_len, p.strategy) for p in parts
                               for _ in range(p.micro_steps)), source)


def build_plans(buckets, static, needs: dict[str, list[int]], memory: Memory, config
                ) -> dict[str, list[Part]]:
    """Each method's parts: the rows it needs, rounded up to split over its strategy (the
    table's over both strategies that run them), in micro-steps that fit the budget."""
    from hotjax.hot import most_sharded
    from sharding.table import Bucket, StrategyTable

    def shards(strategy) -> int:
        return memory.step(strategy).layout.batch_shards

    def rows(need: int, *strategies) -> int:
        multiple = math.lcm(*(shards(s) for s in strategies))
        return -(-max(need, 1) // multiple) * multiple

    context = buckets[-1][0]
    hot_home = most_sharded(StrategyTable(tuple(Bucket(n, s) for n, s in buckets)), config)
    table_rows = [rows(need, s, static) for (_, s), need in zip(buckets, needs["table"],
                                                                strict=True)]
    return {
        "hot": split_parts([Part(n, s, r) for (n, s), r in zip(buckets, table_rows,
                                                               strict=True)], memory, hot_home),
        "c": split_parts([Part(n, static, r) for (n, _), r in zip(buckets, table_rows,
                                                                  strict=True)], memory, static),
        **{m: split_parts([Part(context, static, rows(needs[m][0], static))], memory, static,
                          round_up=True) for m in ("a", "b")},
    }


def build_trainer(method: str, parts: Sequence[Part], memory: Memory, config, optim, devices,
                  switch_method: str):
    """The method's trainer, its micro-steps compiled and each checked against the budget."""
    from hotjax.hot import HotTrainer
    from hotjax.train import step_memory

    trainer = HotTrainer(config, optim, micro_table(parts, DESCRIBE[method]), devices,
                         switch_method=switch_method)
    resident = memory.resident(trainer.home.layout.strategy)
    checks = []
    for part in parts:
        steps = [b for b, t in zip(trainer.buckets, trainer.table.buckets, strict=True)
                 if t.max_len == part.max_len]
        peaks = {step_memory(s.compiled((part.micro_rows, part.max_len)))["peak"] for s in steps}
        checks.append({"max_len": part.max_len, "peak_bytes": max(peaks),
                       "resident_bytes": resident})
        if max(peaks) + resident > memory.budget:
            raise UserError(f"{DESCRIBE[method]}: bucket {part.max_len} under {part.strategy} "
                            f"needs {(max(peaks) + resident) / MiB:,.0f} MiB per device, over "
                            f"the budget: raise --device-memory")
    return trainer, checks


def run(args: argparse.Namespace, console) -> dict:

    from hotjax.data import assemble, load_tokenizer, open_corpus, pack_rows
    from hotjax.data.buckets import estimated_lengths
    from hotjax.optim import OptimConfig
    from hotjax.run import select_devices
    from models.llama import padded_vocab, preset
    from sharding.strategy import Strategy
    from sharding.table import load_table

    context, batch_tokens = args.context, args.batch_tokens
    if batch_tokens < context:
        raise UserError(f"--batch-tokens {batch_tokens}: a mini-batch must hold at least one "
                        f"sequence of the context ({context})")
    if args.steps < 1 or args.warmup < 1:
        raise UserError("--steps and --warmup: run at least one of each")
    devices = select_devices(None)
    dtype = args.compute_dtype or ("float32" if devices[0].platform == "cpu" else "bfloat16")
    corpus = open_corpus(None)
    tokenizer = load_tokenizer(None, corpus)
    config = dataclasses.replace(preset(args.model), vocab_size=padded_vocab(tokenizer.vocab_size),
                                 compute_dtype=dtype, max_seq_len=context)
    total_steps = args.warmup + args.steps
    optim = OptimConfig(warmup_steps=1, total_steps=total_steps + 1)
    memory = Memory(args.device_memory * MiB, config, optim, devices)
    rows_a = -(-batch_tokens // context)

    # Candidates are timed on real rows: documents (not those of the run) packed to the context.
    probe_stream = sequences(corpus, tokenizer, context, args.seed + 1)
    probe_seqs = [next(probe_stream) for _ in range(8 * rows_a)]
    probe_packed = sorted(pack_rows([len(s) for s in probe_seqs], context),
                          key=lambda row: -sum(len(probe_seqs[i]) for i in row))

    def probe_rows(n: int):
        return assemble([[probe_seqs[i] for i in row] for row in probe_packed[:n]], n, context,
                        tokenizer.pad_id)

    texts = [args.strategy] if args.strategy else args.candidates.split(";")
    candidates = [Strategy.parse(t.strip()) for t in texts if t.strip()]
    static, candidate_report = choose_strategy(candidates, memory, probe_rows, context, rows_a,
                                               console)
    console.print(f"(a) strategy: {static}", markup=False)

    if args.table:
        table = load_table(args.table)
        if table.max_len != context:
            raise UserError(f"{table.source}: its longest bucket is {table.max_len}, not the "
                            f"context ({context}): pass --context {table.max_len}")
        buckets = [(b.max_len, b.strategy) for b in table.buckets]
    else:
        buckets = [(n, Strategy.parse(s)) for n, s in SHORT_BUCKETS if n < context]
        buckets.append((context, static))
    # The same documents for every method, in stream order; each method gets the rows it
    # needs to hold every mini-batch of the run (its shapes are fixed: they compile once).
    minibatches = draw_minibatches(sequences(corpus, tokenizer, context, args.seed),
                                   total_steps, batch_tokens)
    plans = build_plans(buckets, static, rows_needed(minibatches, [n for n, _ in buckets]),
                        memory, config)
    inputs = {m: [method_minibatch(seqs, layouts(seqs, plans)[m], plans[m], tokenizer.pad_id)
                  for seqs in minibatches] for m in METHODS}
    for step, seqs in enumerate(minibatches):
        real = {sum(b.real_tokens for b in inputs[m][step].buckets) for m in METHODS}
        if real != {sum(map(len, seqs))}:
            raise RuntimeError(f"mini-batch {step}: methods hold different tokens: {real}")

    trainers, checks = {}, {}
    for m in METHODS:
        started = time.perf_counter()
        trainers[m], checks[m] = build_trainer(m, plans[m], memory, config, optim, devices,
                                               args.switch_method)
        console.print(f"{m}: {len(trainers[m].buckets)} micro-steps, home "
                      f"{trainers[m].home.layout.strategy}; built and compiled in "
                      f"{time.perf_counter() - started:.1f} s", markup=False)

    states = {m: trainers[m].init(0) for m in METHODS}
    records: dict[str, list[dict]] = {m: [] for m in METHODS}
    for step in range(total_steps):
        for m in METHODS:  # interleaved, so that a busy moment of the machine hits all alike
            (states[m], metrics, done), seconds, cpu = timed(trainers[m].step, states[m],
                                                             inputs[m][step])
            records[m].append({"seconds": seconds, "cpu_s": cpu, "loss": metrics["loss"],
                               "real_tokens": sum(b.real_tokens for b in inputs[m][step].buckets),
                               "buckets": [dataclasses.asdict(b) for b in done]})
            warm = " (warm-up)" if step < args.warmup else ""
            console.print(f"step {step + 1}/{total_steps}{warm} {m}: {seconds:.2f} s "
                          f"({cpu:.1f} CPU-s), loss {metrics['loss']:.5f}")
    homes = {m: str(t.home.layout.strategy) for m, t in trainers.items()}
    corpus_lengths = estimated_lengths(corpus, tokenizer, context, "truncate")
    return summarize(args, devices, config, memory, static, candidate_report, plans,
                     minibatches, records, checks, homes, corpus_lengths)


# -- the report ----------------------------------------------------------------------------

def summarize(args, devices, config, memory: Memory, static, candidates: list[dict],
              plans: dict[str, list[Part]], minibatches, records: dict[str, list[dict]],
              checks: dict[str, list[dict]], homes: dict[str, str],
              corpus_lengths: np.ndarray) -> dict:
    import jax

    from hotjax.data import bucket_of

    median = statistics.median
    methods = {}
    for m in METHODS:
        steps = records[m][args.warmup:]
        seconds, cpu = [r["seconds"] for r in steps], [r["cpu_s"] for r in steps]
        by_part = []
        for part, check in zip(plans[m], checks[m], strict=True):
            mine = [[b for b in r["buckets"] if b["max_len"] == part.max_len] for r in steps]
            by_part.append({
                "max_len": part.max_len, "strategy": str(part.strategy), "rows": part.rows,
                "micro_steps": part.micro_steps, "micro_rows": part.micro_rows, **check,
                **{key: median([sum(b[field] for b in bs) for bs in mine])
                   for key, field in (("real_tokens", "tokens"), ("compute_s", "compute_s"),
                                      ("switch_s", "switch_s"),
                                      ("switched_bytes", "switched_bytes"))},
            })
        switch = [sum(b["switch_s"] for b in r["buckets"]) for r in steps]
        methods[m] = {
            "description": DESCRIBE[m], "home": homes[m],
            "padded_tokens_per_step": sum(p.rows * p.max_len for p in plans[m]),
            "step_s": median(seconds), "step_s_each": seconds,
            "cpu_s": median(cpu), "cpu_s_each": cpu,
            "compute_s": median([sum(b["compute_s"] for b in r["buckets"]) for r in steps]),
            "switch_s": median(switch),
            "switch_share": median([s / t for s, t in zip(switch, seconds, strict=True)]),
            "tokens_per_s": median([r["real_tokens"] / r["seconds"] for r in steps]),
            "tokens_per_cpu_s": median([r["real_tokens"] / r["cpu_s"] for r in steps]),
            "losses": [r["loss"] for r in records[m]],
            "warmup_s": [r["seconds"] for r in records[m][:args.warmup]],
            "buckets": by_part,
        }

    def ratios(key: str) -> dict[str, float]:
        v = {m: methods[m][key] for m in METHODS}
        return {"hot/a": v["hot"] / v["a"], "hot/b": v["hot"] / v["b"],
                "hot/c": v["hot"] / v["c"], "c/a": v["c"] / v["a"]}

    max_lens = [p.max_len for p in plans["hot"]]

    def shares(lengths: Sequence[int]) -> list[float]:
        tokens = np.bincount([bucket_of(n, max_lens) for n in lengths], weights=lengths,
                             minlength=len(max_lens))
        return (tokens / tokens.sum()).tolist()

    drawn = [len(seq) for seqs in minibatches for seq in seqs]
    return {
        "machine": {"platform": devices[0].platform, "device_kind": devices[0].device_kind,
                    "devices": len(devices), "cpus": os.cpu_count(),
                    "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "jax": jax.__version__,
                    "load_average": os.getloadavg()},
        "simulated": devices[0].platform == "cpu",
        "model": {"preset": args.model, "params": config.num_params(),
                  "vocab_size": config.vocab_size, "compute_dtype": config.compute_dtype},
        "context": args.context, "batch_tokens": args.batch_tokens,
        "device_memory_bytes": memory.budget, "warmup_steps": args.warmup, "steps": args.steps,
        "switch_method": args.switch_method, "seed": args.seed,
        "static_strategy": str(static), "candidates": candidates,
        "minibatches": {"documents": [len(seqs) for seqs in minibatches],
                        "real_tokens": [r["real_tokens"] for r in records["hot"]],
                        "token_share_by_bucket": shares(drawn),
                        "corpus_token_share_by_bucket": shares(corpus_lengths)},
        "methods": methods,
        "ratios": ratios("tokens_per_s"), "ratios_cpu": ratios("tokens_per_cpu_s"),
        "max_loss_difference": max(abs(x - y) for m in METHODS
                                   for x, y in zip(methods[m]["losses"],
                                                   methods["hot"]["losses"], strict=True)),
    }


def print_report(report: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    m, model, methods = report["machine"], report["model"], report["methods"]
    budget = report["device_memory_bytes"] / MiB

    cands = Table(title=f"(a): candidate strategies at {report['context']} tokens, budget "
                        f"{budget:,.0f} MiB per device", title_justify="left")
    for column in ("strategy", "status", "rows/micro-step", "peak MiB", "tokens/s",
                   "tokens/CPU-s", "chosen"):
        cands.add_column(column, justify="left" if column in ("strategy", "status") else "right")
    for c in report["candidates"]:
        fits = c["status"] == "fits"
        peak = c.get("micro_peak_bytes", c.get("peak_bytes"))
        cands.add_row(escape(_short(c["strategy"])),
                      escape(c["status"] + (f": {c['error']}" if "error" in c else "")),
                      str(c["micro_rows"]) if fits else "-",
                      f"{(peak + c['resident_bytes']) / MiB:,.0f}" if peak else "-",
                      f"{c['tokens_per_s']:,.0f}" if fits else "-",
                      f"{c['tokens_per_cpu_s']:,.0f}" if fits else "-",
                      "yes" if c["chosen"] else "")
    console.print(cands)
    console.print("peak: XLA's memory analysis of one micro-step (the gradients of its rows) "
                  "plus the resident home state (fp32 params, Adam moments, gradient sum); over "
                  "budget: at its fewest rows, one per batch shard. One timed run each.",
                  highlight=False)

    table = Table(title=f"{model['preset']} ({model['params'] / 1e6:.2f}M params, "
                        f"{model['compute_dtype']}), context {report['context']}, "
                        f"{report['batch_tokens']:,}-token mini-batches of the same documents; "
                        f"medians of {report['steps']} steps after {report['warmup_steps']} "
                        f"warm-up", title_justify="left")
    for column in ("method", "rows x len (micro-steps) strategy", "pad %", "step s", "CPU s",
                   "switch s", "switch %", "tokens/s", "tokens/CPU-s"):
        table.add_column(column, justify="left" if column.startswith(("method", "rows"))
                         else "right")
    real = statistics.median(report["minibatches"]["real_tokens"])
    for name, r in methods.items():
        shape = "\n".join(f"{b['rows']}x{b['max_len']} ({b['micro_steps']}) "
                          f"{_short(b['strategy'])}" for b in r["buckets"])
        table.add_row(f"{name}: {r['description']}", escape(shape),
                      f"{100 * (1 - real / r['padded_tokens_per_step']):.0f}",
                      f"{r['step_s']:.2f}", f"{r['cpu_s']:.1f}", f"{r['switch_s']:.3f}",
                      f"{100 * r['switch_share']:.1f}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['tokens_per_cpu_s']:,.0f}")
        table.add_section()
    console.print(table)
    for key, what in (("ratios", "tokens/s"), ("ratios_cpu", "tokens/CPU-s")):
        console.print(f"ratios of real {what}: " + ", ".join(
            f"{k} = {v:.2f}" for k, v in report[key].items()), style="bold", highlight=False)

    per = Table(title="per bucket: hot vs (c), medians per step", title_justify="left")
    for column in ("bucket", "hot strategy", "rows (micro)", "real tokens", "hot compute s",
                   "hot switch s", "switched MiB", "peak MiB", "(c) compute s", "(c) switch s"):
        per.add_column(column, justify="left" if "strategy" in column else "right")
    for h, c in zip(methods["hot"]["buckets"], methods["c"]["buckets"], strict=True):
        per.add_row(f"<= {h['max_len']}", escape(_short(h["strategy"])),
                    f"{h['rows']} ({h['micro_steps']})", f"{h['real_tokens']:,.0f}",
                    f"{h['compute_s']:.2f}", f"{h['switch_s']:.3f}",
                    f"{h['switched_bytes'] / MiB:.2f}",
                    f"{(h['peak_bytes'] + h['resident_bytes']) / MiB:,.0f}",
                    f"{c['compute_s']:.2f}", f"{c['switch_s']:.3f}")
    console.print(per)
    mb, hot = report["minibatches"], methods["hot"]

    def pct(values: list[float]) -> str:
        return "/".join(f"{100 * v:.0f}" for v in values)

    console.print(
        f"hot: switching takes {hot['switch_s']:.3f} s of a {hot['step_s']:.2f} s step "
        f"({100 * hot['switch_share']:.1f}%); home {_short(hot['home'])}; switch method "
        f"{report['switch_method']}. switched MiB: weights into the bucket plus its gradients "
        f"home, summed over devices. Mini-batches: {mb['documents']} documents, "
        f"{mb['real_tokens']} real tokens; token share by bucket {pct(mb['token_share_by_bucket'])}"
        f"% (corpus: {pct(mb['corpus_token_share_by_bucket'])}%). Largest loss difference "
        f"between methods: {report['max_loss_difference']:.1e}.", highlight=False)
    console.print(f"hardware: {m['devices']} {m['platform']} device(s) ({m['device_kind']}), "
                  f"{m['cpus']} CPUs, {m['processor']}, jax {m['jax']}, load average "
                  f"{' '.join(f'{x:.1f}' for x in m['load_average'])}", highlight=False)
    console.print(f"memory budget: {budget:,.0f} MiB per device, checked on every compiled "
                  f"micro-step (XLA peak + resident home state). pad %: padding share of the "
                  f"rows run. CPU s: this process's CPU time, steadier than wall time on a "
                  f"shared machine.", highlight=False)
    if report["simulated"]:
        console.print("[yellow]simulated CPU devices:[/] 8 fake devices share the machine's "
                      "cores, so these timings compare methods on this machine only and do not "
                      "model a GPU cluster (DESIGN §8): no link is slower than memory, and "
                      "attention costs the full masked square (no kernel skips masked blocks).")


def _short(strategy: str) -> str:
    return strategy.removesuffix(" [auto]")


def _console(stderr: bool):
    from rich.console import Console

    # Into a file or a pipe, rich would wrap the tables at 80 columns.
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 150)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document to stdout (the tables go to stderr)")
    parser.add_argument("--model", default="tiny", help="model preset (default: %(default)s)")
    parser.add_argument("--context", type=int, default=CONTEXT,
                        help="the longest bucket, in tokens (default: %(default)s)")
    parser.add_argument("--batch-tokens", type=int, default=BATCH_TOKENS,
                        help="real tokens per mini-batch, at most (default: %(default)s)")
    parser.add_argument("--device-memory", type=int, default=DEVICE_MEMORY_MIB, metavar="MiB",
                        help="per-device memory budget (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps first (default: %(default)s)")
    parser.add_argument("--table", help="a strategy table (TOML) for the hot run; default: "
                        + ", ".join(f"<={n}: {s}" for n, s in SHORT_BUCKETS)
                        + ", <=context: the strategy chosen for (a)")
    parser.add_argument("--candidates", default=CANDIDATES,
                        help="strategies for (a), separated by ';'")
    parser.add_argument("--strategy", help="use this strategy for (a) instead of choosing")
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"),
                        help="default: float32 on CPU, bfloat16 on accelerators")
    parser.add_argument("--switch-method", default="auto", choices=("auto", "plan", "device_put"))
    parser.add_argument("--seed", type=int, default=0, help="document order")
    args = parser.parse_args(argv)

    progress = _console(stderr=True)
    try:
        start_jax(8)
        report = run(args, progress)
    except UserError as e:
        print(f"bench_mixed: error: {e}", file=sys.stderr)
        return 2
    print_report(report, progress if args.json else _console(stderr=False))
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
