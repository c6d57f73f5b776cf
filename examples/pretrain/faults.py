"""What the job does when something goes wrong on one rank: the watchdog's deadlines, one rank's error
reaching every rank, the loss-spike guard, stragglers, and the fault injection its tests use.

[Note: one rank's error]
Errors that every rank finds together (the checks before training, a non-finite step, a failed save)
are agreed on through a collective and printed once by rank 0, as before. An exception that reaches
``main`` on some ranks only (a bad token id in rank 1's batch, a failed read, a bug) would leave the
others blocked in their next collective. So ``main`` first counts the raising ranks in the store for
``RAISED_GRACE_S``: when all of them raised, it is the agreed case above; else the error is
published through the watchdog (``Watchdog.fail``: the run's first error wins), printed once by the
rank that raised it, ``error: rank R (step S, PHASE): ...``, and every process ends with its exit
status (2 bad input, 3 diverged, 1 anything else), the others by their watchdog within its poll.

[Note: fault injection]
``YAFSDP_JOB_FAULT="KIND:RANK:STEP:PHASE[:SECONDS]"`` makes rank RANK, at step STEP (the step being
taken, 1-based; 0: before the first step), on entering PHASE (data, forward, backward, optimizer,
save, export, eval, sample), do KIND: ``stop`` (SIGSTOP itself), ``sleep`` (SECONDS, default an hour),
``raise`` (a RuntimeError), ``exit`` (os._exit(9), as if killed), ``badtoken`` (its next batch holds
an id >= vocab) or ``slow`` (SECONDS of sleep at every entry of PHASE from STEP on: a straggler). It fires in the first attempt of a torchrun worker group only, so a restarted group
runs clean. This is how tests/jobs/test_faults.py injects each fault at one rank in each phase; it
costs one dict lookup per phase mark otherwise.
"""
from __future__ import annotations

import os
import signal
import statistics
import sys
import time
import traceback

import torch

from pretrain import progress as P
from pretrain.ops import JobError
from yafsdp.tools.watchdog import EXIT_HANG, Watchdog
from yafsdp.tools.watchdog import _print as say  # one write per line: ranks share stderr

RAISED_GRACE_S = 5.0  # how long a raising rank waits for the others to raise too (see the Note)


# ---------------------------------------------------------------------------------- the watchdog
def start_watchdog(args, env) -> Watchdog:
    """The job's watchdog, started before anything else can hang (see [Note: the watchdog])."""
    return Watchdog(timeout=args.hang_timeout, startup_timeout=args.init_timeout, rank=env.rank, world=env.world,
                    name="yafsdp").start()


def attach(job, wd: Watchdog) -> None:
    """The job's side of a hang or another rank's error (``wd``'s hooks): an event, the flight
    recorder (NCCL), the lock."""

    def on_hang(report):
        event = dict(event="hang", step=job.step_now(), stuck=report["stuck"], line=report.line, exit_code=EXIT_HANG)
        if job.main and _events_open(job):
            job.outputs.event(event)
        elif _first_responding(report) == job.rank and os.path.isdir(job.args.out):  # rank 0 is the stuck one
            P.Events(os.path.join(job.args.out, "events.jsonl")).write(event)
        dump_flight_recorder(job)
        _release(job)

    def on_error(err):
        if job.main and _events_open(job):
            job.outputs.event(dict(event="error", rank=err.get("rank"), step=err.get("step"),
                                   phase=err.get("phase"), message=err.get("message"),
                                   exit_code=err.get("exit_code")))
        _release(job)

    wd.on_hang, wd.on_error = on_hang, on_error


def _first_responding(report) -> int | None:
    """The lowest rank the report found responding: it writes the run's event where rank 0 cannot."""
    return next((d["rank"] for d in report["ranks"] if d.get("responding") and d["rank"] != 0), None) \
        if 0 in report["stuck"] else None


def _events_open(job) -> bool:
    """events.jsonl is open (rank 0, from ``Job.open_output`` on)."""
    return job.outputs is not None and job.outputs.events is not None


def _release(job) -> None:
    job.run_dir.release()


