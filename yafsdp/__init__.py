"""yafsdp: a sharded data-parallel training engine for PyTorch in the style of YaFSDP."""
from .api import YaFSDP
from .optim import FusedAdamW
from .units import WrapError
from . import adapters  # noqa: F401  (yafsdp.adapters.save_adapter, YaFSDP.save_adapter)

__all__ = ["YaFSDP", "FusedAdamW", "WrapError"]
__version__ = "0.1.0"
