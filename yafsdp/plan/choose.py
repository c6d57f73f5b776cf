"""Activation checkpointing chosen by the memory plan: the fewest blocks to checkpoint so that the
predicted peak fits a memory budget, and the switch that checkpoints exactly those blocks.

    choice = yafsdp.plan.choose_checkpointing(model, budget="60GiB", batch=1, seq=8192)  # wrapped model
    yafsdp.plan.apply_checkpointing(model, choice.blocks)
    print(choice.format())
    python -m yafsdp plan --preset llama3-8b --world-size 8 --batch 1 --seq 8192 --budget 60GiB

[Note: choosing the checkpointed blocks]
Recomputation is the largest avoidable cost of a step, so checkpoint as few blocks as the memory
allows. The plan's peak for a set of checkpointed blocks is in [Note: the peak of a checkpointed
set] (yafsdp/plan/activations.py); everything else the plan counts (the engine's buffers and
shards, the optimizer state) does not depend on the set. For a given count k the best set is the
first k blocks in forward order (see that note: an early block is recomputed when the later
blocks' activations are already freed), and the peak of the first k is non-increasing in k
while a block's input is smaller than what it saves, which holds for every transformer block. The
chooser still does not rely on it: it evaluates every k from 0 up and takes the first whose
predicted peak fits; tests/multirank/test_activation_checkpointing.py checks it against a brute force over all subsets.
Blocks of different sizes (e.g. a model with two block lists) are covered by the same scan
because the set is always a prefix of the forward order; the brute-force test would show a
better non-prefix set if one existed for the models tested.

The budget is per device and counts what the plan counts on the device: the engine's device
bytes, the optimizer state (unless offloaded) and the activation peak (``MemoryPlan.device_total``).
On a GPU the default (``budget=None``) is what this process holds now (the engine is wrapped: its
buffers and shards are allocated) plus what the device has free, minus a margin for the CUDA
context, the collectives' own buffers and the allocator's fragmentation: max(1 GiB, 5% of the
device). On the CPU the budget must be given.
"""
from __future__ import annotations

import copy as _copy
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ..layout.config import EngineConfig
from ..layout.sizing import GiB


