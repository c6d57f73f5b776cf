"""The CUDA path on a GPU: parity, the stream protocol with its timing windows widened, no host
synchronisation anywhere in the step, resume, and the fake process group. Skipped without a GPU
(the same protocol is proven on the CPU by tests/multirank/test_streamcheck.py).

Races between streams hide when the host cannot run ahead of the device. These tests keep the
host free: inputs are put on the device once, losses stay device tensors until the end, and
``torch.cuda._sleep`` delays the comm stream before every collective and the compute stream before
every optimizer step, so a missing event wait reads stale or torn data. Each loop is compared
bit for bit against the same loop with a ``torch.cuda.synchronize()`` after every optimizer step.
"""
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

SLEEP = 2_000_000  # GPU cycles (~1 ms) before each collective and each optimizer step


def _inputs(kind, steps, accum):
    """Every micro-batch of the run, on the device once (pinned copy, no pageable transfers later)."""
    return [[{k: v.pin_memory().cuda(non_blocking=True) for k, v in batch(kind, s, m, 0).items()}
             for m in range(accum)] for s in range(steps)]


def _widen_windows():
    """Delay the comm stream before every gather and reduce (a compute-side read that does not
    wait for the gather then sees the previous owner's weights)."""
    from yafsdp import comm

    gather, reduce = comm.StreamSchedule.gather, comm.StreamSchedule.reduce

    def slow_gather(self, *a, **k):
        with self.streams.use(self.comm):
            torch.cuda._sleep(SLEEP)
        return gather(self, *a, **k)

    def slow_reduce(self, *a, **k):
        with self.streams.use(self.comm):
            torch.cuda._sleep(SLEEP)
        return reduce(self, *a, **k)

    comm.StreamSchedule.gather, comm.StreamSchedule.reduce = slow_gather, slow_reduce


def _buffer_mismatch(model):
    """Device count of elements where a weight buffer holding unit u differs from u's compute
    copy (world 1: the gathered unit is the shard). No host sync."""
    n = torch.zeros((), dtype=torch.int64, device="cuda")
    for u in model.flat_units:
        slot = u.buffer
        if slot.holds(u):
            model.schedule.wait_gathered(slot.sync)
            for g in u.groups:
                got = slot.data[g.buffer_offset:g.buffer_offset + g.layout.padded_numel]
                shard = g.compute.to(got.device)  # offload="all": a host shard (a synchronous copy)
                if g.kind.gather_format is None:
                    n += (got != shard).sum()
                else:  # an NF4 or FP8 group: the expand of its record (world 1: the gathered records are the shard)
                    want = torch.empty_like(got)
                    g.expand(want, shard)
                    n += (got != want).sum()
    return n


def _optimizer(name, params):
    if name == "fused_adamw":
        return yafsdp.FusedAdamW(params, lr=3e-3, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, fused=(name == "torch_fused"))


def _loop(model, opt, kind, inputs, *, sync_after_step, check_buffers, eval_inputs=None):
    losses, mismatch = [], torch.zeros((), dtype=torch.int64, device="cuda")
    accum = len(inputs[0])
    for step, micros in enumerate(inputs):
        for x in micros:
            loss = loss_of(model, kind, x)
            if check_buffers:
                mismatch += _buffer_mismatch(model)
            (loss / accum).backward()
            losses.append(loss.detach())
        model.clip_grad_norm_(1.0)
        torch.cuda._sleep(SLEEP)  # the optimizer runs late: the next gathers must wait for its copy-out
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        if sync_after_step:
            torch.cuda.synchronize()
        if eval_inputs is not None:  # a no-grad forward between steps gathers the new weights too
            with torch.no_grad():
                losses.append(loss_of(model, kind, eval_inputs).detach())
            if check_buffers:
                mismatch += _buffer_mismatch(model)
    return torch.stack(losses), mismatch


CASES = {
    "z3_bf16_fused_adamw": dict(zero=3, dtype="bfloat16", opt="fused_adamw"),
    "z2_bf16_fused_adamw": dict(zero=2, dtype="bfloat16", opt="fused_adamw"),
    "z3_fp32_adamw": dict(zero=3, dtype=None, opt="adamw"),
    "z3_bf16_torch_fused": dict(zero=3, dtype="bfloat16", opt="torch_fused"),
    # NF4 groups: the expand runs on the comm stream after each gather of frozen q/k/mlp weights
    "z3_bf16_nf4": dict(zero=3, dtype="bfloat16", opt="fused_adamw", nf4=True),
    # offload (comm/schedule.py [Note: streams and events]): copy-out uploads on the upload stream, reduced grads
    # device -> host on the comm stream, host folds; "all": the frozen/NF4 shards through the landing
    "z3_bf16_fused_adamw_offload": dict(zero=3, dtype="bfloat16", opt="fused_adamw", offload="optimizer"),
    "z3_bf16_nf4_adamw_offload_all": dict(zero=3, dtype="bfloat16", opt="adamw", nf4=True, offload="all"),
    # FP8 gathers of the decoder layers: FusedAdamW writes the records, the expand runs on the comm stream
    "z3_bf16_fp8": dict(zero=3, dtype="bfloat16", opt="fused_adamw", fp8=True),
    "z2_bf16_fp8_adamw": dict(zero=2, dtype="bfloat16", opt="adamw", fp8=True),
}


