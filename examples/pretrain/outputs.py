"""What the job writes and prints: the run's files in ``--out`` (``Outputs``: ``metrics.jsonl``,
``events.jsonl``, ``run.json``, TensorBoard; ``loss.png``), the header, one metrics row per step, the
closing summary and the Hugging Face export. The functions here read the job (``job``: a
``pretrain.job.Job``) and set none of its attributes; its stages call them."""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time

import torch

import yafsdp
from pretrain.args import shard_size
from pretrain import data as D
from pretrain import progress as P
from pretrain import rundir as R
from pretrain.args import non_default_flags
from pretrain.ops import agree
from yafsdp import checkpoint as C


class Outputs:
    """The run's files in --out as the job writes them (``metrics.jsonl``, ``events.jsonl``,
    ``run.json``, TensorBoard; ``loss.png`` at the end) and the lines rank 0 prints while it runs.
    Rank 0 opens the files; on every other rank nothing is open and ``say``, ``event`` and ``row``
    do nothing."""

    def __init__(self, out: str, main: bool, tensorboard: str | None, export_only: bool):
        self.out, self.main = out, main
        self.metrics_path = os.path.join(out, "metrics.jsonl")
        self.events_path = os.path.join(out, "events.jsonl")
        self.png_path = os.path.join(out, "loss.png")
        self.tb = P.TensorBoard(tensorboard, main and not export_only)
        self.metrics: P.JsonLines | None = None  # rank 0, unless --export-only
        self.events: P.Events | None = None  # rank 0

    def open(self, plan, step: int, record: dict | None) -> None:
        """Collective: rank 0 opens the run's files. With --export-only (``record`` None) only
        events.jsonl, the others stay as they are; else it first deletes what ``plan.wipe`` says, on
        resume drops the metrics rows after ``step``, and writes ``record`` to run.json. A failure
        stops every rank."""
        err = None
        if self.main and record is None:  # the run's files stay as they are; only an "export" event is added
            self.events = P.Events(self.events_path)
        elif self.main:
            try:
                self._open_run_files(plan, step, record)
            except OSError as e:
                err = f"cannot write the run's files in --out {self.out!r}: {C.describe_os_error(e)}"
        agree(err)

    def _open_run_files(self, plan, step: int, record: dict) -> None:
        os.makedirs(self.out, exist_ok=True)
        if plan.wipe:
            print(plan.discarded, flush=True)
            wipe_run(self.out, plan.ck_root)
        if plan.resume_path:
            P.truncate_metrics(self.metrics_path, step)
        self.metrics = P.JsonLines(self.metrics_path)
        self.events = P.Events(self.events_path)
        with open(os.path.join(self.out, "run.json"), "w") as f:
            json.dump(record, f, indent=1, default=str)

    def say(self, bar, msg: str) -> None:
        """One line of output (rank 0), through the progress bar when there is one."""
        if self.main:
            bar.write(msg) if bar is not None else print(msg, flush=True)

    def event(self, record: dict) -> None:
        """One events.jsonl record (rank 0)."""
        if self.events is not None:
            self.events.write(record)

    def note(self, bar, msg: str, event: dict | None = None) -> None:
        """A line of output and, where given, its events.jsonl record (rank 0)."""
        self.say(bar, msg)
        if event is not None:
            self.event(event)

    def row(self, row: dict) -> None:
        """The step's metrics.jsonl row, also to TensorBoard (rank 0)."""
        if self.metrics is not None:
            self.metrics.write(row)
            self.tb.write(row)

    def close(self) -> None:
        for f in (self.metrics, self.events, self.tb):
            if f is not None:
                f.close()


def run_record(job) -> dict:
    """What run.json holds: the command line, the arguments, the world, the versions, the model."""
    args = {k: v for k, v in vars(job.args).items() if k not in ("preset_info", "allowed_changes")}
    return dict(argv=sys.argv, args=args, world=job.world, device=str(job.device), torch=torch.__version__,
                yafsdp=yafsdp.__version__, optimizer=job.opt_name, model_shape=job.shape, params=job.n_params)


