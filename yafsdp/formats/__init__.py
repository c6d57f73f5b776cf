"""Gather formats: what a flat group's compute copy is and how it becomes values. See
[Note: gather formats] in base.py; docs/formats.md says how to add one.

``get(name)`` returns a registered format; ``gather_format(value)`` / ``storage_format(value)``
resolve the user options ``gather_dtype=`` and ``quantize_frozen=`` (None: the plain format).
"""
from __future__ import annotations

import torch

from .base import Format, default_exclude, itemsize
from .fp8 import FP8_FORMAT
from .int8 import INT8_FORMAT
from .nf4 import NF4_FORMAT
from .plain import PLAIN

__all__ = ["Format", "PLAIN", "get", "register", "gather_formats", "storage_formats", "gather_format", "gather_option",
           "storage_option", "storage_format", "itemsize", "default_exclude"]

_REGISTRY: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    """Make ``fmt`` known by its name (and its aliases) to the options and to ``get``."""
    for key in (fmt.name, *fmt.aliases):
        other = _REGISTRY.get(_key(key))
        if other is not None and other is not fmt:
            raise ValueError(f"yafsdp.formats.register: {key!r} already names {other!r}")
        _REGISTRY[_key(key)] = fmt
    return fmt


def _key(value):
    return value.lower() if isinstance(value, str) else value


def get(name) -> Format:
    """The format registered as ``name`` (None or "values": the plain format)."""
    if name is None:
        return PLAIN
    if isinstance(name, Format):
        return name
    fmt = _REGISTRY.get(_key(name))
    if fmt is None:
        raise KeyError(f"yafsdp.formats: no format named {name!r}; known: {sorted(_names())}")
    return fmt


def _names() -> set[str]:
    return {f.name for f in _REGISTRY.values()}


def gather_formats() -> list[Format]:
    """The registered formats a trainable group may be gathered in (``gather_dtype=``)."""
    return sorted({f for f in _REGISTRY.values() if f.compact and not f.stored}, key=lambda f: f.name)


def storage_formats() -> list[Format]:
    """The registered formats a frozen group may be stored in (``quantize_frozen=``)."""
    return sorted({f for f in _REGISTRY.values() if f.stored}, key=lambda f: f.name)


# the spellings of "gather in param_dtype" (gather_dtype=None)
_PLAIN_SPELLINGS = ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32", "param_dtype", "none", "values")


def gather_format(value) -> Format:
    """``gather_dtype``'s value -> a gather format; None and the names of ``param_dtype`` itself
    ("bf16", torch.bfloat16, ...) are the plain format. Anything else is refused."""
    if value is None or value in (torch.bfloat16, torch.float16, torch.float32):
        return PLAIN
    if isinstance(value, str) and value.lower() in _PLAIN_SPELLINGS:
        return PLAIN
    fmt = _REGISTRY.get(_key(value)) if isinstance(value, (str, torch.dtype)) else None
    if fmt is None or fmt not in gather_formats():
        raise ValueError(
            f"yafsdp.YaFSDP: gather_dtype={value!r} is not supported; use None (gather in param_dtype) or one of "
            + ", ".join(f"{f.name!r} (trainable nn.Linear weights gathered as {f.summary})" for f in gather_formats()))
    return fmt


def storage_format(value) -> Format:
    """``quantize_frozen``'s value -> a storage format (None: the plain format); anything else is refused."""
    if value is None:
        return PLAIN
    fmt = _REGISTRY.get(_key(value)) if isinstance(value, str) else None
    if fmt is None or fmt not in storage_formats():
        names = [f.name for f in storage_formats()]
        raise ValueError(f"yafsdp.YaFSDP: quantize_frozen={value!r} is not supported; use None or one of "
                         f"{names} (" + "; ".join(f.summary for f in storage_formats()) + ")")
    return fmt


for _f in (NF4_FORMAT, FP8_FORMAT, INT8_FORMAT):
    register(_f)


def gather_option(value) -> str | None:
    """``gather_dtype``'s value as the engine records it: a gather format's name, or None (param_dtype)."""
    fmt = gather_format(value)
    return fmt.name if fmt.compact else None


def storage_option(value) -> str | None:
    """``quantize_frozen``'s value as the engine records it: a storage format's name, or None."""
    fmt = storage_format(value)
    return fmt.name if fmt.stored else None
