"""Buffer invariants (two weight + two grad buffers, fixed storages, outsized units) and the full
state dict (keys, values, round trip, refusal of bad dicts without modification)."""
import pytest
import torch
from torch import nn

import yafsdp
from dist_utils import run_ranks
from models import VOCAB, Stack, batch, loss_of, tiny_llama


def _pointers(model):
    ptrs = {s.name: s.data.data_ptr() for s in model.weight_buffers}
    ptrs.update({s.name: s.data.data_ptr() for s in model.grad_buffers})
    ptrs.update({s.name + ".staging": s.staging.data_ptr() for s in model.grad_buffers})
    for u in model.flat_units:
        ptrs[u.name + ".master"] = u.flat_param.data_ptr()
        ptrs[u.name + ".aliases"] = tuple(a.data_ptr() for a in u.aliases)
        if u.flat_param.grad is not None:
            ptrs[u.name + ".grad"] = u.flat_param.grad.data_ptr()
    return ptrs


def _invariants(rank, world, zero_stage, vocab, param_dtype):
    model = yafsdp.YaFSDP(tiny_llama(vocab=vocab), zero_stage=zero_stage, param_dtype=param_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = []  # (unit weight tensor ptr, in which buffer) during forward
    slot_ranges = [(s.name, s.data.data_ptr(), s.data.data_ptr() + s.data.numel() * s.data.element_size())
                   for s in model.weight_buffers]

    def where(t):
        for name, lo, hi in slot_ranges:
            if lo <= t.data_ptr() < hi:
                return name
        return None

    hooks = [
        model.module.model.layers[i].self_attn.q_proj.register_forward_pre_hook(
            lambda m, a, i=i: seen.append((i, where(m.weight), m.weight.requires_grad)))
        for i in range(3)
    ]
    hooks.append(model.module.lm_head.register_forward_pre_hook(lambda m, a: seen.append(("head", where(m.weight), True))))
    ptrs = []
    for step in range(3):
        loss = loss_of(model, "llama", batch("llama", step, 0, rank))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        ptrs.append(_pointers(model))
    for h in hooks:
        h.remove()
    return dict(
        slots=[(s.name, s.capacity, str(s.data.dtype)) for s in model.weight_buffers],
        grad_buffers=[(s.name, s.capacity, str(s.data.dtype)) for s in model.grad_buffers],
        units=[(u.name, u.layout.padded_numel, u.buffer.name, u.grad_buffer.name, u.outsized, u.grad_chunk)
               for u in model.flat_units],
        ptrs=ptrs, seen=seen, bytes=model.allocated_bytes(),
    )


INVARIANT_CASES = [(3, VOCAB, None), (3, 1000, torch.bfloat16), (2, 1000, None)]


def _every_invariant(rank, world):
    return [_invariants(rank, world, *case) for case in INVARIANT_CASES]


@pytest.fixture(scope="module")
def invariants():
    """The three cases in one spawn of 2 ranks (rank 0's results, in INVARIANT_CASES' order)."""
    return run_ranks(_every_invariant, 2)[0]


@pytest.mark.parametrize("zero_stage,vocab,dtype", INVARIANT_CASES)
def test_buffer_invariants(zero_stage, vocab, dtype, invariants):
    r = invariants[INVARIANT_CASES.index((zero_stage, vocab, dtype))]
    # Storages never change after step 1.
    assert r["ptrs"][0] == r["ptrs"][1] == r["ptrs"][2]
    weight = [s for s in r["slots"] if s[0] != "weight_small"]
    grads = [s for s in r["grad_buffers"] if s[0] != "grad_small"]
    units = {u[0]: u for u in r["units"]}
    layers = [units[f"model.layers.{i}"] for i in range(3)]
    outsized = vocab > VOCAB
    assert units["model.embed_tokens"][4] == outsized and units["lm_head"][4] == outsized
    assert not any(u[4] for u in layers)
    if zero_stage == 3:
        regular = [s for s in weight if s[0] in ("weight0", "weight1")]
        assert len(regular) == 2 and len(weight) == 2 + outsized
        # Even and odd units alternate between the two buffers.
        assert [u[2] for u in layers] == ["weight0", "weight1", "weight0"] or [u[2] for u in layers] == ["weight1", "weight0", "weight1"]
        if outsized:
            # The big embedding and head share one buffer and do not inflate the alternating two.
            assert units["model.embed_tokens"][2] == units["lm_head"][2] == "weight_outsized"
            assert regular[0][1] == max(u[1] for u in layers)
            assert dict((s[0], s[1]) for s in weight)["weight_outsized"] == units["lm_head"][1]
    else:
        assert len(weight) == len(units) - 1  # ZeRO-2: every unit keeps its own gathered weights
    # No grad buffer of their own for the outsized units: their gradients go through the pair in column chunks
    # (chunk_outsized_grads=True, the default; docs/reduce.md "Memory").
    assert len([s for s in grads if s[0] in ("grad0", "grad1")]) == 2 and len(grads) == 2
    assert (units["model.embed_tokens"][5] > 0) == outsized and (units["lm_head"][5] > 0) == outsized
    assert not any(u[5] for u in layers)
    assert all(s[2] == "torch.float32" for s in r["grad_buffers"])  # reduce_dtype
    if dtype is not None:
        assert all(s[2] == "torch.bfloat16" for s in r["slots"])
    # During forward, each unit's weights are views into its weight buffer.
    assert r["seen"], "hooks did not run"
    for what, buf, req in r["seen"]:
        expect = units["lm_head" if what == "head" else f"model.layers.{what}"][2]
        assert buf == expect and req
    # allocated_bytes agrees with the buffers.
    assert r["bytes"]["weight_small"] > 0 and r["bytes"]["master"] == r["bytes"]["grad"]


def _state_dict_roundtrip(rank, world):
    out = {}
    for tie in (False, True):
        orig = tiny_llama(tie=tie)
        expected = {k: v.clone() for k, v in orig.state_dict().items()}
        model = yafsdp.YaFSDP(orig)
        sd = model.full_state_dict()
        out[f"keys{tie}"] = (list(sd), list(expected)) if rank == 0 else sd
        if rank == 0:
            out[f"equal{tie}"] = all(torch.equal(sd[k], expected[k]) for k in expected)
            out[f"cpu{tie}"] = all(v.device.type == "cpu" and v.shape == expected[k].shape for k, v in sd.items())
        # Load a modified dict and read it back.
        new = {k: v + 1 for k, v in expected.items()} if rank == 0 else None
        if rank == 0 and tie:
            new["lm_head.weight"] = new["model.embed_tokens.weight"]
        model.load_full_state_dict(new)
        back = model.full_state_dict()
        if rank == 0:
            out[f"roundtrip{tie}"] = all(torch.equal(back[k], new[k]) for k in new)
        # The loaded weights are used by the next forward (the compute copies were refreshed).
        ref = tiny_llama(tie=tie)
        if rank == 0:
            ref.load_state_dict(new)
        ids = batch("llama", 0, 0, 0)["input_ids"]
        with torch.no_grad():
            a = model(input_ids=ids).logits
            b = ref(input_ids=ids).logits if rank == 0 else a
        out[f"logits{tie}"] = torch.allclose(a, b, atol=1e-5) if rank == 0 else True
        # Bad dicts: refused on every rank, nothing modified.
        before = model.full_state_dict()
        for bad_name in ("missing", "unexpected", "shape"):
            bad = dict(new) if rank == 0 else None
            if rank == 0:
                if bad_name == "missing":
                    del bad["model.layers.1.mlp.up_proj.weight"]
                elif bad_name == "unexpected":
                    bad["model.layers.9.extra"] = torch.zeros(3)
                else:
                    bad["model.norm.weight"] = torch.zeros(31)
                for k in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
                    bad[k] = bad[k] * 0  # would change weights if anything were applied
            try:
                model.load_full_state_dict(bad)
                out[f"{bad_name}{tie}"] = None
            except ValueError as e:
                out[f"{bad_name}{tie}"] = str(e)
        after = model.full_state_dict()
        out[f"untouched{tie}"] = all(torch.equal(before[k], after[k]) for k in before) if rank == 0 else True
    # Original dtype is kept (a bf16 model gives bf16 tensors back).
    m16 = Stack().to(torch.bfloat16)
    exp16 = {k: v.clone() for k, v in m16.state_dict().items()}
    sd16 = yafsdp.YaFSDP(m16).full_state_dict()
    out["bf16"] = all(sd16[k].dtype == torch.bfloat16 and torch.equal(sd16[k], exp16[k]) for k in exp16) if rank == 0 else sd16 == {}
    return out


def test_full_state_dict():
    r0, r1 = run_ranks(_state_dict_roundtrip, 2)
    for tie in (False, True):
        keys, expected = r0[f"keys{tie}"]
        assert keys == expected and ("lm_head.weight" in keys)
        assert r1[f"keys{tie}"] == {}
        assert r0[f"equal{tie}"] and r0[f"cpu{tie}"] and r0[f"roundtrip{tie}"] and r0[f"logits{tie}"]
        for r in (r0, r1):
            assert "missing keys" in r[f"missing{tie}"] and "model.layers.1.mlp.up_proj.weight" in r[f"missing{tie}"]
            assert "unexpected keys" in r[f"unexpected{tie}"] and "model.layers.9.extra" in r[f"unexpected{tie}"]
            assert "'model.norm.weight' has shape (31,), expected (32,)" in r[f"shape{tie}"]
            assert r[f"untouched{tie}"]
    assert r0["bf16"] and r1["bf16"]


def _inference_and_kwargs(rank, world):
    """No-grad forward (eval), keyword inputs into units, and grads through keyword-only paths."""
    torch.manual_seed(0)
    model = yafsdp.YaFSDP(Stack())
    ref = Stack()
    x = torch.randn(4, 7)
    with torch.no_grad():
        same = torch.allclose(model(x), ref(x), atol=1e-6)
    # A unit whose only grad-requiring input arrives as a keyword (YaFSDP v1 missed these).
    class KwBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 5)

        def forward(self, *, h):
            return self.lin(h)

    class KwStack(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.blocks = nn.ModuleList(KwBlock() for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = b(h=x)
            return x.pow(2).mean()

    kw = yafsdp.YaFSDP(KwStack())
    kref = KwStack()
    kw(torch.ones(2, 5)).backward()
    kref(torch.ones(2, 5)).backward()
    sd = kw.full_state_dict()
    grads_ok = True
    for u in kw.flat_units:
        full = torch.empty(u.layout.padded_numel)
        torch.distributed.all_gather_into_tensor(full, u.flat_param.grad)
        for p, v in zip(u.params, u.layout.views(full)):
            grads_ok &= torch.allclose(v, dict(kref.named_parameters())[p.fqn].grad, atol=1e-6)
    return same, grads_ok, sd if rank == 0 else None


def test_eval_and_keyword_inputs():
    for same, grads_ok, _ in run_ranks(_inference_and_kwargs, 2):
        assert same and grads_ok


def _reentrant(rank, world):
    from torch.utils.checkpoint import checkpoint

    class Reentrant(Stack):
        def forward(self, x, target=None):
            h = self.inp(x)
            for b in self.blocks:
                h = checkpoint(b, h, use_reentrant=True)
            return ((self.head(h) - target) ** 2).mean()

    model = yafsdp.YaFSDP(Reentrant())
    inputs = batch("stack", 0, 0, rank)
    try:
        model(inputs["x"], inputs["target"]).backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_reentrant_checkpointing_is_refused():
    """Reentrant checkpointing would silently drop weight gradients; it is refused by name."""
    for msg in run_ranks(_reentrant, 1):
        assert msg is not None and "reentrant activation checkpointing is not supported" in msg
        assert "'blocks." in msg


def test_weight_free_backward_units():
    """Which units ZeRO-3 need not re-gather for backward: plain embeddings only."""
    from yafsdp.layout.units import discover, weight_free_backward

    def flags(model):
        specs, _ = discover(model, None)
        return {s.name: weight_free_backward(s) for s in specs}

    got = flags(tiny_llama())
    assert got["model.embed_tokens"] is True
    assert not any(v for k, v in got.items() if k != "model.embed_tokens"), got
    # A tied head reads the embedding's weight in its backward.
    assert flags(tiny_llama(tie=True))["model.embed_tokens"] is False

    class Scaled(nn.Embedding):  # its own forward could use the weight in any way
        def forward(self, ids):
            return super().forward(ids) * self.weight.norm()

    class Model(nn.Module):
        def __init__(self, emb):
            super().__init__()
            self.emb = emb
            self.out = nn.Linear(8, 3)

    assert flags(Model(nn.Embedding(10, 8)))["emb"] is True
    assert flags(Model(Scaled(10, 8)))["emb"] is False
    assert flags(Model(nn.Embedding(10, 8, sparse=True)))["emb"] is False
    hooked = nn.Embedding(10, 8)
    hooked.register_forward_hook(lambda m, a, out: out * m.weight.sum())
    assert flags(Model(hooked))["emb"] is False
    # A hook that only switches its output's requires_grad on reads no weight: Hugging Face's, which
    # gradient_checkpointing_enable puts on the input embedding since transformers 5 (the embedding was
    # re-gathered for backward, and never looked up, in every checkpointed HF model before that was seen).
    ckpt = tiny_llama()
    ckpt.gradient_checkpointing_enable()
    assert flags(ckpt)["model.embed_tokens"] is True
    switched = nn.Embedding(10, 8)
    switched.register_forward_hook(lambda m, a, out: out.requires_grad_(True))
    assert flags(Model(switched))["emb"] is True
    for hook in (lambda m, a, out: m.requires_grad_(True), lambda m, a, out: a[0].requires_grad_() or out):
        other = nn.Embedding(10, 8)  # anything else that hook touches rules it out, as before
        other.register_forward_hook(hook)
        assert flags(Model(other))["emb"] is False


def _weight_free_run(rank, world, weight_free: bool):
    torch.manual_seed(0)
    # embedding and head are outsized: they share a buffer (the embedding gathered, not looked up
    # from its shards: that is the path under test; the lookup's own tests are in test_lookup.py)
    model = yafsdp.YaFSDP(tiny_llama(vocab=1000), sharded_lookup=False)
    if not weight_free:
        for u in model.units:
            u.weight_free_bw = False
    gathers = []
    from yafsdp.engine.buffers import WeightBuffer

    real_gather = WeightBuffer.gather
    WeightBuffer.gather = lambda slot, unit: (gathers.append(unit.name), real_gather(slot, unit))[1]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, per_step = [], []
    for step in range(3):
        gathers.clear()
        loss = loss_of(model, "llama", batch("llama", step, 0, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        per_step.append(list(gathers))
    return losses, per_step, model.full_state_dict()


def test_weight_free_backward_skips_the_embedding_regather():
    """ZeRO-3 gathers the embedding once per step (not again for its backward, though the head
    took its buffer) and trains bit for bit as when it does re-gather it."""
    fast = run_ranks(_weight_free_run, 2, True)
    slow = run_ranks(_weight_free_run, 2, False)
    for (lf, gf, sdf), (ls, gs, sds) in zip(fast, slow):
        assert lf == ls
        for step_f, step_s in zip(gf[1:], gs[1:]):  # step 0 has no prefetch plan yet
            assert step_f.count("model.embed_tokens") == 1, step_f
            assert step_s.count("model.embed_tokens") == 2, step_s
            assert sorted(x for x in step_f if x != "model.embed_tokens") == sorted(
                x for x in step_s if x != "model.embed_tokens")
    sdf, sds = fast[0][2], slow[0][2]  # rank 0's full state dicts
    assert sdf and sdf.keys() == sds.keys() and all(torch.equal(sdf[k], sds[k]) for k in sdf)
