"""The LoRA fine-tuning job, examples/finetune_lora.py, launched like users launch it (torchrun,
world 2): it lowers the held-out response loss, its adapter loads in PEFT with the job's logits (and
the merged export has them too), a resumed run repeats the uninterrupted one's losses, the loss
covers response tokens only, and a --lora-targets that matches nothing is a one-line error."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from job_utils import ROOT, Lanes, close, env, losses
from dist_utils import free_port

peft = pytest.importorskip("peft")

JOB = os.path.join(ROOT, "examples", "finetune_lora.py")
# A tiny variant of the default: a base of preset tiny pretrained for 40 steps, 30 fine-tuning steps.
FAST = ["--preset", "tiny", "--base-steps", "40", "--steps", "30", "--batch-size", "4", "--lr", "1e-2", "--no-progress",
        "--sample-tokens", "0", "--eval-batches", "1"]


def run_ft(args, nproc=2, check=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), JOB, *FAST, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env())
    if check and p.returncode != 0:
        raise AssertionError(f"job failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}")
    return p


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ft") / "run")
    p = run_ft(["--out", out, "--save-every", "15", "--merge-export", os.path.join(out, "merged")])
    return dict(out=out, stdout=p.stdout)


@pytest.fixture(scope="module")
def lanes(run, request, tmp_path_factory):
    """The module's other launches, once the default run has written the base they fine-tune: each chain
    side by side with the others (job_utils.Lanes), the longest first, while the in-process tests run;
    those of the selected tests only."""
    selected = {item.originalname for item in request.session.items}
    base = tmp_path_factory.mktemp("lanes")
    base_dir = os.path.join(run["out"], "base", "hf")
    ln = Lanes()
    if "test_offload_job_repeats_the_losses_and_resumes" in selected:
        ln.start("offload", _offload_lane, base_dir, str(base / "offload"))
    if "test_resume_repeats_the_uninterrupted_losses" in selected:
        ln.start("resume", _resume_lane, base_dir, str(base / "resumed"), _one_layer_budget(base_dir))
    if "test_one_ranks_error_and_a_stuck_rank_stop_the_finetuning_job" in selected:
        ln.start("slept", _fault_run, base_dir, base, "sleep:1:3:data", ["--hang-timeout", "8"])
        ln.start("raised", _fault_run, base_dir, base, "raise:1:3:backward", [])
    if "test_qlora_job" in selected:
        budget = _one_layer_budget(base_dir, quantize_frozen="nf4")
        ln.start("qlora", run_ft, ["--out", str(base / "qlora"), "--init-from-hf", base_dir, "--qlora", "--steps",
                                   "15", "--merge-export", str(base / "qlora" / "merged"), "--memory-budget",
                                   str(budget)])
    if "test_a_base_made_with_other_flags_is_refused" in selected:  # the default run's --out, another recipe
        ln.start("recipe", run_ft, ["--out", run["out"], "--base-steps", "41", "--steps", "31"], nproc=1, check=False)
    if "test_bad_lora_targets_is_a_one_line_error" in selected:
        ln.start("bad", run_ft, ["--out", str(base / "bad"), "--init-from-hf", base_dir, "--lora-targets",
                                 "q_proj,attn_qkv"], check=False)
    yield dict(lanes=ln, base=base, base_dir=base_dir)
    ln.close()


def test_default_lowers_the_heldout_response_loss(run, lanes):  # lanes: the other launches start now
    m = re.search(r"held-out response-token loss ([\d.]+) \(before fine-tuning\) -> ([\d.]+) \(step 30\)", run["stdout"])
    assert m, run["stdout"][-3000:]
    before, after = float(m.group(1)), float(m.group(2))
    assert after < before - 0.5, (before, after)
    assert "loss on response tokens only" in run["stdout"]
    assert "pretraining one (pretrain_llama.py" in run["stdout"]  # the base came from the pretraining job
    assert "each rank read its slices" in run["stdout"]  # built on meta, streamed in (yafsdp.peft_load)
    ev = [json.loads(line) for line in open(os.path.join(run["out"], "events.jsonl"))]
    assert [e["loss"] for e in ev if e["event"] == "heldout_before"] == [pytest.approx(before, abs=1e-4)]
    assert len(losses(run["out"])) == 30
    assert os.path.isdir(os.path.join(run["out"], "checkpoints", "step_00000030"))


def test_adapter_loads_in_peft_with_the_jobs_logits(run, lanes):
    from transformers import LlamaForCausalLM

    out = run["out"]
    probe = torch.load(os.path.join(out, "probe.pt"))
    x = probe["input_ids"]
    base_dir = os.path.join(out, "base", "hf")
    assert probe["base"] == base_dir
    with torch.no_grad():
        plain = LlamaForCausalLM.from_pretrained(base_dir)(input_ids=x).logits
        loaded = peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_dir), os.path.join(out, "adapter"))
        ours = loaded(input_ids=x).logits
        merged = LlamaForCausalLM.from_pretrained(os.path.join(out, "merged"))(input_ids=x).logits
    assert (plain - probe["logits"]).abs().max().item() > 1e-2  # the adapter changed the function
    assert (ours - probe["logits"]).abs().max().item() < 1e-5
    assert (merged - probe["logits"]).abs().max().item() < 1e-4
    cfg = json.load(open(os.path.join(out, "adapter", "adapter_config.json")))
    assert sorted(cfg["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"] and cfg["r"] == 8


def _resume_lane(base_dir, out, budget):
    base = ["--out", out, "--init-from-hf", base_dir, "--save-every", "15", "--memory-budget", str(budget)]
    first = run_ft(base + ["--steps", "15"])
    # another base of the same shapes (one byte of a weight changed): refused, the checkpoint holds its own
    other = out + "_other_base"
    shutil.copytree(base_dir, other)
    weights = os.path.join(other, "model.safetensors")
    with open(weights, "r+b") as f:
        f.seek(os.path.getsize(weights) - 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
    refused = run_ft(["--out", out, "--init-from-hf", other, "--resume"], nproc=1, check=False)
    return out, first, run_ft(base + ["--resume"]), refused


def test_resume_repeats_the_uninterrupted_losses(run, lanes):
    """Both halves with --memory-budget (LoRA, auto: the plan traced through PEFT checkpoints the
    first of the base's 2 layers), so this also shows that the chosen checkpointing trains like none."""
    out, first, p, refused = lanes["lanes"].result("resume")
    errs = [x for x in refused.stderr.splitlines() if x.startswith("finetune_lora.py: error:")]
    assert refused.returncode != 0 and len(errs) == 1 and "was trained on another base than --init-from-hf" in errs[0] \
        and "holds its frozen base" in errs[0], refused.stderr[-3000:]
    for q in (first, p):
        assert "1 of 2 blocks checkpointed" in q.stdout and "checkpointed: base_model.model.model.layers.0" in q.stdout, \
            q.stdout[:3000]
    assert "resumed from" in p.stdout and "step_00000015" in p.stdout
    want = losses(run["out"])
    got = losses(out)
    assert len(got) == 30 and close(got, want, rel=1e-6), (got, want)
    # The held-out loss before fine-tuning is the run's, read back on resume.
    assert re.search(r"held-out response-token loss [\d.]+ \(before fine-tuning\)", p.stdout)


def test_bad_lora_targets_is_a_one_line_error(lanes):
    p = lanes["lanes"].result("bad")
    assert p.returncode != 0
    ours = [line for line in p.stderr.splitlines() if line.startswith("finetune_lora.py: error:")]
    assert ours == ["finetune_lora.py: error: --lora-targets 'q_proj,attn_qkv': 'attn_qkv' matches no linear module "
                    "of the model; its linear modules are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, "
                    "up_proj, v_proj"], p.stderr[-3000:]
    assert 'finetune_lora.py", line' not in p.stderr  # no traceback


def test_a_base_made_with_other_flags_is_refused(run, lanes):
    """--out/base/hf was made by the default run with --base-steps 40; a run asking for 41 would have fine-tuned
    that base without a word (with --overwrite too): refused, naming the flag, before anything is touched."""
    p = lanes["lanes"].result("recipe")
    errs = [x for x in p.stderr.splitlines() if x.startswith("finetune_lora.py: error:")]
    assert p.returncode != 0 and len(errs) == 1, p.stderr[-3000:]
    assert "holds the base an earlier run made with other flags (steps 40 -> 41)" in errs[0] and "--overwrite" \
        in errs[0], errs
    assert len(losses(run["out"])) == 30  # the run in --out untouched


def test_response_only_masking():
    from finetune_lora import response_loss
    from pretrain import data as D
    from pretrain import instructions as I
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = D.ByteTokenizer()
    seq = 64
    row = I.encode_instruction("Spell backwards: cat", "tac", tok, seq)
    head = len(I.PROMPT_TEMPLATE.format(prompt="Spell backwards: cat").encode())
    ids, labels = row[0], row[1]
    assert row.shape == (2, seq + 1) and row.dtype == np.int64
    assert ids[:head + 4].tolist() == list((I.PROMPT_TEMPLATE.format(prompt="Spell backwards: cat") + "tac").encode()) \
        + [tok.eos_id]
    assert (labels[:head] == I.IGNORE).all()
    assert labels[head:head + 4].tolist() == [ord("t"), ord("a"), ord("c"), tok.eos_id]
    assert (labels[head + 4:] == I.IGNORE).all() and (ids[head + 4:] == tok.pad_id).all()
    # The loss is the mean cross-entropy over the 4 response targets only, whatever the prompt's labels.
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    x = torch.from_numpy(row)[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=x[:, 0, :-1]).logits[0].float(), -1)
        want = -torch.stack([logp[t - 1, int(ids[t])] for t in range(head, head + 4)]).mean()
        assert torch.allclose(response_loss(model, x), want, atol=1e-6)
    # A response cut by --seq-len keeps the tokens that fit; one with no room left is refused.
    cut = I.encode_instruction("p", "x" * 100, tok, seq)
    assert (cut[1, 1:] != I.IGNORE).sum() == seq + 1 - len(I.PROMPT_TEMPLATE.format(prompt="p"))
    with pytest.raises(D.DataError, match=r"example 2 leaves no response token within --seq-len 64 .*raise --seq-len"):
        I.encode_instructions([("a", "b"), ("y" * 80, "z")], tok, seq, "--data 'x.jsonl'")


