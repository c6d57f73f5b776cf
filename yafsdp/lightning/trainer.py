"""``lightning.pytorch.Trainer(strategy="yafsdp")``: YaFSDPStrategy (yafsdp.lightning); see [Note: a sharding
engine as a Lightning strategy] in yafsdp/lightning/__init__.py."""
from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lightning.pytorch.plugins.precision as pl_precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher as _PLLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy as PLParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only as pl_rank_zero_only

from ..wrapper.api import YaFSDP
from .common import StrategySetupError, start_process_group, _adopt_precision, _check_engine, _engine_dtype, \
    _engines, _fix_summaries, _is_sharded, _load_file, _load_sharded, _meta_context, _outside, _prefixed, _raw, \
    _save_sharded, _unprefixed, _wrap


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
        start_process_group(self, pl_rank_zero_only)

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
        _fix_summaries(trainer)  # the wrapper's own row: see the summary section of common.py
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if len(self.optimizers) > 1:
                raise StrategySetupError(
                    f"yafsdp.lightning: configure_optimizers returned {len(self.optimizers)} optimizers; the "
                    "strategy supports one over the wrapped model's parameters")
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
