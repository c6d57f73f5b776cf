"""The wrapped module's original parameters between their unit's uses: what ``model.module.<path>.weight``
is after wrapping, what may be done with it, and the parameter hooks registered on it.

[Note: the module tree after wrapping]
After ``YaFSDP(module)`` every original parameter is still reachable by its name: each owner's
``_parameters[attr]`` holds a :class:`ShardedParameter`, one per original parameter (tied names
share one), with the original's shape, device and ``requires_grad``, the dtype its unit's forward
sees (``param_dtype``, as the gathered weight), but no storage:
each rank keeps only its slice of the unit's flat shard, so there is no value to read. Its
metadata (shape, dtype, device, ``requires_grad``, ``numel()``, ``repr``) answers, and
``submodule.parameters()`` / ``named_parameters()`` list it, so code that counts, names, freezes or
re-initialises parameters finds them. Everything else is decided at the call:

- **a value read or write** (``F.linear(x, m.weight)``, ``nn.init.normal_``, ``copy_``, ``.data``,
  ``reset_parameters()``) outside its unit's
  forward raises, naming the parameter, its unit and what to use instead:
  ``with model.summon_full_params(writeback=True):`` (the full values, written back into the shards at
  exit; ``model.apply(fn)`` and the HF init methods run inside it), ``model.full_parameter(name)``, or
  ``units=`` so that the module whose forward reads the weight contains it. Inside the unit's forward
  the owner's ``__dict__`` entry shadows it with the gathered view (autograd.py), and the post-hook
  removes that entry again: a weight read after its unit's forward, when its buffer may already hold
  another unit (a hand-tied head ``F.linear(h, self.embed.weight)``, a block reading another
  block's weight), fails loudly instead of computing with another unit's values (FSDP2's
  resharded parameters have no storage and raise alike). One read is answered: inside a backward
  (an activation-checkpoint recompute of a submodule, whose own forward hook the engine does not
  see), while the unit's buffer holds the unit at its current version, the read is served from the
  buffer as a leaf with the parameter's ``requires_grad`` (a non-reentrant recompute only rebuilds
  saved tensors; the gradients flow through the original forward's graph) -- or, for a trainable
  weight, as the gated weight of the unit's latest grad-enabled use (``Unit.last_gated``), so that a
  reentrant recompute (HF's ``use_reentrant=True``), which backpropagates through the recompute
  itself, delivers the weight gradients to that use's gate.
- **``requires_grad`` changes** (``p.requires_grad_(False)``, ``submodule.requires_grad_(False)``)
  raise at the call: the split into trainable and frozen flat groups is made at wrap time. Setting
  the value it already has passes.
- **``register_hook``** is kept by the engine and called once per backward use of the unit with
  this rank's local gradient of the parameter, before the reduce; a returned tensor replaces the
  gradient (DDP's semantics; the reduce then averages what the hooks returned). Hooks registered
  on the original parameter before wrapping are carried over. ``register_post_accumulate_grad_hook``
  is refused (no per-parameter ``.grad`` exists to accumulate into).
- **``.grad``** raises (but see ``zero_grad()`` in [Note: what a parent module sees]), pointing to ``model.named_grad_norms()``, ``model.full_grad(name)`` and
  ``summon_full_params(with_grads=True)`` (views.py).

[Note: what a parent module sees]
Frameworks own the root module (a LightningModule, torchtitan's model, a user's wrapper) and call
``parameters()``, ``zero_grad()``, counts and optimizers on it. A parent recurses through
``named_modules()`` and each module's ``_parameters``, never through ``YaFSDP.named_parameters``; so
the flat shards are this wrapper's parameters (``YaFSDP.named_parameters`` lists them as
``flat.<unit>``, for optimizers, clipping and checkpoints, as before) but are not registered on any
module, and no module holds an anchor parameter ([Note: the device anchor] in anchor.py). A parent
therefore lists each original parameter once (tied names share one), under ``<attr>.module.<name>``,
with the unsharded model's shapes and counts. What a parent then does:

- ``zero_grad()`` (``nn.Module.zero_grad``, ``set_to_none`` either way) reads ``.grad`` of each
  original parameter; read from that function (its frame), the answer clears the unit's flat gradient
  as asked and is None. A module holding part of a unit's trainable parameters (``fc1.zero_grad()``
  inside a block) is refused: the unit's gradient is one tensor, cleared whole.
- an optimizer built over its ``parameters()`` / ``named_parameters()``: every
  ``torch.optim.Optimizer.add_param_group`` (which each optimizer's constructor calls) first hands the
  group to :func:`adopt_param_group` (installed by the first ``YaFSDP``, optim_hooks.py). Each unit
  whose trainable original parameters are all in the group is replaced by its flat shard (the same
  tensor ``model.parameters()`` yields, in the engine's order), frozen ones are dropped (no shard of
  theirs trains), other tensors stay: the optimizer is the one over ``model.parameters()`` with the
  group's options, so it trains identically (tested bit for bit). A unit split across groups (weight
  decay by name on a unit holding both matrices and 1-D parameters) or whose shard another group holds
  is refused there, at construction, naming ``model.parameters()`` / ``model.param_groups(...)``.

Why this and not original parameters as tensor subclasses whose data and ``.grad`` alias the flat
shard (the DTensor-like answer, which would let an optimizer split a unit into groups): each
optimizer would then step per-parameter views -- many small kernels instead of one flat op, the
opposite of why the flat layout exists -- and every non-elementwise op an optimizer may do (a norm in
LAMB/Adafactor/Muon, a clipping norm) would see this rank's slice only and be silently wrong unless
each were intercepted and refused; the engine's own fused path, optimizer-state layout and
checkpoints are keyed by the flat shards. Keeping the shards the only optimizable tensors and making
the parent's habits land on them (or refuse) gives the same results with nothing new to get wrong.

Why not the peers' mechanisms. FSDP1's ``use_orig_params=True`` makes each original parameter a
1-D view of its part of the local flat shard (empty on ranks that hold none of it): writes land,
but an init that reads the shape (``kaiming_uniform_``'s fan-in, HF's per-module init) sees the
flattened slice and draws other values than the unsharded model, and ``p.grad`` is a rank-local
slice that logs look plausible on. FSDP2 makes every parameter a DTensor with per-parameter
dispatch in the optimizer, which this engine exists to avoid. Here the shards stay the only
parameters the optimizer sees; the original names keep their metadata, and every access to values
goes through an explicit collective (views.py) or is refused.
"""
from __future__ import annotations