def dump_flight_recorder(job) -> str | None:
    """NCCL: torch's flight recorder (the last collectives of each group, enabled in
    ``init_distributed``) written to ``--out/flight_recorder/rank_R.pkl``; None elsewhere."""
    if job.env.backend != "nccl":
        return None
    try:
        from torch._C._distributed_c10d import _dump_nccl_trace

        path = os.path.join(job.args.out, "flight_recorder", f"rank_{job.rank}.pkl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(_dump_nccl_trace())
        say(f"yafsdp watchdog (rank {job.rank}): NCCL flight recorder written to {path}")
        return path
    except Exception as e:  # noqa: BLE001 - a missing dump must not keep the process alive
        say(f"yafsdp watchdog (rank {job.rank}): no NCCL flight recorder dump ({type(e).__name__}: {e})")
        return None


# ------------------------------------------------------------------------------ one rank's error
def all_ranks_raised(wd: Watchdog, world: int) -> bool:
    """Count this rank's exception in the store; True when every rank raised within the grace
    period (the agreed case of [Note: one rank's error])."""
    if world == 1:
        return True
    if wd.store is None:
        return False
    try:
        n = wd.store.add("raised", 1)
        deadline = time.monotonic() + RAISED_GRACE_S
        while n < world and time.monotonic() < deadline:
            time.sleep(0.05)
            n = wd.store.add("raised", 0)
        return n >= world
    except Exception:  # noqa: BLE001 - no store: this rank cannot know, so it reports alone
        return False


def report_alone(prog: str, job, wd: Watchdog, e: BaseException) -> int:
    """Publish ``e`` as the run's first error; print it if it is (once, naming this rank, its step and
    phase). Returns the exit status every rank will end with."""
    code = getattr(e, "exit_code", 1)
    if isinstance(e, JobError) or type(e).__name__ in ("DataError", "CheckpointError", "HFCheckpointError"):
        code = getattr(e, "exit_code", 2)
        msg = str(e)
    else:
        msg = f"{type(e).__name__}: {e}"
    step = job.step_now() if job is not None else None
    stood = wd.fail(msg, code)
    if stood.get("rank") == wd.rank:
        if not isinstance(e, JobError) and code == 1:
            traceback.print_exception(e, file=sys.stderr)
        where = f"step {step}, {wd.current_phase}" if step is not None else wd.current_phase
        say(f"{prog}: error: rank {wd.rank} ({where}): {msg}")
    return int(stood.get("exit_code", code))


# ---------------------------------------------------------------------------------- loss spikes
class LossGuard:
    """[Note: loss spikes] A step's loss is a spike when, once ``min_history`` good steps are known,
    it exceeds ``factor`` x the median of the last ``window`` of them, or it is back at the uniform
    guess ln(vocab) while that median is clearly below it (< 0.9 ln V): a model whose weights one
    update ruined often predicts uniformly (loss ln V, a zero gradient) rather than wildly, which no
    factor on the median catches. With ``action`` "skip" (the default) a spike is treated as a
    non-finite step: no optimizer step, counted towards --max-skipped-steps in a row, no checkpoint
    while the streak lasts; "stop" ends the run at once (exit 3); "warn" only says so. The loss is
    the step's mean over every rank, the same on all of them, and the history travels in every
    checkpoint (``recent``), so every rank decides alike, also after a resume. Weights ruined by one
    update show up as a spike at the next step: skipping it keeps the ruin out of the optimizer
    state and out of every checkpoint, and the streak that follows ends the run naming the last good
    checkpoint."""

    def __init__(self, factor: float, window: int = 20, min_history: int = 8, action: str = "skip"):
        self.factor, self.window, self.min_history, self.action = factor, window, min_history, action
        self.recent: list[float] = []
        self.uniform: float | None = None  # ln(vocab), set once the model's vocabulary is known

    def median(self) -> float | None:
        return statistics.median(self.recent) if len(self.recent) >= self.min_history else None

    def spike(self, loss: float) -> str:
        """Why ``loss`` is a spike, or "" when it is not."""
        med = self.median()
        if not self.factor or med is None:
            return ""
        if loss > self.factor * med:
            return f"above {self.factor:g} x the recent median {med:.4g}"
        if self.uniform is not None and med < 0.9 * self.uniform and loss >= 0.995 * self.uniform:
            return f"back at the uniform guess ln(vocab) = {self.uniform:.4g} (recent median {med:.4g})"
        return ""

    def good(self, loss: float) -> None:
        self.recent.append(loss)
        del self.recent[:-self.window]


# ----------------------------------------------------------------------------------- stragglers
class Stragglers:
    """[Note: stragglers] Each step every rank's data wait, compute and communication wait (the
    engine's host waits for collectives) travel in the step's one all-reduce (a slot per rank). A
    rank whose busy time (data + compute) exceeds the median's by ``margin`` (relative) for
    ``patience`` steps in a row is named, once per streak, in the output and events.jsonl."""

    def __init__(self, world: int, margin: float = 0.25, patience: int = 5, min_s: float = 0.002):
        self.world, self.margin, self.patience, self.min_s = world, margin, patience, min_s
        self.streak = [0] * world

    @staticmethod
    def median(busy: list[float]) -> float:
        return statistics.median(busy)

    def columns(self, timing: list) -> dict:
        """The metrics row's timing columns of every rank's (data, compute, comm wait) seconds: per
        rank up to 64 ranks, the slowest and the median beyond."""
        if self.world <= 64:
            return dict(rank_data_s=[round(d, 4) for d, _, _ in timing],
                        rank_compute_s=[round(c, 4) for _, c, _ in timing],
                        rank_comm_wait_s=[round(w, 4) for _, _, w in timing])
        busy = [d + c for d, c, _ in timing]
        slow = max(range(self.world), key=busy.__getitem__)
        return dict(slowest_rank=slow, slowest_busy_s=round(busy[slow], 4), median_busy_s=round(self.median(busy), 4))

    def check(self, busy: list[float]) -> list[int]:
        """The ranks that have just become stragglers (their streak reached ``patience``)."""
        if self.world < 2:
            return []
        med = self.median(busy)
        named = []
        for r, b in enumerate(busy):
            if b > med * (1 + self.margin) and b - med > self.min_s:
                self.streak[r] += 1
                if self.streak[r] == self.patience:
                    named.append(r)
            else:
                self.streak[r] = 0
        return named


# ------------------------------------------------------------------------------- fault injection
class Faults:
    """See [Note: fault injection]."""

    def __init__(self, spec: str | None, rank: int, restart: int):
        self.plan = None
        self.bad_token = False
        if not spec or restart:
            return
        parts = spec.split(":")
        if len(parts) not in (4, 5):
            raise JobError(f"YAFSDP_JOB_FAULT={spec!r}: expected KIND:RANK:STEP:PHASE[:SECONDS]")
        kind, r, step, phase = parts[:4]
        if int(r) == rank:
            self.plan = dict(kind=kind, step=int(step), phase=phase,
                             seconds=float(parts[4]) if len(parts) == 5 else 3600.0)

    def at(self, step: int, phase: str) -> None:
        p = self.plan
        if p is None or p["phase"] != phase or step < p["step"]:
            return
        if p["kind"] == "slow":  # every step from then on
            time.sleep(p["seconds"])
            return
        if step != p["step"]:
            return
        self.plan = None  # once
        kind = p["kind"]
        say(f"fault injection: rank {os.environ.get('RANK', '0')} {kind} at step {step}, {phase}")
        if kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "sleep":
            time.sleep(p["seconds"])
        elif kind == "raise":
            raise RuntimeError(f"injected fault at step {step}, {phase}")
        elif kind == "exit":
            os._exit(9)
        elif kind == "badtoken":
            self.bad_token = True
        else:
            raise JobError(f"YAFSDP_JOB_FAULT: unknown kind {kind!r} (stop, sleep, raise, exit, badtoken, slow)")

    def corrupt(self, x: torch.Tensor, vocab: int) -> torch.Tensor:
        if self.bad_token:
            self.bad_token = False
            x = x.clone()
            x.view(-1)[-1] = vocab + 7
        return x
