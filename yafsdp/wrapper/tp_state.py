"""A tensor-parallel engine's full state dict, and the methods it does not offer yet.

See [Note: tensor parallel inside the data-parallel shards] in layout/dtensor.py. ``full_state_dict()``
gathers each unit over the data-parallel mesh as without TP, on the ranks of data-parallel index 0 (one
per TP coordinate, together a TP group); each TP parameter's local tensor is then gathered over TP
(``DTensor.full_tensor()`` of its layout) and global rank 0 returns the full tensors under the original
keys.
"""
from __future__ import annotations

import torch

from ..layout.units import WrapError

__all__ = ["full_over_tp", "check_method", "check_module", "TP_METHODS"]

# YaFSDP methods (the names they pass to ``check_idle``) that run on a TP engine.
TP_METHODS = frozenset({"full_state_dict"})


def check_method(tp, what: str) -> None:
    """Refuse ``what`` (a method's name) on an engine with TP parameters unless it is in :data:`TP_METHODS`:
    the per-rank views, loads, checkpoints and exports would see or write local TP slices as full tensors."""
    if tp is None or what in TP_METHODS:
        return
    raise RuntimeError(
        f"yafsdp.YaFSDP.{what}: not supported yet on a model with tensor-parallel (DTensor) parameters: it would "
        "read or write each rank's TP slice as if it were the full tensor. model.full_state_dict() (collective) "
        "gathers full tensors over data parallel and TP; load full weights into the model before applying tensor "
        "parallelism and wrapping")


def check_module(module) -> None:
    """At wrap time, before any change to the module: what a TP engine refuses about the module itself."""
    if _checkpointing(module):
        raise WrapError(
            "yafsdp.YaFSDP: HF gradient checkpointing (activation checkpointing) together with tensor-parallel "
            "(DTensor) parameters is not supported yet; call model.gradient_checkpointing_disable() before wrapping, "
            "or wrap a model without tensor parallelism")
    hooked = [name or "<root>" for name, m in module.named_modules()
              if m._state_dict_hooks or m._load_state_dict_pre_hooks]
    if hooked:
        raise WrapError(
            f"yafsdp.YaFSDP: module {hooked[0]!r} has state_dict hooks; together with tensor-parallel (DTensor) "
            "parameters they are not supported yet (the TP gather of the full state dict maps keys to parameters); "
            "remove the hooks, or wrap a model without tensor parallelism")


def _checkpointing(module) -> bool:
    """HF activation checkpointing is on (its newer name first: the older one warns that it is deprecated)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(module), name):
            return bool(getattr(module, name))
    return False


@torch.no_grad()
def full_over_tp(tp, keys, local: dict) -> dict:
    """Collective over the TP group of the data-parallel index 0 ranks (those holding ``local``, this rank's
    data-parallel-gathered state dict with local TP slices): TP rank 0 gets the full tensors under the same
    keys, the others {}. Tied keys keep sharing one tensor."""
    from torch.distributed.tensor import DTensor

    spec_of = {key: ref.tp for key, kind, ref in keys.entries if kind == "param"}
    out, done = {}, {}
    for key, value in local.items():
        spec = spec_of.get(key)
        if spec is None:
            out[key] = value
            continue
        if id(value) not in done:  # tied keys: one tensor, gathered once
            d = DTensor.from_local(value.to(_device_of(spec.mesh)), spec.mesh, spec.placements, run_check=False,
                                   shape=spec.shape, stride=spec.stride)
            done[id(value)] = d.full_tensor().to("cpu", value.dtype)
        out[key] = done[id(value)]
    return out if tp.rank == 0 else {}


def _device_of(mesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())
