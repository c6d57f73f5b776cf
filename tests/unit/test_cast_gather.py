"""[Note: the world-1 cast gather] (yafsdp/layout/sizing.py): at world 1 under ZeRO-3 with a param_dtype
narrower than fp32, a unit made of trainable parameters only keeps no compute copy; each gather casts its
fp32 master into its weight buffer. It changes what is held between and during steps, not a value: training
matches the compute copy kept between steps (``sizing.CAST_WORLD1 = False``) bit for bit, the plan equals the
allocations, and the step's peak falls by the compute copy less the buffers.
"""
import torch

import yafsdp
from dist_utils import run_ranks
from models import Branchy, all_grads, batch, loss_of, tiny_llama
from yafsdp.plan import memory_plan


# name -> (model kwargs, engine options, optimizer, extras)
CASES = {
    # two micro-batches per step, torch AdamW
    "llama_adamw_accum": (dict(), dict(), "adamw", dict(micro=2)),
    # FusedAdamW (no copy-out to write: the master alone), a tied head, HF's activation checkpointing
    "tied_fused_ckpt": (dict(tie=True, checkpointing=True), dict(), "fused", dict()),
    # an outsized embedding and head (their shared buffer), three buffers in rotation
    "outsized_prefetch2": (dict(vocab=1031, layers=4), dict(prefetch=2), "fused", dict()),
    # frozen q/k in every layer: the layers keep the alias and their compute copies, the rest cast
    "frozen_qk": (dict(), dict(), "adamw", dict(freeze=("q_proj", "k_proj"))),
    # fp16 compute with GradScaler's unscale, clip_grad_norm_, zero_grad(set_to_none=False)
    "fp16_scaler": (dict(), dict(param_dtype=torch.float16), "adamw", dict(scaled=True, keep=True)),
    # parameters that get a gradient in some steps only
    "branchy": ("branchy", dict(), "fused", dict()),
    # the full state loaded between steps: the buffers hold weights of before the load
    "reload": (dict(), dict(), "fused", dict(reload=True)),
}


def _build(kw, freeze=()):
    model = Branchy() if kw == "branchy" else tiny_llama(seed=3, **kw)
    for name, p in model.named_parameters():
        if any(f in name for f in freeze):
            p.requires_grad_(False)
    return model


def _loss(model, kw, step, micro, dtype):
    if kw == "branchy":
        x = torch.randn(4, 9, generator=torch.Generator().manual_seed(10 * step + micro)).to(dtype)
        return model(x, step % 2 == 0).float()
    return loss_of(model, "llama", batch("llama", step, micro, 0))


def _train(kw, opts, optimizer, extras):
    """Three steps: losses, grad shards, norms, the weights; and what the engine holds."""
    opts = dict(dict(param_dtype=torch.bfloat16), **opts)
    model = yafsdp.YaFSDP(_build(kw, extras.get("freeze", ())), **opts)
    make = yafsdp.FusedAdamW if optimizer == "fused" else torch.optim.AdamW
    opt = make(model.parameters(), lr=1e-2, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if extras.get("scaled") else None
    losses, grads, norms = [], [], []
    for step in range(3):
        for micro in range(extras.get("micro", 1)):
            loss = _loss(model, kw, step, micro, opts["param_dtype"])
            (scaler.scale(loss) if scaler else loss).backward()
            losses.append(loss.item())
        if scaler:
            scaler.unscale_(opt)
        grads.append(all_grads(model))
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        scaler.step(opt) if scaler else opt.step()
        if scaler:
            scaler.update()
        opt.zero_grad(set_to_none=not extras.get("keep"))
        if extras.get("reload") and step == 1:
            state = {k: v * 1.01 for k, v in model.full_state_dict().items()}
            model.load_full_state_dict(state)
    rt = model._rt
    held = dict(compute=rt.compute.numel(), buffers=len(rt.weight_buffers), aliases=len(rt.alias_buffers),
                cast=sum(rt.buffer_plan.cast_of), allocated=model.allocated_bytes())
    return dict(losses=losses, grads=grads, norms=norms, state=model.full_state_dict(), held=held)


def on_and_off(switch: str, case) -> list[dict]:
    """``_train(*case)`` with ``yafsdp.layout.sizing.<switch>`` True, then False (True again after)."""
    from yafsdp.layout import sizing

    runs = []
    for on in (True, False):
        setattr(sizing, switch, on)
        try:
            runs.append(_train(*case))
        finally:
            setattr(sizing, switch, True)
    return runs


def same_steps(a: dict, b: dict) -> dict:
    """Two ``_train`` results compared bit for bit: ``same`` (losses, norms, grad shards) and ``differ`` (the
    names of the final weights that differ)."""
    return dict(same=a["losses"] == b["losses"] and a["norms"] == b["norms"]
                and all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"])),
                differ=[k for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])])


def _cast_vs_copy(rank, world, names):
    out = {}
    for name in names:
        a, b = on_and_off("CAST_WORLD1", CASES[name])
        out[name] = dict(
            held=(a["held"], b["held"]), **same_steps(a, b),
            moved=any(not torch.equal(a["state"][k].float(), v.float())
                      for k, v in _build(CASES[name][0], CASES[name][3].get("freeze", ())).state_dict().items()
                      if k in a["state"]))
    return out


