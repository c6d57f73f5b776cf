"""The full (unsharded) state dict: its keys, gathering it, loading it, and the one scatter path
that wrap-time materialisation and loads share.

:class:`StateDictKeys` remembers, at wrap time and before any module surgery, what each key of the
original ``module.state_dict()`` refers to: a parameter (a ``ParamInfo`` of some unit) or a buffer
(module, name). Rank 0 flattens each flat group's values into its padded layout in fp32 scratch,
scatters it over the group (``scatter_group``) and every rank's shard receives its slice (a
frozen shard rounded to ``param_dtype``; an NF4 shard rounded, then quantized by its own rank);
``gather_full`` gives an NF4 group's dequantized values (what the model computes with);
module buffers are broadcast from rank 0 (``broadcast_buffers``).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from contextlib import contextmanager

import torch
from torch import nn

from ..comm import collectives
from ..engine import orig_params
from ..comm.groups import check_collective, raise_together, source_rank
from ..layout.flat import ParamInfo
from ..engine.runtime import Runtime
from ..engine.unit import FlatGroup
from ..layout.units import UnitSpec, WrapError

__all__ = ["StateDictKeys", "gather_full", "load_buffers", "load_full", "materialize", "scatter_group", "write_shard", "original_structure"]


class StateDictKeys:
    """Every key of the original module's state_dict and what it refers to."""

    def __init__(self, module: nn.Module, specs: list[UnitSpec], small: list[ParamInfo]):
        key_of: dict[int, ParamInfo] = {}
        for spec in specs:
            for p in spec.params:
                key_of[id(p.param)] = p
        for p in small:
            key_of[id(p.param)] = p
        self.entries: list[tuple[str, str, object]] = []  # (key, "param"|"buffer", ParamInfo|(module, name))
        buf_owner = {}
        for _, m in module.named_modules(remove_duplicate=False):
            for bname, b in m._buffers.items():
                if b is not None:
                    buf_owner.setdefault(id(b), (m, bname))
        # See [Note: state_dict hooks]: the keys are the tensors' own names, the hooks run around them.
        named = [(prefix, m) for prefix, m in _prefixed_modules(module)]
        self.save_hooks: list[tuple[str, nn.Module, frozenset[str]]] = []  # post-order, as state_dict() runs them
        self.load_hooks: list[tuple[str, nn.Module]] = [(pf, m) for pf, m in named if m._load_state_dict_pre_hooks]
        held = [(m, m._state_dict_hooks) for _, m in named if m._state_dict_hooks]
        try:
            for m, _ in held:
                m._state_dict_hooks = type(m._state_dict_hooks)()
            raw = module.state_dict(keep_vars=True)
        finally:
            for m, hooks in held:
                m._state_dict_hooks = hooks
        for key, t in raw.items():
            if id(t) in key_of:
                self.entries.append((key, "param", key_of[id(t)]))
            elif id(t) in buf_owner:
                self.entries.append((key, "buffer", buf_owner[id(t)]))
            else:
                owner = max((pf for pf, _ in named if key.startswith(pf)), key=len, default="")
                raise WrapError(
                    f"state_dict key {key!r} is neither a parameter nor a buffer of the module: module "
                    f"{owner[:-1] or '<root>'!r} writes entries of its own (get_extra_state or a _save_to_state_dict "
                    "override), which the engine cannot map onto its shards; a state_dict post-hook (with a "
                    "load_state_dict pre-hook) is supported in their place")
        hooked = {id(m) for m, _ in held}
        for pf, m in reversed(named):  # children before their parent (named is in pre-order)
            if id(m) in hooked:
                self.save_hooks.append((pf, m, frozenset(k for k, _, _ in self.entries if k.startswith(pf))))

    def module_keys(self, raw: dict, partial: bool = False) -> dict:
        """``raw`` (the entries' keys) as the original module's ``state_dict()`` has it: the modules'
        state_dict post-hooks applied, children first. ``partial``: ``raw`` is one unit of a stream
        (:meth:`check_stream` first); the hooks of the modules whose keys it holds run."""
        if not self.save_hooks:
            return raw
        sd = OrderedDict(raw)
        sd._metadata = OrderedDict()  # type: ignore[attr-defined]
        for pf, m, keys in self.save_hooks:
            if partial and not keys & sd.keys():
                continue
            meta = {"version": m._version}
            for hook in m._state_dict_hooks.values():
                out = hook(m, sd, pf, meta)
                if out is not None and not getattr(hook, "_from_public_api", False):
                    sd = out
        return sd

    def check_stream(self, units: list[set[str]], what: str) -> None:
        """Refuse a per-unit stream (``units``: the keys of each streamed piece) when a hooked module's
        keys are split over several pieces: its hook could not see them together. Not collective: every
        rank decides the same from the same layout."""
        for pf, _, keys in self.save_hooks:
            if keys and not any(keys <= u for u in units):
                raise RuntimeError(
                    f"yafsdp: {what}: module {pf[:-1] or '<root>'!r} has a state_dict post-hook and its parameters "
                    "and buffers are in more than one unit, so a per-unit stream cannot apply it; use "
                    "model.full_state_dict() (collective), which applies it to the whole dict")

    def param_keys(self, sd: dict) -> dict:
        """The inverse of :meth:`module_keys` for a load: a copy of ``sd`` (keys of the original
        module's ``state_dict()``) with the modules' load_state_dict pre-hooks applied, parents first,
        as ``load_state_dict`` runs them. ``sd`` itself is not changed."""
        if not self.load_hooks or not isinstance(sd, dict):
            return sd
        out = OrderedDict(sd)
        meta = getattr(sd, "_metadata", {})
        out._metadata = meta  # type: ignore[attr-defined]
        errors: list[str] = []
        for pf, m in self.load_hooks:
            for hook in m._load_state_dict_pre_hooks.values():
                hook(out, pf, meta.get(pf[:-1], {}), True, [], [], errors)
        if errors:
            raise ValueError("; ".join(errors))
        return out

    def validate(self, sd) -> str | None:
        """None when ``sd`` has exactly the expected keys and shapes, else what is wrong."""
        if not isinstance(sd, dict):
            return f"expected a dict on rank 0, got {type(sd).__name__}"
        names_of: dict[int, list[str]] = {}
        expected = {}
        for key, kind, ref in self.entries:
            expected[key] = ref
            if kind == "param":
                names_of.setdefault(id(ref), []).append(key)
        missing = []
        for key, kind, ref in self.entries:
            if key in sd:
                continue
            if kind == "param" and any(k in sd for k in names_of[id(ref)]):
                continue  # a tied alias whose twin is present
            missing.append(key)
        unexpected = [k for k in sd if k not in expected]
        shape_bad = []
        for key, kind, ref in self.entries:
            if key not in sd:
                continue
            want = ref.shape if kind == "param" else ref[0]._buffers[ref[1]].shape
            got = tuple(sd[key].shape) if hasattr(sd[key], "shape") else None
            if got != tuple(want):
                shape_bad.append(f"{key!r} has shape {got}, expected {tuple(want)}")
        msgs = []
        if missing:
            msgs.append(f"missing keys {missing[:10]}")
        if unexpected:
            msgs.append(f"unexpected keys {unexpected[:10]}")
        if shape_bad:
            msgs.append("; ".join(shape_bad[:10]))
        return "; ".join(msgs) if msgs else None


