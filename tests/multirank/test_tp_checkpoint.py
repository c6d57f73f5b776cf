"""Sharded checkpoints with tensor parallelism, resharded across layouts (yafsdp/checkpoint/by_param.py).

A tiny HF Llama (an uneven vocabulary: its TP slices differ in size) trains 6 AdamW steps at tp 2 x dp 2 (world
4), saving at step 2 (``save_checkpoint``) and step 4 (``AsyncSaver``): the uninterrupted run. Then, from step 2:

- the same layout resumes and trains steps 3-4 bit for bit as the uninterrupted run (same reductions, same
  order: nothing differs);
- a plain engine (tp 1 x dp 4, no TP) loads it (the weights bit for bit: a load moves values, it computes
  nothing), trains steps 3-4 on the same global batch and saves the flat form at step 4; an HSDP engine
  (replicate 2 x shard 2) loads it too, each replica reading its own shards;
- at tp 2 x dp 1 (world 2) that flat checkpoint and the uninterrupted run's step-4 checkpoint (params form)
  each load (bit for bit) and train steps 5-6.

Across layouts the losses and weights agree with the uninterrupted run within fp32 tolerance, not bit for bit:
another TP degree splits every matmul's reduction differently (a row-parallel output is summed over TP ranks;
the norms' gradients are summed over the sequence shards in another order) and another data-parallel size
averages the gradients in another order. A lost optimizer state (AdamW's exp_avg, exp_avg_sq, step) would
change the first step after the load by the order of the learning rate, far outside the tolerance.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

import yafsdp
import yafsdp.checkpoint as ckpt
import yafsdp.init
from yafsdp.integrations.tp_plans import llama_tp_plan
from dist_utils import run_ranks
from models import tiny_llama
from parity import LR, MAX_NORM, rel_l2, rel_seq

SEQ = 10  # a multiple of the TP degree (sequence parallelism)
VOCAB = 67  # uneven over TP: 34 / 33 rows of the head and the embedding
GLOBAL = 4  # sequences per step (two per dp rank at dp 2)


def _global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=torch.Generator().manual_seed(100 + step))


def _model(mesh):
    """TP on mesh["tp"] and the engine on mesh["dp"]; ``mesh`` None: a plain engine over the world."""
    model = tiny_llama(vocab=VOCAB)
    if mesh is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        model = parallelize_module(model, mesh["tp"], llama_tp_plan(model, sequence_parallel=True))
        return yafsdp.YaFSDP(model, mesh=mesh["dp"])
    return yafsdp.YaFSDP(model)


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)


def _train(model, opt, steps, dp_rank: int, dp: int, dp_group):
    """Steps ``steps`` on the global batch split over ``dp`` data-parallel ranks; the global loss of each."""
    losses = []
    for step in steps:
        ids = _global_batch(step).chunk(dp)[dp_rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        t = loss.detach().clone()
        dist.all_reduce(t, group=dp_group)
        losses.append(t.item() / dp)
        model.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
    return losses


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _world4(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    tp_root, flat_root = os.path.join(root, "tp2dp2"), os.path.join(root, "dp4")
    out = {}

    # the seeded init fills the TP slices with the values it gives an engine without TP (layout/pieces.py)
    inits = []
    for m in (_model(mesh), _model(None)):
        yafsdp.init.init_shards_(m, yafsdp.init.normal_init(0.02), seed=3)
        inits.append(m.full_state_dict())
    assert _same(*inits) and (rank != 0 or len(inits[0]) > 0), "init_shards_ differs with TP"

    # the uninterrupted run: saves at step 2 (synchronous) and step 4 (in the background)
    model = _model(mesh)
    opt = _opt(model)
    losses = _train(model, opt, range(2), dp_rank, 2, dp_group)
    ckpt.save_checkpoint(tp_root, 2, model, opt, state={"step": 2, "data": {"pos": 8}},
                         rank_state={"rank": rank, "seed": torch.tensor([rank, 7])})
    full2 = model.full_state_dict()
    saver = ckpt.AsyncSaver(model, opt)
    losses += _train(model, opt, range(2, 4), dp_rank, 2, dp_group)
    saver.save(tp_root, 4, state={"step": 4}, rank_state={"rank": rank}, keep=5)
    out["full4"] = model.full_state_dict()
    losses += _train(model, opt, range(4, 6), dp_rank, 2, dp_group)
    assert saver.close() == ckpt.checkpoint_dir(tp_root, 4)
    out["losses"] = losses
    out["full6"] = model.full_state_dict()

    # the same layout resumes: bit for bit
    model = _model(mesh)
    opt = _opt(model)
    loaded = ckpt.load_checkpoint(ckpt.checkpoint_dir(tp_root, 2), model, opt)
    assert (loaded.step, loaded.state, loaded.saved_world_size) == (2, {"step": 2, "data": {"pos": 8}}, 4)
    assert loaded.rank_state["rank"] == rank and torch.equal(loaded.rank_state["seed"], torch.tensor([rank, 7]))
    assert _same(model.full_state_dict(), full2)
    assert _train(model, opt, range(2, 4), dp_rank, 2, dp_group) == losses[2:4], "same-layout resume not exact"
    assert _same(model.full_state_dict(), out["full4"])

    # tp 1 x dp 4: a plain engine reads the params form, trains, and writes the flat form
    model = _model(None)
    opt = _opt(model)
    loaded = ckpt.load_checkpoint(ckpt.checkpoint_dir(tp_root, 2), model, opt)
    assert loaded.rank_state["rank"] == rank and loaded.state["step"] == 2
    assert _same(model.full_state_dict(), full2), "the params form loaded into a plain engine differs"
    out["dp4_losses"] = _train(model, opt, range(2, 4), rank, 4, dist.group.WORLD)
    hsdp = yafsdp.YaFSDP(tiny_llama(vocab=VOCAB, seed=1),
                         mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    loaded = ckpt.load_checkpoint(ckpt.checkpoint_dir(tp_root, 2), hsdp, _opt(hsdp))  # each replica reads its shards
    assert loaded.rank_state["rank"] == rank and _same(hsdp.full_state_dict(), full2), "HSDP load of the params form"
    assert _same(_replica_shards(hsdp), _replica_shards(hsdp, from_replica=1)), "the replicas differ"
    ckpt.save_checkpoint(flat_root, 4, model, opt, state={"step": 4}, rank_state={"rank": rank})
    out["dp4_full4"] = model.full_state_dict()
    if rank == 0:
        out["manifests"] = [ckpt.read_manifest(ckpt.checkpoint_dir(r, 4)) for r in (tp_root, flat_root)]
        out["keys"] = [sorted(ckpt.SafeReader(ckpt.checkpoint_dir(r, 4)).read_metadata().state_dict_metadata)
                       for r in (tp_root, flat_root)]
    return out


def _replica_shards(model, from_replica: int = 0) -> dict:
    """Replica ``from_replica``'s master shards, received by every rank of the same shard index."""
    out = {}
    for info in model.shard_info():
        t = info.param.detach().clone()
        dist.broadcast(t, src=dist.get_global_rank(model.replicate_group, from_replica), group=model.replicate_group)
        out[info.key] = t
    return out


