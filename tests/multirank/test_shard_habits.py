"""PyTorch habits that act on the wrapped model's parameters and gradients (the flat shards of
``model.parameters()``), each against the unsharded model trained the same way:

- fp16 with torch.amp.GradScaler: every rank skips the same steps, the scale history is the
  unsharded run's (flat, HSDP, offload, accumulation; world 2 and 3);
- torch.nn.utils.clip_grad_norm_ / get_total_norm / clip_grads_with_norm_ / clip_grad_value_ on
  model.parameters() clip by the model's norm (flat, HSDP, offload);
- optimizer state: another rank's opt.state_dict() is refused; the full optimizer state dict saved
  at world 2 resumes at world 1 and 3 exactly as the uninterrupted run;
- copy.deepcopy refused by name; the supported EMA (a second wrap, lerped shards) and ShardEMA
  equal the unsharded EMA;
- model.no_sync() gives DDP's accumulation;
- hooks on the shards: register_hook / register_post_accumulate_grad_hook fire with the final
  gradient; an optimizer stepped in the hook equals stepping after backward.

Two spawns: world 2 (most cases) and world 3 (with a world-1 group on rank 0).
"""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist

import yafsdp
from dist_utils import hsdp_groups, run_ranks
from models import Stack, batch, loss_of, tiny_llama

FP16_STEPS = 5
CLIP_STEPS = 4
LR = 1e-2
GLOBAL = 6  # samples per step, split evenly over 1, 2 or 3 ranks


# ------------------------------------------------------------------------------------------- helpers


def _global_batch(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(500 + 17 * step + micro)
    return torch.randn(GLOBAL, 7, generator=g), torch.randn(GLOBAL, 5, generator=g)


def _part(step: int, rank: int, world: int, micro: int = 0):
    x, y = _global_batch(step, micro)
    n = GLOBAL // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _rel(a: dict, b: dict) -> float:
    num = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in b)
    den = sum(float(b[k].float().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def _sd(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- (A) fp16 + GradScaler
def _fp16_run(model, rank: int, world: int, accum: int) -> dict:
    """Train tiny Llama in fp16 with torch's GradScaler (unchanged); clip with torch's function
    after unscale_. Returns the scale after every update, the norms and the final weights."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=1)
    scales, norms = [], []
    for step in range(FP16_STEPS):
        for micro in range(accum):
            loss = loss_of(model, "llama", batch("llama", step, micro, rank))
            scaler.scale(loss / accum).backward()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        opt.zero_grad()
    return dict(scales=scales, norms=norms, sd=model.full_state_dict())


def fp16_reference(world: int, accum: int) -> dict:
    """DDP in one process: per rank and micro-step an fp16 copy of the fp32 weights computes its
    gradients; their fp32 average is the gradient; torch's GradScaler on the fp32 optimizer."""
    master = tiny_llama()
    opt = torch.optim.AdamW(master.parameters(), lr=LR, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=1)
    scales, norms = [], []
    for step in range(FP16_STEPS):
        low = copy.deepcopy(master)
        for q in low.parameters():
            q.data = q.data.half()
        acc = [torch.zeros_like(p) for p in master.parameters()]
        for micro in range(accum):
            total = [torch.zeros_like(p) for p in master.parameters()]
            for r in range(world):
                low.zero_grad()
                loss = loss_of(low, "llama", batch("llama", step, micro, r))
                scaler.scale(loss / accum).backward()
                for t, q in zip(total, low.parameters()):
                    t += q.grad.float()
            for a, t in zip(acc, total):
                a += t / world
        for p, a in zip(master.parameters(), acc):
            p.grad = a
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)))
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        opt.zero_grad()
    return dict(scales=scales, norms=norms, sd=_sd(master))


def _fp16_cases(rank: int, world: int) -> dict:
    out = {}
    cases = {"flat_accum2": dict(accum=2)}
    if world == 2:
        cases.update(offload=dict(accum=1, offload="optimizer"), hsdp=dict(accum=1, hsdp=True))
    for name, c in cases.items():
        kw = dict(param_dtype=torch.float16, offload=c.get("offload"))
        if c.get("hsdp"):
            kw["process_group"] = hsdp_groups(2, 1)
        model = yafsdp.YaFSDP(tiny_llama(), **kw)
        out[name] = _fp16_run(model, rank, world, c["accum"])
        out[name]["accum"] = c["accum"]
    return out


