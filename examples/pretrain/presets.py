"""Job presets: a model shape plus the training defaults that suit it.

Both come from ``yafsdp.presets`` (the project's one preset table, shared with the plan CLI and
the benchmarks); this file turns its rows into the defaults of ``--seq-len``, ``--batch-size``,
``--lr``, ``--warmup`` and ``--steps`` and fits the vocabulary to the tokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_PRESET = "cpu-4x128"


@dataclass(frozen=True)
class JobPreset:
    model: dict  # LlamaConfig keyword arguments; a tokenizer with more ids enlarges vocab_size
    seq_len: int
    batch_size: int  # sequences per rank per micro-batch
    lr: float
    warmup: int
    steps: int  # the default --steps and --decay-steps
    note: str = ""
    tags: tuple = field(default_factory=tuple)


def presets() -> dict[str, JobPreset]:
    """Every job preset, by name."""
    from yafsdp.presets import PRESETS, TRAINING

    return {name: JobPreset(dict(PRESETS[name]), *TRAINING[name]) for name in PRESETS}


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
