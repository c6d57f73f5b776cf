"""The main job when things go wrong: non-finite training, directories it did not
write, storage errors, a second job on the same --out, and errors under torchrun. Each case is
launched the way users launch the job and checks what is left on disk, not only the message."""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from job_utils import FAST, JOB, env, in_lane, metrics, run_job, torchrun_cmd, tree_digest

WORKER_TRACEBACK = 'pretrain_llama.py", line'  # a frame of the job in a traceback


def _popen(args, nproc=0, **kw):
    cmd = (torchrun_cmd(nproc) if nproc else [sys.executable, JOB]) + FAST + args
    return subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _finite_checkpoint(path: str, tmp) -> bool:
    """Every tensor of a checkpoint (model and optimizer state) is finite: read with DCP's own
    converter, independent of yafsdp's loader."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = str(tmp / (os.path.basename(path) + ".pt"))
    dcp_to_torch_save(path, dst)
    sd = torch.load(dst, weights_only=False)
    tensors = [v for v in sd.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert any(k.startswith("model.") for k in sd) and tensors
    return all(bool(torch.isfinite(t).all()) for t in tensors)


# ------------------------------------------------------------------------- 8: NaN / inf loss
@in_lane
def test_nonfinite_steps_are_skipped_then_the_run_stops(tmp_path):
    """--lr 1000 makes the grad norm NaN from step 7 on: those steps are skipped on both ranks
    (no update), the third in a row stops the run with exit 3, every checkpoint written is finite
    and --keep never rotated the last finite one out."""
    out = str(tmp_path / "run")
    p = run_job(["--lr", "1000", "--steps", "30", "--save-every", "2", "--keep", "1", "--max-skipped-steps", "3",
                 "--out", out], check=False)
    assert p.returncode != 0 and "exitcode  : 3" in p.stderr, (p.returncode, p.stderr[-3000:])
    assert p.stderr.count("pretrain_llama.py: error: training diverged: the loss or grad norm was NaN/inf "
                          "for 3 steps in a row") == 1, p.stderr[-3000:]
    assert WORKER_TRACEBACK not in p.stderr
    rows = metrics(out)
    skipped = [r["step"] for r in rows if r.get("skipped")]
    assert len(skipped) == 3 and skipped == list(range(rows[-1]["step"] - 2, rows[-1]["step"] + 1))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows if not r.get("skipped"))
    assert not math.isfinite(rows[-1]["grad_norm"])
    assert "skipped  step" in p.stdout and "no optimizer step (1 in a row, stop at 3)" in p.stdout
    ck_root = os.path.join(out, "checkpoints")
    cks = sorted(d for d in os.listdir(ck_root) if d.startswith("step_"))
    assert len(cks) == 1  # --keep 1
    assert _finite_checkpoint(os.path.join(ck_root, cks[0]), tmp_path)


# ------------------------------------------------------- 9: a step_* directory without manifest
@in_lane
def test_a_directory_without_manifest_is_reported_and_never_deleted(tmp_path):
    out = tmp_path / "run"
    ck = out / "checkpoints"
    foreign = ck / "step_00000099"  # e.g. a checkpoint being copied in: data files, no manifest yet
    foreign.mkdir(parents=True)
    (foreign / "__0_0.distcp").write_bytes(b"data of a checkpoint being copied")
    (ck / ".tmp.step_00000050").mkdir()  # a killed save: never complete, may be cleaned
    before = tree_digest(str(foreign))
    first = run_job(["--steps", "2", "--save-every", "1", "--keep", "1", "--out", str(out)], nproc=0)
    assert tree_digest(str(foreign)) == before
    assert not (ck / ".tmp.step_00000050").exists()
    assert f"note     skipped {foreign}: no checkpoint.json, not a complete checkpoint" in first.stdout
    assert f"note     '{foreign}' has no checkpoint.json: not a complete checkpoint, skipped and left in place" \
        in first.stdout
    assert sorted(os.listdir(ck)) == ["step_00000002", "step_00000099"]
    # Resume: step 2 is used (step_99 is skipped, saying so); a save of the very step a foreign
    # directory occupies is refused (exit 2), deleting nothing.
    clash = ck / "step_00000003"
    clash.mkdir()
    (clash / "__0_0.distcp").write_bytes(b"not ours either")
    good = tree_digest(str(ck / "step_00000002"))
    second = run_job(["--resume", "--steps", "3", "--out", str(out)], nproc=0, check=False)
    assert second.returncode == 2, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "step_00000002" in second.stdout
    assert f"note     skipped {foreign}" in second.stdout and f"note     skipped {clash}" in second.stdout
    assert (f"step 3 was not saved: cannot save step 3: '{clash}' already exists without a checkpoint.json"
            in second.stderr), second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    assert tree_digest(str(foreign)) == before and (clash / "__0_0.distcp").read_bytes() == b"not ours either"
    assert tree_digest(str(ck / "step_00000002")) == good


# ---------------------------------------------------------------------------- 10: storage errors
# Injected into the job's processes only by this test (a sitecustomize.py first on PYTHONPATH):
# DCP's writer raises ENOSPC for files under the directory named by YAFSDP_TEST_ENOSPC, as a full
# disk does. Simulated: a real full disk needs a filesystem of its own (root ignores permissions).
ENOSPC_HOOK = """
import errno, os
_match = os.environ.get("YAFSDP_TEST_ENOSPC")
if _match:
    import torch.distributed.checkpoint.filesystem as _fs
    _real = _fs._write_item
    def _write_item(transforms, stream, *args, **kw):
        name = getattr(stream, "name", "")
        if isinstance(name, str) and _match in name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        return _real(transforms, stream, *args, **kw)
    _fs._write_item = _write_item
