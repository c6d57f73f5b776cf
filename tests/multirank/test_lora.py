"""PEFT LoRA, unmodified: units found inside PEFT's wrapper, the base frozen (frozen groups), the
adapters train exactly like the unsharded PEFT model, and the adapter saved by
``YaFSDP.save_adapter`` loads with ``peft.PeftModel.from_pretrained`` and gives the same logits."""

import os

import pytest
import torch

import yafsdp
from dist_utils import run_ranks
from models import batch, loss_of, tiny_llama
from parity import rel_l2, rel_seq

peft = pytest.importorskip("peft")

STEPS = 3


def _lora_model():
    model = peft.get_peft_model(
        tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                                      lora_dropout=0.0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B starts at zero in PEFT; make the adapters matter from the first step
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def _train(model, rank, world, sharded):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1,
                            foreach=False)
    losses, norms = [], []
    for step in range(STEPS):
        if sharded:
            inputs = batch("llama", step, 0, rank)
        else:
            parts = [batch("llama", step, 0, r) for r in range(world)]
            inputs = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        loss = loss_of(model, "llama", inputs)
        loss.backward()
        if sharded:
            t = torch.tensor(loss.item())
            torch.distributed.all_reduce(t)
            losses.append(t.item() / world)
            norms.append(model.clip_grad_norm_(1.0).item())
        else:
            losses.append(loss.item())
            norms.append(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                        1.0).item())
        opt.step()
        opt.zero_grad()
    return losses, norms


def _sharded(rank, world, out_dir):
    model = _lora_model()
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    wrapped = yafsdp.YaFSDP(model)
    kinds = {(i.unit.rsplit(".", 1)[-1], i.kind) for i in wrapped.shard_info()}
    losses, norms = _train(wrapped, rank, world, True)
    sd = wrapped.full_state_dict()
    path = wrapped.save_adapter(out_dir)
    merged = yafsdp.adapters.export_merged(wrapped, out_dir + "-merged")
    return dict(merged=merged, losses=losses, norms=norms, sd=sd, init=init, path=path, kinds=sorted(kinds),
                trainable=sum(i.numel for i in wrapped.shard_info() if i.kind == "trainable"))


def _two_adapters():
    model = _lora_model()
    model.add_adapter("second", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                lora_dropout=0.0, init_lora_weights=False))  # B not zero
    return model


def _err(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (the message is what is checked)
        return f"{type(e).__name__}: {e}"
    return ""


def _switches(rank, world, root):
    """PEFT's adapter switches on a wrapped model, against the same calls on the unwrapped one: the base model's
    logits inside ``disable_adapter()`` (TRL's DPO reference with ref_model=None), then a training step as
    before; ``set_adapter`` to another adapter refused before anything changed; the exports that would not be
    what the user meant, refused naming the right ones."""
    model, ref = yafsdp.YaFSDP(_two_adapters()), _two_adapters()
    x = batch("llama", 5, 0, rank)
    out = {}
    with torch.no_grad():
        with model.module.disable_adapter():
            got = model(**x).logits
        with ref.disable_adapter():
            want = ref(**x).logits
        out["disabled"] = (got - want).abs().max().item()
        out["disabled_vs_adapted"] = (got - ref(**x).logits).abs().max().item()  # the adapter did change them
    model.module.base_model.disable_adapter_layers()  # the same, by hand
    with torch.no_grad():
        out["by_hand"] = (model(**x).logits - want).abs().max().item()
    model.module.base_model.enable_adapter_layers()
    out["trainable"] = [n for n, p in model.module.named_parameters() if p.requires_grad] == \
        [n for n, p in ref.named_parameters() if p.requires_grad]
    out["set_same"] = _err(lambda: model.module.set_adapter("default"))
    out["set_other"] = _err(lambda: model.module.set_adapter("second"))
    out["set_other_tuner"] = _err(lambda: model.module.base_model.set_adapter("second"))
    out["active"] = model.module.active_adapter
    opt, ropt = (torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5) for m in (model, ref))
    loss_of(model, "llama", batch("llama", 6, 0, rank)).backward()
    for r in range(world):
        (loss_of(ref, "llama", batch("llama", 6, 0, r)) / world).backward()
    opt.step()
    ropt.step()
    full = model.full_state_dict()
    out["step"] = max(((full[k] - v).abs().max().item() for k, v in ref.state_dict().items() if k in full),
                      default=0.0)
    out["export_hf"] = _err(lambda: yafsdp.hf.export_hf(model, os.path.join(root, "hf")))
    out["exported"] = os.path.exists(os.path.join(root, "hf"))
    out["save_pretrained"] = _err(lambda: model.save_pretrained(os.path.join(root, "sp")))
    out["module_save_pretrained"] = _err(lambda: model.module.save_pretrained(os.path.join(root, "msp")))
    return out


