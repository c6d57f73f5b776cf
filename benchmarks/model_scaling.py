"""Scaling beyond this machine, on paper: predicted step time and exposed communication at
8-1024 GPUs for yafsdp and an FSDP2-like schedule.

Inputs:
- per-unit forward/backward compute time: measured on this device (``--compute measure``: the
  plain model, one process, per-unit timing hooks; CUDA events on GPU), loaded from an earlier
  measurement (``--compute json --compute-json F``), or estimated from FLOPs at an assumed
  model-FLOPs utilisation (``--compute flops --peak-tflops 989 --mfu 0.45``: the stand-in until a
  GPU measurement is committed);
- communication per step: exact, from the engine's own plan (``yafsdp.plan``: every unit's padded
  size, the buffer each one uses, and so which gathers the schedule issues and which it skips
  because a buffer still holds the unit), in ``param_dtype`` for gathers and ``reduce_dtype`` for
  reduce-scatters.

Assumptions (all flags):
- weak scaling: the per-GPU micro-batch is fixed, so per-unit compute does not change with the
  world size; a collective moving B bytes (the gathered size) among W ranks takes
  ``latency + hop * (W - 1) + B * (W - 1) / W / busbw``; ``busbw`` is the NVLink all-gather bus
  bandwidth (default 360 GB/s) inside one node (W <= gpus-per-node) and the per-GPU NIC bandwidth
  (default 48 GB/s) across nodes (a ring crosses node boundaries at the NIC's speed);
- yafsdp: the protocol of DESIGN.md: one comm stream (gathers and reduces in issue order),
  two alternating weight and grad buffers plus the outsized units' buffer, prefetch of one unit,
  a gather waits for its buffer's release, a unit's grads wait for its grad buffer's last reduce,
  a unit whose backward reads no weights (the embedding) is not re-gathered for backward;
  one cast pass over the local shard at step start (6 bytes per element); optimizer: a fused
  AdamW pass (28 bytes per local element) at memory bandwidth ``--hbm-gbs``;
- FSDP2-like: the same prefetch-one structure, the root group (embedding, final norm, head) gathered
  once and kept for backward, every decoder layer re-gathered in backward, and its extra copies:
  all-gather copy-in (6 bytes per shard element, before the collective, on its stream),
  copy-out into per-parameter tensors (4 bytes per gathered element, on the compute stream before
  the layer runs), reduce-scatter copy-in of the grads (6 bytes per element, before the
  collective), and per-parameter optimizer dispatch (``--fsdp2-param-us`` per parameter tensor);
  gathers and reduce-scatters share the links, so they are one comm lane here too;
- yafsdp with ``gather_dtype="fp8"`` (the "fp8" columns): the decoder layers' gathers move the
  FP8 records the plan sizes (~1.03 bytes per element), each followed on the comm stream by its
  expand (records read, ``param_dtype`` values written, at ``--hbm-gbs``); embedding and head as
  before; "gathered MiB/step" is what each rank receives from all-gathers in one step;
- ignored for both: kernel-launch gaps, the small group (1-D parameters: a few MB), contention of
  the comm kernels for SMs, stragglers.

    python benchmarks/model_scaling.py                                   # llama3-8b, FLOP-based compute
    python benchmarks/model_scaling.py --compute measure --preset cpu-6x256   # compute measured here
    python benchmarks/model_scaling.py --compute measure --device cuda --preset llama3-8b --layers 4 \\
        --batch 1 --seq 8192 --save-compute runs/compute_h100.json      # one GPU, no process group
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from _common import md_table, versions, write_json  # this script's directory is on sys.path

from yafsdp.plan import memory_plan
from yafsdp.presets import build_llama


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=None, help="measure with this many layers (times are per layer)")
    ap.add_argument("--batch", type=int, default=1, help="micro-batch per GPU")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--param-dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--reduce-dtype", default="fp32", choices=["bf16", "fp32"])
    ap.add_argument("--compute", default="flops", choices=["flops", "measure", "json"])
    ap.add_argument("--compute-json", default=None)
    ap.add_argument("--save-compute", default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM: 989)")
    ap.add_argument("--mfu", type=float, default=0.45, help="assumed model-FLOPs utilisation of unit compute")
    ap.add_argument("--worlds", default="8,16,32,64,128,256,512,1024")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--intra-busbw", type=float, default=360.0, help="GB/s, NVLink all-gather bus bandwidth")
    ap.add_argument("--inter-busbw", type=float, default=48.0, help="GB/s per GPU (its NIC) across nodes")
    ap.add_argument("--latency-us", type=float, default=15.0, help="fixed cost per collective")
    ap.add_argument("--hop-us", type=float, default=0.5, help="added per rank in the ring")
    ap.add_argument("--hbm-gbs", type=float, default=2500.0, help="achieved memory bandwidth for copies/optimizer")
    ap.add_argument("--fsdp2-param-us", type=float, default=4.0, help="FSDP2 optimizer cost per parameter tensor")
    ap.add_argument("--png", default="runs/model_scaling.png")
    ap.add_argument("--json", default="runs/model_scaling.json")
    ap.add_argument("--md", default=None)
    a = ap.parse_args(argv)
    a.worlds = [int(w) for w in a.worlds.split(",")]
    a.argv = " ".join(sys.argv)
    return a


# ---------------------------------------------------------------------------- per-unit compute
@dataclass
class Use:
    """One use of a unit in forward order (a tied head is a second use of the embedding unit)."""

    unit: str
    fwd: float  # seconds
    bwd: float
    params: int  # parameters computed on (for FLOPs)


def unit_uses(model) -> list[tuple[str, str, torch.nn.Module]]:
    """(unit name, role, module) in forward order for an HF causal LM."""
    out = [("model.embed_tokens", "embed", model.model.embed_tokens)]
    out += [(f"model.layers.{i}", "layer", m) for i, m in enumerate(model.model.layers)]
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    out.append(("model.embed_tokens" if tied else "lm_head", "head", model.lm_head))
    return out


def flops_compute(a, cfg) -> dict:
    """Per-role forward/backward seconds from FLOPs: 2 x params x tokens (+ causal attention),
    backward = 2 x forward, at mfu x peak."""
    tokens = a.batch * a.seq
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    layer_params = h * h * 2 + 2 * h * kv + 3 * h * f
    attn = 2 * a.batch * a.seq * a.seq * h  # QK^T and AV, causal half of 4 b s^2 h
    rate = a.peak_tflops * 1e12 * a.mfu
    fl_layer = 2 * layer_params * tokens + attn
    fl_head = 2 * h * v * tokens
    return dict(
        source=f"FLOPs at {a.mfu:.0%} of {a.peak_tflops:g} TFLOP/s",
        embed=(0.0, 0.0), layer=(fl_layer / rate, 2 * fl_layer / rate), head=(fl_head / rate, 2 * fl_head / rate),
        other=(0.0, 0.0),
    )


def measure_compute(a) -> dict:
    """Per-role forward/backward seconds measured on this device (medians over steps)."""
    dev = torch.device("cuda" if a.device == "cuda" else "cpu")
    over = {"num_hidden_layers": a.layers} if a.layers else {}
    model = build_llama(a.preset, device="cpu", **over).to(dev)
    if a.param_dtype == "bf16" and dev.type == "cuda":
        model = model.to(torch.bfloat16)
    uses = unit_uses(model)
    cuda = dev.type == "cuda"

    def now():
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def span(t0, t1):
        return t0.elapsed_time(t1) / 1e3 if cuda else t1 - t0

    samples: dict[str, list[tuple[float, float]]] = {"embed": [], "layer": [], "head": [], "other": []}
    for step in range(6):
        marks = []
        hs = []
        for i, (_, role, m) in enumerate(uses):
            hs.append(m.register_forward_pre_hook(lambda mod, args, i=i: marks.append(("fs", i, now()))))

            def post(mod, args, out, i=i):
                marks.append(("fe", i, now()))
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(lambda g, i=i: marks.append(("bs", i, now())))

            hs.append(m.register_forward_hook(post))
        ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq), device=dev)
        t0 = now()
        loss = model(input_ids=ids, labels=ids).loss
        t1 = now()
        loss.backward()
        t2 = now()
        model.zero_grad(set_to_none=True)
        for h in hs:
            h.remove()
        if cuda:
            torch.cuda.synchronize()
        if step < 2:
            continue  # warm-up
        fwd = {i: span(t, e) for (k, i, t) in marks if k == "fs" for (k2, j, e) in marks if k2 == "fe" and j == i}
        bs = sorted([(span(t0, t), i) for k, i, t in marks if k == "bs"])
        bwd = {}
        for n, (t, i) in enumerate(bs):
            end = bs[n + 1][0] if n + 1 < len(bs) else span(t0, t2)
            bwd[i] = end - t
        per = {"embed": [], "layer": [], "head": []}
        for i, (_, role, _) in enumerate(uses):
            per[role].append((fwd.get(i, 0.0), bwd.get(i, 0.0)))
        for role, xs in per.items():
            samples[role].append((statistics.mean(x[0] for x in xs), statistics.mean(x[1] for x in xs)))
        other_f = span(t0, t1) - sum(fwd.values())
        other_b = span(t1, t2) - sum(bwd.values())
        samples["other"].append((max(0.0, other_f), max(0.0, other_b)))
    out = {role: (statistics.median(x[0] for x in xs), statistics.median(x[1] for x in xs))
           for role, xs in samples.items()}
    name = torch.cuda.get_device_name(dev) if cuda else "this CPU (1 process)"
    out["source"] = f"measured on {name}, {a.preset}, batch {a.batch} x seq {a.seq}"
    return out


# ---------------------------------------------------------------------------- schedules
@dataclass
class Net:
    intra: float  # bytes/s
    inter: float
    per_node: int
    latency: float  # s
    hop: float  # s

    def time(self, nbytes: float, world: int) -> float:
        if world <= 1:
            return 0.0
        bw = self.intra if world <= self.per_node else self.inter
        return self.latency + self.hop * (world - 1) + nbytes * (world - 1) / world / bw


def simulate_yafsdp(uses, slot_of, outsized, sizes, world, net, a, cmp, weight_free=None, gather_bytes=None,
                    expand=None) -> dict:
    """Two lanes (compute, comm) of one ZeRO-3 step of the yafsdp protocol; see the docstring.
    ``gather_bytes``: per unit, the bytes one gather moves (default: padded elements x param_dtype);
    ``expand``: per unit, seconds of the expand kernel behind its gather on the comm stream (FP8)."""
    pe = 2 if a.param_dtype == "bf16" else 4
    gather_bytes = gather_bytes or {u: n * pe for u, n in sizes.items()}
    expand = expand or {}
    moved = 0.0
    re_ = 2 if a.reduce_dtype == "bf16" else 4
    hbm = a.hbm_gbs * 1e9
    local = sum(sizes.values()) / world
    t_cast = (6 * local / hbm) if pe == 2 else 0.0
    comp = t_cast  # compute lane time
    comm = t_cast  # gathers wait for the cast pass (step event)
    comm_busy = 0.0
    compute_iv, comm_iv = [(0.0, t_cast)] if t_cast else [], []
    owner: dict[str, str | None] = {}
    release: dict[str, float] = {}
    ready: dict[str, float] = {}

    weight_free = weight_free or {}

    def gather(unit, issue_after):
        nonlocal comm, comm_busy
        s = slot_of[unit]
        if owner.get(s) == unit:
            return
        nonlocal moved
        start = max(comm, release.get(s, 0.0), issue_after)
        d = net.time(gather_bytes[unit], world)
        moved += gather_bytes[unit] * (world - 1) / world  # what the ring brings in from the other ranks
        comm = start + d + expand.get(unit, 0.0)
        comm_busy += d
        comm_iv.append((start, comm))
        owner[s] = unit
        ready[unit] = comm

    fwd = [(u.unit, u.fwd) for u in uses]
    # Forward: gather(k) at its pre-hook, prefetch k+1, compute after ready; release at the end.
    gather(fwd[0][0], 0.0)
    for k, (unit, t) in enumerate(fwd):
        if k + 1 < len(fwd):
            gather(fwd[k + 1][0], 0.0)
        start = max(comp, ready.get(unit, 0.0))
        comp = start + t
        compute_iv.append((start, comp))
        release[slot_of[unit]] = comp
    comp += cmp["other"][0] + cmp["other"][1]  # loss forward/backward
    # Backward: re-gather what no buffer still holds; reduce after each unit; grad buffers alternate.
    grad_slot = {}
    regular = [u for u in dict.fromkeys(x for x, _ in fwd) if not outsized[u]]
    for i, u in enumerate(regular):
        grad_slot[u] = f"grad{i % 2}"
    for u in outsized:
        if outsized[u]:
            grad_slot[u] = "grad_outsized"
    grad_free: dict[str, float] = {}
    bwd = [(u.unit, u.bwd) for u in uses][::-1]
    reduced: set[str] = set()

    def bw_gather(unit, issue_after):  # an embedding's backward reads no weights: no re-gather
        if not weight_free.get(unit):
            gather(unit, issue_after)

    bw_gather(bwd[0][0], comp)
    for k, (unit, t) in enumerate(bwd):
        if k + 1 < len(bwd):
            bw_gather(bwd[k + 1][0], comp)
        start = max(comp, ready.get(unit, 0.0))  # a weight-free unit's ready is from forward, long past
        end = start + t
        gs = grad_slot[unit]
        end = max(end, grad_free.get(gs, 0.0)) + sizes[unit] * pe * 2 / hbm  # grads into the buffer
        comp = end
        compute_iv.append((start, end))
        release[slot_of[unit]] = end
        last_use = all(x != unit for x, _ in bwd[k + 1:])
        if last_use and unit not in reduced:
            reduced.add(unit)
            rs_start = max(comm, end)
            d = net.time(sizes[unit] * re_, world)
            comm = rs_start + d
            comm_busy += d
            comm_iv.append((rs_start, comm))
            grad_free[gs] = comm
    t_opt = 28 * local / hbm
    end = max(comp, comm) + t_opt
    return dict(_lanes(compute_iv, comm_iv, end, comm_busy), gathered_bytes=moved)


def simulate_fsdp2(uses, sizes, world, net, a, cmp, n_param_tensors: int, root_units: set) -> dict:
    """The FSDP2-like schedule with its copies; see the docstring."""
    pe = 2 if a.param_dtype == "bf16" else 4
    re_ = 2 if a.reduce_dtype == "bf16" else 4
    hbm = a.hbm_gbs * 1e9
    comp = comm = comm_busy = 0.0
    compute_iv, comm_iv = [], []
    ready: dict[str, float] = {}
    held: set[str] = set()

    def gather(unit, issue_after, shard_of):
        nonlocal comm, comm_busy
        if unit in held:
            return
        shard = sizes[shard_of] / world
        start = max(comm, issue_after)
        cin = 6 * shard / hbm
        d = net.time(sizes[shard_of] * pe, world)
        comm = start + cin + d
        comm_busy += d
        comm_iv.append((start + cin, comm))
        ready[unit] = comm
        held.add(unit)

    root_size = sum(sizes[u] for u in root_units)
    sizes = dict(sizes)
    sizes["root"] = root_size

    def group(unit):
        return "root" if unit in root_units else unit

    fwd = [(group(u.unit), u.fwd) for u in uses]
    gather("root", 0.0, "root")
    for k, (g, t) in enumerate(fwd):
        if k + 1 < len(fwd):
            gather(fwd[k + 1][0], 0.0, fwd[k + 1][0])
        start = max(comp, ready.get(g, 0.0))
        if g != "root" or k == 0:
            start += 4 * sizes[g] / hbm  # copy-out on the compute stream
        comp = start + t
        compute_iv.append((start, comp))
        if g != "root":
            held.discard(g)  # reshard after forward
    comp += cmp["other"][0] + cmp["other"][1]
    bwd = [(group(u.unit), u.bwd) for u in uses][::-1]
    reduced: set[str] = set()
    for k, (g, t) in enumerate(bwd):
        if k + 1 < len(bwd):
            gather(bwd[k + 1][0], comp, bwd[k + 1][0])
        start = max(comp, ready.get(g, 0.0))
        if g != "root":
            start += 4 * sizes[g] / hbm
        comp = start + t
        compute_iv.append((start, comp))
        if all(x != g for x, _ in bwd[k + 1:]) and g not in reduced:
            reduced.add(g)
            held.discard(g)
            rs_start = max(comm, comp) + 6 * sizes[g] / hbm  # chunk_cat copy-in of the grads
            d = net.time(sizes[g] * re_, world)
            comm = rs_start + d
            comm_busy += d
            comm_iv.append((rs_start, comm))
    local = sum(v for k, v in sizes.items() if k != "root") / world
    t_opt = 28 * local / hbm + a.fsdp2_param_us * 1e-6 * n_param_tensors
    end = max(comp, comm) + t_opt
    return _lanes(compute_iv, comm_iv, end, comm_busy)


def _lanes(compute_iv, comm_iv, end, comm_busy) -> dict:
    from yafsdp.trace import exposed

    fig = exposed(comm_iv, compute_iv)
    return dict(step=end, comm=comm_busy, exposed=fig["exposed"], exposed_fraction=fig["exposed_fraction"],
                compute=fig["compute"])


# ---------------------------------------------------------------------------- main
def main(argv=None):
    a = parse(argv)
    model = build_llama(a.preset, device="meta")
    cfg = model.config
    if a.compute == "flops":
        cmp = flops_compute(a, cfg)
    elif a.compute == "measure":
        cmp = measure_compute(a)
    else:
        import json

        with open(a.compute_json) as f:
            cmp = {k: tuple(v) if isinstance(v, list) else v for k, v in json.load(f).items()}
    if a.save_compute:
        write_json(a.save_compute, cmp)
    uses = [Use(name, *cmp[role], 0) for name, role, _ in unit_uses(model)]
    net = Net(a.intra_busbw * 1e9, a.inter_busbw * 1e9, a.gpus_per_node, a.latency_us * 1e-6, a.hop_us * 1e-6)
    n_param_tensors = len(list(model.parameters()))
    root = {u.unit for u in uses if not u.unit.startswith("model.layers.")}
    rows, out = [], []
    for w in a.worlds:
        p = memory_plan(model, world_size=w, param_dtype=a.param_dtype, reduce_dtype=a.reduce_dtype)
        sizes = {u.name: u.padded_numel for u in p.units}
        slot_of = {u.name: u.weight_slot for u in p.units}
        outsized = {u.name: u.outsized for u in p.units}
        weight_free = {u.name: u.weight_free_bw for u in p.units}
        y = simulate_yafsdp(uses, slot_of, outsized, sizes, w, net, a, cmp, weight_free)
        f = simulate_fsdp2(uses, sizes, w, net, a, cmp, n_param_tensors, root)
        # gather_dtype="fp8": the plan of the same model with the decoder layers gathered as FP8 records,
        # plus the expand (records in, param_dtype values out) behind each such gather on the comm stream
        p8 = memory_plan(model, world_size=w, param_dtype=a.param_dtype, reduce_dtype=a.reduce_dtype,
                         gather_dtype="fp8")
        pe = 2 if a.param_dtype == "bf16" else 4
        gb8 = {u.name: u.gather_bytes for u in p8.units}
        exp8 = {u.name: u.padded_numel * (pe + u.gather_bytes / u.padded_numel) / (a.hbm_gbs * 1e9)
                for u in p8.units if u.fp8}
        y8 = simulate_yafsdp(uses, {u.name: u.weight_slot for u in p8.units}, {u.name: u.outsized for u in p8.units},
                             {u.name: u.padded_numel for u in p8.units}, w, net, a, cmp, weight_free, gb8, exp8)
        gathered = sum(sizes.values())
        out.append(dict(world=w, yafsdp=y, fsdp2=f, yafsdp_fp8=y8, gathered_elements=gathered))
        rows.append([w, 1e3 * y["step"], 1e3 * y["comm"], 1e3 * y["exposed"], y["exposed_fraction"],
                     1e3 * f["step"], 1e3 * f["exposed"], f["exposed_fraction"], y["step"] / f["step"],
                     y["gathered_bytes"] / 2**20, y8["gathered_bytes"] / 2**20, 1e3 * y8["step"], 1e3 * y8["exposed"],
                     y8["step"] / y["step"]])
    header = ["GPUs", "yafsdp step ms", "comm ms", "exposed ms", "exposed / comm", "FSDP2-like step ms",
              "exposed ms", "exposed / comm", "yafsdp / FSDP2", f"gathered MiB/step ({a.param_dtype})",
              "gathered MiB/step (fp8)", "fp8 step ms", "fp8 exposed ms", "fp8 / bf16 step"]
    table = md_table(header, rows)
    compute_ms = 1e3 * (sum(u.fwd + u.bwd for u in uses) + sum(cmp["other"]))
    setup = (f"{a.preset}, batch {a.batch} x seq {a.seq} per GPU, {a.param_dtype} gathers, {a.reduce_dtype} "
             f"reduce-scatters; compute {cmp['source']} ({compute_ms:.1f} ms of unit compute per step); links: "
             f"{a.intra_busbw:g} GB/s in a node of {a.gpus_per_node}, {a.inter_busbw:g} GB/s per GPU across nodes, "
             f"{a.latency_us:g} us + {a.hop_us:g} us/rank per collective; memory bandwidth {a.hbm_gbs:g} GB/s")
    assumptions = __doc__.split("Assumptions (all flags):")[1].split("    python")[0].strip()
    text = "\n".join([f"model_scaling: {setup}", "", table])
    print(text, flush=True)
    if a.png:
        draw(out, a.png, f"{a.preset}, b={a.batch} s={a.seq}; {cmp['source']}")
        print(f"wrote {a.png}")
    result = dict(kind="model_scaling", command=a.argv, setup=setup, versions=versions(), compute=cmp, rows=out,
                  table=table, assumptions=assumptions)
    if a.json:
        write_json(a.json, result)
    if a.md:
        from bench_step import write_md

        write_md(a.md, result, text + "\n\nAssumptions:\n" + assumptions, images=[a.png] if a.png else [])
    return result


def draw(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = [r["world"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, style in (("yafsdp", "o-"), ("fsdp2", "s--"), ("yafsdp_fp8", "^-.")):
        label = {"yafsdp": "yafsdp", "fsdp2": "FSDP2-like", "yafsdp_fp8": "yafsdp, fp8 gathers"}[key]
        ax1.plot(w, [1e3 * r[key]["step"] for r in rows], style, label=label)
        ax2.plot(w, [100 * r[key]["exposed_fraction"] for r in rows], style, label=label)
    ax1.plot(w, [1e3 * r["yafsdp"]["compute"] for r in rows], ":", color="grey", label="compute only")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(w, [str(x) for x in w])
        ax.set_xlabel("GPUs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylabel("predicted step time (ms)")
    ax2.set_ylabel("exposed communication (% of comm time)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
