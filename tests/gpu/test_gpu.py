"""The CUDA path on a GPU: parity, the stream protocol with its timing windows widened, no host
synchronisation anywhere in the step, resume, and the fake process group; the narrow reduce with fp32
accumulation, GradScaler and clipping on shard grads, asynchronous saves from device memory and auto
checkpointing under NCCL at world 1 (one spawned rank for the four); int8 records and the fp32 fold on the
device against their CPU twins; with two GPUs, the parity (also HSDP as two replicas) and the race cases
again at world 2 under NCCL.
Skipped without a GPU (the same protocol is proven on the CPU by
tests/multirank/test_streamcheck.py). docs/testing.md ("GPU suite") maps every CUDA path to its check here.

Races between streams hide when the host cannot run ahead of the device. These tests keep the
host free: inputs are put on the device once, losses stay device tensors until the end, and
``torch.cuda._sleep`` delays the comm stream before every collective and the compute stream before
every optimizer step, so a missing event wait reads stale or torn data. Each loop is compared
bit for bit against the same loop with a ``torch.cuda.synchronize()`` after every optimizer step.
"""
import copy
import gc
import math

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

# World 2 under NCCL: a rank per GPU (tests/dist_utils.py sets the device by rank). Every rank reads the same
# batches, so the averaged gradient is the single-process one and the unsharded reference stays exact; what
# world 2 adds is NCCL across devices: the in-place reduce-scatter at rank > 0, the sums, the gathers' peers.
needs_two_gpus = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                                    reason="needs two CUDA devices (NCCL refuses two ranks on one)")


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


def unit_mismatch(slot, u) -> torch.Tensor:
    """Elements (a device count, no host sync) where weight buffer ``slot``, holding unit ``u``, differs
    from what a gather of ``u`` writes at world 1, where the gathered unit is its shard: the compute
    copy; the fp32 master cast to param_dtype where there is none ([Note: the world-1 cast gather]); the
    expand of an NF4, FP8 or INT8 group's record."""
    n = torch.zeros((), dtype=torch.int64, device=slot.data.device)
    for g in u.groups:
        got = slot.data[g.buffer_offset:g.buffer_offset + g.layout.padded_numel]
        shard = g.compute.to(got.device)  # offload="all": a host shard (a synchronous copy)
        if g.kind.format.compact:
            want = torch.empty_like(got)
            g.expand(want, shard)
        else:
            want = shard.to(got.dtype)
        n += (got != want).sum()
    return n


def check_buffers_at_release(counter: list):
    """Compare every weight buffer with its unit as each of the unit's uses ends (``WeightBuffer.release``
    with one use left: forward, eval forward, backward), adding the mismatches to ``counter[0]``, on the
    compute stream before the release is recorded -- before a world-1 buffer's memory is given back
    ([Note: world-1 buffers in use only]). Returns the function that restores ``release``."""
    from yafsdp.engine.buffers import WeightBuffer

    orig = WeightBuffer.release

    def release(self):
        if self.busy == 1 and self.owner is not None and self.holds(self.owner):
            counter[0] = counter[0] + unit_mismatch(self, self.owner)
        orig(self)

    WeightBuffer.release = release

    def restore():
        WeightBuffer.release = orig
    return restore


def _optimizer(name, params):
    if name == "fused_adamw":
        return yafsdp.FusedAdamW(params, lr=3e-3, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, fused=(name == "torch_fused"))


