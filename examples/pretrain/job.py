"""The pretraining job (``examples/pretrain_llama.py``): the stages of a run, the training loop and
``Job.train_step`` (one optimizer step). ``examples/finetune_lora.py`` builds on the same code (its own
flags, data and model set-up; the same checkpoints, resume, metrics, plots and errors). Beside it:
``args.py`` (the flags), ``outputs.py`` (what the job writes and prints), ``saving.py`` (its
checkpoints), ``rundir.py`` (the run directory), ``data.py`` and ``stream.py`` (the data), ``instructions.py`` (the
fine-tuning jobs' examples), ``progress.py``, ``ops.py``."""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from pretrain import faults as F
from pretrain import outputs as O  # examples/pretrain (the job script's directory is on sys.path)
from pretrain import progress as P
from pretrain import rundir as R
from pretrain import saving as S
from pretrain.args import build_parser, check_args, lr_at, parse_args, shard_size  # noqa: F401 - their home was here
from pretrain.ops import Diverged, JobError, StopSignal, init_distributed, shutdown_distributed
from yafsdp.comm.progress import POSITION
from pretrain.saving import get_rng_state, set_rng_state  # noqa: F401 - their home was here
from pretrain.setup import SHAPE_KEYS, BatchShape, Setup, causal_lm_loss, make_optimizer, model_config  # noqa: F401


