"""Where the engine's tensors live, behind one interface: :class:`DevicePlacement` (everything on
the compute device) and :class:`HostPlacement` (``offload=``: the optimizer's tensors in host memory).

[Note: placement]
A placement answers every question the step protocol used to answer with ``if offload``:

- where a role of ``owned_tensors()`` lives (:meth:`Placement.where`; the plan asks the same rule),
  and where the optimizer's tensors are allocated (:meth:`Placement.zeros`, pinned on a CUDA host);
- how a tensor reaches a collective (:meth:`to_device`: collectives only ever see device tensors)
  and comes back (:meth:`to_host`);
- the cast pass (master -> compute copy): in place on the device, or on the host into the staging
  copy followed by an upload (:meth:`cast`), and what follows the optimizer's copy-out
  (:meth:`copy_written`: the upload, overlapped with the optimizer's pass over later shards);
- what a reduce lands in (:meth:`arrival`): the fp32 grad shard on the device, or the host landing
  the host folds from (see [Note: reduced grads to the host] below);
- the cross-replica all-reduce of HSDP (:meth:`replicate`): on the grad shards where they are, or,
  on the host, staged through the device (see [Note: the all-reduce of host grad shards]).

[Note: reduced grads to the host]
The reduced shard goes device -> host into the unit's landing (on CUDA: a copy on the comm stream
right behind the reduce-scatter, into pinned memory), and the host folds it into the fp32 grad
shard once it has landed: the same kernel on the same values as without offload, so the grads are
bit for bit the same. On gloo both happen at the reduce's wait. On CUDA the host folds at the end
of backward (``finish_folds``: one host synchronisation per backward, inherent to an optimizer
step on the CPU); a unit reduced twice in one backward (a tied unit) first folds its previous
landing, so the copy never overwrites values the host has not read.

[Note: the all-reduce of host grad shards]
HSDP with offload: the grad shards to all-reduce across replicas live in host memory. NCCL takes
device tensors only, and a gloo replicate group on a GPU job would be a second set of process
groups every launcher must create (and a CPU all-reduce over the network). So the host shards are
staged through the device: unit by unit, a chunk of the grad shard is copied into the bytes of an
idle grad buffer (viewed as fp32: after backward no reduce uses them; no new device memory, the
plan is unchanged), all-reduced there over the replicate group exactly as without offload, and
copied back. On CUDA the copies run on the compute stream and the all-reduce on the comm stream
between the events ``Schedule.replicate`` records (``grads_final``, ``replicated``); after the
last copy back the host waits for the compute stream (``Schedule.host_waits_compute``: the host
reads and writes the shards next, in the optimizer step; one host synchronisation per step,
inherent to a step on the CPU). The
all-reduce is always *deferred* (to the step's first reader) with offload: the host folds at the
end of backward on CUDA, so there is nothing left to hide an overlapped all-reduce behind.
The sum of each element is that of the run without offload (unit by unit, as the overlapped mode
all-reduces); with two replicas it is bit for bit the same in every mode.

Collectives over replica groups that carry stored shards (``broadcast_from_replica0``) stage host
tensors the same way (:meth:`broadcast`), in chunks of at most ``STAGE_BYTES``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import kernels
from ..tools.trace import span

__all__ = ["Placement", "DevicePlacement", "HostPlacement", "HostFrozenPlacement", "make_placement",
           "placement_class", "STAGE_BYTES"]

STAGE_BYTES = 64 << 20  # most bytes a broadcast of a host tensor stages on the device at once


def placement_class(offload: str | None) -> "type[Placement]":
    """The placement of an engine with ``offload=`` (None, "optimizer", "all"): its class answers the
    layout's questions (what is allocated where) without a device, for the plan and the allocator alike."""
    return {None: DevicePlacement, "optimizer": HostPlacement, "all": HostFrozenPlacement}[offload]


