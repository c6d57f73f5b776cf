"""``python -m yafsdp plan`` (also ``python -m yafsdp.plan``): the memory plan of a preset model."""
from __future__ import annotations

import argparse
import json

from .build import memory_plan
from .report import MemoryPlan
from ..layout.sizing import OPTIMIZER_BYTES

def parser(prog: str = "python -m yafsdp plan") -> argparse.ArgumentParser:
    from ..tools.presets import PRESETS

    ap = argparse.ArgumentParser(
        prog=prog,
        description="Print yafsdp's per-rank memory plan for a preset model, built on the meta device "
        "(nothing is allocated). The presets are yafsdp.presets' table, the same as the pretraining "
        "job's --preset and the benchmarks'.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS), help="model shape (yafsdp.presets)")
    ap.add_argument("--world-size", type=int, default=8, help="ranks the model is sharded over")
    ap.add_argument("--hsdp", type=int, default=1, metavar="R",
                    help="HSDP: R replicas, each sharded over world-size / R ranks (the plan is that of one replica)")
    ap.add_argument("--tp", type=int, default=1, metavar="T",
                    help="tensor parallel: the model as llama_tp_plan splits it over T ranks (each parameter at its "
                    "local shape), then sharded over the world-size / (R x T) data-parallel ranks")
    ap.add_argument("--tp-rank", type=int, default=0,
                    help="with --tp: the TP coordinate whose slices are planned (an uneven vocabulary's differ)")
    ap.add_argument("--loss-parallel", action="store_true",
                    help="with --tp and --batch: the logits split over the vocabulary (torch's loss_parallel), as the "
                    "pretraining job's --loss-parallel")
    ap.add_argument("--rank", type=int, default=0, help="the rank whose shard is planned (padding differs by rank)")
    ap.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_BYTES),
                    help="optimizer whose state is counted (bytes per shard element: adamw 8, sgd-momentum 4)")
    ap.add_argument("--batch", type=int, default=None, help="micro-batch per rank (adds the activation estimate)")
    ap.add_argument("--seq", type=int, default=None,
                    help="sequence length (with --batch; default: the preset's max_position_embeddings)")
    ap.add_argument("--checkpointing", action="store_true", help="per-layer activation checkpointing")
    ap.add_argument("--budget", default=None, metavar="BYTES",
                    help="memory per device (e.g. 60GiB): checkpoint the fewest blocks whose predicted peak fits "
                    "it, and print which (with --batch; yafsdp.plan.choose_checkpointing)")
    ap.add_argument("--attention", default="fused", choices=["fused", "math"],
                    help="fused: what flash/memory-efficient SDPA saves; math: the (seq x seq) probabilities")
    ap.add_argument("--frozen-base", default="none", choices=["none", "bf16", "nf4"],
                    help="plan a fine-tuning base: every parameter frozen (no master, grad or optimizer state), "
                    "stored in param_dtype (bf16) or with its nn.Linear weights in 4-bit NF4 (nf4: "
                    "quantize_frozen='nf4', QLoRA); adapters are not counted (they are small)")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="add PEFT LoRA adapters of this rank on the --lora-targets (default: every linear layer "
                    "but lm_head); they are the trainable parameters, the base is frozen (--frozen-base, default "
                    "bf16 then)")
    ap.add_argument("--lora-targets", default="all-linear", metavar="NAME,...",
                    help="with --lora-rank: the linear modules that get adapters, by name (PEFT's target_modules; the "
                    "fine-tuning job's --lora-targets, whose default is q_proj,k_proj,v_proj,o_proj)")
    ap.add_argument("--async-save", action="store_true",
                    help="add the host memory of an asynchronous save's staging copy (the jobs' --async-save, "
                    "yafsdp.checkpoint.AsyncSaver): this rank's part of a checkpoint, kept between saves")
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"],
                    help="the process group's backend: NCCL reduces in place, gloo through a staging shard per "
                    "grad buffer")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    _engine_flags(ap.add_argument_group("engine options (YaFSDP's, yafsdp.EngineConfig; docs/api.md)"))
    return ap


# The engine options' flags are written from their definitions (yafsdp/layout/config.py). Where the
# plan's flag differs from the option: how it writes None, and its default.
_NONE = {"gather_dtype": "param"}
_DEFAULTS = {"param_dtype": "bf16"}  # a GPU plan: bf16 compute
_SPELLED_OTHERWISE = {"quantize_frozen"}  # --frozen-base, which also freezes the model


