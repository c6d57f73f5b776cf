"""Parameters and submodules set on a wrapped module tree after wrapping: refused at the call.

[Note: the module tree's structure is fixed at wrapping]
Wrapping lays every parameter of the module tree into its unit's flat shards and installs one
ShardedParameter per original in its owners ([Note: the module tree after wrapping] in
orig_params.py). Two PyTorch habits would change that tree behind the engine's back, and both ran
without an error while training something else than the unsharded model:

- ``m.weight = nn.Parameter(new)`` (or ``register_parameter``, or ``m.bias = None``) on a module
  of the tree: the engine kept gathering the old values into the unit's forward, and the new tensor
  was neither sharded, reduced nor stepped (torch calls no hook for a None: that one is refused at the
  unit's next use, by the hand-over in autograd.py);
- ``m.lm_head = nn.Linear(...)`` (or ``add_module``, ``ModuleList.append``) bringing parameters
  the engine does not hold: the new module ran in forward but its parameters were in no shard and
  no optimizer; a replacement dropping a unit's parameters left that unit in the engine.

torch's process-wide module hooks (``register_module_parameter_registration_hook`` and
``register_module_module_registration_hook``, called by ``register_parameter`` /
``register_module`` and so by ``__setattr__``) see each such call; for a module of a wrapped tree
they refuse it, naming the module and attribute and what to do instead (change values in place
inside ``summon_full_params(writeback=True)``, or change the structure before wrapping). What stays
allowed: setting a parameter to the one it already holds (HF's ``tie_weights()`` again), any
parameter inside ``summon_full_params`` (its values are written back), and a submodule holding
exactly the parameters of the one it replaces (a wrapper around a block, a parameter-free activation
or dropout); a submodule allowed in joins the watched tree. The hooks cost nothing in a step: they
run only when a module registers something.
"""
from __future__ import annotations

import weakref

from torch import nn

__all__ = ["watch"]

# module -> (the YaFSDP wrapper, the module's qualified name in the wrapped module)
_TREE: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()
_HANDLES: list = []


def watch(wrapper, module: nn.Module) -> None:
    """Refuse structural changes to ``module``'s tree from now on (see the Note above)."""
    _add(wrapper, module, "")
    if not _HANDLES:
        from torch.nn.modules.module import (register_module_module_registration_hook,
                                             register_module_parameter_registration_hook)

        _HANDLES.append(register_module_parameter_registration_hook(_on_parameter))
        _HANDLES.append(register_module_module_registration_hook(_on_module))


def _add(wrapper, module: nn.Module, prefix: str) -> None:
    ref = weakref.ref(wrapper)
    for name, m in module.named_modules(prefix=prefix, remove_duplicate=False):
        _TREE.setdefault(m, (ref, name))


def _owner(module):
    """(wrapper, qualified name) when ``module`` is in a live wrapped tree, else None."""
    entry = _TREE.get(module)
    if entry is None:
        return None
    wrapper = entry[0]()
    return None if wrapper is None else (wrapper, entry[1])


def _where(qual: str, attr: str) -> str:
    return f"{qual}.{attr}" if qual else attr


def _on_parameter(module, name, param):
    owner = _owner(module)
    if owner is None:
        return None
    wrapper, qual = owner
    if module._parameters.get(name) is param or getattr(wrapper, "_summoned", None) is not None:
        return None
    what = "None" if param is None else f"a new {type(param).__name__} of shape {tuple(param.shape)}"
    raise RuntimeError(
        f"yafsdp: {_where(qual, name)!r} set to {what} after yafsdp.YaFSDP wrapped the model: the units and their "
        "flat shards were fixed at wrapping, so the engine would keep using the old values and the new tensor would be "
        "neither sharded, reduced nor trained. Change values in place instead -- inside `with "
        "model.summon_full_params(writeback=True):` (a new parameter of the same shape is written back there) or "
        "with model.load_full_state_dict(...) -- or make the change before wrapping")


def set_to_none_message(module, name: str) -> str:
    """``module.name = None`` on a parameter of the wrapped tree (``register_parameter`` calls no hook for a
    None): refused at the unit's next use, whose weights would still be handed to the module."""
    qual = _TREE[module][1] if module in _TREE else type(module).__name__
    return (f"yafsdp: {_where(qual, name)!r} was set to None after yafsdp.YaFSDP wrapped the model: the units and "
            "their flat shards were fixed at wrapping, and the unit would keep handing the old values to the module. "
            "Make the change before wrapping")


def swapped_message(module, name: str, value) -> str:
    """A parameter of the wrapped tree replaced without a hook (``torch.func.functional_call`` and torch's
    stateless reparametrization write ``module._parameters[name]`` directly): refused at the unit's next use,
    which would hand the module the unit's own weights in place of the given tensor. ``module`` None: ``name``
    is the wrapper's (``flat.<unit>``)."""
    qual = "" if module is None else _TREE[module][1] if module in _TREE else type(module).__name__
    return (f"yafsdp: {_where(qual, name)!r} holds a {type(value).__name__} that yafsdp did not put there "
            "(torch.func.functional_call, torch.nn.utils.stateless): the engine hands each unit's gathered weights "
            "to its modules, so the tensor given in their place would be ignored and the forward would run the "
            "model's own weights. functional_call over a wrapped model is not supported: run it on an unwrapped "
            "model (model.full_state_dict() gives the weights), or change the weights inside "
            "`with model.summon_full_params(writeback=True):`")


def _params(m) -> set:
    return set() if m is None else {id(p) for p in m.parameters()}


def _on_module(module, name, submodule):
    owner = _owner(module)
    if owner is None:
        return None
    wrapper, qual = owner
    old = module._modules.get(name)
    before, after = _params(old), _params(submodule)
    if before == after:
        if submodule is not None:
            _add(wrapper, submodule, _where(qual, name))
        return None
    new = "None" if submodule is None else f"a new {type(submodule).__name__}"
    why = ("its parameters would be in no flat shard: never reduced across ranks nor trained"
           if after - before else "the parameters it held stay in their unit")
    raise RuntimeError(
        f"yafsdp: {_where(qual, name)!r} set to {new} after yafsdp.YaFSDP wrapped the model: the units and their "
        f"flat shards were fixed at wrapping, and {why}. Replace or add modules before wrapping (to change values, "
        "use `with model.summon_full_params(writeback=True):`)")
