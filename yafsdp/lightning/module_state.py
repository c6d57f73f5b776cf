"""``state_dict()`` / ``load_state_dict()`` of the module set up by ``Fabric(strategy="yafsdp")``:
collective, with DDP's results. Why and how: [Note: the set-up module's state_dict] below."""
from __future__ import annotations

from collections import OrderedDict
from types import MethodType

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from ..wrapper.api import YaFSDP

# [Note: the set-up module's state_dict]
# Fabric's set-up module answers ``state_dict()`` and ``load_state_dict()`` with the module that was
# given to ``fabric.setup`` (its ``_original_module``): here the module YaFSDP wraps, whose parameters
# hold no values between their units' uses, so the engine refuses both there. Scripts written for DDP
# call them all the same: litgpt's ``load_checkpoint`` loads a base model with
# ``model.load_state_dict(sd, strict=...)`` under every strategy but its FSDPStrategy, and its LoRA
# script saves the adapter from ``model.state_dict()`` (every rank iterating the same keys). Under
# ``strategy="yafsdp"`` the wrapped module's two methods are replaced (on that instance only, when
# ``setup_module`` wraps it) by collective ones with DDP's results:
#
# - ``load_state_dict(sd, strict=True)``: rank 0's ``sd`` goes to every rank's shards
#   (``load_full_state_dict``; under DDP each rank loads its own copy, the same file). ``strict=False``
#   loads the keys the dict has and returns ``(missing_keys, unexpected_keys)`` as ``nn.Module`` does:
#   the current values are gathered, the given ones replace them (a tied parameter takes the value of
#   whichever of its names the dict holds), and the whole is scattered back. A shape that differs is
#   refused, strict or not, as ``nn.Module`` refuses it. ``assign=True`` is refused.
# - ``state_dict()``: the unsharded state dict on every rank, on the CPU (gathered to rank 0, then
#   broadcast key by key): what DDP gives, and as costly, since every rank then holds the whole model.
#   Checkpoints go through ``fabric.save`` (sharded or rank 0 only); ``keep_vars=True`` is refused (no
#   parameter object holds values).
#
# Both must be called on every rank. Nothing else of the module changes; a YaFSDP given to
# ``setup_module`` already wrapped keeps its own refusals (``full_state_dict()`` is its API).


def route_module_state(engine: YaFSDP, device: torch.device) -> None:
    """Give ``engine.module`` (Fabric's original module) the collective methods of the Note above."""
    module = engine.module
    module.state_dict = MethodType(_bound_state_dict(engine, device), module)
    module.load_state_dict = MethodType(_bound_load_state_dict(engine), module)


def _coordinator(engine: YaFSDP) -> int:
    """Global rank of the one rank that receives ``full_state_dict()``."""
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(engine.coordinator))
    return flags.index(True)


def _bound_state_dict(engine: YaFSDP, device: torch.device):
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        if args:
            raise TypeError("yafsdp.lightning: state_dict() of the set-up module takes keyword arguments only "
                            "(destination=, prefix=, keep_vars=)")
        if keep_vars:
            raise ValueError(
                f"yafsdp.lightning: state_dict(keep_vars=True) of {type(self).__name__} under strategy=\"yafsdp\": "
                "its parameters hold no values between their units' uses (each rank keeps a slice of the flat "
                "shards); call state_dict() for the unsharded values, or use fabric.save for a checkpoint")
        src = _coordinator(engine)
        me = dist.get_rank()
        full = engine.full_state_dict()  # collective: the coordinator gets the dict, the others {}
        header = [[(k, tuple(v.shape), v.dtype) for k, v in full.items()] if me == src else None]
        dist.broadcast_object_list(header, src=src)
        on_device = dist.get_backend() != "gloo"  # nccl broadcasts device tensors
        out = OrderedDict() if destination is None else destination
        for key, shape, dtype in header[0]:
            t = full[key] if me == src else torch.empty(shape, dtype=dtype)
            if on_device:
                t = t.to(device)
            dist.broadcast(t, src=src)
            out[prefix + key] = t.cpu()
        return out

    return state_dict


def _tied_names(module: nn.Module) -> dict[str, list[str]]:
    """Parameter name -> every name of the same parameter (tied weights share one)."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def _bound_load_state_dict(engine: YaFSDP):
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise ValueError(
                f"yafsdp.lightning: load_state_dict(assign=True) of {type(self).__name__} under strategy=\"yafsdp\": "
                "the engine copies the values into its flat shards; load without assign=")
        src = _coordinator(engine)
        me = dist.get_rank()
        if strict:
            engine.load_full_state_dict(dict(state_dict) if me == src else None)
            return _IncompatibleKeys([], [])
        current = engine.full_state_dict()  # collective
        keys = [None]
        merged = None
        if me == src:
            given = dict(state_dict)
            tied = _tied_names(self)
            merged = dict(current)
            for key, value in given.items():
                for name in tied.get(key, [key]):
                    if name in merged:
                        merged[name] = value
            covered = {name for key in given for name in tied.get(key, [key])}
            keys = [([k for k in current if k not in covered], [k for k in given if k not in current])]
        engine.load_full_state_dict(merged)
        dist.broadcast_object_list(keys, src=src)
        return _IncompatibleKeys(*keys[0])

    return load_state_dict