def _world2(rank, world, root, full4, dp4_full4):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for name, path, full in (("from_flat", ckpt.checkpoint_dir(os.path.join(root, "dp4"), 4), dp4_full4),
                             ("from_tp", ckpt.checkpoint_dir(os.path.join(root, "tp2dp2"), 4), full4)):
        model = _model(mesh)
        opt = _opt(model)
        loaded = ckpt.load_checkpoint(path, model, opt)
        assert (loaded.step, loaded.rank_state) == (4, {"rank": rank}), (loaded.step, loaded.rank_state)
        sd = model.full_state_dict()
        if rank == 0:
            assert _same(sd, full), f"{name}: the loaded weights differ"
        out[name] = (_train(model, opt, range(4, 6), 0, 1, mesh["dp"].get_group()), model.full_state_dict())

    # refusals: a layout this code does not read; a model of other global shapes
    bad = os.path.join(root, "bad")
    if rank == 0:
        shutil.copytree(ckpt.checkpoint_dir(os.path.join(root, "tp2dp2"), 4), os.path.join(bad, "step_00000004"))
        manifest = ckpt.read_manifest(os.path.join(bad, "step_00000004"))
        manifest["layout"]["format"] = "params-v9"
        with open(os.path.join(bad, "step_00000004", ckpt.MANIFEST), "w") as f:
            json.dump(manifest, f)
    dist.barrier()
    model = _model(mesh)
    out["refused"] = []
    for path, m in ((os.path.join(bad, "step_00000004"), model),
                    (ckpt.checkpoint_dir(os.path.join(root, "dp4"), 4), _other_vocab(mesh))):
        try:
            ckpt.load_checkpoint(path, m)
            out["refused"].append(None)
        except ckpt.CheckpointError as e:
            out["refused"].append(str(e))
    return out


