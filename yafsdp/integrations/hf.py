"""Hugging Face checkpoints in and out of a ``yafsdp.YaFSDP`` model.

    cfg = read_hf_config(path)                       # every rank (a small JSON file)
    with meta_parameters(): model = LlamaForCausalLM(cfg)
    model = yafsdp.YaFSDP(model)                     # needs_load: shards allocated, zero
    load_hf_weights(model, path)                     # collective: each rank reads only its slices
    ...
    export_hf(model, out_dir)                        # collective: streamed unit by unit, HF's sharded layout

Loading streams: each rank reads the byte ranges of its own shards ([Note: streaming loads] in
hf_stream.py). Exports stream: the coordinator writes each gathered unit as it arrives, holding one
unit, never the model ([Note: streaming export] in export.py). No rank holds the whole model.
"""
from __future__ import annotations

import os
import shutil

import torch


from .hf_files import INDEX, WEIGHTS, HFCheckpointError, weight_files  # noqa: F401 (yafsdp.hf's names)
from .hf_stream import SafetensorsSource, _agree, load_streaming


def read_hf_config(path: str):
    """The ``PretrainedConfig`` of local folder ``path`` (no network)."""
    from transformers import AutoConfig

    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise HFCheckpointError(f"{path!r} is not a Hugging Face checkpoint: {file!r} is missing")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise HFCheckpointError(f"{file!r} cannot be read as a model config ({type(e).__name__}: {e})") from None


def read_hf_state_dict(path: str) -> dict[str, torch.Tensor]:
    """All tensors of checkpoint ``path`` on the CPU (call on rank 0 only)."""
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        try:
            sd.update(load_file(f, device="cpu"))
        except Exception as e:  # noqa: BLE001
            raise HFCheckpointError(f"{f!r} cannot be read as safetensors ({type(e).__name__}: {e})") from None
    return sd


def load_hf_weights(model, path: str) -> None:
    """Collective. Every rank reads only the byte ranges of ``path``'s safetensors weights (one
    file, or the shards of its index) that fall into its own shards, converting the stored dtype
    on the fly: no rank holds more than its shards plus one flat group's slice in fp32 and one
    bounded read ([Note: streaming loads] in hf_stream.py). Every rank must see ``path``.
    Missing, unexpected or misshapen keys raise on every rank before anything is modified."""
    try:
        source = SafetensorsSource(path)
        problem = None
    except HFCheckpointError as e:
        source, problem = None, str(e)
    problem = _agree(problem, model)
    if problem:
        raise HFCheckpointError(problem)
    load_streaming(model, [source], error=HFCheckpointError, what="load_hf_weights")


def export_hf(model, out_dir: str, *, dtype: torch.dtype | None = None, tokenizer=None,
              max_shard_size: int | str = "5GB") -> str | None:
    """Collective. Write a wrapped HF model as a Hugging Face checkpoint into ``out_dir``:
    ``config.json``, the weights in ``dtype`` (None: bf16 for a bf16 run, else fp32) as
    ``model.safetensors`` or, past ``max_shard_size`` (bytes, or "5GB", "500MB", "2GiB" as HF
    writes them), ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``, and the
    tokenizer if given. Streamed unit by unit: the coordinator holds one gathered unit, never the
    whole model ([Note: streaming export] in yafsdp/integrations/export.py). Written into a temporary folder
    renamed at the end. Tied weights are written once, as ``save_pretrained`` does. Returns
    ``out_dir`` on the coordinator, None elsewhere."""
    from .hf_export import export_dtype, export_folder, tied_keys

    from ..wrapper.module_methods import has_adapters

    if has_adapters(model.module):  # every rank alike: no collective yet
        raise HFCheckpointError(
            f"yafsdp.hf.export_hf: the wrapped module ({type(model.module).__name__}) holds PEFT adapters: its keys "
            "(base_layer, lora_A.<adapter>, ...) are no checkpoint that from_pretrained loads (it would load none of "
            "them and start from random weights). Write the adapter with model.save_adapter(out_dir) "
            "(PeftModel.from_pretrained(base, out_dir) loads it), or the base model with the adapter merged in with "
            "yafsdp.adapters.export_merged(model, out_dir)")
    tied = tied_keys(model.module)
    return export_folder(model, out_dir, model.module, rename=lambda k: None if k in tied else k,
                         dtype=export_dtype(model, dtype), tokenizer=tokenizer, max_shard_size=max_shard_size,
                         where="yafsdp.hf.export_hf")


def write_hf(sd: dict, inner, out_dir: str, *, dtype: torch.dtype = torch.float32, tokenizer=None) -> str:
    """Write state dict ``sd`` of HF model ``inner`` (its config and class name are used) as an HF
    checkpoint into ``out_dir`` (one ``model.safetensors``), via a temporary folder renamed at the
    end. Not collective; the whole dict is in memory (``export_hf`` streams instead)."""
    from safetensors.torch import save_file

    from .hf_export import _finish

    config = inner.config
    tied = set()
    if getattr(config, "tie_word_embeddings", False) and hasattr(inner, "_tied_weights_keys"):
        keys = inner._tied_weights_keys
        tied = set(keys if not isinstance(keys, dict) else keys.keys())
    out = {}
    for k, v in sd.items():
        if k in tied:
            continue
        out[k] = v.to(dtype).contiguous() if v.is_floating_point() else v.contiguous()
    tmp = out_dir.rstrip("/") + ".tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(out, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
    _finish(tmp, out_dir, inner, dtype, tokenizer)  # config (and tokenizer), then the rename: as export_hf
    return out_dir
