"""Full tensors of a tensor-parallel engine: Hugging Face exports and loads (yafsdp/integrations/hf_export.py,
hf_stream.py), ``full_parameter`` / ``full_grad`` / ``named_grad_norms`` (yafsdp/wrapper/views.py).

World 4 as a (dp 2, tp 2) DeviceMesh, a tiny HF Llama under yafsdp's Llama TP plan (sequence parallel; the
vocabulary of 67 rows splits 34 / 33 over TP; the row-parallel projections are split along their columns). After
one AdamW step the TP engine's weights are exported with ``yafsdp.hf.export_hf`` and, loaded into a non-TP engine
over the 4 ranks, exported again: the two folders hold the same files, the same index and the same tensors bit for
bit, and ``LlamaForCausalLM.from_pretrained`` of the TP export computes the logits of the plain model holding those
weights, bit for bit. ``yafsdp.hf.load_hf_weights`` of that export into the same TP model built on the meta device
gives back the full state dict bit for bit (each rank reads its TP slice's runs of the file, then its data-parallel
shard of them); a wrong global shape and a NaN that only one TP coordinate reads are refused on every rank, and so
is an export whose folder cannot be written. After a backward of both engines on the same global batch (the
non-TP engine's rank r takes the batch of data-parallel rank r // 2, so both average the same two batches),
``full_parameter`` of every parameter is equal bit for bit on every rank, and ``full_grad`` and ``named_grad_norms``
agree as tightly as the fp32 parity tests (the TP model sums in another order); so do, after one AdamW step of each,
their full optimizer state dicts, and global rank 0's TP one loaded into a TP engine and into the engine without TP
saves back bit for bit (a wrong global shape refused on every rank). ``summon_full_params`` hands out the full
values and gradients on every rank, and its writeback into the model built on the meta device stores global rank
0's values on every rank, split over TP (each rank draws its own; a parameter left uninitialised is refused on
every rank).
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import yafsdp
import yafsdp.hf
from dist_utils import run_ranks
from models import tiny_llama
from test_tp import VOCAB, _batch, _opt, _refused, tp_plan

SHARD = "40KB"  # several files, so the index and the split between files are compared too


def _meta_tp_engine(mesh):
    """The tiny Llama built on the meta device, TP applied, wrapped: the shards wait for a load."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device("meta"):
        model = tiny_llama(vocab=VOCAB)
    model.model.rotary_emb = LlamaRotaryEmbedding(model.config)  # real buffers (not in the checkpoint)
    model = yafsdp.YaFSDP(tp_plan(model, mesh["tp"], sp=True), mesh=mesh["dp"])
    assert model.needs_load
    return model


