"""Bad input is refused at wrap time (or at load time) with an error that names the culprit."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import yafsdp
from dist_utils import run_ranks
from models import Stack, tiny_llama


def _err(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - we report the type and text
        return f"{type(e).__name__}: {e}"
    return None


def _wrap_errors(rank, world):
    out = {}
    m = tiny_llama()
    out["nested"] = _err(lambda: yafsdp.YaFSDP(m, units=[m.model.layers[0], m.model.layers[0].mlp]))
    out["twice"] = _err(lambda: yafsdp.YaFSDP(m, units=[m.model.layers[1], m.model.layers[1]]))
    out["no_params"] = _err(lambda: yafsdp.YaFSDP(m, units=[*m.model.layers, m.model.rotary_emb]))
    out["left_over"] = _err(lambda: yafsdp.YaFSDP(m, units=list(m.model.layers)))
    out["dtype"] = _err(lambda: yafsdp.YaFSDP(m, param_dtype=torch.int32))
    out["reduce_dtype"] = _err(lambda: yafsdp.YaFSDP(m, reduce_dtype="bf16"))
    out["stage"] = _err(lambda: yafsdp.YaFSDP(m, zero_stage=1))
    s = Stack()
    s.blocks[1].fc1.weight = s.blocks[0].fc1.weight  # a weight shared between two blocks
    out["shared"] = _err(lambda: yafsdp.YaFSDP(s))
    ddp = nn.parallel.DistributedDataParallel(Stack())
    out["ddp"] = _err(lambda: yafsdp.YaFSDP(nn.Sequential(ddp)))
    from torch.distributed.fsdp import fully_shard

    f2 = Stack()
    fully_shard(f2)
    out["fsdp2"] = _err(lambda: yafsdp.YaFSDP(f2))
    from torch.distributed.fsdp import FullyShardedDataParallel

    f1 = FullyShardedDataParallel(Stack(), device_id=torch.device("cpu"), use_orig_params=True)
    out["fsdp1"] = _err(lambda: yafsdp.YaFSDP(f1))
    wrapped = yafsdp.YaFSDP(Stack())
    out["twice_wrapped"] = _err(lambda: yafsdp.YaFSDP(wrapped))
    out["inner_wrapped"] = _err(lambda: yafsdp.YaFSDP(wrapped.module))
    g = dist.new_group([0])  # every rank must call new_group; rank 1 is not in it
    out["group"] = _err(lambda: yafsdp.YaFSDP(Stack(), process_group=g)) if rank == 1 else "skip"
    # A wrap that succeeds on the same inputs, so the checks above are not blanket refusals.
    ok = tiny_llama(tie=True)
    out["ok"] = _err(lambda: yafsdp.YaFSDP(ok, units=[ok.model.embed_tokens, *ok.model.layers, ok.model.norm, ok.lm_head]))
    return out


@pytest.fixture(scope="module")
def errors():
    return run_ranks(_wrap_errors, 2)[1]


@pytest.mark.parametrize(
    "case,needles",
    [
        ("nested", ["WrapError", "'model.layers.0.mlp'", "nested inside", "'model.layers.0'"]),
        ("twice", ["WrapError", "'model.layers.1'", "listed twice"]),
        ("no_params", ["WrapError", "'model.rotary_emb'", "no parameters"]),
        ("left_over", ["WrapError", "'model.embed_tokens.weight'", "in no unit"]),
        ("dtype", ["ValueError", "param_dtype=torch.int32"]),
        ("reduce_dtype", ["ValueError", "reduce_dtype='bf16'"]),
        ("stage", ["ValueError", "zero_stage=1"]),
        ("shared", ["WrapError", "'blocks.0.fc1.weight'", "'blocks.0'", "'blocks.1'", "unsupported"]),
        ("ddp", ["WrapError", "'0'", "DistributedDataParallel"]),
        ("fsdp2", ["WrapError", "FSDP2"]),
        ("fsdp1", ["WrapError", "'<root>'", "already wrapped by FSDP"]),
        ("twice_wrapped", ["WrapError", "already wrapped by yafsdp"]),
        ("inner_wrapped", ["WrapError", "already wrapped by yafsdp"]),
        ("group", ["ValueError", "global rank 1", "not in process_group"]),
    ],
)
def test_wrap_error(errors, case, needles):
    msg = errors[case]
    assert msg is not None, f"{case}: no error raised"
    for n in needles:
        assert n in msg, f"{case}: {n!r} not in {msg!r}"


def test_valid_wrap_passes(errors):
    assert errors["ok"] is None


def test_needs_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        yafsdp.YaFSDP(Stack())
