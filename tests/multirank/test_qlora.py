"""QLoRA: PEFT LoRA on a frozen base stored in NF4 (``YaFSDP(..., quantize_frozen="nf4")``).

Parity with the unsharded PEFT model whose frozen linear weights went through the same
quantize-dequantize (worlds 1-3; ZeRO-2 at world 3); the base never moves; full_state_dict gives the dequantized
values and loading them back re-quantizes to the same records; checkpoints store the records and
reshard (3 ranks -> 2); save_adapter / export_merged; the bf16 path; init of a meta-built model;
refusals; and the bytes gathered per step for the frozen base (NF4 vs bf16: <= 0.30x)."""
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import yafsdp
from dist_utils import run_ranks
from models import batch, loss_of, tiny_llama
from parity import rel_l2, rel_seq
from yafsdp import checkpoint as ckpt
from yafsdp.formats import nf4_codec as nf4
from yafsdp.init import init_shards_, normal_init

peft = pytest.importorskip("peft")
from test_lora import _lora_model, _train  # noqa: E402  (the LoRA tests' model and loop)


def _round_trip_base(model: nn.Module, dtype: torch.dtype, frozen_only: bool = True) -> nn.Module:
    """The unsharded reference: every frozen nn.Linear weight the engine stores in NF4 replaced by its
    NF4 quantize-dequantize in ``dtype`` (the values were first rounded to ``dtype``, as frozen values are).
    ``frozen_only=False``: every such Linear weight (a plain base, before PEFT freezes it)."""
    with torch.no_grad():
        for mod in model.modules():
            w = getattr(mod, "weight", None)
            if (isinstance(mod, nn.Linear) and (not frozen_only or not w.requires_grad)
                    and w.numel() % nf4.BLOCK == 0):
                packed, scales = nf4.quantize(w.detach().reshape(-1).to(dtype))
                values = nf4.dequantize_record(torch.cat([packed, scales.view(torch.uint8)]), w.numel(), dtype)
                w.copy_(values.view_as(w))
    return model


def _records(model):
    return {i.key: i.param.detach().clone() for i in model.shard_info() if i.kind == "nf4"}


def _qlora(rank, world, out_dir):
    model = _lora_model()
    # world 3 runs ZeRO-2 (each unit its own weight buffer and staging area), the others ZeRO-3
    wrapped = yafsdp.YaFSDP(model, quantize_frozen="nf4", zero_stage=2 if world == 3 else 3)
    kinds = sorted({(i.unit.rsplit(".", 1)[-1], i.kind) for i in wrapped.shard_info()})
    losses, norms = _train(wrapped, rank, world, True)
    sd = wrapped.full_state_dict()
    out = dict(losses=losses, norms=norms, sd=sd, kinds=kinds, nf4_bytes=wrapped.allocated_bytes()["nf4"])
    if world == 2:  # the state-dict, checkpoint, adapter, bf16, init and refusal checks, on one world
        # Loading the dequantized values back re-quantizes them to the same records.
        before = _records(wrapped)
        wrapped.load_full_state_dict(sd if rank == 0 else None)
        out["reloaded_same"] = all(torch.equal(before[k], v) for k, v in _records(wrapped).items())
        # A checkpoint holds the records (codes + scales), world-size independent: saved on 2 ranks,
        # loaded on 1 (a subgroup) into a freshly wrapped model.
        path = ckpt.save_checkpoint(os.path.join(out_dir, "ckpt"), 3, wrapped)
        sub = dist.new_group([0])
        if rank == 0:
            fresh = yafsdp.YaFSDP(_lora_model(), process_group=sub, quantize_frozen="nf4")
            ckpt.load_checkpoint(path, fresh)
            out["resharded_sd"] = fresh.full_state_dict()
            try:  # a model whose base is a bf16 frozen group does not take NF4 entries (nor the reverse)
                ckpt.load_checkpoint(path, yafsdp.YaFSDP(_lora_model(), process_group=sub))
            except ckpt.CheckpointError as e:
                out["mismatch_error"] = str(e)
        out["adapter"] = wrapped.save_adapter(os.path.join(out_dir, "adapter"))
        out["merged"] = yafsdp.adapters.export_merged(wrapped, os.path.join(out_dir, "merged"))
        out.update(_bf16_and_bytes(rank, world), init=_meta_init(rank, world))
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_qlora_parity_state_dict_checkpoint_adapter(world, tmp_path):
    r = run_ranks(_qlora, world, str(tmp_path))[0]
    ref = _round_trip_base(_lora_model(), torch.float32)
    init = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    ref_losses, ref_norms = _train(ref, 0, world, False)
    assert rel_seq(r["losses"], ref_losses) < 1e-5, (r["losses"], ref_losses)
    assert rel_seq(r["norms"], ref_norms) < 1e-5, (r["norms"], ref_norms)
    ref_sd = {k: v.detach() for k, v in ref.state_dict().items()}
    assert rel_l2(r["sd"], ref_sd) < 1e-4
    base = [k for k in init if "lora_" not in k]
    # full_state_dict gives the dequantized base, bit for bit the reference's, unchanged by training
    assert base and all(torch.equal(r["sd"][k], init[k]) for k in base)
    # every layer's frozen linears are NF4; the odd-sized head and the embedding stay bf16 (here fp32) frozen
    assert ("0", "nf4") in r["kinds"] and ("0", "trainable") in r["kinds"] and ("lm_head", "frozen") in r["kinds"]
    assert ("embed_tokens", "frozen") in r["kinds"] and not any(k == "nf4" for u, k in r["kinds"] if u == "lm_head")
    assert r["nf4_bytes"] > 0
    if world == 2:
        from transformers import LlamaForCausalLM

        assert r["reloaded_same"]
        assert r["resharded_sd"].keys() == r["sd"].keys()
        assert all(torch.equal(r["resharded_sd"][k], r["sd"][k]) for k in r["sd"])
        # the engine's settings are in the manifest: the refusal names the setting, both values and the way out
        msg = r["mismatch_error"]
        assert "quantize_frozen" in msg and "'nf4'" in msg and "Build the model with quantize_frozen='nf4'" in msg, msg
        _check_bf16_and_bytes(r)
        _check_meta_init(r["init"])

        x = batch("llama", 7, 0, 0)
        with torch.no_grad():
            want = ref(**x).logits
            # The adapter applies to the quantize-dequantized base it was trained with.
            loaded = peft.PeftModel.from_pretrained(_round_trip_base(tiny_llama(), torch.float32, False), r["adapter"])
            assert (loaded(**x).logits - want).abs().max().item() < 1e-5
            # The merged export: the dequantized base + scaling B A, a plain HF checkpoint.
            plain = LlamaForCausalLM.from_pretrained(r["merged"])
            assert (plain(**x).logits - want).abs().max().item() < 1e-4


