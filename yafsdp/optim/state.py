"""Optimizer state over flat shards: which rank's it is, and the full (unsharded) form.

[Note: optimizer state that knows its shard]
An optimizer over ``model.parameters()`` holds, per flat shard, state for this rank's slice only
(AdamW's ``exp_avg`` / ``exp_avg_sq``). The DDP habit "rank 0 saves ``opt.state_dict()``, every
rank loads it" would give every rank rank 0's moments: wrong, and without an error. So the state
carries its shard's identity:

- the first ``opt.step()`` over yafsdp shards (the process-wide step pre-hook of optim/hooks.py)
  installs on that optimizer a ``state_dict`` post-hook that adds to each shard's entry
  ``"yafsdp_shard": {rank, world, numel, padded, unit}`` (integers: torch's loader copies them
  as they are) and a ``load_state_dict`` pre-hook that compares it with the shard it is loaded
  into, refuses a mismatch naming both ranks and worlds, and strips it;
- an optimizer that never stepped has no hooks yet, so a tagged state it loads keeps its tags
  in ``opt.state``; the step pre-hook checks and strips them before that step reads anything.

The supported ways across ranks and world sizes: every rank saves and loads its own
``opt.state_dict()`` (same world, same layout), ``yafsdp.checkpoint`` (sharded, reshardable), or
the full optimizer state dict below (rank 0 saves one file; any world size loads it), laid out
as DCP's ``get_optimizer_state_dict(..., full_state_dict=True)``: ``state`` keyed by original
parameter name, each per-element tensor in that parameter's shape, scalars (``step``) as they
are; ``param_groups`` with the hyperparameters and ``params`` as names. With tensor parallel the state of a
TP parameter is gathered over the shard group, then over TP (global rank 0 returns the global shapes), and a
load splits global rank 0's tensors over TP among the data-parallel index 0 ranks before each scatters its slices
over its shard group, as ``full_state_dict`` / ``load_full_state_dict`` move the weights (wrapper/tp_state.py).
"""
from __future__ import annotations

import math
import weakref
import zlib

import torch

from ..comm import collectives
from ..engine import shards
from ..comm.groups import broadcast_object, source_rank

__all__ = ["TAG", "before_step", "full_optim_state_dict", "load_full_optim_state_dict"]

TAG = "yafsdp_shard"
_HOOKED: "weakref.WeakSet" = weakref.WeakSet()  # optimizers with the state-dict hooks


def _tag(info: shards.ShardInfo) -> dict:
    return dict(rank=info.shard_start // info.shard_numel, world=info.padded_numel // info.shard_numel,
                numel=info.numel, padded=info.padded_numel, unit=zlib.crc32(info.key.encode()))


def _check(tag, info: shards.ShardInfo) -> None:
    mine = _tag(info)
    if not isinstance(tag, dict) or tag == mine:
        return
    if (tag.get("unit"), tag.get("numel")) != (mine["unit"], mine["numel"]):
        where = f"another unit or layout (saved numel={tag.get('numel')}, this shard's numel={mine['numel']})"
    else:
        where = (f"rank {tag.get('rank')} of a {tag.get('world')}-rank shard group and is loaded on rank "
                 f"{mine['rank']} of {mine['world']}")
    raise RuntimeError(
        f"yafsdp: the optimizer state of shard {info.name!r} (unit {info.unit!r}) was saved for {where}: each "
        "rank's optimizer holds the state of its own slice only, so this would train with another rank's moments. "
        "Save opt.state_dict() on every rank and load each rank's own file (same world size), or use "
        "model.full_optim_state_dict(opt) / model.load_full_optim_state_dict(opt, sd) (any world size), or "
        "yafsdp.checkpoint.save_checkpoint / load_checkpoint")


def _pairs(optimizer, sd):
    """(shard info or None, index in ``sd["state"]``) per parameter, in the optimizer's order."""
    for group, saved in zip(optimizer.param_groups, sd["param_groups"]):
        for p, idx in zip(group["params"], saved["params"]):
            yield shards.info_of(p), idx


