"""The pretraining job's activation checkpointing: ``--checkpointing {none,all,auto}`` and
``--memory-budget`` (docs/activation_checkpointing.md). ``--activation-checkpointing`` is ``--checkpointing all``
(HF's switch, set before wrapping); ``auto`` (the default when a budget is given) checkpoints the
fewest decoder layers whose predicted peak fits the budget (``yafsdp.plan.choose_checkpointing``).

Every rank checkpoints the same layers: the budget is the smallest over ranks (GPUs' free memory
differs) and the count the largest over ranks (the plan's padding differs by rank), so the
verdict -- fits or not -- is the same everywhere and the job stops on every rank together.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pretrain.ops import JobError
from yafsdp.plan import apply_checkpointing, choose_checkpointing, parse_bytes
from yafsdp.plan.choose import gpu_budget, model_blocks


def checkpointing_mode(a) -> str:
    """none / all / auto from --activation-checkpointing, --checkpointing and --memory-budget."""
    if a.activation_checkpointing:
        if a.checkpointing not in (None, "all"):
            raise JobError(f"--activation-checkpointing checkpoints every layer; it contradicts "
                           f"--checkpointing {a.checkpointing} (give one of them)")
        return "all"
    return a.checkpointing or ("auto" if a.memory_budget else "none")


def _agree(values: list[int], op, device: torch.device) -> list[int]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=op)
    return [int(v) for v in t.tolist()]


def job_checkpointing(job):
    """Apply the job's checkpointing to ``job.model`` (wrapped); the choice for auto, else None."""
    a = job.args
    mode = checkpointing_mode(a)
    if mode == "all" and a.activation_checkpointing:
        return None  # HF's switch was set before wrapping (Job.build)
    if mode != "auto":
        apply_checkpointing(job.model, model_blocks(job.model) if mode == "all" else [])
        return None
    if a.memory_budget is not None:
        try:
            budget = parse_bytes(a.memory_budget)
        except ValueError as e:
            raise JobError(f"--memory-budget: {e}") from None
    elif job.device.type == "cuda":
        budget = gpu_budget(job.device)  # after the engine's allocations: the model is wrapped
    else:
        raise JobError("--checkpointing auto needs --memory-budget on the CPU (e.g. --memory-budget 8GiB); on a "
                       "GPU the default is the free memory after the engine's allocations minus a margin")
    (budget,) = _agree([budget], dist.ReduceOp.MIN, job.device)
    try:
        choice = choose_checkpointing(job.model, budget=budget, batch=a.batch_size, seq=a.seq_len)
    except ValueError as e:
        raise JobError(f"--checkpointing auto: {e}") from None
    k, short = _agree([len(choice.indices), int(not choice.fits)], dist.ReduceOp.MAX, job.device)
    if k != len(choice.indices):
        choice = choice.take(k)
    if short:
        raise JobError(f"--checkpointing auto: the step does not fit --memory-budget on every rank:\n"
                       f"{choice.format()}")
    apply_checkpointing(job.model, choice.blocks)
    return choice