def _world(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    tp = yafsdp.YaFSDP(tp_plan(tiny_llama(vocab=VOCAB), mesh["tp"], sp=True), mesh=mesh["dp"])
    opt = _opt(tp.parameters())
    tp(**_batch(0, 0, dp_rank)).loss.backward()
    opt.step()
    opt.zero_grad()
    sd = tp.full_state_dict()
    out = {"sd": sd} if rank == 0 else {}

    # the export of the TP engine, and of a non-TP engine over the same 4 ranks holding the same weights
    assert yafsdp.hf.export_hf(tp, f"{root}/tp", max_shard_size=SHARD) == (f"{root}/tp" if rank == 0 else None)
    plain = yafsdp.YaFSDP(tiny_llama(vocab=VOCAB, seed=1))
    plain.load_full_state_dict(sd if rank == 0 else None)
    yafsdp.hf.export_hf(plain, f"{root}/plain", max_shard_size=SHARD)

    # an export whose folder cannot be made: refused on every rank, the other TP coordinate's too
    if rank == 0:
        open(f"{root}/a_file", "w").close()
    dist.barrier()
    out["unwritable"] = _refused(lambda: yafsdp.hf.export_hf(tp, f"{root}/a_file/out"))

    # loads into the TP model built on the meta device
    fresh = _meta_tp_engine(mesh)
    if rank == 0:
        inner = tiny_llama(vocab=VOCAB)
        yafsdp.hf.write_hf(dict(sd, **{"lm_head.weight": sd["lm_head.weight"][:-1]}), inner, f"{root}/short")
        nan = {k: v.clone() for k, v in sd.items()}
        nan["lm_head.weight"][60, 3] = float("nan")  # row 60: TP coordinate 1's rows (34..66) only
        yafsdp.hf.write_hf(nan, inner, f"{root}/nan")
    dist.barrier()
    out["short"] = _refused(lambda: yafsdp.hf.load_hf_weights(fresh, f"{root}/short"))
    out["nan"] = _refused(lambda: yafsdp.hf.load_hf_weights(fresh, f"{root}/nan"))
    yafsdp.hf.load_hf_weights(fresh, f"{root}/tp")
    assert not fresh.needs_load
    back = fresh.full_state_dict()
    if rank == 0:
        out["back_equal"] = back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    inputs = _batch(1, 0, dp_rank)
    with torch.no_grad():
        out["same_loss"] = fresh(**inputs).loss.item() == tp(**inputs).loss.item()
    _views_and_optimizer(out, tp, plain, fresh, dp_rank)
    _summon(out, tp, mesh)
    return out


def _summon(out, tp, mesh):
    """summon_full_params: the full values and gradients on every rank; writeback into the model built on the meta
    device from values each rank draws differently: global rank 0's land everywhere, and a parameter left
    uninitialised is refused on every rank."""
    rank = dist.get_rank()
    with tp.summon_full_params(with_grads=True):
        held = {n: (p.detach().clone(), p.grad.clone()) for n, p in tp.module.named_parameters()}
    out["summon_values"] = all(torch.equal(v, tp.full_parameter(n)) and torch.equal(g, tp.full_grad(n))
                               for n, (v, g) in held.items())
    blank = _meta_tp_engine(mesh)
    torch.manual_seed(100 + rank)

    def draw(skip=None):
        drawn = {}
        with blank.summon_full_params(writeback=True), torch.no_grad():
            for n, p in blank.module.named_parameters():
                if n != skip:
                    drawn[n] = p.normal_().clone()
        return drawn

    out["summon_missing"] = _refused(lambda: draw(skip="model.norm.weight"))
    drawn = draw()
    out["summon_loaded"] = not blank.needs_load
    out["summon_drawn"] = drawn
    out["summon_back"] = {n: blank.full_parameter(n) for n in drawn}


def _views_and_optimizer(out, tp, plain, fresh, dp_rank):
    """``tp`` and ``plain`` hold the same weights. full_parameter / full_grad / named_grad_norms after a backward of
    both on the same global batch; then one AdamW step of each from a fresh optimizer and their full optimizer state
    dicts, and global rank 0's TP one loaded into ``fresh``'s and ``plain``'s optimizers and saved back."""
    rank = dist.get_rank()
    tp(**_batch(5, 0, dp_rank)).loss.backward()
    plain(**_batch(5, 0, dp_rank)).loss.backward()
    names = [n for n, _ in tiny_llama(vocab=VOCAB).named_parameters()]
    out["values_equal"] = all(torch.equal(tp.full_parameter(n), plain.full_parameter(n)) for n in names)
    out["grad_errors"] = {n: _rel(tp.full_grad(n), plain.full_grad(n)) for n in names}
    got, want = tp.named_grad_norms(), plain.named_grad_norms()
    assert got.keys() == want.keys() == set(names), sorted(set(got) ^ set(want))
    out["norm_errors"] = {n: abs(got[n].item() - want[n].item()) / want[n].item() for n in names}

    sds = []
    for model in (tp, plain):
        opt = _opt(model.parameters())
        opt.step()
        sds.append(model.full_optim_state_dict(opt))
    if rank == 0:
        out["optim"] = sds
    else:
        assert sds == [{}, {}], "only global rank 0 gets the full optimizer state dict"
    if rank == 0:  # a wrong global shape: refused on every rank
        bad = {**sds[0], "state": {**sds[0]["state"], "lm_head.weight": {
            **sds[0]["state"]["lm_head.weight"], "exp_avg": sds[0]["state"]["lm_head.weight"]["exp_avg"][:-1]}}}
    fresh_opt = _opt(fresh.parameters())
    out["optim_short"] = _refused(lambda: fresh.load_full_optim_state_dict(fresh_opt, bad if rank == 0 else None))
    back = []
    for model, opt in ((fresh, fresh_opt), (plain, _opt(plain.parameters()))):
        model.load_full_optim_state_dict(opt, sds[0] if rank == 0 else None)
        back.append(model.full_optim_state_dict(opt))
    if rank == 0:
        out["optim_back"] = back


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    return float((a - b).norm() / b.norm())


def _tensors(folder: str) -> dict:
    from safetensors import safe_open

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                out[name] = {k: f.get_tensor(k) for k in f.keys()}
    return out


def test_tp_full_tensors(tmp_path):
    from transformers import LlamaForCausalLM

    res = run_ranks(_world, 4, str(tmp_path))
    assert all(r["same_loss"] for r in res), "the loaded engine computes the trained engine's loss"
    assert all(r["values_equal"] for r in res), "full_parameter: the values of the engine without TP, bit for bit"
    for r in res:
        assert max(r["grad_errors"].values()) < 1e-5, r["grad_errors"]
        assert max(r["norm_errors"].values()) < 1e-5, r["norm_errors"]
    assert res[0]["back_equal"], "load_hf_weights into a meta-built TP engine: the full state dict bit for bit"
    for r in res:
        assert "'lm_head.weight' has shape (66, 32), expected (67, 32)" in r["short"], r["short"]
        assert "holds NaN/inf" in r["nan"] and "lm_head.weight" in r["nan"], r["nan"]
        assert "cannot start writing" in r["unwritable"], r["unwritable"]
    tp_dir, plain_dir = tmp_path / "tp", tmp_path / "plain"
    assert sorted(os.listdir(tp_dir)) == sorted(os.listdir(plain_dir))
    assert len([n for n in os.listdir(tp_dir) if n.endswith(".safetensors")]) > 1
    index = "model.safetensors.index.json"
    assert json.loads((tp_dir / index).read_text()) == json.loads((plain_dir / index).read_text())
    got, want = _tensors(str(tp_dir)), _tensors(str(plain_dir))
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys(), name
        for k in want[name]:
            a, b = got[name][k], want[name][k]
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), (name, k)
    sd = res[0]["sd"]
    assert sorted(k for f in got.values() for k in f) == sorted(sd)

    # the full optimizer state dict: TP against no TP after the same step; the round trips bit for bit
    (with_tp, without), back = res[0]["optim"], res[0]["optim_back"]
    assert with_tp["param_groups"] == without["param_groups"] and with_tp["state"].keys() == without["state"].keys()
    for n, st in without["state"].items():
        assert with_tp["state"][n].keys() == st.keys() == {"step", "exp_avg", "exp_avg_sq"}, (n, st.keys())
        assert torch.equal(with_tp["state"][n]["step"], st["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert _rel(with_tp["state"][n][key], st[key]) < 1e-5, (n, key)
    for again in back:  # into the TP engine and into the engine without TP
        assert again["param_groups"] == with_tp["param_groups"]
        assert all(torch.equal(again["state"][n][k], v) for n, st in with_tp["state"].items() for k, v in st.items())
    for r in res:
        assert "'exp_avg' of 'lm_head.weight' has shape (66, 32), the parameter (67, 32)" in r["optim_short"], r

    # summon_full_params: full values and grads on every rank; writeback of global rank 0's values
    drawn = res[0]["summon_drawn"]
    assert drawn.keys() == sd.keys() and all(drawn[k].shape == sd[k].shape for k in sd)
    assert not torch.equal(res[1]["summon_drawn"]["lm_head.weight"], drawn["lm_head.weight"]), "each rank drew its own"
    for r in res:
        assert r["summon_values"] and r["summon_loaded"]
        assert "not initialised" in r["summon_missing"] and "'model.norm.weight'" in r["summon_missing"], r
        assert all(torch.equal(r["summon_back"][k], drawn[k]) for k in drawn), "global rank 0's values, every rank"

    loaded = LlamaForCausalLM.from_pretrained(str(tp_dir), attn_implementation="eager")
    ref = tiny_llama(vocab=VOCAB, seed=1)
    ref.load_state_dict(sd)
    ids = _batch(2, 0, 0)["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, ref.eval()(input_ids=ids).logits)


def test_tp_slice_reads_torch_chunks():
    """``_tp_slice`` (the HF load's read of a TP slice from a full tensor's file order) against the slices torch's
    ``Shard(dim)`` holds (``torch.chunk``; the ranks past the last chunk hold none), for every dim, uneven sizes,
    and element ranges that start and stop inside runs."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate, Shard

    from yafsdp.integrations.hf_stream import TensorSource, _tp_slice

    full = torch.randn(7, 5, 3, generator=torch.Generator().manual_seed(0))
    entry = TensorSource({"w": full}).entries["w"]
    scratch = torch.empty(64, dtype=torch.uint8)
    for size in (2, 3, 4):
        mesh = SimpleNamespace(size=lambda size=size: size)
        for dim in (0, 1, 2, -1):
            chunks = full.chunk(size, dim)
            for rank in range(size):
                want = chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)
                spec = SimpleNamespace(mesh=mesh, placements=(Shard(dim),), shape=full.shape)
                local = _tp_slice(entry, spec, tuple(want.shape), rank)
                flat = want.reshape(-1)
                n = flat.numel()
                for a, b in ((0, n), (1, n - 1), (n // 3, n // 2 + 2)):
                    a, b = min(a, n), max(min(b, n), min(a, n))
                    out = torch.empty(b - a)
                    local.read(a, b, out, scratch)
                    assert torch.equal(out, flat[a:b]), (size, dim, rank, a, b)
    spec = SimpleNamespace(mesh=SimpleNamespace(size=lambda: 2), placements=(Replicate(),), shape=full.shape)
    assert _tp_slice(entry, spec, tuple(full.shape), 1) is entry
