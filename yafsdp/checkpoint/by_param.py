"""The per-parameter form of a checkpoint: what an engine with tensor-parallel parameters writes, and how any
engine reads a checkpoint written at another TP degree.

[Note: checkpoints with tensor parallelism]
Without TP a checkpoint holds each flat unit as one 1-D tensor of its unpadded length (the *flat* form, [Note:
what a checkpoint holds] in checkpoint/__init__.py). With TP a rank's flat unit holds *local* tensors, TP slices
of the parameters laid end to end, and the first ``numel`` elements of such a unit differ between TP degrees: the
flat form cannot reshard across them. So an engine with TP parameters writes the *params* form: every parameter
under its original name, ``param.<name>``, with its global shape (its optimizer state the same way,
``param_optim.<key>.<name>``: AdamW's ``exp_avg`` and ``exp_avg_sq``). A rank's piece of one parameter is a range
``[a, b)`` of its flattened local tensor (where its data-parallel shard overlaps the parameter); ``boxes``
(layout/pieces.py) cuts such a range into at most ``2 * ndim - 1`` boxes (a partial first row, the whole rows, a partial last row;
recursively inside a row for more than two dims), each contiguous in the flat shard, so each is a view of it and
costs no copy. The box's offsets in the global tensor add the rank's TP offset along its ``Shard`` dim (torch's
``Shard`` splits as ``torch.chunk``: ``ceil(n / T)`` rows per TP rank, the last ones fewer). ``Replicate``
parameters and plain ones (identical on every TP rank) are written by TP rank 0 only; every box is written once,
and together the boxes of all ranks tile each parameter. DCP reads the overlaps of N-d chunks, so a load at any
layout -- another data-parallel size, another TP degree, or none -- asks for its own boxes (:class:`Targets`) and
DCP reads the parts of the saved ones that overlap them: no gather, no rank holding more than its shard.

The other direction: an engine without TP keeps writing the flat form, exactly as before (a checkpoint of an
engine without TP parameters is not changed in any way), and an engine with TP reads it by ranges of the saved
1-D units: each parameter starts in its saved unit where the manifest's list of shapes puts it (a unit lays its
parameters end to end: ``FlatLayout.build`` in layout/flat.py), and a rank reads, per parameter, the whole rows
(along dim 0 of the global shape) that its boxes touch into a buffer, then copies its boxes out of it. The cost:
for a parameter sharded along dim 0 the rows read are the ones needed, plus at most a partial row at each end;
for one sharded along another dim (a row-parallel weight) a rank reads whole rows of which it keeps 1/T, so it
reads T times its share of such parameters and holds that much in host memory during the load (freed after;
never device memory, which the shards and the optimizer state fill). The alternative -- an engine without TP writing the params form when asked -- would need the option
chosen before the save that a resume at another TP degree needs; reading the flat form costs nothing until such
a resume and works for every checkpoint already written.

The manifest of a params checkpoint records ``layout: {"tp": T, "format": "params"}`` (a flat checkpoint has no
``layout``: the flat form at TP 1), its units list global shapes and lengths (contents._units), so a model is
checked against it by name and global shape whatever TP degree either has. A TP engine's save and load run over
the whole world (every data-parallel and TP rank writes or reads its own boxes; HSDP: replica 0 writes, every
replica reads), which must hold exactly the engine's data-parallel x TP ranks; ``rank_state`` is per global rank.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..layout.pieces import copy_out, rows_of, tp_specs
from ..layout.pieces import param_boxes as _param_boxes
from .contents import _optimizer_entries, _optimizer_params, buffer_entries, collect as flat_collect
from .dcp_glue import Chunks, FlatShard
from .files import MANIFEST, CheckpointError
from .safe import encode

__all__ = ["FLAT", "PARAMS", "is_tp", "layout_of", "manifest_layout", "group_of", "collect", "Targets",
           "zero_padding", "param_boxes"]

FLAT, PARAMS = "flat", "params"  # the two forms (the manifest's layout.format)


def param_boxes(info, flat: torch.Tensor, specs: dict, tp_rank: int) -> list:
    """``layout.pieces.param_boxes`` of a plain group; CheckpointError for what a checkpoint cannot place."""
    if info.format is not None:
        raise CheckpointError(f"unit {info.unit!r}: its {info.format} group has no per-parameter form")
    try:
        return _param_boxes(info, flat, specs, tp_rank)
    except ValueError as e:
        raise CheckpointError(f"{e}; a checkpoint cannot place it") from None


def is_tp(model) -> bool:
    """``model`` (a YaFSDP engine) holds tensor-parallel parameters: it saves and loads the params form."""
    return bool(tp_specs(model))


def layout_of(manifest: dict, path: str) -> dict:
    """The checkpoint's layout (``tp``, ``format``); a flat checkpoint records none. CheckpointError for a form this
    code does not read."""
    layout = manifest.get("layout") or {"tp": 1, "format": FLAT}
    if layout.get("format") not in (FLAT, PARAMS):
        raise CheckpointError(
            f"checkpoint {path!r}: {MANIFEST} records the layout {layout!r}, a form this yafsdp does not read (it "
            f"reads {FLAT!r} and {PARAMS!r}); load it with the yafsdp that wrote it and save it again from there")
    return layout


def manifest_layout(model) -> dict:
    """What a save adds to the manifest: nothing without TP (the flat form, unchanged), else the layout."""
    return {"layout": {"tp": model.tp_size, "format": PARAMS}} if is_tp(model) else {}


def group_of(model, what: str):
    """The group a TP engine's checkpoint runs over: the world, which must be exactly its data-parallel x TP
    ranks (every rank writes and reads its own boxes)."""
    ranks = model.replicas * model.world_size * model.tp_size
    if ranks != dist.get_world_size():
        raise CheckpointError(
            f"{what}: the engine's data-parallel x TP ranks ({model.replicas} x {model.world_size} x {model.tp_size} "
            f"= {ranks}) are not the world ({dist.get_world_size()} ranks); a checkpoint of tensor-parallel "
            "parameters is written and read by the whole world: build the DeviceMesh over every rank")
    return dist.group.WORLD


# ----------------------------------------------------------------------------------------- save
def collect(model, optimizer, state, rank_states: dict) -> tuple[dict, dict | None]:
    """(DCP entries, the manifest's optimizer description) of one save: the flat form without TP
    (contents.collect, unchanged), else the params form. Every rank lists every parameter (``needed_bytes``
    counts each once), with the boxes it writes: replica 0's, and of a replicated parameter TP rank 0's only."""
    if not is_tp(model):
        return flat_collect(model, optimizer, state, rank_states)
    specs, tp_rank = tp_specs(model), model.tp_rank
    entries: dict[str, Any] = {}

    def add(info, tensor, name_of):
        for name, shape, boxes in param_boxes(info, tensor, specs, tp_rank):
            spec = specs.get(name)
            writes = model.replica == 0 and (tp_rank == 0 or (spec is not None and spec.sharded))
            entries[name_of(name)] = Chunks(boxes if writes else [], shape, tensor.dtype)

    for info in model.shard_info():
        add(info, info.param.detach(), lambda n: f"param.{n}")
    opt_desc = None
    if optimizer is not None:
        opt_entries, opt_desc = _optimizer_entries(model, optimizer)
        for info, p in _optimizer_params(model, optimizer):
            for key, d in opt_desc["state"][info.key].items():
                if d["kind"] == "shard":  # the flat form's 1-D shard state, here per parameter
                    del opt_entries[f"optim.{info.key}.{key}"]
                    add(info, optimizer.state[p][key].detach(), lambda n, key=key: f"param_optim.{key}.{n}")
        for k, v in opt_entries.items():  # non-tensor state and the param groups: see safe.encode
            entries[k] = v if isinstance(v, (FlatShard, torch.Tensor)) else encode(v, k)
    if model.coordinator:  # one copy of the buffers, global rank 0's (contents.buffer_entries)
        entries.update(buffer_entries(model))
    entries["state"] = encode(dict(state or {}), "state")
    for key, st in rank_states.items():
        entries[f"rank_state.{key}"] = encode(st, f"rank_state (rank {key})")
    return entries, opt_desc


# ----------------------------------------------------------------------------------------- load
class Targets:
    """What a load reads into when the checkpoint or the engine has TP (the params form on either side): the DCP
    entries and the copies to run after ``dcp.load``. See [Note: checkpoints with tensor parallelism]."""

    def __init__(self, model, manifest: dict, path: str):
        self.form = layout_of(manifest, path)["format"]
        self.specs, self.tp_rank = tp_specs(model), model.tp_rank
        self.entries: dict[str, Any] = {}
        self._copies: list = []
        self._saved: dict[str, tuple[str, int, int]] = {}  # flat form: name -> (unit key, offset, unit numel)
        if self.form == FLAT:
            for unit in manifest.get("units", []):
                offset = 0
                for name, shape in unit["params"]:
                    self._saved[name] = (unit["name"], offset, int(unit["numel"]))
                    offset += torch.Size(shape).numel()

    def add(self, info, tensor: torch.Tensor, param_key, flat_key) -> None:
        """Read this rank's part of every parameter of ``info`` into ``tensor`` (its shard, or optimizer state
        shaped like it): from ``param_key(name)`` (params form) or from ``flat_key(unit)`` (flat form)."""
        for name, shape, boxes in param_boxes(info, tensor, self.specs, self.tp_rank):
            if self.form == PARAMS:
                self.entries[param_key(name)] = Chunks(boxes, shape, tensor.dtype)
            elif boxes:
                self._add_rows(name, shape, boxes, tensor, flat_key)

    def _add_rows(self, name, shape, boxes, tensor, flat_key) -> None:
        """The whole rows (dim 0 of the global shape) of parameter ``name`` that ``boxes`` touch, read from its
        saved 1-D unit into a buffer; the boxes copied out of it after the load (:meth:`finish`)."""
        unit, start, unit_numel = self._saved[name]
        first, end, inner = rows_of(shape, boxes)
        rows = torch.empty((end - first) * inner, dtype=tensor.dtype)  # host memory, never the device's
        chunks = self.entries.setdefault(flat_key(unit), Chunks([], (unit_numel,), tensor.dtype))
        chunks.pieces.append(((start + first * inner,), rows))
        self._copies.append((rows, shape, boxes))

    def finish(self) -> None:
        """After ``dcp.load``: the boxes read by rows copied into place, the buffers dropped."""
        for rows, shape, boxes in self._copies:
            copy_out(rows, shape, boxes)
        self._copies = []


@torch.no_grad()
def zero_padding(model) -> None:
    """After a load: the padding past each unit's unpadded length is zero (as ``contents._zero_padding``)."""
    for i in model.shard_info():
        i.param.detach()[max(0, min(i.shard_numel, i.numel - i.shard_start)):].zero_()
