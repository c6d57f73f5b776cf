"""Streaming loads: safetensors weights into a wrapped model, each rank reading only its slices.

    model = yafsdp.YaFSDP(meta_built_model)           # needs_load: shards allocated, zero
    load_streaming(model, [SafetensorsSource(path)])  # collective: each rank reads its byte ranges

``yafsdp.hf.load_hf_weights`` is this with one checkpoint folder; ``yafsdp.peft_load`` adds a
second source (the adapters PEFT initialised) and a renaming (PEFT's ``base_layer`` names).

[Note: streaming loads]
No rank ever holds the whole model, and no rank holds more of it than its own shards plus one
flat group's slice (only where it cannot be written in place) and one bounded read buffer:

- Every rank opens the checkpoint's safetensors files (``_File`` reads the JSON header only;
  the data stays in the file) and checks the keys, shapes and dtypes against the model's
  ``StateDictKeys`` -- missing, unexpected, misshapen, or stored as a non-floating dtype where a
  parameter is. The ranks agree (an all-gather of each rank's verdict over the shard group, then
  over the replicate group) and every rank raises the same error before any shard is written.
- Then, for each stored shard (``Runtime.stored_shards``: [Note: stored shards] in unit.py), the
  rank computes which element range of which parameter falls into its slice of the flat layout.
  A range of a row-major tensor is one contiguous byte range of its file, so each is one
  ``pread``: straight into the destination when it has the stored dtype, else in pieces of at most
  ``READ_BYTES`` into one scratch buffer (allocated once per load), each converted by a single
  copy into the destination. The destination is the stored shard itself when it is in host
  memory (a CPU engine, or offload): the fp32 master, or a frozen shard in ``param_dtype`` (the
  copy rounds as ``write_shard``'s would);
  for an NF4 group (quantized from its ``param_dtype`` values) or a device shard it is one host
  vector of the slice, then ``state_dict.write_shard`` (the old rank-0 scatter's end) writes it.
  The elements no parameter covers (padding) are zeroed. Each stored value is rounded once into
  the shard's dtype, as ``load_full_state_dict``'s fp32 path rounds it, so the shards are
  bit-identical to it. Measured (benchmarks/results/io_cpu_2026-11-26.md): the earlier reader
  (``safe_open(...).get_slice`` per row block, a bf16 tensor per read, an fp32 slice vector,
  then a copy into the shard) made four passes over every byte and ran at 0.48 GB/s.
- HSDP: every replica's rank reads the same ranges itself -- the replicas hold identical shards
  without a broadcast. Module buffers in the checkpoint are read whole by every rank.

Why each rank reads rather than rank 0 streaming a unit at a time: the ranks read 1/N of every
tensor in parallel (one model's bytes in all per shard group), with no collective for the data
and no rank holding a whole unit; the price is that every rank must see the files -- which
``read_hf_config`` already asks of every rank for config.json. A read that fails midway (an I/O
error after the checks) leaves the shards partly written: load again.

The bytes the loader holds are counted (``export.LEDGER``, the one counter the streaming export
uses too): the scratch buffer and every slice vector it allocates are registered and counted until
freed, so a test can bound the loader's peak (tests/multirank/test_hf_stream.py) without timing or RSS.
"""
from __future__ import annotations

import json
import math
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .export import _ST_DTYPES, LEDGER
from .hf_files import INDEX, HFCheckpointError, weight_files

__all__ = ["READ_BYTES", "Entry", "SafetensorsSource", "TensorSource", "load_streaming"]

READ_BYTES = 64 << 20  # the most one converting read from a file holds (the scratch buffer's size)

# safetensors' dtype names -> torch dtypes (the inverse of export's table)
_DTYPES = {code: dt for dt, code in _ST_DTYPES.items()}


