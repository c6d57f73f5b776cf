"""Building the memory plan of a model (``memory_plan``): unit discovery and the flat layouts, the
buffer sizing the allocator uses (sizing.py), placement, staging and the activation estimate, into a
:class:`~yafsdp.plan.report.MemoryPlan` (report.py holds the plan and how it is shown)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import reduces_in_place
from .. import formats
from ..layout.config import OPTIONS, EngineConfig, build_config
from ..engine.placement import placement_class
from ..layout.dtensor import has_dtensor_params
from ..layout.units import discover, weight_free_backward
from .activations import TPTrace, activation_estimate
from .staging import persistent_buffer_bytes, staging_bytes
from ..layout.sizing import (OPTIMIZER_BYTES, as_dtype, check_secondary, dtype_name, itemsize, plan_buffers,
                             plan_secondary, quant_plan, round16, secondary_pieces, unit_align, unit_shape)
from .report import MemoryPlan, UnitRow


def _gather_bytes(lay, cbytes: int) -> int:
    """Bytes one gather of a unit (``sizing.UnitShape``) brings to each rank."""
    plain = (lay.trainable.padded_numel if lay.trainable is not None and not lay.gather_record else 0) + (
        lay.frozen.padded_numel if lay.frozen is not None else 0)
    return plain * cbytes + lay.staging_bytes


def _grad_slot_name(slots, i: int, lay) -> str:
    """The grad slot(s) unit ``i`` reduces through, as the plan prints them."""
    if slots.grad_of[i] < 0:  # frozen; or world 1: [Note: world-1 gradients] in sizing.py
        return "its grad shard (world 1)" if lay.trainable is not None else "-"
    width = slots.grad_chunk[i] if slots.grad_chunk else 0
    if not width:
        return slots.grad[slots.grad_of[i]].name
    n = -(-lay.trainable_shard // width)  # See [Note: chunked outsized gradients] in sizing.py
    return f"{'/'.join(slots.grad[k].name for k in slots.chunk_slots)} in {n} chunks"


def _is_dtype(name: str) -> bool:
    """An engine option whose values are torch dtypes (the plan takes their names too)."""
    opt = OPTIONS.get(name)
    return opt is not None and opt.type.startswith("torch.dtype")


# [Note: the plan of a TP model]
# A wrapped TP engine holds each DTensor parameter's local tensor (layout/dtensor.py), so its plan is that
# of the local shapes over the data-parallel ranks. The plan of a model that has not been parallelized
# yet (``tp=N``) needs those shapes without a TP mesh: ``llama_tp_local_shapes`` reads them off
# ``llama_tp_plan``'s styles as torch would apply them (a Linear split on dim 0 column-parallel, dim 1
# row-parallel, an Embedding the other way round; norms whole), and the unit discovery's ParamInfos
# take them before the flat layouts are cut. Everything downstream is the engine's own sizing, so the
# plan equals a real dp x TP engine's allocations (tests/multirank/test_tp.py checks it at dp 2 x TP 2,
# uneven vocabulary included). Only Llama's plan is known here: another model is refused by name. The
# activation estimate of a TP model (``batch`` and ``seq``) traces the meta copy parallelized the same way:
# [Note: the activation trace under tensor parallelism] in activations.py.
@contextlib.contextmanager
def _tp_trace(model, tp: int, tp_rank: int, seq: int, sequence_parallel: bool, loss_parallel: bool):
    """The ``TPTrace`` of the activation estimate: a wrapped TP engine's own mesh and the settings
    ``parallelize_llama`` recorded; a plain model's ``tp`` > 1 on a TP mesh over the fake process group
    of ``tp`` ranks, set up here and taken down after; None without TP."""
    eng = model if isinstance(getattr(model, "engine_config", None), EngineConfig) else None
    if eng is not None:
        if eng.tp_size == 1:
            yield None
            return
        recorded = next((m._yafsdp_llama_tp for m in eng.module.modules() if hasattr(m, "_yafsdp_llama_tp")), None)
        if recorded is None:
            raise ValueError(
                "yafsdp.plan.memory_plan: batch/seq for a model whose tensor parallelism was not applied by "
                "yafsdp.integrations.tp_plans.parallelize_llama: the activation estimate parallelizes a meta copy "
                "the same way and knows only that plan; plan the bytes without batch and seq")
        tp, sequence_parallel, loss_parallel = eng.tp_size, recorded["sequence_parallel"], recorded["loss_parallel"]
    elif tp == 1:
        yield None
        return
    if sequence_parallel and seq % tp:
        raise ValueError(f"yafsdp.plan.memory_plan: seq={seq} with tensor parallel degree {tp}: sequence parallelism "
                         f"splits the sequence over the TP ranks; give a multiple of {tp}")
    if eng is not None:
        yield TPTrace(eng._tp.mesh, sequence_parallel, loss_parallel)
        return
    if dist.is_available() and dist.is_initialized():
        raise ValueError(
            f"yafsdp.plan.memory_plan: tp={tp} with batch/seq in a process with a process group: the activation "
            "trace sets up a TP mesh of its own over the fake process group, which needs a process without one "
            f"(python -m yafsdp plan --tp {tp} ...); in a distributed script, parallelize and wrap the model and call "
            "model.memory_plan(batch=..., seq=...)")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=dist.HashStore(), rank=tp_rank, world_size=tp)
    try:
        yield TPTrace(init_device_mesh("cpu", (tp,)), sequence_parallel, loss_parallel)
    finally:
        dist.destroy_process_group()


def _tp_shapes(model, cfg, tp: int, tp_rank: int, specs, small_params) -> None:
    """Give the ParamInfos of ``model`` their local shapes under Llama's TP plan (see [Note: the plan of a
    TP model]); refuses what a TP engine refuses."""
    from ..integrations.tp_plans import llama_tp_local_shapes
    from ..layout.dtensor import refuse_options

    try:
        refuse_options(cfg)
        shapes = llama_tp_local_shapes(model, tp, tp_rank)
    except ValueError as e:
        msg = str(e)
        for who in ("yafsdp.YaFSDP:", "yafsdp.integrations.tp_plans:"):
            msg = msg.replace(who, "yafsdp.plan.memory_plan:", 1)
        raise ValueError(msg) from None
    for info in [p for s in specs for p in s.params] + list(small_params):
        info.shape = shapes.get(info.fqn, info.shape)


def plan_backend(backend: str | None) -> str:
    """The backend a plan of a plain module assumes (see ``memory_plan``)."""
    if backend is not None:
        return str(backend)
    if dist.is_available() and dist.is_initialized():
        return str(dist.get_backend())
    return "nccl" if torch.cuda.is_available() else "gloo"


def memory_plan(
    model: nn.Module,
    *,
    world_size: int | None = None,
    rank: int = 0,
    units: list[nn.Module] | None = None,
    optimizer: str | int = "adamw",
    batch: int | None = None,
    seq: int | None = None,
    checkpointing: bool = False,
    attention: str = "fused",
    inputs_fn=None,
    async_save: bool = False,
    backend: str | None = None,
    config=None,
    replicas: int = 1,
    tp: int = 1,
    tp_rank: int = 0,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    **engine_options,
) -> MemoryPlan:
    """Bytes per rank by role for ``model``: a wrapped ``YaFSDP`` (its own layouts and options)
    or a plain module (any device, meta included; nothing is allocated) with the engine options
    given here: ``engine_options`` are ``YaFSDP``'s (the fields of ``yafsdp.EngineConfig``, their
    dtypes also by name: "bf16", "fp32"), checked by ``yafsdp.layout.config.build_config`` as
    ``YaFSDP(...)`` checks them (``config=``: an ``EngineConfig`` instead of the options).
    ``sharded_lookup`` is checked and changes no byte (the lookup's exchanges are the size of an
    activation). ``async_save=True`` adds the host memory of an asynchronous save's staging copy
    (``yafsdp.checkpoint.AsyncSaver``, the jobs' ``--async-save``). ``batch`` and ``seq`` add the
    activation estimate (HF causal LMs, PEFT models around them and modules holding either, or any model with
    ``inputs_fn(batch, seq, device) -> kwargs``: [Note: a meta copy of a wrapped model] in activations.py).
    ``optimizer``: a name in ``OPTIMIZER_BYTES`` or bytes of state per shard element. ``backend`` (a
    plain module): the process group's backend the engine would run on, which decides whether grad
    buffers need a reduce staging ([Note: reduce-scatter in place] in comm/collectives.py); default:
    the initialized default group's, else "nccl" when CUDA is available and "gloo" when not. ``replicas`` (a
    plain module): HSDP's copies of the shard group of ``world_size`` ranks; it changes bytes only where that
    group has one rank ([Note: world-1 gradients] in sizing.py: with replicas the grad buffers stay, their
    all-reduce runs behind the fold). ``tp`` (a plain module, no DTensor parameters): the TP degree of
    ``yafsdp.integrations.tp_plans.llama_tp_plan`` applied before the wrap, ``world_size`` then the
    data-parallel ranks; every parameter is planned at its local shape on TP coordinate ``tp_rank``
    (``llama_tp_local_shapes``; Llama's plan only, the options TP refuses refused here too), and with
    ``batch`` and ``seq`` its activations traced under ``parallelize_llama(..., sequence_parallel,
    loss_parallel)`` (a wrapped TP model: traced on its own TP mesh, with the settings its
    ``parallelize_llama`` recorded; these two arguments are not read). See [Note: the plan of a TP model]
    in this module."""
    unknown = sorted(set(engine_options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"yafsdp.plan.memory_plan: unexpected keyword arguments {unknown}; the engine options are "
                        f"{sorted(OPTIONS)}")
    if isinstance(getattr(model, "engine_config", None), EngineConfig):  # a wrapped YaFSDP
        eng = model
        if tp not in (1, eng.tp_size):
            raise ValueError(
                f"yafsdp.plan.memory_plan: tp={tp} for a wrapped model whose TP degree is {eng.tp_size}; a wrapped "
                "model plans the layouts it holds: leave tp out")
        names = [u.name for u in eng.units]
        layouts = [u.shape for u in eng.units]
        small = eng.small.shape if eng.small is not None else None
        slots = eng.buffer_plan
        weight_free = [u.weight_free_bw for u in eng.units]
        world_size, rank = eng.world_size, eng.rank
        compute_dtype, reduce_dtype, zero_stage = eng.compute_dtype, eng.reduce_dtype, eng.zero_stage
        accum = eng.reduce_accum_dtype
        param_dtype = eng.param_dtype
        quantize_frozen = eng.quantize_frozen
        offload = eng.offload
        place = placement_class(offload)  # the layout's rules: what is allocated where (engine/placement.py)
        gather_dtype = eng.gather_dtype
        module = eng.module
        num_params = sum(lay.numel for lay in layouts) + (small.numel if small else 0)
        secondary_shard = eng.engine_config.secondary_shard
        prefetch = eng.engine_config.prefetch
    else:
        if world_size is None:
            raise ValueError("yafsdp.plan.memory_plan: world_size= is required for a model that is not wrapped")
        if has_dtensor_params(model):  # the layouts would be of the global shapes, not the TP slices the engine holds
            raise ValueError(
                "yafsdp.plan.memory_plan: the model has tensor-parallel (DTensor) parameters, and their global shapes "
                "are not what the engine holds: wrap it (yafsdp.YaFSDP(model, mesh=mesh['dp'])) and call "
                "model.memory_plan(), which plans the local layouts the engine allocates; or plan the model before "
                "parallelize_module with tp=N (Llama's plan)")
        # the plan also takes dtype names ("bf16"), as its CLI does
        cfg = build_config(config, who="yafsdp.plan.memory_plan",
                           **{k: as_dtype(v) if _is_dtype(k) and isinstance(v, str) else v
                              for k, v in engine_options.items()})
        param_dtype, reduce_dtype, compute_dtype = cfg.param_dtype, cfg.reduce_dtype, cfg.compute_dtype
        quantize_frozen, offload, gather_dtype = cfg.quantize_frozen, cfg.offload, cfg.gather_dtype
        zero_stage, align_bytes, outsized_ratio = cfg.zero_stage, cfg.align_bytes, cfg.outsized_ratio
        exclude = formats.default_exclude(model) if cfg.gather_exclude is None else cfg.gather_exclude
        quantize = compute_dtype if quantize_frozen else None
        align = unit_align(compute_dtype, reduce_dtype, align_bytes)
        specs, small_params = discover(model, units)
        if tp != 1:
            _tp_shapes(model, cfg, tp, tp_rank, specs, small_params)
        names = [s.name for s in specs]
        weight_free = [weight_free_backward(s) for s in specs]
        layouts = [unit_shape(s.params, world_size, rank, align, quantize, gather_dtype, exclude) for s in specs]
        small = (unit_shape(small_params, world_size, rank, align, quantize, gather_dtype, exclude)
                 if small_params else None)
        accum = cfg.reduce_accum_dtype
        place = placement_class(offload)  # the layout's rules, as the engine's placement would have them
        slots = plan_buffers(
            names, layouts, small, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
            zero_stage=zero_stage, outsized_ratio=outsized_ratio, offload_frozen=place.host_frozen,
            accumulate_fp32=accum is not None, chunk_outsized=cfg.chunk_outsized_grads and place.chunks_outsized,
            grad_chunks=cfg.grad_chunks, reduce_in_place=reduces_in_place(plan_backend(backend), world_size),
            alias_world1=world_size == 1 and place.aliases_world1,
            direct_grads=reduce_dtype == torch.float32 and accum is None and replicas == 1,
            quant=quant_plan(cfg.grad_quant, cfg.grad_quant_node, world_size, replicas,
                             reduces_in_place(plan_backend(backend), world_size)),
            prefetch=cfg.prefetch,
        )
        module = model
        num_params = sum(lay.numel for lay in layouts) + (small.numel if small else 0)
        secondary_shard = cfg.secondary_shard
        prefetch = cfg.prefetch

    # See [Note: the secondary shard] in yafsdp/engine/secondary.py: the allocator's rule and sizes
    try:
        secondary_size = check_secondary(secondary_shard, world_size)
    except ValueError as e:
        raise ValueError(str(e).replace("yafsdp:", "yafsdp.plan.memory_plan:", 1)) from None
    secondary_at = plan_secondary(layouts, slots.weight_of[:len(layouts)], weight_free, compute_dtype, secondary_size)
    secondary_of = [sum(round16(n) for n in secondary_pieces(lay, compute_dtype, secondary_size)) if a >= 0 else 0
                    for lay, a in zip(layouts, secondary_at)]
    all_layouts = layouts + ([small] if small is not None else [])
    shard = sum(lay.trainable_shard for lay in all_layouts)
    frozen_shard = sum(lay.frozen_shard for lay in all_layouts)
    nf4_shard = sum(lay.nf4_shard for lay in all_layouts)
    nf4_bytes = sum(lay.nf4_record for lay in all_layouts)
    record_bytes = sum(lay.gather_record for lay in all_layouts)
    # a unit gathered by casting its master has no compute copy: [Note: the world-1 cast gather]
    compute_shard = sum(lay.compute_shard for lay, cast in zip(all_layouts, slots.cast_of) if not cast)
    cbytes = itemsize(compute_dtype)
    opt_bytes = optimizer if isinstance(optimizer, int) else OPTIMIZER_BYTES[optimizer]
    slot_list = slots.weight + slots.grad
    rows = [
        UnitRow(
            names[i], lay.numel, lay.weight_numel, lay.trainable_shard + lay.frozen_shard + lay.nf4_shard,
            slots.weight[slots.weight_of[i]].name if slots.weight_of[i] >= 0 else "its shard (world 1)",
            _grad_slot_name(slots, i, lay), slots.outsized[i], weight_free[i],
            _gather_bytes(lay, cbytes), lay.gather.name if lay.gather_record else None, secondary_of[i],
        )
        for i, lay in enumerate(layouts)
    ]
    regular = [lay.weight_numel for lay, o in zip(layouts, slots.outsized) if not o]
    plan = MemoryPlan(
        world_size=world_size, rank=rank, zero_stage=zero_stage,
        param_dtype=dtype_name(compute_dtype), reduce_dtype=dtype_name(reduce_dtype),
        optimizer=str(optimizer), num_params=num_params, shard_numel=shard + frozen_shard + nf4_shard,
        largest_unit=max(regular) if regular else 0, units=rows, slots=slot_list,
        master=4 * shard, grad=4 * shard,
        compute_copy=0 if place.compute_is_master(compute_dtype) else cbytes * compute_shard,
        optimizer_state=opt_bytes * shard, frozen=cbytes * frozen_shard, nf4=nf4_bytes,
        quantize_frozen=quantize_frozen, offload=offload, records=record_bytes, gather_dtype=gather_dtype,
        reduce_accum_dtype=dtype_name(accum) if accum is not None else None,
        compute_host=cbytes * shard if place.optimizer_on_host and compute_dtype != torch.float32 else 0,
        grad_landing=itemsize(reduce_dtype) * shard if place.optimizer_on_host else 0,
        export_unit=max((4 * (lay.trainable.padded_numel if lay.trainable is not None else 0)
                         + cbytes * sum(g.padded_numel for g in (lay.frozen, lay.nf4) if g is not None)
                         for lay in all_layouts), default=0),
        gather_host=record_bytes if place.optimizer_on_host else 0,
        secondary_shard=secondary_size, secondary=secondary_at[-1], grad_in_step=slots.step_grads,
        cast_units=sum(slots.cast_of), prefetch=prefetch,
    )
    if async_save:
        plan.checkpoint_staging = staging_bytes(
            all_layouts, rank=rank, compute_dtype=compute_dtype, optimizer_bytes=opt_bytes,
            buffer_bytes=persistent_buffer_bytes(module))
    from ..integrations.hf_stream import load_host_bytes

    plan.load_host = load_host_bytes(all_layouts, cbytes)
    if tp != 1 and not hasattr(model, "engine_config"):
        plan.notes.append(f"tensor parallel: llama_tp_plan at TP degree {tp}, the local shapes of TP rank {tp_rank}; "
                          f"world size {world_size}: the data-parallel ranks of one TP coordinate"
                          + (f"; activations traced with sequence parallel {'on' if sequence_parallel else 'off'}, "
                             f"loss parallel {'on' if loss_parallel else 'off'}" if batch is not None and seq is not None
                             else ""))
    if batch is not None and seq is not None:
        largest_unit_grads = max((lay.trainable.numel for lay in layouts if lay.trainable is not None),
                                 default=0) * cbytes
        with _tp_trace(model, tp, tp_rank, seq, sequence_parallel, loss_parallel) as tp_trace:
            plan.activations = activation_estimate(
                module, batch=batch, seq=seq, checkpointing=checkpointing, dtype=compute_dtype,
                attention=attention, inputs_fn=inputs_fn, unit_grad_bytes=largest_unit_grads, tp=tp_trace,
            )
        if plan.activations is None:
            plan.notes.append("activations not estimated: not an HF model, a PEFT model around one, a module "
                              "holding either or a meta model, or no inputs_fn given for a model that is not an HF "
                              "causal LM")
    return plan