def _check_fp16(results: list, world: int) -> None:
    refs = {}
    for name, got in results[0].items():
        accum = got["accum"]
        ref = refs.setdefault(accum, fp16_reference(world, accum))
        for r in results[1:]:  # every rank: the same skips and scales
            assert r[name]["scales"] == got["scales"], (name, r[name]["scales"], got["scales"])
        assert got["scales"] == ref["scales"], (name, got["scales"], ref["scales"])
        assert any(not math.isfinite(n) for n in ref["norms"]), "no overflow happened: the case tests nothing"
        for a, b in zip(got["norms"], ref["norms"]):
            assert math.isfinite(a) == math.isfinite(b), (name, got["norms"], ref["norms"])
            if math.isfinite(b):
                assert abs(a - b) <= 2e-3 * b, (name, got["norms"], ref["norms"])
        assert _rel(got["sd"], ref["sd"]) < 2e-3, (name, _rel(got["sd"], ref["sd"]))


# ----------------------------------------------------------------------------------------- (B) clipping
def _clip_step(params, step: int):
    """One of torch's clipping habits per step; returns the norm it computed (or None)."""
    if step == 0:
        return float(torch.nn.utils.clip_grad_norm_(params(), 0.05))
    if step == 1:
        grads = [p.grad for p in params() if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        torch.nn.utils.clip_grads_with_norm_(params(), 0.05, total)
        return float(total)
    if step == 2:
        return float(torch.nn.utils.clip_grad_norm_(params(), 0.05, norm_type=math.inf, foreach=True))
    torch.nn.utils.clip_grad_value_(params(), 0.002)
    return None


def _clip_run(model, rank: int, world: int, sharded: bool = True):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    norms = []
    for step in range(CLIP_STEPS):
        x, y = _part(step, rank, world) if sharded else _global_batch(step)
        model(x, y).backward()
        norms.append(_clip_step(model.parameters, step))
        opt.step()
        opt.zero_grad()
    return norms


def clip_reference():
    model = Stack()
    return _clip_run(model, 0, 1, sharded=False), _sd(model)


def _clip_cases(rank: int, world: int) -> dict:
    out = {}
    for name, kw in (("flat", {}), ("offload", dict(offload="optimizer")),
                     ("hsdp", dict(process_group=hsdp_groups(2, 1)))):
        model = yafsdp.YaFSDP(Stack(), **kw)
        norms = _clip_run(model, rank, world)
        out[name] = (norms, model.full_state_dict())
    return out


def _grad_reads(rank: int, world: int) -> dict:
    """Other reads of a shard's .grad: a full norm is the unit's unsharded norm (collective), a norm
    over dims is refused by name, a saved .grad is a plain tensor."""
    import io

    model = yafsdp.YaFSDP(Stack())
    model(*_part(0, rank, world)).backward()
    g = next(iter(model.parameters())).grad  # unit "inp": inp.weight (its bias is in the small group)
    out = dict(norm=float(g.norm()), linalg=float(torch.linalg.norm(g, ord=math.inf)))
    try:
        g.norm(dim=0)
    except RuntimeError as e:
        out["dim"] = str(e)
    buf = io.BytesIO()
    torch.save(g, buf)
    buf.seek(0)
    out["saved"] = type(torch.load(buf)).__name__
    return out


# ---------------------------------------------------------------------------- (C) optimizer state
def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def _resume_train(model, opt, rank, world, steps):
    for step in steps:
        x, y = _part(step, rank, world)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()


def resume_reference():
    model = Stack()
    opt = _adamw(model.parameters())
    for step in range(4):
        x, y = _global_batch(step)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return _sd(model)


def _optim_state_cases(rank: int, world: int, root: str) -> dict:
    from yafsdp.comm.groups import gather_object

    out = {}
    # another rank's opt.state_dict() (the DDP habit: rank 0 saves, every rank loads): refused by name
    model = yafsdp.YaFSDP(Stack())
    opt = _adamw(model.parameters())
    _resume_train(model, opt, rank, world, [0])
    own = opt.state_dict()
    other = gather_object(own)[(rank + 1) % world]
    try:
        opt.load_state_dict(other)
        out["hooked"] = "loaded"
    except RuntimeError as e:
        out["hooked"] = str(e)
    opt.load_state_dict(own)  # each rank its own: accepted
    out["own"] = "loaded"
    fresh = _adamw(model.parameters())  # never stepped: no hooks yet; its next step checks
    fresh.load_state_dict(other)
    model(*_part(1, rank, world)).backward()
    try:
        fresh.step()
        out["fresh"] = "stepped"
    except RuntimeError as e:
        out["fresh"] = str(e)

    # the full optimizer state dict: saved here after 2 steps, resumed at world 1, 2 (here) and 3
    model = yafsdp.YaFSDP(Stack())
    opt = _adamw(model.parameters())
    _resume_train(model, opt, rank, world, [0, 1])
    full = model.full_optim_state_dict(opt)
    weights = model.full_state_dict()
    if rank == 0:
        torch.save(dict(model=weights, optim=full), os.path.join(root, "resume.pt"))
        out["full_keys"] = sorted(full["state"])[:3]
        out["full_shape"] = {k: tuple(v.shape) for k, v in full["state"]["blocks.0.fc1.weight"].items()}
    dist.barrier()
    out["resumed"] = _resume_at(rank, world, root)
    out["resumed_hsdp"] = _resume_at(rank, world, root, hsdp_groups(2, 1))  # 2 replicas of 1 shard
    return out


def _resume_at(rank: int, world: int, root: str, group=None):
    """Load what world 2 saved after 2 steps (other initial weights first), train steps 2 and 3."""
    model = yafsdp.YaFSDP(Stack(seed=7), process_group=group)  # other weights: the load must replace them all
    opt = _adamw(model.parameters())
    saved = torch.load(os.path.join(root, "resume.pt")) if model.rank == 0 else None
    model.load_full_state_dict(saved["model"] if saved else None)
    model.load_full_optim_state_dict(opt, saved["optim"] if saved else None)
    _resume_train(model, opt, model.rank, model.world_size, [2, 3])
    return model.full_state_dict()


# -------------------------------------------------------------------------------- (D) deepcopy / EMA
DECAY = 0.7


def _ema_cases(rank: int, world: int) -> dict:
    from yafsdp.ema import ShardEMA

    out = {}
    base = Stack()
    ema_model = yafsdp.YaFSDP(copy.deepcopy(base))  # the supported way: a second wrap
    model = yafsdp.YaFSDP(base)
    errors = []
    for what in (lambda: model, lambda: model.module):
        try:
            copy.deepcopy(what())
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    shard_ema = ShardEMA(model)
    opt = _adamw(model.parameters())
    for step in range(3):
        model(*_part(step, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for e, p in zip(ema_model.parameters(), model.parameters()):
                e.lerp_(p, 1 - DECAY)
        shard_ema.update(DECAY)
    try:  # after a forward too
        copy.deepcopy(model)
        errors.append(None)
    except RuntimeError as e:
        errors.append(str(e))
    out["errors"] = errors
    out["second_wrap"] = ema_model.full_state_dict()
    with shard_ema.swapped():
        out["shard_ema"] = model.full_state_dict()
        out["ema_loss"] = float(model(*_part(0, rank, world)))
    out["trained"] = model.full_state_dict()
    return out


def ema_reference():
    model = Stack()
    ema = _sd(model)
    opt = _adamw(model.parameters())
    for step in range(3):
        model(*_global_batch(step)).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for k, v in model.state_dict().items():
                ema[k].lerp_(v, 1 - DECAY)
    return ema, _sd(model)


# ------------------------------------------------------------------------------------- (E) no_sync
def _no_sync_case(rank: int, world: int):
    model = yafsdp.YaFSDP(Stack())
    opt = _adamw(model.parameters())
    for step in range(2):
        for micro in range(3):
            x, y = _part(step, rank, world, micro)
            if micro < 2:
                with model.no_sync():
                    (model(x, y) / 3).backward()
            else:
                (model(x, y) / 3).backward()
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


def no_sync_reference():
    model = Stack()
    opt = _adamw(model.parameters())
    for step in range(2):
        for micro in range(3):
            x, y = _global_batch(step, micro)
            (model(x, y) / 3).backward()
        opt.step()
        opt.zero_grad()
    return _sd(model)


# -------------------------------------------------------------------------------- (F) shard hooks
def _hook_cases(rank: int, world: int) -> dict:
    base = Stack()
    stepped = yafsdp.YaFSDP(copy.deepcopy(base))
    in_backward = yafsdp.YaFSDP(base)
    opt = _adamw(stepped.parameters())
    per = {p: _adamw([p]) for p in in_backward.parameters()}

    def step_in_hook(p):
        per[p].step()
        per[p].zero_grad()

    for p in in_backward.parameters():
        p.register_post_accumulate_grad_hook(step_in_hook)
    seen = {}
    grads_ok = True
    for i, p in enumerate(stepped.parameters()):
        p.register_hook(lambda g, i=i: seen.__setitem__(i, g.detach().clone()))
    for step in range(3):
        x, y = _part(step, rank, world)
        stepped(x, y).backward()
        grads_ok = grads_ok and len(seen) == len(list(stepped.parameters())) and all(
            torch.equal(seen[i], p.grad) for i, p in enumerate(stepped.parameters()))
        seen.clear()
        opt.step()
        opt.zero_grad()
        in_backward(x, y).backward()
        assert all(p.grad is None for p in in_backward.parameters())  # the hooks stepped and zeroed
    return dict(grads_ok=grads_ok, a=stepped.full_state_dict(), b=in_backward.full_state_dict())


# ----------------------------------------------------------------------------------------- spawns
def _world2(rank, world, root):
    return dict(fp16=_fp16_cases(rank, world), clip=_clip_cases(rank, world), reads=_grad_reads(rank, world),
                optim=_optim_state_cases(rank, world, root), ema=_ema_cases(rank, world),
                no_sync=_no_sync_case(rank, world), hooks=_hook_cases(rank, world))


def _world3(rank, world, root):
    out = dict(fp16=_fp16_cases(rank, world), resumed=_resume_at(rank, world, root))
    alone = dist.new_group([0])  # world 1: rank 0 on its own
    out["resumed_1"] = _resume_at(rank, 1, root, alone) if rank == 0 else None
    return out


@pytest.fixture(autouse=True)
def _one_thread():
    """The unsharded references run in this process: one thread, as each rank does (several
    threads on a busy machine make the tiny ops many times slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("habits"))
    return {2: run_ranks(_world2, 2, root, timeout_s=60), 3: run_ranks(_world3, 3, root, timeout_s=60)}


def test_fp16_grad_scaler_agrees_world2(worlds):
    _check_fp16([r["fp16"] for r in worlds[2]], 2)


def test_fp16_grad_scaler_agrees_world3(worlds):
    _check_fp16([r["fp16"] for r in worlds[3]], 3)


def test_torch_clip_functions_use_the_model_norm(worlds):
    ref_norms, ref_sd = clip_reference()
    assert ref_norms[0] > 0.05 and ref_norms[1] > 0.05  # the clips do clip
    for name, (norms, sd) in worlds[2][0]["clip"].items():
        assert worlds[2][1]["clip"][name][0] == norms, name  # the same value on every rank
        for a, b in zip(norms, ref_norms):
            assert (a is None) == (b is None) and (a is None or abs(a - b) <= 1e-5 * b), (name, norms, ref_norms)
        assert _rel(sd, ref_sd) < 1e-5, (name, _rel(sd, ref_sd))


def test_other_reads_of_shard_grads(worlds):
    ref = Stack()
    ref(*_global_batch(0)).backward()
    w = ref.inp.weight.grad
    for r in worlds[2]:
        got = r["reads"]
        assert abs(got["norm"] - float(w.norm())) <= 1e-6 * float(w.norm()), (got, float(w.norm()))
        assert got["linalg"] == float(w.abs().max()), got
        assert "model.clip_grad_norm_" in got["dim"], got
        assert got["saved"] == "Tensor"


def test_optimizer_state_of_another_rank_is_refused(worlds):
    for rank, r in enumerate(worlds[2]):
        got = r["optim"]
        assert got["own"] == "loaded"
        for what in ("hooked", "fresh"):  # loaded into an optimizer that stepped / a fresh one
            msg = got[what]
            want = f"saved for rank {1 - rank} of a 2-rank shard group and is loaded on rank {rank} of 2"
            assert want in msg, msg
            assert "full_optim_state_dict" in msg and "load_full_optim_state_dict" in msg, msg


def test_full_optimizer_state_dict_resumes_at_any_world(worlds):
    ref = resume_reference()
    r0 = worlds[2][0]["optim"]
    assert r0["full_keys"] == ["blocks.0.fc1.bias", "blocks.0.fc1.weight", "blocks.0.fc2.bias"]
    assert r0["full_shape"] == {"exp_avg": (37, 17), "exp_avg_sq": (37, 17), "step": ()}
    for world, got in ((2, r0["resumed"]), ("hsdp 2x1", r0["resumed_hsdp"]), (1, worlds[3][0]["resumed_1"]), (3, worlds[3][0]["resumed"])):
        assert _rel(got, ref) < 1e-6, (world, _rel(got, ref))


def test_deepcopy_refused_and_ema_of_shards_is_exact(worlds):
    ema_ref, trained_ref = ema_reference()
    got = worlds[2][0]["ema"]
    for msg in got["errors"]:
        assert msg is not None and "yafsdp.YaFSDP(copy.deepcopy(base)" in msg and "ShardEMA" in msg, msg
    assert _rel(got["second_wrap"], ema_ref) < 1e-6, _rel(got["second_wrap"], ema_ref)
    assert _rel(got["shard_ema"], ema_ref) < 1e-6, _rel(got["shard_ema"], ema_ref)
    assert _rel(got["trained"], trained_ref) < 1e-6  # swapped back
    x, y = _global_batch(0)
    ema_model = Stack()
    ema_model.load_state_dict(ema_ref)
    assert abs(got["ema_loss"] - float(ema_model(x[:3], y[:3]).detach())) < 1e-5


def test_no_sync_accumulates_as_ddp(worlds):
    ref = no_sync_reference()
    assert _rel(worlds[2][0]["no_sync"], ref) < 1e-6


def test_hooks_on_shards_and_optimizer_in_backward(worlds):
    for r in worlds[2]:
        assert r["hooks"]["grads_ok"]
    got = worlds[2][0]["hooks"]
    for k in got["a"]:
        assert torch.equal(got["a"][k], got["b"][k]), k