import contextlib
import sys
import weakref
from collections import OrderedDict

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .ddp_guard import WrappedTwiceError, inside_ddp_init, wrapped_twice_message
from .unit import in_backward

__all__ = ["ShardedParameter", "install", "run_grad_hooks", "rest", "adopt_param_group"]

# Metadata that reads no values: answered by the tensor itself (methods and property getters).
_METADATA = frozenset({
    "shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "ndim", "layout", "is_cuda", "is_cpu",
    "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "names", "itemsize", "nbytes", "output_nr",
    "_base", "_is_view", "is_xpu", "is_mps",
    "numel", "nelement", "dim", "size", "stride", "is_floating_point", "is_complex", "element_size",
    "is_contiguous", "get_device", "is_signed", "__hash__", "__len__", "ndimension", "__format__",
})

_CONVERSIONS = frozenset({"to", "cuda", "cpu", "half", "float", "double", "bfloat16", "type", "pin_memory"})

_REMEDY = ("between steps change values inside `with model.summon_full_params(writeback=True):` (model.apply(fn) "
           "and HF init_weights()/post_init() on the wrapper run inside it) and read them with "
           "model.full_parameter(name) or inside `with model.summon_full_params():`; inside training, the module "
           "whose forward reads the weight must be (or contain) its unit: pass units=[...] listing that module")


def _op_name(func) -> tuple[str, str]:
    """("get" | "set" | "call", name) of a __torch_function__ func."""
    name = getattr(func, "__name__", None) or repr(func)
    if name in ("__get__", "__set__") and hasattr(func, "__self__"):
        return ("get" if name == "__get__" else "set"), getattr(func.__self__, "__name__", name)
    return "call", name


