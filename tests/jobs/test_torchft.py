"""HSDP replica groups under torchft (yafsdp/integrations/torchft.py, examples/torchft_hsdp.py).

World 4 on gloo: two replica groups of two shard ranks, each its own torchrun, one lighthouse (in
this process). Killed: one group SIGKILLs both its workers at a random step; the other goes on at
the smaller quorum, torchrun restarts the killed group, which takes the live state from the
survivor and rejoins; both end with identical shards, optimizer state, step and data position,
and the weights are those of one process replaying the run's documented semantics (each
committed step: the mean gradient over the ranks of the groups that committed it). Stopped: a
SIGSTOPped group is dropped after the collective deadline and the other goes on alone.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from dist_utils import free_port
from job_utils import workers

os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse (Rust, in this process) logs every quorum at info
pytest.importorskip("torchft")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "torchft_hsdp.py")
TIMEOUT_S = 3  # the cross-group collective deadline of these runs (--timeout)


def _example():
    spec = importlib.util.spec_from_file_location("torchft_hsdp", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _env(lighthouse: str) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"
    e["TORCHFT_LIGHTHOUSE"] = lighthouse
    e["RUST_LOG"] = "warn"  # torchft's Rust side logs every quorum at info
    e.pop("RANK", None)
    return e


def _launch(out, lighthouse, group, args, restarts):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--max-restarts", str(restarts), SCRIPT, "--replica-group", str(group), "--out", str(out),
           "--timeout", str(TIMEOUT_S), "--sleep", "0.02", *args]
    log = open(os.path.join(out, f"torchrun_g{group}.txt"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(lighthouse), start_new_session=True)


def _wait(p, deadline, out, group):
    try:
        return p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise AssertionError(f"replica group {group} did not finish in time:\n{_tail(out, group)}")


def _tail(out, group):
    with open(os.path.join(out, f"torchrun_g{group}.txt")) as f:
        return f.read()[-5000:]


def _log(out, group):
    with open(os.path.join(out, f"log_g{group}.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _final(out, group, rank):
    return torch.load(os.path.join(out, f"final_g{group}_r{rank}.pt"), weights_only=False)


def _same(a, b) -> bool:
    """Equal nested state: tensors bit for bit."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture
def lighthouse():
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    yield server.address()
    server.shutdown()


def _replay(ex, committed: dict[int, list[int]]):
    """The documented semantics in one process: each committed step's gradient is the mean over the
    ranks (2 per group) of the groups that committed it; clip, AdamW."""
    model = ex.build_model()
    opt = ex.make_optimizer(model.parameters())
    for step in sorted(committed):
        groups = committed[step]
        for g in groups:
            for r in (0, 1):
                x, y = ex.batch(step, g, r)
                (ex.loss_fn(model(x), y) / (2 * len(groups))).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), ex.MAX_NORM)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_killed_replica_group_recovers_from_the_survivor(tmp_path, lighthouse):
    die_at = random.Random(os.getpid()).randint(3, 6)
    common = ["--steps", str(die_at + 6), "--together", "3", "--wait", "60"]  # the fault's step comes before the end
    p0 = _launch(tmp_path, lighthouse, 0, common, restarts=0)
    p1 = _launch(tmp_path, lighthouse, 1, common + ["--die-at", str(die_at)], restarts=1)
    deadline = time.monotonic() + 90
    rc0, rc1 = _wait(p0, deadline, tmp_path, 0), _wait(p1, deadline, tmp_path, 1)
    assert (rc0, rc1) == (0, 0), f"{_tail(tmp_path, 0)}\n---\n{_tail(tmp_path, 1)}"
    log0, log1 = _log(tmp_path, 0), _log(tmp_path, 1)
    steps1 = [r["step"] for r in log1]
    # group 1 died once: its committed steps have a gap, which group 0 ran alone at quorum 1
    gap = [s for a, b in zip(steps1, steps1[1:]) for s in range(a + 1, b)]
    assert gap, steps1
    alone = {r["step"]: r["n"] for r in log0 if r["step"] in gap}
    assert set(alone) == set(gap) and set(alone.values()) == {1}, (gap, alone)
    assert [r["step"] for r in log0] == list(range(log0[0]["step"], log0[-1]["step"] + 1))  # never restarted
    # identical state on both groups, shard rank by shard rank
    for rank in (0, 1):
        a, b = _final(tmp_path, 0, rank), _final(tmp_path, 1, rank)
        assert (a["step"], a["position"], a["history"]) == (b["step"], b["position"], b["history"])
        assert a["position"] == a["step"] == log0[-1]["step"] + 1
        assert all(torch.equal(x, y) for x, y in zip(a["shards"], b["shards"]))
        assert _same(a["optim"], b["optim"]), (a["optim"]["state"], b["optim"]["state"])
    # the loss curve's semantics: the weights of a replay of the committed steps
    committed: dict[int, list[int]] = {}
    for r in log0 + log1:
        committed.setdefault(r["step"], []).append(r["group"])
    ref = _replay(_example(), committed)
    full = _final(tmp_path, 0, 0)["full"]
    for k, v in ref.items():
        torch.testing.assert_close(full[k], v, rtol=1e-4, atol=1e-5, msg=k)


