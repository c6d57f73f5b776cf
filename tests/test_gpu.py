"""The CUDA path: NCCL world 1, the comm stream and its events, parity on the GPU, no host sync
inside forward/backward, and the fake process group for larger worlds. Skipped without a GPU."""
import copy

import pytest
import torch

import yafsdp
from dist_utils import run_ranks
from models import Stack, batch, loss_of, tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _train(model, kind, steps, device, accum=2):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            inputs = {k: v.to(device) for k, v in batch(kind, step, micro, 0).items()}
            loss = loss_of(model, kind, inputs)
            (loss / accum).backward()
            total += loss.item() / accum
        losses.append(total)
        clip = model.clip_grad_norm_ if hasattr(model, "clip_grad_norm_") else (
            lambda n: torch.nn.utils.clip_grad_norm_(model.parameters(), n))
        clip(1.0)
        opt.step()
        opt.zero_grad()
    return losses


def _gpu_parity(rank, world, zero_stage, dtype_name):
    dtype = getattr(torch, dtype_name) if dtype_name else None
    out = {}
    for kind in ("llama", "stack"):
        base = tiny_llama(tie=True) if kind == "llama" else Stack()
        ref = copy.deepcopy(base).cuda()
        model = yafsdp.YaFSDP(base, param_dtype=dtype, zero_stage=zero_stage)
        assert model.device.type == "cuda" and model._comm is not None
        assert model._comm.priority < 0 or torch.cuda.Stream.priority_range()[0] == 0  # high priority
        losses = _train(model, kind, 3, "cuda")
        ref_losses = _train(ref, kind, 3, "cuda") if dtype is None else None
        sd = model.full_state_dict()
        out[kind] = (losses, ref_losses, {k: (sd[k] - v.cpu()).norm().item() / max(v.norm().item(), 1e-12)
                                          for k, v in ref.state_dict().items()} if dtype is None else None)
    return out


@pytest.mark.parametrize("zero_stage", [2, 3])
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_nccl_world1_trains(zero_stage, dtype):
    out = run_ranks(_gpu_parity, 1, zero_stage, dtype, backend="nccl")[0]
    for kind, (losses, ref_losses, rel) in out.items():
        assert losses[-1] < losses[0]
        if ref_losses is not None:
            assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < 1e-4
            assert max(rel.values()) < 1e-3


def _no_sync_and_recorder(rank, world):
    from yafsdp.trace import Recorder

    model = yafsdp.YaFSDP(Stack(n=4), param_dtype=torch.bfloat16)
    inputs = {k: v.cuda() for k, v in batch("stack", 0, 0, 0).items()}
    loss_of(model, "stack", inputs).backward()  # warm-up
    torch.cuda.synchronize()
    model.recorder = Recorder()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss_of(model, "stack", inputs).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    iv = model.recorder.finish()
    return [(i.kind, i.unit, i.start, i.end) for i in iv]


def test_step_has_no_host_sync_and_uses_comm_stream():
    iv = run_ranks(_no_sync_and_recorder, 1, backend="nccl")[0]
    kinds = {k for k, *_ in iv}
    assert {"gather", "reduce", "forward", "backward"} <= kinds
    assert all(e >= s for _, _, s, e in iv)


def test_fake_process_group_world8():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    try:
        model = yafsdp.YaFSDP(tiny_llama(), param_dtype=torch.bfloat16, device="cuda")
        for u in model.flat_units:
            assert u.layout.shard_numel * 8 == u.layout.padded_numel
        inputs = {k: v.cuda() for k, v in batch("llama", 0, 0, 0).items()}
        before = torch.cuda.memory_allocated()
        for _ in range(3):
            loss_of(model, "llama", inputs).backward()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - before < 1 << 20
    finally:
        dist.destroy_process_group()
