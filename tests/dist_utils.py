"""Run a function on N gloo ranks (CPU) and collect what each rank returns.

Each call starts fresh processes, so tests batch many cases into one call to keep CI fast. They are
forked from a server that has imported torch and transformers once per test session
(multiprocessing's "forkserver" with a preload): a world-2 start takes ~0.3 s instead of the ~6 s of
two interpreters importing both. Each rank gets the caller's environment as it is at the call (a
forkserver's children would otherwise have the server's) and its own torch seed state is whatever
the test sets (as with spawn, nothing is seeded for it). NCCL ranks (the GPU tests) are always new
interpreters: CUDA does not survive a fork after the driver was touched. ``YAFSDP_TEST_START=spawn`` starts every rank
as a new interpreter instead, to rule the server out when a test misbehaves.
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama", "peft"]


def _start_method(backend: str) -> str:
    method = os.environ.get("YAFSDP_TEST_START", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"YAFSDP_TEST_START={method!r}: use 'forkserver' (the default) or 'spawn'")
    if backend == "nccl":  # CUDA ranks start as new interpreters: an import in the server that touched the
        return "spawn"     # driver (a device count) would leave forked children unable to use CUDA
    if method == "forkserver":
        mp.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first call); a missing module is skipped
    return method


def _entry(rank, world, port, fn, args, outdir, backend="gloo", timeout_s=300.0, env=None):
    if env is not None:  # the caller's environment, not the forkserver's
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    result = None
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:  # report to the parent with the traceback
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        if dist.is_initialized():
            _leave_together(rank, world)
            dist.destroy_process_group()
    # Skip interpreter teardown: the result is on disk, and it saves time. (It is no longer needed
    # for the engine's collectives -- [Note: gloo work and interpreter exit] in yafsdp/comm/collectives.py --
    # but a test may have run torch's own gloo collectives, e.g. DCP's, which the exit hook cannot see.)
    os._exit(0)


def _leave_together(rank: int, world: int, wait_s: float = 60.0) -> None:
    """Rank 0 leaves only after every rank has finished its function (or ``wait_s`` passed).

    Rank 0 hosts the TCPStore through which every later group is built (``dist.new_group``
    rendezvous there): a rank 0 done early took the store down while other ranks were still
    building a subgroup among themselves ("Failed to recv, got 0 bytes" in gloo's rendezvous). Each
    rank marks its end with a key in the store and rank 0 waits for every key -- no collective, so a
    test that left its groups broken on purpose (a desync, a hung collective) cannot hang here; a rank
    that never comes back only costs rank 0 the wait, which ``run_ranks``' join spends waiting for
    that rank anyway."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"dist_utils/finished/{rank}", "1")
        if rank == 0:
            store.wait([f"dist_utils/finished/{r}" for r in range(world)], timedelta(seconds=wait_s))
    except Exception:  # a wait timed out, or the store is gone (the function re-initialised the default group)
        pass


def run_ranks(fn, world: int, *args, backend: str = "gloo", timeout_s: float = 300.0):
    """fn(rank, world, *args) on ``world`` ranks (gloo by default; ``timeout_s``: the process
    group's timeout); returns the per-rank results. A rank that raised makes this raise with its
    traceback."""
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _entry, args=(world, free_port(), fn, args, d, backend, timeout_s, dict(os.environ)), nprocs=world,
            join=True, start_method=_start_method(backend),
        )
        results = []
        for r in range(world):
            with open(os.path.join(d, f"rank{r}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(f"rank {r} failed:\n{value}")
            results.append(value)
        return results


def hsdp_groups(replicas: int, shard: int):
    """(shard_group, replicate_group) of this rank for an HSDP engine over ``replicas x shard`` ranks:
    global rank = replica * shard + shard index. Every rank creates every group, in the same order."""
    rank = dist.get_rank()
    mine = {}
    for r in range(replicas):
        g = dist.new_group(list(range(r * shard, (r + 1) * shard)))
        if rank // shard == r:
            mine["shard"] = g
    for s in range(shard):
        g = dist.new_group(list(range(s, replicas * shard, shard)))
        if rank % shard == s:
            mine["replicate"] = g
    return (mine["shard"], mine["replicate"])
