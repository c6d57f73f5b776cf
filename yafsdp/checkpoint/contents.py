"""What a checkpoint holds: the DCP entries of a model, its optimizer and its buffers, the
engine settings recorded in the manifest, and the staging copy of an asynchronous save.

See [Note: what a checkpoint holds] in ``yafsdp/checkpoint/__init__.py``.
"""
from __future__ import annotations

from typing import Any

import torch

from .. import formats
from ..layout.pieces import tp_specs
from .dcp_glue import Chunks, FlatShard
from .files import CheckpointError
from .safe import encode

__all__ = ["collect", "stage", "settings", "check_settings", "buffer_entries", "load_buffers", "check_buffers"]


def _units(model) -> list[dict]:
    """The manifest's units: each flat group's key, unpadded length and parameters (name, shape). With tensor
    parallelism the shapes are the global ones and the length is theirs (the unit as an engine without TP lays
    it out), so that a model is compared to a checkpoint whatever TP degree either has."""
    specs = tp_specs(model)
    if specs:
        out = []
        for i in model.shard_info():
            shapes = [tuple(specs[n].shape) if n in specs else tuple(sh) for n, sh in zip(i.param_names, i.param_shapes)]
            out.append(dict(name=i.key, numel=sum(torch.Size(sh).numel() for sh in shapes),
                            params=[[n, list(sh)] for n, sh in zip(i.param_names, shapes)]))
        return out
    return [
        dict(name=i.key, numel=i.numel, params=[[n, list(sh)] for n, sh in zip(i.param_names, i.param_shapes)])
        for i in model.shard_info()
    ]


def _flat_shard(info, tensor: torch.Tensor) -> FlatShard:
    """The part of this rank's shard (``info``: a yafsdp.shards.ShardInfo) below the unpadded length."""
    valid = max(0, min(info.shard_numel, info.numel - info.shard_start))
    return FlatShard(tensor[:valid], min(info.shard_start, info.numel), info.numel)


def _model_entries(model) -> dict[str, FlatShard]:
    """The DCP entries of the model's shards: ``model.<key>`` per flat group; an NF4 group (see
    [Note: NF4 frozen groups] in yafsdp/formats/nf4_codec.py) as its packed codes ``model.<unit>.nf4`` (uint8,
    numel/2 bytes) and its scales ``model.<unit>.nf4.scales`` (numel/64), both laid out the same
    for every world size (blocks start at the group's start), so they reshard like the others."""
    out = {}
    for i in model.shard_info():
        if i.format is None:
            out[f"model.{i.key}"] = _flat_shard(i, i.param.detach())
            continue
        # a stored record: the entries its format says (See [Note: gather formats] in formats/base.py)
        for suffix, (local, start, numel) in formats.get(i.format).checkpoint_entries(i, i.param.detach()).items():
            out[f"model.{i.key}{suffix}"] = FlatShard(local, start, numel)
    return out


def _zero_padding(model, entries: dict) -> None:
    """After a load: the padding past the loaded part is zero (NF4: a block of zeros, which
    expands to zeros), whatever was there; bumps each shard's version."""
    with torch.no_grad():
        for i in model.shard_info():
            if i.format is None:
                i.param.detach()[entries[f"model.{i.key}"].local.numel():].zero_()
                continue
            fmt = formats.get(i.format)
            loaded = {suffix: entries[f"model.{i.key}{suffix}"].local.numel()
                      for suffix in fmt.checkpoint_entries(i, i.param.detach())}
            fmt.checkpoint_loaded_(i, i.param.detach(), loaded)


def _optimizer_params(model, optimizer) -> list[tuple[Any, Any]]:
    """(shard info, param) for every parameter of ``optimizer``, in its state_dict index order."""
    by_id = {id(i.param): i for i in model.shard_info()}
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            info = by_id.get(id(p))
            if info is None:
                raise CheckpointError(
                    f"optimizer param group {gi} holds a parameter of shape {tuple(p.shape)} that is not one "
                    "of the wrapped model's flat shards; build the optimizer from model.parameters() or "
                    "model.param_groups()"
                )
            out.append((info, p))
    return out


def _optimizer_entries(model, optimizer) -> tuple[dict, dict]:
    """DCP entries and the manifest's description of the optimizer state."""
    entries: dict[str, Any] = {}
    layout: dict[str, dict] = {}
    for info, p in _optimizer_params(model, optimizer):
        st = optimizer.state.get(p, {})
        desc = {}
        for key, v in st.items():
            name = f"optim.{info.key}.{key}"
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape == p.shape:
                entries[name] = _flat_shard(info, v.detach())
                desc[key] = dict(kind="shard", dtype=str(v.dtype).replace("torch.", ""))
            elif isinstance(v, torch.Tensor):
                entries[name] = v.detach()
                desc[key] = dict(kind="tensor", dtype=str(v.dtype).replace("torch.", ""), shape=list(v.shape))
            else:
                entries[name] = v
                desc[key] = dict(kind="object")
        layout[info.key] = desc
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
    entries["optim.param_groups"] = groups
    return entries, dict(cls=type(optimizer).__name__, state=layout, groups=[len(g["params"]) for g in optimizer.param_groups])


