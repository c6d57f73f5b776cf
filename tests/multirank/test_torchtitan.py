"""yafsdp inside torchtitan (yafsdp/integrations/torchtitan.py, [Note: the torchtitan seam]) and the engine
changes it needed: blocks in a ModuleDict ([Note: blocks in a ModuleDict] in layout/units.py), modules with
state_dict hooks ([Note: state_dict hooks] in wrapper/state_dict.py), no device anchor on a plain root
([Note: the device anchor] in wrapper/anchor.py).

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
from yafsdp.layout.units import discover

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

    class TokenLayer(nn.Module):  # PEFT's trainable-token layer: own weight, reads base_layer's, adapters in a dict
        def __init__(self):
            super().__init__()
            self.delta = nn.Parameter(torch.zeros(4, D))
            self.base_layer = nn.Embedding(64, D)
            self.adapters = nn.ModuleDict({"default": nn.Linear(D, 2), "other": nn.Linear(D, 2)})

    root = nn.Sequential(TokenLayer(), nn.Linear(D, 64))
    assert [s.name for s in discover(root, None)[0]] == ["0", "1"]  # one unit with its whole subtree, then the head


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

    class Extra(nn.Linear):  # state_dict entries that are no tensor of the module: refused, naming it
        def get_extra_state(self):
            return {"scale": 1.0}

    extra = TitanShaped()
    extra.layers["1"].wo = Extra(D, D, bias=False)
    try:
        yafsdp.YaFSDP(extra)
        out["extra"] = ""
    except ValueError as e:
        out["extra"] = str(e)
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
        assert "'layers.1.wo._extra_state'" in out["extra"] and "module 'layers.1.wo'" in out["extra"], out["extra"]
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


def _dims(world, **degrees):
    from torchtitan.distributed import ParallelDims

    sizes = dict(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1)
    sizes.update(degrees)
    return ParallelDims(**sizes, world_size=world)


def _titan_build(spec, cfg, training, ac=None, seed=1, dims=None, compile_config=None):
    """torchtitan's Trainer flow: build on meta, parallelize_fn, to_empty, init_weights under no_grad."""
    with torch.device("meta"):
        meta = cfg.build()
    model = spec.parallelize_fn(meta, parallel_dims=dims, training=training, ac_config=ac,
                                compile_config=compile_config)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def _reference(cfg, seed=1):
    ref = cfg.build()
    torch.manual_seed(seed)
    with torch.no_grad():
        ref.init_weights(buffer_device=None)
    return ref


