"""The helpers the two yafsdp Lightning strategies share (yafsdp.lightning): precision, wrapping, the
optimizer's adoption, checkpoints and the model summary. Why each is so: [Note: a sharding engine as a
Lightning strategy] in yafsdp/lightning/__init__.py."""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import lightning.fabric.plugins.precision as fabric_precision
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
import lightning.pytorch.plugins.precision as pl_precision
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.model_summary.model_summary import ModelSummary as _LayerSummaryTable

from ..wrapper.api import YaFSDP

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


class _EngineCasts:
    """Lightning's half-precision plugins without their module conversion and init dtype: the engine casts."""

    def convert_module(self, module):
        return module

    def tensor_init_context(self):
        return nullcontext()

    def module_init_context(self):
        return nullcontext()


class _PLHalf(_EngineCasts, pl_precision.HalfPrecision):
    pass


class _FabricHalf(_EngineCasts, fabric_precision.HalfPrecision):
    pass


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
    def holds(m):  # own parameters
        return any(p is not None for p in m._parameters.values())

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
    from ..integrations.init import meta_parameters

    return meta_parameters()


def _raw(opt):
    return opt._optimizer if isinstance(opt, LightningOptimizer) else opt


# ----------------------------------------------------------------------------------------------- checkpoints
def _is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / _METADATA).is_file()


def _save_sharded(path: Path, step: int, model: YaFSDP, optimizer, metadata: dict, rank: int) -> None:
    from .. import checkpoint as ckpt

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
    from .. import checkpoint as ckpt

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
# A parent counts the original parameters ([Note: what a parent module sees] in engine/orig_params.py),
# so ModelSummary's totals are the unsharded model's. One row is not: the YaFSDP wrapper's own, which
# ModelSummary counts through the wrapper's parameters(), the flat shards of this rank (what an
# optimizer needs). The callback counts that row by the original parameters too.
def _count(module: nn.Module) -> int:
    """Parameters of ``module`` as the unsharded model has them: original parameters, not flat shards."""
    seen, n = set(), 0
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
    return n


class _Table(_LayerSummaryTable):
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


def start_process_group(strategy, rank_zero_only) -> None:
    """``setup_environment``'s part shared by the Trainer and Fabric strategies: the ranks from the cluster
    environment, Lightning's rank-zero switch, the process group (``strategy._timeout``)."""
    env = strategy.cluster_environment
    env.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
    env.set_world_size(strategy.num_nodes * strategy.num_processes)
    rank_zero_only.rank = strategy.global_rank
    strategy._process_group_backend = strategy._process_group_backend or \
        _get_default_process_group_backend_for_device(strategy.root_device)
    _init_dist_connection(env, strategy._process_group_backend, timeout=strategy._timeout)
