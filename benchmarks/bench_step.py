"""Step time and peak memory per rank: yafsdp against torch FSDP2, FSDP1 and DDP, in one run.

Every engine trains the same HF LlamaForCausalLM (same preset, same init, same per-rank inputs,
AdamW with the same settings) under a matched precision policy: fp32 on CPU; on GPU bf16 compute
with fp32 gradient reduction (yafsdp param_dtype=bf16, FSDP2/FSDP1 MixedPrecision(bf16, fp32
reduce), DDP under bf16 autocast with fp32 gradients). A step is forward, backward, optimizer step,
zero_grad(set_to_none=True).

CPU, gloo, world 2 (spawns its own ranks; or under torchrun):
    python benchmarks/bench_step.py
    torchrun --nproc-per-node 2 benchmarks/bench_step.py --preset cpu-6x256 --batch 4 --seq 128
GPU, NCCL, one H100, a ~1B Llama in bf16 (the single-device goal):
    torchrun --nproc-per-node 1 benchmarks/bench_step.py --device cuda --preset llama3-1b --batch 2 --seq 2048
Large worlds emulated in one process (fake process group: collectives do nothing, memory is real):
    python benchmarks/bench_step.py --fake-world 8,64,256
    python benchmarks/bench_step.py --fake-world 8,64,256 --device cuda --preset llama3-8b --batch 1 --seq 4096

Timing: warm-up steps are not measured; competitors are interleaved step by step (CPU, all
engines alive, the order rotating every step) or round by round (GPU, one engine alive at a time
so peak memory is its own). Each measured step starts after a barrier; a step's time is the
slowest rank's. Memory is measured in a separate phase, each engine alone: GPU
``max_memory_allocated``/``max_memory_reserved``; CPU the torch CPU allocator's live bytes, from
the profiler's memory events (everything the engine and the step allocate through torch).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from _common import (  # this script's directory is on sys.path: the benchmarks' shared plumbing
    finish_distributed,
    ENGINES, REDUCE_ENGINES, MiB, build_engine, free_engine, fused_adamw_available, init_distributed, init_fake, launch,
    make_batch, md_table, median_min_max, reduce_options, resolve_run, versions, write_json,
)

from yafsdp.measure import measure_memory, noise_report

COMPETITORS = ("ddp", "fsdp2", "fsdp1")

GOALS = {
    "cpu": [("yafsdp-z3", "fsdp2", 0.85), ("yafsdp-z3", "ddp", 1.10)],
    "cuda": [("yafsdp-z3", "ddp", 1.03), ("yafsdp-z3", "fsdp2", 0.95)],
}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--preset", default=None, help="yafsdp.presets name (default: cpu-6x256 on CPU, llama3-1b on GPU)")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    ap.add_argument("--vocab", type=int, default=None, help="override the preset's vocabulary size")
    ap.add_argument("--hf-checkpointing", action="store_true",
                    help="every engine's model with HF's gradient_checkpointing_enable() (non-reentrant) before wrapping")
    ap.add_argument("--batch", type=int, default=None, help="micro-batch per rank (default 2)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 128 CPU, 2048 GPU)")
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 compute with fp32 reduce on CPU too (the GPU's precision policy; default on CPU: fp32)")
    ap.add_argument("--world", type=int, default=2, help="ranks to spawn when not under torchrun (CPU)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per spawned rank")
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help="comma-separated subset of " + ",".join(ENGINES + REDUCE_ENGINES) + " (default: all but the last "
                    f"{len(REDUCE_ENGINES)}, the reduce precisions of docs/reduce.md)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="measured steps per engine (per round in round mode)")
    ap.add_argument("--interleave", default=None, choices=["step", "round"],
                    help="default: step on CPU, round on GPU")
    ap.add_argument("--rounds", type=int, default=2, help="round mode: engine rounds")
    ap.add_argument("--mem-steps", type=int, default=3, help="steps in the memory phase (0: skip it)")
    ap.add_argument("--phases", action="store_true",
                    help="also time forward, backward and optimizer step apart (each phase's slowest rank; on "
                    "CUDA a device sync at each phase boundary, which perturbs the step time)")
    ap.add_argument("--fake-world", default=None, help="comma-separated world sizes to emulate (fake process group)")
    ap.add_argument("--json", default="runs/bench_step.json")
    ap.add_argument("--md", default=None, help="also write a markdown report here (benchmarks/results/...)")
    a = ap.parse_args(argv)
    gpu = resolve_run(a)
    a.interleave = a.interleave or ("round" if gpu else "step")
    a.engines = [e for e in a.engines.split(",") if e]
    for e in a.engines:
        if e not in ENGINES + REDUCE_ENGINES:
            ap.error(f"unknown engine {e!r}; known: {', '.join(ENGINES + REDUCE_ENGINES)}")
    a.skipped = []
    for e in [e for e in a.engines if "+FusedAdamW" in e]:
        if not fused_adamw_available():
            a.engines.remove(e)
            a.skipped.append(f"{e}: yafsdp.FusedAdamW is not available in this build")
    a.argv = " ".join(sys.argv)
    a.load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return a


def _sync(dev: torch.device):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Runner:
    """Builds engines and times their steps on this rank."""

    def __init__(self, a, dev: torch.device, meta_init: bool = False):
        self.a, self.dev, self.meta_init = a, dev, meta_init
        self.mixed = dev.type == "cuda" or a.bf16
        from yafsdp.presets import llama_config

        self.vocab = a.vocab or llama_config(a.preset).vocab_size
        self.rank = dist.get_rank()

    def build(self, name: str):
        return build_engine(name, self.a.preset, self.dev, self.mixed, layers=self.a.layers, meta_init=self.meta_init,
                            vocab=self.a.vocab, hf_checkpointing=self.a.hf_checkpointing)

    def batch(self, step: int) -> dict:
        return make_batch(step, self.rank, self.a.batch, self.a.seq, self.vocab, self.dev)

    def step(self, engine, i: int) -> float:
        return float(engine.step(self.batch(i)))

    def timed_step(self, engine, i: int, phases: list | None = None) -> tuple[float, float]:
        """(step seconds, loss); with ``phases`` (a list), appends [forward, backward, optimizer]
        seconds to it."""
        b = self.batch(i)
        _sync(self.dev)
        dist.barrier()
        marks = [time.perf_counter()]

        def mark():
            _sync(self.dev)
            marks.append(time.perf_counter())

        loss = engine.step(b, mark if phases is not None else None)
        _sync(self.dev)
        t1 = time.perf_counter()
        if phases is not None:
            marks.append(t1)
            phases.append([t - s for s, t in zip(marks, marks[1:])])
        return t1 - marks[0], float(loss)

    def plan(self, name: str):
        """yafsdp's memory plan for engine ``name``, computed from a meta-device model (the test
        suite checks it equals what the engine allocates), so nothing is traced while measuring."""
        if not name.startswith("yafsdp"):
            return None
        from yafsdp.plan import memory_plan
        from yafsdp.presets import build_llama

        over = {"num_hidden_layers": self.a.layers} if self.a.layers else {}
        if self.a.vocab:
            over["vocab_size"] = self.a.vocab
        p = memory_plan(
            build_llama(self.a.preset, device="meta", **over), world_size=dist.get_world_size(),
            rank=dist.get_rank(), param_dtype=torch.bfloat16 if self.mixed else None, **reduce_options(name),
            zero_stage=2 if name.startswith("yafsdp-z2") else 3, batch=self.a.batch, seq=self.a.seq,
            gather_dtype="fp8" if name.endswith("+fp8") else None,
        )
        return dict(engine=p.engine_total, optimizer=p.optimizer_state, activations=p.activations.total,
                    total=p.total)


# ---------------------------------------------------------------------------- real worlds
def run_real(a):
    dev = init_distributed(a.device)
    r = Runner(a, dev)
    world, rank = dist.get_world_size(), dist.get_rank()
    memory, plans = {}, {}
    if a.mem_steps:
        for name in a.engines:
            plans[name] = r.plan(name)
            memory[name] = measure_memory(lambda name=name: r.build(name), r.step, a.mem_steps, dev)
    times = {n: [] for n in a.engines}
    phases = {n: [] for n in a.engines} if a.phases else None  # [forward, backward, optimizer] per measured step
    losses = {n: [] for n in a.engines}
    gathered = {}  # yafsdp engines: bytes each rank receives from all-gathers per step (the engine's count)
    reduced = {}  # yafsdp engines: bytes each rank puts into its reduces per step (the engine's count)
    if a.interleave == "step":
        engines = {n: r.build(n) for n in a.engines}
        order = list(a.engines)
        for it in range(a.warmup + a.steps):
            k = it % len(order)
            for name in order[k:] + order[:k]:
                ph = [] if phases is not None and it >= a.warmup else None
                dt, loss = r.timed_step(engines[name], it, ph)
                losses[name].append(loss)
                if it >= a.warmup:
                    times[name].append(dt)
                    if ph is not None:
                        phases[name] += ph
        gathered = {n: sum(e.model.schedule.gathered.values()) / (a.warmup + a.steps)
                    for n, e in engines.items() if n.startswith("yafsdp")}
        reduced = {n: reduce_bytes(e.model) / (a.warmup + a.steps) for n, e in engines.items() if n.startswith("yafsdp")}
        for e in engines.values():
            free_engine(e)
    else:
        for rnd in range(a.rounds):
            for name in (a.engines if rnd % 2 == 0 else a.engines[::-1]):
                e = r.build(name)
                for it in range(a.warmup + a.steps):
                    ph = [] if phases is not None and it >= a.warmup else None
                    dt, loss = r.timed_step(e, it, ph)
                    if rnd == 0:
                        losses[name].append(loss)
                    if it >= a.warmup:
                        times[name].append(dt)
                        if ph is not None:
                            phases[name] += ph
                if name.startswith("yafsdp"):
                    gathered[name] = sum(e.model.schedule.gathered.values()) / (a.warmup + a.steps)
                    reduced[name] = reduce_bytes(e.model) / (a.warmup + a.steps)
                free_engine(e)
    # A step's time is its slowest rank's.
    local = torch.tensor([times[n] for n in a.engines], dtype=torch.float64, device=dev)  # NCCL: on the device
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    times = {n: local[i].tolist() for i, n in enumerate(a.engines)}
    if phases is not None:  # each phase's slowest rank, step by step
        local = torch.tensor([phases[n] for n in a.engines], dtype=torch.float64, device=dev)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        phases = {n: local[i].tolist() for i, n in enumerate(a.engines)}
    mems = [None] * world
    dist.all_gather_object(mems, memory)
    if rank == 0:
        report_real(a, dev, world, times, losses, mems, plans, gathered, reduced, phases)
    finish_distributed()


def reduce_bytes(model) -> int:
    """Bytes this rank put into the reduces of the step protocol so far (each reduce's input: the
    grad buffer in reduce_dtype; what goes over the wire is (world - 1) / world of it)."""
    return sum(v for (kind, _), v in model.schedule.counted.items() if kind == "reduce")


def report_real(a, dev, world, times, losses, mems, plans, gathered=None, reduced=None, phases=None):
    tokens = a.batch * a.seq * world
    med = {n: median_min_max(ts)[0] for n, ts in times.items()}
    rows, out_rows = [], []
    for n in a.engines:
        m, lo, hi = median_min_max(times[n])
        mem = [mm.get(n) for mm in mems] if mems[0] else [None]
        peak = max(x["peak_steady"] for x in mem) if mem[0] else None
        reserved = max(x["reserved"] or 0 for x in mem) if mem[0] and mem[0].get("reserved") is not None else None
        growth = max(abs(x["growth_from_step2"]) for x in mem) if mem[0] and mem[0]["growth_from_step2"] is not None else None
        plan = plans.get(n)
        row = dict(
            engine=n, median_ms=1e3 * m, min_ms=1e3 * lo, max_ms=1e3 * hi, tokens_per_s=tokens / m,
            vs_fsdp2=m / med["fsdp2"] if "fsdp2" in med else None, vs_ddp=m / med["ddp"] if "ddp" in med else None,
            peak_mib=peak / MiB if peak is not None else None,
            reserved_mib=reserved / MiB if reserved is not None else None,
            growth_bytes=growth, plan_mib=plan["total"] / MiB if plan else None,
            first_loss=losses[n][0] if losses[n] else None, losses=losses[n], times_ms=[1e3 * t for t in times[n]],
            memory_per_rank=mem,
            gathered_mib=(gathered or {}).get(n, 0) / MiB if n in (gathered or {}) else None,
            reduced_mib=(reduced or {}).get(n, 0) / MiB if n in (reduced or {}) else None,
        )
        out_rows.append(row)
        rows.append([n, row["median_ms"], row["min_ms"], row["max_ms"], row["tokens_per_s"], row["vs_fsdp2"],
                     row["vs_ddp"], row["peak_mib"], row["reserved_mib"], growth, row["plan_mib"],
                     row["gathered_mib"], row["reduced_mib"]])
    header = ["engine", "median ms", "min ms", "max ms", "tokens/s", "x FSDP2", "x DDP", "peak MiB/rank",
              "reserved MiB", "growth B (step 2+)", "plan MiB", "gathered MiB/step", "reduced MiB/step"]
    table = md_table(header, rows)
    ref = out_rows[0]["first_loss"]
    loss_spread = max(abs(r["first_loss"] - ref) / abs(ref) for r in out_rows) if ref else None
    goals = []
    for eng, other, limit in GOALS[dev.type]:
        if eng in med and other in med:
            ratio = med[eng] / med[other]
            goals.append(dict(engine=eng, vs=other, ratio=ratio, limit=limit, met=ratio <= limit))
    if dev.type == "cuda" and "yafsdp-z3" in med and "fsdp2" in med:
        mine = next(r for r in out_rows if r["engine"] == "yafsdp-z3")["peak_mib"]
        theirs = next(r for r in out_rows if r["engine"] == "fsdp2")["peak_mib"]
        if mine is not None and theirs is not None:
            goals.append(dict(engine="yafsdp-z3", vs="fsdp2", what="peak memory", ratio=mine / theirs, limit=1.0,
                              met=mine <= theirs))
    mem_how = mems[0][a.engines[0]]["how"] if mems[0] else "not measured"
    setup = (f"preset {a.preset}{f' ({a.layers} layers)' if a.layers else ''}"
             f"{f' (vocab {a.vocab})' if a.vocab else ''}{', HF gradient checkpointing' if a.hf_checkpointing else ''}"
             f", world {world}, batch {a.batch} x "
             f"seq {a.seq} per rank ({tokens:,} tokens/step), {'bf16 compute + fp32 reduce' if dev.type == 'cuda' or a.bf16 else 'fp32'}, "
             f"{a.warmup} warm-up + {a.steps} measured steps, interleave={a.interleave}"
             f"{f' x {a.rounds} rounds' if a.interleave == 'round' else ''}")
    mem_line = (f"memory: {mem_how}; peak over steps 2..{a.mem_steps}, max over ranks" if mems[0]
                else "memory: not measured (--mem-steps 0)")
    lines = [f"bench_step: {setup}", mem_line, "",
             table, ""]
    if loss_spread is not None:
        lines.append(f"first-step losses agree across engines to {loss_spread:.1e} (relative; +fp8 engines compute "
                     "with quantize-dequantized decoder weights, so they differ by design)")
    for g in goals:
        lines.append(f"goal: {g['engine']} {g.get('what', 'step time')} <= {g['limit']:.2f} x {g['vs']}: "
                     f"x{g['ratio']:.3f} -> {'met' if g['met'] else 'NOT met'}")
    noise_lines, noise = noise_report(times, goals, a.interleave == "step", a.load_before, os.cpu_count() or 1,
                                      competitors=COMPETITORS)
    lines += noise_lines
    rounds = None
    if a.interleave == "round" and a.rounds > 1:
        rounds_text, rounds = round_table(times, a.engines, a.rounds)
        lines += ["", rounds_text]
    elif a.interleave == "step" and a.steps > 1:  # each step of every engine taken seconds apart: pair them
        rounds_text, rounds = round_table(times, a.engines, a.steps, "step")
        lines += ["", rounds_text]
    if phases:
        lines += ["", phase_table(phases, a.engines)]
    for s in a.skipped:
        lines.append(f"skipped {s}")
    text = "\n".join(lines)
    print(text, flush=True)
    result = dict(kind="bench_step", command=a.argv, setup=setup, versions=versions(dev), rows=out_rows,
                  goals=goals, loss_spread=loss_spread, memory_how=mem_how, skipped=a.skipped, table=table,
                  noise=noise, phases=phases, rounds=rounds)
    if a.json:
        write_json(a.json, result)
    if a.md:
        write_md(a.md, result, text)
    return result


def round_table(times: dict, engines: list, rounds: int, what: str = "round") -> tuple[str, dict]:
    """Each engine's median step in each round (step mode: each measured step, one per engine in rotation),
    and its ratio to the first engine, to DDP and to FSDP2 within the round, then the median and range of
    those paired ratios: on a machine whose load drifts, the figure to read."""
    per = {n: [median_min_max(ts[r * (len(ts) // rounds):(r + 1) * (len(ts) // rounds)])[0] for r in range(rounds)]
           for n, ts in times.items()}
    refs = [e for e in (engines[0], "ddp", "fsdp2") if e in per]
    out, rows = {}, []
    for n in engines:
        ratios = {ref: [m / r for m, r in zip(per[n], per[ref])] for ref in refs}
        out[n] = dict(round_ms=[1e3 * m for m in per[n]], ratios=ratios)
        row = [n, " / ".join(f"{1e3 * m:.0f}" for m in per[n]) if rounds <= 10 else
               f"{1e3 * median_min_max(per[n])[0]:.0f} (median of {rounds})"]
        for ref in refs:
            med, lo, hi = median_min_max(ratios[ref])
            row.append(f"{med:.3f} ({lo:.3f}-{hi:.3f})")
        rows.append(row)
    header = ["engine", f"median ms per {what}"] + [f"x {ref}: median of {what}s (range)" for ref in refs]
    how = ("the order reversed every other round" if what == "round" else "the engines in rotation, the order "
           "turning every step")
    return (f"paired by {what} ({rounds} {what}s, {how}; ratios taken within each {what}):\n"
            + md_table(header, rows)), out


def phase_table(phases: dict, engines: list) -> str:
    """Where the step goes: each phase's median over the measured steps (the slowest rank's time
    in each step), and its difference from DDP's where DDP ran."""
    names = ["forward", "backward", "optimizer"]
    med = {n: [median_min_max([s[k] for s in phases[n]])[0] * 1e3 for k in range(3)] for n in engines}
    header = ["engine"] + [f"{p} ms" for p in names] + (["vs DDP ms: " + "/".join(names)] if "ddp" in med else [])
    rows = []
    for n in engines:
        row = [n] + med[n]
        if "ddp" in med:
            row.append(" / ".join(f"{m - d:+.0f}" for m, d in zip(med[n], med["ddp"])))
        rows.append(row)
    return "phases (medians over the measured steps, slowest rank per step):\n" + md_table(header, rows)