class Placement:
    """Where one engine's tensors live; see [Note: placement]. The class attributes are the layout's
    rules, read by the allocator (alloc.py) and the plan (plan/build.py) alike."""

    offload: str | None = None  # the engine option this placement is
    host_roles: tuple[str, ...] = ()  # roles of allocated_bytes() in host memory
    optimizer_on_host = False  # master, grad shard and optimizer state on the host (with their staging)
    host_frozen = False  # the frozen and NF4 stores in host memory (offload="all")
    # Outsized units reduce their gradients in chunks through the grad pair, and at world 1 a unit's
    # weights alias its shards: both need the fp32 grad shard and the compute copy on the device.
    chunks_outsized = True
    aliases_world1 = True

    @classmethod
    def where_role(cls, role: str) -> str:
        # a gather format's host records: "<format>_host" ("fp8_host", "int8_host")
        return "host" if role in cls.host_roles or (cls.optimizer_on_host and role.endswith("_host")) else "device"

    @classmethod
    def compute_is_master(cls, compute_dtype: torch.dtype) -> bool:
        """Whether the compute copy is the fp32 master itself (fp32 compute with the master on the device)."""
        return compute_dtype == torch.float32 and not cls.optimizer_on_host

    def host_sides(self, master: torch.Tensor, total: int, gather_total: int, compute_dtype: torch.dtype,
                   reduce_dtype: torch.dtype):
        """``(compute_host, grad_landing, gather_host)``: the host side of the compute copy, the host
        landing of the reduced grads and the host side of the compact records -- None each without
        offload."""
        return None, None, None

    def optimizer_copy(self, group) -> torch.Tensor:
        """Where the optimizer's copy-out writes ``group``'s compute copy: the copy itself."""
        return group.compute

    def __init__(self, device: torch.device, host: torch.device):
        self.device = device  # the compute device: buffers, compute copies, collectives
        self.host = host  # where the optimizer runs: the fp32 master and grad shards
        self.pin = host != device and device.type == "cuda"

    def where(self, role: str) -> str:
        return self.where_role(role)

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed 1-D tensor where the optimizer runs (pinned when that is the host of a GPU)."""
        return torch.zeros(numel, dtype=dtype, device=self.host, pin_memory=self.pin)

    def store_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The frozen / NF4 store: on the host with offload="all", else on the device."""
        if self.host_frozen:
            return self.zeros(numel, dtype)
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where the optimizer's tensors live (``t`` itself when already there)."""
        return t if t.device == self.host else t.to(self.host)

    # The protocol's hooks; the device placement's are the plain ones.
    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device)

    def quiesce(self, schedule) -> None:
        """Nothing in flight still reads host tensors (before a load writes them)."""

    def before_step(self, schedule) -> None:
        """An optimizer step is about to write host tensors an upload may still read."""

    def cast(self, rt, groups: list, everything: bool) -> None:
        """The cast pass of ``groups`` (every trainable group when ``everything``): master -> compute copy."""
        if rt.compute is rt.master:
            return
        if everything:
            kernels.cast_(rt.compute, rt.master)
        else:
            for g in groups:
                kernels.cast_(g.compute, g.shard.detach())

    def quantize(self, rt, groups: list) -> None:
        """The records of compact trainable ``groups`` (their gather format's) from their masters."""
        for g in groups:
            g.kind.format.encode_(g.compute, g.shard.detach())

    def copy_written(self, schedule, group) -> None:
        """The optimizer wrote ``group``'s compute copy (its copy-out)."""

    def arrival(self, schedule, unit, fold):
        """What runs on the comm side behind ``unit``'s reduce-scatter: ``fold(reduced)`` itself here
        (the fp32 grad shard is on the device); called on the compute side before the reduce is issued."""
        return fold

    def finish_folds(self, schedule) -> None:
        """End of backward: every reduced shard folded into its grad shard."""

    can_overlap_replicas = True  # HSDP's all-reduce may run right behind each fold

    def replicate(self, rt, grad: torch.Tensor, label: str) -> None:
        """All-reduce one run of grad shards across the replicas (HSDP's deferred mode)."""
        rt.schedule.replicate(grad, label)

    def broadcast(self, t: torch.Tensor, src: int, group) -> None:
        dist.broadcast(t, src, group=group)


class DevicePlacement(Placement):
    """No offload: every tensor on the compute device."""

    def __init__(self, device: torch.device):
        super().__init__(device, device)


