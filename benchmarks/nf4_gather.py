"""Bytes gathered per step for a QLoRA model's frozen base: NF4 (``quantize_frozen="nf4"``) against
the bf16 frozen group, counted by the engine itself (``model.schedule.gathered``: the all-gather
outputs' bytes by flat-group kind). The figure is independent of the hardware (bytes, not time);
it runs on CPU.

    torchrun --nproc-per-node 2 benchmarks/nf4_gather.py            # gloo, CPU
    python benchmarks/nf4_gather.py                                 # one process (world 1)

The frozen base's bytes of the NF4 run are those of its ``nf4`` groups; of the bf16 run, the bytes
of the same weights (its ``frozen`` groups less what stays bf16 in the NF4 run: embedding, head).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import yafsdp  # noqa: E402
from _common import finish_distributed  # this script's directory is on sys.path  # noqa: E402


def qlora_model(hidden=256, intermediate=688, layers=2, vocab=256):
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="eager")
    torch.manual_seed(0)
    return peft.get_peft_model(LlamaForCausalLM(cfg), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0))


def gathered_per_step(quantize_frozen, steps: int = 1, **model_kw) -> dict[str, int]:
    """Bytes this rank received from the engine's all-gathers per training step, by group kind."""
    model = yafsdp.YaFSDP(qlora_model(**model_kw), param_dtype=torch.bfloat16, quantize_frozen=quantize_frozen)
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()  # the first step: its prefetch order is being learned
    model.schedule.gathered.clear()
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
    return {k: v // steps for k, v in model.schedule.gathered.items()}


def measure(**model_kw) -> dict:
    bf16 = gathered_per_step(None, **model_kw)
    q = gathered_per_step("nf4", **model_kw)
    base_bf16 = bf16.get("frozen", 0) - q.get("frozen", 0)  # the weights NF4 stores in 4 bits, as bf16
    base_nf4 = q.get("nf4", 0)
    return dict(bf16=bf16, nf4=q, base_bf16=base_bf16, base_nf4=base_nf4, ratio=base_nf4 / base_bf16)


def main():
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    r = measure()
    if dist.get_rank() == 0:
        print(f"world {dist.get_world_size()}: frozen base gathered per step (ZeRO-3: forward + backward re-gather)")
        print(f"  bf16 frozen group: {r['base_bf16']:,} bytes")
        print(f"  NF4 records:       {r['base_nf4']:,} bytes  ({r['ratio']:.3f}x)")
        print(f"  all kinds, bf16 run: {dict(r['bf16'])}; NF4 run: {dict(r['nf4'])}")
    finish_distributed()


if __name__ == "__main__":
    main()