"""


@in_lane
def test_storage_errors_are_one_line_exit_2_and_keep_the_last_checkpoint(tmp_path):
    """(a) a DCP save that hits ENOSPC (injected, see ENOSPC_HOOK: DCP wraps the OSError in a
    CheckpointException, a BaseException) under torchrun; real kernel errors: (b) checkpoints/ is a
    file; (c) --out lies below a file. One line naming the path and the errno, exit 2, the last
    checkpoint intact, no .tmp.* left."""
    out = str(tmp_path / "run")
    run_job(["--steps", "2", "--out", out], nproc=0)
    ck_root = os.path.join(out, "checkpoints")
    good = tree_digest(os.path.join(ck_root, "step_00000002"))
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(ENOSPC_HOOK)
    full = env()
    full.update(PYTHONPATH=f"{hook}{os.pathsep}{full['PYTHONPATH']}", YAFSDP_TEST_ENOSPC=".tmp.step_00000003")
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "checkpoints").write_text("a file where the checkpoints directory should be")
    (tmp_path / "plain_file").write_text("x")
    procs = {
        "enospc": subprocess.Popen(torchrun_cmd(2) + FAST + ["--resume", "--steps", "4", "--save-every", "1",
                                                             "--out", out],
                                   env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        "ck_file": _popen(["--steps", "1", "--out", str(blocked)]),
        "under_file": _popen(["--steps", "1", "--out", str(tmp_path / "plain_file" / "run")]),
    }
    res = {k: (p.wait(timeout=240), *p.communicate()) for k, p in procs.items()}
    rc, o, e = res["enospc"]
    assert rc != 0 and "exitcode  : 2" in e, e[-3000:]
    msg = [line for line in e.splitlines() if line.startswith("pretrain_llama.py: error:")]
    assert len(msg) == 1, e[-3000:]
    tmp = os.path.join(ck_root, ".tmp.step_00000003")
    assert f"step 3 was not saved: out of disk space in {ck_root!r}: " in msg[0], msg[0]  # see docs/checkpoints.md
    assert f"(saving into {tmp!r} failed on rank 0: [Errno 28] No space left on device: '{tmp}/__0_0.distcp')" \
        in msg[0], msg[0]
    assert "earlier checkpoints are untouched" in msg[0] and msg[0].endswith("last complete checkpoint: "
                                                                             f"{ck_root}/step_00000002")
    assert WORKER_TRACEBACK not in e and "CheckpointException" not in e
    assert sorted(os.listdir(ck_root)) == ["step_00000002"]  # no .tmp.* left behind
    assert tree_digest(os.path.join(ck_root, "step_00000002")) == good
    rc, o, e = res["ck_file"]
    assert rc == 2 and "Traceback" not in e, e[-3000:]
    assert (f"step 1 was not saved: cannot prepare checkpoint directory "
            f"'{blocked}/checkpoints/.tmp.step_00000001': [Errno 17] File exists: '{blocked}/checkpoints'") in e, e
    rc, o, e = res["under_file"]
    assert rc == 2 and "Traceback" not in e, e[-3000:]
    assert f"[Errno 20] Not a directory: '{tmp_path / 'plain_file' / 'run'}'" in e, e


# ------------------------------------------------------------------ 11: two jobs on one --out
@in_lane
def test_second_job_on_the_same_out_is_refused(tmp_path):
    out = str(tmp_path / "run")
    a = _popen(["--steps", "100000", "--save-every", "0", "--out", out])
    t0 = time.monotonic()
    while not (os.path.isfile(os.path.join(out, "metrics.jsonl")) and len(metrics(out)) >= 2):
        assert a.poll() is None and time.monotonic() - t0 < 120, a.communicate()
        time.sleep(0.05)
    b = run_job(["--overwrite", "--steps", "2", "--out", out], nproc=0, check=False)  # would discard a's run
    a.send_signal(signal.SIGTERM)
    ao, ae = a.communicate(timeout=120)
    assert b.returncode == 2, (b.returncode, b.stdout[-2000:], b.stderr[-2000:])
    host = socket.gethostname()
    assert b.stderr.strip().splitlines() == [
        f"pretrain_llama.py: error: --out {out!r} is in use by another job (pid {a.pid} on host {host}, started "
        + b.stderr.split("started ", 1)[1].split(";", 1)[0] + f"; lock file '{out}/.lock'); wait for it to end or "
        "choose another --out"], b.stderr
    assert a.returncode == 0 and "stopped  by SIGTERM" in ao, ae[-3000:]
    steps = [r["step"] for r in metrics(out)]
    assert steps == list(range(1, len(steps) + 1))  # one run's rows only
    assert not os.path.exists(os.path.join(out, ".lock"))  # released on the SIGTERM exit
    # A lock left by a killed job (its pid is gone) is taken over, with a note.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(os.path.join(out, ".lock"), "w") as f:
        json.dump(dict(pid=dead.pid, host=host, started="2026-01-01T00:00:00"), f)
    c = run_job(["--resume", "--steps", str(steps[-1] + 1), "--out", out], nproc=0)
    assert (f"note     took over the stale lock '{out}/.lock' of pid {dead.pid} on host {host}, started "
            "2026-01-01T00:00:00: that job ended without releasing it (killed?)") in c.stdout
    assert not os.path.exists(os.path.join(out, ".lock"))


# -------------------------------------------------------------------- 12: errors under torchrun
@in_lane
def test_errors_under_torchrun_are_printed_once(tmp_path):
    cases = {
        "abbrev": ["--step", "3", "--out", str(tmp_path / "a")],  # not --steps: abbreviations are refused
        "value": ["--lr", "-1", "--out", str(tmp_path / "b")],
        "job": ["--resume", "--out", str(tmp_path / "c")],
    }
    procs = {k: _popen(v, nproc=2) for k, v in cases.items()}
    res = {k: (p.wait(timeout=240), *p.communicate()) for k, p in procs.items()}
    want = {"abbrev": "pretrain_llama.py: error: unrecognized arguments: --step 3 (see --help)",
            "value": "pretrain_llama.py: error: --lr must be > 0, got -1.0 (see --help)",
            "job": "pretrain_llama.py: error: --resume: nothing to resume, no complete checkpoint in"}
    for k, (rc, o, e) in res.items():
        assert rc != 0 and "exitcode  : 2" in e, (k, e[-3000:])
        ours = [line for line in e.splitlines() if line.startswith("pretrain_llama.py")]
        assert len(ours) == 1 and ours[0].startswith(want[k]), (k, e[-3000:])
        assert "usage:" not in e and WORKER_TRACEBACK not in e, (k, e[-3000:])
    assert not os.path.exists(tmp_path / "a")


# ------------------------------------------------------------------------- 13: abort at exit
_THREADS_AFTER_MAIN = """
import os, sys
sys.path.insert(0, os.path.join({root!r}, "examples"))
from pretrain.job import main
code = main(sys.argv[1:])
# one write per rank: print() writes its pieces separately, and two ranks' pieces interleave on the shared stderr
os.write(2, f"threads after main: {{len(os.listdir('/proc/self/task'))}}\\n".encode())
import atexit, gc
from pretrain.ops import exit_fast
atexit.register(lambda: os.write(2, f"collector frozen at exit: {{gc.get_freeze_count() > 0}}\\n".encode()))
exit_fast(code)  # the scripts' own exit
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
@in_lane
def test_the_job_ends_its_gloo_threads_before_exit(tmp_path):
    """[Note: teardown before exit]: when main() returns, on a normal and on an error exit, the gloo
    backend's worker threads are gone (only the main thread is left), so none can free a tensor
    during interpreter finalization (the rare SIGABRT at exit); the scripts' exit_fast ([Note: a fast
    exit]) then exits with main()'s status, the collector frozen."""
    from job_utils import ROOT

    script = tmp_path / "job_then_count.py"
    script.write_text(_THREADS_AFTER_MAIN.format(root=ROOT))
    cases = ((["--steps", "2"], 0), (["--lr", "1e6", "--steps", "30", "--max-skipped-steps", "2"], 3))
    cmds = [torchrun_cmd(2)[:-1] + [str(script)] + FAST + extra + ["--out", str(tmp_path / f"run{code}")]
            for extra, code in cases]
    with ThreadPoolExecutor(2) as pool:  # two jobs, two --out: side by side
        runs = list(pool.map(lambda c: subprocess.run(c, env=env(), capture_output=True, text=True, timeout=240), cmds))
    for (extra, code), p in zip(cases, runs):
        counts = [line for line in p.stderr.splitlines() if "threads after main:" in line]
        assert len(counts) == 2, (p.returncode, p.stderr[-3000:])
        assert all(line.endswith("threads after main: 1") for line in counts), counts
        assert (p.returncode == 0) == (code == 0), p.stderr[-3000:]
        assert p.stderr.count("collector frozen at exit: True") == 2, p.stderr[-3000:]
        if code:
            assert f"exitcode  : {code}" in p.stderr, p.stderr[-3000:]