def _race_windows(rank, world, names):
    _widen_windows()
    out = {}
    for name in names:
        case = CASES[name]
        runs = []
        base = tiny_llama(tie=True)
        if case.get("nf4"):
            for pname, p in base.named_parameters():
                if any(f in pname for f in ("q_proj", "k_proj", "mlp")):
                    p.requires_grad_(False)
        inputs = _inputs("llama", 3, 2)
        evals = {k: v.cuda() for k, v in batch("llama", 99, 0, 0).items()}
        for sync in (False, True):
            model = yafsdp.YaFSDP(copy.deepcopy(base), zero_stage=case["zero"],
                                  param_dtype=getattr(torch, case["dtype"]) if case["dtype"] else None,
                                  quantize_frozen="nf4" if case.get("nf4") else None, offload=case.get("offload"),
                                  gather_dtype="fp8" if case.get("fp8") else None)
            opt = _optimizer(case["opt"], model.parameters())
            torch.cuda.synchronize()
            losses, mismatch = _loop(model, opt, "llama", inputs, sync_after_step=sync, check_buffers=True,
                                     eval_inputs=evals)
            sd = model.full_state_dict()
            runs.append((losses.cpu(), int(mismatch), sd))
        (la, ma, sda), (lb, mb, sdb) = runs
        out[name] = dict(
            same_losses=torch.equal(la, lb), mismatch=(ma, mb),
            same_weights=all(torch.equal(sda[k], sdb[k]) for k in sdb), falls=bool(la[-2] < la[0]),
        )
    return out


def test_widened_windows_match_the_synchronised_run_bit_for_bit():
    out = run_ranks(_race_windows, 1, list(CASES), backend="nccl")[0]
    for name, r in out.items():
        assert r["mismatch"] == (0, 0), (name, r)
        assert r["same_losses"] and r["same_weights"], (name, r)
        assert r["falls"], (name, r)


def _gpu_parity(rank, world, zero_stage):
    out = {}
    for kind in ("llama", "stack"):
        base = tiny_llama(tie=True) if kind == "llama" else Stack()
        ref = copy.deepcopy(base).cuda()
        model = yafsdp.YaFSDP(base, zero_stage=zero_stage)
        assert model.device.type == "cuda" and model.schedule.comm.priority <= 0
        inputs = _inputs(kind, 3, 2)
        losses, _ = _loop(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1), kind, inputs,
                          sync_after_step=False, check_buffers=False)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
        ref_losses = []
        for micros in inputs:
            for x in micros:
                loss = loss_of(ref, kind, x)
                (loss / len(micros)).backward()
                ref_losses.append(loss.detach())
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
        sd = model.full_state_dict()
        rel = {k: ((sd[k] - v.cpu()).norm() / v.norm().clamp_min(1e-12)).item() for k, v in ref.state_dict().items()}
        out[kind] = (losses.cpu(), torch.stack(ref_losses).cpu(), rel)
    return out


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_nccl_world1_fp32_parity(zero_stage):
    out = run_ranks(_gpu_parity, 1, zero_stage, backend="nccl")[0]
    for kind, (losses, ref_losses, rel) in out.items():
        assert ((losses - ref_losses).abs() / ref_losses.abs()).max() < 1e-4, kind
        assert max(rel.values()) < 1e-3, (kind, rel)


def _collectives_on_comm_stream(rank, world):
    """Every gather and reduce of the step is issued synchronously on the comm stream (so the NCCL
    kernel runs there, torch >= 2.8), never with async_op=True."""
    from yafsdp import comm

    seen = []
    for name in ("all_gather", "reduce_scatter"):
        orig = getattr(comm, name)

        def spy(out, inp, group, async_op=True, _orig=orig, _name=name):
            seen.append((_name, torch.cuda.current_stream().stream_id, async_op))
            return _orig(out, inp, group, async_op=async_op)

        setattr(comm, name, spy)
    model = yafsdp.YaFSDP(Stack(n=4), param_dtype=torch.bfloat16)
    loss_of(model, "stack", {k: v.cuda() for k, v in batch("stack", 0, 0, 0).items()}).backward()
    torch.cuda.synchronize()
    return seen, model.schedule.comm.stream_id


