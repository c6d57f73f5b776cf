"""The engine's options, defined once: every option of ``YaFSDP`` is one field of :class:`EngineConfig`,
declared with :func:`option` (its default, its one-line doc, its check and, where the values are a
few, the values themselves, the format names from the registry in ``yafsdp.formats``).
:func:`build_config` checks keyword arguments against those fields and builds the frozen config.

Everything else is derived from the fields (:data:`OPTIONS`): ``EngineConfig.options()``, the
memory plan's engine options (yafsdp/plan/build.py), the flags of ``python -m yafsdp plan``
(yafsdp/plan/cli.py) and the job's flags that mirror an option (their choices), the option table
of docs/api.md and the options part of ``YaFSDP``'s docstring (``options_doc``;
``python -m yafsdp.tools.docs_options`` writes the table). ``YaFSDP.__init__`` spells the options
out for readers and editors; tests/unit/test_config.py checks that its names and defaults are
these. So a value or a combination is accepted or refused with the same words everywhere.

[Note: refused combinations]
What the checks refuse between options, and why; everything else combines. A check sees the
options declared before its own (``checked``), so the field order puts ``reduce_dtype`` and
``offload`` first:

- ``reduce_accum_dtype=torch.float32`` with ``offload``: the reduced shard goes to the host in
  ``reduce_dtype``, one value per element, not every rank's piece (reduce_accum.py).
- ``grad_quant`` with ``reduce_accum_dtype``: the quantized reduce sums what crosses nodes in fp32
  already; its node stage is a reduce-scatter in ``reduce_dtype`` (comm/quant_reduce.py).
  ``grad_quant_node`` above 1 without ``grad_quant`` quantizes nothing. Whether ``grad_quant_node``
  divides the shard group's size is checked where the group is known (``YaFSDP``, the plan).
- ``grad_chunks`` above 1 with ``offload``: an offloaded reduce goes through the host landing whole.
- ``secondary_shard`` above 1 with ``zero_stage=2``: ZeRO-2 has no backward gather to narrow. (Its
  size against the shard group's is checked where the group is known: the engine, the plan.)
- ``prefetch=2`` with ``secondary_shard`` above 1: the backward gathers within the subgroup, two
  units ahead, are not worked through or tested (the pieces kept behind each forward gather, the
  store sized by which units share a buffer); refused rather than run unproven.
- Lifted: ``offload`` with a compact ``gather_dtype`` ("fp8", "int8": the optimizer's copy-out
  and the encode pass write the record into a host staging record, ``gather_host``, that is
  uploaded as the param_dtype staging copy is: placement.py),
- (no longer refused) ``offload`` with HSDP: the all-reduce across replicas of host grad shards is
  staged through the device (see [Note: the all-reduce of host grad shards] in placement.py), and
  so are the broadcasts of host stores from replica 0; QLoRA with ``offload="all"`` on a mesh too.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

from .. import formats
from ..comm.reduce_accum import check_reduce_accum

__all__ = ["MixedPrecision", "Offload", "EngineConfig", "Option", "OPTIONS", "build_config", "check_offload",
           "OFFLOAD_CHOICES", "DTYPE_NAMES", "options_doc"]

OFFLOAD_CHOICES = (None, "optimizer", "all")
GRAD_QUANT_CHOICES = ("int8", "fp8")  # the gather formats a quantized reduce sends (comm/quant_reduce.py)
# how the plan, its CLI and the jobs write the floating-point dtypes an option takes
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Option:
    """One engine option as its :class:`EngineConfig` field declares it (see :func:`option`)."""

    name: str
    default: Any
    type: str  # the field's annotation, as the signature and the docs write it
    doc: str  # one line: the docs table, the CLI help, YaFSDP's docstring
    check: Callable  # (name, value, checked) -> the value recorded; raises ValueError naming the value
    values: Callable[[], tuple] | None  # the values it takes when they are a few (formats: the registry's)

    def choices(self) -> tuple:
        return self.values() if self.values is not None else ()

    def text(self, value, none: str = "none") -> str:
        """``value`` as a command line writes it (None as ``none``, a dtype by its short name)."""
        if value is None:
            return none
        if isinstance(value, torch.dtype):
            return next(k for k, v in DTYPE_NAMES.items() if v == value)
        return str(value)

    def texts(self, none: str = "none") -> list[str]:
        """The command-line spellings of :meth:`choices` (empty when any value of the type goes)."""
        return [self.text(v, none) for v in self.choices()]

    def parse(self, text: str, none: str = "none"):
        """A command line's ``text`` -> the option's value (the inverse of :meth:`text`)."""
        for v in self.choices():
            if self.text(v, none) == text:
                return v
        if text == none and self.default is None:
            return None
        if self.values is not None:
            raise ValueError(f"{text!r} is not one of {self.texts(none)}")
        if isinstance(self.default, bool):
            raise ValueError(f"{self.name} is a flag (True or False), not a value")
        if self.type.startswith("tuple"):
            return tuple(n for n in text.split(",") if n)
        return type(self.default)(text)


def option(default, doc: str, check: Callable, values: Callable[[], tuple] | None = None):
    """A field of :class:`EngineConfig` that is an option of ``YaFSDP`` (see :class:`Option`)."""
    return field(default=default, metadata={"option": (doc, check, values)})


# -- the checks: (name, value, checked) -> the value recorded --------------------------------
def _dtype(none_ok: bool):
    def check(name, v, checked):
        if v is None and none_ok:
            return None
        if not isinstance(v, torch.dtype) or not v.is_floating_point:
            raise ValueError(f"{name}={v!r} is not a floating-point torch.dtype")
        return v
    return check


def _positive(kind: type, what: str):
    def check(name, v, checked):
        if not isinstance(v, kind) or isinstance(v, bool) or not v > 0:
            raise ValueError(f"{name}={v!r} is not a {what} (the default is {_DEFAULT[name]!r}); {name}: {_doc(name)}")
        return v
    return check


def _bool(name, v, checked):
    if not isinstance(v, bool):
        raise ValueError(f"{name}={v!r} is not a bool; {name}: {_doc(name)}")
    return v


def _zero_stage(name, v, checked):
    if v not in (2, 3):
        raise ValueError(f"{name}={v!r} is not supported; use 2 or 3")
    return v


def _module_names(name, v, checked):
    if v is None:
        return None
    if isinstance(v, str) or not all(isinstance(n, str) for n in v):
        raise ValueError(f"{name}={v!r} is not a list of module names")
    return tuple(v)


def _grad_chunks(name, v, checked):
    v = _positive(int, "positive int")(name, v, checked)
    if v > 1 and checked["offload"] is not None:  # See [Note: refused combinations]
        raise ValueError(f"{name}={v} with offload={checked['offload']!r} is not supported (an offloaded reduce goes "
                         "through the host landing whole); use grad_chunks=1")
    return v


def _reduce_accum(name, v, checked):  # See [Note: refused combinations]
    return check_reduce_accum(v, checked["reduce_dtype"], checked["offload"])


def _grad_quant(name, v, checked):  # See [Note: refused combinations]
    if v is None:
        return None
    fmt = formats.get(v) if isinstance(v, (str, torch.dtype)) and _known_format(v) else None
    if fmt is None or fmt.name not in GRAD_QUANT_CHOICES:
        raise ValueError(f"{name}={v!r} is not supported; use None (reduce in reduce_dtype) or one of "
                         f"{list(GRAD_QUANT_CHOICES)} (8-bit codes with an fp32 scale per 128 values)")
    if checked["reduce_accum_dtype"] is not None:
        raise ValueError(f"{name}={fmt.name!r} with reduce_accum_dtype={checked['reduce_accum_dtype']!r} is not "
                         "supported: the quantized reduce already sums what crosses nodes in fp32 (its node stage "
                         "reduces in reduce_dtype); pass one of them, or reduce_dtype=torch.float32 for an fp32 "
                         "node stage")
    return fmt.name


def _known_format(v) -> bool:
    try:
        formats.get(v)
    except (KeyError, ValueError):
        return False
    return True


def _grad_quant_node(name, v, checked):
    v = _positive(int, "positive int")(name, v, checked)
    if v > 1 and checked["grad_quant"] is None:
        raise ValueError(f"{name}={v} without grad_quant quantizes nothing; pass grad_quant='int8' or 'fp8' too, or "
                         f"leave {name} at 1")
    return v


def _secondary_shard(name, v, checked):  # See [Note: refused combinations]
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{name}={v!r} is not an int >= 0 (0: off; N: the backward gathers within groups of N "
                         "consecutive ranks, the ranks of a node); docs/zeropp.md")
    if v > 1 and checked["zero_stage"] == 2:
        raise ValueError(f"{name}={v} with zero_stage=2 is refused: ZeRO-2 keeps every unit's gathered weights "
                         "until backward, so there is no backward gather to narrow; use zero_stage=3 with "
                         f"{name}={v}, or drop {name}")
    return v


def _prefetch(name, v, checked):  # See [Note: refused combinations]
    if v not in (1, 2) or isinstance(v, bool):
        raise ValueError(f"{name}={v!r} is not supported; use 1 (the next unit's gather issued while a unit computes, "
                         "two alternating weight buffers) or 2 (two units ahead, three buffers in rotation)")
    if v == 2 and checked["secondary_shard"] > 1:
        raise ValueError(f"{name}=2 with secondary_shard={checked['secondary_shard']} is not supported (the backward "
                         "gathers within the subgroup have not been worked through two units ahead); use prefetch=1 "
                         "with secondary_shard, or drop secondary_shard")
    return v


def _gather_values() -> tuple:
    return (None, *(f.name for f in formats.gather_formats()))


def _storage_values() -> tuple:
    return (None, *(f.name for f in formats.storage_formats()))


@dataclass(frozen=True)
class EngineConfig:
    """Every option of one engine, validated (:func:`build_config` builds it). Each field is an
    option of ``YaFSDP``, in the order they are checked ([Note: refused combinations])."""

    param_dtype: torch.dtype | None = option(
        None, "dtype of the compute copy and the gathered weights; the master shards stay fp32 (None: fp32)",
        _dtype(none_ok=True), lambda: tuple(DTYPE_NAMES.values()))
    reduce_dtype: torch.dtype = option(
        torch.float32, "dtype of the grad buffers and of the reduce-scatter; the grad shards are fp32 whatever it is",
        _dtype(none_ok=False), lambda: tuple(DTYPE_NAMES.values()))
    zero_stage: int = option(
        3, "3: each unit is gathered again for backward (two alternating weight buffers); 2: the forward's gather "
        "is kept until backward (one buffer per unit: a full param_dtype copy of the model). At world 1 with a "
        "narrower param_dtype, 3 casts each unit from the fp32 master into the buffers (in forward and again in "
        "backward) and 2 keeps a compute copy instead, cast once per step",
        _zero_stage, lambda: (2, 3))
    align_bytes: int = option(
        16, "bytes of the gathered dtype each flat unit is padded to, per rank (a multiple of world_size x "
        "align_bytes in all)", _positive(int, "positive int"))
    outsized_ratio: float = option(
        1.5, "a unit that is not a repeated block and is larger than this times the largest block is outsized: "
        "the outsized units share one extra weight buffer (docs/design.md#in-short)",
        _positive((int, float), "positive number"))
    quantize_frozen: str | None = option(
        None, "a storage format: frozen nn.Linear weights stored in it and gathered compact (QLoRA, docs/qlora.md); "
        "a warning when no weight qualifies",
        lambda name, v, checked: formats.storage_option(v), _storage_values)
    offload: str | None = option(
        None, "optimizer: the fp32 master, grad shard and optimizer state in (pinned) host memory, the optimizer "
        "step on the CPU; all: the frozen and NF4 shards too (docs/offload.md)",
        lambda name, v, checked: check_offload(v), lambda: OFFLOAD_CHOICES)
    gather_dtype: str | None = option(
        None, "a gather format: trainable nn.Linear weights gathered as its records and expanded into the "
        "param_dtype weight buffer (docs/formats.md); None: gathered in param_dtype; a warning when no unit "
        "qualifies", lambda name, v, checked: formats.gather_option(v), _gather_values)
    gather_exclude: tuple[str, ...] | None = option(
        None, "with a compact gather_dtype: module names kept in param_dtype (None: an HF model's output head)",
        _module_names)
    reduce_accum_dtype: torch.dtype | None = option(
        None, "torch.float32 with a 16-bit reduce_dtype: the pieces are sent in reduce_dtype and summed in fp32 "
        "(docs/reduce.md); refused with offload", _reduce_accum, lambda: (None, torch.float32))
    # See [Note: quantized gradient reduction] in comm/quant_reduce.py
    grad_quant: str | None = option(
        None, "int8 or fp8: what a reduce-scatter sends across node groups, and HSDP's all-reduce across "
        "replicas, goes as 8-bit codes with an fp32 scale per 128 values, summed in fp32 by the receiver "
        "(docs/grad_quant.md); refused with reduce_accum_dtype", _grad_quant, lambda: (None, *GRAD_QUANT_CHOICES))
    grad_quant_node: int = option(
        1, "with grad_quant: consecutive ranks of the shard group that share a node (a divisor of its size); the "
        "reduce among them runs in reduce_dtype and only the exchange between node groups is quantized (1: every "
        "exchange; the shard group's size: only HSDP's all-reduce across replicas)", _grad_quant_node)
    # See [Note: chunked outsized gradients] in layout/sizing.py
    chunk_outsized_grads: bool = option(
        True, "True: an outsized unit's gradient is reduced in chunks through the grad pair; False: it gets a "
        "grad buffer of its own (docs/reduce.md); not chunked with offload", _bool)
    grad_chunks: int = option(
        1, "the grad buffers hold 1/grad_chunks of the largest unit's gradient, reduced in that many chunks: less "
        "memory, more and smaller collectives; refused above 1 with offload", _grad_chunks)
    # See [Note: the sharded lookup of an embedding] in engine/lookup.py
    sharded_lookup: bool = option(
        True, "True: on gloo at world 2 (fp32, ZeRO-3, no offload, no HSDP) an untied outsized nn.Embedding is "
        "looked up from the shards instead of gathered, bit for bit the same values "
        "(docs/reduce.md#the-sharded-lookup-of-an-embedding); False: always gathered", _bool)
    # See [Note: the secondary shard] in engine/secondary.py
    secondary_shard: int = option(
        0, "N > 1: after a unit's forward gather each rank keeps 1/N of it, so the backward (and recompute) "
        "gathers run within groups of N consecutive ranks of the shard group (a node: ZeRO++'s hpZ; "
        "docs/zeropp.md); a divisor of the shard group's size below it; refused with zero_stage=2; 0 or 1: off",
        _secondary_shard)
    # See [Note: prefetch depth] in engine/runtime.py
    prefetch: int = option(
        1, "units gathered ahead of the one computing, in forward and backward: 1 (two alternating weight "
        "buffers) or 2 (three in rotation: one more of the largest unit in memory; docs/benchmarks.md says where it "
        "pays); refused with secondary_shard", _prefetch, lambda: (1, 2))

    @property
    def mixed_precision(self) -> "MixedPrecision":
        return MixedPrecision(self.param_dtype, self.reduce_dtype, self.gather_dtype, self.reduce_accum_dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.param_dtype or torch.float32

    def options(self) -> dict:
        """The keyword arguments of ``YaFSDP(...)`` / ``memory_plan(...)`` this config stands for."""
        return {name: getattr(self, name) for name in OPTIONS}


@dataclass(frozen=True)
class MixedPrecision:
    """The dtypes of a step, as FSDP2's ``MixedPrecisionPolicy`` groups them (``EngineConfig.mixed_precision``;
    the fields are :class:`EngineConfig`'s)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32
    gather_dtype: str | None = None
    reduce_accum_dtype: torch.dtype | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.param_dtype or torch.float32


