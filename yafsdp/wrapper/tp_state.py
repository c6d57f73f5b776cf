"""A tensor-parallel engine's full state dict, and the methods it does not offer yet.

See [Note: tensor parallel inside the data-parallel shards] in layout/dtensor.py. ``full_state_dict()``
gathers each unit over the data-parallel mesh as without TP, on the ranks of data-parallel index 0 (one
per TP coordinate, together a TP group); each TP parameter's local tensor is then gathered over TP
(``DTensor.full_tensor()`` of its layout) and global rank 0 returns the full tensors under the original
keys (``iter_full_state_dict()``: the same, one unit at a time). ``load_full_state_dict()`` is the inverse: global rank 0's full dict is checked against the global
shapes, then split over TP among the data-parallel index 0 ranks (``distribute_tensor`` with each
parameter's placements; plain parameters and buffers broadcast), and each of them loads its local dict
into its data-parallel group as without TP.
"""
from __future__ import annotations

import torch

import torch.distributed as dist

from ..comm.groups import raise_together
from ..layout.units import WrapError

__all__ = ["full_over_tp", "split_over_tp", "check_method", "check_module", "TP_METHODS"]

# YaFSDP methods (the names they pass to ``check_idle``) that run on a TP engine.
TP_METHODS = frozenset({"full_state_dict", "iter_full_state_dict", "load_full_state_dict", "export_hf",
                        "load_hf_weights", "full_parameter", "full_grad", "named_grad_norms", "full_optim_state_dict",
                        "load_full_optim_state_dict", "summon_full_params",
                        "save_checkpoint", "load_checkpoint", "AsyncSaver.save"})  # checkpoint/by_param.py


def check_method(tp, what: str) -> None:
    """Refuse ``what`` (a method's name) on an engine with TP parameters unless it is in :data:`TP_METHODS`:
    the per-rank views, loads, checkpoints and exports would see or write local TP slices as full tensors."""
    if tp is None or what in TP_METHODS:
        return
    raise RuntimeError(
        f"yafsdp.YaFSDP.{what}: not supported yet on a model with tensor-parallel (DTensor) parameters: it would "
        "read or write each rank's TP slice as if it were the full tensor. model.full_state_dict(), "
        "model.load_full_state_dict(sd), model.full_parameter(name), model.full_grad(name), "
        "model.full_optim_state_dict(opt), model.load_full_optim_state_dict(opt, sd), model.summon_full_params(), "
        "yafsdp.hf.export_hf and yafsdp.hf.load_hf_weights (collective) move full tensors over data parallel and TP")


def check_module(module) -> None:
    """At wrap time, before any change to the module: what a TP engine refuses about the module itself."""
    from ..integrations.tp_plans import untied_by_tp

    untied = untied_by_tp(module)
    if untied is not None:  # [Note: tied embeddings under TP] in integrations/tp_plans.py
        raise WrapError(
            f"yafsdp.YaFSDP: the model's config ties {untied[0]!r} to {untied[1]!r} (tie_word_embeddings), but they "
            "are two parameters: torch's parallelize_module gives each module its own DTensor, so they would train "
            f"apart; tie them again after parallelizing (model.{untied[0]} = model.{untied[1]}; both Shard(0) under "
            "llama_tp_plan), or apply the plan with yafsdp.integrations.tp_plans.parallelize_llama, which does")
    hooked = [name or "<root>" for name, m in module.named_modules()
              if m._state_dict_hooks or m._load_state_dict_pre_hooks]
    if hooked:
        raise WrapError(
            f"yafsdp.YaFSDP: module {hooked[0]!r} has state_dict hooks; together with tensor-parallel (DTensor) "
            "parameters they are not supported yet (the TP gather of the full state dict maps keys to parameters); "
            "remove the hooks, or wrap a model without tensor parallelism")


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


def _problem(keys, sd) -> str | None:
    """What is wrong with global rank 0's full dict ``sd`` (None: nothing): a TP parameter's shape against its
    global shape here, everything else by ``StateDictKeys.validate`` (given the local shape in its place)."""
    if not isinstance(sd, dict):
        return keys.validate(sd)
    view, bad = dict(sd), []
    for key, kind, ref in keys.entries:
        if kind == "param" and ref.tp is not None and key in sd:
            got = tuple(sd[key].shape) if hasattr(sd[key], "shape") else None
            if got != tuple(ref.tp.shape):
                bad.append(f"{key!r} has shape {got}, expected {tuple(ref.tp.shape)}")
            view[key] = torch.empty(ref.shape, device="meta")  # validate() compares the local shape
    return "; ".join(bad) if bad else keys.validate(view)


@torch.no_grad()
def split_over_tp(tp, keys, state_dict, holder: bool) -> dict | None:
    """Collective over every rank: global rank 0's full ``state_dict`` checked (a problem raised on every
    rank, nothing modified), then each ``holder`` (the data-parallel index 0 ranks, HSDP: of replica 0; one per
    TP coordinate) gets its local dict (every key, its TP slice); the other ranks get None (they receive their
    shards from it in ``load_full``)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    problem = _problem(keys, state_dict) if dist.get_rank() == 0 else None
    raise_together(problem, None, ValueError, "yafsdp.YaFSDP.load_full_state_dict: ")
    if not holder:
        return None
    first = dist.get_rank() == 0 and tp.rank == 0
    device = _device_of(tp.mesh)
    present: dict[int, str] = {}  # id(ref) -> the key rank 0's dict holds it under (tied keys: one of them)
    if first:
        for key, kind, ref in keys.entries:
            if key in state_dict:
                present.setdefault(id(ref) if kind == "param" else key, key)
    out, done = {}, {}
    for key, kind, ref in keys.entries:
        ident = id(ref) if kind == "param" else key
        if ident not in done:
            if kind == "param":
                shape, dtype = (ref.tp.shape if ref.tp is not None else ref.shape), torch.float32
                placements = ref.tp.placements if ref.tp is not None else (Replicate(),)
            else:
                buf = ref[0]._buffers[ref[1]]
                shape, dtype, placements = buf.shape, buf.dtype, (Replicate(),)
            full = (state_dict[present[ident]].to(device, dtype) if first
                    else torch.empty(shape, dtype=dtype, device=device))
            done[ident] = distribute_tensor(full, tp.mesh, placements, src_data_rank=0).to_local()
        out[key] = done[ident]
    return out
