"""Build a model without memory for its parameters, and fill a wrapped model's shards directly.

    from yafsdp.init import meta_parameters, init_shards_
    with meta_parameters():
        model = LlamaForCausalLM(config)      # parameters on meta, buffers (rotary inv_freq) real
    model = yafsdp.YaFSDP(model)              # allocates zeroed shards, model.needs_load = True
    init_shards_(model, normal_init(0.02), seed=0)   # or model.load_full_state_dict(sd) on rank 0

[Note: meta construction]
``meta_parameters()`` moves every parameter to the meta device the moment a module registers it,
so a model of any size is built with no parameter memory and the (costly) in-constructor
initialisation runs on meta tensors, doing nothing. Buffers are left alone: non-persistent
buffers such as HF's rotary ``inv_freq`` are computed in the constructor, are not in any
checkpoint, and must therefore be real. (Building under ``torch.device("meta")`` would make them
meta too, and their values would be lost.) The one transient allocation is the ``torch.empty``
a constructor makes for each parameter before registering it: uninitialised, freed at once.

[Note: world-size independent init]
``init_shards_`` writes initial values straight into each rank's flat master shard; no rank ever
holds a whole parameter. The random values of a parameter are drawn block by block (blocks of
``BLOCK`` elements of its flattened tensor) from a generator seeded with (seed, parameter index,
block index), so a rank draws only the blocks that overlap its shard and the resulting model is
the same whatever the world size -- a run on 1 rank and on 8 ranks start from the same weights.
"""
from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable

import torch
from torch import nn

from .. import formats
from ..layout.pieces import copy_out, param_boxes, rows_of, tp_specs

BLOCK = 1 << 16  # elements per independently seeded block of a parameter's random init


@contextlib.contextmanager
def meta_parameters():
    """Within this context, every parameter registered by a module is moved to the meta device;
    buffers stay where they are created. See [Note: meta construction]."""
    original = nn.Module.register_parameter

    def register_parameter(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


# An init rule maps (parameter name, shape) to ("normal", std) | ("constant", value).
InitRule = Callable[[str, torch.Size], tuple]


def normal_init(std: float = 0.02) -> InitRule:
    """GPT/Llama-style: every >= 2-D weight ~ N(0, std); every 1-D parameter (norm weights) 1.0,
    except biases (named ``*.bias``), which start at 0."""

    def rule(name: str, shape: torch.Size) -> tuple:
        if len(shape) >= 2:
            return ("normal", std)
        return ("constant", 0.0 if name.endswith("bias") else 1.0)

    return rule


def _block_generator(seed: int, param_index: int, block: int, device) -> torch.Generator:
    key = zlib.crc32(f"{seed}/{param_index}/{block}".encode())
    g = torch.Generator(device=device)
    g.manual_seed(key)
    return g


@torch.no_grad()
def init_shards_(model, rule: InitRule, seed: int = 0) -> None:
    """Fill every rank's master shards of a wrapped model (``yafsdp.YaFSDP``) with initial values.

    Not collective: each rank computes only its own slice. Values do not depend on the world size
    (see [Note: world-size independent init]) nor on the TP degree: with tensor-parallel parameters a rank
    computes the whole rows of each global tensor that its piece of the TP slice touches and keeps its boxes
    (layout/pieces.py; a row-parallel weight costs T times its share of draws). Padding is left at zero. Clears
    ``needs_load``."""
    specs = tp_specs(model)
    index = 0
    for info in model.shard_info():
        if specs:  # plain groups only: TP refuses the stored formats (layout/dtensor.py)
            shard = info.param.detach()
            shard.zero_()
            for name, shape, pieces in param_boxes(info, shard, specs, model.tp_rank):
                if pieces:
                    first, end, inner = rows_of(shape, pieces)
                    rows = torch.empty((end - first) * inner, dtype=torch.float32)
                    _fill(rows, name, shape, first * inner, rule, seed, index)
                    copy_out(rows, shape, pieces)  # host rows into the shard's views
                index += 1
            continue
        lo, hi = info.shard_start, info.shard_start + info.shard_numel  # this rank's slice of the flat unit
        compact = info.format is not None  # a stored record (NF4): fill the values, then encode them
        shard = (torch.zeros(info.shard_numel, dtype=torch.float32, device=info.param.device) if compact
                 else info.param.detach())  # 1-D, shard_numel; writing bumps its version
        shard.zero_()
        for name, shape, offset in zip(info.param_names, info.param_shapes, info.param_offsets):
            a, b = max(lo, offset), min(hi, offset + torch.Size(shape).numel())
            if a < b:
                _fill(shard[a - lo:b - lo], name, shape, a - offset, rule, seed, index)
            index += 1
        if compact:
            formats.get(info.format).encode_(info.param.detach(), shard.to(info.values_dtype))
    model.mark_loaded()


def _fill(out: torch.Tensor, name: str, shape, start: int, rule: InitRule, seed: int, param_index: int):
    """out <- elements [start, start + len(out)) of parameter ``name``'s flattened initial value."""
    kind, value = rule(name, torch.Size(shape))
    if kind == "constant":
        out.fill_(value)
        return
    if kind != "normal":
        raise ValueError(f"yafsdp.init: rule returned {kind=!r} for parameter {name!r}; use 'normal' or 'constant'")
    end = start + out.numel()
    first, last = start // BLOCK, (end - 1) // BLOCK
    host = torch.empty(out.numel(), dtype=torch.float32)  # drawn on the CPU (same values on any device)
    for block in range(first, last + 1):
        b0 = block * BLOCK
        n = min(BLOCK, torch.Size(shape).numel() - b0)
        g = _block_generator(seed, param_index, block, "cpu")
        vals = torch.empty(n, dtype=torch.float32).normal_(0.0, value, generator=g)
        a, b = max(start, b0), min(end, b0 + n)
        host[a - start:b - start].copy_(vals[a - b0:b - b0])
    out.copy_(host)  # one copy per parameter slice
