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
  sharded model] in core/ddp_guard.py).
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
  LightningModule's ``self.parameters()``, Fabric's ``model.parameters()``) holds the storage-less
  original parameters next to them: with one param group holding every flat shard, the originals are
  dropped from it at set-up (the optimizer over the shards, exactly); other groupings of original
  parameters are refused, naming one and the way out (``model.parameters()`` of the wrapped module,
  ``YaFSDP.param_groups(weight_decay)``).
- **The parent's habits.** ``LightningModule.zero_grad()`` (called by the Trainer before each stage)
  would read ``.grad`` of the storage-less original parameters: the strategy gives the LightningModule
  a ``zero_grad`` that clears the engine's shards. ``ModelSummary`` / ``RichModelSummary`` would count
  the original parameters and this rank's flat shards both: the strategy makes the callback count the
  original parameters only (the unsharded model's numbers, per layer and in total).
- **Checkpoints**, ``state_dict_type``: ``"sharded"`` (Fabric's default) writes a directory holding a
  yafsdp sharded checkpoint (``step_N/``: model and optimizer, DCP, reshardable; ``yafsdp.checkpoint``)
  and ``meta.pt`` (everything else, rank 0); ``"full"`` (Trainer's default) writes one file on rank 0
  with the unsharded model state dict under the LightningModule's keys (or the Fabric module's) and
  the unsharded optimizer state keyed by parameter name (``full_optim_state_dict``). Both resume
  exactly. ``fabric.save`` / ``fabric.load`` / ``fabric.load_raw`` and ``trainer.save_checkpoint`` /
  ``ckpt_path=`` go through them; a module's own ``state_dict()`` stays refused.
- **Gradient clipping** is the engine's global norm (``model.clip_grad_norm_``, after the scaler's
  unscale); ``no_backward_sync`` is ``model.no_sync()``, which reduces every micro-batch (DDP's result,
  not its skipped communication).
"""
from __future__ import annotations

import contextlib
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lightning.fabric.plugins.precision as fabric_precision
import lightning.pytorch.plugins.precision as pl_precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher as _FabricLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy as FabricParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, \
    _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import StrategyRegistry as PL_REGISTRY
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher as _PLLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy as PLParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_summary.model_summary import ModelSummary as _LayerSummaryTable
from lightning.pytorch.utilities.rank_zero import rank_zero_only as pl_rank_zero_only

from .core.anchor import ANCHOR
from .core.api import YaFSDP
from .core.orig_params import ShardedParameter

__all__ = ["YaFSDPStrategy", "YaFSDPFabricStrategy", "StrategySetupError"]

_METADATA = "meta.pt"  # a sharded checkpoint's non-tensor state, written by rank 0


class StrategySetupError(ValueError):
    """A Lightning configuration that cannot work with the yafsdp strategy."""


# ----------------------------------------------------------------------------------------------- precision
# See [Note: a sharding engine as a Lightning strategy], "Precision".
_DTYPES = {"32-true": None, "32": None, "bf16-true": torch.bfloat16, "bf16-mixed": torch.bfloat16,
           "16-mixed": torch.float16}


def _engine_dtype(plugin) -> torch.dtype | None:
    name = str(getattr(plugin, "precision", "32-true"))
    allowed = (fabric_precision.Precision, pl_precision.Precision)
    known = {pl_precision.Precision, fabric_precision.Precision, pl_precision.MixedPrecision,
             fabric_precision.MixedPrecision, pl_precision.HalfPrecision, fabric_precision.HalfPrecision,
             _PLHalf, _FabricHalf}
    if name not in _DTYPES or type(plugin) not in known or not isinstance(plugin, allowed):
        raise StrategySetupError(
            f"yafsdp.lightning: precision={name!r} ({type(plugin).__name__}) is not supported by strategy=\"yafsdp\": "
            "the engine computes in its param_dtype over fp32 master shards. Use precision=\"32-true\", "
            "\"bf16-mixed\" / \"bf16-true\" (param_dtype=torch.bfloat16) or \"16-mixed\" (param_dtype=torch.float16 "
            "with a GradScaler); \"16-true\" has no loss scaling and its fp16 gradients underflow")
    return _DTYPES[name]


class _PLHalf(pl_precision.HalfPrecision):
    """Lightning's half-precision plugin without its module conversion and init dtype: the engine casts."""

    def convert_module(self, module):
        return module

    def tensor_init_context(self):
        return nullcontext()

    def module_init_context(self):
        return nullcontext()


class _FabricHalf(fabric_precision.HalfPrecision):
    """As _PLHalf, for Fabric."""

    def convert_module(self, module):
        return module

    def tensor_init_context(self):
        return nullcontext()

    def module_init_context(self):
        return nullcontext()


def _adopt_precision(plugin):
    """The plugin the strategy keeps for ``plugin`` (checked; a half-precision one made conversion-free)."""
    if plugin is None:
        return None
    _engine_dtype(plugin)
    if type(plugin) is pl_precision.HalfPrecision:
        return _PLHalf(plugin.precision)
    if type(plugin) is fabric_precision.HalfPrecision:
        return _FabricHalf(plugin.precision)
    return plugin


# ----------------------------------------------------------------------------------------------- wrapping
def _engines(root: nn.Module) -> list[tuple[str, YaFSDP]]:
    out, inside = [], set()
    for name, m in root.named_modules():
        if isinstance(m, YaFSDP) and not any(name.startswith(p + ".") for p in inside):
            out.append((name, m))
            inside.add(name)
    return out


def _outside(root: nn.Module) -> list[str]:
    """Names of parameters of ``root`` that no engine under it owns."""
    owned = {id(p) for _, e in _engines(root) for m in e.modules() for p in m._parameters.values() if p is not None}
    return [n for n, p in root.named_parameters() if id(p) not in owned]


def _wrap(module: nn.Module, options: dict, dtype, device, what: str) -> YaFSDP:
    opts = dict(options)
    if "param_dtype" in opts and (opts["param_dtype"] or torch.float32) != (dtype or torch.float32):
        raise StrategySetupError(
            f"yafsdp.lightning: the strategy was given param_dtype={opts['param_dtype']} but the precision asks for "
            f"{dtype} (fp32 when None); drop param_dtype= and choose the precision, or make them agree")
    opts["param_dtype"] = dtype
    opts.setdefault("device", device)
    model = YaFSDP(module, **opts)
    if model.needs_load:
        _reset_on_meta(model, what)
    return model


def _check_engine(model: YaFSDP, dtype, what: str) -> None:
    if (model.param_dtype or torch.float32) != (dtype or torch.float32):
        raise StrategySetupError(
            f"yafsdp.lightning: {what} was wrapped with param_dtype={model.param_dtype} but the precision plugin asks "
            f"for {dtype or torch.float32}; the engine's param_dtype is the compute dtype: make them agree (wrap with "
            f"param_dtype={dtype}, or choose the matching precision)")


def _reset_on_meta(model: YaFSDP, what: str) -> None:
    """Shards of a model built on meta: every module's ``reset_parameters()`` on the full values, rank
    0's written back (Lightning FSDP's convention for ``empty_init``)."""
    def holds(m):  # own parameters, the engine's empty device anchor aside ([Note: the device anchor])
        return any(k != ANCHOR and p is not None for k, p in m._parameters.items())

    bare = [n or type(m).__name__ for n, m in model.module.named_modules()
            if holds(m) and not callable(getattr(m, "reset_parameters", None))]
    if bare:
        raise StrategySetupError(
            f"yafsdp.lightning: {what} was built on the meta device (empty_init) and module(s) {bare[:3]} hold "
            "parameters but have no reset_parameters() to initialise them; build it with empty_init=False, or "
            "fill the shards yourself (model.load_full_state_dict / yafsdp.init.init_shards_) before training")

    def reset(m):
        if holds(m):
            m.reset_parameters()

    with model.summon_full_params(writeback=True):
        model.module.apply(reset)
    model.mark_loaded()


def _meta_context(empty_init):
    if not empty_init:
        return nullcontext()
    from .integrations.init import meta_parameters

    return meta_parameters()


def _adopt_optimizer(opt, engine: YaFSDP, model_name: str) -> None:
    """An optimizer built over a parent's ``parameters()`` (the LightningModule's, Fabric's module's) holds
    the flat shards and the storage-less original parameters. With one param group that holds every flat
    shard and no state yet, dropping the originals leaves exactly the optimizer over the shards; anything
    else (per-parameter groups, a part of the shards) is refused with the way out."""
    opt = opt if isinstance(opt, torch.optim.Optimizer) else _raw(opt)
    originals = [p for g in opt.param_groups for p in g["params"] if isinstance(p, ShardedParameter)]
    if not originals:
        return
    flat = {id(p) for p in engine.parameters()}
    groups = opt.param_groups
    if len(groups) == 1 and flat <= {id(p) for p in groups[0]["params"]} and not opt.state:
        # the engine's device anchor (empty; [Note: the device anchor] in core/anchor.py) goes with them
        anchor = engine.__dict__.get("_device_param")
        groups[0]["params"] = [p for p in groups[0]["params"]
                               if not isinstance(p, ShardedParameter) and p is not anchor]
        return
    raise StrategySetupError(
        f"yafsdp.lightning: the optimizer holds original parameter {originals[0]._yafsdp_name!r}, which after "
        "wrapping has no storage (the flat shards are what trains), in param groups that do not hold all the flat "
        f"shards in one group; build the optimizer over the wrapped model's parameters: {model_name}.parameters() "
        "(the flat shards; per-group weight decay: yafsdp.YaFSDP.param_groups(weight_decay))")


def _raw(opt):
    return opt._optimizer if isinstance(opt, LightningOptimizer) else opt


# ----------------------------------------------------------------------------------------------- checkpoints
def _is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / _METADATA).is_file()