def _other_vocab(mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    model = tiny_llama(vocab=VOCAB + 2)
    model = parallelize_module(model, mesh["tp"], llama_tp_plan(model, sequence_parallel=True))
    return yafsdp.YaFSDP(model, mesh=mesh["dp"])


def test_boxes_tile_a_range():
    """layout/pieces.py: every range of every shape (0-D to 4-D) cut into at most 2 * ndim - 1 boxes, each the
    elements [start, start + size) of the flattening, together the range in order."""
    from yafsdp.layout.pieces import boxes

    g = torch.Generator().manual_seed(0)
    for _ in range(500):
        shape = tuple(torch.randint(1, 6, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g).tolist())
        n = torch.Size(shape).numel()
        a, b = sorted(torch.randint(0, n + 1, (2,), generator=g).tolist())
        t, got = torch.arange(n).view(shape), []
        cut = boxes(shape, a, b)
        assert len(cut) <= max(1, 2 * len(shape) - 1), (shape, a, b, cut)
        for offsets, sizes, start in cut:
            box = t
            for d, (o, s) in enumerate(zip(offsets, sizes)):
                box = box.narrow(d, o, s)
            assert box.reshape(-1).tolist() == list(range(start, start + box.numel())), (shape, a, b, offsets)
            got += box.reshape(-1).tolist()
        assert got == list(range(a, b)), (shape, a, b, cut)


def test_tp_checkpoints_reshard(tmp_path):
    four = run_ranks(_world4, 4, str(tmp_path))[0]
    losses = four["losses"]
    assert rel_seq(four["dp4_losses"], losses[2:4]) < 1e-5, (four["dp4_losses"], losses[2:4])
    assert rel_l2(four["dp4_full4"], four["full4"]) < 1e-5
    tp_manifest, flat_manifest = four["manifests"]
    assert tp_manifest["layout"] == {"tp": 2, "format": "params"} and "layout" not in flat_manifest
    assert tp_manifest["units"] == flat_manifest["units"], "the units are listed by global shape at any TP degree"
    tp_keys, flat_keys = four["keys"]
    assert "param.lm_head.weight" in tp_keys and "param_optim.exp_avg.lm_head.weight" in tp_keys
    assert not any(k.startswith("model.") for k in tp_keys), tp_keys
    assert not any(k.startswith("param") for k in flat_keys) and any(k.startswith("model.") for k in flat_keys)

    two = run_ranks(_world2, 2, str(tmp_path), four["full4"], four["dp4_full4"])[0]
    for name in ("from_flat", "from_tp"):
        got, sd = two[name]
        assert rel_seq(got, losses[4:6]) < 1e-5, (name, got, losses[4:6])
        assert rel_l2(sd, four["full6"]) < 1e-5, (name, rel_l2(sd, four["full6"]))
    layout, shapes = two["refused"]
    assert layout and "params-v9" in layout and "checkpoint.json" in layout and "step_00000004" in layout, layout
    assert shapes and "different model" in shapes and "(69, 32)" in shapes, shapes
