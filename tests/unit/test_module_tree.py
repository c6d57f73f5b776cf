"""After wrapping, the model is still a model: the original parameters of the wrapped module keep
their names, and what a script does to them takes effect on the shards or is refused at the call
(yafsdp/engine/orig_params.py, yafsdp/wrapper/views.py; docs/migration.md "The module tree after wrapping").

Each item against the unsharded model, world 2, gloo, fp32, ZeRO-3 and ZeRO-2:
re-initialising after wrap (model.apply, reset_parameters inside summon_full_params, the meta-device
flow); freezing after wrap (refused at the call); parameter hooks (called once per backward with
the local gradient, as under DDP; a returned tensor replaces it); per-parameter gradient norms,
full gradients and values; weights read outside their unit's forward (PEFT trainable tokens trained
like the unsharded PEFT model; a hand-tied head, a block reading another block's weight and a read
after the optimizer step refused by name). All cases run in one spawned group."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import yafsdp
from yafsdp.init import meta_parameters
from dist_utils import run_ranks
from models import batch, tiny_llama

peft = pytest.importorskip("peft")

WORLD = 2
BACKWARDS = 3


def _init_fn(m):
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.05)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, std=0.3)


def _init_all(m):  # every parameter of the tiny Llama: the meta-device flow
    _init_fn(m)
    if type(m).__name__ == "LlamaRMSNorm":
        nn.init.ones_(m.weight)


def _err(fn) -> str:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return ""


def _eq(a, b, tol=0.0) -> bool:
    return a.shape == b.shape and bool((a.detach().float() - b.detach().float()).abs().max() <= tol)


def _reinit(rank, zero):
    out = {}
    ref = tiny_llama()
    torch.manual_seed(7)
    ref.apply(_init_fn)
    model = yafsdp.YaFSDP(tiny_llama(), zero_stage=zero)
    out["reset_refused"] = _err(lambda: model.module.lm_head.reset_parameters())
    out["init_refused"] = _err(lambda: nn.init.zeros_(model.module.model.embed_tokens.weight))
    torch.manual_seed(7)
    model.apply(_init_fn)
    ids = batch("llama", 0, 0, rank)
    out["loss"] = (model(**ids).loss.item(), ref(**ids).loss.item())
    with torch.no_grad():
        torch.manual_seed(3)
        ref.lm_head.reset_parameters()
    with model.summon_full_params(writeback=True):
        torch.manual_seed(3)
        model.module.lm_head.reset_parameters()
    sd = model.full_state_dict()
    rsd = ref.state_dict()
    out["state_equal"] = rank != 0 or (sd.keys() == rsd.keys() and all(_eq(sd[k], rsd[k]) for k in sd))
    out["loss_after_reset"] = (model(**ids).loss.item(), ref(**ids).loss.item())
    if zero == 3:  # FSDP2's meta-device flow: wrap on meta, then initialise
        with meta_parameters():
            meta = tiny_llama()
        partial = yafsdp.YaFSDP(meta)
        out["partial_refused"] = _err(lambda: partial.apply(_init_fn))  # the norms were left out
        out["partial_needs_load"] = partial.needs_load
        with meta_parameters():
            meta = tiny_llama()
        model = yafsdp.YaFSDP(meta)
        torch.manual_seed(5)
        model.apply(_init_all)
        ref = tiny_llama()
        torch.manual_seed(5)
        ref.apply(_init_all)
        out["meta_loaded"] = not model.needs_load
        out["meta_loss"] = (model(**ids).loss.item(), ref(**ids).loss.item())
    return out


def _freeze(rank, zero):
    model = yafsdp.YaFSDP(tiny_llama(), zero_stage=zero)
    head = model.module.lm_head
    out = {
        "names": [n for n, _ in model.module.named_parameters()],
        "head_params": [n for n, _ in head.named_parameters()],
        "module_refused": _err(lambda: head.requires_grad_(False)),
        "loop_refused": _err(lambda: [p.requires_grad_(False) for p in head.parameters()]),
        "setter_refused": _err(lambda: setattr(model.module.model.norm.weight, "requires_grad", False)),
        "no_change_ok": _err(lambda: head.requires_grad_(True)) == "",
        "trainable": sum(p.numel() for p in model.module.parameters() if p.requires_grad),
    }
    tied = yafsdp.YaFSDP(tiny_llama(tie=True), zero_stage=zero)
    out["tied_hook_refused"] = _err(lambda: tied.module.lm_head.weight.register_hook(print))
    return out


def _hooks_and_logging(rank, zero):
    """Three backwards (accumulated, no optimizer step) with hooks, then every per-parameter view."""
    base, ref = tiny_llama(), tiny_llama()
    down = "model.layers.1.mlp.down_proj.weight"
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    seen = {"kept_before": [], "kept_after": [], "module_after": []}
    kept = base.get_parameter(down)
    kept.register_hook(lambda g: seen["kept_before"].append(g.clone()))  # registered before wrapping
    removed = kept.register_hook(lambda g: seen["removed"].append(1))
    seen["removed"] = []
    model = yafsdp.YaFSDP(base, zero_stage=zero)
    removed.remove()  # a handle from before wrapping still removes its hook
    kept.register_hook(lambda g: seen["kept_after"].append(g.clone()))  # on the kept reference, after
    model.module.lm_head.weight.register_hook(lambda g: seen["module_after"].append(g.clone()))
    model.module.get_parameter(o_proj).register_hook(lambda g: g * 0)  # a hook that replaces the gradient
    ref.get_parameter(o_proj).register_hook(lambda g: g * 0)
    out = {"post_accumulate_refused": _err(lambda: model.module.lm_head.weight.register_post_accumulate_grad_hook(print))}
    local = {"down": [], "head": []}  # this rank's local gradients, from the unsharded model
    for k in range(BACKWARDS):
        model(**batch("llama", k, 0, rank)).loss.backward()
        probe = copy.deepcopy(ref)
        probe(**batch("llama", k, 0, rank)).loss.backward()
        local["down"].append(probe.get_parameter(down).grad)
        local["head"].append(probe.lm_head.weight.grad)
        for r in range(WORLD):  # DDP's gradients: the average over ranks, summed over the backwards
            (ref(**batch("llama", k, 0, r)).loss / WORLD).backward()
    out["calls"] = {k: len(v) for k, v in seen.items()}
    out["hook_grads"] = (all(_eq(a, b, 1e-6) for a, b in zip(seen["kept_before"], local["down"]))
                         and all(_eq(a, b, 1e-6) for a, b in zip(seen["kept_after"], local["down"]))
                         and all(_eq(a, b, 1e-6) for a, b in zip(seen["module_after"], local["head"])))
    refp = dict(ref.named_parameters())
    norms = model.named_grad_norms()
    out["norm_names"] = sorted(norms) == sorted(refp)
    out["norm_err"] = max(abs(norms[n].item() - refp[n].grad.norm().item()) / (refp[n].grad.norm().item() + 1e-12)
                          for n in refp if n != o_proj)
    out["o_proj_norm"] = norms[o_proj].item()
    out["full_grad"] = _eq(model.full_grad("lm_head.weight"), refp["lm_head.weight"].grad, 1e-6)
    out["full_param"] = _eq(model.full_parameter(down), refp[down])
    out["grad_refused"] = _err(lambda: model.module.lm_head.weight.grad)
    with model.summon_full_params(with_grads=True):
        mine = dict(model.module.named_parameters())
        out["summon_values"] = all(_eq(mine[n], p) for n, p in refp.items())
        out["summon_grads"] = all(_eq(mine[n].grad, p.grad, 1e-6) for n, p in refp.items())
    out["rests_after"] = type(model.module.lm_head.weight).__name__
    return out


class _PeerBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.peer = []  # another block, not a submodule

    def forward(self, x):
        h = x + torch.tanh(self.fc(x))
        return h + 0.1 * F.linear(h, self.peer[0].fc.weight) if self.peer else h


class _HandTied(nn.Module):
    """An embedding and a head tied by hand: the head reads the embedding's weight directly."""

    def __init__(self, vocab=23, d=12, n=3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_PeerBlock(d) for _ in range(n))

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(F.linear(h, self.embed.weight).flatten(0, 1), ids.flatten())


