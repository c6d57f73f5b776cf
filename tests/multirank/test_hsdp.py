"""HSDP: shard inside a group, replicate across groups (yafsdp/comm/hsdp.py).

Parity against one process training the unwrapped model on the global batch, at world 4 as 2x2
(a DeviceMesh) and world 6 as 2x3 (a mesh) and 3x2 (the (shard_group, replicate_group) pair);
accumulation 1, 2 and a changing one (the mispredicted last backward); tied and untied Llama,
ZeRO-2, bf16, frozen parameters. The cross-replica all-reduce is counted: each gradient element
once per optimizer step, and none in a backward that is not the step's last (once predicted).
Checkpoints saved with one mesh load with another and with a flat world, and the reverse.
Each world is spawned once and runs every case (see ``_world``).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

import yafsdp
from dist_utils import hsdp_groups, run_ranks
from models import batch, loss_of, tiny_llama
from parity import LR, MAX_NORM, _cast_model, rel_l2, rel_seq

# name -> options: tie, zero, bf16, accums (backward calls per step), freeze (name fragments)
CASES = {
    "untied_a1": dict(accums=(1, 1, 1)),
    "tied_a2": dict(tie=True, accums=(2, 2, 2)),
    "z2_untied_a2": dict(zero=2, accums=(2, 2, 2)),
    "tied_accum_changes": dict(tie=True, accums=(2, 1, 3)),  # steps 2 and 3 mispredict the last backward
    "bf16_tied_a2": dict(tie=True, bf16=True, accums=(2, 2, 2)),
    "frozen_a2": dict(freeze=("embed_tokens", "q_proj", "model.norm"), accums=(2, 2, 2)),
}
PLAN = {  # world -> [(mesh shape (replicas, shard), form, cases)]
    4: [((2, 2), "mesh", list(CASES)), ((4, 1), "groups", ["tied_a2"])],  # 4 x 1: replication only (DDP)
    6: [((2, 3), "mesh", ["untied_a1", "tied_a2"]), ((3, 2), "groups", ["untied_a1", "tied_a2"])],
}


def _model(case):
    model = tiny_llama(tie=case.get("tie", False))
    for name, p in model.named_parameters():
        if any(f in name for f in case.get("freeze", ())):
            p.requires_grad_(False)
    return model


def _opt(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def _groups(shape, form):
    """(mesh, process_group) arguments for YaFSDP: global rank = replica * shard + shard index."""
    replicas, shard = shape
    if form == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        return dict(mesh=init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")))
    return dict(process_group=hsdp_groups(replicas, shard))


def _train(model, case, rank, world):
    """Train 3 steps; per step: loss, norm, the cross-replica stats before/after."""
    opt = _opt(model.parameters())
    rs = model._rt.replica_sync
    trainable = sum(u.flat_param.numel() for u in model.flat_units if u.flat_param is not None)
    losses, norms, per_step = [], [], []
    for step, accum in enumerate(case["accums"]):
        before = dict(rs.stats)
        early = []  # all-reduces issued during backward calls that were not the step's last
        total = 0.0
        for micro in range(accum):
            loss = loss_of(model, "llama", batch("llama", step, micro, rank))
            (loss / accum).backward()
            total += loss.item() / accum
            if micro < accum - 1:
                early.append(rs.stats["all_reduces"] - before["all_reduces"])
        t = torch.tensor(total)
        dist.all_reduce(t)
        losses.append(t.item() / world)
        synced = model.sync_grads() if step < 2 else None  # True: it had to all-reduce (then clip does not)
        norms.append(model.clip_grad_norm_(MAX_NORM).item())
        mid = dict(rs.stats)
        opt.step()
        assert rs.stats == mid, ("the optimizer step all-reduced again after clip_grad_norm_", step, mid, rs.stats)
        opt.zero_grad(set_to_none=step % 2 == 0)
        per_step.append(dict(elements=mid["elements"] - before["elements"],
                             deferred=mid["deferred"] - before["deferred"],
                             overlapped=mid["overlapped"] - before["overlapped"],
                             rescaled=mid["rescaled"] - before["rescaled"], early=early, synced=synced))
    return losses, norms, per_step, trainable, opt


def _replicas_agree(model) -> bool:
    """Every replica holds the same master shards (compared across the replicate group)."""
    mine = model._rt.master.clone()
    allv = [torch.empty_like(mine) for _ in range(model.replicas)]
    dist.all_gather(allv, mine, group=model.replicate_group)
    return all(torch.equal(v, mine) for v in allv)


def _world(rank, world, ckpt_root):
    out = {"cases": {}, "refusals": {}, "ckpt": {}}
    for shape, form, names in PLAN[world]:
        for name in names:
            case = CASES[name]
            model = yafsdp.YaFSDP(_model(case), zero_stage=case.get("zero", 3),
                                  param_dtype=torch.bfloat16 if case.get("bf16") else None, **_groups(shape, form))
            assert model.mesh_shape == shape and model.world_size == shape[1]
            if name == "untied_a1":  # the memory plan: one replica's, sharded over the shard dim only
                from yafsdp.plan import memory_plan

                with torch.device("meta"):
                    meta = _model(case)
                plan = memory_plan(meta, world_size=shape[1], rank=model.rank)
                assert plan.engine_bytes() == model.memory_plan().engine_bytes() == model.allocated_bytes()
            losses, norms, per_step, trainable, _ = _train(model, case, rank, world)
            sd = model.full_state_dict()
            assert (sd != {}) == (rank == 0), "only global rank 0 receives the full state dict"
            out["cases"][(shape, name)] = (losses, norms, per_step, trainable, sd if rank == 0 else None,
                                           _replicas_agree(model))
    if world == 4:
        out["lora"] = _lora_2x2(rank, ckpt_root)
        out["refusals"] = _refusals()
        out["ckpt"] = _save_and_reload_4(rank, ckpt_root)
    else:
        out["ckpt"] = _reload_6(ckpt_root)
    return out


def _lora_2x2(rank, root) -> dict:
    """A PEFT LoRA model on a 2x2 mesh (frozen base, trainable adapters): trained as in
    tests/multirank/test_lora.py, then the adapter and the merged export written (by global rank 0 only)."""
    from test_lora import _lora_model, _train

    model = yafsdp.YaFSDP(_lora_model(), **_groups((2, 2), "mesh"))
    losses, norms = _train(model, rank, 4, True)
    out = os.path.join(root, "lora_adapter")
    return dict(losses=losses, norms=norms, path=model.save_adapter(out),
                merged=yafsdp.adapters.export_merged(model, out + "-merged"), sd=model.full_state_dict())


def _refusals() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    got = {}
    for key, kwargs in {
        "3d": lambda: dict(mesh=init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "replicate", "shard"))),
        "names": lambda: dict(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))),
        "both": lambda: dict(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
                             process_group=dist.group.WORLD),
        "uneven": None,  # below: every rank must create every group
        "peers": None,
        "offload": lambda: dict(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
                                offload="optimizer"),
    }.items():
        try:
            rank = dist.get_rank()
            if key == "uneven":
                g01, g23 = dist.new_group([0, 1]), dist.new_group([2, 3])
                kw = dict(process_group=(dist.group.WORLD, g01 if rank < 2 else g23))
            elif key == "peers":  # shard groups {0,1}, {2,3}; "replicate" groups {0,3}, {1,2}: other shard indices
                g01, g23, g03, g12 = (dist.new_group(r) for r in ([0, 1], [2, 3], [0, 3], [1, 2]))
                kw = dict(process_group=(g01 if rank < 2 else g23, g03 if rank in (0, 3) else g12))
            else:
                kw = kwargs()
            yafsdp.YaFSDP(tiny_llama(), **kw)
            got[key] = None
        except ValueError as e:
            got[key] = str(e)
    return got


def _ckpt_model(shape, form="mesh"):
    model = yafsdp.YaFSDP(tiny_llama(tie=True), **(_groups(shape, form) if shape else {}))
    return model, _opt(model.parameters())


def _opt_state(model, opt):
    """This rank's AdamW exp_avg shards, by unit (unpadded part), to compare across layouts."""
    out = {}
    for i in model.shard_info():
        st = opt.state.get(i.param, {})
        if "exp_avg" in st:
            valid = max(0, min(i.shard_numel, i.numel - i.shard_start))
            out[i.key] = (i.shard_start, st["exp_avg"][:valid].clone())
    return out