def _tag_state_dict(optimizer, sd):
    state = dict(sd["state"])
    for info, idx in _pairs(optimizer, sd):
        if info is not None and idx in state:
            state[idx] = {**state[idx], TAG: _tag(info)}
    return {**sd, "state": state}


def _check_load(optimizer, sd):
    state = dict(sd.get("state", {}))
    if not any(isinstance(v, dict) and TAG in v for v in state.values()):
        return None
    for info, idx in _pairs(optimizer, sd):
        st = state.get(idx)
        if info is not None and isinstance(st, dict) and TAG in st:
            _check(st[TAG], info)
    for idx, st in state.items():
        if isinstance(st, dict) and TAG in st:
            state[idx] = {k: v for k, v in st.items() if k != TAG}
    return {**sd, "state": state}


def before_step(optimizer) -> None:
    """From the step pre-hook: hooks on an optimizer over yafsdp shards; tags a load left checked."""
    infos = [(p, shards.info_of(p)) for g in optimizer.param_groups for p in g["params"]]
    infos = [(p, i) for p, i in infos if i is not None]
    if not infos:
        return
    if optimizer not in _HOOKED:
        _HOOKED.add(optimizer)
        optimizer.register_state_dict_post_hook(_tag_state_dict)
        optimizer.register_load_state_dict_pre_hook(_check_load)
    for p, info in infos:
        st = optimizer.state.get(p)
        if st and TAG in st:
            _check(st[TAG], info)  # a mismatch stays refused at every later step too
            del st[TAG]


# ---------------------------------------------------------------------------------------------- full form
def _model_shards(model, optimizer):
    """Per optimizer param group: [(shard, info)]; every parameter must be one of model's shards."""
    own = {id(u.flat_param) for u in model._rt.all if u.flat_param is not None}
    out = []
    for i, g in enumerate(optimizer.param_groups):
        row = []
        for p in g["params"]:
            info = shards.info_of(p)
            if info is None or id(p) not in own:
                raise ValueError(
                    f"yafsdp: optimizer param group {i} holds a tensor of shape {tuple(p.shape)} that is not a shard "
                    "of this model; full_optim_state_dict / load_full_optim_state_dict take an optimizer over "
                    "model.parameters() (or model.param_groups(...)) only")
            row.append((p, info))
        out.append(row)
    return out


def _per_element(v, info) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == info.shard_numel


@torch.no_grad()
def full_optim_state_dict(model, optimizer) -> dict:
    """Collective over the shard group. See [Note: optimizer state that knows its shard]."""
    model.check_idle("full_optim_state_dict")
    if model.replica != 0:
        return {}
    rt, group = model._rt, model.process_group
    specs = _tp_specs(model)  # tensor parallel: gathered over the shard group, then over TP (global rank 0 keeps it)
    gatherer = model.rank == 0
    coord = gatherer and model.tp_rank == 0
    state: dict = {}
    groups = []
    for g, row in zip(optimizer.param_groups, _model_shards(model, optimizer)):
        names = []
        for p, info in row:
            names.extend(info.param_names)
            st = optimizer.state.get(p, {})
            per = {n: {} for n in info.param_names}
            for key in sorted(k for k in st if k != TAG):
                v = st[key]
                if _per_element(v, info):
                    full = torch.empty(info.padded_numel, dtype=v.dtype, device=rt.device)
                    collectives.all_gather(full, rt.to_device(v.detach()).contiguous(), group, async_op=False)
                    if gatherer:
                        for n, shape, off in zip(info.param_names, info.param_shapes, info.param_offsets):
                            t = full[off:off + math.prod(shape)].view(shape)
                            if n in specs:  # collective over the TP group of the data-parallel index 0 ranks
                                t = _dtensor(t, specs[n]).full_tensor()
                            per[n][key] = t.cpu().clone()
                elif isinstance(v, torch.Tensor) and v.numel() == 1:
                    for n in per:
                        per[n][key] = v.detach().cpu().clone()
                elif isinstance(v, torch.Tensor):
                    raise ValueError(
                        f"yafsdp.full_optim_state_dict: state {key!r} of shard {info.name!r} has shape "
                        f"{tuple(v.shape)}: neither one value per element of the shard ({info.shard_numel}) nor a "
                        "scalar; use yafsdp.checkpoint for this optimizer")
                else:
                    for n in per:
                        per[n][key] = v
            if st and coord:
                state.update(per)
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
    return {"state": state, "param_groups": groups} if coord else {}


