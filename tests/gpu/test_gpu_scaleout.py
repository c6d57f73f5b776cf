"""The scale-out options on CUDA: quantized gradient reduction (``grad_quant``), the secondary shard
(``secondary_shard``) and tensor parallel x sharding. Skipped without a GPU; the same options are proven
on gloo by tests/multirank/test_grad_quant.py, test_secondary_shard.py and test_tp.py.

One GPU (marker ``gpu``, run by gpu_suite.sh part1): a world of one cannot form node groups or a secondary
group of two, and NCCL refuses two ranks on one device, so what runs here is what a world of one can
check -- the quantized records' encode and expand on device tensors against the CPU, bit for bit; the
quantized reduce-scatter and all-reduce themselves on device tensors, with their collectives replaced by an
in-process exchange between threads (one per simulated rank), against the same run on the CPU bit for bit
and against the fp32 reduce within the bound of [Note: the error of a quantized reduce] (the thread
exchange itself is checked against that bound on the CPU, the one test here that runs without a GPU); the
engine with both options at a world of 8 emulated by torch's fake process group (paths and memory: its
collectives move no data); and the tensor-parallel path at world 1 under NCCL (a (1, 1) DeviceMesh on
CUDA: DTensor parameters wrapped, trained, compared with the same TP model without the engine).

Several GPUs (marker ``multigpu``, run by gpu_suite.sh's ``multigpu`` part, skipped below four devices,
HSDP x TP below eight): the same options under NCCL across devices -- the quantized reduce-scatter with its
node stage in place and the replicas' quantized all-reduce at world 4; the engine with ``grad_quant`` and
with ``secondary_shard=2`` at world 4; HSDP 2 x 2's asynchronous save resumed bit for bit; dp 2 x tp 2 and
replicate 2 x shard 2 x tp 2 against the TP model without the engine. Their rank functions take a device,
so each can be run on the CPU under gloo (the node stage then staged, as gloo needs it).
"""
from __future__ import annotations

import copy
import threading
import types

import pytest
import torch
import torch.distributed as dist

import yafsdp
from dist_utils import run_ranks
from models import batch, loss_of, tiny_llama

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_four_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 4,
                                     reason="needs four CUDA devices (NCCL refuses two ranks on one; node "
                                            "groups and secondary groups of two need a world of four)")


def _bits(t):
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


# ------------------------------------------------- one GPU: the records, the quantized collectives' arithmetic
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_quantized_records_on_cuda_equal_cpu(name):
    """The records the quantized reduce sends (the format's ``encode_`` of an fp32 block-padded piece) and
    their values (``expand_`` to fp32): the same bits on the device as on the CPU, blocks of zeros, tiny and
    huge scales included."""
    from yafsdp import formats

    codec = formats.get(name)
    blocks = 97
    n = codec.block * blocks
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, generator=g) * torch.logspace(-20, 20, blocks).repeat_interleave(codec.block)
    x[codec.block:2 * codec.block] = 0  # scale 0
    x[3 * codec.block] = 1e30  # one outlier widens its block only
    want = torch.zeros(codec.record_bytes(n, torch.float32), dtype=torch.uint8)
    codec.encode_(want, x)
    got = torch.zeros_like(want, device="cuda")
    codec.encode_(got, x.cuda())
    assert torch.equal(got.cpu(), want), name
    out_cpu = torch.empty(n)
    codec.expand_(out_cpu, want, n)
    out = torch.empty(n, device="cuda")
    codec.expand_(out, want.cuda(), n)
    assert torch.equal(_bits(out.cpu()), _bits(out_cpu)), name


