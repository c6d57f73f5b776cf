"""The pretraining job's replica groups under torchft (--torchft; [Note: the job under torchft] in
examples/pretrain/torchft_groups.py).

World 4 on gloo: two replica groups of two ranks, each its own torchrun and --out, one lighthouse
(in this process). Without failures the groups train bit for bit as the --hsdp 2 run over the same
four ranks. A group that fails: group 1 stops (SIGSTOP) inside step K (so group 0's all-reduce of that step
times out: the step is not committed and group 0 takes it again alone), then both its workers are
SIGKILLed; group 0 goes on alone, torchrun restarts group 1, which resumes from its own checkpoint,
takes the live state from group 0 and rejoins; a stop signal to group 0 stops both at one step,
and the two groups' final checkpoints hold the same job state.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import pytest
import torch

from job_utils import FAST, env, lighthouse, metrics, torchrun_cmd
from dist_utils import free_port

os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse (Rust, in this process) logs every quorum at info
pytest.importorskip("torchft")

TIMEOUT_S = 3  # --torchft-timeout of these runs: the all-reduce across groups and the commit
GLOBAL_BATCH = 8  # FAST: 2 sequences x 2 ranks x 2 groups
GROUP_TOKENS = 2 * 2 * 32  # one group's tokens per step (FAST: --batch-size 2, --seq-len 32)


def _launch(out, address: str, group: int, args: list[str], restarts: int = 0, fault: str | None = None):
    """Replica group ``group`` of 2 ranks: its own torchrun (``restarts``: --max-restarts), its own --out."""
    e = env()
    e["TORCHFT_LIGHTHOUSE"] = address
    e["RUST_LOG"] = "warn"  # torchft's Rust side logs every quorum at info
    if fault:
        e["YAFSDP_JOB_FAULT"] = fault
    cmd = torchrun_cmd(2, ["--master-port", str(free_port()), "--max-restarts", str(restarts)]) + FAST + [
        "--torchft", "--replica-group", str(group), "--replica-groups", "2", "--torchft-timeout", str(TIMEOUT_S),
        "--out", str(out), *args]
    log = open(f"{out}.txt", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=e, start_new_session=True)


def _wait(p, deadline: float, out) -> int:
    try:
        return p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise AssertionError(f"{out} did not finish in time:\n{_tail(out)}") from None


def _tail(out) -> str:
    with open(f"{out}.txt") as f:
        return f.read()[-5000:]


def _rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _poll(what: str, until, deadline: float, *procs):
    """Wait until ``until()`` is true (None: a launched process ended first, or time ran out)."""
    while time.monotonic() < deadline:
        got = until()
        if got:
            return got
        for p, out in procs:
            if p.poll() is not None:
                raise AssertionError(f"{out} ended ({p.returncode}) while waiting for {what}:\n{_tail(out)}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}:\n" + "\n---\n".join(_tail(out) for _, out in procs))


def _workers(p) -> dict[int, int]:
    """{rank: pid} of the workers of torchrun ``p``."""
    import psutil

    found = {}
    for c in psutil.Process(p.pid).children(recursive=True):
        try:
            rank = c.environ().get("RANK")
        except psutil.Error:
            continue
        if rank is not None:
            found[int(rank)] = c.pid
    return found


def _checkpoint(out) -> dict:
    """Everything in ``out``'s newest checkpoint, read in this process (tensors, the job's state,
    each rank's RNG state)."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from yafsdp.checkpoint import latest_checkpoint
    from yafsdp.checkpoint.safe import SafeReader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        return _load_state_dict_from_keys(storage_reader=SafeReader(latest_checkpoint(os.path.join(out, "checkpoints"))))