# ------------------------------------------------------------------------------------- buffers
# [Note: module buffers in checkpoints]
# A module's persistent buffers (BatchNorm's running statistics and num_batches_tracked, any
# register_buffer(..., persistent=True)) are state like the weights: the engine keeps them whole
# and identical on every rank (materialize broadcasts them, the forward updates each rank's copy
# alike). They are saved as plain tensors ``buffer.<state_dict key>``: every rank offers them and
# DCP's plan de-duplicates replicated tensors, so one copy is written; on load every rank reads
# that copy, whatever the world size. The manifest lists them (name, shape, dtype), so a model
# whose buffers differ is refused by name, and a checkpoint written before buffers were saved is
# refused when the model has some (loading it would silently keep the model's current values).
def _buffers(model) -> list[tuple[str, Any, str]]:
    """(state_dict key, owning module, attribute) of every persistent buffer."""
    return [(key, *ref) for key, kind, ref in model._keys.entries if kind == "buffer"]


def describe_buffers(model) -> list[dict]:
    return [dict(name=key, shape=list(m._buffers[b].shape), dtype=str(m._buffers[b].dtype).replace("torch.", ""))
            for key, m, b in _buffers(model)]


def buffer_entries(model) -> dict[str, torch.Tensor]:
    """Rank 0's copies only: one copy is written, and it is rank 0's whatever DCP's de-duplication
    would pick (a rank whose forward updated its copy differently -- BatchNorm on per-rank data
    without SyncBatchNorm -- does not make the checkpoint depend on plan sizes)."""
    if model.rank != 0:
        return {}
    return {f"buffer.{key}": m._buffers[b].detach() for key, m, b in _buffers(model)}


def check_buffers(manifest: dict, model, path: str, strict: bool) -> None:
    here = {d["name"]: d for d in describe_buffers(model)}
    if "buffers" not in manifest:
        if here and strict:
            raise CheckpointError(
                f"checkpoint {path!r} was written before checkpoints held module buffers, and this model has "
                f"{len(here)} persistent buffer(s) ({', '.join(list(here)[:3])}): loading it would keep their "
                "current values. Pass strict_buffers=False to load the weights anyway (the buffers keep their "
                "values), or load the buffers from elsewhere")
        return
    saved = {d["name"]: d for d in manifest["buffers"]}
    diffs = [f"buffer {n!r} is in the model but not in the checkpoint" for n in here if n not in saved][:3]
    diffs += [f"buffer {n!r} is in the checkpoint but not in the model" for n in saved if n not in here][:3]
    diffs += [f"buffer {n!r}: checkpoint {tuple(saved[n]['shape'])} {saved[n]['dtype']} vs model "
              f"{tuple(d['shape'])} {d['dtype']}" for n, d in here.items()
              if n in saved and (saved[n]["shape"], saved[n]["dtype"]) != (d["shape"], d["dtype"])][:3]
    if diffs:
        raise CheckpointError(f"checkpoint {path!r} was written for a different model: " + "; ".join(diffs))


def load_targets(manifest: dict) -> dict[str, torch.Tensor]:
    """Host tensors DCP reads the buffers into (see :func:`load_buffers`)."""
    return {f"buffer.{d['name']}": torch.empty(d["shape"], dtype=getattr(torch, d["dtype"]))
            for d in manifest.get("buffers", [])}


@torch.no_grad()
def load_buffers(model, entries: dict) -> None:
    for key, m, b in _buffers(model):
        value = entries.get(f"buffer.{key}")
        if value is None:
            continue
        buf = m._buffers[b]
        if buf.is_meta:  # built on the meta device: the buffer gets its storage now
            buf = torch.empty_like(buf, device=model.device)
        buf.copy_(value)
        m._buffers[b] = buf


# ------------------------------------------------------------------------------------ settings
# [Note: engine settings in the manifest]
# The manifest records the engine's settings. Only one of them changes what is stored:
# quantize_frozen ("nf4" saves the frozen weights as NF4 codes and scales, ``<unit>.nf4``; None
# saves them in fp32) -- the two cannot be converted into each other on load. The others are
# converted as a matter of course: world size and mesh (resharding), zero_stage, offload (where the
# shards live), gather_dtype (only how the weights travel), param_dtype (the compute copy is made
# from the fp32 master at the next step).
STORED = ("quantize_frozen",)


