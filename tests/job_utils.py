"""Launching the main job (examples/pretrain_llama.py) the way users do, and reading what it wrote:
shared by the job's tests (test_pretrain.py, test_job_ops.py, test_examples.py)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys

from dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "examples", "pretrain_llama.py")
FAST = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "2", "--no-progress", "--sample-tokens", "0",
        "--eval-batches", "1"]
# conftest.py's ``hsdp_job_run``: world 4 as 2 replicas x 2 shard ranks, 2 micro-batches a step, saved in the
# background every 2 steps
HSDP_JOB_ARGS = ["--steps", "4", "--save-every", "2", "--hsdp", "2", "--async-save", "--grad-accum", "2"]


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    e.pop("RANK", None)
    return e


def torchrun_cmd(nproc: int, launcher: list[str] | None = None) -> list[str]:
    launcher = launcher if launcher is not None else ["--master-port", str(free_port())]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *launcher, JOB]


def run_job(args: list[str], nproc: int = 2, launcher=None, timeout: int = 240, check: bool = True):
    cmd = torchrun_cmd(nproc, launcher) if nproc else [sys.executable, JOB]
    p = subprocess.run(cmd + FAST + args, capture_output=True, text=True, timeout=timeout, env=env())
    if check and p.returncode != 0:
        raise AssertionError(f"job failed ({p.returncode}): {' '.join(cmd + args)}\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    return p


class Lanes:
    """Independent launch chains of one test module, run side by side in the background while the module's
    tests go on; each test takes its chain's result (or its exception) with :meth:`result`. Two at a time
    by default: a job alone leaves a core idle through torchrun's start and the interpreters' imports (a
    world-2 job of the tiny preset keeps ~70 % of 2 cores busy), two fill it. A module fixture makes
    them and closes them (:meth:`close`) at the module's end."""

    def __init__(self, width: int = 2):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(width)
        self.futures: dict = {}

    def start(self, name: str, fn, *args, **kwargs) -> None:
        self.futures[name] = self.pool.submit(fn, *args, **kwargs)

    def result(self, name: str):
        return self.futures[name].result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def in_lane(body):
    """Test decorator: the test's body (``body(tmp_path)``, needing nothing else of pytest) runs in its module's
    lanes -- started with the bodies of the module's other selected ``in_lane`` tests, side by side, at the first
    of them (the ``lane_runs`` fixture of tests/conftest.py) -- and the test takes its result or failure."""
    def test(lane_runs):
        lane_runs.result(body.__name__)

    # not functools.wraps: pytest would read the body's signature (tmp_path) through __wrapped__
    test.__name__, test.__qualname__, test.__doc__, test.__module__ = (body.__name__, body.__qualname__, body.__doc__,
                                                                      body.__module__)
    test.lane_body = body
    return test


def metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def events(out: str) -> list[dict]:
    with open(os.path.join(out, "events.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(out: str) -> list[float]:
    return [r["loss"] for r in metrics(out)]


def tree_digest(path: str) -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def close(a, b, rel=1e-4):
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


@contextlib.contextmanager
def lighthouse(min_replicas: int = 1):
    """A torchft lighthouse in this process (its address, http://host:port), for the jobs' replica
    groups under --torchft: a quorum waits 1 s for late groups, a group silent for 1 s is dropped."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=1000,
                              heartbeat_timeout_ms=1000)
    try:
        yield server.address()
    finally:
        server.shutdown()


def workers(pid: int, script: str | None = "pretrain_llama.py") -> list[int]:
    """The worker processes of the torchrun agent ``pid`` (its children, read from /proc), those running
    ``script`` only unless it is None; sorted, [] once the agent is gone. torchrun starts its workers in
    sessions of their own, so a kill of the agent's process group does not reach them."""
    kids = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
        except FileNotFoundError:
            pass
    if script is None:
        return sorted(kids)
    out = []
    for k in kids:
        try:
            with open(f"/proc/{k}/cmdline", "rb") as f:
                if script.encode() in f.read():
                    out.append(k)
        except FileNotFoundError:
            pass
    return sorted(out)
