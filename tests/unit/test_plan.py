"""The memory plan: computed on the meta device, it equals what the engine allocates, byte for byte;
its activation estimate lands near the measured peak; the CLI prints the Llama-3-8B plan.
"""
import json
import subprocess
import sys

import pytest
import torch

import yafsdp
from dist_utils import run_ranks
from models import Stack, all_grads, batch, loss_of, random_tokens_step, tiny_llama
from yafsdp.measure import measure_memory
from yafsdp.plan import memory_plan, plan_buffers, unit_align
from yafsdp.presets import build_llama

# (name, builder kwargs, engine options). Uneven sizes; a large vocabulary makes the embedding
# and head outsized (their own buffer); tied weights; ZeRO-2; bf16 compute copy.
CASES = [
    ("llama_z3", dict(kind="llama"), dict()),
    ("llama_outsized_bf16", dict(kind="llama", vocab=1031, layers=4), dict(param_dtype=torch.bfloat16)),
    # the outsized units' gradients in a grad buffer of their own (chunked through the pair by default)
    ("llama_outsized_own", dict(kind="llama", vocab=1031, layers=4), dict(chunk_outsized_grads=False)),
    # the grad pair at half a layer, the layers' gradients reduced in 2 chunks (with fp32 accumulation's landings)
    ("llama_gradchunks_accum", dict(kind="llama", vocab=1031), dict(reduce_dtype=torch.bfloat16,
                                                                    reduce_accum_dtype=torch.float32, grad_chunks=2)),
    ("llama_tied_z2", dict(kind="llama", tie=True), dict(zero_stage=2)),
    ("llama_bf16_reduce", dict(kind="llama", vocab=257), dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
    # bf16 reduce summed in fp32: each grad buffer's all-to-all landing (world x shard) and fp32 accumulator
    ("llama_bf16_reduce_accum", dict(kind="llama", vocab=1031), dict(reduce_dtype=torch.bfloat16,
                                                                     reduce_accum_dtype=torch.float32)),
    ("stack_z3", dict(kind="stack"), dict()),
    # frozen bf16 and NF4 groups (q/k/mlp frozen, quantized where eligible; odd-sized head frozen bf16)
    ("llama_nf4_bf16", dict(kind="llama", freeze=True, vocab=257), dict(param_dtype=torch.bfloat16, quantize_frozen="nf4")),
    ("llama_nf4_fp32_z2", dict(kind="llama", freeze=True), dict(zero_stage=2, quantize_frozen="nf4")),
    ("stack_z2_ratio", dict(kind="stack", n=5), dict(zero_stage=2, outsized_ratio=1.1)),
    # compact trainable gathers (records + staging areas), with an NF4 base in the same staging areas
    ("llama_fp8_bf16", dict(kind="llama", vocab=257), dict(param_dtype=torch.bfloat16, gather_dtype="fp8")),
    ("llama_int8_z2", dict(kind="llama"), dict(zero_stage=2, gather_dtype="int8")),
    ("llama_int8_nf4_bf16", dict(kind="llama", freeze=True),
     dict(param_dtype=torch.bfloat16, quantize_frozen="nf4", gather_dtype="int8")),
    # prefetch=2: a third weight buffer in the rotation (with its staging area for the NF4 records)
    ("llama_outsized_bf16_prefetch2", dict(kind="llama", vocab=1031, layers=4), dict(param_dtype=torch.bfloat16,
                                                                                     prefetch=2)),
    ("llama_nf4_bf16_prefetch2", dict(kind="llama", freeze=True, vocab=257),
     dict(param_dtype=torch.bfloat16, quantize_frozen="nf4", prefetch=2)),
]

# secondary_shard (engine/secondary.py): only where the shard group has a divisor below its size (world 4)
SECONDARY_CASES = [
    ("llama_outsized_int8_bf16_secondary", dict(kind="llama", vocab=1031, layers=4),
     dict(param_dtype=torch.bfloat16, gather_dtype="int8", secondary_shard=2)),
    ("llama_nf4_bf16_secondary", dict(kind="llama", freeze=True, vocab=257),
     dict(param_dtype=torch.bfloat16, quantize_frozen="nf4", secondary_shard=2)),
]


def _build(kind, freeze=False, **kw):
    if kind == "llama":
        model = tiny_llama(**kw)
        for name, p in model.named_parameters():  # a QLoRA-like base: frozen linears next to trainable ones
            if freeze and any(f in name for f in ("q_proj", "k_proj", "mlp", "lm_head", "embed")):
                p.requires_grad_(False)
        return model
    return Stack(**kw)


def _compare(rank, world):
    out = {}
    for name, build_kw, opts in CASES + (SECONDARY_CASES if world == 4 else []):
        with torch.device("meta"):
            meta = _build(**build_kw)
        plan = memory_plan(meta, world_size=world, rank=rank, **opts)
        model = yafsdp.YaFSDP(_build(**build_kw), **opts)
        own = model.memory_plan()
        assert [u.weight_free_bw for u in plan.units] == [u.weight_free_bw for u in own.units], name
        out[name] = (plan.engine_bytes(), own.engine_bytes(), model.allocated_bytes(), plan.num_params,
                     sum(p.numel() for p in _build(**build_kw).parameters()))
    return out


def _check(name, rank, res):
    meta_plan, own_plan, allocated, psi, true_psi = res
    assert meta_plan == allocated, (name, rank, meta_plan, allocated)
    if "nf4" in name:  # the NF4 shards and the weight buffers' staging areas are counted
        assert allocated["nf4"] > 0 and allocated["frozen"] > 0 and allocated["weight_small"] > 0
        assert any(k.endswith("_staging") and k.startswith("weight") for k in allocated), allocated
    for fmt in ("fp8", "int8"):  # the records of the trainable groups gathered compact are counted
        assert (allocated[fmt] > 0) == (fmt in name), (name, fmt, allocated)
        if fmt in name:
            assert any(k.endswith("_staging") and k.startswith("weight") for k in allocated), allocated
    assert own_plan == allocated, (name, rank)
    # [Note: prefetch depth]: three weight buffers of the largest layer, each with its staging area
    assert ("weight2" in allocated) == ("prefetch2" in name), (name, allocated)
    if "prefetch2" in name:
        assert allocated["weight2"] == allocated["weight0"] == allocated["weight1"], allocated
        assert ("weight2_staging" in allocated) == ("nf4" in name), allocated
    assert ("secondary" in allocated) == ("secondary" in name), (name, allocated)
    if "outsized" in name:  # See [Note: chunked outsized gradients]: no grad buffer of their own unless asked
        assert ("grad_outsized" in allocated) == name.endswith("_own") and "weight_outsized" in allocated, allocated
    if "accum" in name:  # the landing is as large as its grad buffer, the accumulator one fp32 shard
        grads = [k for k in allocated if k.startswith("grad") and k[4:] in ("0", "1", "_outsized", "_small")]
        assert len(grads) >= 3 and all(allocated[g + "_staging"] == allocated[g] for g in grads), allocated
        assert all(0 < allocated[g + "_accum"] <= allocated[g] for g in grads), allocated
    assert psi == true_psi, name
    assert sum(allocated.values()) > 0


def _check_staging(name, allocated, in_place):
    """[Note: reduce-scatter in place]: a grad buffer has a reduce staging on gloo, none where the
    backend reduces in place (NCCL; the fake process group stands for it); fp32 accumulation keeps
    its landing either way."""
    grads = [k[:-len("_staging")] for k in allocated if k.startswith("grad") and k.endswith("_staging")]
    assert grads, allocated
    for g in grads:
        if "accum" in name:
            assert allocated[g + "_staging"] == allocated[g], (name, g, allocated)
        else:
            assert (allocated[g + "_staging"] == 0) == in_place, (name, g, in_place, allocated)


def test_plan_equals_allocated_bytes_gloo_world3():
    """Every rank of a real gloo world of 3 (uneven: padding differs from a power of two)."""
    for rank, res in enumerate(run_ranks(_compare, 3)):
        for name, r in res.items():
            _check(name, rank, r)
            _check_staging(name, r[2], in_place=False)


def _world1(rank, world):
    """_compare at world 1, with each weight buffer's members: the units that still have one."""
    out = _compare(rank, world)
    for name, build_kw, opts in CASES:
        model = yafsdp.YaFSDP(_build(**build_kw), **opts)
        rt = model._rt
        # [Note: the world-1 cast gather]: under ZeRO-3 with a narrow param_dtype, a unit made only of
        # trainable parameters gathered in param_dtype casts its master into a buffer
        narrow = opts.get("param_dtype", torch.float32) != torch.float32 and opts.get("zero_stage", 3) == 3
        out[name] += ({u.name: type(u.buffer).__name__ for u in rt.all},
                      {u.name: bool(u.shape.staging_bytes or u.shape.gather_record or u.shape.nf4_record)
                       for u in rt.all},
                      {u.name: narrow and not u.shape.gather_record and u.shape.frozen is None and u.shape.nf4 is None
                       for u in rt.all},
                      rt.compute.numel(), narrow)
    return out


def test_plan_equals_allocated_bytes_world1():
    """[Note: the world-1 alias]: at world 1 (gloo, one rank) the plan still equals the allocations
    byte for byte in every configuration, and only the units with a compact group (NF4, fp8, int8:
    their records expand into the buffer) have a weight buffer; every other unit's parameters alias
    its shards, so a configuration without a compact group allocates no weight buffer at all. No
    grad buffer either, unless the reduce is narrow or accumulates pieces ([Note: world-1 gradients]).
    [Note: the world-1 cast gather]: under ZeRO-3 with bf16 compute, a unit of trainable parameters only
    has a buffer too, and no compute copy (a configuration whose units are all such has none at all)."""
    for name, r in run_ranks(_world1, 1)[0].items():
        meta_plan, own_plan, allocated, psi, true_psi, buffers, compact, cast, compute, narrow = r
        assert meta_plan == allocated == own_plan, (name, meta_plan, allocated)
        assert psi == true_psi, name
        for unit, kind in buffers.items():
            assert kind == ("WeightBuffer" if compact[unit] or cast[unit] else "ShardAlias"), (name, unit, kind)
        weights = [k for k in allocated if k.startswith("weight")]
        assert bool(weights) == any(compact.values()) or any(cast.values()), (name, weights)
        if all(cast.values()):
            assert compute == 0 and allocated["compute_copy"] == 0, (name, compute, allocated)
        # every bf16 ZeRO-3 case has such units (the norms' small group at least; the fp8/int8 cases their
        # embedding and head, gathered in bf16 by default)
        assert any(cast.values()) == narrow, name
        # [Note: world-1 gradients]: no grad buffer where the reduce is fp32 and nothing accumulates in pieces
        grad_buffers = [k for k in allocated if k.startswith("grad") and k not in ("grad", "grad_landing")]
        assert bool(grad_buffers) == ("reduce" in name or "accum" in name), (name, grad_buffers)


def _alias_vs_buffers(rank, world):
    """Three AdamW steps of two micro-batches each at world 1, with the world-1 alias and with every
    unit gathered into a buffer (the switch off): losses and final weights, per configuration."""
    from yafsdp.layout import sizing

    def build(variant):
        model = tiny_llama(seed=3, tie=variant == "tied_unused")
        if variant == "tied_unused":  # a parameter its unit's forward never reads: no gradient reaches it
            model.model.layers[0].unused = torch.nn.Parameter(torch.full((4, 4), 0.5))
        return model

    out = {}
    for bf16, zero, variant in [(b, z, "plain") for b in (False, True) for z in (3, 2)] + [
            (False, 3, "tied_unused"), (True, 2, "tied_unused")]:
        runs = []
        for on in (True, False):
            sizing.ALIAS_WORLD1 = on
            model = yafsdp.YaFSDP(build(variant), param_dtype=torch.bfloat16 if bf16 else None,
                                  zero_stage=zero)
            # bf16 under ZeRO-3: the units of trainable parameters cast into buffers ([Note: the world-1 cast gather])
            cast = on and bf16 and zero == 3  # (every unit of this model is made of trainable parameters)
            assert bool(model._rt.alias_buffers) == (on and not cast) and bool(model.weight_buffers) == (not on or cast)
            assert bool(model.grad_buffers) != on  # [Note: world-1 gradients]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses, grads = [], []
            for step in range(3):
                for micro in range(2):
                    loss = loss_of(model, "llama", batch("llama", step, micro, rank))
                    loss.backward()
                    losses.append(loss.item())
                grads.append(all_grads(model))  # every grad shard, padding included
                opt.step()
                opt.zero_grad()
            runs.append((losses, grads, model.full_state_dict()))
        (la, ga, sa), (lb, gb, sb) = runs
        out[f"{'bf16' if bf16 else 'fp32'}_z{zero}_{variant}"] = (
            la == lb and all(torch.equal(x, y) for x, y in zip(ga, gb)), [k for k in sa if not torch.equal(sa[k], sb[k])])
    sizing.ALIAS_WORLD1 = True
    return out


class _Branch(torch.nn.Module):
    """A block whose second linear is used only when asked (a conditional branch, an MoE expert)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x, use_b: bool):
        x = self.a(x)
        return self.b(x) if use_b else x


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.layers = torch.nn.ModuleList([_Branch() for _ in range(2)])

    def forward(self, x, use_b: bool):
        for layer in self.layers:
            x = layer(x, use_b)
        return x.square().mean()


def _sometimes_used(rank, world):
    """[Note: world-1 gradients] with parameters that get a gradient in some steps only: the grad
    shards after each step's backward, with the world-1 shortcuts and without (set_to_none both ways)."""
    from yafsdp.layout import sizing

    out = {}
    for set_to_none in (True, False):
        runs = []
        for on in (True, False):
            sizing.ALIAS_WORLD1 = on
            model = yafsdp.YaFSDP(_Branchy())  # units: the two blocks of the ModuleList
            assert bool(model.grad_buffers) != on
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            grads = []
            for step, use_b in enumerate((True, False, True, False)):
                model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)), use_b).backward()
                grads.append(all_grads(model))
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
            runs.append(grads)
        out[set_to_none] = all(torch.equal(x, y) for x, y in zip(*runs))
    sizing.ALIAS_WORLD1 = True
    return out