def _loop(model, opt, kind, inputs, *, sync_after_step, check_buffers, eval_inputs=None):
    """``check_buffers``: every weight buffer compared with its unit at the end of each use (world 1)."""
    losses, mismatch = [], [torch.zeros((), dtype=torch.int64, device="cuda")]
    restore = check_buffers_at_release(mismatch) if check_buffers else (lambda: None)
    accum = len(inputs[0])
    try:
        for step, micros in enumerate(inputs):
            for x in micros:
                loss = loss_of(model, kind, x)
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
    finally:
        restore()
    return torch.stack(losses), mismatch[0]


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
    # the narrow reduce summed in fp32 (reduce_accum.py): an all-to-all into the grad buffer's landing and the
    # fp32 fold of its pieces, both on the comm stream
    "z3_bf16_reduce_accum": dict(zero=3, dtype="bfloat16", opt="fused_adamw", reduce_accum=True),
    # INT8 gathers (formats/int8.py): the twin's expand on the comm stream; FP8 and INT8 records with offload:
    # the host record written by the optimizer, uploaded on the upload stream, gathered from the device copy
    "z3_bf16_int8": dict(zero=3, dtype="bfloat16", opt="fused_adamw", gather="int8"),
    "z3_bf16_fp8_offload": dict(zero=3, dtype="bfloat16", opt="fused_adamw", fp8=True, offload="optimizer"),
    "z3_bf16_int8_adamw_offload": dict(zero=3, dtype="bfloat16", opt="adamw", gather="int8", offload="optimizer"),
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
                                  gather_dtype="fp8" if case.get("fp8") else case.get("gather"),
                                  **(dict(reduce_dtype=torch.bfloat16, reduce_accum_dtype=torch.float32)
                                     if case.get("reduce_accum") else {}))
            opt = _optimizer(case["opt"], model.parameters())
            torch.cuda.synchronize()
            # (the buffer check reads a gathered unit as the own shard: world 1 only)
            losses, mismatch = _loop(model, opt, "llama", inputs, sync_after_step=sync, check_buffers=world == 1,
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


@needs_two_gpus
def test_widened_windows_world2_match_the_synchronised_run_bit_for_bit():
    """The race cases on two GPUs: every rank's losses, and rank 0's full weights, bit for bit against the
    run synchronised after every step."""
    for rank, out in enumerate(run_ranks(_race_windows, 2, list(CASES), backend="nccl")):
        for name, r in out.items():
            assert r["same_losses"] and r["same_weights"], (rank, name, r)
            assert r["falls"], (rank, name, r)


def _gpu_parity(rank, world, zero_stage, hsdp_offload=None):
    """``hsdp_offload``: None (full sharding), or HSDP over ``world`` replicas of one rank each with this
    ``offload`` ("none" or "optimizer"): the replicas' all-reduce of the grad shards under NCCL."""
    out = {}
    for kind in ("llama", "stack"):
        base = tiny_llama(tie=True) if kind == "llama" else Stack()
        ref = copy.deepcopy(base).cuda()
        extra = {}
        if hsdp_offload is not None:
            from torch.distributed.device_mesh import init_device_mesh

            extra = dict(mesh=init_device_mesh("cuda", (world, 1), mesh_dim_names=("replicate", "shard")),
                         offload=None if hsdp_offload == "none" else hsdp_offload)
        model = yafsdp.YaFSDP(base, zero_stage=zero_stage, **extra)
        assert hsdp_offload is None or model.mesh_shape == (world, 1)
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
        sd = model.full_state_dict()  # rank 0's; {} elsewhere
        rel = {k: ((sd[k] - v.cpu()).norm() / v.norm().clamp_min(1e-12)).item() for k, v in ref.state_dict().items()
               } if rank == 0 else {}
        out[kind] = (losses.cpu(), torch.stack(ref_losses).cpu(), rel)
    return out


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_nccl_world1_fp32_parity(zero_stage):
    out = run_ranks(_gpu_parity, 1, zero_stage, backend="nccl")[0]
    for kind, (losses, ref_losses, rel) in out.items():
        assert ((losses - ref_losses).abs() / ref_losses.abs()).max() < 1e-4, kind
        assert max(rel.values()) < 1e-3, (kind, rel)


@needs_two_gpus
@pytest.mark.parametrize("offload", ["none", "optimizer"])
def test_nccl_world2_hsdp_fp32_parity(offload):
    """HSDP over two GPUs as two replicas of one rank each (mesh (2, 1)): the grad shards all-reduced across
    the replicas under NCCL (overlapped from the second step; with offload through the device, deferred), fp32
    parity with the unsharded model. Shard groups of two or more need four GPUs."""
    outs = run_ranks(_gpu_parity, 2, 3, offload, backend="nccl")
    for rank, out in enumerate(outs):
        for kind, (losses, ref_losses, rel) in out.items():
            assert ((losses - ref_losses).abs() / ref_losses.abs()).max() < 1e-4, (rank, kind)
            if rank == 0:
                assert max(rel.values()) < 1e-3, (kind, rel)


@needs_two_gpus
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_nccl_world2_fp32_parity(zero_stage):
    """fp32 parity with the unsharded model on two GPUs (the same batches on both ranks: see needs_two_gpus)."""
    outs = run_ranks(_gpu_parity, 2, zero_stage, backend="nccl")
    for rank, out in enumerate(outs):
        for kind, (losses, ref_losses, rel) in out.items():
            assert ((losses - ref_losses).abs() / ref_losses.abs()).max() < 1e-4, (rank, kind)
            if rank == 0:
                assert max(rel.values()) < 1e-3, (kind, rel)


def _bf16_stack_batch():
    """A Stack batch for a bf16 engine: the inputs in the weights' dtype (the engine casts no inputs)."""
    return {k: v.to("cuda", torch.bfloat16) for k, v in batch("stack", 0, 0, 0).items()}


def _collectives_on_comm_stream(rank, world):
    """Every gather and reduce of the step is issued synchronously on the comm stream (so the NCCL
    kernel runs there, torch >= 2.8), never with async_op=True. Spied where the CUDA schedule looks them
    up (comm/cuda.py)."""
    from yafsdp.comm import cuda as comm

    seen = []
    for name in ("all_gather", "reduce_scatter"):
        orig = getattr(comm, name)

        def spy(out, inp, group, async_op=True, _orig=orig, _name=name):
            seen.append((_name, torch.cuda.current_stream().stream_id, async_op))
            return _orig(out, inp, group, async_op=async_op)

        setattr(comm, name, spy)
    model = yafsdp.YaFSDP(Stack(n=4), param_dtype=torch.bfloat16)
    loss_of(model, "stack", _bf16_stack_batch()).backward()
    torch.cuda.synchronize()
    return seen, model.schedule.comm.stream_id


def test_collectives_run_on_the_comm_stream():
    seen, comm_id = run_ranks(_collectives_on_comm_stream, 1, backend="nccl")[0]
    assert {n for n, *_ in seen} == {"all_gather", "reduce_scatter"}
    assert all(s == comm_id and a is False for _, s, a in seen), seen


NO_SYNC_CASES = {
    "bf16": dict(),
    # the all-to-all of the narrow reduce and its fp32 fold; the int8 records' encode (FusedAdamW) and expand
    "bf16_reduce_accum": dict(reduce_dtype=torch.bfloat16, reduce_accum_dtype=torch.float32),
    "bf16_int8": dict(gather_dtype="int8"),
}


def _no_sync_and_recorder(rank, world):
    from yafsdp.trace import Recorder

    out = {}
    for name, opts in NO_SYNC_CASES.items():
        # d=128: the blocks' Linear weights are whole int8 blocks of 128 values (int8-eligible)
        model = yafsdp.YaFSDP(Stack(n=4, d=128), param_dtype=torch.bfloat16, **opts)
        opt = yafsdp.FusedAdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"))
        inputs = _bf16_stack_batch()
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
        formats = {g.kind.format.name for u in model.flat_units for g in u.groups}
        out[name] = ([(i.kind, i.unit, i.start, i.end) for i in iv], formats)
    return out


def test_step_has_no_host_sync_and_uses_comm_stream():
    out = run_ranks(_no_sync_and_recorder, 1, backend="nccl")[0]
    assert set(out) == set(NO_SYNC_CASES)
    for name, (iv, formats) in out.items():
        kinds = {k for k, *_ in iv}
        assert {"gather", "reduce", "forward", "backward"} <= kinds, name
        assert all(e >= s for _, _, s, e in iv), name
    assert "int8" in out["bf16_int8"][1], out["bf16_int8"][1]  # the case gathers int8 records


def _resume_keeps_step_where_torch_does(rank, world, root):
    from yafsdp import checkpoint as ckpt

    out = {}
    for name in ("adamw", "fused_adamw", "torch_fused"):
        model = yafsdp.YaFSDP(Stack(), param_dtype=torch.bfloat16)
        opt = _optimizer(name, model.parameters())
        loss_of(model, "stack", _bf16_stack_batch()).backward()
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
        loss_of(model, "llama", inputs).backward()  # the first step: cuBLAS's workspaces (2 x 32 MiB) are allocated
        torch.cuda.synchronize()
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


# ------------------------------------------------------------------ kernels and twins on the device (no ranks)
def _bits(t):
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def test_fp32_fold_of_narrow_pieces_on_cuda_is_its_cpu_twin():
    """reduce_accum.fold_pieces_ on the device (the comm stream's kernel of the narrow reduce: copy, adds,
    kernels.accumulate_ of the CUDA extension) equals its CPU twin bit for bit, on pieces whose large values
    cancel across ranks, and stays within the Note's bound against the fp32 reduce."""
    from yafsdp.comm.reduce_accum import error_bound, fold_pieces_, fold_pieces_reference

    world, n = 4, 1001
    g = torch.Generator().manual_seed(3)
    c = torch.randn(world, n, generator=g)
    c[0] += 256.0  # a large value on one rank cancelled on another: a bf16 running sum loses the rest
    c[2] -= 256.0
    pieces = c.to(torch.bfloat16)
    base = torch.randn(n, generator=g)
    for accumulate in (False, True):
        want = fold_pieces_reference(base.clone(), pieces, 1 / world, accumulate)
        got = fold_pieces_(base.cuda(), pieces.cuda(), 1 / world, accumulate, torch.empty(n, device="cuda"))
        assert torch.equal(_bits(got.cpu()), _bits(want)), accumulate
    got = fold_pieces_(torch.empty(n, device="cuda"), pieces.cuda(), 1 / world, False, torch.empty(0, device="cuda"))
    fp32 = (c[0] + c[1] + c[2] + c[3]) * (1 / world)  # the fp32 reduce, in rank order
    err = (got.cpu().double() - fp32.double()).abs()
    assert (err <= error_bound(c, 1 / world, torch.bfloat16, reference=fp32)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_records_on_cuda_equal_cpu(dtype):
    """The int8 format's encode (the optimizer's record write) and expand (after each gather) run as torch
    ops on the device (no compiled kernel: formats/int8.py): the same bits as on the CPU."""
    from yafsdp import formats
    from yafsdp.formats import int8

    fmt = formats.get("int8")
    n = int8.BLOCK * 257
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 2, n // int8.BLOCK).repeat_interleave(int8.BLOCK)
    x[int8.BLOCK:2 * int8.BLOCK] = 0  # a block of zeros: scale 0, codes 0
    want = torch.zeros(fmt.record_bytes(n), dtype=torch.uint8)
    fmt.encode_(want, x)
    got = torch.zeros_like(want, device="cuda")
    fmt.encode_(got, x.cuda())
    assert torch.equal(got.cpu(), want)
    other = torch.zeros_like(want)
    fmt.encode_(other, torch.randn(n, generator=g))
    staging = torch.cat([want, other])  # two ranks' records
    out_cpu = torch.empty(2 * n, dtype=dtype)
    fmt.expand_(out_cpu, staging, n)
    out = torch.empty(2 * n, dtype=dtype, device="cuda")
    fmt.expand_(out, staging.cuda(), n)
    assert torch.equal(_bits(out.cpu()), _bits(out_cpu))
    assert torch.equal(_bits(out_cpu[:n]), _bits(int8.fake_quantize(x, dtype)))


# ------------------------------------------------- engine paths under NCCL at world 1, in one spawned rank
class _Leaf(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))

    def forward(self, c):
        return (self.w * c).sum()


class _Probe(torch.nn.Module):
    """Two units whose gradient is exactly the input ``c`` (2 x n)."""

    def __init__(self, n):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Leaf(n), _Leaf(n)])

    def forward(self, c):
        return self.blocks[0](c[0]) + self.blocks[1](c[1])


