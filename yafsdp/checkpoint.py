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
``model.<unit>``. A rank contributes the part of its master shard that lies below ``numel`` (a
DCP chunk at offset ``shard_start``); padding is never saved. Because the first ``numel``
elements of a flat unit are laid out the same for every world size, a checkpoint written by N
ranks loads on M ranks: DCP reads, for each rank, the byte ranges of the saved chunks that
overlap its new shard. Optimizer state tensors shaped like a shard (AdamW's ``exp_avg``,
``exp_avg_sq``) are saved the same way as ``optim.<unit>.<key>``; other state (the ``step``
count) is saved once. ``state`` (picklable, identical on every rank: step, data position) is
saved once; ``rank_state`` (picklable, per rank: RNG states) is saved per rank as
``rank_state.<rank>`` and given back on load to ranks that existed in the saved world.

[Note: atomic saves]
All ranks write into ``root/.tmp.step_N``. When DCP returns (its metadata is written after every
rank's data), the ranks checksum the files (each a share of them), rank 0 writes
``checkpoint.json`` (fsynced) and renames the directory to ``step_N`` -- one atomic rename. A
crash or kill at any point before the rename leaves only a ``.tmp.*`` directory, which discovery
ignores and the next save removes; the previous checkpoints are never touched. Old checkpoints
beyond ``keep`` are first renamed to ``.trash.*`` and then deleted, so a checkpoint directory is
either complete or absent. On load the manifest's sizes and checksums are verified first (each
rank a share of the files) and any problem is reported with the file's name before a byte is
loaded into the model.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

FORMAT = "yafsdp-checkpoint/1"
MANIFEST = "checkpoint.json"  # completion marker and manifest
PREFIX = "step_"
TMP_PREFIX = ".tmp."
TRASH_PREFIX = ".trash."
_STEP_RE = re.compile(rf"^{PREFIX}(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the model; the message names
    the directory and, where one is at fault, the file."""


# ---------------------------------------------------------------------------------------- DCP glue
@dataclass
class FlatShard:
    """This rank's piece of a 1-D tensor of length ``numel``: ``local`` holds elements
    ``[offset, offset + local.numel())``. ``local`` may be empty (a rank holding only padding)."""

    local: torch.Tensor  # 1-D, a view into the master shard (or optimizer state)
    offset: int
    numel: int

    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=torch.Size([self.local.numel()]))


class _SavePlanner(DefaultSavePlanner):
    """DCP's default planner, plus FlatShard values written as chunks of their global tensor."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, FlatShard)}
        items = list(create_default_local_save_plan(plain, self.is_coordinator).items)
        for fqn, s in self.state_dict.items():
            if isinstance(s, FlatShard) and s.local.numel() > 0:
                items.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size([s.offset])),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=s.chunk(),
                        properties=TensorProperties.create_from_tensor(s.local),
                        size=torch.Size([s.numel]),
                    ),
                ))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.local if isinstance(obj, FlatShard) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, plus FlatShard destinations: each reads the overlapping parts of
    whatever chunks the checkpoint holds (this is the resharding)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default set-up walks the dict to materialise meta tensors and replaces any value of
        # a type it does not know (our FlatShard) with None; ours holds no meta tensors.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, FlatShard)}
        items = list(create_default_local_load_plan(plain, self.metadata, True).items)
        for fqn, s in self.state_dict.items():
            if not isinstance(s, FlatShard) or s.local.numel() == 0:
                continue
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != (s.numel,):
                got = tuple(md.size) if isinstance(md, TensorStorageMetadata) else md
                raise CheckpointError(f"checkpoint entry {fqn!r} holds {got}, expected a 1-D tensor of {s.numel}")
            items += create_read_items_for_chunk_list(fqn, md, [s.chunk()])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.local if isinstance(obj, FlatShard) else super().lookup_tensor(index)


# --------------------------------------------------------------------------- discovery & manifest
def checkpoint_dir(root: str, step: int) -> str:
    return os.path.join(root, f"{PREFIX}{step:08d}")


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints (those with a manifest) under ``root``, oldest first."""
    out = []
    if not os.path.isdir(root):
        return out
    for name in os.listdir(root):
        m = _STEP_RE.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, MANIFEST)):
            out.append((int(m.group(1)), path))
    return sorted(out)


def incomplete_checkpoints(root: str) -> list[str]:
    """Directories under ``root`` that look like checkpoints but are not complete: saves in
    progress or killed (``.tmp.*``), and ``step_*`` directories without a manifest."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        if name.startswith(TMP_PREFIX) or (_STEP_RE.match(name) and not os.path.isfile(os.path.join(path, MANIFEST))):
            out.append(path)
    return out


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under ``root`` (incomplete ones are skipped), or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint ``path``; CheckpointError naming the file if absent or unreadable."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    if not os.path.isfile(file):
        raise CheckpointError(f"checkpoint {path!r} is incomplete: {MANIFEST} is missing (a save was interrupted)")
    try:
        with open(file) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path!r}: {MANIFEST} is unreadable or corrupt ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path!r}: {MANIFEST} is not a {FORMAT} manifest (format={manifest.get('format')!r})"
            if isinstance(manifest, dict) else f"checkpoint {path!r}: {MANIFEST} is not a JSON object"
        )
    return manifest


