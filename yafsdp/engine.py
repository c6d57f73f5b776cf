"""``YaFSDP``: whole-unit flat shards, two alternating preallocated buffers, one comm stream.

[Note: buffer aliases]
During forward and backward a unit's parameters are *aliases* of its weight buffer: tensors made
once at wrap time over the buffer's storage (``flat.alias``), each with its own version counter.
The gate (``_Gate``) returns views of them, which the modules use as their weights. A gather
writes into the buffer through the buffer tensor itself, which bumps only the buffer's version
counter, so autograd's saved-tensor check never fires when ZeRO-3 re-gathers a unit into the
same place for backward. The same holds for the fp32 master shards: each unit's ``nn.Parameter``
aliases one big local tensor (one cast pass per step) but keeps its own version, which is how the
engine tells which shards changed since their compute copy was written.

[Note: the backward gate]
``_Gate`` is the autograd node that owns a unit's weights for one use. Its backward runs exactly
once, after every gradient with respect to the unit's weights has been computed (autograd runs a
node when all of its outputs' gradients are in), whatever the unit's inputs and keyword arguments
are: it is the reliable "unit backward done" point. There the grads are written into the grad
buffer and the reduce-scatter is issued. ``_PreBackward`` sits on a unit's outputs and runs
before any of the unit's backward: it re-gathers (ZeRO-3) and prefetches the unit that ran
before it in forward.

[Note: optimizers that do not bump versions]
The engine knows a master shard changed (so its compute copy must be cast again and a buffer
still holding its gathered weights is stale) from the shard's version counter. torch's fused
optimizers (``AdamW(fused=True)``, ``Adam(fused=True)``, ``SGD(fused=True)``) update parameters
in place *without* bumping it, which would leave the engine computing with the weights of the
previous step. A process-wide optimizer step pre/post hook pair (installed by the first
``YaFSDP``) closes the gap: every yafsdp master shard with a gradient whose version an
optimizer step left unchanged gets its version bumped. Optimizers that do bump (foreach/for-loop
torch optimizers, ``yafsdp.FusedAdamW``) are untouched.

[Note: weight-free backward]
Some units' backward reads none of their weights: a plain ``nn.Embedding`` computes its weight
gradient from the indices and the output gradient alone, and its integer input has no gradient
(``units.weight_free_backward`` says which units qualify: every module using the parameters is
a plain dense embedding, so not a tied head). ZeRO-3 does not re-gather such a unit for backward
and does not prefetch it there: for a Llama embedding that is one unit-sized all-gather less per
step, at the very end of backward where nothing is left to hide it behind. The views handed to
the embedding in forward are not saved by autograd (the embedding saves only its indices), so
the buffer may hold another unit's weights by then. Its grads are written and reduced as usual.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import kernels
from .buffers import GradSlot, WeightSlot
from .collectives import all_gather
from .comm import make_schedule
from .flat import FlatLayout, ParamInfo, alias
from .plan import plan_slots, unit_align
from .trace import span
from .units import Member, UnitSpec, WrapError, discover, weight_free_backward


class Unit:
    """Runtime state of one flat unit (or of the small group)."""

    def __init__(self, name: str, index: int, layout: FlatLayout, members: list[Member]):
        self.name = name
        self.index = index
        self.layout = layout
        self.params: list[ParamInfo] = layout.params
        self.members = members
        self.flat_param: nn.Parameter | None = None  # 1-D fp32 master shard (shard_numel)
        self.grad_shard: torch.Tensor | None = None  # 1-D fp32, the flat_param's .grad storage
        self.compute: torch.Tensor | None = None  # 1-D param_dtype compute copy = all-gather input
        self.slot: WeightSlot | None = None
        self.grad_slot: GradSlot | None = None
        self.aliases: list[torch.Tensor] = []  # per parameter, over self.slot.data
        self.anchor: torch.Tensor | None = None  # 0-element leaf, input of the gate: makes its backward run
        self.cast_version = -1  # flat_param._version when the compute copy was last written
        self.bw_held = False  # a backward use holds the slot
        self.outsized = False
        self.weight_free_bw = False  # ZeRO-3 backward needs no re-gather: see [Note: weight-free backward]

    def __repr__(self):
        return f"Unit({self.name!r}, numel={self.layout.numel}, padded={self.layout.padded_numel})"


class _Gate(torch.autograd.Function):
    """See [Note: the backward gate]."""

    @staticmethod
    def forward(ctx, engine, unit, member, anchor, *aliases):
        ctx.engine, ctx.unit, ctx.member = engine, unit, member
        ctx.set_materialize_grads(False)
        return tuple(a.view_as(a) for a in aliases)

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._post_backward(ctx.unit, ctx.member, grads)
        return (None, None, None, None) + (None,) * len(grads)


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs; its backward runs before the unit's backward."""

    @staticmethod
    def forward(ctx, engine, unit, prev, *tensors):
        ctx.engine, ctx.unit, ctx.prev = engine, unit, prev
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._pre_backward(ctx.unit, ctx.prev)
        return (None, None, None) + grads


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