def _same(a, b, where="") -> None:
    """Equal nested values, tensors bit for bit (names the first difference)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        assert torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _without_elapsed(ck: dict) -> dict:
    return {**ck, "state": {k: v for k, v in ck["state"].items() if k != "elapsed"}}


def test_replica_groups_train_as_the_hsdp_run(hsdp_job_run, tmp_path):
    """No failure: both groups (the first step waits for both: --torchft-wait) log the losses of
    the --hsdp 2 run over the same 4 ranks (conftest.py's ``hsdp_job_run``, shared with
    test_pretrain.py; its saves every 2 steps change nothing a step computes; 2 micro-batches a step:
    the groups' all-reduce follows the step's last backward), and end with its weights, optimizer
    state and data position, bit for bit."""
    args = ["--steps", "4", "--save-every", "0", "--grad-accum", "2"]
    with lighthouse() as address:
        groups = [(_launch(tmp_path / f"g{g}", address, g, args), tmp_path / f"g{g}") for g in (0, 1)]
        hsdp = hsdp_job_run["out"]
        deadline = time.monotonic() + 240
        for p, out in groups:
            assert _wait(p, deadline, out) == 0, _tail(out)
    ref = metrics(hsdp)
    ref_ck = _without_elapsed(_checkpoint(hsdp))
    for _, out in groups:
        rows = metrics(out)
        assert [r["loss"] for r in rows] == [r["loss"] for r in ref], (rows, ref)
        assert [(r["tokens"], r["replicas"]) for r in rows] == [(r["tokens"], 2) for r in ref]
        ck = _without_elapsed(_checkpoint(out))
        assert ck["state"].pop("torchft") == {"manager": {"step": 4, "batches_committed": 8}}
        for k in ref_ck:
            if k.startswith("rank_state.") and k not in ck:
                continue  # the hsdp run's ranks 2 and 3: group 1's ranks 0 and 1
            _same(ck[k], ref_ck[k], k)


def test_killed_replica_group_rejoins_with_the_job_state(tmp_path):
    """Group 1 stops (SIGSTOP) in step K (group 0's all-reduce of it times out: not committed, taken again
    alone), is SIGKILLed, restarts, resumes from its checkpoint, takes the live job state from group
    0 and rejoins; a stop signal to group 0 stops both at one step, with identical state."""
    from pretrain.args import lr_at, parse_args

    k = random.Random(os.getpid()).randint(3, 5)
    args = ["--steps", "3000", "--save-every", "2", "--keep", "2"]
    out0, out1 = tmp_path / "g0", tmp_path / "g1"
    deadline = time.monotonic() + 300
    with lighthouse() as address:
        p0 = _launch(out0, address, 0, args)
        p1 = _launch(out1, address, 1, args, restarts=1, fault=f"stop:0:{k}:optimizer")
        both = [(p0, out0), (p1, out1)]
        try:
            _poll(f"group 0 not committing step {k}", lambda: any(
                e["event"] == "uncommitted" for e in _rows(out0 / "events.jsonl")), deadline, *both)
            hung = _workers(p1)
            assert sorted(hung) == [0, 1], hung
            for pid in hung.values():
                os.kill(pid, signal.SIGKILL)

            def rejoined():
                ev = _rows(out1 / "events.jsonl")
                again = next((i for i, e in enumerate(ev) if e.get("restart") == 1), None)
                back = [e for e in ev[again or 0:] if e["event"] == "recovered"] if again is not None else []
                return back and [r for r in _rows(out1 / "metrics.jsonl")
                                 if r["step"] > back[-1]["step"] + 1 and r["replicas"] == 2]
            _poll("group 1 to rejoin", rejoined, deadline, *both)
            os.kill(_workers(p0)[0], signal.SIGTERM)  # a stop signal on one rank of one group
            assert _wait(p0, deadline, out0) == 0, _tail(out0)
            assert _wait(p1, deadline, out1) == 0, _tail(out1)
        finally:
            for p, _ in both:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    rows0, rows1 = metrics(out0), metrics(out1)
    ev0, ev1 = _rows(out0 / "events.jsonl"), _rows(out1 / "events.jsonl")
    steps = [r["step"] for r in rows0]
    last = steps[-1]
    # group 0 never restarted; step K was taken twice (not committed, then alone) but counted once
    assert steps == list(range(1, last + 1)), steps
    assert [e["step"] for e in ev0 if e["event"] == "uncommitted"][:1] == [k], ev0
    assert {r["replicas"] for r in rows0[:k - 1]} == {2} and rows0[k - 1]["replicas"] == 1, rows0[:k + 1]
    alone = [r["step"] for r in rows0 if r["replicas"] == 1]
    assert alone == list(range(k, alone[-1] + 1)) and rows0[-1]["replicas"] == 2, alone
    # the learning-rate schedule and the token count follow the committed steps only
    job_args = parse_args(FAST + args)
    assert [r["lr"] for r in rows0] == [lr_at(job_args, s) for s in steps]
    tokens = 0
    for r in rows0:
        tokens += GROUP_TOKENS * r["replicas"]
        assert r["tokens"] == tokens, r
    # group 1: restarted, resumed from its own checkpoint, then took the live state and trained on
    starts = [e for e in ev1 if e["event"] in ("start", "resume")]
    assert [e["restart"] for e in starts] == [0, 1] and starts[1]["event"] == "resume", starts
    back = [e for e in ev1 if e["event"] == "recovered"][-1]
    assert back["was"] == starts[1]["step"] < back["step"], (starts, back)
    same = ("step", "loss", "lr", "grad_norm", "tokens", "epoch", "replicas")
    after = [{x: r[x] for x in same} for r in rows1 if r["step"] > back["step"]]
    assert after and after == [{x: rows0[r["step"] - 1][x] for x in same} for r in after], after
    # both stopped at one step, with the same weights, optimizer, job state and RNG states
    ck0, ck1 = _checkpoint(out0), _checkpoint(out1)
    _same(_without_elapsed(ck0), _without_elapsed(ck1))
    st = ck0["state"]
    assert (st["step"], st["cursor"], st["tokens"]) == (last, last * GLOBAL_BATCH, tokens), st
    assert st["loss_history"] == [r["loss"] for r in rows0 if not r.get("skipped")][-20:]
    assert st["torchft"]["manager"]["step"] == last


def test_torchft_flags_are_checked(monkeypatch, capsys):
    """The group flags without --torchft, --torchft without them, a group out of range, --hsdp with
    it, no lighthouse: each refused in one line naming what to do."""
    from pretrain.args import parse_args

    def refused(argv):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2
        return capsys.readouterr().err

    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    assert "is a flag of --torchft runs" in refused(["--replica-group", "0"])
    assert "needs --replica-group G and --replica-groups R" in refused(["--torchft", "--replica-groups", "2"])
    assert "must be in 0 .. --replica-groups - 1 = 1, got 2" in refused(
        ["--torchft", "--replica-group", "2", "--replica-groups", "2"])
    assert "drop --hsdp and launch one torchrun per replica group" in refused(
        ["--torchft", "--replica-group", "0", "--replica-groups", "2", "--hsdp", "2"])
    args = parse_args(["--torchft", "--replica-group", "1", "--replica-groups", "2"])
    assert (args.torchft, args.replica_group, args.replica_groups) == (True, 1, 2)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE")
    assert "TORCHFT_LIGHTHOUSE is not set" in refused(["--torchft", "--replica-group", "0", "--replica-groups", "2"])


class _OtherGroup:
    """A stand-in for ReplicaGroups: one other group of the quorum whose sums are ``theirs``."""

    def __init__(self, theirs):
        self.theirs, self.participants = torch.tensor(theirs), 2

    def agree(self, stats):
        stats += self.theirs
        return self.participants * 1


def _verdicts(rank, world):
    from pretrain import faults as F
    from pretrain.job import agree_on_step
    from pretrain.ops import StopSignal

    out = []
    for theirs in ([3.0, 0.0, 0.0], [3.0, 0.0, 1.0], [3.0, 1.0, 0.0], [40.0, 0.0, 0.0]):
        guard = F.LossGuard(3.0)
        guard.recent = [2.0] * 8
        o = agree_on_step(torch.tensor(2.0), 1.5, StopSignal(), world, torch.device("cpu"), guard=guard,
                          groups=_OtherGroup(theirs))
        out.append((o.loss, bool(o.skipped), o.stop, bool(o.spike), o.replicas, len(guard.recent)))
    return out


def test_a_steps_verdicts_are_the_quorums():
    """agree_on_step under --torchft: the loss is the mean over the quorum's ranks; another group's
    NaN/inf, stop signal or spiking loss decides this group's step alike; the loss guard is not told
    of the loss (the job does so once the quorum commits)."""
    from dist_utils import run_ranks

    (got,) = run_ranks(_verdicts, 1, timeout_s=60)
    assert got == [(2.5, False, False, False, 2, 8),   # (2 + 3) / 2 ranks
                   (2.5, True, False, False, 2, 8),    # the other group's NaN/inf: skipped here too
                   (2.5, False, True, False, 2, 8),    # its stop signal stops this group too
                   (21.0, True, False, True, 2, 8)]    # a spike of the quorum's mean loss: skipped alike
