"""Streaming the full state dict one unit at a time, and writing it as Hugging Face's sharded
safetensors layout without holding more than one unit on the writing rank.

    for unit in model.iter_full_state_dict():   # collective; coordinator: {key: CPU tensor}, else {}
        ...
    export_hf(model, out_dir, max_shard_size="5GB")   # yafsdp.hf: streams through ShardWriter

[Note: streaming export]
``full_state_dict()`` collects every unit on rank 0 before anything is written: an 8B model is
32 GB of fp32 host memory there, and ``save_file`` then copies each tensor into a bytes object
again. The export instead walks the units in the engine's order (``stream_order``): every rank
takes part in each unit's all-gather (:func:`iter_units`), and the coordinator hands that unit's
values -- views into the gathered flat buffers -- to :class:`ShardWriter` before the next gather.

Every tensor's key, shape and output dtype are known before anything is gathered (the wrap
recorded them), so the writer plans the files first: HF's rule (a tensor joins the current file
unless that would pass ``max_shard_size`` and the file already holds something; one larger than
the limit gets a file of its own), the names ``model-0000i-of-0000n.safetensors`` (one file:
``model.safetensors``) and each tensor's byte range. A file's header is therefore written when
the file is opened, and each tensor is converted to the output dtype and written in chunks of
``CHUNK_BYTES`` as it arrives. The writer holds: the unit being gathered (its flat groups, in the
shards' dtype) + one chunk (+ for the merged export one merged fp32 weight). No output file is
ever held in memory; the page cache holds what the kernel chooses, and is not the process's.

Each unit ends with a ``raise_together`` (one small broadcast): a write that failed on the
coordinator (disk full) is raised on every rank there, instead of leaving the others waiting in
the next unit's all-gather. The folder is written as ``<out>.tmp-export`` and renamed at the end
(``yafsdp.hf.export_hf``): a killed export leaves no folder that looks like an export.

:data:`LEDGER` counts the bytes the coordinator holds for the stream (every gathered flat buffer,
converted chunk and merged weight is registered and released when its tensor is freed); the tests
read its peak to check the bound above. The streaming loader counts its buffers into the same
ledger ([Note: streaming loads] in hf_stream.py): one counter for the I/O paths.
"""
from __future__ import annotations

import json
import os
import re
import struct
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..comm import collectives
from ..comm.groups import broadcast_object, check_collective, raise_together

__all__ = ["iter_units", "stream_order", "ShardWriter", "parse_size", "LEDGER", "CHUNK_BYTES", "ExportError"]

CHUNK_BYTES = 64 << 20  # a tensor is converted and written this many bytes (of the output dtype) at a time

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


class ExportError(ValueError):
    """An export that cannot be written as asked; the message names the key, file or value."""


class Ledger:
    """Bytes the writing rank holds for the stream: live tensors registered with :meth:`hold`,
    released when the tensor object is freed (a weak reference), so a tensor kept longer than
    planned stays counted. ``peak`` since the last :meth:`reset`."""

    def __init__(self):
        self.now = 0
        self.peak = 0

    def reset(self) -> None:
        self.peak = self.now

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        self.now += n
        self.peak = max(self.peak, self.now)
        weakref.finalize(t, self._release, n)
        return t

    def _release(self, n: int) -> None:
        self.now -= n


LEDGER = Ledger()


def parse_size(size) -> int:
    """``max_shard_size`` as bytes: an int, or a string as Hugging Face writes them -- "5GB"
    (10**9), "500MB", "10KB", "5GiB" (2**30), "200MiB", "10KiB"; a lower-case final "b" ("5Gb")
    means bits, as in HF's ``convert_file_size_to_int``."""
    if isinstance(size, bool):
        raise ExportError(f"max_shard_size={size!r}: give bytes (an int) or a string like '5GB'")
    if isinstance(size, int):
        if size <= 0:
            raise ExportError(f"max_shard_size={size} must be positive")
        return size
    if not isinstance(size, str):
        raise ExportError(f"max_shard_size={size!r}: give bytes (an int) or a string like '5GB'")
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?[Bb]|[Bb]?)\s*", size, flags=re.IGNORECASE)
    if not m:
        raise ExportError(f"max_shard_size={size!r} is not a size: use an int or e.g. '5GB', '500MB', '2GiB'")
    number, unit = float(m.group(1)), m.group(2)
    scale = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit.upper()]
    value = int(number * scale)
    if unit.endswith("b") and unit.upper() != "B":
        value //= 8  # bits
    if value <= 0:
        raise ExportError(f"max_shard_size={size!r} must be positive")
    return value


# ---------------------------------------------------------------------------- the stream (collective)
def stream_order(rt, keys) -> list[list[tuple[str, str, object]]]:
    """The state-dict entries in the order :func:`iter_units` yields them: one list per unit
    (its groups in order, each group's parameters in layout order, a tied parameter's keys
    together), and a last list with the module buffers."""
    keys_of: dict[int, list[str]] = {}
    for key, kind, ref in keys.entries:
        if kind == "param":
            keys_of.setdefault(id(ref), []).append(key)
    out = []
    for u in rt.all:
        unit = []
        for g in u.groups:
            for p in g.params:
                unit.extend((k, "param", p) for k in keys_of.get(id(p), ()))
        out.append(unit)
    out.append([(key, kind, ref) for key, kind, ref in keys.entries if kind == "buffer"])
    return out