def wipe_run(out: str, ck_root: str) -> None:
    """--overwrite: the run's files, checkpoints and killed saves. Every path is listed and checked
    first (nothing is deleted when one cannot be); a symbolic link is removed as a link, never
    followed out of --out. A step_* directory without a manifest is not the run's (see
    yafsdp.checkpoint.foreign_dirs) and stays."""
    paths = [os.path.join(out, name) for name in ("metrics.jsonl", "events.jsonl", "loss.png", "run.json")]
    paths = [p for p in paths if os.path.lexists(p)]
    paths += [path for _, path in C.list_checkpoints(ck_root)] + C.unfinished_saves(ck_root)
    if os.path.lexists(os.path.join(ck_root, C.PINS)):
        paths.append(os.path.join(ck_root, C.PINS))
    for p in paths:  # where a deletion would fail, fail before the first one
        parent = os.path.dirname(p)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied (--overwrite deleted nothing)", parent)
    for p in paths:
        if os.path.islink(p) or not os.path.isdir(p):
            os.remove(p)
        else:
            shutil.rmtree(p)


def header(job):
    a, m = job.args, job.model
    gb = job.batch.sequences
    dtype = "bf16" if job.param_dtype == torch.bfloat16 else "fp32"
    units = len(m.flat_units)
    ac = " | activation checkpointing" if a.activation_checkpointing or a.checkpointing == "all" else ""
    if a.gather_dtype != "bf16":  # a gather format (--gather-dtype)
        n8 = sum(1 for u in m.flat_units for g in u.groups if g.kind.format.name == a.gather_dtype)
        ac += f" | {a.gather_dtype} weight gathers ({n8} units)"
    tp = getattr(a, "tp", 1)
    if a.hsdp > 1:
        ac += f" | HSDP {a.hsdp} replicas x {job.world // (a.hsdp * tp)} shard ranks"
    if tp > 1:  # docs/tp.md
        ac += (f" | TP {tp} x {job.world // tp} data-parallel ranks (sequence parallel"
               f"{', loss parallel' if a.loss_parallel else ''})")
    if getattr(a, "torchft", False):  # [Note: the job under torchft]
        ac += f" | torchft replica group {a.replica_group} of {a.replica_groups}"
    job.say(f"yafsdp {yafsdp.__version__} | {job.name} | {job.world} rank(s) on {job.env.nodes} node(s) | "
             f"{job.device.type} ({job.env.backend}) | {dtype} compute, fp32 master | ZeRO-{a.zero_stage}{ac}")
    job.say(f"flags    {non_default_flags(a, job.parse_args)}")
    if getattr(job, "ckpt_choice", None) is not None:
        job.say(job.ckpt_choice.format())
    preset = f"--init-from-hf {a.init_from_hf}" if a.init_from_hf else f"preset {a.preset}"
    c = job.shape
    job.say(f"model    {preset}: LlamaForCausalLM {P.fmt_count(job.n_params)} params ({c['num_hidden_layers']} "
             f"layers x {c['hidden_size']}, vocab {c['vocab_size']}); {units} flat units, {job.built}")
    job.say(f"init     {job.init_desc}")
    job.say(f"data     {job.describe_data()}")
    total = max(0, a.steps - job.step)
    if a.export_only:
        steps = f"export only (--export-only): no training, the weights of step {job.step}"
    elif total == 0:
        steps = f"nothing to train: the checkpoint is at step {job.step}, --steps is {a.steps}"
    else:
        epochs = f"{total * gb / job.batches.windows:.1f} epochs" if job.batches.windows else "streamed"
        steps = f"steps {job.step} -> {a.steps} ({P.fmt_count(total * job.batch.tokens)} tokens, {epochs})"
    b = job.batch
    job.say(f"batch    {b.per_rank} seq x {b.ranks} ranks x {b.accum} accum = {gb} seq = {b.tokens:,} tokens/step; "
            f"{steps}")
    job.say(f"optim    {job.opt_name}: lr {a.lr:g} (warmup {a.warmup}, cosine to {a.lr * a.min_lr_ratio:g} at "
             f"step {a.decay_steps}), weight decay {job.opt.param_groups[0]['weight_decay']:g}, clip {a.grad_clip:g}")
    mem = sum(m.allocated_bytes().values())
    job.say(f"memory   engine allocations per rank: {mem / 2**20:.1f} MiB "
             f"(model {4 * job.n_params / 2**20:.1f} MiB in fp32, unsharded)")
    mfu = f"MFU against {job.peak_from}" if job.peak else f"MFU n/a ({job.peak_from})"
    job.say(f"perf     {job.flops_per_token / 1e6:.2f} MFLOP/token (6 N + 12 L H S); {mfu}")
    every = f"every {a.save_every} steps and at the end" if a.save_every else "at the end"
    tb = f", TensorBoard {a.tensorboard}" if job.outputs.tb.writer is not None else ""
    job.say(f"out      {a.out}: metrics.jsonl, loss.png, checkpoints/ ({every}, keep {a.keep}){tb}")
    if job.outputs.tb.problem:
        job.say(f"note     {job.outputs.tb.problem}")
    if job.main and job.run_dir.lock.note:
        job.say(f"note     {job.run_dir.lock.note}")
    for note in job.plan.notes:
        job.say(f"note     {note}")
    if job.run_dir.rewound:
        r = job.run_dir.rewound
        job.say(f"rewind   back to step {r['step']}: the continuation after it ({job.plan.rewind.what}) "
                 f"is set aside in {r['set_aside']} (moved, nothing deleted; recorded in events.jsonl)")
    if job.changes:
        job.say(f"note     settings changed from the checkpoint's: {R.describe_changes(job.changes)}; "
                 "recorded in events.jsonl")
    for path in job.plan.foreign:
        job.say(f"note     skipped {path}: no {C.MANIFEST}, not a complete checkpoint (not used by --resume, "
                 "left in place)")
    if getattr(job, "data_resume", None):
        job.say(f"data     {job.data_resume}")
    if job.resumed_from and job.resumed_from[2] not in (None, gb) and not a.export_only:
        job.say(f"note     the checkpoint's global batch was {job.resumed_from[2]} sequences, this run's is {gb}: "
                 "the data order continues, the step contents differ")
    if a.steps > a.decay_steps:
        job.say(f"note     --steps {a.steps} > --decay-steps {a.decay_steps}: the learning rate stays at "
                 f"{a.lr * a.min_lr_ratio:g} after step {a.decay_steps}")