def _tp_specs(model) -> dict:
    """{original parameter name: its TPSpec} of a tensor-parallel engine's TP parameters ({} without TP)."""
    if model._tp is None:
        return {}
    return {key: ref.tp for key, kind, ref in model._keys.entries if kind == "param" and ref.tp is not None}


def _dtensor(local: torch.Tensor, spec):
    """``local`` as a DTensor of TP layout ``spec`` (layout/dtensor.py's TPSpec)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)


def _shapes(info, specs) -> list:
    """The shapes of ``info``'s parameters in the full form: a TP parameter's global shape."""
    return [tuple(specs[n].shape) if n in specs else tuple(shape)
            for n, shape in zip(info.param_names, info.param_shapes)]


def _validate(sd, plan, specs) -> str | None:
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        return "expected the dict of model.full_optim_state_dict(opt) (keys 'state' and 'param_groups') on rank 0"
    if len(sd["param_groups"]) != len(plan):
        return f"the state dict has {len(sd['param_groups'])} param groups, this optimizer {len(plan)}"
    for i, row in enumerate(plan):
        want = [n for _, info in row for n in info.param_names]
        if list(sd["param_groups"][i].get("params", [])) != want:
            missing = sorted(set(want) - set(sd["param_groups"][i].get("params", [])))
            return (f"param group {i} names other parameters than this optimizer's ({len(want)} expected"
                    f"{', missing ' + repr(missing[:4]) if missing else ''})")
        for _, info in row:
            for n, shape in zip(info.param_names, _shapes(info, specs)):
                for key, v in sd["state"].get(n, {}).items():
                    if isinstance(v, torch.Tensor) and v.numel() > 1 and tuple(v.shape) != tuple(shape):
                        return f"state {key!r} of {n!r} has shape {tuple(v.shape)}, the parameter {tuple(shape)}"
    return None


def _meta(sd, plan, specs) -> dict:
    """What every rank must know to receive its slices: per shard, per state key, ("elem", dtype)
    for one value per element, or ("value", v) for one value per parameter (``step``); the
    hyperparameters of each group. Raises ValueError for what cannot be split."""
    meta = dict(groups=[{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]], shards=[])
    for row in plan:
        for _, info in row:
            keys: dict = {}
            for n, shape in zip(info.param_names, _shapes(info, specs)):
                for key, v in sd["state"].get(n, {}).items():
                    if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(shape) and len(shape):
                        keys[key] = ("elem", v.dtype)
                    elif key not in keys:
                        keys[key] = ("value", v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                    elif keys[key][0] == "value" and not _same(keys[key][1], v):
                        raise ValueError(
                            f"state {key!r} differs between the parameters of unit {info.unit!r} ({n!r}: {v!r}); "
                            "a flat shard keeps one value of it for all its parameters")
            meta["shards"].append(keys)
    return meta


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu())
    return a == b


@torch.no_grad()
def load_full_optim_state_dict(model, optimizer, sd) -> None:
    """Collective inverse of :func:`full_optim_state_dict` at any world size: rank 0's ``sd`` (other
    ranks may pass None) into every rank's optimizer state for its slice."""
    model.check_idle("load_full_optim_state_dict")
    plan = _model_shards(model, optimizer)
    specs = _tp_specs(model)
    coord = model.rank == 0 and model.replica == 0 and model.tp_rank == 0  # global rank 0's dict is read
    meta, problem = None, None
    if coord:
        problem = _validate(sd, plan, specs)
        if problem is None:
            try:
                meta = _meta(sd, plan, specs)
            except ValueError as e:
                problem = str(e)
    holder = model.rank == 0 and model.replica == 0  # tensor parallel: one per TP coordinate, a TP group
    meta = (problem, meta)
    if model._tp is not None and holder:
        meta = broadcast_object(meta, model._tp.group)
    meta = _share(meta, model)
    if meta[0]:
        raise ValueError(f"yafsdp.load_full_optim_state_dict: {meta[0]}")
    meta = meta[1]
    if model._tp is not None and holder:  # each holder gets its TP slices, which it scatters as without TP
        sd = _split_over_tp(model, plan, meta, sd if coord else None, specs)
    local = optimizer.state_dict()
    new_state = {}
    index = 0
    for row in plan:
        for _, info in row:
            st = {}
            for key, (kind, val) in sorted(meta["shards"][index].items()):
                st[key] = val if kind == "value" else _scatter_key(model, info, sd if holder else None, key, val)
            if st:
                new_state[index] = st
            index += 1
    groups = [{**saved, "params": now["params"]} for saved, now in zip(meta["groups"], local["param_groups"])]
    optimizer.load_state_dict({"state": new_state, "param_groups": groups})