def _gather_unit(rt, u, group, rank: int, spares: list) -> tuple[list, dict]:
    """Collective: every flat group of unit ``u`` gathered; rank 0 gets (the flat buffers, the
    views of each parameter by ``id(ParamInfo)``), the others ([], {}).

    An fp32 group is gathered into the unit's idle fp32 grad buffer when it fits (memory the
    engine holds anyway), else into ``spares[i]`` (the i-th such group of the unit), a buffer kept
    over the whole stream and grown to the largest group: not a new buffer per unit, because the
    received chunk of a finished gloo all-gather stays referenced by the transport until the next
    one (measured: the previous unit's buffer is freed only after the next unit's is allocated),
    which with a fresh buffer per unit would hold two units at a time."""
    flats, values = [], {}
    grad_buffer_free, slot = True, 0
    for g in u.groups:
        shard = rt.to_device(g.shard.detach())  # offload: the host master, moved for the collective
        n = g.layout.padded_numel
        if g.kind.format.stored:  # the records, expanded: the values the model computes with
            records = torch.empty(g.staging_bytes, dtype=torch.uint8, device=rt.device)
            collectives.all_gather(records, shard, group, async_op=False)
            full = g.kind.format.decode(records, g.layout.shard_numel, g.kind.compute_dtype)
            del records
            count = True
        else:
            gs = u.grad_buffer
            if (grad_buffer_free and shard.dtype == torch.float32 and gs is not None and gs.data.dtype == torch.float32
                    and gs.capacity >= n and not gs.reduce_pending):
                full, grad_buffer_free, count = gs.data[:n], False, True
            else:
                if slot == len(spares):
                    spares.append(None)
                have = spares[slot]
                if have is None or have.dtype != shard.dtype or have.numel() < n:
                    spares[slot] = have = None  # the old one goes before the larger one is made
                    have = spares[slot] = torch.empty(n, dtype=shard.dtype, device=rt.device)
                    if rank == 0 and have.device.type == "cpu":
                        LEDGER.hold(have)
                full, slot, count = have[:n], slot + 1, False
            collectives.all_gather(full, shard, group, async_op=False)
        if rank == 0:
            # counted while in use: the NF4 output (new per unit) and a grad-buffer view (memory the
            # engine holds anyway, but it is the unit the stream holds); a spare once, when made
            flats.append(LEDGER.hold(full) if count and full.device.type == "cpu" else full)
            for p, v in zip(g.params, g.layout.views(full)):
                values[id(p)] = v
    return flats, values


@torch.no_grad()
def iter_units(rt, keys, group, rank: int, what: str = "iter_full_state_dict()"
               ) -> Iterator[dict[str, torch.Tensor] | None]:
    """Collective generator: per entry of :func:`stream_order`, rank 0 gets ``{key: tensor}`` in
    that order -- views into this unit's gathered flat buffers (on the engine's device, in the
    shards' dtype; NF4 groups dequantized), valid until the next iteration -- and the other ranks
    None. Every rank must run it to the end (or close it at the same unit). See [Note: streaming
    export]."""
    check_collective(what, group)
    order = stream_order(rt, keys)
    spares: list = []  # See _gather_unit
    for u, unit_entries in zip(rt.all, order):
        flats, values = _gather_unit(rt, u, group, rank, spares)
        out = {key: values[id(ref)] for key, _, ref in unit_entries} if rank == 0 else None
        del values
        yield out
        del out, flats  # before the next unit is gathered: at most one unit is held
    yield {key: ref[0]._buffers[ref[1]].detach() for key, _, ref in order[-1]} if rank == 0 else None


# ---------------------------------------------------------------------------- the writer (coordinator)
@dataclass
class _File:
    name: str
    entries: list = field(default_factory=list)  # (key, shape, dtype, begin, end)
    size: int = 0