def test_world1_gradients_of_parameters_used_in_some_steps_only():
    """A parameter without a gradient in this step gets what the grad buffer's zeros gave it:
    zero after ``zero_grad()``, itself (+ 0) when gradients are kept."""
    assert run_ranks(_sometimes_used, 1)[0] == {True: True, False: True}


def test_world1_alias_trains_bit_for_bit_like_the_buffers():
    """[Note: the world-1 alias] and [Note: world-1 gradients] change where a unit's weights are read
    from and where its gradients are written, not a value: fp32 and bf16, ZeRO-3 and ZeRO-2, gradient
    accumulation, a tied head (two folds per backward) and a parameter no gradient reaches, the same
    losses and weights bit for bit."""
    for case, (same_losses, differ) in run_ranks(_alias_vs_buffers, 1)[0].items():
        assert same_losses and not differ, (case, differ)


@pytest.mark.parametrize("world", [2, 4])
def test_plan_equals_allocated_bytes_worlds(world):
    """Every rank of worlds 2 and 4, emulated one rank at a time with the fake process group (the
    engine allocates exactly as with real ranks; only the collectives do nothing)."""
    for rank, res in enumerate(_fake_results()["alloc"][world]):
        for name, r in res.items():
            _check(name, rank, r)
            _check_staging(name, r[2], in_place=True)