def _peft_tokens():
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                              trainable_token_indices=[1, 5, 9]))
    with torch.no_grad():  # the new token rows differ from the base rows: the wrapper matters
        for n, p in model.named_parameters():
            if "trainable_tokens_delta" in n:
                p.add_(0.5)
    return model


def _outside_reads(rank, zero):
    out = {}
    ids = batch("llama", 0, 0, rank)["input_ids"]
    # PEFT's trainable tokens: its layer reads base_layer.weight without calling base_layer.
    pm = _peft_tokens()
    ref = copy.deepcopy(pm)
    model = yafsdp.YaFSDP(pm, zero_stage=zero)
    out["peft_units"] = [u.name for u in model.units]
    out["peft_logits"] = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for step in range(2):
        b = batch("llama", step, 0, rank)
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        parts = [batch("llama", step, 0, r) for r in range(WORLD)]
        rl = ref(**{k: torch.cat([p[k] for p in parts]) for k in parts[0]}).loss
        rl.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        losses.append((t.item() / WORLD, rl.item()))
    out["peft_losses"] = losses
    out["peft_logits_after"] = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
    # A read after the optimizer step, outside any forward: refused, not yesterday's values.
    out["stale_refused"] = _err(lambda: model.module.base_model.model.model.norm.weight * 1)

    # A hand-tied head: refused by name at the read; with the root as the one unit it trains exactly.
    tok = torch.randint(0, 23, (2, 5), generator=torch.Generator().manual_seed(rank))
    out["tied_refused"] = _err(lambda: yafsdp.YaFSDP(_HandTied(), zero_stage=zero)(tok))
    root = _HandTied()
    unsharded = copy.deepcopy(root)
    whole = yafsdp.YaFSDP(root, units=[root], zero_stage=zero)
    out["tied_whole_loss"] = (whole(tok).item(), unsharded(tok).item())
    # A block reading another block's weight.
    crossing = _HandTied()
    crossing.blocks[2].peer.append(crossing.blocks[0])
    wrapped = yafsdp.YaFSDP(crossing, units=[crossing.embed] + list(crossing.blocks), zero_stage=zero)
    out["peer_refused"] = _err(lambda: wrapped(tok))
    return out