class ShardedParameter(torch.Tensor):
    """An original parameter of a wrapped module, between its unit's uses: shape and dtype without
    storage. See [Note: the module tree after wrapping]."""

    @staticmethod
    def __new__(cls, name: str, info, index: int, unit, rt, device: torch.device, dtype: torch.dtype):
        t = torch.Tensor._make_wrapper_subclass(cls, info.shape, dtype=dtype, device=device,
                                                requires_grad=not info.frozen)
        t._is_param = True  # isinstance(t, nn.Parameter): modules register it as a parameter
        t._yafsdp_name = name  # canonical name (module.named_parameters() of the unwrapped model)
        t._yafsdp_info = info
        t._yafsdp_index = index  # in unit.params (and unit.aliases)
        t._yafsdp_unit = weakref.ref(unit)
        t._yafsdp_rt = weakref.ref(rt)
        t._yafsdp_hooks = OrderedDict()  # register_hook: called with the local gradient before the reduce
        return t

    def __repr__(self, *, tensor_contents=None):
        unit = self._yafsdp_unit()
        return (f"ShardedParameter({self._yafsdp_name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"unit={unit.name if unit is not None else None!r}: sharded by yafsdp.YaFSDP; "
                "read it with model.full_parameter(name) or inside model.summon_full_params())")

    def _where(self) -> str:
        unit = self._yafsdp_unit()
        return f"parameter {self._yafsdp_name!r} (unit {unit.name if unit is not None else '?'!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind, name = _op_name(func)
        me = next((a for a in args if isinstance(a, ShardedParameter)), None)
        if me is None:  # a keyword argument (nn.init's tensor=) or inside a list (torch.cat([...]))
            flat = [*kwargs.values(), *(t for a in args if isinstance(a, (list, tuple)) for t in a)]
            me = next((t for t in flat if isinstance(t, ShardedParameter)), None)
        if me is not None and kind != "set" and name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if me is not None and name == "__repr__":
            return me.__repr__()
        if me is not None and name in ("requires_grad_", "requires_grad") and kind != "get":
            want = bool(args[1]) if len(args) > 1 else bool(kwargs.get("requires_grad", True))
            if want == me.requires_grad or (not want and _DISABLING_ADAPTERS[0]):  # See [Note: PEFT's adapter switches]
                return me if kind == "call" else None
            raise RuntimeError(
                f"yafsdp: requires_grad of {me._where()} cannot change after wrapping (it is {me.requires_grad}): "
                "the engine split trainable and frozen parameters into separate flat groups at wrap time. Freeze "
                "before wrapping: p.requires_grad_(False) on the plain module, then yafsdp.YaFSDP(module)")
        if me is not None and name == "register_hook":
            return me._register_hook(args[1] if len(args) > 1 else kwargs["hook"])
        if me is not None and name == "register_post_accumulate_grad_hook":
            raise RuntimeError(
                f"yafsdp: register_post_accumulate_grad_hook on {me._where()} is not supported: after wrapping a "
                "parameter has no .grad of its own to accumulate into (its gradient is a slice of its unit's flat "
                "shard's .grad). Use p.register_hook(fn) (called once per backward with this rank's local gradient, "
                "as under DDP) or a hook on the flat shard")
        if me is not None and name == "grad":
            if kind == "set" and len(args) > 1 and args[1] is None:
                return None
            if kind == "get":
                caller = sys._getframe(1)
                if caller.f_code is nn.Module.zero_grad.__code__:  # See [Note: what a parent module sees]
                    return _zero_grad_from(caller, me)
            raise RuntimeError(
                f"yafsdp: {me._where()} has no .grad of its own after wrapping: its gradient is this rank's slice of "
                "its unit's flat shard's .grad (model.named_parameters()). For per-parameter values use "
                "model.named_grad_norms() (collective), model.full_grad(name), or "
                "`with model.summon_full_params(with_grads=True):`; zero_grad() on any module holding the unit, or "
                "opt.zero_grad(), clears them")
        if me is not None and name in _CONVERSIONS:
            raise RuntimeError(
                f"yafsdp: {me._where()}: {name}() on a parameter of a wrapped module (e.g. model.module.to(...)) is "
                "not supported: the engine owns its shards. Pass param_dtype= / device= to yafsdp.YaFSDP(...), or "
                "move the module before wrapping (model.to(...) on the wrapper passes when it changes nothing)")
        resolved = _resolve_in_backward(args, kwargs)
        if resolved is not None:
            return func(*resolved[0], **resolved[1])
        where = me._where() if me is not None else "a parameter of a wrapped module"
        if inside_ddp_init():  # See [Note: DDP around a sharded model] in ddp_guard.py
            raise WrappedTwiceError(wrapped_twice_message(
                "DistributedDataParallel", f"a module holding a yafsdp.YaFSDP model ({where} was read by {name!r})"))
        raise RuntimeError(
            f"yafsdp: {where} was used by {name!r} outside its unit's forward. After wrapping a parameter holds no "
            "values between its unit's uses (each rank keeps only its slice of the flat shard), so this would see "
            f"no weights or another unit's; {_after_forward_hint(me)}{_REMEDY}")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            f"yafsdp: {func} reached a parameter of a wrapped module outside its unit's forward: it holds no values "
            f"there; {_REMEDY}")

    def _register_hook(self, hook):
        if not self.requires_grad:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        if len(self._yafsdp_info.owners) > 1:
            raise RuntimeError(
                f"yafsdp: register_hook on {self._where()} is not supported: it is tied (used by several modules), "
                "and the engine sees each use's gradient separately, where autograd would call the hook once with "
                "their sum. Register the hook on the flat shard instead")
        handle = RemovableHandle(self._yafsdp_hooks)
        self._yafsdp_hooks[handle.id] = hook
        return handle


