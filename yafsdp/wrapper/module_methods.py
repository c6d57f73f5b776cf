"""What the wrapped module's own methods do after wrapping (the module, not the YaFSDP wrapper):
``state_dict()`` and ``load_state_dict()`` refused in one line (its parameters are sharded), HF's
``generate()`` kept in step across ranks, and the init methods the wrapper runs inside
``summon_full_params(writeback=True)`` (``INIT_METHODS``, used by ``YaFSDP.__getattr__``).
"""
from __future__ import annotations

import functools

from torch import nn

__all__ = ["INIT_METHODS", "adapt_module_methods"]

# Methods of the wrapped module (reached through YaFSDP.__getattr__) that (re-)initialise parameters:
# they run inside summon_full_params(writeback=True). See [Note: the module tree after wrapping].
INIT_METHODS = frozenset({"init_weights", "post_init", "_init_weights", "initialize_weights", "reset_parameters",
                          "_initialize_weights"})


def adapt_module_methods(module: nn.Module, entries: list[nn.Module], world_size: int) -> None:
    """``module``: the wrapped module; ``entries``: it and the HF models inside it that code may run on their
    own ([Note: the root entry] in api.py); ``world_size``: the shard group's."""
    for m in entries:
        # HF's generate() keeps every rank forwarding until all are done (synced_gpus) for the models it
        # knows to be sharded (FSDP's, DeepSpeed's): for these too, or a rank that ends first leaves the others
        # in a gather. Asked per call (not by marking the module as FSDP's, which torch.compile reads too).
        if world_size > 1 and callable(getattr(m, "generate", None)):
            m.__dict__["generate"] = _synced_generate(m.generate)
    module.register_state_dict_pre_hook(_refuse_module_state_dict)
    module.register_load_state_dict_pre_hook(_refuse_module_load_state_dict)  # one line, not one per parameter


def _synced_generate(generate):
    """HF ``generate`` with ``synced_gpus=True`` unless the call says otherwise."""
    @functools.wraps(generate)
    def synced(*args, **kwargs):
        kwargs.setdefault("synced_gpus", True)
        return generate(*args, **kwargs)

    return synced


def _refuse_module_state_dict(module, prefix, keep_vars):
    raise RuntimeError(
        f"yafsdp: state_dict() of the module wrapped by yafsdp.YaFSDP ({type(module).__name__}) would hold none of "
        "its parameters (they are sharded); use model.full_state_dict() on the YaFSDP wrapper, or "
        "yafsdp.checkpoint / yafsdp.hf.export_hf"
    )


def _refuse_module_load_state_dict(module, state_dict, prefix, *args):
    raise RuntimeError(
        f"yafsdp: load_state_dict() on the module wrapped by yafsdp.YaFSDP ({type(module).__name__}) cannot write "
        "its parameters (they are sharded); use model.load_full_state_dict(state_dict) on the YaFSDP wrapper (the "
        "original keys), or yafsdp.checkpoint.load_checkpoint / yafsdp.hf.load_hf_weights"
    )
