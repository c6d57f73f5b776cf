"""The job under ``--torchft``: this torchrun is one replica group of a torchft run
(``ReplicaGroups``, around yafsdp.integrations.torchft.FaultTolerantReplicas).

[Note: the job under torchft]
Each replica group is one torchrun of the job with ``--torchft --replica-group G --replica-groups R``
and its own ``--out``; its ranks shard the model as a flat run does, torchft averages the grad
shards across the live groups (docs/hsdp.md; [Note: torchft replicas] in
yafsdp/integrations/torchft.py). A step of the job:

- the quorum first (``begin``): a group behind the quorum's step -- restarted, or new -- takes the
  live state from a group at that step, shard rank from shard rank: the weights, the optimizer
  state, torchft's step, and the job's state (``job_state``: the step, the data cursor, the tokens
  seen, the loss guard's history and skip streak, this rank's RNG states). Its step, learning
  rate and data are then those of the run;
- the data: the run's global batch is R x S x --batch-size x --grad-accum windows (S: the ranks
  of a group), laid out as a flat run of R x S ranks lays it out, and rank s of group G reads the
  part of rank G x S + s. With every group in the quorum the run reads, and averages, exactly
  what ``--hsdp R`` over R x S ranks does (the losses agree up to the order of float sums). A step
  at a smaller quorum trains on the live groups' parts only: the missing groups' windows of that
  step are never trained on (the cursor advances by the whole global batch at every committed
  step), and the tokens-seen counter adds the live groups' tokens only;
- the verdicts (``agree``): the loss, the NaN/inf flag and the stop flag are summed over the
  quorum after the group's own all-reduce, so the step's loss is the mean over every rank of the
  quorum and every group skips, spikes or stops alike;
- the commit (``commit``): torchft's ``should_commit``; only a committed step moves the run: the
  optimizer steps (unless every group skips it), and the job advances its step, data cursor,
  tokens seen, learning-rate schedule and loss guard. A step the quorum does not commit (an
  all-reduce failed: a group died or hung past --torchft-timeout) leaves all of them as they
  were, and the job takes the same step again -- the same step number, the same data -- at the
  next quorum.

Every group writes its own ``--out`` (metrics, events, checkpoints): after a committed step every
group holds the same state, so any group's checkpoint is the run's, and a whole-run restart resumes
each group from its own. A stop signal on any rank of any group stops every group at the same step
(each saves); to take one group out, kill it.
"""
from __future__ import annotations

import math
import time

import torch

from pretrain.ops import JobError
from pretrain.saving import get_rng_state, set_rng_state


class ReplicaGroups:
    """This torchrun's side of the run's replica groups (see [Note: the job under torchft]); made by
    ``Setup.build`` after the model and the optimizer, on every rank."""

    def __init__(self, job):
        from yafsdp.integrations.torchft import FaultTolerantReplicas, TorchFTError

        a = job.args
        self.job = job
        self.group, self.groups = a.replica_group, a.replica_groups
        self.participants = self.groups  # groups in the current step's quorum
        self.recovered: tuple[int, int] | None = None  # (step before, step after) of a state taken at this quorum
        # The first quorum of a launch waits for every group (see begin), in tries of WAIT_TRY_S: the count
        # of tries, not a clock, ends the wait, so every rank of the group ends it at the same quorum.
        self.wait_tries = 0 if job.env.restart_count > 0 else math.ceil(a.torchft_wait / self.WAIT_TRY_S)
        try:
            self.ft = FaultTolerantReplicas(job.model, job.opt, replica_group=self.group, timeout=a.torchft_timeout,
                                            extra_state=self.job_state, load_extra_state=self.load_job_state)
        except TorchFTError as e:
            raise JobError(str(e)) from None

    # ------------------------------------------------------------------------- the live state
    def job_state(self) -> dict:
        """What a restarted group takes from this one besides the weights and the optimizer (this
        rank's part; called by torchft's quorum thread while the job waits in ``begin``)."""
        j = self.job
        return dict(step=j.step, cursor=j.cursor, tokens=j.tokens_seen, loss_history=list(j.guard.recent),
                    skipped_steps=j.skipped_steps, skipped_in_row=j.skipped_in_row, spikes_seen=j.spikes_seen,
                    rng=get_rng_state(j.device), order=j.batches.order)

    def load_job_state(self, st: dict) -> None:
        j = self.job
        self.recovered = (j.step, int(st["step"]))
        j.step, j.cursor, j.tokens_seen = int(st["step"]), int(st["cursor"]), int(st["tokens"])
        j.guard.recent = [float(x) for x in st["loss_history"]]
        j.skipped_steps, j.skipped_in_row, j.spikes_seen = st["skipped_steps"], st["skipped_in_row"], st["spikes_seen"]
        set_rng_state(st["rng"], j.args.seed, j.rank, j.step, j.device)
        if st["order"] != j.batches.order:  # the live group resumed a run begun in an older window order
            for b in (j.batches, j.val):
                if b is not None:
                    b.use_order(st["order"])

    # ------------------------------------------------------------------------------- the step
    WAIT_TRY_S = 0.2

    def begin(self) -> None:
        """Before the step's first forward: the quorum (a group behind takes the live state here).
        The first quorum of a launch (not of a torchrun restart) is taken again until every group is
        in it, for up to --torchft-wait seconds: a quorum that is not followed by a commit moves
        nothing, and the groups start together instead of the first one training alone while the
        others start up."""
        self.recovered = None
        self.ft.start_step()
        while self.ft.participants < self.groups and self.wait_tries > 0:
            self.wait_tries -= 1
            time.sleep(self.WAIT_TRY_S)
            self.ft.start_step()
        self.wait_tries = 0
        self.participants = self.ft.participants
        if self.job.step != self.ft.step_count:
            raise JobError(f"replica group {self.group} is at step {self.job.step} but torchft's quorum at step "
                           f"{self.ft.step_count}: the job's state and torchft's step went apart")

    def agree(self, stats: torch.Tensor) -> int:
        """``stats`` (the group's sums: loss, stop flags, NaN/inf flags) summed over the quorum's
        groups in place; returns the ranks they sum over."""
        self.ft.sum_across_groups(stats)
        return self.participants * self.job.world

    def commit(self, update: bool) -> bool:
        """``should_commit``; the optimizer steps on a commit when ``update`` (not a skipped step)."""
        return self.ft.step(update=update)

    def step_tokens(self, tokens: int) -> int:
        """Of a global batch of ``tokens``, those the step's quorum trained on."""
        return tokens // self.groups * self.participants

    # -------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        return self.ft.state_dict()

    def resumed(self, state: dict | None, step: int) -> None:
        """After the job loaded a checkpoint of ``step`` (its ``state``) or initialised step 0:
        torchft's step is the job's (a checkpoint of a run without --torchft holds none)."""
        ft_state = (state or {}).get("torchft")
        if ft_state is None or ft_state["manager"]["step"] != step:
            ft_state = {"manager": {"step": step, "batches_committed": 0}}
        self.ft.load_state_dict(ft_state)

    def shutdown(self) -> None:
        self.ft.shutdown()
