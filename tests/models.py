"""Small models with deliberately uneven sizes, shared by the tests."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB = 67


def tiny_llama(tie: bool = False, layers: int = 3, seed: int = 0, vocab: int = VOCAB, checkpointing: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=44, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tie, attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    return model


class Block(nn.Module):
    def __init__(self, d: int, ckpt: bool):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d + 3)
        self.fc2 = nn.Linear(2 * d + 3, d)
        self.norm = nn.LayerNorm(d)
        self.ckpt = ckpt

    def _mlp(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))

    def forward(self, x, *, scale: float = 1.0):
        h = self.norm(x)
        h = checkpoint(self._mlp, h, use_reentrant=False) if self.ckpt else self._mlp(h)
        return x + scale * h


class Stack(nn.Module):
    """A plain non-HF stack: input projection, repeated blocks, head."""

    def __init__(self, d_in: int = 7, d: int = 17, d_out: int = 5, n: int = 3, ckpt: bool = False, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d, ckpt) for _ in range(n))
        self.head = nn.Linear(d, d_out, bias=False)

    def forward(self, x, target=None):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h, scale=0.5)  # a keyword input into every unit
        out = self.head(h)
        return ((out - target) ** 2).mean() if target is not None else out


class _Branch(nn.Module):
    """A block whose second linear is used only when asked (a conditional branch, an MoE expert)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(9, 9), nn.Linear(9, 9)  # uneven: padded at world 1

    def forward(self, x, use_b: bool):
        x = self.a(x)
        return self.b(x) if use_b else x


class Branchy(nn.Module):
    """Three blocks whose second linears get a gradient only in the steps that use them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.layers = nn.ModuleList([_Branch() for _ in range(3)])

    def forward(self, x, use_b: bool):
        for layer in self.layers:
            x = layer(x, use_b)
        return x.square().mean()


def batch(kind: str, step: int, micro: int, rank: int, n: int = 2, seq: int = 9, vocab: int = VOCAB):
    """Deterministic per-(step, micro, rank) inputs (llama: ids drawn from the whole ``vocab``)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    if kind == "llama":
        ids = torch.randint(0, vocab, (n, seq), generator=g)
        return {"input_ids": ids, "labels": ids}
    return {"x": torch.randn(n, 7, generator=g), "target": torch.randn(n, 5, generator=g)}


def loss_of(model, kind: str, inputs):
    if kind == "llama":
        return model(**inputs).loss
    return model(inputs["x"], inputs["target"])


def all_grads(model) -> torch.Tensor:
    """Every trainable unit's fp32 grad shard end to end (padding included), laid as the engine's one grad
    store; zeros for a shard whose ``.grad`` is None. The same whether the engine keeps that store or each
    shard lives for a step (world 1: [Note: the grad shard's lifetime at world 1] in yafsdp/layout/sizing.py)."""
    from yafsdp.engine.shard_grad import plain

    parts = []
    for u in model._rt.all:
        p = u.flat_param
        if p is not None:
            parts.append(plain(p.grad).detach().clone() if p.grad is not None else torch.zeros_like(p.detach()))
    return torch.cat(parts) if parts else torch.zeros(0)


def random_tokens_step(vocab: int, b: int, s: int):
    """``step(engine, i)`` for ``measure_memory``: an HF causal LM's loss on ``b`` x ``s`` random tokens (seeded
    by ``i``), backward, the optimizer's step, its gradients set to None. ``engine``: (model, optimizer)."""
    def step(engine, i):
        model, opt = engine
        ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(i))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step