# ------------------------------------------------------------------------------------------- job
class Job(Setup):
    """The pretraining job's stages (prepare, build, initialise, open_output, header, train, finish);
    a job built on it overrides the stages that differ (see examples/finetune_lora.py)."""

    name = "pretrain_llama"  # the header's job name; errors are printed as "<name>.py: error: ..."
    built = "built on meta"  # how make_model makes the model (the header's model line)

    @staticmethod
    def parse_args(argv=None) -> argparse.Namespace:
        return parse_args(argv)

    def __init__(self, args, env):
        self.args, self.env = args, env
        self.rank, self.world, self.device = env.rank, env.world, env.device
        self.main = env.rank == 0
        self.run_dir = R.RunDir(args.out, self.main)  # the lock (rank 0), the plan, a rewind
        # one step's batch; under --torchft the run's, over every replica group ([Note: the job under torchft])
        groups = args.replica_groups if getattr(args, "torchft", False) else 1
        # --tp N: the TP ranks of one data-parallel rank (N consecutive ranks) read the same part of a batch
        self.tp = getattr(args, "tp", 1)
        self.dp_rank, self.dp_world = env.rank // self.tp, env.world // self.tp
        self.batch = BatchShape(args.batch_size, self.dp_world * groups, args.grad_accum, args.seq_len)
        self.data_rank = env.world * args.replica_group + env.rank if groups > 1 else self.dp_rank  # its part of a batch
        self.ft = None  # --torchft: pretrain.torchft_groups.ReplicaGroups (made by build)
        self.outputs: O.Outputs | None = None  # the run's files and lines (open_output)
        self.saver: S.Saver | None = None  # the run's checkpoints (open_output)
        self.wd = None  # the watchdog, set by main (watch)
        self.in_step = False  # inside train_step: step_now() is the step being taken
        self.step = 0
        self.faults = F.Faults(os.environ.get("YAFSDP_JOB_FAULT"), env.rank, env.restart_count)
        self.guard = F.LossGuard(args.loss_spike, action=args.on_spike)
        self.stragglers = F.Stragglers(env.world)

    def watch(self, wd) -> None:
        """The watchdog ``wd`` reports this job's phases, and a hang or another rank's error reaches
        the job (``faults.attach``)."""
        self.wd = wd
        F.attach(self, wd)

    def mark(self, phase: str, timeout: float | None = None) -> None:
        """This rank enters ``phase`` (the watchdog's report; [Note: fault injection])."""
        if self.wd is not None:
            self.wd.set_phase(phase, timeout)
        self.faults.at(self.step_now(), phase)

    def step_now(self) -> int:
        """The step being taken (inside ``train_step``), else the last one taken (its save, its eval)."""
        return self.step + 1 if self.in_step else self.step

    def say(self, msg: str) -> None:
        if self.main:
            print(msg, flush=True)

    def run(self):
        self.prepare()
        self.build()
        self.initialise()
        self.open_output()
        self.header()
        self.train()
        self.finish()

    def open_output(self):
        """From here on files are written (rank 0): the run's files (``Outputs``) and its checkpoints
        (``Saver``)."""
        a = self.args
        self.t_session = time.perf_counter()
        self.outputs = O.Outputs(a.out, self.main, a.tensorboard, a.export_only)
        self.outputs.open(self.plan, self.step, None if a.export_only else O.run_record(self))
        self.saver = S.Saver(self.model, self.opt, self.device, ck_root=self.plan.ck_root, keep=a.keep,
                             background=a.async_save, outputs=self.outputs, resumed_from=self.plan.resume_path,
                             writer_timeout=a.save_timeout)

    def header(self):
        O.header(self)

    # --------------------------------------------------------------------------------- the loop
    def train(self):
        """The loop: one ``train_step`` per optimizer step, then the non-finite guard's count, the
        metrics, a stop signal and the periodic saves."""
        a = self.args
        if a.export_only:
            self.first_loss = self.last_loss = self.val_loss = self.stopped_by = None
            self.train_time, self.trained_steps, self.step_times = 0.0, 0, []
            return
        self.guard.uniform = math.log(self.shape["vocab_size"])  # [Note: loss spikes] in faults.py
        stop = StopSignal().install()
        bar = P.Bar(self.main and not a.no_progress, a.steps, self.step)
        self.first_loss = self.last_loss = self.val_loss = self.stopped_by = None
        last_saved = self.step if self.plan.resume_path else -1
        t_start = time.perf_counter()
        start_step = self.step
        step_times = []
        self.session_losses = []
        self.skipped_steps = 0
        self.skipped_in_row = 0  # consecutive non-finite steps
        self.spikes_seen = 0
        self.losses_before = [r["loss"] for r in P.read_jsonl(self.outputs.metrics_path)] if self.main else []
        self.outputs.event(dict(event="resume" if self.plan.resume_path else "start", step=self.step,
                                world=self.world, restart=self.env.restart_count, checkpoint=self.plan.resume_path,
                                optimizer=self.opt_name))
        if self.changes:  # accepted by --allow-change, or free; see [Note: settings a resume keeps]
            self.outputs.event(dict(event="settings_changed", step=self.step, checkpoint=self.plan.resume_path,
                                    changes=self.changes))
        try:
            while self.step < a.steps:
                t0 = time.perf_counter()
                if self.ft is not None:  # the quorum; a restarted group takes the live state here
                    self.ft.begin()
                    if self.ft.recovered:
                        self.note(bar, f"rejoined step {self.step}: took the live state of the run from another "
                                       f"replica group (this group was at step {self.ft.recovered[0]})",
                                  dict(event="recovered", step=self.step, was=self.ft.recovered[0],
                                       replicas=self.ft.participants))
                    if self.step >= a.steps:
                        break
                lr = lr_at(a, self.step + 1)
                self.in_step = True  # (left set by an exception: its report names the step being taken)
                outcome = self.train_step(lr, stop)
                self.in_step = False
                if not outcome.committed:  # --torchft: nothing of this step counts; it is taken again
                    self.note(bar, f"retry    step {self.step + 1}: the quorum of {self.ft.participants} replica "
                                   "group(s) did not commit it (a group failed); taken again at the next quorum",
                              dict(event="uncommitted", step=self.step + 1, replicas=self.ft.participants))
                    continue
                self.step += 1
                if self.wd is not None:
                    self.wd.step(self.step)
                self.cursor += self.batch.sequences
                self.tokens_seen += self.batch.tokens if self.ft is None else self.ft.step_tokens(self.batch.tokens)
                dt = time.perf_counter() - t0
                step_times.append(dt)
                self.record_step(bar, lr, outcome, dt)
                if outcome.skipped:
                    self.on_skipped(bar, lr, outcome)  # --max-skipped-steps in a row: raises Diverged
                else:
                    self.skipped_in_row = 0
                if outcome.stop:
                    self.stopped_by = stop.name or "a signal on another rank"
                    break
                if a.save_every and self.step % a.save_every == 0 and self.step < a.steps:
                    if self.skipped_in_row:  # [Note: loss spikes]: never a checkpoint of a skip streak
                        self.note(bar, f"not saved step {self.step}: inside a streak of {self.skipped_in_row} "
                                       f"skipped step(s); the last checkpoint stays {self.saver.last_good()}",
                                  dict(event="save_deferred", step=self.step, skipped_in_row=self.skipped_in_row))
                    else:
                        self.save(bar)
                        last_saved = self.step
                self.saver.poll(bar)  # a background save that completed: "saved"
        except BaseException:
            self.saver.drain(bar, quiet=True)  # the write in flight ends before the exception goes on
            raise
        else:
            self.saver.drain(bar)
        finally:
            bar.close()
            stop.uninstall()
        self.train_time = time.perf_counter() - t_start
        self.trained_steps = self.step - start_step
        self.step_times = step_times
        if self.stopped_by:
            self.outputs.event(dict(event="signal", signal=self.stopped_by, step=self.step))
        if self.step != last_saved and (self.trained_steps > 0 or not self.plan.resume_path):
            if self.skipped_in_row:  # stopped by a signal inside a skip streak: the last good one stays
                self.note(None, f"not saved step {self.step}: inside a streak of {self.skipped_in_row} skipped "
                                f"step(s); the last checkpoint stays {self.saver.last_good()}",
                          dict(event="save_deferred", step=self.step, skipped_in_row=self.skipped_in_row))
            else:
                self.save(None)

    def train_step(self, lr: float, stop: StopSignal) -> "StepOutcome":
        """One optimizer step at learning rate ``lr``: forward and backward of ``--grad-accum``
        micro-batches, clipping, the agreement of every rank on the step (``agree_on_step``), then
        the optimizer step -- none when the loss or the grad norm is NaN/inf on some rank."""
        a, opt = self.args, self.opt
        for group in opt.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        t0, data_s, comm0 = time.perf_counter(), 0.0, POSITION.comm_wait_s
        for micro in range(a.grad_accum):
            td = time.perf_counter()
            self.mark("data")
            x = self.batches.micro_batch(self.cursor, micro, self.data_rank, self.batch.ranks, a.batch_size)
            x = self.faults.corrupt(x, self.shape["vocab_size"])
            if int(x.max()) >= self.shape["vocab_size"]:
                raise JobError(f"--data holds token id {int(x.max())} >= vocab {self.shape['vocab_size']} "
                               f"(micro-batch {micro} of step {self.step + 1} on rank {self.rank}; wrong "
                               "--tokenizer or --data-dtype, or a damaged file?)")
            data_s += time.perf_counter() - td
            with self.loss_context():  # --loss-parallel: the forward's loss and its backward on the logits' slices
                self.mark("forward")
                loss = self.loss(x.to(self.device, non_blocking=True))
                self.mark("backward")
                (loss / a.grad_accum).backward()
            total += plain(loss).detach().float()
        self.mark("optimizer")
        norm = self.model.clip_grad_norm_(a.grad_clip if a.grad_clip > 0 else float("inf"))
        comm_s = POSITION.comm_wait_s - comm0
        timing = (data_s, time.perf_counter() - t0 - data_s - comm_s, comm_s)
        outcome = agree_on_step(total / a.grad_accum, norm, stop, self.world, self.device, timing=timing,
                                rank=self.rank, guard=self.guard, groups=self.ft)
        if self.ft is None:
            if not outcome.skipped:
                opt.step()
        else:  # the quorum commits the step, or none of it counts ([Note: the job under torchft])
            outcome.committed = self.ft.commit(update=not outcome.skipped)
            if outcome.committed and not outcome.skipped:
                self.guard.good(outcome.loss)
        opt.zero_grad(set_to_none=True)
        return outcome

    def record_step(self, bar, lr: float, outcome: "StepOutcome", dt: float) -> None:
        """The step's metrics row (and validation loss every --eval-every steps), the bar, the losses
        the summary reports."""
        a = self.args
        row, (mem, tok_s_dev, mfu) = O.metrics_row(self, lr, outcome, dt)
        self.check_timing(bar, outcome, row)
        if outcome.spike and not outcome.skipped:
            self.note(bar, f"spike    step {self.step}: loss {outcome.loss:.4g}, {outcome.spike} (--on-spike warn: "
                           "trained on)",
                      dict(event="spike", step=self.step, loss=outcome.loss, median=outcome.median))
        if not outcome.skipped:
            if self.first_loss is None:
                self.first_loss = outcome.loss
            self.last_loss = outcome.loss
            self.session_losses.append(outcome.loss)
        if self.val is not None and a.eval_every and self.step % a.eval_every == 0:
            row["val_loss"] = self.val_loss = round(self.evaluate(), 6)
        self.outputs.row(row)
        bar.update(outcome.loss, self.batch.tokens / dt, dt, mem, tok_s_dev, mfu)

    def check_timing(self, bar, outcome: "StepOutcome", row: dict) -> None:
        """Every rank's data wait, compute and communication wait into the metrics row (up to 64
        ranks; the slowest and the median beyond), and a straggler named ([Note: stragglers])."""
        busy = [d + c for d, c, _ in outcome.timing]
        row.update(self.stragglers.columns(outcome.timing))
        for r in self.stragglers.check(busy):
            med = self.stragglers.median(busy)
            self.note(bar, f"straggler rank {r}: data + compute {busy[r] * 1e3:.0f} ms/step vs the median "
                           f"{med * 1e3:.0f} ms for {self.stragglers.patience} steps in a row (a slow host, "
                           "throttling, or its data?)",
                      dict(event="straggler", step=self.step, rank=r, busy_s=round(busy[r], 4),
                           median_s=round(med, 4)))

    def on_skipped(self, bar, lr: float, outcome: "StepOutcome") -> None:
        """A non-finite step was skipped on every rank: count it, say so, and stop the run (exit 3)
        after --max-skipped-steps in a row ([Note: non-finite steps])."""
        a = self.args
        self.skipped_steps += 1
        self.skipped_in_row += 1
        in_row, loss_val, grad_norm = self.skipped_in_row, outcome.loss, outcome.grad_norm
        self.spikes_seen += bool(outcome.spike)
        if in_row == 1:  # a skip streak begins: the newest checkpoint is kept beyond --keep
            self.saver.pin_newest(self.step, "spike" if outcome.spike else "non-finite", bar)
        why = f"a loss spike: {outcome.spike}" if outcome.spike else "not finite"
        self.outputs.event(dict(event="skipped", step=self.step, loss=loss_val, grad_norm=grad_norm,
                                reason="spike" if outcome.spike else "non-finite"))
        if in_row >= a.max_skipped_steps or (outcome.spike and a.on_spike == "stop"):
            self.outputs.event(dict(event="diverged", step=self.step, skipped=in_row, last_good=self.saver.last_good()))
            what = ("the loss or grad norm was NaN/inf or a spike" if self.spikes_seen else
                    "the loss or grad norm was NaN/inf")
            raise Diverged(
                f"training diverged: {what} for {in_row} steps in a row (steps "
                f"{self.step - in_row + 1}-{self.step}, lr {lr:g}; last loss {loss_val}, grad norm "
                f"{grad_norm}); the weights are those of step {self.step - in_row}, no checkpoint holds a "
                f"non-finite value; last good checkpoint: {self.saver.last_good()}. {self.rewind_hint()}")
        self.outputs.say(bar, f"skipped  step {self.step}: loss {loss_val:.4g}, grad norm {grad_norm:.4g} ({why}); "
                              f"no optimizer step ({in_row} in a row, stop at {a.max_skipped_steps})")

    def rewind_hint(self) -> str:
        """The command line that goes back to the last good checkpoint."""
        last = self.saver.newest()
        if not last:
            return "No checkpoint was written yet: start again with a lower --lr or a longer --warmup"
        lower = self.args.lr / 2
        return (f"Return to it with the same command plus: --resume {last} --rewind --lr {lower:g} (or a longer "
                f"--warmup; raise --max-skipped-steps or --loss-spike to tolerate more)")

    def note(self, bar, msg: str, event: dict | None = None) -> None:
        """One line of output (rank 0) and, where given, its events.jsonl record."""
        self.outputs.note(bar, msg, event)

    def save(self, bar):
        """Collective: this step's checkpoint (``bar`` None: the run's last save, never in the background)."""
        self.mark("save", self.args.save_timeout)
        state, meta = S.contents(self)
        self.saver.save(self.step, state, meta, bar)

    @torch.no_grad()
    def evaluate(self) -> float:
        a = self.args
        self.mark("eval")
        total = torch.zeros((), device=self.device)
        for i in range(a.eval_batches):  # --tp: the same batch on the TP ranks of a data-parallel rank
            x = self.val.micro_batch(0, i, self.dp_rank, self.dp_world, a.batch_size).to(self.device)
            with self.loss_context():
                total += plain(self.loss(x)).float()
        dist.all_reduce(total)
        return total.item() / (a.eval_batches * self.world)  # each TP rank holds its data-parallel rank's loss

    def loss_context(self):
        """Where the loss and its backward run: torch's ``loss_parallel()`` with --loss-parallel (the logits are
        DTensors split over the vocabulary), else nothing."""
        from yafsdp.integrations.tp_plans import loss_context

        return loss_context(getattr(self.args, "loss_parallel", False))

    @torch.no_grad()
    def sample(self, n_tokens: int) -> str:
        """Collective: sample ``n_tokens`` tokens after ``--prompt`` (temperature 0.8, seeded)."""
        a, tok = self.args, self.tokenizer
        self.mark("sample")
        ids = torch.as_tensor(tok.encode(a.prompt).astype(np.int64), device=self.device).view(1, -1)
        g = torch.Generator(device="cpu").manual_seed(a.seed)
        start = ids.shape[1]
        for _ in range(n_tokens):
            logits = self.model(input_ids=ids[:, -a.seq_len:], use_cache=False).logits[0, -1].float().cpu()
            nxt = torch.multinomial(torch.softmax(logits / 0.8, -1), 1, generator=g).to(self.device)
            dist.broadcast(nxt, src=0)  # every rank continues with rank 0's token
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            if tok.eos_id is not None and int(nxt) == tok.eos_id:
                break
        return a.prompt + tok.decode(ids[0, start:].tolist())

    def finish(self):
        a = self.args
        m = self.model
        if self.val is not None and self.trained_steps > 0 and not self.stopped_by:
            self.val_loss = self.evaluate()
        sample = None
        n_sample = a.sample_tokens if a.sample_tokens is not None else (120 if self.n_params < 1e9 and self.tp == 1
                                                                         else 0)  # --tp: see args.check_tp
        readable = a.tokenizer is not None or not (a.data or "").endswith(".bin")  # else: ids of an unknown tokenizer
        if n_sample > 0 and readable and not self.stopped_by and self.trained_steps > 0:
            sample = self.sample(n_sample)
        exported = None
        if a.export_only:
            exported = self.export()
            if self.main:
                self.summary(None, exported)
                self.outputs.close()
            return
        if not self.stopped_by:
            exported = self.write_exports()
        if self.main:
            O.close(self, sample, exported)
        del m

    def write_exports(self):
        """Collective: what a run that was not stopped writes at the end (here --export-hf); returns
        what ``summary`` reports."""
        a = self.args
        if not a.export_hf:
            return None
        if os.path.isdir(a.export_hf) and os.listdir(a.export_hf):
            self.say(f"export   {a.export_hf} already holds an export (restarted run): left as is")
            return None
        return self.export()

    def export(self):
        """Collective: --export-hf (see outputs.export)."""
        self.mark("export", self.args.save_timeout)
        return O.export(self)

    def summary(self, sample, exported):
        O.summary(self, sample, exported)


