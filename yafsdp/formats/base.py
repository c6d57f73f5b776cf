"""The gather-format protocol: what a flat group's compute copy is, and how it becomes values.

[Note: gather formats]
Every flat group of a unit (see [Note: unit groups] in unit.py) is gathered in one *format*, an
object of a subclass of :class:`Format` held by its ``GroupKind``. The plain format
(:data:`yafsdp.formats.PLAIN`) gathers ``param_dtype`` values straight into the weight buffer;
a *compact* format gathers a byte *record* per rank into the weight buffer's staging area and
expands it there into ``param_dtype`` values ([Note: expanding a compact gather] in comm/schedule.py).
Whatever the format, the modules see plain ``param_dtype`` views of the weight buffer.

A format owns everything that depends on its bytes, so that the engine asks it rather than
testing its name:

- ``record_bytes(n, dtype)`` and ``shard_align(align, dtype)``: one rank's record for ``n``
  values (codes, scales and any alignment), and the elements a rank's shard is a multiple of
  (whole blocks); the plan (``layout/sizing.py``) and the allocator size with these two.
- ``eligible(info)`` / ``eligible_unit(params, exclude)``: which parameters / units it takes. One
  rule for every compact format (:func:`linear_weight`): the 2-D ``weight`` of ``nn.Linear``
  modules only (so not a weight tied to an embedding), outside the small group, of whole blocks;
  trainable for a gather format, frozen for a storage format. ``default_exclude(module)``: the
  units a gather format leaves in ``param_dtype`` unless told otherwise (an HF model's head).
- ``encode_(record, values)``: values -> record. For a *gather* format (``stored=False``: fp8,
  int8) the values are the fp32 master shard and this is the cast pass; for a *storage* format
  (``stored=True``: nf4) the record is the shard of record itself, encoded at wrap time and on
  every load from the values in ``param_dtype``.
- ``adamw_step_(...)``: ``yafsdp.FusedAdamW``'s step when its copy-out is a record of this format
  (the AdamW kernel, then ``encode_`` of the updated shard, or one fused kernel).
- ``expand_(out, staging, shard_numel)`` and its pure-PyTorch twin ``expand_reference``: every
  rank's record end to end -> the values (the kernel + twin pattern of kernels/__init__.py);
  ``decode(records, shard_numel, dtype)`` allocates and expands (state dicts, views).
- ``checkpoint_entries(info, record)`` / ``checkpoint_loaded_(info, record, loaded)``: what a
  checkpoint holds of a stored record, and its zero padding after a load (a gather format's
  records are derived from the master and never saved).
- Zero padding: a gather format's record of the master's zero padding must expand to zeros (a
  block of zeros keeps scale 0 and codes 0); a stored format's padding is a record of zeros too
  (``checkpoint_loaded_`` writes it after a load).

A format is registered by name in ``yafsdp/formats/__init__.py`` (``register``); the user-facing
options resolve names through it: ``gather_dtype=`` takes the gather formats, ``quantize_frozen=``
the storage formats. Adding one is one module plus its registration: docs/formats.md walks
through int8.

The words, one meaning each: a *format* is a :class:`Format` object (``GroupKind.format``,
``formats.get(name)``, ``formats.gather_format(value)``); its *name* is a string ("values", "fp8",
"int8", "nf4"), and that is what the options hold: ``gather_dtype`` and ``quantize_frozen`` (the
config's, ``YaFSDP``'s attributes, the plan's) are a format's name or None, never a dtype.
``Format.compact`` and ``Format.stored`` are bools. A ``*_dtype`` that is not one of those two
options is a ``torch.dtype``: ``GroupKind.storage_dtype`` (the shard as kept) and
``GroupKind.compute_dtype`` (the weight buffer's values, what the modules compute with).
"""
from __future__ import annotations

import math

import torch

from .. import kernels

__all__ = ["Format", "itemsize", "linear_weight", "default_exclude"]


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def linear_weight(info, block: int) -> bool:
    """A parameter (``flat.ParamInfo``) a compact format may hold: the 2-D ``weight`` of
    ``nn.Linear`` modules only (every module holding the tensor is an ``nn.Linear`` holding it as
    ``weight``, so a weight tied to an embedding is not one), outside the small group, a whole
    number of ``block`` values (so a block never straddles two parameters)."""
    return (not info.small and len(info.shape) == 2 and info.numel % block == 0 and bool(info.owners)
            and all(isinstance(m, torch.nn.Linear) and attr == "weight" for m, attr in info.owners))


def default_exclude(module: torch.nn.Module) -> tuple[str, ...]:
    """The modules a gather format leaves in ``param_dtype`` when ``gather_exclude`` is None: an HF
    model's output head (``get_output_embeddings()``), as torchtitan's float8 recipes keep the
    output layer exact."""
    get = getattr(module, "get_output_embeddings", None)
    head = None
    if callable(get):
        try:
            head = get()
        except (AttributeError, NotImplementedError):
            head = None
    if head is None:
        return ()
    return tuple(name for name, m in module.named_modules() if m is head)


