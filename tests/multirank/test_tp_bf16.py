"""bf16 with tensor parallel: the engine against the same TP model rounded the same way without it.

World 4 as a (dp 2, tp 2) DeviceMesh, sequence parallelism, a tiny HF Llama (tests/multirank/test_tp.py's).
The engine runs ``param_dtype=torch.bfloat16`` with each gradient reduction it offers (``reduce_dtype`` fp32;
bf16; bf16 with ``reduce_accum_dtype=torch.float32``). The reference applies the same rounding without the
engine, as the grid's per-rank reference does (docs/design.md, "The combination grid"): fp32 DTensor masters
and torch AdamW; before each step a bf16 compute copy of the same TP model (its local tensors rounded from the
masters'); per backward call, each bf16 DTensor gradient brought to its parameter's placements (a ``Partial``
one summed over TP in bf16, what ``DTensor.from_local``'s backward does inside the engine), summed over dp
in the reduce dtype, and folded into the fp32 gradient as ``grad (+)= sum * (1 / dp)``. Held to the bf16
same-rounding tolerances of the grid (losses and clipped norms 1e-5, weights 1e-4 relative); the first step's
loss is equal bit for bit (the same bf16 weights, the same computation). ``reduce_accum_dtype=torch.float32``
over two data-parallel ranks sums two bf16 values in fp32, exactly what the fp32 reduce does with them: the
two runs are equal bit for bit.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import yafsdp
from dist_utils import run_ranks
from models import tiny_llama
from parity import MAX_NORM
from test_tp import STEPS, VOCAB, _batch, _compare, _opt, _train, tp_plan

BF16 = torch.bfloat16

# name -> sequence parallel, loss parallel, zero stage, backward calls per step, the engine's reduce options
# (reduce_dtype; sum_fp32: reduce_accum_dtype=torch.float32), max_norm (None: MAX_NORM; a bound the norm never reaches
# leaves the gradients as they are, so nothing but the norm's own summation order differs from the reference)
CASES = {
    "sp_z3_accum2_reduce_fp32": dict(sp=True, zero=3, accum=2, reduce=torch.float32),
    "sp_z3_accum2_reduce_bf16_sum_fp32": dict(sp=True, zero=3, accum=2, reduce=BF16, sum_fp32=True),
    "sp_lp_z2_accum2_reduce_bf16_unclipped": dict(sp=True, lp=True, zero=2, accum=2, reduce=BF16, max_norm=1e9),
}


def _engine(case, mesh):
    model = tp_plan(tiny_llama(vocab=VOCAB), mesh["tp"], case["sp"], case.get("lp", False))
    model = yafsdp.YaFSDP(model, mesh=mesh["dp"], zero_stage=case["zero"], param_dtype=BF16,
                          reduce_dtype=case["reduce"],
                          reduce_accum_dtype=torch.float32 if case.get("sum_fp32") else None)
    opt = _opt(model.parameters())
    losses, norms = _train(model, opt, case, mesh["dp"].get_local_rank(), mesh["dp"].get_group(),
                           lambda: model.clip_grad_norm_(case.get("max_norm", MAX_NORM)))
    return losses, norms, model.full_state_dict()


def _local(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _reference(case, mesh):
    """The same TP model without the engine, rounded as the engine rounds (see the module's docstring)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    master = tp_plan(tiny_llama(vocab=VOCAB), mesh["tp"], case["sp"], case.get("lp", False))
    plain = tiny_llama(vocab=VOCAB)
    for p in plain.parameters():  # the compute copy: parameters in bf16, buffers (RoPE's) as they are
        p.data = p.data.to(BF16)
    low = tp_plan(plain, mesh["tp"], case["sp"], case.get("lp", False))
    pairs = list(zip(master.parameters(), low.parameters()))
    assert all(type(p) is type(q) and p.shape == q.shape for p, q in pairs)
    dp, dp_rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    scale = 1.0 / dist.get_world_size(dp)
    narrow = case["reduce"] == BF16 and not case.get("sum_fp32")  # summed over dp in bf16
    opt = _opt(master.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        with torch.no_grad():
            for p, q in pairs:  # the compute copy, rounded from the masters as the engine's is
                _local(q).copy_(_local(p))
        grads: dict[int, torch.Tensor] = {}  # id(master) -> its local fp32 gradient
        total = 0.0
        for micro in range(case["accum"]):
            with loss_parallel() if case.get("lp") else contextlib.nullcontext():
                loss = low(**_batch(step, micro, dp_rank)).loss
                (loss / case["accum"]).backward()
            total += (loss.full_tensor() if isinstance(loss, DTensor) else loss).item() / case["accum"]
            for p, q in pairs:  # per backward call: the engine's gate, reduce-scatter and fold
                g = q.grad
                if isinstance(g, DTensor):  # to the parameter's placements: a Partial one summed over TP in bf16
                    g = g.redistribute(q.device_mesh, q.placements).to_local()
                g = g.clone() if narrow else g.float()
                dist.all_reduce(g, group=dp)
                part = g.float() * scale
                grads[id(p)] = part if id(p) not in grads else grads[id(p)].add_(part)
                q.grad = None
        t = torch.tensor(total)
        dist.all_reduce(t, group=dp)
        losses.append(t.item() / dist.get_world_size(dp))
        for p, _ in pairs:
            g = grads[id(p)]
            p.grad = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                        stride=p.stride()) if isinstance(p, DTensor) else g
        full = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p, _ in pairs]
        norm = torch.stack([g.pow(2).sum() for g in full]).sum().sqrt()
        coef = torch.clamp(case.get("max_norm", MAX_NORM) / (norm + 1e-6), max=1.0)
        for p, _ in pairs:
            p.grad.mul_(coef)
        norms.append(norm.item())
        opt.step()
        opt.zero_grad()
    sd = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
          for k, v in master.state_dict().items()}
    return losses, norms, sd


def _world(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for name, case in CASES.items():
        got, want = _engine(case, mesh), _reference(case, mesh)
        if rank == 0:
            out[name] = (got, want)
    return out


def test_tp_bf16_same_rounding():
    res = run_ranks(_world, 4)[0]
    assert set(res) == set(CASES)
    for name, (got, want) in res.items():
        _compare(got, want, f"{name}: bf16 against the same rounding without the engine")
        assert got[0] == want[0], (name, "losses", got[0], want[0])  # bit for bit: the same bf16 weights each step
    got, want = res["sp_lp_z2_accum2_reduce_bf16_unclipped"]
    assert all(torch.equal(got[2][k], want[2][k]) for k in want[2]), "unclipped: the weights bit for bit"
    # two bf16 gradients summed in fp32 are what the fp32 reduce sums: the same run bit for bit
    (a, b), (c, d) = res["sp_z3_accum2_reduce_fp32"], res["sp_z3_accum2_reduce_bf16_sum_fp32"]
    assert a[:2] == c[:2] and all(torch.equal(a[2][k], c[2][k]) for k in a[2])
