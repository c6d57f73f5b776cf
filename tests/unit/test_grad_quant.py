"""grad_quant in one process: the options' checks, the plan's rooms, and the half step of one record that
the error bound of a quantized reduce is made of ([Note: the error of a quantized reduce] in
yafsdp/comm/quant_reduce.py). The collectives themselves run in tests/multirank/test_grad_quant.py."""
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
