"""grad_quant: gradients sent across node groups as 8-bit blocks, summed in fp32 by the receiver.

See [Note: quantized gradient reduction] in yafsdp/comm/quant_reduce.py. One world of 4 (two node groups
of 2) runs every case: the quantized reduce-scatter and the quantized all-reduce across replicas on
adversarial inputs against torch's fp32 sums, within the per-element bound of [Note: the error of a
quantized reduce]; the engine's gradients against the fp32 reduce's; a few training steps, alone and
with the options it composes with. A world of 2 with one node group is the option off, bit for bit.
"""
import pytest
import torch
import torch.distributed as dist

import yafsdp
from dist_utils import hsdp_groups, run_ranks
from models import batch, loss_of, tiny_llama
from test_reduce_accum import Probe  # two units whose gradient on each rank is its chosen contribution
from yafsdp import formats
from yafsdp.comm.subgroups import consecutive_subgroups, strided_subgroups
from yafsdp.comm.quant_reduce import (QuantAllReduce, QuantReduce, _decode, _padded,
                                      _record, all_reduce_room_bytes, error_bound, reduce_room_bytes)

WORLD, NODE = 4, 2
S = 300  # a shard: two blocks of 128 and a padded third
CODECS = ("int8", "fp8")
X = 1000.0


def contributions(case: str, seed: int = 0) -> torch.Tensor:
    """(WORLD, WORLD * S) fp32: every rank's grad buffer for one adversarial ``case``."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(WORLD, WORLD * S, generator=g)
    if case == "cancel":  # node 0's ranks send +x, node 1's exactly -x: the sum is 0
        c[2:] = -c[:2]
    elif case == "cancel_signal":  # +X on node 0, -X plus a small signal on node 1
        c[:2] = X / 2
        c[2:] = -X / 2 + 0.01 * c[2:]
    elif case == "outlier":  # one huge value in one block of every shard
        c[1, ::S] = 1e6
    elif case == "zeros":
        c.zero_()
    elif case == "one_value":  # every block holds one value
        c[:] = 3.14159
    return c


CASES = ("random", "cancel", "cancel_signal", "outlier", "zeros", "one_value")


def _reduce(rank, world):
    """Every case through QuantReduce (both formats) and QuantAllReduce (over the world as 4 replicas)."""
    node_group = consecutive_subgroups(dist.group.WORLD, NODE)
    cross_group = strided_subgroups(dist.group.WORLD, NODE)
    out = {}
    for name in CODECS:
        codec = formats.get(name)
        qr = QuantReduce(codec, world, rank, NODE, node_group, cross_group, in_place=False)
        room = torch.zeros(reduce_room_bytes(codec, world // NODE, NODE, S, torch.float32, True), dtype=torch.uint8)
        ar_room = torch.zeros(all_reduce_room_bytes(codec, world, 2 * S), dtype=torch.uint8)
        qar = QuantAllReduce(codec, dist.group.WORLD, ar_room, 2 * S)
        for case in CASES:
            full = contributions(case)[rank].clone()
            total = qr.output(room, full)
            work = qr(room, total, full, async_op=case != "random")  # the gloo schedule's way, and at once
            if work is not None:
                work.wait()
            shard = contributions(case)[rank, :2 * S + 57].clone()  # uneven: the last piece is short
            qar(shard, async_op=False)
            out[name, case] = (total.clone(), shard)
    return out


# ----------------------------------------------------------------------------------- the engine
N_PROBE = 1001  # per block: uneven, the flat units are padded; shards of 252 values at world 4


def probe_contributions() -> torch.Tensor:
    """(WORLD, 2 * N_PROBE): each rank's gradient of the two probe units, an outlier in some blocks."""
    c = torch.randn(WORLD, 2 * N_PROBE, generator=torch.Generator().manual_seed(1))
    c[1, ::700] = 1e4
    return c


