"""Parameters that are DTensors on a tensor-parallel mesh: their local tensors become the engine's.

[Note: tensor parallel inside the data-parallel shards]
torch's tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` /
``SequenceParallel`` on ``mesh["tp"]``) leaves every parameter it touches a ``DTensor``: a local tensor
(this rank's slice of the weight, or all of it for a ``Replicate`` placement) plus the mesh, the
placements and the global shape. The engine shards over the data-parallel mesh only, so for it a
TP parameter *is* its local tensor: at wrap time (:meth:`TPLayout.localize`) every DTensor parameter is
replaced in its owners by an ``nn.Parameter`` over its local tensor, and the DTensor's layout is kept
(:class:`TPSpec`, on the parameter's ``ParamInfo.tp``). Units, flat groups, shards, gathers,
reduce-scatters, the optimizer and the grad shards then run on local tensors exactly as without TP:
each data-parallel group holds the ranks with the same TP coordinate, whose local tensors have the
same shapes.

Inside a unit's forward each gathered weight is handed to its module as
``DTensor.from_local(view, tp_mesh, placements, shape=global shape, stride=...)``
(engine/tp.py), so the module computes with what torch's TP gave it and TP's own input/output hooks and
redistributions run as written. The backward of ``from_local`` brings the weight's gradient to the
parameter's placements before it reaches the unit's gate: a ``Replicate`` parameter that
sequence-parallel norms use gets a ``Partial`` gradient from its shard of the sequence, which is
summed over the TP mesh there, as torch's TP does for a plain DTensor parameter (its ``.grad`` is
``Partial`` and every reader, the optimizer's step or ``full_tensor()``, reduces it). So the local
gradient that the engine writes and reduce-scatters over the data-parallel mesh is the one a
TP-only model's ``.grad.to_local()`` would hold after that reduction. An activation-checkpoint recompute inside a
unit's forward (HF's checkpointing) reads the weights from the gathered buffer as DTensors of the same layout
(engine/orig_params.py, ``_resolve_in_backward``).

What needs the global view is done with it: the gradient norm counts a sharded parameter's
elements over data parallel and TP, a replicated one's over data parallel only (engine/tp.py);
``full_state_dict()`` gathers each parameter over the data-parallel mesh, then over TP
(wrapper/tp_state.py), and the HF export streams the same way (integrations/hf_export.py); the HF load reads
from the files each rank's share of its TP slice (``_tp_slice`` in integrations/hf_stream.py). With HSDP
(a ("replicate", "shard", "tp") mesh) the shard and replicate groups each hold one TP coordinate; the replicas' all-reduce of the grad shards runs on local tensors as without TP. What is not done yet is refused by name (:func:`refuse_options` and the
wrapper's methods).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .units import WrapError, _already_wrapped

__all__ = ["TPSpec", "TPLayout", "find", "has_dtensor_params", "refuse_options", "TP_REFUSED"]


@dataclass(frozen=True)
class TPSpec:
    """The DTensor layout of one TP parameter (what ``DTensor.from_local`` needs to rebuild it)."""

    mesh: object  # the 1-D DeviceMesh of tensor parallelism (every TP parameter's the same)
    placements: tuple  # Shard(d) or Replicate()
    shape: torch.Size  # the global shape
    stride: tuple  # the global stride

    @property
    def sharded(self) -> bool:
        """True when the local tensors of the TP ranks are different slices (their elements add up
        over TP); False for ``Replicate``: every TP rank holds the same values."""
        return any(p.is_shard() for p in self.placements)


@dataclass
class TPLayout:
    """What :func:`find` found: the TP mesh, its group, and (after :meth:`localize`) each local parameter's
    layout."""

    mesh: object  # the 1-D TP DeviceMesh
    group: object  # its process group
    size: int  # TP degree
    rank: int  # this rank's TP coordinate
    found: list  # (owner module, attribute, DTensor parameter) of every owner of a DTensor parameter
    by_param: dict = field(default_factory=dict)  # id(local nn.Parameter) -> TPSpec, filled by localize()

    def localize(self) -> None:
        """Replace every DTensor parameter by an ``nn.Parameter`` over its local tensor in every owner (tied
        names keep sharing one). See [Note: tensor parallel inside the data-parallel shards]."""
        local_of: dict[int, nn.Parameter] = {}
        for m, attr, p in self.found:
            local = local_of.get(id(p))
            if local is None:
                local = local_of[id(p)] = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
                self.by_param[id(local)] = TPSpec(self.mesh, tuple(p.placements), p.shape, tuple(p.stride()))
            m._parameters[attr] = local

    def restore(self) -> None:
        """Undo :meth:`localize` (the wrap failed after it): the owners hold their DTensors again."""
        for m, attr, p in self.found:
            m._parameters[attr] = p
        self.by_param.clear()

    def tag(self, infos) -> None:
        """``info.tp`` of every ParamInfo whose parameter was a DTensor (before ``info.param`` goes); the
        DTensors are dropped (they would keep every local tensor alive next to the shards)."""
        for info in infos:
            info.tp = self.by_param.get(id(info.param))
        self.found = []


# The engine options and features that do not run with TP parameters yet: refused at wrap time.
TP_REFUSED = {  # option: (what it is, its value when off)
    "quantize_frozen": ("the NF4 frozen base", None),
    "offload": ("optimizer offload", None),
    "gather_dtype": ("compact fp8/int8 gathers", None),
    "secondary_shard": ("the secondary shard of the backward gathers", 0),
    "grad_quant": ("quantized gradient reduction", None),
}


def refuse_options(cfg) -> None:
    """The options that do not run with TP yet, refused naming both (``cfg``: the EngineConfig)."""
    for name, (what, off) in TP_REFUSED.items():
        value = getattr(cfg, name)
        if value != off and not (name == "secondary_shard" and value == 1):
            raise WrapError(
                f"yafsdp.YaFSDP: {name}={value!r} ({what}) together with tensor-parallel (DTensor) parameters is "
                f"not supported yet; drop {name}, or wrap a model without tensor parallelism")


def has_dtensor_params(module: nn.Module) -> bool:
    """``module`` holds a DTensor parameter (no DTensor exists before torch.distributed.tensor is imported)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and any(isinstance(p, mod.DTensor) for p in module.parameters())