def _cuda(inputs):
    return {k: v.cuda() for k, v in inputs.items()}


def _narrow_reduce():
    """The grads of fp32, bf16 and bf16-summed-in-fp32 reduces (world 1: the NCCL reduce-scatter and
    all-to-all copy; the folds run on the comm stream) and each reduce's bytes."""
    n = 37  # uneven: the flat units are padded
    c = torch.randn(2, n, generator=torch.Generator().manual_seed(5)) * 100
    out = {}
    for name, opts in {"fp32": {}, "bf16": dict(reduce_dtype=torch.bfloat16),
                       "accum": dict(reduce_dtype=torch.bfloat16, reduce_accum_dtype=torch.float32)}.items():
        model = yafsdp.YaFSDP(_Probe(n), **opts)
        model(c.cuda()).backward()
        torch.cuda.synchronize()
        sent = sum(v for (kind, _), v in model.schedule.counted.items() if kind == "reduce")
        out[name] = (torch.cat([model.full_grad(f"blocks.{i}.w").cpu() for i in range(2)]), sent,
                     model.device.type)
    return c.reshape(-1), out


def _grad_scaler():
    """fp16 with torch's GradScaler("cuda") and torch's clip_grad_norm_ on the engine's shard grads
    (found_inf and the norm all-reduced over NCCL), against the unwrapped model's fp16 grads on an fp32
    master: the same scale history (the same steps skipped) and norms."""
    steps, init = 6, 2.0 ** 24  # 2^24: the first steps overflow fp16 for sure, then the scale halves

    def scaler():
        return torch.amp.GradScaler("cuda", init_scale=init, growth_interval=1)

    model = yafsdp.YaFSDP(tiny_llama(), param_dtype=torch.float16)
    opt, sc, got = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False), scaler(), ([], [])
    for step in range(steps):
        sc.scale(loss_of(model, "llama", _cuda(batch("llama", step, 0, 0)))).backward()
        sc.unscale_(opt)
        got[1].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        sc.step(opt)
        sc.update()
        got[0].append(float(sc.get_scale()))
        opt.zero_grad()
    master = tiny_llama().cuda()
    opt, sc, ref = torch.optim.AdamW(master.parameters(), lr=1e-3, foreach=False), scaler(), ([], [])
    for step in range(steps):
        low = copy.deepcopy(master)
        for q in low.parameters():
            q.data = q.data.half()
        sc.scale(loss_of(low, "llama", _cuda(batch("llama", step, 0, 0)))).backward()
        for p, q in zip(master.parameters(), low.parameters()):
            p.grad = None if q.grad is None else q.grad.float()
        sc.unscale_(opt)
        ref[1].append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)))
        sc.step(opt)
        sc.update()
        ref[0].append(float(sc.get_scale()))
        opt.zero_grad()
    return got, ref