def test_collectives_run_on_the_comm_stream():
    seen, comm_id = run_ranks(_collectives_on_comm_stream, 1, backend="nccl")[0]
    assert {n for n, *_ in seen} == {"all_gather", "reduce_scatter"}
    assert all(s == comm_id and a is False for _, s, a in seen), seen


def _no_sync_and_recorder(rank, world):
    from yafsdp.trace import Recorder

    model = yafsdp.YaFSDP(Stack(n=4), param_dtype=torch.bfloat16)
    opt = yafsdp.FusedAdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"))
    inputs = {k: v.cuda() for k, v in batch("stack", 0, 0, 0).items()}
    loss_of(model, "stack", inputs).backward()  # warm-up: state allocated, kernels loaded
    model.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize()
    model.recorder = Recorder()
    torch.cuda.set_sync_debug_mode("error")
    try:  # the whole step: forward, backward, clipping, FusedAdamW with its copy-out, zero_grad
        for _ in range(2):
            loss_of(model, "stack", inputs).backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    iv = model.recorder.finish()
    return [(i.kind, i.unit, i.start, i.end) for i in iv]


def test_step_has_no_host_sync_and_uses_comm_stream():
    iv = run_ranks(_no_sync_and_recorder, 1, backend="nccl")[0]
    kinds = {k for k, *_ in iv}
    assert {"gather", "reduce", "forward", "backward"} <= kinds
    assert all(e >= s for _, _, s, e in iv)


def _resume_keeps_step_where_torch_does(rank, world, root):
    from yafsdp import checkpoint as ckpt

    out = {}
    for name in ("adamw", "fused_adamw", "torch_fused"):
        model = yafsdp.YaFSDP(Stack(), param_dtype=torch.bfloat16)
        opt = _optimizer(name, model.parameters())
        loss_of(model, "stack", {k: v.cuda() for k, v in batch("stack", 0, 0, 0).items()}).backward()
        opt.step()
        path = ckpt.save_checkpoint(f"{root}/{name}", 1, model, opt)
        model2 = yafsdp.YaFSDP(Stack(seed=1), param_dtype=torch.bfloat16)
        opt2 = _optimizer(name, model2.parameters())
        ckpt.load_checkpoint(path, model2, opt2)
        out[name] = sorted({st["step"].device.type for st in opt2.state.values()})
    return out


def test_resume_puts_optimizer_step_where_the_optimizer_keeps_it(tmp_path):
    out = run_ranks(_resume_keeps_step_where_torch_does, 1, str(tmp_path), backend="nccl")[0]
    # torch's for-each AdamW keeps `step` on the CPU (on the GPU it would read it back with a
    # host sync every step); fused and capturable optimizers and FusedAdamW keep it on the device.
    assert out == {"adamw": ["cpu"], "fused_adamw": ["cuda"], "torch_fused": ["cuda"]}, out


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


def _offload_placement_and_parity(rank, world):
    """offload on a GPU: where every tensor lives (pinned host memory for the host roles), the optimizer
    state on the host, and the losses of offload vs none (CPU vs CUDA AdamW kernels: close, not bitwise)."""
    out = {}
    base = tiny_llama()
    for pname, p in base.named_parameters():
        if any(f in pname for f in ("q_proj", "k_proj", "mlp")):
            p.requires_grad_(False)
    inputs = _inputs("llama", 3, 1)
    for off in (None, "optimizer", "all"):
        model = yafsdp.YaFSDP(copy.deepcopy(base), param_dtype=torch.bfloat16, quantize_frozen="nf4", offload=off)
        opt = yafsdp.FusedAdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        losses, _ = _loop(model, opt, "llama", inputs, sync_after_step=False, check_buffers=False)
        owned = model.owned_tensors()
        where = model.placement()
        out[off] = dict(
            losses=losses.cpu(),
            placed={k: (t.device.type, t.is_pinned() if t.device.type == "cpu" else None) for k, t in owned.items()},
            where={k: where[k] for k in owned},
            params={p.device.type for p in model.parameters()},
            state={t.device.type for s in opt.state.values() for t in s.values() if torch.is_tensor(t)},
        )
    return out


def test_offload_placement_and_parity_on_gpu():
    out = run_ranks(_offload_placement_and_parity, 1, backend="nccl")[0]
    for off, r in out.items():
        for role, (dev, pinned) in r["placed"].items():
            assert dev == ("cpu" if r["where"][role] == "host" else "cuda"), (off, role, dev)
            assert pinned in (None, True), (off, role)
        if off is not None:
            assert r["params"] == {"cpu"} and r["state"] == {"cpu"}, (off, r)
            assert torch.allclose(r["losses"], out[None]["losses"], rtol=1e-3), (off, r["losses"], out[None]["losses"])
    assert out["all"]["where"]["nf4"] == "host" and out["optimizer"]["where"]["nf4"] == "device"
