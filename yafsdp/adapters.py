"""PEFT adapters of a wrapped model, in PEFT's own format.

    model = peft.get_peft_model(base, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    model = yafsdp.YaFSDP(model)            # the base is frozen: a frozen group of each unit
    ...                                     # train the adapters
    yafsdp.adapters.save_adapter(model, "runs/adapter")     # collective
    # later, anywhere: peft.PeftModel.from_pretrained(base, "runs/adapter")
    yafsdp.adapters.export_merged(model, "runs/merged")     # collective: W + scaling * B @ A
    # later: LlamaForCausalLM.from_pretrained("runs/merged")

The adapter is taken from the full state dict (gathered one unit at a time, on rank 0) with PEFT's
own ``get_peft_model_state_dict`` (run while the modules show their original parameters:
``state_dict.original_structure``), so the file holds what PEFT's ``save_pretrained`` writes --
LoRA/DoRA matrices, ``modules_to_save`` copies, trainable-token deltas -- and is written as ``adapter_model.safetensors`` +
``adapter_config.json`` into a temporary folder renamed at the end (a failed save leaves no partial
directory behind).
"""
from __future__ import annotations

import os
import shutil

import torch

from .dist import raise_together

__all__ = ["save_adapter", "export_merged", "AdapterError"]

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
    if not model.coordinator:
        return None
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    from .state_dict import original_structure

    # PEFT decides which keys belong to the adapter partly from the modules themselves (a
    # modules_to_save wrapper lists its copy's state_dict() keys; tuner layers their own
    # parameters): it must see them as they were before wrapping, the values coming from ``sd``.
    with original_structure(model._rt, model._anchored):
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


def _lora_modules(inner, adapter_name: str) -> tuple[dict, str | None]:
    """The LoRA Linear modules of ``adapter_name`` by name, or a reason the merge cannot be made."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:  # pragma: no cover - peft is a dependency of the tests
        return {}, "peft is not installed"
    found, problem = {}, None
    for name, m in inner.named_modules():
        if not hasattr(m, "lora_A") or adapter_name not in getattr(m, "lora_A", {}):
            if hasattr(m, "lora_embedding_A") and adapter_name in getattr(m, "lora_embedding_A", {}):
                problem = problem or f"module {name!r} is a LoRA embedding: only LoRA on Linear layers can be merged"
            continue
        if not isinstance(m, LoraLinear):
            problem = problem or f"module {name!r} is a {type(m).__name__}: only LoRA on Linear layers can be merged"
        elif getattr(m, "use_dora", {}).get(adapter_name, False):
            problem = problem or f"module {name!r} uses DoRA, which this merge does not implement"
        else:
            found[name] = m
    if not found and problem is None:
        problem = f"adapter {adapter_name!r} has no LoRA layers"
    return found, problem


def export_merged(model, out_dir: str, adapter_name: str = "default", *, dtype: torch.dtype = torch.float32,
                  tokenizer=None) -> str | None:
    """Collective. The base model with LoRA adapter ``adapter_name`` merged into it (``W + scaling *
    B @ A``, in fp32, then ``dtype``), written as a plain HF checkpoint of the base model's class on
    rank 0 (``from_pretrained`` loads it; no PEFT needed). Returns ``out_dir`` on rank 0."""
    inner = model.module
    config = getattr(inner, "peft_config", None)
    problem = None
    if not isinstance(config, dict) or adapter_name not in config:
        problem = (f"yafsdp.adapters.export_merged: the wrapped module ({type(inner).__name__}) has no PEFT adapter "
                   f"{adapter_name!r}")
    else:
        lora, why = _lora_modules(inner, adapter_name)
        if why:
            problem = f"yafsdp.adapters.export_merged: {why}"
        elif any(".modules_to_save." in k for k, _ in inner.named_modules()):
            problem = "yafsdp.adapters.export_merged: modules_to_save are not supported; save the adapter instead"
    raise_together(problem, model.process_group, AdapterError)
    sd = model.full_state_dict()
    if not model.coordinator:
        return None
    from .hf import write_hf

    merged = {}
    for name, m in lora.items():
        a = sd[f"{name}.lora_A.{adapter_name}.weight"].float()
        b = sd[f"{name}.lora_B.{adapter_name}.weight"].float()
        w = sd[f"{name}.base_layer.weight"]
        delta = b @ a
        if getattr(m, "fan_in_fan_out", False):
            delta = delta.T
        merged[f"{name}.base_layer.weight"] = (w.float() + delta * m.scaling[adapter_name]).to(w.dtype)
    base = inner.get_base_model()
    prefix = next((n + "." for n, mod in inner.named_modules() if mod is base), "")
    out = {}
    for k, v in sd.items():
        if ".lora_" in k:
            continue
        v = merged.get(k, v)
        k = k[len(prefix):] if k.startswith(prefix) else k
        out[k.replace(".base_layer.", ".")] = v
    return write_hf(out, base, out_dir, dtype=dtype, tokenizer=tokenizer)
