"""The scale-out options on paper: the cost of each collective on a two-level network (NVLink inside
a node, one NIC per GPU across nodes), for ``benchmarks/model_scaling.py --study zeropp`` (the
ZeRO++ options and HSDP) and ``--study tp`` (tensor parallel inside a node x sharding across).

Nothing here runs a collective: every function returns a ``Cost`` (seconds on the wire, seconds of
kernels behind it on the comm lane, bytes one GPU sends over NVLink and over its NIC), and
model_scaling.py's two-lane simulation of a step places them. See [Note: the two-level network].
"""
from __future__ import annotations

from dataclasses import dataclass

# int8 (and fp8) records of yafsdp/formats: one byte per value and one fp32 scale per 128 values
QBYTES = 1 + 4 / 128


@dataclass
class Cost:
    """One collective as one GPU sees it."""

    seconds: float = 0.0  # on the wire (the collective itself)
    extra: float = 0.0  # kernels behind it on the comm lane (copies, quantize, dequantize + sum)
    nvlink: float = 0.0  # bytes this GPU sends over NVLink
    nic: float = 0.0  # bytes this GPU sends over its NIC

    def __add__(self, o: "Cost") -> "Cost":
        return Cost(self.seconds + o.seconds, self.extra + o.extra, self.nvlink + o.nvlink, self.nic + o.nic)


# [Note: the two-level network]
# A node holds ``per_node`` GPUs on NVLink (all-gather bus bandwidth ``intra``); each GPU has its own
# NIC of ``nic`` bytes/s across nodes. A group of k GPUs on each of m nodes runs a ring collective
# (all-gather or reduce-scatter) of B bytes (the gathered size); every GPU sends B (g - 1) / g, g = k m.
# - m = 1: all of it over NVLink. k = 1 (one GPU per node: an HSDP replica ring, a data-parallel group
#   beside tensor parallelism): all of it over the GPU's own NIC. Both are exact.
# - k > 1 and m > 1 (full sharding past a node): how a ring's node crossings use the node's NICs is
#   the one assumption that moves every answer, so it is a flag, ``cross``:
#   "rail" (default): every GPU's whole ring share crosses its own NIC, time B (g - 1) / g / nic. It is
#   the accounting of the ZeRO++ paper ("M per GPU" across nodes for a ZeRO-3 all-gather) and of
#   model_scaling.py's earlier tables (``--inter-busbw``), and an upper bound on the cost.
#   "spread": a ring crosses between nodes once per node, so a node sends B (g - 1) / g across, spread
#   over its k NICs (NCCL's multi-channel rings), time B (g - 1) / g / min(intra, k nic). The lower bound
#   for large messages.
# Hierarchical collectives (the secondary shard's backward gather inside a node, qgZ's two stages,
# HSDP's replica all-reduce, tensor parallelism's data-parallel rings) are exact under both: the
# options' gains over flat full sharding are largest under "rail" and smallest under "spread".
# Every collective also pays ``latency + hop (g - 1)``.


@dataclass
class Fabric:
    intra: float  # bytes/s, NVLink all-gather bus bandwidth
    nic: float  # bytes/s per GPU across nodes
    per_node: int
    latency: float  # s per collective
    hop: float  # s per rank in the ring
    hbm: float  # bytes/s for the kernels around a collective
    cross: str = "rail"  # "rail" | "spread": see the note

    def __post_init__(self):
        if self.cross not in ("rail", "spread"):
            raise ValueError(f"scaling_options.Fabric: cross={self.cross!r}; expected 'rail' or 'spread'")

    def ring(self, nbytes: float, k: int, m: int) -> Cost:
        """A ring all-gather / reduce-scatter of ``nbytes`` (gathered size) over k GPUs on each of m nodes."""
        g = k * m
        if g <= 1:
            return Cost()
        share = nbytes * (g - 1) / g
        t0 = self.latency + self.hop * (g - 1)
        if m == 1:
            return Cost(t0 + share / self.intra, nvlink=share)
        if k == 1 or self.cross == "rail":
            return Cost(t0 + share / self.nic, nic=share)
        return Cost(t0 + share / min(self.intra, k * self.nic), nvlink=share * (k - 1) / k, nic=share / k)

    def all_to_all(self, nbytes: float, m: int) -> Cost:
        """Each of m GPUs (one per node) sends the other m - 1 their part of its ``nbytes``."""
        if m <= 1:
            return Cost()
        share = nbytes * (m - 1) / m
        return Cost(self.latency + self.hop * (m - 1) + share / self.nic, nic=share)

    def all_reduce(self, nbytes: float, replicas: int) -> Cost:
        """A ring all-reduce of ``nbytes`` over one GPU per replica, each on its own node (HSDP)."""
        if replicas <= 1:
            return Cost()
        share = 2 * nbytes * (replicas - 1) / replicas
        return Cost(self.latency + self.hop * (replicas - 1) + share / self.nic, nic=share)

    def hier_reduce(self, numel: int, reduce_bytes: int, k: int, m: int, wire_bytes: float = QBYTES) -> Cost:
        """qgZ: reduce-scatter of ``numel`` gradient elements in ``reduce_bytes`` inside the node (k GPUs,
        NVLink), then each GPU's 1/k summed across the m nodes by one all-to-all of ``wire_bytes`` per
        element (int8 codes + a scale per block) and an fp32 sum at the receiver: one quantization per
        element, never a running sum in 8 bits. ``wire_bytes=4`` is the same path in fp32."""
        inside = self.ring(numel * reduce_bytes, k, 1)
        part = numel / k
        across = self.all_to_all(part * wire_bytes, m)
        # quantize (read 4, write wire), dequantize and sum (read wire per source, write 4)
        kernels = (4 + 2 * wire_bytes + 4) * part / self.hbm if m > 1 else 0.0
        return inside + across + Cost(extra=kernels)

    def quantized_all_reduce(self, numel: int, replicas: int, wire_bytes: float = QBYTES) -> Cost:
        """HSDP's replica all-reduce of an fp32 grad shard of ``numel`` elements sent as records: an
        all-to-all reduce (each sums its 1/R in fp32) and an all-gather of the sums, re-quantized once."""
        if replicas <= 1:
            return Cost()
        share = 2 * numel * wire_bytes * (replicas - 1) / replicas
        kernels = 2 * (4 + 2 * wire_bytes + 4) * numel / self.hbm
        return Cost(self.latency + self.hop * (replicas - 1) + share / self.nic, extra=kernels, nic=share)


