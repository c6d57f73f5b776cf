"""PEFT adapters of a wrapped model, in PEFT's own format.

    model = peft.get_peft_model(base, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    model = yafsdp.YaFSDP(model)            # the base is frozen: a frozen group of each unit
    ...                                     # train the adapters
    yafsdp.adapters.save_adapter(model, "runs/adapter")     # collective
    # later, anywhere: peft.PeftModel.from_pretrained(base, "runs/adapter")

The adapter is taken from the full state dict (gathered one unit at a time, on rank 0) with PEFT's
own ``get_peft_model_state_dict``, and written as ``adapter_model.safetensors`` +
``adapter_config.json`` into a temporary folder renamed at the end (a failed save leaves no partial
directory behind).
"""
from __future__ import annotations

import os
import shutil

from .dist import raise_together

__all__ = ["save_adapter", "AdapterError"]

WEIGHTS = "adapter_model.safetensors"


class AdapterError(ValueError):
    """The model has no PEFT adapter to save, or the save failed."""


def save_adapter(model, out_dir: str, adapter_name: str = "default") -> str | None:
    """Collective. Write the PEFT adapter ``adapter_name`` of a wrapped PEFT model to ``out_dir``
    (on rank 0), loadable with ``peft.PeftModel.from_pretrained(base, out_dir)``. Returns
    ``out_dir`` on rank 0, None elsewhere."""
    inner = model.module
    problem = None
    config = getattr(inner, "peft_config", None)
    if not isinstance(config, dict) or adapter_name not in config:
        have = sorted(config) if isinstance(config, dict) else None
        problem = (f"yafsdp.adapters.save_adapter: the wrapped module ({type(inner).__name__}) has no PEFT adapter "
                   f"{adapter_name!r}" + (f" (it has {have})" if have else "; wrap a model made by peft.get_peft_model"))
    raise_together(problem, model.process_group, AdapterError)
    sd = model.full_state_dict()  # collective; rank 0: every key of the PEFT model
    if model.rank != 0:
        return None
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    adapter = get_peft_model_state_dict(inner, state_dict=sd, adapter_name=adapter_name)
    if not adapter:
        raise AdapterError(f"yafsdp.adapters.save_adapter: adapter {adapter_name!r} holds no tensors")
    tmp = out_dir.rstrip("/") + ".tmp-adapter"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        save_file({k: v.contiguous() for k, v in adapter.items()}, os.path.join(tmp, WEIGHTS),
                  metadata={"format": "pt"})
        config[adapter_name].save_pretrained(tmp)
        if os.path.isdir(out_dir):
            extra = sorted(set(os.listdir(out_dir)) - {WEIGHTS, "adapter_config.json", "README.md"})
            if extra:
                raise AdapterError(f"yafsdp.adapters.save_adapter: {out_dir!r} exists and holds other files "
                                   f"({extra[:5]}); choose another directory")
            old = out_dir.rstrip("/") + ".old-adapter"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out_dir, old)  # the previous adapter stays whole until the new one is in place
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except (OSError, AdapterError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, AdapterError):
            raise
        raise AdapterError(f"yafsdp.adapters.save_adapter: writing {out_dir!r} failed: {e}") from None
    return out_dir
