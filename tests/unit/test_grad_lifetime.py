"""[Note: the grad shard's lifetime at world 1] (yafsdp/layout/sizing.py): at world 1 each unit's fp32 grad
shard is a tensor of its own, made at the unit's first fold of a step and freed by
``zero_grad(set_to_none=True)``. It changes where the gradients are stored, not a value: training matches
the one grad store kept between steps (``sizing.GRAD_LIFETIME_WORLD1 = False``) bit for bit; the shards
appear unit by unit during backward; ``set_to_none`` frees or keeps them as plain PyTorch does; the plan
counts them in the step's peak, not between steps.
"""
import weakref

import torch

import yafsdp
from dist_utils import run_ranks
from models import Branchy, all_grads, batch, loss_of, tiny_llama
from yafsdp.engine.shard_grad import plain
from yafsdp.plan import memory_plan


def _build(kind):
    return Branchy() if kind == "branchy" else tiny_llama(seed=3, tie=kind == "tied")


def _loss(model, kind, step, micro, dtype):
    if kind == "branchy":
        x = torch.randn(4, 9, generator=torch.Generator().manual_seed(10 * step + micro)).to(dtype)
        return model(x, step % 2 == 0).float()  # b of every block: a gradient in even steps only
    return loss_of(model, "llama", batch("llama", step, micro, 0))


# (model, param_dtype bf16, zero stage, optimizer, GradScaler, zero_grad(set_to_none))
CASES = [
    ("llama", False, 3, "adamw", False, True),
    ("llama", True, 3, "fused", False, True),
    ("llama", False, 2, "fused", True, True),
    ("llama", True, 2, "adamw", False, False),
    ("tied", False, 3, "fused", False, True),
    ("tied", True, 2, "adamw", True, True),
    ("branchy", False, 3, "adamw", False, True),
    ("branchy", True, 2, "fused", False, False),
    ("branchy", False, 2, "fused", False, True),
]


