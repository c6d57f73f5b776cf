"""The autograd nodes and module hooks that drive the runtime's step protocol.

[Note: the backward gate]
``_Gate`` is the autograd node that owns a unit's weights for one use. Its backward runs after
every gradient with respect to the unit's weights has been computed (autograd runs a node when all
of its outputs' gradients are in), whatever the unit's inputs and keyword arguments are: it is the
reliable "unit backward done" point. There the grads are written into the grad buffer and the
reduce-scatter is issued. Its input is the unit's flat shard, so that ``torch.autograd.grad`` with
respect to a shard reaches it (and is refused there, see ``unit.refuse_captured``); it returns no gradient
for it (the engine's reduce fills ``.grad``). Autograd then calls the shard's accumulation node
with no gradient, and with it any hook a user put on the shard; so a shard with a hook is not the
gate's input (the unit's empty anchor is): the engine calls such hooks itself with the final
gradient ([Note: hooks on the shards] in shard_hooks.py), and ``torch.autograd.grad`` with respect
to that shard gets torch's own "not used in the graph" error. ``_PreBackward`` sits on a unit's outputs and runs
before any of the unit's backward: it re-gathers (ZeRO-3) and prefetches the unit that ran before
it in forward. The first node of the engine that runs in a backward queues the end of that
backward (``Runtime.end_task``).

[Note: releasing frozen weights]
Only trainable weights go through the gate: a frozen weight gets no gradient (the modules see a
plain view of the buffer, and autograd computes no weight gradient for it). Its backward use is
then not ordered before the gate: the node that computes an input's gradient from a frozen weight
(``grad_x = grad_y @ W``) may run after the gate. So at ZeRO-3 each forward use also puts
``_InputsDone`` on the unit's grad-requiring inputs; it runs after every gradient with respect to
them is computed, i.e. after every node that reads the weights on the way.

[Note: releasing by what autograd runs]
A forward use does not have exactly one backward: ``torch.autograd.grad(loss, x)`` runs only the
nodes on the way to ``x`` (no gate), ``retain_graph`` lets a second backward run the same nodes
again, and a forward may have no backward at all. So nothing is counted per forward. When a
use's ``_PreBackward`` runs in a backward call (an autograd *graph task*), it asks the autograd
engine which of the use's end nodes — its gate and its ``_InputsDone`` — that call will run
(``torch._C._will_engine_execute_node``) and holds the weights until the last of those has run;
a hold whose end nodes the call does not run (nothing of the unit leads where the call goes) is
dropped when the call ends (``Runtime.end_task``, queued on the graph task by the first node of the
engine that runs in it). The next backward call over a retained graph begins the use again. The
gate reduces whatever gradients autograd hands it in each call: several backward calls accumulate
in ``.grad`` as DDP's do, and a call that does not run the gate (``autograd.grad`` with respect to
inputs) leaves ``.grad`` alone, as plain PyTorch does.

[Note: boundary nodes and in-place ops]
``_PreBackward`` and ``_InputsDone`` return *detached aliases* of the tensors they pass on, not
views: autograd refuses an in-place op on a view made inside a custom Function, and a caller that
writes ``h = block(h); h.mul_(0.9)`` (or HF's ``inputs_embeds *= scale``) must see what the unsharded
module would have returned. The alias shares the tensor's storage and version counter, so an
in-place op is checked against saved tensors exactly as it would be on the original tensor. Two
cases need more, because there another tensor object sees the same memory:
- a unit that modifies an input in place: the caller still holds the original tensor, whose memory
  changed but whose autograd history did not. After the unit's forward, an input whose version
  moved is *rebased*: ``_Rebase`` (an in-place identity, ``mark_dirty``) gives the caller's tensor
  the history of the modified alias, as the in-place op would have in plain PyTorch;
- an output that shares storage with another output, with an input of the unit or with a weight
  buffer (a view of an input, ``(h, h[:, -1])``, a slice of a weight): an in-place op on its alias
  would change what the others see without autograd knowing. Such an output is passed on as a view,
  on which autograd refuses in-place ops (loud, never silently wrong).

[Note: recomputed weights]
An activation-checkpoint recompute runs a unit's forward again inside backward, with whatever
weights the modules hold then. Its graph is thrown away (non-reentrant checkpointing only keeps
the tensors it saves), so what matters is that they hold the buffer's values with the
``requires_grad`` of the original forward: otherwise autograd saves other tensors and
``torch.utils.checkpoint`` raises (a trainable weight that needs no grad saves fewer). Two rules
keep that true whatever forwards ran in between (a validation loss, a frozen reference's logits,
``generate()``):
- a no-grad forward leaves a module's weight alone when it already is a view of the same place in
  the buffer (a gated weight of an earlier forward: the same values; under no_grad its
  ``requires_grad`` records nothing), so it does not replace gated weights by un-gated ones;
- a recompute that runs the unit's hooks (``checkpoint(block, h)`` around the module call; HF's
  layers checkpoint ``forward`` and leave the hooks outside) hands the unit's modules fresh leaves
  over the buffer, trainable ones requiring grad, and the same for the small group's weights inside
  them. A reentrant checkpoint backpropagates through the recompute; a gradient reaching such a
  leaf means exactly that, and is refused by a hook on it.

[Note: the engine's hooks around the user's]
A member module holds its unit's weights from the engine's forward pre-hook to its forward hook.
The pre-hook goes first among the module's pre-hooks (``prepend=True``), so the user's pre-hooks
run with the weights handed out, whenever they were registered: ``torch.nn.utils.prune``'s and the
old ``torch.nn.utils.weight_norm``'s (they compute ``weight`` from other parameters), or one that
reads a weight. What they compute from the weights is upstream of the unit's output or held by
the gate's outputs, so its backward runs while the unit is held (the gate waits for every gradient
of its weights). The forward hook keeps its place in registration order: a user forward hook
registered before wrapping runs with the weights still there, and the backward gate goes on the
output it returns, so what it computes from them is inside the unit's backward; one registered
after wrapping gets the gated output (differentiable when kept for a loss) and the weights taken
back, so its read is refused, with a hint to read in a pre-hook or register before wrapping
(``Runtime.closed_last``). A hook that runs before the engine's pre-hook (a global
``register_module_forward_pre_hook``, or one registered after wrapping with ``prepend=True``)
sees the weights at rest: its read is refused too.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import orig_params, tp, tree_guard
from .lookup import install_lookup, lookup_now, lookup_unit
from .runtime import BackwardUse, Runtime, in_backward
from .unit import Unit, refuse_captured
from ..layout.units import Member

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


def _ends(use: BackwardUse) -> int:
    """How many of ``use``'s end nodes the running backward call will run."""
    return sum(1 for ref in use.ends if (node := ref()) is not None and torch._C._will_engine_execute_node(node))


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
        refuse_captured(ctx, unit)
        rt.enter_backward()
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
        ctx.set_materialize_grads(False)  # an input the unit did not use passes no gradient on, not zeros
        return tuple(t.detach() for t in tensors)  # See [Note: boundary nodes and in-place ops]

    @staticmethod
    def backward(ctx, *grads):
        rt, unit = _deref(ctx)
        if rt is not None and unit is not None:
            rt.enter_backward()
            rt.use_done(unit, ctx.use)
        return (None, None, None) + grads


