"""yafsdp inside torchtitan: a ``ModelSpec.parallelize_fn`` and the helpers that select it by configuration.

    from torchtitan.models.llama3 import model_registry
    from yafsdp.integrations.torchtitan import yafsdp_model_spec
    config.model_spec = yafsdp_model_spec(model_registry("8B"))      # in a config_registry function

    torchrun --nproc-per-node 8 -m torchtitan.train --module yafsdp.integrations.torchtitan --config llama3_debugmodel

[Note: the torchtitan seam]
torchtitan's ``Trainer`` builds the model on the meta device, hands it to ``model_spec.parallelize_fn``,
then calls ``to_empty(device=...)`` and ``init_weights(buffer_device=...)`` on what that returned
and builds the optimizers from its ``parameters()``. :func:`parallelize_yafsdp` returns the
``YaFSDP`` wrapper (a :class:`TitanYaFSDP`), so each of those lands where it must:

- ``to_empty`` passes through the wrapper's ``_apply`` (nothing changes device or dtype; the
  module buffers are re-made empty, as torchtitan expects), ``init_weights`` runs inside
  ``summon_full_params(writeback=True)`` (the wrapper's init methods), so every rank's shards get
  rank 0's initial values and the model no longer needs a load;
- ``parameters()`` are the flat shards: the optimizer steps them, as FSDP2's optimizer steps its
  DTensors;
- the units: the embedding, each block of the ``layers`` ModuleDict ([Note: blocks in a ModuleDict]
  in layout/units.py) and the head; the fused QKV layer's state_dict hooks (and those of the
  activation-checkpoint wrappers) run around the gathered values ([Note: state_dict hooks] in
  wrapper/state_dict.py);
- ``activation_checkpoint``: torchtitan's policy (full or selective) wraps each block before
  the engine does, so the checkpoint wrappers are the units and recompute inside their backward;
- gradient clipping: the Trainer's ``clip_grad_norm_`` over ``parameters()`` takes the model's norm:
  the flat shards' gradients answer a norm with one all-reduce over the shard group ([Note: shard
  gradients that know they are shards] in engine/shard_grad.py), so every rank clips by the same factor, and the
  ``grad_norm`` it logs is the model's;
- the Trainer's ``_skip_lm_head`` flag (``ChunkedLossWrapper``) is set on the wrapped model,
  whose forward reads it; the chunked loss then calls ``lm_head`` once per chunk after the
  forward, each with its own backward: the head unit is gathered for each call, and the chunks'
  gradients add up to the unchunked one (tested against the unsharded model).

Not supported, refused when configured (naming the option): tensor, context, pipeline and expert
parallelism and more than one data-parallel replica; the Trainer's CUDA graph of the forward and
backward (on by default in torchtitan 0.3: a replay would skip the engine's Python side, so
``training.disable_cuda_graphs`` must be True); ``training.enable_cpu_offload`` (yafsdp's
``offload=`` instead); torchtitan's DCP checkpointer (it calls
``state_dict()``, which YaFSDP refuses): save with ``yafsdp.checkpoint.save_checkpoint`` /
``load_checkpoint`` (sharded, resumable at another world size), or ``model.full_state_dict()``,
whose keys are those of the unwrapped model (fused QKV split as torchtitan saves it).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..wrapper.api import YaFSDP

__all__ = ["TitanYaFSDP", "parallelize_yafsdp", "yafsdp_model_spec", "yafsdp_trainer_config", "llama3_debugmodel",
           "llama3_debugmodel_varlen_attn"]


class TitanYaFSDP(YaFSDP):
    """The ``YaFSDP`` wrapper torchtitan's Trainer gets from :func:`parallelize_yafsdp`. It differs from
    ``YaFSDP`` in two habits of torchtitan's Trainer: a flag it sets on the model object that the wrapped
    model has (``_skip_lm_head``) is set there, where the forward reads it, and its checkpointer's
    ``state_dict()`` is refused naming the way out."""

    def __setattr__(self, name, value):
        inner = self.__dict__.get("_modules", {}).get("module")
        if inner is not None and name not in self.__dict__ and not hasattr(type(self), name) and not isinstance(
                value, (torch.nn.Module, torch.Tensor)) and hasattr(inner, name):
            setattr(inner, name, value)  # a flag of the model's own, read by its forward (_skip_lm_head)
            return
        super().__setattr__(name, value)

    def state_dict(self, *args, **kwargs):
        raise RuntimeError(
            "yafsdp.integrations.torchtitan: state_dict() of a YaFSDP model is not supported, so torchtitan's DCP "
            "checkpointer cannot save it: set checkpoint.enable=False and save with "
            "yafsdp.checkpoint.save_checkpoint(root, step, model, optimizer) / load_checkpoint(path, model, optimizer) "
            "(sharded, resumable), or model.full_state_dict() (collective; rank 0 gets torchtitan's keys)")


def parallelize_yafsdp(model: torch.nn.Module, *, parallel_dims=None, training=None, parallelism=None,
                       compile_config=None, ac_config=None, dump_folder=None, **yafsdp_options) -> TitanYaFSDP:
    """torchtitan's ``parallelize_fn`` contract: shard ``model`` (built on the meta device or not) with
    yafsdp over the world and return the wrapper, after applying ``ac_config`` (activation
    checkpointing). ``training.mixed_precision_param`` / ``_reduce`` become ``param_dtype`` /
    ``reduce_dtype`` and ``parallelism.fsdp_reshard_after_forward="never"`` ``zero_stage=2``, unless
    ``yafsdp_options`` name them; other ``yafsdp_options`` go to ``YaFSDP`` (``zero_stage=``,
    ``offload=``, ...). ``compile_config`` with "model" in its components compiles each unit with
    its backend (``compile_units``). What it cannot do is refused: [Note: the torchtitan seam]."""
    if parallel_dims is not None:
        for what, on in (("tensor_parallel_degree", parallel_dims.tp_enabled), ("pipeline_parallel_degree",
                         parallel_dims.pp_enabled), ("context_parallel_degree", parallel_dims.cp_enabled),
                         ("expert_parallel_degree", getattr(parallel_dims, "ep_enabled", False)),
                         ("data_parallel_replicate_degree", parallel_dims.dp_replicate_enabled)):
            if on:
                raise ValueError(
                    f"yafsdp.integrations.torchtitan: parallelism.{what} > 1 is not supported with yafsdp (it shards "
                    "over the whole world, data parallel only); set it to 1")
    if parallelism is not None and parallelism.fsdp_reshard_after_forward == "never":
        yafsdp_options.setdefault("zero_stage", 2)  # FSDP2's reshard_after_forward=False: keep the forward's gather
    if training is not None:
        from torchtitan.config import TORCH_DTYPE_MAP

        if not training.disable_cuda_graphs:  # See [Note: the torchtitan seam]
            raise ValueError(
                "yafsdp.integrations.torchtitan: torchtitan's CUDA graph of the forward and backward is not supported "
                "with yafsdp: a replay would run the recorded kernels without the engine's gathers, buffer hand-offs "
                "and reduces deciding anew. Set training.disable_cuda_graphs=True (--training.disable_cuda_graphs; "
                "yafsdp_trainer_config sets it)")
        if training.enable_cpu_offload:  # the Trainer would then to_empty() onto the CPU, away from the engine's device
            raise ValueError(
                "yafsdp.integrations.torchtitan: training.enable_cpu_offload is not supported with yafsdp (the Trainer "
                "then moves the model to the CPU); set it to False and pass offload='optimizer' (or 'all') to "
                "yafsdp_model_spec(spec, offload=...) / yafsdp_trainer_config(config, offload=...)")

        yafsdp_options.setdefault("param_dtype", TORCH_DTYPE_MAP[training.mixed_precision_param])
        yafsdp_options.setdefault("reduce_dtype", TORCH_DTYPE_MAP[training.mixed_precision_reduce])
    if ac_config is not None:  # each block wrapped for recompute; the wrappers become the units
        ac_config.build(dump_folder=dump_folder or "").apply(model)
    wrapped = TitanYaFSDP(model, **yafsdp_options)
    if compile_config is not None and compile_config.enable and "model" in compile_config.components:
        wrapped.compile_units(backend=compile_config.backend)
    return wrapped


def yafsdp_model_spec(spec, **yafsdp_options):
    """A copy of torchtitan ``ModelSpec`` ``spec`` whose ``parallelize_fn`` is :func:`parallelize_yafsdp`
    (with ``yafsdp_options``) and which has no pipelining function (pipeline parallelism is refused)."""
    fn = functools.partial(parallelize_yafsdp, **yafsdp_options) if yafsdp_options else parallelize_yafsdp
    return dataclasses.replace(spec, name=f"{spec.name}_yafsdp", parallelize_fn=fn, pipelining_fn=None)


def yafsdp_trainer_config(config, **yafsdp_options):
    """torchtitan ``Trainer.Config`` ``config`` set up for yafsdp, in place (and returned): its model spec
    through :func:`yafsdp_model_spec`, torchtitan's checkpointer off (save with ``yafsdp.checkpoint``) and
    its CUDA graphs off."""
    config.model_spec = yafsdp_model_spec(config.model_spec, **yafsdp_options)
    config.checkpoint.enable = False
    config.training.disable_cuda_graphs = True
    return config


def llama3_debugmodel():
    """``--module yafsdp.integrations.torchtitan --config llama3_debugmodel``: torchtitan's llama3 debug
    model and training recipe, sharded by yafsdp."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel as base

    return yafsdp_trainer_config(base())


def llama3_debugmodel_varlen_attn():
    """``--config llama3_debugmodel_varlen_attn``: the same with varlen attention (no flex compile; CUDA)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel_varlen_attn as base

    return yafsdp_trainer_config(base())
