"""[Note: world-1 buffers in use only] (yafsdp/layout/sizing.py): at world 1 under ZeRO-3 a weight buffer's
memory is taken at its gather and given back at its release. It changes when the gathered, cast or
dequantized weights exist, not a value: training matches the buffers held for the whole run
(``sizing.IN_USE_WORLD1 = False``) bit for bit; between steps no buffer holds memory, and the plan says so;
the step's peak falls below what the held buffers cost, to what the plan predicts.
"""
import torch

import yafsdp
from dist_utils import run_ranks
from models import batch, loss_of, tiny_llama
from test_cast_gather import CASES, RECORDS, measured_step, on_and_off, same_steps
from yafsdp.plan import memory_plan

# the cases where a buffer's memory comes and goes in a way of its own: an activation-checkpoint recompute
# inside backward, three buffers in rotation with deferred prefetches, a load between steps, NF4 records
# (a QLoRA-like base, two micro-batches), int8 records with prefetch=2
NAMES = {"tied_fused_ckpt": CASES, "outsized_prefetch2": CASES, "reload": CASES, "nf4_frozen": RECORDS,
         "int8_prefetch2": RECORDS}


def _weight_slots(allocated: dict, names) -> int:
    return sum(allocated[n] for n in names)


def _in_use_vs_held(rank, world):
    out = {}
    for name, table in NAMES.items():
        a, b = on_and_off("IN_USE_WORLD1", table[name])
        slots = [k for k in b["held"]["allocated"]  # the small group's slot is gathered once per forward: held
                 if k.startswith("weight") and k != "weight_small" and not k.endswith(("_staging", "_landing"))]
        out[name] = dict(slots=slots, between=[_weight_slots(r["held"]["allocated"], slots) for r in (a, b)],
                         **same_steps(a, b))
    return out


def test_world1_buffers_in_use_only_train_bit_for_bit():
    """Checkpoint recomputes, prefetch=2 rotations, a state loaded between steps, NF4 and int8 records: the
    same losses, grad shards, norms and weights bit for bit as with the buffers held for the whole run, and
    between steps the weight buffers hold no memory (with the switch off: all of it)."""
    for name, r in run_ranks(_in_use_vs_held, 1)[0].items():
        assert r["slots"], (name, r)
        assert r["between"][0] == 0 < r["between"][1], (name, r)
        assert r["same"] and not r["differ"], (name, r)


def _qlora_like():
    model = tiny_llama(seed=3, layers=3, vocab=1031)
    for name, p in model.named_parameters():
        if "o_proj" not in name and "norm" not in name:
            p.requires_grad_(False)
    return model


def _eval_and_grad_only(rank, world):
    """A no-grad forward, a forward never backpropagated and an ``autograd.grad`` with respect to the
    inputs between training steps: each gives its buffers back, and the steps stay bit for bit."""
    from yafsdp.layout import sizing

    runs = []
    for on in (True, False):
        sizing.IN_USE_WORLD1 = on
        try:
            model = yafsdp.YaFSDP(_qlora_like(), param_dtype=torch.bfloat16, quantize_frozen="nf4")
            bufs = [s for s in model.weight_buffers if s.name != "weight_small"]  # that one is held: gathered per forward
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses, held = [], []
            for step in range(3):
                with torch.no_grad():
                    losses.append(loss_of(model, "llama", batch("llama", step, 1, 0)).item())
                held.append(sum(s.allocated for s in bufs))
                loss_of(model, "llama", batch("llama", step, 2, 0))  # no backward: its graph is dropped
                emb = model.module.model.embed_tokens  # the inputs' gradient only (the embedding is frozen)
                ids = batch("llama", step, 3, 0)["input_ids"]
                x = emb(ids).detach().requires_grad_(True)
                out = model(inputs_embeds=x, labels=ids).loss
                losses.append(torch.autograd.grad(out, x)[0].float().norm().item())
                held.append(sum(s.allocated for s in bufs))
                loss = loss_of(model, "llama", batch("llama", step, 0, 0))
                loss.backward()
                losses.append(loss.item())
                opt.step()
                opt.zero_grad()
                held.append(sum(s.allocated for s in bufs))
            runs.append(dict(losses=losses, held=held, state=model.full_state_dict(),
                             in_use=[s.in_use for s in bufs]))
        finally:
            sizing.IN_USE_WORLD1 = True
    return runs


