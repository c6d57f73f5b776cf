"""The smallest complete yafsdp training script: a Hugging Face Llama, gradient accumulation,
gradient clipping and the full state dict at the end (the README's minimal example is its core).

    torchrun --nproc-per-node 2 examples/minimal.py              # CPU: gloo; GPUs: NCCL, bf16
    torchrun --nproc-per-node 2 examples/minimal.py model.pt     # also save the state dict (rank 0)
"""
import gc
import glob
import os
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import yafsdp

files = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "*.txt")))
text = torch.tensor(list(b"".join(open(f, "rb").read() for f in files)))  # the embedded corpus as byte ids


def micro_batch(step, micro, rank):
    """This rank's micro-batch: random windows of the corpus, a function of (step, micro, rank)."""
    g = torch.Generator().manual_seed(step * 1000 + micro * 10 + rank)
    starts = torch.randint(0, len(text) - seq, (batch_size,), generator=g)
    return torch.stack([text[s:s + seq] for s in starts])


# --- begin README "Use"
steps, accum, batch_size, seq = 40, 2, 4, 64
dist.init_process_group()                      # torchrun; NCCL on GPU, gloo on CPU
rank, cuda = dist.get_rank(), torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)
torch.manual_seed(0)                           # the same initial weights on every rank
model = yafsdp.YaFSDP(LlamaForCausalLM(config), param_dtype=torch.bfloat16 if cuda else None)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)   # or yafsdp.FusedAdamW
for step in range(steps):
    for micro in range(accum):                 # gradient accumulation: plain PyTorch habit
        ids = micro_batch(step, micro, rank).to(model.device)
        loss = model(input_ids=ids, labels=ids).loss
        (loss / accum).backward()
    norm = model.clip_grad_norm_(1.0)          # the global (unsharded) norm
    opt.step()
    opt.zero_grad()
    if rank == 0 and (step == 0 or (step + 1) % 10 == 0):
        print(f"step {step + 1}: loss {loss.item():.4f} (rank 0's last micro-batch), grad norm {norm:.3f}")
sd = model.full_state_dict()                   # rank 0: original HF keys, CPU tensors
# --- end README "Use"
if rank == 0 and len(sys.argv) > 1:
    torch.save(sd, sys.argv[1])
    print(f"saved {len(sd)} tensors to {sys.argv[1]}")
dist.barrier()                                 # no rank leaves while another still receives
# End as docs/api.md "Ending a script" says: drop the engine, then destroy the group and collect, so the gloo
# backend's threads are joined while Python still runs (never during interpreter finalization).
del model, opt, sd, loss, norm
dist.destroy_process_group()
gc.collect()
