"""Refusing a data-parallel wrapper around a yafsdp-wrapped model, before it touches the shards.

[Note: DDP around a sharded model]
``DistributedDataParallel(model)`` assumes every rank holds the whole model: its constructor
broadcasts rank 0's parameters over every other rank (``_sync_module_states``) and its reducer
all-reduces ``.grad`` of each parameter after backward. Around a ``yafsdp.YaFSDP`` model both are
wrong: each rank's flat shard is a *different* slice of the model, so the broadcast silently replaces
rank 1's slice by rank 0's (every rank then trains on one slice), and the engine has already
reduce-scattered the gradients. Frameworks do it on the user's behalf (Lightning / Fabric
``strategy="ddp"``, accelerate's ``prepare()`` with several processes), so it is refused in DDP's
constructor, before its first collective, with the setting to change. There is no exact no-op to
offer instead: listing every parameter in ``_ddp_params_and_buffers_to_ignore`` makes DDP refuse a
module without trainable parameters, and a DDP that ignores everything still owns the forward.

Two places see it, both without patching torch and with no cost outside DDP's constructor:

- **DDP around the wrapper itself** (``DDP(YaFSDP(m))``, Fabric's ``setup_module``, accelerate's
  ``prepare``): the first thing DDP's constructor asks the module, before any collective, is
  ``hasattr(module, "_ddp_params_and_buffers_to_ignore")``. ``YaFSDP`` answers it with a property
  that raises :class:`WrappedTwiceError` (``hasattr`` passes on every exception but AttributeError).
- **DDP around a parent of the wrapper** (a ``LightningModule`` whose ``configure_model`` wrapped a
  child, a user's container): DDP reads the parent's attribute, not the child's, so the first touch
  is in ``_sync_module_states``, which calls ``.detach()`` on every parameter of the parent,
  the storage-less original parameters included ([Note: the module tree after wrapping] in
  orig_params.py), and broadcasts only once all of them are collected. That read is refused
  anyway; when the refusal finds DDP's constructor on the Python stack (:func:`inside_ddp_init`,
  a frame walk that runs only on this error path), it raises :class:`WrappedTwiceError` instead of
  the generic "read outside its unit's forward". With ``init_sync=False`` DDP broadcasts nothing;
  its first backward then never sees its hooks fire on the flat shards and DDP fails at the next
  step ("Expected to have finished reduction"): loud, not silent.
"""
from __future__ import annotations

import sys

__all__ = ["WrappedTwiceError", "wrapped_twice_message", "inside_ddp_init"]


class WrappedTwiceError(RuntimeError):
    """A data-parallel wrapper (DDP, a framework's DDP strategy) around a yafsdp-wrapped model."""


_WAY_OUT = ("yafsdp.YaFSDP already shards the model and reduces its gradients over the process group; it needs no "
            "DistributedDataParallel around it (DDP's constructor would broadcast rank 0's flat shards over every "
            "other rank's own slice). Use it as it is: plain PyTorch: no DDP; Lightning Trainer / Fabric: "
            "strategy=\"yafsdp\" (import yafsdp.lightning) instead of \"ddp\"; transformers / TRL Trainer: "
            "yafsdp.trainer.YaFSDPTrainer; accelerate: do not pass the model to accelerator.prepare() (prepare the "
            "optimizer and data loaders only)")


def wrapped_twice_message(outer: str, inner: str = "a yafsdp.YaFSDP model") -> str:
    """The refusal's text: ``outer`` (what wraps) around ``inner``, and the setting to change."""
    return f"yafsdp: {outer} around {inner} (wrapped twice). {_WAY_OUT}"


def inside_ddp_init() -> bool:
    """True when ``torch.nn.parallel.DistributedDataParallel.__init__`` (or a subclass's call of it)
    is on the calling thread's Python stack. Cheap enough for error paths only."""
    from torch.nn.parallel import DistributedDataParallel

    code = DistributedDataParallel.__init__.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
