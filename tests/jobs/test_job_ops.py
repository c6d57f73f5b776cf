"""Operations of the main job: SIGTERM -> checkpoint and a clean exit; a killed rank under
``torchrun --max-restarts`` -> the worker group restarts and resumes from the last checkpoint."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from job_utils import FAST, env, events, in_lane, metrics, torchrun_cmd, workers


def _wait_for(cond, proc, timeout=180.0, what=""):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the job ended (rc {proc.returncode}) before {what}:\n{out[-2000:]}\n{err[-4000:]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}")


def _lines(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for line in f if line.endswith("\n"))
    except FileNotFoundError:
        return 0


@in_lane
def test_sigterm_saves_and_exits_cleanly(tmp_path):
    out = str(tmp_path / "run")
    cmd = torchrun_cmd(2) + FAST + ["--steps", "400", "--save-every", "1000", "--out", out]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: _lines(os.path.join(out, "metrics.jsonl")) >= 4, proc, what="4 steps")
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to every worker
    stdout, stderr = proc.communicate(timeout=120)
    rows = metrics(out)
    last = rows[-1]["step"]
    assert 4 <= last < 400
    ev = events(out)
    sig = [e for e in ev if e["event"] == "signal"]
    assert sig and sig[0]["signal"] == "SIGTERM" and sig[0]["step"] == last
    assert ev[-1]["event"] == "stopped"  # the workers ran to the end of the job
    saves = [e for e in ev if e["event"] == "save"]
    assert saves[-1]["step"] == last
    ck = os.path.join(out, "checkpoints", f"step_{last:08d}")
    manifest = json.load(open(os.path.join(ck, "checkpoint.json")))
    assert manifest["step"] == last and manifest["world_size"] == 2
    assert all(os.path.getsize(os.path.join(ck, f)) == m["bytes"] for f, m in manifest["files"].items())
    assert f"stopped  by SIGTERM at step {last}" in stdout
    # torchrun itself ends with a SignalException traceback; the workers must print none.
    assert "pretrain_llama.py\", line" not in stderr, stderr[-4000:]


@in_lane
def test_killed_rank_restarts_and_resumes(tmp_path):
    out = str(tmp_path / "run")
    steps = 80  # the kill comes after 8 steps: the restart still has most of the run to train
    cmd = torchrun_cmd(2, ["--master-port", str(_port()), "--max-restarts", "1"])
    cmd += FAST + ["--steps", str(steps), "--save-every", "5", "--keep", "2", "--out", out]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    mpath = os.path.join(out, "metrics.jsonl")
    first_ck = os.path.join(out, "checkpoints", "step_00000005", "checkpoint.json")
    _wait_for(lambda: os.path.isfile(first_ck) and _lines(mpath) >= 8, proc, what="a checkpoint and 8 steps")
    before = [json.loads(line) for line in open(mpath) if line.endswith("\n")]
    victims = workers(proc.pid)
    assert len(victims) == 2, victims
    os.kill(victims[-1], signal.SIGKILL)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        for pid in workers(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"no restart within 240 s:\n{stdout[-3000:]}\n{stderr[-8000:]}") from None
    assert proc.returncode == 0, f"{stdout[-3000:]}\n{stderr[-6000:]}"
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # each step once, in order
    ev = events(out)
    resumes = [e for e in ev if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["restart"] == 1
    k = resumes[0]["step"]
    assert k >= 5 and k % 5 == 0 and resumes[0]["checkpoint"].endswith(f"step_{k:08d}")
    assert ev[-1]["event"] == "end" and ev[-1]["step"] == steps
    # Steps logged before the kill and recomputed after the restart: the same losses, bit for bit.
    again = {r["step"]: r["loss"] for r in rows}
    redone = [r for r in before if r["step"] > k]
    assert all(again[r["step"]] == r["loss"] for r in before), "a step's loss changed across the restart"
    assert len(before) >= 8 and (redone or before[-1]["step"] == k)


def _port() -> int:
    from dist_utils import free_port

    return free_port()
