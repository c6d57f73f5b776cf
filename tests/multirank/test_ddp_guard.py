"""DistributedDataParallel around a yafsdp-wrapped model is refused in DDP's constructor, before it
broadcasts rank 0's flat shards over the other ranks' ([Note: DDP around a sharded model] in
yafsdp/engine/ddp_guard.py): around the wrapper itself, around a parent module holding it (what
Lightning's strategy="ddp" builds), with init_sync=False, and through accelerate's prepare(). After
every refused attempt each rank's shards are bit for bit what they were, and the model still trains
as the unsharded one does. One world-2 spawn.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import yafsdp
from dist_utils import run_ranks
from models import Stack


class _Parent(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.net = inner
        self.scale = 0.5

    def forward(self, x, target):
        return self.net(x, target) * self.scale


def _refusal(fn) -> str:
    try:
        fn()
    except yafsdp.WrappedTwiceError as e:
        return str(e)
    return "not refused"


def _body(rank, world):
    torch.manual_seed(0)
    model = yafsdp.YaFSDP(Stack(seed=1))
    before = [p.detach().clone() for p in model.parameters()]
    # the two ranks hold different slices: a broadcast from rank 0 would change rank 1's
    gathered = [None] * world
    dist.all_gather_object(gathered, [b.sum().item() for b in before])
    out = {"slices_differ": gathered[0] != gathered[1]}
    out["direct"] = _refusal(lambda: DDP(model))
    out["parent"] = _refusal(lambda: DDP(_Parent(model)))
    out["no_init_sync"] = _refusal(lambda: DDP(model, init_sync=False))

    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    out["accelerate"] = _refusal(lambda: acc.prepare(model))
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    # still trains as the unsharded model (plain DDP on a plain copy)
    ref = DDP(Stack(seed=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7 + rank)
    for _ in range(2):
        x, y = torch.randn(3, 7, generator=g), torch.randn(3, 5, generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x, y).backward()
            o.step()
    full = model.full_state_dict()
    if rank == 0:
        out["max_diff"] = max((full[k] - v).abs().max().item() for k, v in ref.module.state_dict().items())
    return out


def test_ddp_refused_and_shards_untouched():
    for rank, r in enumerate(run_ranks(_body, 2)):
        assert r["slices_differ"]
        for case in ("direct", "parent", "no_init_sync", "accelerate"):
            msg = r[case]
            assert "DistributedDataParallel" in msg and "wrapped twice" in msg, (case, msg)
            assert 'strategy="yafsdp"' in msg and "yafsdp.YaFSDP" in msg, (case, msg)
        assert "holding a yafsdp.YaFSDP model (parameter 'inp.weight'" in r["parent"], r["parent"]
        assert r["untouched"], rank
        if rank == 0:
            assert r["max_diff"] < 1e-6, r["max_diff"]
