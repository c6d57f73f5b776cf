"""yafsdp: a sharded data-parallel training engine for PyTorch in the style of YaFSDP.

The package is laid out by role (docs/design.md has one line per module):

- ``yafsdp.core``          the engine: ``YaFSDP``, its options, units, flat groups, the runtime and its step
                           protocol, allocation and placement, autograd hooks, state dicts, ``FusedAdamW``
- ``yafsdp.comm``          the comm schedule (base, CUDA streams + events, gloo handles), the collectives seam,
                           HSDP's replica sync, the narrow reduce with fp32 accumulation
- ``yafsdp.formats``       gather/storage formats (param_dtype, fp8, int8, NF4): one object per format
- ``yafsdp.kernels``       the hot-path kernels (C++/CUDA extension or their pure-PyTorch twins)
- ``yafsdp.plan``          the memory plan, the sizing the allocator uses, ``python -m yafsdp plan``
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

from .core.api import YaFSDP
from .core.config import EngineConfig, MixedPrecision, Offload, build_config
from .core.optim import FusedAdamW
from .core.units import WrapError
from .comm.groups import CollectiveError
from .core.ddp_guard import WrappedTwiceError
from .core import ema, shards
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
