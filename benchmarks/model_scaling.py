"""Scaling beyond this machine, on paper: predicted step time and exposed communication at
8-1024 GPUs for yafsdp and an FSDP2-like schedule.

Inputs:
- per-unit forward/backward compute time: measured on this device (``--compute measure``: the
  plain model, one process, per-unit timing hooks; CUDA events on GPU), loaded from an earlier
  measurement (``--compute json --compute-json F``), or estimated from FLOPs at an assumed
  model-FLOPs utilisation (``--compute flops --peak-tflops 989 --mfu 0.45``). The default
  (``--compute auto``) takes a committed GPU measurement of the preset at the same micro-batch and
  sequence length where there is one (Llama-3-8B and -70B at 1 x 8192, measured on an H200:
  ``benchmarks/results/gpu_2026-11-27/compute_*_h200.json``) and FLOPs otherwise; the header line of
  every result says which;
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
  before; "gathered MiB/step" is the all-gather output bytes of one step on each rank;
- HSDP (yafsdp's ``mesh=(replicas, shard)``): the shard group is the smallest multiple of a node
  whose memory plan (model states, buffers, and activations of the micro-batch with per-layer
  checkpointing, from ``yafsdp.plan``) fits ``--gpu-mem-gib`` (or ``--hsdp-shard``); gathers and
  reduce-scatters run over it exactly as full sharding over that many ranks, and the fp32 grad shards
  are all-reduced across the replicas (a ring over one GPU per replica, each on its own node, at the
  per-GPU NIC bandwidth: ``latency + hop * (R - 1) + 2 * B * (R - 1) / R / busbw``), on the same one
  comm lane: overlapped = right behind each unit's reduce-scatter in backward (the engine's steady
  state: the last backward of a step is predicted from the previous step), deferred = one
  all-reduce of every shard after backward, before the optimizer (the first step, or a step whose
  accumulation changed); with ``--grad-accum k`` every schedule runs k forward/backward passes per
  optimizer step (yafsdp keeps a unit a buffer still holds; FSDP2 re-gathers), full sharding repeats
  its cross-node traffic k times while HSDP's all-reduce stays once per step;
- ignored for both: kernel-launch gaps, the small group (1-D parameters: a few MB), contention of
  the comm kernels for SMs, stragglers.

    python benchmarks/model_scaling.py                                   # llama3-8b, the committed H200 compute
    python benchmarks/model_scaling.py --preset llama3-70b                # HSDP rows: shard group sized by memory
    python benchmarks/model_scaling.py --compute measure --preset cpu-6x256   # compute measured here
    python benchmarks/model_scaling.py --compute measure --device cuda --preset llama3-8b --layers 4 \\
        --batch 1 --seq 8192 --save-compute runs/compute_h100.json      # one GPU, no process group
    python benchmarks/model_scaling.py --study zeropp --preset llama3-70b   # qwZ, hpZ, qgZ, HSDP: 64-4,096 GPUs
    python benchmarks/model_scaling.py --study tp --preset llama3-405b --compute flops --mfu 0.57  # TP 8 x sharding

The scale-out options (``--study``, the cost of each collective in benchmarks/scaling_options.py, its
assumptions written into every report): ``--study zeropp`` predicts full sharding with compact gathers
(qwZ), a secondary shard inside the node for the backward gather (hpZ), quantized gradient reduction
across nodes (qgZ), their combination and HSDP, at 64-4,096 GPUs, for each cross-node line rate of
``--nic-gbit`` and each way a flat ring crosses nodes (``--cross rail,spread``: [Note: the two-level
network]); ``--study tp`` predicts tensor parallel of degree ``--tp`` inside a node with sharding across
nodes, against full sharding and against the FSDP2-like schedule with the same layout.
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
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches (backward passes) per optimizer step")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--param-dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--reduce-dtype", default="fp32", choices=["bf16", "fp32"])
    ap.add_argument("--compute", default="auto", choices=["auto", "flops", "measure", "json"],
                    help="auto: a committed GPU measurement of this preset, batch and seq "
                    "(benchmarks/results/gpu_*/compute_*.json) where there is one, else flops")
    ap.add_argument("--compute-json", default=None)
    ap.add_argument("--save-compute", default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM: 989)")
    ap.add_argument("--mfu", type=float, default=0.45, help="assumed model-FLOPs utilisation of unit compute")
    ap.add_argument("--worlds", default=None, help="default 8,16,...,1024; with --study 64,128,...,4096")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--intra-busbw", type=float, default=360.0, help="GB/s, NVLink all-gather bus bandwidth")
    ap.add_argument("--inter-busbw", type=float, default=48.0, help="GB/s per GPU (its NIC) across nodes")
    ap.add_argument("--latency-us", type=float, default=15.0, help="fixed cost per collective")
    ap.add_argument("--hop-us", type=float, default=0.5, help="added per rank in the ring")
    ap.add_argument("--hbm-gbs", type=float, default=2500.0, help="achieved memory bandwidth for copies/optimizer")
    ap.add_argument("--fsdp2-param-us", type=float, default=4.0, help="FSDP2 optimizer cost per parameter tensor")
    ap.add_argument("--hsdp-shard", default="auto",
                    help="HSDP shard group size (a multiple of --gpus-per-node), or auto: the smallest that fits "
                    "--gpu-mem-gib")
    ap.add_argument("--gpu-mem-gib", type=float, default=80.0, help="GPU memory for the HSDP shard-size fit (H100: 80)")
    ap.add_argument("--bytes", default=None, metavar="RxS,...",
                    help="only print (JSON) the bytes one rank puts into each collective kind per step for these "
                    "meshes (replicas x shard), overlapped and deferred; tests/jobs/test_bench_smoke.py checks them "
                    "against the engine's counts")
    ap.add_argument("--study", default=None, choices=["zeropp", "tp", "prefetch"],
                    help="zeropp: the ZeRO++ options (compact gathers, secondary shard, quantized gradient "
                    "reduction) and HSDP; tp: tensor parallel in a node x sharding across; prefetch: prefetch=1 "
                    "against prefetch=2 (gathers two units ahead); see study_zeropp / study_tp / study_prefetch")
    ap.add_argument("--nic-gbit", default="100,200,400",
                    help="--study: line rates per GPU across nodes, Gb/s, each taken at --nic-efficiency")
    ap.add_argument("--nic-efficiency", type=float, default=0.96, help="achieved / line rate (400 Gb/s -> 48 GB/s)")
    ap.add_argument("--cross", default="rail,spread",
                    help="--study: how a flat ring crosses nodes ([Note: the two-level network] in "
                    "benchmarks/scaling_options.py): rail, spread or both")
    ap.add_argument("--tp", type=int, default=8, help="--study tp: tensor-parallel degree (inside a node)")
    ap.add_argument("--recompute", action="store_true",
                    help="--study tp: full activation checkpointing (a layer's forward and its TP collectives again "
                    "in backward)")
    ap.add_argument("--png", default="runs/model_scaling.png")
    ap.add_argument("--json", default="runs/model_scaling.json")
    ap.add_argument("--md", default=None)
    a = ap.parse_args(argv)
    if a.worlds is None:
        a.worlds = ("64,128,256,512,1024,2048,4096" if a.study in ("zeropp", "tp")
                    else "8,16,32,64,128,256,512,1024")
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


def load_compute(path: str) -> dict:
    import json

    with open(path) as f:
        return {k: tuple(v) if isinstance(v, list) else v for k, v in json.load(f).items()}


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def committed_measurement(preset: str, batch: int, seq: int) -> str | None:
    """The newest committed GPU measurement (``benchmarks/results/gpu_<date>/compute_*.json``, written by
    ``--compute measure --device cuda --save-compute``) of this preset at this micro-batch and sequence
    length, or None. Its "source" names them, as ``measure_compute`` writes it."""
    import glob

    for path in sorted(glob.glob(os.path.join(RESULTS, "gpu_*", "compute_*.json")), reverse=True):
        src = load_compute(path).get("source", "")
        if "CPU" not in src and measured_shape(src) == (preset, batch, seq):
            return path
    return None


def measured_shape(source: str) -> tuple[str, int, int] | None:
    """(preset, micro-batch, sequence length) of a measurement's "source" line, None for FLOP estimates."""
    import re

    m = re.fullmatch(r"measured on .*, (\S+), batch (\d+) x seq (\d+)", source)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


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

    def all_reduce(self, nbytes: float, replicas: int) -> float:
        """A ring all-reduce of ``nbytes`` over one GPU per replica, each on another node (HSDP)."""
        if replicas <= 1:
            return 0.0
        return self.latency + self.hop * (replicas - 1) + 2 * nbytes * (replicas - 1) / replicas / self.inter


