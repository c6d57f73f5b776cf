"""Frozen parameters (requires_grad=False at wrap time) as a unit's frozen flat group: gathered for
use, never reduced, no grad shard or optimizer state, stored only in param_dtype. The sharded model
trains like the unsharded one with the same parameters frozen, the frozen values never change, and
the memory plan and allocations show no grad or optimizer bytes for them."""

import pytest
import torch

import yafsdp
from dist_utils import run_ranks
from models import batch, loss_of, tiny_llama
from parity import rel_l2, rel_seq

STEPS = 3

# name -> (which parameters to freeze, options). Frozen: a whole unit (the embedding), part of every
# decoder layer (q/k projections), part of the small group (the final norm), a tied embedding+head.
CASES = {
    "embed_z3": (("embed",), dict()),
    "qk_norm_z3_accum": (("q_proj", "k_proj", "model.norm"), dict(accum=2)),
    "qk_z2": (("q_proj", "k_proj"), dict(zero=2)),
    "tied_embed_ckpt": (("embed",), dict(tie=True, ckpt=True)),
    "head_z3": (("lm_head",), dict()),
}


def _freeze(model, which):
    for name, p in model.named_parameters():
        if any(w in name for w in which):
            p.requires_grad_(False)


def _build(name):
    which, opts = CASES[name]
    model = tiny_llama(tie=opts.get("tie", False), checkpointing=opts.get("ckpt", False))
    _freeze(model, which)
    return model, opts


def _train(model, opts, rank, world, sharded):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1,
                            foreach=False)
    accum = opts.get("accum", 1)
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(accum):
            if sharded:
                inputs = batch("llama", step, micro, rank)
            else:  # the global batch
                parts = [batch("llama", step, micro, r) for r in range(world)]
                inputs = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            loss = loss_of(model, "llama", inputs)
            (loss / accum).backward()
            total += loss.item() / accum
        if sharded:
            t = torch.tensor(total)
            torch.distributed.all_reduce(t)
            total = t.item() / world
            norms.append(model.clip_grad_norm_(1.0).item())
        else:
            norms.append(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                        1.0).item())
        losses.append(total)
        opt.step()
        opt.zero_grad()
    return losses, norms


def _sharded(rank, world, names):
    out = {}
    for name in names:
        model, opts = _build(name)
        init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        frozen = [k for k, p in model.named_parameters() if not p.requires_grad]
        wrapped = yafsdp.YaFSDP(model, zero_stage=opts.get("zero", 3))
        kinds = sorted({i.kind for i in wrapped.shard_info()})
        n_params = len(list(wrapped.parameters()))
        losses, norms = _train(wrapped, opts, rank, world, True)
        sd = wrapped.full_state_dict()
        out[name] = dict(losses=losses, norms=norms, sd=sd, init=init, frozen=frozen, kinds=kinds,
                         n_params=n_params, bytes=wrapped.allocated_bytes())
    return out


PLAN = {1: ["embed_z3", "qk_norm_z3_accum"], 2: list(CASES), 3: ["qk_norm_z3_accum", "tied_embed_ckpt"],
        4: ["embed_z3", "qk_z2", "head_z3"]}


def _world2(rank, world, root):
    """The world-2 runs of this file in one spawn."""
    return dict(sharded=_sharded(rank, world, PLAN[2]), memory=_memory_and_refusals(rank, world),
                ckpt=_checkpoint_roundtrip(rank, world, root))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_ranks(_world2, 2, str(tmp_path_factory.mktemp("frozen2")))


@pytest.fixture(scope="module", params=sorted(PLAN))
def world_results(request):
    world = request.param
    if world == 2:
        return world, request.getfixturevalue("world2")[0]["sharded"]
    return world, run_ranks(_sharded, world, PLAN[world])[0]


def test_frozen_parity_and_frozen_values_unchanged(world_results):
    world, results = world_results
    for name, r in results.items():
        model, opts = _build(name)
        ref_losses, ref_norms = _train(model, opts, 0, world, False)
        assert rel_seq(r["losses"], ref_losses) < 1e-5, (world, name, r["losses"], ref_losses)
        assert rel_seq(r["norms"], ref_norms) < 1e-5, (world, name, r["norms"], ref_norms)
        ref_sd = {k: v.detach() for k, v in model.state_dict().items()}
        assert rel_l2(r["sd"], ref_sd) < 1e-4, (world, name)
        assert r["frozen"], name
        for k in r["frozen"]:  # bit-identical before and after training (fp32 compute: stored exactly)
            assert torch.equal(r["sd"][k], r["init"][k]), (world, name, k)
        assert "frozen" in r["kinds"]