def _titan_ranks(rank, world, root):
    llama3, cfg = _titan_config()
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as titan_dist
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from yafsdp import checkpoint as ckpt
    from yafsdp.integrations.torchtitan import parallelize_yafsdp, yafsdp_model_spec

    max_norm = 0.05  # small enough that every step clips (the gradient norms are ~2)

    def _training(**options):  # fp32 compute (the parity is fp32); no CUDA graphs, as yafsdp_trainer_config sets
        return TrainingConfig(mixed_precision_param="float32", disable_cuda_graphs=True, **options)

    out = {}
    spec = yafsdp_model_spec(llama3.model_registry("debugmodel", attn_backend="flex"))
    out["spec"] = (spec.name, spec.parallelize_fn is parallelize_yafsdp, spec.pipelining_fn)
    training = _training(max_norm=max_norm)
    model = _titan_build(spec, cfg, training, dims=_dims(world))
    out["refused"] = []
    try:
        _titan_build(spec, cfg, TrainingConfig(mixed_precision_param="float32"))  # torchtitan's default: CUDA graphs
        out["graphs_refused"] = ""
    except ValueError as e:
        out["graphs_refused"] = str(e)
    try:
        _titan_build(spec, cfg, _training(enable_cpu_offload=True))
        out["offload_refused"] = ""
    except ValueError as e:
        out["offload_refused"] = str(e)
    with torch.device("meta"):
        meta = cfg.build()
    out["zero_stage"] = spec.parallelize_fn(meta, parallelism=ParallelismConfig(fsdp_reshard_after_forward="never"),
                                            training=training).zero_stage
    for degrees in (dict(dp_shard=1, tp=2), dict(dp_shard=1, dp_replicate=2), dict(dp_shard=1, cp=2)):
        try:
            _titan_build(spec, cfg, training, dims=_dims(world, **degrees))
            out["refused"].append("")
        except ValueError as e:
            out["refused"].append(str(e))
    ref = _reference(cfg)
    out["units"] = [u.name for u in model._rt.units]
    out["needs_load"] = model.needs_load
    out["names"] = [n for n, _ in model.module.named_parameters()] == [n for n, _ in ref.named_parameters()]
    full, want = model.full_state_dict(), ref.state_dict()
    if rank == 0:
        out["init_keys"] = sorted(full) == sorted(want)
        out["init"] = max((full[k] - want[k]).abs().max().item() for k in want)
    try:
        model.state_dict()  # what torchtitan's checkpointer calls when the Trainer builds it
        out["ckpt_refused"] = ""
    except RuntimeError as e:
        out["ckpt_refused"] = str(e)

    def train(m, opt, steps, first=0, loss_fn=None, micro=1, reduce_by_hand=False):
        """The Trainer's step: forward/backward per microbatch, its clip of parameters(), the optimizer."""
        losses = []
        for step in range(first, steps):
            for k in range(micro):
                x, y = _batch(10 * step + k, rank)
                if loss_fn is None:
                    loss = nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten()) / micro
                else:
                    loss, _ = loss_fn(m(x), y, torch.tensor(float(micro * y.numel())))
                loss.backward()
            if reduce_by_hand:  # DDP's average, for a loss DDP refuses (a backward per chunk marks lm_head twice)
                for p in m.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            if hasattr(m, "_rt"):  # the Trainer's clip, of what parallelize_fn returned
                titan_dist.clip_grad_norm_(list(m.parameters()), max_norm, foreach=True)
            else:
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    # A: plain cross-entropy against DDP; a sharded checkpoint after step 2, resumed in a new model
    # SGD: unlike Adam, its update scales with the gradient, so a clip by the wrong norm shows
    sgd = dict(lr=0.5, momentum=0.9, weight_decay=0.01)
    opt = torch.optim.SGD(model.parameters(), **sgd)
    ddp = DistributedDataParallel(ref)
    ref_opt = torch.optim.SGD(ddp.parameters(), **sgd)
    ours = train(model, opt, 2)
    path = ckpt.save_checkpoint(root, 2, model, opt)
    ours += train(model, opt, 3, first=2)
    out["losses"] = list(zip(ours, train(ddp, ref_opt, 3)))
    full, want = model.full_state_dict(), ref.state_dict()
    if rank == 0:
        out["weights"] = max(((full[k] - want[k]).norm() / want[k].norm()).item() for k in want)
    resumed = _titan_build(spec, cfg, _training(max_norm=max_norm), seed=9)
    opt2 = torch.optim.SGD(resumed.parameters(), **sgd)
    ckpt.load_checkpoint(path, resumed, opt2)
    out["resumed_loss"] = (train(resumed, opt2, 3, first=2)[0], ours[2])
    again = resumed.full_state_dict()
    if rank == 0:
        out["resumed"] = max((again[k] - full[k]).abs().max().item() for k in full)

    # B: torchtitan's chunked loss (the Trainer sets _skip_lm_head), selective activation checkpointing and
    # compile (the eager backend: dynamo traces each unit, nothing is code-generated), two microbatches, against
    # the unsharded model with DDP's gradient average
    training = _training(max_norm=max_norm)
    compiled = CompileConfig(enable=True, components=["model"], backend="eager")
    model = _titan_build(spec, cfg, training, ac=SelectiveAC.Config(), compile_config=compiled)
    out["compiled"] = getattr(model, "_compiled_units", False)
    out["ac_units"] = [u.name for u in model._rt.units]
    ref = _reference(cfg)
    chunked = [ChunkedLossWrapper.Config(num_chunks=4, loss_fn=CrossEntropyLoss.Config()).build() for _ in range(2)]
    chunked[0].set_lm_head(model.lm_head)
    model._skip_lm_head = True  # as torchtitan's Trainer does: it lands on the wrapped model
    chunked[1].set_lm_head(ref.lm_head)
    ref._skip_lm_head = True
    out["skip_flag"] = (model.module._skip_lm_head, "_skip_lm_head" in model.__dict__)
    opt = torch.optim.SGD(model.parameters(), **sgd)
    ref_opt = torch.optim.SGD(ref.parameters(), **sgd)
    out["chunked_losses"] = list(zip(train(model, opt, 3, loss_fn=chunked[0], micro=2),
                                     train(ref, ref_opt, 3, loss_fn=chunked[1], micro=2, reduce_by_hand=True)))
    full, want = model.full_state_dict(), ref.state_dict()
    if rank == 0:
        out["chunked_keys"] = sorted(full) == sorted(want)
        out["chunked_weights"] = max(((full[k] - want[k]).norm() / want[k].norm()).item() for k in want)
    return out


@pytest.mark.skipif(_torchtitan_missing() is not None, reason=str(_torchtitan_missing()))
def test_torchtitan_llama3_parallelize_fn_matches_ddp(tmp_path):
    """torchtitan's flow (meta build -> parallelize_fn -> to_empty -> init_weights) gives the reference
    init on every rank; 3 SGD steps with the Trainer's clip (torchtitan's clip_grad_norm_ of the flat
    shards) match DDP with torch's clip on the unsharded model (losses, weights); a yafsdp.checkpoint
    saved at step 2 resumes exactly; the chunked loss with selective activation checkpointing, compiled
    units and two microbatches matches too; what the engine cannot do (other parallelisms, CUDA graphs,
    torchtitan's CPU offload and checkpointer) is refused naming what to use."""
    res = run_ranks(_titan_ranks, 2, str(tmp_path), timeout_s=300)
    for out in res:
        assert out["spec"] == ("llama3_yafsdp", True, None)
        assert out["units"] == out["ac_units"] == ["tok_embeddings", "layers.0", "layers.1", "lm_head"]
        assert not out["needs_load"] and out["names"]
        assert "enable_cpu_offload" in out["offload_refused"] and "offload='optimizer'" in out["offload_refused"]
        assert out["zero_stage"] == 2
        assert "training.disable_cuda_graphs=True" in out["graphs_refused"], out["graphs_refused"]
        for what, msg in zip(("tensor_parallel", "data_parallel_replicate", "context_parallel"), out["refused"]):
            assert f"parallelism.{what}_degree > 1 is not supported" in msg, out["refused"]
        assert "checkpoint.enable=False" in out["ckpt_refused"] and "yafsdp.checkpoint" in out["ckpt_refused"]
        assert out["skip_flag"] == (True, False) and out["compiled"]
        for ours, theirs in out["losses"] + out["chunked_losses"]:
            assert abs(ours - theirs) < 1e-5, (out["losses"], out["chunked_losses"])
        assert out["resumed_loss"][0] == out["resumed_loss"][1]
    r0 = res[0]
    assert r0["init_keys"] and r0["init"] == 0.0 and r0["chunked_keys"]
    assert r0["weights"] < 1e-5 and r0["chunked_weights"] < 1e-5, (r0["weights"], r0["chunked_weights"])
    assert r0["resumed"] == 0.0
