"""The checkpoint library's contracts beyond round trips:

- loading never runs code from the checkpoint: a crafted ``.metadata`` or byte item whose
  checksums were recomputed is refused naming the file, and its payload does not run;
- a save that runs out of disk space says so (root, free and needed bytes) whatever writer fails,
  and the last checkpoint stays;
- module buffers (BatchNorm running statistics) are saved and loaded, across world sizes;
- the engine's settings are recorded: quantize_frozen (which changes what is stored) is named
  when it differs, zero_stage / offload / gather_dtype / mesh / world size convert;
- asynchronous saves (AsyncSaver): the checkpoint holds the state of the step it was called at,
  a failure of the background write leaves the previous checkpoint, a resume equals the
  uninterrupted run.

Two spawns: world 2 runs every case, world 1 loads the world-2 checkpoint (buffers across world
sizes) and does a real full-disk save on a small tmpfs where mounting one is allowed."""
import contextlib
import errno
import json
import os
import subprocess

import pytest
import torch
from torch import nn

import yafsdp
from dist_utils import run_ranks
from models import tiny_llama
from yafsdp import checkpoint as ckpt

STEPS = 3


class BNBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)  # running_mean, running_var, num_batches_tracked: persistent buffers

    def forward(self, x):
        return x + torch.tanh(self.bn(self.fc(x)))


class BNStack(nn.Module):
    def __init__(self, d=16, n=2):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(7, d)
        self.blocks = nn.ModuleList(BNBlock(d) for _ in range(n))
        self.head = nn.Linear(d, 5, bias=False)

    def forward(self, x, target):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return ((self.head(h) - target) ** 2).mean()


def _data(step):
    # The same batch on every rank keeps the buffers replicated (as DDP's broadcast_buffers would).
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 7, generator=g), torch.randn(8, 5, generator=g)