def test_plan_buffers_pure_rules():
    """The rules themselves: two alternating buffers sized by the largest regular unit; an outsized
    unit gets its own buffer; the small group its own; ZeRO-2 one buffer per unit."""
    from yafsdp.layout.flat import FlatLayout, ParamInfo
    from yafsdp.layout.sizing import UnitShape

    def flat(n):
        return FlatLayout.build([ParamInfo("w", torch.Size([n]), torch.float32, [])], 4, 1, 4)

    def lay(n):
        return UnitShape(flat(n), None)

    sizes = [10_000, 100, 120, 110, 9_000]
    layouts = [lay(n) for n in sizes]
    names = [f"u{i}" for i in range(5)]
    p = plan_buffers(names, layouts, lay(7), compute_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                   zero_stage=3, outsized_ratio=1.5)
    assert p.outsized == [True, False, False, False, True]
    w = {s.name: s for s in p.weight}
    assert set(w) == {"weight0", "weight1", "weight_outsized", "weight_small"}
    assert w["weight0"].capacity == w["weight1"].capacity == layouts[2].weight_numel
    assert w["weight_outsized"].capacity == layouts[0].weight_numel
    assert [p.weight[i].name for i in p.weight_of] == ["weight_outsized", "weight0", "weight1", "weight0",
                                                      "weight_outsized", "weight_small"]
    g = {s.name: s for s in p.grad}
    assert g["grad0"].dtype == torch.float32 and g["grad0"].shard_capacity == layouts[2].trainable_shard
    # bf16 reduce summed in fp32: the staging is the all-to-all's landing (world x shard = the buffer), plus
    # one fp32 shard of accumulator; 2 + 2 + 4/world bytes per element against fp32's 4 + 4/world
    acc = plan_buffers(names, layouts, lay(7), compute_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                       zero_stage=3, outsized_ratio=1.5, accumulate_fp32=True)
    a = {s.name: s for s in acc.grad}
    assert a["grad0"].shard_capacity == a["grad0"].capacity == layouts[2].trainable.padded_numel
    assert a["grad0"].accum_capacity == layouts[2].trainable_shard and a["grad0"].dtype == torch.bfloat16
    assert a["grad0"].nbytes == 2 * 2 * a["grad0"].capacity + 4 * a["grad0"].accum_capacity
    assert p.grad_chunk == [0] * 6 and p.chunk_slots == []
    # chunked outsized gradients: no grad_outsized slot; the outsized units go through the pair in
    # chunks of the pair's shard width (the largest regular unit's shard)
    for accum in (False, True):
        c = plan_buffers(names, layouts, lay(7), compute_dtype=torch.bfloat16,
                         reduce_dtype=torch.bfloat16 if accum else torch.float32, zero_stage=3, outsized_ratio=1.5,
                         accumulate_fp32=accum, chunk_outsized=True)
        assert [s.name for s in c.grad] == ["grad0", "grad1", "grad_small"]
        assert [s.nbytes for s in c.grad] == [s.nbytes for s in (acc if accum else p).grad if s.name != "grad_outsized"]
        assert c.grad_chunk == [layouts[2].trainable_shard, 0, 0, 0, layouts[2].trainable_shard, 0]
        assert [c.grad[i].name for i in c.chunk_slots] == ["grad0", "grad1"] and c.grad_of[0] == c.grad_of[4] == 0
        assert c.weight == p.weight
    z2 = plan_buffers(names, layouts, None, compute_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                    zero_stage=2, outsized_ratio=1.5)
    assert [s.capacity for s in z2.weight] == [x.weight_numel for x in layouts]
    # Frozen groups: the weight buffer holds both groups; grad buffers only the trainable group; an
    # all-frozen unit has no grad buffer at all.
    mixed = [UnitShape(flat(100), flat(60)), UnitShape(None, flat(130)), UnitShape(flat(90), None)]
    f = plan_buffers(["a", "b", "c"], mixed, None, compute_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                     zero_stage=3, outsized_ratio=1.5)
    assert {s.capacity for s in f.weight} == {mixed[0].weight_numel} == {flat(100).padded_numel + flat(60).padded_numel}
    assert f.grad_of[1] == -1 and {s.capacity for s in f.grad} == {flat(100).padded_numel}
    assert unit_align(torch.bfloat16, torch.float32, 16) == 8
    assert unit_align(torch.float32, torch.float32, 16) == 4