def _save_sharded(path: Path, step: int, model: YaFSDP, optimizer, metadata: dict, rank: int) -> None:
    from . import checkpoint as ckpt

    if rank == 0 and path.is_file():
        path.unlink()
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier(group=model.process_group)
    ckpt.save_checkpoint(str(path), step, model, optimizer, keep=1)
    if rank == 0:
        torch.save(metadata, path / _METADATA)
    dist.barrier(group=model.process_group)


def _load_file(path: Path, weights_only) -> dict:
    # memory-mapped: every rank reads the non-tensor state, only rank 0's tensors are loaded into the shards.
    # weights_only=None: Lightning's default for its own checkpoints (they hold its loops' and callbacks' objects)
    return torch.load(path, map_location="cpu", mmap=True, weights_only=bool(weights_only))


def _load_sharded(path: Path, model: YaFSDP, optimizer, weights_only=None) -> dict:
    from . import checkpoint as ckpt

    found = ckpt.latest_checkpoint(str(path))
    if found is None:
        raise FileNotFoundError(f"yafsdp.lightning: {str(path)!r} holds {_METADATA} but no complete yafsdp checkpoint")
    ckpt.load_checkpoint(found, model, optimizer)
    return torch.load(path / _METADATA, map_location="cpu", weights_only=bool(weights_only))


