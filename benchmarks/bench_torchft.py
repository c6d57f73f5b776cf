"""HSDP under torchft on the CPU: the per-step cost of the managed all-reduce against plain HSDP, and
what one lost replica group costs against a whole-job restart.

    python benchmarks/bench_torchft.py [--steps 300]

World 4 on gloo, the MLP of examples/torchft_hsdp.py: (a) plain HSDP, one torchrun, a (2, 2) mesh;
(b) two replica groups under torchft (two torchruns, one lighthouse), no fault; (c) the same with
one group SIGKILLed after 100 steps committed by both groups, restarted by its torchrun. Prints the median step
time of (a) and (b), and from (c): the survivor's stall (its last step with both groups to its
first committed step without), steps the survivor did not commit, and the killed group's time to
rejoin (kill to its first committed step after the restart, which the survivor spent training).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("RUST_LOG", "warn")  # before torchft's import: the lighthouse (in this process) logs every quorum
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "torchft_hsdp.py")


def _env(extra=None):
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
             RUST_LOG="warn")
    e.pop("RANK", None)
    e.update(extra or {})
    return e


def _port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain_worker(steps: int, out: str) -> None:
    """One rank of plain HSDP (a (2, 2) mesh): the example's model, data and step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, os.path.dirname(EXAMPLE))
    import torchft_hsdp as ex
    import yafsdp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = yafsdp.YaFSDP(ex.build_model(), mesh=mesh)
    opt = ex.make_optimizer(model.parameters())
    times = []
    for step in range(steps):
        t = time.perf_counter()
        x, y = ex.batch(step, rank // 2, rank % 2)
        ex.loss_fn(model(x), y).backward()
        model.clip_grad_norm_(ex.MAX_NORM)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.barrier()
    del model, opt
    dist.destroy_process_group()


def run_plain(steps: int, d: str) -> list[float]:
    out = os.path.join(d, "plain.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(_port()),
           __file__, "--plain-worker", "--steps", str(steps), "--out", out]
    subprocess.run(cmd, check=True, env=_env(), capture_output=True)
    with open(out) as f:
        return json.load(f)


def run_ft(steps: int, d: str, die_at: int | None) -> tuple[list[dict], list[dict]]:
    from torchft._torchft import LighthouseServer

    lh = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
    procs = []
    try:
        for g in (0, 1):
            args = ["--replica-group", str(g), "--out", d, "--steps", str(steps), "--together", "3", "--timeout", "3"]
            if g == 1 and die_at is not None:
                args += ["--die-at", str(die_at)]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(_port()), "--max-restarts", "1", EXAMPLE, *args]
            procs.append(subprocess.Popen(cmd, env=_env({"TORCHFT_LIGHTHOUSE": lh.address()}),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"a replica group failed ({p.returncode}); rerun to see its output")
    finally:
        lh.shutdown()
    logs = []
    for g in (0, 1):
        with open(os.path.join(d, f"log_g{g}.jsonl")) as f:
            logs.append([json.loads(line) for line in f])
    return logs[0], logs[1]


def _step_times(log: list[dict], n: int) -> list[float]:
    """Times between consecutive committed steps that both had ``n`` groups."""
    return [b["t"] - a["t"] for a, b in zip(log, log[1:]) if a["n"] == b["n"] == n and b["step"] == a["step"] + 1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--plain-worker", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.plain_worker:
        return plain_worker(args.steps, args.out)
    with tempfile.TemporaryDirectory() as d:
        plain = run_plain(args.steps, d)[10:]
    with tempfile.TemporaryDirectory() as d:
        log0, _ = run_ft(args.steps, d, None)
    ft2 = _step_times(log0, 2)
    with tempfile.TemporaryDirectory() as d:
        log0, log1 = run_ft(args.steps, d, 100)
    ft1 = _step_times(log0, 1)
    last1 = next(i for i in range(len(log1) - 1) if log1[i + 1]["step"] != log1[i]["step"] + 1)
    killed_after = log1[last1]  # the killed group's last commit before the kill
    back = log1[last1 + 1]  # its first commit after the restart
    before = next(r for r in log0 if r["step"] == killed_after["step"])
    alone = [r for r in log0 if killed_after["step"] < r["step"] < back["step"]]
    med = statistics.median
    print(f"plain HSDP (2, 2) mesh:          {1e3 * med(plain):7.2f} ms/step (median of {len(plain)})")
    print(f"torchft, 2 groups x 2:           {1e3 * med(ft2):7.2f} ms/step (median of {len(ft2)})")
    print(f"torchft, survivor alone (1 x 2): {1e3 * med(ft1):7.2f} ms/step (median of {len(ft1)})")
    print(f"survivor stall at the kill:      {alone[0]['t'] - before['t']:7.2f} s "
          f"(its last step with both groups to its first alone; 1 step run again)")
    print(f"killed group back after:         {back['t'] - before['t']:7.2f} s "
          f"({len(alone)} steps committed by the survivor alone meanwhile)")


if __name__ == "__main__":
    main()
