"""Per-parameter views of a wrapped model: the full values and gradients of its original parameters,
their gradient norms, and writing values back into the shards.

- ``summon_full_params(model, writeback=False, with_grads=False)`` — collective context: every original
  parameter of the wrapped module is a plain ``nn.Parameter`` holding its full values (trainable ones
  as their fp32 masters, frozen ones in ``param_dtype``, NF4 ones dequantized), ``with_grads=True``
  with its full ``.grad`` (DDP's averaged gradient, fp32). ``writeback=True``: at exit rank 0's values
  are scattered into every rank's shards (as at wrap time), so re-initialising after wrapping —
  ``model.apply(init_fn)``, ``reset_parameters()``, HF ``init_weights()`` — takes effect on the shards
  exactly as on the unsharded model initialised on rank 0. Like FSDP's ``summon_full_params`` it
  holds the whole model on every rank while open.
  Tensor parallel: each TP parameter's full tensor (gathered over the shard group, then over TP) on every rank;
  at exit global rank 0's values are split over TP, then scattered over each shard group (a forward inside the
  context would meet plain tensors where TP's modules expect DTensors: read and write values only).
- ``full_tensor(model, name, grad)`` — collective: one parameter's full values or gradient, every rank
  (a tensor-parallel parameter: gathered over the shard group, then over TP).
- ``named_grad_norms(model)`` — collective: {name: norm of the full gradient} for every trainable
  parameter whose unit has a gradient; each rank sums the squares over its slice of each parameter
  (the ShardInfo slices), one all-reduce of one float per parameter over the shard group (tensor
  parallel: one more over TP, which adds the TP-sharded parameters' squares).

[Note: writing back after a meta-device wrap]
A model built on the meta device has shards with no values yet (``model.needs_load``). Inside
``summon_full_params(writeback=True)`` its parameters then start as NaN; at exit rank 0 checks that
every one was written (no NaN left) before the shards count as loaded, and otherwise raises naming
the parameters left uninitialised — the FSDP2 flow "shard on meta, then init_weights()" without
a silently half-initialised model.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..comm import collectives
from ..comm.collectives import all_gather
from ..comm.groups import check_collective, raise_together

__all__ = ["summon_full_params", "full_tensor", "named_grad_norms"]


def _gather_group(rt, u, g, group, grad: bool = False) -> torch.Tensor | None:
    """Collective over the shard group: a flat group's full padded values (a fresh tensor: fp32 for a
    trainable group, compute_dtype for a frozen or NF4 one), or its full fp32 grad (None without one)."""
    if grad:
        local = g.shard.grad if g.kind.reduced else None
        has = torch.tensor([0 if local is None else 1], device=rt.device)
        collectives.all_reduce(has, group, op=dist.ReduceOp.MIN)
        if not has.item():
            return None
        full = torch.empty(g.layout.padded_numel, dtype=torch.float32, device=rt.device)
        all_gather(full, rt.to_device(local.detach()).float(), group, async_op=False)
        return full
    shard = rt.to_device(g.shard.detach())
    if g.kind.format.stored:  # the records, expanded: the values the model computes with
        records = torch.empty(g.staging_bytes, dtype=torch.uint8, device=rt.device)
        all_gather(records, shard, group, async_op=False)
        return g.kind.format.decode(records, g.layout.shard_numel, g.kind.compute_dtype)
    full = torch.empty(g.layout.padded_numel, dtype=shard.dtype, device=rt.device)
    all_gather(full, shard, group, async_op=False)
    return full


def _all_groups(rt):
    return [(u, g) for u in rt.all for g in u.groups]


@contextlib.contextmanager
def summon_full_params(model, writeback: bool = False, with_grads: bool = False):
    """See the module docstring."""
    from .state_dict import scatter_group

    outer = getattr(model, "_summoned", None)
    if outer is not None:  # nested (model.apply(model._init_weights), apply inside a context): the outer one rules
        if (writeback and not outer[0]) or (with_grads and not outer[1]):
            raise RuntimeError(
                f"yafsdp.YaFSDP.summon_full_params(writeback={writeback}, with_grads={with_grads}) inside "
                f"summon_full_params(writeback={outer[0]}, with_grads={outer[1]}): the outer context decides what is "
                "written back and which gradients are there; open the outer one with these options")
        yield model
        return
    rt = model._rt
    group = model.process_group
    model.check_idle("summon_full_params")
    check_collective("summon_full_params()", group)
    if with_grads:
        rt.sync_replicas()
    unloaded = model.needs_load  # See [Note: writing back after a meta-device wrap]
    installed = []  # (ParamInfo, the nn.Parameter handed out)
    for u, g in _all_groups(rt):
        full = _gather_group(rt, u, g, group)
        if unloaded:
            full = torch.full_like(full, float("nan"))
        gfull = _gather_group(rt, u, g, group, grad=True) if with_grads else None
        views = g.layout.views(full)
        gviews = g.layout.views(gfull) if gfull is not None else [None] * len(views)
        for info, v, gv in zip(g.params, views, gviews):
            t = nn.Parameter(_over_tp(v.clone(), info), requires_grad=not info.frozen)
            if gv is not None:
                t.grad = _over_tp(gv.clone(), info)
            for owner, attr in info.owners:
                owner._parameters[attr] = t
            installed.append((info, t))
    model._summoned = (writeback, with_grads)
    ok = False
    try:
        yield model
        ok = True
    finally:
        model._summoned = None
        current = {id(info): _current(info) for info, _ in installed}
        for info, _ in installed:  # the module tree rests again, whatever happens below
            for owner, attr in info.owners:
                owner._parameters[attr] = info.resting
                owner.__dict__.pop(attr, None)
        if ok:
            changed = [info.fqn for info, t in installed if current[id(info)].requires_grad != (not info.frozen)]
            if changed:
                raise RuntimeError(
                    f"yafsdp: requires_grad of {changed[:5]} changed inside summon_full_params(); the split into "
                    "trainable and frozen flat groups is made at wrap time: freeze before wrapping")
        if ok and writeback:
            _write_back(model, current, unloaded, scatter_group)


def _over_tp(local: torch.Tensor, info) -> torch.Tensor:
    """A TP parameter's local tensor (or gradient) gathered over TP on every rank; any other as it is."""
    if info.tp is None:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, info.tp.mesh, info.tp.placements, run_check=False, shape=info.tp.shape,
                              stride=info.tp.stride).full_tensor()