class _Exchange:
    """The collectives of yafsdp.comm.quant_reduce between threads of one process, one per simulated rank
    (a group is the tuple of its global ranks): each call meets its group's other calls at a barrier, then
    reads the others' inputs. Sums run in group order in the input's dtype."""

    def __init__(self, world: int):
        self.world = world
        self.me = threading.local()
        self.barriers: dict[tuple, threading.Barrier] = {}
        self.posted: dict[tuple, dict[int, torch.Tensor]] = {}
        self.lock = threading.Lock()

    def _meet(self, group: tuple, value: torch.Tensor) -> dict[int, torch.Tensor]:
        with self.lock:
            bar = self.barriers.setdefault(group, threading.Barrier(len(group)))
            self.posted.setdefault(group, {})[self.me.rank] = value.clone()
        bar.wait()
        seen = dict(self.posted[group])
        bar.wait()  # every member has read before the next call of this group posts
        return seen

    def all_to_all(self, output, full, group, async_op=True):
        seen = self._meet(group, full)
        i = group.index(self.me.rank)
        for j, r in enumerate(group):
            output.view(len(group), -1)[j].copy_(seen[r].view(len(group), -1)[i])
        return None

    def all_gather(self, output, shard, group, async_op=True, local=False):
        seen = self._meet(group, shard)
        for j, r in enumerate(group):
            output.view(len(group), -1)[j].copy_(seen[r])
        return None

    def reduce_scatter(self, shard_out, full, group, async_op=True, local=False):
        seen = self._meet(group, full)
        i, n = group.index(self.me.rank), shard_out.numel()
        acc = seen[group[0]][i * n:(i + 1) * n].clone()
        for r in group[1:]:
            acc += seen[r][i * n:(i + 1) * n]
        shard_out.copy_(acc)
        return None

    def run(self, fn):
        """fn(rank) on every simulated rank, each in its own thread; the results in rank order."""
        out, errors = [None] * self.world, []

        def body(rank):
            self.me.rank = rank
            try:
                out[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 -- reported below, after every thread ended
                errors.append((rank, e))
                for bar in list(self.barriers.values()):
                    bar.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        if errors:  # the first cause, not a rank released from a barrier the failure aborted
            errors.sort(key=lambda e: isinstance(e[1], threading.BrokenBarrierError))
            raise AssertionError(f"simulated rank {errors[0][0]} failed") from errors[0][1]
        assert not any(t.is_alive() for t in threads), "a simulated rank is still waiting at a barrier"
        return out


def simulated_quant_reduce(name, device, world, node, dtype, case, monkeypatch):
    """Every rank's reduced shard (fp32) of QuantReduce with its node stage in place (NCCL's way) and of
    QuantAllReduce over the world as replicas, on ``device``, the collectives exchanged between threads."""
    from test_grad_quant import S, contributions

    from yafsdp import formats
    from yafsdp.comm import quant_reduce as qr_mod

    ex = _Exchange(world)
    for f in ("all_to_all", "all_gather", "reduce_scatter"):
        monkeypatch.setattr(qr_mod, f, getattr(ex, f))
    # QuantAllReduce asks torch.distributed for its group's size and its rank in it
    monkeypatch.setattr(qr_mod, "dist", types.SimpleNamespace(get_world_size=len,
                                                              get_rank=lambda group: group.index(ex.me.rank)))
    codec = formats.get(name)
    c = contributions(case)

    def rank_fn(rank):
        n_here, l_here = divmod(rank, node)
        node_group = tuple(range(n_here * node, (n_here + 1) * node))
        cross_group = tuple(range(l_here, world, node))
        qr = qr_mod.QuantReduce(codec, world, rank, node, node_group if node > 1 else None, cross_group,
                                in_place=True)
        room = torch.zeros(qr_mod.reduce_room_bytes(codec, world // node, node, S, dtype, False),
                           dtype=torch.uint8, device=device)
        full = c[rank].to(device=device, dtype=dtype, copy=True)  # reduced in place: never c itself
        total = qr.output(room, full)
        qr(room, total, full, async_op=False)
        ar_room = torch.zeros(qr_mod.all_reduce_room_bytes(codec, world, 2 * S), dtype=torch.uint8, device=device)
        shard = c[rank, :2 * S + 57].to(device, copy=True)  # uneven: the last piece is short
        qar = qr_mod.QuantAllReduce(codec, tuple(range(world)), ar_room, 2 * S)
        qar(shard, async_op=False)
        return total.cpu().clone(), shard.cpu().clone()

    return ex.run(rank_fn), c


def check_simulated_bound(name, got, c, node):
    """Every simulated rank's reduced shard (fp32 buffers) within the Note's bound of the fp32 reduce; the
    replicas' all-reduce the same bits on every rank."""
    from test_grad_quant import S

    from yafsdp import formats
    from yafsdp.comm.quant_reduce import error_bound

    codec, world = formats.get(name), len(got)
    for rank in range(world):
        piece = c[:, rank * S:(rank + 1) * S]
        partials = piece.view(world // node, node, S).sum(1)
        err = (got[rank][0].double() - piece.double().sum(0)).abs()
        bound = error_bound(codec, partials, rank // node, piece)
        assert (err <= bound).all(), (name, node, rank, (err - bound).max().item())
        assert torch.equal(got[rank][1], got[0][1]), (name, node, rank, "replicas differ")


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_simulated_exchange_on_the_cpu_is_within_the_bound(name, monkeypatch):
    """The thread exchange the CUDA test below relies on, on the CPU (no GPU needed): with it QuantReduce's
    in-place node stage and QuantAllReduce give the fp32 reduce within the bound on every adversarial case of
    test_grad_quant.py, so the CUDA test compares the device against a simulation that reduces correctly."""
    from test_grad_quant import CASES

    for node in (2, 1):
        for case in CASES:
            got, c = simulated_quant_reduce(name, "cpu", 4, node, torch.float32, case, monkeypatch)
            check_simulated_bound(name, got, c, node)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_quantized_reduce_on_cuda_is_its_cpu_twin_and_within_the_bound(name, monkeypatch):
    """QuantReduce (world 4, node groups of 2, the node stage in place as on NCCL; and node groups of 1)
    and QuantAllReduce (4 replicas) on device tensors: the quantize, the dequantize and the fp32 sums in
    node order give the CPU's bits, and the reduced shards are the fp32 reduce within the Note's bound."""
    from test_grad_quant import CASES

    world = 4
    for node in (2, 1):
        for dtype in (torch.float32, torch.bfloat16):
            for case in CASES:
                got, c = simulated_quant_reduce(name, "cuda", world, node, dtype, case, monkeypatch)
                want, _ = simulated_quant_reduce(name, "cpu", world, node, dtype, case, monkeypatch)
                for rank in range(world):
                    for a, b, what in zip(got[rank], want[rank], ("reduce-scatter", "all-reduce")):
                        assert torch.equal(_bits(a), _bits(b)), (name, node, dtype, case, rank, what)
                if dtype == torch.float32:  # the bound is against the fp32 reduce; bf16 sums carry bf16's roundings
                    check_simulated_bound(name, got, c, node)


# ------------------------------------------------------- one GPU: the engine's paths at a fake world of 8
FAKE_OPTS = {
    "int8_node2": dict(grad_quant="int8", grad_quant_node=2),
    "fp8_node2": dict(grad_quant="fp8", grad_quant_node=2),
    "int8_node1": dict(grad_quant="int8"),
    "secondary2": dict(secondary_shard=2),
    "secondary4_fp8_node4": dict(secondary_shard=4, grad_quant="fp8", grad_quant_node=4),
}


def fake_world8_paths(device):
    """Each of FAKE_OPTS at rank 3 of a world of 8 emulated with torch's fake process group (its collectives
    move no data, so the values mean nothing; it stands for NCCL: the node stage reduces in place): three
    AdamW steps on ``device``. Per option: the kinds of collectives the schedule ran, whether every quantized
    reduce runs in place, the plan equal to the allocations, and the device bytes allocated after steps 2
    and 3. A world of one plans no quantized reduce and no secondary group, so this is where one GPU runs
    the engine's side of both options: the rooms, the quantized reduce called by the stream schedule, the
    kept pieces and the backward's gathers from them."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    out = {}
    for name, opts in FAKE_OPTS.items():
        dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
        try:
            model = yafsdp.YaFSDP(tiny_llama(), device=device, **opts)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            inputs = {k: v.to(device) for k, v in batch("llama", 0, 0, 0).items()}
            after = []
            for _ in range(3):
                loss_of(model, "llama", inputs).backward()
                opt.step()
                opt.zero_grad()
                if device == "cuda":
                    torch.cuda.synchronize()
                after.append(torch.cuda.memory_allocated() if device == "cuda" else 0)
            quant = [gb.quant_reduce for gb in model._rt.grad_buffers if getattr(gb, "quant_reduce", None)]
            out[name] = dict(kinds={k[0] if isinstance(k, tuple) else k for k in model.schedule.counted},
                             in_place=[q.reduce.in_place for q in quant],
                             planned=model.memory_plan().engine_bytes() == model.allocated_bytes(), after=after)
        finally:
            dist.destroy_process_group()
    return out


def check_fake_world8(out):
    for name, r in out.items():
        assert r["planned"], (name, "the plan is not the allocations")
        if "grad_quant" in FAKE_OPTS[name]:
            assert "reduce_quant" in r["kinds"] and r["in_place"] and all(r["in_place"]), (name, r)
        if "secondary_shard" in FAKE_OPTS[name]:
            assert "secondary_gather" in r["kinds"], (name, r["kinds"])
        assert r["after"][2] - r["after"][1] < 1 << 20, (name, r["after"])  # nothing grows from step 2 on


@pytest.mark.gpu
@needs_cuda
def test_fake_world8_quantized_reduce_and_secondary_shard_on_cuda():
    """The engine's side of grad_quant and secondary_shard on the device at a fake world of 8 (values
    meaningless, paths real): see fake_world8_paths."""
    check_fake_world8(fake_world8_paths("cuda"))


# ---------------------------------------------------------------------- one GPU: tensor parallel at world 1
def _tp_run(rank, world, dp, tp, zero_stage, device="cuda", replicas=1):
    """dp x tp on ``device`` (CUDA under NCCL; the CPU under gloo checks this helper without a GPU): the
    engine over mesh["dp"] (``replicas`` > 1: HSDP x TP, the engine over mesh["replicate", "shard"] of a
    (replicas, dp / replicas, tp) mesh) against the same TP model without it (its DTensor grads averaged
    over dp). Returns the losses of both and rank 0's largest relative weight error."""
    from test_tp import LR, MAX_NORM, SEQ, VOCAB, tp_plan
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_group, dp_rank = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
    wrap = mesh["dp"]
    if replicas > 1:  # the same ranks as a 3-D mesh: data parallel split into replicas of shard groups
        mesh3 = init_device_mesh(device, (replicas, dp // replicas, tp), mesh_dim_names=("replicate", "shard", "tp"))
        wrap = mesh3["replicate", "shard"]
    base = tiny_llama(vocab=VOCAB).to(device)
    ref = tp_plan(copy.deepcopy(base), mesh["tp"], sp=True)
    model = yafsdp.YaFSDP(tp_plan(base, mesh["tp"], sp=True), mesh=wrap, zero_stage=zero_stage)
    assert model.tp_size == tp and model.device.type == device and model.replicas == replicas
    opts = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1, foreach=False) for m in (model, ref)]
    losses = {"engine": [], "reference": []}
    for step in range(3):
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g).to(device)
        for which, m, opt in (("engine", model, opts[0]), ("reference", ref, opts[1])):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            t = loss.detach().clone()
            dist.all_reduce(t, group=dp_group)
            losses[which].append(t / dp)
            if which == "engine":
                model.clip_grad_norm_(MAX_NORM)
            else:
                for p in ref.parameters():
                    local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                    dist.all_reduce(local, group=dp_group)
                    local.div_(dp)
                grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in ref.parameters()]
                total = torch.stack([q.pow(2).sum() for q in grads]).sum().sqrt()
                coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)
                for p in ref.parameters():
                    p.grad.mul_(coef)
            opt.step()
            opt.zero_grad()
    sd = model.full_state_dict()
    want = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in ref.state_dict().items()}
    rel = max(((sd[k].to(device) - want[k]).norm() / want[k].norm().clamp_min(1e-12)).item() for k in sd) \
        if rank == 0 else 0.0
    return ({k: torch.stack(v).cpu() for k, v in losses.items()}, rel)