def _inner(model: nn.Module) -> nn.Module:
    """The wrapped module of a ``YaFSDP`` (known by its ``engine_config``: the plan does not import
    the wrapper), else ``model``."""
    return model.module if isinstance(getattr(model, "engine_config", None), EngineConfig) else model

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_bytes(value) -> int:
    """``60GiB``, ``60G`` (binary), ``60GB`` (decimal), ``1.5TiB`` or a plain number of bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"memory budget {value!r}: write a number with a unit, e.g. 60GiB, 512MiB or 8e9")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def gpu_budget(device: torch.device | None = None) -> int:
    """The default budget on a GPU: held by this process + free on the device - margin (see the Note)."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    free, total = torch.cuda.mem_get_info(device)
    margin = max(GiB, total // 20)
    return torch.cuda.memory_allocated(device) + free - margin


@dataclass
class CheckpointChoice:
    budget: int  # bytes per device the step must fit in
    blocks: list[str]  # module paths of the blocks to checkpoint, forward order
    indices: list[int]  # their indices among the model's blocks
    all_blocks: list[str]  # every block, forward order
    fixed: int  # device bytes that do not depend on the choice: engine + optimizer state
    peak: int  # predicted device peak with the chosen blocks checkpointed
    peak_none: int  # ... with none checkpointed
    peak_all: int  # ... with every block checkpointed
    fits: bool  # the chosen peak is within the budget (False: even checkpointing every block does not fit)
    plan: object = field(default=None, repr=False)  # the MemoryPlan of the choice

    def format(self) -> str:
        n, k = len(self.all_blocks), len(self.indices)
        lines = [f"activation checkpointing (auto) for a budget of {_size(self.budget)} per device: "
                 f"{k} of {n} blocks checkpointed"]
        if self.indices:
            lines.append(f"  checkpointed: {_ranges(self.blocks, self.indices)}")
        lines.append(f"  predicted peak {_size(self.peak)} (engine + optimizer state {_size(self.fixed)} "
                     f"+ activations{' or grad shards' if self.plan.grad_in_step else ''} "
                     f"{_size(self.peak - self.fixed)}); none checkpointed "
                     f"{_size(self.peak_none)}, all {_size(self.peak_all)}")
        if not self.fits:
            lines.append(f"  DOES NOT FIT: even with every block checkpointed the predicted peak "
                         f"{_size(self.peak_all)} exceeds the budget; lower the batch or sequence, shard "
                         "over more ranks, or offload (offload='optimizer')")
        return "\n".join(lines)

    def take(self, k: int) -> "CheckpointChoice":
        """The same budget with the first ``k`` blocks checkpointed instead (e.g. the largest count
        chosen over ranks, whose padding and free memory differ)."""
        from .activations import estimate_from_trace

        act = self.plan.activations
        est = estimate_from_trace(act.trace, range(k), act.unit_grad_bytes)
        peak = self.fixed + self.plan.step_bytes(est.total, est.saved)
        plan = _copy.copy(self.plan)
        plan.activations = est
        return CheckpointChoice(budget=self.budget, blocks=self.all_blocks[:k], indices=list(range(k)),
                                all_blocks=self.all_blocks, fixed=self.fixed, peak=peak, peak_none=self.peak_none,
                                peak_all=self.peak_all, fits=peak <= self.budget, plan=plan)

    def to_dict(self) -> dict:
        return dict(budget=self.budget, blocks=self.blocks, indices=self.indices, n_blocks=len(self.all_blocks),
                    fixed=self.fixed, peak=self.peak, peak_none=self.peak_none, peak_all=self.peak_all,
                    fits=self.fits)


def _size(b: int) -> str:
    return f"{b / GiB:.2f} GiB" if abs(b) >= GiB else f"{b / 2**20:.2f} MiB"


def _ranges(names: list[str], idx: list[int]) -> str:
    """``model.layers.0-11`` for a run of consecutive blocks of one list, names otherwise."""
    m = [re.fullmatch(r"(.*\.)(\d+)", n) for n in names]
    if all(m) and len({x.group(1) for x in m}) == 1 and idx == list(range(idx[0], idx[0] + len(idx))):
        lo, hi = m[0].group(2), m[-1].group(2)
        return m[0].group(1) + (lo if lo == hi else f"{lo}-{hi}")
    return ", ".join(names)


def choose_checkpointing(model: nn.Module, *, budget=None, batch: int, seq: int, device=None,
                         **plan_options) -> CheckpointChoice:
    """The fewest blocks of ``model`` to checkpoint so that the predicted device peak of a step on
    (``batch``, ``seq``) fits ``budget`` (bytes or e.g. "60GiB"; None: the GPU default, see
    [Note: choosing the checkpointed blocks]). ``model``: a wrapped ``YaFSDP`` or a plain model with
    ``memory_plan``'s options (``world_size=``, ``param_dtype=``, ``attention=``, ...) in
    ``plan_options``. The returned ``plan`` is ``memory_plan(..., checkpointing=choice.indices)``."""
    from .activations import estimate_from_trace
    from .build import memory_plan

    if budget is None:
        dev = device if device is not None else getattr(model, "device", None)
        if dev is None or torch.device(dev).type != "cuda":
            raise ValueError("choose_checkpointing: budget= is required off the GPU (e.g. budget='8GiB'); on a GPU "
                             "the default is the device's free memory after the engine's allocations minus a margin")
        budget = gpu_budget(torch.device(dev))
    budget = parse_bytes(budget)
    plan = memory_plan(model, batch=batch, seq=seq, checkpointing=False, **plan_options)
    if plan.activations is None:
        raise ValueError("choose_checkpointing: the activations cannot be traced: the plan traces a meta copy, which "
                         "it builds for an HF model, a PEFT model around one, a module holding either or a model "
                         "already on the meta device, and a model that is not an HF causal LM needs "
                         "inputs_fn=(batch, seq, device) -> kwargs (docs/activation_checkpointing.md)")
    trace, grads = plan.activations.trace, plan.activations.unit_grad_bytes
    n = len(trace.per_block)
    if n == 0:
        raise ValueError("choose_checkpointing: the model has no repeated blocks to checkpoint")
    fixed = plan.device_total - plan.step_bytes(plan.activations.total)  # the state between steps
    # See [Note: choosing the checkpointed blocks]: the first k blocks, the smallest k that fits (world 1: with
    # the grad shards made in backward, plan.step_bytes).
    peaks = [fixed + plan.step_bytes(trace.peak(frozenset(range(k)), grads), trace.saved(frozenset(range(k))))
             for k in range(n + 1)]
    k = next((k for k, p in enumerate(peaks) if p <= budget), n)
    plan.activations = estimate_from_trace(trace, range(k), grads)
    return CheckpointChoice(budget=budget, blocks=trace.blocks[:k], indices=list(range(k)), all_blocks=trace.blocks,
                            fixed=fixed, peak=peaks[k], peak_none=peaks[0], peak_all=peaks[n],
                            fits=peaks[k] <= budget, plan=plan)


def _blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    from ..layout.units import find_blocks

    names = {id(m): n for n, m in module.named_modules()}
    return [(names[id(b)], b) for b in find_blocks(module)]


def model_blocks(model: nn.Module) -> list[str]:
    """The module paths of the blocks ``apply_checkpointing`` can checkpoint (the repeated
    blocks the engine's units are made of), in forward order; ``model`` wrapped or not."""
    return [n for n, _ in _blocks(_inner(model))]


def apply_checkpointing(model: nn.Module, blocks) -> list[str]:
    """Checkpoint exactly ``blocks`` (module paths, or indices among the model's blocks, e.g. a
    ``CheckpointChoice``'s ``blocks``) and no other block, non-reentrant. ``model``: wrapped or not;
    call it before the first step. HF blocks (``GradientCheckpointingLayer``) use HF's own switch,
    per block (it also turns their KV cache off under checkpointing); other blocks have their
    ``forward`` run under ``torch.utils.checkpoint`` (the engine's hooks stay outside it, in
    ``__call__``, as with HF). Returns the checkpointed blocks' paths."""
    module = _inner(model)
    found = _blocks(module)
    if isinstance(blocks, CheckpointChoice):
        blocks = blocks.blocks
    by_name = {n: i for i, (n, _) in enumerate(found)}
    want: set[int] = set()
    for b in blocks:
        if isinstance(b, int):
            if not 0 <= b < len(found):
                raise ValueError(f"apply_checkpointing: block index {b} out of range; the model has "
                                 f"{len(found)} blocks")
            want.add(b)
        elif b in by_name:
            want.add(by_name[b])
        else:
            raise ValueError(f"apply_checkpointing: {b!r} is not one of the model's blocks "
                             f"({found[0][0] if found else 'none'} ... {found[-1][0] if found else ''})")
    for i, (name, b) in enumerate(found):
        _switch(b, i in want)
    return [found[i][0] for i in sorted(want)]


def _switch(block: nn.Module, on: bool):
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    if hasattr(type(block), "gradient_checkpointing"):  # HF GradientCheckpointingLayer
        block._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
        block.gradient_checkpointing = on
        return
    orig = block.__dict__.pop("_yafsdp_forward", None)
    if orig is not None:  # undo an earlier switch
        block.__dict__.pop("forward", None)
    if on:
        fwd = block.forward
        block._yafsdp_forward = fwd

        def forward(*args, **kwargs):
            if block.training and torch.is_grad_enabled():
                return checkpoint(fwd, *args, use_reentrant=False, **kwargs)
            return fwd(*args, **kwargs)

        block.forward = forward


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """The blocks that are checkpointed now (by ``apply_checkpointing`` or HF's switch)."""
    module = _inner(model)
    return [n for n, b in _blocks(module)
            if getattr(b, "gradient_checkpointing", False) or "_yafsdp_forward" in b.__dict__]


def configure_checkpointing(model: nn.Module, mode: str, *, budget=None, batch: int, seq: int,
                            **plan_options) -> CheckpointChoice | None:
    """One switch for a training script: ``mode`` "none" (no block checkpointed), "all" (every
    block) or "auto" (the fewest blocks that fit ``budget``; None on a GPU: the default budget).
    Returns the choice for "auto" (print ``choice.format()``), else None. A choice that does not fit
    even with every block checkpointed raises ValueError (the step would run out of memory)."""
    if mode not in ("none", "all", "auto"):
        raise ValueError(f"checkpointing={mode!r}: use 'none', 'all' or 'auto'")
    if mode != "auto":
        apply_checkpointing(model, model_blocks(model) if mode == "all" else [])
        return None
    choice = choose_checkpointing(model, budget=budget, batch=batch, seq=seq, **plan_options)
    if not choice.fits:
        raise ValueError(choice.format())
    apply_checkpointing(model, choice.blocks)
    return choice
