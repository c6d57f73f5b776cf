"""--async-save: the job's checkpoints written in the background (yafsdp.checkpoint.AsyncSaver).

The training loop is blocked for the staging copy only (see [Note: asynchronous saves] in
yafsdp/checkpoint/background.py). ``saved`` is printed when the checkpoint is complete (the loop
polls after each step), not when staging ends; a save that waits for the previous one says so;
a background failure stops the run at the next save or at the end with the same message as a
synchronous one, the last complete checkpoint named. The run's last save is synchronous (after
the one in flight), and an exception or a signal waits for the write in flight, saying so
(``waiting  for the background save of step N ...``).
"""
from __future__ import annotations

import time

from yafsdp import checkpoint as C


def _write(job, bar, msg: str) -> None:
    if job.main:
        bar.write(msg) if bar is not None else print(msg, flush=True)


def _failed(job, e: C.CheckpointError, step: int):
    from pretrain.ops import JobError

    last = getattr(job, "last_checkpoint", None) or job.plan["resume_path"]
    return JobError(f"step {step} was not saved: {e}; last complete checkpoint: {last or 'none'}")


def save(job, bar, state: dict, meta: dict, rank_state) -> None:
    """Stage this step's checkpoint and write it in the background (collective)."""
    a = job.args
    t0 = time.perf_counter()
    try:
        if getattr(job, "saver", None) is None:
            job.saver_step = None
            job.saver = C.AsyncSaver(job.model, job.opt)  # collective: its writer's gloo group
        job.saver.wait()  # the previous save (at most one in flight): its failure stops the run here
    except C.CheckpointError as e:
        raise _failed(job, e, job.step if job.saver_step is None else job.saver_step) from None
    poll(job, bar)  # the previous one's "saved", if it completed while we waited
    wait_s = time.perf_counter() - t0
    try:
        staged = job.saver.save(job.plan["ck_root"], job.step, state=state, rank_state=rank_state, meta=meta,
                                keep=a.keep)
    except C.CheckpointError as e:
        raise _failed(job, e, job.step) from None
    job.saver_step = job.step
    waited = f"; waited {wait_s:.1f} s for the previous save to finish" if wait_s >= 0.05 else ""
    _write(job, bar, f"saving   step {job.step} in the background (training blocked {staged.staged_s:.2f} s{waited}; "
                     f"staging copy {staged.staging_bytes / 2**20:.0f} MiB of host memory on this rank)")
    if job.main:
        job.events.write(dict(event="save_staged", step=job.step, path=staged.path,
                              seconds=round(staged.staged_s + wait_s, 3)))


def poll(job, bar) -> None:
    """Print ``saved`` for a background save that has completed (rank 0 only prints)."""
    saver = getattr(job, "saver", None)
    done = saver.poll() if saver is not None else None
    if done is None:
        return
    path, seconds = done
    job.last_checkpoint = path
    if job.main:
        job.events.write(dict(event="save", step=job.saver_step, path=path, seconds=round(seconds, 3),
                              background=True))
    _write(job, bar, f"saved    {path} ({seconds:.1f} s in the background)")


def drain(job, bar, quiet: bool = False) -> None:
    """Wait for the save in flight. Raises its failure as a JobError; ``quiet`` (an exception is
    already on its way): prints it instead.""" 
    saver = getattr(job, "saver", None)
    if saver is None:
        return
    if saver.in_flight:  # a signal, an exception or the end of the run waits for it: say so
        _write(job, bar, f"waiting  for the background save of step {job.saver_step} to finish before "
                         f"{'the error is raised' if quiet else 'going on'}")
    try:
        saver.wait()
        poll(job, bar)
    except C.CheckpointError as e:
        err = _failed(job, e, job.saver_step)
        if quiet:
            _write(job, bar, f"error    {err}")
        else:
            raise err from None