def _memory_and_refusals(rank, world):
    out = {}
    for dtype in (None, torch.bfloat16):
        model = tiny_llama()
        _freeze(model, ("q_proj", "k_proj", "embed"))
        n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        with torch.device("meta"):
            meta = tiny_llama()
        _freeze(meta, ("q_proj", "k_proj", "embed"))
        plan = yafsdp.plan.memory_plan(meta, world_size=world, rank=rank, param_dtype=dtype)
        init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        wrapped = yafsdp.YaFSDP(model, param_dtype=dtype)
        b = wrapped.allocated_bytes()
        sd = wrapped.full_state_dict()
        out[str(dtype)] = dict(plan=plan.engine_bytes(), alloc=b, n_frozen=n_frozen, n_train=n_train,
                               shards=sum(i.shard_numel for i in wrapped.shard_info() if i.kind == "trainable"),
                               fshards=sum(i.shard_numel for i in wrapped.shard_info() if i.kind == "frozen"),
                               rounded=rank != 0 or all(torch.equal(sd[k], init[k].to(dtype or torch.float32).float())
                                                        for k in init if "q_proj" in k))
    model = tiny_llama()
    q = model.model.layers[0].self_attn.q_proj.weight
    q.requires_grad_(False)
    wrapped = yafsdp.YaFSDP(model)
    errors = {}
    q.requires_grad_(True)  # after wrapping: would have no effect
    try:
        loss_of(wrapped, "llama", batch("llama", 0, 0, rank))
    except RuntimeError as e:
        errors["original"] = str(e)
    q.requires_grad_(False)
    next(iter(wrapped.parameters())).requires_grad_(False)
    try:
        loss_of(wrapped, "llama", batch("llama", 0, 0, rank))
    except RuntimeError as e:
        errors["shard"] = str(e)
    out["errors"] = errors
    return out


def test_frozen_memory_plan_and_refusals(world2):
    for r in (per_rank["memory"] for per_rank in world2):
        for dtype, itemsize in (("None", 4), ("torch.bfloat16", 2)):
            m = r[dtype]
            assert m["plan"] == m["alloc"], (dtype, m["plan"], m["alloc"])
            # No master, grad or compute-copy bytes for frozen weights: those follow the trainable shards.
            assert m["alloc"]["master"] == m["alloc"]["grad"] == 4 * m["shards"]
            assert m["alloc"]["frozen"] == itemsize * m["fshards"] > 0
            assert m["fshards"] * 2 >= m["n_frozen"] and m["shards"] * 2 >= m["n_train"] - 32 * 4
            assert m["rounded"]  # frozen values are stored in param_dtype: rounded once, then exact
        e = r["errors"]
        assert "requires_grad of parameter 'model.layers.0.self_attn.q_proj.weight' changed after wrapping" in e["original"]
        assert "has requires_grad=False" in e["shard"] and "wrap time" in e["shard"]


def _checkpoint_roundtrip(rank, world, root):
    from yafsdp import checkpoint as ckpt

    def build(seed):
        model = tiny_llama(seed=seed)
        _freeze(model, ("q_proj", "lm_head", "model.norm"))
        return yafsdp.YaFSDP(model, param_dtype=torch.bfloat16)

    a = build(0)
    opt = yafsdp.FusedAdamW(a.parameters(), lr=1e-3)
    loss_of(a, "llama", batch("llama", 0, 0, rank)).backward()
    opt.step()
    opt.zero_grad()
    path = ckpt.save_checkpoint(root, 1, a, opt)
    b = build(1)  # other initial values everywhere, frozen ones included
    opt_b = yafsdp.FusedAdamW(b.parameters(), lr=1e-3)
    ckpt.load_checkpoint(path, b, opt_b)
    sa, sb = a.full_state_dict(), b.full_state_dict()
    x = batch("llama", 1, 0, rank)
    with torch.no_grad():
        same_logits = torch.equal(a(**x).logits, b(**x).logits)
    return dict(same=all(torch.equal(sa[k], sb[k]) for k in sa), n=len(sa), logits=same_logits,
                keys=sorted(ckpt.read_manifest(path)["files"]) and [u["name"] for u in ckpt.read_manifest(path)["units"]])


def test_frozen_groups_in_checkpoints(world2):
    for r in (per_rank["ckpt"] for per_rank in world2):
        assert r["same"] and r["logits"], r
        assert "lm_head.frozen" in r["keys"] and "model.layers.0" in r["keys"] and "model.layers.0.frozen" in r["keys"]
