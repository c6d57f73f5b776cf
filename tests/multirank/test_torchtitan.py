"""yafsdp inside torchtitan (yafsdp/integrations/torchtitan.py, [Note: the torchtitan seam]) and the engine
changes it needed: blocks in a ModuleDict ([Note: blocks in a ModuleDict] in core/units.py), modules with
state_dict hooks ([Note: state_dict hooks] in core/state_dict.py), no device anchor on a plain root
([Note: the device anchor] in core/anchor.py).

A torchtitan-shaped model of our own covers the engine side without torchtitan; torchtitan 0.3's llama3
(its debug model cut to 2 layers, SDPA attention: FlexAttention has no backward on CPU) runs through
``parallelize_yafsdp`` in a plain training loop against DDP on the unsharded model. torchtitan's own
Trainer needs CUDA: benchmarks/gpu_suite.sh runs it. torchtitan imports triton (its MoE kernels) at import
time; CI installs triton into <repo>/.triton (pip --target, as .torchao), put on sys.path only inside the
ranks that import torchtitan."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
from torch import nn

import yafsdp
from dist_utils import run_ranks
from yafsdp.core.units import discover

TRITON_DIR = os.environ.get("YAFSDP_TRITON_DIR", os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".triton"))


def _import_torchtitan():
    """torchtitan.models.llama3, with <repo>/.triton on sys.path (in this process only)."""
    if os.path.isdir(TRITON_DIR) and TRITON_DIR not in sys.path:
        sys.path.insert(0, TRITON_DIR)
    import torchtitan.models.llama3 as llama3

    return llama3


def _torchtitan_missing() -> str | None:
    if importlib.util.find_spec("torchtitan") is None:
        return "torchtitan is not installed (.ci/run installs torchtitan==0.3.0)"
    if importlib.util.find_spec("triton") is None and not os.path.isdir(TRITON_DIR):
        return f"triton (imported by torchtitan) is neither installed nor in {TRITON_DIR}"
    return None


# ---------------------------------------------------------------------------- a torchtitan-shaped model
D = 16


class FusedQKV(nn.Module):
    """One fused weight, saved as three (a state_dict post-hook) and merged back on load, as
    torchtitan's FusedQKVLinear does."""

    def __init__(self):
        super().__init__()
        self.wqkv = nn.Linear(D, 3 * D, bias=False)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    def forward(self, x):
        return self.wqkv(x).chunk(3, dim=-1)

    @staticmethod
    def _split(module, sd, prefix, meta):
        w = sd.pop(f"{prefix}wqkv.weight")
        for name, part in zip(("wq", "wk", "wv"), w.chunk(3)):
            sd[f"{prefix}{name}.weight"] = part.clone()

    @staticmethod
    def _merge(module, sd, prefix, *args):
        keys = [f"{prefix}{n}.weight" for n in ("wq", "wk", "wv")]
        if all(k in sd for k in keys):
            sd[f"{prefix}wqkv.weight"] = torch.cat([sd.pop(k) for k in keys])


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = FusedQKV()
        self.wo = nn.Linear(D, D, bias=False)
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x))
        return x + self.wo(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)


class TitanShaped(nn.Module):
    def __init__(self, layers=2, vocab=64):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, D)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(layers)})
        self.lm_head = nn.Linear(D, vocab, bias=False)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for layer in self.layers.values():
            h = layer(h)
        return self.lm_head(h)


def test_module_dict_blocks_are_units():
    """Same-class composite children of a ModuleDict are blocks (one unit each, in the dict's order);
    leaf alternatives in a ModuleDict (PEFT's per-adapter layers) are not made a block list."""
    specs, _ = discover(TitanShaped(layers=3), None)
    assert [s.name for s in specs] == ["tok_embeddings", "layers.0", "layers.1", "layers.2", "lm_head"]

    class Adapters(nn.Module):  # PEFT-like: {"default": Linear, "other": Linear} beside a base layer
        def __init__(self):
            super().__init__()
            self.base = nn.Linear(D, D)
            self.lora_A = nn.ModuleDict({"default": nn.Linear(D, 2), "other": nn.Linear(D, 2)})

    root = nn.Sequential(Adapters(), Adapters())
    assert [s.name for s in discover(root, None)[0]] == ["0", "1"]  # the two outer blocks, adapters inside


def _shaped_ranks(rank, world):
    torch.manual_seed(0)
    ref = TitanShaped()
    want = ref.state_dict()
    model = yafsdp.YaFSDP(TitanShaped())
    out = {"units": [u.name for u in model._rt.units],
           "names": [n for n, _ in model.module.named_parameters()]}
    model.load_full_state_dict(want if rank == 0 else None)
    got = model.full_state_dict()
    streamed = {}
    for piece in model.iter_full_state_dict():
        streamed.update(piece)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(3))
    out["logits"] = (model(ids) - ref(ids)).abs().max().item()
    if rank == 0:
        out["keys"] = (sorted(got), sorted(want), sorted(streamed))
        out["values"] = max((got[k] - want[k]).abs().max().item() for k in want)
        out["streamed"] = max((streamed[k] - want[k]).abs().max().item() for k in want)
    return out


