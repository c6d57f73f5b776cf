"""PEFT LoRA (and QLoRA) models whose base is never materialized.

    cfg = read_hf_config(path)
    built = meta_peft_model(cfg, peft.LoraConfig(...), seed=0)   # base on meta, adapters real
    model = yafsdp.YaFSDP(built.model, quantize_frozen="nf4")    # needs_load
    load_peft_base(model, path, built.adapters)                  # collective: each rank reads its slices

[Note: adapters over a meta base]
``meta_peft_model`` builds the base under ``yafsdp.init.meta_parameters`` (no parameter memory, no
draws from any random generator) and runs ``peft.get_peft_model`` on it with one change: PEFT
moves each new adapter to its base layer's device, which here is meta, so inside
``adapters_stay_on_cpu`` an adapter whose base layer is on meta is moved to the CPU instead
(dtype handling unchanged). The adapters are therefore created and initialised by PEFT's own
code, drawing from torch's global CPU generator in PEFT's order, and equal those of a
materialized base: with ``seed`` set, ``torch.manual_seed(seed)`` runs right before
``get_peft_model``, and PEFT then, for each targeted module in ``named_modules()`` order, builds
``lora_A`` = ``nn.Linear(in, r, bias=False)`` and ``lora_B`` = ``nn.Linear(r, out)`` (each
constructor draws a kaiming-uniform weight), then ``reset_lora_parameters``: with the default
``init_lora_weights=True``, A = kaiming_uniform_(a=sqrt(5)) (drawn again), B = zeros
(``"gaussian"``: A ~ N(0, 1/r)). A materialized base makes the same draws in the same order, as
long as it is built before the seed is set (tests/multirank/test_hf_stream.py checks equal adapters and
equal losses against ``from_pretrained`` + ``get_peft_model``). Inits computed from the base
weights (PiSSA, OLoRA, LoftQ, CorDA, EVA, DoRA's magnitude, ...) cannot run on a meta base and
are refused.

The adapters (full, on every rank: r x (in + out) per target, a fraction of a percent of the
model) are kept aside (``MetaPeftModel.adapters``) because wrapping drops a unit's values when
any of its parameters is on meta. ``load_peft_base`` then streams both into the shards
([Note: streaming loads] in hf_stream.py): the adapters from memory, every other key from the
checkpoint under its base name (``base_model.model.`` dropped, ``base_layer`` /
``original_module`` / ``modules_to_save.<adapter>`` components removed). An NF4 group is
quantized per slice as it arrives (``write_shard``), so no rank ever holds its bf16 base.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MetaPeftModel", "meta_peft_model", "load_peft_base", "base_key", "adapters_stay_on_cpu"]

PREFIX = "base_model.model."
_DROPPED = ("base_layer", "original_module")
_WEIGHT_FREE_INITS = (True, False, "gaussian")


@dataclass
class MetaPeftModel:
    model: nn.Module  # the PeftModel: base parameters on meta, adapters real (CPU)
    adapters: dict[str, torch.Tensor]  # every non-meta parameter, by state-dict key (cloned)


def base_key(key: str) -> str:
    """A PeftModel's state-dict key -> the base checkpoint's key for the same tensor."""
    if key.startswith(PREFIX):
        key = key[len(PREFIX):]
    parts, out, i = key.split("."), [], 0
    while i < len(parts):
        if parts[i] in _DROPPED:
            i += 1
        elif parts[i] == "modules_to_save":
            i += 2  # modules_to_save.<adapter name>
        else:
            out.append(parts[i])
            i += 1
    return ".".join(out)


@contextlib.contextmanager
def adapters_stay_on_cpu():
    """While PEFT adds adapters, a move to the meta device (PEFT places each new adapter on its
    base layer's device: here meta) goes to the CPU instead, dtype handling unchanged: the
    adapters keep the values PEFT initialised. See [Note: adapters over a meta base]."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    move_adapter = getattr(BaseTunerLayer, "_move_adapter_to_device_of_base_layer", None)
    if move_adapter is None:  # pragma: no cover - a PEFT without the hook: say so rather than lose values
        import peft

        raise RuntimeError(f"yafsdp.peft_load: peft {peft.__version__} has no "
                           "BaseTunerLayer._move_adapter_to_device_of_base_layer; build the base materialized")
    module_to = nn.Module.to

    def move(self, adapter_name, device=None):  # adapters held in ParameterDicts move as tensors
        w = getattr(self.get_base_layer(), "weight", None)
        if device is None and isinstance(w, torch.Tensor) and w.is_meta:
            device = torch.device("cpu")
        return move_adapter(self, adapter_name, device)

    def to(self, *args, **kwargs):  # adapter modules (lora_A, lora_B, ...) placed by _replace_module
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type == "meta" and not any(p.is_meta for p in self.parameters()):
            return module_to(self, "cpu", dtype, non_blocking) if dtype is not None else module_to(self, "cpu")
        return module_to(self, *args, **kwargs)

    BaseTunerLayer._move_adapter_to_device_of_base_layer = move
    nn.Module.to = to
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = move_adapter
        nn.Module.to = module_to


def _check_config(lora_config) -> None:
    bad = []
    init = getattr(lora_config, "init_lora_weights", True)
    if not (init is True or init is False or (isinstance(init, str) and init.lower() == "gaussian")):
        bad.append(f"init_lora_weights={init!r}")
    if getattr(lora_config, "use_dora", False):
        bad.append("use_dora=True")
    if bad:
        raise ValueError(f"yafsdp.peft_load: {', '.join(bad)} computes the adapters from the base weights, which "
                         "are not materialized here; use init_lora_weights=True/False/'gaussian' without DoRA, or "
                         "build the base materialized (from_pretrained) and wrap that")


def meta_peft_model(config, lora_config, *, seed: int | None = None, model_class=None, **from_config) -> MetaPeftModel:
    """A PeftModel over a base built on meta from ``config`` (``model_class``, default
    ``AutoModelForCausalLM``, ``.from_config(config, **from_config)``; or ``config`` is that base
    already, built under ``yafsdp.init.meta_parameters``), its adapters initialised by PEFT on the
    CPU (``torch.manual_seed(seed)`` first when ``seed`` is given). Not collective.
    See [Note: adapters over a meta base]."""
    import peft

    from .init import meta_parameters

    _check_config(lora_config)
    if isinstance(config, nn.Module):
        base = config
        real = [n for n, p in base.named_parameters() if not p.is_meta]
        if real:
            raise ValueError(f"yafsdp.peft_load.meta_peft_model: the base has parameters off the meta device "
                             f"({real[:3]}); build it under yafsdp.init.meta_parameters()")
    else:
        if model_class is None:
            from transformers import AutoModelForCausalLM as model_class
        with meta_parameters():
            base = model_class.from_config(config, **from_config)
    if seed is not None:
        torch.manual_seed(seed)
    with adapters_stay_on_cpu():
        model = peft.get_peft_model(base, lora_config)
    adapters = {k: v.detach().clone() for k, v in model.state_dict().items() if not v.is_meta}
    return MetaPeftModel(model, adapters)


def load_peft_base(model, path: str, adapters: dict[str, torch.Tensor]) -> None:
    """Collective. Fill wrapped ``model`` (a ``yafsdp.YaFSDP`` over ``meta_peft_model``'s model):
    ``adapters`` from memory, every other tensor from HF checkpoint ``path`` under its base name
    (``base_key``), each rank reading only its slices. Checked on every rank first (missing,
    unexpected, misshapen keys); nothing is modified on error."""
    from .hf import HFCheckpointError
    from .hf_stream import SafetensorsSource, TensorSource, _agree, load_streaming

    try:
        source, problem = SafetensorsSource(path), None
    except HFCheckpointError as e:
        source, problem = None, str(e)
    problem = _agree(problem, model)
    if problem:
        raise HFCheckpointError(problem)
    load_streaming(model, [(TensorSource(adapters, "the adapters PEFT initialised"), None), (source, base_key)],
                   error=HFCheckpointError, what="load_peft_base")