def _one_layer_budget(base_dir: str, **opts) -> int:
    """Bytes per rank that the plan's peak with the first layer checkpointed fits and the peak with
    none does not, for the job's default LoRA model on ``base_dir`` at world 2 (batch 4, seq 96)."""
    from transformers import LlamaForCausalLM

    from finetune_lora import DEFAULT_TARGETS
    from yafsdp.hf import read_hf_config
    from yafsdp.plan import choose_checkpointing

    with torch.device("meta"):
        base = LlamaForCausalLM._from_config(read_hf_config(base_dir))
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=DEFAULT_TARGETS.split(","),
                                                      task_type="CAUSAL_LM"))
    ends = choose_checkpointing(model, budget=1 << 50, world_size=2, batch=4, seq=96, **opts)
    one = ends.take(1).peak
    assert ends.peak_all < one < ends.peak_none, (ends.peak_all, one, ends.peak_none)
    return one + (ends.peak_none - one) // 4


def test_qlora_job(lanes):
    """--qlora at world 2: the base's linear weights in NF4; the held-out loss falls; probe.pt's logits are
    PEFT's with the adapter on the NF4-dequantized base (the merged export has them too)."""
    from transformers import LlamaForCausalLM

    from yafsdp.formats import nf4_codec as nf4

    out, base_dir = str(lanes["base"] / "qlora"), lanes["base_dir"]
    p = lanes["lanes"].result("qlora")
    assert "linear weights stored in NF4 (--qlora)" in p.stdout and "NF4-dequantized base" in p.stdout
    # --memory-budget (auto): the plan traced through PEFT chose 1 of the base's 2 layers (docs/activation_checkpointing.md)
    assert "1 of 2 blocks checkpointed" in p.stdout and "checkpointed: base_model.model.model.layers.0" in p.stdout, \
        p.stdout[:3000]
    m = re.search(r"held-out response-token loss ([\d.]+) \(before fine-tuning\) -> ([\d.]+)", p.stdout)
    assert m and float(m.group(2)) < float(m.group(1)) - 0.2, p.stdout[-3000:]
    probe = torch.load(os.path.join(out, "probe.pt"))
    base = LlamaForCausalLM.from_pretrained(base_dir)
    with torch.no_grad():
        for mod in base.modules():  # the base as the engine stored it (fp32 compute on CPU: fp32 NF4)
            if isinstance(mod, torch.nn.Linear) and mod.weight.numel() % nf4.BLOCK == 0:
                w = mod.weight
                packed, scales = nf4.quantize(w.detach().reshape(-1))
                w.copy_(nf4.dequantize_record(torch.cat([packed, scales.view(torch.uint8)]), w.numel(),
                                              w.dtype).view_as(w))
        ours = peft.PeftModel.from_pretrained(base, os.path.join(out, "adapter"))(input_ids=probe["input_ids"]).logits
        merged = LlamaForCausalLM.from_pretrained(os.path.join(out, "merged"))(input_ids=probe["input_ids"]).logits
    assert (ours - probe["logits"]).abs().max().item() < 1e-5
    assert (merged - probe["logits"]).abs().max().item() < 1e-4


