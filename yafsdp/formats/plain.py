"""The plain format: a group gathered as ``param_dtype`` values, straight into the weight buffer
(the compute copy is the values; nothing to expand). See [Note: gather formats] in base.py."""
from __future__ import annotations

from .base import Format

__all__ = ["Values", "PLAIN"]


class Values(Format):
    name = "values"
    summary = "param_dtype values"


PLAIN = Values()