def _full_opt(model, opt):
    """exp_avg of every unit, whole (gathered over the shard group), on every rank."""
    parts = _opt_state(model, opt)
    every = [None] * model.world_size
    dist.all_gather_object(every, parts, group=model.process_group)
    full = {}
    for key in parts:
        full[key] = torch.cat([p[key][1] for p in every if p[key][1].numel()])
    return full


def _save_and_reload_4(rank, root) -> dict:
    from yafsdp import checkpoint as ckpt

    case = dict(tie=True, accums=(2, 1))
    res = {}
    # 2x2 -> flat world 4
    model, opt = _ckpt_model((2, 2))
    _train_steps(model, opt, case, rank)
    res["sd_2x2"] = model.full_state_dict()
    res["opt_2x2"] = _full_opt(model, opt)
    path = ckpt.save_checkpoint(os.path.join(root, "hsdp"), 7, model, opt, state=dict(k=1), rank_state=rank * 10)
    res["files"] = sorted(os.listdir(path))
    res["manifest"] = ckpt.read_manifest(path)
    flat, fopt = _ckpt_model(None)
    loaded = ckpt.load_checkpoint(path, flat, fopt)
    res["rank_state_flat"] = loaded.rank_state
    res["sd_flat_loaded"] = flat.full_state_dict()
    res["opt_flat_loaded"] = _full_opt(flat, fopt)
    # flat world 4 -> 2x2
    _train_steps(flat, fopt, case, rank)
    res["sd_flat_trained"] = flat.full_state_dict()
    fpath = ckpt.save_checkpoint(os.path.join(root, "flat"), 9, flat, fopt, rank_state=rank)
    model2, opt2 = _ckpt_model((2, 2), "groups")
    l2 = ckpt.load_checkpoint(fpath, model2, opt2)
    res["rank_state_hsdp"] = l2.rank_state
    res["sd_hsdp_loaded"] = model2.full_state_dict()
    res["hsdp_replicas_agree"] = _replicas_agree(model2)
    res["opt_hsdp_loaded"] = _full_opt(model2, opt2)
    res["opt_flat_trained"] = _full_opt(flat, fopt)
    # load_full_state_dict on a mesh: global rank 0's dict reaches every replica
    model3, _ = _ckpt_model((2, 2))
    model3.load_full_state_dict(res["sd_2x2"] if rank == 0 else None)
    res["sd_loaded_full"] = model3.full_state_dict()
    res["loaded_full_agree"] = _replicas_agree(model3)
    return res


