"""The ``.grad`` of a flat shard as torch's own gradient utilities see it.

[Note: shard gradients that know they are shards]
``model.parameters()`` yields one flat fp32 master shard per unit; each rank holds its slice. Code
written for DDP reads those gradients with torch's utilities, which assume every rank holds the
whole gradient:

- ``torch.nn.utils.clip_grad_norm_`` / ``get_total_norm`` (and accelerate's
  ``Accelerator.clip_grad_norm_``, HF Trainer's ``max_grad_norm``) take the norm of what they see:
  the local shards. Each rank clipped by its own norm, silently.
- ``torch.amp.GradScaler`` looks for inf/nan in the gradients it sees. An overflow in one rank's
  shard made that rank skip ``opt.step()`` while the others stepped: the ranks diverged and hung.

FSDP2 solves both by making its shards DTensors. Here the grad shard is handed out as a
``ShardGrad``: a tensor subclass over the same storage (no copy) whose ``__torch_function__``
passes every op through unchanged (plain tensors out, the same kernels, so optimizers give
bit-identical results) except these:

- a full norm (``torch.linalg.vector_norm`` / ``norm``, ``torch.norm`` / ``Tensor.norm``, ``torch._foreach_norm``)
  returns a ``PartialNorm``: this rank's norm of its slice (without the padding of the flat
  layout), which is not yet the value. ``.to()`` keeps it partial; ``torch.stack`` of partial norms
  is partial; ``torch.linalg.vector_norm`` of such a stack with the same order (exactly what
  ``get_total_norm`` does) is one all-reduce over the shard group and gives the model's norm.
  Any other use of a partial norm (``.item()``, arithmetic) first completes it with an
  all-reduce of its own, so a partial value never leaks: ``p.grad.norm()`` is collective, as with
  a DTensor. A norm over some dims (``dim=``) of a shard has no meaning for the unsharded tensor
  and is refused, naming ``model.clip_grad_norm_``.
- ``torch._amp_foreach_non_finite_check_and_unscale_`` (GradScaler's ``unscale_``): after the
  local check, ``found_inf`` is all-reduced (MAX) over the shard group, the replicas and TP, so every
  rank sees the overflow any rank found, skips the same steps and updates its scale alike (as
  FSDP's ShardedGradScaler does, but with torch's own GradScaler). One 1-element all-reduce per
  ``unscale_``, and nothing at all for runs without a scaler.
- HSDP: a norm or a clamp (``clip_grad_value_``) first completes the gradients across the
  replicas (``Runtime.sync_replicas``); otherwise they would read one replica's part.

Clipping then needs nothing more: ``_clip_grads_with_norm_`` multiplies each shard by the same
coefficient on every rank, and ``clip_grad_value_`` is elementwise. torch's foreach checks take
exact types, so torch's clipping picks its per-tensor path for the shards (one small op per unit);
optimizers choose foreach/fused from the parameters, which stay plain ``nn.Parameter``.
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_map

from ..comm import collectives

__all__ = ["ShardGrad", "PartialNorm", "grad_view", "plain"]

_NORMS = {torch.linalg.vector_norm, torch.linalg.norm, torch.norm, torch.Tensor.norm}
_CLAMPS = {torch.Tensor.clamp_, torch.Tensor.clamp, torch.clamp, torch.clamp_, torch.Tensor.clamp_min_,
           torch.Tensor.clamp_max_, torch._foreach_clamp_min_, torch._foreach_clamp_max_, torch.Tensor.clip_,
           torch.Tensor.clip}


def plain(t):
    """The plain tensor under a ``ShardGrad`` (``t`` itself otherwise)."""
    return t._plain if type(t) is ShardGrad else t


def grad_view(unit, rt, written: bool = False) -> "ShardGrad":
    """The ``ShardGrad`` over ``unit``'s grad shard (made once per unit). A unit whose grad shard lives
    for a step (no grad store: [Note: the grad shard's lifetime at world 1] in layout/sizing.py) gets a
    new shard each time, held by nothing but the view: uninitialised when the caller writes every
    element (``written``), zeros otherwise."""
    if unit.grad_shard is None:
        make = torch.empty if written else torch.zeros
        return ShardGrad.make(make(unit.layout.shard_numel, dtype=torch.float32, device=rt.host_device), rt, unit)
    view = unit.__dict__.get("_shard_grad")
    if view is None:
        view = ShardGrad.make(unit.grad_shard, rt, unit)
        unit.__dict__["_shard_grad"] = view
    return view


class ShardGrad(torch.Tensor):
    """A grad shard as handed out in ``.grad``. See [Note: shard gradients that know they are shards]."""

    _plain: torch.Tensor  # the engine's own tensor (same storage)
    _rt: weakref.ref  # the Runtime
    _valid: int  # elements of this shard before the padding of the flat layout

    @staticmethod
    def make(grad: torch.Tensor, rt, unit) -> "ShardGrad":
        with DisableTorchFunctionSubclass():
            view = grad.as_subclass(ShardGrad)
        lay = unit.layout
        view._plain = grad
        view._rt = weakref.ref(rt)
        view._valid = max(0, min(lay.shard_numel, lay.numel - lay.shard_start))
        return view

    def __reduce_ex__(self, protocol):  # torch.save / pickle: the values, as a plain tensor
        return self._plain.__reduce_ex__(protocol)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NORMS:
            _refuse_tp(args, kwargs)
            return _norm(func, args, kwargs)
        if func is torch._foreach_norm:
            _refuse_tp(args, kwargs)
            return _foreach_norm(args, kwargs)
        if func is torch._amp_foreach_non_finite_check_and_unscale_:
            return _unscale(args, kwargs)
        if func in _CLAMPS:
            _sync(args)
        with DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------- norms
class PartialNorm(torch.Tensor):
    """A norm not yet combined over the shard group: this rank's value. ``_parts``: per element
    (a scalar has one) the runtime and order of a partial norm, or None for a complete value."""

    _local: torch.Tensor
    _parts: list

    @staticmethod
    def make(local: torch.Tensor, parts: list) -> "PartialNorm":
        with DisableTorchFunctionSubclass():
            out = local.as_subclass(PartialNorm)
        out._local = local
        out._parts = parts
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func is torch.Tensor.to and type(first) is PartialNorm:
            with DisableTorchFunctionSubclass():
                return PartialNorm.make(first._local.to(*args[1:], **kwargs), first._parts)
        if func is torch.stack:
            return _stack(args, kwargs)
        if func is torch.linalg.vector_norm and type(first) is PartialNorm and first._local.dim() == 1:
            done = _combine(first, args, kwargs)
            if done is not None:
                return done
        args, kwargs = tree_map(_complete, (args, kwargs))
        with DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _ord(func, args, kwargs):
    """(the order, whether the call is a norm over every element) of a norm call."""
    if func in (torch.linalg.vector_norm, torch.linalg.norm):
        ord_ = kwargs.get("ord", args[1] if len(args) > 1 else None)
        ord_ = 2 if ord_ is None else ord_
        dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
    else:  # torch.norm(input, p="fro", dim=None, keepdim=False, out=None, dtype=None)
        ord_ = kwargs.get("p", args[1] if len(args) > 1 else "fro")
        dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
        ord_ = 2 if ord_ == "fro" else ord_
    return ord_, dim is None and not isinstance(ord_, str)


def _refuse(what: str):
    raise RuntimeError(
        f"yafsdp: {what} of a flat shard's .grad has no meaning for the unsharded gradient (each rank holds "
        "one slice of several parameters laid end to end). Use model.clip_grad_norm_(max_norm) or "
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) / get_total_norm, which combine the "
        "shards")


def _sync(args) -> None:
    """HSDP: the gradients completed across replicas before they are read (once per runtime)."""
    seen = set()
    for t in _shard_grads(args):
        rt = t._rt()
        if rt is not None and id(rt) not in seen:
            seen.add(id(rt))
            if rt.replicas > 1:
                rt.sync_replicas()


def _refuse_tp(args, kwargs) -> None:
    """A norm of the grad shards of a model with tensor-parallel parameters: refused (a partial norm over the shard
    group misses the other TP ranks' slices; see [Note: tensor parallel inside the data-parallel shards] in
    layout/dtensor.py)."""
    if any(getattr(t._rt(), "tp_group", None) is not None for t in _shard_grads([*args, *kwargs.values()])):
        raise RuntimeError(
            "yafsdp: a norm of the gradient shards of a model with tensor-parallel (DTensor) parameters "
            "(torch.nn.utils.clip_grad_norm_, p.grad.norm()) is not supported: it would miss the other TP ranks' "
            "slices. Use model.clip_grad_norm_(max_norm) on the yafsdp.YaFSDP wrapper (the global norm over data "
            "parallel and TP)")


def _shard_grads(args):
    for a in args:
        if type(a) is ShardGrad:
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if type(t) is ShardGrad)


def _local_norm(g: ShardGrad, ord_, dtype=None) -> torch.Tensor:
    with DisableTorchFunctionSubclass():
        return torch.linalg.vector_norm(g._plain[:g._valid], ord_, dtype=dtype)


def _norm(func, args, kwargs):
    if not args or type(args[0]) is not ShardGrad:
        with DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    ord_, full = _ord(func, args, kwargs)
    if not full:
        _refuse(f"{getattr(func, '__name__', func)} with dim= or a matrix norm")
    g = args[0]
    _sync(args)
    local = _local_norm(g, float(ord_), kwargs.get("dtype"))
    return PartialNorm.make(local, [(g._rt, float(ord_))])


def _foreach_norm(args, kwargs):
    tensors = list(args[0])
    ord_ = float(kwargs.get("ord", args[1] if len(args) > 1 else 2))
    dtype = kwargs.get("dtype", args[2] if len(args) > 2 else None)
    _sync(args)
    out = []
    for t in tensors:
        if type(t) is ShardGrad:
            out.append(PartialNorm.make(_local_norm(t, ord_, dtype), [(t._rt, ord_)]))
        else:
            with DisableTorchFunctionSubclass():
                out.append(torch.linalg.vector_norm(t, ord_, dtype=dtype))
    return out


def _stack(args, kwargs):
    tensors = list(args[0])
    with DisableTorchFunctionSubclass():
        scalars = all(isinstance(t, torch.Tensor) and t.dim() == 0 for t in tensors)
        if not scalars:  # not a stack of norms: complete them
            return torch.stack([_complete(t) for t in tensors], *args[1:], **kwargs)
    parts, locals_ = [], []
    for t in tensors:
        if type(t) is PartialNorm:
            parts.extend(t._parts)
            locals_.append(t._local)
        else:
            parts.append(None)
            locals_.append(t)
    with DisableTorchFunctionSubclass():
        return PartialNorm.make(torch.stack(locals_, *args[1:], **kwargs), parts)


def _reduce_op(ord_: float):
    if ord_ == math.inf:
        return dist.ReduceOp.MAX
    if ord_ == -math.inf:
        return dist.ReduceOp.MIN
    return dist.ReduceOp.SUM


def _all_reduce(rt, t: torch.Tensor, op) -> torch.Tensor:
    """``t`` reduced over the shard group (the collective runs on the device)."""
    dev = rt.to_device(t.detach().clone())
    collectives.all_reduce(dev, rt.group, op=op)
    return dev.to(t.device)


def _powers(x: torch.Tensor, ord_: float) -> torch.Tensor:
    """What the shard group combines for an order-``ord_`` norm of norms ``x``."""
    if ord_ in (math.inf, -math.inf):
        return x
    if ord_ == 0:
        return x
    return x.pow(ord_)


def _root(s: torch.Tensor, ord_: float) -> torch.Tensor:
    if ord_ in (math.inf, -math.inf, 0):
        return s
    return s.pow(1.0 / ord_)


def _fold(vals: torch.Tensor, ord_: float) -> torch.Tensor:
    if ord_ == math.inf:
        return vals.max()
    if ord_ == -math.inf:
        return vals.min()
    return vals.sum()


def _complete(t):
    """A partial norm (scalar or vector) completed elementwise: each element the norm of the
    unsharded tensor (one all-reduce per runtime and order); anything else as it is."""
    if type(t) is not PartialNorm:
        return t
    with DisableTorchFunctionSubclass():
        out = t._local.clone()
        flat = out.reshape(-1)
        keys = {}
        for i, part in enumerate(t._parts):
            if part is not None:
                keys.setdefault((id(part[0]), part[1]), (part, []))[1].append(i)
        for (_, ord_), (part, idx) in keys.items():
            rt = part[0]()
            if rt is None:
                raise RuntimeError("yafsdp: the model whose gradient norm this is was freed")
            sel = torch.tensor(idx, dtype=torch.long, device=flat.device)
            vals = _all_reduce(rt, _powers(flat.index_select(0, sel), ord_), _reduce_op(ord_))
            flat.index_copy_(0, sel, _root(vals, ord_).to(flat.dtype))
        return out


def _combine(vec: PartialNorm, args, kwargs):
    """``vector_norm`` of a stack of norms: the order-p norm over the shard group with one
    all-reduce, when every partial element has order p and one runtime; None otherwise."""
    ord_, full = _ord(torch.linalg.vector_norm, args, kwargs)
    if not full or kwargs.get("dtype") is not None:
        return None
    ord_ = float(ord_)
    parts = [p for p in vec._parts if p is not None]
    if not parts or any(p[1] != ord_ for p in parts) or len({id(p[0]) for p in parts}) != 1:
        return None
    rt = parts[0][0]()
    if rt is None:
        return None
    with DisableTorchFunctionSubclass():
        x = vec._local
        mask = torch.tensor([p is not None for p in vec._parts], device=x.device)
        local = _fold(_powers(x[mask], ord_), ord_)
        total = _all_reduce(rt, local, _reduce_op(ord_))
        rest = x[~mask]
        if rest.numel():  # complete norms (of tensors every rank holds whole) counted once
            total = torch.stack([total, _fold(_powers(rest, ord_), ord_)])
            total = _fold(total, ord_)
        return _root(total, ord_)


# ---------------------------------------------------------------------------------------------- GradScaler
def _unscale(args, kwargs):
    """GradScaler's check: local, then ``found_inf`` agreed over the shard group and the replicas."""
    with DisableTorchFunctionSubclass():
        out = torch._amp_foreach_non_finite_check_and_unscale_(*args, **kwargs)
    found_inf = kwargs.get("found_inf", args[1] if len(args) > 1 else None)
    seen = set()
    for g in _shard_grads(args):
        rt = g._rt()
        if rt is None or id(rt) in seen:
            continue
        seen.add(id(rt))
        with DisableTorchFunctionSubclass():
            agreed = _all_reduce(rt, found_inf, dist.ReduceOp.MAX)
            for other in (rt.replicate_group, rt.tp_group):  # HSDP's replicas; TP's ranks (layout/dtensor.py)
                if other is not None:
                    dev = rt.to_device(agreed)
                    collectives.all_reduce(dev, other, op=dist.ReduceOp.MAX)
                    agreed = dev.to(found_inf.device)
            found_inf.copy_(agreed)
    return out
