"""[Note: the sharded lookup of an embedding] (yafsdp/engine/lookup.py): at gloo world 2 an untied
embedding is looked up from the shards and its gradient rows added where they are owned. One
spawn runs every case (each world-2 start costs seconds on 2 cores)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import yafsdp
from dist_utils import run_ranks
from models import tiny_llama
from parity import rel_l2

VOCAB = 1000
PAD = 7


def _ids(step: int, micro: int, rank: int) -> torch.Tensor:
    """Token ids whose count differs by rank and step (the lookup's room grows, the ranks pad),
    with the padding id among them."""
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    ids = torch.randint(0, VOCAB, (2, 9 + 3 * rank + 2 * step), generator=g)
    ids[0, :2] = PAD
    return ids


def _embed_bytes(model, kind: str) -> int:
    return sum(v for (k, unit), v in model._rt.schedule.counted.items() if k == kind and unit == "model.embed_tokens")


def _train(lookup: bool, rank: int):
    model = tiny_llama(vocab=VOCAB, layers=2)
    model.model.embed_tokens.padding_idx = PAD  # its row gets no gradient, as in the dense backward
    model = yafsdp.YaFSDP(model, sharded_lookup=lookup)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        for micro in range(2):  # the second backward accumulates into the grad shard
            ids = _ids(step, micro, rank)
            loss = model(input_ids=ids, labels=ids).loss / 2
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # a no-grad forward (evaluation) looks up too
        logits = model(input_ids=_ids(5, 0, rank)).logits
    # the embedding called on its own, its output modified in place (as the plain module's may be)
    rows = model.module.model.embed_tokens(_ids(6, 0, rank)).mul_(3.0)
    (rows * rows).sum().backward()
    return model, losses, (logits, rows.detach(), model._rt.units[0].flat_param.grad.clone())


class _CheckpointedEmbedding(nn.Module):
    """The embedding's call under a non-reentrant activation checkpoint (recomputed inside backward)."""

    def __init__(self, inner: nn.Embedding):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        return torch.utils.checkpoint.checkpoint(self.inner, ids, use_reentrant=False)


def _checkpointed(lookup: bool, rank: int):
    model = tiny_llama(vocab=VOCAB, layers=2)
    model.model.embed_tokens = _CheckpointedEmbedding(model.model.embed_tokens)
    model = yafsdp.YaFSDP(model, sharded_lookup=lookup)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        ids = _ids(step, 0, rank)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    gathered = sum(v for (k, unit), v in model._rt.schedule.counted.items()
                   if k == "gather" and unit == "model.embed_tokens.inner")
    return model.full_state_dict(), gathered


def _cases(rank, world):
    out = {}
    for lookup in (True, False):
        model, losses, logits = _train(lookup, rank)
        out[lookup] = dict(sd=model.full_state_dict(), losses=losses, logits=logits,
                           gathered=_embed_bytes(model, "gather"), reduced=_embed_bytes(model, "reduce"),
                           armed=model._rt.units[0].lookup_hooks is not None)

    out["checkpointed"] = [_checkpointed(lookup, rank) for lookup in (True, False)]

    # An id out of range: every rank refuses it (rank 1 has it), nothing hangs, the engine goes on.
    model = yafsdp.YaFSDP(tiny_llama(vocab=VOCAB, layers=2))
    bad = _ids(0, 0, rank)
    if rank == 1:
        bad[1, 3] = VOCAB + 5
    try:
        model(input_ids=bad, labels=bad)
        out["range"] = None
    except IndexError as e:
        out["range"] = str(e)
    ids = _ids(0, 0, rank)
    try:  # token ids that are not integers on one rank: both refuse, none waits for the other
        model.module.model.embed_tokens(ids.float() if rank == 0 else ids)
        out["dtype"] = None
    except RuntimeError as e:
        out["dtype"] = str(e)
    out["after"] = model(input_ids=ids, labels=ids).loss.item()

    # A hook on the parameter (it reads the full local gradient) and a forward hook added after
    # wrapping (it may read the full weight): those calls gather the embedding as before.
    model = yafsdp.YaFSDP(tiny_llama(vocab=VOCAB, layers=2))
    emb = model.module.model.embed_tokens
    seen = []
    handle = emb.weight.register_hook(lambda g: seen.append(tuple(g.shape)))
    before = _embed_bytes(model, "gather")
    model(input_ids=ids, labels=ids).loss.backward()
    out["hooked"] = (seen, _embed_bytes(model, "gather") - before)
    handle.remove()
    weights = []
    emb.register_forward_hook(lambda m, a, o: weights.append(tuple(o.shape)))
    before = _embed_bytes(model, "gather")
    model(input_ids=ids, labels=ids)
    out["forward_hook"] = (weights, _embed_bytes(model, "gather") - before)
    return out


@pytest.fixture(scope="module")
def cases():
    return run_ranks(_cases, 2)


def test_sharded_lookup_trains_bit_for_bit_like_the_gathered_embedding(cases):
    """Two steps of two micro-batches (the second accumulating), token counts that differ by rank and
    step, a padding id, AdamW: losses, every trained weight and no-grad logits are bit for bit those of
    the gathered embedding; the exchanges moved a few KiB where the gathered path moves the unit."""
    unit_bytes = VOCAB * 32 * 4
    for r in cases:
        on, off = r[True], r[False]
        assert on["armed"] and not off["armed"]
        assert on["losses"] == off["losses"]
        assert all(torch.equal(a, b) for a, b in zip(on["logits"], off["logits"]))
        # 4 trained forwards, 1 no-grad and the call on its own (the gathered path gathers it each time),
        # 5 backwards (one reduce each)
        assert off["gathered"] == 6 * unit_bytes and off["reduced"] == 5 * unit_bytes
        assert 0 < on["gathered"] + on["reduced"] < (off["gathered"] + off["reduced"]) // 8, (on, off)
        if on["sd"]:  # rank 0's full state dict
            assert rel_l2(on["sd"], dict(tiny_llama(vocab=VOCAB, layers=2).state_dict())) > 1e-4  # it trained
            assert all(torch.equal(on["sd"][k], off["sd"][k]) for k in on["sd"])
            # the padding row got no gradient: AdamW's weight decay alone moved it
            emb = on["sd"]["model.embed_tokens.weight"]
            start = tiny_llama(vocab=VOCAB, layers=2).model.embed_tokens.weight.detach()
            assert torch.allclose(emb[PAD], start[PAD] * (1 - 1e-2 * 1e-2) ** 2, rtol=0, atol=1e-7)
            assert not torch.allclose(emb[_ids(0, 0, 0)[0, 5]], start[_ids(0, 0, 0)[0, 5]], atol=1e-4)


def test_sharded_lookup_refuses_bad_ids_on_every_rank(cases):
    """An id out of range or ids that are not integers on one rank: every rank raises, naming the rank."""
    for r in cases:
        assert r["range"] is not None, "an id out of range was looked up silently"
        assert "token id 1005 on rank 1" in r["range"] and "model.embed_tokens" in r["range"], r["range"]
        assert r["dtype"] is not None and "not integers on rank 0" in r["dtype"], r["dtype"]
        assert r["after"] > 0  # the next forward runs


def test_hooks_that_read_the_full_weight_or_gradient_keep_the_gathered_embedding(cases):
    for r in cases:
        seen, gathered = r["hooked"]
        assert seen == [(VOCAB, 32)] and gathered == VOCAB * 32 * 4
        shapes, gathered = r["forward_hook"]
        assert len(shapes) == 1 and gathered == VOCAB * 32 * 4


def test_a_checkpointed_embedding_is_looked_up_again_in_its_recompute(cases):
    """A non-reentrant checkpoint around the embedding: the recompute inside backward looks up as the
    forward did (the same saved tensors, so torch's checkpoint check passes), bit for bit the gathered path."""
    for r in cases:
        (sd, gathered), (sd_g, gathered_g) = r["checkpointed"]
        assert gathered < gathered_g // 8 and gathered_g == 4 * VOCAB * 32 * 4  # forward and recompute, 2 steps
        if sd:
            assert all(torch.equal(sd[k], sd_g[k]) for k in sd)