def _train_steps(model, opt, case, rank):
    for step, accum in enumerate(case["accums"]):
        for micro in range(accum):
            (loss_of(model, "llama", batch("llama", step, micro, rank)) / accum).backward()
        model.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()


def _reload_6(root) -> dict:
    from yafsdp import checkpoint as ckpt

    res = {}
    path = ckpt.latest_checkpoint(os.path.join(root, "hsdp"))
    for shape, form in (((3, 2), "groups"), ((2, 3), "mesh")):
        model, opt = _ckpt_model(shape, form)
        loaded = ckpt.load_checkpoint(path, model, opt)
        res[shape] = (model.full_state_dict(), _full_opt(model, opt), loaded.rank_state, _replicas_agree(model))
    return res


def _reference(case, world):
    model = _model(case)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _opt(params)
    losses, norms = [], []
    for step, accum in enumerate(case["accums"]):
        low = _cast_model(model, torch.bfloat16) if case.get("bf16") else model
        total = 0.0
        for micro in range(accum):
            parts = [batch("llama", step, micro, r) for r in range(world)]
            inputs = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            loss = loss_of(low, "llama", inputs)
            (loss / accum).backward()
            total += loss.item() / accum
        if case.get("bf16"):
            for p, q in zip(model.parameters(), low.parameters()):
                p.grad = q.grad.float() if q.grad is not None else None
        losses.append(total)
        norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


_results: dict = {}


def results(world, tmp_path_factory):
    if world not in _results:
        if "root" not in _results:
            _results["root"] = str(tmp_path_factory.mktemp("hsdp_ckpt"))
        if world == 6:
            results(4, tmp_path_factory)  # the world-6 loads read the world-4 checkpoint
        _results[world] = run_ranks(_world, world, _results["root"])
    return _results[world]


