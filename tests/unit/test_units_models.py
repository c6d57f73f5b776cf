"""Automatic units on encoder-decoder and encoder-only HF models (tiny configs built here, no
downloads): every repeated block list becomes units -- T5's encoder blocks as well as its decoder
blocks -- and the wrapped models train like the unwrapped ones (world 2, gloo)."""
from __future__ import annotations

import torch

from dist_utils import run_ranks
from yafsdp.layout.units import discover, find_block_lists


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=3, num_heads=2,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(cfg)


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                     max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(cfg)


def _inputs(kind: str, step: int, rank: int, n: int = 2):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(1, 64, (n, 11), generator=g)
    y = torch.randint(1, 64, (n, 7 if kind == "t5" else 11), generator=g)
    return dict(input_ids=x, labels=y)


def test_every_block_list_is_found():
    t5 = _t5()
    lists = find_block_lists(t5)
    assert [len(b) for b in lists] == [2, 3]
    assert lists[0][0] is t5.encoder.block[0] and lists[1][0] is t5.decoder.block[0]
    names = [s.name for s in discover(t5, None)[0]]
    # Before: only the decoder's (largest) list was found and each encoder Linear became a unit.
    assert names == ["shared", "encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1",
                     "decoder.block.2"]
    shared = discover(t5, None)[0][0]
    assert {m.name for m in shared.members} >= {"shared", "lm_head"}  # tied head: a member, not a copy
    names = [s.name for s in discover(_bert(), None)[0]]
    assert names == ["bert.embeddings.word_embeddings", "bert.embeddings.position_embeddings",
                     "bert.embeddings.token_type_embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1",
                     "cls.predictions.transform.dense"]


def _train(rank: int, world: int):
    import yafsdp

    out = {}
    for kind, build in (("t5", _t5), ("bert", _bert)):
        ref = build()
        model = yafsdp.YaFSDP(build())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        losses, ref_losses = [], []
        for _ in range(3):
            loss = model(**_inputs(kind, 0, rank)).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            torch.distributed.all_reduce(t)
            losses.append(t.item() / world)
            both = [_inputs(kind, 0, r) for r in range(world)]  # the global batch, unsharded
            ref_loss = ref(**{k: torch.cat([b[k] for b in both]) for k in both[0]}).loss
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(ref_loss.item())
        out[kind] = (losses, ref_losses, [u.name for u in model.flat_units])
    return out


def test_t5_and_bert_train_like_unsharded():
    res = run_ranks(_train, 2)[0]
    for kind, (losses, ref_losses, units) in res.items():
        assert losses[2] < losses[0], (kind, losses)  # it learns
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref_losses)), (kind, losses, ref_losses)
    assert "encoder.block.1" in res["t5"][2] and "decoder.block.2" in res["t5"][2]
