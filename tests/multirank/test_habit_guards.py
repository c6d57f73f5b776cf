"""PyTorch habits that ran without an error on a wrapped model and trained something else than the
unsharded model: each is refused now, at the call, naming what to do instead, and the refused call
changes nothing (the next step is the unsharded model's step).

- an optimizer over the parameters as they were before wrapping (built before it, or over a list
  kept from before): it never got a gradient, so the model did not train at all;
- an optimizer that is not element-wise (Adafactor, LBFGS, Muon) over the flat shards: its
  per-matrix statistics saw 1-D slices spanning many parameters;
- a weight-decay split by name over the wrapper's ``named_parameters()`` (names ``flat.<unit>``):
  the no-decay group came out empty and every norm was decayed;
- ``m.weight = nn.Parameter(...)`` on a module of the wrapped tree: ignored (the old values kept
  being gathered); ``m.head = nn.Linear(...)`` / ``ModuleList.append``: the new parameters were in
  no shard, never reduced nor trained;
- ``torch.func.functional_call`` over the wrapper or its module: the given tensors were ignored and the
  forward ran the model's own weights;
- a loss term computed from the flat shards (an L2 penalty over ``model.parameters()``): its gradient
  reached them through autograd's accumulation, which the engine's fold overwrote on some units;
- HF ``generate()`` where one rank reaches its EOS first: that rank stopped forwarding and left the
  others in a gather (a gloo abort); HF now keeps every rank forwarding until all are done
  (``synced_gpus=True`` by default, as for FSDP models), and each rank's tokens are the unsharded model's.

yafsdp/optim/guard.py and yafsdp/engine/tree_guard.py. One spawn of 2 ranks (gloo, fp32, ZeRO-3).

And habits that must simply work: a unit's own module's pre-hooks that read its weights --
``torch.nn.utils.prune`` and the old ``weight_norm`` applied before wrapping, a pre-hook registered
before wrapping -- see the weights the unsharded module's hooks see and train the same
([Note: the engine's hooks around the user's] in yafsdp/engine/autograd.py; they were refused as
reads outside the unit's forward), beside forward hooks that use the weights (registered before
wrapping) or replace the output (after). A forward hook registered after wrapping that reads a
weight is refused with where to read it. A second spawn, ZeRO-3 and ZeRO-2.
"""
from __future__ import annotations

import torch
from torch import nn

import yafsdp
from dist_utils import run_ranks
from models import Stack, batch, tiny_llama

WORLD = 2