# ---------------------------------------------------------------------------- fake worlds
def run_fake(a):
    dev = torch.device(a.device if a.device == "cpu" else "cuda", 0) if a.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    worlds = [int(w) for w in a.fake_world.split(",")]
    engines = [e for e in a.engines if e.startswith("yafsdp-z") or e == "fsdp2"] or ["yafsdp-z3", "fsdp2"]
    out_rows, rows = [], []
    for w in worlds:
        init_fake(w, dev)
        r = Runner(a, dev, meta_init=True)
        for name in engines:
            plan = r.plan(name)
            mem = measure_memory(lambda name=name: r.build(name), r.step, max(3, a.mem_steps), dev,
                                 method="cuda" if dev.type == "cuda" else "torch")
            row = dict(world=w, engine=name, built_mib=mem["built"] / MiB, peak_mib=mem["peak_steady"] / MiB,
                       reserved_mib=mem["reserved"] / MiB if mem.get("reserved") else None,
                       growth_bytes=mem["growth_from_step2"], step_end=mem["step_end"],
                       plan_mib=plan["total"] / MiB if plan else None,
                       plan_engine_mib=(plan["engine"] + plan["optimizer"]) / MiB if plan else None)
            out_rows.append(row)
            rows.append([w, name, row["built_mib"], row["peak_mib"], row["reserved_mib"], row["growth_bytes"],
                         row["plan_engine_mib"], row["plan_mib"]])
            print(f"world {w} {name}: peak {row['peak_mib']:.1f} MiB, growth from step 2 {row['growth_bytes']} B",
                  flush=True)
        finish_distributed()
    # peak per rank against FSDP2's in the same world (same run, same process)
    fsdp2 = {r["world"]: r["peak_mib"] for r in out_rows if r["engine"] == "fsdp2"}
    goals = []
    for r, row in zip(out_rows, rows):
        r["vs_fsdp2"] = r["peak_mib"] / fsdp2[r["world"]] if r["world"] in fsdp2 else None
        row.insert(4, r["vs_fsdp2"])
        if r["engine"] == "yafsdp-z3" and r["vs_fsdp2"] is not None:
            goals.append(f"goal: yafsdp-z3 peak <= 0.95 x fsdp2 at world {r['world']}: x{r['vs_fsdp2']:.3f} -> "
                         f"{'met' if r['vs_fsdp2'] <= 0.95 else 'NOT met'}")
    header = ["world", "engine", "after wrap MiB", "peak MiB (steps 2+)", "x FSDP2 peak", "reserved MiB",
              "growth B (step 2+)", "plan: state MiB", "plan: total MiB"]
    table = md_table(header, rows)
    setup = (f"fake process group (one process emulates rank 0 of each world; collectives do nothing), preset "
             f"{a.preset}{f' ({a.layers} layers)' if a.layers else ''}, batch {a.batch} x seq {a.seq}, "
             f"{'bf16 + fp32 reduce' if dev.type == 'cuda' or a.bf16 else 'fp32'}, {max(3, a.mem_steps)} steps, device {dev}")
    mem_how = ("torch.cuda.max_memory_allocated" if dev.type == "cuda"
               else "torch CPU allocator live bytes (profiler memory events)")
    flat = [r for r in out_rows if r["engine"].startswith("yafsdp")]
    flat_ok = all(r["growth_bytes"] == 0 for r in flat)
    text = "\n".join([f"bench_step --fake-world: {setup}", f"memory: {mem_how}", "", table, "", *goals,
                      f"yafsdp memory flat from step 2 on (0 bytes growth) in every world: {flat_ok}"])
    print(text, flush=True)
    result = dict(kind="bench_step_fake", command=a.argv, setup=setup, versions=versions(dev), rows=out_rows,
                  table=table, flat=flat_ok, memory_how=mem_how, goals=goals)
    if a.json:
        write_json(a.json, result)
    if a.md:
        write_md(a.md, result, text)
    return result


