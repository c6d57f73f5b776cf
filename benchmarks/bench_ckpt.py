"""How long a checkpoint save blocks the training loop: synchronous (save_checkpoint) against
asynchronous (AsyncSaver), and the step time around them, in one run.

CPU, gloo, world 2 (spawns its own ranks), a ~105M-parameter Llama (cpu-6x256 widened):
    python benchmarks/bench_ckpt.py --md benchmarks/results/ckpt_async_cpu_<date>.md
GPU (one rank per device):
    torchrun --nproc-per-node 2 benchmarks/bench_ckpt.py --device cuda --preset llama3-1b --hidden 0

Each round: ``--steps`` timed steps with no save (baseline), a synchronous save then ``--steps``
steps, an asynchronous save then ``--steps`` steps (the write runs meanwhile), then the wait for
that write (not counted as blocked: a job trains on instead). Rounds alternate sync / async so
that both see the same machine. Blocked = the save call's wall time on the slowest rank, after a
barrier. The goal: async blocked <= 0.25 x sync blocked.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _common import finish_distributed, init_distributed, launch, make_batch, versions  # this script's directory is on sys.path

import yafsdp
from yafsdp import checkpoint as ckpt
from yafsdp.presets import build_llama, llama_config


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--preset", default="cpu-6x256")
    ap.add_argument("--hidden", type=int, default=768, help="override hidden_size (0: the preset's)")
    ap.add_argument("--intermediate", type=int, default=2048, help="override intermediate_size (0: the preset's)")
    ap.add_argument("--layers", type=int, default=8, help="override num_hidden_layers (0: the preset's)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after each save (and as baseline)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--root", default="runs/bench_ckpt", help="where the checkpoints go (removed at the end)")
    ap.add_argument("--md", default=None, help="write a markdown report here")
    a = ap.parse_args(argv)
    a.argv = " ".join(sys.argv)
    return a


def _overrides(a) -> dict:
    over = {}
    if a.hidden:
        over.update(hidden_size=a.hidden, num_attention_heads=max(1, a.hidden // 64),
                    num_key_value_heads=max(1, a.hidden // 64))
    if a.intermediate:
        over["intermediate_size"] = a.intermediate
    if a.layers:
        over["num_hidden_layers"] = a.layers
    return over


def _timed(dev, fn):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dt = torch.tensor(time.perf_counter() - t0)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's
    return float(dt), out


def run(a):
    dev = init_distributed(a.device)
    rank = dist.get_rank()
    over = _overrides(a)
    model = yafsdp.YaFSDP(build_llama(a.preset, device="cpu", **over), device=dev)
    n_params = sum(i.numel for i in model.shard_info())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = llama_config(a.preset).vocab_size
    step_no = [0]

    def step():
        b = make_batch(step_no[0], rank, a.batch, a.seq, vocab, dev)
        model(**b).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_no[0] += 1

    def steps():
        return [_timed(dev, step)[0] for _ in range(a.steps)]

    for _ in range(2):  # warm-up; creates the optimizer state
        step()
    saver = ckpt.AsyncSaver(model, opt)
    root = os.path.join(a.root, "ck")
    rows = dict(baseline=[], sync_blocked=[], after_sync=[], async_blocked=[], during_async=[], async_drain=[],
                background_s=[])
    for r in range(a.rounds):
        rows["baseline"] += steps()
        t, _ = _timed(dev, lambda: ckpt.save_checkpoint(root, step_no[0], model, opt, keep=1))
        rows["sync_blocked"].append(t)
        rows["after_sync"] += steps()
        t, staged = _timed(dev, lambda: saver.save(root, step_no[0], keep=1))
        rows["async_blocked"].append(t)
        t_bg = time.perf_counter()
        rows["during_async"] += steps()
        t, _ = _timed(dev, saver.wait)
        rows["async_drain"].append(t)
        rows["background_s"].append(time.perf_counter() - t_bg)
    saver.close()
    if rank == 0:
        path = ckpt.latest_checkpoint(root)
        ck_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        med = {k: statistics.median(v) for k, v in rows.items()}
        cores = os.cpu_count()
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        lines = [
            f"bench_ckpt: {a.preset} {over}, {n_params / 1e6:.1f}M parameters, world {dist.get_world_size()}, "
            f"{dev.type}, batch {a.batch} x seq {a.seq}; {a.rounds} rounds x {a.steps} steps per phase",
            f"checkpoint: {ck_bytes / 2**20:.0f} MiB on disk; staging copy {staged.staging_bytes / 2**20:.0f} MiB of "
            f"host memory on rank 0",
            "",
            "| what | median s | all |",
            "|---|---|---|",
        ]
        for k, v in rows.items():
            lines.append(f"| {k} | {med[k]:.3f} | {', '.join(f'{x:.3f}' for x in v)} |")
        ratio = med["async_blocked"] / med["sync_blocked"]
        verdict = "met" if ratio <= 0.25 else "NOT met"
        lines += ["", f"async blocked / sync blocked = {ratio:.3f} (goal <= 0.25: {verdict})",
                  f"step time: baseline {med['baseline']:.3f} s, after a sync save {med['after_sync']:.3f} s, "
                  f"during the async write {med['during_async']:.3f} s "
                  f"({med['during_async'] / med['baseline']:.2f}x baseline)"]
        text = "\n".join(lines)
        print(text, flush=True)
        if a.md:
            v = versions()
            with open(a.md, "w") as f:
                f.write(f"# bench_ckpt -- {dev.type} ({cores} cores), {time.strftime('%Y-%m-%d')}\n\n")
                f.write(f"Command:\n\n```\n{a.argv}\n```\n\n")
                f.write(f"Versions: {v}. Load average (1 min) at the end: {load}.\n\n")
                f.write(text + "\n")
        shutil.rmtree(a.root, ignore_errors=True)
    finish_distributed()


if __name__ == "__main__":
    args = parse()
    launch(run, args, args.world)