# [Note: state_dict hooks]
# A module may reshape its state_dict through hooks: torchtitan's ``FusedQKVLinear`` stores one
# fused ``wqkv.weight`` but saves it as the stock ``wq``/``wk``/``wv`` weights (a state_dict
# post-hook splitting it) and merges them back on load (a load_state_dict pre-hook). The keys such a
# hook writes are new tensors, not the module's parameters, so they cannot be mapped onto the shards.
# The entries are therefore the keys of the module's state_dict *without* its post-hooks (each
# parameter and buffer under its own name); ``full_state_dict()`` gathers those and then runs the
# modules' post-hooks on the result (``module_keys``: the keys and values the unwrapped module's
# ``state_dict()`` gives), and ``load_full_state_dict(sd)`` runs the load pre-hooks on a copy of
# ``sd`` first (``param_keys``). ``iter_full_state_dict()`` applies a module's hooks within the unit
# holding its parameters (and refuses a hooked module whose parameters span units). The sharded
# checkpoints and the HF export/streaming loads work on the parameters' own names.


def _prefixed_modules(module: nn.Module, prefix: str = ""):
    """(prefix, module) in pre-order, as ``state_dict()`` visits them (shared modules once per path)."""
    yield prefix, module
    for name, child in module._modules.items():
        if child is not None:
            yield from _prefixed_modules(child, prefix + name + ".")


