"""Operations: the distributed environment, agreement on errors, and stop signals."""
from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from yafsdp.dist import raise_if_any


class JobError(RuntimeError):
    """Bad input or state the user must fix; printed without a traceback, exit status 2."""


@dataclass
class Env:
    rank: int
    world: int
    local_rank: int
    local_world: int
    nodes: int
    device: torch.device
    backend: str
    restart_count: int  # torchrun --max-restarts: how many times this worker group was restarted


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_arg: str) -> Env:
    """torchrun's environment (env://), or a world of one when started with plain ``python``."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if device_arg == "auto":
        device_arg = "cuda" if torch.cuda.is_available() else "cpu"
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    kw = {}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # [Note: one store per attempt] torchrun's default (static) rendezvous keeps one TCPStore for
        # all restarts of the worker group, so a restarted group could read the dead group's
        # connection keys (gloo: "connectFullMesh ... Connection refused"). A prefix per attempt
        # keeps the attempts apart; with the c10d rendezvous it is harmless.
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                             timeout=dist.constants.default_pg_timeout)
        kw = dict(store=dist.PrefixStore(f"yafsdp_job/attempt_{restart}", base), rank=rank, world_size=world)
    if device_arg == "cuda":
        if not torch.cuda.is_available():
            raise JobError("--device cuda: no CUDA device is available (torch "
                           f"{torch.__version__}, CUDA build: {torch.version.cuda})")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
        dist.init_process_group(backend, device_id=device, **kw)
    else:
        device = torch.device("cpu")
        backend = "gloo"
        dist.init_process_group(backend, **kw)
    return Env(rank, world, local_rank, local_world, max(1, world // max(1, local_world)), device, backend, restart)


def agree(error: str | None) -> None:
    """Collective: if any rank found a problem, every rank raises the first one (rank order), so
    all ranks stop together with the same message instead of some hanging in a collective."""
    raise_if_any(error, None, JobError)


class StopSignal:
    """SIGTERM/SIGINT -> a flag the training loop checks after each step (then: checkpoint, clean
    exit). Launchers often deliver the signal twice (torchrun forwards the one it got; SLURM signals
    every process); repeats within ``grace_s`` are ignored, a later one stops at once."""

    def __init__(self, grace_s: float = 10.0):
        self.signum: int | None = None
        self.first = 0.0
        self.grace_s = grace_s
        self._old = {}

    def install(self) -> "StopSignal":
        for s in (signal.SIGTERM, signal.SIGINT):
            self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):  # noqa: ARG002
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.first = signum, now
        elif now - self.first > self.grace_s:  # asked again, later: give up at once
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def uninstall(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
