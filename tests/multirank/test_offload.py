"""offload="optimizer": fp32 master, grad shard and optimizer state on the host, the compute copy
(all-gather input) on the device; see [Note: host and device tensors] in yafsdp/engine/alloc.py.

On a CPU-only machine host and device are both the CPU, so the same code path runs and must give
bit for bit the results of the engine without offload: LoRA and QLoRA (NF4 base), fp32 and bf16,
FusedAdamW (the copy-out into the host staging) and torch AdamW (the cast pass), gradient
accumulation and clipping, at worlds 1-3; resume from a checkpoint written with offload. What a
CPU run cannot see -- a host tensor handed to a collective -- is checked by watching every
collective's arguments against the storages the engine keeps on the host. The plan and
``allocated_bytes()`` report the same host/device split."""
import os

import pytest
import torch
import torch.distributed as dist

import yafsdp
from dist_utils import run_ranks
from models import batch, loss_of, tiny_llama
from yafsdp import checkpoint as ckpt

peft = pytest.importorskip("peft")
from test_lora import _lora_model  # noqa: E402

STEPS = 3

# name -> (model, engine options, optimizer, accumulation)
CASES = {
    "lora_fp32_adamw": ("lora", dict(), "adamw", 1),
    "lora_bf16_fused_accum2": ("lora", dict(param_dtype=torch.bfloat16), "fused", 2),
    "qlora_bf16_fused": ("lora", dict(param_dtype=torch.bfloat16, quantize_frozen="nf4"), "fused", 1),
    "qlora_fp32_adamw_z2": ("lora", dict(quantize_frozen="nf4", zero_stage=2), "adamw", 1),
    "full_bf16_fused_reduce_bf16": ("llama", dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
                                    "fused", 2),
    "full_fp32_fused_tied": ("tied", dict(), "fused", 1),
}


def _model(kind):
    return _lora_model() if kind == "lora" else tiny_llama(tie=kind == "tied")


def _optimizer(name, params):
    params = [p for p in params if p.requires_grad]
    if name == "fused":
        return yafsdp.FusedAdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


def _run(model, opt, rank, accum, steps=STEPS, start=0):
    out = []
    for step in range(start, start + steps):
        for micro in range(accum):
            (loss_of(model, "llama", batch("llama", step, micro, rank)) / accum).backward()
        norm = model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        out.append((loss_of(model, "llama", batch("llama", 99, 0, rank)).item(), norm.item()))
    return out


def _state(opt):
    return [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]


def _parity(rank, world):
    """Every case at world 2; the LoRA and QLoRA ones at worlds 1 and 3 (the suite's time)."""
    out = {}
    for name, (kind, opts, optim, accum) in CASES.items():
        if world != 2 and kind != "lora":
            continue
        res = {}
        for offload in (None, "optimizer", "all") if kind == "lora" else (None, "optimizer"):
            model = yafsdp.YaFSDP(_model(kind), offload=offload, **opts)
            opt = _optimizer(optim, model.parameters())
            trace = _run(model, opt, rank, accum)
            res[offload] = (trace, model.full_state_dict(), _state(opt),
                            [p.grad is None for p in model.parameters()])
        out[name] = res
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_offload_is_bit_identical(world, request):
    per_rank = ([r["parity"] for r in request.getfixturevalue("world2")] if world == 2  # its spawn is shared
                else run_ranks(_parity, world))
    for rank, res in enumerate(per_rank):
        for name, r in res.items():
            a, sd_a, st_a, g_a = r[None]
            for off in [k for k in r if k is not None]:
                b, sd_b, st_b, g_b = r[off]
                assert a == b, (name, off, rank, a, b)
                assert g_a == g_b, (name, off)
                if rank == 0:
                    assert sd_a.keys() == sd_b.keys() and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a), (name, off)
                assert len(st_a) == len(st_b) and all(
                    torch.equal(x[k], y[k]) for x, y in zip(st_a, st_b) for k in x), (name, off)


