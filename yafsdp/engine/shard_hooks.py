"""Tensor hooks registered on the flat shards of ``model.parameters()``.

[Note: hooks on the shards]
The shards never enter autograd's graph (a unit's forward uses views of its gathered weight
buffer), so torch itself never calls a hook registered on them. The engine calls them at the end
of backward, after every reduce is folded into the grad shards (HSDP: after the all-reduce across
replicas, so the hooks see the complete gradient), in the order torch uses for a leaf:

- ``p.register_hook(fn)``: ``fn(p.grad)`` with the shard's final gradient; a tensor it returns
  replaces the gradient's values. Unlike torch (which calls it with each backward's incoming
  gradient, before accumulation), it sees the gradient accumulated so far in ``.grad``;
- ``p.register_post_accumulate_grad_hook(fn)``: ``fn(p)``, once ``p.grad`` is final. The
  optimizer-in-backward pattern (``fn`` steps an optimizer over ``p`` and zeroes ``p.grad``) works
  as it does in plain PyTorch.

Hooks run on every rank in the same order (units in order, the small group last), so a hook may
run collectives. Cost without hooks: one attribute check per unit per backward.
"""
from __future__ import annotations

import torch

from .shard_grad import plain

__all__ = ["fire"]


def fire(rt) -> None:
    hooked = [u.flat_param for u in rt.all if u.flat_param is not None and u.flat_param.grad is not None
              and (u.flat_param._backward_hooks or u.flat_param._post_accumulate_grad_hooks)]
    if not hooked:
        return
    if rt.replicas > 1:  # HSDP: complete first
        rt.sync_replicas()
    for p in hooked:
        for hook in list((p._backward_hooks or {}).values()):
            if p.grad is None:
                break
            out = hook(p.grad)
            if out is not None and out is not p.grad:
                with torch.no_grad():
                    plain(p.grad).copy_(out)
        for hook in list((p._post_accumulate_grad_hooks or {}).values()):
            hook(p)