def _prefixed(sd: dict, prefix: str) -> dict:
    return {prefix + k: v for k, v in sd.items()}


def _unprefixed(sd: dict, prefix: str, where: str) -> dict:
    mine = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    if not mine:
        raise KeyError(f"yafsdp.lightning: {where} holds no key under {prefix!r} (keys: {list(sd)[:3]} ...)")
    return mine


class _NoSync(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool):
        if not enabled:
            return nullcontext()
        engine = module if isinstance(module, YaFSDP) else next((e for _, e in _engines(module)), None)
        if engine is None:
            raise TypeError(
                f"yafsdp.lightning: no_backward_sync on {type(module).__name__}, which holds no yafsdp.YaFSDP")
        return engine.no_sync()


# ----------------------------------------------------------------------------------------------- summary
def _count(module: nn.Module, trainable: bool = False) -> int:
    """Parameters of ``module`` as the unsharded model has them: original parameters, not flat shards."""
    flat = {id(p) for e in module.modules() if isinstance(e, YaFSDP) for p in e.parameters()}
    seen, n = set(), 0
    for m in module.modules():
        for p in m._parameters.values():
            if p is None or id(p) in seen or id(p) in flat or (trainable and not p.requires_grad):
                continue
            seen.add(id(p))
            n += p.numel()
    return n


class _Table(_LayerSummaryTable):
    @property
    def total_parameters(self) -> int:
        return _count(self._model)

    @property
    def trainable_parameters(self) -> int:
        return _count(self._model, trainable=True)

    @property
    def param_nums(self) -> list[int]:
        return [_count(layer._module) for layer in self._layer_summary.values()]


class _CountOriginals:
    def _summary(self, trainer, pl_module):
        return _Table(pl_module, max_depth=self._max_depth)


_SUMMARY_CLASSES: dict = {}


