"""The engine's options are checked once (yafsdp/core/config.py): ``YaFSDP(...)``, the memory plan and
the jobs refuse the same values with the same words, and ``YaFSDP(config=...)`` is the same engine
as the keyword arguments it stands for."""
import pathlib

import pytest
import torch

import yafsdp
from dist_utils import run_ranks
from models import batch, loss_of, tiny_llama
from yafsdp.core.config import EngineConfig, MixedPrecision, Offload, build_config

ROOT = pathlib.Path(yafsdp.__file__).parent

BAD = {  # options -> words every entry's message must hold
    "zero": (dict(zero_stage=1), ["zero_stage=1 is not supported; use 2 or 3"]),
    "dtype": (dict(param_dtype=torch.int8), ["param_dtype=torch.int8 is not a floating-point torch.dtype"]),
    "offload": (dict(offload="gpu"), ["offload='gpu' is not supported", "'optimizer'", "'all'"]),
    "nf4": (dict(quantize_frozen="int4"), ["quantize_frozen='int4' is not supported", "nf4"]),
    "fp8": (dict(gather_dtype="int4"), ["gather_dtype='int4' is not supported", "'fp8'"]),
    "align": (dict(align_bytes=0), ["align_bytes=0 is not a positive int"]),
    "ratio": (dict(outsized_ratio=-1.0), ["outsized_ratio=-1.0 is not a positive number"]),
    "exclude": (dict(gather_exclude="lm_head"), ["gather_exclude='lm_head' is not a list of module names"]),
    "chunk": (dict(chunk_outsized_grads="yes"), ["chunk_outsized_grads='yes' is not a bool"]),
    "lookup": (dict(sharded_lookup=1), ["sharded_lookup=1 is not a bool"]),
    "gradchunks": (dict(grad_chunks=0), ["grad_chunks=0 is not a positive int"]),
    "gradchunks_offload": (dict(grad_chunks=2, offload="optimizer"), ["grad_chunks=2 with offload='optimizer'"]),
}


def _message(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return str(e)
    return None


@pytest.mark.parametrize("case", sorted(BAD))
def test_plan_and_builder_refuse_alike(case):
    """The plan (no process group needed) and the builder refuse with the same words; the plan's
    message opens with its own name."""
    opts, words = BAD[case]
    built = _message(lambda: build_config(**opts))
    planned = _message(lambda: yafsdp.plan.memory_plan(tiny_llama(), world_size=2, **opts))
    assert built is not None and planned is not None, (built, planned)
    assert built.startswith("yafsdp.YaFSDP: ") and planned.startswith("yafsdp.plan.memory_plan: "), (built, planned)
    assert built.split(": ", 1)[1] == planned.split(": ", 1)[1]
    for w in words:
        assert w in built, (w, built)


def test_config_object():
    cfg = build_config(param_dtype=torch.bfloat16, offload="optimizer", gather_exclude=["lm_head"])
    assert cfg == EngineConfig(MixedPrecision(torch.bfloat16, torch.float32, None), Offload("optimizer"),
                               gather_exclude=("lm_head",))
    assert cfg.compute_dtype == torch.bfloat16 and cfg.offload_what == "optimizer"
    assert build_config(cfg) == cfg and build_config(**cfg.options()) == cfg
    with pytest.raises(dataclasses_frozen()):
        cfg.zero_stage = 2
    msg = _message(lambda: build_config(cfg, zero_stage=2))
    assert "pass either config= or the options ['zero_stage'], not both" in msg, msg
    assert "is not a yafsdp.EngineConfig" in _message(lambda: build_config({"zero_stage": 2}))
    # the plan takes a config too, and reports the same bytes as for the keywords
    a = yafsdp.plan.memory_plan(tiny_llama(), world_size=2, config=cfg).engine_bytes()
    b = yafsdp.plan.memory_plan(tiny_llama(), world_size=2, **cfg.options()).engine_bytes()
    assert a == b and a["grad_landing"] > 0


def dataclasses_frozen():
    import dataclasses

    return dataclasses.FrozenInstanceError


def _same_engine(rank, world):
    out = {}
    cfg = build_config(param_dtype=torch.bfloat16, zero_stage=2, offload="optimizer")
    for how in ("keywords", "config"):
        kw = cfg.options() if how == "keywords" else dict(config=cfg)
        model = yafsdp.YaFSDP(tiny_llama(), **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(2):
            loss = loss_of(model, "llama", batch("llama", step, 0, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[how] = (losses, model.allocated_bytes(), model.engine_config, model.zero_stage, model.offload)
    out["clash"] = _message(lambda: yafsdp.YaFSDP(tiny_llama(), config=cfg, offload="all"))
    return out


def test_config_is_the_keywords():
    out = run_ranks(_same_engine, 2)[0]
    assert out["keywords"] == out["config"], out
    assert out["config"][3:] == (2, "optimizer")
    assert "pass either config= or the options ['offload'], not both" in out["clash"], out["clash"]


