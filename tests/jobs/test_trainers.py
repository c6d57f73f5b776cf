"""yafsdp under transformers.Trainer and TRL's SFTTrainer (yafsdp/integrations/trainer.py), world 2 on gloo.

One spawn runs the Trainer cases: the same run three ways — YaFSDPTrainer on a wrapped tiny Llama,
plain Trainer (accelerate's DDP) on the unsharded model, and the project's own loop on the wrapped
model over the same batches — fp32, weight_decay > 0 (large, so a norm decayed by mistake shows),
max_grad_norm active, gradient accumulation 2, a linear schedule with warmup. Then checkpoints with
save_total_limit, an exact resume, save_model loading in from_pretrained, evaluate() / predict(),
yafsdp.FusedAdamW, bf16, and the refusals. A second spawn runs SFTTrainer with LoRA (and QLoRA).
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from dist_utils import run_ranks

pytest.importorskip("accelerate")

SEQ, N_TRAIN, N_EVAL = 12, 16, 6
LR, WD, CLIP = 1e-2, 5.0, 0.05


class Rows(torch.utils.data.Dataset):
    def __init__(self, n, seed, vocab):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=2, per_device_eval_batch_size=3,
                gradient_accumulation_steps=2, max_steps=4, learning_rate=LR, weight_decay=WD, max_grad_norm=CLIP,
                lr_scheduler_type="linear", warmup_steps=1, logging_steps=1, save_strategy="no", report_to=[],
                seed=7, train_sampling_strategy="sequential", disable_tqdm=True, use_cpu=True,
                optim="adamw_torch", dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


def _logs(trainer):
    h = [e for e in trainer.state.log_history if "loss" in e]
    return [(e["step"], e["loss"], e["grad_norm"], e["learning_rate"]) for e in h]


def _close(a, b, rel=1e-5):
    return all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-7) for x, y in zip(a, b)) and len(a) == len(b)


def _with_env(values: dict, fn):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        return fn()
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _trainer_cases(rank, world, tmp):
    import transformers
    from transformers import Trainer

    import yafsdp
    from models import VOCAB, tiny_llama
    from yafsdp.trainer import TrainerSetupError, YaFSDPTrainer

    os.environ["LOCAL_RANK"] = str(rank)
    transformers.logging.set_verbosity_error()
    train, evals = Rows(N_TRAIN, 1, VOCAB), Rows(N_EVAL, 2, VOCAB)
    out = {}

    # 1. plain Trainer, accelerate's DDP, the unsharded model
    ref = tiny_llama(layers=2)
    t = Trainer(model=ref, args=_args(f"{tmp}/ddp"), train_dataset=train, eval_dataset=evals)
    t.train()
    out["ddp_logs"] = _logs(t)
    out["ddp_eval"] = t.evaluate()["eval_loss"]
    out["ddp_pred"] = t.predict(evals).predictions
    out["ddp_sd"] = {k: v.detach().clone() for k, v in ref.state_dict().items()}

    # 2. YaFSDPTrainer, the wrapped model; a checkpoint every step, the last 3 kept
    model = yafsdp.YaFSDP(tiny_llama(layers=2))
    ck_args = dict(save_strategy="steps", save_steps=1, save_total_limit=3)
    t = YaFSDPTrainer(model=model, args=_args(f"{tmp}/ya", **ck_args), train_dataset=train, eval_dataset=evals)
    t.train()
    out["ya_logs"] = _logs(t)
    out["ya_eval"] = t.evaluate()["eval_loss"]
    out["ya_pred"] = t.predict(evals).predictions
    out["ckpts"] = sorted(d for d in os.listdir(f"{tmp}/ya") if d.startswith("checkpoint-"))
    out["groups"] = [(len(g["params"]), g["weight_decay"]) for g in t.optimizer.param_groups]
    out["ya_sd"] = model.full_state_dict()
    t.save_model(f"{tmp}/ya/final")

    # 3. exact resume from checkpoint-2
    model_r = yafsdp.YaFSDP(tiny_llama(layers=2, seed=3))  # other initial weights: the checkpoint must replace them
    t = YaFSDPTrainer(model=model_r, args=_args(f"{tmp}/ya", **ck_args), train_dataset=train)
    t.train(resume_from_checkpoint=f"{tmp}/ya/checkpoint-2")
    out["resumed_logs"] = _logs(t)
    out["resumed_sd"] = model_r.full_state_dict()

    # 4. the project's own loop on the wrapped model, over Trainer's batches (sequential sampler,
    # accelerate's sharding: rank r takes batch k * world + r), the same optimizer groups and schedule
    own = yafsdp.YaFSDP(tiny_llama(layers=2))
    groups = own.param_groups(weight_decay=WD, small_weight_decay=0.0)
    opt = torch.optim.AdamW(groups, lr=LR, fused=None, foreach=None)
    sched = transformers.get_linear_schedule_with_warmup(opt, 1, 4)
    own_logs = []
    for step in range(4):
        losses = []
        for micro in range(2):
            first = (((step % 2) * 2 + micro) * world + rank) * 2  # 2 steps an epoch
            ids = train.ids[first:first + 2]
            loss = own(input_ids=ids, labels=ids).loss
            (loss / 2).backward()
            losses.append(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(own.parameters(), CLIP)
        lr = sched.get_last_lr()[0]
        opt.step()
        sched.step()
        opt.zero_grad()
        mean = torch.stack(losses).mean()
        torch.distributed.all_reduce(mean)
        own_logs.append((step + 1, (mean / world).item(), norm.item(), lr))
    out["own_logs"] = own_logs
    out["own_sd"] = own.full_state_dict()

    # 5. yafsdp.FusedAdamW through optimizer_cls_and_kwargs: Trainer's groups, the same run
    model_f = yafsdp.YaFSDP(tiny_llama(layers=2))
    t = YaFSDPTrainer(model=model_f, args=_args(f"{tmp}/fused", max_steps=2), train_dataset=train,
                      optimizer_cls_and_kwargs=(yafsdp.FusedAdamW, {"lr": LR}))
    t.train()
    out["fused_logs"] = _logs(t)

    # 5b. gradient_checkpointing=True (Trainer enables it on the wrapped module): the same 2 steps
    model_c = yafsdp.YaFSDP(tiny_llama(layers=2))
    t = YaFSDPTrainer(model=model_c, args=_args(f"{tmp}/ckpt", max_steps=2, gradient_checkpointing=True),
                      train_dataset=train)
    t.train()
    out["gc_logs"] = _logs(t)

    # 6. bf16: param_dtype bf16 and bf16=True train; mismatches are refused by name
    model_b = yafsdp.YaFSDP(tiny_llama(layers=2), param_dtype=torch.bfloat16)
    t = YaFSDPTrainer(model=model_b, args=_args(f"{tmp}/bf16", bf16=True, max_steps=2), train_dataset=train)
    t.train()
    out["bf16_logs"] = _logs(t)
    refusals = {}
    for name, make in {
        "bf16_mismatch": lambda: YaFSDPTrainer(model=yafsdp.YaFSDP(tiny_llama(layers=1)),
                                               args=_args(f"{tmp}/x", bf16=True), train_dataset=train),
        "plain_model": lambda: YaFSDPTrainer(model=tiny_llama(layers=1), args=_args(f"{tmp}/x"), train_dataset=train),
        "ddp_around": lambda: YaFSDPTrainer(
            model=torch.nn.parallel.DistributedDataParallel(yafsdp.YaFSDP(tiny_llama(layers=1))),
            args=_args(f"{tmp}/x"), train_dataset=train),
        "fsdp_env_cpu": lambda: _with_env(  # what an accelerate FSDP config leaves on a CPU machine
            {"ACCELERATE_USE_FSDP": "true"}, lambda: YaFSDPTrainer(
                model=yafsdp.YaFSDP(tiny_llama(layers=1)), args=_args(f"{tmp}/x"), train_dataset=train)),
        "parent_around": lambda: YaFSDPTrainer(
            model=torch.nn.ModuleDict({"lm": yafsdp.YaFSDP(tiny_llama(layers=1))}),
            args=_args(f"{tmp}/x"), train_dataset=train),
        "fp16_cpu": lambda: YaFSDPTrainer(model=yafsdp.YaFSDP(tiny_llama(layers=1), param_dtype=torch.float16),
                                          args=_args(f"{tmp}/x", fp16=True), train_dataset=train),
        "fp16_no_scaler": lambda: YaFSDPTrainer(model=yafsdp.YaFSDP(tiny_llama(layers=1), param_dtype=torch.float16),
                                                args=_args(f"{tmp}/x"), train_dataset=train),
        "compile": lambda: YaFSDPTrainer(model=yafsdp.YaFSDP(tiny_llama(layers=1)),
                                         args=_args(f"{tmp}/x", torch_compile=True), train_dataset=train),
    }.items():
        try:
            make()
            refusals[name] = None
        except (TrainerSetupError, ValueError, RuntimeError) as e:
            refusals[name] = f"{type(e).__name__}: {e}"
    # a flat shard mixing decayed and non-decayed parameters: refused with weight decay, fine without
    from yafsdp.trainer import decay_parameter_names

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.gamma = torch.nn.Parameter(torch.ones(8))  # 1-D, not a norm or bias: Trainer decays it

        def forward(self, x):
            return self.fc(x) * self.gamma

    mixed = yafsdp.YaFSDP(Scaled())
    names = Trainer.get_decay_parameter_names(None, mixed.module)
    try:
        decay_parameter_names(mixed, names, WD)
        refusals["mixed"] = None
    except TrainerSetupError as e:
        refusals["mixed"] = str(e)
    refusals["mixed_wd0"] = decay_parameter_names(mixed, names, 0.0)
    out["refusals"] = refusals
    return out


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("trainers"))
    res = run_ranks(_trainer_cases, 2, tmp)
    return res[0], tmp


def test_trainer_matches_ddp_trainer_and_own_loop(trainer_run):
    r, _ = trainer_run
    ddp, ya, own = r["ddp_logs"], r["ya_logs"], r["own_logs"]
    assert len(ddp) == 4 and [s for s, *_ in ya] == [1, 2, 3, 4]
    for col in (1, 2, 3):  # loss, grad norm (pre-clip, global), learning rate
        assert _close([x[col] for x in ya], [x[col] for x in ddp]), (col, ya, ddp)
        assert _close([x[col] for x in ya], [x[col] for x in own]), (col, ya, own)
    assert all(x[2] > 10 * CLIP for x in ddp)  # clipping was active at every step
    # Trainer's decay groups over the flat shards: the units decayed, the small group (norms) not
    assert r["groups"] == [(4, WD), (1, 0.0)]
    for k, v in r["ddp_sd"].items():
        assert torch.allclose(r["ya_sd"][k], v, rtol=1e-4, atol=1e-6), k
        assert torch.allclose(r["own_sd"][k], v, rtol=1e-4, atol=1e-6), k


def test_trainer_evaluate_and_predict(trainer_run):
    r, _ = trainer_run
    assert math.isclose(r["ya_eval"], r["ddp_eval"], rel_tol=1e-5), (r["ya_eval"], r["ddp_eval"])
    assert r["ya_pred"].shape == r["ddp_pred"].shape == (N_EVAL, SEQ, 67)
    assert abs(r["ya_pred"] - r["ddp_pred"]).max() < 1e-4


def test_trainer_checkpoints_resume_and_save_model(trainer_run):
    from transformers import LlamaForCausalLM

    r, tmp = trainer_run
    assert r["ckpts"] == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]  # save_total_limit=3
    ck = os.path.join(tmp, "ya", "checkpoint-2")
    assert {"trainer_state.json", "scheduler.pt", "step_00000002"} <= set(os.listdir(ck))
    # steps 1-2 come from the checkpoint's trainer_state.json, 3-4 were trained after the resume
    assert r["resumed_logs"] == r["ya_logs"]  # exactly the uninterrupted run's
    for k, v in r["ya_sd"].items():
        assert torch.equal(r["resumed_sd"][k], v), k
    final = LlamaForCausalLM.from_pretrained(os.path.join(tmp, "ya", "final"))
    for k, v in final.state_dict().items():
        assert torch.equal(v, r["ya_sd"][k]), k
    assert os.path.isfile(os.path.join(tmp, "ya", "final", "training_args.bin"))


def test_trainer_fused_checkpointing_bf16_and_refusals(trainer_run):
    r, _ = trainer_run
    for col in (1, 2):
        assert _close([x[col] for x in r["fused_logs"]], [x[col] for x in r["ddp_logs"][:2]]), r["fused_logs"]
    for col in (1, 2):
        assert _close([x[col] for x in r["gc_logs"]], [x[col] for x in r["ddp_logs"][:2]]), r["gc_logs"]
    bf = [x[1] for x in r["bf16_logs"]]
    assert len(bf) == 2 and _close(bf, [x[1] for x in r["ddp_logs"][:2]], rel=3e-2), bf
    ref = r["refusals"]
    assert "param_dtype=None" in ref["bf16_mismatch"] and "param_dtype=torch.bfloat16" in ref["bf16_mismatch"]
    assert "not a yafsdp.YaFSDP model" in ref["plain_model"]
    # DDP's own constructor refuses it (yafsdp/engine/ddp_guard.py), with the trainer's words
    assert ref["ddp_around"].startswith("WrappedTwiceError") and "wrapped twice" in ref["ddp_around"], ref["ddp_around"]
    assert "wrapped twice" in ref["parent_around"] and "ModuleDict" in ref["parent_around"], ref["parent_around"]
    assert "configured for FSDP" in ref["fsdp_env_cpu"], ref["fsdp_env_cpu"]
    assert "compile_units" in ref["compile"]
    assert "accelerate made no GradScaler" in ref["fp16_cpu"], ref["fp16_cpu"]
    assert "fp16=False" in ref["fp16_no_scaler"], ref["fp16_no_scaler"]
    assert "flat shard 'flat.small_group'" in ref["mixed"] and "gamma" in ref["mixed"], ref["mixed"]
    assert ref["mixed_wd0"] == ["flat.small_group"] or "flat.small_group" in ref["mixed_wd0"]


# ------------------------------------------------------------------------------------ TRL SFTTrainer
def _sft_cases(rank, world, tmp):
    import peft
    import transformers
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    import yafsdp
    from models import tiny_llama
    from pretrain import data as D
    from pretrain import instructions as I
    from yafsdp.formats import nf4_codec as nf4
    from yafsdp.trainer import YaFSDPSFTTrainer

    os.environ["LOCAL_RANK"] = str(rank)
    transformers.logging.set_verbosity_error()
    if rank == 0:
        D.ByteTokenizer().save_pretrained(f"{tmp}/tok")
    torch.distributed.barrier()
    tok = AutoTokenizer.from_pretrained(f"{tmp}/tok")
    pairs = I.read_instructions(I.EMBEDDED_INSTRUCTIONS)[:24]
    ds = Dataset.from_list([{"prompt": I.PROMPT_TEMPLATE.format(prompt=p), "completion": r} for p, r in pairs])

    def lora(qlora=False):
        base = tiny_llama(layers=2, vocab=D.ByteTokenizer.vocab_size)
        if qlora:  # the base as the engine stores it: its NF4 round trip (fp32 compute on the CPU)
            with torch.no_grad():
                for mod in base.modules():
                    if isinstance(mod, torch.nn.Linear) and mod.weight.numel() % nf4.BLOCK == 0:
                        w = mod.weight
                        packed, scales = nf4.quantize(w.detach().reshape(-1))
                        w.copy_(nf4.dequantize_record(torch.cat([packed, scales.view(torch.uint8)]), w.numel(),
                                                      w.dtype).view_as(w))
        torch.manual_seed(5)
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        return peft.get_peft_model(base, cfg)

    def args(out, **kw):
        base = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                    learning_rate=LR, weight_decay=0.5, max_grad_norm=CLIP, warmup_steps=1, logging_steps=1,
                    save_strategy="no", report_to=[], seed=7, train_sampling_strategy="sequential", disable_tqdm=True,
                    use_cpu=True, max_length=96, dataloader_num_workers=0, bf16=False)
        base.update(kw)
        return SFTConfig(**base)

    out = {}
    ref = lora()
    t = SFTTrainer(model=ref, args=args(f"{tmp}/ddp"), train_dataset=ds, processing_class=tok)
    t.train()
    out["ddp_logs"] = _logs(t)
    out["ddp_adapter"] = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(ref).items()}

    model = yafsdp.YaFSDP(lora())
    t = YaFSDPSFTTrainer(model=model, args=args(f"{tmp}/ya", save_strategy="steps", save_steps=2), train_dataset=ds,
                         processing_class=tok)
    t.train()
    out["ya_logs"] = _logs(t)
    t.save_model(f"{tmp}/ya/adapter")

    model_r = yafsdp.YaFSDP(lora())
    t = YaFSDPSFTTrainer(model=model_r, args=args(f"{tmp}/ya", save_strategy="steps", save_steps=2), train_dataset=ds,
                         processing_class=tok)
    t.train(resume_from_checkpoint=f"{tmp}/ya/checkpoint-2")
    out["resumed_logs"] = _logs(t)

    # reentrant activation checkpointing (SFTConfig turns checkpointing on by default; non-reentrant above)
    model_g = yafsdp.YaFSDP(lora())
    t = YaFSDPSFTTrainer(model=model_g, args=args(f"{tmp}/ya_re", max_steps=2,
                                                  activation_checkpointing_kwargs={"use_reentrant": True}),
                         train_dataset=ds, processing_class=tok)
    t.train()
    out["reentrant_logs"] = _logs(t)

    # QLoRA: the base's linear weights in NF4, against DDP on the NF4 round trip of the base
    ref_q = lora(qlora=True)
    t = SFTTrainer(model=ref_q, args=args(f"{tmp}/ddp_q", max_steps=2), train_dataset=ds, processing_class=tok)
    t.train()
    out["ddp_q_logs"] = _logs(t)
    model_q = yafsdp.YaFSDP(lora(), quantize_frozen="nf4")
    t = YaFSDPSFTTrainer(model=model_q, args=args(f"{tmp}/ya_q", max_steps=2), train_dataset=ds, processing_class=tok)
    t.train()
    out["ya_q_logs"] = _logs(t)
    return out


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    tmp = str(tmp_path_factory.mktemp("sft"))
    return run_ranks(_sft_cases, 2, tmp)[0], tmp


def test_sft_lora_matches_ddp_resumes_and_saves_the_adapter(sft_run):
    import peft
    from transformers import LlamaForCausalLM

    r, tmp = sft_run
    ddp, ya = r["ddp_logs"], r["ya_logs"]
    assert [s for s, *_ in ya] == [1, 2, 3, 4]
    for col in (1, 2, 3):
        assert _close([x[col] for x in ya], [x[col] for x in ddp]), (col, ya, ddp)
    assert all(x[2] > CLIP for x in ddp)
    assert r["resumed_logs"] == ya
    for col in (1, 2):  # reentrant checkpointing: the LoRA gradients flow (the inputs are made to require grad)
        assert _close([x[col] for x in r["reentrant_logs"]], [x[col] for x in ddp[:2]]), r["reentrant_logs"]
    adapter = os.path.join(tmp, "ya", "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter))
    from models import tiny_llama

    loaded = peft.PeftModel.from_pretrained(tiny_llama(layers=2, vocab=259), adapter)
    got = peft.get_peft_model_state_dict(loaded)
    assert sorted(got) == sorted(r["ddp_adapter"])
    for k, v in r["ddp_adapter"].items():
        assert torch.allclose(got[k], v, rtol=1e-4, atol=1e-6), k


def test_sft_qlora_matches_ddp_on_the_nf4_base(sft_run):
    r, _ = sft_run
    ddp, ya = r["ddp_q_logs"], r["ya_q_logs"]
    assert len(ya) == 2
    for col in (1, 2):
        assert _close([x[col] for x in ya], [x[col] for x in ddp]), (col, ya, ddp)



def test_example_trainer_sft(tmp_path):
    """examples/trainer_sft.py under torchrun (world 2): the held-out loss falls and the adapter loads in PEFT."""
    import re
    import subprocess
    import sys

    import peft

    from dist_utils import free_port
    from job_utils import ROOT, env

    pytest.importorskip("trl")
    out = str(tmp_path / "sft")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           os.path.join(ROOT, "examples", "trainer_sft.py"), "--out", out, "--max-steps", "6", "--save-steps", "3"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    m = re.search(r"held-out loss ([\d.]+) \(before\) -> ([\d.]+) \(step 6\)", p.stdout)
    assert m and float(m.group(2)) < float(m.group(1)), p.stdout[-3000:]
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint-")) == ["checkpoint-3", "checkpoint-6"]
    from yafsdp.presets import build_llama

    loaded = peft.PeftModel.from_pretrained(build_llama("tiny", vocab_size=259), os.path.join(out, "adapter"))
    b = [v for k, v in loaded.named_parameters() if "lora_B" in k]
    assert len(b) == 14 and all(v.abs().max() > 0 for v in b)  # trained adapters on 7 linear kinds x 2 layers


def test_accelerate_multi_cpu_config_refused(tmp_path):
    """``accelerate launch`` with a MULTI_CPU config of 2 processes starts one (its simple launcher); the
    example refuses to train at world 1 ([Note: accelerate's launchers] in yafsdp/integrations/trainer.py)."""
    import subprocess
    import sys

    from job_utils import ROOT, env

    cfg = tmp_path / "multi_cpu.yaml"
    cfg.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n"
                   "num_machines: 1\nmachine_rank: 0\nmixed_precision: 'no'\nuse_cpu: true\n")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg),
           os.path.join(ROOT, "examples", "trainer_sft.py"), "--max-steps", "1", "--out", str(tmp_path / "out")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env())
    assert p.returncode != 0
    assert "TrainerSetupError" in p.stderr and "world size 1" in p.stderr and "MULTI_GPU" in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "out").exists()


