"""The engine's options are defined and checked once (yafsdp/layout/config.py): ``YaFSDP(...)``, the memory
plan and the jobs refuse the same values with the same words, ``YaFSDP(config=...)`` is the same engine
as the keyword arguments it stands for, and the signature, the plan's CLI, the job's flags and the docs
are written from (or checked against) the one definition."""
import inspect
import pathlib

import pytest
import torch

import yafsdp
from dist_utils import run_ranks
from models import batch, loss_of, tiny_llama
from yafsdp.layout.config import OPTIONS, EngineConfig, MixedPrecision, Offload, build_config

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
    "prefetch": (dict(prefetch=3), ["prefetch=3 is not supported; use 1"]),
    "prefetch_secondary": (dict(prefetch=2, secondary_shard=2), ["prefetch=2 with secondary_shard=2 is not supported"]),
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
    assert cfg == EngineConfig(param_dtype=torch.bfloat16, offload="optimizer", gather_exclude=("lm_head",))
    assert cfg.mixed_precision == MixedPrecision(torch.bfloat16, torch.float32, None)
    assert cfg.compute_dtype == torch.bfloat16 and cfg.offload == "optimizer"
    assert build_config(offload=Offload("all")).offload == "all"
    assert list(cfg.options()) == list(OPTIONS)
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




ENGINE_ARGS = {"self", "module", "units", "process_group", "mesh", "device", "config"}  # not engine options


def test_signature_is_the_config():
    """``YaFSDP.__init__`` names every option of ``EngineConfig`` with its default, and no other."""
    params = inspect.signature(yafsdp.YaFSDP.__init__).parameters
    assert set(params) - ENGINE_ARGS == set(OPTIONS)
    assert {n: params[n].default for n in OPTIONS} == {n: o.default for n, o in OPTIONS.items()}
    assert all(f"``{n}`` (default {o.default!r}" in yafsdp.YaFSDP.__doc__ for n, o in OPTIONS.items())


def test_plan_flags_are_the_options():
    """``python -m yafsdp plan`` has a flag for every option (``quantize_frozen``: --frozen-base), whose
    values are the option's (the formats from the registry), and its flags reach the config."""
    from yafsdp import formats
    from yafsdp.plan import cli

    ap = cli.parser()
    flags = {a.dest: a for a in ap._actions}
    assert set(OPTIONS) - set(flags) == {"quantize_frozen"}
    assert flags["gather_dtype"].metavar == "{" + ",".join(["param"] + [f.name for f in formats.gather_formats()]) + "}"
    a = ap.parse_args(["--gather-dtype", "int8", "--grad-chunks", "2", "--no-sharded-lookup", "--gather-exclude",
                       "lm_head,model.embed_tokens", "--reduce-dtype", "bf16", "--reduce-accum-dtype", "fp32"])
    assert build_config(**cli._engine_options(a)) == build_config(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, reduce_accum_dtype=torch.float32, gather_dtype="int8",
        grad_chunks=2, sharded_lookup=False, gather_exclude=["lm_head", "model.embed_tokens"])
    assert cli._engine_options(ap.parse_args([]))["gather_dtype"] is None


def test_job_flags_take_the_options_values():
    """The job's --gather-dtype offers every gather format of the registry (int8 too), --zero-stage the
    option's stages."""
    from yafsdp import formats
    from pretrain.args import build_parser

    flags = {a.dest: a for a in build_parser()._actions}
    assert list(flags["gather_dtype"].choices) == ["bf16"] + [f.name for f in formats.gather_formats()]
    assert "int8" in flags["gather_dtype"].choices
    assert tuple(flags["zero_stage"].choices) == OPTIONS["zero_stage"].choices()
    flags_doc = (pathlib.Path(yafsdp.__file__).parents[1] / "docs" / "pretrain.md").read_text()
    assert f"`--gather-dtype {{{','.join(flags['gather_dtype'].choices)}}}`" in flags_doc  # its table says so too


def test_docs_are_written_from_the_options():
    """docs/api.md's option table and the signature lines of docs/api.md and the README are what
    ``python -m yafsdp.tools.docs_options`` writes (run it after changing an option)."""
    from yafsdp.tools import docs_options as D

    for path in (D.ROOT / "docs" / "api.md", D.ROOT / "README.md"):
        assert D.render(path) == path.read_text(), f"{path} is stale: run python -m yafsdp.tools.docs_options"
    table = D.option_table()
    assert all(f"| `{n}` |" in table for n in OPTIONS)
    assert '`"int8"`' in table and "`reduce_accum_dtype`" in table  # the drifts this replaced
    readme = (D.ROOT / "README.md").read_text()  # its one-line mentions name every option
    assert not [n for n in OPTIONS if f"`{n}`" not in readme]
