"""Copies of a wrapped model: why ``copy.deepcopy`` is refused, and an EMA over the shards.

[Note: copies of a wrapped model]
``copy.deepcopy(model)`` (an EMA copy, a frozen DPO reference policy) cannot give a working
second engine: the copy would share nothing with a process group (which cannot be pickled),
its modules hold views of the first engine's weight buffers (autograd refuses to deepcopy
them after a forward), and the hooks would drive the first engine's runtime. So it is refused,
on the wrapper and on the module it wraps, naming the supported ways:

- wrap a second model: ``ema = yafsdp.YaFSDP(copy.deepcopy(base), ...)`` with a deepcopy of the
  base model taken before wrapping (or a fresh model filled with
  ``ema.load_full_state_dict(model.full_state_dict())``). Two engines over the same architecture
  and arguments lay out the same flat shards on every rank, so ``ema.parameters()`` and
  ``model.parameters()`` pair up element for element and an elementwise update of the shards
  (``e.lerp_(p, 1 - decay)``) is exactly the update of the unsharded weights;
- :class:`ShardEMA`: the same without a second engine: one fp32 copy of this rank's shards.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["ShardEMA", "refuse_deepcopy"]


def refuse_deepcopy(what: str):
    def __deepcopy__(memo=None):
        raise RuntimeError(
            f"yafsdp: copy.deepcopy of {what} is not supported: its parameters are flat shards owned by the engine "
            "(and its process group cannot be copied). For an EMA or a frozen reference model, wrap a second model: "
            "yafsdp.YaFSDP(copy.deepcopy(base), ...) with the base model copied before wrapping (or a fresh one "
            "filled with other.load_full_state_dict(model.full_state_dict())); both engines lay out the same shards, "
            "so updating other.parameters() from model.parameters() elementwise (e.lerp_(p, 1 - decay)) is exact. "
            "Or use yafsdp.ema.ShardEMA(model)")

    return __deepcopy__


class ShardEMA:
    """An exponential moving average of a wrapped model's trainable shards (fp32, this rank's
    slice only; no collective). ``update(decay)``: ``ema = decay * ema + (1 - decay) * weights``.
    ``swapped()``: a context in which the model computes (and ``full_state_dict()`` exports) with
    the averaged weights; the training weights are back on exit."""

    def __init__(self, model):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, decay: float) -> None:
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1.0 - float(decay))

    @contextlib.contextmanager
    def swapped(self):
        """The averaged weights in the model for the duration (in place: the engine re-casts them)."""
        self.model.check_idle("ShardEMA.swapped")
        self._swap()
        try:
            yield self.model
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for p, s in zip(self.params, self.shadow):
            tmp = p.detach().clone()
            p.copy_(s)  # bumps the shard's version: its compute copy is cast again before the next gather
            s.copy_(tmp)
        self.model._rt.invalidate_buffers()

    def state_dict(self) -> dict:
        """This rank's averaged shards (save per rank, as the optimizer's state)."""
        return {"shadow": [s.clone() for s in self.shadow]}

    def load_state_dict(self, sd: dict) -> None:
        with torch.no_grad():
            for s, v in zip(self.shadow, sd["shadow"]):
                s.copy_(v)