class HostPlacement(Placement):
    """``offload="optimizer"``: the fp32 master and grad shards (and the optimizer state) in host
    memory, the CPU, with the host side of the compute copy and the host landing of reduced grads."""

    offload = "optimizer"
    host_roles = ("master", "grad", "compute_host", "grad_landing")
    optimizer_on_host = True
    chunks_outsized = False  # an outsized unit's reduced grads need a landing of their own
    aliases_world1 = False

    def __init__(self, device: torch.device):
        super().__init__(device, torch.device("cpu"))
        self.folds: list = []  # units whose reduced grads await the host fold
        self.pin = device.type == "cuda"

    def host_sides(self, master, total, gather_total, compute_dtype, reduce_dtype):
        compute_host = master if compute_dtype == torch.float32 else self.zeros(total, compute_dtype)
        gather_host = self.zeros(gather_total, torch.uint8) if gather_total else None
        return compute_host, self.zeros(total, reduce_dtype), gather_host

    def optimizer_copy(self, group) -> torch.Tensor:
        return group.compute_host

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Always a copy (also when host and device are both the CPU, so a CPU run hands
        collectives the same tensors a GPU run does)."""
        return t.to(self.device, copy=True)

    def quiesce(self, schedule) -> None:
        schedule.quiesce()

    def before_step(self, schedule) -> None:
        schedule.wait_uploads()

    def cast(self, rt, groups: list, everything: bool) -> None:
        # master (host) -> compute_host (host, param_dtype) -> upload -> compute (device).
        # The host waits for the last upload before it writes its source again.
        if rt.compute_host is not rt.master:
            rt.schedule.wait_uploads()
            if everything:
                kernels.cast_(rt.compute_host, rt.master)
            else:
                for g in groups:
                    kernels.cast_(g.compute_host, g.shard.detach())
        if everything:
            rt.schedule.upload(rt.compute, rt.compute_host)
        else:
            for g in groups:
                rt.schedule.upload(g.compute, g.compute_host)

    def quantize(self, rt, groups: list) -> None:
        # master (host) -> record on the host (gather_host) -> upload -> gather_store (device)
        rt.schedule.wait_uploads()
        for g in groups:
            g.kind.format.encode_(g.compute_host, g.shard.detach())
            rt.schedule.upload(g.compute, g.compute_host)

    def copy_written(self, schedule, group) -> None:
        # Host -> device now, overlapped with the optimizer's pass over the next shards.
        schedule.upload(group.compute, group.compute_host)

    def arrival(self, schedule, unit, fold):
        # See [Note: reduced grads to the host]
        landing = unit.trainable.grad_landing
        if unit in self.folds:  # its previous landing is folded before the copy overwrites it
            self.finish_folds(schedule)
        self.folds.append(unit)

        def land(reduced: torch.Tensor) -> None:
            landing.copy_(reduced, non_blocking=True)
            schedule.on_host(unit.name, lambda: fold(landing))

        return land

    def finish_folds(self, schedule) -> None:
        if self.folds:
            self.folds = []
            schedule.finish_host_folds()

    can_overlap_replicas = False  # See [Note: the all-reduce of host grad shards]

    @torch.no_grad()
    def replicate(self, rt, grad: torch.Tensor, label: str) -> None:
        # See [Note: the all-reduce of host grad shards]
        stage = _idle_fp32(rt)
        step = stage.numel()
        with span("stage_all_reduce", label):
            for lo in range(0, grad.numel(), step):
                part = grad[lo:lo + step]
                dev = stage[:part.numel()]
                dev.copy_(part, non_blocking=True)  # compute stream (CUDA); replicate() waits for it
                rt.schedule.replicate(dev, label)
                rt.schedule.wait_replicated()  # gloo: the handle; CUDA: compute already waits on `replicated`
                part.copy_(dev, non_blocking=True)  # compute stream, into pinned host memory
        rt.schedule.host_waits_compute()  # the host reads (and writes) these shards next

    def broadcast(self, t: torch.Tensor, src: int, group) -> None:
        if t.device == self.device and t.device.type != "cpu":
            dist.broadcast(t, src, group=group)
            return
        flat = t.view(-1)
        step = max(1, STAGE_BYTES // max(1, t.element_size()))
        for lo in range(0, flat.numel(), step):
            part = flat[lo:lo + step]
            dev = self.to_device(part)
            dist.broadcast(dev, src, group=group)
            part.copy_(dev)


def _idle_fp32(rt) -> torch.Tensor:
    """fp32 device room for staging: the largest grad buffer's bytes (idle between backward calls)."""
    gs = max(rt.grad_buffers, key=lambda s: s.data.numel() * s.data.element_size())
    data = gs.data
    n = data.numel() * data.element_size() // 4
    return data.view(torch.uint8)[:n * 4].view(torch.float32)


class HostFrozenPlacement(HostPlacement):
    """``offload="all"``: also the frozen and NF4 stores in host memory, copied into their weight
    buffer's device landing before each gather ([Note: the frozen landing] in layout/sizing.py)."""

    offload = "all"
    host_roles = HostPlacement.host_roles + ("frozen", "nf4")
    host_frozen = True


def make_placement(device: torch.device, offload: str | None) -> Placement:
    cls = placement_class(offload)
    return cls(device)
