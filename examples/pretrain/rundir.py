"""The run directory (``--out``): who may use it, what a job finds there (a fresh start, a resume,
a rewind), and the settings a resume must keep. Rank 0 decides under the lock; every rank gets
the same plan.

[Note: one line per run directory]
A run directory holds one line of training: ``checkpoints/`` and ``metrics.jsonl`` describe the
same steps 1..N, so a plain ``--resume`` (or a torchrun restart) continues the line, ``--keep``
rotates within it and ``loss.png`` draws it. Three things would break that, and each is handled
here:

- two jobs in one directory: the lock (``ops.OutLock``) is taken before the directory is looked at
  -- also a new one, which the lock makes -- so the plan below is made by the lock's holder only
  and a second job stops with "in use by another job" (``RunDir.take_lock``);
- going back (``--resume PATH`` of a checkpoint older than the run's newest): the continuation
  after it -- its checkpoints and metrics rows -- would mix with the new one. Such a resume needs
  ``--rewind``, which *sets the continuation aside*: it is moved (never deleted) to
  ``abandoned/<time>-after-step_K/`` (checkpoints/, metrics.jsonl, loss.png and rewind.json, what
  was moved and why) and recorded as a ``rewind`` event in events.jsonl; the checkpoints and
  metrics left are the current line's. The moves are renames in one filesystem; ``rewind.json``
  is written first, so a rewind a kill interrupted is finished by the next job (``RunDir.make_plan``);
- other data or model settings on resume: the data stream (cursor, windows, order) is no longer
  the run's. ``check_settings`` refuses unless ``--allow-change`` accepts the setting, and an
  accepted change is recorded in events.jsonl.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
import traceback
import zlib
from dataclasses import dataclass, replace

import numpy as np
import torch.distributed as dist

from pretrain import progress as P
from pretrain.ops import JobError, OutLock, agree
from yafsdp import checkpoint as C
from yafsdp.checkpoint.files import OLD_PREFIX, fsync_dir, write_json_atomic

ABANDONED = "abandoned"  # --out/abandoned/<time>-after-step_K/: continuations set aside by --rewind
RECORD = "rewind.json"


# ------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Rewind:
    """What a ``--resume PATH --rewind`` sets aside: the continuation after ``checkpoint``."""

    step: int  # the checkpoint's step: everything after it goes to abandoned/
    checkpoint: str  # the checkpoint resumed from
    what: str  # the continuation in words (describe_continuation), for the header


@dataclass(frozen=True)
class RunPlan:
    """What this job does with ``--out``: decided by rank 0 under the lock (``plan_output``), the
    same on every rank. A fresh start has no ``resume_path``."""

    ck_root: str  # --out/checkpoints
    resume_path: str | None = None  # the checkpoint the job loads
    wipe: bool = False  # delete the run's files before writing (--overwrite; a restart before any checkpoint)
    discarded: str | None = None  # with wipe: the line said before (what is deleted: describe_run)
    foreign: tuple[str, ...] = ()  # step_* directories without a manifest: reported, never used or deleted
    rewind: Rewind | None = None  # --rewind: the continuation to set aside before training
    notes: tuple[str, ...] = ()  # the header's notes about --out


class RunDir:
    """The run directory ``--out`` as this job uses it: the lock (rank 0 holds it for the whole
    job), the plan made under it and the rewind done in it (see [Note: one line per run
    directory]). Rank 0 decides and acts; every rank holds the same plan."""

    def __init__(self, out: str, main: bool):
        self.out, self.main = out, main
        self.lock = OutLock(out) if main else None
        self.plan: RunPlan | None = None  # make_plan
        self.rewound: dict | None = None  # rewind(): the record of what was set aside

    def take_lock(self) -> None:
        """Collective: rank 0 locks --out (once; a new --out is made for the lock); a job already
        there stops every rank. Before anything reads --out."""
        err = None
        if self.main and self.lock.fd is None:
            try:
                self.lock.acquire()
            except JobError as e:
                err = str(e)
        agree(err)

    def release(self) -> None:  # rank 0: the job ends
        if self.lock is not None:
            self.lock.release()

    def make_plan(self, args, env) -> RunPlan:
        """Collective, holding the lock: rank 0 finishes an interrupted rewind, decides fresh start /
        resume / rewind (``plan_output``) and sends the plan to every rank; a problem is a JobError
        on every rank together."""
        box = [None, None]
        if self.main:
            try:
                notes = finish_interrupted_rewinds(self.out)
                plan = plan_output(args, env)
                box[0] = replace(plan, notes=(*notes, *plan.notes))
            except (JobError, C.CheckpointError) as e:
                box[1] = str(e)
            except OSError as e:
                box[1] = f"--out {self.out!r}: {C.describe_os_error(e)}"
            except Exception as e:  # noqa: BLE001 - unexpected: still stop every rank together
                traceback.print_exc()
                box[1] = f"rank 0: {type(e).__name__}: {e}"
        dist.broadcast_object_list(box, src=0)
        if box[1] is not None:
            raise JobError(box[1])
        self.plan = box[0]
        return self.plan

    def rewind(self) -> None:
        """Collective: rank 0 sets the plan's continuation aside (``set_aside``); every rank then goes
        on or stops together."""
        err = None
        if self.main:
            try:
                self.rewound = set_aside(self.out, self.plan.rewind)
            except OSError as e:
                err = f"--rewind: setting the continuation aside failed: {C.describe_os_error(e)}; nothing was deleted"
        agree(err)


def plan_output(args, env) -> RunPlan:
    """Decide fresh start vs resume (and whether it is a rewind); a problem becomes an error before
    anything is written. Reads --out: call it holding the lock."""
    out = args.out
    ck_root = os.path.join(out, "checkpoints")
    complete = C.list_checkpoints(ck_root)
    metrics = os.path.join(out, "metrics.jsonl")
    has_metrics = os.path.isfile(metrics) and os.path.getsize(metrics) > 0
    mode = args.resume
    if mode is None and args.export_only:
        mode = "latest"  # export the newest complete checkpoint
    if env.restart_count > 0 and not args.export_only:
        mode = restart_mode(args, complete, out)
    resume_path, wipe, discarded, rewind, notes = None, False, None, None, ()
    if os.path.exists(out) and not os.path.isdir(out):
        raise JobError(f"--out {out!r} exists and is not a directory")
    if mode is None:
        if (complete or has_metrics) and not args.overwrite:
            what = f"checkpoints up to {os.path.basename(complete[-1][1])}" if complete else "metrics.jsonl"
            raise JobError(
                f"--out {out!r} already holds a run ({what}); pass --resume to continue it, --overwrite to "
                "discard it, or choose another --out"
            )
        wipe = bool(args.overwrite and (complete or has_metrics))
        if wipe:
            discarded = f"overwrite discarded the run in {out}: {describe_run(out, complete, metrics)}"
    elif mode in ("latest", "auto"):
        if complete:
            resume_path = complete[-1][1]
        elif mode == "latest":
            partial = C.incomplete_checkpoints(ck_root)
            extra = f" (only incomplete ones: {', '.join(os.path.basename(x) for x in partial)})" if partial else ""
            flag = "--export-only" if args.export_only and args.resume is None else "--resume"
            raise JobError(f"{flag}: nothing to {'export' if flag == '--export-only' else 'resume'}, no complete "
                           f"checkpoint in {ck_root!r}{extra}")
        elif has_metrics:  # a restart (or --resume auto) before the first checkpoint: start the run again
            wipe, discarded = True, (f"start    no complete checkpoint in {ck_root} to resume: the run starts "
                                     f"again; discarded {describe_run(out, complete, metrics)}")
    else:
        if not os.path.isdir(mode):
            raise JobError(f"--resume {mode!r}: no such checkpoint directory")
        resume_path = mode.rstrip("/")
    if resume_path and not args.export_only:
        rewind = rewind_plan(args, resume_path, complete, metrics)
        if args.rewind and rewind is None:
            notes = (f"--rewind: no checkpoint after {os.path.basename(resume_path)} in {ck_root}; nothing set aside",)
    if args.export_hf and os.path.isdir(args.export_hf) and os.listdir(args.export_hf) and env.restart_count == 0:
        raise JobError(f"--export-hf {args.export_hf!r} exists and is not empty; choose a new directory")
    return RunPlan(ck_root=ck_root, resume_path=resume_path, wipe=wipe, discarded=discarded,
                   foreign=tuple(C.foreign_dirs(ck_root)), rewind=rewind, notes=notes)


def restart_mode(args, complete: list, out: str):
    """What a torchrun restart (of a worker group that failed) resumes: the current line's newest
    checkpoint. With ``--resume PATH`` that is PATH until the run has saved past it; with
    ``--resume PATH --rewind`` the rewind is done once -- by the first attempt of this launch (its
    record names the launcher), else by this one."""
    if args.resume in (None, "auto"):
        return "auto"
    if args.resume == "latest":
        return "latest"
    path = args.resume.rstrip("/")
    if args.rewind and not rewound_by_this_launch(out, path):
        return path
    try:
        k = int(C.read_manifest(path)["step"])
    except C.CheckpointError:
        return path  # refused with the reason below
    return complete[-1][1] if complete and complete[-1][0] >= k else path


def describe_run(out: str, complete: list, metrics: str) -> str:
    """What a wipe (``RunPlan.wipe``) is about to delete in ``out``: checkpoints, metrics steps, other files."""
    parts = []
    if complete:
        names = [os.path.basename(p) for _, p in complete]
        parts.append(f"{len(names)} checkpoint(s) {', '.join(names)}")
    rows = P.read_jsonl(metrics)
    if rows:
        parts.append(f"metrics.jsonl ({len(rows)} steps, {rows[0].get('step')}-{rows[-1].get('step')}, "
                     f"last loss {rows[-1].get('loss', float('nan')):.4f})")
    parts += [n for n in ("events.jsonl", "loss.png", "run.json") if os.path.exists(os.path.join(out, n))]
    return ", ".join(parts)


# ------------------------------------------------------------------------------------- rewinds
def launcher_id() -> str | None:
    """This launch of the job: rank 0's host and its torchrun agent's pid (the same for every
    attempt of one ``torchrun``); None outside torchrun (nothing restarts it)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return f"{socket.gethostname()}:{os.getppid()}"


