"""Job presets: a model shape plus the training defaults that suit it.

The model shapes of the real sizes come from ``yafsdp.presets`` (the project's single source for
Llama shapes); this file adds the job's own default -- ``cpu-4x128``, a byte-level Llama sized so
the embedded run finishes in a few minutes on 2 CPU cores -- and, per preset, the defaults of
``--seq-len``, ``--batch-size``, ``--lr``, ``--warmup`` and ``--steps``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_PRESET = "cpu-4x128"


@dataclass(frozen=True)
class JobPreset:
    model: dict  # LlamaConfig keyword arguments; vocab_size None: from the tokenizer
    seq_len: int
    batch_size: int  # sequences per rank per micro-batch
    lr: float
    warmup: int
    steps: int  # the default --steps and --decay-steps
    note: str = ""
    tags: tuple = field(default_factory=tuple)


# The embedded default: 4 layers x 128 hidden, byte vocabulary (0.8 M parameters); about 0.5 s
# per step per rank on one CPU core at seq 256 x batch 8.
_CPU_4X128 = dict(
    vocab_size=None, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
)

_TRAINING = {
    # name: (seq_len, batch_size, lr, warmup, steps, note)
    "cpu-4x128": (256, 8, 3e-3, 20, 300, "the embedded default: a few minutes on 2 CPU cores"),
    "tiny": (64, 4, 3e-3, 4, 50, "CI and smoke tests: seconds on CPU"),
    "cpu-6x256": (256, 8, 1e-3, 20, 300, "DESIGN.md's CPU anchor shape (Llama-2 vocabulary)"),
    "llama3-1b": (2048, 8, 3e-4, 2000, 100_000, "Llama-3.2-1B shape; GPUs, --bf16"),
    "llama3-3b": (2048, 4, 3e-4, 2000, 100_000, "Llama-3.2-3B shape; GPUs, --bf16"),
    "llama3-8b": (4096, 2, 3e-4, 2000, 100_000, "Llama-3-8B shape; GPU nodes, --bf16, --activation-checkpointing"),
    "llama3-70b": (4096, 1, 1.5e-4, 2000, 100_000, "Llama-3-70B shape; many GPU nodes"),
}


def presets() -> dict[str, JobPreset]:
    """Every job preset, by name."""
    from yafsdp.presets import PRESETS as SHAPES  # the project's Llama shapes

    out = {}
    for name, (seq, bs, lr, warmup, steps, note) in _TRAINING.items():
        model = _CPU_4X128 if name == "cpu-4x128" else SHAPES.get(name)
        if model is None:  # a shape the project does not define (any more): skip it
            continue
        out[name] = JobPreset(dict(model), seq, bs, lr, warmup, steps, note)
    return out


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def model_config_dict(preset: JobPreset, tokenizer_vocab: int, seq_len: int) -> dict:
    """The LlamaConfig keyword arguments for a run: the preset's shape, a vocabulary that holds the
    tokenizer's, and room for ``seq_len`` positions."""
    cfg = dict(preset.model)
    have = int(cfg.get("vocab_size") or 0)
    cfg["vocab_size"] = have if have >= tokenizer_vocab else round_up(tokenizer_vocab, 64)
    cfg["max_position_embeddings"] = max(int(cfg.get("max_position_embeddings") or 0), seq_len)
    return cfg
