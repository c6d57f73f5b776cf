"""yafsdp: a sharded data-parallel training engine for PyTorch in the style of YaFSDP."""
import warnings as _warnings

# ``python -m yafsdp.plan`` (the old spelling of ``python -m yafsdp plan``) would warn that the
# module was imported before runpy ran it; harmless here. See [Note: CLI entry point] in __main__.py.
_warnings.filterwarnings("ignore", message=r"'yafsdp\.plan' found in sys\.modules", category=RuntimeWarning)

from .api import YaFSDP  # noqa: E402
from .optim import FusedAdamW
from .units import WrapError

__all__ = ["YaFSDP", "FusedAdamW", "WrapError"]
__version__ = "0.1.0"
