"""Pretrain a Llama (Hugging Face ``LlamaForCausalLM``) with yafsdp -- the project's main job.

On a fresh CPU machine, with nothing downloaded (embedded public-domain corpus, byte-level
tokenizer, a 0.8 M-parameter Llama; a few minutes on 2 cores):

    torchrun --nproc-per-node 2 examples/pretrain_llama.py

On one GPU node (bf16 compute, fp32 master weights and optimizer state):

    torchrun --nproc-per-node 8 examples/pretrain_llama.py --preset llama3-1b --data corpus.bin --bf16 \\
        --tokenizer /models/llama3-tokenizer --out runs/llama1b

On two nodes (run the same line on each, NODE_RANK=0 on the first, 1 on the second; --out must be a
shared filesystem; --max-restarts lets a failed worker group restart and resume):

    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint node0.cluster:29500 --rdzv-id llama8b --max-restarts 3 \\
        examples/pretrain_llama.py --preset llama3-8b --data /shared/corpus.bin --bf16 \\
        --activation-checkpointing --out /shared/runs/llama8b --save-every 500

Tensor parallel inside each node, sharded across nodes (docs/tp.md; on a CPU: --nproc-per-node 4 --tp 2):

    torchrun --nnodes 4 --node-rank $NODE_RANK --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint node0.cluster:29500 --rdzv-id llama8b-tp \\
        examples/pretrain_llama.py --preset llama3-8b --data /shared/corpus.bin --bf16 --tp 8 \\
        --activation-checkpointing --out /shared/runs/llama8b-tp --save-every 500

Continue a run (newest complete checkpoint in --out), export it for Hugging Face:

    torchrun --nproc-per-node 2 examples/pretrain_llama.py --resume --steps 600 --export-hf runs/default/hf

Also runs as plain ``python examples/pretrain_llama.py`` (a world of one). Everything the run
writes goes to --out: metrics.jsonl (one line per step), events.jsonl, loss.png, run.json and
checkpoints/step_*/ (torch.distributed.checkpoint). See docs/pretrain.md.
"""
from __future__ import annotations

# The job lives in examples/pretrain/job.py (beside this script; its directory is on sys.path), shared
# with examples/finetune_lora.py; these names stay importable from here (examples/generate.py uses them).
from pretrain.job import Job, JobError, main, model_config, parse_args  # noqa: F401
from pretrain.ops import exit_fast

if __name__ == "__main__":
    exit_fast(main())  # sys.exit(main()), without the collector's pass over every object at exit