def _world2(rank, world, root):
    """The world-2 runs of this file in one spawn."""
    return dict(sharded=_sharded(rank, world, os.path.join(root, "adapter")),
                not_peft=_not_peft(rank, world, os.path.join(root, "x")), mixed=_mixed_sharded(rank, world),
                switches=_switches(rank, world, os.path.join(root, "switches")))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora2"))
    return root, run_ranks(_world2, 2, root)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_lora_parity_and_adapter_round_trip(world, tmp_path, request):
    if world == 2:  # its spawn is shared with the other world-2 tests of this file
        root, per_rank = request.getfixturevalue("world2")
        r, out = per_rank[0]["sharded"], os.path.join(root, "adapter")
    else:
        out = str(tmp_path / "adapter")
        r = run_ranks(_sharded, world, out)[0]
    ref = _lora_model()
    ref_losses, ref_norms = _train(ref, 0, world, False)
    assert rel_seq(r["losses"], ref_losses) < 1e-5, (r["losses"], ref_losses)
    assert rel_seq(r["norms"], ref_norms) < 1e-5, (r["norms"], ref_norms)
    ref_sd = {k: v.detach() for k, v in ref.state_dict().items()}
    assert rel_l2(r["sd"], ref_sd) < 1e-4
    base = [k for k in r["init"] if "lora_" not in k]
    assert base and all(torch.equal(r["sd"][k], r["init"][k]) for k in base)  # the base never moves
    assert ("lm_head", "frozen") in r["kinds"] and ("0", "trainable") in r["kinds"]
    assert r["trainable"] == sum(p.numel() for p in ref.parameters() if p.requires_grad)
    # PEFT's own loader takes the adapter; its logits are the trained model's.
    assert r["path"] == out
    loaded = peft.PeftModel.from_pretrained(tiny_llama(), out)
    x = batch("llama", 7, 0, 0)
    with torch.no_grad():
        want = ref(**x).logits
        assert (loaded(**x).logits - want).abs().max().item() < 1e-5
        # The merged export is a plain HF checkpoint of the base class with the same function.
        from transformers import LlamaForCausalLM

        assert r["merged"] == out + "-merged"
        plain = LlamaForCausalLM.from_pretrained(r["merged"])
        assert (plain(**x).logits - want).abs().max().item() < 1e-4
        assert not any("lora" in k for k in plain.state_dict())


def _not_peft(rank, world, out_dir):
    model = yafsdp.YaFSDP(tiny_llama())
    try:
        model.save_adapter(out_dir)
    except yafsdp.adapters.AdapterError as e:
        return str(e)
    return None


def test_adapter_switches_and_exports(world2):
    """[Note: PEFT's adapter switches] in yafsdp/engine/orig_params.py; export_hf and save_pretrained of a PEFT model."""
    for r in (per_rank["switches"] for per_rank in world2[1]):
        assert r["disabled"] < 1e-6 and r["by_hand"] < 1e-6 and r["disabled_vs_adapted"] > 1e-3, r
        assert r["trainable"] and r["set_same"] == "" and r["active"] == "default", r
        for k in ("set_other", "set_other_tuner"):
            assert "set_adapter('second') on a wrapped PEFT model" in r[k] and "before yafsdp.YaFSDP(model)" in r[k], r[k]
        assert r["step"] < 1e-6, r["step"]  # (rank 0 compares; the others return 0)
        assert "holds PEFT adapters" in r["export_hf"] and "model.save_adapter(out_dir)" in r["export_hf"] and \
            "export_merged" in r["export_hf"] and not r["exported"], r["export_hf"]
        for k in ("save_pretrained", "module_save_pretrained"):
            assert "model.save_adapter(out_dir)" in r[k] and "export_merged" in r[k], r[k]