def _train(kind, bf16, zero, optimizer, scaled, set_to_none):
    """Three steps of two micro-batches: losses, the grad shards and clipped norm of each step, the weights."""
    model = yafsdp.YaFSDP(_build(kind), param_dtype=torch.bfloat16 if bf16 else None, zero_stage=zero)
    make = yafsdp.FusedAdamW if optimizer == "fused" else torch.optim.AdamW
    opt = make(model.parameters(), lr=1e-2, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaled else None
    losses, grads, norms, named = [], [], [], []
    for step in range(3):
        for micro in range(2):
            loss = _loss(model, kind, step, micro, torch.bfloat16 if bf16 else torch.float32)
            (scaler.scale(loss) if scaled else loss).backward()
            losses.append(loss.item())
        if scaled:
            scaler.unscale_(opt)
        grads.append(all_grads(model))
        first = next(n for n, p in model.module.named_parameters() if p.requires_grad)
        named.append((model.named_grad_norms(), model.full_grad(first)))
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        scaler.step(opt) if scaled else opt.step()
        if scaled:
            scaler.update()
        opt.zero_grad(set_to_none=set_to_none)
    return dict(losses=losses, grads=grads, norms=norms, named=named, state=model.full_state_dict(),
                store=model._rt.grad.numel(), step_grads=model._rt.buffer_plan.step_grads)


def _poisoned_empty():
    """``torch.empty`` whose floating-point tensors hold NaN: an element the engine leaves unwritten in a fresh
    grad shard (allocated uninitialised) would show in the grads and weights instead of the allocator's zeros."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.is_floating_point():
            with torch.no_grad():
                t.fill_(float("nan"))
        return t

    return empty, poisoned


def _lifetime_vs_store(rank, world):
    from yafsdp.layout import sizing

    out = {}
    for case in CASES:
        runs = []
        for on in (True, False):
            sizing.GRAD_LIFETIME_WORLD1 = on
            empty, poisoned = _poisoned_empty()
            torch.empty = poisoned
            try:
                runs.append(_train(*case))
            finally:
                torch.empty = empty
                sizing.GRAD_LIFETIME_WORLD1 = True
        a, b = runs
        out[case] = dict(
            kinds=(a["step_grads"], a["store"] == 0, b["step_grads"], b["store"] > 0),
            losses=a["losses"] == b["losses"], norms=a["norms"] == b["norms"],
            grads=[torch.equal(x, y) for x, y in zip(a["grads"], b["grads"])],
            named=[na.keys() == nb.keys() and all(torch.equal(na[k], nb[k]) for k in na) and torch.equal(fa, fb)
                   for (na, fa), (nb, fb) in zip(a["named"], b["named"])],
            differ=[k for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])],
            moved=any(not torch.equal(a["state"][k], _build(case[0]).state_dict()[k]) for k in a["state"]))
    return out


def test_world1_grad_lifetime_trains_bit_for_bit_like_the_store():
    """fp32 and bf16, ZeRO-3 and ZeRO-2, two micro-batches per step, a tied head (two folds per backward),
    parameters that get a gradient in some steps only, FusedAdamW and torch AdamW, GradScaler's unscale and
    clip_grad_norm_, named_grad_norms and full_grad, zero_grad both ways: the same losses, grad shards, norms
    and weights bit for bit."""
    for case, r in run_ranks(_lifetime_vs_store, 1)[0].items():
        assert r["kinds"] == (True, True, False, True), (case, r["kinds"])
        assert r["losses"] and r["norms"] and all(r["grads"]) and all(r["named"]) and not r["differ"], (case, r)
        assert r["moved"], case  # the steps changed the weights: the comparison compares something


def _set_to_none(rank, world):
    model = yafsdp.YaFSDP(tiny_llama(seed=1))
    rt = model._rt
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shards = [u.flat_param for u in rt.all if u.flat_param is not None]
    out = dict(store=rt.grad.numel(), before=[p.grad is None for p in shards])
    # During backward: when the gradient reaches the first decoder layer's output, the units after it
    # have their grad shards and the units before it (the embedding, the first layer) have none yet.
    layers = model.module.model.layers
    first, last = rt.units[0].flat_param, rt.units[-1].flat_param
    seen = {}

    def hook(module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        h.register_hook(lambda g: seen.update(first=first.grad is None, last=last.grad is not None))

    handle = layers[0].register_forward_hook(hook)
    loss_of(model, "llama", batch("llama", 0, 0, 0)).backward()
    handle.remove()
    out["during"] = seen
    out["after"] = [p.grad is not None for p in shards]
    refs = [weakref.ref(plain(p.grad)) for p in shards]
    views = [weakref.ref(p.grad) for p in shards]
    opt.step()
    opt.zero_grad(set_to_none=True)
    out["freed"] = [p.grad is None and r() is None and v() is None for p, r, v in zip(shards, refs, views)]
    # set_to_none=False: the same tensors, zeroed, and the next backward accumulates into them
    loss_of(model, "llama", batch("llama", 1, 0, 0)).backward()
    held = [p.grad for p in shards]
    ptrs = [plain(g).data_ptr() for g in held]
    opt.step()
    opt.zero_grad(set_to_none=False)
    out["kept"] = [p.grad is g and not plain(g).any().item() for p, g in zip(shards, held)]
    loss_of(model, "llama", batch("llama", 2, 0, 0)).backward()
    out["same_storage"] = [plain(p.grad).data_ptr() == q for p, q in zip(shards, ptrs)]
    # the plan: the grad shards in the step's peak, not between steps; the allocations agree
    with torch.device("meta"):
        meta = tiny_llama(seed=1)
    plan = memory_plan(meta, world_size=1, batch=2, seq=9, backend="gloo")
    bare = memory_plan(meta, world_size=1, backend="gloo")
    narrow = memory_plan(meta, world_size=1, reduce_dtype=torch.bfloat16, backend="gloo")
    act = plan.activations
    out["plan"] = dict(
        equal=plan.engine_bytes() == model.allocated_bytes() == model.memory_plan().engine_bytes(),
        grad=(plan.engine_bytes()["grad"], plan.grad, bare.step_grads, 4 * sum(p.numel() for p in shards)),
        # the step's peak: the activations' (start of backward) or every grad shard + the last unit's gradients
        total=(plan.total - (plan.engine_total + plan.optimizer_state), max(act.total, plan.grad + act.unit_grad_bytes),
               plan.step_grads, max(0, plan.grad + act.unit_grad_bytes - act.total)),
        device=plan.device_total == plan.total and bare.total == bare.engine_total + bare.optimizer_state + bare.grad,
        narrow=(narrow.engine_bytes()["grad"] == narrow.grad > 0, narrow.step_grads),
        row=[r for r, _ in plan.rows() if r.startswith("grad shard")])
    return out


def test_world1_grad_shards_live_for_a_step():
    """No grad store; a unit's shard appears at its first fold (the units after the first layer have theirs
    while the embedding and the first layer have none); ``zero_grad(set_to_none=True)`` frees every shard
    (nothing else holds it), ``set_to_none=False`` keeps and zeroes the same tensors, which the next backward
    accumulates into. The plan counts the shards in the step's peak (``total``: the larger of the activations
    and every grad shard with the last unit's gradients; without an activation estimate every grad shard) and
    not in ``engine_bytes()`` (equal to ``allocated_bytes()``); a bf16 reduce keeps the store as before."""
    r = run_ranks(_set_to_none, 1)[0]
    assert r["store"] == 0 and all(r["before"]), r
    assert r["during"] == dict(first=True, last=True), r["during"]
    assert all(r["after"]) and all(r["freed"]), r
    assert all(r["kept"]) and all(r["same_storage"]), r
    p = r["plan"]
    assert p["equal"], p
    zero, grad, step, numel = p["grad"]
    assert zero == 0 and grad == step == numel > 0 and p["device"], p
    step, want, extra, want_extra = p["total"]
    assert step == want and extra == want_extra, p
    assert p["narrow"] == (True, 0), p
    assert p["row"] == ["grad shards (fp32; world 1: in backward, freed by zero_grad)"], p
