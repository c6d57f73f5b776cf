"""A parent module holding a yafsdp-wrapped model sees the original model ([Note: what a parent module
sees] in yafsdp/engine/orig_params.py): its named_parameters() are the unsharded model's names, shapes and
counts (no flat shard, no device anchor); zero_grad() on it clears the engine's gradients (set_to_none
True and False); an optimizer built over its parameters trains bit for bit as one built over
model.parameters(), or, when a unit is split across param groups, is refused at construction naming
model.parameters(); full_grad(name) answers every name. One world-2 spawn.
"""
from __future__ import annotations

import torch
from torch import nn

import yafsdp
from dist_utils import run_ranks
from models import Stack, tiny_llama


class _Parent(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.net = inner
        self.extra = nn.Linear(5, 5)  # a parameter the engine does not own

    def forward(self, x, target):
        return ((self.extra(self.net(x)) - target) ** 2).mean()


def _data(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)


def _train(make_opt, rank, steps=3, zero=lambda parent, opt: opt.zero_grad()):
    parent = _Parent(yafsdp.YaFSDP(Stack(seed=1)))
    torch.manual_seed(3)
    parent.extra.reset_parameters()
    opt = make_opt(parent)
    for step in range(steps):
        x, t = _data(rank, step)
        parent(x, t).backward()
        torch.distributed.all_reduce(parent.extra.weight.grad)
        torch.distributed.all_reduce(parent.extra.bias.grad)
        parent.extra.weight.grad /= 2
        parent.extra.bias.grad /= 2
        opt.step()
        zero(parent, opt)
    return [p.detach().clone() for p in parent.net.parameters()] + [parent.extra.weight.detach().clone()]


def _body(rank, world):
    out = {}
    ref_names = [(n, tuple(p.shape)) for n, p in Stack(seed=1).named_parameters()]
    parent = _Parent(yafsdp.YaFSDP(Stack(seed=1)))
    names = [(n, tuple(p.shape)) for n, p in parent.named_parameters()]
    out["names"] = names
    out["ref_names"] = [("net.module." + n, s) for n, s in ref_names] + [("extra.weight", (5, 5)), ("extra.bias", (5,))]
    out["count"] = sum(p.numel() for p in parent.parameters())
    out["ref_count"] = sum(p.numel() for p in Stack(seed=1).parameters()) + 30
    out["wrapper_flat"] = [n for n, _ in parent.net.named_parameters()]
    # full_grad over the parent's names
    x, t = _data(rank, 0)
    parent(x, t).backward()
    out["full_grad"] = all(parent.net.full_grad(n[len("net.module."):]).shape == s
                           for n, s in names if n.startswith("net.module."))
    # zero_grad on the parent: set_to_none True (default) and False
    parent.zero_grad(set_to_none=False)
    out["zeroed"] = [float(p.grad.abs().sum()) if p.grad is not None else None for p in parent.net.parameters()]
    parent(x, t).backward()
    parent.zero_grad()
    out["none"] = [p.grad is None for p in parent.net.parameters()]
    # requires_grad_ on the parent: a change is refused (at the first original parameter, before any shard
    # changes), the value it already has passes
    try:
        parent.requires_grad_(False)
        out["freeze"] = "not refused"
    except RuntimeError as e:
        out["freeze"] = str(e)
    parent.requires_grad_(True)
    out["shards_trainable"] = all(p.requires_grad for p in parent.net.parameters())
    # zero_grad on a module holding part of a unit is refused, not silently partial
    try:
        parent.net.module.blocks[0].fc1.zero_grad()
        out["partial_zero"] = "not refused"
    except RuntimeError as e:
        out["partial_zero"] = str(e)
    # the optimizer over the parent's parameters trains exactly as over model.parameters() (+ extra)
    a = _train(lambda p: torch.optim.AdamW(p.parameters(), lr=0.01, weight_decay=0.1), rank)
    b = _train(lambda p: torch.optim.AdamW([*p.net.parameters(), *p.extra.parameters()], lr=0.01,
                                           weight_decay=0.1), rank)
    out["same_adamw"] = all(torch.equal(u, v) for u, v in zip(a, b))
    c = _train(lambda p: torch.optim.SGD(p.named_parameters(), lr=0.05, momentum=0.9), rank,
               zero=lambda parent, opt: parent.zero_grad())
    d = _train(lambda p: torch.optim.SGD([*p.net.parameters(), *p.extra.parameters()], lr=0.05, momentum=0.9), rank)
    out["same_sgd_named_parent_zero"] = all(torch.equal(u, v) for u, v in zip(c, d))
    init = [p.detach().clone() for p in yafsdp.YaFSDP(Stack(seed=1)).parameters()]
    out["moved"] = all(not torch.equal(u, v) for u, v in zip(a, init))
    # an HF model (a class answering .device / .dtype): no anchor parameter; device and dtype still answered
    ref = tiny_llama(tie=True)
    hf = nn.ModuleDict({"lm": yafsdp.YaFSDP(tiny_llama(tie=True), param_dtype=torch.bfloat16)})
    out["hf_names"] = [n for n, _ in hf.named_parameters()]
    out["hf_ref_names"] = ["lm.module." + n for n, _ in ref.named_parameters()]
    out["hf_count"] = (hf["lm"].module.num_parameters(), ref.num_parameters())
    out["hf_device"] = (str(hf["lm"].module.device), hf["lm"].module.dtype, hf["lm"].module.model.dtype)
    # a unit split across param groups: refused at construction
    parent = _Parent(yafsdp.YaFSDP(Stack(seed=1)))
    fc1 = [p for n, p in parent.named_parameters() if n.endswith("blocks.0.fc1.weight")]
    rest = [p for n, p in parent.named_parameters() if not n.endswith("blocks.0.fc1.weight")]
    try:
        torch.optim.AdamW([{"params": rest}, {"params": fc1, "weight_decay": 0.0}])
        out["split"] = "not refused"
    except ValueError as e:
        out["split"] = str(e)
    return out


def test_parent_sees_the_original_model():
    for r in run_ranks(_body, 2):
        assert r["names"] == r["ref_names"], r["names"]
        assert r["hf_names"] == r["hf_ref_names"], r["hf_names"]
        assert r["hf_count"][0] == r["hf_count"][1]
        assert r["hf_device"] == ("cpu", torch.bfloat16, torch.bfloat16), r["hf_device"]
        assert r["count"] == r["ref_count"]
        assert r["wrapper_flat"] and all(n.startswith("flat.") for n in r["wrapper_flat"])
        assert r["full_grad"]
        assert "cannot change after wrapping" in r["freeze"] and r["shards_trainable"], r["freeze"]
        assert r["zeroed"] and all(z == 0.0 for z in r["zeroed"]), r["zeroed"]
        assert all(r["none"])
        assert "part of a unit" in r["partial_zero"] or "not 'blocks.0" in r["partial_zero"], r["partial_zero"]
        assert r["same_adamw"] and r["same_sgd_named_parent_zero"] and r["moved"]
        assert "model.parameters()" in r["split"] and "blocks.0.fc1.weight" in r["split"], r["split"]