def _split_over_tp(model, plan, meta, sd, specs) -> dict:
    """Collective over the TP group of the holders (the data-parallel index 0 ranks of replica 0): global rank 0's
    per-parameter state tensors (``sd``; None elsewhere) split by each TP parameter's placements, the others'
    broadcast; returns this holder's ``{"state": {name: {key: local tensor}}}`` (a state missing from rank 0's
    dict: zeros, as the scatter fills it)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    device, state, index = model._rt.device, {}, 0
    for row in plan:
        for _, info in row:
            for n, shape in zip(info.param_names, _shapes(info, specs)):
                for key, (kind, dtype) in sorted(meta["shards"][index].items()):
                    if kind != "elem":
                        continue
                    v = sd["state"].get(n, {}).get(key) if sd is not None else None
                    full = (v.to(device, dtype) if v is not None else torch.zeros(shape, dtype=dtype, device=device)
                            ) if sd is not None else torch.empty(shape, dtype=dtype, device=device)
                    placements = specs[n].placements if n in specs else (Replicate(),)
                    local = distribute_tensor(full, model._tp.mesh, placements, src_data_rank=0).to_local()
                    state.setdefault(n, {})[key] = local
            index += 1
    return {"state": state}


def _share(meta, model):
    """rank 0's ``meta`` on every rank of the shard group (HSDP: and of every replica)."""
    if model.replicate_group is not None and model.rank == 0:
        meta = broadcast_object(meta, model.replicate_group)
    return broadcast_object(meta, model.process_group)


def _scatter_key(model, info, sd, key, dtype: torch.dtype) -> torch.Tensor:
    """This rank's slice of state ``key`` of shard ``info`` from rank 0's per-parameter tensors."""
    rt, group = model._rt, model.process_group
    shard = torch.zeros(info.shard_numel, dtype=dtype, device=rt.device)
    if model.replica == 0:
        chunks = None
        if model.rank == 0:
            full = torch.zeros(info.padded_numel, dtype=dtype, device=rt.device)
            for n, shape, off in zip(info.param_names, info.param_shapes, info.param_offsets):
                v = sd["state"].get(n, {}).get(key)
                if v is not None:
                    full[off:off + math.prod(shape)].copy_(v.reshape(-1))
            chunks = list(full.chunk(model.world_size))
        collectives.scatter(shard, chunks, source_rank(group), group)
    if model.replicate_group is not None:
        collectives.broadcast(shard, source_rank(model.replicate_group), model.replicate_group)
    return shard.to(rt.host_device)
