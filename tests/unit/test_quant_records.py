"""grad_quant in one process: the options' checks, the plan's rooms, and the half step of one record that
the error bound of a quantized reduce is made of ([Note: the error of a quantized reduce] in
yafsdp/comm/quant_reduce.py), and the node stage in place on simulated groups. The collectives on gloo run in
tests/multirank/test_grad_quant.py."""
import threading

import pytest
import torch

import yafsdp
from models import tiny_llama
from yafsdp import formats
from yafsdp.comm.quant_reduce import _decode, _encode, _padded, _record, half_step, reduce_room_bytes
from yafsdp.plan import memory_plan


def test_options_are_checked_and_refused_by_name():
    cfg = yafsdp.build_config(grad_quant="int8", grad_quant_node=8)
    assert (cfg.grad_quant, cfg.grad_quant_node) == ("int8", 8)
    assert yafsdp.build_config(grad_quant=torch.float8_e4m3fn).grad_quant == "fp8"  # the formats' spellings
    with pytest.raises(ValueError, match="grad_quant='nf4' is not supported"):
        yafsdp.build_config(grad_quant="nf4")
    with pytest.raises(ValueError, match="grad_quant='int8' with reduce_accum_dtype=torch.float32"):
        yafsdp.build_config(grad_quant="int8", reduce_dtype=torch.bfloat16, reduce_accum_dtype=torch.float32)
    with pytest.raises(ValueError, match="grad_quant_node=2 without grad_quant"):
        yafsdp.build_config(grad_quant_node=2)
    with pytest.raises(ValueError, match="grad_quant_node=0 is not a positive int"):
        yafsdp.build_config(grad_quant="fp8", grad_quant_node=0)
    with pytest.raises(ValueError, match="grad_quant_node=3 does not divide the shard group's 4 ranks"):
        memory_plan(tiny_llama(), world_size=4, grad_quant="int8", grad_quant_node=3)


def test_the_plan_holds_each_grad_buffers_room():
    model = tiny_llama()
    off = memory_plan(model, world_size=4, backend="gloo").engine_bytes()
    one_node = memory_plan(model, world_size=4, backend="gloo", grad_quant="int8", grad_quant_node=4)
    assert one_node.engine_bytes() == off  # one node group: nothing quantized, nothing added
    plan = memory_plan(model, world_size=4, backend="gloo", grad_quant="int8", grad_quant_node=2)
    got = plan.engine_bytes()
    rooms = {k: v for k, v in got.items() if k.endswith("_quant")}
    assert rooms and {k: v for k, v in got.items() if k not in rooms} == off
    codec = formats.get("int8")
    for s in plan.slots:
        if s.kind == "grad":  # fp32 total + padded scratch + the gloo stage + two records per node
            assert rooms[s.name + "_quant"] == reduce_room_bytes(codec, 2, 2, s.shard_capacity, torch.float32, True)
    nccl = memory_plan(model, world_size=4, backend="nccl", grad_quant="int8", grad_quant_node=2)
    assert sum(v for k, v in nccl.engine_bytes().items() if k.endswith("_quant")) < sum(rooms.values())  # in place
    hsdp = memory_plan(model, world_size=2, replicas=2, backend="gloo", grad_quant="fp8", grad_quant_node=2)
    assert set(k for k in hsdp.engine_bytes() if k.endswith("_quant")) == {"replica_quant"}


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_one_record_gives_back_each_value_within_half_a_step(name):
    codec = formats.get(name)
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 128, 300, 1000):
        for values in (torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-30, torch.zeros(n),
                       torch.full((n,), -2.5), torch.cat([torch.tensor([1e6]), torch.randn(n - 1, generator=g)])):
            record = torch.zeros(_record(codec, n), dtype=torch.uint8)
            scratch = torch.zeros(_padded(codec, n))
            _encode(codec, record, values, scratch)
            back = _decode(codec, record, scratch)[:n].clone()
            err = (back.double() - values.double()).abs()
            assert (err <= half_step(codec, values) + 2 ** -23 * values.abs().double()).all(), (name, n)
            # symmetric: the record of -x is the negated record of x (opposite contributions cancel in fp32)
            _encode(codec, record, -values, scratch)
            assert torch.equal(_decode(codec, record, scratch)[:n], -back)


# ------------------------------------------------------------- the NCCL shape of the node stage, simulated
class _SimGroup:
    """An in-memory process group of threads (``_ME.rank``: the caller's global rank): what NCCL promises --
    a reduce-scatter may write its output into its own input's slice -- without a GPU."""

    def __init__(self, ranks):
        self.ranks = list(ranks)
        self.barrier = threading.Barrier(len(self.ranks))
        self.inputs = {}

    def exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.inputs[_ME.rank] = t.clone()
        self.barrier.wait()
        every = [self.inputs[r] for r in self.ranks]
        self.barrier.wait()
        return every

    def me(self) -> int:
        return self.ranks.index(_ME.rank)


_ME = threading.local()


class _Done:
    def wait(self):
        return True


def _sim_reduce_scatter(out, full, group, async_op=False):
    every = group.exchange(full)
    k = len(group.ranks)
    out.copy_(sum(t.chunk(k)[group.me()] for t in every))  # out may be full's own slice: inputs were copied
    return _Done() if async_op else None


def _sim_all_to_all(out, full, group, async_op=False):
    every = group.exchange(full)
    k = len(group.ranks)
    for r, t in enumerate(every):
        out.chunk(k)[r].copy_(t.chunk(k)[group.me()])
    return _Done() if async_op else None


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_the_node_stage_in_place_gives_what_the_staged_one_gives(name, monkeypatch):
    """NCCL reduces the node stage into the grad buffer's own slices (no stage in the room); simulated by
    threads, it gives the staged path's values bit for bit, within the bound."""
    from yafsdp.comm import quant_reduce as Q

    monkeypatch.setattr(Q, "reduce_scatter", _sim_reduce_scatter)
    monkeypatch.setattr(Q, "all_to_all", _sim_all_to_all)
    codec = formats.get(name)
    world, node, s = 6, 2, 200  # 3 node groups of 2
    c = torch.randn(world, world * s, generator=torch.Generator().manual_seed(3))
    c[4, 7] = 1e5
    nodes = [_SimGroup(range(k, k + node)) for k in range(0, world, node)]
    cross = [_SimGroup(range(l, world, node)) for l in range(node)]
    got = {}

    def rank_fn(rank, in_place):
        _ME.rank = rank
        qr = Q.QuantReduce(codec, world, rank, node, nodes[rank // node], cross[rank % node], in_place=in_place)
        room = torch.zeros(Q.reduce_room_bytes(codec, world // node, node, s, torch.float32, not in_place),
                           dtype=torch.uint8)
        full = c[rank].clone()
        total = qr.output(room, full)
        work = qr(room, total, full, async_op=True)
        work.wait()
        got[rank, in_place] = total.clone()

    for in_place in (False, True):
        threads = [threading.Thread(target=rank_fn, args=(r, in_place)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    for rank in range(world):
        assert torch.equal(got[rank, True], got[rank, False]), rank
        mine = c[:, rank * s:(rank + 1) * s].double()
        partials = torch.stack([mine[m * node:(m + 1) * node].sum(0) for m in range(world // node)]).float()
        bound = Q.error_bound(codec, partials, rank // node, mine)
        assert ((got[rank, True].double() - mine.sum(0)).abs() <= bound).all(), rank
    assert Q.reduce_room_bytes(codec, 3, node, s, torch.float32, False) < Q.reduce_room_bytes(
        codec, 3, node, s, torch.float32, True)  # no stage in the room
