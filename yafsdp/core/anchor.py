"""The device anchor: how model code finds its device and dtype after wrapping.

[Note: the device anchor]
After wrapping, the modules hold no parameters (the flat shards are the engine's), but model code
finds its device and dtype from them: HF's ``PreTrainedModel.device`` / ``.dtype`` are
``next(self.parameters())``'s, and ``generate()`` asks the *inner* model (a PEFT model delegates
to ``base_model.model``), as do ``get_input_embeddings``-style helpers and ``num_parameters``. So
one empty parameter in the compute dtype on the device, shared, is registered as ``yafsdp_device_anchor``
on the wrapped module and on every module under it whose class answers ``device`` or ``dtype``
through a property (HF ``PreTrainedModel`` / ``ModuleUtilsMixin``, diffusers' ``ModelMixin``, any
model class written the same way): each of them, at any depth, finds a parameter of the right
device and dtype. Plain layers (``nn.Linear`` ...) do not get one: their own state_dict() keys and
PEFT's view of them (``state_dict.original_structure`` hides the anchors too) stay as before.
"""
from __future__ import annotations

from torch import nn

__all__ = ["ANCHOR", "anchored_modules"]

ANCHOR = "yafsdp_device_anchor"


def anchored_modules(module: nn.Module) -> list[nn.Module]:
    """The wrapped module and every submodule whose class has a ``device`` or ``dtype`` property."""
    out = [module]
    for _, m in module.named_modules():
        if m is not module and any(isinstance(getattr(type(m), k, None), property) for k in ("device", "dtype")):
            out.append(m)
    return out
