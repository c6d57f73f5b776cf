"""Reliability II (issue 21): silent failures where features meet.

- every stored shard kind (trainable master, frozen, NF4 record, trainable gathered as FP8) reaches
  every rank, flat and HSDP, through load_full_state_dict, yafsdp.hf.load_hf_weights and wrapping
  from different weights per rank (the HSDP replica broadcast once skipped the NF4 store);
"""
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import yafsdp
from dist_utils import run_ranks


# ---------------------------------------------------------------------------- stored shard kinds
class _Net(nn.Sequential):
    def forward(self, x):
        for m in self:
            x = torch.tanh(m(x))
        return x


def _kinds_model(seed: int) -> nn.Module:
    """Every group kind, with quantize_frozen="nf4", gather_dtype="fp8": unit 0 trainable and gathered
    as FP8 records; unit 1 a frozen Linear weight (NF4); unit 2 a plain trainable group; unit 3 a
    frozen weight NF4 cannot take (330 elements); the small group: a trainable bias and frozen ones."""
    torch.manual_seed(seed)
    m = _Net(nn.Linear(16, 64, bias=False), nn.Linear(64, 64), nn.Linear(64, 33), nn.Linear(33, 10))
    for p in list(m[1].parameters()) + list(m[3].parameters()):
        p.requires_grad_(False)
    return m


def _wrap(module, mesh):
    return yafsdp.YaFSDP(module, units=list(module), mesh=mesh, quantize_frozen="nf4", gather_dtype="fp8")


_X = torch.linspace(-1, 1, 4 * 16).reshape(4, 16)


def _stored_kinds(rank, world, hf_dir):
    from torch.distributed.device_mesh import init_device_mesh

    from yafsdp.hf import load_hf_weights
    from yafsdp.init import meta_parameters

    meshes = {"flat": init_device_mesh("cpu", (world,)),
              "hsdp": init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))}
    expected = {}
    for seed in (10, 20):  # the known-good path: every rank wraps the same weights, full sharding
        model = _wrap(_kinds_model(seed), meshes["flat"])
        expected[seed] = model(_X).detach()
        kinds = sorted({(g.kind.name, str(g.kind.gather_format)) for u in model._rt.all for g in u.groups})
        del model
    out = dict(kinds=kinds)
    for how, mesh in meshes.items():
        for case in ("wrap_different", "load_full", "load_hf"):
            if case == "wrap_different":  # each rank starts from its own weights: rank 0's are the model's
                model, seed = _wrap(_kinds_model(10 + dist.get_rank()), mesh), 10
            else:
                with meta_parameters():
                    module = _kinds_model(0)
                model, seed = _wrap(module, mesh), 20
                if case == "load_full":
                    model.load_full_state_dict(_kinds_model(20).state_dict() if dist.get_rank() == 0 else None)
                else:
                    load_hf_weights(model, hf_dir)
            got = model(_X).detach()
            # every stored shard equal on every replica (HSDP) / the model computing the loaded values
            same = True
            if model.replicate_group is not None:
                for i in model.shard_info():
                    t = i.param.detach()
                    peers = [torch.empty_like(t) for _ in range(model.replicas)]
                    dist.all_gather(peers, t.contiguous(), group=model.replicate_group)
                    same &= all(torch.equal(p, peers[0]) for p in peers)
            out[(how, case)] = dict(equal=torch.equal(got, expected[seed]),
                                    err=(got - expected[seed]).abs().max().item(), replicas_agree=same)
            del model
    return out


def test_every_stored_shard_kind_reaches_every_rank(tmp_path):
    """Flat and HSDP 2x1 x {wrap from different weights, load_full_state_dict, load_hf_weights}, on a
    model holding every group kind: every rank computes with the loaded weights (the known-good
    flat wrap's output, bit for bit) and the replicas hold identical shards."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in _kinds_model(20).state_dict().items()},
              os.path.join(tmp_path, "model.safetensors"))
    results = run_ranks(_stored_kinds, 2, str(tmp_path))
    assert results[0]["kinds"] == [("frozen", "None"), ("nf4", "nf4"), ("trainable", "None"), ("trainable", "fp8")], \
        results[0]["kinds"]
    for rank, res in enumerate(results):
        for key, r in res.items():
            if key == "kinds":
                continue
            assert r["equal"] and r["replicas_agree"], (rank, key, r)
