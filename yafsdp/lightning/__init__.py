"""yafsdp as a Lightning strategy: ``Trainer(strategy="yafsdp")`` and ``Fabric(strategy="yafsdp")``.

    import yafsdp.lightning                                   # registers "yafsdp" with Trainer and Fabric
    trainer = L.Trainer(strategy="yafsdp", devices=2, precision="bf16-mixed", gradient_clip_val=1.0)
    trainer = L.Trainer(strategy=yafsdp.lightning.YaFSDPStrategy(units=..., state_dict_type="sharded"))
    fabric = L.Fabric(strategy=yafsdp.lightning.YaFSDPFabricStrategy(zero_stage=2), devices=2)

[Note: a sharding engine as a Lightning strategy]
This follows Lightning's own ``FSDPStrategy`` (pytorch and fabric): a ``ParallelStrategy`` that owns
the process group, wraps the model when it is set up, and owns the checkpoint format; nothing in
Lightning is patched. The differences from FSDP, each for a reason:

- **What is wrapped.** Fabric: the module given to ``setup_module`` becomes ``YaFSDP(module, **options)``
  (a module already wrapped is kept). Trainer: the ``LightningModule`` stays the root (its hooks and
  ``training_step`` are Lightning's), and its one child that holds parameters -- built in ``__init__``
  or in ``configure_model`` -- is replaced by ``YaFSDP(child, **options)``, unless ``configure_model``
  wrapped it already. Parameters in several children, or on the LightningModule itself, are refused
  (one engine, one process group, one optimizer layout). No DDP is put around anything; a
  ``strategy="ddp"`` around a wrapped model is refused by DDP's constructor ([Note: DDP around a
  sharded model] in engine/ddp_guard.py).
- **Precision** is the engine's dtypes, not a module conversion: ``"32-true"`` -> fp32,
  ``"bf16-true"`` / ``"bf16-mixed"`` -> ``param_dtype=torch.bfloat16``, ``"16-mixed"`` ->
  ``param_dtype=torch.float16`` with the plugin's GradScaler (its inf check is the engine's, agreed over
  ranks); the master shards and optimizer state stay fp32 in every case. Modules are built in fp32 (the
  half-precision plugins' init dtype is not applied) and never converted. ``"16-true"``, ``"64-true"``
  and the other plugins are refused, as is an engine ``param_dtype`` that disagrees with the precision
  (naming both).
- **Meta init** (``Trainer``: ``configure_model`` under ``empty_init``; ``fabric.init_module(empty_init=True)``):
  parameters are built on meta (``yafsdp.init.meta_parameters``), the engine allocates the shards, and
  every module's ``reset_parameters()`` runs inside ``summon_full_params(writeback=True)``: the values
  of the unsharded model built on rank 0 (Lightning FSDP's materialize-and-reset convention). A
  module holding parameters without ``reset_parameters`` is refused, naming it.
- **The optimizer** steps the flat shards. One built over a parent's ``parameters()`` (the
  LightningModule's ``self.parameters()``, Fabric's ``model.parameters()``) holds them already: each
  unit's original parameters become its flat shard when the optimizer is built; a param group holding
  part of a unit is refused there, naming ``model.parameters()`` / ``YaFSDP.param_groups(weight_decay)``
  ([Note: what a parent module sees] in engine/orig_params.py).
- **The parent's habits**: ``LightningModule.zero_grad()`` clears the engine's gradients, and
  ``ModelSummary`` / ``RichModelSummary`` totals count the original parameters (the unsharded model's
  numbers), since a parent sees no flat shard. The one row that would not -- the YaFSDP wrapper's own,
  counted through its ``parameters()`` (this rank's flat shards) -- the strategy makes the callback
  count by the original parameters as well.
- **Checkpoints**, ``state_dict_type``: ``"sharded"`` (Fabric's default) writes a directory holding a
  yafsdp sharded checkpoint (``step_N/``: model and optimizer, DCP, reshardable; ``yafsdp.checkpoint``)
  and ``meta.pt`` (everything else, rank 0); ``"full"`` (Trainer's default) writes one file on rank 0
  with the unsharded model state dict under the LightningModule's keys (or the Fabric module's) and
  the unsharded optimizer state keyed by parameter name (``full_optim_state_dict``). Both resume
  exactly. ``fabric.save`` / ``fabric.load`` / ``fabric.load_raw`` and ``trainer.save_checkpoint`` /
  ``ckpt_path=`` go through them. A module's own ``state_dict()`` stays refused, except that of the
  module Fabric set up, which is collective with DDP's results for scripts written for DDP ([Note: the
  set-up module's state_dict] in lightning/module_state.py).
- **Gradient clipping** is the engine's global norm (``model.clip_grad_norm_``, after the scaler's
  unscale); ``no_backward_sync`` is ``model.no_sync()``, which reduces every micro-batch (DDP's result,
  not its skipped communication).
"""
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry as PL_REGISTRY

from .common import StrategySetupError
from .fabric import YaFSDPFabricStrategy
from .trainer import YaFSDPStrategy

__all__ = ["YaFSDPStrategy", "YaFSDPFabricStrategy", "StrategySetupError"]

YaFSDPStrategy.register_strategies(PL_REGISTRY)
YaFSDPFabricStrategy.register_strategies(FABRIC_REGISTRY)