class _Rebase(torch.autograd.Function):
    """In place on ``orig``: its history becomes that of ``alias`` (the input a unit modified in
    place). See [Note: boundary nodes and in-place ops]."""

    @staticmethod
    def forward(ctx, orig, alias):
        ctx.view = orig._base is not None
        ctx.mark_dirty(orig)
        return orig

    @staticmethod
    def backward(ctx, grad):
        # a view's base keeps the gradient of its other elements only when this one is a tensor
        return (torch.zeros_like(grad) if ctx.view else None), grad


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs; its backward runs before the unit's backward."""

    @staticmethod
    def forward(ctx, rt, unit, use, prevs, shared, *tensors):
        (ctx.rt_ref, ctx.unit_ref), ctx.use = _refs(rt, unit), use
        ctx.prev_refs = [weakref.ref(p) for p in prevs]  # the units prefetched before its backward, nearest first
        ctx.set_materialize_grads(False)  # an output nobody used passes no gradient on, not zeros
        # See [Note: boundary nodes and in-place ops]
        return tuple(t.view_as(t) if sh else t.detach() for t, sh in zip(tensors, shared))

    @staticmethod
    def backward(ctx, *grads):
        rt, unit = _deref(ctx)
        if rt is None or unit is None:
            return (None, None, None, None, None) + grads
        rt.enter_backward()
        prevs = [p for p in (r() for r in ctx.prev_refs) if p is not None]
        rt.pre_backward(unit, ctx.use, prevs, _ends(ctx.use))  # See [Note: releasing by what autograd runs]
        if rt.schedule.recorder is not None:  # after the wait: waiting for the gather is not compute
            unit.bw_interval = rt.schedule.recorder.compute_start("backward", unit.name)
        return (None, None, None, None, None) + grads


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no plain storage: treated as shared
        return None