def _crc32(path: str, chunk: int = 1 << 24) -> str:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _group_info(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _src(group) -> int:
    return 0 if group is None or group is dist.group.WORLD else dist.get_global_rank(group, 0)


def _broadcast(obj, group):
    box = [obj]
    dist.broadcast_object_list(box, src=_src(group), group=group)
    return box[0]


def _all_gather(obj, group) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# ------------------------------------------------------------------------------ state collection
def _units(model) -> list[dict]:
    return [
        dict(name=u.name, numel=u.layout.numel, params=[[p.fqn, list(p.shape)] for p in u.layout.params])
        for u in model.flat_units
    ]


def _flat_shard(unit, tensor: torch.Tensor) -> FlatShard:
    lay = unit.layout
    valid = max(0, min(lay.shard_numel, lay.numel - lay.shard_start))
    return FlatShard(tensor[:valid], min(lay.shard_start, lay.numel), lay.numel)


def _optimizer_params(model, optimizer) -> list[tuple[Any, Any]]:
    """(unit, param) for every parameter of ``optimizer``, in its state_dict index order."""
    by_id = {id(u.flat_param): u for u in model.flat_units}
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            unit = by_id.get(id(p))
            if unit is None:
                raise CheckpointError(
                    f"optimizer param group {gi} holds a parameter of shape {tuple(p.shape)} that is not one "
                    "of the wrapped model's flat shards; build the optimizer from model.parameters() or "
                    "model.param_groups()"
                )
            out.append((unit, p))
    return out


def _optimizer_entries(model, optimizer) -> tuple[dict, dict]:
    """DCP entries and the manifest's description of the optimizer state."""
    entries: dict[str, Any] = {}
    layout: dict[str, dict] = {}
    for unit, p in _optimizer_params(model, optimizer):
        st = optimizer.state.get(p, {})
        desc = {}
        for key, v in st.items():
            name = f"optim.{unit.name}.{key}"
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape == p.shape:
                entries[name] = _flat_shard(unit, v.detach())
                desc[key] = dict(kind="shard", dtype=str(v.dtype).replace("torch.", ""))
            elif isinstance(v, torch.Tensor):
                entries[name] = v.detach()
                desc[key] = dict(kind="tensor", dtype=str(v.dtype).replace("torch.", ""), shape=list(v.shape))
            else:
                entries[name] = v
                desc[key] = dict(kind="object")
        layout[unit.name] = desc
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
    entries["optim.param_groups"] = groups
    return entries, dict(cls=type(optimizer).__name__, state=layout, groups=[len(g["params"]) for g in optimizer.param_groups])


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
    manifest. A checkpoint of the same step already there is replaced (after the new one is
    complete). ``keep``: afterwards delete all but the newest ``keep`` complete checkpoints."""
    group = model.process_group
    rank, world = _group_info(group)
    model._check_idle("save_checkpoint")
    final = checkpoint_dir(root, step)
    tmp = os.path.join(root, f"{TMP_PREFIX}{PREFIX}{step:08d}")

    plan = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            for stale in incomplete_checkpoints(root):  # killed saves: never read, safe to drop
                _remove(stale, root)
            os.makedirs(tmp)
            plan = ("save", None)
        except OSError as e:
            plan = ("error", f"cannot prepare {tmp!r}: {e}")
    plan = _broadcast(plan, group)
    if plan[0] == "error":
        raise CheckpointError(plan[1])

    entries: dict[str, Any] = {}
    for u in model.flat_units:
        entries[f"model.{u.name}"] = _flat_shard(u, u.flat_param.detach())
    opt_desc = None
    if optimizer is not None:
        opt_entries, opt_desc = _optimizer_entries(model, optimizer)
        entries.update(opt_entries)
    entries["state"] = dict(state or {})
    entries[f"rank_state.{rank}"] = rank_state

    try:
        dcp.save(entries, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), planner=_SavePlanner(),
                 process_group=group)
    except Exception as e:  # noqa: BLE001 - report as a checkpoint error on every rank
        raise CheckpointError(f"saving checkpoint into {tmp!r} failed: {type(e).__name__}: {e}") from e

    # Checksums: each rank a share of the files (the directory is shared).
    files = sorted(f for f in os.listdir(tmp) if f != MANIFEST)
    mine = {f: dict(bytes=os.path.getsize(os.path.join(tmp, f)), crc32=_crc32(os.path.join(tmp, f)))
            for f in files[rank::world]}
    sums: dict[str, dict] = {}
    for part in _all_gather(mine, group):
        sums.update(part)

    outcome = None
    if rank == 0:
        manifest = dict(
            format=FORMAT, step=int(step), world_size=world, saved_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
            torch=torch.__version__, units=_units(model), optimizer=opt_desc,
            meta=meta or {}, files=sums,
        )
        try:
            _write_json_atomic(os.path.join(tmp, MANIFEST), manifest)
            if os.path.isdir(final):  # an older save of this step (a run resumed from further back)
                _remove(final, root)
            os.rename(tmp, final)
            _fsync_dir(root)
            if keep is not None and keep > 0:
                for _, old in list_checkpoints(root)[:-keep]:
                    _remove(old, root)
            outcome = ("ok", None)
        except OSError as e:
            outcome = ("error", f"finishing checkpoint {final!r} failed: {e}")
    outcome = _broadcast(outcome, group)
    if outcome[0] != "ok":
        raise CheckpointError(outcome[1])
    return final


def _write_json_atomic(path: str, obj) -> None:
    tmp = path + ".part"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _remove(path: str, root: str) -> None:
    """Rename out of sight first (atomic), then delete: a half-deleted checkpoint is never visible."""
    trash = os.path.join(root, f"{TRASH_PREFIX}{os.path.basename(path)}.{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
    for name in os.listdir(root):  # leftovers of an earlier interrupted removal
        if name.startswith(TRASH_PREFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


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
    problems = _all_gather(problem, group)
    if any(problems):
        raise CheckpointError(next(p for p in problems if p))
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
        elif checksums and _crc32(file) != want["crc32"]:
            bad = f"checkpoint {path!r} is corrupt: file {name!r} fails its CRC-32 check (expected {want['crc32']})"
    bads = [b for b in _all_gather(bad, group) if b]
    if bads:
        raise CheckpointError(bads[0])
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


def load_checkpoint(path: str, model, optimizer=None, *, verify: bool = True) -> Loaded:
    """Collective. Load checkpoint ``path`` into ``model``'s shards (and ``optimizer``'s state),
    whatever world size wrote it. Everything is checked before anything is loaded."""
    group = model.process_group
    rank, world = _group_info(group)
    model._check_idle("load_checkpoint")
    manifest = verify_checkpoint(path, group, checksums=verify)
    check_compatible(manifest, model, path)
    saved_world = int(manifest["world_size"])

    entries: dict[str, Any] = {}
    for u in model.flat_units:
        entries[f"model.{u.name}"] = _flat_shard(u, u.flat_param.detach())
    opt_state: dict = {}
    opt_desc = manifest.get("optimizer")
    if optimizer is not None:
        if not opt_desc:
            raise CheckpointError(f"checkpoint {path!r} holds no optimizer state, but an optimizer was given")
        groups_now = [len(g["params"]) for g in optimizer.param_groups]
        if opt_desc.get("groups") != groups_now:
            raise CheckpointError(
                f"checkpoint {path!r}: optimizer param groups hold {opt_desc.get('groups')} parameters, "
                f"this optimizer {groups_now}"
            )
        for unit, p in _optimizer_params(model, optimizer):
            st = opt_state.setdefault(id(p), {})
            for key, d in opt_desc["state"].get(unit.name, {}).items():
                name = f"optim.{unit.name}.{key}"
                if d["kind"] == "shard":
                    st[key] = torch.zeros_like(p.detach(), dtype=getattr(torch, d["dtype"]))
                    entries[name] = _flat_shard(unit, st[key])
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
    if rank < saved_world:
        entries[f"rank_state.{rank}"] = None

    try:
        dcp.load(entries, storage_reader=dcp.FileSystemReader(path), planner=_LoadPlanner(), process_group=group)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"loading checkpoint {path!r} failed: {type(e).__name__}: {e}") from e

    with torch.no_grad():
        for u in model.flat_units:  # padding: zero, whatever was there (bumps the shard's version)
            valid = entries[f"model.{u.name}"].local.numel()
            u.flat_param.detach()[valid:].zero_()
    model.needs_load = False

    if optimizer is not None:
        sd = optimizer.state_dict()
        index = 0
        state = {}
        for unit, p in _optimizer_params(model, optimizer):
            st = opt_state[id(p)]
            for key, d in opt_desc["state"].get(unit.name, {}).items():
                if d["kind"] == "object":
                    st[key] = entries[f"optim.{unit.name}.{key}"]
            if st:
                state[index] = st
            index += 1
        groups = []
        for saved, now in zip(entries["optim.param_groups"], sd["param_groups"]):
            groups.append({**saved, "params": now["params"]})
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    return Loaded(
        path=path, step=int(manifest["step"]), state=entries["state"] or {},
        rank_state=entries.get(f"rank_state.{rank}"), meta=manifest.get("meta") or {},
        manifest=manifest, saved_world_size=saved_world,
    )


__all__ = [
    "CheckpointError", "FlatShard", "Loaded", "MANIFEST", "checkpoint_dir", "check_compatible",
    "incomplete_checkpoints", "latest_checkpoint", "list_checkpoints", "load_checkpoint",
    "read_manifest", "save_checkpoint", "verify_checkpoint",
]
