"""The secondary shard (``secondary_shard=N``, ZeRO++'s hpZ): after a unit's forward gather each rank
keeps 1/N of it, and the backward (and recompute) gathers run within groups of N consecutive ranks.

An all-gather moves bytes, so the weights every step computes with are those of ``secondary_shard=0``
bit for bit: each case is trained with the option on and off and the losses, grad norms and final
weights are asserted identical, and the plain cases are also held to fp32 parity with one process
training the unwrapped model on the global batch. World 4 with groups of 2 (accumulation, a tied head
with activation checkpointing, int8 gathers in bf16 with offload, an NF4 frozen base with offload="all",
loads between steps); world 8 with groups of 2 and 4, and HSDP (2 replicas x 4 ranks, groups of 2). The
collectives are counted by the size of the group they ran on; the memory plan equals the allocations;
the refusals name both options. Each world is spawned once (see ``_world4`` / ``_world8``).
"""
from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

import yafsdp
from dist_utils import run_ranks
from models import batch, loss_of, tiny_llama
from parity import LR, MAX_NORM, make_optimizer, rel_l2, rel_seq
from yafsdp.layout.sizing import round16
from yafsdp.plan import memory_plan

STEPS = 2


def _llama(tie=False, ckpt=False, layers=3, freeze=()):
    model = tiny_llama(tie=tie, checkpointing=ckpt, layers=layers)
    for name, p in model.named_parameters():
        if any(f in name for f in freeze):
            p.requires_grad_(False)
    return model


def _train(rank, world, opts, *, tie=False, ckpt=False, accum=1, steps=STEPS, layers=3, count=False, freeze=()):
    """Train ``steps`` steps; returns the losses, grad norms, final weights, the plans and allocations,
    and (``count``) per step the number of all-gathers on each group size."""
    import yafsdp.comm.gloo as gloo

    sizes: list[int] = []
    real = gloo.all_gather

    def counting(out, shard, group, *a, **kw):  # every gather of the step protocol goes through here
        sizes.append(dist.get_world_size(group))
        return real(out, shard, group, *a, **kw)

    model = yafsdp.YaFSDP(_llama(tie, ckpt, layers, freeze), **opts)
    opt = make_optimizer(model.parameters())
    losses, norms, per_step = [], [], []
    gloo.all_gather = counting
    try:
        for step in range(steps):
            sizes.clear()
            total = 0.0
            for micro in range(accum):
                loss = loss_of(model, "llama", batch("llama", step, micro, rank))
                (loss / accum).backward()
                total += loss.item() / accum
            per_step.append(sorted(sizes))
            t = torch.tensor(total)
            dist.all_reduce(t)
            losses.append(t.item() / world)
            norms.append(model.clip_grad_norm_(MAX_NORM).item())
            opt.step()
            opt.zero_grad()
    finally:
        gloo.all_gather = real
    with torch.device("meta"):
        meta = _llama(tie, ckpt, layers, freeze)
    meta_opts = {k: v for k, v in opts.items() if k not in ("mesh", "process_group")}
    plans = (memory_plan(meta, world_size=model.world_size, rank=model.rank, **meta_opts), model.memory_plan())
    kept = {u.name: sum(round16(p.numel() * p.element_size()) for p in u.secondary.pieces) if u.secondary else 0
            for u in model._rt.units}  # each piece starts on a 16-byte line
    return dict(losses=losses, norms=norms, sd=model.full_state_dict(), per_step=per_step if count else None,
                allocated=model.allocated_bytes(), meta_plan=plans[0].engine_bytes(), own_plan=plans[1].engine_bytes(),
                rows={u.name: u.secondary_bytes for u in plans[0].units}, kept=kept,
                counted={k: v for k, v in model.schedule.counted.items() if k[0] != "reduce"})


