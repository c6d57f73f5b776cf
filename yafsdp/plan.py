"""The memory plan: bytes per rank by role, computed without allocating.

    model.memory_plan(batch=4, seq=2048)                   # a wrapped model (YaFSDP)
    yafsdp.plan.memory_plan(meta_model, world_size=64)     # a plain model, e.g. on the meta device
    python -m yafsdp plan --preset llama3-8b --world-size 64 --param-dtype bf16 --batch 1 --seq 8192

[Note: one plan, one allocator]
The engine's buffers are sized by :func:`plan_slots` and nothing else: ``Runtime._allocate`` calls
it, and the plan of a model that has never been wrapped calls it on layouts built by the engine's
own unit discovery (``units.discover``) and ``FlatLayout.build``. So the plan equals what the
engine allocates, byte for byte (tests/test_plan.py checks it against ``allocated_bytes()``).

What the engine allocates per rank (Psi parameters, N ranks, every count padded as the engine pads):
- master shard (fp32) 4 Psi/N, grad shard (fp32) 4 Psi/N, compute copy (param_dtype; none in fp32)
- weight buffers: two in param_dtype holding the largest regular unit each (ZeRO-2: one per unit)
- grad buffers: two in reduce_dtype, each with a shard-sized reduce-scatter staging area
- the small group (all 1-D parameters): its own weight and grad buffer
- outsized units (not a repeated block, padded size > outsized_ratio x the largest block; see
  [Note: outsized units]; a 128k-vocab embedding or head): one weight and one grad buffer they
  share, so they do not set the size of the pair
Outside the engine and estimated here: optimizer state (AdamW: fp32 m and v, 8 bytes per shard
element) and activations.

[Note: activation estimate]
Activations are traced, not guessed: a copy of the model on the meta device runs one forward on
(batch, seq) inputs under ``saved_tensors_hooks``, and every tensor autograd saves for backward is
counted once per storage (parameters excluded: they are the engine's weight buffers). This is
exact for the model's own code, with one substitution: on the meta device SDPA would take its
"math" path and save the (seq x seq) attention probabilities, which the fused kernels used on GPU
(flash / memory-efficient) and on CPU (flash-for-CPU) do not; so SDPA is replaced during the trace
by a stand-in that saves what a fused kernel saves (q, k, v, output, fp32 logsumexp).
``attention="math"`` keeps the quadratic path. With activation checkpointing (HF's per-layer
checkpoint), a block keeps only its inputs, and one block's activations live again during its
recompute. The backward adds a transient the trace cannot see. Its peak is the larger of: two
tensors the size of the largest saved one, live while that one is still held (for a causal LM the
fp32 log-softmax of the logits: its incoming gradient and the logits' gradient), and the largest
unit's weight gradients as autograd produces them before the engine copies them into the grad
buffer (by then the log-softmax output has been freed, which makes room for the logits'
gradient). On CPU (fake process group, tests/test_plan.py) plan and measured peak agree within a
few percent.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .flat import FlatLayout
from .units import discover, find_blocks, weight_free_backward

GiB = 1024**3

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}

# Optimizer state bytes per shard element (fp32 master shards).
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd-momentum": 4, "sgd": 0, "none": 0}


# ---------------------------------------------------------------------------- slot sizing
@dataclass(frozen=True)
class SlotSpec:
    """One preallocated buffer, as ``YaFSDP._allocate`` creates it."""

    name: str  # the engine's slot name (also its key in ``allocated_bytes()``)
    kind: str  # "weight" | "grad"
    capacity: int  # elements: one gathered flat unit
    shard_capacity: int  # grad slots: elements of the reduce-scatter staging; weight slots: 0
    dtype: torch.dtype
    role: str  # "buffers" (the alternating pair; ZeRO-2: per unit) | "outsized" | "small"

    @property
    def nbytes(self) -> int:
        return (self.capacity + self.shard_capacity) * _itemsize(self.dtype)


@dataclass
class SlotPlan:
    weight: list[SlotSpec]  # in allocation order
    grad: list[SlotSpec]  # in allocation order
    weight_of: list[int]  # per flat unit (units in order, the small group last): index into weight
    grad_of: list[int]  # likewise into grad
    outsized: list[bool]  # per unit (small group excluded)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def unit_align(compute_dtype: torch.dtype, reduce_dtype: torch.dtype, align_bytes: int) -> int:
    """Elements per rank a flat unit's length is padded to (``align_bytes`` of the narrower dtype)."""
    elem = min(torch.finfo(compute_dtype).bits, torch.finfo(reduce_dtype).bits) // 8
    return max(1, align_bytes // elem)


def repeated_blocks(names: list[str]) -> list[bool]:
    """Per unit: is it a member of a repeated block list? See [Note: outsized units]."""
    prefix = [(m.group(1) or "") if (m := re.fullmatch(r"(.*\.)?\d+", n)) else None for n in names]
    count: dict[str, int] = {}
    for p in prefix:
        if p is not None:
            count[p] = count.get(p, 0) + 1
    return [p is not None and count[p] >= 2 for p in prefix]


# [Note: outsized units]
# An outsized unit (a 128k-vocab embedding or head) gets its own buffer so that it does not set
# the size of the alternating pair. Repeated blocks are what the pair is for, so they are never
# outsized: a unit is outsized when it is not a block of a repeated block list and is larger than
# ``outsized_ratio`` x the largest such block. The blocks are recognised by their names (units are
# named by module path; a ModuleList's children end in ".<index>", e.g. "model.layers.7"), two or
# more under one prefix. A model without such a list (e.g. explicit units with other names) falls
# back to ``outsized_ratio`` x the median unit. (The median alone misfires on small models: with
# vocab 256, hidden 64 and 2 layers the embedding and head are half the units, so the median is
# the embedding and both decoder layers would be outsized.)
def plan_slots(
    names: list[str],
    layouts: list[FlatLayout],
    small: FlatLayout | None,
    *,
    compute_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    zero_stage: int,
    outsized_ratio: float,
) -> SlotPlan:
    """The weight and grad buffers for units with ``layouts`` (and the small group): pure, no
    allocation. See [Note: one plan, one allocator]."""
    sizes = [lay.padded_numel for lay in layouts]
    outsized = [False] * len(layouts)
    repeated = repeated_blocks(names)
    if any(repeated):  # See [Note: outsized units]
        largest_block = max(n for n, r in zip(sizes, repeated) if r)
        outsized = [not r and n > outsized_ratio * largest_block for n, r in zip(sizes, repeated)]
    elif len(sizes) >= 3:
        median = statistics.median_low(sizes)
        outsized = [n > outsized_ratio * median for n in sizes]
    regular = [i for i, o in enumerate(outsized) if not o]
    big = [i for i, o in enumerate(outsized) if o]
    n_all = len(layouts) + (1 if small is not None else 0)
    weight: list[SlotSpec] = []
    grad: list[SlotSpec] = []
    weight_of = [-1] * n_all
    grad_of = [-1] * n_all

    def lay(i: int) -> FlatLayout:
        return small if i == len(layouts) else layouts[i]

    def grad_slot(name: str, members: list[int], role: str) -> int:
        grad.append(SlotSpec(
            name, "grad", max(lay(i).padded_numel for i in members),
            max(lay(i).shard_numel for i in members), reduce_dtype, role,
        ))
        return len(grad) - 1

    if regular:
        pair = [grad_slot(f"grad{k}", regular, "buffers") for k in range(min(2, len(regular)))]
        for j, i in enumerate(regular):
            grad_of[i] = pair[j % len(pair)]
    if big:
        g = grad_slot("grad_outsized", big, "outsized")
        for i in big:
            grad_of[i] = g
    if small is not None:
        grad_of[len(layouts)] = grad_slot("grad_small", [len(layouts)], "small")

    def weight_slot(name: str, capacity: int, role: str) -> int:
        weight.append(SlotSpec(name, "weight", capacity, 0, compute_dtype, role))
        return len(weight) - 1

    if zero_stage == 3:
        if regular:
            cap = max(layouts[i].padded_numel for i in regular)
            pair = [weight_slot(f"weight{k}", cap, "buffers") for k in range(min(2, len(regular)))]
            for j, i in enumerate(regular):
                weight_of[i] = pair[j % len(pair)]
        if big:
            w = weight_slot("weight_outsized", max(layouts[i].padded_numel for i in big), "outsized")
            for i in big:
                weight_of[i] = w
    else:  # ZeRO-2: every unit keeps its gathered weights from forward to backward
        for i, name in enumerate(names):
            weight_of[i] = weight_slot(f"weight_{name}", layouts[i].padded_numel, "buffers")
    if small is not None:
        weight_of[len(layouts)] = weight_slot("weight_small", small.padded_numel, "small")
    return SlotPlan(weight, grad, weight_of, grad_of, outsized)


# ---------------------------------------------------------------------------- the plan
@dataclass
class UnitRow:
    name: str
    numel: int
    padded_numel: int
    shard_numel: int
    weight_slot: str
    grad_slot: str
    outsized: bool
    weight_free_bw: bool = False  # ZeRO-3 skips its backward re-gather (runtime.py [Note: weight-free backward])


@dataclass
class ActivationEstimate:
    batch: int
    seq: int
    checkpointing: bool
    attention: str  # "fused" | "math"
    dtype: str
    saved: int  # bytes saved for backward at the end of forward
    transient: int  # bytes the backward adds on top (see [Note: activation estimate])
    per_block: int  # saved bytes of the largest block (without checkpointing)
    largest_saved: int  # the largest single saved tensor

    @property
    def total(self) -> int:
        return self.saved + self.transient


@dataclass
class MemoryPlan:
    world_size: int
    rank: int
    zero_stage: int
    param_dtype: str
    reduce_dtype: str
    optimizer: str
    num_params: int  # Psi: parameters of the model, tied ones once, unpadded
    shard_numel: int  # this rank's shard elements over all flat units (padded)
    largest_unit: int  # L: padded elements of the largest unit in the alternating pair
    units: list[UnitRow]
    slots: list[SlotSpec]
    master: int
    grad: int
    compute_copy: int
    optimizer_state: int
    activations: ActivationEstimate | None = None
    notes: list[str] = field(default_factory=list)

    # Bytes by role -----------------------------------------------------------------------
    def _slot_bytes(self, role: str, kind: str | None = None) -> int:
        return sum(s.nbytes for s in self.slots if s.role == role and (kind is None or s.kind == kind))

    @property
    def weight_buffers(self) -> int:
        return self._slot_bytes("buffers", "weight")

    @property
    def grad_buffers(self) -> int:
        return self._slot_bytes("buffers", "grad")

    @property
    def small_group(self) -> int:
        return self._slot_bytes("small")

    @property
    def outsized_buffers(self) -> int:
        return self._slot_bytes("outsized")

    @property
    def engine_total(self) -> int:
        """Every byte the engine itself allocates on this rank."""
        return sum(self.engine_bytes().values())

    @property
    def model_state(self) -> int:
        """Sharded state + optimizer state: what the ZeRO paper calls model states."""
        return self.master + self.grad + self.compute_copy + self.optimizer_state

    @property
    def total(self) -> int:
        act = self.activations.total if self.activations is not None else 0
        return self.engine_total + self.optimizer_state + act

    def engine_bytes(self) -> dict[str, int]:
        """The same keys and values as ``YaFSDP.allocated_bytes()`` returns once wrapped."""
        out = {"master": self.master, "grad": self.grad, "compute_copy": self.compute_copy}
        for s in self.slots:
            if s.kind == "weight":
                out[s.name] = s.capacity * _itemsize(s.dtype)
        for s in self.slots:
            if s.kind == "grad":
                out[s.name] = s.capacity * _itemsize(s.dtype)
                out[s.name + "_staging"] = s.shard_capacity * _itemsize(s.dtype)
        return out

    def rows(self) -> list[tuple[str, int]]:
        """(role, bytes) in the order the table prints them."""
        rows = [
            ("master shard (fp32)", self.master),
            ("grad shard (fp32)", self.grad),
            (f"optimizer state ({self.optimizer})", self.optimizer_state),
            (f"compute copy ({self.param_dtype})", self.compute_copy),
            ("weight buffers" + (" (per unit, ZeRO-2)" if self.zero_stage == 2 else " (x2)"), self.weight_buffers),
            ("grad buffers (x2, + staging)", self.grad_buffers),
            ("small group (weight + grad)", self.small_group),
            ("outsized-unit buffers", self.outsized_buffers),
        ]
        if self.activations is not None:
            a = self.activations
            ck = ", checkpointed" if a.checkpointing else ""
            rows.append((f"activations (b={a.batch}, s={a.seq}{ck}, saved)", a.saved))
            rows.append(("backward transient (estimate)", a.transient))
        rows.append(("total", self.total))
        return rows

    def zero_formula(self) -> dict[str, float]:
        """The ZeRO paper's model-state formula (Rajbhandari et al. 2020, mixed-precision Adam,
        K = 12) next to ours, in bytes per rank."""
        psi, n = self.num_params, self.world_size
        if self.zero_stage == 3:
            zero = 16 * psi / n  # (2 + 2 + K) Psi / N
        else:
            zero = 2 * psi + 14 * psi / n  # 2 Psi + (2 + K) Psi / N
        ours = self.model_state + (self.weight_buffers if self.zero_stage == 2 else 0)
        return {"zero_paper": zero, "yafsdp": float(ours), "ratio": ours / zero if zero else float("nan")}

    def format(self) -> str:
        lines = [
            f"yafsdp memory plan: world_size={self.world_size} rank={self.rank} zero_stage={self.zero_stage} "
            f"param_dtype={self.param_dtype} reduce_dtype={self.reduce_dtype}",
            f"  parameters Psi={self.num_params:,}  local shard={self.shard_numel:,} elements  "
            f"largest regular unit L={self.largest_unit:,} elements  units={len(self.units)}",
        ]
        big = [u.name for u in self.units if u.outsized]
        if big:
            lines.append(f"  outsized units (own shared buffer): {', '.join(big)}")
        free = [u.name for u in self.units if u.weight_free_bw]
        if free and self.zero_stage == 3:
            lines.append(f"  not re-gathered for backward (weight-free backward): {', '.join(free)}")
        w = max(len(r) for r, _ in self.rows())
        lines.append(f"  {'role':<{w}}  {'bytes':>16}  {'GiB':>9}")
        for role, b in self.rows():
            if role == "total":
                lines.append("  " + "-" * (w + 29))
            lines.append(f"  {role:<{w}}  {b:>16,}  {b / GiB:>9.3f}")
        z = self.zero_formula()
        stage = "16 Psi/N" if self.zero_stage == 3 else "2 Psi + 14 Psi/N"
        lines.append(
            f"  model state vs ZeRO paper ({stage}, mixed-precision Adam K=12): "
            f"{z['yafsdp'] / GiB:.3f} GiB vs {z['zero_paper'] / GiB:.3f} GiB (x{z['ratio']:.3f}; "
            "yafsdp keeps an fp32 grad shard where ZeRO counts a 16-bit one, +2 Psi/N)"
        )
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["slots"] = [dict(asdict(s), dtype=str(s.dtype).replace("torch.", ""), nbytes=s.nbytes) for s in self.slots]
        d["activations"] = asdict(self.activations) if self.activations is not None else None
        d["roles"] = dict(self.rows())
        d["engine_bytes"] = self.engine_bytes()
        d["zero_formula"] = self.zero_formula()
        return d


def _dtype_name(dt: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt, str(dt))


def _as_dtype(dt) -> torch.dtype | None:
    if dt is None or isinstance(dt, torch.dtype):
        return dt
    return _DTYPES[str(dt).lower()]


def memory_plan(
    model: nn.Module,
    *,
    world_size: int | None = None,
    rank: int = 0,
    units: list[nn.Module] | None = None,
    param_dtype=None,
    reduce_dtype=torch.float32,
    zero_stage: int = 3,
    align_bytes: int = 16,
    outsized_ratio: float = 1.5,
    optimizer: str | int = "adamw",
    batch: int | None = None,
    seq: int | None = None,
    checkpointing: bool = False,
    attention: str = "fused",
    inputs_fn=None,
) -> MemoryPlan:
    """Bytes per rank by role for ``model``: a wrapped ``YaFSDP`` (its own layouts and options)
    or a plain module (any device, meta included; nothing is allocated) with the engine options
    given here. ``batch`` and ``seq`` add the activation estimate (HF causal LMs, or any model
    with ``inputs_fn(batch, seq, device) -> kwargs``). ``optimizer``: a name in
    ``OPTIMIZER_BYTES`` or bytes of state per shard element."""
    from .api import YaFSDP

    if isinstance(model, YaFSDP):
        eng = model
        names = [u.name for u in eng.units]
        layouts = [u.layout for u in eng.units]
        small = eng.small.layout if eng.small is not None else None
        slots = eng.buffer_plan
        weight_free = [u.weight_free_bw for u in eng.units]
        world_size, rank = eng.world_size, eng.rank
        compute_dtype, reduce_dtype, zero_stage = eng.compute_dtype, eng.reduce_dtype, eng.zero_stage
        param_dtype = eng.param_dtype
        module = eng.module
        num_params = sum(lay.numel for lay in layouts) + (small.numel if small else 0)
    else:
        if world_size is None:
            raise ValueError("yafsdp.plan.memory_plan: world_size= is required for a model that is not wrapped")
        param_dtype, reduce_dtype = _as_dtype(param_dtype), _as_dtype(reduce_dtype)
        compute_dtype = param_dtype or torch.float32
        align = unit_align(compute_dtype, reduce_dtype, align_bytes)
        specs, small_params = discover(model, units)
        names = [s.name for s in specs]
        weight_free = [weight_free_backward(s) for s in specs]
        layouts = [FlatLayout.build(s.params, world_size, rank, align) for s in specs]
        small = FlatLayout.build(small_params, world_size, rank, align) if small_params else None
        slots = plan_slots(
            names, layouts, small, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
            zero_stage=zero_stage, outsized_ratio=outsized_ratio,
        )
        module = model
        num_params = sum(lay.numel for lay in layouts) + (small.numel if small else 0)

    all_layouts = layouts + ([small] if small is not None else [])
    shard = sum(lay.shard_numel for lay in all_layouts)
    cbytes = _itemsize(compute_dtype)
    opt_bytes = optimizer if isinstance(optimizer, int) else OPTIMIZER_BYTES[optimizer]
    slot_list = slots.weight + slots.grad
    rows = [
        UnitRow(
            names[i], lay.numel, lay.padded_numel, lay.shard_numel,
            slots.weight[slots.weight_of[i]].name, slots.grad[slots.grad_of[i]].name, slots.outsized[i],
            weight_free[i],
        )
        for i, lay in enumerate(layouts)
    ]
    regular = [lay.padded_numel for lay, o in zip(layouts, slots.outsized) if not o]
    plan = MemoryPlan(
        world_size=world_size, rank=rank, zero_stage=zero_stage,
        param_dtype=_dtype_name(compute_dtype), reduce_dtype=_dtype_name(reduce_dtype),
        optimizer=str(optimizer), num_params=num_params, shard_numel=shard,
        largest_unit=max(regular) if regular else 0, units=rows, slots=slot_list,
        master=4 * shard, grad=4 * shard, compute_copy=0 if compute_dtype == torch.float32 else cbytes * shard,
        optimizer_state=opt_bytes * shard,
    )
    if batch is not None and seq is not None:
        largest_unit_grads = max((lay.numel for lay in layouts), default=0) * cbytes
        plan.activations = activation_estimate(
            module, batch=batch, seq=seq, checkpointing=checkpointing, dtype=compute_dtype,
            attention=attention, inputs_fn=inputs_fn, unit_grad_bytes=largest_unit_grads,
        )
        if plan.activations is None:
            plan.notes.append("activations not estimated: not an HF model and no inputs_fn given")
    return plan


# ---------------------------------------------------------------------------- activations
class _FusedAttentionStandIn(torch.autograd.Function):
    """Saves what flash / memory-efficient SDPA saves: q, k, v, output and an fp32 logsumexp."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the trace runs forward only
        raise RuntimeError("the activation trace runs forward only")


class _FusedSDPA(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = args[:3]
            return _FusedAttentionStandIn.apply(q, k, v)
        return func(*args, **kwargs)


def _meta_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module | None:
    """A fresh copy of ``module`` on the meta device in ``dtype``, or None if it cannot be built."""
    config = getattr(module, "config", None)
    if config is not None and hasattr(type(module), "_from_config"):
        with torch.device("meta"):
            copy = type(module)(config)
    elif all(p.is_meta for p in module.parameters()):
        import copy as _copy

        copy = _copy.deepcopy(module)
    else:
        return None
    return copy.to(dtype)


def _hf_inputs(batch: int, seq: int, device) -> dict:
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    return {"input_ids": ids, "labels": ids}


def activation_estimate(
    module: nn.Module,
    *,
    batch: int,
    seq: int,
    checkpointing: bool = False,
    dtype: torch.dtype = torch.float32,
    attention: str = "fused",
    inputs_fn=None,
    unit_grad_bytes: int = 0,
) -> ActivationEstimate | None:
    """Trace one forward of a meta copy of ``module``; see [Note: activation estimate]."""
    if attention not in ("fused", "math"):
        raise ValueError(f"attention={attention!r}: use 'fused' or 'math'")
    model = _meta_copy(module, dtype)
    if model is None:
        return None
    if inputs_fn is None:
        if getattr(model, "config", None) is None:
            return None
        inputs_fn = _hf_inputs
    model.train()
    blocks = find_blocks(model)
    block_ids = {id(b): i for i, b in enumerate(blocks)}
    skip = {p.untyped_storage()._cdata for p in model.parameters()}
    skip |= {b.untyped_storage()._cdata for b in model.buffers()}
    saved: dict[int, tuple[int, str]] = {}  # storage -> (bytes, "block i" | "outside")
    where = ["outside"]
    block_inputs: list[int] = []

    def pack(t: torch.Tensor):
        key = t.untyped_storage()._cdata
        if key not in skip and key not in saved:
            saved[key] = (t.untyped_storage().nbytes(), where[0])
        return t

    def pre(mod, args, kwargs):
        where[0] = f"block {block_ids[id(mod)]}"
        h = args[0] if args else kwargs.get("hidden_states")
        block_inputs.append(h.untyped_storage().nbytes() if isinstance(h, torch.Tensor) else 0)

    def post(mod, args, kwargs, out):
        where[0] = "outside"

    handles = [b.register_forward_pre_hook(pre, with_kwargs=True) for b in blocks]
    handles += [b.register_forward_hook(post, with_kwargs=True) for b in blocks]
    try:
        mode = _FusedSDPA() if attention == "fused" else None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if mode is not None:
                with mode:
                    model(**inputs_fn(batch, seq, "meta"))
            else:
                model(**inputs_fn(batch, seq, "meta"))
    finally:
        for h in handles:
            h.remove()
    per_block: dict[str, int] = {}
    for nbytes, w in saved.values():
        per_block[w] = per_block.get(w, 0) + nbytes
    outside = per_block.pop("outside", 0)
    largest_block = max(per_block.values(), default=0)
    if checkpointing and blocks:
        # HF per-layer checkpoint: each block keeps its input; one block is recomputed at a time.
        total = outside + sum(block_inputs) + largest_block
    else:
        total = outside + sum(per_block.values())
    largest = max((b for b, _ in saved.values()), default=0)
    return ActivationEstimate(
        batch=batch, seq=seq, checkpointing=checkpointing, attention=attention, dtype=_dtype_name(dtype),
        saved=total, transient=max(2 * largest, unit_grad_bytes), per_block=largest_block, largest_saved=largest,
    )


# ---------------------------------------------------------------------------- CLI
def _parser(prog: str = "python -m yafsdp plan") -> argparse.ArgumentParser:
    from .presets import PRESETS

    ap = argparse.ArgumentParser(
        prog=prog,
        description="Print yafsdp's per-rank memory plan for a preset model, built on the meta device "
        "(nothing is allocated). The presets are yafsdp.presets' table, the same as the pretraining "
        "job's --preset and the benchmarks'.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS), help="model shape (yafsdp.presets)")
    ap.add_argument("--world-size", type=int, default=8, help="ranks the model is sharded over")
    ap.add_argument("--rank", type=int, default=0, help="the rank whose shard is planned (padding differs by rank)")
    ap.add_argument("--param-dtype", default="bf16", choices=["fp32", "bf16", "fp16"],
                    help="compute dtype of the gathered weights (the master shards stay fp32)")
    ap.add_argument("--reduce-dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                    help="dtype of the grad buffers and of the reduce-scatter")
    ap.add_argument("--zero-stage", type=int, default=3, choices=[2, 3],
                    help="3: two alternating weight buffers; 2: one gathered copy per unit")
    ap.add_argument("--outsized-ratio", type=float, default=1.5,
                    help="a unit that is not a repeated block and is larger than this x the largest block gets "
                    "the outsized buffer")
    ap.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_BYTES),
                    help="optimizer whose state is counted (bytes per shard element: adamw 8, sgd-momentum 4)")
    ap.add_argument("--batch", type=int, default=None, help="micro-batch per rank (adds the activation estimate)")
    ap.add_argument("--seq", type=int, default=None,
                    help="sequence length (with --batch; default: the preset's max_position_embeddings)")
    ap.add_argument("--checkpointing", action="store_true", help="per-layer activation checkpointing")
    ap.add_argument("--attention", default="fused", choices=["fused", "math"],
                    help="fused: what flash/memory-efficient SDPA saves; math: the (seq x seq) probabilities")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return ap


def _parse(argv=None, prog="python -m yafsdp plan"):
    return _parser(prog).parse_args(argv)


def main(argv=None, prog="python -m yafsdp plan") -> MemoryPlan:
    from .presets import build_llama

    a = _parse(argv, prog)
    model = build_llama(a.preset, device="meta")
    if a.batch is not None and a.seq is None:
        a.seq = model.config.max_position_embeddings
    plan = memory_plan(
        model, world_size=a.world_size, rank=a.rank, param_dtype=a.param_dtype, reduce_dtype=a.reduce_dtype,
        zero_stage=a.zero_stage, outsized_ratio=a.outsized_ratio, optimizer=a.optimizer,
        batch=a.batch, seq=a.seq, checkpointing=a.checkpointing, attention=a.attention,
    )
    if a.json:
        print(json.dumps(dict(preset=a.preset, **plan.to_dict()), indent=1, default=str))
    else:
        print(f"preset {a.preset}")
        print(plan.format())
    return plan


if __name__ == "__main__":  # the old spelling, python -m yafsdp.plan; see [Note: CLI entry point]
    main(sys.argv[1:], prog="python -m yafsdp.plan")