@dataclass(frozen=True)
class Offload:
    """A spelling of ``offload=``, as FSDP2's ``OffloadPolicy``: ``Offload("optimizer")`` is
    ``offload="optimizer"``, ``Offload("all")`` is ``offload="all"``."""

    what: str = "optimizer"


#: Every option, in check order: name -> :class:`Option` (from :class:`EngineConfig`'s fields).
OPTIONS: dict[str, Option] = {
    f.name: Option(f.name, f.default, f.type, *f.metadata["option"]) for f in fields(EngineConfig)}
_DEFAULT = {name: o.default for name, o in OPTIONS.items()}


def _doc(name: str) -> str:
    return OPTIONS[name].doc


def check_offload(offload) -> str | None:
    """``offload=``: None, "optimizer" (fp32 master, grad shard and optimizer state on the host) or
    "all" (the frozen and NF4 shards too); an :class:`Offload` policy; anything else is refused by name."""
    if isinstance(offload, Offload):
        offload = offload.what
    if offload in OFFLOAD_CHOICES:
        return offload
    raise ValueError(f"yafsdp.YaFSDP: offload={offload!r} is not supported; use None, 'optimizer' (the fp32 master, "
                     "grad shard and optimizer state on the host) or 'all' (the frozen and NF4 shards too)")


