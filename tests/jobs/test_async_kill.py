"""Asynchronous and synchronous saves killed at each phase, and a synchronous save into
the root of a background save in flight.

A kill is a real SIGKILL of the whole process, sent from the thread that reaches the phase (the
writer thread for the background phases): nothing after it runs, no handler or ``finally``. After
each kill the newest complete checkpoint is the previous one -- or the new one once its rename
happened -- and a resume from it is exact (the same weights, and the same next step, as the
uninterrupted run); the next save removes what the killed one left. An I/O error at each background phase is raised
by ``wait()`` with the message of a synchronous save failing there. The job, SIGTERM'd while its
background write is in flight, says it waits, waits, and exits as documented.

Cost: one driver process (``python tests/jobs/test_async_kill.py``, a world of one) imports torch
once and forks one child per phase, each killed; the driver then checks every root and runs the
in-flight and failure cases itself (~3 s idle); the job test is one plain-python launch."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)  # the shared helpers (dist_utils, models, job_utils)

# phase -> the step the newest complete checkpoint must hold after a kill there
PHASES = {
    "staging": 2,  # the host copy taken, the writer not started
    "dcp_data": 2,  # in the middle of DCP's data file (one item written)
    "dcp_metadata": 2,  # data written, DCP's .metadata not
    "checksums": 2,  # DCP done, the CRC-32s under way
    "manifest": 2,  # checkpoint.json half written (.part)
    "rename": 2,  # complete in .tmp.step_4, not yet renamed
    "rotation": 4,  # renamed; step 2 (keep=1) renamed to .trash, not yet deleted
}


def _kill(_phase=None):
    os.kill(os.getpid(), signal.SIGKILL)


_kill.kills = True


def _fail(phase):
    raise OSError(errno.EIO, "injected I/O error", phase)


def _on_writer() -> bool:
    return threading.current_thread().name.startswith("yafsdp-ckpt")


def _on_main() -> bool:
    return threading.current_thread() is threading.main_thread()


def _install(phase: str, act, when=_on_writer):
    """At ``phase`` of a save, in a thread where ``when()``: ``act(phase)`` (a SIGKILL, or a raised
    OSError). Returns the function that takes the injection out."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as fs

    import yafsdp.checkpoint as C
    from yafsdp.checkpoint import background, contents, files, write

    kill = getattr(act, "kills", False)
    if phase == "staging":
        owner, name = background, "stage"  # where AsyncSaver looks it up

        def hook(*a, **k):
            real(*a, **k)
            act(phase)
    elif phase == "dcp_data":
        owner, name, calls = fs, "_write_item", []

        def hook(*a, **k):
            if when() and calls:  # one item written: the data file is partial
                act(phase)
            calls.append(1)
            return real(*a, **k)
    elif phase == "dcp_metadata":
        owner, name = dcp.FileSystemWriter, "finish"

        def hook(self, *a, **k):
            if when():
                act(phase)
            return real(self, *a, **k)
    elif phase == "checksums":
        owner, name = write, "crc32"

        def hook(path, *a):
            if when():
                act(phase)
            return real(path, *a)
    elif phase == "manifest":
        owner, name = write, "write_json_atomic"

        def hook(path, obj):
            if when():
                if kill:
                    with open(path + ".part", "w") as f:
                        f.write(json.dumps(obj)[:100])
                act(phase)
            return real(path, obj)
    elif phase == "rename":
        owner, name = write, "publish_checkpoint"

        def hook(*a):
            if when():
                act(phase)
            return real(*a)
    elif phase == "rotation":
        owner, name = files, "remove_checkpoint"

        def hook(path, root):
            if when() and os.path.basename(path).startswith(files.PREFIX):  # rotation, not a replacement
                if kill:
                    os.rename(path, os.path.join(root, files.TRASH_PREFIX + os.path.basename(path) + ".1"))
                act(phase)
            return real(path, root)
    else:
        raise ValueError(phase)
    real = getattr(owner, name)
    setattr(owner, name, hook)
    return lambda: setattr(owner, name, real)


