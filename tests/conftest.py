"""Shared test set-up.

What spawned ranks need must be importable by name in a fresh process, so the helpers live in
modules beside this file: ``dist_utils`` (spawning gloo/NCCL ranks), ``models`` (small models with
uneven sizes, deterministic batches), ``parity`` (the training-parity harness), ``job_utils``
(launching the main job and reading its files). ``tests/`` and ``examples/`` are on pytest's
``pythonpath`` (pyproject.toml); nothing edits ``sys.path``. The fixtures below hand the same
helpers to tests that run in the pytest process.
"""
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
