"""Operations: the distributed environment (start, the HSDP mesh, teardown before exit, the exit itself),
agreement on errors, and stop signals."""
from __future__ import annotations

import fcntl
import gc
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from yafsdp.comm.groups import raise_if_any


class JobError(RuntimeError):
    """Bad input or state the user must fix; printed without a traceback (rank 0), exit status 2."""

    exit_code = 2


class Diverged(JobError):
    """Training produced non-finite losses, gradients or weights; exit status 3."""

    exit_code = 3


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


ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_launch_env(environ=os.environ) -> None:
    """A launcher that sets some of torch's env:// variables but not all of them gets one line
    naming the missing ones (torch's own error is a traceback about the store)."""
    given = [k for k in ENV_VARS if environ.get(k)]
    if given and len(given) < len(ENV_VARS):
        missing = [k for k in ENV_VARS if not environ.get(k)]
        raise JobError(f"the environment sets {', '.join(f'{k}={environ[k]}' for k in given)} but not "
                       f"{', '.join(missing)}: launch with torchrun (it sets all four), set every one of "
                       f"{', '.join(ENV_VARS)}, or unset {', '.join(given)} for a world of one")
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        v = environ.get(k)
        if v is not None and not v.strip().isdigit():
            raise JobError(f"the environment sets {k}={v!r}: a non-negative integer is needed")
    if given and int(environ["RANK"]) >= int(environ["WORLD_SIZE"]):
        raise JobError(f"the environment sets RANK={environ['RANK']} but WORLD_SIZE={environ['WORLD_SIZE']}: "
                       "RANK must be below WORLD_SIZE")


def init_distributed(device_arg: str, init_timeout: float = 600.0) -> Env:
    """torchrun's environment (env://), or a world of one when started with plain ``python``.
    ``init_timeout``: the process group's timeout (start-up and any collective the watchdog does
    not end first; see [Note: the watchdog] in yafsdp/tools/watchdog.py)."""
    check_launch_env()
    timeout = timedelta(seconds=init_timeout)
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
                             timeout=timeout)
        kw = dict(store=dist.PrefixStore(f"yafsdp_job/attempt_{restart}", base), rank=rank, world_size=world)
    if device_arg == "cuda":
        if not torch.cuda.is_available():
            raise JobError("--device cuda: no CUDA device is available (torch "
                           f"{torch.__version__}, CUDA build: {torch.version.cuda})")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
        # torch's flight recorder: the last collectives of each group, dumped by the watchdog on a hang
        # (examples/pretrain/faults.py) and by NCCL's own watchdog on its timeout.
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        dist.init_process_group(backend, device_id=device, timeout=timeout, **kw)
    else:
        device = torch.device("cpu")
        backend = "gloo"
        dist.init_process_group(backend, timeout=timeout, **kw)
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