def _tp_world1(rank, world):
    return {z: _tp_run(rank, world, 1, 1, z) for z in (2, 3)}  # one spawned rank for both stages


@pytest.mark.gpu
@needs_cuda
def test_tp_world1_smoke_under_nccl():
    """The tensor-parallel path at world 1, ZeRO-2 and -3: a (1, 1) ("dp", "tp") DeviceMesh on CUDA, torch's
    TP with sequence parallelism applied on mesh["tp"], the engine on mesh["dp"]; every parameter a DTensor
    on a one-rank mesh, handed to its module as DTensor.from_local in the unit's forward. Three AdamW steps
    match the same TP model without the engine."""
    out = run_ranks(_tp_world1, 1, backend="nccl")[0]
    for z in (2, 3):
        check_tp([out[z]])


def check_tp(results):
    """Every rank's losses those of TP alone; rank 0's full weights within fp32 parity's tolerance."""
    for rank, (losses, rel) in enumerate(results):
        assert ((losses["engine"] - losses["reference"]).abs() / losses["reference"].abs()).max() < 1e-4, \
            (rank, losses)
        assert rel < 1e-3, (rank, rel)


# ----------------------------------------------------------------- several GPUs: NCCL across devices
def _quant_nccl(rank, world, device="cuda"):
    """QuantReduce with its node stage in place (NCCL reduces into the grad buffer's slices) and
    QuantAllReduce over the world, on CUDA, every case of tests/multirank/test_grad_quant.py."""
    from test_grad_quant import CASES, NODE, S, contributions

    from yafsdp import formats
    from yafsdp.comm.quant_reduce import QuantAllReduce, QuantReduce, all_reduce_room_bytes, reduce_room_bytes
    from yafsdp.comm.subgroups import consecutive_subgroups, strided_subgroups

    node_group = consecutive_subgroups(dist.group.WORLD, NODE)
    cross_group = strided_subgroups(dist.group.WORLD, NODE)
    out = {}
    for name in ("int8", "fp8"):
        codec = formats.get(name)
        # NCCL reduces the node stage into the grad buffer's own slices, as the engine does there; gloo (this
        # helper checked on the CPU) into the room's stage
        in_place = device == "cuda"
        qr = QuantReduce(codec, world, rank, NODE, node_group, cross_group, in_place=in_place)
        room = torch.zeros(reduce_room_bytes(codec, world // NODE, NODE, S, torch.float32, not in_place),
                           dtype=torch.uint8, device=device)
        ar_room = torch.zeros(all_reduce_room_bytes(codec, world, 2 * S), dtype=torch.uint8, device=device)
        qar = QuantAllReduce(codec, dist.group.WORLD, ar_room, 2 * S)
        for case in CASES:
            full = contributions(case)[rank].to(device, copy=True)
            total = qr.output(room, full)
            work = qr(room, total, full, async_op=case != "random")
            if work is not None:
                work.wait()
            shard = contributions(case)[rank, :2 * S + 57].to(device, copy=True)
            qar(shard, async_op=False)
            out[name, case] = (total.cpu().clone(), shard.cpu())
    return out


@pytest.mark.multigpu
@needs_four_gpus
def test_nccl_world4_quantized_reduce_in_place_within_the_bound():
    check_quant(run_ranks(_quant_nccl, 4, backend="nccl"))


def check_quant(res):
    """Every rank's reduced shard within the bound of the fp32 reduce; the replicas' all-reduce the same
    bits on every rank."""
    from test_grad_quant import CASES, NODE, S, contributions

    from yafsdp import formats
    from yafsdp.comm.quant_reduce import error_bound

    for name in ("int8", "fp8"):
        codec = formats.get(name)
        for case in CASES:
            c = contributions(case)
            for rank in range(4):
                piece = c[:, rank * S:(rank + 1) * S]
                partials = piece.view(4 // NODE, NODE, S).sum(1)
                err = (res[rank][name, case][0].double() - piece.double().sum(0)).abs()
                assert (err <= error_bound(codec, partials, rank // NODE, piece)).all(), (name, case, rank)
                assert torch.equal(res[rank][name, case][1], res[0][name, case][1]), (name, case, "replicas differ")


def _engine_nccl(rank, world, opts_list, device="cuda"):
    """Three AdamW steps of a tiny Llama per engine option set, inputs on the device; losses and rank 0's
    full state dict."""
    out = []
    for opts in opts_list:
        model = yafsdp.YaFSDP(tiny_llama(), **opts)
        assert model.device.type == device
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        losses = []
        for step in range(3):
            x = {k: v.to(device) for k, v in batch("llama", step, 0, rank).items()}
            loss = loss_of(model, "llama", x)
            loss.backward()
            losses.append(loss.detach())
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        out.append((torch.stack(losses).cpu(), model.full_state_dict()))
    return out


@pytest.mark.multigpu
@needs_four_gpus
def test_nccl_world4_secondary_shard_bit_identical_to_off():
    """secondary_shard=2 at world 4 under NCCL: the backward's gathers within the pairs give the same
    bits as the full group's (as on gloo in test_secondary_shard.py)."""
    check_secondary(run_ranks(_engine_nccl, 4, [{}, dict(secondary_shard=2)], backend="nccl"))


def check_secondary(results):
    for rank, (off, on) in enumerate(results):
        assert torch.equal(off[0], on[0]), rank
        assert off[1].keys() == on[1].keys() and all(torch.equal(off[1][k], on[1][k]) for k in off[1]), rank


@pytest.mark.multigpu
@needs_four_gpus
def test_nccl_world4_grad_quant_trains_close_to_off():
    """grad_quant int8 and fp8 over node groups of 2 at world 4 under NCCL (the node stage in place): the
    losses and weights stay as close to the unquantized run as test_grad_quant.py asks on gloo."""
    check_grad_quant(run_ranks(_engine_nccl, 4, GRAD_QUANT_OPTS, backend="nccl"))


GRAD_QUANT_OPTS = [{}, dict(grad_quant="int8", grad_quant_node=2), dict(grad_quant="fp8", grad_quant_node=2)]


def check_grad_quant(res):
    (l_off, sd_off), *quantized = res[0]
    for l_on, sd_on in quantized:
        assert l_on[0] == l_off[0]  # the first loss precedes any reduce
        assert (l_on[1:] - l_off[1:]).abs().max() < 2e-3 * l_off[0].abs(), (l_off, l_on)
        diff = max((sd_on[k] - sd_off[k]).abs().max().item() for k in sd_off)
        assert 0 < diff < 2e-2, diff


@pytest.mark.multigpu
@needs_four_gpus
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_nccl_world4_tp_dp_parity(zero_stage):
    """dp 2 x tp 2 on four GPUs under NCCL: the engine over mesh["dp"] against the TP model without it."""
    check_tp(run_ranks(_tp_run, 4, 2, 2, zero_stage, backend="nccl"))



def _hsdp_async_save(rank, world, root, device="cuda"):
    """HSDP 2 x 2 on ``device``: an asynchronous save at step 2 written while steps 3 and 4 train, then
    loaded into a new engine on the same mesh which trains steps 3 and 4 again. Returns rank 0's weights
    after step 4 of both runs, and each rank's staged bytes."""
    from torch.distributed.device_mesh import init_device_mesh

    from yafsdp import checkpoint as ckpt

    def steps(model, opt, first, n):
        for step in range(first, first + n):
            x = {k: v.to(device) for k, v in batch("llama", step, 0, rank).items()}
            loss_of(model, "llama", x).backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()

    def engine():
        mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("replicate", "shard"))
        model = yafsdp.YaFSDP(tiny_llama(tie=True), mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    model, opt = engine()
    assert model.device.type == device and model.mesh_shape == (2, 2)
    steps(model, opt, 0, 2)
    saver = ckpt.AsyncSaver(model, opt)
    staged = saver.save(root, 2, state=dict(step=2), keep=1).staging_bytes
    steps(model, opt, 2, 2)  # while step 2 is written from its staging copy
    path = saver.wait()
    saver.close()
    sd4 = model.full_state_dict()
    again, aopt = engine()
    loaded = ckpt.load_checkpoint(path, again, aopt)
    steps(again, aopt, 2, 2)
    return dict(staged=staged, step=loaded.step, sd4=sd4, resumed_sd4=again.full_state_dict())


def check_hsdp_async_save(results):
    r0 = results[0]
    assert r0["sd4"] and r0["sd4"].keys() == r0["resumed_sd4"].keys()
    assert all(torch.equal(r0["sd4"][k], r0["resumed_sd4"][k]) for k in r0["sd4"]), "the resumed run differs"
    for rank, r in enumerate(results):
        assert r["step"] == 2, (rank, r["step"])
        assert (r["staged"] > 0) == (rank < 2), (rank, r["staged"])  # replica 0 stages and writes


@pytest.mark.multigpu
@needs_four_gpus
def test_nccl_world4_hsdp_async_save_resumes_exactly(tmp_path):
    """AsyncSaver with HSDP (2 replicas x 2) under NCCL: replica 0 stages from device memory and writes
    while training goes on; the checkpoint resumes the uninterrupted run bit for bit."""
    check_hsdp_async_save(run_ranks(_hsdp_async_save, 4, str(tmp_path), backend="nccl"))


needs_eight_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 8,
                                      reason="needs eight CUDA devices (replicate 2 x shard 2 x tp 2)")


@pytest.mark.multigpu
@needs_eight_gpus
def test_nccl_world8_hsdp_tp_parity():
    """HSDP x TP on eight GPUs under NCCL: replicate 2 x shard 2 x tp 2, the engine over
    mesh["replicate", "shard"] (the replicas' all-reduce across devices) against the TP model without it."""
    check_tp(run_ranks(_tp_run, 8, 4, 2, 3, "cuda", 2, backend="nccl"))
