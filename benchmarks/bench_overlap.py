"""Is communication hidden? The two-lane timeline of a training step, for yafsdp and FSDP2.

For each engine, on the same model, inputs and precision as bench_step.py, a few steps run under
``torch.profiler`` and this script reads off, per unit and per step, when each gather and reduce
ran on the communication side and when compute ran:

- GPU: kernels. NCCL kernels are the comm lane (yafsdp: its one comm stream); every other kernel
  is compute. A kernel belongs to the unit whose host-side range launched it.
- CPU (gloo): the comm lane is, for yafsdp, each collective from its issue to its async handle's
  completion (the engine's Recorder: yafsdp's gloo collectives are point-to-point messages that
  gloo's transport threads move unseen by the profiler), and for FSDP2 gloo's own execution of
  each collective (the ``gloo:*`` events on its worker threads); the compute lane is the main
  thread running ops (``aten::*`` and custom ops, plus gaps between them shorter than
  ``--gap-us``, i.e. Python between ops; longer gaps are the main thread waiting).

Exposed communication = the comm lane's time not covered by the compute lane; the fraction is of
the comm lane's time. yafsdp's own Recorder (CUDA events on the comm and compute streams; on CPU
timestamps from issue to the async handle's completion) gives a second, engine-internal figure.

Outputs: a table per engine, a per-unit table, ``--png`` (the two-lane picture, engines side by
side) and a Perfetto-loadable ``torch.profiler`` trace per engine (``--trace-dir``; open in
https://ui.perfetto.dev; the labels are ``yafsdp.gather <unit>``, ``yafsdp.reduce <unit>``,
``FSDP::...``; with ``--nvtx`` the same labels go to NVTX for Nsight Systems).

CPU, gloo, world 2 (spawns its own ranks):
    python benchmarks/bench_overlap.py
GPU (one or more GPUs; with world 1 NCCL collectives are copies, so use >= 2 GPUs to see real comm):
    torchrun --nproc-per-node 8 benchmarks/bench_overlap.py --device cuda --preset llama3-8b --layers 8 --batch 1 --seq 4096
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import torch
import torch.distributed as dist
from _common import (  # this script's directory is on sys.path: the benchmarks' shared plumbing
    finish_distributed,
    build_engine, free_engine, init_distributed, launch, make_batch, md_table, resolve_run, versions, write_json,
)

import yafsdp
from yafsdp.trace import Recorder, exposed, union

ENGINES = ("yafsdp-z3", "yafsdp-z2", "fsdp2")
_COMM_ISSUE = re.compile(r"^c10d::(_allgather_base_|allgather|_reduce_scatter_base_|reduce_scatter|allreduce)")
_LABEL = [
    (re.compile(r"^yafsdp\.gather (.+)$"), "gather"),
    (re.compile(r"^yafsdp\.reduce (.+)$"), "reduce"),
    (re.compile(r"^FSDP::all_gather \((.*)\)$"), "gather"),
    (re.compile(r"^FSDP::all_gather$"), "gather"),
    (re.compile(r"^FSDP::post_backward_reduce \((.*)\)$"), "reduce"),
    (re.compile(r"^FSDP::post_backward_reduce$"), "reduce"),
]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--preset", default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--world", type=int, default=2, help="ranks to spawn when not under torchrun (CPU)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--engines", default="yafsdp-z3,fsdp2")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps; figures are medians over them")
    ap.add_argument("--gap-us", type=float, default=100.0, help="CPU: longer main-thread gaps count as waiting")
    ap.add_argument("--png", default="runs/overlap.png")
    ap.add_argument("--trace-dir", default="runs/overlap_traces", help="Perfetto traces (rank 0); '' to skip")
    ap.add_argument("--nvtx", action="store_true", help="also emit NVTX ranges (torch.autograd.profiler.emit_nvtx)")
    ap.add_argument("--json", default="runs/bench_overlap.json")
    ap.add_argument("--md", default=None)
    a = ap.parse_args(argv)
    gpu = resolve_run(a)
    a.engines = [e for e in a.engines.split(",") if e]
    for e in a.engines:
        if e not in ENGINES:
            ap.error(f"unknown engine {e!r}; known: {', '.join(ENGINES)}")
    a.argv = " ".join(sys.argv)
    return a


# ---------------------------------------------------------------------------- unit ranges
def _unit_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """The modules each engine treats as a unit, by their name in the HF model."""
    inner = model.module if isinstance(model, yafsdp.YaFSDP) else model
    inner = getattr(inner, "_fsdp_wrapped_module", inner)
    out = [("model.embed_tokens", inner.model.embed_tokens)]
    out += [(f"model.layers.{i}", m) for i, m in enumerate(inner.model.layers)]
    out.append(("lm_head", inner.lm_head))
    return out


def _mark(label: str):
    with torch.profiler.record_function(f"bench.mark {label}"):
        pass


def install_unit_marks(model):
    """Forward pre/post hooks and output-grad hooks that drop profiler marks: forward of X spans
    its pre- to post-hook; backward of X starts when its output's gradient arrives and lasts
    until the next unit's backward starts (or the end of backward)."""
    handles = []
    for name, m in _unit_modules(model):
        def pre(mod, args, name=name):
            _mark(f"fwd_start {name}")

        def post(mod, args, out, name=name):
            _mark(f"fwd_end {name}")
            t = out if isinstance(out, torch.Tensor) else (out[0] if isinstance(out, (tuple, list)) else None)
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, name=name: _mark(f"bwd_start {name}"))
            return None

        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    return handles