def _setup():
    import torch

    import yafsdp
    from models import tiny_llama

    model = yafsdp.YaFSDP(tiny_llama(layers=2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, start, steps):
    from models import batch, loss_of

    for step in range(start, start + steps):
        loss_of(model, "llama", batch("llama", step, 0, 0)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _init():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


# the phases of a synchronous save (no staging copy); everything runs on the main thread
SYNC_PHASES = {p: want for p, want in PHASES.items() if p != "staging"}


def _child(phase: str, root: str, sync: bool = False) -> None:
    from yafsdp import checkpoint as C

    _init()
    model, opt = _setup()
    _train(model, opt, 0, 2)
    C.save_checkpoint(root, 2, model, opt, state={"step": 2})
    _train(model, opt, 2, 2)
    if sync:
        _install(phase, _kill, when=_on_main)
        C.save_checkpoint(root, 4, model, opt, state={"step": 4}, keep=1)
        os._exit(3)  # not killed: the test fails on this exit code
    _install(phase, _kill)
    saver = C.AsyncSaver(model, opt)
    saver.save(root, 4, state={"step": 4}, keep=1)
    _train(model, opt, 4, 1)  # the loop goes on while the writer works
    saver.wait()
    os._exit(3)  # not killed: the test fails on this exit code


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def _driver(base: str) -> dict:
    import torch

    torch.set_num_threads(1)
    import torch.distributed  # noqa: F401 - imported before the forks, as everything below
    from yafsdp import checkpoint as C

    import transformers.models.llama.modeling_llama  # noqa: F401 - imported once, before the forks

    import yafsdp  # noqa: F401
    out: dict = {"exit": {}}
    cases = [(phase, phase, False) for phase in PHASES] + [("sync_" + p, p, True) for p in SYNC_PHASES]
    for key, phase, sync in cases:
        pid = os.fork()
        if pid == 0:
            try:
                _child(phase, os.path.join(base, key), sync)
            finally:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        out["exit"][key] = os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)

    _init()
    model, opt = _setup()  # the uninterrupted run
    ref = {}
    for s in range(6):
        ref[s] = model.full_state_dict()
        _train(model, opt, s, 1)
    for key, want in [*PHASES.items(), *(("sync_" + p, w) for p, w in SYNC_PHASES.items())]:
        root = os.path.join(base, key)
        r = out[key] = {"left": sorted(os.listdir(root))}
        latest = C.latest_checkpoint(root)
        r["latest"] = os.path.basename(latest) if latest else None
        m, o = _setup()
        loaded = C.load_checkpoint(latest, m, o)
        r["state"] = loaded.state
        r["weights_exact"] = _same(m.full_state_dict(), ref[want])
        _train(m, o, want, 1)
        r["resume_exact"] = _same(m.full_state_dict(), ref[want + 1])
        C.save_checkpoint(root, 9, m, o)  # the next save tidies up
        r["after_next_save"] = sorted(os.listdir(root))

    # A synchronous save into the root of a background save in flight: it waits for it.
    root = os.path.join(base, "in_flight")
    real_crc, entered, events = C.write.crc32, threading.Event(), []

    def slow_crc32(path, *a):
        if threading.current_thread().name.startswith("yafsdp-ckpt") and not entered.is_set():
            entered.set()
            time.sleep(1.0)  # the write stays in flight for a second
            events.append("writer checksummed")
        return real_crc(path, *a)

    C.write.crc32 = slow_crc32
    saver = C.AsyncSaver(model, opt)
    saver.save(root, 5, state={"step": 5})
    assert entered.wait(60)
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always", C.CheckpointWarning)
        C.save_checkpoint(root, 6, model, opt, state={"step": 6})
    events.append("sync saved")
    try:
        out["in_flight_wait"] = saver.wait()
    except C.CheckpointError as e:
        out["in_flight_wait"] = f"error: {e}"
    C.write.crc32 = real_crc
    out["in_flight_events"] = events
    out["in_flight_notes"] = [str(w.message) for w in notes if issubclass(w.category, C.CheckpointWarning)]
    out["in_flight_list"] = [s for s, _ in C.list_checkpoints(root)]
    out["in_flight_left"] = sorted(os.listdir(root))

    # Another saver's save into that root waits too; the write in flight fails, and its failure is
    # raised by its own saver afterwards.
    root = os.path.join(base, "in_flight2")
    entered.clear()

    def failing_crc32(path, *a):
        if threading.current_thread().name.startswith("yafsdp-ckpt") and not entered.is_set():
            entered.set()
            time.sleep(1.0)
            raise OSError(errno.EIO, "injected I/O error", path)
        return real_crc(path, *a)

    C.write.crc32 = failing_crc32
    other = C.AsyncSaver(model, opt)
    saver.save(root, 5)
    assert entered.wait(60)
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always", C.CheckpointWarning)
        other.save(root, 6)
    out["other_path"] = other.close()
    try:
        saver.wait()
        out["other_first"] = None
    except C.CheckpointError as e:
        out["other_first"] = str(e)
    C.write.crc32 = real_crc
    out["other_notes"] = [str(w.message) for w in notes if issubclass(w.category, C.CheckpointWarning)]
    out["other_left"] = sorted(os.listdir(root))

    # A failed write at each background phase: the synchronous save's message, the previous checkpoint kept.
    out["fail"] = {}
    for phase in [p for p in PHASES if p != "staging"]:
        root = os.path.join(base, "fail_" + phase)
        C.save_checkpoint(root, 2, model, opt)
        msgs = []
        for when in (_on_main, _on_writer):
            undo = _install(phase, _fail, when)
            try:
                if when is _on_main:
                    C.save_checkpoint(root, 7, model, opt, keep=1)
                else:
                    saver.save(root, 7, keep=1)
                    saver.wait()
                msgs.append(None)
            except C.CheckpointError as e:
                msgs.append(str(e))
            finally:
                undo()
        out["fail"][phase] = dict(sync=msgs[0], background=msgs[1], left=sorted(os.listdir(root)))
    saver.close()
    return out


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    base = tmp_path_factory.mktemp("async_kill")
    res = base / "res.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(TESTS), TESTS, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, __file__, str(base), str(res)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-5000:]
    return base, json.loads(res.read_text())


def test_async_save_killed_at_each_phase(driver):
    """A SIGKILL at each phase of an asynchronous save leaves the previous checkpoint (or the new
    one once renamed), from which a resume is exact; the next save removes the leftovers."""
    _, r = driver
    assert {p: r["exit"][p] for p in PHASES} == {p: signal.SIGKILL for p in PHASES}, r["exit"]  # each killed there
    for phase, want in PHASES.items():
        x = r[phase]
        assert x["latest"] == f"step_{want:08d}" and x["state"] == {"step": want}, (phase, x)
        assert x["weights_exact"] and x["resume_exact"], (phase, x)
        assert x["after_next_save"] == [f"step_{want:08d}", "step_00000009"], (phase, x)
    # what each kill left (the next save removed it)
    assert r["staging"]["left"] == ["step_00000002"]
    for phase in ("dcp_data", "dcp_metadata", "checksums", "manifest", "rename"):
        assert r[phase]["left"] == [".tmp.step_00000004", "step_00000002"], (phase, r[phase])
    assert r["rotation"]["left"] == [".trash.step_00000002.1", "step_00000004"]


def test_sync_save_killed_at_each_phase(driver):
    """The same SIGKILLs at each phase of a synchronous save (the same fault injection for both
    kinds of save): the previous checkpoint, or the new one once renamed, resumes exactly."""
    _, r = driver
    assert {k: v for k, v in r["exit"].items() if k.startswith("sync_")} == \
        {"sync_" + p: signal.SIGKILL for p in SYNC_PHASES}, r["exit"]
    for phase, want in SYNC_PHASES.items():
        x = r["sync_" + phase]
        assert x["latest"] == f"step_{want:08d}" and x["state"] == {"step": want}, (phase, x)
        assert x["weights_exact"] and x["resume_exact"], (phase, x)
        assert x["after_next_save"] == [f"step_{want:08d}", "step_00000009"], (phase, x)
    for phase in ("dcp_data", "dcp_metadata", "checksums", "manifest", "rename"):
        assert r["sync_" + phase]["left"] == [".tmp.step_00000004", "step_00000002"], (phase, r["sync_" + phase])
    assert r["sync_rotation"]["left"] == [".trash.step_00000002.1", "step_00000004"]


def test_sync_save_waits_for_a_background_save_into_the_same_root(driver):
    """save_checkpoint into the root of an AsyncSaver's write in flight waits for it, with a
    CheckpointWarning; before, it removed the in-flight .tmp.step_5 (a killed save, to it) and the
    background save failed."""
    base, r = driver
    assert r["in_flight_wait"] == str(base / "in_flight" / "step_00000005"), r["in_flight_wait"]
    assert r["in_flight_events"] == ["writer checksummed", "sync saved"]
    assert r["in_flight_list"] == [5, 6] and r["in_flight_left"] == ["step_00000005", "step_00000006"]
    (note,) = r["in_flight_notes"]
    assert "save_checkpoint of step 6 into" in note and "waited" in note and "background save of step 5" in note
    # another AsyncSaver into the same root: it waits; the failure stays with the first saver
    (note,) = r["other_notes"]
    assert "AsyncSaver.save of step 6 into" in note and "background save of step 5" in note
    assert r["other_path"] == str(base / "in_flight2" / "step_00000006") and r["other_left"] == ["step_00000006"]
    assert r["other_first"].startswith("the background save of step 5 failed: saving checkpoint into "), r["other_first"]
    assert "[Errno 5] injected I/O error" in r["other_first"]


def test_a_failed_background_write_reports_the_synchronous_message(driver):
    """An I/O error at each phase of the background write is raised by wait() with the message of a
    synchronous save failing at the same point, and leaves the previous checkpoint (a rotation's
    failure: the new one is in place, the old one too)."""
    _, r = driver
    for phase, x in r["fail"].items():
        assert x["sync"] and f"[Errno 5] injected I/O error: '{phase}'" in x["sync"], (phase, x)
        assert x["background"] == f"the background save of step 7 failed: {x['sync']}", (phase, x)
        kept = ["step_00000002", "step_00000007"] if phase == "rotation" else ["step_00000002"]
        assert x["left"] == kept, (phase, x)


# The job, SIGTERM'd while its background save is in flight. The job sends the signal to itself right after
# its save of step 3 returned (the write then in flight on the writer thread), and the writer is held in its
# checksums until the test, having seen the job say it waits, creates "<mark>.release" (bounded). Sending the
# signal from outside when the writer reached its checksums raced: on a fast step the main thread was already
# blocked in the save of step 6 (waiting for step 3's write) when the signal came, and never said it waits.
_SLOW_WRITER = """
import os, runpy, signal, sys, threading, time
job = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(job))
import yafsdp.checkpoint as C
real, mark = C.write.crc32, os.environ["ASYNC_KILL_MARK"]
def crc32(path, *a):
    if threading.current_thread().name.startswith("yafsdp-ckpt"):
        t0 = time.monotonic()  # held until the test saw the job wait for it (bounded)
        while not os.path.exists(mark + ".release") and time.monotonic() - t0 < 120:
            time.sleep(0.01)
    return real(path, *a)
C.write.crc32 = crc32
real_save = C.AsyncSaver.save
def save(self, root, step, **kw):
    staged = real_save(self, root, step, **kw)
    if step == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return staged
C.AsyncSaver.save = save
runpy.run_path(job, run_name="__main__")
"""


def test_job_sigterm_waits_for_the_background_save(tmp_path):
    """SIGTERM while --async-save's write of step 3 is in flight: the job says it waits, reports
    step 3 saved, saves the step it stopped at, exits 0; both checkpoints complete, nothing left over."""
    from job_utils import FAST, JOB, env, events

    out, mark = str(tmp_path / "run"), str(tmp_path / "writer_in_checksums")
    e = dict(env(), ASYNC_KILL_MARK=mark)
    a = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, JOB, *FAST, "--steps", "100000", "--save-every", "3",
                          "--async-save", "--out", out], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in a.stdout:  # the writer is held until the job says it waits for it
        lines.append(line)
        if "waiting  for the background save of step 3 to finish" in line:
            break
    open(mark + ".release", "w").close()
    o, err = a.communicate(timeout=180)
    o = "".join(lines) + o
    assert a.returncode == 0, (o[-3000:], err[-3000:])
    ev = events(out)
    stop = [x for x in ev if x["event"] == "signal"][0]["step"]
    assert stop > 3
    waiting = o.index("waiting  for the background save of step 3 to finish")
    saved3 = o.index("step_00000003 (", waiting)
    assert "in the background)" in o[saved3:saved3 + 100]
    assert o.index(f"saved    {out}/checkpoints/step_{stop:08d}", saved3) < o.index(f"stopped  by SIGTERM at step {stop}")
    assert [(x["step"], x.get("background")) for x in ev if x["event"] == "save"] == [(3, True), (stop, None)]
    ck = os.path.join(out, "checkpoints")
    assert sorted(os.listdir(ck)) == ["step_00000003", f"step_{stop:08d}"]
    from yafsdp import checkpoint as C

    assert [s for s, _ in C.list_checkpoints(ck)] == [3, stop]


if __name__ == "__main__":
    base, dest = sys.argv[1], sys.argv[2]
    result = _driver(base)
    with open(dest, "w") as f:
        json.dump(result, f)
    os._exit(0)
