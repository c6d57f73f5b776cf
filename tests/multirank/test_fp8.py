"""Compact trainable gathers (``gather_dtype="fp8"``): the sharded run equals an unsharded run whose
linear weights are replaced, before each forward, by quantize-dequantize of the fp32 master (same
128-blocks, straight-through gradients), at worlds 1-3, ZeRO-2/3, fp32 and bf16 param_dtype, torch
AdamW and yafsdp.FusedAdamW (which writes the FP8 record in its own pass). Also: the bytes gathered,
plan == allocation, a reload re-quantizes, errors. See [Note: compact trainable gathers] in yafsdp/formats/fp8_codec.py."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import yafsdp
from yafsdp import formats
from yafsdp.formats import fp8_codec as fp8
from dist_utils import run_ranks
from models import batch, loss_of, tiny_llama

STEPS = 3
LR = 3e-3
MAX_NORM = 1.0

# name -> (param_dtype, zero_stage, optimizer, accum)
CASES = {
    "fp32_z3_fused": (None, 3, "fused", 1),
    "fp32_z3_adamw": (None, 3, "adamw", 2),
    "bf16_z2_fused": ("bf16", 2, "fused", 1),
    "bf16_z3_adamw": ("bf16", 3, "adamw", 1),
    "bf16_z3_fused_accum": ("bf16", 3, "fused", 2),
    "fp32_hsdp_2x1_fused": (None, 3, "fused", 1),  # HSDP: 2 replicas of a 1-rank shard group
}
PLAN = {1: ["fp32_z3_fused", "bf16_z3_adamw"], 2: list(CASES), 3: ["fp32_z3_adamw", "bf16_z2_fused"]}
_DT = {None: None, "bf16": torch.bfloat16}


def _opt(kind, params):
    if kind == "fused":
        return yafsdp.FusedAdamW(params, lr=LR, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def _compact_weights(model) -> set[str]:
    """Names of the weights a compact gather covers: the decoder layers' linear weights (not the head)."""
    return {n for n, p in model.named_parameters() if n.startswith("model.layers.") and p.dim() == 2}


def train_sharded(rank, world, names, gather="fp8"):
    out = {}
    for name in names:
        dtype, zero, optname, accum = CASES[name]
        extra = {}
        if "hsdp" in name:
            from torch.distributed.device_mesh import init_device_mesh

            extra["mesh"] = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        model = yafsdp.YaFSDP(tiny_llama(), param_dtype=_DT[dtype], zero_stage=zero, gather_dtype=gather, **extra)
        opt = _opt(optname, model.parameters())
        model.schedule.gathered.clear()
        losses = []
        for step in range(STEPS):
            total = 0.0
            for micro in range(accum):
                loss = loss_of(model, "llama", batch("llama", step, micro, rank))
                (loss / accum).backward()
                total += loss.item() / accum
            t = torch.tensor(total)
            dist.all_reduce(t)
            losses.append(t.item() / world)
            model.clip_grad_norm_(MAX_NORM)
            opt.step()
            opt.zero_grad()
        shard_world = model.world_size  # HSDP: the shard group's
        info = dict(gathered=dict(model.schedule.gathered), plan_ok=model.memory_plan().engine_bytes() ==
                    model.allocated_bytes(), alloc=model.allocated_bytes(),
                    meta_plan_ok=yafsdp.plan.memory_plan(
                        tiny_llama(), world_size=shard_world, rank=model.rank, param_dtype=_DT[dtype],
                        zero_stage=zero, gather_dtype=gather, replicas=model.mesh_shape[0]).engine_bytes()
                    == model.allocated_bytes())
        if gather is None:
            out[name] = (losses, None, info)
            continue
        # The records written last (by FusedAdamW's pass or the cast pass) are the quantizer's of the master.
        with torch.no_grad():
            model(input_ids=batch("llama", 0, 0, rank)["input_ids"])  # a step entry writes stale records
        recs_ok, fmt = True, formats.get(gather)
        for u in model.flat_units:
            g = u.groups[0]
            if g.kind.format.name == gather:
                want = torch.zeros_like(g.compute)
                fmt.encode_(want, g.shard.detach(), twin=True)  # the twin (fp8: kernels.fp8_quantize_reference)
                recs_ok &= torch.equal(want, g.compute)
        info["records_ok"] = recs_ok
        sd = model.full_state_dict()
        if name == "bf16_z3_fused_accum":
            # A load re-quantizes: the records are derived from the master, never stored. Spoil them,
            # load the same weights; the next step entry writes them anew.
            model._rt.gather_store.fill_(0x7F)
            model.load_full_state_dict(sd if rank == 0 else None)
            with torch.no_grad():
                model(input_ids=batch("llama", 0, 0, rank)["input_ids"])
            for u in model.flat_units:
                g = u.groups[0]
                if g.kind.format.name == gather:
                    want = torch.zeros_like(g.compute)
                    fmt.encode_(want, g.shard.detach(), twin=True)
                    info["records_ok"] &= torch.equal(want, g.compute)
            info["bf16_gathered"] = _bf16_gathered(rank, world, name)
        out[name] = (losses, sd, info)
    return out