# [Note: PEFT's adapter switches]
# PEFT disables its adapters (``PeftModel.disable_adapter()``, the reference logits of TRL's DPO with
# ``ref_model=None``; ``disable_adapter_layers()``; transformers' ``disable_adapters()``) through each
# tuner layer's ``enable_adapters(False)``, which also turns ``requires_grad`` off on the adapter
# weights, and ``enable_adapters(True)`` turns it back on for the active adapter. Which parameters train
# is fixed at wrap time (they are in the trainable flat group), so while a layer disables its adapters
# (``disabling_adapters``, entered by the wrapped layers' ``enable_adapters(False)``:
# wrapper/module_methods.py) turning ``requires_grad`` off is a no-op: the disabled adapters take no
# part in the forward, so they get no gradient either way, and enabling them again finds them as
# they were -- the state PEFT restores. Anything else that would change a parameter's
# ``requires_grad`` is refused, switching to another adapter included (module_methods.py refuses it
# before PEFT changes anything).
_DISABLING_ADAPTERS = [0]


@contextlib.contextmanager
def disabling_adapters():
    """See [Note: PEFT's adapter switches]."""
    _DISABLING_ADAPTERS[0] += 1
    try:
        yield
    finally:
        _DISABLING_ADAPTERS[0] -= 1


def _after_forward_hint(me) -> str:
    """For a read right after its unit's forward ended (a forward hook on the unit's module registered after
    wrapping): where the weights can be read. See [Note: the engine's hooks around the user's] in autograd.py."""
    unit, rt = (me._yafsdp_unit(), me._yafsdp_rt()) if me is not None else (None, None)
    if unit is None or rt is None or rt.closed_last is not unit or in_backward():
        return ""
    return (f"it was read right after unit {unit.name!r}'s forward ended, as by a forward hook on its module "
            "registered after wrapping, which runs after the engine took the weights back: read them in a forward "
            "pre-hook (those run with the weights), or register the forward hook before wrapping; ")