def _records(out: str) -> list[tuple[str, dict]]:
    root = os.path.join(out, ABANDONED)
    found = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        try:
            with open(os.path.join(root, name, RECORD)) as f:
                found.append((os.path.join(root, name), json.load(f)))
        except (OSError, ValueError):
            continue
    return found


def rewound_by_this_launch(out: str, path: str) -> bool:
    me, here = launcher_id(), os.path.realpath(path)
    return me is not None and any(
        r.get("done") and r.get("launcher") == me and os.path.realpath(r.get("checkpoint", "")) == here
        for _, r in _records(out))


def _later(step: int, resume_path: str, complete: list, metrics: str) -> tuple[list[str], list[int]]:
    """The continuation after ``step``: checkpoints of later steps, and metrics steps after it."""
    here = os.path.realpath(resume_path)
    cks = [p for s, p in complete if s > step and os.path.realpath(p) != here]
    rows = [r["step"] for r in P.read_jsonl(metrics) if r.get("step", 0) > step]
    return cks, rows


def rewind_plan(args, resume_path: str, complete: list, metrics: str) -> Rewind | None:
    """None when ``resume_path`` continues the run (no later checkpoint: metrics rows after it are
    the unsaved tail of a stopped job, recomputed identically); else what a rewind sets aside --
    refused unless ``--rewind`` (see [Note: one line per run directory])."""
    k = int(C.read_manifest(resume_path)["step"])
    cks, rows = _later(k, resume_path, complete, metrics)
    if not cks:
        return None
    what = describe_continuation(cks, rows)
    if not args.rewind:
        raise JobError(
            f"--resume {resume_path!r} is step {k}, but the run in {args.out!r} went on after it ({what}): resuming "
            f"from it abandons that continuation. Pass --rewind as well to set it aside in "
            f"{os.path.join(args.out, ABANDONED)}/ (moved, nothing deleted; recorded in events.jsonl), or --resume "
            f"without a path to continue from {os.path.basename(cks[-1])}")
    return Rewind(step=k, checkpoint=resume_path, what=what)