def metrics_row(job, lr: float, outcome, dt: float) -> tuple[dict, tuple]:
    """The metrics.jsonl row of the step just taken (``outcome``: its ``StepOutcome``, ``dt`` its
    seconds), and the progress bar's (memory GB, tokens/s per device, MFU) unrounded."""
    mem = P.peak_memory_gb(job.device)
    tok_s_dev = job.batch.tokens / dt / job.batch.ranks
    mfu = job.flops_per_token * tok_s_dev / (job.peak * 1e12) if job.peak else None
    row = dict(step=job.step, loss=outcome.loss, lr=lr, grad_norm=outcome.grad_norm,
               tokens=job.tokens_seen, tokens_per_s=round(job.batch.tokens / dt, 1),
               tokens_per_s_per_device=round(tok_s_dev, 1), mfu=round(mfu, 5) if mfu is not None else None,
               step_time_s=round(dt, 4), mem_gb=round(mem, 4),
               epoch=round(job.batches.epoch_of(job.cursor), 4))
    if outcome.skipped:
        row["skipped"] = True
    if outcome.replicas is not None:  # --torchft: the replica groups that took the step
        row["replicas"] = outcome.replicas
    return row, (mem, tok_s_dev, mfu)


def export(job):
    from yafsdp.hf import export_hf

    a = job.args
    dtype = torch.bfloat16 if a.export_dtype == "bfloat16" else torch.float32
    t0 = time.perf_counter()
    probe = torch.arange(min(32, a.seq_len), device=job.device).view(1, -1) % job.shape["vocab_size"]
    with torch.no_grad():
        ours = job.model(input_ids=probe, use_cache=False).logits
    if hasattr(ours, "full_tensor"):  # --tp with --loss-parallel: the logits are split over the vocabulary
        ours = ours.full_tensor()
    ours = ours.float().cpu()
    tok = job.tokenizer if isinstance(job.tokenizer, (D.ByteTokenizer, D.HFTokenizer)) else None
    # The exported config names the tokenizer's special tokens (generate() and pipelines read
    # them). Set here, not at build time: a pad_token_id in the training config would make HF
    # build the embedding with padding_idx, which changes nothing numerically for this data
    # but is not what the checkpoint was trained with.
    cfg = job.model.module.config
    for key in ("pad", "bos", "eos"):
        tid = getattr(job.tokenizer, f"{key}_id", None)
        if tid is not None:
            setattr(cfg, f"{key}_token_id", int(tid))
    export_hf(job.model, a.export_hf, dtype=dtype, tokenizer=tok, max_shard_size=shard_size(a))
    check = None
    if job.main and job.n_params <= 200_000_000:  # reload on rank 0 and compare the logits
        from transformers import LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf, info = LlamaForCausalLM.from_pretrained(a.export_hf, output_loading_info=True, dtype=torch.float32)
        with torch.no_grad():
            theirs = hf(input_ids=probe.cpu()).logits.float()
        check = dict(missing=len(info["missing_keys"]), unexpected=len(info["unexpected_keys"]),
                     max_abs_diff=float((theirs - ours).abs().max()))
    job.outputs.event(dict(event="export", path=a.export_hf, dtype=a.export_dtype, check=check,
                           seconds=round(time.perf_counter() - t0, 3)))
    return a.export_hf, check


