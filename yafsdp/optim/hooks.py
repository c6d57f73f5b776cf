"""The process-wide optimizer hooks the engine needs (installed once, by the first YaFSDP).

[Note: optimizers that do not bump versions]
The engine knows a master shard changed (so its compute copy must be cast again and a buffer
still holding its gathered weights is stale) from the shard's version counter. torch's fused
optimizers (``AdamW(fused=True)``, ``Adam(fused=True)``, ``SGD(fused=True)``) update parameters
in place *without* bumping it, which would leave the engine computing with the weights of the
previous step. A process-wide optimizer step pre/post hook pair (installed by the first
``YaFSDP``) closes the gap: every yafsdp master shard with a gradient whose version an
optimizer step left unchanged gets its version bumped. Optimizers that do bump (foreach/for-loop
torch optimizers, ``yafsdp.FusedAdamW``) are untouched.

The same pre-step hook completes an aborted backward (``Runtime.recover``) before any optimizer
step reads the grad shards, and (HSDP) all-reduces them across replicas: see [Note: the
cross-replica all-reduce] in replicas.py. The pair also leaves parameters no rank used untouched by the
step (see [Note: parameters no rank used] in unused.py).
"""
from __future__ import annotations

import weakref

import torch

from . import state as optim_state, unused
from .guard import check_before_step, check_group
from ..engine import shards
from ..engine.orig_params import adopt_param_group
from ..engine.replicas import sync_before_step
from ..engine.runtime import live_runtimes

__all__ = ["install_optimizer_hooks"]


def recover_all() -> None:
    """Recover every engine whose last backward was aborted (see ``Runtime.recover``)."""
    for rt in live_runtimes():
        rt.recover()


_OPTIMIZER_HOOKS: list = []  # the process-wide pair, installed once
_VERSIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> [(shard, version)]


def _versions_before_step(optimizer, args, kwargs):
    """See [Note: optimizers that do not bump versions]. Also: an aborted backward is completed
    before any optimizer step reads the grad shards."""
    check_before_step(optimizer)  # see [Note: optimizers that would train the wrong thing] in guard.py
    optim_state.before_step(optimizer)  # see [Note: optimizer state that knows its shard] in optim/state.py
    recover_all()
    sync_before_step(optimizer, live_runtimes())  # HSDP: the all-reduce across replicas, once per step (replicas.py)
    for rt in live_runtimes():  # offload: no upload still reads what this step is about to write
        rt.before_optimizer_step()
    _VERSIONS[optimizer] = [
        (p, p._version) for g in optimizer.param_groups for p in g["params"]
        if p.grad is not None and shards.info_of(p) is not None
    ]
    unused.before_step(optimizer)


def _bump_unchanged_after_step(optimizer, args, kwargs):
    unused.after_step(optimizer)
    for p, v in _VERSIONS.pop(optimizer, ()):
        if p._version == v:
            torch.autograd.graph.increment_version(p)


def install_optimizer_hooks() -> None:
    if not _OPTIMIZER_HOOKS:
        _adopt_original_parameters()
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _OPTIMIZER_HOOKS.append(register_optimizer_step_pre_hook(_versions_before_step))
        _OPTIMIZER_HOOKS.append(register_optimizer_step_post_hook(_bump_unchanged_after_step))


def _adopt_original_parameters() -> None:
    """``torch.optim.Optimizer.add_param_group`` (which every optimizer's constructor calls) first hands each
    group to ``orig_params.adopt_param_group``: an optimizer built over a parent module's parameters steps the
    flat shards, or is refused at construction. See [Note: what a parent module sees] in orig_params.py. Then
    ``guard.check_group``: see [Note: optimizers that would train the wrong thing] in guard.py."""
    from torch.optim import Optimizer

    plain = Optimizer.add_param_group
    if getattr(plain, "_yafsdp_adopts", False):
        return

    def add_param_group(self, param_group):
        if isinstance(param_group, dict):
            adopt_param_group(param_group, {id(p) for g in self.param_groups for p in g["params"]})
            check_group(self, param_group)
        return plain(self, param_group)

    add_param_group._yafsdp_adopts = True
    add_param_group.__doc__ = plain.__doc__
    Optimizer.add_param_group = add_param_group