@dataclass
class Entry:
    """One tensor of a source: its shape, stored dtype, and how to read a range of its elements."""

    shape: tuple
    dtype: str  # as stored ("BF16", "F32", ... for safetensors; str(torch dtype) for tensors)
    floating: bool
    # (start, stop, out, scratch): flattened elements [start, stop) into 1-D contiguous ``out``, converted
    # to out's dtype; ``scratch``: a 1-D uint8 CPU tensor a converting read may use (see load_streaming)
    read: Callable[[int, int, torch.Tensor, torch.Tensor], None]


def _pread_into(fd: int, offset: int, dest: torch.Tensor, where: str) -> None:
    """The file's bytes from ``offset`` into contiguous CPU tensor ``dest``'s memory, whole."""
    mv = memoryview(dest.view(-1).view(torch.uint8).numpy()).cast("B")
    while len(mv):
        got = os.preadv(fd, [mv], offset)
        if got <= 0:
            raise OSError(f"{where}: the file ends at byte {offset}, before the tensor's data does")
        mv, offset = mv[got:], offset + got


class NonFiniteWeights(ValueError):
    """A tensor read from a checkpoint holds NaN or inf; the message names the file and the tensor."""


class _File:
    """One safetensors file: its header parsed (8-byte little-endian length, then JSON), its tensors
    read by byte range with ``pread`` -- no mapping, so what the loader holds is what it allocated."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)
        size = os.fstat(self.fd).st_size
        raw = os.pread(self.fd, 8, 0)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 0 < n <= min(size - 8, 100 << 20):
            raise ValueError(f"header length {n} does not fit the file's {size} bytes")
        header = json.loads(os.pread(self.fd, n, 8))
        header.pop("__metadata__", None)
        base = 8 + n
        self.tensors = {}  # key -> (shape, dtype name, torch dtype, byte offset of its data in the file)
        for k, h in header.items():
            shape, code, (b, e) = tuple(h["shape"]), h["dtype"], h["data_offsets"]
            dt = _DTYPES.get(code)
            if dt is None:
                raise ValueError(f"tensor {k!r} has dtype {code!r}, which this loader does not read")
            if e - b != math.prod(shape) * dt.itemsize or not 0 <= b <= e <= size - base:
                raise ValueError(f"tensor {k!r}: data_offsets [{b}, {e}] do not fit shape {shape} x {code} "
                                 f"in a file of {size} bytes")
            self.tensors[k] = (shape, code, dt, base + b)

    def read(self, key: str, start: int, stop: int, out: torch.Tensor, scratch: torch.Tensor) -> None:
        """Elements [start, stop) of row-major ``key`` into 1-D contiguous ``out``: one read straight
        into ``out`` when it has the stored dtype, else reads of at most ``scratch``'s bytes, each
        converted by one copy into its part of ``out`` (no other intermediate)."""
        _, _, dt, at = self.tensors[key]
        size = dt.itemsize
        where = f"{self.path!r}, tensor {key!r}"
        if out.dtype == dt and out.device.type == "cpu":
            _pread_into(self.fd, at + start * size, out, where)
        else:
            step = max(1, scratch.numel() // size)
            for i in range(start, stop, step):
                j = min(stop, i + step)
                part = scratch[:(j - i) * size]
                _pread_into(self.fd, at + i * size, part, where)
                out[i - start:j - start].copy_(part.view(dt))
        seg = out[:stop - start]
        if seg.is_floating_point() and not bool(torch.isfinite(seg).all()):  # one pass over what was read
            bad = torch.logical_not(torch.isfinite(seg)).nonzero()[0].item()
            raise NonFiniteWeights(f"{where} holds NaN/inf (the first at element {start + bad} of the flattened "
                                   "tensor)")


class SafetensorsSource:
    """The tensors of an HF checkpoint folder (``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` lists), read lazily. Opening reads the headers only."""

    def __init__(self, path: str):

        self.path = path
        self.entries: dict[str, Entry] = {}
        self._files = []
        where: dict[str, str] = {}
        for f in weight_files(path):
            try:
                h = _File(f)
            except Exception as e:  # noqa: BLE001
                raise HFCheckpointError(f"{f!r} cannot be read as safetensors ({type(e).__name__}: {e})") from None
            self._files.append(h)
            for k, (shape, code, _, _) in h.tensors.items():
                if k in where:
                    raise HFCheckpointError(f"{path!r}: tensor {k!r} is in both {where[k]!r} and "
                                            f"{os.path.basename(f)!r}")
                where[k] = os.path.basename(f)
                self.entries[k] = Entry(shape, code, code.startswith(("F", "BF")),
                                        lambda a, b, out, scratch, h=h, k=k: h.read(k, a, b, out, scratch))
        index = os.path.join(path, INDEX)
        if len(self._files) > 1 or not os.path.isfile(os.path.join(path, "model.safetensors")):
            with open(index) as fh:
                listed = json.load(fh)["weight_map"]
            wrong = sorted(k for k in set(listed) | set(where) if listed.get(k) != where.get(k))
            if wrong:
                k = wrong[0]
                raise HFCheckpointError(f"{index!r} does not match its files: {len(wrong)} tensor(s) differ, e.g. "
                                        f"{k!r} listed in {listed.get(k)!r} but found in {where.get(k)!r}")

    def describe(self) -> str:
        return repr(self.path)


class TensorSource:
    """Tensors in memory (every rank holds the same values), under the model's own keys."""

    def __init__(self, tensors: dict[str, torch.Tensor], what: str = "tensors in memory"):
        self.what = what
        self.entries = {k: Entry(tuple(t.shape), str(t.dtype), t.is_floating_point(),
                                 lambda a, b, out, scratch, t=t: out.copy_(t.detach().reshape(-1)[a:b]))
                        for k, t in tensors.items()}

    def describe(self) -> str:
        return self.what


def _tp_slice(e: Entry, spec, shape: tuple, tp_rank: int) -> Entry:
    """Entry ``e`` of a full tensor read as this TP rank's local tensor of layout ``spec`` (a TPSpec; ``shape``:
    the local shape). ``Shard(d)`` holds torch's chunk ``tp_rank`` of dim ``d`` (``ceil(n / T)`` rows each, the
    last ones fewer): for each index of the dims before ``d`` one contiguous run of the full tensor, so a range
    of the local elements is one read per run it touches (a column-parallel or an embedding slice: one read;
    a row-parallel one: one per row). ``Replicate``: the full tensor itself."""
    place = spec.placements[0]
    if not place.is_shard():
        return e
    full = tuple(spec.shape)
    d = place.dim % len(full)
    n, size = full[d], spec.mesh.size()
    first = min(tp_rank * -(-n // size), n)  # torch's chunk: ceil(n / size) rows a rank
    inner = math.prod(full[d + 1:])
    local_run, full_run = shape[d] * inner, n * inner  # one index of the dims before d: its elements

    def read(start: int, stop: int, out: torch.Tensor, scratch: torch.Tensor) -> None:
        i = start
        while i < stop:
            outer, within = divmod(i, local_run)
            j = min(stop, (outer + 1) * local_run)
            at = outer * full_run + first * inner + within
            e.read(at, at + j - i, out[i - start:j - start], scratch)
            i = j
    return Entry(shape, e.dtype, e.floating, read)


def _resolve(keys, sources: list[tuple[object, Callable[[str], str] | None]], tp=None):
    """(entry per ParamInfo id, entry per buffer key, problem or None). ``sources``: (source,
    rename), where rename maps a model key to the source's key (None: the same key); the first
    source holding a key gives it. A source's key no model key takes is unexpected. ``tp``: a
    tensor-parallel engine's ``TPLayout``: a TP parameter's entry must have its global shape and is
    read as this rank's slice (:func:`_tp_slice`)."""
    view, used = {}, [set() for _ in sources]
    by_param, buffers = {}, {}
    not_float, wrong_global = [], []
    for key, kind, ref in keys.entries:
        for i, (src, rename) in enumerate(sources):
            skey = rename(key) if rename is not None else key
            e = src.entries.get(skey)
            if e is None:
                continue
            used[i].add(skey)
            if kind == "param" and ref.tp is not None:
                if tuple(e.shape) != tuple(ref.tp.shape):
                    wrong_global.append(f"{skey!r} has shape {tuple(e.shape)}, expected {tuple(ref.tp.shape)}")
                    e = Entry(tuple(ref.shape), e.dtype, e.floating, e.read)  # reported above, not again
                else:
                    e = _tp_slice(e, ref.tp, tuple(ref.shape), tp.rank)
            view[key] = e
            if kind == "param":
                by_param.setdefault(id(ref), e)
                if not e.floating:
                    not_float.append(f"{skey!r} is stored as {e.dtype}, expected a floating-point dtype")
            else:
                buffers[key] = e
            break
    for (src, _), u in zip(sources, used):
        for skey in src.entries:
            if skey not in u:
                view.setdefault(f"{skey} (in {src.describe()})", src.entries[skey])
    problem = keys.validate(view)
    if not_float or wrong_global:
        problem = "; ".join(([problem] if problem else []) + wrong_global[:10] + not_float[:10])
    return by_param, buffers, problem


def _agree(problem: str | None, model) -> str | None:
    """Collective: the first rank's problem (in rank order), on every rank of the shard group, of the
    replicate group and of the TP group (a tensor-parallel engine: its ranks read different slices)."""
    tp = model._tp.group if model._tp is not None else None
    for group in (model.process_group, model.replicate_group, tp):
        if group is None or dist.get_world_size(group) == 1:
            continue
        got = [None] * dist.get_world_size(group)
        dist.all_gather_object(got, problem, group=group)
        problem = next((p for p in got if p), None)
    return problem


@torch.no_grad()
def _dtype_of(g) -> torch.dtype:
    """The dtype ``write_shard`` takes group ``g``'s values in without another rounding."""
    return g.kind.compute_dtype if g.kind.format.stored else g.shard.dtype


def _fill(g, lo: int, n: int, out: torch.Tensor, by_param: dict, scratch: torch.Tensor) -> None:
    """Elements [lo, lo + n) of flat group ``g`` into 1-D ``out``: each parameter's part read from its
    source, every element no parameter covers (padding, alignment gaps) set to zero."""
    at = 0
    for p in sorted(g.params, key=lambda p: p.offset):
        a, b = max(lo, p.offset), min(lo + n, p.offset + p.numel)
        if a >= b:
            continue
        if a - lo > at:
            out[at:a - lo].zero_()
        by_param[id(p)].read(a - p.offset, b - p.offset, out[a - lo:b - lo], scratch)
        at = max(at, b - lo)
    if at < n:
        out[at:].zero_()


def load_streaming(model, sources: list, *, error: type[Exception] = ValueError, what: str = "load") -> None:
    """Collective. Fill every stored shard and checkpointed buffer of wrapped ``model`` from
    ``sources`` (a list of sources, or of (source, rename) pairs), each rank reading only its own
    slices. Checked on every rank first; nothing is modified on error. See [Note: streaming loads]."""
    from ..comm.groups import check_collective
    from ..wrapper.state_dict import load_buffers, write_shard

    check_collective(f"{what}()", model.process_group)
    model.check_idle(what)
    rt = model._rt
    pairs = [s if isinstance(s, tuple) else (s, None) for s in sources]
    try:
        by_param, buffers, problem = _resolve(model._keys, pairs, model._tp)
    except Exception as e:  # noqa: BLE001 - still agree with the other ranks before raising
        by_param, buffers, problem = {}, {}, f"{type(e).__name__}: {e}"
    problem = _agree(problem, model)
    if problem:
        raise error(f"{' + '.join(s.describe() for s, _ in pairs)} does not fit the model: {problem}")
    # one converting read's room, for every group: at most READ_BYTES, never more than the largest slice
    # (4 bytes an element: a wider stored dtype, F64, is read in pieces of fewer elements)
    widest = max((g.layout.shard_numel * 4 for _, g, _, _ in rt.stored_shards()), default=0)
    scratch = LEDGER.hold(torch.empty(min(READ_BYTES, max(widest, 64)), dtype=torch.uint8))

    def direct(g):  # a host shard that stores the values as they are (not NF4): written in place
        return g.shard.device.type == "cpu" and not g.kind.format.stored

    indirect = [s for s in rt.stored_shards() if not direct(s.group)]
    try:
        _fill_all(rt, by_param, scratch, direct, indirect, write_shard)
        bad = None
    except NonFiniteWeights as e:  # a rank's own slices only: every rank must hear of it
        bad = str(e)
    bad = _agree(bad, model)
    if bad:
        rt.invalidate_buffers()
        raise error(f"{bad}: the model's weights are now partly overwritten; load again from finite weights")

    def fill(key, b):
        flat = LEDGER.hold(torch.empty(b.numel(), dtype=b.dtype))
        buffers[key].read(0, b.numel(), flat, scratch)
        b.copy_(flat.view(b.shape))

    try:
        load_buffers(rt, model._keys, fill)
    except NonFiniteWeights as e:  # buffers are read whole, alike on every rank
        raise error(str(e)) from None
    del scratch
    rt.invalidate_buffers()
    model.mark_loaded()


def _fill_all(rt, by_param, scratch, direct, indirect, write_shard) -> None:
    """Every stored shard of ``rt`` from its sources (see load_streaming)."""
    slab = None
    for u, g, _, _ in rt.stored_shards():  # See [Note: stored shards] in unit.py
        lo, n = g.layout.shard_start, g.layout.shard_numel
        if direct(g):
            # straight into the stored shard (fp32 master or frozen shard, on a CPU engine or offloaded):
            # each range converted once from the file's dtype, as write_shard's copy would round it;
            # the padding zeroed here
            _fill(g, lo, n, g.shard.detach(), by_param, scratch)
            continue
        # an NF4 group (encoded from its param_dtype values) or a device shard: this rank's slice of
        # the flat group in the dtype write_shard stores from, on the host, then written once
        dtype = _dtype_of(g)
        if slab is None:  # one host vector for every such group, sized to the largest: touched once
            most = max(s.group.layout.shard_numel * _dtype_of(s.group).itemsize for s in indirect)
            slab = LEDGER.hold(torch.empty(most, dtype=torch.uint8))
        out = slab[:n * dtype.itemsize].view(dtype)
        _fill(g, lo, n, out, by_param, scratch)
        write_shard(rt, g, out.to(rt.device))  # consumed before the next group overwrites the slab
        del out


def load_host_bytes(layouts, compute_itemsize: int) -> int:
    """Host bytes the streaming loader holds at its peak on one rank, beyond the engine's own
    allocations (``python -m yafsdp plan``'s "host at load" row), at most: one flat group's slice
    (on a CPU engine only an NF4 group's, in ``param_dtype``; on a GPU engine any group's, in its
    shard's dtype: at most fp32), the NF4 slice, and the scratch of one converting read (at most
    ``READ_BYTES``, never more than a slice in fp32). ``layouts``: the units' ``layout.sizing.UnitShape``."""
    big = max((max(lay.trainable_shard, lay.frozen_shard, lay.nf4_shard) for lay in layouts), default=0)
    nf4 = max((lay.nf4_shard for lay in layouts), default=0)
    return 4 * big + compute_itemsize * nf4 + min(READ_BYTES, 4 * big)
