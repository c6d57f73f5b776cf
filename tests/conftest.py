"""Shared test set-up.

What spawned ranks need must be importable by name in a fresh process, so the helpers live in
modules beside this file: ``dist_utils`` (spawning gloo/NCCL ranks), ``models`` (small models with
uneven sizes, deterministic batches), ``parity`` (the training-parity harness), ``job_utils``
(launching the main job and reading its files). ``tests/`` and ``examples/`` are on pytest's
``pythonpath`` (pyproject.toml); nothing edits ``sys.path``. The fixtures below hand the same
helpers to tests that run in the pytest process.
"""
import os
import resource
import time

import pytest
import torch

import dist_utils
import models


def pytest_report_header(config):
    import yafsdp.kernels as k

    return [f"torch {torch.__version__}; {k.describe()}"]


@pytest.fixture
def run_ranks():
    """``run_ranks(fn, world, *args, backend="gloo")``: fn(rank, world, *args) on spawned ranks."""
    return dist_utils.run_ranks


@pytest.fixture
def tiny_llama():
    """A factory of small HF Llama models (``tiny_llama(tie=False, layers=3, seed=0, ...)``)."""
    return models.tiny_llama


@pytest.fixture(scope="session")
def hsdp_job_run(tmp_path_factory):
    """The pretraining job at world 4 as ``--hsdp 2`` (2 replicas x 2 shard ranks), 4 steps of 2 micro-batches,
    saved every 2 steps in the background (``--async-save``): one run read by three files --
    test_pretrain.py resumes it, test_torchft_job.py's replica groups must train as it does (saving
    changes nothing a step computes), test_hsdp.py's full sharding over the same 4 ranks must train
    like it. Tests only read its folder (``out``); ``stdout`` is the job's."""
    from job_utils import HSDP_JOB_ARGS, run_job

    out = str(tmp_path_factory.mktemp("hsdp_job") / "run")
    p = run_job(HSDP_JOB_ARGS + ["--out", out], 4)
    return dict(out=out, stdout=p.stdout)


@pytest.fixture(scope="module")
def lane_runs(request, tmp_path_factory):
    """The bodies of this module's selected ``job_utils.in_lane`` tests, in the module's order, two at a time
    (``job_utils.Lanes``), each with a folder of its own; closed at the module's end."""
    from job_utils import Lanes

    selected = {item.originalname for item in request.session.items}
    lanes = Lanes()
    for name, test in vars(request.module).items():
        if name in selected and hasattr(test, "lane_body"):
            lanes.start(name, test.lane_body, tmp_path_factory.mktemp(name.removeprefix("test_")[:30]))
    yield lanes
    lanes.close()


# ------------------------------------------------------------------ where the suite's time goes
# YAFSDP_TEST_CPU=1: at the end, each test module's wall time beside the CPU time spent in it (this
# process and the children it waited for: job launches, benchmark runs), busiest first. A module far
# below 2 CPU-s per wall-s on a 2-core machine leaves a core idle (start-up, deadlines, sleeps); one
# near it can only get faster by doing less. Ranks started through the forkserver (tests/multirank's
# run_ranks) are the server's children, not this process's: their CPU is not counted there (~0).
# See docs/testing.md.
_CPU: dict = {}


def _cpu_now() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not os.environ.get("YAFSDP_TEST_CPU"):
        return (yield)
    w0, c0 = time.monotonic(), _cpu_now()
    try:
        return (yield)
    finally:
        row = _CPU.setdefault(item.nodeid.split("::")[0], [0.0, 0.0])
        row[0] += time.monotonic() - w0
        row[1] += _cpu_now() - c0


def pytest_terminal_summary(terminalreporter):
    if not _CPU:
        return
    tr = terminalreporter
    tr.section("wall and CPU seconds by module (YAFSDP_TEST_CPU)")
    wall, cpu = sum(w for w, _ in _CPU.values()), sum(c for _, c in _CPU.values())
    for mod, (w, c) in sorted(_CPU.items(), key=lambda kv: -kv[1][0])[:40]:
        tr.write_line(f"{w:8.1f} s wall {c:8.1f} s CPU  {c / max(w, 1e-9):4.2f} CPU/wall  {mod}")
    tr.write_line(f"{wall:8.1f} s wall {cpu:8.1f} s CPU  {cpu / max(wall, 1e-9):4.2f} CPU/wall  all {len(_CPU)} modules")