def test_world1_buffers_in_use_only_around_eval_and_input_grads():
    on, off = run_ranks(_eval_and_grad_only, 1)[0]
    assert on["in_use"] and all(on["in_use"]) and not any(off["in_use"]), (on["in_use"], off["in_use"])
    assert set(on["held"]) == {0} and set(off["held"]) == {len(off["in_use"])}, (on["held"], off["held"])
    assert on["losses"] == off["losses"], (on["losses"], off["losses"])
    assert all(torch.equal(on["state"][k], off["state"][k]) for k in on["state"])


def _peaks(rank, world):
    """The step's peak and what is held between steps with the buffers in use only and held for the run
    (torch CPU allocator, exact), and the plan's figures for each."""
    from yafsdp.layout import sizing
    from yafsdp.measure import measure_memory

    def build():
        model = yafsdp.YaFSDP(_qlora_like(), param_dtype=torch.bfloat16, quantize_frozen="nf4")
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    engine = build()  # first-use allocations of the process (a one-time 64 KiB) before either measurement
    measured_step(engine, 0)
    del engine
    out = {}
    for on in (True, False):
        sizing.IN_USE_WORLD1 = on
        try:
            m = measure_memory(build, measured_step, 3, torch.device("cpu"), method="torch")
            with torch.device("meta"):
                meta = _qlora_like()
            ids = batch("llama", 0, 0, 0)["input_ids"]
            plan = memory_plan(meta, world_size=1, param_dtype=torch.bfloat16, quantize_frozen="nf4",
                               backend="gloo", batch=ids.shape[0], seq=ids.shape[1])
            out[on] = dict(peak=m["peak_steady"], between=m["step_end"][-1],
                           state=plan.engine_total + plan.optimizer_state, total=plan.total,
                           slots=sum(s.nbytes for s in plan.slots if s.kind == "weight" and s.role != "small"),
                           in_use=plan.in_use_peak, rows=[r for r, _ in plan.rows() if "buffers" in r])
        finally:
            sizing.IN_USE_WORLD1 = True
    return out


def test_world1_buffers_in_use_only_leave_the_state_and_lower_the_peak_as_planned():
    r = run_ranks(_peaks, 1)[0]
    on, off = r[True], r[False]
    # between steps: exactly the buffers less, as the plan says
    assert on["slots"] == off["slots"] > 0 and on["in_use"] > 0 == off["in_use"], r
    assert on["slots"] == off["state"] - on["state"], r
    assert abs(off["between"] - on["between"] - on["slots"]) <= 64, r  # the allocator's counts, to a few bytes
    # the peak: lower, and within 1 % of the plan's total (which was within it with the buffers held too)
    assert on["peak"] < off["peak"], r
    for x in (on, off):
        assert abs(x["total"] - x["peak"]) <= 0.01 * x["peak"], r
    assert any("in use only" in row for row in on["rows"]) and not any("in use only" in row for row in off["rows"])


def test_zero2_and_worlds_above_one_hold_their_buffers():
    """ZeRO-2 keeps a unit's weights from its forward to its backward, and at world > 1 the collectives
    write into preallocated buffers: no slot is in use only there."""
    with torch.device("meta"):
        meta = _qlora_like()
    kw = dict(param_dtype=torch.bfloat16, quantize_frozen="nf4", backend="gloo")
    assert any(s.in_use for s in memory_plan(meta, world_size=1, **kw).slots)
    assert not any(s.in_use for s in memory_plan(meta, world_size=1, zero_stage=2, **kw).slots)
    assert not any(s.in_use for s in memory_plan(meta, world_size=2, **kw).slots)