def _probe(rank, world, **opts):
    c = probe_contributions()
    model = yafsdp.YaFSDP(Probe(N_PROBE), **opts)
    model(c[rank].view(2, N_PROBE)).backward()
    model.sync_grads()
    unit, = model.flat_units  # the two 1-D parameters: one flat unit (the small group), laid end to end
    shard = unit.groups[0].layout.shard_numel
    assert [p.offset for p in unit.groups[0].layout.params] == [0, N_PROBE]
    kinds = {}
    for (kind, _), v in model.schedule.counted.items():
        kinds[kind] = kinds.get(kind, 0) + v
    return torch.cat([model.full_grad(f"blocks.{i}.w") for i in range(2)]), shard, kinds


def _train(rank, steps=3, accum=1, **opts):
    """Losses and the final full state of a few AdamW steps of a tiny Llama."""
    model = yafsdp.YaFSDP(tiny_llama(), **opts)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            loss = loss_of(model, "llama", batch("llama", step, micro, rank))
            (loss / accum).backward()
            total += loss.item() / accum
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    plan_ok = model.memory_plan().engine_bytes() == model.allocated_bytes()
    shards = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    return losses, model.full_state_dict(), plan_ok, shards


COMPOSED = {  # what grad_quant composes with (each against the same options without it)
    "accum": dict(accum=2),
    "zero2": dict(zero_stage=2),
    "offload": dict(offload="optimizer"),
    "gather_int8": dict(gather_dtype="int8"),
    "grad_chunks": dict(grad_chunks=2),
    "secondary_shard": dict(secondary_shard=2),
    "bf16": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
}


def _streams(rank, world):
    """The CUDA schedule on simulated streams (yafsdp.streamcheck): a quantized reduce's stages, its fold and
    HSDP's quantized all-reduce touch their rooms and buffers in the order the events make -- no race."""
    from torch.distributed.device_mesh import init_device_mesh
    from yafsdp.streamcheck import StreamChecker

    out = []
    for kw in (dict(grad_quant_node=NODE), dict(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
                                                 grad_quant_node=2)):
        with StreamChecker() as chk:
            model = yafsdp.YaFSDP(tiny_llama(tie=True), param_dtype=torch.bfloat16, grad_quant="int8", **kw)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
            chk.watch(model)
            with chk.recording():
                for step, accum in enumerate((2, 2, 1)):
                    for micro in range(accum):
                        (loss_of(model, "llama", batch("llama", step, micro, rank)) / accum).backward()
                    model.clip_grad_norm_(1.0)
                    opt.step()
                    opt.zero_grad(set_to_none=step % 2 == 0)
        kernels = [entry[1:4] for entry in chk.log if entry[0] == "kernel"]
        comm_ops = {op for stream, op, label in kernels
                    if stream == "comm" and label.startswith(("yafsdp.reduce", "yafsdp.all_reduce"))}
        stray = [k for k in kernels if k[2].startswith(("yafsdp.reduce", "yafsdp.all_reduce")) and k[0] != "comm"]
        out.append(([str(r) for r in chk.races], comm_ops, stray))
    return out


def _world4(rank, world):
    out = {"reduce": _reduce(rank, world), "streams": _streams(rank, world)}
    q = dict(grad_quant="int8", grad_quant_node=NODE)
    out["probe"] = {"off": _probe(rank, world), "int8": _probe(rank, world, **q),
                    "fp8": _probe(rank, world, grad_quant="fp8", grad_quant_node=NODE),
                    "node1": _probe(rank, world, grad_quant="int8")}
    out["train"] = {"off": _train(rank), "int8": _train(rank, **q),
                    "hsdp_off": _train(rank, process_group=hsdp_groups(2, 2)),
                    "hsdp": _train(rank, process_group=hsdp_groups(2, 2), **q)}
    for name, opts in COMPOSED.items():
        opts = dict(opts)
        accum = opts.pop("accum", 1)
        out["train"][name] = (_train(rank, steps=2, accum=accum, **opts),
                              _train(rank, steps=2, accum=accum, **q, **opts))
    return out


_RESULTS: dict = {}


def _results(world: int):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_world4 if world == 4 else _world2, world)
    return _RESULTS[world]