def _async_save(root):
    """AsyncSaver staging from device memory while the device is still busy: the checkpoint holds the
    state at save() (the optimizer step queued behind a sleep included, the later change excluded)."""
    from yafsdp import checkpoint as ckpt

    model = yafsdp.YaFSDP(tiny_llama(), param_dtype=torch.bfloat16)
    opt = yafsdp.FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    saver = ckpt.AsyncSaver(model, opt)
    for step in range(2):
        loss_of(model, "llama", _cuda(batch("llama", step, 0, 0))).backward()
        torch.cuda._sleep(50 * SLEEP)  # ~50 ms: the optimizer step below is still queued when save() stages
        opt.step()
        opt.zero_grad()
    saver.save(root, 2)
    want = model.full_state_dict()
    want_state = [{k: v.detach().cpu().clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
                  for p in model.parameters()]
    with torch.no_grad():  # after save() returned: the checkpoint must not see this
        for p in model.parameters():
            p.add_(1.0)
    path = saver.wait()
    saver.close()
    fresh = yafsdp.YaFSDP(tiny_llama(seed=1), param_dtype=torch.bfloat16)
    fopt = yafsdp.FusedAdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    ckpt.load_checkpoint(path, fresh, fopt)
    got = fresh.full_state_dict()
    got_state = [{k: v.detach().cpu() for k, v in fopt.state[p].items() if torch.is_tensor(v)}
                 for p in fresh.parameters()]
    return dict(same_weights=want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want),
                same_state=len(want_state) == len(got_state) and all(
                    a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                    for a, b in zip(want_state, got_state)),
                changed=not torch.equal(model.full_state_dict()["model.norm.weight"], want["model.norm.weight"]))


