"""Sharded checkpoints (yafsdp.checkpoint): exact resume, resharding 2 -> 1 -> 2, atomic saves,
refusal of corrupt, partial and mismatched checkpoints with the files left untouched, and the
meta-device helpers (yafsdp.init).

Three spawns in all: world 2 trains and saves, world 1 loads (2 -> 1) and saves, world 2 loads
that (1 -> 2) and runs every refusal case."""
import hashlib
import os

import pytest
import torch

import yafsdp
from dist_utils import run_ranks
from models import batch, loss_of, tiny_llama
from yafsdp import checkpoint as ckpt

STEPS_BEFORE, STEPS_AFTER = 3, 2


def _setup(layers=3):
    model = yafsdp.YaFSDP(tiny_llama(tie=True, layers=layers))
    opt = torch.optim.AdamW(model.param_groups(weight_decay=0.1), lr=1e-2, betas=(0.9, 0.95))
    return model, opt


def _train(model, opt, rank, world, steps, start, parts_per_rank=1):
    """``steps`` optimizer steps; on world 1 pass parts_per_rank=2 to see both world-2 ranks' data."""
    losses = []
    for step in range(start, start + steps):
        total = 0.0
        for r in range(rank * parts_per_rank, (rank + 1) * parts_per_rank):
            loss = loss_of(model, "llama", batch("llama", step, 0, r))
            (loss / parts_per_rank).backward()
            total += loss.item() / parts_per_rank
        t = torch.tensor(total)
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _save_then_continue(rank, world, root):
    """World 2: train, save at STEPS_BEFORE, train on. Also: a failed save leaves the last good one."""
    model, opt = _setup()
    _train(model, opt, rank, world, STEPS_BEFORE, 0)
    sd = model.full_state_dict()
    path = ckpt.save_checkpoint(root, STEPS_BEFORE, model, opt, state={"cursor": 123},
                                rank_state={"rank": rank}, meta={"note": "test"}, keep=2)
    from yafsdp.hf import export_hf

    export_hf(model, os.path.join(os.path.dirname(root), "hf_tied"))  # tied embeddings: written once
    assert ckpt.save_checkpoint(root, STEPS_BEFORE, model, opt, state={"cursor": 123}, rank_state={"rank": rank},
                                meta={"note": "test"}) == path  # saved again: replaced
    assert ckpt.read_manifest(path)["step"] == STEPS_BEFORE and ckpt.list_checkpoints(root) == [(STEPS_BEFORE, path)]
    after = _train(model, opt, rank, world, STEPS_AFTER, STEPS_BEFORE)

    # A save that fails before its rename (here: the rename fails on rank 0) damages nothing and
    # cleans up after itself (a killed save's .tmp.* is removed by the next save instead).
    real_rename = os.rename
    if rank == 0:
        def broken(a, b):
            if os.path.basename(a).startswith(ckpt.TMP_PREFIX):
                raise OSError("simulated crash before the rename")
            return real_rename(a, b)
        os.rename = broken
    try:
        with pytest.raises(ckpt.CheckpointError, match="simulated crash"):
            ckpt.save_checkpoint(root, 99, model, opt)
    finally:
        os.rename = real_rename
    latest_after_crash = ckpt.latest_checkpoint(root)
    incomplete = [os.path.basename(p) for p in ckpt.incomplete_checkpoints(root)]
    return dict(sd=sd, after=after, path=path, latest_after_crash=latest_after_crash, incomplete=incomplete)


def _load_reshard(rank, world, path, root_out, parts_per_rank):
    """Load ``path`` (any saved world), return the full state dict, save again under ``root_out``,
    then train on."""
    model, opt = _setup()
    loaded = ckpt.load_checkpoint(path, model, opt)
    sd = model.full_state_dict()
    out = ckpt.save_checkpoint(root_out, loaded.step, model, opt, state=loaded.state, rank_state=loaded.rank_state)
    after = _train(model, opt, rank, world, STEPS_AFTER, loaded.step, parts_per_rank)
    return dict(sd=sd, after=after, step=loaded.step, state=loaded.state, rank_state=loaded.rank_state,
                meta=loaded.meta, saved_world=loaded.saved_world_size, out=out, init=_meta_init(rank, world))


def _digest(path):
    h = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            h[name] = hashlib.sha256(f.read()).hexdigest()
    return h