def _resolve_in_backward(args, kwargs):
    """Inside a backward, each ShardedParameter among ``args``/``kwargs`` whose unit's buffer holds the unit
    at its current version, as a leaf view of the buffer; None when any cannot be served."""
    if not in_backward():
        return None
    ok = True

    def sub(a):
        nonlocal ok
        if isinstance(a, ShardedParameter):
            unit, rt = a._yafsdp_unit(), a._yafsdp_rt()
            if unit is None or rt is None or not unit.buffer.holds(unit):
                ok = False
                return a
            gated = unit.last_gated.get(a._yafsdp_index) if a.requires_grad else None
            if gated is None:
                gated = unit.aliases[a._yafsdp_index].detach().requires_grad_(a.requires_grad)
            if a._yafsdp_info.tp is not None:  # See [Note: tensor parallel inside the data-parallel shards]
                from .tp import as_dtensors

                gated, = as_dtensors([a._yafsdp_info.tp], [gated])
            return gated
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        return a

    new_args = tuple(sub(a) for a in args)
    new_kwargs = {k: sub(v) for k, v in kwargs.items()}
    return (new_args, new_kwargs) if ok else None


def install(rt, unit, index: int, original: nn.Parameter | None) -> ShardedParameter:
    """Replace parameter ``unit.params[index]`` in every owner by one ShardedParameter (keeping the
    owners' parameter order); the original's hooks are its hooks."""
    info = unit.params[index]
    # its dtype is the one its unit's forward sees (the gathered weight's: param_dtype), so that code reading a
    # weight's dtype outside the unit's hooks -- PEFT casts its input to lora_A.weight.dtype, an HF recompute
    # inside backward runs past the decoder layer's hooks, HF's model.dtype reads the first parameter --
    # agrees with the values it then gets
    sp = ShardedParameter(info.fqn, info, index, unit, rt, rt.device, unit.aliases[index].dtype)
    if original is not None:
        # One hook dict for both: hooks registered on the original (before wrapping, or after it on a
        # reference kept from before) are called as those registered on the ShardedParameter, and the
        # user's handles remove from this same dict.
        if original._backward_hooks is None:
            original._backward_hooks = OrderedDict()
        sp._yafsdp_hooks = original._backward_hooks
        # an optimizer holding the original is refused: [Note: optimizers that would train the wrong thing]
        original._yafsdp_replaced = info.fqn
    info.resting = sp
    for owner, attr in info.owners:
        owner._parameters[attr] = sp
        owner.__dict__.pop(attr, None)
    return sp


def run_grad_hooks(unit, pidx, grads):
    """The parameter hooks of a unit's use, on this rank's local gradients (before the reduce)."""
    out = None
    for k, (i, g) in enumerate(zip(pidx, grads)):
        sp = unit.params[i].resting
        if g is None or sp is None or not sp._yafsdp_hooks:
            continue
        for hook in list(sp._yafsdp_hooks.values()):
            r = hook(g)
            if r is not None:
                g = r
        if out is None:
            out = list(grads)
        out[k] = g
    return grads if out is None else out


def rest(slots) -> None:
    """After a use: the owners' attributes fall back to their ShardedParameters."""
    for owner, attr, _ in slots:
        owner.__dict__.pop(attr, None)


# ----------------------------------------------------------------------------------------------- parents
def _trainable(unit) -> list:
    """The ParamInfos of ``unit``'s trainable flat group (the one its ``flat_param`` is the shard of)."""
    return [p for g in unit.groups if g.kind.reduced for p in g.params]


# [(id of zero_grad's frame, weakref to its module, ids of the module's parameters)]: the call being
# answered, so that each parameter's answer does not walk the module again; nothing held alive
_ZERO_GRAD_SEEN: list = []