_FAULTY_TRAINER = """
import os, sys, time
sys.path.insert(0, {tests!r})
import torch, torch.distributed as dist
from transformers import TrainerCallback, TrainingArguments
import yafsdp
from models import VOCAB, tiny_llama
from yafsdp.trainer import YaFSDPTrainer

dist.init_process_group("gloo")
rank, fault = dist.get_rank(), sys.argv[1]

class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        ids = torch.arange(12) * (i + 1) % VOCAB
        return {{"input_ids": ids, "labels": ids}}

class Fault(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if rank == 1 and state.global_step == 2:
            if fault == "raise":
                raise RuntimeError("injected in rank 1's callback")
            time.sleep(3600)

args = TrainingArguments(output_dir=sys.argv[2], per_device_train_batch_size=2, max_steps=8, report_to=[],
                         save_strategy="no", use_cpu=True, disable_tqdm=True, ddp_timeout=300)
trainer = YaFSDPTrainer(model=yafsdp.YaFSDP(tiny_llama()), args=args, train_dataset=Rows(), callbacks=[Fault()],
                        hang_timeout=6)
trainer.train()
"""


def test_trainer_watchdog_one_rank_raising_or_stuck(tmp_path):
    """YaFSDPTrainer under the watchdog: an exception raised in rank 1's callback alone ends rank 0 too
    (status 1, not a hang); rank 1 asleep after step 2 is named by both ranks within hang_timeout
    (6 s) and every process ends with status 4."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from job_utils import env
    from dist_utils import free_port

    script = tmp_path / "faulty_trainer.py"
    script.write_text(_FAULTY_TRAINER.format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

    def run(fault):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(script), fault, str(tmp_path / fault)]
        return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=180)

    with ThreadPoolExecutor(2) as pool:
        raised, slept = pool.map(run, ["raise", "sleep"])
    assert raised.returncode != 0 and "RuntimeError: injected in rank 1's callback" in raised.stderr
    codes = [int(c) for c in __import__("re").findall(r"exitcode\s*:\s*(-?\d+)", raised.stderr)]
    assert codes and all(c in (1, -15) for c in codes), raised.stderr[-3000:]
    lines = [x for x in slept.stderr.splitlines() if x.startswith("yafsdp watchdog")]
    assert len(lines) == 2 and all("stuck: rank 1 (behind the others)" in x for x in lines), slept.stderr[-3000:]
    assert all("rank 1: 2 steps done, train" in x and "(deadline 6 s)" in x for x in lines), lines
    codes = [int(c) for c in __import__("re").findall(r"exitcode\s*:\s*(-?\d+)", slept.stderr)]
    assert 4 in codes, slept.stderr[-3000:]
