"""Training-parity harness: the sharded model against one process on the global batch."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import yafsdp
from models import Stack, batch, loss_of, tiny_llama

STEPS = 3
LR = 3e-3
MAX_NORM = 1.0

# name -> options. kind: llama | stack; dtype: None (fp32) or "bf16" (param_dtype); reduce: "bf16"
# for bf16 grad buffers and reduce-scatters (reduce_dtype).
CASES = {
    "llama_z3": dict(kind="llama"),
    "llama_z3_tied_accum3": dict(kind="llama", tie=True, accum=3),
    "llama_z2_tied_accum3": dict(kind="llama", tie=True, accum=3, zero=2),
    "llama_z2": dict(kind="llama", zero=2),
    "llama_z3_ckpt": dict(kind="llama", ckpt=True, accum=3),
    "llama_z2_ckpt_tied": dict(kind="llama", ckpt=True, tie=True, zero=2),
    "llama_units_tied": dict(kind="llama", tie=True, units=True),
    "llama_groups": dict(kind="llama", groups=True),
    "stack_z3": dict(kind="stack", accum=3),
    "stack_z3_ckpt_units": dict(kind="stack", ckpt=True, units=True),
    "stack_z2": dict(kind="stack", zero=2),
    "llama_outsized": dict(kind="llama", vocab=1000, accum=3),
    "llama_bf16_z3_tied": dict(kind="llama", tie=True, dtype="bf16"),
    "llama_bf16_z2_accum3": dict(kind="llama", zero=2, accum=3, dtype="bf16"),
    "llama_bf16_reduce_bf16": dict(kind="llama", vocab=1000, dtype="bf16", reduce="bf16"),
}


def build(case: dict):
    if case["kind"] == "llama":
        return tiny_llama(tie=case.get("tie", False), checkpointing=case.get("ckpt", False), vocab=case.get("vocab", 67))
    return Stack(ckpt=case.get("ckpt", False))


def explicit_units(model, case):
    if case["kind"] == "llama":
        return [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]
    return [model.inp, *model.blocks, model.head]


def make_optimizer(params_or_groups):
    return torch.optim.AdamW(params_or_groups, lr=LR, weight_decay=0.1, foreach=False)


def reference_groups(model):
    decay = [p for p in model.parameters() if p.dim() > 1]
    small = [p for p in model.parameters() if p.dim() <= 1]
    return [dict(params=decay, weight_decay=0.1), dict(params=small, weight_decay=0.0)]


def train_sharded(rank: int, world: int, names: list[str], optimizer_factory=None):
    out = {}
    for name in names:
        case = CASES[name]
        model = build(case)
        units = explicit_units(model, case) if case.get("units") else None
        dtype = torch.bfloat16 if case.get("dtype") == "bf16" else None
        reduce = torch.bfloat16 if case.get("reduce") == "bf16" else torch.float32
        sharded = yafsdp.YaFSDP(model, units=units, param_dtype=dtype, reduce_dtype=reduce, zero_stage=case.get("zero", 3))
        if case.get("groups"):
            opt = make_optimizer(sharded.param_groups(weight_decay=0.1, small_weight_decay=0.0))
        elif optimizer_factory is not None:
            opt = optimizer_factory(sharded.parameters())
        else:
            opt = make_optimizer(sharded.parameters())
        accum = case.get("accum", 1)
        losses, norms = [], []
        for step in range(STEPS):
            total = 0.0
            for micro in range(accum):
                loss = loss_of(sharded, case["kind"], batch(case["kind"], step, micro, rank))
                (loss / accum).backward()
                total += loss.item() / accum
            t = torch.tensor(total)
            dist.all_reduce(t)
            losses.append(t.item() / world)
            norms.append(sharded.clip_grad_norm_(MAX_NORM).item())
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
        out[name] = (losses, norms, sharded.full_state_dict())
    return out


def _cast_model(master, dtype):
    low = copy.deepcopy(master).to(dtype)
    return low


def train_reference(name: str, world: int, dtype=None):
    """One process, global batch; dtype=bf16: forward/backward in bf16 copies, fp32 master + AdamW."""
    case = CASES[name]
    model = build(case)
    opt = make_optimizer(reference_groups(model) if case.get("groups") else model.parameters())
    accum = case.get("accum", 1)
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        low = _cast_model(model, dtype) if dtype is not None else model
        for micro in range(accum):
            parts = [batch(case["kind"], step, micro, r) for r in range(world)]
            inputs = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            loss = loss_of(low, case["kind"], inputs)
            (loss / accum).backward()
            total += loss.item() / accum
        if dtype is not None:
            for p, q in zip(model.parameters(), low.parameters()):
                p.grad = q.grad.float()
        losses.append(total)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def rel_l2(a: dict, b: dict) -> float:
    num = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in b)
    den = sum(float(b[k].float().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def rel_seq(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