def settings(model, world_record: int) -> dict:
    return dict(world_size=world_record, mesh=list(getattr(model, "mesh_shape", (1, world_record))),
                quantize_frozen=model.quantize_frozen, gather_dtype=model.gather_dtype,
                zero_stage=model.zero_stage, offload=model.offload,
                param_dtype=str(model.param_dtype).replace("torch.", "") if model.param_dtype is not None else None)


def check_settings(manifest: dict, model, path: str) -> None:
    """CheckpointError naming a setting that changes what is stored and differs from ``model``'s."""
    saved = manifest.get("settings")
    if saved is None:  # written before settings were recorded: the unit names tell NF4 groups
        saved = {"quantize_frozen": "nf4" if any(u["name"].endswith(".nf4") for u in manifest.get("units", []))
                 else None}
    for key in STORED:
        theirs, ours = saved.get(key), getattr(model, key)
        if key == "quantize_frozen" and theirs != ours:
            unit = next((u["name"] for u in manifest.get("units", []) if u["name"].endswith(".nf4")), None)
            what = (f"its frozen weights are stored as NF4 codes (unit {unit!r})" if theirs
                    else "its frozen weights are stored in fp32")
            raise CheckpointError(
                f"checkpoint {path!r} was saved with quantize_frozen={theirs!r} and this model has "
                f"quantize_frozen={ours!r}: {what}, and a checkpoint is not converted between the two on load. "
                f"Build the model with quantize_frozen={theirs!r} to resume it"
                + ("" if theirs else "; to quantize, load it without quantize_frozen and export the weights "
                   "(yafsdp.hf.export_hf), then build the quantized model from that export"))


# ------------------------------------------------------------------------- one save's entries
def collect(model, optimizer, state, rank_states: dict) -> tuple[dict, dict | None]:
    """(DCP entries, the manifest's optimizer description) of one save: views of the live state."""
    entries: dict[str, Any] = dict(_model_entries(model))
    opt_desc = None
    if optimizer is not None:
        opt_entries, opt_desc = _optimizer_entries(model, optimizer)
        for k, v in opt_entries.items():  # non-tensor state and the param groups: see safe.encode
            entries[k] = v if isinstance(v, (FlatShard, torch.Tensor)) else encode(v, k)
    entries.update(buffer_entries(model))
    entries["state"] = encode(dict(state or {}), "state")
    for key, st in rank_states.items():
        entries[f"rank_state.{key}"] = encode(st, f"rank_state (rank {key})")
    return entries, opt_desc


def needed_bytes(model, entries: dict) -> int:
    """About how many bytes a save of ``entries`` writes, over all ranks: the global tensors'
    bytes (the unpadded flat units, optimizer state like them; plain tensors once) plus 1 KiB per
    tensor. A lower bound (torch.save's zip container adds about 2 KiB per item and rank, and
    ``.metadata`` and the manifest come on top), so that a save refused for want of space would
    surely have failed."""
    total = 0
    for v in entries.values():
        if isinstance(v, FlatShard):
            total += v.numel * v.local.element_size() + 1024
        elif isinstance(v, Chunks):  # every rank lists every tensor (see by_param.py), pieces or not
            total += torch.Size(v.size).numel() * v.dtype.itemsize + 1024
        elif isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size() + 1024
    return total


def stage(entries: dict, into: dict | None) -> tuple[dict, int]:
    """The staging copy of an asynchronous save: every tensor of ``entries`` copied into host
    buffers (``into``: those of the previous save, reused when the shapes match), the other values
    deep-copied. Returns (staged entries, bytes of the host buffers)."""
    into = into if into is not None else {}
    out: dict[str, Any] = {}
    nbytes = 0

    def host(name, t):
        nonlocal nbytes
        buf = into.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = into[name] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        buf.copy_(t.detach())
        nbytes += buf.numel() * buf.element_size()
        return buf

    def copy(name, v):
        if isinstance(v, torch.Tensor):
            return host(name, v)
        if isinstance(v, dict):
            return {k: copy(f"{name}.{k}", x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            items = [copy(f"{name}.{i}", x) for i, x in enumerate(v)]
            return items if isinstance(v, list) else tuple(items)
        return v  # numbers, strings, None: immutable

    for name, v in entries.items():
        if isinstance(v, FlatShard):
            out[name] = FlatShard(host(name, v.local), v.offset, v.numel)
        elif isinstance(v, Chunks):
            out[name] = Chunks([(o, host(f"{name}@{tuple(o)}", t)) for o, t in v.pieces], v.size, v.dtype)
        else:
            out[name] = copy(name, v)
    return out, nbytes