class OutLock:
    """An exclusive lock on ``--out``, held by rank 0 for the whole job: a second job on the same
    directory is refused instead of interleaving its metrics and checkpoints with the first's. It
    is taken before the job looks at --out at all (a new --out is made for it), so the decision
    between a fresh start and a resume is made by the holder only (see examples/pretrain/rundir.py).

    ``flock`` on ``<out>/.lock``: the kernel releases it when the process ends, however it ends
    (exception, SIGTERM, SIGKILL). The file names the holder (pid, host, start time) and is removed
    on a clean exit; one left by a killed job is *stale* -- its lock was released with the process
    -- and is taken over with a note. Where the filesystem does not enforce flock across hosts the
    file still names the holder; a holder on this host whose pid still runs is refused too."""

    NAME = ".lock"

    def __init__(self, out: str):
        self.out = out
        self.path = os.path.join(out, self.NAME)
        self.fd: int | None = None
        self.note: str | None = None  # "took over a stale lock ..." when it did
        self.created = False  # acquire made --out: release removes it again if the job left it empty
        self.me = dict(pid=os.getpid(), host=socket.gethostname(), started=time.strftime("%Y-%m-%dT%H:%M:%S"))

    @staticmethod
    def _describe(holder: dict) -> str:
        return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"

    def _read(self, fd: int) -> dict:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            return json.loads(os.read(fd, 4096).decode() or "{}")
        except (OSError, ValueError):
            return {}

    def _holder(self, fd: int, wait_s: float = 2.0) -> dict:
        """The locked file's holder. The holder writes its name right after it took the lock, so a
        job refused in between reads an empty file (or the stale name of a killed job, not yet
        overwritten): read again for up to ``wait_s`` until it names a live job (on this host) or
        another host's. Seen with two jobs started at once on a new --out ("pid ? on host ?")."""
        deadline = time.monotonic() + wait_s
        while True:
            holder = self._read(fd)
            pid = holder.get("pid")
            if pid is not None and (holder.get("host") != self.me["host"] or _pid_alive(int(pid))):
                return holder
            if time.monotonic() >= deadline:
                return holder
            time.sleep(0.02)

    def acquire(self) -> None:
        """Take the lock or raise JobError naming the holder (pid/host) and the lock file."""
        try:
            while True:
                if not os.path.isdir(self.out):  # (again after a refused job removed the one it made)
                    os.makedirs(self.out, exist_ok=True)
                    self.created = True
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = self._holder(fd)
                    os.close(fd)
                    raise JobError(f"--out {self.out!r} is in use by another job ({self._describe(holder)}; lock "
                                   f"file {self.path!r}); wait for it to end or choose another --out") from None
                try:  # the holder may have removed the file between our open and flock: lock the new one
                    same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)
            holder = self._read(fd)
            if holder.get("pid") is not None and holder != self.me:
                alive = holder.get("host") == self.me["host"] and _pid_alive(int(holder["pid"]))
                if alive and int(holder["pid"]) != os.getpid():
                    os.close(fd)
                    raise JobError(f"--out {self.out!r} is in use by another job ({self._describe(holder)}; lock "
                                   f"file {self.path!r}; this filesystem does not enforce the lock, the pid runs); "
                                   "wait for it to end or choose another --out")
                self.note = (f"took over the stale lock {self.path!r} of {self._describe(holder)}: that job ended "
                             "without releasing it (killed?)")
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, json.dumps(self.me).encode())
            os.fsync(fd)
            self.fd = fd
        except OSError as e:
            raise JobError(f"--out {self.out!r}: cannot create the lock file {self.path!r}: "
                           f"[Errno {e.errno}] {e.strerror}: {e.filename!r}") from None

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if self._read(self.fd) == self.me:
                os.unlink(self.path)  # while still locked: a waiting job then locks a fresh file
        except OSError:
            pass
        os.close(self.fd)  # releases the flock
        self.fd = None
        if self.created:  # a job refused before writing anything leaves no empty --out behind
            try:
                os.rmdir(self.out)  # only if empty (another job may have locked it meanwhile)
            except OSError:
                pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def hsdp_mesh(replicas: int, world: int, device: torch.device) -> dict:
    """YaFSDP's mesh argument for ``--hsdp R``: a (R, world / R) mesh named ('replicate', 'shard')
    (torchrun numbers the ranks node by node, so with R = nodes each replica is one node); none for R = 1."""
    if replicas == 1:
        return {}
    from torch.distributed.device_mesh import init_device_mesh

    return dict(mesh=init_device_mesh(device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")))


def shutdown_distributed() -> None:
    """Destroy the process group *and* its backend before the interpreter exits.

    [Note: teardown before exit] A gloo worker thread that drops the last C++ reference of a
    tensor while the interpreter finalizes aborts the process ("terminate called without an
    active exception", SIGABRT, after all the work was done; see [Note: gloo work and interpreter
    exit] in yafsdp/comm/collectives.py for the mechanism and the engine's exit hook). The job goes
    further and ends the gloo backend itself before exit: ``destroy_process_group()`` only
    unregisters the group, and the backend (its worker threads) lives while Python objects hold it
    -- the model, the optimizer and the job, which sit in reference cycles. The caller has dropped
    its references and every rank met in a barrier after its last collective; the collection here
    frees the group while Python still runs, and the backend's destructor joins its threads. This
    holds on the error path too (the engine's autograd nodes hold it weakly: [Note: weak
    references from autograd nodes]); tests/jobs/test_job_failures.py checks that no thread but the
    main one is left after ``main()`` returns, on a normal and on an error exit."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def exit_fast(code: int):
    """``sys.exit(code)`` for a job's script, without the interpreter's collections over every object
    at exit (see [Note: a fast exit]). Only for ``__main__``: it leaves the collector frozen.

    [Note: a fast exit]
    A job's process ends holding torch, transformers and what they import: millions of objects that
    the cyclic garbage collector tracks. At exit the interpreter clears every module and runs full
    collections over all of them: about 1 CPU-second per process on the CPU box (the 2-step tiny run on
    one rank takes 5.9 s of CPU with them, 4.9 s without; /usr/bin/time), paid by every rank of every
    run. ``gc.freeze()`` just before ``sys.exit`` moves every object alive into the permanent
    generation, which those collections skip. The rest of the exit happens as before: the atexit
    handlers, the flush of stdout and stderr, the deallocation of everything reference counting frees
    while the modules are cleared. What no longer happens is the collection of reference cycles that
    become garbage only while the modules are cleared, and so the finalizers of their objects (which
    Python does not promise at exit anyway). The job has nothing left there: ``main()`` has closed its
    files and dropped the job, and ``shutdown_distributed`` collected its cycles, the process group's
    among them, while Python still ran ([Note: teardown before exit]). A caller that runs ``main()`` in
    its own process keeps its collector: only the scripts' ``__main__`` exits this way."""
    gc.freeze()
    sys.exit(code)