# ---------------------------------------------------------------------------- extraction
def extract(prof, device: torch.device, gap_us: float, recorded=None) -> list[dict]:
    """Per profiled step: the compute lane, the comm lane (with kind/unit), unit ranges.

    ``recorded`` (CPU, yafsdp): per step, the engine Recorder's comm intervals as (start, end,
    kind, unit) in seconds from that step's start; they replace the gloo-thread lane (yafsdp's
    gloo collectives are point-to-point messages moved by gloo's transport threads, which the
    profiler does not see; see [Note: gloo point-to-point collectives] in yafsdp/comm/collectives.py)."""
    evs = list(prof.profiler.kineto_results.events())
    steps = sorted((e.start_ns(), e.end_ns()) for e in evs if e.name() == "bench.step")
    if not steps:
        return []
    main_tid = next(e.start_thread_id() for e in evs if e.name() == "bench.step")
    host = [e for e in evs if str(e.device_type()).endswith("CPU")]
    main = [e for e in host if e.start_thread_id() == main_tid]
    labels = []  # (start, end, kind, unit)
    for e in main:
        for rx, kind in _LABEL:
            m = rx.match(e.name())
            if m:
                unit = m.group(1) if m.groups() else "root"
                labels.append((e.start_ns(), e.end_ns(), kind, unit or "root"))
                break
    issues = sorted((e.start_ns(), e.end_ns()) for e in main if _COMM_ISSUE.match(e.name()))

    def label_at(t):
        best = None
        for s, en, kind, unit in labels:
            if s <= t <= en and (best is None or s >= best[0]):
                best = (s, en, kind, unit)
        return (best[2], best[3]) if best else ("comm", "?")

    marks = sorted((e.start_ns(), e.name()[len("bench.mark "):]) for e in main if e.name().startswith("bench.mark "))
    if device.type == "cuda":
        dev_evs = [e for e in evs if str(e.device_type()).endswith("CUDA")]
        launch_t = {e.correlation_id(): e.start_ns() for e in host if e.correlation_id()}
        comm_k = [e for e in dev_evs if "nccl" in e.name().lower()]
        comp_k = [e for e in dev_evs if "nccl" not in e.name().lower()]
        comm = []
        for e in comm_k:
            t = launch_t.get(e.linked_correlation_id())
            kind, unit = label_at(t) if t is not None else ("comm", "?")
            comm.append((e.start_ns(), e.end_ns(), kind, unit))
        compute = [(e.start_ns(), e.end_ns(), launch_t.get(e.linked_correlation_id())) for e in comp_k]
    elif recorded is not None:
        comm = []
        for (s0, _), step in zip(steps, recorded):
            comm += [(s0 + int(a * 1e9), s0 + int(b * 1e9), kind, unit) for a, b, kind, unit in step]
    else:
        gloo = sorted((e.start_ns(), e.end_ns()) for e in host
                      if e.name().startswith("gloo:") and e.start_thread_id() != main_tid)
        comm = []
        for i, (s, en) in enumerate(gloo):  # gloo runs its queue in issue order
            kind, unit = label_at(issues[i][0]) if i < len(issues) else ("comm", "?")
            comm.append((s, en, kind, unit))
    if device.type != "cuda":
        ops = sorted((e.start_ns(), e.end_ns()) for e in main
                     if ("::" in e.name() and not e.name().startswith(("c10d::", "FSDP::", "autograd::", "bench.")))
                     and not e.is_user_annotation())
        busy = union(ops)
        gap = gap_us * 1e3
        filled = []
        for (s0, e0), (s1, _) in zip(busy, busy[1:] + [(None, None)]):
            filled.append((s0, e0))
            if s1 is not None and s1 - e0 <= gap:
                filled.append((e0, s1))
        compute = [(s, e, s) for s, e in union(filled)]
    out = []
    for s0, s1 in steps:
        def clip(lst):
            return [x for x in lst if x[1] > s0 and x[0] < s1]

        cm = [(max(a, s0), min(b, s1), k, u) for a, b, k, u in clip(comm)]
        cp = [(max(a, s0), min(b, s1), t) for a, b, t in clip(compute)]
        ranges = _unit_ranges([m for m in marks if s0 <= m[0] <= s1], s1)

        def unit_of(t):
            if t is None:
                return None
            for a, b, kind, unit in ranges:
                if a <= t <= b:
                    return f"{kind} {unit}"
            return None

        fig = exposed([(a, b) for a, b, *_ in cm], [(a, b) for a, b, _ in cp])
        out.append(dict(
            start=s0, end=s1,
            comm=[dict(start=a - s0, end=b - s0, kind=k, unit=u) for a, b, k, u in cm],
            compute=[dict(start=a - s0, end=b - s0, unit=unit_of(t)) for a, b, t in cp],
            units=[dict(start=a - s0, end=b - s0, kind=k, unit=u) for a, b, k, u in ranges],
            step_ns=s1 - s0, comm_ns=fig["comm"], compute_ns=fig["compute"], exposed_ns=fig["exposed"],
            exposed_fraction=fig["exposed_fraction"],
            exposed_ranges=[(a - s0, b - s0) for a, b in fig["exposed_intervals"]],
        ))
    return out