def describe_continuation(cks: list[str], rows: list[int]) -> str:
    names = ", ".join(os.path.basename(p).replace(OLD_PREFIX, "") for p in cks)
    parts = [f"checkpoint(s) {names}"] if cks else []
    if rows:
        parts.append(f"metrics.jsonl steps {rows[0]}-{rows[-1]}")
    return "; ".join(parts) or "nothing"


def set_aside(out: str, rewind: Rewind) -> dict:
    """Rank 0, holding the lock: move the continuation after ``rewind.step`` into a new
    ``abandoned/<time>-after-step_K/`` (see [Note: one line per run directory]); returns the record."""
    k = rewind.step
    base = os.path.join(out, ABANDONED, f"{time.strftime('%Y%m%d-%H%M%S')}-after-step_{k}")
    dest, n = base, 1
    while os.path.exists(dest):
        n += 1
        dest = f"{base}-{n}"
    os.makedirs(dest)
    record = dict(event="rewind", step=k, checkpoint=rewind.checkpoint, set_aside=dest, launcher=launcher_id(),
                  done=False)
    write_json_atomic(os.path.join(dest, RECORD), record)  # first: an interrupted rewind is finished later
    return _finish_rewind(out, dest, record)


def _finish_rewind(out: str, dest: str, record: dict) -> dict:
    """The moves of a rewind; each is idempotent, so an interrupted rewind is finished by calling
    this again."""
    k = record["step"]
    ck_root = os.path.join(out, "checkpoints")
    metrics = os.path.join(out, "metrics.jsonl")
    cks, rows = _later(k, record["checkpoint"], C.list_checkpoints(ck_root), metrics)
    os.makedirs(os.path.join(dest, "checkpoints"), exist_ok=True)
    for path in cks:
        os.rename(path, os.path.join(dest, "checkpoints", os.path.basename(path).replace(OLD_PREFIX, "")))
    fsync_dir(ck_root)
    if rows:  # the abandoned rows first, then the current line's file without them
        later = [r for r in P.read_jsonl(metrics) if r.get("step", 0) > k]
        tmp = os.path.join(dest, "metrics.jsonl.part")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in later)
        os.replace(tmp, os.path.join(dest, "metrics.jsonl"))
        P.truncate_metrics(metrics, k)
    moved_rows = P.read_jsonl(os.path.join(dest, "metrics.jsonl"))
    if moved_rows:
        record["metrics_steps"] = [moved_rows[0].get("step"), moved_rows[-1].get("step")]
    png = os.path.join(out, "loss.png")
    if os.path.isfile(png) and not os.path.exists(os.path.join(dest, "loss.png")):
        shutil.copyfile(png, os.path.join(dest, "loss.png"))  # it drew the abandoned line
    record.update(checkpoints=sorted(os.listdir(os.path.join(dest, "checkpoints"))), time=round(time.time(), 3))
    events = P.Events(os.path.join(out, "events.jsonl"))
    events.write({k_: v for k_, v in record.items() if k_ not in ("done", "time")})
    events.close()
    record["done"] = True
    write_json_atomic(os.path.join(dest, RECORD), record)
    return record


