"""The autograd nodes and module hooks that drive the runtime's step protocol.

[Note: the backward gate]
``_Gate`` is the autograd node that owns a unit's weights for one use. Its backward runs exactly
once, after every gradient with respect to the unit's weights has been computed (autograd runs a
node when all of its outputs' gradients are in), whatever the unit's inputs and keyword arguments
are: it is the reliable "unit backward done" point. There the grads are written into the grad
buffer and the reduce-scatter is issued. ``_PreBackward`` sits on a unit's outputs and runs
before any of the unit's backward: it re-gathers (ZeRO-3) and prefetches the unit that ran
before it in forward. The first of them to run in a backward queues the end-of-backward
callback (``Runtime.finalize_backward``).

[Note: releasing frozen weights]
Only trainable weights go through the gate: a frozen weight gets no gradient (the modules see a
plain view of the buffer, and autograd computes no weight gradient for it). Its backward use is
then not ordered before the gate: the node that computes an input's gradient from a frozen weight
(``grad_x = grad_y @ W``) may run after the gate. So for a unit with frozen weights each forward
use also puts ``_InputsDone`` on the unit's grad-requiring inputs; it runs after every gradient
with respect to them is computed, i.e. after every node that reads the weights on the way. ZeRO-3
releases the weights when both the gate and that node have run (``BackwardUse.pending``); with
no grad-requiring input nothing upstream needs the weights, and with no trainable weight there is
no gate. A unit without frozen weights keeps the gate as its only point, as before. (In ordinary
models autograd's ready queue, which runs newer nodes first, already runs a gate after the unit's
other nodes, since the gate is created before them; the node on the inputs makes the release point
independent of that order, and it is what releases a unit that is all frozen, which has no gate.)
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import orig_params
from .runtime import BackwardUse, Runtime, in_backward
from .unit import Unit
from .units import Member

__all__ = ["in_backward", "install_hooks", "gate_small_group", "rest_small_group"]


# [Note: weak references from autograd nodes]
# A module keeps the tensors the gate handed it (its weights) after a step, and they keep their
# grad_fn: the gate node and its context live as long as the module does. A strong reference from a
# node's context to the runtime closes a cycle through C++ (module -> tensor -> grad_fn -> context ->
# runtime -> units -> module) that Python's collector cannot see, so a dropped model would never be
# freed: shards, buffers and all. The nodes hold the runtime and units weakly; a backward through
# the graph of an engine already gone does nothing.


def _refs(rt: Runtime, unit: Unit):
    return weakref.ref(rt), weakref.ref(unit)


def _deref(ctx):
    return ctx.rt_ref(), ctx.unit_ref()


def _queue_finalize(rt: Runtime) -> None:
    if rt.enter_backward():
        torch.autograd.Variable._execution_engine.queue_callback(rt.finalize_backward)


class _Gate(torch.autograd.Function):
    """See [Note: the backward gate]."""

    @staticmethod
    def forward(ctx, rt, unit, pidx, use, anchor, *aliases):
        (ctx.rt_ref, ctx.unit_ref), ctx.pidx, ctx.use = _refs(rt, unit), pidx, use
        ctx.set_materialize_grads(False)
        return tuple(a.view_as(a) for a in aliases)

    @staticmethod
    def backward(ctx, *grads):
        rt, unit = _deref(ctx)  # See [Note: weak references from autograd nodes]
        if rt is None or unit is None:
            return (None, None, None, None, None) + (None,) * len(grads)
        _queue_finalize(rt)
        if rt.schedule.recorder is not None and unit.bw_interval is not None:
            rt.schedule.recorder.compute_end(unit.bw_interval)
            unit.bw_interval = None
        rt.post_backward(unit, ctx.pidx, grads, ctx.use)
        return (None, None, None, None, None) + (None,) * len(grads)


class _InputsDone(torch.autograd.Function):
    """Identity on a unit's grad-requiring inputs; its backward runs once their gradients are
    computed. See [Note: releasing frozen weights]."""

    @staticmethod
    def forward(ctx, rt, unit, use, *tensors):
        (ctx.rt_ref, ctx.unit_ref), ctx.use = _refs(rt, unit), use
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        rt, unit = _deref(ctx)
        if rt is not None and unit is not None:
            _queue_finalize(rt)
            rt.use_done(unit, ctx.use)
        return (None, None, None) + grads


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs; its backward runs before the unit's backward."""

    @staticmethod
    def forward(ctx, rt, unit, prev, *tensors):
        (ctx.rt_ref, ctx.unit_ref) = _refs(rt, unit)
        ctx.prev_ref = weakref.ref(prev) if prev is not None else None
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        rt, unit = _deref(ctx)
        if rt is None or unit is None:
            return (None, None, None) + grads
        _queue_finalize(rt)
        rt.pre_backward(unit, ctx.prev_ref() if ctx.prev_ref is not None else None)
        if rt.schedule.recorder is not None:  # after the wait: waiting for the gather is not compute
            unit.bw_interval = rt.schedule.recorder.compute_start("backward", unit.name)
        return (None, None, None) + grads


def _attach_pre_backward(rt: Runtime, unit: Unit, prev: Unit | None, output):
    """Route every grad-requiring tensor of ``output`` through one _PreBackward node."""
    leaves, spec = tree_flatten(output)
    idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return output
    outs = _PreBackward.apply(rt, unit, prev, *[leaves[i] for i in idx])
    for i, t in zip(idx, outs):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