@dataclass(frozen=True)
class Option:
    """One configuration of the ZeRO++ study: a shard group of ``shard`` GPUs (k per node on
    shard / k nodes), ``replicas`` copies of it (HSDP), and the options."""

    name: str
    shard: int
    replicas: int = 1
    qw: bool = False  # compact gathers (gather_dtype="int8": records of QBYTES per value)
    hp: bool = False  # secondary shard inside the node, backward gathers over NVLink
    qg: bool = False  # quantized gradient reduction across nodes (and of the replica all-reduce)
    engine: str = "yafsdp"  # or "fsdp2": the FSDP2-like schedule of model_scaling.py
    prefetch: int = 1  # the engine's option: units gathered ahead (2: a third weight buffer)


def layout(shard: int, per_node: int) -> tuple[int, int]:
    """(GPUs per node, nodes) of a shard group laid out node by node."""
    if shard <= per_node:
        return shard, 1
    if shard % per_node:
        raise ValueError(f"scaling_options.layout: a shard group of {shard} GPUs is not whole nodes of {per_node}")
    return per_node, shard // per_node


def option_link(fab: Fabric, opt: Option, sizes: dict, reduce_bytes: int):
    """``link(kind, unit, nbytes, phase) -> Cost`` for model_scaling.simulate_yafsdp under ``opt``."""
    k, m = layout(opt.shard, fab.per_node)

    def link(kind, unit, nbytes, phase):
        if kind == "gather":
            if opt.hp and m > 1 and phase == "backward":  # from the secondary shard, inside the node
                return fab.ring(nbytes, k, 1)
            c = fab.ring(nbytes, k, m)
            if opt.hp and m > 1:  # the forward gather also leaves this GPU's 1/k of the unit behind
                c = c + Cost(extra=2 * nbytes / k / fab.hbm)
            return c
        if kind == "reduce":
            if opt.qg and m > 1:
                return fab.hier_reduce(sizes[unit], reduce_bytes, k, m)
            return fab.ring(nbytes, k, m)
        if opt.qg:  # "all_reduce": nbytes of fp32 shard
            return fab.quantized_all_reduce(nbytes // 4, opt.replicas)
        return fab.all_reduce(nbytes, opt.replicas)

    return link


class RingNet:
    """A ``Net`` for model_scaling.simulate_fsdp2: every collective a ring over k GPUs on each of m
    nodes of ``fab``, its bytes per link counted."""

    def __init__(self, fab: Fabric, k: int, m: int):
        self.fab, self.k, self.m = fab, k, m
        self.links = dict(nvlink=0.0, nic=0.0)

    def time(self, nbytes: float, world: int) -> float:
        assert world == self.k * self.m, (world, self.k, self.m)
        c = self.fab.ring(nbytes, self.k, self.m)
        self.links["nvlink"] += c.nvlink
        self.links["nic"] += c.nic
        return c.seconds


def secondary_bytes(units, k: int) -> int:
    """hpZ's memory per GPU: 1/k of every unit whose backward reads its weights, in the gathered format,
    held from its forward to its backward (all of them at the end of forward)."""
    return sum(u.gather_bytes // k for u in units if not u.weight_free_bw)


def qgz_staging(largest: int, reduce_bytes: int, k: int) -> int:
    """qgZ's buffers per GPU for the largest unit: the node's reduce-scatter output and the records sent
    and received."""
    return int(largest / k * (reduce_bytes + 2 * QBYTES))


# ---------------------------------------------------------------------------- tensor parallelism
def tp_activation_bytes(tokens: int, hidden: int, act_bytes: int = 2) -> int:
    """Gathered size of one sequence-parallel all-gather / reduce-scatter: the [tokens, hidden]
    activations of the tensor-parallel group's micro-batch."""
    return tokens * hidden * act_bytes


# Per decoder layer with sequence parallelism (torch's ColwiseParallel / RowwiseParallel /
# SequenceParallel, torchtitan's Llama plan): forward all-gathers the normed input before attention
# and before the MLP and reduce-scatters after o_proj and down_proj; backward runs the conjugates.
TP_PER_LAYER = dict(forward=4, backward=4)
# The embedding (rowwise: its output reduce-scattered into the sequence shards) and the head
# (colwise with loss parallel: its input all-gathered): one each way.
TP_PER_EDGE = dict(forward=1, backward=1)


def tp_unit_comm(fab: Fabric, role: str, tokens: int, hidden: int, tp: int, recompute: bool) -> tuple[Cost, Cost]:
    """(forward, backward) cost of one unit's tensor-parallel activation collectives inside the node;
    ``recompute`` (full activation checkpointing) repeats the forward's in backward."""
    per = TP_PER_LAYER if role == "layer" else TP_PER_EDGE if role in ("embed", "head") else dict(forward=0, backward=0)
    one = fab.ring(tp_activation_bytes(tokens, hidden), tp, 1)
    fwd = Cost()
    for _ in range(per["forward"]):
        fwd = fwd + one
    bwd = Cost()
    for _ in range(per["backward"] + (per["forward"] if recompute and role == "layer" else 0)):
        bwd = bwd + one
    return fwd, bwd


# ---------------------------------------------------------------------------- the studies
def _fabrics(a, cross: str) -> list[tuple[float, Fabric]]:
    return [(g, Fabric(a.intra_busbw * 1e9, g / 8 * 1e9 * a.nic_efficiency, a.gpus_per_node, a.latency_us * 1e-6,
                       a.hop_us * 1e-6, a.hbm_gbs * 1e9, cross))
            for g in (float(x) for x in a.nic_gbit.split(","))]


def _crosses(a) -> list[str]:
    out = [c.strip() for c in a.cross.split(",")]
    for c in out:
        if c not in ("rail", "spread"):
            raise SystemExit(f"model_scaling: --cross {a.cross!r}: each of rail, spread")
    return out


class _Setup:
    """What every configuration of a study shares: the units in forward order with their compute,
    memory plans (cached), the activation estimate (once)."""

    def __init__(self, a, model, cmp, recompute: bool = False):
        import model_scaling as ms

        from yafsdp.plan import memory_plan

        self.a, self.model, self.ms, self.memory_plan = a, model, ms, memory_plan
        self.roles = {name: role for name, role, _ in ms.unit_uses(model)}
        self.cmp = dict(cmp)
        if recompute:  # full activation checkpointing: each layer's forward again in its backward
            f, b = cmp["layer"]
            self.cmp["layer"] = (f, b + f)
        self.uses = [ms.Use(name, *self.cmp[role], 0) for name, role, _ in ms.unit_uses(model)]
        self.n_param_tensors = len(list(model.parameters()))
        self.root = {u.unit for u in self.uses if not u.unit.startswith("model.layers.")}
        self.pe = 2 if a.param_dtype == "bf16" else 4
        self.re = 2 if a.reduce_dtype == "bf16" else 4
        self._plans: dict = {}
        act = memory_plan(model, world_size=a.gpus_per_node, param_dtype=a.param_dtype, reduce_dtype=a.reduce_dtype,
                          batch=a.batch, seq=a.seq, checkpointing=True).activations
        self.act = act.total if act is not None else 0

    def plan(self, world: int, gather_dtype=None, replicas: int = 1, prefetch: int = 1):
        key = (world, gather_dtype, replicas, prefetch)
        if key not in self._plans:
            self._plans[key] = self.memory_plan(self.model, world_size=world, param_dtype=self.a.param_dtype,
                                                reduce_dtype=self.a.reduce_dtype, gather_dtype=gather_dtype,
                                                replicas=replicas, prefetch=prefetch)
        return self._plans[key]


def run_option(st: _Setup, opt: Option, fab: Fabric) -> dict:
    """One configuration of the ZeRO++ study on one fabric: the simulated step, bytes per link, memory."""
    ms, a = st.ms, st.a
    k, m = layout(opt.shard, fab.per_node)
    p = st.plan(opt.shard, "int8" if opt.qw else None, opt.replicas, opt.prefetch)
    sizes, slot_of, outsized, weight_free = ms.plan_maps(p)
    if opt.engine == "fsdp2":
        net = RingNet(fab, k, m)
        r = ms.simulate_fsdp2(st.uses, sizes, opt.shard, net, a, st.cmp, st.n_param_tensors, st.root)
        r.update(links=net.links, memory=None)
        return r
    kw = {}
    if opt.qw:  # the records' bytes per gather, and the expand behind each on the comm lane
        kw["gather_bytes"] = {u.name: u.gather_bytes for u in p.units}
        kw["expand"] = {u.name: u.padded_numel * (st.pe + u.gather_bytes / u.padded_numel) / fab.hbm
                        for u in p.units if u.compact}
    link = option_link(fab, opt, sizes, st.re)
    r = ms.simulate_yafsdp(st.uses, slot_of, outsized, sizes, opt.shard, None, a, st.cmp, weight_free,
                           replicas=opt.replicas, link=link, prefetch=opt.prefetch, **kw)
    extra = (secondary_bytes(p.units, k) if opt.hp and m > 1 else 0) + \
        (qgz_staging(p.largest_unit, st.re, k) if opt.qg and m > 1 else 0)
    r.update(memory=p.device_total + st.act + extra, secondary=secondary_bytes(p.units, k) if opt.hp and m > 1 else 0,
             weight_buffers=sum(s.nbytes for s in p.slots if s.kind == "weight"))
    return r


def zeropp_options(world: int, hsdp: int | None) -> list[Option]:
    """The ZeRO++ study's configurations at ``world`` GPUs (HSDP where ``hsdp`` divides it at least twice)."""
    out = [Option("FSDP2-like", world, engine="fsdp2"), Option("full", world), Option("+qwZ", world, qw=True),
           Option("+hpZ", world, hp=True), Option("+qgZ", world, qg=True),
           Option("qwZ+hpZ+qgZ", world, qw=True, hp=True, qg=True)]
    if hsdp and world % hsdp == 0 and world // hsdp >= 2:
        r = world // hsdp
        out += [Option("HSDP", hsdp, r), Option("HSDP+qgZ", hsdp, r, qg=True),
                Option("HSDP+qwZ+hpZ+qgZ", hsdp, r, qw=True, hp=True, qg=True)]
    return out


def _gib(x) -> str:
    return "—" if x is None else f"{x / 2**30:,.1f}"


def study_zeropp(a, model, cmp) -> dict:
    """``--study zeropp``: every ZeRO++ option alone and together, and with HSDP, at each world, line
    rate and crossing model; tables of step time (and its ratio to the FSDP2-like schedule), bytes per
    GPU per link and memory per GPU."""
    from _common import md_table, versions, write_json

    st = _Setup(a, model, cmp)
    hsdp = st.ms.hsdp_shard(a, model)
    rows, sections = [], []
    for cross in _crosses(a):
        for gbit, fab in _fabrics(a, cross):
            names, cells = None, []
            for w in a.worlds:
                opts = zeropp_options(w, hsdp)
                res = {o.name: run_option(st, o, fab) for o in opts}
                base = res["FSDP2-like"]["step"]
                for o in opts:
                    r = res[o.name]
                    rows.append(dict(cross=cross, nic_gbit=gbit, world=w, config=o.name, shard=o.shard,
                                     replicas=o.replicas, step=r["step"], exposed=r["exposed"], compute=r["compute"],
                                     nic=r["links"]["nic"], nvlink=r["links"]["nvlink"], memory=r["memory"],
                                     gathered=r.get("bytes", {}).get("gather"), vs_fsdp2=r["step"] / base))
                names = names or [o.name for o in zeropp_options(max(a.worlds), hsdp)]
                cells.append([w] + [f"{1e3 * res[n]['step']:,.0f} ({res[n]['step'] / base:.2f})" if n in res else ""
                                    for n in names])
            title = (f"### {gbit:g} Gb/s per GPU across nodes ({fab.nic / 1e9:.0f} GB/s), crossing: {cross} — "
                     "step ms (ratio to FSDP2-like)")
            sections += [title, "", md_table(["GPUs"] + names, cells), ""]
    # bytes per GPU per step and memory per GPU, at the largest world (they hardly depend on it)
    w = max(a.worlds)
    pick = [r for r in rows if r["world"] == w and r["nic_gbit"] == rows[0]["nic_gbit"]]
    by = {}
    for r in pick:
        by.setdefault(r["config"], {})[r["cross"]] = r
    brows = []
    for name, d in by.items():
        any_ = next(iter(d.values()))
        brows.append([name, f"{any_['replicas']} x {any_['shard']}" if any_["replicas"] > 1 else str(any_["shard"])]
                     + [_gib(d[c]["nic"]) if c in d else "" for c in ("rail", "spread")]
                     + [_gib(d[c]["nvlink"]) if c in d else "" for c in ("rail", "spread")]
                     + [_gib(any_["memory"]), "—" if any_["memory"] is None else
                        ("yes" if any_["memory"] <= a.gpu_mem_gib * 2**30 else "no")])
    btable = md_table(["config", "replicas x shard", "NIC GiB/GPU (rail)", "NIC GiB/GPU (spread)",
                       "NVLink GiB/GPU (rail)", "NVLink GiB/GPU (spread)", "memory GiB/GPU",
                       f"fits {a.gpu_mem_gib:g} GiB"], brows)
    mem_rows = []
    for w2 in a.worlds:
        d = _memory_by_config(rows, w2)
        mem_rows.append([w2] + [_gib(d.get(n)) if n in d else "" for n in names])
    mtable = md_table(["GPUs"] + names, mem_rows)
    compute_ms = _compute_ms(st)
    setup = (f"{a.preset}, batch {a.batch} x seq {a.seq} per GPU, {a.param_dtype} gathers, {a.reduce_dtype} "
             f"reduce-scatters, nodes of {a.gpus_per_node} at {a.intra_busbw:g} GB/s NVLink; compute "
             f"{cmp['source']} ({compute_ms:.0f} ms of unit compute per step); HSDP shard group "
             f"{hsdp} GPUs; {a.latency_us:g} us + {a.hop_us:g} us/rank per collective")
    text = "\n".join([f"model_scaling --study zeropp: {setup}", ""] + sections + [
        f"### Bytes each GPU sends per step and memory per GPU, {w} GPUs", "", btable, "",
        "### Memory per GPU (GiB; the FSDP2-like schedule's is not modelled)", "", mtable, ""])
    print(text, flush=True)
    result = dict(kind="model_scaling_zeropp", command=a.argv, setup=setup, versions=versions(), compute=cmp,
                  rows=rows, hsdp_shard=hsdp, text=text)
    if a.png:
        draw_study(rows, a.png, f"{a.preset}, b={a.batch} s={a.seq}: ZeRO++ options and HSDP", "config")
    if a.json:
        write_json(a.json, result)
    if a.md:
        write_report(a.md, result, text, ZEROPP_ASSUMPTIONS, [a.png] if a.png else [])
    return result


def study_prefetch(a, model, cmp) -> dict:
    """``--study prefetch``: full sharding with ``prefetch=1`` and ``prefetch=2`` (each gather two units
    ahead, a third weight buffer: [Note: prefetch depth] in yafsdp/engine/runtime.py) at each world, line
    rate and crossing model: step time, exposed communication, bytes gathered and the buffers' memory.
    One comm lane runs the same collectives either way; what the depth can change is when a gather that
    is long against one unit's compute but not two starts, and one backward re-gather fewer (the third
    buffer still holds a unit when backward reaches it)."""
    from _common import md_table, versions, write_json

    st = _Setup(a, model, cmp, a.recompute)
    rows, sections = [], []
    for cross in _crosses(a):
        for gbit, fab in _fabrics(a, cross):
            cells = []
            for w in a.worlds:
                one, two = (run_option(st, Option("full", w, prefetch=pf), fab) for pf in (1, 2))
                rows.append(dict(cross=cross, nic_gbit=gbit, world=w, step=[one["step"], two["step"]],
                                 exposed=[one["exposed"], two["exposed"]], compute=one["compute"],
                                 gathered=[one["bytes"]["gather"], two["bytes"]["gather"]],
                                 weight_buffers=[one["weight_buffers"], two["weight_buffers"]],
                                 ratio=two["step"] / one["step"]))
                cells.append([w, 1e3 * one["step"], 1e3 * one["exposed"], 1e3 * two["step"], 1e3 * two["exposed"],
                              two["step"] / one["step"], (one["bytes"]["gather"] - two["bytes"]["gather"]) / 2**20,
                              (two["weight_buffers"] - one["weight_buffers"]) / 2**20])
            title = f"### {gbit:g} Gb/s per GPU across nodes ({fab.nic / 1e9:.0f} GB/s), crossing: {cross}"
            sections += [title, "", md_table(["GPUs", "prefetch=1 step ms", "exposed ms", "prefetch=2 step ms",
                                              "exposed ms", "2 / 1 step", "gathered MiB/step saved",
                                              "weight buffers MiB added"], cells), ""]
    compute_ms = _compute_ms(st)
    best = min(rows, key=lambda r: r["ratio"])
    setup = (f"{a.preset}, batch {a.batch} x seq {a.seq} per GPU, {a.param_dtype} gathers, {a.reduce_dtype} "
             f"reduce-scatters{', full activation recompute' if a.recompute else ''}, nodes of {a.gpus_per_node} "
             f"at {a.intra_busbw:g} GB/s NVLink; compute {cmp['source']} ({compute_ms:.0f} ms of unit compute per "
             f"step); {a.latency_us:g} us + {a.hop_us:g} us/rank per collective")
    verdict = (f"largest predicted gain: {best['ratio']:.4f}x the step of prefetch=1 at {best['world']} GPUs, "
               f"{best['nic_gbit']:g} Gb/s, {best['cross']}")
    text = "\n".join([f"model_scaling --study prefetch: {setup}", ""] + sections + [verdict])
    print(text, flush=True)
    result = dict(kind="model_scaling_prefetch", command=a.argv, setup=setup, versions=versions(), compute=cmp,
                  rows=rows, text=text)
    if a.json:
        write_json(a.json, result)
    if a.md:
        write_report(a.md, result, text, PREFETCH_ASSUMPTIONS, [])
    return result


PREFETCH_ASSUMPTIONS = """model_scaling.py's two-lane simulation of one step (its docstring: one comm lane for gathers and
reduce-scatters in issue order, a gather waits for its buffer's release, compute per unit fixed), with the
buffers of the engine's own memory plan at each depth, the collectives' costs of [Note: the two-level
network]. Ignored as everywhere there: kernel-launch gaps, stragglers and jitter (the one thing a deeper
prefetch absorbs that this model cannot show), SM contention of the comm kernels."""


def study_tp(a, model, cmp) -> dict:
    """``--study tp``: tensor parallel of degree ``--tp`` inside each node with yafsdp (or the FSDP2-like
    schedule) sharding over the data-parallel ranks (one GPU per node in each group), against full
    sharding over every GPU; the sequence-parallel activation collectives of every unit on the compute
    lane (exposed: torch's TP without async TP) and, as a bound, hidden (async TP)."""
    from _common import md_table, versions, write_json

    t, n = a.tp, a.gpus_per_node
    if n % t:
        raise SystemExit(f"model_scaling: --tp {t} must divide --gpus-per-node {n}")
    bad = [w for w in a.worlds if w % n]
    if bad:
        raise SystemExit(f"model_scaling: --study tp needs whole nodes of {n} GPUs; --worlds has {bad}")
    st = _Setup(a, model, cmp, recompute=a.recompute)
    ms = st.ms
    cfg = model.config
    tokens = t * a.batch * a.seq  # the TP group's micro-batch: each GPU's share of tokens as in full sharding
    rows, sections = [], []
    for cross in _crosses(a):
        for gbit, fab in _fabrics(a, cross):
            cells = []
            for w in a.worlds:
                dp = w // t
                p = st.plan(w)
                sizes, slot_of, outsized, weight_free = ms.plan_maps(p)
                k, m = layout(w, n)
                res = {}
                link = option_link(fab, Option("full", w), sizes, st.re)
                res["full sharding"] = ms.simulate_yafsdp(st.uses, slot_of, outsized, sizes, w, None, a, st.cmp,
                                                          weight_free, link=link)
                net = RingNet(fab, k, m)
                res["FSDP2-like"] = ms.simulate_fsdp2(st.uses, sizes, w, net, a, st.cmp, st.n_param_tensors, st.root)
                res["FSDP2-like"]["links"] = net.links
                # TP: each unit's local size is 1/t of it (norms, replicated, are left out), sharded over
                # the dp ranks, one per node: every data-parallel collective crosses nodes on its own NIC
                tsizes = {u: v // t for u, v in sizes.items()}
                tcomm = {u.unit: tp_unit_comm(fab, st.roles[u.unit], tokens, cfg.hidden_size, t, a.recompute)
                         for u in st.uses}
                tuses = [ms.Use(u.unit, u.fwd + tcomm[u.unit][0].seconds, u.bwd + tcomm[u.unit][1].seconds, 0)
                         for u in st.uses]
                tp_link = lambda kind, unit, nbytes, phase: fab.ring(nbytes, 1, dp)  # noqa: E731
                tp_comm_s = sum(c[0].seconds + c[1].seconds for c in tcomm.values())
                tp_nvlink = sum(c[0].nvlink + c[1].nvlink for c in tcomm.values())
                res["TP x yafsdp"] = ms.simulate_yafsdp(tuses, slot_of, outsized, tsizes, dp, None, a, st.cmp,
                                                        weight_free, link=tp_link)
                res["TP x yafsdp, async TP"] = ms.simulate_yafsdp(st.uses, slot_of, outsized, tsizes, dp, None, a,
                                                                  st.cmp, weight_free, link=tp_link)
                dnet = RingNet(fab, 1, dp)
                res["FSDP2 + TP"] = ms.simulate_fsdp2(tuses, tsizes, dp, dnet, a, st.cmp, st.n_param_tensors, st.root)
                res["FSDP2 + TP"]["links"] = dnet.links
                for key in ("TP x yafsdp", "TP x yafsdp, async TP"):
                    res[key]["links"] = dict(nic=res[key]["links"]["nic"],
                                             nvlink=res[key]["links"]["nvlink"] + tp_nvlink)
                res["FSDP2 + TP"]["links"]["nvlink"] += tp_nvlink
                full_mem = p.device_total + st.act
                tp_mem = p.model_state + (p.device_total - p.model_state) / t + st.act  # buffers / t
                base = res["FSDP2-like"]["step"]
                for name, r in res.items():
                    rows.append(dict(cross=cross, nic_gbit=gbit, world=w, config=name, step=r["step"],
                                     exposed=r["exposed"], compute=r["compute"], nic=r["links"]["nic"],
                                     nvlink=r["links"]["nvlink"], vs_fsdp2=r["step"] / base,
                                     tp_comm=tp_comm_s if "TP" in name else 0.0,
                                     memory=None if name.startswith("FSDP2") else
                                     (tp_mem if "TP" in name else full_mem)))
                names = list(res)
                cells.append([w, f"{t} x {dp}"] + [f"{1e3 * res[x]['step']:,.0f} ({res[x]['step'] / base:.2f})"
                                                   for x in names] + [f"{1e3 * tp_comm_s:,.0f}"])
            sections += [f"### {gbit:g} Gb/s per GPU across nodes ({fab.nic / 1e9:.0f} GB/s), crossing: {cross} — "
                         "step ms (ratio to FSDP2-like full sharding)", "",
                         md_table(["GPUs", "TP x DP"] + names + ["TP collectives ms/step"], cells), ""]
    w = max(a.worlds)
    pick = [r for r in rows if r["world"] == w and r["nic_gbit"] == rows[0]["nic_gbit"] and r["cross"] == "rail"] or \
        [r for r in rows if r["world"] == w and r["nic_gbit"] == rows[0]["nic_gbit"]]
    btable = md_table(["config", "NIC GiB/GPU", "NVLink GiB/GPU", "memory GiB/GPU", f"fits {a.gpu_mem_gib:g} GiB"],
                      [[r["config"], _gib(r["nic"]), _gib(r["nvlink"]), _gib(r["memory"]),
                        "—" if r["memory"] is None else ("yes" if r["memory"] <= a.gpu_mem_gib * 2**30 else "no")]
                       for r in pick])
    mem_rows = []
    for w2 in a.worlds:
        d = _memory_by_config(rows, w2)
        mem_rows.append([w2, _gib(d["full sharding"]), _gib(d["TP x yafsdp"])])
    mtable = md_table(["GPUs", "full sharding GiB/GPU", f"TP {t} x yafsdp GiB/GPU"], mem_rows)
    compute_ms = _compute_ms(st)
    setup = (f"{a.preset}, {a.batch} x {a.seq} tokens per GPU (a TP group's micro-batch: {t} x that), "
             f"{a.param_dtype} gathers, {a.reduce_dtype} reduce-scatters, TP {t} inside nodes of {n} at "
             f"{a.intra_busbw:g} GB/s NVLink, {'full activation checkpointing (recompute in backward)' if a.recompute else 'no recompute'}; "
             f"compute {cmp['source']} ({compute_ms:.0f} ms of unit compute per step)")
    text = "\n".join([f"model_scaling --study tp: {setup}", ""] + sections + [
        f"### Bytes each GPU sends per step and memory per GPU, {w} GPUs (rail)", "", btable, "",
        "### Memory per GPU", "", mtable, ""])
    print(text, flush=True)
    result = dict(kind="model_scaling_tp", command=a.argv, setup=setup, versions=versions(), compute=cmp, rows=rows,
                  text=text)
    if a.png:
        draw_study(rows, a.png, f"{a.preset}, {a.batch} x {a.seq} tokens per GPU: TP {t} x sharding", "config")
    if a.json:
        write_json(a.json, result)
    if a.md:
        write_report(a.md, result, text, TP_ASSUMPTIONS, [a.png] if a.png else [])
    return result


def draw_study(rows, path, title, key):
    """Step time against GPUs per configuration: one panel per line rate, rail solid and spread dashed."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["nic_gbit"] for r in rows})
    fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates) + 2.2, 3.8), squeeze=False)
    configs = list(dict.fromkeys(r[key] for r in rows))
    colors = {c: f"C{i}" for i, c in enumerate(configs)}
    for ax, g in zip(axes[0], rates):
        for cross, style in (("rail", "o-"), ("spread", "x--")):
            for c in configs:
                pts = sorted((r["world"], 1e3 * r["step"]) for r in rows
                             if r["nic_gbit"] == g and r["cross"] == cross and r[key] == c)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=colors[c], markersize=3,
                            label=c if cross == "rail" else None, alpha=1.0 if cross == "rail" else 0.6)
        worlds = sorted({r["world"] for r in rows})
        comp = sorted({(r["world"], 1e3 * r["compute"]) for r in rows if r["nic_gbit"] == g and r["cross"] == "rail"
                       and r[key] == configs[1]})
        ax.plot([p[0] for p in comp], [p[1] for p in comp], ":", color="grey", label="compute only" if ax is axes[0][0]
                else None)
        ax.set_xscale("log", base=2)
        ax.set_xticks(worlds, [str(x) for x in worlds])
        ax.set_xlabel("GPUs")
        ax.set_title(f"{g:g} Gb/s per GPU (solid: rail, dashed: spread)", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("predicted step time (ms)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1 - 2.0 / fig.get_size_inches()[0], 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _memory_by_config(rows, world: int) -> dict:
    """Memory per GPU of each configuration at ``world`` GPUs (memory does not depend on the link, so
    the rows of the first bandwidth and crossing stand for all)."""
    return {r["config"]: r["memory"] for r in rows if r["world"] == world and r["nic_gbit"] == rows[0]["nic_gbit"]
            and r["cross"] == rows[0]["cross"]}


def _compute_ms(st) -> float:
    """The units' forward and backward compute plus the rest of a step, in ms."""
    return 1e3 * (sum(u.fwd + u.bwd for u in st.uses) + sum(st.cmp["other"]))


def write_report(path, result, text, assumptions, images):
    """The committed report: command, versions, the tables (markdown), the assumptions, the picture."""
    import os

    from bench_step import write_body  # this script's directory is on sys.path

    v = result["versions"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + "/"
    body = [f"# {result['kind']} — predictions of the model (not measurements) — {v['date']}", "",
            "Command:", "", "```", "python " + result["command"].replace(root, ""), "```", "",
            f"Versions: python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, "
            f"yafsdp {v['yafsdp']}", "", text, "## Assumptions", "", assumptions.strip(), ""]
    write_body(path, body, images)


ZEROPP_ASSUMPTIONS = """
- Everything of model_scaling.py's model (its docstring): weak scaling (per-GPU micro-batch fixed), the
  two-lane simulation of yafsdp's schedule (one comm stream, two alternating buffers, prefetch of one
  unit) and of the FSDP2-like schedule with its copies, the plan's padded unit sizes.
- The network ([Note: the two-level network] in benchmarks/scaling_options.py): nodes of 8 GPUs on
  NVLink (360 GB/s all-gather bus bandwidth), one NIC per GPU at the line rate given x 0.96
  (100/200/400 Gb/s -> 12/24/48 GB/s). "rail": a flat ring over several nodes sends every GPU's whole
  ring share through its own NIC (the ZeRO++ paper's accounting; model_scaling.py's earlier tables);
  "spread": the node's crossings are spread over its 8 NICs (NCCL's multi-channel rings), so a flat ring
  runs at min(NVLink, 8 x NIC). Hierarchical collectives cost the same under both.
- Full sharding ("full"): gathers in bf16 and reduce-scatters in fp32 over all GPUs, the embedding not
  re-gathered for backward.
- +qwZ: gather_dtype="int8": the plan's records (1 byte per value + an fp32 scale per 128 values) in
  every gather of the units the plan gathers compact, each followed by its expand on the comm lane.
  gather_dtype="fp8" moves the same bytes (its records are 1.03 bytes per value too): the same figures.
- +hpZ (secondary shard): the forward gather as before, plus a copy of this GPU's 1/8 of the gathered
  unit (in the gathered format) kept until the unit's backward; the backward gather runs over the 8
  GPUs of the node from it (no NIC bytes). Memory: 1/8 of every gathered unit whose backward reads its
  weights, all held at the end of forward. Only where the shard group spans nodes.
- +qgZ: each unit's gradients reduce-scattered in fp32 inside the node, then each GPU's 1/8 sent across
  the nodes by one all-to-all as int8 with an fp32 scale per 128 values and summed in fp32 at the
  receiver (kernels: quantize, dequantize + sum at memory bandwidth, on the comm lane, not pipelined
  with the transfer). HSDP's replica all-reduce likewise (an all-to-all reduce and an all-gather of the
  sums, each sent as int8 records). Staging memory: the largest unit's 1/8 in fp32 and twice in records.
- HSDP: the shard group is the smallest multiple of a node whose memory plan fits 80 GiB (8 GPUs for
  Llama-3-8B, 32 for -70B); its fp32 grad shards all-reduced across replicas behind each reduce-scatter
  (the steady state).
- Memory per GPU: the plan's device bytes (sharded state, optimizer state, buffers) + the activations
  of the micro-batch under per-layer checkpointing (the plan's estimate) + the secondary shard and the
  qgZ staging above. Not modelled for the FSDP2-like schedule.
- Ignored: kernel-launch gaps, the small group, SM contention between comm kernels and compute,
  stragglers, congestion in the network fabric beyond a GPU's own NIC.
"""

TP_ASSUMPTIONS = """
- Everything of model_scaling.py's model and of the ZeRO++ study's network (above, and
  [Note: the two-level network] in benchmarks/scaling_options.py).
- Equal tokens per GPU in every configuration: a tensor-parallel group of t GPUs runs a micro-batch of
  t sequences, so each GPU's matmul FLOPs (and the per-unit compute time, measured or from FLOPs)
  equal full sharding's at one sequence per GPU; the global batch is the same. Smaller matmuls under
  TP are assumed to run at the same efficiency.
- TP (torchtitan's Llama plan, sequence parallel): per decoder layer 4 collectives in forward (all-gather
  before attention and MLP, reduce-scatter after o_proj and down_proj) and 4 in backward, the
  embedding and the head one each way; each moves the group's [tokens, hidden] bf16 activations over
  NVLink among the t GPUs. On the compute lane, exposed ("TP x yafsdp", "FSDP2 + TP": torch's TP
  without async TP); "async TP" is the bound where all of them hide behind the matmuls. With
  --recompute (full activation checkpointing) a layer's forward and its 4 forward collectives run again
  in its backward, in every configuration.
- Data parallel beside TP: each unit's local parameters are 1/t of the unit (norms, replicated over TP,
  left out), sharded over the W / t ranks that hold the same TP slice, one per node: every gather and
  reduce-scatter is a ring across nodes over the GPUs' own NICs, the same under "rail" and "spread".
  "FSDP2 + TP" is the FSDP2-like schedule with the same unit sizes and its copies (copy-in, copy-out,
  per-parameter optimizer dispatch).
- Memory per GPU: the sharded and optimizer state are the same per GPU as full sharding's (Psi / W
  each); the engine's buffers are 1/t of full sharding's; activations as full sharding's (each GPU holds
  1/t of the group's t sequences under sequence parallelism), not modelled for the FSDP2-like schedules.
"""
