"""The methods of ``YaFSDP`` beyond wrapping and the forward (a base class of it, so that api.py holds
the wrapper's arguments, its contract, the forward and the module habits): optimizer groups,
clipping and the gradients' completion, full state dicts (whole, streamed one unit at a time,
loaded), the full optimizer state dict, per-parameter views of the full values and gradients, the
facts about the shards, the memory plan and what the engine allocated. Every method reads the
wrapper's attributes (``_rt``, ``_keys``, the groups), set by ``YaFSDP.__init__``."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .. import formats
from ..comm import collectives
from ..comm.groups import check_collective
from ..comm.hsdp import across_replicas, broadcast_from_replica0
from ..engine import shards
from ..engine.shard_grad import plain
from .state_dict import gather_full, load_full


class WrapperMethods:
    """Mixed into :class:`yafsdp.YaFSDP`; see the module docstring."""

    # ------------------------------------------------------------------ training
    def param_groups(self, weight_decay: float, small_weight_decay: float = 0.0, **options) -> list[dict]:
        """Two optimizer param groups: every unit's shard with ``weight_decay``, and the small group
        (all 1-D parameters: norm weights and biases) with ``small_weight_decay``."""
        big = [u.flat_param for u in self._rt.units if u.flat_param is not None]
        groups = [dict(params=big, weight_decay=weight_decay, **options)] if big else []
        if self._rt.small is not None and self._rt.small.flat_param is not None:
            groups.append(dict(params=[self._rt.small.flat_param], weight_decay=small_weight_decay, **options))
        return groups

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of all shards together; returns the total norm (unsharded value).

        HSDP: the gradients are first all-reduced across replicas (if a backward left local
        contributions), so every replica holds the same shards and the norm is taken over the
        shard group only: each element counted once, not once per replica."""
        rt = self._rt
        rt.sync_replicas()  # recovers an aborted backward first
        check_collective("clip_grad_norm_()", self.process_group)
        norm_type = float(norm_type)
        # The grad shards live where the optimizer runs (rt.host_device: the CPU with offload); the
        # all-reduce runs on the device (NCCL takes device tensors only), the scaling where the grads are.
        grads = [plain(u.flat_param.grad) for u in rt.all
                 if u.flat_param is not None and u.flat_param.grad is not None]
        if norm_type == float("inf"):
            local = (torch.stack([g.abs().max() for g in grads]).max() if grads
                     else torch.zeros((), device=rt.host_device))
            local = rt.to_device(local.float())
            collectives.all_reduce(local, self.process_group, op=dist.ReduceOp.MAX)
            total = local
        else:
            if grads:
                local = torch.stack([n.float() ** norm_type for n in torch._foreach_norm(grads, norm_type)]).sum()
            else:
                local = torch.zeros((), device=rt.host_device)
            local = rt.to_device(local)
            collectives.all_reduce(local, self.process_group)
            total = local ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, rt.to_host(coef))
        return total

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's accumulation context, kept for scripts and accelerate's ``accumulate()``: a no-op.
        Each backward inside it reduce-scatters as any other and its gradients accumulate in the
        fp32 grad shards, so the result is DDP's (which defers the all-reduce instead); no
        unsharded gradient is held across micro-steps. HSDP defers its cross-replica all-reduce to
        the step anyway (see [Note: the cross-replica all-reduce] in engine/replicas.py)."""
        yield

    def sync_grads(self) -> bool:
        """HSDP: complete the gradients now (their all-reduce across replicas, which the optimizer
        step and ``clip_grad_norm_`` otherwise trigger); call it before reading ``.grad`` yourself.
        Collective over every rank; a no-op for full sharding or when nothing is left to reduce.
        See [Note: the cross-replica all-reduce] in yafsdp/engine/replicas.py."""
        return self._rt.sync_replicas()

    # ------------------------------------------------------------------ the module tree after wrapping
    # Per-parameter views, all collective: yafsdp/wrapper/views.py; [Note: the module tree after wrapping] in orig_params.py.
    def summon_full_params(self, writeback: bool = False, with_grads: bool = False):
        """Context: the original parameters hold their full values (and ``.grad``); ``writeback=True``
        writes rank 0's values into the shards at exit."""
        from .views import summon_full_params

        return summon_full_params(self, writeback=writeback, with_grads=with_grads)

    def full_parameter(self, name: str) -> torch.Tensor:
        """The full values of original parameter ``name``, on every rank."""
        from .views import full_tensor

        return full_tensor(self, name, grad=False)

    def full_grad(self, name: str) -> torch.Tensor | None:
        """The full (averaged) gradient of original parameter ``name``, on every rank (None: no gradient)."""
        from .views import full_tensor

        return full_tensor(self, name, grad=True)

    def named_grad_norms(self) -> dict[str, torch.Tensor]:
        """{original parameter name: norm of its full gradient} (one small all-reduce)."""
        from .views import named_grad_norms

        return named_grad_norms(self)

    def full_optim_state_dict(self, optimizer) -> dict:
        """Collective. Rank 0: ``optimizer``'s state (an optimizer over this model's shards) in the
        unsharded form, keyed by original parameter name (as DCP's full optimizer state dict);
        other ranks: {}. See [Note: optimizer state that knows its shard] in optim/state.py."""
        from ..optim.state import full_optim_state_dict

        return full_optim_state_dict(self, optimizer)

    def load_full_optim_state_dict(self, optimizer, state_dict: dict | None) -> None:
        """Collective inverse of :meth:`full_optim_state_dict`, at any world size: rank 0's dict
        (other ranks may pass None) into every rank's optimizer state for its slice."""
        from ..optim.state import load_full_optim_state_dict

        load_full_optim_state_dict(self, optimizer, state_dict)

    # ------------------------------------------------------------------ state dicts
    def check_idle(self, what: str) -> None:
        """Raise unless the engine is between steps (no forward or backward running)."""
        if not self._rt.idle:
            raise RuntimeError(f"yafsdp.YaFSDP.{what} called during forward/backward; call it between steps")
        self._rt.quiesce()  # offload: nothing in flight still reads the host shards a load writes

    @property
    def needs_load(self) -> bool:
        """True while the shards hold no values yet (the model was built on the meta device):
        fill them with ``load_full_state_dict``, ``yafsdp.init``, ``yafsdp.hf`` or a checkpoint."""
        return self._needs_load

    def mark_loaded(self) -> None:
        """Every shard and buffer now holds the values to train with. The loaders call it; call it
        yourself only when zero-filled shards are what you want (a speed or memory benchmark)."""
        self._needs_load = False
        self._rt.invalidate_buffers()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective. Rank 0: the original module's state_dict (same keys, shapes, dtypes) on CPU;
        other ranks: {}. Gathers one unit at a time. HSDP: replica 0's shard group gathers (the
        replicas hold the same shards); the other replicas return {} at once."""
        self.check_idle("full_state_dict")
        if self.replica != 0:
            return {}
        return gather_full(self._rt, self._keys, self.process_group, self.rank)

    def iter_full_state_dict(self):
        """Collective generator: the full state dict one unit at a time. The coordinator gets a
        ``{key: CPU tensor}`` per unit (original dtypes; the module buffers last), the other ranks
        ``{}``; every rank must run it to the end. The coordinator holds one unit, not the model
        (``full_state_dict()`` collects these; ``yafsdp.hf.export_hf`` writes them as they come).
        See [Note: streaming export] in yafsdp/integrations/export.py."""
        from ..integrations.export import iter_units

        self.check_idle("iter_full_state_dict")
        if self.replica != 0:
            return
        from ..integrations.export import stream_order

        self._keys.check_stream([{key for key, _, _ in piece} for piece in stream_order(self._rt, self._keys)],
                                "iter_full_state_dict()")
        dtype_of = {key: ref.dtype for key, kind, ref in self._keys.entries if kind == "param"}
        for unit in iter_units(self._rt, self._keys, self.process_group, self.rank):
            # See [Note: state_dict hooks] in state_dict.py
            yield self._keys.module_keys({k: v.to("cpu", dtype_of.get(k, v.dtype), copy=True)
                                          for k, v in unit.items()}, partial=True) if unit else {}
            del unit

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor] | None):
        """Collective inverse of :meth:`full_state_dict`: rank 0's dict goes to every rank's shards.
        Other ranks may pass ``None`` or ``{}``. Checked on rank 0 first; nothing is modified on error."""
        self.check_idle("load_full_state_dict")
        if self.replicate_group is None:
            load_full(self._rt, self._keys, state_dict, self.process_group, self.rank, self.world_size)
        else:  # replica 0 loads (global rank 0's dict), then every replica takes its shards
            across_replicas(self.replicate_group, self.replica, ValueError, lambda: load_full(
                self._rt, self._keys, state_dict, self.process_group, self.rank, self.world_size))
            broadcast_from_replica0(self._rt, self.module, self.replicate_group)
        self.mark_loaded()

    # ------------------------------------------------------------------ introspection
    @property
    def flat_units(self):
        """Every flat unit in order, the small group (if any) last."""
        return list(self._rt.all)

    @property
    def units(self):
        """The units in order (the small group not included)."""
        return list(self._rt.units)

    @property
    def small(self):
        """The small group (every 1-D parameter of every unit as one flat unit), or None."""
        return self._rt.small

    @property
    def weight_buffers(self):
        return self._rt.weight_buffers

    @property
    def grad_buffers(self):
        return self._rt.grad_buffers

    @property
    def buffer_plan(self):
        return self._rt.buffer_plan

    def shard_info(self) -> list[shards.ShardInfo]:
        """Per flat shard (as named by ``named_parameters()``): its unit and this rank's slice.

        The first ``numel`` elements of a unit's flat layout do not depend on the world size (the
        padding after them does), which is what lets a sharded checkpoint be resharded."""
        return [shards.info_of(s.group.shard) for s in self._rt.stored_shards()]  # [Note: stored shards]

    def memory_plan(self, **activation_options):
        """Bytes per rank by role; see yafsdp.plan."""
        from ..plan import memory_plan

        return memory_plan(self, **activation_options)

    def owned_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the engine allocated on this rank, by role: the flat master, grad and
        compute-copy shards of all units (one tensor each) and the weight and grad buffers."""
        return self._rt.owned_tensors()

    def allocated_bytes(self, where: str | None = None) -> dict[str, int]:
        """Bytes of every tensor the engine allocated on this rank, by role. ``where="host"`` /
        ``"device"``: only the roles that live there (offload puts the master and grad shards and
        their host staging on the host; see [Note: host and device tensors] in alloc.py)."""
        if where not in (None, "host", "device"):
            raise ValueError(f"yafsdp.YaFSDP.allocated_bytes: where={where!r}; use None, 'host' or 'device'")
        out = {k: t.numel() * t.element_size() for k, t in self.owned_tensors().items()}
        out.setdefault("compute_copy", 0)
        out.setdefault("frozen", 0)
        out.setdefault("nf4", 0)
        for fmt in formats.gather_formats():  # the records of the gather formats ("fp8", "int8")
            out.setdefault(fmt.name, 0)
        if self._rt.placement.optimizer_on_host:
            out.setdefault("compute_host", 0)
            if self.gather_dtype is not None:  # the records' host side ("fp8_host", "int8_host")
                out.setdefault(self.gather_dtype + "_host", 0)
        if where is not None:
            out = {k: v for k, v in out.items() if self._rt.where(k) == where}
        return out

    def placement(self) -> dict[str, str]:
        """Where each role of :meth:`allocated_bytes` lives: "host" or "device"."""
        return {k: self._rt.where(k) for k in self.allocated_bytes()}
