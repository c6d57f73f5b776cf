"""The device anchor: how model code finds its device and dtype after wrapping.

[Note: the device anchor]
After wrapping, the modules hold no parameters (the flat shards are the engine's), but model code
finds its device and dtype from them: HF's ``PreTrainedModel.device`` / ``.dtype`` are
``next(self.parameters())``'s, and ``generate()`` asks the *inner* model (a PEFT model delegates
to ``base_model.model``), as do ``get_input_embeddings``-style helpers and ``num_parameters``. So
one empty parameter in the compute dtype on the device, shared, is registered as ``yafsdp_device_anchor``
on every module (the wrapped one included) whose class answers ``device`` or ``dtype`` through a
property (HF ``PreTrainedModel`` / ``ModuleUtilsMixin``, diffusers' ``ModelMixin``, any model class
written the same way): each of them, at any depth, finds a parameter of the right device and dtype
first. No other module gets one: not plain layers (their own state_dict() keys and PEFT's view of
them stay as before; ``state_dict.original_structure`` hides the anchors too), and not a wrapped
root that is a plain ``nn.Module`` (a torchtitan model, a user's model, a PEFT model, whose
``device`` reaches the HF model inside): code walking its parameters -- torchtitan's
``init_weights`` requires every module holding a parameter to initialise it, parameter counts --
must find the original parameters only. Such a module answers its device through its original
parameters, which keep device and dtype after wrapping ([Note: the module tree after wrapping] in
orig_params.py).
"""
from __future__ import annotations

from torch import nn

__all__ = ["ANCHOR", "anchored_modules"]

ANCHOR = "yafsdp_device_anchor"


def anchored_modules(module: nn.Module) -> list[nn.Module]:
    """Every module under ``module`` (itself included) whose class has a ``device`` or ``dtype`` property."""
    return [m for _, m in module.named_modules()
            if any(isinstance(getattr(type(m), k, None), property) for k in ("device", "dtype"))]