def _engine_flags(group) -> None:
    from ..layout.config import OPTIONS

    for name, opt in OPTIONS.items():
        if name in _SPELLED_OTHERWISE:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(opt.default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=opt.default, help=opt.doc)
            continue
        none = _NONE.get(name, "none")

        def parse(text, opt=opt, none=none):
            try:
                return opt.parse(text, none)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None

        texts = opt.texts(none)
        metavar = "{" + ",".join(texts) + "}" if texts else "NAME,..." if opt.type.startswith("tuple") else None
        group.add_argument(flag, type=parse, default=_DEFAULTS.get(name, opt.text(opt.default, none)),
                           metavar=metavar, help=opt.doc)


def _engine_options(a) -> dict:
    """The engine options the flags give (``quantize_frozen`` from --frozen-base)."""
    from ..layout.config import OPTIONS

    out = {name: getattr(a, name) for name in OPTIONS if name not in _SPELLED_OTHERWISE}
    out["quantize_frozen"] = "nf4" if a.frozen_base == "nf4" else None
    return out


def _parse(argv=None, prog="python -m yafsdp plan"):
    return parser(prog).parse_args(argv)


def main(argv=None, prog="python -m yafsdp plan") -> MemoryPlan:
    from ..tools.presets import build_llama

    a = _parse(argv, prog)
    _check(a, parser(prog))
    # HSDP: every memory figure is one replica's (shards over `shard` ranks); TP: of one TP coordinate's ranks
    shard = a.world_size // (a.hsdp * a.tp)
    model = build_llama(a.preset, device="meta")
    if a.tp > 1:  # a TP degree the preset's heads or MLP width cannot be split by: the usage error, by dimension
        from ..integrations.tp_plans import llama_tp_local_shapes

        try:
            llama_tp_local_shapes(model, a.tp, a.tp_rank)
        except ValueError as e:
            parser(prog).error(f"--tp {a.tp}: " + str(e).removeprefix("yafsdp.integrations.tp_plans: "))
    if a.batch is not None and a.seq is None:
        a.seq = model.config.max_position_embeddings
    if a.frozen_base != "none" or a.lora_rank:
        model.requires_grad_(False)
    if a.lora_rank:
        import peft

        # low_cpu_mem_usage: the adapters are made on the meta device, as the base is; without it PEFT draws
        # their initial values on the CPU and then moves them to the base's device (meta): 3.3 GB and ~8 s
        # for Llama-2-70B at r=64, all thrown away
        model = peft.get_peft_model(model, peft.LoraConfig(r=a.lora_rank, lora_alpha=2 * a.lora_rank,
                                                           target_modules=_lora_targets(a, model, prog),
                                                           lora_dropout=0.0), low_cpu_mem_usage=True)
    plan = (_choose if a.budget is not None else memory_plan)(
        model, world_size=shard, rank=a.rank, optimizer=a.optimizer,
        batch=a.batch, seq=a.seq, checkpointing=a.checkpointing, attention=a.attention, async_save=a.async_save,
        backend=a.backend, **_engine_options(a), **({"budget": a.budget} if a.budget else {}),
        **({"tp": a.tp, "tp_rank": a.tp_rank, "replicas": a.hsdp, "loss_parallel": a.loss_parallel}
           if a.tp > 1 else {}),
    )
    choice = getattr(plan, "choice", None)
    if a.json:
        extra = {"checkpointing_choice": choice.to_dict()} if choice is not None else {}
        print(json.dumps(dict(preset=a.preset, **plan.to_dict(), **extra), indent=1, default=str))
    else:
        print(f"preset {a.preset}" + (f" | HSDP: {a.hsdp} replicas x {shard} shard ranks" if a.hsdp > 1 else "")
              + (f" | TP {a.tp} (rank {a.tp_rank}) x {shard * a.hsdp} data-parallel ranks" if a.tp > 1 else "")
              + (f" = {a.world_size} ranks" if a.hsdp > 1 or a.tp > 1 else ""))
        print(plan.format())
        if choice is not None:
            print(choice.format())
    return plan