def _reload(rank, world, opts, path):
    """forward + backward, then other weights loaded (the state-dict load; the streamed HF load, which
    reads into the shards in place without bumping a version), each followed by forward + backward:
    no backward may gather the pieces kept before a load."""
    from yafsdp.hf import load_hf_weights

    model = yafsdp.YaFSDP(tiny_llama(), **opts)
    other = {k: v * 0.5 for k, v in model.full_state_dict().items()}
    loss_of(model, "llama", batch("llama", 0, 0, rank)).backward()
    model.load_full_state_dict(other)
    model.zero_grad()
    loss_of(model, "llama", batch("llama", 2, 0, rank)).backward()
    load_hf_weights(model, path)
    model.zero_grad()
    loss = loss_of(model, "llama", batch("llama", 1, 0, rank))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# name -> (options, train kwargs); each is trained with secondary_shard 0 and 2 at world 4
W4 = {
    "plain_accum2": (dict(), dict(accum=2, count=True)),
    "tied_ckpt": (dict(), dict(tie=True, ckpt=True)),
    "int8_bf16_offload": (dict(gather_dtype="int8", param_dtype=torch.bfloat16, offload="optimizer"), dict()),
    # a QLoRA-like base: frozen q/k/mlp stored and gathered as NF4 records, the frozen shards on the host
    "nf4_frozen_offload_all": (dict(quantize_frozen="nf4", param_dtype=torch.bfloat16, offload="all"),
                               dict(freeze=("q_proj", "k_proj", "mlp"))),
}


def _world4(rank, world):
    out = {}
    for name, (opts, kw) in W4.items():
        out[name] = [_train(rank, world, dict(opts, secondary_shard=s), **kw) for s in (0, 2)]
    with tempfile.TemporaryDirectory() as path:  # each rank its own copy of other weights in HF's format
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tiny_llama(seed=1).state_dict().items()}, f"{path}/model.safetensors")
        out["reload"] = [_reload(rank, world, dict(secondary_shard=s), path) for s in (0, 2)]
    refused = {}
    for size in (3, 4):  # not a divisor of 4; all of it
        try:
            yafsdp.YaFSDP(tiny_llama(), secondary_shard=size)
        except ValueError as e:
            refused[size] = str(e)
    out["refused"] = refused
    return out


def _world8(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    out = {s: _train(rank, world, dict(secondary_shard=s), layers=2, count=True) for s in (0, 2, 4)}
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    out["hsdp"] = [_train(rank, world, dict(mesh=mesh, secondary_shard=s), layers=2, count=True) for s in (0, 2)]
    return out


_RESULTS: dict[int, list] = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_world4 if world == 4 else _world8, world)
    return _RESULTS[world]


def _reference(world, *, layers=3, accum=1, steps=STEPS):
    """One process, the global batch, the unwrapped model (the parity tests' reference)."""
    model = tiny_llama(layers=layers)
    opt = make_optimizer(model.parameters())
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            parts = [batch("llama", step, micro, r) for r in range(world)]
            loss = loss_of(model, "llama", {k: torch.cat([p[k] for p in parts]) for k in parts[0]})
            (loss / accum).backward()
            total += loss.item() / accum
        losses.append(total)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _identical(a, b, what):
    assert a["losses"] == b["losses"], (what, a["losses"], b["losses"])
    assert a["norms"] == b["norms"], (what, a["norms"], b["norms"])
    assert set(a["sd"]) == set(b["sd"])
    differ = [k for k in a["sd"] if not torch.equal(a["sd"][k], b["sd"][k])]
    assert not differ, (what, differ)


def _parity(r, ref, what):
    losses, norms, sd = ref
    assert rel_seq(r["losses"], losses) < 1e-5, (what, r["losses"], losses)
    assert rel_seq(r["norms"], norms) < 1e-5, (what, r["norms"], norms)
    assert rel_l2(r["sd"], sd) < 1e-4, what


def _plan_is_allocation(r, what):
    assert r["meta_plan"] == r["own_plan"] == r["allocated"], (what, r["meta_plan"], r["allocated"])
    assert r["rows"] == r["kept"], (what, r["rows"], r["kept"])


@pytest.mark.parametrize("name", list(W4))
def test_world4_groups_of_2_bit_identical_to_off(name):
    for rank, res in enumerate(_results(4)):
        off, on = res[name]
        _identical(off, on, (name, rank))
        _plan_is_allocation(on, (name, rank))
        assert "secondary" not in off["allocated"] and on["allocated"]["secondary"] > 0
        # the backward re-gathers (and with checkpointing the recomputes) ran within the pairs
        assert any(kind == "secondary_gather" for kind, _ in on["counted"]), on["counted"]
        assert not any(kind == "secondary_gather" for kind, _ in off["counted"])
    if name == "plain_accum2":
        _parity(_results(4)[0][name][1], _reference(4, accum=2), name)


