"""Tensor parallel inside the data-parallel shards (yafsdp/layout/dtensor.py, yafsdp/engine/tp.py).

World 4 as a (dp 2, tp 2) DeviceMesh: torch's own TP (``parallelize_module`` with ColwiseParallel /
RowwiseParallel, SequenceParallel norms, loss parallel) applied to a tiny HF Llama on ``mesh["tp"]``, then
``yafsdp.YaFSDP(model, mesh=mesh["dp"])``. Each case trains 3 AdamW steps with the engine's
``clip_grad_norm_`` against two independent references on every rank: the same TP model without the
engine (its DTensor gradients averaged over dp by all-reduce, the global norm from the full gradients), and
one process training the unsharded model on the global batch. Losses, gradient norms and the full state dict
(gathered over dp and TP) agree as tightly as the other fp32 parity tests. The world is spawned once and runs
every case, then the refusals. World 8: HSDP x TP, replicate 2 x shard 2 x tp 2, one case the same way, and its
HF export (replica 0 writes) loaded back with every replica reading its slices.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import yafsdp
import yafsdp.checkpoint
import yafsdp.hf
from yafsdp.integrations.tp_plans import llama_tp_plan, parallelize_llama
from yafsdp.plan import memory_plan
from dist_utils import run_ranks
from models import tiny_llama
from parity import LR, MAX_NORM, rel_l2, rel_seq
from yafsdp.engine.shard_grad import plain

STEPS = 3
SEQ = 10  # sequence parallelism splits the sequence over TP: a multiple of the TP degree
VOCAB = 67  # uneven over TP: the head's and the embedding's rows split 34 / 33

# name -> sequence parallel, zero stage, backward calls per step; lp: loss parallel (the head's logits stay split
# over the vocabulary, torch's loss_parallel() computes the cross-entropy); ckpt: HF's activation checkpointing (the
# engine's run only: the references compute the same values without it); reload: the full state dict's round trip
CASES = {
    "sp_z3": dict(sp=True, zero=3, accum=1, reload=True),
    "sp_lp_z2_accum2": dict(sp=True, lp=True, zero=2, accum=2),
    "tp_ckpt_z3_accum2": dict(sp=False, ckpt=True, zero=3, accum=2),
    # a head tied to the embedding (Llama-3.2-1B's): parallelize_module unties them, parallelize_llama ties them again
    "tied_sp_z3": dict(sp=True, zero=3, accum=1, tie=True, prefetch=2),  # and gathers two units ahead
}


def tp_plan(model, tp_mesh, sp: bool, loss_parallel: bool = False):
    """torch's TP on an HF Llama with yafsdp's plan for it (yafsdp/integrations/tp_plans.py; a tied head tied again)."""
    return parallelize_llama(model, tp_mesh, sequence_parallel=sp, loss_parallel=loss_parallel)


def _batch(step: int, micro: int, dp_rank: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dp_rank)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def _opt(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def _train(model, opt, case, dp_rank, dp_group, clip, grads_done=lambda: None):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(case["accum"]):
            with loss_parallel() if case.get("lp") else contextlib.nullcontext():
                loss = model(**_batch(step, micro, dp_rank)).loss
                (loss / case["accum"]).backward()
            total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).item() / case["accum"]
        grads_done()
        t = torch.tensor(total)
        dist.all_reduce(t, group=dp_group)
        losses.append(t.item() / dist.get_world_size(dp_group))
        norms.append(float(clip()))
        opt.step()
        opt.zero_grad()
    return losses, norms


def _tp_reference(case, mesh):
    """The same TP model without the engine: grads averaged over dp by all-reduce, torch's clip."""
    from torch.distributed.tensor import DTensor

    model = tp_plan(tiny_llama(vocab=VOCAB, tie=case.get("tie", False)), mesh["tp"], case["sp"], case.get("lp", False))
    dp = mesh["dp"].get_group()
    opt = _opt(model.parameters())

    def average():
        for p in model.parameters():
            local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(local, group=dp)
            local.div_(dist.get_world_size(dp))

    def clip():  # the global norm from the full gradients (a DTensor's gathered over TP)
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
        total = torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
        coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)
        for p in model.parameters():
            p.grad.mul_(coef)
        return total

    losses, norms = _train(model, opt, case, mesh["dp"].get_local_rank(), dp, clip, average)
    sd = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}
    return losses, norms, sd


