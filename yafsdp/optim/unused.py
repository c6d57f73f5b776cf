"""Parameters no rank used are left untouched by the optimizer step.

[Note: parameters no rank used]
DDP and FSDP2 leave the ``.grad`` of a parameter that no rank's backward reached at None, so
``opt.step()`` skips it: no weight decay, no momentum. A flat shard has one ``.grad`` for all the
parameters of its unit, so a parameter of a unit that ran but was itself unused (an MoE expert no
token reached, a LoRA branch behind a condition) would read a zero gradient and be moved by weight
decay and momentum. The engine restores such parameters around the step instead:

* **Usage.** Each reduce of a unit records which of its trainable parameters the backward gave a
  gradient (``Unit.used``, host booleans, known without looking at the device). The record restarts
  when the reduce finds the shard's ``.grad`` None (after ``zero_grad()``), and accumulates
  otherwise — exactly when DDP's ``.grad`` would go from None to a tensor.
* **Agreement.** A parameter is unused when no rank used it. The optimizer's pre-step hook
  all-reduces (MAX) one byte per trainable parameter of the units this optimizer steps, over the
  engine's whole data-parallel world (HSDP: the shard group, then the replicas): one tiny
  collective per ``opt.step()`` (two with HSDP), issued on the
  compute stream like the grad-norm all-reduce, after every reduce of the backward was folded.
* **Snapshot, step, restore.** Before the step, each rank copies the slices of its shards that hold
  parameters *it* did not use (a superset of the globally unused ones, known on the host): the fp32
  master and every optimizer-state tensor of the shard's shape (AdamW's moments, SGD's momentum).
  After the step each copied slice is put back where the agreed byte is 0, with ``torch.where`` on
  the device (no host sync); a state the step created is reset to zero, its value before any
  step. A rank that used every parameter copies nothing. The restore bumps the shard's version, so
  the next cast pass writes its compute copy again.

* **Per-parameter steps.** DDP's AdamW counts steps per parameter; a flat shard's ``step`` counts
  the shard's. ``yafsdp.FusedAdamW`` asks :func:`step_usage` for the agreed bytes of each shard it
  steps and keeps, besides ``step``, a ``param_step`` per parameter of the unit (``state["param_step"]``,
  float32, shape ``(1, parameters)``, the same on every rank and world size): it advances only where
  some rank used the parameter, and a shard whose parameters' counts differ is stepped parameter by
  parameter with each one's own count -- DDP's per-parameter AdamW exactly (see optim/adamw.py,
  [Note: per-parameter steps]).

What remains different from DDP with other optimizers: their per-shard counters (torch AdamW's and
Adam's ``step``) and any optimizer state not shaped like the shard (factored statistics) still
advance, so a parameter used again later gets its unit's bias correction, not its own; for AdamW,
after a parameter sat out ``s`` of ``t`` steps, its update is scaled by
``(1-beta1^(t-s))/(1-beta1^t) * sqrt((1-beta2^t)/(1-beta2^(t-s)))`` (0.86 at t=3, s=1 with the default
betas), which tends to 1 as ``beta^t`` vanishes. Nothing else moves.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..comm import collectives
from ..comm.groups import check_collective
from ..engine.runtime import live_runtimes

__all__ = ["before_step", "after_step", "step_usage", "StepUsage"]

_PENDING: dict[int, list["_Snapshot"]] = {}  # id(optimizer) -> the snapshots of its current step


class StepUsage(NamedTuple):
    """Which parameters of one shard's unit some rank used in the step being taken."""

    agreed: torch.Tensor  # 1-D uint8 where the shard lives, one per trainable parameter (layout order)
    used_here: bool  # this rank used every one of them (then the agreed bytes are all 1, known on the host)


_USAGE: dict[int, dict[int, StepUsage]] = {}  # id(optimizer) -> id(shard) -> its usage in the current step


def step_usage(optimizer, p: torch.Tensor) -> StepUsage | None:
    """Inside ``optimizer.step()``: the usage of flat shard ``p`` (None for a parameter that is no
    engine's shard). See [Note: parameters no rank used]."""
    return _USAGE.get(id(optimizer), {}).get(id(p))


class _Snapshot:
    """One runtime's copies of the locally unused slices for one step, and the agreed usage."""

    def __init__(self, agreed: torch.Tensor):
        self.agreed = agreed  # uint8 per parameter: 1 where some rank used it
        self.slices: list[tuple] = []  # (flag index, shard, lo, hi, master copy, {state name: copy or None})


def _units_of(rt, params: set[int]) -> list:
    return [u for u in rt.all if u.flat_param is not None and id(u.flat_param) in params]


def before_step(optimizer) -> None:
    """Agree on usage across ranks and copy the slices this rank did not use (see the Note)."""
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    snaps = []
    _USAGE[id(optimizer)] = {}
    for rt in live_runtimes():
        units = _units_of(rt, params)
        if not units:
            continue
        flags: list[int] = []
        for u in units:
            n = len(u.layout.params)
            flags.extend(u.used if len(u.used) == n else [0] * n)
        local = torch.tensor(flags, dtype=torch.uint8)
        if rt.device.type == "cuda":
            local = local.pin_memory().to(rt.device, non_blocking=True)
        else:
            local = local.to(rt.device)
        for group in (rt.group, rt.replicate_group):  # HSDP: the replicas' usage counts too
            if group is not None and dist.get_world_size(group) > 1:
                check_collective("optimizer step (agreeing on parameters no rank used)", group)
                collectives.all_reduce(local, group, op=dist.ReduceOp.MAX)
        # The restore runs where the shards are: with offload the host (one tiny copy back; the
        # step itself runs there). See [Note: host and device tensors] in alloc.py.
        snap = _Snapshot(rt.to_host(local))
        k = 0
        usage = _USAGE[id(optimizer)]
        for u in units:
            lay = u.layout
            shard = u.flat_param
            n = len(lay.params)
            usage[id(shard)] = StepUsage(snap.agreed[k:k + n], all(flags[k:k + n]))
            state = optimizer.state.get(shard, {})
            for j, p in enumerate(lay.params):
                if shard.grad is None or flags[k + j]:
                    continue
                lo = max(p.offset, lay.shard_start) - lay.shard_start
                hi = min(p.offset + p.numel, lay.shard_start + lay.shard_numel) - lay.shard_start
                if hi <= lo:
                    continue  # no element of this parameter lives on this rank
                with torch.no_grad():
                    states = {name: t.detach()[lo:hi].clone() for name, t in state.items()
                              if torch.is_tensor(t) and t.shape == shard.shape}
                    snap.slices.append((k + j, shard, lo, hi, shard.detach()[lo:hi].clone(), states))
            k += len(lay.params)
        snaps.append(snap)
    if snaps:
        _PENDING[id(optimizer)] = snaps


def after_step(optimizer) -> None:
    """Put the copied slices back where no rank used the parameter."""
    _USAGE.pop(id(optimizer), None)
    for snap in _PENDING.pop(id(optimizer), ()):
        with torch.no_grad():
            for k, shard, lo, hi, master, states in snap.slices:
                used = snap.agreed[k].bool()
                cur = shard.detach()[lo:hi]  # shares the shard's version counter: the restore bumps it
                cur.copy_(torch.where(used, cur, master))
                for name, t in optimizer.state.get(shard, {}).items():
                    if not (torch.is_tensor(t) and t.shape == shard.shape):
                        continue
                    now = t.detach()[lo:hi]
                    before = states.get(name)
                    now.copy_(torch.where(used, now, before if before is not None else torch.zeros_like(now)))