def find(module: nn.Module, group, replicate_group=None) -> TPLayout | None:
    """The DTensor parameters of ``module`` and their TP mesh, checked (nothing is changed yet); None when
    there is none. ``group`` (the engine's shard group) and ``replicate_group`` (HSDP's, or None) must each be
    orthogonal to the TP mesh (holding this rank and no other rank of it)."""
    from torch.distributed.tensor import DTensor

    if _already_wrapped(module):  # FSDP2's parameters are DTensors too: discover() refuses it, naming the wrapper
        return None
    found, named = [], {}  # named: id(DTensor) -> (its first name, the DTensor)
    for mname, m in module.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if isinstance(p, DTensor):
                found.append((m, attr, p))
                named.setdefault(id(p), (f"{mname}.{attr}" if mname else attr, p))
        for bname, b in m._buffers.items():
            if isinstance(b, DTensor):
                raise WrapError(
                    f"yafsdp.YaFSDP: buffer {(mname + '.' if mname else '') + bname!r} is a DTensor; tensor-parallel "
                    "buffers are not supported (the engine broadcasts buffers as plain tensors); keep buffers plain")
    if not found:
        return None
    mesh = None
    for name, p in named.values():
        if p.device_mesh.ndim != 1:
            raise WrapError(
                f"yafsdp.YaFSDP: parameter {name!r} is a DTensor on a {p.device_mesh.ndim}-D mesh (dims "
                f"{p.device_mesh.mesh_dim_names}); apply tensor parallelism on the 1-D TP mesh (mesh['tp']) and pass "
                "the data-parallel mesh to yafsdp.YaFSDP(mesh=mesh['dp'])")
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            raise WrapError(
                f"yafsdp.YaFSDP: parameter {name!r} is a DTensor on mesh {p.device_mesh}, another parameter on "
                f"{mesh}; every tensor-parallel parameter must be on the same TP mesh")
        bad = [pl for pl in p.placements if not (pl.is_replicate() or type(pl).__name__ == "Shard")]
        if bad:
            raise WrapError(
                f"yafsdp.YaFSDP: parameter {name!r} has placement {bad[0]}; tensor-parallel parameters must be "
                "Shard(dim) or Replicate() on the TP mesh (what ColwiseParallel, RowwiseParallel and SequenceParallel "
                "make)")
    tp_group = mesh.get_group()
    theirs = set(dist.get_process_group_ranks(tp_group))
    for what, g in (("data-parallel group", group), ("replicate group", replicate_group)):
        if g is None:
            continue
        mine = set(dist.get_process_group_ranks(g))
        both = mine & theirs
        if both != {dist.get_rank()}:
            raise WrapError(
                f"yafsdp.YaFSDP: the {what} (ranks {sorted(mine)}) and the TP mesh of the DTensor parameters (ranks "
                f"{sorted(theirs)}) share ranks {sorted(both)}; the engine must run over the data-parallel dims only: "
                "build init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), apply TP on mesh['tp'] and "
                "pass yafsdp.YaFSDP(model, mesh=mesh['dp']) (HSDP: a ('replicate', 'shard', 'tp') mesh and "
                "mesh=mesh['replicate', 'shard'])")
    return TPLayout(mesh, tp_group, dist.get_world_size(tp_group), dist.get_rank(tp_group), found)
