"""The engine's options, validated once: :func:`build_config` builds a frozen :class:`EngineConfig`
from ``YaFSDP``'s keyword arguments. ``YaFSDP(...)`` (yafsdp/core/api.py), the memory plan
(yafsdp/plan/report.py, ``python -m yafsdp plan``) and the example jobs all build their options
here, so a value or a combination is accepted or refused with the same words everywhere.

The policies follow FSDP2's ``MixedPrecisionPolicy`` / ``OffloadPolicy``: small frozen dataclasses
that say *what* is wanted; the engine decides how (yafsdp/core/placement.py for offload).

[Note: refused combinations]
What the checks below refuse between options, and why; everything else combines:

- ``reduce_accum_dtype=torch.float32`` with ``offload``: the reduced shard goes to the host in
  ``reduce_dtype``, one value per element, not every rank's piece (reduce_accum.py).
- Lifted: ``offload`` with a compact ``gather_dtype`` ("fp8", "int8": the optimizer's copy-out
  and the encode pass write the record into a host staging record, ``gather_host``, that is
  uploaded as the param_dtype staging copy is: placement.py),
- (no longer refused) ``offload`` with HSDP: the all-reduce across replicas of host grad shards is
  staged through the device (see [Note: the all-reduce of host grad shards] in placement.py), and
  so are the broadcasts of host stores from replica 0; QLoRA with ``offload="all"`` on a mesh too.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import formats
from ..comm.reduce_accum import check_reduce_accum

__all__ = ["MixedPrecision", "Offload", "EngineConfig", "build_config", "check_offload", "OFFLOAD_CHOICES"]

OFFLOAD_CHOICES = (None, "optimizer", "all")


@dataclass(frozen=True)
class MixedPrecision:
    """The dtypes of a step. ``param_dtype``: the compute copy and the gathered weights (None: fp32,
    the master's own dtype); ``reduce_dtype``: the grad buffers and the reduce-scatter;
    ``gather_dtype``: None (gather in param_dtype) or a gather format's name, "fp8" / "int8"
    (trainable nn.Linear weights gathered as 8-bit records, see [Note: gather formats] in
    formats/base.py); ``reduce_accum_dtype``: torch.float32 to send ``reduce_dtype`` pieces and sum
    them in fp32 ([Note: narrow reduce, fp32 accumulation] in reduce_accum.py), None to sum in
    ``reduce_dtype``."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32
    gather_dtype: str | None = None
    reduce_accum_dtype: torch.dtype | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.param_dtype or torch.float32


@dataclass(frozen=True)
class Offload:
    """Which shards live in host memory. ``what="optimizer"``: the fp32 master, grad shard and
    optimizer state (the optimizer steps on the CPU); ``"all"``: the frozen and NF4 shards too. No
    offload is ``offload=None`` (no policy object)."""

    what: str = "optimizer"


@dataclass(frozen=True)
class EngineConfig:
    """Every option of one engine, validated (:func:`build_config` builds it). ``gather_exclude``
    None means "the default for the model" (its HF output head): resolved at wrap time."""

    mixed_precision: MixedPrecision = field(default_factory=MixedPrecision)
    offload: Offload | None = None
    zero_stage: int = 3
    align_bytes: int = 16
    outsized_ratio: float = 1.5
    quantize_frozen: str | None = None
    gather_exclude: tuple[str, ...] | None = None
    # outsized units' gradients reduced in chunks through the grad pair instead of a grad buffer of
    # their own: see [Note: chunked outsized gradients] in plan/sizing.py
    chunk_outsized_grads: bool = True
    # the grad pair holds 1/grad_chunks of the largest regular unit; larger units' gradients are
    # reduced in that many chunks (the same note)
    grad_chunks: int = 1
    # an untied embedding looked up from the shards instead of gathered (gloo, world 2): see [Note: the
    # sharded lookup of an embedding] in core/lookup.py
    sharded_lookup: bool = True

    # The flat names the rest of the engine reads.
    @property
    def param_dtype(self) -> torch.dtype | None:
        return self.mixed_precision.param_dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.mixed_precision.compute_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.mixed_precision.reduce_dtype

    @property
    def gather_dtype(self) -> str | None:
        return self.mixed_precision.gather_dtype

    @property
    def reduce_accum_dtype(self) -> torch.dtype | None:
        return self.mixed_precision.reduce_accum_dtype

    @property
    def offload_what(self) -> str | None:
        """None, "optimizer" or "all" (the ``offload=`` keyword's value)."""
        return self.offload.what if self.offload is not None else None

    def options(self) -> dict:
        """The keyword arguments of ``YaFSDP(...)`` / ``memory_plan(...)`` this config stands for."""
        return dict(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype, zero_stage=self.zero_stage,
                    align_bytes=self.align_bytes, outsized_ratio=self.outsized_ratio,
                    quantize_frozen=self.quantize_frozen, offload=self.offload_what, gather_dtype=self.gather_dtype,
                    gather_exclude=self.gather_exclude, reduce_accum_dtype=self.reduce_accum_dtype,
                    chunk_outsized_grads=self.chunk_outsized_grads, grad_chunks=self.grad_chunks,
                    sharded_lookup=self.sharded_lookup)


def check_offload(offload) -> str | None:
    """``offload=``: None, "optimizer" (fp32 master, grad shard and optimizer state on the host) or
    "all" (the frozen and NF4 shards too); an :class:`Offload` policy; anything else is refused by name."""
    if isinstance(offload, Offload):
        offload = offload.what
    if offload in OFFLOAD_CHOICES:
        return offload
    raise ValueError(f"yafsdp.YaFSDP: offload={offload!r} is not supported; use None, 'optimizer' (the fp32 master, "
                     "grad shard and optimizer state on the host) or 'all' (the frozen and NF4 shards too)")


def _check_dtype(what: str, dt, who: str) -> torch.dtype | None:
    if dt is None and what == "param_dtype":
        return None
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"{who}: {what}={dt!r} is not a floating-point torch.dtype")
    return dt