def scatter_group(rt: Runtime, g: FlatGroup, full: torch.Tensor | None, group, rank: int, world: int) -> None:
    """Rank 0's ``full`` (fp32, padded_numel) -> every rank's shard of flat group ``g``."""
    out = torch.empty(g.layout.shard_numel, dtype=torch.float32, device=rt.device)
    chunks = list(full.chunk(world)) if rank == 0 else None
    collectives.scatter(out, chunks, source_rank(group), group)
    write_shard(rt, g, out)


def write_shard(rt: Runtime, g: FlatGroup, values: torch.Tensor) -> None:
    """This rank's slice of flat group ``g`` (fp32, shard_numel, padding zero) into its stored shard:
    the fp32 master, a frozen shard (rounded), or an NF4 record (rounded, then quantized here).
    The scatter above and the streaming loads ([Note: streaming loads] in hf_stream.py) both end here."""
    if g.kind.format.stored:  # each rank encodes its own slice: [Note: NF4 frozen groups] in formats/nf4_codec.py
        g.kind.format.encode_(g.shard.detach(), values.to(g.kind.compute_dtype))  # bumps the record's version
    else:
        g.shard.detach().copy_(values)  # bumps the shard's version: its compute copy is now stale


def _broadcast_buffer(b: torch.Tensor, group) -> None:
    collectives.broadcast(b, source_rank(group), group)


@torch.no_grad()
def materialize(rt: Runtime, module: nn.Module, group, rank: int, world: int) -> bool:
    """Rank 0's values into every rank's shards, one unit at a time; then the module surgery
    (parameters replaced by ShardedParameters: [Note: the module tree after wrapping] in
    orig_params.py). Returns True when something was on the meta device (the model then needs a
    load: ``load_full_state_dict``, ``yafsdp.init`` or a checkpoint)."""
    on_meta = {u.index for u in rt.all if any(p.param.is_meta for p in u.params)}  # built on the meta device
    needs_load = bool(on_meta)
    for u, g, _, _ in rt.stored_shards():  # See [Note: stored shards] in unit.py
        if u.index in on_meta:
            continue
        full = None
        if rank == 0:
            full = rt.fp32_scratch(u, g)
            g.layout.flatten([p.param.detach().to(rt.device, torch.float32) for p in g.params], full)
        scatter_group(rt, g, full, group, rank, world)
    for u in rt.all:
        for i, p in enumerate(u.params):
            rt.originals.append((weakref.ref(p.param), p.param.requires_grad, p.fqn))
            # See [Note: the module tree after wrapping] in orig_params.py
            orig_params.install(rt, u, i, p.param)
            del p.param
    for _, m in module.named_modules():
        for bname, b in list(m._buffers.items()):
            if b is None:
                continue
            if b.is_meta:
                needs_load = True
                continue
            b = b.to(rt.device)
            _broadcast_buffer(b, group)
            m._buffers[bname] = b
    return needs_load