def _checked(who: str, opt: Option, value, checked: dict):
    """``opt``'s check of ``value``, its refusal opened with ``who`` (the format modules' and
    reduce_accum's checks open with "yafsdp.YaFSDP: ")."""
    try:
        return opt.check(opt.name, value, checked)
    except ValueError as e:
        msg = str(e).removeprefix("yafsdp.YaFSDP: ")
        raise ValueError(f"{who}: {msg}") from None


def build_config(config: EngineConfig | None = None, *, who: str = "yafsdp.YaFSDP", **options) -> EngineConfig:
    """The one place options are checked: ``YaFSDP``'s keyword arguments (the fields of
    :class:`EngineConfig`) or a ``config`` to re-check (not both; an option left at its default may
    accompany a config). Every refusal names the value and what to pass instead; ``who`` opens the
    message. No combination depends on the process groups (HSDP takes every option), so the plan
    checks exactly what ``YaFSDP`` checks."""
    if config is not None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"{who}: config={config!r} is not a yafsdp.EngineConfig (build one with "
                            "yafsdp.build_config(...))")
        clash = {k: v for k, v in options.items() if k not in _DEFAULT or v != _DEFAULT[k]}
        if clash:
            raise ValueError(f"{who}: pass either config= or the options {sorted(clash)}, not both")
        options = config.options()
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TypeError(f"{who}: unknown options {sorted(unknown)}; the options are {sorted(OPTIONS)}")
    checked: dict = {}
    for name, opt in OPTIONS.items():
        checked[name] = _checked(who, opt, options.get(name, opt.default), checked)
    return EngineConfig(**checked)


def options_doc(indent: str = "    ") -> str:
    """The options as ``YaFSDP``'s docstring lists them: one line each, with the default and the values."""
    lines = []
    for o in OPTIONS.values():
        values = f"; one of {', '.join(map(repr, o.choices()))}" if o.values is not None else ""
        lines.append(f"{indent}- ``{o.name}`` (default {o.default!r}{values}): {o.doc}.")
    return "\n".join(lines)
