"""What does HSDP's all-reduce across replicas cost? Full sharding against HSDP, the all-reduce
overlapped with the last backward (the engine's steady state) and deferred to clipping (its first
step, forced here on every step), interleaved step by step on the same model, data and ranks.

Per engine: the step time (median, min, max over the measured steps), and from the engine itself
the all-reduces across replicas per step, their elements, and their busy time (the Recorder: from
issue to completion of each all-reduce; on CUDA, events on the comm stream); the JSON also holds
every rank's bytes per collective kind in the last step (``schedule.counted``), which
tests/jobs/test_bench_smoke.py compares with benchmarks/model_scaling.py's byte model.

CPU, gloo (spawns its own ranks; world 4 as 2 replicas x 2):
    python benchmarks/bench_hsdp.py
GPUs (two nodes, or one node split in two replicas to see the mechanics):
    torchrun --nproc-per-node 8 benchmarks/bench_hsdp.py --device cuda --replicas 2 --preset llama3-1b --seq 2048
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _common import finish_distributed, init_distributed, launch, make_batch, make_model, md_table, resolve_run, versions, write_json

import yafsdp
from yafsdp.trace import Recorder

ENGINES = ("full", "hsdp", "hsdp-deferred")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--world", type=int, default=4, help="CPU ranks to spawn (without torchrun)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--preset", default=None, help="default: cpu-6x256 on CPU, llama3-1b on GPU")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--accum", type=int, default=2, help="backward calls per optimizer step")
    ap.add_argument("--warmup", type=int, default=2, help="steps not measured (the first is always deferred)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default="runs/bench_hsdp.json")
    ap.add_argument("--md", default=None)
    a = ap.parse_args(argv)
    a.argv = " ".join(sys.argv)
    return a


def _engine(name, a, dev, mesh):
    model = make_model(a.preset, dev)
    mixed = torch.bfloat16 if dev.type == "cuda" else None
    kw = {} if name == "full" else dict(mesh=mesh)
    m = yafsdp.YaFSDP(model, param_dtype=mixed, **kw)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, foreach=dev.type == "cuda")
    m.recorder = Recorder()
    return m, opt


def _bytes(model, before: dict, deferred: bool) -> dict:
    """Bytes this rank put into each collective kind during the step (the engine's own counts), the
    small group left out as benchmarks/model_scaling.py leaves it out (the deferred all-reduce is one
    run over every grad shard, the small group's included)."""
    got = {"gather": 0, "reduce": 0, "all_reduce": 0}
    for (kind, unit), n in model.schedule.counted.items():
        if unit != "small_group":
            got[kind] += n - before.get((kind, unit), 0)
    if deferred and model.small is not None and model.small.flat_param is not None:
        got["all_reduce"] -= model.small.flat_param.numel() * 4
    return got


def run(a):
    gpu = resolve_run(a)
    dev = init_distributed(a.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % a.replicas:
        raise SystemExit(f"bench_hsdp.py: --replicas {a.replicas} does not divide the world size {world}")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (a.replicas, world // a.replicas), mesh_dim_names=("replicate", "shard"))
    engines = {n: _engine(n, a, dev, mesh) for n in ENGINES}
    vocab = engines["full"][0].config.vocab_size
    times = {n: [] for n in ENGINES}
    per_step = {n: [] for n in ENGINES}
    for step in range(a.warmup + a.steps):
        for name in ENGINES:
            model, opt = engines[name]
            rs = model._rt.replica_sync
            if name == "hsdp-deferred":
                rs.expected = None  # no prediction: the all-reduce waits for clip_grad_norm_
            before = dict(rs.stats)
            counted = dict(model.schedule.counted)
            n_iv = len(model.recorder.intervals)
            if gpu:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for micro in range(a.accum):
                batch = make_batch(step * a.accum + micro, rank, a.batch, a.seq, vocab, dev)
                (model(**batch).loss / a.accum).backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            if gpu:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            dist.barrier()
            if step < a.warmup:
                continue
            times[name].append(dt)
            ivs = [iv for iv in model.recorder.finish()[n_iv:] if iv.kind == "all_reduce"]
            per_step[name].append(dict(
                all_reduces=rs.stats["all_reduces"] - before["all_reduces"],
                elements=rs.stats["elements"] - before["elements"],
                busy=sum(iv.duration for iv in ivs),
                bytes=_bytes(model, counted, name == "hsdp-deferred"),
            ))
    # every rank's bytes of the last measured step (tests/jobs/test_bench_smoke.py checks the byte model with them)
    every = [None] * world
    dist.all_gather_object(every, {n: per_step[n][-1]["bytes"] for n in ENGINES})
    if rank != 0:
        finish_distributed()
        return
    full = statistics.median(times["full"])
    rows = []
    for name in ENGINES:
        ts, ps = times[name], per_step[name]
        med = statistics.median(ts)
        rows.append([name, 1e3 * med, 1e3 * min(ts), 1e3 * max(ts), statistics.median(p["all_reduces"] for p in ps),
                     statistics.median(p["elements"] for p in ps),
                     1e3 * statistics.median(p["busy"] for p in ps), med / full])
    header = ["engine", "step ms (median)", "min", "max", "all-reduces / step", "elements all-reduced / step",
              "all-reduce busy ms / step", "step / full"]
    table = md_table(header, rows)
    shape = f"{a.replicas} replicas x {world // a.replicas} shard ranks"
    setup = (f"bench_hsdp: {a.preset}, batch {a.batch} x seq {a.seq} per rank, accumulation {a.accum}, world {world} "
             f"({shape} for hsdp), {'bf16' if gpu else 'fp32'}, {a.steps} measured steps after {a.warmup}, "
             "engines interleaved step by step")
    text = "\n".join([setup, "", table])
    print(text, flush=True)
    result = dict(kind="bench_hsdp", command=a.argv, setup=setup, versions=versions(dev), table=table,
                  times=times, per_step=per_step, bytes=every)
    if a.json:
        write_json(a.json, result)
    if a.md:
        from bench_step import write_md

        write_md(a.md, result, text)
    finish_distributed()


def main(argv=None):
    a = parse(argv)
    launch(run, a, a.world)


if __name__ == "__main__":
    main()
