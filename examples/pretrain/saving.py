"""The job's checkpoints: what a checkpoint of the job holds (``contents``: the training state, the
settings a resume checks; the RNG states), and ``Saver``, which writes them: synchronously or with
--async-save in the background (yafsdp.checkpoint.AsyncSaver), rotated by --keep, pinned at a skip
streak, and refused when a weight is NaN/inf (``Saver.check_finite``).

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


def contents(job) -> tuple[dict, dict]:
    """Collective (streamed data: every rank's position): what a checkpoint of the job holds besides
    the model and the optimizer -- its training state (step, data position, token count, the loss
    guard's history) and the meta a resume checks (model shape, settings, optimizer, tokenizer)."""
    a = job.args
    state = dict(step=job.step, cursor=job.cursor, tokens=job.tokens_seen,
                 elapsed=job.elapsed_before + time.perf_counter() - job.t_session,
                 global_batch=job.batch.sequences, seq_len=a.seq_len, seed=a.seed,
                 loss_history=list(job.guard.recent) if getattr(job, "guard", None) is not None else [])
    if getattr(job, "ft", None) is not None:  # --torchft: torchft's committed step
        state["torchft"] = job.ft.state_dict()
    if hasattr(job.batches, "order"):  # the cursor's meaning: the window order (see [Note: window order])
        state["order"] = job.batches.order
    if hasattr(job.batches, "state"):  # streamed data: every rank's position (see [Note: streamed positions])
        states = [None] * job.world
        dist.all_gather_object(states, job.batches.state())
        state["stream"] = states
    meta = dict(model_shape=job.shape, settings=job.settings, preset_args=describe_model_args(a),
                optimizer=job.opt_name,
                # what the run looked like when this was written ([Note: loss spikes] in faults.py)
                loss=getattr(job, "last_loss", None), skipped_steps=getattr(job, "skipped_steps", 0),
                tokenizer="bytes" if isinstance(job.tokenizer, D.ByteTokenizer) else job.tokenizer.name)
    return state, meta


class Saver:
    """The job's checkpoints in ``ck_root`` (every rank holds one; rank 0 prints and records): each
    save -- synchronous, or --async-save's background write -- with rotation by ``keep``, the pins
    that rotation leaves, and the newest complete checkpoint (the last good one: no save happens
    inside a skip streak)."""

    def __init__(self, model, opt, device, ck_root: str, keep: int, background: bool, outputs,
                 resumed_from: str | None, writer_timeout: float | None = None):
        self.model, self.opt, self.device = model, opt, device
        self.ck_root, self.keep = ck_root, keep
        self.background = background  # --async-save: the periodic saves are written in the background
        # the background writer's collectives give up after --save-timeout (a rank stopped or died while
        # the others write), the deadline the watchdog gives a save
        self.writer_timeout = writer_timeout
        self.outputs = outputs  # pretrain.outputs.Outputs: where rank 0 says and records each save
        self.resumed_from = resumed_from  # the checkpoint the job loaded, if any
        self.last: str | None = None  # this job's newest complete save
        self.pinned: list[str] = []  # kept beyond --keep (the newest before a skip streak)
        self.reported: set[str] = set()  # checkpoint warnings already printed
        self.writer: C.AsyncSaver | None = None  # made by the first background save (collective)
        self.writer_step: int | None = None  # the step of the background save in flight, or the last one

    def newest(self) -> str | None:
        """The newest complete checkpoint: the last save, else the checkpoint the job resumed from."""
        return self.last or self.resumed_from

    def last_good(self) -> str:
        return self.newest() or "none yet"

    def _failed(self, e: C.CheckpointError, step: int) -> JobError:
        return JobError(f"step {step} was not saved: {e}; last complete checkpoint: {self.newest() or 'none'}")

    def save(self, step: int, state: dict, meta: dict, bar) -> None:
        """Collective: the checkpoint of ``step`` (``state`` and ``meta``: see ``contents``), after
        ``check_finite``; in the background with --async-save unless ``bar`` is None (the run's last
        save is synchronous)."""
        t0 = time.perf_counter()
        self.check_finite(step)
        if self.background and bar is not None:
            return self._save_background(step, state, meta, get_rng_state(self.device), bar)
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always", C.CheckpointWarning)
            try:
                path = C.save_checkpoint(self.ck_root, step, self.model, self.opt, state=state,
                                         rank_state=get_rng_state(self.device), meta=meta, keep=self.keep)
            except C.CheckpointError as e:
                raise self._failed(e, step) from None
        for w in notes:
            if issubclass(w.category, C.CheckpointWarning) and str(w.message) not in self.reported:
                self.reported.add(str(w.message))
                self.outputs.say(bar, f"note     {w.message}")
        dt = time.perf_counter() - t0
        self.outputs.event(dict(event="save", step=step, path=path, seconds=round(dt, 3)))
        self.outputs.say(bar, f"saved    {path} ({dt:.1f} s)")
        self.last = path

    def _save_background(self, step: int, state: dict, meta: dict, rank_state, bar) -> None:
        """Stage ``step``'s checkpoint and write it in the background (collective)."""
        t0 = time.perf_counter()
        try:
            if self.writer is None:
                self.writer_step = None
                # collective: its writer's gloo groups (HSDP: replica 0 writes, every replica hears the verdict)
                self.writer = C.AsyncSaver(self.model, self.opt, timeout=self.writer_timeout)
            self.writer.wait()  # the previous save (at most one in flight): its failure stops the run here
        except C.CheckpointError as e:
            raise self._failed(e, step if self.writer_step is None else self.writer_step) from None
        self.poll(bar)  # the previous one's "saved", if it completed while we waited
        wait_s = time.perf_counter() - t0
        try:
            staged = self.writer.save(self.ck_root, step, state=state, rank_state=rank_state, meta=meta,
                                      keep=self.keep)
        except C.CheckpointError as e:
            raise self._failed(e, step) from None
        self.writer_step = step
        waited = f"; waited {wait_s:.1f} s for the previous save to finish" if wait_s >= 0.05 else ""
        self.outputs.say(bar, f"saving   step {step} in the background (training blocked {staged.staged_s:.2f} s"
                              f"{waited}; staging copy {staged.staging_bytes / 2**20:.0f} MiB of host memory on this "
                              "rank)")
        self.outputs.event(dict(event="save_staged", step=step, path=staged.path,
                                seconds=round(staged.staged_s + wait_s, 3)))

    def poll(self, bar) -> None:
        """Print ``saved`` for a background save that has completed (rank 0 only prints)."""
        done = self.writer.poll() if self.writer is not None else None
        if done is None:
            return
        path, seconds = done
        self.last = path
        self.outputs.event(dict(event="save", step=self.writer_step, path=path, seconds=round(seconds, 3),
                                background=True))
        self.outputs.say(bar, f"saved    {path} ({seconds:.1f} s in the background)")

    def drain(self, bar, quiet: bool = False) -> None:
        """Wait for the background save in flight. Raises its failure as a JobError; ``quiet`` (an
        exception is already on its way): prints it instead."""
        if self.writer is None:
            return
        if self.writer.in_flight:  # a signal, an exception or the end of the run waits for it: say so
            self.outputs.say(bar, f"waiting  for the background save of step {self.writer_step} to finish before "
                                  f"{'the error is raised' if quiet else 'going on'}")
        try:
            self.writer.wait()
            self.poll(bar)
        except C.CheckpointError as e:
            err = self._failed(e, self.writer_step)
            if quiet:
                self.outputs.say(bar, f"error    {err}")
            else:
                raise err from None

    def pin_newest(self, step: int, reason: str, bar) -> None:
        """A skip streak begins at ``step``: the newest checkpoint is pinned (never rotated out by
        --keep; see yafsdp.checkpoint.pin_checkpoint), once."""
        path = self.newest()
        if not path or path in self.pinned:
            return
        if self.outputs.main:
            try:
                meta = C.read_manifest(path).get("meta", {})
            except C.CheckpointError:
                meta = {}
            C.pin_checkpoint(path, f"newest checkpoint before the {reason} streak at step {step}", step=step,
                             loss=meta.get("loss"))
        self.pinned.append(path)
        self.outputs.note(bar, f"pinned   {path}: the newest checkpoint before the skip streak at step {step} "
                               "(--keep never deletes it)", dict(event="pinned", step=step, path=path, reason=reason))

    @torch.no_grad()
    def check_finite(self, step: int) -> None:
        """Collective: refuse to save NaN/inf weights or optimizer state (one all-reduce per save).
        Skipped steps (see [Note: non-finite steps]) keep them finite; this is the last guard, so
        that no checkpoint -- and no rotation by --keep -- ever replaces finite ones with garbage."""
        bad = torch.zeros((), device=self.device)
        for i in self.model.shard_info():
            bad += torch.logical_not(torch.isfinite(i.param)).sum()
            for v in self.opt.state.get(i.param, {}).values():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    bad += torch.logical_not(torch.isfinite(v)).sum()
        dist.all_reduce(bad)
        if bad.item() > 0:
            raise Diverged(f"training diverged: {int(bad.item())} weights or optimizer-state values are NaN/inf at "
                           f"step {step}; not saved, the last complete checkpoint ({self.newest() or 'none'}) is "
                           "kept. Resume from it with a lower --lr or a longer --warmup")


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
