"""The pretraining job (``examples/pretrain_llama.py``): the stages of a run, the training loop and
``Job.train_step`` (one optimizer step). ``examples/finetune_lora.py`` builds on the same code (its own
flags, data and model set-up; the same checkpoints, resume, metrics, plots and errors). Beside it:
``args.py`` (the flags), ``outputs.py`` (what the job writes and prints), ``saving.py`` (its
checkpoints), ``rundir.py`` (the run directory), ``data.py``, ``progress.py``, ``ops.py``."""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from pretrain import outputs as O  # examples/pretrain (the job script's directory is on sys.path)
from pretrain import progress as P
from pretrain import rundir as R
from pretrain import saving as S
from pretrain.args import build_parser, check_args, lr_at, parse_args, shard_size  # noqa: F401 - their home was here
from pretrain.ops import Diverged, JobError, OutLock, StopSignal, init_distributed, shutdown_distributed
from pretrain.rundir import describe_run, plan_output  # noqa: F401 - their home was here
from pretrain.saving import get_rng_state, set_rng_state  # noqa: F401 - their home was here
from pretrain.setup import SHAPE_KEYS, Setup, causal_lm_loss, make_optimizer, model_config  # noqa: F401


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
        self.lock = OutLock(args.out) if self.main else None  # rank 0 holds it for the job
        self.reported: set[str] = set()  # checkpoint notes already printed

    def take_lock(self) -> None:
        """Collective: rank 0 locks --out (once); a job already there stops every rank."""
        R.take_out_lock(self)

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
        """From here on files are written (rank 0): see outputs.open_output."""
        O.open_output(self)

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
            self.last_checkpoint = self.plan["resume_path"]
            return
        stop = StopSignal().install()
        bar = P.Bar(self.main and not a.no_progress, a.steps, self.step)
        self.first_loss = self.last_loss = None
        self.val_loss = None
        self.stopped_by = None
        last_saved = self.step if self.plan["resume_path"] else -1
        t_start = time.perf_counter()
        start_step = self.step
        step_times = []
        self.session_losses = []
        self.skipped_steps = 0
        self.skipped_in_row = 0  # consecutive non-finite steps
        self.losses_before = [r["loss"] for r in P.read_jsonl(self.metrics_path)] if self.main else []
        if self.main:
            kind = "resume" if self.plan["resume_path"] else "start"
            self.events.write(dict(event=kind, step=self.step, world=self.world, restart=self.env.restart_count,
                                   checkpoint=self.plan["resume_path"], optimizer=self.opt_name))
            if self.changes:  # accepted by --allow-change, or free; see [Note: settings a resume keeps]
                self.events.write(dict(event="settings_changed", step=self.step, checkpoint=self.plan["resume_path"],
                                       changes=self.changes))
        try:
            while self.step < a.steps:
                t0 = time.perf_counter()
                lr = lr_at(a, self.step + 1)
                outcome = self.train_step(lr, stop)
                self.step += 1
                self.cursor += a.batch_size * self.world * a.grad_accum
                self.tokens_seen += self.tokens_per_step
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
                    self.save(bar)
                    last_saved = self.step
                S.poll(self, bar)
        except BaseException:
            S.drain(self, bar, quiet=True)  # the write in flight ends before the exception goes on
            raise
        else:
            S.drain(self, bar)
        finally:
            bar.close()
            stop.uninstall()
        self.train_time = time.perf_counter() - t_start
        self.trained_steps = self.step - start_step
        self.step_times = step_times
        if self.stopped_by and self.main:
            self.events.write(dict(event="signal", signal=self.stopped_by, step=self.step))
        if self.step != last_saved and (self.trained_steps > 0 or not self.plan["resume_path"]):
            self.save(None)

    def train_step(self, lr: float, stop: StopSignal) -> "StepOutcome":
        """One optimizer step at learning rate ``lr``: forward and backward of ``--grad-accum``
        micro-batches, clipping, the agreement of every rank on the step (``agree_on_step``), then
        the optimizer step -- none when the loss or the grad norm is NaN/inf on some rank."""
        a, opt = self.args, self.opt
        for group in opt.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        for micro in range(a.grad_accum):
            x = self.batches.micro_batch(self.cursor, micro, self.rank, self.world, a.batch_size)
            if int(x.max()) >= self.shape["vocab_size"]:
                raise JobError(f"--data holds token id {int(x.max())} >= vocab {self.shape['vocab_size']}")
            loss = self.loss(x.to(self.device, non_blocking=True))
            (loss / a.grad_accum).backward()
            total += loss.detach().float()
        norm = self.model.clip_grad_norm_(a.grad_clip if a.grad_clip > 0 else float("inf"))
        outcome = agree_on_step(total / a.grad_accum, norm, stop, self.world, self.device)
        if not outcome.skipped:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return outcome

    def record_step(self, bar, lr: float, outcome: "StepOutcome", dt: float) -> None:
        """The step's metrics row (and validation loss every --eval-every steps), the bar, the losses
        the summary reports."""
        a = self.args
        row, (mem, tok_s_dev, mfu) = O.metrics_row(self, lr, outcome, dt)
        if not outcome.skipped:
            if self.first_loss is None:
                self.first_loss = outcome.loss
            self.last_loss = outcome.loss
            self.session_losses.append(outcome.loss)
        if self.val is not None and a.eval_every and self.step % a.eval_every == 0:
            row["val_loss"] = self.val_loss = round(self.evaluate(), 6)
        if self.main:
            self.metrics.write(row)
            self.tb.write(row)
        bar.update(outcome.loss, self.tokens_per_step / dt, dt, mem, tok_s_dev, mfu)

    def on_skipped(self, bar, lr: float, outcome: "StepOutcome") -> None:
        """A non-finite step was skipped on every rank: count it, say so, and stop the run (exit 3)
        after --max-skipped-steps in a row ([Note: non-finite steps])."""
        a = self.args
        self.skipped_steps += 1
        self.skipped_in_row += 1
        in_row, loss_val, grad_norm = self.skipped_in_row, outcome.loss, outcome.grad_norm
        last = getattr(self, "last_checkpoint", None) or "none yet"
        if self.main:
            self.events.write(dict(event="skipped", step=self.step, loss=loss_val, grad_norm=grad_norm))
        if in_row >= a.max_skipped_steps:
            if self.main:
                self.events.write(dict(event="diverged", step=self.step, skipped=in_row))
            raise Diverged(
                f"training diverged: the loss or grad norm was NaN/inf for {in_row} steps in a row (steps "
                f"{self.step - in_row + 1}-{self.step}, lr {lr:g}; last loss {loss_val}, grad norm "
                f"{grad_norm}); the weights are those of step {self.step - in_row}, no checkpoint holds a "
                f"non-finite value; last checkpoint: {last}. "
                "Resume from it with a lower --lr or a longer --warmup (or raise --max-skipped-steps)")
        msg = (f"skipped  step {self.step}: loss {loss_val:.4g}, grad norm {grad_norm:.4g} (not finite); "
               f"no optimizer step ({in_row} in a row, stop at {a.max_skipped_steps})")
        if self.main:
            bar.write(msg)

    def save(self, bar):
        """Collective: this step's checkpoint (see saving.checkpoint)."""
        S.checkpoint(self, bar)

    def check_finite(self) -> None:
        S.check_finite(self)

    @torch.no_grad()
    def evaluate(self) -> float:
        a = self.args
        total = torch.zeros((), device=self.device)
        for i in range(a.eval_batches):
            x = self.val.micro_batch(0, i, self.rank, self.world, a.batch_size).to(self.device)
            total += self.loss(x).float()
        dist.all_reduce(total)
        return total.item() / (a.eval_batches * self.world)

    @torch.no_grad()
    def sample(self, n_tokens: int) -> str:
        """Collective: sample ``n_tokens`` tokens after ``--prompt`` (temperature 0.8, seeded)."""
        a, tok = self.args, self.tokenizer
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
        n_sample = a.sample_tokens if a.sample_tokens is not None else (120 if self.n_params < 1e9 else 0)
        readable = a.tokenizer is not None or not (a.data or "").endswith(".bin")  # else: ids of an unknown tokenizer
        if n_sample > 0 and readable and not self.stopped_by and self.trained_steps > 0:
            sample = self.sample(n_sample)
        exported = None
        if a.export_only:
            exported = self.export()
            if self.main:
                self.summary(None, exported)
                self.events.close()
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
        return O.export(self)

    def summary(self, sample, exported):
        O.summary(self, sample, exported)