def _err(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        return str(e)
    return ""


def _step_matches_unsharded(model, ref, rank, world, step) -> float:
    """One SGD step of ``model`` (wrapped) and of ``ref`` (unsharded, the whole global batch) on the same data:
    the largest difference of their weights after it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    b = batch("llama", step, 0, rank)
    model(**b).loss.backward()
    opt.step()
    for r in range(world):  # DDP's gradient: the mean over ranks of each rank's loss
        (ref(**batch("llama", step, 0, r)).loss / world).backward()
    ropt.step()
    full = model.full_state_dict()  # rank 0's; {} elsewhere
    return max((float((full[k] - v).abs().max()) for k, v in ref.state_dict().items() if k in full), default=0.0)


def _cases(rank, world):
    out = {}
    # -- optimizers
    base = tiny_llama()
    before = torch.optim.AdamW(base.parameters(), lr=1e-2)  # built before wrapping: the old habit
    kept = list(base.parameters())
    model = yafsdp.YaFSDP(base)
    model(**batch("llama", 0, 0, rank)).loss.backward()
    out["before_wrap_step"] = _err(before.step)
    out["kept_list"] = _err(lambda: torch.optim.AdamW(kept, lr=1e-2))
    for cls in (torch.optim.Adafactor, torch.optim.LBFGS, torch.optim.Muon):
        out[cls.__name__] = _err(lambda cls=cls: cls(model.parameters()))
    out["elementwise"] = [_err(lambda cls=cls: cls(model.parameters(), lr=1e-3))
                          for cls in (torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop, yafsdp.FusedAdamW)]
    named = list(model.named_parameters())
    decay = [p for n, p in named if not ("norm" in n or "bias" in n)]
    no_decay = [p for n, p in named if "norm" in n or "bias" in n]
    out["empty_after"] = _err(lambda: torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0}]))
    out["empty_first"] = _err(lambda: torch.optim.AdamW([{"params": no_decay, "weight_decay": 0}, {"params": decay}]))
    frozen_vectors = tiny_llama()  # norms frozen (as under LoRA): the no-decay group is empty unsharded too
    for p in frozen_vectors.parameters():
        p.requires_grad_(p.dim() > 1)
    fv = yafsdp.YaFSDP(frozen_vectors)
    out["empty_beside_matrices"] = _err(lambda: torch.optim.AdamW([{"params": list(fv.parameters())},
                                                                   {"params": [], "weight_decay": 0.0}]))
    orig = list(model.module.named_parameters())  # the original names: the split the habit meant
    split = torch.optim.AdamW([{"params": [p for n, p in orig if "norm" not in n]},
                               {"params": [p for n, p in orig if "norm" in n], "weight_decay": 0.0}])
    out["split_sizes"] = [len(g["params"]) for g in split.param_groups]
    model.zero_grad()
    # torch's vector_to_parameters assigns p.data: the engine kept reading the old storage
    vec = torch.nn.utils.parameters_to_vector(model.parameters()).clone()
    torch.nn.utils.vector_to_parameters(vec, model.parameters())
    out["data_assigned"] = _err(lambda: model(**batch("llama", 0, 0, rank)))
    sd = tiny_llama().state_dict()
    out["module_load"] = _err(lambda: model.module.load_state_dict(sd))
    out["resize"] = _err(lambda: model.resize_token_embeddings(100))
    out["wrapper_frozen"] = _err(lambda: model.requires_grad_(False))  # a teacher frozen after wrapping
    out["wrapper_same"] = _err(lambda: model.requires_grad_(True))
    # -- the module tree
    m = yafsdp.YaFSDP(tiny_llama(seed=1))
    ref = tiny_llama(seed=1)
    lm = m.module
    out["param"] = _err(lambda: setattr(lm.lm_head, "weight", nn.Parameter(torch.zeros(lm.lm_head.weight.shape))))
    out["new_param"] = _err(lambda: setattr(lm.model.layers[0].mlp, "scale", nn.Parameter(torch.ones(1))))
    out["same_param"] = _err(lambda: setattr(lm.lm_head, "weight", lm.lm_head.weight))
    out["module"] = _err(lambda: setattr(lm, "lm_head", nn.Linear(32, lm.lm_head.out_features, bias=False)))
    out["dropped"] = _err(lambda: setattr(lm, "lm_head", nn.Identity()))
    out["append"] = _err(lambda: lm.model.layers.append(nn.Linear(2, 2)))
    out["activation"] = _err(lambda: setattr(lm.model.layers[0].mlp, "act_fn", nn.SiLU()))
    with m.summon_full_params(writeback=True):  # a new parameter of the same shape is written back there
        out["in_summon"] = _err(lambda: setattr(lm.model.norm, "weight", nn.Parameter(torch.full((32,), 2.0))))
    with torch.no_grad():
        ref.model.norm.weight.fill_(2.0)
    out["written_back"] = float(m.full_parameter("model.norm.weight").sub(2.0).abs().max())
    # torch.func.functional_call swaps parameters without a hook: the engine ran its own weights instead
    x0 = batch("llama", 0, 0, rank)
    out["fcall_flat"] = _err(lambda: torch.func.functional_call(
        m, {k: v.detach() * 0.9 for k, v in m.named_parameters()}, (), x0))
    out["fcall_orig"] = _err(lambda: torch.func.functional_call(
        lm, {"lm_head.weight": torch.zeros(lm.lm_head.weight.shape)}, (), x0))
    out["step_diff"] = _step_matches_unsharded(m, ref, rank, world, 1)  # the refused calls changed nothing
    # -- HF generate() where one rank ends first (its EOS): HF keeps it forwarding (synced_gpus) as for FSDP
    gen, gref = yafsdp.YaFSDP(tiny_llama(seed=2)), tiny_llama(seed=2)
    prompts = [batch("llama", 9, 0, r)["input_ids"][:1, :4] for r in range(world)]
    with torch.no_grad():
        eos = int(gref.generate(input_ids=prompts[0], max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1])
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=eos)
        out["generated"] = [gen.generate(input_ids=prompts[rank], **kw)[0].tolist(),
                            gref.generate(input_ids=prompts[rank], **kw)[0].tolist()]
    out["gen_step_diff"] = _step_matches_unsharded(gen, gref, rank, world, 2)  # and training goes on
    s = yafsdp.YaFSDP(Stack())
    s.module.inp.bias = None  # torch calls no hook for a None: refused at the unit's next use
    g = torch.Generator().manual_seed(rank)
    out["bias_none"] = _err(lambda: s(torch.randn(2, 7, generator=g)))
    # -- a loss term over the flat shards (an L2 penalty over model.parameters()): its gradient was overwritten by
    # the engine's fold on some units and kept on others; refused, and added after backward instead it is DDP's
    pen, pref = yafsdp.YaFSDP(tiny_llama(seed=4)), tiny_llama(seed=4)
    lam = 0.01
    out["penalty"] = _err(lambda: (pen(**batch("llama", 3, 0, rank)).loss
                                   + lam * sum(p.pow(2).sum() for p in pen.parameters())).backward())
    pen.zero_grad()
    opt, ropt = torch.optim.SGD(pen.parameters(), lr=0.5), torch.optim.SGD(pref.parameters(), lr=0.5)
    pen(**batch("llama", 3, 0, rank)).loss.backward()
    with torch.no_grad():
        for p in pen.parameters():
            p.grad.add_(p, alpha=2 * lam)
    opt.step()
    for r in range(world):
        (pref(**batch("llama", 3, 0, r)).loss / world).backward()
    (lam * sum(p.pow(2).sum() for p in pref.parameters())).backward()
    ropt.step()
    full = pen.full_state_dict()
    out["penalty_step"] = max((float((full[k] - v).abs().max()) for k, v in pref.state_dict().items() if k in full),
                              default=0.0)
    return out


def test_habits_refused_at_the_call():
    results = run_ranks(_cases, WORLD)
    lengths = [len(r["generated"][1]) for r in results]
    assert lengths[0] == 5 and lengths[1] > 5, lengths  # rank 0 ends at its first token, rank 1 goes on
    for r in results:
        msg = r["before_wrap_step"]
        assert "AdamW holds parameter 'model.embed_tokens.weight' as it was before yafsdp.YaFSDP wrapped" in msg, msg
        assert "Build the optimizer after wrapping" in msg
        assert "as it was before yafsdp.YaFSDP wrapped" in r["kept_list"], r["kept_list"]
        assert "it computes a second moment factored" in r["Adafactor"], r["Adafactor"]
        assert "LBFGS cannot step a yafsdp.YaFSDP model's flat shards" in r["LBFGS"], r["LBFGS"]
        assert "Muon cannot step" in r["Muon"], r["Muon"]
        assert r["elementwise"] == ["", "", "", ""], r["elementwise"]
        for k, i in (("empty_after", 1), ("empty_first", 0)):
            assert f"param group {i} of AdamW holds no parameters" in r[k] and "model.param_groups(weight_decay)" \
                in r[k], (k, r[k])
        assert r["empty_beside_matrices"] == "", r["empty_beside_matrices"]
        assert r["split_sizes"][1] >= 1 and sum(r["split_sizes"]) >= 2, r["split_sizes"]
        assert "'lm_head.weight' set to a new Parameter of shape (67, 32) after yafsdp.YaFSDP wrapped" in r["param"]
        assert "summon_full_params(writeback=True)" in r["param"], r["param"]
        assert "'model.layers.0.mlp.scale' set to a new Parameter" in r["new_param"], r["new_param"]
        assert "'lm_head' set to a new Linear" in r["module"] and "never reduced across ranks nor trained" \
            in r["module"], r["module"]
        assert "'lm_head' set to a new Identity" in r["dropped"] and "stay in their unit" in r["dropped"], r["dropped"]
        assert "'model.layers.3' set to a new Linear" in r["append"], r["append"]
        assert r["same_param"] == r["activation"] == r["in_summon"] == r["wrapper_same"] == "", r
        assert "YaFSDP.requires_grad_(False): which parameters train is fixed at wrap time" in r["wrapper_frozen"]
        assert r["module_load"].startswith("yafsdp: load_state_dict() on the module wrapped by yafsdp.YaFSDP") and \
            r["module_load"].count("yafsdp:") == 1 and "load_full_state_dict" in r["module_load"], r["module_load"]
        assert "resize_token_embeddings() after wrapping" in r["resize"] and "before wrapping" in r["resize"], r["resize"]
        assert "was given new storage (p.data = ...; torch.nn.utils.vector_to_parameters" in r["data_assigned"], \
            r["data_assigned"]
        for k, name in (("fcall_flat", "flat.model_embed_tokens"), ("fcall_orig", "lm_head.weight")):
            assert f"'{name}' holds a Tensor that yafsdp did not put there (torch.func.functional_call" in r[k], r[k]
        assert r["written_back"] == 0.0
        assert r["step_diff"] < 1e-6, r["step_diff"]  # (rank 0 compares; the others return 0)
        got, want = r["generated"]
        assert got == want, r["generated"]
        assert r["gen_step_diff"] < 1e-6, r["gen_step_diff"]
        assert "'inp.bias' was set to None after yafsdp.YaFSDP wrapped" in r["bias_none"], r["bias_none"]
        assert "a gradient reached the flat shard of unit" in r["penalty"] and "p.grad.add_(p, alpha=2 * lam)" \
            in r["penalty"], r["penalty"]
        assert r["penalty_step"] < 1e-6, r["penalty_step"]


def _hooked(seed: int):
    """tiny_llama with hooks registered before wrapping that read a unit's own module's weights (the hooked
    modules are units: lm_head, the embedding, a decoder layer), and the values the head's hooks saw."""
    import torch.nn.utils.prune as prune

    m = tiny_llama(seed=seed)
    head, seen = m.lm_head, []
    prune.l1_unstructured(head, "weight", amount=0.3)  # weight = weight_orig * weight_mask, in a pre-hook
    m.model.embed_tokens = torch.nn.utils.weight_norm(m.model.embed_tokens, dim=0)  # weight from g and v
    head.register_forward_pre_hook(lambda mod, a: seen.append(float(mod.weight_orig.detach().double().sum())))
    # a forward hook that uses the weights in what it returns (before wrapping it runs while they are there)
    layer = m.model.layers[1]
    layer.register_forward_hook(lambda mod, a, o: (o[0] + 0.1 * torch.tanh(o[0] @ mod.mlp.down_proj.weight[:, :32]),)
                                + tuple(o[1:]) if isinstance(o, tuple) else o + 0.1 * torch.tanh(o @ mod.mlp.down_proj.weight[:, :32]))
    return m, seen


def _after(m: nn.Module) -> None:
    """A forward hook registered after wrapping that replaces a unit's output (layer 0's)."""
    m.model.layers[0].register_forward_hook(lambda mod, a, o: (o[0] * 0.5,) + tuple(o[1:]) if isinstance(o, tuple)
                                            else o * 0.5)


def _hook_cases(rank, world):
    import warnings

    warnings.simplefilter("ignore", FutureWarning)  # the old weight_norm's deprecation
    out = {}
    for zero in (3, 2):
        base, seen = _hooked(3)
        ref, rseen = _hooked(3)
        model = yafsdp.YaFSDP(base, zero_stage=zero)
        _after(model.module)
        _after(ref)
        diffs = [_step_matches_unsharded(model, ref, rank, world, step) for step in range(2)]
        # the reference runs every rank's batch (world forwards per step): what it saw, once per step
        out[zero] = (diffs, list(seen), rseen[::world])
    # a loss on a middle layer's output only (HF's output_hidden_states): the layers' outputs keep their backward
    # gates through HF's tuple, and the layers above it get no gradient (ZeRO-3)
    hid, href = yafsdp.YaFSDP(tiny_llama(seed=5)), tiny_llama(seed=5)
    hid(**batch("llama", 4, 0, rank), output_hidden_states=True).hidden_states[2].pow(2).mean().backward()
    for r in range(world):
        (href(**batch("llama", 4, 0, r), output_hidden_states=True).hidden_states[2].pow(2).mean() / world).backward()
    with hid.summon_full_params(with_grads=True):
        got = {n: p.grad for n, p in hid.module.named_parameters()}
        out["hidden_grads"] = max(float((got[n] - p.grad).abs().max()) if p.grad is not None else
                                  (-1.0 if got[n] is not None and bool(got[n].any()) else 0.0)
                                  for n, p in href.named_parameters())
    # a forward hook registered after wrapping runs after the engine took the weights back: refused, with where
    # to read them instead
    head = model.module.lm_head
    handle = head.register_forward_hook(lambda mod, a, o: mod.weight_orig.sum())
    out["after"] = _err(lambda: model(**batch("llama", 5, 0, rank)))
    handle.remove()
    # a global pre-hook runs before every module's own hooks, the engine's included: its read is refused
    handle = nn.modules.module.register_module_forward_pre_hook(
        lambda mod, a: mod.weight_orig.sum() if mod is head else None)
    try:
        out["global"] = _err(lambda: model(**batch("llama", 5, 0, rank)))
    finally:
        handle.remove()
    return out


def test_hooks_on_a_units_module_see_its_weights():
    for r in run_ranks(_hook_cases, WORLD):
        after, glob = r.pop("after"), r.pop("global")
        assert 0.0 <= r.pop("hidden_grads") < 1e-6  # (-1: a gradient where the unsharded model has none)
        assert "parameter 'lm_head.weight_orig' (unit 'lm_head') was used by 'sum' outside its unit's forward" \
            in after and "right after unit 'lm_head''s forward ended" in after and "forward pre-hook" in after, after
        assert "parameter 'lm_head.weight_orig' (unit 'lm_head') was used by 'sum' outside its unit's forward" \
            in glob and "right after" not in glob, glob
        for zero, (diffs, seen, want) in r.items():
            assert max(diffs) < 1e-6, (zero, diffs)  # (rank 0 compares; the others return 0)
            assert len(seen) == 2 and seen == want, (zero, seen, want)  # the head's pre-hook, once per step
