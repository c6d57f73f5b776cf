"""yafsdp.Watchdog in a user's own loop (world 2, gloo): a rank that stops making progress is named with
what each rank was doing, the engine's position (unit, the collective waited for) is in the report, and
an error that one rank publishes reaches the other. ``exit=False``: the processes stay, so the test reads
the verdicts instead of exit statuses (the jobs' exit paths: tests/jobs/test_faults.py)."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from models import tiny_llama

import yafsdp


def _hang_and_error(rank, world):
    torch.manual_seed(0)
    model = yafsdp.YaFSDP(tiny_llama())
    ids = torch.randint(0, 64, (2, 8))
    wd = yafsdp.Watchdog(timeout=2.0, startup_timeout=30.0, poll=0.25, exit=False).start()
    model(input_ids=ids, labels=ids).loss.backward()
    wd.step(1)
    # rank 1 sleeps in its "data" phase; rank 0 goes on into the next forward and waits in a gather
    if rank == 1:
        with wd.phase("data"):
            time.sleep(6.0)
        dist.barrier()  # rank 0's, at last
    else:
        work = dist.barrier(async_op=True)  # rank 0 waits (as in a collective) for rank 1
        with wd.phase("forward"):
            while not work.is_completed():
                time.sleep(0.05)
    report = wd.report
    dist.barrier()
    wd.stop()
    # a second watchdog (a new key prefix: a restarted attempt's would be another) and one rank's error
    wd2 = yafsdp.Watchdog(timeout=30.0, poll=0.2, exit=False, name="second")
    wd2.start()
    if rank == 1:
        stood = wd2.fail("RuntimeError: boom", 1)
        assert stood["rank"] == 1
    deadline = time.monotonic() + 10
    while wd2.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    err = wd2.error
    dist.barrier()
    wd2.stop()
    return report, err


def test_a_sleeping_rank_is_named_and_an_error_reaches_the_other_rank():
    (r0, e0), (r1, e1) = run_ranks(_hang_and_error, 2, timeout_s=120)
    for report in (r0, r1):
        assert report is not None and report["stuck"] == [1], report
        assert "stuck: rank 1 (behind the others)" in report.line, report.line
        assert "rank 1: 1 steps done, data" in report.line, report.line
        assert "rank 0: 1 steps done, forward" in report.line, report.line
    assert 2.0 <= r0["idle_s"] <= 4.0
    for err in (e0, e1):
        assert err["rank"] == 1 and err["message"] == "RuntimeError: boom" and err["exit_code"] == 1


def test_bad_deadlines_are_refused():
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0, got nan"):
        yafsdp.Watchdog(timeout=float("nan"))
    with pytest.raises(ValueError, match="startup_timeout must be"):
        yafsdp.Watchdog(startup_timeout=0)