def simulate_yafsdp(uses, slot_of, outsized, sizes, world, net, a, cmp, weight_free=None, replicas: int = 1,
                    overlap: bool = True, accum: int = 1, gather_bytes=None, expand=None, link=None,
                    prefetch: int = 1) -> dict:
    """Two lanes (compute, comm) of one ZeRO-3 step of the yafsdp protocol; see the docstring.
    ``world``: the shard group; ``replicas`` > 1: HSDP, its all-reduce overlapped (with the last of
    ``accum`` backward passes) or deferred (after it). ``gather_bytes``: per unit, the bytes one
    gather moves (default: padded elements x param_dtype); ``expand``: per unit, seconds of the
    expand kernel behind its gather on the comm stream (fp8 gathers). ``link``: the cost of each
    collective from ``benchmarks/scaling_options.py`` (``link(kind, unit, nbytes, phase) -> Cost``:
    the secondary shard, quantized reductions, a tensor-parallel layout), which also counts the bytes
    each GPU sends over NVLink and over its NIC (``links``); default: ``net`` as above. ``prefetch``: the
    engine's option, the uses gathered ahead of the one computing (``slot_of`` then from a plan with as
    many weight buffers; a farther one only into a buffer no nearer use takes, as the engine does).
    Also counts the bytes put into each kind of collective (``bytes``; the engine's
    ``schedule.counted`` is checked against it in tests/jobs/test_bench_smoke.py)."""
    links = dict(nvlink=0.0, nic=0.0)

    def wire(kind, unit, nbytes, phase=""):
        """(seconds on the wire, seconds of kernels behind it on the comm lane) of one collective."""
        if link is None:
            return (net.all_reduce(nbytes, replicas) if kind == "all_reduce" else net.time(nbytes, world)), 0.0
        c = link(kind, unit, nbytes, phase)
        links["nvlink"] += c.nvlink
        links["nic"] += c.nic
        return c.seconds, c.extra

    nbytes = dict(gather=0, reduce=0, all_reduce=0)
    pe = 2 if a.param_dtype == "bf16" else 4
    gather_bytes = gather_bytes or {u: n * pe for u, n in sizes.items()}
    expand = expand or {}
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

    def gather(unit, issue_after, phase="forward"):
        nonlocal comm, comm_busy
        s = slot_of[unit]
        if owner.get(s) == unit:
            return
        start = max(comm, release.get(s, 0.0), issue_after)
        d, extra = wire("gather", unit, gather_bytes[unit], phase)
        nbytes["gather"] += gather_bytes[unit]
        comm = start + d + expand.get(unit, 0.0) + extra
        comm_busy += d
        comm_iv.append((start, comm))
        owner[s] = unit
        ready[unit] = comm

    fwd = [(u.unit, u.fwd) for u in uses]
    grad_slot = {}
    regular = [u for u in dict.fromkeys(x for x, _ in fwd) if not outsized[u]]
    for i, u in enumerate(regular):
        grad_slot[u] = f"grad{i % 2}"
    for u in outsized:
        if outsized[u]:
            grad_slot[u] = "grad_outsized"
    grad_free: dict[str, float] = {}
    bwd = [(u.unit, u.bwd) for u in uses][::-1]
    all_reduce = 0.0

    def bw_gather(unit, issue_after):  # an embedding's backward reads no weights: no re-gather
        if not weight_free.get(unit):
            gather(unit, issue_after, "backward")

    def ahead(seq, k, issue_after, fetch):  # [Note: prefetch depth] in yafsdp/engine/runtime.py
        taken = [slot_of[seq[k][0]]]
        for j in range(k + 1, min(k + 1 + prefetch, len(seq))):
            if j > k + 1 and slot_of[seq[j][0]] in taken:
                return
            fetch(seq[j][0], issue_after)
            taken.append(slot_of[seq[j][0]])

    for micro in range(accum):  # accumulation: buffers still holding a unit keep it (no step in between)
        last = micro == accum - 1
        # Forward: gather(k) at its pre-hook, prefetch k+1, compute after ready; release at the end.
        gather(fwd[0][0], 0.0)
        for k, (unit, t) in enumerate(fwd):
            ahead(fwd, k, 0.0, gather)
            start = max(comp, ready.get(unit, 0.0))
            comp = start + t
            compute_iv.append((start, comp))
            release[slot_of[unit]] = comp
        comp += cmp["other"][0] + cmp["other"][1]  # loss forward/backward
        # Backward: re-gather what no buffer still holds; reduce after each unit; grad buffers alternate.
        reduced: set[str] = set()
        bw_gather(bwd[0][0], comp)
        for k, (unit, t) in enumerate(bwd):
            ahead(bwd, k, comp, bw_gather)
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
                d, extra = wire("reduce", unit, sizes[unit] * re_)
                nbytes["reduce"] += sizes[unit] * re_
                comm = rs_start + d + extra
                comm_busy += d
                comm_iv.append((rs_start, comm))
                if replicas > 1 and overlap and last:  # the unit's fp32 grad shard, right behind its fold
                    shard_bytes = sizes[unit] // world * 4
                    d, extra = wire("all_reduce", unit, shard_bytes)
                    nbytes["all_reduce"] += shard_bytes
                    comm_iv.append((comm, comm + d + extra))
                    comm += d + extra
                    comm_busy += d
                    all_reduce += d
                grad_free[gs] = comm
    end = max(comp, comm)
    if replicas > 1 and not overlap:  # deferred: every grad shard at once, before the optimizer
        shard_bytes = sum(sizes[u] // world for u in reduced) * 4
        d, extra = wire("all_reduce", None, shard_bytes)
        nbytes["all_reduce"] += shard_bytes
        comm_iv.append((end, end + d + extra))
        end += d + extra
        comm_busy += d
        all_reduce += d
    t_opt = 28 * local / hbm
    end = end + t_opt
    out = _lanes(compute_iv, comm_iv, end, comm_busy)
    out.update(bytes=nbytes, all_reduce=all_reduce, shard=world, replicas=replicas, links=links)
    return out


def simulate_fsdp2(uses, sizes, world, net, a, cmp, n_param_tensors: int, root_units: set, accum: int = 1) -> dict:
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
    bwd = [(group(u.unit), u.bwd) for u in uses][::-1]
    for _ in range(accum):  # FSDP2 reshards after each backward: every micro-step gathers again
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


def plan_maps(p):
    """(padded sizes, weight slot, outsized, weight-free backward) per unit name, from a memory plan."""
    return ({u.name: u.padded_numel for u in p.units}, {u.name: u.weight_slot for u in p.units},
            {u.name: u.outsized for u in p.units}, {u.name: u.weight_free_bw for u in p.units})


def simulate_plan(uses, p, world, net, a, cmp, **kw) -> dict:
    """simulate_yafsdp over the units of memory plan ``p``."""
    sizes, slot_of, outsized, weight_free = plan_maps(p)
    return simulate_yafsdp(uses, slot_of, outsized, sizes, world, net, a, cmp, weight_free, **kw)


def hsdp_shard(a, model) -> int | None:
    """The HSDP shard group: --hsdp-shard, or the smallest multiple of a node whose memory plan
    (with the micro-batch's activations under per-layer checkpointing) fits --gpu-mem-gib."""
    if a.hsdp_shard != "auto":
        return int(a.hsdp_shard)
    s = a.gpus_per_node
    while s <= max(a.worlds):
        p = memory_plan(model, world_size=s, param_dtype=a.param_dtype, reduce_dtype=a.reduce_dtype,
                        batch=a.batch, seq=a.seq, checkpointing=True)
        if p.total <= a.gpu_mem_gib * 2**30:
            return s
        s *= 2
    return None


def predicted_bytes(model, shard: int, replicas: int, param_dtype: str = "fp32", reduce_dtype: str = "fp32",
                    overlap: bool = True, accum: int = 1) -> dict:
    """Bytes this rank puts into gathers, reduce-scatters and (HSDP) all-reduces in one optimizer
    step of ``accum`` backward passes (the small group left out), as the simulation counts them."""
    a = parse(["--param-dtype", param_dtype, "--reduce-dtype", reduce_dtype])
    cmp = dict(embed=(0.0, 0.0), layer=(0.0, 0.0), head=(0.0, 0.0), other=(0.0, 0.0))
    uses = [Use(name, 0.0, 0.0, 0) for name, _, _ in unit_uses(model)]
    net = Net(1.0, 1.0, 8, 0.0, 0.0)
    p = memory_plan(model, world_size=shard, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    return simulate_plan(uses, p, shard, net, a, cmp, replicas=replicas, overlap=overlap, accum=accum)["bytes"]


# ---------------------------------------------------------------------------- main
def resolve_compute(a, cfg) -> dict:
    """Per-role (forward, backward) seconds of unit compute as ``--compute`` asks (see the docstring)."""
    if a.compute == "auto" and a.compute_json:  # a file named is the file used
        a.compute = "json"
    elif a.compute == "auto":  # (the committed measurements are of bf16 compute)
        a.compute_json = committed_measurement(a.preset, a.batch, a.seq) if a.param_dtype == "bf16" else None
        a.compute = "json" if a.compute_json else "flops"
    elif a.compute == "json" and not a.compute_json:
        raise SystemExit("model_scaling: --compute json needs --compute-json FILE (written by --save-compute)")
    elif a.compute_json and a.compute != "json":
        raise SystemExit(f"model_scaling: --compute-json is read only with --compute json or auto, not {a.compute}")
    if a.compute == "flops":
        cmp = flops_compute(a, cfg)
    elif a.compute == "measure":
        cmp = measure_compute(a)
    else:
        cmp = load_compute(a.compute_json)
        shape = measured_shape(cmp.get("source", ""))
        if shape and shape != (a.preset, a.batch, a.seq):  # per-unit times scale with the tokens and the shapes
            raise SystemExit(f"model_scaling: {a.compute_json} was measured for {shape[0]} at batch {shape[1]} x seq "
                             f"{shape[2]}, not {a.preset} at batch {a.batch} x seq {a.seq}: measure this shape "
                             "(--compute measure --save-compute) or use --compute flops")
    return cmp


# Shapes beyond yafsdp.presets, built from a preset with overrides (Meta's config.json of Llama-3.1-405B)
SHAPES = {"llama3-405b": ("llama3-70b", dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                             num_attention_heads=128, num_key_value_heads=8))}


def build_model(name: str):
    """The meta-device model of preset ``name`` (or of a shape in ``SHAPES``)."""
    base, over = SHAPES.get(name, (name, {}))
    return build_llama(base, device="meta", **over)


def main(argv=None):
    a = parse(argv)
    model = build_model(a.preset)
    if a.bytes:
        import json

        out = {}
        for mesh in a.bytes.split(","):
            r, sh = (int(x) for x in mesh.split("x"))
            out[mesh] = {how: predicted_bytes(model, sh, r, a.param_dtype, a.reduce_dtype,
                                              overlap=(how == "overlapped"), accum=a.grad_accum)
                         for how in ("overlapped", "deferred")}
        print(json.dumps(out))
        return out
    cmp = resolve_compute(a, model.config)
    if a.save_compute:
        write_json(a.save_compute, cmp)
    if a.study:
        from scaling_options import study_prefetch, study_tp, study_zeropp

        return dict(zeropp=study_zeropp, tp=study_tp, prefetch=study_prefetch)[a.study](a, model, cmp)
    uses = [Use(name, *cmp[role], 0) for name, role, _ in unit_uses(model)]

    net = Net(a.intra_busbw * 1e9, a.inter_busbw * 1e9, a.gpus_per_node, a.latency_us * 1e-6, a.hop_us * 1e-6)
    n_param_tensors = len(list(model.parameters()))
    root = {u.unit for u in uses if not u.unit.startswith("model.layers.")}
    plans: dict[int, object] = {}

    def plan_of(w):
        if w not in plans:
            plans[w] = memory_plan(model, world_size=w, param_dtype=a.param_dtype, reduce_dtype=a.reduce_dtype)
        return plans[w]

    def sim(w, replicas=1, overlap=True):
        return simulate_plan(uses, plan_of(w), w, net, a, cmp, replicas=replicas, overlap=overlap, accum=a.grad_accum)

    shard = hsdp_shard(a, model)
    rows, hrows, out = [], [], []
    for w in a.worlds:
        sizes, slot_of, outsized, weight_free = plan_maps(plan_of(w))
        y = sim(w)
        f = simulate_fsdp2(uses, sizes, w, net, a, cmp, n_param_tensors, root, accum=a.grad_accum)
        gathered = sum(sizes.values())
        # gather_dtype="fp8": the plan of the same model with the decoder layers gathered as FP8 records,
        # plus the expand (records in, param_dtype values out) behind each such gather on the comm stream
        p8 = memory_plan(model, world_size=w, param_dtype=a.param_dtype, reduce_dtype=a.reduce_dtype,
                         gather_dtype="fp8")
        pe = 2 if a.param_dtype == "bf16" else 4
        gb8 = {u.name: u.gather_bytes for u in p8.units}
        exp8 = {u.name: u.padded_numel * (pe + u.gather_bytes / u.padded_numel) / (a.hbm_gbs * 1e9)
                for u in p8.units if u.compact}
        y8 = simulate_plan(uses, p8, w, net, a, cmp, accum=a.grad_accum, gather_bytes=gb8, expand=exp8)
        row = dict(world=w, yafsdp=y, fsdp2=f, yafsdp_fp8=y8, gathered_elements=gathered)
        rows.append([w, 1e3 * y["step"], 1e3 * y["comm"], 1e3 * y["exposed"], y["exposed_fraction"],
                     1e3 * f["step"], 1e3 * f["exposed"], f["exposed_fraction"], y["step"] / f["step"],
                     y["bytes"]["gather"] / 2**20, y8["bytes"]["gather"] / 2**20, 1e3 * y8["step"],
                     1e3 * y8["exposed"], y8["step"] / y["step"]])
        if shard is not None and w % shard == 0 and w // shard >= 2:
            r = w // shard
            h, hd = sim(shard, r, True), sim(shard, r, False)
            row.update(hsdp=h, hsdp_deferred=hd)
            # bytes each GPU sends over its NIC per step: full sharding's rings all cross nodes once
            # the world leaves a node; HSDP's shard-group rings only when the group spans nodes
            nic_full = (y["bytes"]["gather"] + y["bytes"]["reduce"]) * (w - 1) / w if w > a.gpus_per_node else 0
            nic_h = ((h["bytes"]["gather"] + h["bytes"]["reduce"]) * (shard - 1) / shard if shard > a.gpus_per_node
                     else 0) + 2 * h["bytes"]["all_reduce"] * (r - 1) / r
            hrows.append([w, f"{r} x {shard}", 1e3 * y["step"], 1e3 * y["exposed"], 1e3 * h["step"],
                          1e3 * h["exposed"], 1e3 * h["all_reduce"], 1e3 * hd["step"], nic_full / 2**30,
                          nic_h / 2**30, h["step"] / y["step"]])
        out.append(row)
    header = ["GPUs", "yafsdp step ms", "comm ms", "exposed ms", "exposed / comm", "FSDP2-like step ms",
              "exposed ms", "exposed / comm", "yafsdp / FSDP2", f"gathered MiB/step ({a.param_dtype})",
              "gathered MiB/step (fp8)", "fp8 step ms", "fp8 exposed ms", "fp8 / bf16 step"]
    table = md_table(header, rows)
    hheader = ["GPUs", "HSDP replicas x shard", "full-shard step ms", "exposed ms", "HSDP step ms", "exposed ms",
               "all-reduce ms", "HSDP deferred step ms", "NIC GiB/GPU full", "NIC GiB/GPU HSDP", "HSDP / full"]
    htable = md_table(hheader, hrows) if hrows else "(no world is a multiple >= 2 of the HSDP shard group)"
    compute_ms = 1e3 * (sum(u.fwd + u.bwd for u in uses) + sum(cmp["other"])) * a.grad_accum
    setup = (f"{a.preset}, batch {a.batch} x seq {a.seq} per GPU x {a.grad_accum} accumulation, {a.param_dtype} gathers, {a.reduce_dtype} "
             f"reduce-scatters; compute {cmp['source']} ({compute_ms:.1f} ms of unit compute per step); links: "
             f"{a.intra_busbw:g} GB/s in a node of {a.gpus_per_node}, {a.inter_busbw:g} GB/s per GPU across nodes, "
             f"{a.latency_us:g} us + {a.hop_us:g} us/rank per collective; memory bandwidth {a.hbm_gbs:g} GB/s")
    hsetup = (f"HSDP: shard group of {shard} GPUs ({a.hsdp_shard} for {a.gpu_mem_gib:g} GiB per GPU), "
              "fp32 grad shards all-reduced across replicas once per step; 'HSDP step' = overlapped with the last "
              "backward (steady state), 'deferred' = after backward (first step)" if shard else
              f"HSDP: no shard group fits {a.gpu_mem_gib:g} GiB")
    assumptions = __doc__.split("Assumptions (all flags):")[1].split("    python")[0].strip()
    text = "\n".join([f"model_scaling: {setup}", "", table, "", hsetup, "", htable])
    print(text, flush=True)
    if a.png:
        draw(out, a.png, f"{a.preset}, b={a.batch} s={a.seq}; {cmp['source']}")
        print(f"wrote {a.png}")
    result = dict(kind="model_scaling", command=a.argv, setup=setup, versions=versions(), compute=cmp, rows=out,
                  table=table, hsdp_table=htable, hsdp_shard=shard, assumptions=assumptions)
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
        label = {"yafsdp": "yafsdp (full sharding)", "fsdp2": "FSDP2-like", "yafsdp_fp8": "yafsdp, fp8 gathers"}[key]
        ax1.plot(w, [1e3 * r[key]["step"] for r in rows], style, label=label)
        ax2.plot(w, [100 * r[key]["exposed_fraction"] for r in rows], style, label=label)
    hs = [r for r in rows if "hsdp" in r]
    if hs:
        hw = [r["world"] for r in hs]
        shape = f"{hs[0]['hsdp']['shard']}-GPU shard groups"
        ax1.plot(hw, [1e3 * r["hsdp"]["step"] for r in hs], "^-", label=f"yafsdp HSDP ({shape})")
        ax1.plot(hw, [1e3 * r["hsdp_deferred"]["step"] for r in hs], "v:", label="HSDP, all-reduce deferred")
        ax2.plot(hw, [100 * r["hsdp"]["exposed_fraction"] for r in hs], "^-", label="yafsdp HSDP")
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
