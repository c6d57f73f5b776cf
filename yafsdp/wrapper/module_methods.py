"""What the wrapped module's own methods do after wrapping (the module, not the YaFSDP wrapper):
``state_dict()`` and ``load_state_dict()`` refused in one line (its parameters are sharded), HF's
``generate()`` kept in step across ranks, PEFT's adapters disabled and enabled again without changing
which parameters train, a switch to another adapter refused before PEFT changes anything
([Note: PEFT's adapter switches] in engine/orig_params.py), and the init methods the wrapper runs
inside ``summon_full_params(writeback=True)`` (``INIT_METHODS``, used by ``YaFSDP.__getattr__``).
"""
from __future__ import annotations

import functools

from torch import nn

from ..engine.orig_params import disabling_adapters

__all__ = ["INIT_METHODS", "adapt_module_methods", "has_adapters"]

# Methods of the wrapped module (reached through YaFSDP.__getattr__) that (re-)initialise parameters:
# they run inside summon_full_params(writeback=True). See [Note: the module tree after wrapping].
INIT_METHODS = frozenset({"init_weights", "post_init", "_init_weights", "initialize_weights", "reset_parameters",
                          "_initialize_weights"})


def has_adapters(module: nn.Module) -> bool:
    """``module`` holds PEFT adapters (a PeftModel, its tuner, or a transformers model given adapters)."""
    return isinstance(getattr(module, "peft_config", None), dict)


def adapt_module_methods(module: nn.Module, entries: list[nn.Module], world_size: int) -> None:
    """``module``: the wrapped module; ``entries``: it and the HF models inside it that code may run on their
    own ([Note: the root entry] in api.py); ``world_size``: the shard group's."""
    for m in entries:
        # HF's generate() keeps every rank forwarding until all are done (synced_gpus) for the models it
        # knows to be sharded (FSDP's, DeepSpeed's): for these too, or a rank that ends first leaves the others
        # in a gather. Asked per call (not by marking the module as FSDP's, which torch.compile reads too).
        if world_size > 1 and callable(getattr(m, "generate", None)):
            m.__dict__["generate"] = _synced_generate(m.generate)
    for m in module.modules():  # See [Note: PEFT's adapter switches] in engine/orig_params.py
        if callable(getattr(m, "enable_adapters", None)) and hasattr(m, "_disable_adapters"):  # a PEFT layer
            m.__dict__["enable_adapters"] = _enabling(m.enable_adapters)
        if callable(getattr(m, "set_adapter", None)) and has_adapters(m):
            m.__dict__["set_adapter"] = _same_adapter(m, m.set_adapter)  # PeftModel, its tuner (LoraModel)
    module.register_state_dict_pre_hook(_refuse_module_state_dict)
    module.register_load_state_dict_pre_hook(_refuse_module_load_state_dict)  # one line, not one per parameter


def _synced_generate(generate):
    """HF ``generate`` with ``synced_gpus=True`` unless the call says otherwise."""
    @functools.wraps(generate)
    def synced(*args, **kwargs):
        kwargs.setdefault("synced_gpus", True)
        return generate(*args, **kwargs)

    return synced


def _enabling(enable_adapters):
    """A PEFT layer's ``enable_adapters``: disabling runs in ``disabling_adapters()``."""
    @functools.wraps(enable_adapters)
    def enabling(enabled: bool, *args, **kwargs):
        if enabled:
            return enable_adapters(enabled, *args, **kwargs)
        with disabling_adapters():
            return enable_adapters(enabled, *args, **kwargs)

    return enabling


def _same_adapter(model: nn.Module, set_adapter):
    """PEFT's ``set_adapter``, refused up front when it names other adapters than the active ones."""
    @functools.wraps(set_adapter)
    def same(adapter_name, *args, **kwargs):
        want = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        active = getattr(model, "active_adapters", None)
        active = active() if callable(active) else active  # a method on transformers' models, else a property
        active = [active] if isinstance(active, str) else list(active or [])
        if sorted(want) != sorted(active):
            raise RuntimeError(
                f"yafsdp: set_adapter({adapter_name!r}) on a wrapped PEFT model ({type(model).__name__}; active: "
                f"{active}): which adapter trains is fixed at wrap time (its weights are in the trainable flat "
                "shards, the other adapters' in the frozen ones), so switching would train nothing or the wrong "
                "adapter. Call set_adapter(...) before yafsdp.YaFSDP(model), one wrapped model per adapter you "
                "train; disable_adapter() (the base model's outputs) works after wrapping")
        return set_adapter(adapter_name, *args, **kwargs)

    return same


def _refuse_module_state_dict(module, prefix, keep_vars):
    peft = has_adapters(module)
    raise RuntimeError(
        f"yafsdp: state_dict() of the module wrapped by yafsdp.YaFSDP ({type(module).__name__}) would hold none of "
        "its parameters (they are sharded); use model.full_state_dict() on the YaFSDP wrapper, or "
        "yafsdp.checkpoint / yafsdp.hf.export_hf"
        + ("; for its PEFT adapter (what save_pretrained writes) model.save_adapter(out_dir) on the wrapper, and "
           "for the base model with the adapter merged in yafsdp.adapters.export_merged(model, out_dir)" if peft else "")
    )


def _refuse_module_load_state_dict(module, state_dict, prefix, *args):
    raise RuntimeError(
        f"yafsdp: load_state_dict() on the module wrapped by yafsdp.YaFSDP ({type(module).__name__}) cannot write "
        "its parameters (they are sharded); use model.load_full_state_dict(state_dict) on the YaFSDP wrapper (the "
        "original keys), or yafsdp.checkpoint.load_checkpoint / yafsdp.hf.load_hf_weights"
    )