def finish_interrupted_rewinds(out: str) -> list[str]:
    """Rank 0, holding the lock: finish the rewinds a kill interrupted; returns notes saying so."""
    notes = []
    for dest, record in _records(out):
        if not record.get("done"):
            _finish_rewind(out, dest, record)
            notes.append(f"finished the rewind to step {record['step']} that was interrupted: the continuation "
                         f"after it is in {dest}")
    return notes


# ------------------------------------------------------------------------------------ settings
# [Note: settings a resume keeps]
# Recorded in every checkpoint's manifest (meta["settings"]) and compared on resume. Each one
# changes the data stream or the model, so a resume with another value is refused unless
# --allow-change names it (then recorded in events.jsonl as "settings_changed"):
#   seq_len       the windows the token stream is cut into (a long-context stage changes it);
#   seed          the order of the windows;
#   global_batch  sequences per optimizer step, batch x ranks x accum: the windows of each step.
#                 batch, ranks and accum are free as long as their product stays (2 ranks ->
#                 1 rank with --grad-accum 2 continues the same steps); a change through the
#                 number of ranks alone (same --batch-size and --grad-accum: an elastic restart
#                 on fewer nodes, a resume on more GPUs) is free too -- the launch's size, not the
#                 recipe; it is noted in the header and recorded like an accepted change;
#   data          the training token stream -- count and CRC-32 of its first and last 2^20 ids --
#                 whatever file, format or tokenizer gives it (--data, --tokenizer, --text-key,
#                 --data-dtype, --val-fraction);
#   model         the architecture beyond the shapes (RoPE, norm epsilon, activation, biases;
#                 a derived job adds its own: Job.model_settings, the LoRA job's rank, alpha, targets);
#                 other shapes are refused outright (the checkpoint cannot be loaded).
# Free: --lr and the schedule, --weight-decay, --grad-clip, --steps, precision (--bf16), the
# engine's settings (--zero-stage, --hsdp, --gather-dtype, --compile, activation checkpointing),
# --attn. A checkpoint written before these were recorded is checked on seq_len and seed (its
# state holds them) once loaded.
SETTINGS = ("seq_len", "seed", "global_batch", "data", "model")
ARCH_KEYS = ("hidden_act", "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling", "attention_bias",
             "mlp_bias", "attention_dropout", "pretraining_tp")
_EDGE = 1 << 20  # ids at each end of the stream that go into its checksum