@torch.no_grad()
def _split_over_tp(model, current) -> dict:
    """Collective over the TP group of the data-parallel index 0 ranks: global rank 0's full values (``current``)
    split by each TP parameter's placements, every other parameter's broadcast (each rank may have drawn its own);
    returns this rank's local values by id(ParamInfo)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    rt, first, out = model._rt, model.tp_rank == 0, {}
    for u, g in _all_groups(rt):
        for info in g.params:
            shape = tuple(info.tp.shape) if info.tp is not None else tuple(info.shape)
            full = (current[id(info)].detach().to(rt.device, torch.float32) if first
                    else torch.empty(shape, dtype=torch.float32, device=rt.device))
            placements = info.tp.placements if info.tp is not None else (Replicate(),)
            out[id(info)] = distribute_tensor(full, model._tp.mesh, placements, src_data_rank=0).to_local()
    return out


def _current(info) -> torch.Tensor:
    """What the owner holds now (the user may have replaced the parameter inside the context)."""
    owner, attr = info.owners[0]
    return owner._parameters.get(attr) if attr in owner._parameters else owner.__dict__.get(attr)


@torch.no_grad()
def _write_back(model, current, unloaded: bool, scatter_group) -> None:
    """Rank 0's values (``current``: id(ParamInfo) -> tensor) into every rank's shards."""
    rt, group, rank, world, tp = model._rt, model.process_group, model.rank, model.world_size, model._tp
    bad = None
    if rank == 0 and model.tp_rank == 0:  # tensor parallel: global rank 0's values, split over TP below
        def shape(info):
            return tuple(info.tp.shape if info.tp is not None else info.shape)

        wrong = [f"{info.fqn!r} has shape {tuple(current[id(info)].shape)}" for u, g in _all_groups(rt)
                 for info in g.params if tuple(current[id(info)].shape) != shape(info)]
        missing = ([info.fqn for u, g in _all_groups(rt) for info in g.params
                    if torch.isnan(current[id(info)].detach()).any()] if unloaded else [])
        if wrong:
            bad = f"parameters replaced with another shape inside summon_full_params(): {wrong[:5]}"
        elif missing:
            bad = (f"the model was built on the meta device and {len(missing)} parameter(s) were not initialised "
                   f"inside summon_full_params(writeback=True): {missing[:5]}; initialise every parameter (or load "
                   "a state dict)")
    if tp is not None and rank == 0:  # the verdict of global rank 0 to the other TP coordinates first
        from ..comm.groups import broadcast_object

        bad = broadcast_object(bad, tp.group)
    raise_together(bad, group, RuntimeError, "yafsdp.YaFSDP.summon_full_params: ")
    if tp is not None and rank == 0:
        current = _split_over_tp(model, current)
    for u, g in _all_groups(rt):
        full = None
        if rank == 0:
            full = torch.empty(g.layout.padded_numel, dtype=torch.float32, device=rt.device)
            g.layout.flatten([current[id(info)].detach().to(rt.device, torch.float32) for info in g.params], full)
        scatter_group(rt, g, full, group, rank, world)
    if model.replicate_group is not None:  # every replica takes replica 0's shards
        from ..comm.hsdp import broadcast_from_replica0

        broadcast_from_replica0(rt, model.module, model.replicate_group)
    if unloaded and not any(b is not None and b.is_meta for m in model.module.modules() for b in m._buffers.values()):
        model.mark_loaded()
    else:
        rt.invalidate_buffers()


def _lookup(model, name: str):
    """(unit, group, ParamInfo) of original parameter ``name`` (any of a tied parameter's names)."""
    for n, p in model.module.named_parameters(remove_duplicate=False):
        if n == name and getattr(p, "_yafsdp_info", None) is not None:
            info = p._yafsdp_info
            unit = p._yafsdp_unit()
            return unit, unit.group_of[id(info)], info
    names = [n for n, p in model.module.named_parameters() if getattr(p, "_yafsdp_info", None) is not None]
    close = [n for n in names if name.split(".")[-1] in n][:5]
    raise KeyError(f"yafsdp: no parameter {name!r} in the wrapped module (names as module.named_parameters() of the "
                   f"unwrapped model gives them, e.g. {close or names[:5]})")


def full_tensor(model, name: str, grad: bool) -> torch.Tensor | None:
    """Collective: the full values (or gradient) of one original parameter, on every rank."""
    rt = model._rt
    model.check_idle("full_grad" if grad else "full_parameter")
    check_collective("full_grad()" if grad else "full_parameter()", model.process_group)
    if grad:
        rt.sync_replicas()
    u, g, info = _lookup(model, name)
    if grad and not g.kind.reduced:
        return None  # frozen: no gradient, as its .grad stays None unsharded
    full = _gather_group(rt, u, g, model.process_group, grad=grad)
    if full is None:
        return None
    return _over_tp(full[info.offset:info.offset + info.numel].view(info.shape).clone(), info)


@torch.no_grad()
def named_grad_norms(model) -> dict[str, torch.Tensor]:
    """Collective: {name: 2-norm of the full gradient} for every trainable original parameter whose
    unit has a gradient (DDP's ``p.grad`` is None otherwise); one all-reduce over the shard group."""
    rt = model._rt
    rt.sync_replicas()  # HSDP: the replicas hold the same grad shards afterwards; count them once
    model.check_idle("named_grad_norms")
    check_collective("named_grad_norms()", model.process_group)
    names, parts, tp_sharded = [], [], []
    for u in rt.all:
        g = u.trainable
        if g is None or g.shard.grad is None:
            continue
        grad, lay = g.shard.grad.detach(), g.layout
        start, stop = lay.shard_start, lay.shard_start + lay.shard_numel
        for info in g.params:
            lo, hi = max(info.offset, start), min(info.offset + info.numel, stop)
            names.append(info.fqn)
            tp_sharded.append(info.tp is not None and info.tp.sharded)
            parts.append(grad[lo - start:hi - start].float().pow(2).sum() if hi > lo
                         else torch.zeros((), device=grad.device))
    if not parts:
        return {}
    sq = rt.to_device(torch.stack(parts))
    collectives.all_reduce(sq, model.process_group)
    if model._tp is not None:  # a TP-sharded parameter's squares summed over TP too; a replicated one's are its own
        sharded = torch.tensor(tp_sharded, device=sq.device)
        over_tp = sq * sharded
        collectives.all_reduce(over_tp, model._tp.group)
        sq = torch.where(sharded, over_tp, sq)
    norms = sq.sqrt()
    return {n: norms[i] for i, n in enumerate(names)}
