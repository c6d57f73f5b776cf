"""``prefetch=2``: the gathers of the two units after the one computing are issued before it computes
(in backward, of the two before it), through three weight buffers in rotation, and training is the
same bit for bit as with ``prefetch=1`` ([Note: prefetch depth] in yafsdp/engine/runtime.py). The
stream protocol with it is checked in test_streamcheck.py, its buffers in the plan in test_plan.py.
"""
import torch

import yafsdp
from dist_utils import run_ranks
from models import Stack, batch, loss_of, tiny_llama

# name -> (model kind, builder kwargs, engine options, micro-batches per step)
CASES = {
    "z3_fp32_accum": ("llama", dict(layers=4), dict(), 2),
    "z3_bf16_outsized_tied": ("llama", dict(layers=6, vocab=1000, tie=True), dict(param_dtype=torch.bfloat16), 1),
    "z2_fp32_accum": ("llama", dict(layers=4), dict(zero_stage=2), 2),
    "z2_bf16": ("llama", dict(layers=4), dict(zero_stage=2, param_dtype=torch.bfloat16), 1),
    "z3_bf16_checkpointing": ("llama", dict(layers=4, checkpointing=True), dict(param_dtype=torch.bfloat16), 2),
    "stack_z3_checkpointing": ("stack", dict(n=5, ckpt=True), dict(), 1),
    # the gathers that expand records (fp8, NF4) and the host-side shards of offload
    "z3_bf16_fp8_offload_opt": ("llama", dict(layers=4), dict(param_dtype=torch.bfloat16, gather_dtype="fp8",
                                                             offload="optimizer"), 1),
    "qlora_nf4_offload_all": ("lora", dict(layers=6), dict(param_dtype=torch.bfloat16, quantize_frozen="nf4", offload="all"), 2),
}


def _issue_log(rt):
    """Log each gather issued and each compute start (a unit's forward or backward after its wait)."""
    log = []
    gather, unit_forward, pre_backward = rt.schedule.gather, rt.unit_forward, rt.pre_backward

    def logged_gather(sync, out, shard, unit, *args, **kw):
        log.append(("gather", unit))
        return gather(sync, out, shard, unit, *args, **kw)

    def logged_forward(unit, gather=True):
        unit_forward(unit, gather)
        log.append(("forward", unit.name))

    def logged_backward(unit, use, prevs, ends):
        pre_backward(unit, use, prevs, ends)
        log.append(("backward", unit.name))

    rt.schedule.gather, rt.unit_forward, rt.pre_backward = logged_gather, logged_forward, logged_backward
    return log


def _ahead(log, phase):
    """The most units gathered (since they last computed) before some unit of the same forward (or backward)
    pass computes, that compute later in it: how far ahead the gathers run."""
    passes, start = [], 0  # (first log index, [(index, unit) of its computes]) per pass of ``phase``
    for i, (what, u) in enumerate(log):
        if what in ("forward", "backward") and what != phase:
            start = i + 1
        elif what == phase:
            if not passes or passes[-1][0] != start:
                passes.append((start, []))
            passes[-1][1].append((i, u))
    most = 0
    for start, computes in passes:
        for k, (i, u) in enumerate(computes):
            later = {v for _, v in computes[k + 1:]} - {u}
            seen: dict = {}  # unit -> what happened to it last in this pass before this compute
            for what, v in log[start:i]:
                seen[v] = what
            most = max(most, sum(seen.get(v) == "gather" for v in later))  # gathered for its next compute
    return most


def _train(rank, kind, build_kw, opts, accum, prefetch, steps=3):
    if kind == "lora":  # PEFT LoRA on q/v/o over a frozen base
        import peft

        module, kind = peft.get_peft_model(tiny_llama(**build_kw), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], lora_dropout=0.0)), "llama"
        with torch.no_grad():  # B starts at zero in PEFT; make the adapters matter from the first step
            for n, p in module.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
    else:
        module = tiny_llama(**build_kw) if kind == "llama" else Stack(**build_kw)
    model = yafsdp.YaFSDP(module, prefetch=prefetch, **opts)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, log = [], None
    for step in range(steps):
        if step == steps - 1:  # the last step runs with the order of the one before: the prefetch plan
            log = _issue_log(model._rt)
        for micro in range(accum):
            loss = loss_of(model, kind, batch(kind, step, micro, rank))
            (loss / accum).backward()
            losses.append(loss.detach())
        if step < steps - 1:
            opt.step()
            opt.zero_grad()
    grads = [p.grad.clone() for p in model.parameters()]
    weights = [p.detach().clone() for p in model.parameters()]
    buffers = sorted(k for k in model.allocated_bytes() if k.startswith("weight"))
    return dict(losses=torch.stack(losses), grads=grads, weights=weights, buffers=buffers,
                fw_ahead=_ahead(log, "forward"), bw_ahead=_ahead(log, "backward"))


def _both(rank, world):
    return {name: {pf: _train(rank, *case, prefetch=pf) for pf in (1, 2)} for name, case in CASES.items()}


def test_prefetch2_trains_bit_for_bit_as_prefetch1_and_gathers_two_ahead():
    for rank, res in enumerate(run_ranks(_both, 2)):
        for name, by in res.items():
            one, two = by[1], by[2]
            assert torch.equal(one["losses"], two["losses"]), (name, rank, one["losses"], two["losses"])
            for what in ("grads", "weights"):
                assert all(torch.equal(a, b) for a, b in zip(one[what], two[what])), (name, rank, what)
            zero2 = "z2" in name
            # ZeRO-3: a third weight buffer in the rotation; ZeRO-2 keeps one per unit either way
            if zero2:
                assert one["buffers"] == two["buffers"], (name, one["buffers"], two["buffers"])
            else:
                staging = {f"weight2_{k}" for k in ("staging", "landing") if f"weight1_{k}" in one["buffers"]}  # records
                assert set(two["buffers"]) - set(one["buffers"]) == {"weight2"} | staging, (name, one["buffers"],
                                                                                           two["buffers"])
            assert (one["fw_ahead"], two["fw_ahead"]) == (1, 2), (name, rank, one["fw_ahead"], two["fw_ahead"])
            # backward: ZeRO-3 re-gathers the units before the one computing; ZeRO-2 gathers nothing there
            assert (one["bw_ahead"], two["bw_ahead"]) == ((0, 0) if zero2 else (1, 2)), (name, rank, one["bw_ahead"],
                                                                                          two["bw_ahead"])


def _refusals(rank, world):
    out = {}
    for opts in (dict(prefetch=3), dict(prefetch=0), dict(prefetch=2, secondary_shard=2)):
        try:
            yafsdp.YaFSDP(tiny_llama(), **opts)
            out[str(opts)] = None
        except ValueError as e:
            out[str(opts)] = str(e)
    return out


def test_prefetch_refuses_what_it_does_not_support():
    out = run_ranks(_refusals, 2)[0]
    assert "prefetch=3 is not supported; use 1" in out[str(dict(prefetch=3))], out
    assert "prefetch=0 is not supported" in out[str(dict(prefetch=0))], out
    msg = out[str(dict(prefetch=2, secondary_shard=2))]
    assert msg is not None and "prefetch=2 with secondary_shard=2 is not supported" in msg, out