def parse_allow_change(value: str | None) -> set[str] | str:
    """The setting names of ``--allow-change a,b``; a string (the error) for an unknown one."""
    names = {n.strip().replace("-", "_") for n in (value or "").split(",") if n.strip()}
    bad = sorted(names - set(SETTINGS))
    if bad:
        return (f"--allow-change: unknown setting(s) {', '.join(bad)}; the settings a resume checks are "
                f"{', '.join(SETTINGS)}")
    return names


def data_fingerprint(batches) -> dict:
    """The training stream as ids: their count and the CRC-32 of the first and last ``_EDGE`` (as
    int64), independent of the file format and tokenizer that produced them."""
    if hasattr(batches, "fingerprint"):  # streamed: the source's identity (its length is unknown)
        return batches.fingerprint()
    ids = batches.tokens if hasattr(batches, "tokens") else batches.examples.reshape(-1)
    n = len(ids)
    crc = zlib.crc32(np.ascontiguousarray(ids[:_EDGE], dtype=np.int64).tobytes())
    if n > _EDGE:
        crc = zlib.crc32(np.ascontiguousarray(ids[max(_EDGE, n - _EDGE):], dtype=np.int64).tobytes(), crc)
    return dict(tokens=int(n), crc32=f"{crc:08x}")


def run_settings(args, world: int, batches, config, model_extra: dict | None = None) -> dict:
    """This run's values of the settings a resume keeps (see [Note: settings a resume keeps]);
    ``model_extra``: what a derived job adds to ``model`` (the LoRA job: rank, alpha, targets)."""
    cfg = config.to_dict()
    arch = {k: cfg[k] for k in ARCH_KEYS if k in cfg}
    arch = json.loads(json.dumps({**arch, **(model_extra or {})}, default=str))
    return dict(seq_len=args.seq_len, seed=args.seed, global_batch=args.batch_size * world * args.grad_accum,
                batch=[args.batch_size, world, args.grad_accum], data=data_fingerprint(batches), model=arch)


def _show(name: str, value, settings: dict) -> str:
    if name == "global_batch" and settings.get("batch"):
        b, w, g = settings["batch"]
        return f"{value} ({b} x {w} rank(s) x {g} accum)"
    if name == "data" and isinstance(value, dict):
        if value.get("source"):
            return f"{value['source']} (id {value['crc32']})"
        return f"{value['tokens']:,} tokens, crc32 {value['crc32']}"
    return repr(value) if isinstance(value, str) else str(value)


def check_settings(saved: dict, now: dict, allowed: set, path: str) -> dict:
    """The settings that differ between the checkpoint ``path`` (``saved``) and this run (``now``)
    as {name: [old, new]}; a JobError naming every one not in ``allowed``."""
    changes, refused = {}, []
    for name in SETTINGS:
        if name not in saved or name not in now or saved[name] == now[name]:
            continue
        old, new = saved[name], now[name]
        if name == "model":
            keys = [k for k in sorted({*old, *new}) if old.get(k) != new.get(k)]
            old, new = {k: old.get(k) for k in keys}, {k: new.get(k) for k in keys}
        changes[name] = [old, new]
        if name == "global_batch" and _ranks_only(saved, now):
            continue  # the launch's size, not the recipe: free (the header notes it)
        if name not in allowed:
            refused.append(f"{name} {_show(name, old, saved)} (checkpoint) vs {_show(name, new, now)} (now)")
    if refused:
        hint = ""
        if "global_batch" in [r.split(" ", 1)[0] for r in refused] and saved.get("global_batch"):
            hint = (f" To keep the run's steps, keep batch x ranks x accum = {saved['global_batch']} (e.g. "
                    "--grad-accum to make up for fewer ranks).")
        names = ",".join(n for n in SETTINGS if n in changes and n not in allowed)
        raise JobError(
            f"checkpoint {path!r} was written with other settings that decide the data stream or the model: "
            f"{'; '.join(refused)}. Resuming would not continue the run's data.{hint} Resume with the run's values, "
            f"or accept the change deliberately with --allow-change {names} (recorded in events.jsonl)")
    return changes


def _ranks_only(saved: dict, now: dict) -> bool:
    """The global batch differs only because the number of ranks does (same --batch-size and
    --grad-accum): an elastic restart on fewer nodes, a resume on more GPUs."""
    return bool(saved.get("batch")) and bool(now.get("batch")) and \
        (saved["batch"][0], saved["batch"][2]) == (now["batch"][0], now["batch"][2])


def describe_changes(changes: dict) -> str:
    return "; ".join(f"{k} {_show(k, a, {})} -> {_show(k, b, {})}" for k, (a, b) in changes.items())
