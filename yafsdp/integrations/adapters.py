"""PEFT adapters of a wrapped model, in PEFT's own format.

    model = peft.get_peft_model(base, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    model = yafsdp.YaFSDP(model)            # the base is frozen: a frozen group of each unit
    ...                                     # train the adapters
    yafsdp.adapters.save_adapter(model, "runs/adapter")     # collective
    # later, anywhere: peft.PeftModel.from_pretrained(base, "runs/adapter")
    yafsdp.adapters.export_merged(model, "runs/merged")     # collective: W + scaling * B @ A
    # later: LlamaForCausalLM.from_pretrained("runs/merged")

The adapter is taken from the units streamed by (gathered one at a time, on rank 0, keeping only the
adapter's keys: ``_adapter_tensors``) with PEFT's own ``get_peft_model_state_dict`` (run while the
modules show their original parameters: ``state_dict.original_structure``), so the file holds what
PEFT's ``save_pretrained`` writes --
LoRA/DoRA matrices, ``modules_to_save`` copies, trainable-token deltas -- and is written as ``adapter_model.safetensors`` +
``adapter_config.json`` into a temporary folder renamed at the end (a failed save leaves no partial
directory behind).
"""
from __future__ import annotations

import os
import shutil

import torch

from ..comm.groups import raise_together

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
    adapter = _adapter_tensors(model, inner, adapter_name)  # collective; rank 0: the adapter's tensors
    if not model.coordinator:
        return None
    from safetensors.torch import save_file

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


def _adapter_tensors(model, inner, adapter_name: str) -> dict | None:
    """Collective. Rank 0: PEFT's ``get_peft_model_state_dict`` of the wrapped model, None elsewhere.

    PEFT chooses the adapter's keys from their names and the modules (a modules_to_save wrapper
    lists its copy's keys; tuner layers their own parameters), so it is asked twice: first with a
    meta-device stand-in for every key (which keys does it pick?), then, after the model was
    streamed unit by unit keeping only those keys, with their values. Rank 0 so holds the
    adapter and one gathered unit, never the base model. Should PEFT build a tensor of its own
    from the stand-ins (nothing the tests know of), the whole state dict is gathered as before."""
    from peft import get_peft_model_state_dict

    from .export import iter_units
    from ..wrapper.state_dict import original_structure

    ref_of = {key: (ref.shape, ref.dtype) if kind == "param" else (ref[0]._buffers[ref[1]].shape,
                                                                   ref[0]._buffers[ref[1]].dtype)
              for key, kind, ref in model._keys.entries}
    probe = {k: torch.empty(shape, dtype=dt, device="meta") for k, (shape, dt) in ref_of.items()}
    which = {id(v): k for k, v in probe.items()}
    # See the module docstring: PEFT must see the modules as they were before wrapping.
    with original_structure(model._rt):
        picked = get_peft_model_state_dict(inner, state_dict=probe, adapter_name=adapter_name)
    wanted = {which[id(v)] for v in picked.values() if id(v) in which}
    model.check_idle("save_adapter")
    if any(id(v) not in which for v in picked.values()):
        sd = model.full_state_dict()  # PEFT computed something from the values: give it all of them
    elif model.replica != 0:
        return None
    else:
        sd = {}
        for unit in iter_units(model._rt, model._keys, model.process_group, model.rank, "save_adapter()"):
            for k, v in (unit or {}).items():
                if k in wanted:
                    sd[k] = v.to("cpu", ref_of[k][1], copy=True)
            del unit
        sd = {k: sd.get(k, probe[k]) for k in probe}
    if not model.coordinator:
        return None
    with original_structure(model._rt):
        adapter = get_peft_model_state_dict(inner, state_dict=sd, adapter_name=adapter_name)
    meta = [k for k, v in adapter.items() if v.is_meta]
    if meta:  # pragma: no cover - PEFT read a key it had not picked
        raise AdapterError(f"yafsdp.adapters.save_adapter: PEFT's adapter state reads keys it did not select "
                           f"({meta[:5]}); please report this")
    return adapter


def _split_layer(model, lora: dict, adapter_name: str) -> str | None:
    """Why the streamed merge cannot run: a LoRA layer whose W, A and B sit in different units."""
    from .export import stream_order

    unit_of = {key: i for i, unit in enumerate(stream_order(model._rt, model._keys)) for key, _, _ in unit}
    for name in lora:
        keys = [f"{name}.base_layer.weight", f"{name}.lora_A.{adapter_name}.weight",
                f"{name}.lora_B.{adapter_name}.weight"]
        if len({unit_of.get(k) for k in keys}) != 1:
            return (f"yafsdp.adapters.export_merged: LoRA layer {name!r} has its weight and its A/B matrices in "
                    f"different units ({[unit_of.get(k) for k in keys]}); wrap so that each layer is in one unit")
    return None


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


def export_merged(model, out_dir: str, adapter_name: str = "default", *, dtype: torch.dtype | None = None,
                  tokenizer=None, max_shard_size: int | str = "5GB") -> str | None:
    """Collective. The base model with LoRA adapter ``adapter_name`` merged into it (``W + scaling *
    B @ A``, in fp32, then ``dtype``; None: bf16 for a bf16 run, else fp32), written as a plain HF
    checkpoint of the base model's class on rank 0 (``from_pretrained`` loads it; no PEFT needed),
    sharded as ``yafsdp.hf.export_hf`` does. Streamed: each unit is merged as it is gathered (a
    LoRA layer's W, A and B must be in one unit, as wrapping by decoder layer makes them).
    Returns ``out_dir`` on rank 0."""
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
        else:
            problem = _split_layer(model, lora, adapter_name)
    raise_together(problem, model.process_group, AdapterError)
    from .export import LEDGER
    from .hf_export import export_dtype, export_folder, tied_keys

    ref_dtype = {key: ref.dtype for key, kind, ref in model._keys.entries if kind == "param"}
    pieces = {}
    for name, m in lora.items():
        pieces[name] = (f"{name}.base_layer.weight", f"{name}.lora_A.{adapter_name}.weight",
                        f"{name}.lora_B.{adapter_name}.weight", m)

    def merge(values: dict) -> dict:  # one unit: W + scaling * B @ A for each LoRA layer whose W is here
        values = dict(values)
        for name, (wk, ak, bk, m) in pieces.items():
            if wk not in values:
                continue
            a = values[ak].to(ref_dtype[ak]).float()
            b = values[bk].to(ref_dtype[bk]).float()
            delta = LEDGER.hold(b @ a)
            if getattr(m, "fan_in_fan_out", False):
                delta = delta.T
            w = values[wk].to(ref_dtype[wk])
            values[wk] = LEDGER.hold((w.float() + delta * m.scaling[adapter_name]).to(w.dtype))
            del delta, w
        return values

    base = inner.get_base_model()
    prefix = next((n + "." for n, mod in inner.named_modules() if mod is base), "")
    tied = tied_keys(base)

    def rename(k: str) -> str | None:
        if ".lora_" in k:
            return None
        k = (k[len(prefix):] if k.startswith(prefix) else k).replace(".base_layer.", ".")
        return None if k in tied else k

    return export_folder(model, out_dir, base, rename=rename, dtype=export_dtype(model, dtype), tokenizer=tokenizer,
                         max_shard_size=max_shard_size, where="yafsdp.adapters.export_merged", merge=merge)