def test_save_adapter_refuses_a_model_without_adapters(world2):
    for msg in (per_rank["not_peft"] for per_rank in world2[1]):
        assert msg and "has no PEFT adapter 'default'" in msg and "peft.get_peft_model" in msg


def _bf16_base():
    """A bf16 base with PEFT's default fp32 adapters (``autocast_adapter_dtype=True``): the mix that needs
    separate wrapping in other engines (LlamaFactory #10157)."""
    model = peft.get_peft_model(tiny_llama().to(torch.bfloat16), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at zero in PEFT
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def _mixed_sharded(rank, world):
    model = _bf16_base()
    dtypes = sorted({(("lora_" in n), str(p.dtype)) for n, p in model.named_parameters()})
    wrapped = yafsdp.YaFSDP(model, param_dtype=torch.bfloat16)
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    losses = []
    for step in range(STEPS):
        loss = loss_of(wrapped, "llama", batch("llama", step, 0, rank))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    sd = wrapped.full_state_dict()
    return dict(dtypes=dtypes, losses=losses, sd={k: v for k, v in sd.items() if "lora_" in k},
                sd_dtypes=sorted({(("lora_" in k), str(v.dtype)) for k, v in sd.items()}))


def _mixed_reference(world):
    """The engine's arithmetic written out unsharded: fp32 masters of the adapters, bf16 compute copies of
    them in the forward, each rank's bf16 gradients summed in fp32 and divided by the world, AdamW on the
    masters. Returns (per step, per rank losses), the masters."""
    model = _bf16_base()
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in adapters.items()}
    for p in adapters.values():
        p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW(list(masters.values()), lr=1e-2, foreach=False)
    losses = []
    for step in range(STEPS):
        with torch.no_grad():
            for n, p in adapters.items():
                p.copy_(masters[n])
        total = {n: torch.zeros_like(m) for n, m in masters.items()}
        per_rank = []
        for r in range(world):
            loss = loss_of(model, "llama", batch("llama", step, 0, r))
            loss.backward()
            per_rank.append(loss.item())
            for n, p in adapters.items():
                total[n] += p.grad.float()
                p.grad = None
        for n, m in masters.items():
            m.grad = total[n] / world
        losses.append(per_rank)
        opt.step()
        opt.zero_grad()
    return losses, {n: m.detach() for n, m in masters.items()}


def test_fp32_adapters_over_a_bf16_base(request):
    """PEFT's fp32 adapters on a bf16 base wrap as one model (no per-dtype wrapping): the adapters get fp32
    masters and bf16 compute copies (``param_dtype``), the base stays a bf16 frozen group, and the training
    is the unsharded model's with the same rounding: the same losses on every rank and the same adapters."""
    world = 2
    per_rank = [r["mixed"] for r in request.getfixturevalue("world2")[1]]
    ref_losses, ref_masters = _mixed_reference(world)
    assert per_rank[0]["dtypes"] == [(False, "torch.bfloat16"), (True, "torch.float32")]
    for rank, r in enumerate(per_rank):
        got, want = r["losses"], [step[rank] for step in ref_losses]
        assert rel_seq(got, want) < 1e-6, (rank, got, want)
    sd = per_rank[0]["sd"]
    # the exported state keeps each parameter's own dtype: fp32 adapters, a bf16 base
    assert per_rank[0]["sd_dtypes"] == [(False, "torch.bfloat16"), (True, "torch.float32")]
    names = {k.replace(".default", "").replace("base_model.model.", ""): k for k in sd}
    for n, m in ref_masters.items():
        key = names[n.replace(".default", "").replace("base_model.model.", "")]
        assert torch.equal(sd[key], m), (n, (sd[key] - m).abs().max())