PAIRS = [(w, shape, n) for w, plans in PLAN.items() for shape, _, names in plans for n in names]


@pytest.mark.parametrize("world,shape,name", PAIRS, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_hsdp_parity(world, shape, name, tmp_path_factory):
    case = CASES[name]
    per_rank = results(world, tmp_path_factory)
    losses, norms, per_step, trainable, sd, agree = per_rank[0]["cases"][(shape, name)]
    assert all(r["cases"][(shape, name)][5] for r in per_rank), "the replicas' shards differ after training"
    ref_losses, ref_norms, ref_sd = _reference(case, world)
    init = _model(case).state_dict()
    assert set(sd) == set(ref_sd)
    if case.get("bf16"):  # judged against the same mixed precision done unsharded (as tests/multirank/test_parity.py)
        fp_losses, _, fp_sd = _reference({**case, "bf16": False}, world)
        ref_dist = rel_l2(ref_sd, fp_sd)
        assert 1e-4 < rel_l2(sd, fp_sd) <= 2 * ref_dist
        assert rel_seq(losses, fp_losses) <= 2 * rel_seq(ref_losses, fp_losses) + 1e-5
    else:
        assert rel_seq(losses, ref_losses) < 1e-5, (losses, ref_losses)
        assert rel_seq(norms, ref_norms) < 1e-5, (norms, ref_norms)
        assert rel_l2(sd, ref_sd) < 1e-4
    assert rel_l2(sd, init) > 1e-3  # it trained
    if case.get("freeze"):
        for k, v in sd.items():
            if any(f in k for f in case["freeze"]):
                assert torch.equal(v, init[k]), k  # frozen values never move (fp32: not rounded)


@pytest.mark.parametrize("world,shape,name", PAIRS, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_cross_replica_all_reduce_once_per_step(world, shape, name, tmp_path_factory):
    """Every gradient element is all-reduced across replicas once per optimizer step whatever the
    accumulation; the first step defers it to clip_grad_norm_; later steps with the same
    accumulation overlap it with their last backward and issue none in the earlier ones; a
    mispredicted step repairs (rescales) and still sums correctly (parity above)."""
    case = CASES[name]
    for r in results(world, tmp_path_factory):
        _, _, per_step, trainable, _, _ = r["cases"][(shape, name)]
        accums = case["accums"]
        for step, st in enumerate(per_step):
            predicted = step > 0 and accums[step] == accums[step - 1]
            assert not any(st["early"]) or not predicted, (step, st)
            if step == 0:  # no history: deferred to the first reader, one collective over every shard
                assert st["elements"] == trainable and st["deferred"] == 1 and st["overlapped"] == 0, st
                assert st["synced"] is True, st  # sync_grads() did it; clip_grad_norm_ found nothing left
            elif predicted:  # overlapped: one all-reduce per unit right behind its fold, nothing deferred
                assert st["elements"] == trainable and st["deferred"] == 0 and st["overlapped"] > 1, st
                assert st["rescaled"] == 0 or step % 2 == 0, st  # zero_grad(set_to_none=False) before odd steps
                assert st["synced"] in (False, None), st  # complete at the end of the last backward already
        if name == "tied_accum_changes":
            s1, s2 = per_step[1], per_step[2]
            assert s1["overlapped"] == 0 and s1["deferred"] == 1, s1  # predicted 2 backward calls, saw 1
            # predicted 1, saw 3: overlapped in the first, repaired by a 1/replicas scale at the next fold
            assert s2["overlapped"] > 0 and s2["rescaled"] > 0 and s2["deferred"] >= 1, s2


def test_hsdp_refusals(tmp_path_factory):
    got = results(4, tmp_path_factory)[0]["refusals"]
    assert "3-D mesh" in got["3d"] and "('replicate', 'shard')" in got["3d"], got["3d"]
    assert "mesh_dim_names=('dp', 'tp')" in got["names"], got["names"]
    assert "not both" in got["both"], got["both"]
    assert "4 shard ranks" in got["uneven"] and "world has 4" in got["uneven"], got["uneven"]
    assert "joins ranks holding shards [0, 1]" in got["peers"], got["peers"]
    assert got["offload"] is None, got["offload"]  # offload x HSDP is supported now (tests/multirank/test_offload.py)


def test_hsdp_checkpoints_across_meshes(tmp_path_factory):
    r4 = results(4, tmp_path_factory)
    res = r4[0]["ckpt"]
    assert res["manifest"]["world_size"] == 4 and res["manifest"]["mesh"] == [2, 2]
    # replica 0 wrote: one DCP data file per rank of its shard group
    assert len([f for f in res["files"] if f.endswith(".distcp")]) == 2, res["files"]
    assert rel_l2(res["sd_flat_loaded"], res["sd_2x2"]) == 0.0
    for k in res["opt_2x2"]:
        assert torch.equal(res["opt_flat_loaded"][k], res["opt_2x2"][k]), k
    assert rel_l2(res["sd_hsdp_loaded"], res["sd_flat_trained"]) == 0.0
    for k in res["opt_flat_trained"]:
        assert torch.equal(res["opt_hsdp_loaded"][k], res["opt_flat_trained"][k]), k
    assert rel_l2(res["sd_loaded_full"], res["sd_2x2"]) == 0.0
    for r, rr in enumerate(r4):
        c = rr["ckpt"]
        assert c["rank_state_flat"] == r * 10 and c["rank_state_hsdp"] == r  # per global rank, both ways
        assert c["hsdp_replicas_agree"] and c["loaded_full_agree"]
    r6 = results(6, tmp_path_factory)
    for shape in ((3, 2), (2, 3)):
        sd, opt, _, _ = r6[0]["ckpt"][shape]
        assert rel_l2(sd, res["sd_2x2"]) == 0.0, shape
        for k in res["opt_2x2"]:
            assert torch.equal(opt[k], res["opt_2x2"][k]), (shape, k)
        for r, rr in enumerate(r6):
            _, _, rank_state, agree = rr["ckpt"][shape]
            assert agree and rank_state == (r * 10 if r < 4 else None), (shape, r, rank_state)


def test_plan_cli_hsdp(capsys):
    """`python -m yafsdp plan --hsdp R`: one replica's plan, sharded over world / R ranks."""
    from yafsdp.plan.cli import main

    plan = main(["--preset", "llama3-8b", "--world-size", "16", "--hsdp", "2"])
    flat8 = main(["--preset", "llama3-8b", "--world-size", "8"])
    assert plan.world_size == 8 and plan.engine_bytes() == flat8.engine_bytes()
    assert "HSDP: 2 replicas x 8 shard ranks = 16 ranks" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--world-size", "16", "--hsdp", "3"])
    assert "--hsdp 3 does not divide --world-size 16" in capsys.readouterr().err


def test_job_hsdp_matches_full_sharding(hsdp_job_run, tmp_path):
    """`pretrain_llama.py --hsdp 2` at world 4 (2 replicas x 2 shard ranks, 2 micro-batches a step; the run
    is conftest.py's ``hsdp_job_run``, shared with test_pretrain.py and test_torchft_job.py) trains like
    full sharding over the same 4 ranks (same global batch, same flags otherwise) and checkpoints from
    replica 0; an --hsdp that does not divide the world is a one-line error (exit 2) before anything is
    written."""
    from concurrent.futures import ThreadPoolExecutor

    from job_utils import HSDP_JOB_ARGS, close, losses, run_job

    hs, flat = hsdp_job_run["out"], str(tmp_path / "flat")
    i = HSDP_JOB_ARGS.index("--hsdp")
    flat_args = HSDP_JOB_ARGS[:i] + HSDP_JOB_ARGS[i + 2:]
    assert "--grad-accum" in flat_args  # HSDP's deferred all-reduce under accumulation, as the job runs it
    with ThreadPoolExecutor(2) as pool:  # the refused run (below) starts alongside: it stops before any rank
        b = pool.submit(run_job, flat_args + ["--out", flat], 4)
        c = pool.submit(run_job, ["--steps", "1", "--out", str(tmp_path / "bad"), "--hsdp", "2"], 0, check=False)
        _, bad = b.result(), c.result()
    assert "HSDP 2 replicas x 2 shard ranks" in hsdp_job_run["stdout"]
    assert len(losses(hs)) == 4 and close(losses(hs), losses(flat), rel=1e-4), (losses(hs), losses(flat))
    # replica 0 wrote the checkpoints (2 DCP files: its shard group); the manifest records the world
    # (resuming one on other meshes and flat worlds: test_hsdp_checkpoints_across_meshes)
    step2 = os.path.join(hs, "checkpoints", "step_00000002")
    assert len([f for f in os.listdir(step2) if f.endswith(".distcp")]) == 2
    with open(os.path.join(step2, "checkpoint.json")) as f:
        manifest = json.load(f)
    assert manifest["world_size"] == 4 and manifest["mesh"] == [2, 2]
    assert bad.returncode == 2 and "--hsdp 2 does not divide the world size 1" in bad.stderr, bad.stderr[-2000:]
    assert not os.path.exists(tmp_path / "bad")


def test_lora_on_a_mesh(tmp_path_factory):
    """LoRA under HSDP (2x2): the same losses and norms as the unsharded PEFT model, the adapter and the
    merged export written once (global rank 0; the other ranks get None) and loadable by PEFT / HF."""
    import peft

    from test_lora import _lora_model, _train

    per_rank = results(4, tmp_path_factory)
    r = per_rank[0]["lora"]
    ref = _lora_model()
    ref_losses, ref_norms = _train(ref, 0, 4, False)
    assert rel_seq(r["losses"], ref_losses) < 1e-5 and rel_seq(r["norms"], ref_norms) < 1e-5
    assert [p["lora"]["path"] is None for p in per_rank] == [False, True, True, True]
    assert [p["lora"]["merged"] is None for p in per_rank] == [False, True, True, True]
    x = batch("llama", 7, 0, 0)
    with torch.no_grad():
        want = ref(**x).logits
        loaded = peft.PeftModel.from_pretrained(tiny_llama(), r["path"])
        assert (loaded(**x).logits - want).abs().max().item() < 1e-5


# ------------------------------------------------------------------------ asynchronous saves of HSDP
def _steps(model, opt, rank, first, n):
    for step in range(first, first + n):
        loss_of(model, "llama", batch("llama", step, 0, rank)).backward()
        model.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()


def _fail_data_file(name_part):
    """DCP's data files whose name holds ``name_part``, opened by the writer thread: EIO. Returns the undo."""
    import errno
    import threading

    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream

    def create_stream(self, path, mode):
        if "w" in mode and name_part in str(path) and threading.current_thread().name.startswith("yafsdp-ckpt"):
            raise OSError(errno.EIO, "injected I/O error", str(path))
        return real(self, path, mode)

    FileSystem.create_stream = create_stream
    return lambda: setattr(FileSystem, "create_stream", real)


def _async_2x2(rank, world, root):
    """AsyncSaver on a 2x2 mesh: saves at steps 2 and 4 (training on while each is written), a
    failed write of one writer at step 6, a stopped writer against a short timeout; resumes."""
    import threading
    import time

    from yafsdp import checkpoint as ckpt
    from yafsdp.checkpoint import write as W

    out = {}
    model, opt = _ckpt_model((2, 2))
    _steps(model, opt, rank, 0, 2)
    saver = ckpt.AsyncSaver(model, opt)
    out["default_timeout"] = saver.timeout_s  # the default group's (run_ranks: 300 s)
    staged = saver.save(root, 2, state=dict(step=2), rank_state=rank * 10 + 2, keep=1)
    out["staging"] = (staged.staging_bytes, model.memory_plan(async_save=True).checkpoint_staging,
                      len(opt.param_groups[0]["params"]))
    _steps(model, opt, rank, 2, 2)  # while step 2 is written
    out["sd4"], out["opt4"] = model.full_state_dict(), _full_opt(model, opt)
    saver.save(root, 4, state=dict(step=4), rank_state=rank * 10 + 4, keep=1)  # waits for step 2
    _steps(model, opt, rank, 4, 2)
    out["path4"] = saver.wait()
    out["sd6"] = model.full_state_dict()
    out["files4"] = sorted(os.listdir(out["path4"]))
    out["manifest4"] = ckpt.read_manifest(out["path4"])

    # one writer's data file fails (global rank 1: replica 0, shard 1): every rank raises, step 4 stays
    undo = _fail_data_file("__1_") if rank == 1 else (lambda: None)
    try:
        saver.save(root, 6, state=dict(step=6), rank_state=rank, keep=1)
        out["fail"] = saver.wait()
    except ckpt.CheckpointError as e:
        out["fail"] = str(e)
    finally:
        undo()
    out["after_fail"] = ([s for s, _ in ckpt.list_checkpoints(root)], ckpt.incomplete_checkpoints(root))
    out["usable_after_fail"] = saver.save(os.path.join(root, "again"), 6).path == saver.wait()  # an agreed verdict
    saver.close()

    # replica 0 on global ranks 0 and 2 (shard groups {0, 2} and {1, 3}): the failing writer is named by
    # its global rank, not by its rank among the writers
    groups = [dist.new_group(r) for r in ([0, 2], [1, 3], [0, 1], [2, 3])]
    strided = yafsdp.YaFSDP(tiny_llama(tie=True), process_group=(groups[rank % 2], groups[2 + rank // 2]))
    sopt = _opt(strided.parameters())
    _steps(strided, sopt, rank, 0, 1)
    ssaver = ckpt.AsyncSaver(strided, sopt)
    undo = _fail_data_file("__1_") if rank == 2 else (lambda: None)
    try:
        ssaver.save(os.path.join(root, "strided"), 1)
        out["strided_fail"] = ssaver.wait()
    except ckpt.CheckpointError as e:
        out["strided_fail"] = str(e)
    finally:
        undo()
    out["strided_replica"] = strided.replica
    ssaver.close()

    # resumed on the same mesh: the uninterrupted run's weights, bit for bit
    again, aopt = _ckpt_model((2, 2), "groups")
    loaded = ckpt.load_checkpoint(ckpt.latest_checkpoint(root), again, aopt)
    out["resumed"] = (loaded.step, loaded.state, loaded.rank_state)
    _steps(again, aopt, rank, 4, 2)
    out["resumed_sd6"] = again.full_state_dict()
    out["resumed_agree"] = _replicas_agree(again)
    # loaded by a flat world of 4: the saved state exactly, each rank its own rank_state
    flat, fopt = _ckpt_model(None)
    floaded = ckpt.load_checkpoint(out["path4"], flat, fopt)
    out["flat"] = (flat.full_state_dict(), _full_opt(flat, fopt), floaded.rank_state)

    # a writer stopped in its write (rank 1, until rank 0 has its answer): the others' collectives give
    # up after the writer's timeout instead of waiting for it; the saver refuses to save again
    gone = os.path.join(root, "stopped")
    released = os.path.join(root, "released")
    real_crc = W.crc32

    def stopped_crc32(path, *a):
        if threading.current_thread().name.startswith("yafsdp-ckpt"):
            deadline = time.monotonic() + 60
            while not os.path.exists(released) and time.monotonic() < deadline:
                time.sleep(0.05)
        return real_crc(path, *a)

    dist.barrier()
    short = ckpt.AsyncSaver(model, opt, timeout=2.0)
    if rank == 1:
        W.crc32 = stopped_crc32
    t0 = time.monotonic()
    try:
        short.save(gone, 8)
        out["stopped"] = short.wait()
    except ckpt.CheckpointError as e:
        out["stopped"] = str(e)
    out["stopped_s"] = time.monotonic() - t0
    if rank == 0:
        open(released, "w").close()
    W.crc32 = real_crc
    try:
        short.save(gone, 9)
        out["refused"] = None
    except ckpt.CheckpointError as e:
        out["refused"] = str(e)
    out["stopped_left"] = ckpt.latest_checkpoint(gone)
    return out


def _async_load_2(rank, world, path):
    """The 2x2 asynchronous checkpoint loaded by a flat world of 2."""
    from yafsdp import checkpoint as ckpt

    model, opt = _ckpt_model(None)
    loaded = ckpt.load_checkpoint(path, model, opt)
    return model.full_state_dict(), _full_opt(model, opt), loaded.rank_state


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hsdp_async"))
    r4 = run_ranks(_async_2x2, 4, os.path.join(root, "ckpt"))
    r2 = run_ranks(_async_load_2, 2, r4[0]["path4"])
    return r4, r2


def _same_dict(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b)


def test_async_save_on_a_mesh_resumes_exactly(async_runs):
    """AsyncSaver with HSDP (2x2): replica 0 writes (2 DCP files, the world and the mesh in the
    manifest) and stages, the other replica copies nothing; each checkpoint holds its step's state
    although training went on during the write; resumed on the mesh it gives the uninterrupted
    run's weights bit for bit, and flat worlds of 4 and 2 load the saved state exactly, each rank
    its own rank_state."""
    r4, r2 = async_runs
    r0 = r4[0]
    assert r0["path4"].endswith("step_00000004") and all(r["path4"] == r0["path4"] for r in r4)
    assert len([f for f in r0["files4"] if f.endswith(".distcp")]) == 2, r0["files4"]
    assert r0["manifest4"]["world_size"] == 4 and r0["manifest4"]["mesh"] == [2, 2]
    assert r0["default_timeout"] == 300.0
    for rank, r in enumerate(r4):
        staged, planned, n_params = r["staging"]
        if rank < 2:  # replica 0: the plan's staging copy but for AdamW's step counters
            assert staged == planned + 4 * n_params, (rank, staged, planned, n_params)
        else:
            assert staged == 0, (rank, staged)
        step, state, rank_state = r["resumed"]
        assert (step, state, rank_state) == (4, {"step": 4}, rank * 10 + 4), (rank, r["resumed"])
        assert r["resumed_agree"]
        assert r["flat"][2] == rank * 10 + 4
    assert rel_l2(r0["sd6"], r0["sd4"]) > 1e-4  # it trained on after the save
    assert _same_dict(r0["resumed_sd6"], r0["sd6"])
    sd, opt, _ = r0["flat"]
    assert _same_dict(sd, r0["sd4"]) and _same_dict(opt, r0["opt4"])
    sd, opt, _ = r2[0]
    assert _same_dict(sd, r0["sd4"]) and _same_dict(opt, r0["opt4"])
    assert [r[2] for r in r2] == [4, 14]


def test_async_save_on_a_mesh_failures(async_runs):
    """A writer's failed data file (global rank 1) is raised on every rank of both replicas with the
    same message, naming the rank and the file; step 4 stays the newest checkpoint, nothing partial
    is left, and the saver saves again; where replica 0 is global ranks 0 and 2, the second writer's
    failure names global rank 2. A writer stopped in its write: the other ranks' wait()
    raises after the 2 s timeout rather than waiting for it, every rank's saver then refuses to save
    (its groups are out of step), and nothing is published."""
    r4, _ = async_runs
    msgs = [r["fail"] for r in r4]
    assert len(set(msgs)) == 1, msgs
    msg = msgs[0]
    assert msg.startswith("the background save of step 6 failed: saving checkpoint into") and \
        "failed on rank 1: [Errno 5] injected I/O error" in msg and "__1_0.distcp" in msg, msg
    assert "earlier checkpoints are untouched" in msg, msg
    assert [r["strided_replica"] for r in r4] == [0, 1, 0, 1]  # replica 0: global ranks 0 and 2
    for r in r4:
        assert "failed on rank 2: [Errno 5] injected I/O error" in r["strided_fail"], r["strided_fail"]
    for r in r4:
        assert r["after_fail"] == ([4], []), r["after_fail"]
        assert r["usable_after_fail"]
        assert r["stopped"] and r["stopped"].startswith("the background save of step 8 failed"), r["stopped"]
        assert "cannot be used again" in r["refused"] and "step 9 was not saved" in r["refused"], r["refused"]
        assert r["stopped_left"] is None
    # rank 0 (the stopped writer's peer) gave up after the timeout, not at the writer's release
    assert "a collective of the background writer failed on global rank 0" in r4[0]["stopped"], r4[0]["stopped"]
    assert "writer's timeout (2 s" in r4[0]["stopped"] and "Earlier checkpoints are untouched" in r4[0]["stopped"]
    assert r4[0]["stopped_s"] < 30, r4[0]["stopped_s"]
    assert r4[1]["stopped_s"] >= r4[0]["stopped_s"]