def summary(job, sample, exported):
    a = job.args
    st = job.step_times
    if st:
        med = sorted(st)[len(st) // 2]
        tps = job.batch.tokens / med
        mfu = job.flops_per_token * tps / job.batch.ranks / (job.peak * 1e12) if job.peak else None
        job.say(f"done     {job.trained_steps} steps in {P.fmt_time(job.train_time)} (median {med * 1e3:.0f} ms/step, "
                 f"{tps:,.0f} tokens/s = {tps / job.batch.ranks:,.0f} per device, MFU {P.fmt_mfu(mfu)}, peak memory "
                 f"{P.peak_memory_gb(job.device):.2f} GB on rank 0); step {job.step}/{a.steps}")
        val = f"; val {job.val_loss:.4f}" if job.val_loss is not None else ""
        start = job.step - job.trained_steps
        job.say(f"loss     {P.loss_windows(job.losses_before, job.session_losses, start, job.step)}{val} "
                 f"(nats/token; uniform guess {math.log(job.shape['vocab_size']):.2f})")
    elif a.export_only:
        job.say(f"done     export only: the weights of step {job.step} ({job.plan.resume_path})")
    else:
        job.say(f"done     nothing to train: already at step {job.step} (--steps {a.steps})")
    if job.stopped_by:
        job.say(f"stopped  by {job.stopped_by} at step {job.step}; checkpoint {job.saver.last_good()}; "
                 "continue with --resume")
    if sample is not None:
        job.say("sample   " + repr(sample[:300]))
    if exported:
        path, check = exported
        extra = ""
        if check:
            extra = (f"; reloaded with from_pretrained: {check['missing']} missing, {check['unexpected']} unexpected "
                     f"keys, max |logit diff| {check['max_abs_diff']:.2e}")
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors")) if job.main else []
        weights = files[0] if len(files) == 1 else f"{len(files)} safetensors files + model.safetensors.index.json"
        job.say(f"export   {path}: config.json + {weights} ({a.export_dtype}){extra}")
    if not a.export_only:
        last = job.saver.last if job.saver.last is not None else "(no checkpoint)"
        job.say(f"files    {job.outputs.metrics_path}, {job.outputs.png_path}, {last}")
    for path in job.saver.pinned:  # [Note: loss spikes] in faults.py
        job.say(f"pinned   {path}: the newest checkpoint before a skip streak; --keep leaves it (delete it by hand)")


def close(job, sample, exported) -> None:
    """Rank 0, at the end of a run that trained: the plot, the summary, the closing event; the files closed."""
    a, out = job.args, job.outputs
    P.plot_loss(out.metrics_path, out.png_path,
                title=f"{a.preset if not a.init_from_hf else 'from HF'}: {P.fmt_count(job.n_params)} params, "
                      f"{job.world} ranks", final_val=(job.step, job.val_loss), events_path=out.events_path)
    job.summary(sample, exported)
    out.event(dict(event="stopped" if job.stopped_by else "end", step=job.step, loss=job.last_loss,
                   val_loss=job.val_loss))
    out.close()