def _bf16_gathered(rank, world, name):
    """Bytes each rank receives from all-gathers over the same steps with gather_dtype=None."""
    return train_sharded(rank, world, [name], gather=None)[name][2]["gathered"] if name != "plain" else None


def train_reference(name, world, quantized=True, compute=None, fake=fp8.fake_quantize):
    """One process, the global batch; before each forward the decoder layers' linear weights are
    quantize-dequantized from the fp32 master (``fake``, fp8.fake_quantize: each weight's row-major 128-blocks,
    which is what the flat layout's blocks are), every other weight cast to param_dtype; gradients
    w.r.t. those weights update the fp32 master (straight-through)."""
    dtype, _, _, accum = CASES[name]
    dt = compute or _DT[dtype] or torch.float32
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    compact = _compact_weights(model) if quantized else set()
    losses = []
    for step in range(STEPS):
        low = copy.deepcopy(model).to(dt)
        with torch.no_grad():
            for n, p in low.named_parameters():
                if n in compact:
                    p.copy_(fake(model.get_parameter(n), dt))
        total = 0.0
        for micro in range(accum):
            parts = [batch("llama", step, micro, r) for r in range(world)]
            inputs = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            loss = loss_of(low, "llama", inputs)
            (loss / accum).backward()
            total += loss.item() / accum
        for p, q in zip(model.parameters(), low.parameters()):
            p.grad = q.grad.float()
        losses.append(total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rel_l2(a, b):
    num = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in b)
    return (num / sum(float(b[k].float().pow(2).sum()) for k in b)) ** 0.5