def _host_storages(model, opt):
    rt = model._rt
    ts = [rt.master, rt.grad, rt.compute_host, rt.grad_landing]
    if rt.offload == "all":
        ts += [rt.frozen_store, rt.nf4_store]
    ts += [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    return {t.untyped_storage().data_ptr() for t in ts if t is not None}


class _Watch:
    """Every collective's tensor arguments, checked against the storages the engine keeps on the host."""

    def __init__(self, monkeypatch_like):
        from yafsdp.comm import collectives, gloo as comm

        self.host: set[int] = set()
        self.calls: list[str] = []
        self.bad: list[str] = []
        for mod, names in ((collectives, ("all_reduce", "broadcast", "scatter", "all_gather", "reduce_scatter")),
                           (comm, ("all_gather", "reduce_scatter"))):
            for name in names:
                monkeypatch_like(mod, name, self._wrap(name, getattr(mod, name)))

    def _wrap(self, name, fn):
        def watched(*args, **kwargs):
            tensors = []
            for a in args:
                if torch.is_tensor(a):
                    tensors.append(a)
                elif isinstance(a, (list, tuple)):
                    tensors += [t for t in a if torch.is_tensor(t)]
            self.calls.append(name)
            for t in tensors:
                if t.numel() and t.untyped_storage().data_ptr() in self.host:
                    self.bad.append(f"{name}: {tuple(t.shape)} {t.dtype}")
            return fn(*args, **kwargs)

        return watched


def _placement_and_collectives(rank, world, out_dir):
    patched = []

    def setattr_(mod, name, value):
        patched.append((mod, name, getattr(mod, name)))
        setattr(mod, name, value)

    watch = _Watch(setattr_)
    out = {}
    for dt, offload in ((torch.bfloat16, "optimizer"), (None, "optimizer"), (torch.bfloat16, "all")):
        model = yafsdp.YaFSDP(_lora_model(), offload=offload, param_dtype=dt, quantize_frozen="nf4")
        rt = model._rt
        opt = yafsdp.FusedAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        _run(model, opt, rank, 1, steps=1)
        watch.host = _host_storages(model, opt)
        _run(model, opt, rank, 2, steps=2, start=1)  # forward, backward, clip, unused-parameter agreement
        sd = model.full_state_dict()
        model.load_full_state_dict(sd if rank == 0 else None)
        ckpt.load_checkpoint(ckpt.save_checkpoint(os.path.join(out_dir, f"c{dt}"), 1, model, opt), model, opt)
        key = f"{dt} {offload}"
        out[key] = dict(
            bad=list(watch.bad), calls=len(watch.calls),
            host=sorted(model.allocated_bytes("host")), device=sorted(model.allocated_bytes("device")),
            placement=model.placement(), plan=model.memory_plan().engine_bytes(), allocated=model.allocated_bytes(),
            plan_host=model.memory_plan().host_bytes, alloc_host=sum(model.allocated_bytes("host").values()),
            separate=rt.compute.untyped_storage().data_ptr() != rt.master.untyped_storage().data_ptr(),
            copy_out=yafsdp.shards.copy_out_of(model.units[1].flat_param).copy.untyped_storage().data_ptr()
            == rt.compute_host.untyped_storage().data_ptr() if dt is not None else None,
        )
        watch.bad.clear()
        # The check has teeth: full_state_dict without the move to the device hands the host master
        # shards to the all-gather.
        rt.to_device = lambda t: t
        model.full_state_dict()
        out[key]["fault_seen"] = bool(watch.bad)
        watch.bad.clear()
        watch.host = set()
    for mod, name, fn in reversed(patched):
        setattr(mod, name, fn)
    return out


def _world2(rank, world, out_dir):
    """The world-2 runs of this file in one spawn (each restores what it patched)."""
    return dict(parity=_parity(rank, world), placement=_placement_and_collectives(rank, world, out_dir),
                hsdp=_hsdp_offload(rank, world), fp8=_fp8(rank, world))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_ranks(_world2, 2, str(tmp_path_factory.mktemp("offload2")))


def test_collectives_see_only_device_tensors_and_placement(world2):
    for r in (per_rank["placement"] for per_rank in world2):
        for dt, o in r.items():
            assert o["calls"] > 0 and o["bad"] == [], (dt, o["bad"])
            assert o["fault_seen"], dt
            assert o["separate"]  # the device compute copy is its own tensor, fp32 included
            assert o["copy_out"] in (True, None)
            want_host = ["compute_host", "grad", "grad_landing", "master"]
            if dt.startswith("None"):  # fp32: the master itself is the upload's source
                assert o["allocated"]["compute_host"] == 0
            if dt.endswith("all"):  # the frozen and NF4 shards on the host, a landing per weight buffer
                assert o["host"] == sorted(want_host + ["frozen", "nf4"]), o["host"]
                assert "weight0_landing" in o["device"] and "nf4" not in o["device"]
            else:
                assert o["host"] == want_host, o["host"]
                assert "nf4" in o["device"] and not any(k.endswith("_landing") for k in o["device"] if k != "grad_landing")
            assert "compute_copy" in o["device"] and "master" not in o["device"]
            assert o["plan"] == o["allocated"]
            assert o["plan_host"] == o["alloc_host"]


def test_offload_refuses_unknown_values():
    assert [yafsdp.layout.config.check_offload(v) for v in (None, "optimizer", "all")] == [None, "optimizer", "all"]
    with pytest.raises(ValueError, match="offload='gpu' is not supported; use None, 'optimizer' .* or 'all'"):
        yafsdp.layout.config.check_offload("gpu")


# HSDP with offload: the grad shards' all-reduce across replicas and the broadcasts from replica 0
# run on host shards staged through the device ([Note: the all-reduce of host grad shards] in
# yafsdp/engine/placement.py). Two replicas of one-rank shard groups (world 2, the cheapest mesh): every
# sum is of two values, so the results equal HSDP without offload bit for bit, whether that run
# all-reduces overlapped (from the second step on) or deferred.
HSDP_CASES = {
    "lora_bf16_fused_accum2": ("lora", dict(param_dtype=torch.bfloat16), "fused", 2, (None, "optimizer", "all")),
    "qlora_fp32_adamw": ("lora", dict(quantize_frozen="nf4"), "adamw", 1, (None, "all")),
    "full_fp32_fused_tied_accum2": ("tied", dict(), "fused", 2, (None, "optimizer")),
}


def _hsdp_offload(rank, world):
    from dist_utils import hsdp_groups

    patched = []

    def setattr_(mod, name, value):
        patched.append((mod, name, getattr(mod, name)))
        setattr(mod, name, value)

    from yafsdp.comm import gloo as comm  # HandleSchedule: the schedule of a gloo run

    watch = _Watch(setattr_)
    setattr_(comm, "all_reduce", watch._wrap("replicate all_reduce", comm.all_reduce))
    setattr_(dist, "broadcast", watch._wrap("dist.broadcast", dist.broadcast))
    groups = hsdp_groups(world, 1)
    out = {}
    for name, (kind, opts, optim, accum, offloads) in HSDP_CASES.items():
        res = {}
        for offload in offloads:
            model = yafsdp.YaFSDP(_model(kind), offload=offload, process_group=groups, **opts)
            opt = _optimizer(optim, model.parameters())
            watch.host = _host_storages(model, opt)
            trace = _run(model, opt, rank, accum)
            sd = model.full_state_dict()
            model.load_full_state_dict(sd if rank == 0 else None)  # the broadcast from replica 0
            res[offload] = dict(trace=trace, sd=sd, state=_state(opt), stats=dict(model._rt.replica_sync.stats),
                                plan=model.memory_plan().engine_bytes(), allocated=model.allocated_bytes(),
                                after_load=_run(model, opt, rank, 1, steps=1, start=STEPS), bad=list(watch.bad))
            watch.bad.clear()
        out[name] = res
    for mod, name, fn in reversed(patched):
        setattr(mod, name, fn)
    return out


def test_offload_with_hsdp_is_bit_identical(world2):
    """offload x HSDP (refused before): the same losses, norms, weights and optimizer state as HSDP
    without offload, bit for bit; no collective saw a host tensor; the plan equals the allocations."""
    for rank, res in enumerate(per_rank["hsdp"] for per_rank in world2):
        for name, r in res.items():
            a = r[None]
            for off in [k for k in r if k is not None]:
                b = r[off]
                assert b["bad"] == [], (name, off, b["bad"])
                assert a["trace"] == b["trace"] and a["after_load"] == b["after_load"], (name, off, a, b)
                if rank == 0:
                    assert a["sd"].keys() == b["sd"].keys()
                    assert all(torch.equal(a["sd"][k], b["sd"][k]) for k in a["sd"]), (name, off)
                assert all(torch.equal(x[k], y[k]) for x, y in zip(a["state"], b["state"]) for k in x), (name, off)
                assert b["plan"] == b["allocated"], (name, off)
                # every gradient element all-reduced once per step, deferred (host shards: never overlapped)
                assert b["stats"]["overlapped"] == 0 and b["stats"]["elements"] == a["stats"]["elements"], b["stats"]
            assert a["stats"]["overlapped"] > 0 or r is res["qlora_fp32_adamw"], a["stats"]


def _fp8(rank, world):
    """offload x gather_dtype="fp8" (refused before) against fp8 gathers without offload."""
    out = {}
    for dt, optim in ((torch.bfloat16, "fused"), (None, "adamw")):
        res = {}
        for offload in (None, "optimizer"):
            model = yafsdp.YaFSDP(tiny_llama(), param_dtype=dt, gather_dtype="fp8", offload=offload)
            opt = _optimizer(optim, model.parameters())
            res[offload] = dict(trace=_run(model, opt, rank, 2), sd=model.full_state_dict(), state=_state(opt),
                                plan=model.memory_plan().engine_bytes(), allocated=model.allocated_bytes(),
                                host=sorted(model.allocated_bytes("host")))
        out[f"{dt} {optim}"] = res
    return out


def test_offload_with_fp8_gathers_is_bit_identical(world2):
    """The FP8 records' host side (fp8_host) is what the optimizer and the quantize pass write, then
    uploaded: the same losses, norms, weights and optimizer state as fp8 gathers without offload."""
    for rank, res in enumerate(per_rank["fp8"] for per_rank in world2):
        for name, r in res.items():
            a, b = r[None], r["optimizer"]
            assert a["trace"] == b["trace"], (name, a["trace"], b["trace"])
            if rank == 0:
                assert all(torch.equal(a["sd"][k], b["sd"][k]) for k in a["sd"]), name
            assert all(torch.equal(x[k], y[k]) for x, y in zip(a["state"], b["state"]) for k in x), name
            assert b["plan"] == b["allocated"] and b["allocated"]["fp8_host"] == b["allocated"]["fp8"] > 0, b
            assert b["host"] == ["compute_host", "fp8_host", "grad", "grad_landing", "master"], b["host"]