class Format:
    """A gather format (see [Note: gather formats]). Subclasses set the class attributes and
    override the methods their kind needs; the defaults are the plain format's."""

    name: str = "values"  # the user-facing name ("fp8", "int8", "nf4"); "values" for param_dtype
    compact: bool = False  # gathered as byte records into the staging area, then expanded
    stored: bool = False  # the record is the shard of record (frozen storage), not derived from a master
    block: int = 1  # values per scale block (a rank's shard holds whole blocks)
    aliases: tuple[str, ...] = ()  # other spellings accepted for ``name`` by the options
    summary: str = ""  # one line for error messages: what the record holds
    label: str = ""  # a few words for the plan's table: what the record holds

    def __repr__(self) -> str:
        return f"<yafsdp format {self.name!r}>"

    # -- sizes -------------------------------------------------------------------------------
    def shard_align(self, align: int, dtype: torch.dtype) -> int:
        """Elements a rank's shard is a multiple of: whole blocks, and ``align``."""
        return self.block * align // math.gcd(self.block, align)

    def record_bytes(self, shard_numel: int, dtype: torch.dtype) -> int:
        """Bytes one rank's compute copy takes for ``shard_numel`` values (gathered in ``dtype``)."""
        return shard_numel * itemsize(dtype)

    # -- which parameters --------------------------------------------------------------------
    def eligible(self, info) -> bool:
        """A parameter (``flat.ParamInfo``) this format may hold: any, for the plain format; for a
        compact one a :func:`linear_weight` of whole blocks, frozen for a stored format and
        trainable for a gather format."""
        if not self.compact:
            return True
        return info.frozen == self.stored and linear_weight(info, self.block)

    def eligible_unit(self, params, exclude: tuple[str, ...] = ()) -> bool:
        """A unit whose trainable group is gathered in this format (gather formats)."""
        trainable = [p for p in params if not p.frozen]
        return bool(trainable) and all(self.eligible(p) for p in trainable) and not any(
            p.fqn == e or p.fqn.startswith(e + ".") for p in trainable for e in exclude)

    # -- writing the record ------------------------------------------------------------------
    def encode_(self, record: torch.Tensor, values: torch.Tensor, *, twin: bool = False) -> torch.Tensor:
        raise NotImplementedError(f"format {self.name!r} has no record to encode")

    def adamw_step_(self, param, grad, exp_avg, exp_avg_sq, step, *, record: torch.Tensor, twin: bool,
                    **hyper) -> None:
        """FusedAdamW's step whose copy-out is this format's record of the updated ``param``:
        by default the AdamW kernel (no copy-out), then :meth:`encode_` of the whole shard."""
        if twin:
            kernels.adamw_step_reference(param, grad, exp_avg, exp_avg_sq, step, exact=False, **hyper)
        else:
            kernels.adamw_step_(param, grad, exp_avg, exp_avg_sq, step, **hyper)
        self.encode_(record, param.detach().view(-1), twin=twin)

    def check_copy(self, p: torch.Tensor, copy) -> None:
        """A copy-out registered for ``p`` in this format must be its record: refuse anything else."""
        n = p.numel()
        if not (isinstance(copy, torch.Tensor) and copy.dtype == torch.uint8 and copy.is_contiguous()
                and n % self.block == 0 and copy.numel() == self.record_bytes(n, torch.float32)
                and copy.device == p.device):
            raise ValueError(
                f"the {self.name} copy-out registered for p must be a contiguous uint8 record of "
                f"yafsdp.formats.get({self.name!r}).record_bytes({n}) bytes on {p.device} (p.numel() a multiple "
                f"of {self.block}); got "
                + (f"dtype={copy.dtype} numel={copy.numel()} device={copy.device}" if isinstance(copy, torch.Tensor)
                   else repr(type(copy))))

    # -- reading the record ------------------------------------------------------------------
    def expand_(self, out: torch.Tensor, staging: torch.Tensor, shard_numel: int) -> torch.Tensor:
        """``out`` (1-D, ``world * shard_numel`` values) <- ``world`` records end to end in ``staging``."""
        raise NotImplementedError(f"format {self.name!r} is gathered as values, not expanded")

    def expand_reference(self, out: torch.Tensor, staging: torch.Tensor, shard_numel: int) -> torch.Tensor:
        """The pure-PyTorch twin of :meth:`expand_` (the reference in tests)."""
        raise NotImplementedError(f"format {self.name!r} is gathered as values, not expanded")

    @torch.no_grad()
    def decode(self, records: torch.Tensor, shard_numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Records of ``world`` ranks end to end (1-D uint8) -> the values (1-D ``dtype``, fresh)."""
        world = records.numel() // self.record_bytes(shard_numel, dtype)
        out = torch.empty(world * shard_numel, dtype=dtype, device=records.device)
        return self.expand_(out, records, shard_numel)

    # -- checkpoints -------------------------------------------------------------------------
    def checkpoint_entries(self, info, record: torch.Tensor) -> dict[str, tuple[torch.Tensor, int, int]]:
        """What a checkpoint saves of a stored record (``stored`` formats; ``info``: its
        ``shards.ShardInfo``): ``{suffix: (local part, global start, global length)}``, each entry
        laid out alike for every world size so that it reshards like a flat group of values."""
        raise NotImplementedError(f"format {self.name!r} stores no record")

    def checkpoint_loaded_(self, info, record: torch.Tensor, loaded: dict[str, int]) -> None:
        """After a load of :meth:`checkpoint_entries` (``loaded``: the local length per suffix):
        the record past the loaded part holds zeros."""
        raise NotImplementedError(f"format {self.name!r} stores no record")
