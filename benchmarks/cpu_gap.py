"""Where yafsdp's step time at gloo world 2 goes, against DDP's: the engine's own work or its communication.

    python benchmarks/cpu_gap.py [--vocab 2048] [--engines yafsdp-z3,yafsdp-z2,ddp] [--steps 20]

Every engine runs the same model and batches twice, interleaved step by step: as it is, and with its
collectives replaced by local copies ("local"): yafsdp's weight all-gathers and gradient reduce-scatters
become copies of this rank's own rows (the exchanges it waits for at once, the sharded lookup's and the
direct exchange of an outsized gradient, stay real), DDP runs under ``no_sync()``. The losses of
the local runs are meaningless; their times are what an engine costs without the network. Per step and
rank it takes the wall time, the main thread's CPU time (also by phase: forward, backward, optimizer step
with ``zero_grad``), the process's CPU time (gloo's threads too) and,
for yafsdp, the time the main thread sat in the waits for gathers, for reduce-scatters and in the exchanges
made at once; the table gives the medians over the measured steps, averaged over the ranks. The
decomposition is clean only where the engine makes no exchange at once (e.g. ``--vocab 2048``, where the
embedding and the head are not outsized); elsewhere the local runs still wait for those, and say so.

Reading it (docs/benchmarks.md, "CPU findings"): the local rows' main-thread CPU difference is the engine's
own work against DDP's (hooks, the copy of the gradients into the grad buffer, the folds, its own rows
copied into a gathered buffer); the difference between an engine's two rows is what its communication costs
it, in wall time. On 2 cores with one compute thread per rank no core is idle for gloo's threads, so
communication is not hidden behind compute: it shows as wall time (waits) and as CPU time taken from the
other rank.

A diagnostic, not a goal check: ``bench_step.py`` measures the goals.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import Counter

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    build_engine, finish_distributed, init_distributed, launch, make_batch, md_table, versions, write_json,
)


# What each measured step records (seconds per step; the report prints milliseconds).
FIELDS = ("wall", "main_cpu", "process_cpu", "waited_gather", "waited_reduce", "waited_exchange",
          "forward_cpu", "backward_cpu", "optimizer_cpu")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-6x256")
    ap.add_argument("--vocab", type=int, default=None, help="override the preset's vocabulary size")
    ap.add_argument("--engines", default="yafsdp-z3,ddp",
                    help="comma-separated: yafsdp-z3, yafsdp-z2 (and their +gathered) and ddp")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--world", type=int, default=2, help="spawned gloo ranks (the local copies assume 2)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / world)")
    ap.add_argument("--json", default=None, help="also write the table's figures here")
    return ap.parse_args(argv)


# ------------------------------------------------------------------ local stand-ins of the collectives
def _local_all_gather(output, shard, group, async_op=True, local=False, cast=False):
    """This rank's slot of the output gets its shard (the copy a real gather makes too; ``cast``: the
    world-1 casting copy, which copy_ makes as well); the other slots keep what they held (the weights
    are stale: the local runs' losses mean nothing)."""
    from yafsdp.comm.collectives import _local

    output.view(-1).chunk(output.numel() // shard.numel())[dist.get_rank(group)].copy_(shard.view(-1))
    return _local(async_op)


def _local_reduce_scatter(output, full, group, async_op=True, local=False):
    """This rank's row of the input, as if no other rank contributed."""
    from yafsdp.comm.collectives import _local

    output.view(-1).copy_(full.view(-1).chunk(full.numel() // output.numel())[dist.get_rank(group)])
    return _local(async_op)


def _local_all_to_all(output, full, group, async_op=True):
    from yafsdp.comm.collectives import _local

    output.view(-1).copy_(full.view(-1))
    return _local(async_op)


@contextlib.contextmanager
def _no_comm(engine):
    """yafsdp: the weight gathers and gradient reduce-scatters of its gloo schedule swapped for the
    local stand-ins above; the exchanges it waits for at once (the sharded lookup's, the direct
    exchange of an outsized gradient) stay real, as they carry ids and row counts the engine checks.
    DDP: ``no_sync()`` (its compute alone: no all-reduce, no bucket copies)."""
    if engine.name == "ddp":
        with engine.model.no_sync():
            yield
        return
    import yafsdp.comm.gloo as gloo

    saved = gloo.all_gather, gloo.reduce_scatter, gloo.all_to_all
    stand_ins = {_local_all_gather: saved[0], _local_reduce_scatter: saved[1], _local_all_to_all: saved[2]}
    now = gloo.HandleSchedule._now

    def real_now(self, kind, what, collective, *rest):
        return now(self, kind, what, stand_ins.get(collective, collective), *rest)

    gloo.all_gather, gloo.reduce_scatter, gloo.all_to_all = _local_all_gather, _local_reduce_scatter, _local_all_to_all
    gloo.HandleSchedule._now = real_now
    try:
        yield
    finally:
        gloo.all_gather, gloo.reduce_scatter, gloo.all_to_all = saved
        gloo.HandleSchedule._now = now


def _timed_waits(waits: Counter):
    """yafsdp's waits on its gloo handles timed into ``waits``: "gather" and "reduce-scatter" for the
    weight gathers and gradient reduces, "exchange" for the exchanges waited for at once (the whole call)."""
    import yafsdp.comm.gloo as gloo

    original, now = gloo._wait, gloo.HandleSchedule._now  # (every name this tool swaps is read first: a rename fails)
    inside = []

    def timed(work, what, unit):
        t = time.perf_counter()
        try:
            original(work, what, unit)
        finally:
            if not inside:
                waits[what] += time.perf_counter() - t

    def timed_now(self, *args):
        t = time.perf_counter()
        inside.append(1)
        try:
            return now(self, *args)
        finally:
            inside.pop()
            waits["exchange"] += time.perf_counter() - t

    gloo._wait = timed
    gloo.HandleSchedule._now = timed_now


# ------------------------------------------------------------------ the run (every rank)
def run(a):
    dev = init_distributed("cpu")
    rank = dist.get_rank()
    names = a.engines.split(",")
    for n in names:
        if n != "ddp" and not n.startswith(("yafsdp-z3", "yafsdp-z2")):
            raise SystemExit(f"cpu_gap: engine {n!r} is not one this tool measures (yafsdp-z3, yafsdp-z2, ddp)")
    engines = {n: build_engine(n, a.preset, dev, False, vocab=a.vocab) for n in names}
    from yafsdp.presets import llama_config

    vocab = a.vocab or llama_config(a.preset).vocab_size
    waits: Counter = Counter()
    _timed_waits(waits)
    rows = {(n, m): [] for n in names for m in ("comm", "local")}
    for i in range(a.warmup + a.steps):
        for n in names:
            for mode in ("comm", "local"):
                e = engines[n]
                batch = make_batch(i, rank, a.batch, a.seq, vocab, dev)
                ctx = _no_comm(e) if mode == "local" else contextlib.nullcontext()
                dist.barrier()
                waits.clear()
                w0, m0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
                marks = [m0]
                with ctx:
                    e.step(batch, lambda: marks.append(time.thread_time()))  # after forward, after backward
                w1, m1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
                marks.append(m1)
                if i >= a.warmup:
                    rows[(n, mode)].append(dict(
                        wall=w1 - w0, main_cpu=m1 - m0, process_cpu=p1 - p0, waited_gather=waits["gather"],
                        waited_reduce=waits["reduce-scatter"], waited_exchange=waits["exchange"],
                        forward_cpu=marks[1] - marks[0], backward_cpu=marks[2] - marks[1],
                        optimizer_cpu=marks[3] - marks[2]))
    med = {k: {f: 1e3 * statistics.median(r[f] for r in v) for f in FIELDS} for k, v in rows.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, med)
    if rank == 0:
        report(a, every, names, vocab)
    engines.clear()
    finish_distributed()


def report(a, every, names, vocab):
    world = len(every)
    mean = {k: {f: sum(r[k][f] for r in every) / world for f in FIELDS} for k in every[0]}
    print(f"cpu_gap: preset {a.preset} (vocab {vocab}), world {world}, batch {a.batch} x seq {a.seq} per rank, fp32, "
          f"{a.warmup} warm-up + {a.steps} measured steps; load average before {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores")
    print("medians over the steps, mean over the ranks (ms per step)\n")
    table = []
    for n in names:
        for mode in ("comm", "local"):
            r = mean[(n, mode)]
            waited = "" if n == "ddp" else " / ".join(f"{r[f]:.1f}" for f in ("waited_gather", "waited_reduce",
                                                                           "waited_exchange"))
            table.append([n, mode, f"{r['wall']:.1f}", f"{r['main_cpu']:.1f}",
                          f"{r['forward_cpu']:.1f} / {r['backward_cpu']:.1f} / {r['optimizer_cpu']:.1f}",
                          f"{r['process_cpu']:.1f}", f"{r['process_cpu'] - r['main_cpu']:.1f}", waited])
    print(md_table(["engine", "collectives", "wall", "main-thread CPU", "of it: forward / backward / optimizer",
                    "process CPU", "other threads CPU", "waited: gathers / reduces / exchanges"], table))
    if a.json:
        write_json(a.json, {"args": vars(a), "vocab": vocab, "world": world, "versions": versions(),
                            "load_before": os.getloadavg()[0], "unit": "ms per step",
                            "rows": {n: {m: mean[(n, m)] for m in ("comm", "local")} for n in names}})
    if "ddp" in names:
        d, dl = mean[("ddp", "comm")], mean[("ddp", "local")]
        for n in names:
            if n == "ddp":
                continue
            y, yl = mean[(n, "comm")], mean[(n, "local")]
            own = {f: yl[f] - dl[f] for f in FIELDS}  # the local rows' differences
            print(f"\n{n} against ddp: wall {y['wall'] - d['wall']:+.1f} ms ({y['wall'] / d['wall']:.3f}x); of it")
            print(f"  the engine's own work (local main-thread CPU):   {own['main_cpu']:+.1f} ms "
                  f"(forward {own['forward_cpu']:+.1f}, backward {own['backward_cpu']:+.1f}, "
                  f"optimizer {own['optimizer_cpu']:+.1f})")
            print(f"  local wall beyond that (skew, sync points):      {own['wall'] - own['main_cpu']:+.1f} ms")
            print(f"  communication (comm - local wall): {y['wall'] - yl['wall']:.1f} ms against ddp's "
                  f"{d['wall'] - dl['wall']:.1f}: {(y['wall'] - yl['wall']) - (d['wall'] - dl['wall']):+.1f} ms")
            if yl["waited_exchange"] > 0.05:
                print(f"  (its local run still waited {yl['waited_exchange']:.1f} ms in exchanges made at once -- the "
                      "sharded lookup's, the direct exchange of an outsized gradient --, which the lines above "
                      "count as the engine's)")


def main(argv=None):
    a = parse(argv)
    launch(run, a, a.world)


if __name__ == "__main__":
    main()