def _bf16_and_bytes(rank, world):
    """The bf16 path (the QLoRA recipe), and the bytes gathered per step for the frozen base."""
    model = _lora_model()
    originals = {k: v.detach().clone() for k, v in model.state_dict().items()}
    wrapped = yafsdp.YaFSDP(model, param_dtype=torch.bfloat16, quantize_frozen="nf4")
    first = loss_of(wrapped, "llama", batch("llama", 0, 0, rank)).item()
    opt = yafsdp.FusedAdamW(wrapped.parameters(), lr=1e-2)
    for step in range(2):
        loss_of(wrapped, "llama", batch("llama", step, 0, rank)).backward()
        opt.step()
        opt.zero_grad()
    sd = wrapped.full_state_dict()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
    from nf4_gather import measure

    return dict(bf16_first=first, bf16_sd=sd, originals=originals, bytes=measure())


def _check_bf16_and_bytes(r):
    # The gathered base is the NF4 round trip of the bf16-rounded weights, bit for bit (torchao's
    # values: tests/unit/test_nf4.py), so the first forward is the bf16 reference model's.
    ref = _round_trip_base(_lora_model(), torch.bfloat16)
    want = {k: v.detach().to(torch.bfloat16).float() for k, v in ref.state_dict().items()}  # frozen: bf16 values
    base = [k for k in want if "lora_" not in k]
    assert all(torch.equal(r["bf16_sd"][k], want[k]) for k in base)
    changed = [k for k in base if not torch.equal(r["originals"][k], want[k])]
    assert len(changed) >= 7 * 3  # every frozen linear of every layer was quantized
    with torch.no_grad():
        ref_bf16 = _round_trip_base(_lora_model(), torch.bfloat16).to(torch.bfloat16)
        ref_loss = loss_of(ref_bf16, "llama", batch("llama", 0, 0, 0)).item()
    assert abs(r["bf16_first"] - ref_loss) < 1e-3 * abs(ref_loss), (r["bf16_first"], ref_loss)
    # Bytes gathered per step for the frozen base: NF4 records vs the bf16 frozen group.
    rb = r["bytes"]
    assert rb["base_bf16"] > 0 and rb["ratio"] <= 0.30, rb
    assert rb["nf4"].get("trainable") == rb["bf16"].get("trainable")  # the adapters move as before


def _meta_init(rank, world):
    """init_shards_ of a meta-built QLoRA model: each rank quantizes its own values; compared with the
    same init without quantize_frozen (world-size independent values, tested for plain shards)."""
    sds = []
    for quantize in ("nf4", None):
        with torch.device("meta"):
            model = _lora_model()
        wrapped = yafsdp.YaFSDP(model, quantize_frozen=quantize)
        init_shards_(wrapped, normal_init(0.02), seed=3)
        sds.append(wrapped.full_state_dict())
    errors = []
    try:
        yafsdp.YaFSDP(tiny_llama(), quantize_frozen="int4")
    except ValueError as e:
        errors.append(str(e))
    with warnings.catch_warnings(record=True) as caught:  # nothing frozen: nothing to quantize, said once
        warnings.simplefilter("always")
        yafsdp.YaFSDP(tiny_llama(), quantize_frozen="nf4")
    errors += [str(w.message) for w in caught if "quantize_frozen" in str(w.message)]
    return dict(quantized=sds[0], plain=sds[1], errors=errors)


def _check_meta_init(r):
    """The quantized init is the NF4 round trip of the plain init (weights the engine quantizes),
    equal elsewhere. An unknown format is refused naming it; quantize_frozen with nothing frozen warns."""
    q, plain = r["quantized"], r["plain"]
    assert q.keys() == plain.keys()
    names = {n for n, m in tiny_llama().named_modules() if isinstance(m, nn.Linear) and m.weight.numel() % 64 == 0}
    quantized = [k for k in q if "lora_" not in k and any(k.endswith(f"{n}.weight") or k.endswith(f"{n}.base_layer.weight")
                                                          for n in names)]
    assert len(quantized) == 7 * 3
    for k in q:
        if k in quantized:
            w = plain[k]
            packed, scales = nf4.quantize(w.reshape(-1))
            want = nf4.dequantize_record(torch.cat([packed, scales.view(torch.uint8)]), w.numel(), w.dtype)
            assert torch.equal(q[k], want.view_as(w)), k
            assert not torch.equal(q[k], w)
        else:
            assert torch.equal(q[k], plain[k]), k
    err, warn = r["errors"]
    assert "quantize_frozen='int4' is not supported" in err and "nf4" in err
    assert "found no frozen nn.Linear weight" in warn