def _unsharded(case, dp: int):
    """One process, the global batch (every dp rank's), the plain model."""
    model = tiny_llama(vocab=VOCAB, tie=case.get("tie", False))
    opt = _opt(model.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(case["accum"]):
            parts = [_batch(step, micro, r) for r in range(dp)]
            loss = model(**{k: torch.cat([p[k] for p in parts]) for k in parts[0]}).loss
            (loss / case["accum"]).backward()
            total += loss.item() / case["accum"]
        losses.append(total)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sharded(case, tp_mesh, wrap_mesh, dp_mesh):
    """TP on ``tp_mesh``, the engine on ``wrap_mesh`` (mesh["dp"], or HSDP's mesh["replicate", "shard"]);
    ``dp_mesh``: the data-parallel ranks as one dim (the batches and the loss's average)."""
    model = tp_plan(tiny_llama(vocab=VOCAB, checkpointing=case.get("ckpt", False), tie=case.get("tie", False)),
                    tp_mesh, case["sp"], case.get("lp", False))
    model = yafsdp.YaFSDP(model, mesh=wrap_mesh, zero_stage=case["zero"], prefetch=case.get("prefetch", 1))
    assert (model.tp_size, model.replicas * model.world_size) == (2, dp_mesh.size())
    opt = _opt(model.parameters())
    dp_rank = dp_mesh.get_local_rank()
    assert dp_rank == model.replica * model.world_size + model.rank
    losses, norms = _train(model, opt, case, dp_rank, dp_mesh.get_group(), lambda: model.clip_grad_norm_(MAX_NORM))
    assert model.memory_plan().engine_bytes() == model.allocated_bytes()  # the plan of the local layouts
    # the plan of the plain model with the TP degree: the same bytes, before any TP or wrap ([Note: the plan of a TP
    # model] in yafsdp/plan/build.py); this rank's TP coordinate (the uneven vocabulary's rows differ by it)
    before = memory_plan(tiny_llama(vocab=VOCAB, tie=case.get("tie", False)), world_size=model.world_size, rank=model.rank, tp=model.tp_size,
                         tp_rank=model.tp_rank, replicas=model.replicas, zero_stage=case["zero"],
                         prefetch=case.get("prefetch", 1))
    assert before.engine_bytes() == model.allocated_bytes(), (before.engine_bytes(), model.allocated_bytes())
    assert before.shard_numel == model.memory_plan().shard_numel
    sd = model.full_state_dict()
    assert (sd != {}) == (dist.get_rank() == 0) == model.coordinator, "only global rank 0 gets the full state dict"
    if case.get("reload"):
        streamed = {}
        for piece in model.iter_full_state_dict():  # one unit at a time, gathered over dp and TP
            assert piece == {} or dist.get_rank() == 0
            streamed.update(piece)
        assert streamed.keys() == sd.keys() and all(torch.equal(streamed[k], sd[k]) for k in sd)
        _reload(model, sd, case, tp_mesh, wrap_mesh, dp_rank)
    return losses, norms, sd


def _reload(model, sd, case, tp_mesh, wrap_mesh, dp_rank):
    """Global rank 0's full state dict loaded into the same model built on the meta device, TP applied, wrapped:
    the same full state dict back bit for bit, and the same loss; a wrong shape refused on every rank."""
    fresh = _meta_built(case, tp_mesh, wrap_mesh)
    if dist.get_rank() == 0:
        bad = dict(sd, **{"lm_head.weight": sd["lm_head.weight"][:-1]})
    msg = _refused(lambda: fresh.load_full_state_dict(bad if dist.get_rank() == 0 else None))
    assert "'lm_head.weight' has shape (66, 32), expected (67, 32)" in msg, msg
    fresh.load_full_state_dict(sd if dist.get_rank() == 0 else None)
    back = fresh.full_state_dict()
    if dist.get_rank() == 0:
        assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    inputs = _batch(STEPS, 0, dp_rank)
    with torch.no_grad():
        assert fresh(**inputs).loss.item() == model(**inputs).loss.item()
    if case.get("hf"):  # the HF export (HSDP: replica 0 writes) and the streaming load (every replica reads)
        assert (yafsdp.hf.export_hf(model, case["hf"]) is not None) == (dist.get_rank() == 0)
        again = _meta_built(case, tp_mesh, wrap_mesh)
        yafsdp.hf.load_hf_weights(again, case["hf"])
        back = again.full_state_dict()
        if dist.get_rank() == 0:
            assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
        with torch.no_grad():  # on every rank: each replica's shards hold the loaded values
            assert again(**inputs).loss.item() == model(**inputs).loss.item()


def _meta_built(case, tp_mesh, wrap_mesh):
    """The tiny Llama built on the meta device, TP applied, wrapped: its shards wait for a load."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device("meta"):
        fresh = tiny_llama(vocab=VOCAB)
    fresh.model.rotary_emb = LlamaRotaryEmbedding(fresh.config)  # real buffers (not in the state dict)
    fresh = tp_plan(fresh, tp_mesh, case["sp"])
    fresh = yafsdp.YaFSDP(fresh, mesh=wrap_mesh, zero_stage=case["zero"])
    assert fresh.needs_load
    return fresh


def _compare(got, want, what):
    (gl, gn, gsd), (wl, wn, wsd) = got, want
    assert rel_seq(gl, wl) < 1e-5, (what, "losses", gl, wl)
    assert rel_seq(gn, wn) < 1e-5, (what, "grad norms", gn, wn)
    assert gsd.keys() == wsd.keys(), (what, sorted(set(gsd) ^ set(wsd)))
    for k in wsd:
        assert gsd[k].shape == wsd[k].shape and gsd[k].dtype == wsd[k].dtype, (what, k, gsd[k].shape, wsd[k].shape)
    assert rel_l2(gsd, wsd) < 1e-4, (what, "weights", rel_l2(gsd, wsd))


def _refused(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return str(e)
    raise AssertionError(f"not refused: {fn}")


def _refusals(mesh, tmp):
    """What a TP engine refuses, by name: the message of each refusal; the module unchanged after one."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    def tp_model(**kw):
        return tp_plan(tiny_llama(vocab=VOCAB, **kw), mesh["tp"], sp=True)

    out = {}
    model = tp_model()
    for name, value in (("quantize_frozen", "nf4"), ("offload", "optimizer"), ("gather_dtype", "fp8"),
                        ("secondary_shard", 2), ("grad_quant", "int8")):
        out[name] = _refused(lambda: yafsdp.YaFSDP(model, mesh=mesh["dp"], **{name: value}))
    untied = parallelize_module(tiny_llama(vocab=VOCAB, tie=True), mesh["tp"], llama_tp_plan(model))  # not tied again
    out["untied"] = _refused(lambda: yafsdp.YaFSDP(untied, mesh=mesh["dp"]))
    out["world group"] = _refused(lambda: yafsdp.YaFSDP(model))  # the TP ranks inside the shard group
    out["bad units"] = _refused(lambda: yafsdp.YaFSDP(model, mesh=mesh["dp"], units=[model.model.layers[0]]))
    assert all(isinstance(p, DTensor) for p in model.model.layers[0].parameters()), "a refused wrap changed the model"
    out["memory_plan"] = _refused(lambda: memory_plan(tp_model(), world_size=2))
    wrapped = yafsdp.YaFSDP(model, mesh=mesh["dp"])
    out["compile_units"] = _refused(wrapped.compile_units)
    # the activations traced on the TP mesh (gloo; meta tensors: nothing communicated), against the unsplit model's
    whole = memory_plan(tiny_llama(vocab=VOCAB), world_size=2, batch=2, seq=SEQ).activations.trace.per_block
    out["plan activations"] = (wrapped.memory_plan(batch=2, seq=SEQ).activations.trace.per_block, whole)
    out["save_adapter"] = _refused(lambda: wrapped.check_idle("save_adapter"))  # still refused with TP
    # GradScaler: an overflow on one TP rank only (rank 3: dp 1, tp 1) is seen by every rank, which all skip the step
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    scaler.scale(wrapped(**_batch(0, 0, mesh["dp"].get_local_rank())).loss).backward()
    out["torch clip"] = _refused(lambda: torch.nn.utils.clip_grad_norm_(wrapped.parameters(), MAX_NORM))
    opt = _opt(wrapped.parameters())
    if dist.get_rank() == 3:
        plain(next(wrapped.parameters()).grad)[0] = float("inf")
    scaler.unscale_(opt)
    out["found_inf"] = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
    return out


def _world(rank, world, tmp):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for name, case in CASES.items():
        _case(out, name, case, mesh, _sharded(case, mesh["tp"], mesh["dp"], mesh["dp"]))
    out["refused"] = _refusals(mesh, tmp)
    return out


def _case(out, name, case, mesh, got):
    """``got`` (losses, norms, full state dict) against TP alone on ``mesh`` (dims "dp", "tp") and the unsharded
    model on the global batch."""
    ref = _tp_reference(case, mesh)
    if dist.get_rank() == 0:
        plain = _unsharded(case, mesh["dp"].size())
        _compare(got, ref, f"{name} against TP alone")
        _compare(got, plain, f"{name} against the unsharded model")
        _compare(ref, plain, f"{name}: TP alone against the unsharded model")  # the references agree
        out[name] = (got[0], got[1])


def _world8(rank, world, tmp):
    """HSDP x TP: replicate 2 x shard 2 x TP 2 (a 3-D mesh; the engine on mesh["replicate", "shard"])."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh3 = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))  # the same ranks, data parallel as one dim
    out = {}
    case = dict(sp=True, ckpt=True, zero=3, accum=2, reload=True, hf=f"{tmp}/hf")
    _case(out, "hsdp_sp_ckpt_z3_accum2", case, mesh, _sharded(case, mesh3["tp"], mesh3["replicate", "shard"], mesh["dp"]))
    return out


def test_tp_dp_parity(tmp_path):
    res = run_ranks(_world, 4, str(tmp_path))
    assert set(res[0]) == set(CASES) | {"refused"}
    refused = res[0]["refused"]
    for option in ("quantize_frozen", "offload", "gather_dtype", "secondary_shard", "grad_quant"):
        assert option in refused[option] and "tensor-parallel" in refused[option], refused[option]
    assert "mesh=mesh['dp']" in refused["world group"] and "share ranks" in refused["world group"]
    assert "no parameters" in refused["bad units"] or "in no unit" in refused["bad units"], refused["bad units"]
    assert "compile_units" in refused["compile_units"] and "tensor-parallel" in refused["compile_units"]
    assert "model.memory_plan()" in refused["memory_plan"] and "tensor-parallel" in refused["memory_plan"]
    split, whole = refused["plan activations"]
    assert len(split) == len(whole) and all(w / 2 < s < w for s, w in zip(split, whole)), (split, whole)
    assert "model.clip_grad_norm_" in refused["torch clip"] and "tensor-parallel" in refused["torch clip"]
    assert [r["refused"]["found_inf"] for r in res] == [1.0] * 4, "an overflow on one TP rank skips every rank's step"
    assert "ties 'lm_head.weight' to 'model.embed_tokens.weight'" in refused["untied"] \
        and "parallelize_llama" in refused["untied"], refused["untied"]
    assert "save_adapter" in refused["save_adapter"] and "tensor-parallel" in refused["save_adapter"], refused["save_adapter"]


def test_hsdp_tp_parity(tmp_path):
    res = run_ranks(_world8, 8, str(tmp_path))
    assert set(res[0]) == {"hsdp_sp_ckpt_z3_accum2"}