def _shared(outputs: list, seen: set) -> tuple[bool, ...]:
    """Per output: it shares storage with another output or with a tensor of ``seen`` (storage
    keys of the unit's inputs and of the weight buffers). See [Note: boundary nodes and in-place ops]."""
    keys = [_storage(t) for t in outputs]
    return tuple(k is None or k in seen or keys.count(k) > 1 for k in keys)


def _attach_pre_backward(rt: Runtime, unit: Unit, use: BackwardUse, prevs: list[Unit], output, args, kwargs):
    """Route every grad-requiring tensor of ``output`` through one _PreBackward node."""
    leaves, spec = tree_flatten(output)
    idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return output
    tensors = [leaves[i] for i in idx]
    seen = {_storage(s.data) for s in rt.weight_buffers if s.allocated}  # world 1: some are given back
    seen.update(_storage(t) for s in rt.alias_buffers for t in s.stores)  # world 1: [Note: the world-1 alias]
    seen.update(_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
    outs = _PreBackward.apply(rt, unit, use, prevs, _shared(tensors, seen), *tensors)
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
    # per position in pidx: the TP layout of a tensor-parallel parameter (None: plain); None when the
    # member has none. See [Note: tensor parallel inside the data-parallel shards] in layout/dtensor.py
    tp: list | None = None

    @classmethod
    def of(cls, member: Member, params: list) -> "_MemberIndex":
        pidx: list[int] = []
        slots = []
        for owner, attr, idx in member.assignments:
            if idx not in pidx:
                pidx.append(idx)
            slots.append((owner, attr, pidx.index(idx)))
        return cls(pidx, slots, [k for k, i in enumerate(pidx) if not params[i].frozen],
                   list(member.assignments), [p.frozen for p in params], tp.specs_of(params, pidx))


def _gate(rt: Runtime, unit: Unit, pidx: list[int], trainable: list[int], tensors: list, use: BackwardUse):
    """The tensors handed to the modules for one grad-enabled use (the trainable ones through a
    gate, which becomes one of ``use``'s end nodes)."""
    if not trainable:
        return tensors
    # See [Note: the backward gate]: the shard is the gate's input unless a hook is on it (autograd would
    # call that hook with no gradient; the engine calls it with the final one: [Note: hooks on the shards])
    shard = unit.flat_param
    hooked = shard is not None and bool(shard._backward_hooks or getattr(shard, "_post_accumulate_grad_hooks", None))
    anchor = shard if shard is not None and not hooked else unit.anchor
    gated = _Gate.apply(rt, unit, [pidx[k] for k in trainable], use, anchor, *[tensors[k] for k in trainable])
    use.ends.append(weakref.ref(gated[0].grad_fn))
    tensors = list(tensors)
    for k, t in zip(trainable, gated):
        tensors[k] = t
    return tensors


def gate_small_group(rt: Runtime, tensors: list) -> None:
    """Hand the small group's gathered tensors to their modules (through a gate when training)."""
    small = rt.small
    if torch.is_grad_enabled():
        pidx = list(range(len(small.params)))
        trainable = [i for i in pidx if not small.params[i].frozen]
        tensors = _gate(rt, small, pidx, trainable, tensors, BackwardUse())
        small.last_gated.update({i: tensors[i] for i in trainable})  # as a unit's use: see _pre_hook
    specs = tp.specs_of(small.params, range(len(small.params)))
    if specs is not None:  # See [Note: tensor parallel inside the data-parallel shards] in layout/dtensor.py
        tensors = tp.as_dtensors(specs, tensors)
    for p, t in zip(small.params, tensors):
        for owner, attr in p.owners:
            _hand(owner, attr, t)


def rest_small_group(rt: Runtime) -> None:
    """After the root forward (or a unit run on its own): the small group's owners fall back to their
    ShardedParameters. See [Note: the module tree after wrapping] in orig_params.py."""
    for p in rt.small.params:
        for owner, attr in p.owners:
            owner.__dict__.pop(attr, None)


def _attach_inputs_done(rt: Runtime, unit: Unit, use: BackwardUse, args, kwargs, passed: list):
    """Route the grad-requiring tensors among ``(args, kwargs)`` through one _InputsDone node
    (one of ``use``'s end nodes); ``passed`` gets (input, alias, version) of each, for the rebase
    of an input the unit modifies in place."""
    leaves, spec = tree_flatten((args, kwargs))
    idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return None
    outs = _InputsDone.apply(rt, unit, use, *[leaves[i] for i in idx])
    use.ends.append(weakref.ref(outs[0].grad_fn))
    for i, t in zip(idx, outs):
        passed.append((leaves[i], t, t._version))
        leaves[i] = t
    return tree_unflatten(leaves, spec)


def _rebase_modified(passed: list) -> None:
    """The caller's inputs a unit modified in place take the history of the modified aliases."""
    for orig, alias, version in passed:
        if alias._version != version:
            # the rebase writes no memory: the version bump of mark_dirty is undone, so tensors the unit
            # saved after its own in-place op still match, as they do in plain PyTorch
            with torch.autograd._unsafe_preserve_version_counter(orig):
                _Rebase.apply(orig, alias)


def _refuse_reentrant(name: str):
    def hook(grad):
        raise RuntimeError(
            f"yafsdp: unit {name!r} is recomputed in backward and backpropagated through the recompute: "
            "reentrant activation checkpointing is not supported; use "
            "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
        )

    return hook


def _recomputed(alias: torch.Tensor, trainable: bool, name: str) -> torch.Tensor:
    """A weight for a recompute inside backward. See [Note: recomputed weights]."""
    if not (trainable and torch.is_grad_enabled()):
        return alias
    t = alias.detach().requires_grad_()
    t.register_hook(_refuse_reentrant(name))
    return t


def _same_place(held, t: torch.Tensor) -> bool:
    if tp.is_dtensor(held) or tp.is_dtensor(t):  # made anew per use; a recompute reads TP weights via orig_params
        return False
    return (isinstance(held, torch.Tensor) and held.requires_grad and held.data_ptr() == t.data_ptr()
            and held.shape == t.shape and held.stride() == t.stride() and held.dtype == t.dtype)


def _hand(owner: nn.Module, attr: str, t: torch.Tensor) -> None:
    """``owner.attr = t`` for a forward; a no-grad forward keeps a gated weight of an earlier
    forward that is a view of the same place (see [Note: recomputed weights])."""
    if not torch.is_grad_enabled() and _same_place(owner.__dict__.get(attr), t):
        return
    held = owner._parameters.get(attr)
    if type(held) is not orig_params.ShardedParameter:
        if held is None:  # ``m.bias = None`` after wrapping (torch calls no hook for a None)
            raise RuntimeError(tree_guard.set_to_none_message(owner, attr))
        raise RuntimeError(tree_guard.swapped_message(owner, attr, held))  # functional_call
    owner.__dict__[attr] = t


def _small_slots(rt: Runtime, module: nn.Module) -> list[tuple[nn.Module, str, int]]:
    """(owner, attr, small-group index) of the small group's weights held by ``module``'s modules."""
    if rt.small is None:
        return []
    inside = {id(m) for m in module.modules()}
    return [(owner, attr, i) for i, p in enumerate(rt.small.params) for owner, attr in p.owners if id(owner) in inside]


def _pre_hook(rt: Runtime, unit: Unit, index: _MemberIndex, uses: list, small_slots: list):
    def pre_hook(module, args, kwargs):
        if in_backward():  # activation-checkpoint recompute: weights must be there, nothing else
            if unit.lookup_hooks is not None and lookup_now(unit, module):  # the recompute looks up too
                unit.lookup_armed = True
                return None
            if index.tp is not None or (small_slots and tp.specs_of(rt.small.params, [i for *_, i in small_slots])):
                tp.refuse_recompute(unit.name)
            rt.unit_recompute(unit)
            for owner, attr, pos in index.slots:  # See [Note: recomputed weights]
                owner.__dict__[attr] = _recomputed(unit.aliases[index.pidx[pos]], pos in index.trainable, unit.name)
            for owner, attr, i in small_slots:
                owner.__dict__[attr] = _recomputed(rt.small.aliases[i], not rt.small.params[i].frozen, unit.name)
            return None
        if unit.lookup_hooks is not None and lookup_now(unit, module):  # See [Note: the sharded lookup of an embedding]
            rt.unit_forward(unit, gather=False)
            unit.lookup_armed = True  # the module's forward (lookup.LookupForward) takes it
            uses.append((_LOOKUP, []))
            return None
        rt.closed_last = None
        rt.unit_forward(unit)
        if rt.root_depth == 0 and rt.small is not None:  # a unit run on its own: its norms and biases too
            gate_small_group(rt, rt.small.aliases)
        if rt.schedule.recorder is not None:  # after the wait: waiting for the gather is not compute
            unit.fw_interval = rt.schedule.recorder.compute_start("forward", unit.name)
        tensors = [unit.aliases[i] for i in index.pidx]
        new_inputs = None
        use = BackwardUse() if torch.is_grad_enabled() else None
        passed: list = []
        uses.append((use, passed))  # the post-hook of this call takes them (calls nest)
        if use is not None:
            tensors = _gate(rt, unit, index.pidx, index.trainable, tensors, use)
            # what a recompute inside backward that reads the weights past the hooks gets (HF's reentrant
            # checkpointing): see _resolve_in_backward in orig_params.py
            unit.last_gated.update({index.pidx[k]: tensors[k] for k in index.trainable})
            if rt.zero_stage == 3:  # See [Note: releasing by what autograd runs]
                new_inputs = _attach_inputs_done(rt, unit, use, args, kwargs, passed)
        if index.tp is not None:  # See [Note: tensor parallel inside the data-parallel shards] in layout/dtensor.py
            tensors = tp.as_dtensors(index.tp, tensors)
        for owner, attr, pos in index.slots:
            _hand(owner, attr, tensors[pos])
        return new_inputs

    return pre_hook


def _post_hook(rt: Runtime, unit: Unit, index: "_MemberIndex", uses: list):
    def post_hook(module, args, kwargs, output):
        # The weights were valid only during this use: [Note: the module tree after wrapping]
        orig_params.rest(index.slots)
        if in_backward():
            return None
        if uses and uses[-1][0] is _LOOKUP:  # a sharded lookup: nothing gathered, nothing to release
            uses.pop()
            unit.lookup_armed = False
            return None
        if rt.root_depth == 0 and rt.small is not None:
            rest_small_group(rt)
        if rt.schedule.recorder is not None and unit.fw_interval is not None:
            rt.schedule.recorder.compute_end(unit.fw_interval)
            unit.fw_interval = None
        use, passed = uses.pop() if uses else (None, [])
        if use is not None and rt.zero_stage == 3 and torch.is_grad_enabled():
            _rebase_modified(passed)  # See [Note: boundary nodes and in-place ops]
            output = _attach_pre_backward(rt, unit, use, rt.previous_in_forward(), output, args, kwargs)
        unit.buffer.release()
        rt.closed_last = unit  # See [Note: the engine's hooks around the user's]
        return output

    return post_hook


_LOOKUP = object()  # a member call's entry in ``uses`` when it is a sharded lookup (lookup.py)


# [Note: gradients that reach a shard past the engine]
# A flat shard's gradient is the engine's to write: the gate returns none for it, and this rank's reduced
# slice is folded into ``.grad`` when the reduce completes -- at a fresh step by overwriting the grad
# shard's memory (no zeroing pass). A loss term computed from the shards themselves (an L2 or proximal
# penalty over ``model.parameters()``, EWC) reaches them through autograd's accumulation instead, at a
# time autograd chooses: after the fold it was added, before it the fold overwrote it -- the penalty's
# gradient silently lost on some units and kept on others. So a pre-hook on each trainable shard's
# accumulation node refuses any gradient that arrives there (the gate's is always None): the term is
# to be added to ``.grad`` after backward, where the values are this rank's slice as DDP's would be.
# The node is kept alive by the unit (a node's hooks live as long as it does); the hook holds only names.
def _refuse_direct(where: str):
    def hook(grad_outputs):
        if any(g is not None for g in grad_outputs):
            raise RuntimeError(
                f"yafsdp: a gradient reached {where} through autograd, not through its unit's forward: a loss "
                "term computed from model.parameters() (the flat shards; an L2 or proximal penalty, EWC). The engine "
                "writes this rank's reduced gradient into the shard's .grad and would overwrite it. Add the term's "
                "gradient after backward instead, e.g. `with torch.no_grad(): p.grad.add_(p, alpha=2 * lam)` for p "
                "in model.parameters() (each rank's slice, as DDP's), or use the optimizer's weight_decay")
        return None

    return hook


def _guard_shards(rt: Runtime) -> None:
    """See [Note: gradients that reach a shard past the engine]."""
    for u in (*rt.units, rt.small):
        shard = u.flat_param if u is not None else None
        if shard is None or not shard.requires_grad:
            continue
        with torch.enable_grad():
            node = shard.view_as(shard).grad_fn.next_functions[0][0]
        node.register_prehook(_refuse_direct(f"the flat shard of unit {u.name!r} (flat.{u.flat_attr})"))
        u.__dict__["_accumulator"] = node


def install_hooks(rt: Runtime) -> None:
    """A forward pre-hook and post-hook on every member module of every unit; the forward of an
    embedding looked up from its shards ([Note: the sharded lookup of an embedding] in lookup.py);
    the guard of the shards' gradients ([Note: gradients that reach a shard past the engine])."""
    _guard_shards(rt)
    for u in rt.units:
        for m in u.members:
            # per call of the member running now (calls nest): its BackwardUse (None without grad) and
            # its inputs passed through _InputsDone
            uses: list = []
            index = _MemberIndex.of(m, u.params)
            # the pre-hook first among the module's: [Note: the engine's hooks around the user's]
            m.module.register_forward_pre_hook(_pre_hook(rt, u, index, uses, _small_slots(rt, m.module)),
                                               with_kwargs=True, prepend=True)
            m.module.register_forward_hook(_post_hook(rt, u, index, uses), with_kwargs=True)
        if lookup_unit(rt, u):
            install_lookup(rt, u)
