"""``YaFSDP``: the public face of the engine — its arguments (the contract is the class docstring),
the forward, the nn.Module habits of a wrapped model, and its methods: optimizer groups, clipping and the
gradients' completion, full state dicts (whole, streamed one unit at a time, loaded), the full optimizer
state dict, per-parameter views, the facts about the shards, the memory plan and what the engine
allocated. The work is done elsewhere:

- units.py discovers the units; flat.py lays each out as a flat padded tensor;
- runtime.py owns the shards and buffers and runs the step protocol; autograd.py drives it
  from autograd nodes and module hooks; ``yafsdp.comm`` orders it on CUDA streams or gloo handles;
- state_dict.py gathers and loads the full state dict and materialises the shards at wrap time.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch import nn

from ..comm import collectives
from ..comm.checked import make_schedule
from ..comm.groups import check_collective
from ..comm.hsdp import across_replicas, broadcast_from_replica0, check_layout, resolve_groups
from .. import formats
from .anchor import anchored_modules
from ..engine.autograd import gate_small_group, install_hooks, rest_small_group
from ..layout.config import OPTIONS, EngineConfig, build_config, options_doc
from ..engine.ddp_guard import WrappedTwiceError, wrapped_twice_message
from .ema import refuse_deepcopy
from .module_methods import INIT_METHODS, adapt_module_methods, has_adapters
from ..optim.hooks import install_optimizer_hooks
from ..engine import shards
from ..engine.runtime import Runtime, in_backward
from ..engine.tree_guard import swapped_message, watch as watch_tree
from ..engine.shard_grad import plain
from .state_dict import StateDictKeys, gather_full, load_full, materialize
from ..layout.units import discover, mark_wrapped
from ..layout import dtensor
from . import tp_state

__all__ = ["YaFSDP"]


class YaFSDP(nn.Module):
    """Shard ``module`` over ``process_group`` unit by unit; a drop-in for the unwrapped module.

    Arguments (keyword-only after ``module``; every value and combination is checked once, by
    ``yafsdp.build_config``, which ``memory_plan`` and the example jobs use too):

    - ``module``: the model, on the CPU, the target device or the meta device; must not be wrapped already.
    - ``units`` (default None: automatic, HF decoder layers, embedding and head): modules whose parameters
      are gathered and reduced together; each parameter belongs to exactly one unit.
    - ``process_group`` (default None: the world): the shard group, or a pair ``(shard_group,
      replicate_group)`` for HSDP. Refused together with ``mesh``, and when this rank is not in it.
    - ``mesh`` (default None): a 1-D DeviceMesh (full sharding) or a 2-D one named ``("replicate",
      "shard")`` (HSDP); other shapes and names are refused. A model whose parameters are DTensors of
      torch's tensor parallel (``parallelize_module`` on ``mesh["tp"]``): the data-parallel dim,
      ``mesh["dp"]`` (docs/tp.md; pipeline parallel is not handled).
    - ``device`` (default None: the current CUDA device with NCCL, else the CPU): where buffers and
      collectives live.
    - ``config`` (default None): a ``yafsdp.EngineConfig`` (``yafsdp.build_config(...)``) standing for
      every engine option below; refused together with any of them.

    The engine options are the fields of ``yafsdp.EngineConfig`` (yafsdp/layout/config.py), where each
    is declared once with its default, its values and its check; this list is written from them
    (``options_doc``), and so is docs/api.md's table. Every value is checked, a refusal names it:
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        units: list[nn.Module] | None = None,
        process_group=None,
        mesh=None,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype = torch.float32,
        reduce_accum_dtype: torch.dtype | None = None,
        grad_quant: str | None = None,
        grad_quant_node: int = 1,
        zero_stage: int = 3,
        device: torch.device | str | None = None,
        align_bytes: int = 16,
        outsized_ratio: float = 1.5,
        chunk_outsized_grads: bool = True,
        grad_chunks: int = 1,
        sharded_lookup: bool = True,
        secondary_shard: int = 0,
        prefetch: int = 1,
        quantize_frozen: str | None = None,
        offload: str | None = None,
        gather_dtype: str | None = None,
        gather_exclude: list[str] | tuple[str, ...] | None = None,
        config: EngineConfig | None = None,
    ):
        # the arguments that are engine options (EngineConfig's fields), by name; first, while locals() holds
        # only the arguments
        engine_options = {name: value for name, value in locals().items() if name in OPTIONS}
        super().__init__()
        # Every option checked in one place (yafsdp/layout/config.py), as the plan and the jobs check them.
        cfg = build_config(config, **engine_options)
        quantize_frozen, offload, gather_dtype = cfg.quantize_frozen, cfg.offload, cfg.gather_dtype
        param_dtype, reduce_dtype, zero_stage = cfg.param_dtype, cfg.reduce_dtype, cfg.zero_stage
        reduce_accum_dtype = cfg.reduce_accum_dtype  # See [Note: narrow reduce, fp32 accumulation]
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "yafsdp.YaFSDP needs torch.distributed: call torch.distributed.init_process_group() first "
                "(launch with torchrun; gloo on CPU, nccl on GPU)"
            )
        # HSDP: shard over `group`, all-reduce the grad shards over `replicate` (yafsdp/comm/hsdp.py).
        group, replicate = resolve_groups(mesh, process_group)
        group = group if group is not None else dist.group.WORLD
        for what, g in (("process_group", group), ("the replicate group", replicate)):
            if g is not None and (g == dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(g) < 0):
                raise ValueError(f"yafsdp.YaFSDP: the current rank (global rank {dist.get_rank()}) is not in {what}")
        if replicate is not None and dist.get_world_size(replicate) == 1:
            replicate = None  # one replica: plain full sharding
        # Tensor-parallel (DTensor) parameters: found and checked here, before anything changes; see [Note:
        # tensor parallel inside the data-parallel shards] in layout/dtensor.py. None without TP.
        self._tp = dtensor.find(module, group, replicate)
        if self._tp is not None:
            dtensor.refuse_options(cfg)
            tp_state.check_module(module)
        if replicate is not None:
            check_layout(group, replicate, tp=self._tp.size if self._tp is not None else 1)
        self.process_group = group  # the shard group: every gather, reduce-scatter and state-dict collective
        self.replicate_group = replicate  # HSDP: this rank's peers holding the same shard; else None
        self.rank = dist.get_rank(group)  # index of this rank's shard
        self.world_size = dist.get_world_size(group)  # ranks sharing one copy of the model
        self.replicas = dist.get_world_size(replicate) if replicate is not None else 1
        self.replica = dist.get_rank(replicate) if replicate is not None else 0
        self.device = _resolve_device(device, group)
        self.zero_stage = zero_stage
        self.engine_config = cfg  # every option, validated (yafsdp/layout/config.py)
        self.param_dtype = param_dtype
        self.compute_dtype = cfg.compute_dtype
        self.reduce_dtype = reduce_dtype
        self.reduce_accum_dtype = reduce_accum_dtype  # torch.float32: reduce_dtype pieces summed in fp32; else None

        if self._tp is not None:  # the DTensor parameters' local tensors from here on (restored if this fails)
            self._tp.localize()
            try:
                specs, small = discover(module, units)
            except BaseException:
                self._tp.restore()
                raise
            self._tp.tag([p for s in specs for p in s.params] + small)
        else:
            specs, small = discover(module, units)
        # See [Note: compact trainable gathers] in formats/fp8_codec.py
        gather_exclude = formats.default_exclude(module) if cfg.gather_exclude is None else cfg.gather_exclude
        self._keys = StateDictKeys(module, specs, small)  # before any surgery
        # How gathers and reduces are ordered against compute: CUDA streams and events, or gloo
        # work handles. See [Note: streams and events] in comm/schedule.py.
        self.schedule = make_schedule(self.device, group, replicate)
        self._rt = Runtime(specs, small, cfg, gather_exclude=gather_exclude, schedule=self.schedule, group=group,
                           rank=self.rank, device=self.device, replicate_group=replicate)
        if self._tp is not None:
            self._rt.tp_group = self._tp.group
        self.quantize_frozen = quantize_frozen
        self.offload = offload
        self.gather_dtype = gather_dtype
        self.gather_exclude = gather_exclude
        if gather_dtype is not None and not any(g.kind.format is self._rt.gather_format for u in self._rt.all
                                                for g in u.groups):
            import warnings

            warnings.warn(
                f"yafsdp.YaFSDP: gather_dtype={gather_dtype!r} found no unit to gather compact (a unit qualifies "
                "when all its trainable parameters are 2-D nn.Linear weights with a multiple of "
                f"{self._rt.gather_format.block} elements; "
                f"excluded: {list(gather_exclude)}); every weight is gathered in param_dtype. Drop gather_dtype, "
                "or list units so that the linear layers form units of their own", UserWarning, stacklevel=2)
        if quantize_frozen is not None and not any(g.kind.format.stored for u in self._rt.all for g in u.groups):
            import warnings

            warnings.warn(
                f"yafsdp.YaFSDP: quantize_frozen={quantize_frozen!r} found no frozen nn.Linear weight to quantize "
                "(it takes 2-D weights of nn.Linear modules with requires_grad=False at wrap time and a multiple of "
                "64 elements); nothing is stored in 4 bits. Freeze the base before wrapping (peft.get_peft_model "
                "does), or drop quantize_frozen", UserWarning, stacklevel=2)
        # The flat master shards: this wrapper's parameters (named_parameters below), but not a submodule,
        # so that a parent module sees the original parameters only. See [Note: what a parent module sees]
        # in orig_params.py.
        self.__dict__["flat"] = self._rt.flat
        self.__dict__["_flat_shards"] = list(self._rt.flat._parameters.items())  # See _check_flat
        self.module = module
        mark_wrapped(module)
        mark_wrapped(self)
        # See [Note: copies of a wrapped model] in ema.py
        module.__dict__["__deepcopy__"] = refuse_deepcopy(f"the module wrapped by yafsdp.YaFSDP ({type(module).__name__})")
        self._needs_load = materialize(self._rt, module, group, self.rank, self.world_size)
        if replicate is not None:  # every replica starts from replica 0's values, as DDP does
            broadcast_from_replica0(self._rt, module, replicate)
        install_hooks(self._rt)
        watch_tree(self, module)  # See [Note: the module tree's structure is fixed at wrapping] in tree_guard.py
        install_optimizer_hooks()  # See [Note: optimizers that do not bump versions] in optim/hooks.py
        # See [Note: the root entry] and [Note: the device anchor] in anchor.py.
        self._anchored = anchored_modules(module)
        # The step entry on the root and on every model inside it that code may run on its own (HF
        # models: a PEFT model's generate() runs the inner LlamaForCausalLM's forward, never the root's);
        # entries nest (root_depth). prepend: the entry runs before a unit's own pre-hook when the
        # module is itself a unit (units=[module]).
        entries = [module] + [m for m in self._anchored if m is not module]
        for m in entries:
            m.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True, prepend=True)
            m.register_forward_hook(self._root_post_forward, with_kwargs=True, always_call=True)
        adapt_module_methods(module, entries, self.world_size)  # state_dict refused, generate synced: module_methods.py

    # ------------------------------------------------------------------ forward
    # [Note: the root entry]
    # A step begins when the wrapped module's own forward begins, whoever calls it: ``model(...)``,
    # ``model.module(...)``, a reference to the module kept from before wrapping, or HF
    # ``generate()`` (reached through ``model.generate``), or when the forward of an HF model inside
    # it begins (a PEFT model's ``generate()`` runs its base model's forward only). A forward pre-hook on the module runs
    # the cast pass, gathers the small group and hands it out; a forward hook that runs even when
    # the forward raises ends it (an exception drops every hold on the buffers).
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _root_pre_forward(self, module, args, kwargs):
        if in_backward():  # a recompute of the whole module inside backward: the units see to their weights
            return None
        if self._needs_load:
            raise RuntimeError(
                "yafsdp.YaFSDP: the model was built on the meta device and its shards hold no values yet; "
                "fill them first with model.load_full_state_dict(sd), yafsdp.init.init_shards_(model, rule), "
                "yafsdp.hf.load_hf_weights(model, path) or yafsdp.checkpoint.load_checkpoint(path, model)"
            )
        rt = self._rt
        rt.recover()  # before counting this entry: recovering an aborted backward resets the depth
        if rt.root_depth == 0:
            self._check_flat()
        rt.root_depth += 1
        if rt.root_depth == 1:
            small = rt.begin_forward()
            if small:
                gate_small_group(rt, small)
        return None

    def _check_flat(self) -> None:
        """The flat shards the engine reads are the wrapper's parameters: ``torch.func.functional_call(model,
        {"flat.<unit>": t}, ...)`` swaps them in ``model.flat._parameters`` without a hook, and the engine would
        read its own shards instead of ``t``: refused."""
        held = self._rt.flat._parameters
        for name, shard in self.__dict__["_flat_shards"]:
            if held.get(name) is not shard:
                raise RuntimeError(swapped_message(None, f"flat.{name}", held.get(name)))

    def _root_post_forward(self, module, args, kwargs, output):
        if in_backward():
            return None
        rt = self._rt
        if rt.root_depth == 0:  # the pre-hook refused (nothing was begun)
            return None
        rt.root_depth -= 1
        if rt.root_depth == 0:
            if rt.small is not None:  # See [Note: the module tree after wrapping] in orig_params.py
                rest_small_group(rt)
            # Called from torch's exception handler when the forward raised (see always_call).
            rt.end_forward(ok=not (output is None and sys.exc_info()[0] is not None))
        return None

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The flat master shards (one per unit and the small group) as ``flat.<unit>``: what an optimizer
        steps. (The wrapped module's own ``named_parameters()``, and a parent module's, list the original
        names: [Note: what a parent module sees] in orig_params.py.)"""
        yield from self.__dict__["flat"].named_parameters(prefix=f"{prefix}.flat" if prefix else "flat",
                                                          remove_duplicate=remove_duplicate)

    def apply(self, fn):
        """``fn`` on every module, inside ``summon_full_params(writeback=True)`` (collective): what
        ``fn`` writes into parameters lands in the shards (rank 0's values)."""
        with self.summon_full_params(writeback=True):
            super().apply(fn)
        return self

    # ------------------------------------------------------------------ refused PyTorch habits
    def _apply(self, fn, recurse=True):
        """``.to(dtype)``, ``.half()``, ``.double()``, ``.bfloat16()``, ``.cuda()``, ``.cpu()`` ...:
        refused when they would change a dtype or the device (the shards would stop being the
        engine's); a conversion that changes nothing passes."""
        probe = torch.empty(1, dtype=torch.float32, device=self.device)
        out = fn(probe)
        if isinstance(out, torch.Tensor) and (out.dtype != probe.dtype or out.device != probe.device):
            raise _conversion_error(out, self.device)
        # Nothing to convert: the flat shards stay as they are, the original parameters hold no
        # values ([Note: the module tree after wrapping]); only the module buffers see fn.
        for m in self.modules():
            for key, b in m._buffers.items():
                if b is not None:
                    m._buffers[key] = fn(b)
        return self

    @property
    def _ddp_params_and_buffers_to_ignore(self):
        # The first thing DistributedDataParallel's constructor asks its module, before any collective:
        # see [Note: DDP around a sharded model] in ddp_guard.py.
        raise WrappedTwiceError(wrapped_twice_message("DistributedDataParallel"))

    def state_dict(self, *args, **kwargs):
        raise RuntimeError(
            "yafsdp.YaFSDP.state_dict() is not supported: each rank holds only flat shards of the parameters, "
            "which loaded on another rank would silently mix them up. Use model.full_state_dict() (collective; "
            "rank 0 gets the original module's keys) or yafsdp.checkpoint.save_checkpoint(root, step, model, opt) "
            "for sharded checkpoints"
        )

    def load_state_dict(self, *args, **kwargs):
        raise RuntimeError(
            "yafsdp.YaFSDP.load_state_dict() is not supported: use model.load_full_state_dict(sd) (collective; "
            "rank 0 passes the original module's state_dict) or yafsdp.checkpoint.load_checkpoint(path, model, opt)"
        )

    def save_pretrained(self, *args, **kwargs):
        peft = has_adapters(self.module)
        raise RuntimeError(
            "yafsdp.YaFSDP: save_pretrained() of the wrapped module would write no weights (they are sharded); "
            + ("for its PEFT adapter use model.save_adapter(out_dir) (collective; PeftModel.from_pretrained loads "
               "it), for the base model with the adapter merged in yafsdp.adapters.export_merged(model, out_dir)"
               if peft else "use yafsdp.hf.export_hf(model, out_dir) (collective) to write an HF checkpoint")
        )

    def resize_token_embeddings(self, *args, **kwargs):
        raise RuntimeError(
            "yafsdp.YaFSDP: resize_token_embeddings() after wrapping would change the shapes of the embedding and the "
            "head, which were laid into flat shards at wrap time; resize the module before wrapping "
            "(module.resize_token_embeddings(len(tokenizer)), then yafsdp.YaFSDP(module))"
        )

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None or name == "module":
                raise
            attr = getattr(inner, name)
            if name in INIT_METHODS and callable(attr):
                def run_written_back(*args, **kwargs):
                    with self.summon_full_params(writeback=True):
                        return attr(*args, **kwargs)

                return run_written_back
            return attr

    def save_adapter(self, out_dir: str, adapter_name: str = "default") -> str | None:
        """Collective: the PEFT adapter of a wrapped PEFT model, in PEFT's format (see yafsdp.adapters)."""
        from ..integrations.adapters import save_adapter

        return save_adapter(self, out_dir, adapter_name)

    def compile_units(self, **compile_options) -> "YaFSDP":
        """Compile each unit's modules on their own, the torchtitan way: ``torch.compile`` of every
        member module's ``forward`` (the decoder layers, the embedding, the head), while the engine's
        gathers, gates and hooks stay outside the compiled regions (they run in the module's
        ``__call__``). An embedding looked up from its shards (``sharded_lookup``) stays uncompiled: its
        forward is the lookup's exchanges (collectives dynamo does not trace) around a row copy.
        ``compile_options`` go to ``torch.compile`` (e.g. ``mode=``, ``dynamic=``).
        Call it once, after wrapping and before the first step; returns the model."""
        if getattr(self, "_compiled_units", False):
            raise RuntimeError("yafsdp.YaFSDP.compile_units() was already called on this model")
        if self._tp is not None:
            raise RuntimeError(
                "yafsdp.YaFSDP.compile_units() together with tensor-parallel (DTensor) parameters is not supported "
                "yet; leave the units uncompiled, or wrap a model without tensor parallelism")
        if getattr(self.module, "is_gradient_checkpointing", False):
            import warnings

            warnings.warn(
                "yafsdp.YaFSDP.compile_units(): HF gradient checkpointing is on; it runs each block inside "
                "torch.utils.checkpoint, which disables dynamo, so those blocks run uncompiled. Turn it off to "
                "compile them, or checkpoint inside the block's own forward",
                RuntimeWarning, stacklevel=2,
            )
        seen: set[int] = set()
        for u in self._rt.units:
            if u.lookup_hooks is not None:  # See [Note: the sharded lookup of an embedding] in lookup.py
                continue
            for m in u.members:
                mod = m.module
                if id(mod) in seen:
                    continue
                seen.add(id(mod))
                mod.forward = torch.compile(mod.forward, **compile_options)
        self._compiled_units = True
        return self

    @property
    def recorder(self):
        """A ``yafsdp.trace.Recorder`` collecting what ran when, or None (the default)."""
        return self.schedule.recorder

    @recorder.setter
    def recorder(self, rec):
        self.schedule.recorder = rec

    def __deepcopy__(self, memo):
        raise refuse_deepcopy("a yafsdp.YaFSDP model")()

    @property
    def coordinator(self) -> bool:
        """True on the one rank that receives ``full_state_dict()`` and writes exports: rank 0 of
        the shard group (HSDP: of replica 0; tensor parallel: of TP rank 0)."""
        return self.rank == 0 and self.replica == 0 and self.tp_rank == 0

    @property
    def tp_rank(self) -> int:
        """This rank's coordinate on the tensor-parallel mesh of the model's DTensor parameters (0 without TP)."""
        return self._tp.rank if self._tp is not None else 0

    @property
    def tp_size(self) -> int:
        """The tensor-parallel degree of the model's DTensor parameters (1 without TP)."""
        return self._tp.size if self._tp is not None else 1

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """(replicas, shard size): (1, world size) for full sharding."""
        return self.replicas, self.world_size

    # ------------------------------------------------------------------ training
    def requires_grad_(self, requires_grad: bool = True) -> "YaFSDP":
        """Passes when nothing would change; otherwise refused: the split into trainable and frozen flat
        groups is made at wrap time (it flipped the flat shards only, leaving the module's parameters as
        they were, and the next forward refused the shards)."""
        if all(p.requires_grad == requires_grad for p in self.parameters()):
            return self
        raise RuntimeError(
            f"yafsdp: YaFSDP.requires_grad_({requires_grad}): which parameters train is fixed at wrap time (the "
            "trainable and frozen flat groups). Freeze before wrapping: module.requires_grad_(False), then "
            "yafsdp.YaFSDP(module); a model that never trains (a teacher, a reference model) is wrapped so and "
            "run under torch.no_grad()")

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
        shard group only: each element counted once, not once per replica. Tensor parallel: over the
        data-parallel and TP meshes, each element of the global model once (engine/tp.py)."""
        rt = self._rt
        rt.sync_replicas()  # recovers an aborted backward first
        check_collective("clip_grad_norm_()", self.process_group)
        norm_type = float(norm_type)
        # The grad shards live where the optimizer runs (rt.host_device: the CPU with offload); the
        # all-reduce runs on the device (NCCL takes device tensors only), the scaling where the grads are.
        held = [(u, plain(u.flat_param.grad)) for u in rt.all
                if u.flat_param is not None and u.flat_param.grad is not None]
        grads = [g for _, g in held]
        if self._tp is not None:  # each element of the global model once, over data parallel and TP
            from ..engine.tp import grad_norm

            total = grad_norm(rt, held, norm_type, self.process_group, self._tp.group)
        elif norm_type == float("inf"):
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
        tp_state.check_method(self._tp, what)  # a TP engine: the methods that do not run with it yet
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
        out = gather_full(self._rt, self._keys, self.process_group, self.rank)
        if self._tp is not None and self.rank == 0:  # the data-parallel index 0 ranks: then over TP
            out = tp_state.full_over_tp(self._tp, self._keys, out)
        return out

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
            if self._tp is not None and self.rank == 0:  # the data-parallel index 0 ranks: then over TP
                unit = tp_state.full_over_tp(self._tp, self._keys, unit)
            # See [Note: state_dict hooks] in state_dict.py
            yield self._keys.module_keys({k: v.to("cpu", dtype_of.get(k, v.dtype), copy=True)
                                          for k, v in unit.items()}, partial=True) if unit else {}
            del unit

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor] | None):
        """Collective inverse of :meth:`full_state_dict`: rank 0's dict goes to every rank's shards.
        Other ranks may pass ``None`` or ``{}``. Checked on rank 0 first; nothing is modified on error."""
        self.check_idle("load_full_state_dict")
        if self._tp is not None:  # global rank 0's full tensors split over TP first (HSDP: inside replica 0)
            state_dict = tp_state.split_over_tp(self._tp, self._keys, state_dict, self.rank == 0 and self.replica == 0)
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


# The engine options' part of the docstring, written from their one definition (yafsdp/layout/config.py).
YaFSDP.__doc__ = YaFSDP.__doc__.rstrip(" ") + options_doc() + "\n"


def _conversion_error(out: torch.Tensor, device) -> RuntimeError:
    return RuntimeError(
        f"yafsdp.YaFSDP: converting the wrapped model to dtype={out.dtype}, device={out.device} is not "
        f"supported: its parameters are fp32 master shards on {device} that the engine owns. For "
        "bf16/fp16 compute pass param_dtype= (and reduce_dtype=) to YaFSDP(...); to use another device, "
        "move the module before wrapping or pass device= to YaFSDP(...)"
    )


def _resolve_device(device, group) -> torch.device:
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