# --------------------------------------------------------------------------------------- helpers
@dataclass
class StepOutcome:
    """What every rank agreed on about one step (``agree_on_step``)."""

    loss: float  # the mean loss over every rank's micro-batches
    grad_norm: float  # the global grad norm (before clipping)
    skipped: bool  # the loss or the grad norm was NaN/inf on some rank: no optimizer step
    stop: bool  # a stop signal arrived on some rank


def agree_on_step(mean: torch.Tensor, norm, stop: StopSignal, world: int, device) -> StepOutcome:
    """Collective: the step's loss, grad norm, non-finite verdict and stop flag, the same on every rank.

    [Note: non-finite steps] One all-reduce (the step's only host sync) carries the loss, a stop
    signal, "this rank's loss or the grad norm is NaN/inf" and the norm, and it comes before the
    optimizer step: every rank skips a bad step together (no update, gradients dropped) instead of
    writing NaN into the weights, the optimizer state and then every checkpoint. --max-skipped-steps
    in a row stop the run (exit 3)."""
    norm = torch.as_tensor(norm, device=device).detach().float()
    bad = torch.logical_not(torch.isfinite(mean) & torch.isfinite(norm)).float()
    stats = torch.stack([mean, torch.tensor(float(stop.signum is not None), device=device), bad, norm])
    dist.all_reduce(stats)
    loss_sum, n_stop, n_bad, norm_sum = stats.tolist()
    return StepOutcome(loss=loss_sum / world, grad_norm=norm_sum / world,  # the same global norm on every rank
                       skipped=n_bad > 0, stop=n_stop > 0)

def main(argv=None, job_cls=Job) -> int:
    """Run ``job_cls`` through its stages; a JobError (every rank together) is one line on stderr
    and the exit status of its kind."""
    prog = f"{job_cls.name}.py"
    args = job_cls.parse_args(argv)
    try:
        env = init_distributed(args.device)
    except JobError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: error: {e}", file=sys.stderr)
        return e.exit_code
    code = 0
    job = None
    try:
        job = job_cls(args, env)
        job.run()
        dist.barrier()  # see [Note: teardown before exit]
    except JobError as e:  # raised on every rank together (see agree); printed once
        if env.rank == 0:
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        code = e.exit_code
        dist.barrier()  # every rank raises a JobError together; see [Note: teardown before exit]
    finally:
        if job is not None and job.lock is not None:
            job.lock.release()
        job = None
        shutdown_distributed()
    return code