def _bn(**kw):
    model = yafsdp.YaFSDP(BNStack(), **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, start, steps):
    for step in range(start, start + steps):
        model(*_data(step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _same(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


class _Full:
    """A write stream that takes ``room`` bytes, then fails as a full disk does."""

    def __init__(self, inner, room, lose_errno=False):
        self.inner, self.room, self.lose_errno = inner, room, lose_errno

    def write(self, b):
        n = len(memoryview(b).cast("B"))
        if n > self.room:
            self.inner.write(memoryview(b).cast("B")[:self.room])
            self.room = 0
            if self.lose_errno:  # as torch's zip writer reports it: no errno, and the disk is full
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return self.inner.write(b)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@contextlib.contextmanager
def _disk_full(name_part, room, on=True, lose_errno=False):
    """DCP's files whose name contains ``name_part`` take ``room`` bytes, then ENOSPC (or, with
    ``lose_errno``, a RuntimeError while the filesystem reports no free bytes)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    from yafsdp.checkpoint import space

    real, real_free = FileSystem.create_stream, space.free_bytes

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as s:
            yield _Full(s, room, lose_errno) if on and "w" in mode and name_part in str(path) else s

    FileSystem.create_stream = create_stream
    if on and lose_errno:  # the partial save's folder is on a full filesystem
        space.free_bytes = lambda path: 0 if ckpt.TMP_PREFIX in str(path) else real_free(path)
    try:
        yield
    finally:
        FileSystem.create_stream, space.free_bytes = real, real_free


class Evil:
    """A pickle payload: unpickling it creates the file ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _rewrite_manifest(path):
    """Recompute the manifest's sizes and CRC-32s, as whoever edits a checkpoint can."""
    mf = os.path.join(path, ckpt.MANIFEST)
    m = json.load(open(mf))
    for name in m["files"]:
        f = os.path.join(path, name)
        m["files"][name] = dict(bytes=os.path.getsize(f), crc32=ckpt.crc32(f))
    json.dump(m, open(mf, "w"))


def _load_error(path, model, opt=None):
    try:
        ckpt.load_checkpoint(path, model, opt)
    except ckpt.CheckpointError as e:
        return str(e)
    return None


def _world2(rank, world, base):
    out = {}
    root = os.path.join(base, "bn")
    # --- buffers: the resumed run equals the uninterrupted one, buffers included
    model, opt = _bn()
    _train(model, opt, 0, STEPS)
    path3 = ckpt.save_checkpoint(root, STEPS, model, opt)
    out["sd3"] = model.full_state_dict()
    _train(model, opt, STEPS, 2)
    out["sd5"] = sd5 = model.full_state_dict()
    fresh, fopt = _bn()
    ckpt.load_checkpoint(path3, fresh, fopt)
    _train(fresh, fopt, STEPS, 2)
    out["resumed_sd5"] = fresh.full_state_dict()

    # --- asynchronous save: staged state, failure in the background, resume
    saver = ckpt.AsyncSaver(model, opt)
    staged = saver.save(root, 5)
    with torch.no_grad():  # right after save() returns: the checkpoint must not see these
        for p in model.parameters():
            p.add_(1.0)
        for b in model.module.buffers():
            b.add_(1)
    out["async_path"] = saver.wait()
    out["async_staged"] = (staged.path, staged.staging_bytes)
    out["async_plan"] = (model.memory_plan(async_save=True).checkpoint_staging,
                         yafsdp.plan.memory_plan(BNStack(), world_size=world, rank=rank,
                                                 async_save=True).checkpoint_staging,
                         len(opt.param_groups[0]["params"]))
    check, copt = _bn()
    ckpt.load_checkpoint(out["async_path"], check, copt)
    out["async_loaded"] = check.full_state_dict()
    _train(check, copt, 5, 1)
    out["async_resumed_sd6"] = check.full_state_dict()
    model, opt = _bn()  # the uninterrupted run to step 6
    _train(model, opt, 0, 6)
    out["sd6"] = model.full_state_dict()
    saver.close()
    saver = ckpt.AsyncSaver(model, opt)
    with _disk_full("__1_", 100, on=rank == 1):
        saver.save(root, 6)  # rank 1's data file fills the disk in the background
        try:
            saver.wait()
            out["async_fail"] = None
        except ckpt.CheckpointError as e:
            out["async_fail"] = str(e)
    out["async_after_fail"] = (ckpt.latest_checkpoint(root), ckpt.incomplete_checkpoints(root))
    saver.close()

    # --- the staging copy of a QLoRA model (bf16 frozen shards, NF4 records, LoRA masters) vs the plan
    import peft
    qmodel = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                               lora_dropout=0.0))
    plain_plan = yafsdp.plan.memory_plan(qmodel, world_size=world, rank=rank, param_dtype=torch.bfloat16,
                                         quantize_frozen="nf4", async_save=True)
    qmodel = yafsdp.YaFSDP(qmodel, param_dtype=torch.bfloat16, quantize_frozen="nf4")
    qopt = torch.optim.AdamW(qmodel.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(rank))
    qmodel(input_ids=ids, labels=ids).loss.backward()
    qopt.step()
    qsaver = ckpt.AsyncSaver(qmodel, qopt)
    qstaged = qsaver.save(os.path.join(base, "qlora"), 1)
    qsaver.close()
    out["qlora_staging"] = (qstaged.staging_bytes, qmodel.memory_plan(async_save=True).checkpoint_staging,
                            plain_plan.checkpoint_staging, len(qopt.param_groups[0]["params"]),
                            sum(1 for i in qmodel.shard_info() if i.values_dtype is not None),
                            "async-save staging copy" in qmodel.memory_plan(async_save=True).format())

    # --- a full disk at several points of a synchronous save
    fails = {}
    for case, ctx in {
        "data file (rank 1)": lambda: _disk_full("__1_", 100, on=rank == 1),
        "data file (rank 0)": lambda: _disk_full("__0_", 700, on=rank == 0),
        ".metadata": lambda: _disk_full(".metadata", 10, on=rank == 0),
        "data file, errno lost": lambda: _disk_full("__1_", 100, on=rank == 1, lose_errno=True),
    }.items():
        with ctx():
            try:
                ckpt.save_checkpoint(root, 7, model, opt)
                fails[case] = None
            except ckpt.CheckpointError as e:
                fails[case] = str(e)
    real = ckpt.write.write_json_atomic

    def no_space(path, obj):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    ckpt.write.write_json_atomic = no_space
    try:
        ckpt.save_checkpoint(root, 7, model, opt)
        fails["manifest"] = None
    except ckpt.CheckpointError as e:
        fails["manifest"] = str(e)
    finally:
        ckpt.write.write_json_atomic = real
    out["disk_full"] = fails
    out["after_disk_full"] = (ckpt.latest_checkpoint(root), ckpt.incomplete_checkpoints(root))

    # --- settings: convertible ones load, quantize_frozen is named
    conv = {}
    for name, kw in {"zero_stage=2": dict(zero_stage=2), "offload": dict(offload="optimizer"),
                     "gather_dtype=fp8": dict(gather_dtype="fp8"), "mesh (2, 1)": "mesh"}.items():
        if kw == "mesh":
            from torch.distributed.device_mesh import init_device_mesh

            kw = dict(mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")))
        m2, o2 = _bn(**kw)
        ckpt.load_checkpoint(path3, m2, o2)
        got = m2.full_state_dict()  # collective; rank 0 holds the dict
        conv[name] = _same(got, out["sd3"])
    out["convert"] = conv
    out["settings"] = ckpt.read_manifest(path3).get("settings")

    def frozen(quantize):
        mod = tiny_llama(layers=1)
        for n, p in mod.named_parameters():
            if "proj" in n:
                p.requires_grad_(False)
        return yafsdp.YaFSDP(mod, quantize_frozen=quantize)

    qpath = ckpt.save_checkpoint(os.path.join(base, "nf4"), 1, frozen("nf4"))
    out["nf4_into_plain"] = _load_error(qpath, frozen(None))
    ppath = ckpt.save_checkpoint(os.path.join(base, "plain"), 1, frozen(None))
    out["plain_into_nf4"] = _load_error(ppath, frozen("nf4"))

    # --- loading runs no code from the checkpoint
    marker = os.path.join(base, "PWNED")
    bad_meta = os.path.join(base, "evil_meta", "step_00000003")
    if rank == 0:
        import pickle
        import shutil

        shutil.copytree(path3, bad_meta)
        with open(os.path.join(bad_meta, ".metadata"), "wb") as f:
            pickle.dump(Evil(marker), f)
        _rewrite_manifest(bad_meta)
    torch.distributed.barrier()
    m3, o3 = _bn()
    out["evil_meta"] = _load_error(bad_meta, m3, o3)
    out["evil_meta_marker"] = os.path.exists(marker)
    # A byte item (``state``) that needs a global to load: written by patching the save's encoder
    # out, which is what a crafted file amounts to (our own save writes the checksums).
    from yafsdp.checkpoint import contents

    real_encode = contents.encode
    contents.encode = lambda x, where: x
    try:
        bad_state = ckpt.save_checkpoint(os.path.join(base, "evil_state"), 3, m3, o3, state={"x": Evil(marker)})
        # as written before encode existed: numpy's RNG state pickled as an array -- still loads
        import numpy as np

        np.random.seed(rank)
        old = ckpt.save_checkpoint(os.path.join(base, "old_rng"), 3, m3, o3, rank_state=np.random.get_state())
    finally:
        contents.encode = real_encode
    st = ckpt.load_checkpoint(old, *_bn()).rank_state
    np.random.seed(rank)
    want = np.random.get_state()
    out["old_rng"] = st[0] == want[0] and np.array_equal(st[1], want[1]) and st[2:] == want[2:]
    out["evil_state"] = _load_error(bad_state, *_bn())
    out["evil_state_marker"] = os.path.exists(marker)
    try:
        ckpt.save_checkpoint(os.path.join(base, "refused"), 3, m3, o3, rank_state={"gen": Evil(marker)})
        out["save_object"] = None
    except ckpt.CheckpointError as e:
        out["save_object"] = str(e)
    out["path3"] = path3
    return out


def _tmpfs(mnt, size):
    os.makedirs(mnt, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mnt], capture_output=True, text=True)
    return r.returncode == 0, r.stderr.strip()


def _world1(rank, world, path3, base):
    out = {}
    model, opt = _bn()
    ckpt.load_checkpoint(path3, model, opt)
    out["sd3"] = model.full_state_dict()
    # A real full disk: a small tmpfs, filled up to a point by a filler file.
    from yafsdp.checkpoint import contents, space

    mnt = os.path.join(base, "small")
    first = ckpt.save_checkpoint(os.path.join(base, "probe"), 1, model, opt)
    size = sum(os.path.getsize(os.path.join(first, f)) for f in os.listdir(first))
    ok, why = _tmpfs(mnt, (size * 3 // 4096 + 1) * 4096)
    out["tmpfs"] = why if not ok else None
    needed = contents.needed_bytes(model, contents.collect(model, opt, None, {0: None})[0])

    def leave(n):  # fill the tmpfs until about n bytes are free
        with open(os.path.join(mnt, "filler"), "wb") as f:
            f.write(b"\0" * max(0, (space.free_bytes(mnt) - n) // 4096 * 4096))

    if ok:
        try:
            root = os.path.join(mnt, "ck")
            out["real_first"] = ckpt.save_checkpoint(root, 1, model, opt)
            leave(needed // 2)  # less than the estimate: refused before writing
            try:
                ckpt.save_checkpoint(root, 2, model, opt)
                out["real_full"] = None
            except ckpt.CheckpointError as e:
                out["real_full"] = str(e)
            out["real_after"] = (ckpt.latest_checkpoint(root), ckpt.incomplete_checkpoints(root))
            # Room for the estimate but not for DCP's zip headers and .metadata: the write itself fails.
            os.remove(os.path.join(mnt, "filler"))
            leave(needed + 12288)
            out["midway_free"] = (space.free_bytes(mnt), needed)
            try:
                ckpt.save_checkpoint(root, 3, model, opt)
                out["real_midway"] = None
            except ckpt.CheckpointError as e:
                out["real_midway"] = str(e)
            out["real_after_midway"] = (ckpt.latest_checkpoint(root), ckpt.incomplete_checkpoints(root))
            m2, o2 = _bn()
            ckpt.load_checkpoint(out["real_first"], m2, o2)
            out["real_loads"] = _same(m2.full_state_dict(), out["sd3"])
        finally:
            subprocess.run(["umount", mnt], capture_output=True)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("cklib")
    a = run_ranks(_world2, 2, str(base / "w2"), timeout_s=90)
    b = run_ranks(_world1, 1, a[0]["path3"], str(base / "w1"), timeout_s=90)
    return a, b[0]


def _buffers(sd):
    return {k: v for k, v in sd.items() if "running" in k or "num_batches" in k}


def test_buffers_saved_and_resumed_exactly(runs):
    a, b = runs
    r0 = a[0]
    bufs = _buffers(r0["sd3"])
    assert len(bufs) == 6 and int(bufs["blocks.0.bn.num_batches_tracked"]) == STEPS
    assert _same(r0["resumed_sd5"], r0["sd5"])  # weights and buffers: the uninterrupted run
    assert _same(b["sd3"], r0["sd3"])  # world 2 -> 1: running statistics and counts come back


def test_loading_runs_no_code(runs):
    r0 = runs[0][0]
    for rank in (0, 1):
        r = runs[0][rank]
        assert ".metadata" in r["evil_meta"] and "io.open" in r["evil_meta"] and "refused" in r["evil_meta"]
        msg = r["evil_state"]
        assert ".distcp'" in msg and "io.open" in msg and "'state'" in msg and "refused" in msg
    assert not r0["evil_meta_marker"] and not r0["evil_state_marker"]
    assert r0["old_rng"] and runs[0][1]["old_rng"]  # numpy arrays in byte items written earlier still load
    assert "rank_state (rank 0)['gen']" in r0["save_object"] and "Evil" in r0["save_object"]


def test_full_disk_says_so(runs):
    r0 = runs[0][0]
    for rank in (0, 1):
        fails = runs[0][rank]["disk_full"]
        assert set(fails) == {"data file (rank 1)", "data file (rank 0)", ".metadata", "manifest",
                              "data file, errno lost"}
        for case, msg in fails.items():
            assert msg is not None, case
            assert "out of disk space in" in msg and "/bn'" in msg, (case, msg)
            assert "free there before this save" in msg and "the checkpoint needs about" in msg, (case, msg)
            assert "earlier checkpoints are untouched" in msg or "partial save was removed" in msg, (case, msg)
    latest, incomplete = runs[0][0]["after_disk_full"]
    assert latest.endswith("step_00000005") and incomplete == []
    # a real full disk (tmpfs), where mounting one is allowed
    b = runs[1]
    if b["tmpfs"] is not None:
        pytest.skip(f"cannot mount a tmpfs here: {b['tmpfs']}")
    assert "out of disk space in" in b["real_full"] and "nothing was written" in b["real_full"], b["real_full"]
    assert b["real_after"] == (b["real_first"], []) and b["real_loads"]
    assert "out of disk space in" in b["real_midway"] and "free there before this save" in b["real_midway"]
    assert "nothing was written" not in b["real_midway"], (b["real_midway"], b["midway_free"])  # failed writing
    assert b["real_after_midway"] == (b["real_first"], [])
    assert r0["disk_full"]["data file (rank 1)"].count("rank 1") == 1
    assert "unexpected pos" in r0["disk_full"]["data file, errno lost"]


def test_settings_recorded_and_checked(runs):
    r0 = runs[0][0]
    assert r0["settings"] == dict(world_size=2, mesh=[1, 2], quantize_frozen=None, gather_dtype=None, zero_stage=3,
                                  offload=None, param_dtype=None)
    assert r0["convert"] == {"zero_stage=2": True, "offload": True, "gather_dtype=fp8": True, "mesh (2, 1)": True}
    for key in ("nf4_into_plain", "plain_into_nf4"):
        msg = r0[key]
        assert "quantize_frozen='nf4'" in msg and "quantize_frozen=None" in msg and "Build the model with" in msg
    assert ".nf4'" in r0["nf4_into_plain"]


def test_async_staging_copy_is_planned(runs):
    """The plan's async-save row (yafsdp/plan/staging.py) is the staging copy AsyncSaver takes,
    to the byte, but for torch AdamW's 0-d step counters (4 bytes per flat parameter), which it
    leaves out: BatchNorm buffers on rank 0 only, the fp32 masters and AdamW state of a plain
    model; bf16 frozen slices, NF4 codes and scales, LoRA masters of a QLoRA model. The plan of the
    wrapped model and of the unwrapped one agree."""
    for rank in (0, 1):
        r = runs[0][rank]
        staged = r["async_staged"][1]
        wrapped, plain, n_params = r["async_plan"]
        assert wrapped == plain and staged == wrapped + 4 * n_params, (rank, staged, wrapped, plain, n_params)
        q_staged, q_wrapped, q_plain, q_params, n_nf4, shown = r["qlora_staging"]
        assert n_nf4 > 0 and shown
        assert q_wrapped == q_plain and q_staged == q_wrapped + 4 * q_params, (rank, q_staged, q_wrapped, q_plain)


def test_async_save(runs):
    r0 = runs[0][0]
    assert r0["async_path"].endswith("step_00000005") and r0["async_staged"][0] == r0["async_path"]
    assert r0["async_staged"][1] > 0
    assert _same(r0["async_loaded"], r0["sd5"])  # the state of the step, not the later edit
    assert _same(r0["async_resumed_sd6"], r0["sd6"])
    for rank in (0, 1):
        msg = runs[0][rank]["async_fail"]
        assert msg and "background save of step 6 failed" in msg and "out of disk space" in msg, msg
    assert r0["async_after_fail"] == (r0["async_path"], [])
