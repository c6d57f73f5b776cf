"""yafsdp: a sharded data-parallel training engine for PyTorch in the style of YaFSDP.

The package is laid out by role (docs/design.md has one line per module):

- ``yafsdp.wrapper``       the module facade: ``YaFSDP`` (arguments, forward, methods), state dicts, full views, EMA
- ``yafsdp.layout``        units, flat groups, the engine options (``EngineConfig``), the sizing of every buffer
- ``yafsdp.engine``        the runtime and its step protocol: gathers, the backward gate, a gradient's path,
                           HSDP's all-reduce across replicas, buffers, allocation, placement, autograd hooks
- ``yafsdp.optim``         the optimizer seams: ``FusedAdamW``, the step hooks, optimizer state dicts
- ``yafsdp.comm``          the comm schedule (base, CUDA streams + events, gloo handles), the collectives seam,
                           HSDP's groups, the narrow reduce with fp32 accumulation
- ``yafsdp.formats``       gather/storage formats (param_dtype, fp8, int8, NF4): one object per format
- ``yafsdp.kernels``       the hot-path kernels (C++/CUDA extension or their pure-PyTorch twins)
- ``yafsdp.plan``          the memory plan (over the layout's sizing), ``python -m yafsdp plan``
- ``yafsdp.checkpoint``    sharded checkpoints (DCP), background saves
- ``yafsdp.integrations``  Hugging Face load/export, PEFT, meta init, transformers.Trainer / TRL
- ``yafsdp.lightning``     Lightning Trainer / Fabric ``strategy="yafsdp"`` (imported on demand: needs lightning)
- ``yafsdp.tools``         tracing, measuring, the stream checker, model presets

The paths users import keep working: ``yafsdp.YaFSDP``, ``yafsdp.FusedAdamW``, ``yafsdp.hf``,
``yafsdp.adapters``, ``yafsdp.init``, ``yafsdp.presets``, ``yafsdp.trainer``, ``yafsdp.peft_load``,
``yafsdp.export``, ``yafsdp.ema``, ``yafsdp.shards``, ``yafsdp.trace``, ``yafsdp.measure``,
``yafsdp.streamcheck`` are the modules themselves (registered under both names, so ``import
yafsdp.hf`` and ``mock.patch("yafsdp.hf.…")`` reach the one module).
"""
import sys as _sys

from .wrapper.api import YaFSDP
from .layout.config import EngineConfig, MixedPrecision, Offload, build_config
from .optim.adamw import FusedAdamW
from .layout.units import WrapError
from .comm.groups import CollectiveError
from .engine.ddp_guard import WrappedTwiceError
from .wrapper import ema
from .engine import shards
from . import plan
from .integrations import adapters, export, hf, init, peft_load, trainer
from .tools import measure, presets, streamcheck, trace
from .tools.watchdog import EXIT_HANG, Watchdog

for _m in (ema, shards, adapters, export, hf, init, peft_load, trainer, measure, presets, streamcheck, trace):
    _sys.modules[f"{__name__}.{_m.__name__.rpartition('.')[2]}"] = _m
del _m

__all__ = ["YaFSDP", "EngineConfig", "MixedPrecision", "Offload", "build_config", "FusedAdamW", "WrapError",
           "WrappedTwiceError", "CollectiveError", "Watchdog", "EXIT_HANG", "adapters", "hf", "init", "presets", "trainer", "peft_load", "export", "ema", "shards",
           "trace", "measure", "streamcheck"]
__version__ = "0.1.0"
