r"""HSDP replica groups under torchft: one replica group per torchrun, one lighthouse for the run.

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 --bind [::]:29510 &
    export TORCHFT_LIGHTHOUSE=http://localhost:29510
    torchrun --nproc-per-node 2 --master-port 29600 --max-restarts 2 examples/torchft_hsdp.py \
        --replica-group 0 --out /tmp/ft &
    torchrun --nproc-per-node 2 --master-port 29700 --max-restarts 2 examples/torchft_hsdp.py \
        --replica-group 1 --out /tmp/ft

Each replica group shards a small MLP over its own ranks (a flat YaFSDP); the gradient shards are
averaged across the groups through torchft's Manager ([Note: torchft replicas] in
yafsdp/integrations/torchft.py). Kill a group (``kill -9`` both its workers): the other goes on
alone, torchrun restarts the killed one, which takes the live state from the survivor and
rejoins. ``--die-at S`` / ``--stop-at S`` make this group SIGKILL / SIGSTOP both its workers in its
first attempt, after the backward of a step with every group in its quorum, once it has committed
S such steps (the tests' faults); ``--wait S`` starts the groups together (else the first one may train
alone while the others start up, and a run can end before a fault's step comes).

The run ends at the first step >= ``--steps`` whose last ``--together`` committed steps had all
``--replicas`` groups (so a restarted group has rejoined); each rank then writes its final state
to ``OUT/final_g<group>_r<rank>.pt``; rank 0 of each group logs every committed step to
``OUT/log_g<group>.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import yafsdp
import yafsdp.checkpoint
from yafsdp.integrations.torchft import FaultTolerantReplicas

LR, MAX_NORM, BATCH, DIM = 1e-2, 1.0, 4, 8


def build_model() -> nn.Module:
    torch.manual_seed(0)  # every group builds the same initial weights (torchft also syncs them at step 0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def batch(step: int, group: int, rank: int):
    """Rank ``rank`` of replica group ``group``'s batch at ``step``: a function of the three only, so
    a step run again (not committed) reads the same data, and the data position is the step."""
    g = torch.Generator().manual_seed(step * 1000 + group * 10 + rank)
    x = torch.randn(BATCH, DIM, generator=g)
    return x, torch.stack([x[:, :4].sum(1), x[:, 4:].prod(1)], 1)


def loss_fn(out, y):
    return (out - y).pow(2).mean()


def _init_group() -> None:
    """The replica group's own process group; under torchrun --max-restarts one store prefix per
    attempt, as the job does ([Note: one store per attempt] in examples/pretrain/ops.py)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo")
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"torchft_hsdp/attempt_{attempt}", base),
                            rank=rank, world_size=world)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replica-group", type=int, required=True)
    ap.add_argument("--replicas", type=int, default=2, help="replica groups of the run")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--together", type=int, default=3)
    ap.add_argument("--max-steps", type=int, default=3000, help="give up (exit 3) past this step")
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=10.0, help="cross-group collective / commit deadline (s)")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step (the tests pace the survivor)")
    ap.add_argument("--ckpt", default=None, help="checkpoint root: resume from its newest, save every --save-every")
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--wait", type=float, default=0.0,
                    help="the first quorum of a launch (not of a restart) is taken again, in tries of 0.2 s, until "
                         "every group is in it, for up to this many seconds: the groups start together")
    ap.add_argument("--die-at", type=int, default=None)
    ap.add_argument("--stop-at", type=int, default=None)
    args = ap.parse_args(argv)

    _init_group()
    rank, G = dist.get_rank(), args.replica_group
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"pid_g{G}_r{rank}"), "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()  # every pid file written before any rank may signal its peers

    model = yafsdp.YaFSDP(build_model())
    opt = make_optimizer(model.parameters())
    run = {"position": 0, "history": []}  # the data position and the participants of each committed step

    def load_extra(extra):
        run.clear()
        run.update(extra)

    ft = FaultTolerantReplicas(model, opt, replica_group=G, timeout=args.timeout,
                               extra_state=lambda: dict(run, history=list(run["history"])),
                               load_extra_state=load_extra)
    if args.ckpt and yafsdp.checkpoint.latest_checkpoint(args.ckpt):
        loaded = yafsdp.checkpoint.load_checkpoint(yafsdp.checkpoint.latest_checkpoint(args.ckpt), model, opt)
        ft.load_state_dict(loaded.state["torchft"])
        load_extra(loaded.state["run"])
    log = open(os.path.join(args.out, f"log_g{G}.jsonl"), "a") if rank == 0 else None
    code, together_here = 0, 0  # steps this attempt committed with every group
    # --wait: a quorum not followed by a commit moves nothing; the count of tries, not a clock, ends the wait, so
    # every rank of the group ends it at the same quorum
    wait_tries = int(args.wait / 0.2) if first_attempt else 0
    while True:
        ft.start_step()
        while ft.participants < args.replicas and wait_tries > 0:
            wait_tries -= 1
            time.sleep(0.2)
            ft.start_step()
        wait_tries = 0
        step = ft.step_count
        tail = run["history"][len(run["history"]) - args.together:]
        if step >= args.steps and len(tail) == args.together and all(n == args.replicas for n in tail):
            break
        if step >= args.max_steps:
            code = 3
            break
        x, y = batch(run["position"], G, rank)
        loss = loss_fn(model(x), y)
        loss.backward()
        fault = args.die_at if args.die_at is not None else args.stop_at
        if (first_attempt and fault is not None and together_here >= fault and ft.participants == args.replicas
                and rank == 0):
            sig = signal.SIGKILL if args.die_at is not None else signal.SIGSTOP
            peers = [int(open(os.path.join(args.out, f"pid_g{G}_r{r}")).read()) for r in range(dist.get_world_size())]
            for pid in sorted(peers, key=lambda p: p == os.getpid()):  # this process last
                os.kill(pid, sig)
        norm = model.clip_grad_norm_(MAX_NORM)  # runs the managed all-reduce first
        n = ft.participants
        if ft.step():
            together_here += n == args.replicas
            run["position"] += 1
            run["history"].append(n)
            if args.save_every and ft.step_count % args.save_every == 0 and ft.writes_checkpoints:
                yafsdp.checkpoint.save_checkpoint(args.ckpt, ft.step_count, model, opt,
                                                  state={"torchft": ft.state_dict(), "run": run})
            if log is not None:
                row = dict(step=step, group=G, n=n, loss=loss.item(), norm=float(norm), t=time.time())
                log.write(json.dumps(row) + "\n")
                log.flush()
        opt.zero_grad()
        if args.sleep:
            time.sleep(args.sleep)
    shards = [s.tensor.clone() for s in model._rt.stored_shards()]
    torch.save(dict(step=ft.step_count, position=run["position"], history=run["history"], shards=shards,
                    optim=opt.state_dict(), full=model.full_state_dict()),
               os.path.join(args.out, f"final_g{G}_r{rank}.pt"))
    if log is not None:
        log.close()
    dist.barrier()
    ft.shutdown()
    del model, opt
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from pretrain.ops import exit_fast

    exit_fast(main())  # sys.exit(main()), without the collector's pass over every object at exit