def test_llama3_8b_plan_and_zero_formula():
    """Built on the meta device (nothing allocated). The sharded model state is 18 bytes per
    parameter over N (fp32 master + fp32 grad + AdamW m, v + bf16 compute copy) up to padding; the
    ZeRO paper's 16 Psi/N differs by the fp32 grad shard (+2 Psi/N)."""
    model = build_llama("llama3-8b", device="meta")
    assert all(p.is_meta for p in model.parameters())
    psi = sum(p.numel() for p in model.parameters())
    assert abs(psi - 8_030_261_248) < 1e6
    n = 64
    p = memory_plan(model, world_size=n, param_dtype="bf16")
    assert p.num_params == psi
    assert abs(p.model_state - 18 * psi / n) / (18 * psi / n) < 1e-3
    z = p.zero_formula()
    assert abs(z["zero_paper"] - 16 * psi / n) < 1
    assert abs(z["ratio"] - 18 / 16) < 1e-3
    outs = {u.name for u in p.units if u.outsized}
    assert outs == {"model.embed_tokens", "lm_head"}
    assert {u.name for u in p.units if u.weight_free_bw} == {"model.embed_tokens"}
    assert "not re-gathered for backward (weight-free backward): model.embed_tokens" in p.format()
    layer = next(u for u in p.units if u.name == "model.layers.0")
    assert p.largest_unit == layer.padded_numel == 218_103_808  # one Llama-3-8B layer: 436 MB in bf16
    assert p.weight_buffers == 2 * 2 * layer.padded_numel
    # the bf16 weight; the gradients go through the grad pair in chunks ([Note: chunked outsized gradients])
    assert p.outsized_buffers == 2 * 128256 * 4096
    assert {u.grad_slot for u in p.units if u.outsized} == {"grad0/grad1 in 3 chunks"}  # 128256 x 4096 / L
    own = memory_plan(model, world_size=n, param_dtype="bf16", chunk_outsized_grads=False)
    assert own.outsized_buffers == (2 + 4) * 128256 * 4096 + 4 * 128256 * 4096 // n  # + fp32 grad and staging
    assert own.total - p.total == (4 + 4 / n) * 128256 * 4096
    # Activation checkpointing keeps far less.
    full = memory_plan(model, world_size=n, param_dtype="bf16", batch=1, seq=2048)
    ckpt = memory_plan(model, world_size=n, param_dtype="bf16", batch=1, seq=2048, checkpointing=True)
    assert 0 < ckpt.activations.saved < full.activations.saved / 3