_OPTIMIZER_HOOKS: list = []  # the process-wide pair, installed once


def _versions_before_step(optimizer, args, kwargs):
    """See [Note: optimizers that do not bump versions]."""
    optimizer._yafsdp_versions = [
        (p, p._version) for g in optimizer.param_groups for p in g["params"]
        if p.grad is not None and hasattr(p, "_yafsdp_unit")
    ]


def _bump_unchanged_after_step(optimizer, args, kwargs):
    for p, v in optimizer.__dict__.pop("_yafsdp_versions", ()):
        if p._version == v:
            torch.autograd.graph.increment_version(p)


def _install_optimizer_hooks():
    if not _OPTIMIZER_HOOKS:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _OPTIMIZER_HOOKS.append(register_optimizer_step_pre_hook(_versions_before_step))
        _OPTIMIZER_HOOKS.append(register_optimizer_step_post_hook(_bump_unchanged_after_step))


@dataclass
class _MemberIndex:
    """A member's distinct parameter indices and where each attribute finds its tensor."""

    pidx: list[int]
    slots: list[tuple[nn.Module, str, int]]  # (owner, attr, position in pidx)


class YaFSDP(nn.Module):
    """Shard ``module`` over ``process_group`` unit by unit (see README for the contract)."""

    _is_yafsdp = True

    def __init__(
        self,
        module: nn.Module,
        *,
        units: list[nn.Module] | None = None,
        process_group=None,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        zero_stage: int = 3,
        device: torch.device | str | None = None,
        align_bytes: int = 16,
        outsized_ratio: float = 1.5,
    ):
        super().__init__()
        if zero_stage not in (2, 3):
            raise ValueError(f"yafsdp.YaFSDP: zero_stage={zero_stage!r} is not supported; use 2 or 3")
        for what, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if dt is None and what == "param_dtype":
                continue
            if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
                raise ValueError(f"yafsdp.YaFSDP: {what}={dt!r} is not a floating-point torch.dtype")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "yafsdp.YaFSDP needs torch.distributed: call torch.distributed.init_process_group() first "
                "(launch with torchrun; gloo on CPU, nccl on GPU)"
            )
        group = process_group if process_group is not None else dist.group.WORLD
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
            raise ValueError(
                f"yafsdp.YaFSDP: the current rank (global rank {dist.get_rank()}) is not in process_group"
            )
        self.process_group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
        self.device = self._resolve_device(device, group)
        self.zero_stage = zero_stage
        self.param_dtype = param_dtype
        self.compute_dtype = param_dtype or torch.float32
        self.reduce_dtype = reduce_dtype

        specs, small = discover(module, units)
        # Remember the original state_dict's keys and what each refers to, before any surgery.
        key_of: dict[int, ParamInfo] = {}
        for spec in specs:
            for p in spec.params:
                key_of[id(p.param)] = p
        for p in small:
            key_of[id(p.param)] = p
        self._sd_keys: list[tuple[str, str, object]] = []  # (key, "param"|"buffer", ParamInfo|(module, name))
        buf_owner = {}
        for mname, m in module.named_modules(remove_duplicate=False):
            for bname, b in m._buffers.items():
                if b is not None:
                    buf_owner.setdefault(id(b), (m, bname))
        for key, t in module.state_dict(keep_vars=True).items():
            if id(t) in key_of:
                self._sd_keys.append((key, "param", key_of[id(t)]))
            elif id(t) in buf_owner:
                self._sd_keys.append((key, "buffer", buf_owner[id(t)]))
            else:  # pragma: no cover - a module with a custom state_dict
                raise WrapError(f"state_dict key {key!r} is neither a parameter nor a buffer of the module")

        align = unit_align(self.compute_dtype, reduce_dtype, align_bytes)
        self.units: list[Unit] = [
            Unit(s.name, i, FlatLayout.build(s.params, self.world_size, self.rank, align), s.members)
            for i, s in enumerate(specs)
        ]
        for u, s in zip(self.units, specs):
            u.weight_free_bw = weight_free_backward(s)
        self.small: Unit | None = None
        if small:
            self.small = Unit("small_group", len(self.units), FlatLayout.build(small, self.world_size, self.rank, align), [])
        self._all = self.units + ([self.small] if self.small else [])
        self._member_index = {
            (id(u), i): self._index_member(m) for u in self.units for i, m in enumerate(u.members)
        }

        # How gathers and reduces are ordered against compute: CUDA streams and events, or gloo
        # work handles. See [Note: streams and events] in comm.py.
        self.schedule = make_schedule(self.device, group)
        self._allocate(outsized_ratio)
        self.module = module
        module._is_yafsdp = True
        self._materialize_from(module)
        self._install_hooks()
        _install_optimizer_hooks()  # See [Note: optimizers that do not bump versions]

        # The compute copies changed since the schedule was last told (the optimizer wrote them):
        # the next step entry records the schedule's copies-ready point. See _ensure_step_ready.
        self._copies_changed = True
        self._order: list[Unit] = []  # units in the order of the last forward (prefetch plan)
        self._trace: list[Unit] = []  # units used so far in the current forward
        self._finalize_queued = False

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _resolve_device(device, group) -> torch.device:
        if device is not None:
            device = torch.device(device)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            return device
        backend = str(dist.get_backend(group)).lower()
        if "nccl" in backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _index_member(self, member: Member) -> _MemberIndex:
        pidx: list[int] = []
        slots = []
        for owner, attr, idx in member.assignments:
            if idx not in pidx:
                pidx.append(idx)
            slots.append((owner, attr, pidx.index(idx)))
        return _MemberIndex(pidx, slots)

    def _allocate(self, outsized_ratio: float):
        """Local shards (one tensor each for all units), then the weight and grad buffers."""
        dev = self.device
        total = sum(u.layout.shard_numel for u in self._all)
        # 1-D fp32: every unit's master shard end to end (one cast pass covers all of them).
        self._master = torch.zeros(total, dtype=torch.float32, device=dev)
        # 1-D fp32: every unit's grad shard; each flat_param's .grad aliases its slice.
        self._grad = torch.zeros(total, dtype=torch.float32, device=dev)
        # 1-D param_dtype: the compute copies (all-gather inputs); the master itself in fp32.
        self._compute = (
            self._master if self.compute_dtype == torch.float32
            else torch.zeros(total, dtype=self.compute_dtype, device=dev)
        )
        self.flat = nn.Module()  # holds the flat master shards as registered parameters
        off = 0
        for u in self._all:
            n = u.layout.shard_numel
            u.flat_param = nn.Parameter(alias(self._master, off, (n,)))
            u.grad_shard = alias(self._grad, off, (n,))
            u.compute = self._compute[off:off + n]
            u.anchor = torch.empty(0, device=dev, requires_grad=True)
            u.flat_param._yafsdp_unit = u.name
            u.flat_param._yafsdp_names = [p.fqn for p in u.params]
            if self.compute_dtype != torch.float32:
                u.flat_param._yafsdp_compute_copy = u.compute
                u.flat_param._yafsdp_copy_written = self._copy_written_cb(u)
            self.flat.register_parameter(u.name.replace(".", "_"), u.flat_param)
            off += n

        # Buffer sizes come from the plan, so yafsdp.plan can report them without allocating.
        # See [Note: one plan, one allocator] in plan.py.
        self.slot_plan = plan = plan_slots(
            [u.name for u in self.units], [u.layout for u in self.units],
            self.small.layout if self.small is not None else None,
            compute_dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype,
            zero_stage=self.zero_stage, outsized_ratio=outsized_ratio,
        )
        self.grad_slots: list[GradSlot] = [
            GradSlot(s.name, s.capacity, s.shard_capacity, s.dtype, dev, self.schedule.grad_sync()) for s in plan.grad
        ]
        self.weight_slots: list[WeightSlot] = [
            WeightSlot(s.name, s.capacity, s.dtype, dev, self.schedule.weight_sync()) for s in plan.weight
        ]
        for u, w, g in zip(self._all, plan.weight_of, plan.grad_of):
            u.slot, u.grad_slot = self.weight_slots[w], self.grad_slots[g]
        for u, big in zip(self.units, plan.outsized):
            u.outsized = big
        for u in self._all:
            u.aliases = [alias(u.slot.data, p.offset, p.shape) for p in u.params]

    def _copy_written_cb(self, unit: Unit):
        def copy_written():  # the optimizer wrote the compute copy, on the compute side
            unit.cast_version = unit.flat_param._version
            self._copies_changed = True
        return copy_written

    def _materialize_from(self, module: nn.Module):
        """Rank 0's values into every rank's shards, one unit at a time; then the module surgery."""
        dev = self.device
        self.needs_load = False
        with torch.no_grad():
            for u in self._all:
                if any(p.param.is_meta for p in u.params):
                    self.needs_load = True  # built on the meta device: load_full_state_dict() fills it
                else:
                    full = None
                    if self.rank == 0:
                        full = self._fp32_scratch(u)
                        u.layout.flatten([p.param.detach().to(dev, torch.float32) for p in u.params], full)
                    self._scatter_into(u, full)
                for p, a in zip(u.params, u.aliases):
                    for owner, attr in p.owners:
                        del owner._parameters[attr]
                        owner.__dict__[attr] = a
                    del p.param
            for mname, m in module.named_modules():
                for bname, b in list(m._buffers.items()):
                    if b is None:
                        continue
                    if b.is_meta:
                        self.needs_load = True
                        continue
                    b = b.to(dev)
                    dist.broadcast(b, self._src, group=self.process_group)
                    m._buffers[bname] = b

    def _scatter_into(self, unit: Unit, full: torch.Tensor | None):
        """Rank 0's ``full`` (fp32, padded_numel) -> every rank's master shard of ``unit``."""
        out = torch.empty(unit.layout.shard_numel, dtype=torch.float32, device=self.device)
        chunks = list(full.chunk(self.world_size)) if self.rank == 0 else None
        dist.scatter(out, chunks, src=self._src, group=self.process_group)
        unit.flat_param.detach().copy_(out)  # bumps the shard's version: its compute copy is now stale

    def _install_hooks(self):
        for u in self.units:
            for i, m in enumerate(u.members):
                m.module.register_forward_pre_hook(self._make_pre_hook(u, i), with_kwargs=True)
                m.module.register_forward_hook(self._make_post_hook(u, i), with_kwargs=True)

    # ------------------------------------------------------------------ public API
    @property
    def recorder(self):
        """A ``yafsdp.trace.Recorder`` collecting what ran when, or None (the default)."""
        return self.schedule.recorder

    @recorder.setter
    def recorder(self, rec):
        self.schedule.recorder = rec

    def forward(self, *args, **kwargs):
        self._begin_forward()
        ok = False
        try:
            out = self.module(*args, **kwargs)
            ok = True
            return out
        finally:
            self._end_forward(ok)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None or name == "module":
                raise
            return getattr(inner, name)

    def param_groups(self, weight_decay: float, small_weight_decay: float = 0.0, **options) -> list[dict]:
        """Two optimizer param groups: every unit's shard with ``weight_decay``, and the small group
        (all 1-D parameters: norm weights and biases) with ``small_weight_decay``."""
        big = [u.flat_param for u in self.units]
        groups = [dict(params=big, weight_decay=weight_decay, **options)] if big else []
        if self.small is not None:
            groups.append(dict(params=[self.small.flat_param], weight_decay=small_weight_decay, **options))
        return groups

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of all shards together; returns the total norm (unsharded value)."""
        norm_type = float(norm_type)
        grads = [u.flat_param.grad for u in self._all if u.flat_param.grad is not None]
        if norm_type == float("inf"):
            local = torch.stack([g.abs().max() for g in grads]).max() if grads else torch.zeros((), device=self.device)
            local = local.float()
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.process_group)
            total = local
        else:
            if grads:
                local = torch.stack([n.float() ** norm_type for n in torch._foreach_norm(grads, norm_type)]).sum()
            else:
                local = torch.zeros((), device=self.device)
            dist.all_reduce(local, group=self.process_group)
            total = local ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef)
        return total

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective. Rank 0: the original module's state_dict (same keys, shapes, dtypes) on CPU;
        other ranks: {}. Gathers one unit at a time."""
        self._check_idle("full_state_dict")
        values: dict[int, torch.Tensor] = {}
        for u in self._all:
            full = self._fp32_scratch(u)
            all_gather(full, u.flat_param.detach(), self.process_group, async_op=False)
            if self.rank == 0:
                for p, v in zip(u.params, u.layout.views(full)):
                    values[id(p)] = v.to("cpu", p.dtype, copy=True)
        if self.rank != 0:
            return {}
        out = {}
        for key, kind, ref in self._sd_keys:
            if kind == "param":
                out[key] = values[id(ref)]
            else:
                m, bname = ref
                out[key] = m._buffers[bname].detach().to("cpu", copy=True)
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor] | None):
        """Collective inverse of :meth:`full_state_dict`: rank 0's dict goes to every rank's shards.
        Other ranks may pass ``None`` or ``{}``. Checked on rank 0 first; nothing is modified on error."""
        self._check_idle("load_full_state_dict")
        problem = [None]
        if self.rank == 0:
            problem[0] = self._validate_state_dict(state_dict)
        dist.broadcast_object_list(problem, src=self._src, group=self.process_group)
        if problem[0]:
            raise ValueError(f"yafsdp.YaFSDP.load_full_state_dict: {problem[0]}")
        by_param: dict[int, torch.Tensor] = {}
        if self.rank == 0:
            for key, kind, ref in self._sd_keys:
                if kind == "param" and key in state_dict:
                    by_param.setdefault(id(ref), state_dict[key])
        for u in self._all:
            full = None
            if self.rank == 0:
                full = self._fp32_scratch(u)
                u.layout.flatten([by_param[id(p)].to(self.device, torch.float32) for p in u.params], full)
            self._scatter_into(u, full)
        for key, kind, ref in self._sd_keys:
            if kind != "buffer":
                continue
            m, bname = ref
            b = m._buffers[bname]
            if b.is_meta:
                b = torch.empty_like(b, device=self.device)
            if self.rank == 0:
                b.copy_(state_dict[key])
            dist.broadcast(b, self._src, group=self.process_group)
            m._buffers[bname] = b
        self.needs_load = False
        for s in self.weight_slots:
            s.owner = None

    # ------------------------------------------------------------------ introspection
    @property
    def flat_units(self) -> list[Unit]:
        """Every flat unit in order, the small group (if any) last."""
        return list(self._all)

    def shard_info(self) -> list[dict]:
        """Per flat parameter (as named by ``named_parameters()``): its unit and this rank's slice.

        The first ``numel`` elements of a unit's flat layout do not depend on the world size (the
        padding after them does), which is what lets a sharded checkpoint be resharded."""
        names = {id(p): n for n, p in self.named_parameters()}
        return [
            dict(
                name=names[id(u.flat_param)], unit=u.name, numel=u.layout.numel,
                padded_numel=u.layout.padded_numel, shard_start=u.layout.shard_start,
                shard_numel=u.layout.shard_numel, param_names=[p.fqn for p in u.params],
                param=u.flat_param,
            )
            for u in self._all
        ]

    def memory_plan(self, **activation_options):
        """Bytes per rank by role; see yafsdp.plan."""
        from .plan import memory_plan

        return memory_plan(self, **activation_options)

    def owned_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the engine allocated on this rank, by role: the flat master, grad and
        compute-copy shards of all units (one tensor each) and the weight and grad buffers."""
        out = {"master": self._master, "grad": self._grad}
        if self._compute is not self._master:
            out["compute_copy"] = self._compute
        for s in self.weight_slots:
            out[s.name] = s.data
        for s in self.grad_slots:
            out[s.name] = s.data
            out[s.name + "_staging"] = s.staging
        return out

    def allocated_bytes(self) -> dict[str, int]:
        """Bytes of every tensor the engine allocated on this rank, by role."""
        out = {k: t.numel() * t.element_size() for k, t in self.owned_tensors().items()}
        out.setdefault("compute_copy", 0)
        return out

    def _check_idle(self, what: str):
        if any(s.busy for s in self.weight_slots) or self._finalize_queued:
            raise RuntimeError(f"yafsdp.YaFSDP.{what} called during forward/backward; call it between steps")

    def _fp32_scratch(self, unit: Unit) -> torch.Tensor:
        """fp32 room for one gathered unit: its grad buffer when that is fp32, else a temporary."""
        n = unit.layout.padded_numel
        gs = unit.grad_slot
        if (gs is not None and gs.data.dtype == torch.float32 and gs.capacity >= n
                and not self.schedule.reduce_pending(gs.sync)):
            return gs.data[:n]
        return torch.empty(n, dtype=torch.float32, device=self.device)

    def _validate_state_dict(self, sd) -> str | None:
        if not isinstance(sd, dict):
            return f"expected a dict on rank 0, got {type(sd).__name__}"
        names_of: dict[int, list[str]] = {}
        expected = {}
        for key, kind, ref in self._sd_keys:
            expected[key] = ref
            if kind == "param":
                names_of.setdefault(id(ref), []).append(key)
        missing = []
        for key, kind, ref in self._sd_keys:
            if key in sd:
                continue
            if kind == "param" and any(k in sd for k in names_of[id(ref)]):
                continue  # a tied alias whose twin is present
            missing.append(key)
        unexpected = [k for k in sd if k not in expected]
        shape_bad = []
        for key, kind, ref in self._sd_keys:
            if key not in sd:
                continue
            want = ref.shape if kind == "param" else ref[0]._buffers[ref[1]].shape
            got = tuple(sd[key].shape) if hasattr(sd[key], "shape") else None
            if got != tuple(want):
                shape_bad.append(f"{key!r} has shape {got}, expected {tuple(want)}")
        msgs = []
        if missing:
            msgs.append(f"missing keys {missing[:10]}")
        if unexpected:
            msgs.append(f"unexpected keys {unexpected[:10]}")
        if shape_bad:
            msgs.append("; ".join(shape_bad[:10]))
        return "; ".join(msgs) if msgs else None

    # ------------------------------------------------------------------ the step protocol
    def _begin_forward(self):
        self._trace = []
        self._ensure_step_ready()
        small = self.small
        if small is None:
            return
        if not small.slot.holds(small):
            self._gather(small)
        if self._order:  # the first unit's gather goes out before the wait for the (tiny) small group
            self._prefetch(self._order[0])
        self.schedule.wait_gathered(small.slot.sync)
        tensors = small.aliases
        if torch.is_grad_enabled():
            tensors = _Gate.apply(self, small, -1, small.anchor, *small.aliases)
        for p, t in zip(small.params, tensors):
            for owner, attr in p.owners:
                owner.__dict__[attr] = t

    def _end_forward(self, ok: bool):
        if ok and self._trace:
            self._order = self._trace
        if not ok and not _in_backward():  # an exception inside forward: drop every hold
            for s in self.weight_slots:
                s.busy, s.deferred = 0, None

    def _ensure_step_ready(self):
        """The cast pass: fp32 master -> compute copy for every shard changed since last written;
        then, if any compute copy changed (cast here, or written by the optimizer), the schedule's
        copies-ready point, which every later gather waits for."""
        stale = [u for u in self._all if u.flat_param._version != u.cast_version]
        if not stale:
            if self._copies_changed:
                self._copies_changed = False
                self.schedule.copies_written()
            return
        with torch.no_grad():
            if self._compute is not self._master:
                with span("cast", "all" if len(stale) == len(self._all) else f"{len(stale)} units"):
                    if len(stale) == len(self._all):
                        kernels.cast_(self._compute, self._master)
                    else:
                        for u in stale:
                            kernels.cast_(u.compute, u.flat_param.detach())
            for u in stale:
                u.cast_version = u.flat_param._version
        self._copies_changed = False
        self.schedule.copies_written()

    def _gather(self, unit: Unit):
        slot = unit.slot
        if slot.busy and slot.owner is not unit:
            raise RuntimeError(
                f"yafsdp: unit {unit.name!r} needs buffer {slot.name!r} while unit {slot.owner.name!r} is still "
                "using it (two units that share a buffer are running nested); list them so that they do not "
                "alternate into the same buffer, or use zero_stage=2"
            )
        if slot.deferred is not None and slot.deferred is not unit:
            slot.deferred = None
        slot.owner, slot.owner_version = unit, unit.cast_version
        self.schedule.gather(slot.sync, slot.data[:unit.layout.padded_numel], unit.compute, unit.name)

    def _prefetch(self, unit: Unit | None):
        if unit is None or unit.slot.holds(unit):
            return
        if unit.slot.busy:
            unit.slot.deferred = unit  # issued by the release that frees the buffer
        else:
            self._gather(unit)

    def _wait_ready(self, slot: WeightSlot):
        self.schedule.wait_gathered(slot.sync)

    def _acquire(self, unit: Unit):
        if not unit.slot.holds(unit):
            self._gather(unit)
        unit.slot.busy += 1

    def _release(self, unit: Unit):
        slot = unit.slot
        slot.busy -= 1
        if slot.busy > 0:
            return
        self.schedule.released(slot.sync)
        nxt, slot.deferred = slot.deferred, None
        if nxt is not None and not slot.holds(nxt):
            self._gather(nxt)

    def _make_pre_hook(self, unit: Unit, member_i: int):
        index = self._member_index[(id(unit), member_i)]

        def pre_hook(module, args, kwargs):
            if _in_backward():  # activation-checkpoint recompute: weights must be there, nothing else
                owner, attr, _ = index.slots[0]
                if torch.is_grad_enabled() and not owner.__dict__[attr].requires_grad:
                    raise RuntimeError(
                        f"yafsdp: unit {unit.name!r} is recomputed in backward but its forward ran without "
                        "autograd: reentrant activation checkpointing is not supported; use "
                        "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
                    )
                if not unit.bw_held:
                    self._acquire(unit)
                    unit.bw_held = True
                self._wait_ready(unit.slot)
                return None
            self._ensure_step_ready()
            self._acquire(unit)
            self._trace.append(unit)
            pos = len(self._trace)
            if self._order and pos < len(self._order) and self._order[pos - 1] is unit:
                self._prefetch(self._order[pos])
            self._wait_ready(unit.slot)
            if self.recorder:  # after the wait: waiting for the gather is not compute
                unit._fw_iv = self.recorder.compute_start("forward", unit.name)
            tensors = [unit.aliases[i] for i in index.pidx]
            if torch.is_grad_enabled():
                tensors = _Gate.apply(self, unit, member_i, unit.anchor, *tensors)
            for owner, attr, pos_ in index.slots:
                owner.__dict__[attr] = tensors[pos_]
            return None

        return pre_hook

    def _make_post_hook(self, unit: Unit, member_i: int):
        def post_hook(module, args, kwargs, output):
            if _in_backward():
                return None
            if self.recorder and getattr(unit, "_fw_iv", None) is not None:
                self.recorder.compute_end(unit._fw_iv)
            if self.zero_stage == 3 and torch.is_grad_enabled():
                prev = self._trace[-2] if len(self._trace) >= 2 else None
                output = _attach_pre_backward(self, unit, prev, output)
            self._release(unit)
            return output

        return post_hook

    def _queue_finalize(self):
        if not self._finalize_queued:
            self._finalize_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)

    def _pre_backward(self, unit: Unit, prev: Unit | None):
        self._queue_finalize()
        needs_weights = not unit.weight_free_bw  # See [Note: weight-free backward]
        if needs_weights and not unit.bw_held:
            self._acquire(unit)
            unit.bw_held = True
        if prev is not None and not prev.weight_free_bw:
            self._prefetch(prev)  # after the acquire, before the wait: the next gather goes out first
        if needs_weights:
            self._wait_ready(unit.slot)
        if self.recorder:  # after the wait: waiting for the gather is not compute
            unit._bw_iv = self.recorder.compute_start("backward", unit.name)

    def _post_backward(self, unit: Unit, member_i: int, grads):
        """The gate's backward: weights released, grads into the grad buffer, reduce-scatter issued."""
        self._queue_finalize()
        if self.recorder and getattr(unit, "_bw_iv", None) is not None:
            self.recorder.compute_end(unit._bw_iv)
            unit._bw_iv = None
        if self.zero_stage == 3 and unit is not self.small and not unit.weight_free_bw and not unit.slot.holds(unit):
            raise RuntimeError(
                f"yafsdp: unit {unit.name!r} reached its backward without its weights gathered; its output "
                "escaped the engine's pre-backward hook (return tensors, tuples, lists or dicts from the unit)"
            )
        if self.zero_stage == 3 and unit.bw_held:
            # Every node that reads the weights has run: release them first, so a gather deferred
            # on this buffer is issued ahead of this unit's reduce and does not queue behind it.
            unit.bw_held = False
            self._release(unit)
        gs = unit.grad_slot
        self.schedule.wait_reduced(gs.sync)
        lay = unit.layout
        buf = gs.data[:lay.padded_numel]
        pidx = range(len(unit.params)) if member_i < 0 else self._member_index[(id(unit), member_i)].pidx
        with torch.no_grad(), span("grads", unit.name):
            if len(pidx) == len(unit.params):
                buf[lay.numel:].zero_()
            else:
                buf.zero_()
            for i, g in zip(pidx, grads):
                p = unit.params[i]
                dst = buf[p.offset:p.offset + p.numel]
                if g is None:
                    dst.zero_()
                else:
                    dst.view(p.shape).copy_(g)
        self._reduce(unit, gs)

    def _reduce(self, unit: Unit, gs: GradSlot):
        p = unit.flat_param
        fresh = p.grad is None
        if fresh:
            p.grad = unit.grad_shard
        target = p.grad
        lay = unit.layout
        buf = gs.data[:lay.padded_numel]
        staging = gs.staging[:lay.shard_numel]
        self.schedule.reduce(gs.sync, staging, buf, unit.name, lambda: self._fold(target, staging, fresh))

    def _fold(self, target: torch.Tensor, staging: torch.Tensor, fresh: bool):
        """grad shard (+)= reduced sum / world: the one post-divide."""
        with torch.no_grad():
            if fresh:
                kernels.cast_(target, staging, 1.0 / self.world_size)  # scaled in fp32, rounded once
            else:
                kernels.accumulate_(target, staging, 1.0 / self.world_size)

    def _finalize_backward(self):
        """End of backward: every reduce folded, compute waits for comm, every hold dropped."""
        self._finalize_queued = False
        for gs in self.grad_slots:
            self.schedule.wait_reduced(gs.sync)
        for u in self.units:
            if u.bw_held:
                u.bw_held = False
                self._release(u)
        for s in self.weight_slots:
            s.deferred = None


def _attach_pre_backward(engine: YaFSDP, unit: Unit, prev: Unit | None, output):
    """Route every grad-requiring tensor of ``output`` through one _PreBackward node."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(output)
    idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return output
    outs = _PreBackward.apply(engine, unit, prev, *[leaves[i] for i in idx])
    for i, t in zip(idx, outs):
        leaves[i] = t
    return tree_unflatten(leaves, spec)