def _auto_checkpointing():
    """choose_checkpointing on the GPU: the default budget (free device memory after the engine, minus a
    margin) and a budget between "all" and "none"; each choice's predicted peak against the peak the CUDA
    allocator measures (world 1, bf16, a 4-layer Llama-3.2-1B)."""
    from test_plan import _llama_step

    from yafsdp.measure import measure_memory
    from yafsdp.plan import apply_checkpointing, choose_checkpointing
    from yafsdp.plan.choose import gpu_budget, model_blocks

    dev = torch.device("cuda", torch.cuda.current_device())
    b, s = 2, 1024
    build, step = _llama_step("llama3-1b", dev, b, s, bf16=True, layers=4, meta=False)
    model, opt = build()
    default = choose_checkpointing(model, batch=b, seq=s)
    expected_budget = gpu_budget(dev)
    mid = choose_checkpointing(model, batch=b, seq=s, budget=(default.peak_all + default.peak_none) // 2)
    every = model_blocks(model)
    out = dict(default=default.to_dict(), expected_budget=expected_budget, total=torch.cuda.mem_get_info(dev)[1],
               mid=mid.to_dict(), n=len(every))
    runs = (("none", [], default.peak_none), ("mid", list(mid.blocks), mid.peak), ("all", every, default.peak_all))
    del model, opt, default, mid  # the choices' plans refer to this engine: the peaks below are absolute
    gc.collect()
    torch.cuda.empty_cache()
    for name, blocks, predicted in runs:
        def build_with(blocks=blocks):
            engine = build()
            apply_checkpointing(engine[0], blocks)
            return engine

        m = measure_memory(build_with, step, 3, dev)
        out["run_" + name] = dict(predicted=predicted, measured=m["peak_steady"], reserved=m["reserved"],
                         growth=m["growth_from_step2"])
    return out


def _guarded(fn, *args):
    """One check's result, or its traceback: a failing check does not hide the others of the spawn."""
    import traceback

    try:
        return ("ok", fn(*args))
    except Exception as e:  # noqa: BLE001 - reported by the test of this check
        return ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


def _engine_paths(rank, world, root):
    return dict(narrow_reduce=_guarded(_narrow_reduce), grad_scaler=_guarded(_grad_scaler),
                async_save=_guarded(_async_save, f"{root}/async"), auto_ckpt=_guarded(_auto_checkpointing))


@pytest.fixture(scope="module")
def engine_paths(tmp_path_factory):
    return run_ranks(_engine_paths, 1, str(tmp_path_factory.mktemp("gpu_paths")), backend="nccl")[0]


def _ok(engine_paths, name):
    status, value = engine_paths[name]
    assert status == "ok", value
    return value


def test_narrow_reduce_with_fp32_accumulation_under_nccl(engine_paths):
    """World 1: each reduce leaves the contribution rounded once to its reduce dtype; the fp32-summed
    bf16 reduce sends the bf16 reduce's bytes, fewer than the fp32 one's."""
    c, out = _ok(engine_paths, "narrow_reduce")
    assert {dev for _, _, dev in out.values()} == {"cuda"}
    assert torch.equal(_bits(out["fp32"][0]), _bits(c))
    rounded = c.to(torch.bfloat16).float()
    assert torch.equal(_bits(out["bf16"][0]), _bits(rounded)) and torch.equal(_bits(out["accum"][0]), _bits(rounded))
    assert out["accum"][1] == out["bf16"][1] < out["fp32"][1], {k: v[1] for k, v in out.items()}


def test_grad_scaler_and_clipping_under_nccl(engine_paths):
    (scales, norms), (ref_scales, ref_norms) = _ok(engine_paths, "grad_scaler")
    assert scales == ref_scales, (scales, ref_scales)
    assert any(b < a for a, b in zip([2.0 ** 24] + scales, scales)), f"no step was skipped: tests nothing {scales}"
    # the norms: the same up to an fp16 ulp (2^-11) here and there (cuBLAS may pick another algorithm for the
    # engine's views into its flat buffer than for the reference's own tensors)
    for a, b in zip(norms, ref_norms):
        assert math.isfinite(a) == math.isfinite(b), (norms, ref_norms)
        assert not math.isfinite(a) or abs(a - b) <= 2e-3 * b, (norms, ref_norms)


def test_async_save_from_device_memory(engine_paths):
    r = _ok(engine_paths, "async_save")
    assert r["changed"] and r["same_weights"] and r["same_state"], r


def test_auto_checkpointing_with_the_gpu_budget(engine_paths):
    r = _ok(engine_paths, "auto_ckpt")
    d = r["default"]
    # the default budget: what the device has free after the engine, minus a margin (the engine was alive)
    assert 0 < d["budget"] <= r["total"] and abs(d["budget"] - r["expected_budget"]) <= 0.05 * r["total"], r
    assert d["indices"] == [] and d["fits"], d  # a 4-layer 1B at 2 x 1024 fits an H100/H200: nothing checkpointed
    assert 0 < len(r["mid"]["indices"]) < r["n"] and r["mid"]["fits"], r["mid"]
    for name in ("none", "mid", "all"):
        p = r["run_" + name]
        assert p["growth"] == 0 and abs(p["predicted"] - p["measured"]) <= 0.10 * p["measured"], (name, p)
    assert r["run_all"]["measured"] < r["run_mid"]["measured"] < r["run_none"]["measured"], r



def test_watchdog_dumps_the_nccl_flight_recorder_on_a_hang(tmp_path):
    """The pretraining job on one GPU (NCCL) with its data phase asleep at step 3: the watchdog declares
    the hang within --hang-timeout, every rank's NCCL flight recorder is written to
    --out/flight_recorder/rank_R.pkl (torch's trace buffer, enabled by the job), and the exit is 4."""
    import os
    import subprocess
    import sys

    from job_utils import FAST, JOB, env

    e = env()
    e["YAFSDP_JOB_FAULT"] = "sleep:0:3:data"
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, JOB, *FAST, "--device", "cuda", "--steps", "6", "--save-every", "0",
                        "--hang-timeout", "6", "--out", str(out)], capture_output=True, text=True, timeout=180, env=e)
    assert p.returncode == 4, p.stderr[-3000:]
    assert "yafsdp watchdog (rank 0): no progress for" in p.stderr, p.stderr[-3000:]
    dump = out / "flight_recorder" / "rank_0.pkl"
    assert dump.is_file() and dump.stat().st_size > 0, p.stderr[-3000:]