@dataclass
class _MemberIndex:
    """A member's distinct parameter indices and where each attribute finds its tensor."""

    pidx: list[int]
    slots: list[tuple[nn.Module, str, int]]  # (owner, attr, position in pidx)
    trainable: list[int]  # positions in pidx of the trainable parameters (those the gate hands out)
    slots_by_param: list[tuple[nn.Module, str, int]]  # (owner, attr, param idx in unit.params)
    frozen: list[bool]  # per parameter of the unit: frozen at wrap time

    @classmethod
    def of(cls, member: Member, params: list) -> "_MemberIndex":
        pidx: list[int] = []
        slots = []
        for owner, attr, idx in member.assignments:
            if idx not in pidx:
                pidx.append(idx)
            slots.append((owner, attr, pidx.index(idx)))
        return cls(pidx, slots, [k for k, i in enumerate(pidx) if not params[i].frozen],
                   list(member.assignments), [p.frozen for p in params])


def _gate(rt: Runtime, unit: Unit, pidx: list[int], trainable: list[int], tensors: list):
    """The tensors handed to the modules for one grad-enabled use (the trainable ones through a
    gate), and the use's BackwardUse (see [Note: releasing frozen weights])."""
    use = BackwardUse(1 if trainable else 0)
    if not trainable:
        return tensors, use
    gated = _Gate.apply(rt, unit, [pidx[k] for k in trainable], use, unit.anchor, *[tensors[k] for k in trainable])
    tensors = list(tensors)
    for k, t in zip(trainable, gated):
        tensors[k] = t
    return tensors, use


def gate_small_group(rt: Runtime, tensors: list) -> None:
    """Hand the small group's gathered tensors to their modules (through a gate when training)."""
    small = rt.small
    if torch.is_grad_enabled():
        pidx = list(range(len(small.params)))
        tensors, _ = _gate(rt, small, pidx, [i for i in pidx if not small.params[i].frozen], tensors)
    for p, t in zip(small.params, tensors):
        for owner, attr in p.owners:
            owner.__dict__[attr] = t


def rest_small_group(rt: Runtime) -> None:
    """After the root forward (or a unit run on its own): the small group's owners fall back to their
    ShardedParameters. See [Note: the module tree after wrapping] in orig_params.py."""
    for p in rt.small.params:
        for owner, attr in p.owners:
            owner.__dict__.pop(attr, None)


def _attach_inputs_done(rt: Runtime, unit: Unit, use: BackwardUse, args, kwargs):
    """Route the grad-requiring tensors among ``(args, kwargs)`` through one _InputsDone node."""
    leaves, spec = tree_flatten((args, kwargs))
    idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return None
    use.pending += 1
    outs = _InputsDone.apply(rt, unit, use, *[leaves[i] for i in idx])
    for i, t in zip(idx, outs):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


def _pre_hook(rt: Runtime, unit: Unit, index: _MemberIndex):
    def pre_hook(module, args, kwargs):
        if in_backward():  # activation-checkpoint recompute: weights must be there, nothing else
            if index.trainable and torch.is_grad_enabled() and not unit.forward_grad:
                raise RuntimeError(
                    f"yafsdp: unit {unit.name!r} is recomputed in backward but its forward ran without "
                    "autograd: reentrant activation checkpointing is not supported; use "
                    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
                )
            rt.unit_recompute(unit)
            orig_params.recompute_views(unit, index.slots_by_param, index.frozen)
            return None
        rt.unit_forward(unit)
        if rt.root_depth == 0 and rt.small is not None:  # a unit run on its own: its norms and biases too
            gate_small_group(rt, rt.small.aliases)
        unit.forward_grad = torch.is_grad_enabled()
        if rt.schedule.recorder is not None:  # after the wait: waiting for the gather is not compute
            unit.fw_interval = rt.schedule.recorder.compute_start("forward", unit.name)
        tensors = [unit.aliases[i] for i in index.pidx]
        new_inputs = None
        if torch.is_grad_enabled():
            tensors, use = _gate(rt, unit, index.pidx, index.trainable, tensors)
            if unit.frozen is not None and rt.zero_stage == 3:  # See [Note: releasing frozen weights]
                new_inputs = _attach_inputs_done(rt, unit, use, args, kwargs)
        for owner, attr, pos in index.slots:
            owner.__dict__[attr] = tensors[pos]
        return new_inputs

    return pre_hook


def _post_hook(rt: Runtime, unit: Unit, index: "_MemberIndex"):
    def post_hook(module, args, kwargs, output):
        # The weights were valid only during this use: [Note: the module tree after wrapping]
        orig_params.rest(index.slots)
        if in_backward():
            return None
        if rt.root_depth == 0 and rt.small is not None:
            rest_small_group(rt)
        if rt.schedule.recorder is not None and unit.fw_interval is not None:
            rt.schedule.recorder.compute_end(unit.fw_interval)
            unit.fw_interval = None
        if rt.zero_stage == 3 and torch.is_grad_enabled():
            output = _attach_pre_backward(rt, unit, rt.previous_in_forward(), output)
        unit.buffer.release()
        return output

    return post_hook


def install_hooks(rt: Runtime) -> None:
    """A forward pre-hook and post-hook on every member module of every unit."""
    for u in rt.units:
        for m in u.members:
            index = _MemberIndex.of(m, u.params)
            m.module.register_forward_pre_hook(_pre_hook(rt, u, index), with_kwargs=True)
            m.module.register_forward_hook(_post_hook(rt, u, index), with_kwargs=True)
