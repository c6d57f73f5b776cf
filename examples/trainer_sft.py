"""TRL's SFTTrainer with a LoRA model under yafsdp: the habits of a TRL script, the model sharded.

On a CPU machine, with nothing downloaded (a few minutes on 2 cores): a small Llama (seeded, the
project's ``tiny`` preset with a byte vocabulary) gets LoRA adapters on every linear layer and is
fine-tuned on the embedded instruction set (examples/data/instructions.jsonl); the held-out loss is
printed before and after, and the adapter is written to --out/adapter in PEFT's format:

    torchrun --nproc-per-node 2 examples/trainer_sft.py
    torchrun --nproc-per-node 2 examples/trainer_sft.py --out runs/sft --max-steps 40

A local HF Llama and its tokenizer, QLoRA (the frozen base's linear weights in NF4), bf16 on GPUs:

    torchrun --nproc-per-node 8 examples/trainer_sft.py --init-from-hf /models/llama --qlora --bf16 \\
        --data my_instructions.jsonl --out runs/sft

Continue a run from its newest checkpoint (--out/checkpoint-N, yafsdp's sharded checkpoint plus
Trainer's state): add --resume. Also runs as plain ``python`` (one rank). The recipe, how it relates
to ``accelerate launch`` and what is refused: docs/trainers.md. Under ``accelerate launch`` on CPU use a config with
``distributed_type: MULTI_GPU`` and ``use_cpu: true`` (torchrun underneath); a MULTI_CPU config starts one process
and is refused.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser("trainer_sft.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/trainer_sft", help="output_dir: checkpoints, then adapter/")
    p.add_argument("--max-steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--init-from-hf", default=None, metavar="DIR",
                   help="a local HF Llama (config, weights and tokenizer); default: the seeded tiny preset")
    p.add_argument("--data", default=None, help="instruction JSONL, one {prompt, response} per line "
                   "(default: the embedded set)")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-length", type=int, default=96)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--qlora", action="store_true", help="YaFSDP(quantize_frozen='nf4'): the frozen base in 4 bits")
    p.add_argument("--bf16", action="store_true", help="bf16 compute: YaFSDP(param_dtype=bfloat16) and bf16=True")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    return p.parse_args(argv)


def init_distributed():
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "RANK" not in os.environ:  # plain python (or accelerate's one-process launcher): one rank
        # accelerate asked for several processes but started this one alone: refused, naming the launch to use
        from yafsdp.trainer import check_launch

        check_launch(world_size=1)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        port = os.environ.get("MASTER_PORT", "29517")  # MASTER_ADDR stays unset: check_launch reads it
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        return cuda
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    return cuda


def main(argv=None):
    a = parse_args(argv)
    cuda = init_distributed()
    import peft
    import transformers
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaForCausalLM
    from trl import SFTConfig

    import yafsdp
    from yafsdp.presets import build_llama
    from yafsdp.trainer import YaFSDPSFTTrainer

    sys.path.insert(0, HERE)
    from pretrain import data as D
    from pretrain import instructions as I

    transformers.logging.set_verbosity_error()
    rank = dist.get_rank()
    if a.init_from_hf:
        tok = AutoTokenizer.from_pretrained(a.init_from_hf)
        base = LlamaForCausalLM.from_pretrained(a.init_from_hf, dtype=torch.float32)
    else:
        tok_dir = os.path.join(a.out, "tokenizer")
        if rank == 0 and not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
            D.ByteTokenizer().save_pretrained(tok_dir)
        dist.barrier()
        tok = AutoTokenizer.from_pretrained(tok_dir)
        base = build_llama("tiny", seed=a.seed, vocab_size=D.ByteTokenizer.vocab_size)
    pairs = I.read_instructions(a.data or I.EMBEDDED_INSTRUCTIONS)
    rows = [{"prompt": I.PROMPT_TEMPLATE.format(prompt=q), "completion": r} for q, r in pairs]
    n_eval = max(1, len(rows) // 10)
    train, held_out = Dataset.from_list(rows[:-n_eval]), Dataset.from_list(rows[-n_eval:])

    torch.manual_seed(a.seed)  # the adapters' A: the same on every rank
    lora = peft.LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, task_type="CAUSAL_LM",
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = yafsdp.YaFSDP(peft.get_peft_model(base, lora), param_dtype=torch.bfloat16 if a.bf16 else None,
                          quantize_frozen="nf4" if a.qlora else None)

    args = SFTConfig(
        output_dir=a.out, max_steps=a.max_steps, per_device_train_batch_size=a.batch_size,
        per_device_eval_batch_size=a.batch_size, gradient_accumulation_steps=a.grad_accum, learning_rate=a.lr,
        weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=max(1, a.max_steps // 20),
        logging_steps=max(1, a.max_steps // 10), save_strategy="steps", save_steps=a.save_steps, save_total_limit=2,
        bf16=a.bf16, max_length=a.max_length, seed=a.seed, report_to=[], use_cpu=not cuda, disable_tqdm=True,
    )
    trainer = YaFSDPSFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                               processing_class=tok)
    before = trainer.evaluate()["eval_loss"]
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    after = trainer.evaluate()["eval_loss"]
    adapter = os.path.join(a.out, "adapter")
    trainer.save_model(adapter)
    if rank == 0:
        base_desc = repr(a.init_from_hf) if a.init_from_hf else "the tiny preset (build_llama('tiny', ...))"
        print(f"held-out loss {before:.4f} (before) -> {after:.4f} (step {trainer.state.global_step})")
        print(f"adapter  {adapter} (PEFT's format: PeftModel.from_pretrained(base, {adapter!r}); base: {base_desc})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from pretrain.ops import exit_fast  # main() put examples/ on the path

    exit_fast(0)  # without the collector's pass over every object at exit (pretrain/ops.py)