def _fix_summaries(trainer) -> None:
    for cb in trainer.callbacks:
        cls = type(cb)
        if isinstance(cb, ModelSummary) and not isinstance(cb, _CountOriginals):
            if cls not in _SUMMARY_CLASSES:
                _SUMMARY_CLASSES[cls] = type(f"YaFSDP{cls.__name__}", (_CountOriginals, cls), {})
            cb.__class__ = _SUMMARY_CLASSES[cls]


# ----------------------------------------------------------------------------------------------- Trainer
class YaFSDPStrategy(PLParallelStrategy):
    """``lightning.pytorch.Trainer(strategy="yafsdp")``; see [Note: a sharding engine as a Lightning strategy].
    ``state_dict_type``: "full" (default) or "sharded"; ``**engine_options`` go to ``yafsdp.YaFSDP``."""

    strategy_name = "yafsdp"

    def __init__(self, accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision_plugin=None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout, state_dict_type: str = "full", **engine_options):
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        if state_dict_type not in ("full", "sharded"):
            raise StrategySetupError(f"yafsdp.lightning: state_dict_type={state_dict_type!r}: use 'full' or 'sharded'")
        self.num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._state_dict_type = state_dict_type
        self.engine_options = engine_options
        self._engine_name = None

    # ---- plumbing, as Lightning's FSDPStrategy
    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self):
        return self._process_group_backend

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def is_distributed(self) -> bool:  # the Trainer's data connector: a DistributedSampler per rank
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property
    def precision_plugin(self):
        plugin = self._precision_plugin
        return plugin if plugin is not None else pl_precision.Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        self._precision_plugin = _adopt_precision(plugin)

    def _configure_launcher(self) -> None:
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _PLLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        pl_rank_zero_only.rank = self.global_rank
        self._process_group_backend = self._process_group_backend or \
            _get_default_process_group_backend_for_device(self.root_device)
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)

    def barrier(self, name=None) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor, group=None, reduce_op="mean"):
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def model_to_device(self) -> None:
        pass  # the engine places its shards

    def teardown(self) -> None:
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ---- set-up
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None):
        with _meta_context(empty_init):
            yield

    @contextlib.contextmanager
    def model_sharded_context(self):
        yield  # configure_model builds the module; setup() wraps it (or keeps the YaFSDP it made)

    @property
    def engine(self) -> YaFSDP:
        """The LightningModule's wrapped child (after set-up)."""
        return self.lightning_module.get_submodule(self._engine_name)

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        lm = self.lightning_module
        dtype = _engine_dtype(self.precision_plugin)
        found = _engines(lm)
        if not found:
            holders = [n for n, c in lm.named_children() if any(True for _ in c.parameters())]
            own = [n for n, _ in lm.named_parameters(recurse=False)]
            if own or len(holders) != 1:
                raise StrategySetupError(
                    f"yafsdp.lightning: strategy=\"yafsdp\" wraps the one child of the LightningModule that holds "
                    f"parameters; {type(lm).__name__} has parameters in children {holders} and on itself {own}. Put "
                    "the model under one attribute (self.model = nn.ModuleDict(...) / nn.Sequential(...)), or wrap it "
                    "yourself in configure_model (self.model = yafsdp.YaFSDP(...))")
            name = holders[0]
            setattr(lm, name, _wrap(getattr(lm, name), self.engine_options, dtype, self.root_device,
                                    f"{type(lm).__name__}.{name}"))
            found = _engines(lm)
        if len(found) != 1:
            raise StrategySetupError(
                f"yafsdp.lightning: {type(lm).__name__} holds {len(found)} yafsdp.YaFSDP modules "
                f"({[n for n, _ in found]}); the strategy supports one (one optimizer layout, one checkpoint)")
        self._engine_name, engine = found[0]
        _check_engine(engine, dtype, f"{type(lm).__name__}.{self._engine_name}")
        outside = _outside(lm)
        if outside:
            raise StrategySetupError(
                f"yafsdp.lightning: parameters {outside[:3]} of {type(lm).__name__} are outside its yafsdp.YaFSDP "
                f"module {self._engine_name!r}: no strategy would reduce their gradients. Move them into it")
        self.model = lm
        # See [Note: a sharding engine as a Lightning strategy], "The parent's habits".
        lm.zero_grad = engine.zero_grad
        _fix_summaries(trainer)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if len(self.optimizers) > 1:
                raise StrategySetupError(
                    f"yafsdp.lightning: configure_optimizers returned {len(self.optimizers)} optimizers; the "
                    "strategy supports one over the wrapped model's parameters")
            for opt in self.optimizers:
                _adopt_optimizer(opt, engine, f"self.{self._engine_name}")
        self.setup_precision_plugin()

    # ---- checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._state_dict_type == "sharded":
            return {}  # written by save_checkpoint, straight from the shards
        return _prefixed(self.engine.full_state_dict(), self._engine_name + ".")

    def optimizer_state(self, optimizer) -> dict:
        if self._state_dict_type == "sharded":
            return {}
        return self.engine.full_optim_state_dict(_raw(optimizer))

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # loaded in load_checkpoint, as FSDPStrategy does

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError("yafsdp.lightning: save_checkpoint(..., storage_options=...) is not supported")
        path = Path(self.broadcast(str(filepath)))
        if self._state_dict_type == "full":
            return super().save_checkpoint(checkpoint, path)  # rank 0 writes (CheckpointIO)
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        opt = _raw(self.optimizers[0]) if self.optimizers else None
        _save_sharded(path, int(checkpoint.get("global_step", 0)), self.engine, opt, checkpoint, self.global_rank)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        path = Path(self.broadcast(str(checkpoint_path)))
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        opt = _raw(self.optimizers[0]) if self.optimizers and fitting else None
        if _is_sharded(path):
            return _load_sharded(path, self.engine, opt, weights_only)
        checkpoint = _load_file(path, weights_only)
        self.engine.load_full_state_dict(_unprefixed(checkpoint["state_dict"], self._engine_name + ".", str(path)))
        states = checkpoint.get("optimizer_states")
        if opt is not None and states:
            self.engine.load_full_optim_state_dict(opt, states[0])
        return checkpoint

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            import shutil

            p = Path(filepath)
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)

    @classmethod
    def register_strategies(cls, registry) -> None:
        registry.register("yafsdp", cls, description="yafsdp sharded data parallel", override=True)