def _lora_targets(a, model, prog: str):
    """--lora-targets as PEFT's ``target_modules``; a name that is no linear module of the preset is the
    parser's error, naming the preset's linear modules (PEFT's own error would be a traceback)."""
    if a.lora_targets == "all-linear":
        return "all-linear"
    from torch import nn

    names = [t.strip() for t in a.lora_targets.split(",") if t.strip()]
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
    bad = [t for t in names if t not in linear]
    if bad or not names:
        parser(prog).error(f"--lora-targets {a.lora_targets}: {bad[0] if bad else 'no name'!r} matches no linear "
                           f"module of {a.preset}; its linear modules are {', '.join(linear)} (or all-linear: every "
                           "one but lm_head)")
    return names


def _check(a, ap: argparse.ArgumentParser) -> None:
    """Refuse what the plan cannot be computed for with the parser's usage and exit status 2, before
    any model is built: the engine options go through ``build_config`` (the check ``YaFSDP`` makes,
    whose message names the value and what to pass instead), the sizes and the budget here."""
    from ..layout.config import build_config
    from ..layout.sizing import check_secondary
    from .choose import parse_bytes

    if a.world_size < 1:
        ap.error(f"--world-size {a.world_size}: give the number of ranks, at least 1")
    if a.hsdp < 1 or a.world_size % a.hsdp:
        ap.error(f"--hsdp {a.hsdp} does not divide --world-size {a.world_size}; HSDP shards over "
                 "world-size / R ranks, so pick R among the divisors of the world size")
    if a.tp < 1 or a.world_size % (a.hsdp * a.tp):
        hsdp = f" / --hsdp {a.hsdp}" if a.hsdp > 1 else ""
        ap.error(f"--tp {a.tp} does not divide --world-size {a.world_size}{hsdp}; the data-parallel ranks are "
                 "world-size / (R x T): pick T among the divisors")
    if not 0 <= a.tp_rank < a.tp:
        ap.error(f"--tp-rank {a.tp_rank} is not a coordinate of --tp {a.tp} (0 to {a.tp - 1})")
    if a.tp > 1 and a.lora_rank:
        ap.error(f"--tp {a.tp} with --lora-rank: adapters are refused with tensor parallelism; leave one out")
    if a.loss_parallel and a.tp == 1:
        ap.error("--loss-parallel splits the logits over the TP ranks; it needs --tp T with T > 1")
    if a.tp > 1 and a.seq is not None and a.seq % a.tp:
        ap.error(f"--seq {a.seq} with --tp {a.tp}: sequence parallelism splits the sequence over the TP ranks; give a "
                 f"multiple of {a.tp}")
    shard = a.world_size // (a.hsdp * a.tp)
    if not 0 <= a.rank < shard:
        ap.error(f"--rank {a.rank} is not a rank of the {shard} ranks the model is sharded over")
    for flag, value in (("--batch", a.batch), ("--seq", a.seq)):
        if value is not None and value < 1:
            ap.error(f"{flag} {value}: give a positive number")
    if a.lora_rank < 0:
        ap.error(f"--lora-rank {a.lora_rank}: give a positive rank (0: no adapters)")
    if a.lora_targets != "all-linear" and not a.lora_rank:
        ap.error(f"--lora-targets {a.lora_targets} without --lora-rank: give the adapters' rank too")
    if a.budget is not None:
        if a.batch is None or a.checkpointing:
            ap.error("--budget chooses the checkpointed blocks for a step: give --batch (and --seq), "
                     "and leave out --checkpointing")
        try:
            parse_bytes(a.budget)
        except ValueError as e:
            ap.error(f"--budget: {e}")
    try:
        cfg = build_config(who="options", **_engine_options(a))
    except (TypeError, ValueError) as e:  # a refused combination of options: the parser's error, not a traceback
        ap.error(str(e).removeprefix("options: "))
    try:  # the secondary shard's groups against the shard group (one replica's ranks with --hsdp)
        check_secondary(cfg.secondary_shard, shard)
    except ValueError as e:
        ap.error(str(e).removeprefix("yafsdp: "))
    if a.tp > 1:  # the options a TP engine refuses
        from ..layout.dtensor import refuse_options

        try:
            refuse_options(cfg)
        except ValueError as e:
            ap.error(f"--tp {a.tp}: " + str(e).removeprefix("yafsdp.YaFSDP: "))


def _choose(model, *, budget, checkpointing, **options) -> MemoryPlan:
    """The plan with the blocks ``choose_checkpointing`` picks for ``budget``; the choice is its ``choice``."""
    from .choose import choose_checkpointing

    choice = choose_checkpointing(model, budget=budget, **options)
    choice.plan.choice = choice
    return choice.plan