def _piece_bound(codec, c: torch.Tensor, rank: int) -> torch.Tensor:
    """The bound on rank ``rank``'s reduced shard of ``c`` (WORLD x WORLD * S')."""
    s = c.shape[1] // WORLD
    mine = c[:, rank * s:(rank + 1) * s].double()
    partials = torch.stack([mine[m * NODE:(m + 1) * NODE].sum(0) for m in range(WORLD // NODE)]).float()
    return error_bound(codec, partials, rank // NODE, mine)


@pytest.mark.parametrize("name", CODECS)
def test_quantized_reduce_scatter_is_within_the_bound_on_adversarial_inputs(name):
    res = _results(4)
    codec = formats.get(name)
    for case in CASES:
        c = contributions(case)
        for rank in range(WORLD):
            got = res[rank]["reduce"][name, case][0]
            assert got.dtype == torch.float32 and got.numel() == S
            want = c[:, rank * S:(rank + 1) * S].sum(0)  # torch's fp32 reduce
            err = (got.double() - want.double()).abs()
            bound = _piece_bound(codec, c, rank)
            assert (err <= bound).all(), (name, case, rank, (err - bound).max())
            if case == "zeros":  # zero blocks are exact
                assert torch.equal(got, torch.zeros(S)), (name, case, got.abs().max())
            if case == "cancel_signal":  # +X and -X: what is left is the signal, within two half steps of X
                assert err.max() <= 2 * (X / (127 if name == "int8" else 28)), err.max()
            if case == "outlier" and rank // NODE == 1:  # the outlier's partial arrived as a record: it
                # widens its own block's step only
                assert bound[128:].max() < 1e-3 * bound[:128].min(), (name, rank)


@pytest.mark.parametrize("name", CODECS)
def test_the_receiver_sums_dequantized_records_in_fp32_never_in_8_bits(name):
    """The result is bit for bit the fp32 sum, in node order, of this node's exact partial and the other
    node's partial as its record dequantizes -- no partial sum was ever requantized."""
    res = _results(4)
    codec = formats.get(name)
    pad = _padded(codec, S)
    for case in CASES:
        c = contributions(case)
        for rank in range(WORLD):
            mine = c[:, rank * S:(rank + 1) * S]
            partials = [mine[0] + mine[1], mine[2] + mine[3]]  # gloo's world-2 exchange: received + own
            if rank % 2 == 0:
                partials = [mine[1] + mine[0], mine[3] + mine[2]]
            other = 1 - rank // NODE
            values = torch.zeros(pad)
            values[:S] = partials[other]
            record = torch.zeros(_record(codec, S), dtype=torch.uint8)
            codec.encode_(record, values)
            deq = _decode(codec, record, torch.zeros(pad))[:S]
            terms = [partials[0], deq] if other == 1 else [deq, partials[1]]
            want = terms[0].clone()
            want += terms[1]
            assert torch.equal(res[rank]["reduce"][name, case][0], want), (name, case, rank)


@pytest.mark.parametrize("name", CODECS)
def test_quantized_all_reduce_across_replicas_is_the_same_on_every_replica_and_within_the_bound(name):
    res = _results(4)
    codec = formats.get(name)
    for case in CASES:
        n = 2 * S + 57
        c = contributions(case)[:, :n]
        got = [res[r]["reduce"][name, case][1] for r in range(WORLD)]
        for r in range(1, WORLD):  # every replica holds the same bits
            assert torch.equal(got[r], got[0]), (name, case, r)
        want = c.sum(0)
        err = (got[0].double() - want.double()).abs()
        seg = 2 * S
        for lo in range(0, n, seg):  # segments of the room, each in WORLD pieces
            m = min(seg, n - lo)
            p = -(-m // WORLD)
            for j in range(WORLD):
                a, b = lo + min(j * p, m), lo + min((j + 1) * p, m)
                if a == b:
                    continue
                bound = error_bound(codec, c[:, a:b], j, c[:, a:b], requantized=want[a:b])
                assert (err[a:b] <= bound).all(), (name, case, j, (err[a:b] - bound).max())
        if case == "zeros":
            assert torch.equal(got[0], torch.zeros(n))


def test_engine_gradients_are_the_fp32_reduce_within_the_bound():
    res = _results(4)
    c = probe_contributions()
    ref = res[0]["probe"]["off"][0]
    shard = res[0]["probe"]["off"][1]
    for name in ("int8", "fp8", "node1"):
        codec = formats.get("fp8" if name == "fp8" else "int8")
        got = res[0]["probe"][name][0]
        for r in res[1:]:
            assert torch.equal(r["probe"][name][0], got)
        cu = torch.zeros(WORLD, WORLD * shard)  # the flat gradient, padded to WORLD shards
        cu[:, :2 * N_PROBE] = c
        node = 1 if name == "node1" else NODE
        bound = torch.cat([_bound_node(codec, cu, rank, shard, node) for rank in range(WORLD)])[:2 * N_PROBE]
        err = (got.double() - ref.double()).abs()
        # the fold scales both by 1/world: exact in fp32
        assert (err <= bound / WORLD).all(), (name, (err - bound / WORLD).max())
        assert err.max() > 0  # quantized: not the fp32 reduce's bits
    kinds = res[0]["probe"]["int8"][2]
    off = res[0]["probe"]["off"][2]
    # bytes this rank put in: the node stage the grad buffer (fp32, as a plain reduce), the cross-node
    # stage's all-to-all one int8 record per node (its own stays local): 256 codes + 2 scales, per unit
    assert kinds["reduce"] == off["reduce"] and kinds["reduce_quant"] == 2 * 2 * (256 + 8), kinds


def _bound_node(codec, cu, rank, shard, node):
    mine = cu[:, rank * shard:(rank + 1) * shard].double()
    partials = torch.stack([mine[m * node:(m + 1) * node].sum(0) for m in range(WORLD // node)]).float()
    return error_bound(codec, partials, rank // node, mine)


def test_training_with_quantized_reduction_stays_close_and_composes():
    res = _results(4)
    for off, on in (("off", "int8"), ("hsdp_off", "hsdp")):
        l_off, sd_off, plan_off, _ = res[0]["train"][off]
        l_on, sd_on, plan_on, _ = res[0]["train"][on]
        assert plan_off and plan_on, on  # the plan is what the engine allocates, rooms included
        assert max(abs(a - b) for a, b in zip(l_off[1:], l_on[1:])) < 2e-3 * abs(l_off[0]), (l_off, l_on)
        assert l_off[0] == l_on[0]  # the first loss precedes any reduce
        diff = max((sd_on[k] - sd_off[k]).abs().max().item() for k in sd_off)
        assert 0 < diff < 2e-2, (on, diff)
    # HSDP: the replicas hold the same weights (the quantized all-reduce gives every replica the same bits)
    for r in (0, 1):
        assert torch.equal(res[r]["train"]["hsdp"][3], res[r + 2]["train"]["hsdp"][3])
    for name in COMPOSED:
        (l_off, sd_off, plan_off, _), (l_on, sd_on, plan_on, _) = res[0]["train"][name]
        assert plan_off and plan_on, name
        assert max(abs(a - b) for a, b in zip(l_off, l_on)) < 5e-3 * abs(l_off[0]), (name, l_off, l_on)
        diff = max((sd_on[k].float() - sd_off[k].float()).abs().max().item() for k in sd_off)
        assert diff < 2e-2, (name, diff)


def test_the_stream_schedule_runs_the_quantized_reduce_race_free_on_the_comm_stream():
    for rank, res in enumerate(_results(4)):
        cases = res["streams"]
        for races, comm_ops, stray in cases:
            assert not races, f"rank {rank}:\n" + "\n".join(races[:5])
            assert not stray, stray[:5]
            # the node stage, the records' all-to-all (and HSDP's all-gather) and the fp32 sum, on comm
            assert {"c10d.send", "c10d.recv_", "aten.add_"} <= comm_ops, comm_ops


# ------------------------------------------------------------------- one node group: the option off
def _world2(rank, world):
    off = _train(rank, steps=2, accum=2)
    on = _train(rank, steps=2, accum=2, grad_quant="int8", grad_quant_node=2)
    return off, on


def test_one_node_group_is_the_option_off_bit_for_bit():
    for (l_off, sd_off, _, _), (l_on, sd_on, plan_on, _) in _results(2):
        assert l_off == l_on and plan_on
        assert all(torch.equal(sd_off[k], sd_on[k]) for k in sd_off)