def _as(who: str, check, value):
    """``check(value)``, its refusal opened with ``who`` (the format modules' checks name YaFSDP)."""
    try:
        return check(value)
    except ValueError as e:
        msg, mine = str(e), "yafsdp.YaFSDP: "
        raise ValueError(who + ": " + msg[len(mine):] if msg.startswith(mine) else msg) from None


def build_config(config: EngineConfig | None = None, *, who: str = "yafsdp.YaFSDP", **options) -> EngineConfig:
    """The one place options are checked: ``YaFSDP``'s keyword arguments (``param_dtype``,
    ``reduce_dtype``, ``zero_stage``, ``align_bytes``, ``outsized_ratio``, ``quantize_frozen``,
    ``offload``, ``gather_dtype``, ``gather_exclude``, ``reduce_accum_dtype``, ``chunk_outsized_grads``, ``grad_chunks``, ``sharded_lookup``) or a ``config`` to re-check (not both; an
    option left at its default may accompany a config). Every refusal names the value and what to
    pass instead; ``who`` opens the message. No combination depends on the process groups (HSDP
    takes every option), so the plan checks exactly what ``YaFSDP`` checks."""
    if config is not None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"{who}: config={config!r} is not a yafsdp.EngineConfig (build one with "
                            "yafsdp.build_config(...))")
        clash = {k: v for k, v in options.items() if v != _DEFAULTS.get(k)}
        if clash:
            raise ValueError(f"{who}: pass either config= or the options {sorted(clash)}, not both")
        options = config.options()
    unknown = set(options) - set(_DEFAULTS)
    if unknown:
        raise TypeError(f"{who}: unknown options {sorted(unknown)}; the options are {sorted(_DEFAULTS)}")
    o = {**_DEFAULTS, **options}
    quantize_frozen = _as(who, formats.storage_option, o["quantize_frozen"])
    offload = _as(who, check_offload, o["offload"])
    gather_dtype = _as(who, formats.gather_option, o["gather_dtype"])
    zero_stage = o["zero_stage"]
    if zero_stage not in (2, 3):
        raise ValueError(f"{who}: zero_stage={zero_stage!r} is not supported; use 2 or 3")
    param_dtype = _check_dtype("param_dtype", o["param_dtype"], who)
    reduce_dtype = _check_dtype("reduce_dtype", o["reduce_dtype"], who)
    reduce_accum_dtype = _as(who, lambda v: check_reduce_accum(v, reduce_dtype, offload), o["reduce_accum_dtype"])
    align_bytes = o["align_bytes"]
    if not isinstance(align_bytes, int) or isinstance(align_bytes, bool) or align_bytes < 1:
        raise ValueError(f"{who}: align_bytes={align_bytes!r} is not a positive int (bytes of the gathered dtype "
                         "each flat unit is padded to, per rank; 16 is the default)")
    ratio = o["outsized_ratio"]
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not ratio > 0:
        raise ValueError(f"{who}: outsized_ratio={ratio!r} is not a positive number (a unit larger than this times "
                         "the typical unit gets its own buffer; 1.5 is the default)")
    chunk = o["chunk_outsized_grads"]
    if not isinstance(chunk, bool):
        raise ValueError(f"{who}: chunk_outsized_grads={chunk!r} is not a bool (True, the default: an outsized unit's "
                         "gradient is reduced in chunks through the grad pair; False: it gets a grad buffer of its own)")
    grad_chunks = o["grad_chunks"]
    if not isinstance(grad_chunks, int) or isinstance(grad_chunks, bool) or grad_chunks < 1:
        raise ValueError(f"{who}: grad_chunks={grad_chunks!r} is not a positive int (the grad buffers hold 1/grad_chunks "
                         "of the largest unit's gradient, reduced in that many chunks; 1 is the default)")
    if grad_chunks > 1 and offload is not None:
        raise ValueError(f"{who}: grad_chunks={grad_chunks} with offload={offload!r} is not supported (an offloaded "
                         "reduce goes through the host landing whole); use grad_chunks=1")
    lookup = o["sharded_lookup"]
    if not isinstance(lookup, bool):
        raise ValueError(f"{who}: sharded_lookup={lookup!r} is not a bool (True, the default: an untied embedding is "
                         "looked up from the shards instead of gathered where the engine can, gloo at world 2; False: "
                         "always gathered)")
    exclude = o["gather_exclude"]
    if exclude is not None:
        if isinstance(exclude, str) or not all(isinstance(n, str) for n in exclude):
            raise ValueError(f"{who}: gather_exclude={exclude!r} is not a list of module names")
        exclude = tuple(exclude)
    return EngineConfig(
        mixed_precision=MixedPrecision(param_dtype, reduce_dtype, gather_dtype, reduce_accum_dtype),
        offload=Offload(offload) if offload is not None else None, zero_stage=zero_stage, align_bytes=align_bytes,
        outsized_ratio=ratio, quantize_frozen=quantize_frozen, gather_exclude=exclude, chunk_outsized_grads=chunk,
        grad_chunks=grad_chunks, sharded_lookup=lookup)


_DEFAULTS = dict(param_dtype=None, reduce_dtype=torch.float32, zero_stage=3, align_bytes=16, outsized_ratio=1.5,
                 quantize_frozen=None, offload=None, gather_dtype=None, gather_exclude=None, reduce_accum_dtype=None,
                 chunk_outsized_grads=True, grad_chunks=1, sharded_lookup=True)