def _zero_grad_from(frame, sp: ShardedParameter):
    """``.grad`` of ``sp`` read by ``nn.Module.zero_grad`` (of a parent, or of a module inside the wrapped
    one): clears the flat gradient of ``sp``'s unit as that call asks (``set_to_none``) and answers None,
    so the loop moves on. Refused when the module holds only part of the unit's trainable parameters."""
    unit = sp._yafsdp_unit()
    if unit is None or not sp.requires_grad or unit.flat_param is None:
        return None
    module = frame.f_locals["self"]
    if not _ZERO_GRAD_SEEN or _ZERO_GRAD_SEEN[0][0] != id(frame) or _ZERO_GRAD_SEEN[0][1]() is not module:
        _ZERO_GRAD_SEEN[:] = [(id(frame), weakref.ref(module), {id(p) for p in module.parameters()})]
    ids = _ZERO_GRAD_SEEN[0][2]
    missing = [i.fqn for i in _trainable(unit) if i.resting is not None and id(i.resting) not in ids]
    if missing:
        _ZERO_GRAD_SEEN.clear()
        raise RuntimeError(
            f"yafsdp: zero_grad() on {type(module).__name__} reached {sp._where()} but not {missing[0]!r} of the "
            "same unit: a unit's gradients are one flat tensor, cleared whole, so a module holding part of a unit "
            "cannot clear its part alone. Call zero_grad() on the yafsdp.YaFSDP wrapper, on a module holding it, "
            "or opt.zero_grad()")
    flat = unit.flat_param
    if flat.grad is not None:
        if frame.f_locals.get("set_to_none", True):
            flat.grad = None
        else:
            if flat.grad.grad_fn is not None:
                flat.grad.detach_()
            else:
                flat.grad.requires_grad_(False)
            flat.grad.zero_()
    return None


def adopt_param_group(group: dict, held=frozenset()) -> None:
    """An optimizer param group holding original parameters of a wrapped module (built over a parent's
    ``parameters()``), before torch's ``Optimizer.add_param_group`` reads it: each unit's trainable
    original parameters, all present, become that unit's flat shard (frozen ones are dropped: no shard of
    theirs trains); a unit present only in part, or whose shard another group (ids in ``held``) holds, is
    refused, naming the way out. See [Note: what a parent module sees]."""
    params = group.get("params")
    if isinstance(params, torch.Tensor) or isinstance(params, (set, frozenset)) or params is None:
        return  # torch wraps a lone tensor and refuses a set
    params = list(params)
    group["params"] = params
    tensor = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]
    if not any(isinstance(t, ShardedParameter) for t in tensor):
        return
    out, units, first = [], {}, None
    for entry, t in zip(params, tensor):
        if not isinstance(t, ShardedParameter):
            out.append(entry)
            continue
        unit = t._yafsdp_unit()
        if unit is None:
            raise RuntimeError(f"yafsdp: {t._where()} belongs to a yafsdp.YaFSDP model that no longer exists")
        if first is None:
            first = len(out)
        if t.requires_grad and unit.flat_param is not None:
            units.setdefault(id(unit), (unit, t._yafsdp_rt(), set()))[2].add(id(t._yafsdp_info))
    named = isinstance(params[0], tuple)
    shards, engines = [], {}
    for unit, rt, present in units.values():
        absent = [i.fqn for i in _trainable(unit) if id(i) not in present]
        if absent:
            have = next(i.fqn for i in _trainable(unit) if id(i) in present)
            raise ValueError(
                f"yafsdp: an optimizer param group holds parameter {have!r} of unit {unit.name!r} but not "
                f"{absent[0]!r} of the same unit: after wrapping, a unit's trainable parameters are one flat shard, "
                "stepped whole with one group's options, so they cannot be split across param groups or left out. "
                "Build the optimizer over the wrapper's parameters: model.parameters() (the flat shards), or "
                "model.param_groups(weight_decay) for weight decay on matrices only (model: the yafsdp.YaFSDP "
                "wrapper)")
        shards.append((engines.setdefault(id(rt), len(engines)), rt.all.index(unit) if rt is not None else 0, unit))
    seen = {id(t) for t in tensor}
    add = []
    for _, _, unit in sorted(shards, key=lambda x: x[:2]):  # the engine's order: model.parameters()'
        if id(unit.flat_param) in held:
            raise ValueError(
                f"yafsdp: an optimizer param group holds parameter {_trainable(unit)[0].fqn!r} of unit "
                f"{unit.name!r}, whose flat shard another param group holds already: after wrapping, a unit's "
                "trainable parameters are one flat shard, stepped with one group's options. Build the optimizer over "
                "the wrapper's parameters: model.parameters() (the flat shards), or model.param_groups(weight_decay) "
                "for weight decay on matrices only (model: the yafsdp.YaFSDP wrapper)")
        if id(unit.flat_param) not in seen:
            add.append((f"flat.{unit.flat_attr}", unit.flat_param) if named else unit.flat_param)
    group["params"] = out[:first] + add + out[first:]
