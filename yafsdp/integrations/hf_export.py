"""Hugging Face exports written unit by unit: ``yafsdp.hf.export_hf`` and
``yafsdp.adapters.export_merged`` call :func:`export_folder`. See [Note: streaming export] in
export.py for the memory bound and the order of the files.

The folder is HF's ``save_pretrained`` layout: ``config.json`` (the ``architectures`` and dtype
set), ``model.safetensors`` when everything fits in ``max_shard_size``, otherwise
``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``, and the tokenizer files
when one is given. It is written as ``<out_dir>.tmp-export`` and renamed to ``out_dir`` last.
"""
from __future__ import annotations

import os
import shutil

import torch

from .export import ExportError, ShardWriter, iter_units, raise_over, stream_order, stream_to_writer

__all__ = ["export_folder", "export_dtype", "tied_keys", "TMP_SUFFIX"]

TMP_SUFFIX = ".tmp-export"


def export_dtype(model, dtype) -> torch.dtype:
    """``dtype`` or, when None, the run's: bf16 for a bf16 run (``param_dtype``), fp32 otherwise."""
    if dtype is None:
        return torch.bfloat16 if model.compute_dtype == torch.bfloat16 else torch.float32
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ExportError(f"dtype={dtype!r}: give a floating torch.dtype (torch.bfloat16, torch.float32) or None")
    return dtype


def tied_keys(inner) -> set[str]:
    """The keys ``save_pretrained`` leaves out because they are tied to another (``lm_head.weight``)."""
    config = inner.config
    if getattr(config, "tie_word_embeddings", False) and hasattr(inner, "_tied_weights_keys"):
        keys = inner._tied_weights_keys
        return set(keys if not isinstance(keys, dict) else keys.keys())
    return set()


def export_folder(model, out_dir: str, inner, *, rename, dtype: torch.dtype, tokenizer, max_shard_size,
                  where: str, merge=None) -> str | None:
    """Collective. Stream the wrapped model's state dict unit by unit into an HF folder for HF
    model ``inner`` (its config and class name are written). ``rename(key)`` gives the output key
    or None to leave the key out; ``merge(values)`` (optional) rewrites one unit's
    ``{key: tensor}`` before it is renamed (the LoRA merge). Returns ``out_dir`` on the
    coordinator, None elsewhere. HSDP: replica 0's shard group writes; the others return at once.
    Tensor parallel: each unit is gathered over data parallel, then each TP parameter over TP, on the
    ranks of data-parallel index 0; global rank 0 writes the full tensors (their global shapes)."""
    model.check_idle(where.split(":")[0].rsplit(".", 1)[-1])
    if model.replica != 0:
        return None
    rt, keys, group, tp = model._rt, model._keys, model.process_group, model._tp
    then = tp.group if tp is not None else None  # a verdict reaches the other TP coordinates' ranks too
    writer, tmp, problem = None, out_dir.rstrip("/") + TMP_SUFFIX, None
    via_of, plan = {}, []
    for unit in stream_order(rt, keys):
        for key, kind, ref in unit:
            new = rename(key)
            if new is None:
                continue
            if kind == "param":  # a TP parameter's global shape: the file holds the full tensor
                shape = tuple(ref.tp.shape if ref.tp is not None else ref.shape)
            else:
                shape = tuple(ref[0]._buffers[ref[1]].shape)
            src = ref.dtype if kind == "param" else ref[0]._buffers[ref[1]].dtype
            plan.append((new, shape, dtype if src.is_floating_point else src))
            via_of[key] = src
    if model.coordinator:
        problem = _target_problem(out_dir, where)  # before anything is gathered: every rank raises it
        if problem is None:
            try:
                shutil.rmtree(tmp, ignore_errors=True)  # a killed export's leftovers
                os.makedirs(tmp)
                writer = ShardWriter(tmp, plan, max_shard_size)
            except (OSError, ExportError) as e:
                problem = f"{where}: cannot start writing {out_dir!r}: {e}"
    raise_over(problem, group, then, ExportError)

    def transform(values):
        if merge is not None:
            values = merge(values)
        out = []
        for key, v in values.items():
            new = rename(key)
            if new is not None:
                out.append((new, v, via_of[key]))
        return out

    try:
        units = iter_units(rt, keys, group, model.rank, where)
        if tp is not None:
            units = _full_over_tp(units, tp, keys, model.rank)
        stream_to_writer(units, transform, writer, group, where, then)
        if writer is not None:
            writer.close()
            try:
                _finish(tmp, out_dir, inner, dtype, tokenizer)
            except OSError as e:  # the folder changed under the export: raised on every rank below
                problem = f"{where}: the export was written but could not be moved to {out_dir!r}: {e}"
                shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        if writer is not None:
            writer.abort()
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    raise_over(problem, group, then, ExportError)
    return out_dir if model.coordinator else None


def _target_problem(out_dir: str, where: str) -> str | None:
    """Why ``out_dir`` cannot take an export (it is a file, or a folder with files in it), or None."""
    if os.path.isdir(out_dir):
        if os.listdir(out_dir):
            return (f"{where}: {out_dir!r} exists and is not empty; export into a new or empty folder (or remove "
                    "that one first): nothing was written")
    elif os.path.exists(out_dir):
        return f"{where}: {out_dir!r} is a file, not a folder; export into a new or empty folder: nothing was written"
    return None


def _full_over_tp(units, tp, keys, rank: int):
    """``units`` (from ``iter_units``) with each TP parameter gathered over TP on the data-parallel index 0
    ranks (``full_over_tp``, collective over their TP group); global rank 0 gets the full tensors. Closing it
    closes ``units`` (every rank leaves the stream at the same unit)."""
    from ..wrapper.tp_state import full_over_tp

    try:
        for values in units:
            yield full_over_tp(tp, keys, values) if rank == 0 else values
            del values
    finally:
        units.close()


def _finish(tmp: str, out_dir: str, inner, dtype: torch.dtype, tokenizer) -> None:
    config = inner.config
    cfg = config.__class__.from_dict(config.to_dict())
    cfg.architectures = [type(inner).__name__]
    if "dtype" in cfg.to_dict():  # transformers >= 4.56 names it dtype; older ones torch_dtype
        cfg.dtype = dtype
    else:
        cfg.torch_dtype = dtype
    cfg.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if os.path.isdir(out_dir) and not os.listdir(out_dir):
        os.rmdir(out_dir)
    os.rename(tmp, out_dir)