def _offload_lane(base_dir, out):
    base = ["--out", out, "--init-from-hf", base_dir, "--save-every", "15"]
    return out, run_ft(base + ["--steps", "15", "--offload"]), run_ft(base + ["--resume", "--offload", "all"])


def test_offload_job_repeats_the_losses_and_resumes(run, lanes):
    """--offload at world 2 (adapters' fp32 state on the host, the step on the CPU): the first half with
    --offload, a checkpoint, a resumed second half with --offload all (the frozen base on the host too)
    repeat the default run's 30 losses bit for bit."""
    out, p, q = lanes["lanes"].result("offload")
    assert "stepped on the CPU (--offload)" in p.stdout, p.stdout[-3000:]
    assert "resumed from" in q.stdout and "--offload all" in q.stdout
    want, got = losses(run["out"]), losses(out)
    assert len(got) == 30 and got == want, (got, want)


def _fault_run(base_dir, base, fault, extra):
    e = env()
    e["YAFSDP_JOB_FAULT"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           JOB, *FAST, "--init-from-hf", base_dir, "--steps", "6", "--save-every", "0", *extra,
           "--out", str(base / fault.split(":")[0])]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=e)


def test_one_ranks_error_and_a_stuck_rank_stop_the_finetuning_job(lanes):
    """The fine-tuning job shares the pretraining job's fault handling: an exception on rank 1 alone is
    printed once naming rank, step and phase, every rank exits 1; rank 1 asleep in its data is named by
    both ranks within --hang-timeout and the job exits 4 (tests/jobs/test_faults.py has the catalogue)."""
    raised, slept = lanes["lanes"].result("raised"), lanes["lanes"].result("slept")
    lines = [x for x in raised.stderr.splitlines() if x.startswith("finetune_lora.py: error:")]
    assert len(lines) == 1 and lines[0].startswith("finetune_lora.py: error: rank 1 (step 3, backward): "
                                                   "RuntimeError: injected fault"), raised.stderr[-3000:]
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", raised.stderr)]
    assert codes and all(c in (1, -15) for c in codes), raised.stderr[-3000:]
    lines = [x for x in slept.stderr.splitlines() if x.startswith("yafsdp watchdog")]
    assert len(lines) == 2 and all("stuck: rank 1 (behind the others)" in x and "rank 1: 2 steps done, data" in x
                                   for x in lines), slept.stderr[-3000:]
    assert 4 in [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", slept.stderr)], slept.stderr[-3000:]
