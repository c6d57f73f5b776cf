"""Streaming loads: safetensors weights into a wrapped model, each rank reading only its slices.

    model = yafsdp.YaFSDP(meta_built_model)           # needs_load: shards allocated, zero
    load_streaming(model, [SafetensorsSource(path)])  # collective: each rank reads its byte ranges

``yafsdp.hf.load_hf_weights`` is this with one checkpoint folder; ``yafsdp.peft_load`` adds a
second source (the adapters PEFT initialised) and a renaming (PEFT's ``base_layer`` names).

[Note: streaming loads]
No rank ever holds the whole model, and no rank holds more of it than its own shards plus one
flat group's slice in fp32 and one bounded read:

- Every rank opens the checkpoint's safetensors files (``safe_open`` reads the JSON header only;
  the data stays in the file) and checks the keys, shapes and dtypes against the model's
  ``StateDictKeys`` -- missing, unexpected, misshapen, or stored as a non-floating dtype where a
  parameter is. The ranks agree (an all-gather of each rank's verdict over the shard group, then
  over the replicate group) and every rank raises the same error before any shard is written.
- Then, for each stored shard (``Runtime.stored_shards``: [Note: stored shards] in unit.py), the
  rank computes which element range of which parameter falls into its slice of the flat layout
  and reads exactly those elements with ``get_slice`` (whole rows, or one partial row at a slice's
  ends, in reads of at most ``READ_BYTES``), converting the stored dtype (bf16, fp16, fp32) to fp32
  on the fly into a zeroed fp32 vector of the shard's length (the padding stays zero). That
  vector then goes where the old rank-0 scatter's output went (``state_dict.write_shard``): copied
  into the fp32 master, rounded into a frozen shard, or rounded and NF4-quantized by this rank.
  Arithmetic is the same as ``load_full_state_dict``'s, so the shards are bit-identical to it.
- HSDP: every replica's rank reads the same ranges itself -- the replicas hold identical shards
  without a broadcast. Module buffers in the checkpoint are read whole by every rank.

Why each rank reads rather than rank 0 streaming a unit at a time: the ranks read 1/N of every
tensor in parallel (one model's bytes in all per shard group), with no collective for the data
and no rank holding a whole unit; the price is that every rank must see the files -- which
``read_hf_config`` already asks of every rank for config.json. A read that fails midway (an I/O
error after the checks) leaves the shards partly written: load again.

The bytes the loader holds are counted (``HELD``): every tensor it reads from a file and every
scratch vector it allocates is registered and counted until it is freed, so a test can bound the
loader's peak (tests/multirank/test_hf_stream.py) without timing or RSS.
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

from .hf_files import INDEX, HFCheckpointError, weight_files

__all__ = ["HELD", "READ_BYTES", "Entry", "SafetensorsSource", "TensorSource", "load_streaming"]

READ_BYTES = 64 << 20  # the most one read from a file holds (at least one row of the tensor)


class Held:
    """Bytes of the tensors the loader has read or allocated and not yet freed; ``peak`` since ``reset``."""

    def __init__(self):
        self.current = 0
        self.peak = 0

    def reset(self) -> None:
        self.peak = self.current

    def take(self, t: torch.Tensor) -> torch.Tensor:
        n = t.untyped_storage().nbytes()
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(t, self._free, n)
        return t

    def _free(self, n: int) -> None:
        self.current -= n


HELD = Held()


@dataclass
class Entry:
    """One tensor of a source: its shape, stored dtype, and how to read a range of its elements."""

    shape: tuple
    dtype: str  # as stored ("BF16", "F32", ... for safetensors; str(torch dtype) for tensors)
    floating: bool
    read: Callable[[int, int, torch.Tensor], None]  # (start, stop, out): flattened elements -> 1-D out


def _read_range(sl, shape: tuple, start: int, stop: int, out: torch.Tensor, prefix: tuple = ()) -> None:
    """Elements [start, stop) of the row-major tensor ``sl[prefix]`` (of shape ``shape``) into 1-D
    ``out`` (converted to out's dtype), reading whole rows, or a partial row at either end."""
    if start >= stop:
        return
    if not shape:  # a scalar
        out.copy_(HELD.take(sl[prefix] if prefix else sl[...]).reshape(-1))
        return
    if len(shape) == 1:
        out.copy_(HELD.take(sl[prefix + (slice(start, stop),)]))
        return
    row = math.prod(shape[1:])
    first, last = -(-start // row), stop // row  # the whole rows in [start, stop)
    if first > last:  # inside one row
        r = start // row
        _read_range(sl, shape[1:], start - r * row, stop - r * row, out, prefix + (r,))
        return
    head = first * row - start
    _read_range(sl, shape[1:], row - head, row, out[:head], prefix + (first - 1,))
    itemsize = max(1, out.element_size())
    step = max(1, READ_BYTES // (row * itemsize))
    for r in range(first, last, step):
        r2 = min(last, r + step)
        chunk = HELD.take(sl[prefix + (slice(r, r2),)])
        at = head + (r - first) * row
        out[at:at + (r2 - r) * row].copy_(chunk.reshape(-1))
        del chunk
    _read_range(sl, shape[1:], 0, stop - last * row, out[head + (last - first) * row:], prefix + (last,))


class SafetensorsSource:
    """The tensors of an HF checkpoint folder (``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` lists), read lazily. Opening reads the headers only."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        self.entries: dict[str, Entry] = {}
        self._files = []
        where: dict[str, str] = {}
        for f in weight_files(path):
            try:
                h = safe_open(f, framework="pt", device="cpu")
                keys = list(h.keys())
                slices = {k: h.get_slice(k) for k in keys}
            except Exception as e:  # noqa: BLE001
                raise HFCheckpointError(f"{f!r} cannot be read as safetensors ({type(e).__name__}: {e})") from None
            self._files.append(h)
            for k, sl in slices.items():
                if k in where:
                    raise HFCheckpointError(f"{path!r}: tensor {k!r} is in both {where[k]!r} and "
                                            f"{os.path.basename(f)!r}")
                where[k] = os.path.basename(f)
                shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
                self.entries[k] = Entry(shape, dtype, dtype.startswith(("F", "BF")),
                                        lambda a, b, out, sl=sl, shape=shape: _read_range(sl, shape, a, b, out))
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
                                 lambda a, b, out, t=t: out.copy_(t.detach().reshape(-1)[a:b]))
                        for k, t in tensors.items()}

    def describe(self) -> str:
        return self.what


def _resolve(keys, sources: list[tuple[object, Callable[[str], str] | None]]):
    """(entry per ParamInfo id, entry per buffer key, problem or None). ``sources``: (source,
    rename), where rename maps a model key to the source's key (None: the same key); the first
    source holding a key gives it. A source's key no model key takes is unexpected."""
    view, used = {}, [set() for _ in sources]
    by_param, buffers = {}, {}
    not_float = []
    for key, kind, ref in keys.entries:
        for i, (src, rename) in enumerate(sources):
            skey = rename(key) if rename is not None else key
            e = src.entries.get(skey)
            if e is None:
                continue
            used[i].add(skey)
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
    if not_float:
        problem = "; ".join(([problem] if problem else []) + not_float[:10])
    return by_param, buffers, problem


def _agree(problem: str | None, model) -> str | None:
    """Collective: the first rank's problem (in rank order), on every rank of the shard group and
    of the replicate group."""
    for group in (model.process_group, model.replicate_group):
        if group is None or dist.get_world_size(group) == 1:
            continue
        got = [None] * dist.get_world_size(group)
        dist.all_gather_object(got, problem, group=group)
        problem = next((p for p in got if p), None)
    return problem


@torch.no_grad()
def load_streaming(model, sources: list, *, error: type[Exception] = ValueError, what: str = "load") -> None:
    """Collective. Fill every stored shard and checkpointed buffer of wrapped ``model`` from
    ``sources`` (a list of sources, or of (source, rename) pairs), each rank reading only its own
    slices. Checked on every rank first; nothing is modified on error. See [Note: streaming loads]."""
    from ..comm.groups import check_collective
    from ..core.state_dict import write_shard

    check_collective(f"{what}()", model.process_group)
    model.check_idle(what)
    rt = model._rt
    pairs = [s if isinstance(s, tuple) else (s, None) for s in sources]
    try:
        by_param, buffers, problem = _resolve(model._keys, pairs)
    except Exception as e:  # noqa: BLE001 - still agree with the other ranks before raising
        by_param, buffers, problem = {}, {}, f"{type(e).__name__}: {e}"
    problem = _agree(problem, model)
    if problem:
        raise error(f"{' + '.join(s.describe() for s, _ in pairs)} does not fit the model: {problem}")
    for u, g, _, _ in rt.stored_shards():  # See [Note: stored shards] in unit.py
        lo, n = g.layout.shard_start, g.layout.shard_numel
        out = HELD.take(torch.zeros(n, dtype=torch.float32))  # this rank's slice of the flat group, padding zero
        for p in g.params:
            a, b = max(lo, p.offset), min(lo + n, p.offset + p.numel)
            if a < b:
                by_param[id(p)].read(a - p.offset, b - p.offset, out[a - lo:b - lo])
        write_shard(rt, g, out.to(rt.device))
        del out
    for key, kind, ref in model._keys.entries:
        if kind != "buffer":
            continue
        m, bname = ref
        b = m._buffers[bname]
        if b.is_meta:
            b = torch.empty_like(b, device=rt.device)
        flat = HELD.take(torch.empty(b.numel(), dtype=b.dtype))
        buffers[key].read(0, b.numel(), flat)
        b.copy_(flat.view(b.shape))
        m._buffers[bname] = b
        del flat
    rt.invalidate_buffers()
    model.mark_loaded()


def load_host_bytes(layouts, compute_itemsize: int) -> int:
    """Host bytes the streaming loader holds at its peak on one rank, beyond the engine's own
    allocations (``python -m yafsdp plan``'s "host at load" row): one flat group's slice in fp32,
    its ``param_dtype`` copy when it is NF4-quantized, and one read (at most ``READ_BYTES``, or one
    row of a tensor when a row is longer, and never more than the slice). ``layouts``: the units'
    ``plan.sizing.UnitShape``. On a GPU the fp32 slice is also copied to the device once at a time."""
    big = max((max(lay.trainable_shard, lay.frozen_shard, lay.nf4_shard) for lay in layouts), default=0)
    nf4 = max((lay.nf4_shard for lay in layouts), default=0)
    return 4 * big + compute_itemsize * nf4 + min(READ_BYTES, 4 * big)