# --------------------------------------------------------------------------------------- helpers
def plain(t: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (--loss-parallel's is a replicated DTensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@dataclass
class StepOutcome:
    """What every rank agreed on about one step (``agree_on_step``)."""

    loss: float  # the mean loss over every rank's micro-batches
    grad_norm: float  # the global grad norm (before clipping)
    skipped: bool  # the loss or the grad norm was NaN/inf on some rank, or a loss spike: no optimizer step
    stop: bool  # a stop signal arrived on some rank
    spike: str = ""  # why the loss is a spike, "" if it is not ([Note: loss spikes] in faults.py)
    median: float | None = None  # that median
    timing: list | None = None  # per rank (data, compute, comm wait) seconds ([Note: stragglers])
    committed: bool = True  # --torchft: the quorum committed the step (else nothing of it counts)
    replicas: int | None = None  # --torchft: the replica groups in the step's quorum


def agree_on_step(mean: torch.Tensor, norm, stop: StopSignal, world: int, device, timing=(0.0, 0.0, 0.0),
                  rank: int = 0, guard: "F.LossGuard | None" = None, groups=None) -> StepOutcome:
    """Collective: the step's loss, grad norm, non-finite and spike verdicts, stop flag and every
    rank's timing, the same on every rank.

    [Note: non-finite steps] One all-reduce (the step's only host sync) carries the loss, a stop
    signal, "this rank's loss or the grad norm is NaN/inf", the norm and a slot per rank for its
    step timing, and it comes before the optimizer step: every rank skips a bad step together (no
    update, gradients dropped) instead of writing NaN into the weights, the optimizer state and then
    every checkpoint. --max-skipped-steps in a row stop the run (exit 3). A loss spike (see
    [Note: loss spikes] in faults.py) is judged on the agreed mean loss, so alike on every rank.

    ``groups`` (--torchft: the job's ``ReplicaGroups``): the loss, stop and NaN/inf sums are then
    summed over the quorum's replica groups too, so every group decides alike, and the guard is
    told of a good loss by the caller once the quorum has committed the step ([Note: the job under
    torchft])."""
    norm = torch.as_tensor(norm, device=device).detach().float()
    bad = torch.logical_not(torch.isfinite(mean) & torch.isfinite(norm)).float()
    slots = torch.zeros(3 * world, device=device)
    slots[3 * rank: 3 * rank + 3] = torch.tensor(timing, dtype=torch.float32)
    stats = torch.cat([torch.stack([mean, torch.tensor(float(stop.signum is not None), device=device), bad, norm]),
                       slots])
    dist.all_reduce(stats)
    ranks = world if groups is None else groups.agree(stats[:3])
    values = stats.tolist()
    loss_sum, n_stop, n_bad, norm_sum = values[:4]
    loss = loss_sum / ranks
    spike = guard.spike(loss) if n_bad == 0 and guard is not None else ""
    median = guard.median() if guard is not None else None
    skip = n_bad > 0 or (spike and guard.action != "warn")
    if guard is not None and not skip and groups is None:
        guard.good(loss)
    return StepOutcome(loss=loss, grad_norm=norm_sum / world,  # the same global norm on every rank
                       skipped=skip, stop=n_stop > 0, spike=spike, median=median,
                       timing=[values[4 + 3 * r: 7 + 3 * r] for r in range(world)],
                       replicas=None if groups is None else groups.participants)

def main(argv=None, job_cls=Job) -> int:
    """Run ``job_cls`` through its stages; a JobError (every rank together) is one line on stderr
    and the exit status of its kind."""
    prog = f"{job_cls.name}.py"
    args = job_cls.parse_args(argv)
    try:
        env = init_distributed(args.device, args.init_timeout)
    except JobError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: error: {e}", file=sys.stderr)
        return e.exit_code
    code = 0
    job = None
    wd = F.start_watchdog(args, env)  # see [Note: the watchdog] in yafsdp/tools/watchdog.py
    try:
        job = job_cls(args, env)
        job.watch(wd)
        job.run()
        dist.barrier()  # see [Note: teardown before exit]
    except BaseException as e:  # noqa: BLE001 - see [Note: one rank's error] in faults.py
        if isinstance(e, (SystemExit, KeyboardInterrupt)) and env.world == 1:
            raise
        if not F.all_ranks_raised(wd, env.world):  # some rank is elsewhere: it must hear of this one
            code = F.report_alone(prog, job, wd, e)
            if job is not None:
                job.run_dir.release()
            sys.stdout.flush()
            sys.stderr.flush()
            time.sleep(wd.poll + 0.5)  # the others' watchdogs read the error before a launcher tears them down
            os._exit(code)  # the others may be blocked in a collective with us: no teardown to wait for
        if not isinstance(e, JobError):
            raise
        if env.rank == 0:  # raised on every rank together (see agree); printed once
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        code = e.exit_code
        dist.barrier()  # every rank raises a JobError together; see [Note: teardown before exit]
    finally:
        wd.stop()
        if job is not None and job.ft is not None:
            job.ft.shutdown()  # torchft's manager server and checkpoint transport
        wd.on_hang = wd.on_error = None  # they hold the job (its model, the process group): [Note: teardown before exit] in ops.py
        if job is not None:
            job.close_data()
            job.run_dir.release()
        job = None
        shutdown_distributed()
    return code