def test_plan_cli_json(capsys):
    """The CLI's --json, in this process (test_plan_cli_takes_every_preset_helps_every_flag_and_does_not_warn
    runs both module entry points with --json as new interpreters)."""
    from yafsdp.plan import main

    main(["--preset", "llama3-8b", "--world-size", "64", "--batch", "1", "--seq", "1024", "--checkpointing", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert d["world_size"] == 64 and d["preset"] == "llama3-8b"
    roles = d["roles"]
    assert roles["master shard (fp32)"] == roles["grad shard (fp32)"] == 4 * d["shard_numel"]
    assert roles["optimizer state (adamw)"] == 8 * d["shard_numel"]
    assert roles["compute copy (bf16)"] == 2 * d["shard_numel"]
    assert roles["total"] == sum(v for k, v in roles.items() if k != "total")
    plan = main(["--preset", "llama3-1b", "--world-size", "8"])
    assert plan.units[0].outsized and plan.zero_formula()["ratio"] > 1
    assert "outsized units" in plan.format() and "ZeRO paper" in plan.format()
    # --async-save: the staging copy (12 bytes per trainable element / N with AdamW), on the host, in the total
    staged = main(["--preset", "llama3-1b", "--world-size", "8", "--async-save"])
    assert plan.checkpoint_staging == 0 and 0.99 < staged.checkpoint_staging / (12 * staged.num_params / 8) < 1.01
    assert staged.total == plan.total + staged.checkpoint_staging
    assert staged.host_total == staged.checkpoint_staging and "async-save staging copy" in staged.format()


def _llama_step(preset: str, device: torch.device, batch: int, seq: int, *, rank: int = 0, bf16: bool = False,
                layers: int | None = None, meta: bool = True, checkpointing: bool = False):
    """(build, step) for yafsdp.measure.measure_memory: ZeRO-3 around a preset Llama (built on the
    meta device, zero shards: memory only), torch's fused AdamW, random token batches."""
    over = {"num_hidden_layers": layers} if layers else {}

    def build():
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        model = build_llama(preset, device="meta" if meta else device, **over)
        if meta:  # buffers must be real; the engine allocates the shards
            model.model.rotary_emb = LlamaRotaryEmbedding(model.config).to(device)
        wrapped = yafsdp.YaFSDP(model, param_dtype=torch.bfloat16 if bf16 else None, device=device)
        if meta:
            wrapped.mark_loaded()
        if checkpointing:
            wrapped.module.gradient_checkpointing_enable()
        try:
            opt = torch.optim.AdamW(wrapped.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
        except (RuntimeError, ValueError):  # pragma: no cover - a build without fused AdamW here
            opt = torch.optim.AdamW(wrapped.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
        return wrapped, opt

    def step(engine, i):
        model, opt = engine
        g = torch.Generator().manual_seed(10_000 * i + rank)
        ids = torch.randint(0, model.module.config.vocab_size, (batch, seq), generator=g).to(device)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return build, step


# (preset, batch, seq, world, checkpointing); world 1: the grad shards made in backward, freed by zero_grad
PEAK_CASES = [("cpu-6x256", 2, 64, 4, False), ("cpu-6x256", 2, 128, 8, True), ("cpu-6x256", 2, 64, 1, False)]
_FAKE: dict = {}


def _fake_checks(rank, world):
    """In one spawned process, with the fake process group (no other threads, so the torch CPU
    allocator's live bytes are measured exactly from the profiler's memory events):
    the allocation check for every rank of worlds 2 and 4, and plan vs measured peak."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.destroy_process_group()
    alloc = {}
    for w in (2, 4):
        alloc[w] = []
        for r in range(w):
            dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=w)
            alloc[w].append(_compare(r, w))
            dist.destroy_process_group()
    peaks = []
    for preset, b, s, w, ckpt in PEAK_CASES:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=w)
        meta = build_llama(preset, device="meta")
        plan = memory_plan(meta, world_size=w, batch=b, seq=s, checkpointing=ckpt)

        build, step = _llama_step(preset, torch.device("cpu"), b, s, checkpointing=ckpt)
        m = measure_memory(build, step, 3, torch.device("cpu"), method="torch")
        peaks.append((plan.total, plan.engine_total + plan.optimizer_state, m["peak_steady"], m["step_end"],
                      m["growth_from_step2"]))
        dist.destroy_process_group()
    dist.init_process_group("gloo", rank=0, world_size=1)
    return dict(alloc=alloc, peaks=peaks)


def _fake_results():
    if not _FAKE:
        _FAKE.update(run_ranks(_fake_checks, 1)[0])
    return _FAKE


def test_predicted_peak_matches_measured_cpu():
    """Predicted peak (engine + optimizer + activations) within 10% of the measured peak; the
    state between steps as planned; no growth from step 2 on."""
    for (total, state, peak, ends, growth), case in zip(_fake_results()["peaks"], PEAK_CASES):
        # Between steps: the engine and the optimizer state, as planned (+ AdamW's scalar step counters).
        assert 0 <= ends[-1] - state <= 64 * 16, (case, ends, state)
        assert growth == 0, case
        assert abs(total - peak) / peak <= 0.10, (case, total, peak)


def _gpu_peak(rank, world):
    dev = torch.device("cuda", 0)
    b, s = 2, 1024
    meta = build_llama("llama3-1b", device="meta", num_hidden_layers=4)
    plan = memory_plan(meta, world_size=world, rank=rank, param_dtype="bf16", batch=b, seq=s)
    build, step = _llama_step("llama3-1b", dev, b, s, rank=rank, bf16=True, layers=4, meta=False)
    m = measure_memory(build, step, 3, dev)
    return plan.total, m["peak_steady"], m["growth_from_step2"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_predicted_peak_matches_measured_gpu():
    total, peak, growth = run_ranks(_gpu_peak, 1, backend="nccl")[0]
    assert growth == 0
    assert abs(total - peak) / peak <= 0.10, (total, peak)


def test_plan_cli_takes_every_preset_helps_every_flag_and_does_not_warn():
    """One preset table (yafsdp.presets) for the plan, the job and the benchmarks; both spellings
    of the CLI run without runpy's RuntimeWarning; every flag has a help text."""
    import os

    from yafsdp.plan.cli import parser as _parser
    from yafsdp.presets import PRESETS, TRAINING

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from pretrain.presets import DEFAULT_PRESET, presets

    assert set(presets()) == set(PRESETS) == set(TRAINING) and DEFAULT_PRESET in PRESETS
    ap = _parser()
    assert set(next(a for a in ap._actions if a.dest == "preset").choices) == set(PRESETS)
    assert [a.dest for a in ap._actions if not a.help] == []
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    def start(*args):  # the three interpreters run at once (each is mostly torch's import)
        return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=root)

    runs = [(cmd, start(*cmd, "--preset", DEFAULT_PRESET, "--world-size", "2", "--json"))
            for cmd in (["-m", "yafsdp.plan"], ["-m", "yafsdp", "plan"])]
    nope = start("-m", "yafsdp", "nope")
    for cmd, proc in runs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and err == "", (cmd, err)
        d = json.loads(out)
        assert d["preset"] == "cpu-4x128" and d["num_params"] == 869_504  # the job's 0.87 M model
    _, err = nope.communicate(timeout=120)
    assert nope.returncode == 2 and "unknown command 'nope'; choose one of: plan" in err


def test_repeated_blocks_are_never_outsized():
    """[Note: outsized units]: on every preset no decoder layer is outsized, and on a tiny model
    (vocab 256, hidden 64, 2 layers: half the units are embedding/head, so the old median rule
    picked the embedding's size and put both layers in the outsized buffer) nothing is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from yafsdp.plan import repeated_blocks
    from yafsdp.presets import PRESETS

    assert repeated_blocks(["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]) == [
        False, True, True, False]
    assert repeated_blocks(["0", "1", "2"]) == [True] * 3 and repeated_blocks(["a.0", "b.0", "u1"]) == [False] * 3
    for name in PRESETS:
        p = memory_plan(build_llama(name, device="meta"), world_size=8, param_dtype="bf16")
        layers = [u for u in p.units if ".layers." in u.name]
        assert layers and not any(u.outsized for u in layers), name
        assert p.largest_unit == max(u.padded_numel for u in p.units if not u.outsized), name
        big = {u.name for u in p.units if u.outsized}
        # llama3-70b's embedding (1.05 G) is under 1.5 x a layer (0.86 G): it shares the pair.
        assert big == ({"model.embed_tokens", "lm_head"} if name in ("cpu-6x256", "llama3-8b")
                       else {"model.embed_tokens"} if name in ("llama3-1b", "llama3-3b") else set()), (name, big)
    with torch.device("meta"):
        small = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    p = memory_plan(small, world_size=2)
    assert [(u.name, u.outsized) for u in p.units] == [
        ("model.embed_tokens", False), ("model.layers.0", False), ("model.layers.1", False), ("lm_head", False)]
    assert {s.name for s in p.slots} == {"weight0", "weight1", "weight_small", "grad0", "grad1", "grad_small"}


def test_plan_of_a_frozen_nf4_base():
    """python -m yafsdp plan --frozen-base nf4: a QLoRA base of Llama-3-8B on 8 ranks holds its linear
    weights as NF4 records (0.5 + 2/64 bytes per parameter in bf16) and the rest frozen in bf16; no
    master, grad or optimizer state; the weight buffers carry the NF4 staging areas."""
    from yafsdp.plan.cli import main

    plans = {fb: main(["--preset", "llama3-8b", "--world-size", "8", "--frozen-base", fb, "--json"])
             for fb in ("bf16", "nf4")}
    bf, q = plans["bf16"], plans["nf4"]
    assert bf.master == q.master == 0 and bf.optimizer_state == q.optimizer_state == 0 and bf.nf4 == 0
    embed = 128256 * 4096  # the embedding stays bf16; every linear weight (lm_head included) is NF4
    linear = bf.num_params - embed - (32 * 2 + 1) * 4096
    assert abs(q.nf4 - linear * (0.5 + 2 / 64) / 8) < 1e6, (q.nf4, linear)
    assert abs(q.frozen - (embed + 65 * 4096) * 2 / 8) < 1e5
    assert q.model_state < 0.32 * bf.model_state  # the bf16 embedding (1 B of the 8 B parameters) stays
    staging = [s for s in q.slots if s.kind == "weight" and s.staging_bytes]
    assert staging and "frozen NF4 shard" in q.format()


def _qlora_model(preset: str, rank_r: int = 64, **overrides):
    """A QLoRA model on the meta device: the preset's base frozen, PEFT LoRA of rank ``rank_r`` on
    every linear layer (target_modules="all-linear": not lm_head), as ``--lora-rank`` plans it."""
    import peft
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model = build_llama(preset, device="meta", **overrides)
    model.model.rotary_emb = LlamaRotaryEmbedding(model.config)  # real buffers: the engine broadcasts them
    model.requires_grad_(False)
    return peft.get_peft_model(model, peft.LoraConfig(r=rank_r, lora_alpha=2 * rank_r, target_modules="all-linear",
                                                      lora_dropout=0.0), low_cpu_mem_usage=True)  # as the CLI


QLORA_OPTS = dict(param_dtype="bf16", quantize_frozen="nf4", offload="optimizer")


def test_plan_cli_lora_targets_are_the_adapters_planned():
    """--lora-targets reaches PEFT: q,k,v,o (the fine-tuning job's default) plans the adapters of those
    four layers, r x (in + out) each, as memory_plan does for the same PEFT model; the default
    (all-linear) plans more."""
    import contextlib
    import io

    import peft

    from yafsdp.plan.cli import main

    def cli(*extra):
        with contextlib.redirect_stdout(io.StringIO()):
            return main(["--preset", "cpu-4x128", "--world-size", "1", "--lora-rank", "8", *extra])

    qkvo = cli("--lora-targets", "q_proj,k_proj,v_proj,o_proj")
    every = cli()
    model = build_llama("cpu-4x128", device="meta")
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    want = memory_plan(model, world_size=1, param_dtype="bf16")
    assert (qkvo.master, qkvo.optimizer_state, qkvo.frozen) == (want.master, want.optimizer_state, want.frozen)
    h = model.config.hidden_size
    kv = model.config.num_key_value_heads * (h // model.config.num_attention_heads)
    lora = model.config.num_hidden_layers * 8 * (2 * (h + h) + 2 * (h + kv))  # q, o; k, v: r x (in + out)
    assert lora == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 4 * lora <= qkvo.master < 4 * lora + 4096, (qkvo.master, lora)  # padded to the units' alignment
    assert every.master > qkvo.master


def test_llama2_70b_qlora_offload_plan_on_2_gpus():
    """The plan's QLoRA figure: Llama-2-70B QLoRA (NF4 base, LoRA r=64 on all linear layers), seq 2048,
    activation checkpointing, 2 GPUs. offload="all" (adapters' fp32 state and the NF4/bf16 frozen
    shards on the host) plans 8.84 GiB per GPU: under the 24 GiB goal. offload="optimizer" alone
    plans 25.59 GiB, over it: the NF4 base is 17.0 GiB per GPU at N=2 and stays on the device.
    (9.48 and 26.23 GiB before the activation peak of a checkpointed set was modelled per block:
    [Note: the peak of a checkpointed set]; the recompute no longer overlaps the head's transient.)"""
    from yafsdp.layout.sizing import GiB

    model = _qlora_model("llama2-70b")
    kw = dict(world_size=2, param_dtype="bf16", quantize_frozen="nf4", batch=1, seq=2048, checkpointing=True)
    p = memory_plan(model, offload="optimizer", **kw)
    lora = 80 * 64 * (2 * 16384 + 2 * 9216 + 3 * 36864)  # q, o; k, v; gate, up, down: r x (in + out)
    assert abs(p.master - 4 * lora / 2) < 1e6 and p.placement()["master"] == "host"
    assert p.host_total == p.master + p.grad + p.optimizer_state + p.compute_host + p.grad_landing
    assert p.device_total == p.total - p.host_total
    assert 16.9 < p.nf4 / GiB < 17.1  # the 4-bit base: (0.5 + 2/64) bytes x 68.7 G linear weights / 2
    assert 25.4 < p.device_total / GiB < 25.8, p.device_total / GiB  # 25.59 GiB: over the 24 GiB goal
    every = memory_plan(model, offload="all", **kw)
    assert every.placement()["nf4"] == every.placement()["frozen"] == "host"
    assert every.device_total <= 24 * GiB and 8.6 < every.device_total / GiB < 9.1, every.device_total / GiB
    # the frozen shards leave the device; each weight buffer gains a landing for one unit's shards
    landing = sum(v for k, v in every.engine_bytes().items() if k.endswith("_landing") and k.startswith("weight"))
    assert 0 < landing < 0.6 * GiB
    assert every.device_total == p.device_total - p.nf4 - p.frozen + landing
    without = memory_plan(model, world_size=2, param_dtype="bf16", quantize_frozen="nf4")
    # offload moves 16 bytes per trainable parameter / N off the device (fp32 master, grad, AdamW m, v)
    assert (without.device_total - (p.device_total - p.activations.total)) == 16 * p.master // 4
    text = every.format()
    assert "per GPU (device)" in text and "frozen landing" in text


def _qlora_8b_fake(rank, world):
    """Fake process group, one process: a QLoRA Llama-3-8B (its shapes: hidden 4096, intermediate
    14336, vocab 128256; 2 of its 32 layers and 16 tokens, to keep the CPU step short) with offload, planned and
    measured (exact torch CPU allocations: host and device are both the CPU here). The compute is fp32: on a CPU
    without AVX-512 (an AMD EPYC with AVX2 here) torch's bf16 matmul of a gradient by a row-major weight runs at
    ~0.3 GFLOP/s, so the bf16 step took ~10 minutes there (13 s on an AVX-512 machine); the bf16 placement with
    offload (its host compute copy included) is the plan's to the byte in tests/multirank/test_offload.py."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.destroy_process_group()
    w, b, s = 8, 1, 16
    opts = dict(QLORA_OPTS, param_dtype=None)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=w)

    def build():
        model = yafsdp.YaFSDP(_qlora_model("llama3-8b", num_hidden_layers=2), **opts, device="cpu")
        model.mark_loaded()
        model.module.gradient_checkpointing_enable()
        return model, yafsdp.FusedAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    plan = memory_plan(_qlora_model("llama3-8b", num_hidden_layers=2), world_size=w, batch=b, seq=s,
                       checkpointing=True, **opts)
    m = measure_memory(build, random_tokens_step(128256, b, s), 3, torch.device("cpu"), method="torch")
    dist.destroy_process_group()
    dist.init_process_group("gloo", rank=0, world_size=1)
    return plan.total, plan.engine_total + plan.optimizer_state, plan.host_total, m


def test_qlora_offload_8b_fake_pg_confirms_the_plan():
    total, state, host, m = run_ranks(_qlora_8b_fake, 1)[0]
    assert host > 0 and m["growth_from_step2"] == 0
    assert 0 <= m["step_end"][-1] - state <= 64 * 16, (m["step_end"], state)
    assert abs(total - m["peak_steady"]) / m["peak_steady"] <= 0.10, (total, m["peak_steady"])


@pytest.mark.parametrize("argv, says", [
    (["--reduce-dtype", "bf16", "--reduce-accum-dtype", "fp32", "--offload", "optimizer"],
     "reduce_accum_dtype=torch.float32 with offload='optimizer' is not supported yet"),
    (["--outsized-ratio", "0"], "outsized_ratio=0.0 is not a positive number"),
    (["--budget", "lots", "--batch", "1"], "--budget: memory budget 'lots': write a number with a unit"),
    (["--budget", "8GiB"], "--budget chooses the checkpointed blocks for a step: give --batch"),
    (["--world-size", "0"], "--world-size 0: give the number of ranks"),
    (["--world-size", "4", "--rank", "4"], "--rank 4 is not a rank of the 4 ranks"),
    (["--batch", "0"], "--batch 0: give a positive number"),
    (["--lora-targets", "q_proj"], "--lora-targets q_proj without --lora-rank: give the adapters' rank too"),
    (["--lora-rank", "8", "--lora-targets", "q_proj,attn"],
     "--lora-targets q_proj,attn: 'attn' matches no linear module of cpu-4x128; its linear modules are down_proj, "),
    (["--world-size", "16", "--hsdp", "2", "--secondary-shard", "3"],
     "secondary_shard=3 does not divide the shard group's 8 ranks"),
    (["--zero-stage", "2", "--secondary-shard", "2"], "secondary_shard=2 with zero_stage=2 is refused"),
    (["--world-size", "8", "--tp", "3"], "--tp 3 does not divide --world-size 8"),
    (["--world-size", "8", "--tp", "4"], "--tp 4: TP degree 4 does not divide the model's num_key_value_heads (2)"),
    (["--tp", "2", "--tp-rank", "2"], "--tp-rank 2 is not a coordinate of --tp 2"),
    (["--tp", "2", "--batch", "1", "--seq", "7"], "--seq 7 with --tp 2: sequence parallelism splits the sequence"),
    (["--loss-parallel"], "--loss-parallel splits the logits over the TP ranks; it needs --tp T with T > 1"),
    (["--tp", "2", "--gather-dtype", "fp8"], "--tp 2: gather_dtype='fp8' (compact fp8/int8 gathers) together with "
                                             "tensor-parallel"),
])
def test_plan_cli_refuses_with_usage_not_a_traceback(argv, says, capsys):
    """A refused combination of options (yafsdp.layout.config.build_config's own refusals among them) is the
    parser's error: its usage, the message, exit status 2, before any model is built."""
    from yafsdp.plan.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--preset", "cpu-4x128", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("usage: python -m yafsdp plan") and f"python -m yafsdp plan: error: {says}" in err, err


def test_plan_backend_decides_the_reduce_staging():
    """A plain module's plan follows the backend it is given (the CLI's --backend; default: the
    initialized group's, else NCCL with CUDA and gloo without): NCCL reduces in place, so the two
    plans differ by exactly the grad buffers' staging shards."""
    meta = build_llama("cpu-6x256", device="meta")
    nccl = memory_plan(meta, world_size=8, param_dtype="bf16", backend="nccl")
    gloo = memory_plan(meta, world_size=8, param_dtype="bf16", backend="gloo")
    staging = sum(s.shard_capacity * 4 for s in gloo.slots if s.kind == "grad")
    assert staging > 0 and all(s.shard_capacity == 0 for s in nccl.slots if s.kind == "grad")
    assert gloo.total - nccl.total == staging
    acc = [memory_plan(meta, world_size=8, param_dtype="bf16", reduce_dtype="bf16", reduce_accum_dtype="fp32",
                       backend=b).total for b in ("nccl", "gloo")]
    assert acc[0] == acc[1]  # the all-to-all's landing is needed on every backend


def test_grad_buffer_reduces_into_its_own_slice():
    """In place, the reduce's output is this rank's slice of the buffer (NCCL's in-place form:
    output = input + rank x count) and no staging is allocated; otherwise the staging shard."""
    from yafsdp.engine.buffers import GradBuffer

    class Recording:
        def __init__(self):
            self.calls = []

        def grad_sync(self):
            return None

        def reduce(self, sync, out, full, unit, then, pieces=False):
            self.calls.append((out, full))
            then()

    for rank in (0, 2, 3):
        sched = Recording()
        gb = GradBuffer("grad0", 64, 0, torch.float32, torch.device("cpu"), sched, in_place_rank=rank)
        folded = []
        gb.reduce("u", 40, 10, folded.append)
        out, full = sched.calls[0]
        assert gb.staging.numel() == 0 and full.data_ptr() == gb.data.data_ptr() and full.numel() == 40
        assert out.data_ptr() == gb.data[rank * 10:].data_ptr() and out.numel() == 10 and folded[0] is out
    sched = Recording()
    gb = GradBuffer("grad0", 64, 16, torch.float32, torch.device("cpu"), sched)
    gb.reduce("u", 40, 10, lambda r: None)
    assert sched.calls[0][0].data_ptr() == gb.staging.data_ptr()


def test_plan_of_the_secondary_shard():
    """``secondary_shard=N`` ([Note: the secondary shard] in engine/secondary.py): the layers, which
    alternate over the pair, keep 1/N of their gathered bytes; the weight-free embedding and the head
    that shares the outsized buffer only with it (never evicted before its backward) keep none; the
    store is one role, the sum of the rows, on the device; off (0 or 1) it is absent. The allocation
    itself is compared in tests/multirank/test_secondary_shard.py (it needs a group to split)."""
    from yafsdp.layout.sizing import round16

    with torch.device("meta"):
        meta = _build(kind="llama", vocab=1031, layers=4)
    for opts in (dict(), dict(param_dtype=torch.bfloat16, gather_dtype="int8")):
        off = memory_plan(meta, world_size=8, **opts)
        plan = memory_plan(meta, world_size=8, secondary_shard=4, **opts)
        rows = {u.name: u for u in plan.units}
        assert [rows[n].outsized for n in ("model.embed_tokens", "lm_head")] == [True, True]
        layers = [n for n in rows if n.startswith("model.layers.")]
        assert rows["model.embed_tokens"].secondary_bytes == rows["lm_head"].secondary_bytes == 0
        for n in layers:  # 1/4 of what the gather brings (records for int8), each group on a 16-byte line
            assert rows[n].gather_bytes // 4 <= rows[n].secondary_bytes <= rows[n].gather_bytes // 4 + 16 * 2, n
        assert plan.engine_bytes()["secondary"] == sum(u.secondary_bytes for u in plan.units) > 0
        assert plan.engine_total == off.engine_total + plan.secondary
        assert plan.placement()["secondary"] == "device" and "secondary" not in off.engine_bytes()
        assert all(u.secondary_bytes == round16(u.secondary_bytes) for u in plan.units)
        said = "secondary shard: backward gathers within groups of 4 ranks for " + ", ".join(layers) + ";"
        assert said in plan.format()
        assert memory_plan(meta, world_size=8, secondary_shard=1, **opts).engine_bytes() == off.engine_bytes()


def test_plan_with_a_tp_degree():
    """``memory_plan(..., tp=N)`` of a plain Llama: each parameter at its local shape under llama_tp_plan
    (colwise dim 0, rowwise dim 1, the embedding's and the head's vocabulary rows as torch.chunk splits them,
    norms whole); equal to a real dp x TP engine's allocations: tests/multirank/test_tp.py. Refused: a TP degree
    that does not split a dimension, a model that is not Llama's, a sequence that sequence parallelism cannot
    split, a TP option."""
    from yafsdp.integrations.tp_plans import llama_tp_local_shapes
    from yafsdp.plan.cli import main

    model = tiny_llama(vocab=67)
    shapes = llama_tp_local_shapes(model, 2, 1)
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    assert shapes[f"{attn}.q_proj.weight"] == (16, 32) and shapes[f"{attn}.k_proj.weight"] == (8, 32)
    assert shapes[f"{attn}.o_proj.weight"] == (32, 16) and shapes[f"{mlp}.down_proj.weight"] == (32, 22)
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (33, 32)  # 67 rows: 34 on TP rank 0
    assert "model.norm.weight" not in shapes and "model.layers.0.input_layernorm.weight" not in shapes
    local = {r: memory_plan(model, world_size=2, tp=2, tp_rank=r, backend="gloo") for r in (0, 1)}
    whole = memory_plan(model, world_size=2, backend="gloo")
    norms = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    assert local[0].num_params - local[1].num_params == 2 * 32  # one vocabulary row each of embedding and head
    assert local[1].num_params == (whole.num_params - norms) // 2 - 32 + norms
    assert "TP degree 2" in local[0].notes[-1]

    def refused(**kw):
        with pytest.raises(ValueError) as e:
            memory_plan(kw.pop("m", model), world_size=2, **kw)
        return str(e.value)

    assert "does not divide the model's num_key_value_heads (2)" in refused(tp=4)
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        wide = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=42, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=4))
    assert "does not divide the model's intermediate_size (42)" in refused(m=wide, tp=4)
    assert "tp_rank=2" in refused(tp=2, tp_rank=2)
    assert "which is Llama's" in refused(m=Stack(), tp=2) and "model.layers[*].self_attn" in refused(m=Stack(), tp=2)
    assert "sequence parallelism splits the sequence over the TP ranks; give a multiple of 2" in refused(
        tp=2, batch=1, seq=7)
    assert "quantize_frozen='nf4'" in refused(tp=2, quantize_frozen="nf4")
    # the CLI: --world-size counts every rank, the plan is sharded over world-size / tp of them
    cli = main(["--preset", "cpu-4x128", "--world-size", "4", "--tp", "2", "--json"])
    assert cli.world_size == 2 and cli.num_params < 869_504 // 2 + 4 * 128 * 2
    # --batch with --tp: the activations traced on a TP mesh over the fake process group, set up and taken down
    # by the plan ([Note: the activation trace under tensor parallelism]; checked against a measured dp 2 x TP 2
    # peak in tests/multirank/test_activation_checkpointing.py)
    act = {(tp, lp): main(["--preset", "cpu-4x128", "--world-size", "4", "--tp", str(tp), "--batch", "2", "--seq",
                           "64", "--json", *lp]).activations.trace
           for tp, lp in ((1, ()), (2, ()), (2, ("--loss-parallel",)))}
    assert not torch.distributed.is_initialized()
    one, two, lp = act[1, ()], act[2, ()], act[2, ("--loss-parallel",)]
    assert all(a / 2 < b < a for a, b in zip(one.per_block, two.per_block)), (one, two)
    assert lp.per_block == two.per_block and lp.after < two.after < one.after, (one, two, lp)


def test_plan_report_counts_the_prefetch_buffers():
    """[Note: prefetch depth]: the report's weight-buffer line says how many buffers take turns, and with
    prefetch=2 the third is one more of the largest regular unit."""
    with torch.device("meta"):
        model = tiny_llama(layers=4)
    one, two = (memory_plan(model, world_size=2, prefetch=pf) for pf in (1, 2))
    assert "weight buffers (x2)" in one.format() and "weight buffers (x3)" in two.format()
    assert two.weight_buffers - one.weight_buffers == one.weight_buffers // 2 > 0