def test_state_dict_hooks_and_module_dict_blocks():
    """A module with a state_dict post-hook (the fused QKV) wraps; full_state_dict / iter_full_state_dict
    give the unwrapped module's keys and values (hooks applied), load_full_state_dict takes them (the
    load pre-hook applied); the root is a plain nn.Module and gets no device anchor."""
    res = run_ranks(_shaped_ranks, 2, timeout_s=120)
    for out in res:
        assert out["units"] == ["tok_embeddings", "layers.0", "layers.1", "lm_head"]
        assert "yafsdp_device_anchor" not in out["names"] and len(out["names"]) == len(set(out["names"]))
        assert out["logits"] < 1e-6
    first = res[0]
    got, want, streamed = first["keys"]
    assert got == want == streamed and "layers.0.qkv.wq.weight" in want and "layers.0.qkv.wqkv.weight" not in want
    assert first["values"] == 0.0 and first["streamed"] == 0.0


# ---------------------------------------------------------------------------- torchtitan's llama3
def _titan_config():
    """torchtitan's llama3 debug model (dim 256, vocab 2048), 2 layers, SDPA inner attention."""
    llama3 = _import_torchtitan()
    from torchtitan.models.common.attention import ScaledDotProductAttention

    cfg = llama3.llama3_configs["debugmodel"](attn_backend="flex")
    cfg.layers = cfg.layers[:2]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return llama3, cfg


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, 2048, (2, 17), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _titan_ranks(rank, world, steps):
    llama3, cfg = _titan_config()
    from torch.nn.parallel import DistributedDataParallel
    from torchtitan.config import TrainingConfig

    from yafsdp.integrations.torchtitan import parallelize_yafsdp, yafsdp_model_spec

    out = {}
    spec = yafsdp_model_spec(llama3.model_registry("debugmodel", attn_backend="flex"))
    out["spec"] = (spec.name, spec.parallelize_fn is parallelize_yafsdp, spec.pipelining_fn)
    # torchtitan's Trainer: build on meta, parallelize_fn, to_empty, init_weights under no_grad
    with torch.device("meta"):
        meta = cfg.build()
    model = spec.parallelize_fn(meta, training=TrainingConfig(mixed_precision_param="float32"))
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    ref = cfg.build()
    torch.manual_seed(1)
    with torch.no_grad():
        ref.init_weights(buffer_device=None)
    out["units"] = [u.name for u in model._rt.units]
    out["needs_load"] = model.needs_load
    out["names"] = [n for n, _ in model.module.named_parameters()] == [n for n, _ in ref.named_parameters()]
    full = model.full_state_dict()
    want = ref.state_dict()
    if rank == 0:
        out["init_keys"] = sorted(full) == sorted(want)
        out["init"] = max((full[k] - want[k]).abs().max().item() for k in want)
    # torchtitan's Trainer flags: _skip_lm_head=False lands on the model; True (ChunkedLossWrapper) is refused
    model._skip_lm_head = False
    try:
        model._skip_lm_head = True
        out["chunked"] = ""
    except RuntimeError as e:
        out["chunked"] = str(e)
    try:
        model.state_dict()
        out["ckpt"] = ""
    except RuntimeError as e:
        out["ckpt"] = str(e)
    ddp = DistributedDataParallel(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = _batch(step, rank)
        pair = []
        for m, o in ((model, opt), (ddp, ref_opt)):
            loss = nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())
            loss.backward()
            o.step()
            o.zero_grad()
            pair.append(loss.item())
        losses.append(pair)
    out["losses"] = losses
    full = model.full_state_dict()
    if rank == 0:
        want = ref.state_dict()
        out["weights"] = max(((full[k] - want[k]).norm() / want[k].norm().clamp_min(1e-12)).item() for k in want)
    return out


@pytest.mark.skipif(_torchtitan_missing() is not None, reason=str(_torchtitan_missing()))
def test_torchtitan_llama3_parallelize_fn_matches_ddp():
    """torchtitan's flow (meta build -> parallelize_fn -> to_empty -> init_weights) gives the reference
    init on every rank; 3 AdamW steps match DDP on the unsharded model (losses, weights); the chunked
    loss and torchtitan's checkpointer are refused naming what to use."""
    res = run_ranks(_titan_ranks, 2, 3, timeout_s=240)
    for out in res:
        assert out["spec"] == ("llama3_yafsdp", True, None)
        assert out["units"] == ["tok_embeddings", "layers.0", "layers.1", "lm_head"]
        assert not out["needs_load"] and out["names"]
        assert "lm_head.weight" in out["chunked"] and "CrossEntropyLoss" in out["chunked"]
        assert "checkpoint.enable=False" in out["ckpt"] and "yafsdp.checkpoint" in out["ckpt"]
        for ours, theirs in out["losses"]:
            assert abs(ours - theirs) < 1e-5, out["losses"]
    assert res[0]["init_keys"] and res[0]["init"] == 0.0
    assert res[0]["weights"] < 1e-5, res[0]["weights"]
