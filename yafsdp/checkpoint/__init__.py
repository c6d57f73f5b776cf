"""Sharded checkpoints of a ``yafsdp.YaFSDP`` model and its optimizer, with
``torch.distributed.checkpoint`` (DCP): atomic, verified, and resharded across world sizes.

    from yafsdp import checkpoint as ckpt
    path = ckpt.save_checkpoint(root, step, model, optimizer, state={...}, rank_state={...})
    path = ckpt.latest_checkpoint(root)              # newest complete one, or None
    loaded = ckpt.load_checkpoint(path, model, optimizer)   # loaded.step, .state, .rank_state, .meta

Layout on disk (``root`` is shared by all ranks; on several nodes it must be a shared filesystem)::

    root/step_00000120/           one checkpoint: DCP files + our manifest
        .metadata                 DCP's global metadata (written by rank 0)
        __0_0.distcp ...          DCP data, one file per rank
        checkpoint.json           manifest: step, world size, units, optimizer layout, file sizes
                                  and CRC-32s; written last -- its presence marks completion
    root/.tmp.step_00000140/      a save in progress (or killed mid-way): never read

[Note: what a checkpoint holds]
Each flat unit is saved as one 1-D tensor of its *unpadded* length ``numel``, named
``model.<unit>`` (an NF4 group: its packed codes and its scales, two such tensors; see
``_model_entries``). A rank contributes the part of its master shard that lies below ``numel`` (a
DCP chunk at offset ``shard_start``); padding is never saved. Because the first ``numel``
elements of a flat unit are laid out the same for every world size, a checkpoint written by N
ranks loads on M ranks: DCP reads, for each rank, the byte ranges of the saved chunks that
overlap its new shard. Optimizer state tensors shaped like a shard (AdamW's ``exp_avg``,
``exp_avg_sq``) are saved the same way as ``optim.<unit>.<key>``; other state (the ``step``
count) is saved once. ``state`` (identical on every rank: step, data position) is saved once;
``rank_state`` (per rank: RNG states) is saved per rank as ``rank_state.<rank>`` and given back
on load to ranks that existed in the saved world; both hold tensors, numpy arrays, numbers,
strings and containers of them (see [Note: loading runs no code from the checkpoint] in safe.py).
The module's persistent buffers are saved once as ``buffer.<key>`` (see [Note: module buffers in
checkpoints] in contents.py) and the engine's settings go into the manifest (see [Note: engine
settings in the manifest]). An engine with tensor-parallel parameters saves each parameter under
its own name instead (the params form), and every engine reads either form: see [Note: checkpoints
with tensor parallelism] in by_param.py. A full disk: see [Note: a full disk] in space.py; saving in the
background: [Note: asynchronous saves] in background.py.

[Note: atomic saves]
All ranks write into ``root/.tmp.step_N``. When DCP returns (its metadata is written after every
rank's data), the ranks checksum the files (each a share of them), rank 0 writes
``checkpoint.json`` (fsynced) and renames the directory to ``step_N`` -- one atomic rename. A
crash or kill at any point before the rename leaves only a ``.tmp.*`` directory, which discovery
ignores and the next save removes; the previous checkpoints are never touched. A save that fails
(a storage error: disk full, read-only, quota) removes its ``.tmp.*`` directory and raises
CheckpointError naming the path and the errno on every rank. A ``step_*`` directory without a
manifest was not written by a save (see ``files.foreign_dirs``): it is skipped, reported with a
CheckpointWarning, and never deleted -- a save of that very step is refused instead. Old checkpoints
beyond ``keep`` are first renamed to ``.trash.*`` and then deleted, so a checkpoint directory is
either complete or absent; a checkpoint of the saved step already there goes only after the new one
is in place ([Note: replacing a checkpoint] in files.py). On load the manifest's sizes and checksums are verified first (each
rank a share of the files) and any problem is reported with the file's name before a byte is
loaded into the model.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..comm.groups import gather_object, raise_if_any
from ..comm.hsdp import across_replicas
from . import by_param, contents
from .contents import (
    _model_entries,
    _optimizer_params,
    _units,
    _zero_padding,
    _flat_shard,
)
from .dcp_glue import FlatShard, LoadPlanner
from .write import _failing_rank, _group_info, _root_cause, _save  # noqa: F401 (their old home)
from .safe import SafeReader
from .files import (  # noqa: F401 - the package's names (ckpt.list_checkpoints, ckpt.FORMAT, ...)
    FORMAT,
    MANIFEST,
    PINS,
    PREFIX,
    TMP_PREFIX,
    CheckpointError,
    CheckpointWarning,
    checkpoint_dir,
    crc32,
    describe_os_error,
    foreign_dirs,
    incomplete_checkpoints,
    latest_checkpoint,
    pin_checkpoint,
    pinned_checkpoints,
    list_checkpoints,
    publish_checkpoint,
    read_manifest,
    remove_checkpoint,
    remove_trash,
    rotate_checkpoints,
    unfinished_saves,
    write_json_atomic,
)

# ------------------------------------------------------------------------------------------ save
def save_checkpoint(
    root: str,
    step: int,
    model,
    optimizer=None,
    *,
    state: dict | None = None,
    rank_state: Any = None,
    meta: dict | None = None,
    keep: int | None = None,
) -> str:
    """Collective. Save ``model`` (a ``yafsdp.YaFSDP``), ``optimizer`` and the extra states as
    ``root/step_<step>``, atomically (see [Note: atomic saves]); returns that path. ``state`` must
    be identical on every rank; ``rank_state`` is per rank; ``meta`` (JSON) goes into the
    manifest. A checkpoint of the same step already there is replaced once the new one is in place
    (see [Note: replacing a checkpoint] in files.py). ``keep``: afterwards delete the complete
    checkpoints of steps up to ``step`` beyond the newest ``keep`` (the new one is never deleted;
    those of later steps are left alone).

    HSDP: see [Note: checkpoints of HSDP]. A background save (``AsyncSaver``) in flight into
    ``root`` is waited for first, with a CheckpointWarning (see [Note: one save at a time per root]
    in background.py). Tensor parallel: see [Note: checkpoints with tensor parallelism] in by_param.py."""
    _wait_for_root(root, "save_checkpoint", step)
    if by_param.is_tp(model):  # the world writes: every rank its boxes and its own rank_state
        group = by_param.group_of(model, "save_checkpoint")
        return _save(root, step, model, optimizer, state, {dist.get_rank(): rank_state}, meta, keep,
                     dist.get_world_size(), group=group)
    replicate = getattr(model, "replicate_group", None)
    if replicate is None:
        rank, _ = _group_info(model.process_group)
        return _save(root, step, model, optimizer, state, {rank: rank_state}, meta, keep, None)
    model.check_idle("save_checkpoint")
    states = dict(gather_object((dist.get_rank(), rank_state), replicate))  # global rank -> its rank_state
    across_replicas(replicate, model.replica, CheckpointError, lambda: _save(
        root, step, model, optimizer, state, states, meta, keep, dist.get_world_size()))
    return checkpoint_dir(root, step)


# [Note: checkpoints of HSDP]
# The replicas of an HSDP engine hold the same shards and optimizer state, so replica 0 writes the
# checkpoint (its shard group runs DCP, exactly as a flat engine of that size) while the other
# replicas wait for its verdict (an error is raised on every rank together). ``rank_state`` is
# per global rank: each replica-0 rank writes its replicate group's states as
# ``rank_state.<global rank>``, and the manifest records the whole world (``world_size``) and
# ``mesh`` [replicas, shard size]. Since the saved tensors are the unpadded flat units (see [Note:
# what a checkpoint holds]), such a checkpoint loads with any other mesh or a flat world, and a
# flat one loads on a mesh: every rank of every replica reads its own shard. The other replicas wait
# for the whole save in one broadcast: the process group's timeout must exceed the time of a save.
# An asynchronous save writes the same checkpoint from replica 0's staging copy: see [Note:
# asynchronous saves of HSDP] in background.py.


# ------------------------------------------------------------------------------------------ load
@dataclass
class Loaded:
    path: str
    step: int
    state: dict  # the ``state`` given to save_checkpoint
    rank_state: Any  # this rank's ``rank_state``; None if this rank did not exist in the saved world
    meta: dict  # the ``meta`` given to save_checkpoint
    manifest: dict
    saved_world_size: int


def verify_checkpoint(path: str, process_group=None, checksums: bool = True) -> dict:
    """Collective. Read the manifest and check every file it lists (existence, size, CRC-32;
    each rank a share). Raises CheckpointError naming the first bad file on every rank."""
    group = process_group if process_group is not None else dist.group.WORLD
    rank, world = _group_info(group)
    problem = None
    manifest = None
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        problem = str(e)
    raise_if_any(problem, group, CheckpointError)
    files = manifest.get("files") or {}
    bad = None
    if not files:
        bad = f"checkpoint {path!r}: {MANIFEST} lists no files"
    if ".metadata" not in files and bad is None:
        bad = f"checkpoint {path!r}: {MANIFEST} does not list DCP's .metadata"
    for name in sorted(files)[rank::world]:
        if bad:
            break
        want = files[name]
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            bad = f"checkpoint {path!r} is damaged: file {name!r} is missing"
        elif os.path.getsize(file) != want["bytes"]:
            bad = (f"checkpoint {path!r} is damaged: file {name!r} has {os.path.getsize(file)} bytes, "
                   f"the manifest says {want['bytes']} (truncated or overwritten)")
        elif checksums and crc32(file) != want["crc32"]:
            bad = f"checkpoint {path!r} is corrupt: file {name!r} fails its CRC-32 check (expected {want['crc32']})"
    raise_if_any(bad, group, CheckpointError)
    return manifest


def check_compatible(manifest: dict, model, path: str = "") -> None:
    """CheckpointError listing how the checkpoint's units differ from ``model``'s."""
    saved = {u["name"]: u for u in manifest.get("units", [])}
    here = {u["name"]: u for u in _units(model)}
    diffs = []
    for name in [n for n in saved if n not in here][:3]:
        diffs.append(f"unit {name!r} is in the checkpoint but not in the model")
    for name in [n for n in here if n not in saved][:3]:
        diffs.append(f"unit {name!r} is in the model but not in the checkpoint")
    for name in here:
        if name in saved and saved[name]["params"] != here[name]["params"]:
            a = {k: tuple(s) for k, s in saved[name]["params"]}
            b = {k: tuple(s) for k, s in here[name]["params"]}
            for k in list(dict.fromkeys([*a, *b])):
                if a.get(k) != b.get(k):
                    diffs.append(f"{k}: checkpoint {a.get(k)} vs model {b.get(k)}")
                    break
    if diffs:
        raise CheckpointError(
            f"checkpoint {path!r} was written for a different model: " + "; ".join(diffs[:5])
        )


_ADAMW_FAMILY = {"AdamW", "FusedAdamW"}  # yafsdp.FusedAdamW keeps torch's AdamW state and options: either loads the other


def load_checkpoint(path: str, model, optimizer=None, *, verify: bool = True, strict_buffers: bool = True) -> Loaded:
    """Collective. Load checkpoint ``path`` into ``model``'s shards, buffers (and ``optimizer``'s
    state), whatever world size, mesh, zero_stage or offload wrote it. Everything is checked
    before anything is loaded, and nothing in the checkpoint is run as code (see [Note: loading
    runs no code from the checkpoint] in safe.py). ``strict_buffers=False``: a checkpoint written
    before checkpoints held module buffers loads, the buffers keeping their values. Either form loads
    into an engine with or without tensor parallelism, at any TP degree (see [Note: checkpoints with
    tensor parallelism] in by_param.py)."""
    model.check_idle("load_checkpoint")
    tp = by_param.is_tp(model)
    group = by_param.group_of(model, "load_checkpoint") if tp else model.process_group
    rank, world = _group_info(group)
    manifest = verify_checkpoint(path, group, checksums=verify)
    # An engine without TP reading a flat checkpoint: the flat form's own path (below), as it always was.
    targets = by_param.Targets(model, manifest, path) if tp or by_param.layout_of(manifest, path)["format"] != \
        by_param.FLAT else None
    contents.check_settings(manifest, model, path)
    check_compatible(manifest, model, path)
    contents.check_buffers(manifest, model, path, strict_buffers)
    saved_world = int(manifest["world_size"])

    if targets is None:
        entries: dict[str, Any] = dict(_model_entries(model))
    else:
        for info in model.shard_info():
            targets.add(info, info.param.detach(), lambda n: f"param.{n}", lambda u: f"model.{u}")
        entries = targets.entries
    entries.update(contents.load_targets(manifest))
    opt_state: dict = {}
    opt_desc = manifest.get("optimizer")
    if optimizer is not None:
        if not opt_desc:
            raise CheckpointError(f"checkpoint {path!r} holds no optimizer state, but an optimizer was given")
        saved_cls, cls = opt_desc.get("cls"), type(optimizer).__name__
        mro = {c.__name__ for c in type(optimizer).__mro__}  # a subclass of the saving class loads its state
        if saved_cls is not None and saved_cls not in mro and {saved_cls, cls} != _ADAMW_FAMILY:
            raise CheckpointError(
                f"checkpoint {path!r}: its optimizer state was written by {saved_cls}, and this optimizer is {cls}: "
                f"{saved_cls}'s state ({', '.join(sorted({k for st in opt_desc['state'].values() for k in st})) or 'none'}) "
                f"and options do not fit {cls}. Build a {saved_cls} as the run that saved did, or load the model "
                "alone (optimizer=None) and start the optimizer's state afresh")
        groups_now = [len(g["params"]) for g in optimizer.param_groups]
        if opt_desc.get("groups") != groups_now:
            raise CheckpointError(
                f"checkpoint {path!r}: optimizer param groups hold {opt_desc.get('groups')} parameters, "
                f"this optimizer {groups_now}"
            )
        for info, p in _optimizer_params(model, optimizer):
            st = opt_state.setdefault(id(p), {})
            for key, d in opt_desc["state"].get(info.key, {}).items():
                name = f"optim.{info.key}.{key}"
                if d["kind"] == "shard":
                    st[key] = torch.zeros_like(p.detach(), dtype=getattr(torch, d["dtype"]))
                    if targets is None:
                        entries[name] = _flat_shard(info, st[key])
                    else:
                        targets.add(info, st[key], lambda n, key=key: f"param_optim.{key}.{n}",
                                    lambda u, key=key: f"optim.{u}.{key}")
                elif d["kind"] == "tensor":
                    # On the CPU, as in a state_dict: the optimizer's load_state_dict puts it where that
                    # optimizer keeps it (torch's AdamW keeps `step` on the CPU unless fused or
                    # capturable; on the device it would read it back with a host sync every step).
                    st[key] = torch.zeros(d["shape"], dtype=getattr(torch, d["dtype"]), device="cpu")
                    entries[name] = st[key]
                else:
                    entries[name] = None
        entries["optim.param_groups"] = None
    entries["state"] = None
    # rank_state is per global rank under HSDP (see [Note: checkpoints of HSDP]) and TP; a flat engine's
    # group rank is its global rank when it shards over the world.
    me = dist.get_rank() if getattr(model, "replicate_group", None) is not None or tp else rank
    if me < saved_world:
        entries[f"rank_state.{me}"] = None

    try:
        reader = SafeReader(path)
        reader.read_metadata()  # a refusal raised as itself, not as DCP's "fall back to rank-local metadata"
        dcp.load(entries, storage_reader=reader, planner=LoadPlanner(reader), process_group=group)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise CheckpointError(f"loading checkpoint {path!r} failed: {_root_cause(e)}") from e

    if targets is None:
        _zero_padding(model, entries)
    else:
        targets.finish()
        by_param.zero_padding(model)
    contents.load_buffers(model, entries)
    model.mark_loaded()

    if optimizer is not None:
        sd = optimizer.state_dict()
        index = 0
        state = {}
        for info, p in _optimizer_params(model, optimizer):
            st = opt_state[id(p)]
            for key, d in opt_desc["state"].get(info.key, {}).items():
                if d["kind"] == "object":
                    st[key] = entries[f"optim.{info.key}.{key}"]
            if st:
                state[index] = st
            index += 1
        groups = []
        for saved, now in zip(entries["optim.param_groups"], sd["param_groups"]):
            groups.append({**saved, "params": now["params"]})
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    return Loaded(
        path=path, step=int(manifest["step"]), state=entries["state"] or {},
        rank_state=entries.get(f"rank_state.{me}"), meta=manifest.get("meta") or {},
        manifest=manifest, saved_world_size=saved_world,
    )


from .background import AsyncSaver, Staged, wait_for_root as _wait_for_root  # noqa: E402,F401

__all__ = [
    "AsyncSaver", "Staged", "CheckpointError", "CheckpointWarning", "foreign_dirs", "unfinished_saves", "FlatShard", "Loaded", "MANIFEST", "checkpoint_dir", "check_compatible",
    "incomplete_checkpoints", "latest_checkpoint", "list_checkpoints", "load_checkpoint",
    "read_manifest", "save_checkpoint", "verify_checkpoint",
]