def _case(fn, rank, zero):
    """One case's results, or what it raised (then only that case's test fails)."""
    import traceback

    try:
        return fn(rank, zero)
    except Exception:  # noqa: BLE001 - reported by the case's test
        return {"crashed": traceback.format_exc()}


def _all(rank, world):
    out = {}
    for zero in (3, 2):
        out[zero] = {k: _case(fn, rank, zero) for k, fn in
                     (("reinit", _reinit), ("freeze", _freeze), ("hooks", _hooks_and_logging), ("reads", _outside_reads))}
    return out


def _get(r, zero, case):
    x = r[zero][case]
    assert "crashed" not in x, x["crashed"]
    return x


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, WORLD)


@pytest.mark.parametrize("zero", [3, 2])
def test_reinit_after_wrap_takes_effect(results, zero):
    for r in results:
        x = _get(r, zero, "reinit")
        for key in ("reset_refused", "init_refused"):
            assert "summon_full_params(writeback=True)" in x[key] and "'lm_head.weight'" in x["reset_refused"], x[key]
        assert x["state_equal"]
        assert x["loss"][0] == pytest.approx(x["loss"][1], rel=1e-6)
        assert x["loss_after_reset"][0] == pytest.approx(x["loss_after_reset"][1], rel=1e-6)
        if zero == 3:
            assert "were not initialised" in x["partial_refused"] and "input_layernorm.weight" in x["partial_refused"]
            assert x["partial_needs_load"] and x["meta_loaded"]
            assert x["meta_loss"][0] == pytest.approx(x["meta_loss"][1], rel=1e-6)


@pytest.mark.parametrize("zero", [3, 2])
def test_freeze_after_wrap_refused_at_the_call(results, zero):
    ref_names = [n for n, _ in tiny_llama().named_parameters()]
    for r in results:
        x = _get(r, zero, "freeze")
        assert x["names"] == ref_names and x["head_params"] == ["weight"]
        for key in ("module_refused", "loop_refused"):
            assert "'lm_head.weight'" in x[key] and "Freeze before wrapping" in x[key], x[key]
        assert "'model.norm.weight'" in x["setter_refused"]
        assert "tied" in x["tied_hook_refused"] and "'model.embed_tokens.weight'" in x["tied_hook_refused"]
        assert x["no_change_ok"]
        assert x["trainable"] == sum(p.numel() for p in tiny_llama().parameters())


@pytest.mark.parametrize("zero", [3, 2])
def test_parameter_hooks_fire_with_the_local_gradient(results, zero):
    for r in results:
        x = _get(r, zero, "hooks")
        assert x["calls"] == {"kept_before": BACKWARDS, "kept_after": BACKWARDS, "module_after": BACKWARDS,
                              "removed": 0}
        assert x["hook_grads"]
        assert x["o_proj_norm"] == 0.0  # the hook's returned gradient is what was reduced
        assert "register_hook" in x["post_accumulate_refused"]


@pytest.mark.parametrize("zero", [3, 2])
def test_per_parameter_grad_norms_and_full_views(results, zero):
    for r in results:
        x = _get(r, zero, "hooks")
        assert x["norm_names"] and x["norm_err"] < 1e-5
        assert x["full_grad"] and x["full_param"]
        assert x["summon_values"] and x["summon_grads"]
        assert "named_grad_norms()" in x["grad_refused"]
        assert x["rests_after"] == "ShardedParameter"


@pytest.mark.parametrize("zero", [3, 2])
def test_weights_read_outside_their_unit(results, zero):
    for r in results:
        x = _get(r, zero, "reads")
        assert "base_model.model.model.embed_tokens.token_adapter" in x["peft_units"]
        assert x["peft_logits"] < 1e-5 and x["peft_logits_after"] < 1e-5
        for mine, ref in x["peft_losses"]:
            assert mine == pytest.approx(ref, rel=1e-5)
        assert "'model.norm.weight'" in x["stale_refused"] or "norm.weight" in x["stale_refused"]
        assert "'embed.weight'" in x["tied_refused"] and "units=" in x["tied_refused"]
        assert x["tied_whole_loss"][0] == pytest.approx(x["tied_whole_loss"][1], rel=1e-6)
        assert "'blocks.0.fc.weight'" in x["peer_refused"] and "units=" in x["peer_refused"]