def test_world1_cast_gather_trains_bit_for_bit_like_the_compute_copy():
    """bf16 and fp16, accumulation, FusedAdamW and torch AdamW, a tied head, activation checkpointing,
    outsized units with prefetch=2, frozen parameters beside trainable ones, GradScaler, parameters used in
    some steps only, a state loaded between steps: the same losses, grad shards, norms and weights bit
    for bit; the cast units have no compute copy and gather into buffers."""
    for name, r in run_ranks(_cast_vs_copy, 1, list(CASES))[0].items():
        on, off = r["held"]
        assert on["cast"] > 0 and off["cast"] == 0 and on["buffers"] > 0, (name, on, off)
        assert on["allocated"]["compute_copy"] < off["allocated"]["compute_copy"], (name, on, off)
        if name == "frozen_qk":  # the layers (frozen q/k beside trainable weights) keep the alias
            assert on["aliases"] == 3 and on["compute"] > 0, on
        else:
            assert on["aliases"] == 0 and on["compute"] == 0, (name, on)
        assert r["same"] and not r["differ"], (name, r)
        assert r["moved"], name  # the steps changed the weights: the comparison compares something


def measured_step(engine, i):
    """One step of ``(model, optimizer)`` on the llama batch ``i``: what the peak measurements time."""
    model, opt = engine
    loss_of(model, "llama", batch("llama", i, 0, 0)).backward()
    opt.step()
    opt.zero_grad()


def _peaks(rank, world):
    """Peak bytes of a step (torch CPU allocator, exact: at world 1 nothing runs on another thread) with the
    cast gather and with the compute copy, and what the plan predicts for each."""
    from yafsdp.layout import sizing
    from yafsdp.measure import measure_memory

    def build():
        model = yafsdp.YaFSDP(tiny_llama(seed=3, layers=6, vocab=1031), param_dtype=torch.bfloat16)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    out = {}
    sizing.IN_USE_WORLD1 = False  # the buffers held for the run: the cast gather's difference alone
    for on in (True, False):
        sizing.CAST_WORLD1 = on
        try:
            model, _ = build()
            held = sum(model.allocated_bytes().values())
            del model
            peak = measure_memory(build, measured_step, 3, torch.device("cpu"), method="torch")["peak_steady"]
            with torch.device("meta"):
                meta = tiny_llama(seed=3, layers=6, vocab=1031)
            plan = memory_plan(meta, world_size=1, param_dtype=torch.bfloat16, backend="gloo")
            out[on] = dict(peak=peak, held=held, plan=sum(plan.engine_bytes().values()),
                           compute=plan.compute_copy, buffers=plan.weight_buffers + plan.outsized_buffers
                           + plan.small_group, rows=[r for r, _ in plan.rows() if r.startswith("compute copy")])
        finally:
            sizing.CAST_WORLD1 = True
    sizing.IN_USE_WORLD1 = True
    return out


def test_world1_cast_gather_lowers_the_step_peak_by_the_compute_copy_less_the_buffers():
    """What the engine holds is the plan's in both layouts, and the measured step peak falls by exactly what
    the plan says the layouts differ by: the compute copy of every unit, less the buffers it casts into."""
    r = run_ranks(_peaks, 1)[0]
    on, off = r[True], r[False]
    assert on["held"] == on["plan"] and off["held"] == off["plan"], r
    assert on["compute"] == 0 < off["compute"] and off["buffers"] < on["buffers"], r
    saved = (off["compute"] + off["buffers"]) - (on["compute"] + on["buffers"])
    assert saved > 0 and on["peak"] == off["peak"] - saved, r  # exact counts: the rest of the step is the same
    assert on["rows"] == ["compute copy (bf16) (none for 9 units: cast into buffers)"], on["rows"]  # 6 layers, embedding, head, norms


# [Note: world-1 records in place]: name -> (model kwargs, engine options, optimizer, extras)
RECORDS = {
    # a QLoRA-like base: frozen q/k/MLP quantized to NF4 beside trainable weights, two micro-batches
    "nf4_frozen": (dict(), dict(quantize_frozen="nf4"), "adamw",
                   dict(freeze=("q_proj", "k_proj", "mlp"), micro=2)),
    # trainable weights gathered as fp8 records that FusedAdamW writes, a tied head
    "fp8_fused_tied": (dict(tie=True), dict(gather_dtype="fp8"), "fused", dict()),
    "int8_prefetch2": (dict(vocab=1031, layers=4), dict(gather_dtype="int8", prefetch=2), "adamw", dict()),
}


def _in_place_vs_staged(rank, world):
    """Each RECORDS case at world 1 with the records expanded in place and with every unit gathered through a
    buffer and its staging area, as at any world (the alias switch off)."""
    out = {}
    for name, case in RECORDS.items():
        runs = on_and_off("ALIAS_WORLD1", case)
        out[name] = dict(
            staging=[sum(v for k, v in r["held"]["allocated"].items() if k.endswith("_staging")) for r in runs],
            **same_steps(*runs))
    return out


def test_world1_records_expand_in_place_bit_for_bit():
    """[Note: world-1 records in place]: at world 1 the NF4, fp8 and int8 records expand into the buffers from
    where they lie (no staging area at all), training bit for bit as through the staging areas."""
    for name, r in run_ranks(_in_place_vs_staged, 1)[0].items():
        assert r["staging"][0] == 0 < r["staging"][1], (name, r["staging"])
        assert r["same"] and not r["differ"], (name, r)
