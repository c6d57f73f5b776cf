"""Gather formats (yafsdp/formats: [Note: gather formats] in formats/base.py) and int8 gathers,
the format added as one module ([Note: int8 gathers] in formats/int8.py):

- the int8 expand (the dispatching ``expand_``) equals its twin bit for bit, and both equal an
  independent per-block computation, for every world size and compute dtype;
- the sharded int8 run equals an unsharded run whose linear weights are quantize-dequantized the
  same way (``int8.fake_quantize``) at fp32-parity tolerances (tests/multirank/test_fp8.py's checks), with
  torch AdamW (the cast pass writes the records) and FusedAdamW (its step writes them); the plan
  equals the allocations; a checkpoint round trip continues bit for bit;
- the kernels and the formats import without cycles (no function-level import holds one apart).
"""
from __future__ import annotations

import os
import pathlib

import pytest
import torch

import yafsdp
from yafsdp import formats
from yafsdp.formats import int8
from dist_utils import run_ranks
from models import batch, loss_of, tiny_llama
import test_fp8

ROOT = pathlib.Path(yafsdp.__file__).parent


# ------------------------------------------------------------------------------------ kernels
def _values(n, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g) * torch.logspace(-3, 1, n // int8.BLOCK).repeat_interleave(int8.BLOCK)
    v[int8.BLOCK:2 * int8.BLOCK] = 0  # a block of zeros: scale 0, codes 0
    return v


def _independent(values: torch.Tensor, dtype: torch.dtype) -> tuple[list, torch.Tensor]:
    """Block by block, written without the format's code: (codes, scales) per block and the values."""
    blocks, out = [], []
    for b in values.split(int8.BLOCK):
        amax = max(abs(float(x)) for x in b.tolist())
        s = torch.tensor(amax, dtype=torch.float32) / 127
        c = torch.zeros(int8.BLOCK) if amax == 0 else torch.round(torch.clamp(b / s, -127, 127))
        blocks.append((c.to(torch.int8), s))
        out.append((c * s).to(dtype))
    return blocks, torch.cat(out)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_int8_expand_equals_twin_and_independent(world, dtype):
    fmt = formats.get("int8")
    assert fmt is formats.gather_format(torch.int8) is formats.gather_format("INT8")
    n = 4 * int8.BLOCK  # one rank's shard
    values = [_values(n, seed=r) for r in range(world)]
    records = []
    for v in values:
        rec = torch.full((fmt.record_bytes(n),), 0xAB, dtype=torch.uint8)
        fmt.encode_(rec, v)
        blocks, _ = _independent(v, dtype)
        # the record: n int8 codes, then one float32 scale per block
        assert rec.numel() == n + 4 * n // int8.BLOCK
        assert torch.equal(rec[:n].view(torch.int8), torch.cat([c for c, _ in blocks]))
        assert torch.equal(rec[n:].view(torch.float32), torch.stack([s for _, s in blocks]))
        records.append(rec)
    staging = torch.cat(records)
    got = fmt.expand_(torch.empty(world * n, dtype=dtype), staging, n)
    twin = fmt.expand_reference(torch.empty(world * n, dtype=dtype), staging, n)
    want = torch.cat([_independent(v, dtype)[1] for v in values])
    assert torch.equal(got, twin) and torch.equal(got, want)
    assert torch.equal(fmt.decode(staging, n, dtype), want)
    # the rounding error is at most half a step of each block's grid
    full = torch.cat(values)
    step = full.view(-1, int8.BLOCK).abs().amax(1, keepdim=True) / 127
    err = (fmt.expand_(torch.empty(world * n), staging, n) - full).view(-1, int8.BLOCK).abs()
    assert bool((err <= step / 2 * (1 + 1e-6) + 1e-12).all())
    # fake_quantize (the parity reference) is the same arithmetic on one weight
    w = values[0].view(4, int8.BLOCK)
    assert torch.equal(int8.fake_quantize(w, dtype).reshape(-1), _independent(values[0], dtype)[1])


def test_format_protocol_sizes():
    """Record sizes and alignment the plan and the allocator use, per format."""
    f8, i8, n4, plain = (formats.get(n) for n in ("fp8", "int8", "nf4", None))
    assert plain is formats.PLAIN and not plain.compact
    assert i8.record_bytes(256) == f8.record_bytes(256, torch.bfloat16) == 256 + 8
    assert n4.record_bytes(256, torch.bfloat16) == 128 + 4 * 2
    assert i8.shard_align(8, torch.float32) == 128 and i8.shard_align(48, torch.float32) == 384
    assert n4.stored and not i8.stored and i8 in formats.gather_formats() and n4 in formats.storage_formats()
    with pytest.raises(ValueError, match="gather_dtype='int4' is not supported.*'fp8'.*'int8'"):
        formats.gather_option("int4")
    with pytest.raises(ValueError, match="quantize_frozen='int8' is not supported"):
        formats.storage_option("int8")


def test_one_eligibility_rule_and_one_vocabulary():
    """Every compact format takes parameters by the one rule of formats/base.py (none redefines it):
    the 2-D weight of nn.Linear modules only, of whole blocks, trainable for a gather format and frozen
    for a storage format. The words agree ([Note: gather formats]): a kind's ``*_dtype`` is a torch.dtype,
    ``compact`` / ``stored`` are bools, the options hold format names."""
    from types import SimpleNamespace

    from yafsdp.layout.config import OPTIONS
    from yafsdp.engine.unit import frozen_kind, stored_kind, trainable_kind
    from yafsdp.formats.base import Format

    compact = [f for f in {*formats.gather_formats(), *formats.storage_formats()}]
    assert compact and all(type(f).eligible is Format.eligible for f in compact), compact
    lin, emb = torch.nn.Linear(16, 16), torch.nn.Embedding(16, 16)

    def info(frozen, owners, numel=256, shape=(16, 16), small=False):
        return SimpleNamespace(frozen=frozen, owners=owners, numel=numel, shape=shape, small=small)

    for f in compact:
        assert f.eligible(info(f.stored, [(lin, "weight")]))
        assert not f.eligible(info(not f.stored, [(lin, "weight")]))  # the other kind of group
        assert not f.eligible(info(f.stored, [(lin, "weight"), (emb, "weight")]))  # tied to an embedding
        assert not f.eligible(info(f.stored, [(lin, "weight")], numel=256 + f.block // 2))  # a part block
        assert not f.eligible(info(f.stored, [(lin, "bias")], shape=(256,)))
    assert formats.PLAIN.eligible(info(True, [(emb, "weight")]))
    for fmt in (*formats.gather_formats(), *formats.storage_formats(), formats.PLAIN):
        assert isinstance(fmt.compact, bool) and isinstance(fmt.stored, bool) and isinstance(fmt.name, str)
    kinds = [trainable_kind(torch.bfloat16, formats.get("fp8")), frozen_kind(torch.bfloat16),
             stored_kind(torch.bfloat16, formats.get("nf4"))]
    for kind in kinds:
        dtypes = {n: getattr(kind, n) for n in dir(kind) if n.endswith("_dtype")}
        assert dtypes and all(isinstance(v, torch.dtype) for v in dtypes.values()), dtypes
        assert isinstance(getattr(kind, "compact", False), bool)  # a kind says no name where a format says a bool
    for name in ("gather_dtype", "quantize_frozen"):
        assert all(v is None or formats.get(v).name == v for v in OPTIONS[name].choices())


# ------------------------------------------------------------------------------------ training
PARITY = ["fp32_z3_fused", "fp32_z3_adamw", "bf16_z2_fused"]


def _int8_run(rank, world, out_dir):
    import yafsdp.checkpoint as ckpt

    out = {"parity": test_fp8.train_sharded(rank, world, PARITY, gather="int8")}
    # checkpoint round trip: the records are derived from the master, never saved; a reload continues
    # bit for bit, and the same checkpoint loads into a model gathering in param_dtype.
    def make(seed, gather="int8"):
        m = yafsdp.YaFSDP(tiny_llama(seed=seed), param_dtype=torch.bfloat16, gather_dtype=gather)
        return m, yafsdp.FusedAdamW(m.parameters(), lr=test_fp8.LR, weight_decay=0.1)

    def step(m, opt, s):
        loss = loss_of(m, "llama", batch("llama", s, 0, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    model, opt = make(0)
    out["gathered"] = dict(alloc=model.allocated_bytes())
    for s in range(2):
        step(model, opt, s)
    path = ckpt.save_checkpoint(os.path.join(out_dir, "ckpt"), 2, model, opt)
    fresh, fopt = make(1)
    ckpt.load_checkpoint(path, fresh, fopt)
    out["loaded_sd"] = fresh.full_state_dict()
    out["saved_sd"] = model.full_state_dict()
    out["next"] = (step(model, opt, 2), step(fresh, fopt, 2))
    out["next_sd"] = (model.full_state_dict(), fresh.full_state_dict())
    plain, popt = make(2, gather=None)
    ckpt.load_checkpoint(path, plain, popt)
    out["plain_sd"] = plain.full_state_dict()
    return out


@pytest.fixture(scope="module")
def int8_results(tmp_path_factory):
    return run_ranks(_int8_run, 2, str(tmp_path_factory.mktemp("int8")))[0]


@pytest.mark.parametrize("name", PARITY)
def test_int8_gather_parity(int8_results, name):
    losses, sd, info = int8_results["parity"][name]
    assert info["alloc"]["int8"] > 0 and info["alloc"]["fp8"] == 0
    assert info["gathered"]["trainable"] > 0
    # int8's rounding (at most amax/254 per value) is finer than fp8's: in bf16 it is of the order of
    # bf16's own rounding, so the bf16 run is told apart from the unquantized one by a smaller margin
    test_fp8.check_gather_parity(name, 2, losses, sd, info, fake=int8.fake_quantize, margin=1.2)


def test_int8_checkpoint_round_trip(int8_results):
    r = int8_results
    assert r["loaded_sd"].keys() == r["saved_sd"].keys()
    assert all(torch.equal(r["loaded_sd"][k], r["saved_sd"][k]) for k in r["saved_sd"])
    assert r["next"][0] == r["next"][1]
    a, b = r["next_sd"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(r["plain_sd"][k], r["saved_sd"][k]) for k in r["saved_sd"])


def test_plan_cli_int8(capsys):
    from yafsdp.plan.cli import main

    plain = main(["--preset", "tiny", "--world-size", "2"])
    packed = main(["--preset", "tiny", "--world-size", "2", "--gather-dtype", "int8"])
    assert "INT8 records" in capsys.readouterr().out
    assert plain.engine_bytes()["int8"] == 0 and packed.engine_bytes()["int8"] == packed.records > 0
    assert packed.engine_bytes()["fp8"] == 0
    layers = {"model.layers.0", "model.layers.1"}
    assert {u.name for u in packed.units if u.gather_dtype == "int8"} == layers
    # the plan speaks of any gather format: a row says it is gathered compact for int8 as for fp8 (it
    # had fp8-only properties that read 0 / False for an int8 plan)
    assert {u.name for u in packed.units if u.compact} == layers and not any(u.compact for u in plain.units)
    assert not any(hasattr(type(packed), n) or hasattr(type(packed.units[0]), n) for n in ("fp8", "fp8_host"))


def test_fused_adamw_writes_a_registered_int8_copy_out():
    """FusedAdamW's copy-out contract with ``format="int8"``: after each step the copy is the int8
    record of the updated parameter (compiled AdamW then the format's encode, and the twins);
    a record of the wrong size, or an unknown format, is refused with what to do."""
    from yafsdp import shards

    fmt = formats.get("int8")
    for fused in (None, False):
        p = torch.nn.Parameter(_values(512, seed=3))
        rec = torch.zeros(fmt.record_bytes(512), dtype=torch.uint8)
        calls = []
        shards.set_copy_out(p, rec, lambda: calls.append(1), format="int8")
        opt = yafsdp.FusedAdamW([p], lr=1e-2, fused=fused)
        for _ in range(2):
            p.grad = torch.randn(512)
            opt.step()
            want = torch.zeros_like(rec)
            fmt.encode_(want, p.detach())
            assert torch.equal(rec, want) and len(calls) == _ + 1
    shards.set_copy_out(p, rec[:-4], lambda: None, format="int8")
    with pytest.raises(ValueError, match=r"int8 copy-out registered for p must be a contiguous uint8 record"):
        opt.step()
    shards.set_copy_out(p, rec, lambda: None, format="int4")
    with pytest.raises(ValueError, match=r"format='int4'.*'fp8', 'int8'"):
        opt.step()