# ----------------------------------------------------------------------------------------------- Fabric
class YaFSDPFabricStrategy(FabricParallelStrategy):
    """``lightning.fabric.Fabric(strategy="yafsdp")``; see [Note: a sharding engine as a Lightning strategy].
    ``state_dict_type``: "sharded" (default) or "full"; ``**engine_options`` go to ``yafsdp.YaFSDP``."""

    def __init__(self, accelerator=None, parallel_devices=None, cluster_environment=None, precision=None,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 state_dict_type: str = "sharded", **engine_options):
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=None, precision=precision)
        if state_dict_type not in ("full", "sharded"):
            raise StrategySetupError(f"yafsdp.lightning: state_dict_type={state_dict_type!r}: use 'full' or 'sharded'")
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._state_dict_type = state_dict_type
        self.engine_options = engine_options
        self._backward_sync_control = _NoSync()
        self._engines_set_up: list[YaFSDP] = []  # what setup_module returned, for setup_optimizer

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, n: int) -> None:
        self._num_nodes = n

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def precision(self):
        return self._precision if self._precision is not None else fabric_precision.Precision()

    @precision.setter
    def precision(self, plugin) -> None:
        self._precision = _adopt_precision(plugin)

    def _configure_launcher(self) -> None:
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _FabricLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        fabric_rank_zero_only.rank = self.global_rank
        self._process_group_backend = self._process_group_backend or \
            _get_default_process_group_backend_for_device(self.root_device)
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)

    def all_reduce(self, tensor, group=None, reduce_op="mean"):
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args, **kwargs) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # ---- set-up
    def setup_module(self, module: nn.Module) -> nn.Module:
        dtype = _engine_dtype(self.precision)
        if isinstance(module, YaFSDP):
            _check_engine(module, dtype, type(module.module).__name__)
        else:
            module = _wrap(module, self.engine_options, dtype, self.root_device, type(module).__name__)
        self._engines_set_up.append(module)
        return module

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        raise StrategySetupError(
            "yafsdp.lightning: fabric.setup(model, optimizer) would keep an optimizer over the original parameters, "
            "which wrapping leaves without storage; set up the model first and build the optimizer over its flat "
            "shards: model = fabric.setup_module(model); "
            "optimizer = fabric.setup_optimizers(AdamW(model.parameters()))")

    def setup_optimizer(self, optimizer):
        engines = {id(p): m for m in self._engines_set_up for p in m.parameters()}
        engine = next((engines[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in engines), None)
        if engine is not None:
            _adopt_optimizer(optimizer, engine, "model")
        elif any(isinstance(p, ShardedParameter) for g in optimizer.param_groups for p in g["params"]):
            raise StrategySetupError(
                "yafsdp.lightning: the optimizer holds only original parameters of a wrapped module, which have no "
                "storage; build it over the module fabric.setup_module returned: AdamW(model.parameters())")
        return optimizer

    def module_to_device(self, module: nn.Module) -> None:
        pass

    def module_init_context(self, empty_init: bool | None = None):
        return _meta_context(empty_init)

    def module_sharded_context(self):
        return nullcontext()

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        engine = module if isinstance(module, YaFSDP) else getattr(module, "_forward_module", None)
        if not isinstance(engine, YaFSDP):
            raise TypeError(f"yafsdp.lightning: clip_gradients on {type(module).__name__}: pass the module that "
                            "fabric.setup_module returned")
        self.precision.unscale_gradients(optimizer)
        norm = engine.clip_grad_norm_(max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"yafsdp.lightning: the total norm of order {norm_type} of the gradients is {norm}")
        return norm

    # ---- checkpoints
    def _split(self, state: dict):
        models = [(k, v) for k, v in state.items() if isinstance(v, YaFSDP)]
        if len(models) != 1 or any(isinstance(v, nn.Module) and not isinstance(v, YaFSDP) for v in state.values()):
            raise ValueError(
                "yafsdp.lightning: a checkpoint's state must hold exactly one module, the one fabric.setup_module "
                f"returned (state={{'model': model, 'optimizer': optimizer, ...}}); got {list(state)}")
        opts = [(k, v) for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
        if len(opts) > 1:
            raise ValueError(f"yafsdp.lightning: a checkpoint's state holds {len(opts)} optimizers; one is supported")
        rest = {k: v for k, v in state.items() if k != models[0][0] and not (opts and k == opts[0][0])}
        return models[0], (opts[0] if opts else (None, None)), rest

    def save_checkpoint(self, path, state: dict, storage_options=None, filter=None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError("yafsdp.lightning: save_checkpoint(..., storage_options= / filter=) is not supported")
        path = Path(self.broadcast(str(path)))
        (mkey, model), (okey, opt), rest = self._split(state)
        from lightning.fabric.utilities.types import _Stateful

        meta = {k: (v.state_dict() if isinstance(v, _Stateful) else v) for k, v in rest.items()}
        if self._state_dict_type == "sharded":
            meta["yafsdp.keys"] = (mkey, okey)
            _save_sharded(path, 0, model, opt, meta, self.global_rank)
            return
        full = dict(meta)
        full[mkey] = model.full_state_dict()
        if okey is not None:
            full[okey] = model.full_optim_state_dict(opt)
        if self.global_rank == 0:
            torch.save(full, path)
        self.barrier()

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only=None) -> dict:
        path = Path(self.broadcast(str(path)))
        if isinstance(state, YaFSDP):
            return self.load_raw(path, state)
        if not state:
            raise ValueError("yafsdp.lightning: load_checkpoint needs state={'model': model, ...}")
        (mkey, model), (okey, opt), rest = self._split(state)
        if _is_sharded(path):
            meta = _load_sharded(path, model, opt, weights_only)
            meta.pop("yafsdp.keys", None)
        else:
            meta = _load_file(path, weights_only)
            model.load_full_state_dict(meta.pop(mkey))
            if okey is not None:
                model.load_full_optim_state_dict(opt, meta.pop(okey))
        from lightning.fabric.utilities.types import _Stateful

        for k in list(rest):
            if k in meta:
                v = meta.pop(k)
                if isinstance(state[k], _Stateful):
                    state[k].load_state_dict(v)
                else:
                    state[k] = v
        return meta

    def load_raw(self, path, obj, strict: bool = True, weights_only=None) -> None:
        """``fabric.load_raw``: an unsharded state dict file (``torch.save(module.state_dict())``, or a "full"
        checkpoint's model part) into a set-up module."""
        model = obj
        if not isinstance(model, YaFSDP):
            raise TypeError(f"yafsdp.lightning: load_raw into {type(obj).__name__}: pass the set-up module")
        model.load_full_state_dict(_load_file(Path(path), True if weights_only is None else weights_only))

    @classmethod
    def register_strategies(cls, registry) -> None:
        registry.register("yafsdp", cls, description="yafsdp sharded data parallel", override=True)


YaFSDPStrategy.register_strategies(PL_REGISTRY)
YaFSDPFabricStrategy.register_strategies(FABRIC_REGISTRY)