class ShardWriter:
    """Writes tensors, in a planned order, into HF's safetensors files in folder ``folder``.

    ``plan`` lists ``(key, shape, dtype)`` in the order :meth:`write` will be called; the files,
    their headers and every tensor's byte range follow from it (see [Note: streaming export]).
    ``write(key, tensor)`` converts ``tensor`` to the planned dtype chunk by chunk and appends it;
    ``close()`` checks everything was written and writes ``model.safetensors.index.json`` when
    there is more than one file. Not collective."""

    def __init__(self, folder: str, plan: list[tuple[str, tuple, torch.dtype]], max_shard_size,
                 *, prefix: str = "model", metadata: dict | None = None):
        limit = parse_size(max_shard_size)
        self.folder = folder
        self.prefix = prefix
        self.metadata = {"format": "pt", **(metadata or {})}
        files: list[_File] = []
        seen = set()
        for key, shape, dtype in plan:
            if key in seen:
                raise ExportError(f"key {key!r} is planned twice")
            seen.add(key)
            if dtype not in _ST_DTYPES:
                raise ExportError(f"key {key!r}: dtype {dtype} has no safetensors code")
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            if not files or (files[-1].size + nbytes > limit and files[-1].entries):
                files.append(_File(""))
            f = files[-1]
            f.entries.append((key, tuple(shape), dtype, f.size, f.size + nbytes))
            f.size += nbytes
        if not files:
            files.append(_File(""))
        n = len(files)
        for i, f in enumerate(files):
            f.name = f"{prefix}.safetensors" if n == 1 else f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
        self.files = files
        self.total_size = sum(f.size for f in files)
        self._queue = [(fi, e) for fi, f in enumerate(files) for e in f.entries]
        self._next = 0
        self._open_index = -1
        self._handle = None

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.files]

    def _open(self, fi: int) -> None:
        self._finish_file()
        f = self.files[fi]
        header = {"__metadata__": self.metadata}
        for key, shape, dtype, b, e in f.entries:
            header[key] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [b, e]}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned, as safetensors pads it
        self._handle = open(os.path.join(self.folder, f.name), "wb")
        self._handle.write(struct.pack("<Q", len(blob)))
        self._handle.write(blob)
        self._open_index = fi

    def _finish_file(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None

    def write(self, key: str, tensor: torch.Tensor, via: torch.dtype | None = None) -> None:
        """Append ``tensor`` (any device and dtype) as ``key``, the next key of the plan, converted
        to the planned dtype ``CHUNK_BYTES`` at a time (first rounded to ``via`` when given: the
        parameter's original dtype, as ``full_state_dict()`` gives it)."""
        if self._next >= len(self._queue):
            raise ExportError(f"key {key!r} was not planned (every planned key is written already)")
        fi, (want, shape, dtype, b, e) = self._queue[self._next]
        if key != want:
            raise ExportError(f"key {key!r} written where the plan has {want!r}")
        if tuple(tensor.shape) != shape:
            raise ExportError(f"key {key!r} has shape {tuple(tensor.shape)}, planned {shape}")
        if fi != self._open_index:
            self._open(fi)
        flat = tensor.detach().reshape(-1)
        step = max(1, CHUNK_BYTES // torch.empty((), dtype=dtype).element_size())
        for i in range(0, flat.numel(), step):
            part = flat[i:i + step]
            if via is not None and via != part.dtype:
                part = LEDGER.hold(part.to("cpu", via))
            if part.dtype != dtype or part.device.type != "cpu":
                part = LEDGER.hold(part.to("cpu", dtype))  # a new chunk: counted while it lives
            self._handle.write(part.contiguous().view(torch.uint8).numpy().data)
            del part
        self._next += 1

    def close(self) -> list[str]:
        """Finish the last file; write the index when there are several. Returns the file names."""
        if self._next != len(self._queue):
            missing = [e[0] for _, e in self._queue[self._next:self._next + 5]]
            raise ExportError(f"{len(self._queue) - self._next} planned tensors were not written (first: {missing})")
        if self._open_index < len(self.files) - 1:  # only an empty plan leaves a file unopened
            self._open(len(self.files) - 1)
        self._finish_file()
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total_size},
                     "weight_map": {e[0]: f.name for f in self.files for e in f.entries}}
            with open(os.path.join(self.folder, f"{self.prefix}.safetensors.index.json"), "w") as fh:
                json.dump(index, fh, indent=2, sort_keys=True)
                fh.write("\n")
        return self.names

    def abort(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _write_unit(writer: ShardWriter, items: list) -> None:
    for key, t, via in items:
        writer.write(key, t, via)


def raise_over(problem: str | None, group, then, error: type[Exception]) -> None:
    """Collective: ``raise_together`` over ``group``, the verdict then passed on over group ``then``
    (None: none) from its rank 0 before anyone raises -- a tensor-parallel engine's TP group, whose
    rank 0 holds the verdict of the coordinator's data-parallel group."""
    if then is None:
        raise_together(problem, group, error)
        return
    verdict = broadcast_object(broadcast_object(problem, group), then)
    if verdict:
        raise error(verdict)


def stream_to_writer(units, transform, writer: ShardWriter | None, group, where: str, then=None) -> None:
    """Collective: drive generator ``units`` (from :func:`iter_units`) to the end on every rank;
    on the coordinator (``writer`` set) pass each unit's dict through ``transform`` (returns
    ``[(key, tensor, via)]`` in plan order; ``via``: see :meth:`ShardWriter.write`) into
    ``writer``. A failure on the coordinator is raised on every rank at the end of that unit
    (``ExportError``, naming ``where``), over ``group`` and then over ``then`` (see :func:`raise_over`)."""
    problem = None
    for values in units:
        if writer is not None and problem is None:
            try:
                _write_unit(writer, transform(values))  # a function: its loop variables die with it
            except (OSError, ExportError, RuntimeError) as e:
                writer.abort()
                problem = f"{where}: {type(e).__name__}: {e}"
        del values
        try:
            raise_over(problem, group, then, ExportError)
        except ExportError:
            units.close()  # the generator is left at a unit boundary on every rank alike
            raise