def test_world4_collectives_per_group():
    """Per step, each all-gather's group size: with the option the gathers a step repeats run on the
    pairs, and every one of them replaces a gather over all 4 ranks (nothing is gathered twice).
    Accumulation 2: forward, backward, forward, backward; the second forward gathers from the
    pieces too (same weights, same bytes). The kept units are exactly those the plan lists."""
    for res in _results(4):
        off, on = res["plain_accum2"]
        for step_off, step_on in zip(off["per_step"], on["per_step"]):
            assert set(step_off) == {4} and set(step_on) == {2, 4}, (step_off, step_on)
            assert len(step_on) == len(step_off), (step_off, step_on)
            assert step_on.count(2) >= 4, step_on  # two re-gathered layers, in two backward calls at least
        kept = {u for u, b in on["rows"].items() if b}
        regathered = {u for kind, u in on["counted"] if kind == "secondary_gather"}
        assert regathered and regathered <= kept, (regathered, kept)
        assert "model.embed_tokens" not in kept  # weight-free backward: never re-gathered, keeps nothing
        assert on["rows"]["model.embed_tokens"] == 0


def test_load_between_steps_forgets_the_pieces():
    for res in _results(4):
        (loss_off, grads_off), (loss_on, grads_on) = res["reload"]
        assert loss_off == loss_on
        assert set(grads_off) == set(grads_on)
        differ = [n for n in grads_off if not torch.equal(grads_off[n], grads_on[n])]
        assert not differ, differ


def test_refused_sizes_name_both_values():
    for res in _results(4):
        assert set(res["refused"]) == {3, 4}, res["refused"]
        assert "secondary_shard=3 does not divide the shard group's 4 ranks" in res["refused"][3]
        assert "secondary_shard=4 is all of the shard group's 4 ranks" in res["refused"][4]
    with pytest.raises(ValueError, match="secondary_shard=2 with zero_stage=2"):
        yafsdp.build_config(zero_stage=2, secondary_shard=2)
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="secondary_shard="):
            yafsdp.build_config(secondary_shard=bad)
    with torch.device("meta"):
        meta = tiny_llama()
    with pytest.raises(ValueError, match="memory_plan: secondary_shard=4 does not divide the shard group's 6 ranks"):
        memory_plan(meta, world_size=6, secondary_shard=4)
    assert memory_plan(meta, world_size=6, secondary_shard=1).secondary == 0  # 0 and 1: off


def test_world8_groups_of_2_and_4_and_hsdp():
    """World 8 (a couple of steps, two layers): groups of 2 and of 4 are bit for bit the option off
    and in fp32 parity with the unwrapped model; so is HSDP (2 replicas x 4 ranks) with groups of 2
    inside each replica's shard group, against HSDP without them and against the unwrapped model."""
    results = _results(8)
    ref = _reference(8, layers=2)
    for rank, res in enumerate(results):
        for s in (2, 4):
            _identical(res[0], res[s], (s, rank))
            _plan_is_allocation(res[s], (s, rank))
            assert all(set(step) == {8, s} for step in res[s]["per_step"]), res[s]["per_step"]
        assert res[2]["allocated"]["secondary"] == 2 * res[4]["allocated"]["secondary"]  # 1/2 of a unit vs 1/4
        off, on = res["hsdp"]
        _identical(off, on, ("hsdp", rank))
        _plan_is_allocation(on, ("hsdp", rank))
        assert all(set(step) == {4, 2} for step in on["per_step"]), on["per_step"]  # the replica's 4, the pairs
        assert all(set(step) == {4} for step in off["per_step"]), off["per_step"]
    _parity(results[0][2], ref, "world 8, groups of 2")
    _parity(results[0][4], ref, "world 8, groups of 4")
    _parity(results[0]["hsdp"][1], ref, "HSDP 2 x 4, groups of 2")
