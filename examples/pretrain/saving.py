"""The job's checkpoints: what a checkpoint of the job holds (``checkpoint``: the training state, the
settings a resume checks, the RNG states), the guard that no checkpoint holds a NaN (``check_finite``),
and --async-save, the checkpoints written in the background (yafsdp.checkpoint.AsyncSaver).

The training loop is blocked for the staging copy only (see [Note: asynchronous saves] in
yafsdp/checkpoint/background.py). ``saved`` is printed when the checkpoint is complete (the loop
polls after each step), not when staging ends; a save that waits for the previous one says so;
a background failure stops the run at the next save or at the end with the same message as a
synchronous one, the last complete checkpoint named. The run's last save is synchronous (after
the one in flight), and an exception or a signal waits for the write in flight, saying so
(``waiting  for the background save of step N ...``).
"""
from __future__ import annotations

import random
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

from pretrain import data as D
from pretrain.args import describe_model_args
from pretrain.ops import Diverged, JobError
from yafsdp import checkpoint as C


def _write(job, bar, msg: str) -> None:
    if job.main:
        bar.write(msg) if bar is not None else print(msg, flush=True)


def _failed(job, e: C.CheckpointError, step: int):
    last = job.newest_checkpoint()
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


def checkpoint(job, bar) -> None:
    """Collective: the checkpoint of this step (synchronous, or ``--async-save``'s background write
    for the periodic ones; ``bar`` None: the run's last save)."""
    a = job.args
    t0 = time.perf_counter()
    state = dict(step=job.step, cursor=job.cursor, tokens=job.tokens_seen,
                 elapsed=job.elapsed_before + time.perf_counter() - job.t_session,
                 global_batch=a.batch_size * job.world * a.grad_accum, seq_len=a.seq_len, seed=a.seed,
                 loss_history=list(job.guard.recent) if getattr(job, "guard", None) is not None else [])
    if hasattr(job.batches, "state"):  # streamed data: every rank's position (see [Note: streamed positions])
        states = [None] * job.world
        dist.all_gather_object(states, job.batches.state())
        state["stream"] = states
    meta = dict(model_shape=job.shape, settings=job.settings, preset_args=describe_model_args(a),
                optimizer=job.opt_name,
                # what the run looked like when this was written ([Note: loss spikes] in faults.py)
                loss=getattr(job, "last_loss", None), skipped_steps=getattr(job, "skipped_steps", 0),
                tokenizer="bytes" if isinstance(job.tokenizer, D.ByteTokenizer) else job.tokenizer.name)
    check_finite(job)
    if a.async_save and bar is not None:  # periodic saves; the run's last one is synchronous
        return save(job, bar, state, meta, get_rng_state(job.device))
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always", C.CheckpointWarning)
        try:
            path = C.save_checkpoint(job.plan["ck_root"], job.step, job.model, job.opt, state=state,
                                     rank_state=get_rng_state(job.device), meta=meta, keep=a.keep)
        except C.CheckpointError as e:
            last = job.newest_checkpoint()
            raise JobError(f"step {job.step} was not saved: {e}; last complete checkpoint: "
                           f"{last or 'none'}") from None
    for w in notes:
        if issubclass(w.category, C.CheckpointWarning) and str(w.message) not in job.reported:
            job.reported.add(str(w.message))
            msg = f"note     {w.message}"
            if job.main:
                bar.write(msg) if bar is not None else print(msg, flush=True)
    dt = time.perf_counter() - t0
    if job.main:
        job.events.write(dict(event="save", step=job.step, path=path, seconds=round(dt, 3)))
        msg = f"saved    {path} ({dt:.1f} s)"
        if bar is not None:
            bar.write(msg)
        else:
            print(msg, flush=True)
    job.last_checkpoint = path


def pin(job, path: str, reason: str) -> None:
    """Rank 0: ``path`` is kept beyond --keep (see yafsdp.checkpoint.pin_checkpoint)."""
    try:
        meta = C.read_manifest(path).get("meta", {})
    except C.CheckpointError:
        meta = {}
    C.pin_checkpoint(path, reason, step=job.step, loss=meta.get("loss"))


@torch.no_grad()
def check_finite(job) -> None:
    """Collective: refuse to save NaN/inf weights or optimizer state (one all-reduce per save).
    Skipped steps (see [Note: non-finite steps]) keep them finite; this is the last guard, so
    that no checkpoint -- and no rotation by --keep -- ever replaces finite ones with garbage."""
    bad = torch.zeros((), device=job.device)
    for i in job.model.shard_info():
        bad += torch.logical_not(torch.isfinite(i.param)).sum()
        for v in job.opt.state.get(i.param, {}).values():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                bad += torch.logical_not(torch.isfinite(v)).sum()
    dist.all_reduce(bad)
    if bad.item() > 0:
        last = job.newest_checkpoint() or "none"
        raise Diverged(f"training diverged: {int(bad.item())} weights or optimizer-state values are NaN/inf at "
                       f"step {job.step}; not saved, the last complete checkpoint ({last}) is kept. Resume "
                       "from it with a lower --lr or a longer --warmup")


def get_rng_state(device) -> dict:
    st = dict(torch=torch.get_rng_state(), numpy=np.random.get_state(), python=random.getstate())
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def set_rng_state(st, seed: int, rank: int, step: int, device) -> None:
    if st is None:  # a fresh run, or a rank that did not exist in the saved world
        s = seed * 100003 + rank * 1009 + step
        torch.manual_seed(s)
        np.random.seed(s % 2**32)
        random.seed(s)
        return
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if device.type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"], device)
