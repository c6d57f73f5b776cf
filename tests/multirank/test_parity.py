"""The core assertion: the sharded model trains like the unsharded one, step by step.

Each world size spawns its ranks once and trains every case listed for it; the reference is one
process training the unwrapped model on the global batch (see tests/parity.py).
"""
import pytest
import torch

from dist_utils import run_ranks
from parity import CASES, build, rel_l2, rel_seq, train_reference, train_sharded

FP32 = [n for n, c in CASES.items() if c.get("dtype") is None]
BF16 = [n for n, c in CASES.items() if c.get("dtype") == "bf16"]

PLAN = {
    1: ["llama_z3", "stack_z3", "llama_bf16_z3_tied"],
    2: list(CASES),
    3: ["llama_z3_tied_accum3", "llama_z2", "stack_z3_ckpt_units", "llama_outsized", "llama_bf16_z3_tied",
        "llama_bf16_reduce_bf16"],
    4: ["llama_z3", "llama_z3_ckpt", "stack_z2", "llama_units_tied", "llama_bf16_z2_accum3"],
}
PAIRS = [(w, n) for w, names in PLAN.items() for n in names]

_results: dict[int, dict] = {}


def sharded(world: int) -> dict:
    if world not in _results:
        _results[world] = run_ranks(train_sharded, world, PLAN[world])[0]
    return _results[world]


@pytest.mark.parametrize("world,name", [p for p in PAIRS if p[1] in FP32], ids=lambda v: str(v))
def test_fp32_parity(world, name):
    losses, norms, sd = sharded(world)[name]
    ref_losses, ref_norms, ref_sd = train_reference(name, world)
    assert set(sd) == set(ref_sd)
    assert rel_seq(losses, ref_losses) < 1e-5, (losses, ref_losses)
    assert rel_seq(norms, ref_norms) < 1e-5, (norms, ref_norms)
    assert rel_l2(sd, ref_sd) < 1e-4
    # The run trained: weights moved away from their initial values.
    init = build(CASES[name]).state_dict()
    assert rel_l2(sd, init) > 1e-3


@pytest.mark.parametrize("world,name", [p for p in PAIRS if p[1] in BF16], ids=lambda v: str(v))
def test_bf16_parity(world, name):
    """Judged against the same mixed precision done unsharded: the sharded run may be at most about
    twice as far from the fp32 reference as the unsharded bf16 run is."""
    losses, norms, sd = sharded(world)[name]
    fp_losses, _, fp_sd = train_reference(name, world)
    bf_losses, _, bf_sd = train_reference(name, world, torch.bfloat16)
    ref_dist = rel_l2(bf_sd, fp_sd)
    assert ref_dist > 1e-4  # the reference really ran in bf16
    assert rel_l2(sd, fp_sd) <= 2 * ref_dist
    assert rel_l2(sd, fp_sd) > 1e-4  # and so did the sharded run
    assert rel_seq(losses, fp_losses) <= 2 * rel_seq(bf_losses, fp_losses) + 1e-5
    assert all(v.dtype == torch.float32 for v in sd.values())  # original dtype, not param_dtype
