"""One AdamW step over one flat fp32 shard: yafsdp.FusedAdamW against torch's AdamW.

    python benchmarks/bench_optimizer.py                       # CPU, 24M elements
    python benchmarks/bench_optimizer.py --numel 4000000 --rounds 5
    python benchmarks/bench_optimizer.py --device cuda         # GPU (build with the CUDA extension)

Competitors, in one interleaved run on the same inputs (each has its own param and state; they
share one gradient), with the bytes per parameter each must move at the least:

    yafsdp FusedAdamW                 28 B  read p g m v, write p m v (fp32)
    yafsdp FusedAdamW + copy-out      30 B  ... and write the bf16 all-gather input
    torch AdamW foreach               28 B  (the floor; it moves more)
    torch AdamW fused                 28 B
    torch AdamW fused + cast          34 B  fused step, then p.to(bf16) as a second pass (4 + 2)
    yafsdp cast_ fp32->bf16            6 B  the engine's cast pass (yafsdp.kernels.cast_)
    torch copy_ fp32->bf16             6 B
    copy fp32                          8 B  dst.copy_(src): the memory bandwidth reference

Timing: warm-up steps first, then `--rounds` rounds; in each round every competitor runs
`--steps` steps back to back (the order rotates between rounds) and the round's time per step is
kept; the table shows the median over rounds, and a speed-up is the median over rounds of the
two competitors' time ratio within the round. On CUDA, CUDA events around each competitor's steps.
GB/s = bytes per parameter x numel / time. Not a timed test: results go to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from yafsdp import kernels, shards
from yafsdp.optim.adamw import FusedAdamW

HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@dataclass
class Competitor:
    name: str
    bytes_per_param: int
    step: Callable[[], None]
    times: list[float] = field(default_factory=list)  # seconds per step, one per round

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def _param(init: torch.Tensor, grad: torch.Tensor) -> torch.nn.Parameter:
    p = torch.nn.Parameter(init.clone())
    p.grad = grad
    return p


def build(numel: int, device: torch.device, copy_dtype: torch.dtype, skip: set[str]) -> list[Competitor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    init = torch.randn(numel, generator=g).to(device)
    grad = (torch.randn(numel, generator=g) * 1e-3).to(device)
    out: list[Competitor] = []

    def add(name, bytes_per_param, step):
        if not any(s in name for s in skip):
            out.append(Competitor(name, bytes_per_param, step))

    p1 = _param(init, grad)
    opt1 = FusedAdamW([p1], **HYPER)
    add("yafsdp FusedAdamW", 28, opt1.step)

    p2 = _param(init, grad)
    shards.set_copy_out(p2, torch.empty(numel, dtype=copy_dtype, device=device), lambda: None)
    opt2 = FusedAdamW([p2], **HYPER)
    add("yafsdp FusedAdamW + copy-out", 30, opt2.step)

    if "foreach" not in skip:
        p3 = _param(init, grad)
        opt3 = torch.optim.AdamW([p3], foreach=True, **HYPER)
        add("torch AdamW foreach", 28, opt3.step)

    p4 = _param(init, grad)
    opt4 = torch.optim.AdamW([p4], fused=True, **HYPER)
    add("torch AdamW fused", 28, opt4.step)

    p5 = _param(init, grad)
    opt5 = torch.optim.AdamW([p5], fused=True, **HYPER)
    copy5 = torch.empty(numel, dtype=copy_dtype, device=device)

    def fused_then_cast():
        opt5.step()
        copy5.copy_(p5.detach())

    add("torch AdamW fused + cast", 34, fused_then_cast)

    src = init.clone()
    low = torch.empty(numel, dtype=copy_dtype, device=device)
    short = {torch.bfloat16: "bf16", torch.float16: "fp16"}[copy_dtype]
    add(f"yafsdp cast_ fp32->{short}", 6, lambda: kernels.cast_(low, src))
    low2 = torch.empty(numel, dtype=copy_dtype, device=device)
    add(f"torch copy_ fp32->{short}", 6, lambda: low2.copy_(src))
    dst = torch.empty_like(src)
    add("copy fp32", 8, lambda: dst.copy_(src))
    return out


def measure(competitors: list[Competitor], device: torch.device, warmup: int, steps: int, rounds: int) -> None:
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for c in competitors:
        for _ in range(warmup):
            c.step()
    sync()
    for r in range(rounds):
        k = r % len(competitors)
        for c in competitors[k:] + competitors[:k]:  # rotate the order between rounds
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(steps):
                    c.step()
                end.record()
                end.synchronize()
                c.times.append(start.elapsed_time(end) / 1e3 / steps)
            else:
                t0 = time.perf_counter()
                for _ in range(steps):
                    c.step()
                c.times.append((time.perf_counter() - t0) / steps)


def report(competitors: list[Competitor], numel: int, device: torch.device, args) -> str:
    by = {c.name: c for c in competitors}
    lines = []
    lines.append(f"numel={numel:,} device={device} rounds={args.rounds} steps/round={args.steps} warmup={args.warmup}")
    lines.append("")
    lines.append("| competitor | B/param | ms/step (median) | min..max ms | GB/s |")
    lines.append("|---|---:|---:|---:|---:|")
    for c in competitors:
        gbs = c.bytes_per_param * numel / c.median / 1e9
        lines.append(
            f"| {c.name} | {c.bytes_per_param} | {c.median * 1e3:.2f} | "
            f"{min(c.times) * 1e3:.2f}..{max(c.times) * 1e3:.2f} | {gbs:.1f} |"
        )
    lines.append("")

    def ratio(a, b):
        """Speed of a over b: the median over rounds of b's time / a's time in the same round
        (paired within a round, so a load change on a shared machine hits both sides)."""
        if a not in by or b not in by:
            return None
        return statistics.median(tb / ta for ta, tb in zip(by[a].times, by[b].times))

    goals = []
    r1 = ratio("yafsdp FusedAdamW", "torch AdamW fused")
    r2 = ratio("yafsdp FusedAdamW + copy-out", "torch AdamW fused + cast")
    r3 = ratio("yafsdp FusedAdamW", "torch AdamW foreach")
    casts = [c.name for c in competitors if c.name.startswith(("yafsdp cast_", "torch copy_"))]
    r4 = ratio(*casts) if len(casts) == 2 else None
    if r1 is not None:
        goals.append(("speed-up, FusedAdamW vs torch fused (no copy-out)", r1, 0.9))
    if r2 is not None:
        goals.append(("speed-up, FusedAdamW + copy-out vs torch fused + cast", r2, 1.2 if device.type == "cuda" else 1.15))
    if r3 is not None:
        goals.append(("speed-up, FusedAdamW vs torch foreach", r3, None))
    if r4 is not None:
        goals.append(("speed-up, yafsdp cast_ vs torch copy_ (the engine's cast pass)", r4, None))
    if "copy fp32" in by and "yafsdp FusedAdamW + copy-out" in by:
        frac = ratio("yafsdp FusedAdamW + copy-out", "copy fp32") * 30 / 8  # GB/s over GB/s
        goals.append(("FusedAdamW + copy-out GB/s / copy fp32 GB/s", frac, 0.9 if device.type == "cuda" else None))
    lines.append("| ratio | value | goal | |")
    lines.append("|---|---:|---:|---|")
    for what, value, goal in goals:
        verdict = "" if goal is None else ("met" if value >= goal else "NOT met")
        lines.append(f"| {what} | {value:.2f}x | {'' if goal is None else f'>= {goal}x'} | {verdict} |")
    return "\n".join(lines)


def versions(device: torch.device) -> str:
    parts = [
        f"python {platform.python_version()}",
        f"torch {torch.__version__}",
        kernels.describe(),
        f"torch threads {torch.get_num_threads()}",
        f"cpu {platform.processor() or platform.machine()}",
    ]
    if device.type == "cuda":
        parts.append(f"gpu {torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})")
    return "; ".join(parts)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=24 * 2**20, help="shard size in elements (default 24M)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--steps", type=int, default=3, help="steps per competitor per round")
    ap.add_argument("--rounds", type=int, default=20, help="interleaved rounds; the median is reported")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps per competitor")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    ap.add_argument("--copy-dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--skip", default="", help="comma-separated substrings of competitor names to leave out (e.g. foreach)")
    ap.add_argument("--md", default=None, help="also write the report (with versions and command) to this file")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if kernels.backend(device.type) != "extension":
        print(f"warning: {kernels.describe()}: FusedAdamW runs its pure-PyTorch twin here", file=sys.stderr)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    competitors = build(args.numel, device, getattr(torch, args.copy_dtype), skip)
    measure(competitors, device, args.warmup, args.steps, args.rounds)
    text = f"{versions(device)}\ncommand: python {' '.join(sys.argv)}\n{report(competitors, args.numel, device, args)}"
    print(text)
    if args.md:
        os.makedirs(os.path.dirname(os.path.abspath(args.md)), exist_ok=True)
        with open(args.md, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