def _unit_ranges(marks, step_end):
    """(start, end, "forward"|"backward", unit) from the marks of one step."""
    ranges, open_fwd = [], {}
    bw = [(t, lab.split(" ", 1)[1]) for t, lab in marks if lab.startswith("bwd_start ")]
    for t, lab in marks:
        what, unit = lab.split(" ", 1)
        if what == "fwd_start":
            open_fwd[unit] = t
        elif what == "fwd_end" and unit in open_fwd:
            ranges.append((open_fwd.pop(unit), t, "forward", unit))
    for i, (t, unit) in enumerate(bw):
        end = bw[i + 1][0] if i + 1 < len(bw) else step_end
        ranges.append((t, end, "backward", unit))
    return ranges


# ---------------------------------------------------------------------------- run
def run(a):
    dev = init_distributed(a.device)
    rank = dist.get_rank()
    mixed = dev.type == "cuda"
    from yafsdp.presets import llama_config

    vocab = llama_config(a.preset).vocab_size
    results = {}
    for name in a.engines:
        e = build_engine(name, a.preset, dev, mixed, layers=a.layers)
        handles = install_unit_marks(e.model)
        for i in range(a.warmup):
            e.step(make_batch(i, rank, a.batch, a.seq, vocab, dev))
        rec = None
        if name.startswith("yafsdp"):
            rec = e.model.recorder = Recorder()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier()
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if mixed else [])
        nvtx = torch.autograd.profiler.emit_nvtx() if a.nvtx and dev.type == "cuda" else _null()
        with nvtx, torch.profiler.profile(activities=acts, record_shapes=False) as prof:
            for i in range(a.steps):
                batch = make_batch(a.warmup + i, rank, a.batch, a.seq, vocab, dev)
                ctx = rec.step() if rec is not None else _null()
                with torch.profiler.record_function("bench.step"), ctx:
                    e.step(batch)
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
        engine_view = None
        if rec is not None:
            e.model.recorder = None
            rec.finish()
            engine_view = []
            for s0, s1 in rec.steps:
                ivs = [iv for iv in rec.intervals if iv.end is not None and s0 <= iv.start <= s1]
                fig = rec.summary((s0, s1))
                engine_view.append(dict(
                    step_s=s1 - s0, comm_s=fig["comm"], exposed_s=fig["exposed"],
                    exposed_fraction=fig["exposed_fraction"],
                    intervals=[dict(kind=iv.kind, unit=iv.unit, start=iv.start - s0, end=iv.end - s0, lane=iv.lane)
                               for iv in ivs],
                ))
        recorded = None
        if engine_view is not None and dev.type != "cuda":
            recorded = [[(iv["start"], iv["end"], iv["kind"], iv["unit"]) for iv in v["intervals"] if iv["lane"] == "comm"]
                        for v in engine_view]
        steps = extract(prof, dev, a.gap_us, recorded)
        if a.trace_dir and rank == 0:
            os.makedirs(a.trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(a.trace_dir, f"{name}_{dev.type}_rank0.json.gz"))
        for h in handles:
            h.remove()
        free_engine(e)
        results[name] = dict(steps=steps, engine_view=engine_view)
        dist.barrier()
    if rank == 0:
        report(a, dev, dist.get_world_size(), results)
    finish_distributed()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def report(a, dev, world, results):
    rows, summary = [], {}
    for name, r in results.items():
        st = r["steps"]
        med = lambda k: _median([s[k] for s in st])  # noqa: E731
        ev = r["engine_view"]
        row = dict(
            engine=name, step_ms=med("step_ns") / 1e6, comm_ms=med("comm_ns") / 1e6, exposed_ms=med("exposed_ns") / 1e6,
            exposed_fraction=med("exposed_fraction"),
            exposed_of_step=_median([s["exposed_ns"] / s["step_ns"] for s in st]),
            gathers=len([c for c in st[-1]["comm"] if c["kind"] == "gather"]) if st else 0,
            reduces=len([c for c in st[-1]["comm"] if c["kind"] == "reduce"]) if st else 0,
            recorder_exposed_fraction=_median([v["exposed_fraction"] for v in ev]) if ev else None,
        )
        summary[name] = row
        rows.append([name, row["step_ms"], row["comm_ms"], row["exposed_ms"], row["exposed_fraction"],
                     row["exposed_of_step"], row["gathers"], row["reduces"], row["recorder_exposed_fraction"]])
    header = ["engine", "step ms", "comm ms", "exposed comm ms", "exposed / comm", "exposed / step", "gathers",
              "reduces", "recorder: exposed / comm"]
    table = md_table(header, rows)
    unit_table = _unit_table(results)
    setup = (f"preset {a.preset}{f' ({a.layers} layers)' if a.layers else ''}, world {world}, batch {a.batch} x seq "
             f"{a.seq} per rank, {'bf16 + fp32 reduce' if dev.type == 'cuda' else 'fp32'}, {a.warmup} warm-up + "
             f"{a.steps} profiled steps (medians), device {dev.type}")
    how = ("GPU: NCCL kernels vs all other kernels (torch.profiler)" if dev.type == "cuda" else
           f"CPU: yafsdp: issue to completion of each async handle (engine Recorder); FSDP2: gloo worker-thread "
           f"execution of each collective; compute: main-thread ops (gaps <= {a.gap_us:g} us count as compute)")
    text = "\n".join([f"bench_overlap: {setup}", f"lanes: {how}", "", table, "", "per unit (last profiled step, rank 0):",
                      "", unit_table])
    print(text, flush=True)
    if a.png:
        draw(results, a.png, title=f"{a.preset}, world {world}, {dev.type}")
        print(f"wrote {a.png}")
    result = dict(kind="bench_overlap", command=a.argv, setup=setup, lanes=how, versions=versions(dev),
                  summary=summary, table=table, unit_table=unit_table,
                  steps={n: r["steps"] for n, r in results.items()},
                  engine_view={n: r["engine_view"] for n, r in results.items()})
    if a.json:
        write_json(a.json, result)
    if a.md:
        from bench_step import write_md

        write_md(a.md, result, text, images=[a.png] if a.png else [])
    return result


