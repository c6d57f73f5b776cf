"""Bit-for-bit comparison of this branch against another checkout (for refactors that must not change the numerics): losses, clipped
grad norms and final weights of several configs at world 4 (2x2 for the HSDP ones).

    PYTHONPATH=/work/main python tests/parity_vs_main.py run /tmp/main.pt
    SEAM_NEW=1 PYTHONPATH=$PWD python tests/parity_vs_main.py run /tmp/branch.pt
    PYTHONPATH=$PWD python tests/parity_vs_main.py compare /tmp/main.pt /tmp/branch.pt

SEAM_NEW=1 adds combinations main refuses (``name@variant``), compared against main's run of ``name``
(offload x HSDP, offload x fp8: bit for bit the same)."""
import sys, os
_T = os.path.join(os.environ.get("PYTHONPATH") or os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path[:0] = [_T, os.path.join(_T, "multirank")]
import torch, torch.distributed as dist
import yafsdp
from dist_utils import run_ranks, hsdp_groups
from models import batch, loss_of, tiny_llama

def lora():
    from test_lora import _lora_model
    return _lora_model()

CONFIGS = {
    "fp32": (lambda: tiny_llama(), dict(), "adamw", 4),
    "bf16_fused_tied": (lambda: tiny_llama(tie=True), dict(param_dtype=torch.bfloat16), "fused", 4),
    "z2_bf16reduce": (lambda: tiny_llama(), dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, zero_stage=2), "fused", 4),
    "offload_opt": (lambda: tiny_llama(), dict(offload="optimizer", param_dtype=torch.bfloat16), "fused", 4),
    "qlora_offload_all": (lora, dict(offload="all", quantize_frozen="nf4", param_dtype=torch.bfloat16), "fused", 4),
    "fp8": (lambda: tiny_llama(), dict(gather_dtype="fp8", param_dtype=torch.bfloat16), "fused", 4),
    "hsdp2x2": (lambda: tiny_llama(tie=True), dict(hsdp=(2, 2)), "adamw", 4),
    "hsdp2x2_bf16_lora": (lora, dict(hsdp=(2, 2), param_dtype=torch.bfloat16), "fused", 4),
}
import os as _os
if _os.environ.get("SEAM_NEW"):  # combinations main refuses: compared against main's run without offload
    CONFIGS["hsdp2x2_bf16_lora@offload_opt"] = (lora, dict(hsdp=(2, 2), param_dtype=torch.bfloat16, offload="optimizer"), "fused", 4)
    CONFIGS["fp8@offload_opt"] = (lambda: tiny_llama(), dict(gather_dtype="fp8", param_dtype=torch.bfloat16, offload="optimizer"), "fused", 4)
    CONFIGS["hsdp2x2@offload_opt"] = (lambda: tiny_llama(tie=True), dict(hsdp=(2, 2), offload="optimizer"), "adamw", 4)

def fn(rank, world):
    out = {}
    for name, (mk, opts, optim, steps) in CONFIGS.items():
        opts = dict(opts)
        if "hsdp" in opts:
            opts["process_group"] = hsdp_groups(*opts.pop("hsdp"))
        model = yafsdp.YaFSDP(mk(), **opts)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = yafsdp.FusedAdamW(params, lr=1e-2, weight_decay=0.1) if optim == "fused" else torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
        losses, norms = [], []
        for step in range(steps):
            for micro in range(2):
                l = loss_of(model, "llama", batch("llama", step, micro, rank)) / 2
                l.backward()
                losses.append(l.detach().clone())
            norms.append(model.clip_grad_norm_(1.0).detach().clone())
            opt.step(); opt.zero_grad()
        out[name] = dict(losses=losses, norms=norms, sd=model.full_state_dict())
        del model, opt
    return out

def compare(pa, pb):
    a, b = torch.load(pa, weights_only=False), torch.load(pb, weights_only=False)
    bad = 0
    for rank, (ra, rb) in enumerate(zip(a, b)):
        for name in rb:
            x, y = ra[name.split("@")[0]], rb[name]
            ok = all(torch.equal(p, q) for p, q in zip(x["losses"], y["losses"])) and all(torch.equal(p, q) for p, q in zip(x["norms"], y["norms"])) \
                and x["sd"].keys() == y["sd"].keys() and all(torch.equal(x["sd"][k], y["sd"][k]) for k in x["sd"])
            if not ok: bad += 1; print("DIFF", rank, name)
    print("configs", len(b[0]), "ranks", len(a), "bit-identical" if not bad else f"{bad} differ")
    return bad


if __name__ == "__main__":
    if sys.argv[1] == "run":
        torch.save(run_ranks(fn, 4), sys.argv[2])
    else:
        sys.exit(1 if compare(sys.argv[2], sys.argv[3]) else 0)
