"""Misuse and faults end in correct training or a clear error, never in silently wrong results:
an exception inside backward, calling the wrapped module (or HF generate) directly, an optimizer
step between forward and backward, dtype/device conversions, state_dict(). World 2, gloo."""
import copy
import warnings

import pytest
import torch

import yafsdp
from models import batch, loss_of, tiny_llama


def _train(model, opt, steps, rank, bad_steps=()):
    """The "skip the bad batch" loop: a backward that raises is caught, gradients are zeroed."""
    losses = []
    for step in steps:
        loss = loss_of(model, "llama", batch("llama", step, 0, rank))
        handle = None
        if step in bad_steps:  # the backward raises half-way, after some units have been reduced
            inner = model.module if isinstance(model, yafsdp.YaFSDP) else model

            def poison(module, args, output):
                out = output[0] if isinstance(output, tuple) else output
                out.register_hook(lambda g: (_ for _ in ()).throw(FloatingPointError("bad batch")))

            handle = inner.model.layers[1].register_forward_hook(poison)
            loss = loss_of(model, "llama", batch("llama", step, 0, rank))
            handle.remove()
        try:
            loss.backward()
        except FloatingPointError:
            opt.zero_grad()
            continue
        losses.append(loss.item())
        model.clip_grad_norm_(1.0) if isinstance(model, yafsdp.YaFSDP) else None
        opt.step()
        opt.zero_grad()
    return losses


def _aborted_backward(rank, world, zero_stage):
    base = tiny_llama(tie=True)
    a = yafsdp.YaFSDP(copy.deepcopy(base), zero_stage=zero_stage)
    b = yafsdp.YaFSDP(copy.deepcopy(base), zero_stage=zero_stage)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        la = _train(a, opt_a, [0, 1, 2, 3], rank, bad_steps=(1,))
    lb = _train(b, opt_b, [0, 2, 3], rank)
    sa, sb = a.full_state_dict(), b.full_state_dict()
    return dict(la=la, lb=lb, same=all(torch.equal(sa[k], sb[k]) for k in sb) if rank == 0 else True,
                warned=any("backward raised before it finished" in str(w.message) for w in caught))


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_aborted_backward_then_training_is_as_if_the_batch_was_skipped(zero_stage, run_ranks):
    for r in run_ranks(_aborted_backward, 2, zero_stage):
        assert r["la"] == r["lb"] and r["same"], r
        assert r["warned"]


def _paths_and_misuse(rank, world):
    out = {}
    base = tiny_llama()
    ref = copy.deepcopy(base)
    model = yafsdp.YaFSDP(base)
    hf = base  # a reference to the HF model kept from before wrapping
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):  # the same global batch on both ranks: the reference is the unsharded model
        x = batch("llama", step, 0, 0)
        loss_of(model, "llama", x).backward()
        opt.step()
        opt.zero_grad()
        loss_of(ref, "llama", x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    x = batch("llama", 9, 0, 0)
    with torch.no_grad():
        want = ref(**x).logits
        out["wrapper"] = (model(**x).logits - want).abs().max().item()
        out["module"] = (model.module(**x).logits - want).abs().max().item()
        out["kept_ref"] = (hf(**x).logits - want).abs().max().item()
        # A decoder layer run on its own after a step: its norms (the small group) are current.
        h = torch.randn(1, 5, 32)
        pos = torch.arange(5).view(1, 5)
        emb = ref.model.rotary_emb(h, pos)
        out["layer"] = (hf.model.layers[0](h, position_embeddings=emb)
                        - ref.model.layers[0](h, position_embeddings=emb)).abs().max().item()
    ids = x["input_ids"][:1, :4]
    out["generate"] = (model.generate(ids, max_new_tokens=6, do_sample=False).tolist(),
                       ref.generate(ids, max_new_tokens=6, do_sample=False).tolist())
    out["device_dtype"] = (str(model.module.device), str(model.module.dtype), len(list(model.parameters())))

    errors = {}
    for name, call in [
        ("to_bf16", lambda: model.to(torch.bfloat16)), ("double", lambda: model.double()),
        ("half", lambda: model.half()), ("state_dict", lambda: model.state_dict()),
        ("load_state_dict", lambda: model.load_state_dict({})),
        ("module_state_dict", lambda: model.module.state_dict()),
        ("save_pretrained", lambda: model.save_pretrained("/nonexistent")),
    ]:
        try:
            call()
            errors[name] = None
        except RuntimeError as e:
            errors[name] = str(e)
    model.float()  # changes nothing: allowed
    model.to("cpu")
    with torch.no_grad():
        errors["unchanged"] = (model(**x).logits - want).abs().max().item()
    out["errors"] = errors

    # An optimizer step between forward and backward: refused, naming the unit; then training goes on.
    steps = {}
    for zero in (2, 3):
        m = yafsdp.YaFSDP(tiny_llama(), zero_stage=zero)
        o = yafsdp.FusedAdamW(m.parameters(), lr=1e-2)
        loss_of(m, "llama", batch("llama", 0, 0, rank)).backward()
        loss = loss_of(m, "llama", batch("llama", 1, 0, rank))
        o.step()
        try:
            loss.backward()
            steps[zero] = None
        except RuntimeError as e:
            steps[zero] = str(e)
        o.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = loss_of(m, "llama", batch("llama", 2, 0, rank))
        loss.backward()
        o.step()
        steps[f"{zero}_after"] = loss.item()
    out["step_between"] = steps
    return out


def test_forward_paths_generate_and_refusals(run_ranks):
    for r in run_ranks(_paths_and_misuse, 2):
        for path in ("wrapper", "module", "kept_ref", "layer"):
            assert r[path] < 1e-5, (path, r[path])
        assert r["generate"][0] == r["generate"][1]
        assert r["device_dtype"] == ("cpu", "torch.float32", 7)  # 6 unit shards + the small group
        e = r["errors"]
        for name in ("to_bf16", "double", "half"):
            assert e[name] and "param_dtype=" in e[name], (name, e[name])
        assert "full_state_dict()" in e["state_dict"] and "yafsdp.checkpoint" in e["state_dict"]
        assert "load_full_state_dict" in e["load_state_dict"]
        assert "full_state_dict()" in e["module_state_dict"]
        assert "export_hf" in e["save_pretrained"]
        assert e["unchanged"] < 1e-5
        s = r["step_between"]
        for zero in (2, 3):
            assert s[zero] and "changed between its forward and its backward" in s[zero], s
            assert "unit 'model.layers." in s[zero] or "unit 'lm_head'" in s[zero], s[zero]
            assert s[f"{zero}_after"] == s[f"{zero}_after"]  # finite, no exception