def _rel_seq(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


_results: dict[int, dict] = {}


def sharded(world):
    if world not in _results:
        _results[world] = run_ranks(train_sharded, world, PLAN[world])[0]
    return _results[world]


@pytest.mark.parametrize("world,name", [(w, n) for w, ns in PLAN.items() for n in ns], ids=str)
def test_fp8_gather_parity(world, name):
    losses, sd, info = sharded(world)[name]
    check_gather_parity(name, world, losses, sd, info)


def check_gather_parity(name, world, losses, sd, info, fake=fp8.fake_quantize, margin=2.0):
    """The sharded run (``train_sharded``'s result for case ``name``) against the unsharded reference
    whose compact weights are ``fake``-quantized (tests/unit/test_formats.py uses it for int8). ``margin``:
    how much farther the bf16 run must be from the unquantized reference than from the quantized one."""
    ref_losses, ref_sd = train_reference(name, world, fake=fake)
    plain_losses, plain_sd = train_reference(name, world, quantized=False)
    assert info["plan_ok"] and info["meta_plan_ok"], info["alloc"]
    assert info["records_ok"]
    assert all(v.dtype == torch.float32 for v in sd.values())
    # the quantization really happened: the plain run is much farther away than the quantized reference
    d_ref, d_plain = _rel_l2(sd, ref_sd), _rel_l2(sd, plain_sd)
    l_ref, l_plain = _rel_seq(losses, ref_losses), _rel_seq(losses, plain_losses)
    if CASES[name][0] is None:  # fp32 compute: the same arithmetic up to the order of sums
        assert l_ref < 2e-5 and d_ref < 2e-4, (l_ref, d_ref, losses, ref_losses)
        assert d_plain > 5 * d_ref and l_plain > 2 * l_ref, (d_ref, d_plain, l_ref, l_plain)
    else:  # bf16 compute: judged against the same mixed precision done unsharded, as test_parity does
        fp_losses, fp_sd = train_reference(name, world, compute=torch.float32, fake=fake)
        noise, l_noise = _rel_l2(ref_sd, fp_sd), _rel_seq(ref_losses, fp_losses)
        assert _rel_l2(sd, fp_sd) <= 2 * noise, (_rel_l2(sd, fp_sd), noise)
        assert _rel_seq(losses, fp_losses) <= 2 * l_noise + 1e-5
        _, plain_fp_sd = train_reference(name, world, quantized=False, compute=torch.float32)
        assert _rel_l2(sd, plain_fp_sd) > margin * _rel_l2(sd, fp_sd)  # the quantization really happened


def test_fp8_gathers_about_half_the_bytes():
    """The engine's own count: the decoder layers' weights move as ~1.03 bytes per parameter instead
    of 2; the embedding, head and small group as before."""
    info = sharded(2)["bf16_z3_fused_accum"][2]
    fp8_bytes, bf16_bytes = info["gathered"]["trainable"], info["bf16_gathered"]["trainable"]
    assert 0.55 < fp8_bytes / bf16_bytes < 0.8, (fp8_bytes, bf16_bytes)  # embedding + head stay bf16 here
    assert info["alloc"]["fp8"] > 0 and info["alloc"]["weight0_staging"] > 0


def _compact(g) -> str | None:
    """The name of the format a group is gathered in when it is gathered compact, else None."""
    return g.kind.format.name if g.kind.format.compact else None


def _errors(rank, world):
    from torch import nn

    out = {}
    try:
        yafsdp.YaFSDP(tiny_llama(), gather_dtype="int4")
    except ValueError as e:
        out["bad"] = str(e)
    # offload x fp8: accepted now (was refused; parity in tests/multirank/test_offload.py)
    m = yafsdp.YaFSDP(tiny_llama(), gather_dtype="fp8", offload="optimizer")
    out["offload"] = m.allocated_bytes("host").get("fp8_host", 0)
    plan = yafsdp.plan.memory_plan(tiny_llama(), world_size=1, gather_dtype="fp8", offload="optimizer")
    out["plan_offload"] = plan.engine_bytes().get("fp8_host", 0)
    import warnings

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        yafsdp.YaFSDP(nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)), gather_dtype="fp8")
    out["warn"] = [str(x.message) for x in w]
    m = yafsdp.YaFSDP(tiny_llama(vocab=64), gather_dtype="fp8")  # the head: 64 x 32, whole 128-blocks
    out["head_default"] = [_compact(g) for u in m.flat_units if u.name == "lm_head" for g in u.groups]
    m = yafsdp.YaFSDP(tiny_llama(vocab=64), gather_dtype="fp8", gather_exclude=())
    out["head"] = [_compact(g) for u in m.flat_units if u.name == "lm_head" for g in u.groups]
    m = yafsdp.YaFSDP(tiny_llama(), gather_dtype="bf16")
    out["bf16"] = [_compact(g) for u in m.flat_units for g in u.groups]
    return out


def test_fp8_options_and_errors():
    out = run_ranks(_errors, 1)[0]
    assert "gather_dtype='int4' is not supported" in out["bad"] and "'fp8'" in out["bad"]
    assert out["offload"] > 0 and out["plan_offload"] == out["offload"], out  # the FP8 records' host side
    assert any("found no unit to gather compact" in m for m in out["warn"]), out["warn"]
    assert out["head_default"] == [None]  # the HF output head stays in param_dtype by default
    assert out["head"] == ["fp8"]  # gather_exclude=() includes it
    assert out["bf16"] == [None] * len(out["bf16"])


def test_plan_cli_fp8(capsys):
    from yafsdp.plan.cli import main

    plain = main(["--preset", "tiny", "--world-size", "2"])
    packed = main(["--preset", "tiny", "--world-size", "2", "--gather-dtype", "fp8"])
    assert plain.records == 0 and packed.records == packed.engine_bytes()["fp8"] > 0
    assert "FP8 records" in capsys.readouterr().out
    # the decoder layers' compute copy: 2-byte bf16 values -> 1 + 4/128-byte records
    assert packed.compute_copy + packed.records < plain.compute_copy or plain.compute_copy == 0
    assert {u.name for u in packed.units if u.compact} == {"model.layers.0", "model.layers.1"}
    before = {u.name: u.gather_bytes for u in plain.units}
    for u in packed.units:  # ~1.03 bytes per element instead of 2 (the CLI's default param_dtype is bf16)
        assert u.gather_bytes / before[u.name] < 0.53 if u.compact else u.gather_bytes == before[u.name]