def write_md(path: str, result: dict, text: str, images: list[str] = ()):
    """The committed report: command, versions, the printed tables, the pictures."""
    v = result["versions"]
    hw = v.get("gpu") or f"CPU ({v['cpus']} cores, {v.get('cpu', '')})"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + "/"
    body = [
        f"# {result['kind']} — {hw} — {v['date']}", "",
        "Command:", "", "```", "python " + result["command"].replace(root, ""), "```", "",
        f"Versions: python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, yafsdp {v['yafsdp']}"
        + (f", CUDA {v.get('cuda')}" if v.get("cuda") else "")
        + (f". Load average (1/5/15 min) when written: {v['load_avg']}" if v.get("load_avg") else ""), "",
        "```", text, "```", "",
    ]
    write_body(path, body, images)


def write_body(path: str, body: list[str], images=()) -> None:
    """The lines ``body``, then the pictures ``images`` linked relative to ``path``, written to ``path``."""
    body = list(body)
    for img in images:
        rel = os.path.relpath(os.path.abspath(img), os.path.dirname(os.path.abspath(path)))
        body += [f"![{os.path.basename(img)}]({rel})", ""]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(body))


def main(argv=None):
    a = parse(argv)
    if a.fake_world:
        return run_fake(a)
    launch(run_real, a, a.world)


if __name__ == "__main__":
    main()
