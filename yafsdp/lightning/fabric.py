"""``lightning.fabric.Fabric(strategy="yafsdp")``: YaFSDPFabricStrategy (yafsdp.lightning); see [Note: a
sharding engine as a Lightning strategy] in yafsdp/lightning/__init__.py."""
from __future__ import annotations

from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import lightning.fabric.plugins.precision as fabric_precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher as _FabricLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy as FabricParallelStrategy
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only

from ..wrapper.api import YaFSDP
from .common import StrategySetupError, start_process_group, _NoSync, _adopt_precision, _check_engine, \
    _engine_dtype, _is_sharded, _load_file, _load_sharded, _meta_context, _save_sharded, _wrap
from .module_state import route_module_state


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
        start_process_group(self, fabric_rank_zero_only)

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
            route_module_state(module, self.root_device)  # See [Note: the set-up module's state_dict]
        self._engines_set_up.append(module)
        return module

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        raise StrategySetupError(
            "yafsdp.lightning: fabric.setup(model, optimizer) would keep an optimizer over the original parameters, "
            "which wrapping leaves without storage; set up the model first and build the optimizer over its flat "
            "shards: model = fabric.setup_module(model); "
            "optimizer = fabric.setup_optimizers(AdamW(model.parameters()))")

    def setup_optimizer(self, optimizer):
        # An optimizer built over the module's parameters steps the flat shards, or was refused at its
        # construction: [Note: what a parent module sees] in engine/orig_params.py.
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
