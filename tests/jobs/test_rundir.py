"""A run directory never loses a saved checkpoint: two jobs on a new --out, a rewind
(--resume PATH --rewind) that sets the abandoned continuation aside, resuming with other data
settings, and the checkpoint library's replacement of a step and rotation.

Function-level where the behaviour is in a function (examples/pretrain/rundir.py,
yafsdp/checkpoint/files.py); the job itself is launched as plain ``python`` (a world of one: the
lock and the run directory are rank 0's) in few launches."""
from __future__ import annotations

import argparse
import json
import os
import signal
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from job_utils import FAST, JOB, ROOT, env, events, in_lane, metrics, run_job, tree_digest
from pretrain import progress as P
from pretrain import rundir as R
from yafsdp import checkpoint as ckpt
from yafsdp.checkpoint import files as F


# --------------------------------------------------------------- checkpoint library: replace, rotate
class _Killed(BaseException):
    """Stands for a SIGKILL at that point: nothing after it runs, no handler cleans up."""


def _save_tagged(root, step, model, opt, tag, keep=None):
    return ckpt.save_checkpoint(root, step, model, opt, state={"step": step}, meta={"tag": tag}, keep=keep)


def _tags(root):
    return {s: ckpt.read_manifest(p)["meta"]["tag"] for s, p in ckpt.list_checkpoints(root)}