@torch.no_grad()
def gather_full(rt: Runtime, keys: StateDictKeys, group, rank: int) -> dict[str, torch.Tensor]:
    """Collective. Rank 0: the original module's state_dict on CPU (each parameter in its original
    dtype; tied keys share one tensor); other ranks: {}. Gathered unit by unit through
    ``export.iter_units`` (the streaming form: ``YaFSDP.iter_full_state_dict``)."""
    from ..integrations.export import iter_units

    ref_of = {key: ref for key, kind, ref in keys.entries if kind == "param"}
    values: dict = {}
    for unit in iter_units(rt, keys, group, rank, "full_state_dict()"):
        for key, v in (unit or {}).items():
            ref = ref_of.get(key)
            if ref is None:  # a module buffer
                values[key] = v.to("cpu", copy=True)
            elif id(ref) not in values:
                values[id(ref)] = v.to("cpu", ref.dtype, copy=True)
        del unit
    if rank != 0:
        return {}
    return keys.module_keys({key: values[id(ref) if kind == "param" else key] for key, kind, ref in keys.entries})


@torch.no_grad()
def load_full(rt: Runtime, keys: StateDictKeys, state_dict, group, rank: int, world: int) -> None:
    """Collective inverse of :func:`gather_full`; checked on rank 0 first, nothing modified on error."""
    check_collective("load_full_state_dict()", group)
    problem = None
    if rank == 0:  # See [Note: state_dict hooks]
        try:
            state_dict = keys.param_keys(state_dict)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            problem = f"a module's load_state_dict pre-hook failed on the given dict: {type(e).__name__}: {e}"
        problem = problem or keys.validate(state_dict)
    raise_together(problem, group, ValueError, "yafsdp.YaFSDP.load_full_state_dict: ")
    by_param: dict[int, torch.Tensor] = {}
    if rank == 0:
        for key, kind, ref in keys.entries:
            if kind == "param" and key in state_dict:
                by_param.setdefault(id(ref), state_dict[key])
    for u, g, _, _ in rt.stored_shards():  # See [Note: stored shards] in unit.py
        full = None
        if rank == 0:
            full = rt.fp32_scratch(u, g)
            g.layout.flatten([by_param[id(p)].to(rt.device, torch.float32) for p in g.params], full)
        scatter_group(rt, g, full, group, rank, world)

    def fill(key, b):
        if rank == 0:
            b.copy_(state_dict[key])
        _broadcast_buffer(b, group)

    load_buffers(rt, keys, fill)
    rt.invalidate_buffers()


def load_buffers(rt: Runtime, keys: StateDictKeys, fill) -> None:
    """Every checkpointed module buffer (``keys``' buffer entries), in key order: one still on the
    meta device is made on the engine's device, then ``fill(key, buffer)`` writes it in place
    (``load_full``: rank 0's value, broadcast; the streaming loads: each rank reads it)."""
    for key, kind, ref in keys.entries:
        if kind != "buffer":
            continue
        m, bname = ref
        b = m._buffers[bname]
        if b.is_meta:
            b = torch.empty_like(b, device=rt.device)
        fill(key, b)
        m._buffers[bname] = b


@contextmanager
def original_structure(rt: Runtime):
    """Inside: every parameter the wrap moved into the flat shards is back in its modules'
    ``_parameters`` as a meta-device placeholder of its original shape and ``requires_grad``, so that
    code which reads a module's structure -- ``named_parameters()``, a submodule's ``state_dict()``
    keys, as PEFT's ``get_peft_model_state_dict`` does for ``modules_to_save`` -- sees the model as it
    was before wrapping. Values are not there (take them from ``gather_full``); no forward may run
    inside. On exit the modules are as before. Not collective."""
    import torch.nn as nn

    moved = []  # (owner, attr, what its __dict__ held)
    try:
        for u in rt.all:
            for p in u.params:
                ph = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=not p.frozen)
                for owner, attr in p.owners:
                    registered = owner._parameters.get(attr)
                    if registered is not None and not isinstance(registered, orig_params.ShardedParameter):
                        continue  # a real parameter still registered there: nothing to stand in for
                    # a ShardedParameter holds no values and refuses reads ([Note: the module tree after
                    # wrapping] in orig_params.py): the placeholder stands in for it too
                    moved.append((owner, attr, owner.__dict__.pop(attr, None), registered))
                    owner._parameters[attr] = ph
        yield
    finally:
        for owner, attr, held, registered in reversed(moved):
            owner._parameters.pop(attr, None)
            if registered is not None:
                owner._parameters[attr] = registered
            if held is not None:
                owner.__dict__[attr] = held
