"""The activation estimate: a meta-device trace of one forward. See [Note: activation estimate]
in ``yafsdp/plan/__init__.py``."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..units import find_blocks
from .sizing import dtype_name


@dataclass
class ActivationEstimate:
    batch: int
    seq: int
    checkpointing: bool
    attention: str  # "fused" | "math"
    dtype: str
    saved: int  # bytes saved for backward at the end of forward
    transient: int  # bytes the backward adds on top (see [Note: activation estimate])
    per_block: int  # saved bytes of the largest block (without checkpointing)
    largest_saved: int  # the largest single saved tensor

    @property
    def total(self) -> int:
        return self.saved + self.transient


class _FusedAttentionStandIn(torch.autograd.Function):
    """Saves what flash / memory-efficient SDPA saves: q, k, v, output and an fp32 logsumexp."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the trace runs forward only
        raise RuntimeError("the activation trace runs forward only")


class _FusedSDPA(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = args[:3]
            return _FusedAttentionStandIn.apply(q, k, v)
        return func(*args, **kwargs)


def _meta_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module | None:
    """A fresh copy of ``module`` on the meta device in ``dtype``, or None if it cannot be built."""
    config = getattr(module, "config", None)
    if config is not None and hasattr(type(module), "_from_config"):
        with torch.device("meta"):
            copy = type(module)(config)
    elif all(p.is_meta for p in module.parameters()):
        import copy as _copy

        copy = _copy.deepcopy(module)
    else:
        return None
    return copy.to(dtype)


def _hf_inputs(batch: int, seq: int, device) -> dict:
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    return {"input_ids": ids, "labels": ids}


def activation_estimate(
    module: nn.Module,
    *,
    batch: int,
    seq: int,
    checkpointing: bool = False,
    dtype: torch.dtype = torch.float32,
    attention: str = "fused",
    inputs_fn=None,
    unit_grad_bytes: int = 0,
) -> ActivationEstimate | None:
    """Trace one forward of a meta copy of ``module``; see [Note: activation estimate]."""
    if attention not in ("fused", "math"):
        raise ValueError(f"attention={attention!r}: use 'fused' or 'math'")
    model = _meta_copy(module, dtype)
    if model is None:
        return None
    if inputs_fn is None:
        if getattr(model, "config", None) is None:
            return None
        inputs_fn = _hf_inputs
    model.train()
    blocks = find_blocks(model)
    block_ids = {id(b): i for i, b in enumerate(blocks)}
    skip = {p.untyped_storage()._cdata for p in model.parameters()}
    skip |= {b.untyped_storage()._cdata for b in model.buffers()}
    saved: dict[int, tuple[int, str]] = {}  # storage -> (bytes, "block i" | "outside")
    where = ["outside"]
    block_inputs: list[int] = []

    def pack(t: torch.Tensor):
        key = t.untyped_storage()._cdata
        if key not in skip and key not in saved:
            saved[key] = (t.untyped_storage().nbytes(), where[0])
        return t

    def pre(mod, args, kwargs):
        where[0] = f"block {block_ids[id(mod)]}"
        h = args[0] if args else kwargs.get("hidden_states")
        block_inputs.append(h.untyped_storage().nbytes() if isinstance(h, torch.Tensor) else 0)

    def post(mod, args, kwargs, out):
        where[0] = "outside"

    handles = [b.register_forward_pre_hook(pre, with_kwargs=True) for b in blocks]
    handles += [b.register_forward_hook(post, with_kwargs=True) for b in blocks]
    try:
        mode = _FusedSDPA() if attention == "fused" else None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if mode is not None:
                with mode:
                    model(**inputs_fn(batch, seq, "meta"))
            else:
                model(**inputs_fn(batch, seq, "meta"))
    finally:
        for h in handles:
            h.remove()
    per_block: dict[str, int] = {}
    for nbytes, w in saved.values():
        per_block[w] = per_block.get(w, 0) + nbytes
    outside = per_block.pop("outside", 0)
    largest_block = max(per_block.values(), default=0)
    if checkpointing and blocks:
        # HF per-layer checkpoint: each block keeps its input; one block is recomputed at a time.
        total = outside + sum(block_inputs) + largest_block
    else:
        total = outside + sum(per_block.values())
    largest = max((b for b, _ in saved.values()), default=0)
    return ActivationEstimate(
        batch=batch, seq=seq, checkpointing=checkpointing, attention=attention, dtype=dtype_name(dtype),
        saved=total, transient=max(2 * largest, unit_grad_bytes), per_block=largest_block, largest_saved=largest,
    )
