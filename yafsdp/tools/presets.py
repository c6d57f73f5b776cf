"""Model presets: the project's one table of Llama shapes (HF ``LlamaConfig`` keyword arguments)
and the training defaults that suit each, read by the plan CLI (``python -m yafsdp plan``), the
benchmarks and the examples (``examples/pretrain_llama.py``); a name valid in one is valid in all.

    from yafsdp.presets import PRESETS, TRAINING, llama_config, build_llama
    model = build_llama("llama3-8b", device="meta")   # no memory allocated

The Llama-3 numbers are the published configurations (Meta's ``config.json``); the small ones are
chosen for this project's CPU runs. ``cpu-4x128`` is the pretraining job's default (a byte-level
vocabulary: 259 ids rounded up to 320); ``cpu-6x256`` is the DESIGN.md anchor model (6 layers x 256
hidden, fp32 on CPU). The module imports nothing from the engine, so tools can use it alone.
"""
from __future__ import annotations

import torch

_LLAMA3 = dict(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)

PRESETS: dict[str, dict] = {
    # The pretraining job's default: 4 layers x 128 hidden, byte vocabulary (0.87 M parameters);
    # about 0.5 s per step per rank on one CPU core at seq 256 x batch 8.
    "cpu-4x128": dict(
        vocab_size=320, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    # CI / smoke tests: a few hundred thousand parameters.
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    ),
    # DESIGN.md's CPU anchor: 6 layers x 256 hidden, Llama-2-sized vocabulary (21 M parameters).
    "cpu-6x256": dict(
        vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
    ),
    # The GPU single-device goal's "~1B Llama": Llama-3.2-1B (1.24 B parameters, tied head).
    "llama3-1b": dict(
        _LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    "llama3-3b": dict(
        _LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
    "llama3-8b": dict(
        _LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
    ),
    "llama3-70b": dict(
        _LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False,
    ),
    # Llama-2-70B (Meta's config.json): the QLoRA-on-2-GPUs figure of the plan (docs/qlora.md).
    "llama2-70b": dict(
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
}


# Training defaults per preset: (seq_len, batch per rank, peak lr, warmup steps, steps, what it is for).
TRAINING: dict[str, tuple[int, int, float, int, int, str]] = {
    "cpu-4x128": (256, 8, 3e-3, 20, 300, "the embedded default: a few minutes on 2 CPU cores"),
    "tiny": (64, 4, 3e-3, 4, 50, "CI and smoke tests: seconds on CPU"),
    "cpu-6x256": (256, 8, 1e-3, 20, 300, "DESIGN.md's CPU anchor shape (Llama-2 vocabulary)"),
    "llama3-1b": (2048, 8, 3e-4, 2000, 100_000, "Llama-3.2-1B shape; GPUs, --bf16"),
    "llama3-3b": (2048, 4, 3e-4, 2000, 100_000, "Llama-3.2-3B shape; GPUs, --bf16"),
    "llama3-8b": (4096, 2, 3e-4, 2000, 100_000, "Llama-3-8B shape; GPU nodes, --bf16, --activation-checkpointing"),
    "llama3-70b": (4096, 1, 1.5e-4, 2000, 100_000, "Llama-3-70B shape; many GPU nodes"),
    "llama2-70b": (2048, 1, 1e-4, 100, 10_000, "Llama-2-70B shape; the QLoRA fine-tuning anchor (2 GPUs, --offload)"),
}
assert TRAINING.keys() == PRESETS.keys(), "every preset needs its training defaults"


def llama_config(name: str, **overrides):
    """A ``transformers.LlamaConfig`` for preset ``name``; ``overrides`` replace any field."""
    from transformers import LlamaConfig

    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    kwargs = dict(PRESETS[name])
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def build_llama(name: str, *, device: str | torch.device = "cpu", seed: int = 0, **overrides):
    """``LlamaForCausalLM`` for preset ``name``. ``device="meta"`` allocates nothing; on a real
    device the weights come from HF's init under ``torch.manual_seed(seed)`` (identical across
    ranks and engines)."""
    from transformers import LlamaForCausalLM

    cfg = llama_config(name, **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def param_count(name: str, **overrides) -> int:
    """Parameters of preset ``name`` (tied weights counted once), computed on the meta device."""
    model = build_llama(name, device="meta", **overrides)
    return sum(p.numel() for p in model.parameters())
