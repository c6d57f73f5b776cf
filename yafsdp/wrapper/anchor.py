"""The device anchor: how model code finds its device and dtype after wrapping.

[Note: the device anchor]
Model code finds its device and dtype from its parameters: HF's ``PreTrainedModel.device`` / ``.dtype``
are ``next(self.parameters())``'s (the first floating one for the dtype), and ``generate()`` asks the
*inner* model (a PEFT model delegates to ``base_model.model``), as do ``num_parameters`` and
``get_input_embeddings``-style helpers. After wrapping these modules still hold parameters: the
original ones, storage-less ``ShardedParameter``s that keep the device (the engine's) and carry the
dtype their unit's forward sees (``param_dtype``, the gathered weight's), so the first one answers
both, at any depth ([Note: the module tree after wrapping] in orig_params.py). An earlier design
registered one empty parameter, ``yafsdp_device_anchor``, on such modules; a parent then counted,
named and initialised it (torchtitan's ``init_weights``, Lightning's summary, ``full_grad(name)`` over
``named_parameters()``): no module holds one now ([Note: what a parent module sees]). What remains is
the list of these modules (:func:`anchored_modules`): each gets the step entry, since code may run
one on its own ([Note: the root entry] in api.py).
"""
from __future__ import annotations

from torch import nn

__all__ = ["anchored_modules"]


def anchored_modules(module: nn.Module) -> list[nn.Module]:
    """Every module under ``module`` (itself included) whose class has a ``device`` or ``dtype`` property."""
    return [m for _, m in module.named_modules()
            if any(isinstance(getattr(type(m), k, None), property) for k in ("device", "dtype"))]