def _unit_table(results) -> str:
    rows = []
    for name, r in results.items():
        if not r["steps"]:
            continue
        st = r["steps"][-1]
        compute = [(c["start"], c["end"]) for c in st["compute"]]
        for c in st["comm"]:
            dur = c["end"] - c["start"]
            hidden = dur - exposed([(c["start"], c["end"])], compute)["exposed"]
            rows.append([name, c["unit"], c["kind"], c["start"] / 1e6, c["end"] / 1e6, dur / 1e6,
                         hidden / dur if dur else 1.0])
    return md_table(["engine", "unit", "collective", "start ms", "end ms", "ms", "hidden"], rows)


def draw(results, path: str, title: str = ""):
    """The two-lane picture: for each engine, compute on the top row, comm below, units coloured;
    exposed communication marked in red under the comm lane. One step (the last profiled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = [n for n, r in results.items() if r["steps"]]
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 1.9 * len(names) + 0.6), squeeze=False)
    units = []
    for n in names:
        st = results[n]["steps"][-1]
        for u in [r["unit"] for r in st["units"]] + [c["unit"] for c in st["comm"]]:
            if u not in units:
                units.append(u)
    cmap = plt.get_cmap("tab20")
    color = {u: cmap(i % 20) for i, u in enumerate(units)}
    xmax = max(results[n]["steps"][-1]["step_ns"] for n in names) / 1e6
    for ax, n in zip(axes[:, 0], names):
        st = results[n]["steps"][-1]
        for c in st["compute"]:
            u = (c["unit"] or " ?").split(" ", 1)[1]
            kind = (c["unit"] or "x").split(" ", 1)[0]
            ax.barh(1, (c["end"] - c["start"]) / 1e6, left=c["start"] / 1e6, height=0.6,
                    color=color.get(u, (0.6, 0.6, 0.6, 1)), alpha=1.0 if kind == "forward" else 0.55, linewidth=0)
        for c in st["comm"]:
            ax.barh(0, (c["end"] - c["start"]) / 1e6, left=c["start"] / 1e6, height=0.6,
                    color=color.get(c["unit"], "grey"), hatch="///" if c["kind"] == "reduce" else None,
                    edgecolor="black", linewidth=0.3)
        for s, e in st["exposed_ranges"]:
            ax.barh(-0.55, (e - s) / 1e6, left=s / 1e6, height=0.18, color="red", linewidth=0)
        ax.set_yticks([1, 0, -0.55], ["compute", "comm", "exposed"])
        ax.set_xlim(0, xmax)
        ax.set_ylim(-0.8, 1.45)
        ax.set_title(f"{n}: step {st['step_ns'] / 1e6:.0f} ms, comm {st['comm_ns'] / 1e6:.0f} ms, exposed "
                     f"{st['exposed_ns'] / 1e6:.0f} ms ({st['exposed_fraction']:.0%} of comm)", fontsize=9, loc="left")
        ax.tick_params(labelsize=8)
    axes[-1, 0].set_xlabel("ms from step start (rank 0); forward solid, backward light; reduce hatched", fontsize=8)
    handles = [Patch(color=color[u], label=u) for u in units[:20]]
    fig.legend(handles=handles, loc="lower center", ncol=min(10, len(handles)), fontsize=6, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None):
    a = parse(argv)
    launch(run, a, a.world, port=29513)


if __name__ == "__main__":
    main()
