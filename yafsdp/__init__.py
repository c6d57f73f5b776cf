"""yafsdp: a sharded data-parallel training engine for PyTorch in the style of YaFSDP."""
from .api import YaFSDP
from .config import EngineConfig, MixedPrecision, Offload, build_config
from .optim import FusedAdamW
from .units import WrapError
from . import adapters  # yafsdp.adapters.save_adapter / export_merged (PEFT)

__all__ = ["YaFSDP", "EngineConfig", "MixedPrecision", "Offload", "build_config", "FusedAdamW", "WrapError", "adapters"]
__version__ = "0.1.0"