def test_stopped_replica_group_is_dropped_after_the_deadline(tmp_path, lighthouse):
    # --wait: the groups start together (without it, on a slow machine group 0 could run its 14 steps alone
    # while group 1 starts up; group 1 then joins at step 14, never reaches its fault and ends cleanly)
    common = ["--steps", "14", "--together", "0", "--wait", "60"]
    p0 = _launch(tmp_path, lighthouse, 0, common, restarts=0)
    p1 = _launch(tmp_path, lighthouse, 1, common + ["--stop-at", "3"], restarts=0)
    try:
        rc0 = _wait(p0, time.monotonic() + 90, tmp_path, 0)
        assert rc0 == 0, _tail(tmp_path, 0)
        assert p1.poll() is None, _tail(tmp_path, 1)  # stopped, not dead
    finally:
        stopped = workers(p1.pid, script=None)  # torchrun starts its workers in sessions of their own: killpg misses them
        try:
            os.killpg(p1.pid, signal.SIGKILL)  # the launcher
        except ProcessLookupError:  # it ended (the assertion above says why)
            pass
        for pid in stopped:  # the stopped workers (left behind, stopped, after the test otherwise)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p1.wait()
    log0, log1 = _log(tmp_path, 0), _log(tmp_path, 1)
    stopped = log1[-1]["step"] + 1  # group 1 stopped in this step, before committing it
    after = [r for r in log0 if r["step"] >= stopped]
    assert after and {r["n"] for r in after} == {1}, after
    before = next(r for r in log0 if r["step"] == stopped - 1)
    stall = after[0]["t"] - before["t"]
    # the collective deadline, then the lighthouse's heartbeat timeout (1 s) and a new quorum
    assert stall < TIMEOUT_S + 8, stall


def test_checkpoint_of_a_replica_group_resumes_exactly(tmp_path, lighthouse):
    """A group's save is the run's checkpoint (with torchft's step); a run resumed from it ends
    bit-identical to the run that went through."""
    import shutil

    args = ["--replicas", "1", "--steps", "6", "--together", "0", "--save-every", "3"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    for out in (whole, resumed):
        out.mkdir()
    p = _launch(whole, lighthouse, 0, args + ["--ckpt", str(whole / "ckpt")], restarts=0)
    assert _wait(p, time.monotonic() + 60, whole, 0) == 0, _tail(whole, 0)
    assert sorted(os.listdir(whole / "ckpt")) == ["step_00000003", "step_00000006"], os.listdir(whole / "ckpt")
    shutil.copytree(whole / "ckpt" / "step_00000003", resumed / "ckpt" / "step_00000003")
    p = _launch(resumed, lighthouse, 0, args + ["--ckpt", str(resumed / "ckpt")], restarts=0)
    assert _wait(p, time.monotonic() + 60, resumed, 0) == 0, _tail(resumed, 0)
    assert [r["step"] for r in _log(resumed, 0)] == [3, 4, 5]
    for rank in (0, 1):
        a, b = _final(whole, 0, rank), _final(resumed, 0, rank)
        assert (a["step"], a["position"], a["history"]) == (b["step"], b["position"], b["history"]) == (6, 6, [1] * 6)
        assert _same(a["shards"], b["shards"]) and _same(a["optim"], b["optim"])


def _misuse(rank, world, lighthouse):
    import yafsdp
    from yafsdp.integrations.torchft import FaultTolerantReplicas, TorchFTError

    ex = _example()
    model = yafsdp.YaFSDP(ex.build_model())
    opt = ex.make_optimizer(model.parameters())
    ft = FaultTolerantReplicas(model, opt, replica_group=0, lighthouse=lighthouse, timeout=5)
    said = []

    def refused(fn):
        try:
            fn()
        except TorchFTError as e:
            said.append(str(e))
            return True
        return False

    x, y = ex.batch(0, 0, rank)
    try:
        assert refused(lambda: FaultTolerantReplicas(model, opt, replica_group=1, lighthouse=lighthouse))
        assert refused(model.sync_grads)  # outside a step: no quorum to all-reduce over
        ft.start_step()
        ex.loss_fn(model(x), y).backward()
        model.clip_grad_norm_(1.0)  # the step's all-reduce ...
        ex.loss_fn(model(x), y).backward()  # ... then one more backward: it would stay local
        assert refused(ft.step)
        assert ft.step_count == 0
        ft.start_step()  # torch's own clipping completes the gradients across groups first, as the engine's does
        ex.loss_fn(model(x), y).backward()
        syncs = ft._sync.stats["syncs"]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert ft._sync.stats["syncs"] == syncs + 1
        assert ft.step() and ft.step_count == 1
    finally:
        ft.shutdown()
    return said


def test_misuse_is_refused(lighthouse):
    """Two managers on one model, gradients read outside a step, a backward after the step's
    all-reduce: each raises, naming what to do; torch's clip_grad_norm_ runs the managed all-reduce."""
    from dist_utils import run_ranks

    said, = run_ranks(_misuse, 1, lighthouse, timeout_s=60)
    assert "one FaultTolerantReplicas per model" in said[0]
    assert "call ft.start_step()" in said[1]
    assert "a backward ran after this step's all-reduce" in said[2]


def _on_a_mesh(rank, world, lighthouse):
    from torch.distributed.device_mesh import init_device_mesh

    import yafsdp
    from yafsdp.integrations.torchft import FaultTolerantReplicas, TorchFTError

    ex = _example()
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = yafsdp.YaFSDP(ex.build_model(), mesh=mesh)
    try:
        FaultTolerantReplicas(model, ex.make_optimizer(model.parameters()), replica_group=0, lighthouse=lighthouse)
    except TorchFTError as e:
        return str(e)
    return None


def test_an_hsdp_model_is_refused(lighthouse):
    """Under torchft the replicate dimension is torchft's: a model already HSDP over a mesh is refused."""
    from dist_utils import run_ranks

    for said in run_ranks(_on_a_mesh, 2, lighthouse, timeout_s=60):
        assert said and "already HSDP over a replicate group of 2 ranks" in said, said
