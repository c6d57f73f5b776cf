"""The engine's host-side cost per step: a tiny model whose step is mostly the engine's per-unit
Python work (hooks, gathers, gates, reduces), one rank, one thread.

    python benchmarks/host_overhead.py                       # this checkout's yafsdp
    PYTHONPATH=/path/to/other/checkout python benchmarks/host_overhead.py   # another engine version

Run the two alternately a few times on a quiet machine and compare the best figures. The process
CPU time per step (all threads: gloo's workers too) is printed beside the wall time: on a loaded
machine it moves less with the load than the wall time does.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the tiny Llama (32 hidden)")
    ap.add_argument("--steps", type=int, default=5, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; the best round is reported")
    a = ap.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    import yafsdp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29671")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=44, num_hidden_layers=a.layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = yafsdp.YaFSDP(LlamaForCausalLM(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 67, (2, 9), generator=g) for _ in range(a.steps)]

    def step(ids):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    for ids in batches[:2]:
        step(ids)
    best = best_cpu = float("inf")
    for _ in range(a.rounds):
        t, c = time.perf_counter(), time.process_time()
        for ids in batches:
            step(ids)
        best = min(best, (time.perf_counter() - t) / len(batches))
        best_cpu = min(best_cpu, (time.process_time() - c) / len(batches))
    print(f"yafsdp from {os.path.dirname(yafsdp.__file__)}: {1e3 * best:.2f} ms/step, process CPU "
          f"{1e3 * best_cpu:.2f} ms/step (best of {a.rounds} rounds of {a.steps}; {len(model.flat_units)} flat units)")
    del model, opt
    dist.destroy_process_group()
    import gc

    gc.collect()  # the backend's threads joined before exit (docs/api.md, "Ending a script")


if __name__ == "__main__":
    main()