def _replace_and_rotate(rank, world, root):
    import yafsdp
    from models import tiny_llama

    model = yafsdp.YaFSDP(tiny_llama(layers=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = {}
    for s in (4, 6, 8):
        _save_tagged(root, s, model, opt, "old", keep=3)
    # A save of an earlier step (a run gone back to step 4) with --keep 2: kept, and the later
    # steps of the other line are not "older" -- nothing of theirs is deleted either.
    _save_tagged(root, 5, model, opt, "new", keep=2)
    out["after_rotation"] = _tags(root)

    # Replace step 6, killed between the two renames: the old step 6 is still there, complete.
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(src).startswith(F.TMP_PREFIX) and dst.endswith("step_00000006"):
            raise _Killed
        return real_rename(src, dst)

    os.rename = rename
    try:
        _save_tagged(root, 6, model, opt, "new")
    except _Killed:
        out["killed"] = True
    finally:
        os.rename = real_rename
    out["between_renames"] = _tags(root)
    out["between_paths"] = sorted(os.listdir(root))
    six = dict(ckpt.list_checkpoints(root))[6]
    out["loads"] = ckpt.load_checkpoint(six, model, opt).meta["tag"]
    _save_tagged(root, 7, model, opt, "new")  # the next save finishes the interrupted replacement
    out["after_next_save"] = sorted(os.listdir(root))
    # Killed after the second rename, before the old one is removed: the new step 6 is read.
    real_remove = F.remove_checkpoint

    def remove(path, r):
        if os.path.basename(path).startswith(F.OLD_PREFIX):
            raise _Killed
        return real_remove(path, r)

    F.remove_checkpoint = remove
    try:
        _save_tagged(root, 6, model, opt, "newer")
    except _Killed:
        pass
    finally:
        F.remove_checkpoint = real_remove
    out["after_second_rename"] = (_tags(root), sorted(os.listdir(root)))
    _save_tagged(root, 6, model, opt, "newest")
    out["replaced"] = (_tags(root), sorted(os.listdir(root)))
    return out


@in_lane
def test_replacing_a_step_and_rotation_keep_a_complete_checkpoint(tmp_path):
    """yafsdp.checkpoint's finishing block: a save of step 5 among 4, 6, 8 with keep=2 keeps what it
    wrote (rotation went by step number and deleted it); a replacement of step 6 killed between its
    renames leaves a complete step 6 that discovery finds and that loads (the old code deleted it
    first: no step 6 at all), and the next save tidies up."""
    from dist_utils import run_ranks

    root = str(tmp_path / "ck")
    r = run_ranks(_replace_and_rotate, 1, root)[0]
    assert r["after_rotation"] == {4: "old", 5: "new", 6: "old", 8: "old"}
    assert r["killed"] and r["between_renames"] == {4: "old", 5: "new", 6: "old", 8: "old"}
    assert ".old.step_00000006" in r["between_paths"] and ".tmp.step_00000006" in r["between_paths"]
    assert r["loads"] == "old"
    assert r["after_next_save"] == [f"step_0000000{s}" for s in (4, 5, 6, 7, 8)]
    tags, names = r["after_second_rename"]
    assert tags[6] == "newer" and ".old.step_00000006" in names
    tags, names = r["replaced"]
    assert tags[6] == "newest" and names == [f"step_0000000{s}" for s in (4, 5, 6, 7, 8)]


# ---------------------------------------------------------------------- rundir, function level
def _fake_checkpoint(root, step, tag="x"):
    d = os.path.join(root, f"step_{step:08d}")
    os.makedirs(d)
    with open(os.path.join(d, F.MANIFEST), "w") as f:
        json.dump(dict(format=F.FORMAT, step=step, meta={"tag": tag}), f)
    return d


def _fake_run(out, steps, last_row):
    ck = os.path.join(out, "checkpoints")
    for s in steps:
        _fake_checkpoint(ck, s)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        for s in range(1, last_row + 1):
            f.write(json.dumps(dict(step=s, loss=10.0 - s)) + "\n")
    return ck


def _args(out, **kw):
    base = dict(out=out, resume=None, export_only=False, overwrite=False, rewind=False, export_hf=None)
    return argparse.Namespace(**{**base, **kw})


def test_rewind_plan_restart_and_interrupted_rewind(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    ck = _fake_run(out, (4, 6, 8), 9)
    four = os.path.join(ck, "step_00000004")
    fresh = argparse.Namespace(restart_count=0)
    # Continuing the newest checkpoint is no rewind (rows after it: the unsaved tail).
    assert R.plan_output(_args(out, resume="latest"), fresh).rewind is None
    with pytest.raises(R.JobError, match=r"is step 4, but the run in .* went on after it \(checkpoint\(s\) "
                                         r"step_00000006, step_00000008; metrics.jsonl steps 5-9\).*Pass --rewind"):
        R.plan_output(_args(out, resume=four), fresh)
    plan = R.plan_output(_args(out, resume=four, rewind=True), fresh)
    assert plan.rewind.step == 4 and plan.resume_path == four

    # A rewind a kill interrupted after its record and one move is finished by the next job.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t")
    dest = os.path.join(out, R.ABANDONED, "20260101-000000-after-step_4")
    os.makedirs(os.path.join(dest, "checkpoints"))
    F.write_json_atomic(os.path.join(dest, R.RECORD), dict(event="rewind", step=4, checkpoint=four, set_aside=dest,
                                                          launcher=R.launcher_id(), done=False))
    os.rename(os.path.join(ck, "step_00000008"), os.path.join(dest, "checkpoints", "step_00000008"))
    notes = R.finish_interrupted_rewinds(out)
    assert len(notes) == 1 and "interrupted" in notes[0]
    assert sorted(os.listdir(ck)) == ["step_00000004"]
    assert sorted(os.listdir(os.path.join(dest, "checkpoints"))) == ["step_00000006", "step_00000008"]
    assert [r["step"] for r in P.read_jsonl(os.path.join(out, "metrics.jsonl"))] == [1, 2, 3, 4]
    assert [r["step"] for r in P.read_jsonl(os.path.join(dest, "metrics.jsonl"))] == [5, 6, 7, 8, 9]
    ev = P.read_jsonl(os.path.join(out, "events.jsonl"))
    assert [e["event"] for e in ev] == ["rewind"] and ev[0]["checkpoints"] == ["step_00000006", "step_00000008"]
    assert json.load(open(os.path.join(dest, R.RECORD)))["done"] is True

    # The new line saved step 5; torchrun restarts the launch that rewound: it continues the new
    # line (not step 4 again, not the abandoned step 8). Another launch would rewind again.
    _fake_checkpoint(ck, 5)
    restart = argparse.Namespace(restart_count=1)
    plan = R.plan_output(_args(out, resume=four, rewind=True), restart)
    assert plan.resume_path.endswith("step_00000005") and plan.rewind is None
    monkeypatch.setattr(R, "launcher_id", lambda: "otherhost:1")
    plan = R.plan_output(_args(out, resume=four, rewind=True), restart)
    assert plan.resume_path == four and plan.rewind.step == 4
    # Without --rewind a restart of `--resume PATH` continues from the newest checkpoint past PATH.
    assert R.plan_output(_args(out, resume=four), restart).resume_path.endswith("step_00000005")


def test_validation_points_drop_the_abandoned_line(tmp_path):
    ev = tmp_path / "events.jsonl"
    rows = [dict(event="end", step=8, val_loss=1.5), dict(event="rewind", step=4),
            dict(event="end", step=6, val_loss=2.0)]
    ev.write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics_rows = [dict(step=s, loss=1.0) for s in range(1, 11)]
    assert P.validation_points(metrics_rows, str(ev), (10, 1.8)) == [(6, 2.0), (10, 1.8)]


def test_settings_check_names_each_change():
    saved = dict(seq_len=64, seed=0, global_batch=16, batch=[8, 2, 1], data=dict(tokens=100, crc32="0000abcd"),
                 model=dict(rope_parameters={"rope_theta": 10000.0}, rms_norm_eps=1e-6))
    now = dict(saved, seq_len=32, seed=1, global_batch=24, batch=[4, 3, 2],
               model=dict(rope_parameters={"rope_theta": 500000.0}, rms_norm_eps=1e-6))
    with pytest.raises(R.JobError) as e:
        R.check_settings(saved, now, set(), "ck/step_00000006")
    msg = str(e.value)
    for part in ("seq_len 64 (checkpoint) vs 32 (now)", "seed 0 (checkpoint) vs 1 (now)",
                 "global_batch 16 (8 x 2 rank(s) x 1 accum) (checkpoint) vs 24 (4 x 3 rank(s) x 2 accum) (now)",
                 "model {'rope_parameters': {'rope_theta': 10000.0}} (checkpoint) vs",
                 "--allow-change seq_len,seed,global_batch,model"):
        assert part in msg, (part, msg)
    assert "data" not in msg.split("Resuming")[0].replace("data stream", "")
    changes = R.check_settings(saved, now, {"seq_len", "seed", "global_batch", "model"}, "p")
    assert changes["seq_len"] == [64, 32] and changes["model"][1] == {"rope_parameters": {"rope_theta": 500000.0}}
    assert R.check_settings(saved, dict(saved, batch=[4, 2, 2]), set(), "p") == {}  # same global batch: free
    # Only the number of ranks changed it (an elastic restart, more GPUs): free, but reported.
    assert R.check_settings(saved, dict(saved, global_batch=24, batch=[8, 3, 1]), set(), "p") == \
        {"global_batch": [16, 24]}
    with pytest.raises(R.JobError, match=r"global_batch 16 \(8 x 2 rank\(s\) x 1 accum\) \(checkpoint\) vs 8 "):
        R.check_settings(saved, dict(saved, global_batch=8, batch=[4, 2, 1]), set(), "p")
    with pytest.raises(R.JobError, match=r"data 100 tokens, crc32 0000abcd \(checkpoint\) vs 100 tokens, crc32 "):
        R.check_settings(saved, dict(saved, data=dict(tokens=100, crc32="ffff0000")), set(), "p")
    assert R.parse_allow_change("seq_len, seed") == {"seq_len", "seed"}
    assert R.parse_allow_change("seq-len") == {"seq_len"}
    assert "unknown setting(s) lr" in R.parse_allow_change("lr")


# ------------------------------------------------------------------------ job: two jobs, new --out
# The job with its plan paused: after the plan is made, it waits for GATE.go (having written
# GATE.reached). Patched wherever the job keeps plan_output, so the same script runs the code
# before the fix (where the plan was made before the lock) and after.
_PAUSED_JOB = """
import os, sys, time
sys.path.insert(0, os.path.join({root!r}, "examples"))
import pretrain.job as J
try:
    import pretrain.rundir as R
except ImportError:
    R = None
gate = os.environ["GATE"]
def pause(fn):
    def wrapped(*a, **k):
        plan = fn(*a, **k)
        open(gate + ".reached", "w").close()
        while not os.path.exists(gate + ".go"):
            time.sleep(0.02)
        return plan
    return wrapped
for mod in (J, R):
    if mod is not None and hasattr(mod, "plan_output"):
        mod.plan_output = pause(mod.plan_output)
sys.exit(J.main(sys.argv[1:]))
"""


def _popen(args, script=None, extra_env=None):
    e = env()
    e.update(extra_env or {})
    cmd = [sys.executable, script or JOB] + FAST + args
    return subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _in_use(stderr, out, pid):
    return f"pretrain_llama.py: error: --out {out!r} is in use by another job (pid {pid} on host" in stderr


@in_lane
def test_two_jobs_on_a_new_out(tmp_path):
    """(a) Forced interleaving: job B makes its plan for a new --out and stalls; job A runs a whole
    run meanwhile; B goes on. Before the fix B had planned a fresh start without the lock and then
    trained into A's run (both exit 0, metrics steps 1-6 twice). Now the plan is made under the
    lock: A is refused, naming B, and B's run is the only one. (b) Two jobs started at once on a
    new --out: one trains, the other is refused."""
    with ThreadPoolExecutor(1) as pool:  # (b) beside (a): their own --out
        at_once = pool.submit(_two_at_once, str(tmp_path / "new2"))
        out = str(tmp_path / "new")
        gate = str(tmp_path / "gate")
        script = tmp_path / "paused_job.py"
        script.write_text(_PAUSED_JOB.format(root=ROOT))
        b = _popen(["--steps", "6", "--out", out], script=str(script), extra_env={"GATE": gate})
        t0 = time.monotonic()
        while not os.path.exists(gate + ".reached"):
            assert b.poll() is None and time.monotonic() - t0 < 120, b.communicate()
            time.sleep(0.05)
        a = run_job(["--steps", "6", "--out", out], nproc=0, check=False)
        open(gate + ".go", "w").close()
        bo, be = b.communicate(timeout=240)
        assert sorted([a.returncode, b.returncode]) == [0, 2], (a.returncode, a.stderr[-2000:], b.returncode,
                                                                be[-2000:])
        assert b.returncode == 0 and _in_use(a.stderr, out, b.pid), (a.stderr[-2000:], be[-2000:])
        assert [r["step"] for r in metrics(out)] == list(range(1, 7))
        assert [e["event"] for e in events(out)].count("start") == 1
        at_once.result()


def _two_at_once(out2: str) -> None:
    """(b) of test_two_jobs_on_a_new_out: two jobs started at once on a new --out, each would run for long."""
    jobs = [_popen(["--steps", "100000", "--save-every", "0", "--out", out2]) for _ in range(2)]
    t0 = time.monotonic()
    while all(j.poll() is None for j in jobs):
        assert time.monotonic() - t0 < 120
        time.sleep(0.05)
    loser = next(j for j in jobs if j.poll() is not None)
    winner = next(j for j in jobs if j is not loser)
    while not (os.path.isfile(os.path.join(out2, "metrics.jsonl")) and metrics(out2)):
        assert winner.poll() is None and time.monotonic() - t0 < 120
        time.sleep(0.05)
    winner.send_signal(signal.SIGTERM)
    wo, we = winner.communicate(timeout=120)
    lo, le = loser.communicate(timeout=10)
    assert loser.returncode == 2 and _in_use(le, out2, winner.pid), le[-2000:]
    assert winner.returncode == 0 and "stopped  by SIGTERM" in wo, we[-2000:]
    steps = [r["step"] for r in metrics(out2)]
    assert steps == list(range(1, len(steps) + 1))


@in_lane
def test_a_restart_before_the_first_checkpoint_starts_the_run_again(tmp_path):
    """A torchrun restart (or ``--resume auto``) in an --out that holds metrics but no complete
    checkpoint -- the first attempt died before its first save -- starts the run again, saying what
    it discards. The plan used to leave the wipe's description out, and the job then stopped with a
    KeyError on rank 0 at every restart."""
    out = str(tmp_path / "run")
    os.makedirs(out)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.write(json.dumps(dict(step=1, loss=9.0)) + "\n")
    p = run_job(["--steps", "2", "--save-every", "0", "--resume", "auto", "--out", out], nproc=0)
    said = [line for line in p.stdout.splitlines() if line.startswith("start    ")]
    assert said == [f"start    no complete checkpoint in {out}/checkpoints to resume: the run starts again; "
                    "discarded metrics.jsonl (1 steps, 1-1, last loss 9.0000)"], p.stdout[-2000:]
    assert [r["step"] for r in metrics(out)] == [1, 2] and metrics(out)[0]["loss"] != 9.0
    assert [e["event"] for e in events(out)][0] == "start"


def test_the_lock_makes_a_new_out_and_a_refused_job_leaves_none(tmp_path):
    """The lock is taken before --out is read, so it makes a new --out; a job refused before it
    wrote anything (e.g. --resume with nothing to resume) removes it again. A second lock on the
    same folder is refused (flock: per open file, also within one process)."""
    from pretrain.ops import OutLock

    out = str(tmp_path / "a" / "new")
    first = OutLock(out)
    first.acquire()
    assert first.created and os.path.isfile(os.path.join(out, ".lock"))
    with pytest.raises(R.JobError, match=f"--out {out!r} is in use by another job \\(pid {os.getpid()} on host"):
        OutLock(out).acquire()
    first.release()
    assert not os.path.exists(out) and os.path.isdir(tmp_path / "a")
    kept = OutLock(out)
    kept.acquire()
    open(os.path.join(out, "metrics.jsonl"), "w").close()  # the job wrote something: --out stays
    kept.release()
    assert os.listdir(out) == ["metrics.jsonl"]


def test_a_refused_job_names_a_holder_that_has_not_written_its_name_yet(tmp_path):
    """A job refused between the holder's flock and its write of the lock file's contents used to
    read an empty file and say "pid ? on host ?" (seen in CI with two jobs started at once); it reads
    again until the holder's name is there."""
    import fcntl
    import threading

    from pretrain.ops import OutLock

    out = str(tmp_path / "new")
    os.makedirs(out)
    path = os.path.join(out, OutLock.NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked, still empty: the holder's window
    me = OutLock(out).me
    late = threading.Timer(0.3, lambda: os.write(fd, json.dumps(me).encode()))
    late.start()
    try:
        with pytest.raises(R.JobError, match=f"in use by another job \\(pid {os.getpid()} on host"):
            OutLock(out).acquire()
    finally:
        late.join()
        os.close(fd)


# ----------------------------------------------------------------------- job: rewind and settings
@in_lane
def test_rewind_sets_the_continuation_aside_and_settings_are_checked(tmp_path):
    """A run with checkpoints 4, 6, 8. `--resume step_4` alone is refused (it would abandon
    steps 5-8) and so is `--resume` with another --seq-len, --seed and --batch-size (each named,
    old and new value); nothing changes. `--resume step_4 --rewind --lr 1e-3 --save-every 1`
    moves step 6, step 8 and metrics rows 5-8 to abandoned/, keeps the step 5 it saves, and a
    plain --resume then continues the new line (with a --seq-len change accepted and recorded)."""
    out = str(tmp_path / "run")
    ck = os.path.join(out, "checkpoints")
    run_job(["--steps", "8", "--save-every", "2", "--keep", "3", "--out", out], nproc=0)
    assert sorted(os.listdir(ck)) == ["step_00000004", "step_00000006", "step_00000008"]
    before, old_rows = tree_digest(out), metrics(out)
    four = os.path.join(ck, "step_00000004")

    twin = str(tmp_path / "twin")  # the run copied: a job holds its --out's lock, so the refusals need one each
    shutil.copytree(out, twin)
    with ThreadPoolExecutor(2) as pool:  # the two refusals side by side
        rewind = pool.submit(run_job, ["--resume", four, "--lr", "1e-3", "--save-every", "1", "--steps", "6", "--out",
                                       out], nproc=0, check=False)
        changed = pool.submit(run_job, ["--resume", "--seq-len", "16", "--seed", "1", "--batch-size", "1", "--steps",
                                        "10", "--out", twin], nproc=0, check=False)
        p = rewind.result()
        changed = changed.result()
    assert p.returncode == 2, p.stdout[-2000:]
    assert p.stderr.strip() == (
        f"pretrain_llama.py: error: --resume {four!r} is step 4, but the run in {out!r} went on after it "
        "(checkpoint(s) step_00000006, step_00000008; metrics.jsonl steps 5-8): resuming from it abandons that "
        f"continuation. Pass --rewind as well to set it aside in {out}/abandoned/ (moved, nothing deleted; recorded "
        "in events.jsonl), or --resume without a path to continue from step_00000008"), p.stderr
    p = changed
    assert p.returncode == 2, p.stdout[-2000:]
    msg = p.stderr.strip()
    assert msg.startswith(f"pretrain_llama.py: error: checkpoint '{twin}/checkpoints/step_00000008' was written with "
                          "other settings that decide the data stream or the model: seq_len 32 (checkpoint) vs 16 "
                          "(now); seed 0 (checkpoint) vs 1 (now); global_batch 2 (2 x 1 rank(s) x 1 accum) "
                          "(checkpoint) vs 1 (1 x 1 rank(s) x 1 accum) (now)."), msg
    assert msg.endswith("--allow-change seq_len,seed,global_batch (recorded in events.jsonl)"), msg
    assert tree_digest(out) == before and tree_digest(twin) == before

    old6, old8 = tree_digest(os.path.join(ck, "step_00000006")), tree_digest(os.path.join(ck, "step_00000008"))
    p = run_job(["--resume", four, "--rewind", "--lr", "1e-3", "--save-every", "1", "--keep", "3", "--steps", "6",
                 "--out", out], nproc=0)
    assert "saved    " + os.path.join(ck, "step_00000005") in p.stdout
    assert sorted(os.listdir(ck)) == ["step_00000004", "step_00000005", "step_00000006"]
    (aside,) = os.listdir(os.path.join(out, "abandoned"))
    assert aside.endswith("-after-step_4")
    dest = os.path.join(out, "abandoned", aside)
    assert f"rewind   back to step 4: the continuation after it (checkpoint(s) step_00000006, step_00000008; " \
           f"metrics.jsonl steps 5-8) is set aside in {dest}" in p.stdout
    assert tree_digest(os.path.join(dest, "checkpoints", "step_00000006")) == old6
    assert tree_digest(os.path.join(dest, "checkpoints", "step_00000008")) == old8
    assert P.read_jsonl(os.path.join(dest, "metrics.jsonl")) == old_rows[4:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7)) and rows[:4] == old_rows[:4]
    assert rows[5]["lr"] < old_rows[5]["lr"]  # the new line's
    rewind = [e for e in events(out) if e["event"] == "rewind"]
    assert len(rewind) == 1 and rewind[0]["step"] == 4 and rewind[0]["set_aside"] == dest
    assert rewind[0]["checkpoints"] == ["step_00000006", "step_00000008"] and rewind[0]["metrics_steps"] == [5, 8]

    p = run_job(["--resume", "--seq-len", "16", "--allow-change", "seq_len", "--lr", "1e-3", "--steps", "7",
                 "--weight-decay", "0", "--out", out], nproc=0)
    assert f"init     resumed from {ck}/step_00000006 (step 6" in p.stdout
    # the flags decide the optimizer's options on a resume (the checkpoint's 0.1 was restored with its state)
    assert "weight decay 0, clip" in p.stdout, p.stdout
    assert "note     settings changed from the checkpoint's: seq_len 32 -> 16; recorded in events.jsonl" in p.stdout
    ev = events(out)
    changed = [e for e in ev if e["event"] == "settings_changed"]
    assert len(changed) == 1 and changed[0]["changes"] == {"seq_len": [32, 16]} and changed[0]["step"] == 6
    assert [r["step"] for r in metrics(out)] == list(range(1, 8))
    assert ckpt.read_manifest(os.path.join(ck, "step_00000007"))["meta"]["settings"]["seq_len"] == 16