def _refusals(rank, world, good, scratch):
    """Each damaged copy of ``good`` is refused naming the file; nothing on disk changes."""
    import shutil

    out = {}
    cases = {}
    if rank == 0:
        for case in ("flip", "truncate", "missing", "manifest", "json"):
            dst = os.path.join(scratch, case, os.path.basename(good))
            shutil.copytree(good, dst)
            data = sorted(f for f in os.listdir(dst) if f.endswith(".distcp"))[-1]
            f = os.path.join(dst, data)
            if case == "flip":
                raw = bytearray(open(f, "rb").read())
                raw[len(raw) // 2] ^= 0xFF
                open(f, "wb").write(bytes(raw))
            elif case == "truncate":
                os.truncate(f, os.path.getsize(f) // 2)
            elif case == "missing":
                os.remove(f)
            elif case == "manifest":
                os.remove(os.path.join(dst, ckpt.MANIFEST))
            elif case == "json":
                with open(os.path.join(dst, ckpt.MANIFEST), "w") as fh:
                    fh.write('{"format": "yafsdp-checkpoint/1", "step": ')
            cases[case] = (dst, data)
    box = [cases]
    torch.distributed.broadcast_object_list(box, src=0)
    cases = box[0]
    for case, (dst, data) in cases.items():
        before = _digest(dst)
        model, opt = _setup()
        ref = model.full_state_dict()
        try:
            ckpt.load_checkpoint(dst, model, opt)
            msg = None
        except ckpt.CheckpointError as e:
            msg = str(e)
        unchanged_model = model.full_state_dict()
        torch.distributed.barrier()
        out[case] = dict(msg=msg, file=data, untouched=_digest(dst) == before,
                         model_untouched=all(torch.equal(ref[k], unchanged_model[k]) for k in ref),
                         latest=ckpt.latest_checkpoint(os.path.dirname(dst)))
    # A checkpoint of another model shape.
    model, opt = _setup(layers=2)
    try:
        ckpt.load_checkpoint(good, model, opt)
        out["shape"] = None
    except ckpt.CheckpointError as e:
        out["shape"] = str(e)
    # Another optimizer class: its state and options would not fit (SGD then failed at its first step, KeyError
    # 'momentum'; Adam silently became AdamW through the saved groups' options)
    model, _ = _setup()
    try:
        ckpt.load_checkpoint(good, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        out["other_optimizer"] = None
    except ckpt.CheckpointError as e:
        out["other_optimizer"] = str(e)
    # The folder holding the checkpoints (a job's --resume of its run folder): named as such, not "incomplete"
    try:
        ckpt.load_checkpoint(os.path.dirname(good), model)
        out["folder"] = None
    except ckpt.CheckpointError as e:
        out["folder"] = str(e)
    out["init"] = _meta_init(rank, world)
    return out


def _reshard_then_refusals(rank, world, path, root_out, good, scratch):
    """World 2: load the world-1 checkpoint (1 -> 2) and train on; then the refusal cases."""
    return _load_reshard(rank, world, path, root_out, 1), _refusals(rank, world, good, scratch)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    root2, root1, root21 = str(base / "w2"), str(base / "w1"), str(base / "w21")
    a = run_ranks(_save_then_continue, 2, root2)
    b = run_ranks(_load_reshard, 1, a[0]["path"], root1, 2)
    cd = run_ranks(_reshard_then_refusals, 2, b[0]["out"], root21, a[0]["path"], str(base / "damaged"))
    return dict(a=a, b=b, c=[r[0] for r in cd], d=[r[1] for r in cd])


def test_save_load_roundtrip_and_state(runs):
    a, b = runs["a"][0], runs["b"][0]
    assert a["path"].endswith("step_00000003")
    for k, v in a["sd"].items():
        assert torch.equal(v, b["sd"][k]), k  # 2 -> 1: bit-identical weights
    assert b["step"] == STEPS_BEFORE and b["state"] == {"cursor": 123} and b["meta"] == {"note": "test"}
    assert b["rank_state"] == {"rank": 0} and b["saved_world"] == 2


def test_export_tied_model_loads_in_transformers(runs, tmp_path_factory):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    hf_dir = os.path.join(os.path.dirname(os.path.dirname(runs["a"][0]["path"])), "hf_tied")
    assert "lm_head.weight" not in load_file(os.path.join(hf_dir, "model.safetensors"))
    model, info = LlamaForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    sd = model.state_dict()
    for k, v in runs["a"][0]["sd"].items():
        assert torch.equal(sd[k], v), k
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_reshard_2_to_1_trains_on(runs):
    a, b = runs["a"][0], runs["b"][0]
    # World 1 sees both ranks' data as two accumulation parts: equal up to summation order.
    for x, y in zip(a["after"], b["after"]):
        assert abs(x - y) <= 1e-5 * abs(x), (a["after"], b["after"])


def test_reshard_1_to_2_resumes_exactly(runs):
    a, c = runs["a"], runs["c"]
    for k, v in a[0]["sd"].items():
        assert torch.equal(v, c[0]["sd"][k]), k
    assert c[0]["saved_world"] == 1
    assert c[0]["rank_state"] == {"rank": 0} and c[1]["rank_state"] is None  # rank 1 did not exist in world 1
    assert c[0]["after"] == a[0]["after"]  # 2 -> 1 -> 2 round trip: the same losses, bit for bit


def test_failed_save_leaves_previous(runs):
    a = runs["a"][0]
    assert a["latest_after_crash"] == a["path"]
    assert a["incomplete"] == []  # the failed save removed its .tmp.step_00000099


@pytest.mark.parametrize("case,needle", [
    ("flip", "fails its CRC-32 check"), ("truncate", "bytes, the manifest says"), ("missing", "is missing"),
    ("manifest", "checkpoint.json is missing"), ("json", "unreadable or corrupt"),
])
def test_damaged_checkpoint_refused_untouched(runs, case, needle):
    for r in runs["d"]:
        res = r[case]
        assert res["msg"] is not None and needle in res["msg"], res["msg"]
        if case in ("flip", "truncate", "missing"):
            assert repr(res["file"]) in res["msg"]  # names the file
        assert res["untouched"] and res["model_untouched"]
    # Discovery: a directory without a manifest is not a checkpoint.
    assert runs["d"][0]["manifest"]["latest"] is None
    assert runs["d"][0]["flip"]["latest"] is not None


def test_other_model_shape_refused(runs):
    msg = runs["d"][0]["shape"]
    assert msg and "different model" in msg and "model.layers.2" in msg


def test_a_folder_of_checkpoints_is_named_as_such(runs, tmp_path):
    msg = runs["d"][0]["folder"]
    assert msg and "is not a checkpoint but a folder holding" in msg and "the newest complete one" in msg, msg
    with pytest.raises(ckpt.CheckpointError, match="checkpoint.json is missing"):  # an empty folder: as before
        ckpt.read_manifest(str(tmp_path))


def test_other_optimizer_class_refused(runs):
    for r in runs["d"]:
        msg = r["other_optimizer"]
        assert msg and "its optimizer state was written by AdamW, and this optimizer is SGD" in msg, msg
        assert "exp_avg" in msg and "optimizer=None" in msg, msg


# --------------------------------------------------------------------------- yafsdp.init helpers
def _meta_init(rank, world):
    from transformers import LlamaConfig, LlamaForCausalLM

    from yafsdp.init import init_shards_, meta_parameters, normal_init

    cfg = LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with meta_parameters():
        model = LlamaForCausalLM(cfg)
    metas = all(p.is_meta for p in model.parameters())
    bufs_real = all(not b.is_meta for b in model.buffers())
    wrapped = yafsdp.YaFSDP(model)
    needs = wrapped.needs_load
    ids = torch.arange(10).view(1, 10)
    try:  # training on shards that hold no values would be silently wrong
        wrapped(input_ids=ids, labels=ids)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    init_shards_(wrapped, normal_init(0.02), seed=7)
    sd = wrapped.full_state_dict()
    loss = wrapped(input_ids=ids, labels=ids).loss.item()
    return dict(metas=metas, bufs_real=bufs_real, needs=needs, after=wrapped.needs_load, sd=sd, loss=loss,
                refused=refused)


def test_meta_build_and_world_independent_init(runs):
    one = runs["b"][0]["init"]
    two = [r["init"] for r in runs["d"]]
    assert one["metas"] and one["bufs_real"] and one["needs"] and not one["after"]
    assert one["refused"] and "built on the meta device" in one["refused"] and "init_shards_" in one["refused"]
    for k, v in one["sd"].items():
        assert torch.equal(v, two[0]["sd"][k]), k  # same initial model on 1 and 2 ranks
    w = one["sd"]["model.layers.0.mlp.up_proj.weight"]
    assert 0.015 < w.std().item() < 0.025 and abs(w.mean().item()) < 0.005
    assert torch.equal(one["sd"]["model.norm.weight"], torch.ones(32))
    assert abs(one["loss"] - two[0]["loss"]) < 1e-5
