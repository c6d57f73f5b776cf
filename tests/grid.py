"""The combination grid: every pair of engine options trained at least once, against the unsharded
reference (tests/multirank/test_grid.py runs it; docs/design.md "The combination grid" says why).

A **dimension** is one entry of ``DIMS``: its name and, per value, an *effect* -- a function that
edits a ``Recipe`` (what a row does, read by both the sharded run and the unsharded reference).
Effects are built from four helpers and combined with ``both``:

- ``engine(**kw)``     keyword arguments of ``YaFSDP(...)`` (the reference ignores them);
- ``sets(**kw)``       fields of the ``Recipe`` the runs read: ``accum``, ``clip``, ``optimizer``,
                       ``resume``, ``world``, ``mesh``, ``compute_dtype``, ``tie``, ``set_to_none``, ``tol``,
                       ``vocab``;
- ``edit(fn)``         ``fn(model, seed) -> model`` applied to the freshly built model, on both sides,
                       in the order of ``DIMS`` (a PEFT wrap before the checkpointing switch);
- ``after(fn)``        ``fn(model)`` on the wrapped model right after wrapping (the engine writes it
                       through into the shards), on the reference's model before training;
- ``store(fn)`` / ``step(fn)``  the reference's rounding: ``fn(model, compute_dtype)`` once after
                       building it (the values the engine *stores*: NF4, frozen values in
                       ``param_dtype``), ``fn(master, low, compute_dtype)`` before each forward on the
                       compute copy ``low`` (the values the engine *gathers*: fp8).

Something the run does that no field says yet gets a new ``Recipe`` field, set by ``sets(...)``, and
the few lines that read it in the code both runs share (``forward_backward``: the no-grad forward
between, the several backwards, ``torch.autograd.grad``; ``optimizer_step``: GradScaler, the two
clipping calls) or in ``train_sharded`` / ``train_reference`` (the parameter hook). Pairs a feature
cannot meet go into ``allowed`` (the generator never builds them); pairs the engine refuses by design
go into ``REFUSED`` (rows that check the error message); known engine bugs into ``KNOWN`` in
tests/multirank/test_grid.py (the parity rows avoid them; each has its own strict-xfail row); a combination of
three or more values that must stay covered (a bug's reproduction) into ``SEEDS``.

Example, the fp16 value of ``"param_dtype"``: ``both(engine(param_dtype=torch.float16),
sets(compute_dtype=torch.float16, scaler=True))``; ``scaler`` makes ``forward_backward`` call
``scaler.scale(loss).backward()`` and ``optimizer_step`` call ``unscale_`` before clipping, then
``step(opt)`` / ``update()``, on both sides alike; the test compares the scale history exactly.

The rows are an all-pairs covering array (``all_pairs``: greedy, deterministic). Rows of one world
size run in one spawned process group (``run_world``), several rows per spawn.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import yafsdp
from models import VOCAB, batch, loss_of, tiny_llama

STEPS = 3
RESUME_AT = 2  # resume rows: save after this many optimizer steps, reload with other settings, go on
LR = 1e-2
# [Note: the grid's AdamW eps]
# AdamW's early steps turn a gradient element g into about lr * g / (|g| + eps). Where micro-batches or
# ranks cancel to |g| ~ 1e-8, the one-ulp difference between the engine's order of fp32 sums (gloo's
# all-reduce across 3 HSDP replicas) and the reference's becomes a difference of ~lr in that weight,
# far above the tolerances. eps = 1e-6 keeps that amplification out, while every gradient element
# that matters (|g| >> 1e-6 here) is compared as tightly as before.
EPS = 1e-6
MAX_NORM = 0.05  # small enough that clipping changes every step's update
HOOK_SCALE = 0.5  # the "param" hook (_hook): even rows of its parameter's gradient times this, odd rows zeroed
HOOKED = "layers.1.self_attn.o_proj"  # its parameter: the first trainable one under this module
SCALE = 2.0 ** 19  # fp16 rows' initial loss scale: tiny Llama's largest gradients (~0.3) overflow there
SPLIT = 0.25  # backward="two": the first loss's share
LARGE_VOCAB = 1000  # vocab="large": the embedding and the head are outsized units (4x a decoder layer)


# ----------------------------------------------------------------------------- the generator
def _pair(a, b):
    return (a, b) if a[0] < b[0] else (b, a)


def pairs_of(row: dict) -> set:
    """Every (dimension, value) pair a row holds."""
    items = sorted(row.items())
    return {(items[i], items[j]) for i in range(len(items)) for j in range(i + 1, len(items))}


def all_value_pairs(dims: dict[str, tuple], allowed: Callable[[dict], bool]) -> set:
    """Every pair of values of two dimensions that ``allowed`` (a predicate over a partial row) admits."""
    names = sorted(dims)
    return {((a, va), (b, vb)) for i, a in enumerate(names) for b in names[i + 1:]
            for va in dims[a] for vb in dims[b] if allowed({a: va, b: vb})}


def all_pairs(dims: dict[str, tuple], allowed: Callable[[dict], bool] = lambda r: True,
              seeds: list[dict] = ()) -> list[dict]:
    """A small set of full rows covering every allowed pair of values (greedy, AETG-style).

    Deterministic: a new row starts from the first uncovered pair (in ``repr`` order) and fills the
    other dimensions, most values first, each with the value that covers the most uncovered pairs
    with the row so far -- on a tie the value used least so far, then the first -- among those
    ``allowed`` admits; a start that reaches a dimension with no admissible value is skipped for the
    next. ``allowed`` must be decidable on partial rows (a constraint on the dimensions present).
    ``seeds``: partial rows that must appear (a triple that matters), completed the same way first."""
    order = sorted(dims, key=lambda n: -len(dims[n]))  # stable: table order among equals
    uncovered = all_value_pairs(dims, allowed)
    used: dict = {}
    rows = []
    seeds = [tuple(sorted(seed.items())) for seed in seeds]
    while uncovered or seeds:
        for start in seeds[:1] or sorted(uncovered, key=repr):
            row = dict(start)
            for name in order:
                if name in row:
                    continue
                choice = None
                for v in dims[name]:
                    if not allowed({**row, name: v}):
                        continue
                    key = (sum(_pair((n, row[n]), (name, v)) in uncovered for n in row), -used.get((name, v), 0))
                    if choice is None or key > choice[0]:
                        choice = (key, v)
                if choice is None:
                    break  # a dead end from this start: try the next one
                row[name] = choice[1]
            else:
                break
        else:
            raise ValueError(f"all_pairs: no allowed row covers any of {sorted(uncovered, key=repr)[:3]} ...")
        seeds = seeds[1:]
        rows.append({n: row[n] for n in dims})
        uncovered -= pairs_of(row)
        for item in row.items():
            used[item] = used.get(item, 0) + 1
    return rows


# ----------------------------------------------------------------------------- what a row does
@dataclasses.dataclass
class Recipe:
    world: int = 2
    mesh: str = "flat"  # "hsdp": a (world, 1) mesh -- replicas of a one-rank shard group
    engine: dict = dataclasses.field(default_factory=dict)
    edits: list = dataclasses.field(default_factory=list)  # fn(model, seed) -> model
    store: list = dataclasses.field(default_factory=list)  # reference: fn(model, compute_dtype)
    step: list = dataclasses.field(default_factory=list)  # reference: fn(master, low, compute_dtype)
    compute_dtype: torch.dtype = torch.float32
    accum: int = 1
    clip: str = "off"  # "engine": model.clip_grad_norm_; "torch": torch.nn.utils.clip_grad_norm_(model.parameters())
    optimizer: str = "adamw"
    resume: str = "none"  # see RESUME
    tie: bool = False  # tied input and output embeddings
    set_to_none: bool = True  # optimizer.zero_grad(set_to_none=...)
    tol: float = 1.0  # multiplier of the fp32 tolerances (fp8: a master difference can flip a code)
    after: list = dataclasses.field(default_factory=list)  # fn(model): on the wrapped model / the reference's
    scaler: bool = False  # torch.amp.GradScaler("cpu") around backward and step, unchanged
    between: bool = False  # a no-grad forward of another batch between each forward and its backward
    backward: str = "one"  # "two": two losses, two backward calls; "grad": autograd.grad first, see BACKWARD
    grad_hook: bool = False  # a register_hook on one original trainable parameter: see _hook
    vocab: int = VOCAB  # the embedding's and the head's rows; the batches' ids are drawn from all of them


def engine(**kw):
    return lambda r: r.engine.update(kw)


def sets(**kw):
    return lambda r: [setattr(r, k, v) for k, v in kw.items()]


def edit(fn):
    return lambda r: r.edits.append(fn)


def store(fn):
    return lambda r: r.store.append(fn)


def step(fn):
    return lambda r: r.step.append(fn)


def after(fn):
    return lambda r: r.after.append(fn)


def both(*effects):
    def apply(r):
        for e in effects:
            e(r)
    return apply


def nothing(r):
    pass


# --- the model edits and the reference's rounding
FROZEN = ("embed_tokens", "q_proj", "model.norm")  # "frozen part": an embedding, a linear per layer, a norm


def freeze_part(model, seed):
    for name, p in model.named_parameters():
        if any(f in name for f in FROZEN):
            p.requires_grad_(False)
    return model


def lora(model, seed):
    import peft

    # q_proj and o_proj: their adapters are whole 128-blocks, so fp8 gathers cover them too
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                                                       lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # B starts at zero in PEFT; make the adapters matter from the first step
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def checkpointing(model, seed):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.gradient_checkpointing_enable()  # HF: use_reentrant=False
    return model


def reentrant_checkpointing(model, seed):
    """HF's reentrant checkpointing, with HF's documented companion for frozen input embeddings
    (without it a reentrant layer whose input needs no gradient gives its weights none)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    base.enable_input_require_grads()
    return model


def reinit(model):
    """Re-initialisation through ``model.apply`` (on the wrapper: after wrapping, written through into
    the shards; the reference: before training): every trainable nn.Linear weight from one generator,
    in module order."""
    g = torch.Generator().manual_seed(7)

    def init(m):
        if isinstance(m, nn.Linear) and m.weight.requires_grad:
            with torch.no_grad():
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.05)
    model.apply(init)


def frozen_in_dtype(model, dtype):
    """The engine stores frozen values in param_dtype."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                p.copy_(p.to(dtype))


def nf4_round_trip(model, dtype):
    """Frozen nn.Linear weights of whole 64-blocks: NF4 quantize-dequantize of their param_dtype values
    (not a head tied to an embedding: a weight some other module also holds stays in param_dtype)."""
    from yafsdp.formats import nf4_codec as nf4

    elsewhere = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    with torch.no_grad():
        for mod in model.modules():
            w = getattr(mod, "weight", None)
            if (isinstance(mod, nn.Linear) and not w.requires_grad and w.numel() % nf4.BLOCK == 0
                    and id(w) not in elsewhere):
                packed, scales = nf4.quantize(w.detach().reshape(-1).to(dtype))
                values = nf4.dequantize_record(torch.cat([packed, scales.view(torch.uint8)]), w.numel(), dtype)
                w.copy_(values.view_as(w))


def fp8_layers(model) -> list[str]:
    """Names of the decoder layers a compact gather covers: all their trainable >= 2-D parameters are
    nn.Linear weights of whole 128-blocks (the output head is left out by default)."""
    from yafsdp.formats import fp8_codec as fp8

    weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    out = []
    for name, mod in model.named_modules():
        if type(mod).__name__ != "LlamaDecoderLayer":
            continue
        ps = [p for p in mod.parameters() if p.requires_grad and p.dim() >= 2]
        if ps and all(id(p) in weights and p.numel() % fp8.BLOCK == 0 for p in ps):
            out.append(name)
    return out


def fp8_gather(master, low, dtype, fake=None):
    from yafsdp.formats import fp8_codec as fp8

    fake = fake or fp8.fake_quantize
    layers = set(fp8_layers(master))
    with torch.no_grad():
        for (name, mod), low_mod in zip(master.named_modules(), low.modules()):
            if name in layers:
                for p, q in zip(mod.parameters(), low_mod.parameters()):
                    if p.requires_grad and p.dim() >= 2:
                        q.copy_(fake(p, dtype))


def int8_gather(master, low, dtype):
    """The int8 gathers' values (yafsdp/formats/int8.py): the same layers and 128-blocks as fp8."""
    from yafsdp.formats import int8

    fp8_gather(master, low, dtype, fake=int8.fake_quantize)


# ----------------------------------------------------------------------------- the dimensions
DIMS: dict[str, dict[Any, Callable]] = {
    "zero": {3: engine(zero_stage=3), 2: engine(zero_stage=2)},
    "trainable": {"full": nothing, "frozen": edit(freeze_part), "lora": edit(lora),
                  "qlora": both(edit(lora), engine(quantize_frozen="nf4"), store(nf4_round_trip))},
    "offload": {"none": nothing, "optimizer": engine(offload="optimizer"), "all": engine(offload="all")},
    "mesh": {"flat": nothing, "hsdp": sets(mesh="hsdp")},
    "gather": {"none": nothing, "fp8": both(engine(gather_dtype="fp8"), step(fp8_gather), sets(tol=2.0)),
               "int8": both(engine(gather_dtype="int8"), step(int8_gather), sets(tol=2.0))},
    "param_dtype": {"fp32": nothing,
                    "bf16": both(engine(param_dtype=torch.bfloat16), sets(compute_dtype=torch.bfloat16)),
                    "fp16": both(engine(param_dtype=torch.float16), sets(compute_dtype=torch.float16, scaler=True))},
    "accum": {1: nothing, 2: sets(accum=2)},
    "clip": {"off": nothing, "on": sets(clip="engine"), "torch": sets(clip="torch")},
    "ac": {"off": nothing, "on": edit(checkpointing), "reentrant": edit(reentrant_checkpointing)},
    "world": {2: sets(world=2), 3: sets(world=3), 4: sets(world=4)},
    "resume": {"none": nothing, "zero": sets(resume="zero"), "world": sets(resume="world"),
               "weights": sets(resume="weights")},
    "optimizer": {"adamw": nothing, "fused": sets(optimizer="fused")},
    "tie": {"untied": nothing, "tied": sets(tie=True)},
    "zero_grad": {"none": nothing, "zeros": sets(set_to_none=False)},
    "between": {"none": nothing, "no_grad": sets(between=True)},
    "backward": {"one": nothing, "two": sets(backward="two"), "grad": sets(backward="grad")},
    "after_wrap": {"none": nothing, "reinit": after(reinit)},
    "hook": {"none": nothing, "param": sets(grad_hook=True)},
    "vocab": {"small": nothing, "large": sets(vocab=LARGE_VOCAB)},
    "secondary": {0: nothing, 2: engine(secondary_shard=2)},
}
# fp16 rows: torch.amp.GradScaler("cpu", init_scale=SCALE, backoff_factor=0.25, growth_interval=1) on both sides (unscale_
# before clipping, step, update); the scale after every update is compared exactly (the same steps skipped).
# BACKWARD: "two": the loss split into SPLIT * loss and (1 - SPLIT) * loss over one forward,
# ``backward(retain_graph=True)`` then ``backward()``; "grad": ``torch.autograd.grad(loss,
# first_layer_output, retain_graph=True)`` (the embeddings' output needs no gradient where they are frozen) (its norm compared with the reference's, no .grad may change)
# then ``loss.backward()``. ``between``: ``with torch.no_grad()`` a forward of another batch.
# RESUME: after RESUME_AT steps the run goes on in a fresh engine built from another seed (whatever the
# load misses shows), with one setting changed. "zero": a checkpoint (model + optimizer) loaded with
# the other zero stage; "world": a checkpoint loaded on world - 1 ranks (flat rows) or on the flat
# world (HSDP rows); "weights": full_state_dict() loaded with load_full_state_dict() into the other
# zero stage, with a new optimizer (the reference restarts its optimizer there too).
VALUES = {name: tuple(values) for name, values in DIMS.items()}


def allowed(row: dict) -> bool:
    """Combinations no row may hold (QLoRA brings its own frozen linears, HSDP at world 2 and 3 is a
    (world, 1) mesh): reentrant checkpointing with ``torch.autograd.grad`` is refused by torch itself,
    unsharded too ("incompatible with .grad()"). A predicate over the dimensions present in ``row``."""
    if row.get("secondary") == 2 and (row.get("world", 4) != 4 or row.get("mesh", "flat") != "flat"
                                      or row.get("zero", 3) != 3):
        return False  # secondary_shard=2 needs a flat shard group of 4 (the grid's HSDP mesh is (world, 1)) at ZeRO-3
    return not (row.get("ac") == "reentrant" and row.get("backward") == "grad")


# Refused by the engine, by design (yafsdp/layout/config.py): (dim, values, dim, values, words) -- a row holding
# both gets YaFSDP(...) refused with a ValueError naming both options (``words(row)``). Lifting a
# refusal: delete its entry here; the generator then covers those pairs with parity rows.
REFUSED = [
    # (offload x HSDP was refused here until the host grad shards' all-reduce was staged through the
    # device: yafsdp/engine/placement.py; its pairs are parity rows now)
    # (offload x gather_dtype="fp8" / "int8" likewise, since the records have a host staging side)
]


def refusal_of(row: dict):
    """The REFUSED entries a (partial) row triggers."""
    return [e for e in REFUSED if row.get(e[0]) in e[1] and row.get(e[2]) in e[3]]


def parity_allowed(row: dict) -> bool:
    return allowed(row) and not refusal_of(row)


def refused_pairs() -> set:
    return {_pair((a, va), (b, vb)) for a, vas, b, vbs, _ in REFUSED for va in vas for vb in vbs
            if allowed({a: va, b: vb})}


def refusal_rows() -> list[dict]:
    """One row per refused pair: the pair, every other dimension at its first value that triggers no
    other refusal (so the message has one cause)."""
    rows = []
    for (a, va), (b, vb) in sorted(refused_pairs(), key=repr):
        row = {a: va, b: vb}
        for name, values in VALUES.items():
            if name not in row:
                row[name] = next(v for v in values if allowed({**row, name: v}) and
                                 len(refusal_of({**row, name: v})) == 1)
        rows.append({n: row[n] for n in VALUES})
    return rows


LOOKUP = dict(vocab="large", world=2, mesh="flat", zero=3, offload="none", gather="none", param_dtype="fp32",
              trainable="full", tie="untied")


def looks_up(row: dict) -> bool:
    """Whether the row's first engine looks its embedding up from the shards (every condition of LOOKUP)."""
    return all(row[k] == v for k, v in LOOKUP.items())


# Combinations of more than two values every grid must hold (each completed into a row): the
# reproductions of bugs found where three features meet, so they stay covered when the table changes.
SEEDS = [
    dict(trainable="qlora", mesh="hsdp", resume="weights"),  # NF4 base loaded on every replica, not replica 0 only
    dict(trainable="qlora", mesh="hsdp", offload="all"),  # QLoRA, host base shards, on a mesh
    # the sharded lookup of an embedding (yafsdp/engine/lookup.py) takes only rows that hold all of these (an
    # outsized, trainable, untied embedding; gloo world 2, flat, ZeRO-3, fp32, gathered as is, kept on the
    # device); three rows of it, completed with different values of the other dimensions by the generator
    *[LOOKUP] * 3,
]


def parity_rows(avoid: Callable[[dict], bool] = lambda r: False) -> list[dict]:
    """The covering rows; ``avoid`` (a predicate over partial rows: the known engine bugs) keeps its
    combinations out, so that no pair is covered by an expected failure only."""
    return all_pairs(VALUES, lambda r: parity_allowed(r) and not avoid(r), SEEDS)


def completed(seed: dict) -> dict:
    """A partial row completed as the generator completes a seed."""
    return all_pairs(VALUES, parity_allowed, [seed])[0]


def recipe(row: dict) -> Recipe:
    r = Recipe()
    for name, value in row.items():
        DIMS[name][value](r)
    return r


def row_name(row: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in row.items())


def build(r: Recipe, seed: int = 0):
    model = tiny_llama(layers=2, seed=seed, tie=r.tie, vocab=r.vocab)
    for fn in r.edits:
        model = fn(model, seed)
    model.train()
    return model


# ----------------------------------------------------------------------------- both runs
def _unwrapped(model):
    return model.module if isinstance(model, yafsdp.YaFSDP) else model


def hook_param(model):
    """The "param" hook on the original parameter named by HOOKED (``model.module.<path>`` on the
    wrapper); returns its name."""
    root = _unwrapped(model)
    name = next(n for n, p in root.named_parameters() if HOOKED in n and p.requires_grad)
    mod_name, _, attr = name.rpartition(".")
    getattr(root.get_submodule(mod_name), attr).register_hook(_hook)
    return name


def _hook(g):
    """A rescale alone would hardly show: AdamW's update is invariant to it (only clipping sees it);
    zeroed rows stop moving but for weight decay."""
    mask = torch.zeros(g.shape[0], *([1] * (g.dim() - 1)), dtype=g.dtype)
    mask[0::2] = HOOK_SCALE
    return g * mask


def new_scaler(r: Recipe):
    return torch.amp.GradScaler("cpu", init_scale=SCALE, backoff_factor=0.25, growth_interval=1) if r.scaler else None


def forward_backward(r: Recipe, model, inputs, other, scaler, harvest=lambda: None):
    """One micro-batch, the same on both sides: the forward, the row's habits between it and the
    backward (see BACKWARD), the backward call(s) -- ``harvest()`` after each (the reference takes each
    backward's gradients as the engine reduces them). Returns the loss, the norm of the gradient
    w.r.t. the first decoder layer's output (backward="grad", else None) and whether .grad stayed untouched by it."""
    box = {}
    first = _unwrapped(model).get_decoder().layers[0]
    handle = first.register_forward_hook(lambda m, i, o: box.update(h=o[0] if isinstance(o, tuple) else o))
    loss = loss_of(model, "llama", inputs)
    handle.remove()
    if r.between:
        with torch.no_grad():
            loss_of(model, "llama", other)
    scaled = (lambda t: scaler.scale(t)) if scaler is not None else (lambda t: t)
    aux, untouched = None, True
    if r.backward == "grad":
        before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        g, = torch.autograd.grad(loss, box["h"], retain_graph=True)
        aux = float(g.float().norm())
        untouched = all((a is None and p.grad is None) or (a is not None and p.grad is not None and _same_bits(a, p.grad))
                        for a, p in zip(before, model.parameters()))
    if r.backward == "two":
        scaled(loss * (SPLIT / r.accum)).backward(retain_graph=True)
        harvest()
        scaled(loss * ((1 - SPLIT) / r.accum)).backward()
    else:
        scaled(loss / r.accum).backward()
    harvest()
    return loss.item(), aux, untouched


def _same_bits(a, b) -> bool:
    """Equal bit for bit (an fp16 overflow leaves inf and nan in .grad, and nan != nan)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8).reshape(-1),
                                                                     b.contiguous().view(torch.uint8).reshape(-1))


def optimizer_step(r: Recipe, opt, scaler, clip, norms: list, scales: list):
    if scaler is not None and r.clip != "off":
        scaler.unscale_(opt)
    if r.clip != "off":
        norms.append(float(clip()))
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    else:
        opt.step()


# ----------------------------------------------------------------------------- the sharded run
def _optimizer(r: Recipe, params):
    params = [p for p in params if p.requires_grad]
    if r.optimizer == "fused":
        return yafsdp.FusedAdamW(params, lr=LR, eps=EPS, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.1, foreach=False)


class Ctx:
    """What a spawn shares between rows: the HSDP mesh and the subgroup of world - 1 ranks."""

    def __init__(self, world, root):
        from torch.distributed.device_mesh import init_device_mesh

        self.root = root
        self.mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        self.smaller = dist.new_group(list(range(world - 1)))  # every rank creates it


def _wrap(r: Recipe, ctx: Ctx, seed: int, mesh: str, zero=None, group=None):
    kw = dict(r.engine)
    if zero is not None:
        kw["zero_stage"] = zero
    if kw.get("zero_stage") == 2 or group is not None:  # a resume into ZeRO-2 or onto world - 1 = 3 ranks: the
        kw.pop("secondary_shard", None)  # checkpoint of a secondary_shard=2 engine loaded by one without it
    if mesh == "hsdp":
        kw["mesh"] = ctx.mesh
    if group is not None:
        kw["process_group"] = group
    return yafsdp.YaFSDP(build(r, seed), **kw)


def _replicas_agree(model) -> bool:
    mine = model._rt.master.clone()
    every = [torch.empty_like(mine) for _ in range(model.replicas)]
    dist.all_gather(every, mine, group=model.replicate_group)
    return all(torch.equal(v, mine) for v in every)


def _resume(r: Recipe, ctx: Ctx, model, opt, rank: int, world: int, index: int):
    """The run goes on in a fresh engine (another seed: whatever the load misses shows); see RESUME.
    Returns the model (None on a rank left out), its optimizer and its process group."""
    from yafsdp import checkpoint as ckpt

    other_zero = 5 - r.engine.get("zero_stage", 3)
    if r.resume == "weights":
        sd = model.full_state_dict()
        model = _wrap(r, ctx, 1, r.mesh, zero=other_zero)
        model.load_full_state_dict(sd if rank == 0 else None)
        return model, _optimizer(r, model.parameters()), None
    path = ckpt.save_checkpoint(os.path.join(ctx.root, f"row{index}"), RESUME_AT, model, opt)
    group = None
    if r.resume == "zero":
        model = _wrap(r, ctx, 1, r.mesh, zero=other_zero)
    elif r.mesh == "hsdp":  # HSDP -> a flat world of the same size
        model = _wrap(r, ctx, 1, "flat")
    else:  # flat world -> world - 1
        group = ctx.smaller
        if rank >= world - 1:
            return None, None, group
        model = _wrap(r, ctx, 1, "flat", group=group)
    opt = _optimizer(r, model.parameters())
    ckpt.load_checkpoint(path, model, opt)
    return model, opt, group


def train_sharded(rank: int, world: int, row: dict, ctx: Ctx, index: int) -> dict | None:
    """One row on every rank; rank 0 returns what the parent compares (None on the others)."""
    r = recipe(row)
    model = _wrap(r, ctx, 0, r.mesh)
    for fn in r.after:
        fn(model)
    if r.grad_hook:
        hook_param(model)
    opt = _optimizer(r, model.parameters())
    scaler = new_scaler(r)
    out = dict(losses=[], norms=[], worlds=[], scales=[], aux=[], info=dict(untouched=True))
    out["info"]["fp8_units"] = sorted(u.name for u in model.flat_units
                                      if any(g.kind.format.name in ("fp8", "int8") for g in u.groups))
    out["info"]["nf4"] = sum(1 for i in model.shard_info() if i.kind == "nf4")
    out["info"]["lookups"] = sorted(u.name for u in model.units if u.lookup_hooks is not None)
    group, ranks = None, world
    for s in range(STEPS):
        if r.resume != "none" and s == RESUME_AT:
            if model.replicas > 1:
                out["info"]["replicas_agree_before_resume"] = _replicas_agree(model)
            model, opt, group = _resume(r, ctx, model, opt, rank, world, index)
            if model is None:  # not in the smaller world
                return None
            if r.grad_hook:
                hook_param(model)
            ranks = dist.get_world_size(group) if group is not None else world
        total = 0.0
        for micro in range(r.accum):
            loss, aux, untouched = forward_backward(r, model, batch("llama", s, micro, rank, vocab=r.vocab),
                                                    batch("llama", s + STEPS, micro, rank, vocab=r.vocab), scaler)
            total += loss / r.accum
            if aux is not None:
                out["aux"].append(aux)
            out["info"]["untouched"] &= untouched
        t = torch.tensor(total)
        dist.all_reduce(t, group=group)
        out["losses"].append(t.item() / ranks)
        out["worlds"].append(ranks)
        clip = (lambda: model.clip_grad_norm_(MAX_NORM)) if r.clip == "engine" else \
            (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        optimizer_step(r, opt, scaler, clip, out["norms"], out["scales"])
        opt.zero_grad(set_to_none=r.set_to_none)
    if model.replicas > 1:
        out["info"]["replicas_agree"] = _replicas_agree(model)
    sd = model.full_state_dict()
    return out | dict(sd=sd) if rank == 0 else None


def try_refusal(row: dict, ctx: Ctx) -> str:
    r = recipe(row)
    try:
        _wrap(r, ctx, 0, r.mesh)
    except ValueError as e:
        return str(e)
    return "<no error>"


def run_world(rank: int, world: int, rows: list[tuple[int, dict, str]], root: str) -> dict:
    """Every row of this world, in one process group: index -> (status, result, seconds)."""
    ctx = Ctx(world, root)
    out = {}
    for index, row, kind in rows:
        t0 = time.perf_counter()
        try:
            res = try_refusal(row, ctx) if kind == "refused" else train_sharded(rank, world, row, ctx, index)
            out[index] = ("ok", res, time.perf_counter() - t0)
        except Exception as e:  # reported by the parent under the row's name
            out[index] = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}",
                          time.perf_counter() - t0)
        dist.barrier()
    return out


# ----------------------------------------------------------------------------- the reference
def train_reference(row: dict, compute: torch.dtype | None = None, worlds: list[int] | None = None,
                    per_rank: bool = False):
    """One process, the unsharded model, torch AdamW, the same rounding as the row's engine: stored
    values (frozen in param_dtype, NF4) once, gathered values (fp8) before each forward, the
    forward/backward in ``compute`` (default: the row's param_dtype). ``per_rank=False``: one
    backward over the global batch. ``per_rank=True`` (what rows are judged against): data parallelism done in
    one process, rounded as the engine rounds it -- a backward per rank's batch in ``compute``, the
    gradient of each use of a weight (a tied weight has two) taken to fp32, summed over the ranks
    and folded into the fp32 gradient (``grad (+)= sum * (1 / world)``) per backward call, in backward order.
    Returns losses, norms, the state dict, the trainable keys, the initial state dict and dict(scales, aux)."""
    r = recipe(row)
    dt = compute or r.compute_dtype
    model = build(r)
    for fn in r.after:
        fn(model)
    frozen_in_dtype(model, r.compute_dtype)
    for fn in r.store:
        fn(model, r.compute_dtype)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = [p for p in model.parameters() if p.requires_grad]
    trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}  # tied: both
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.1, foreach=False)
    scaler = new_scaler(r)
    losses, norms, scales, aux = [], [], [], []
    for s in range(STEPS):
        world = worlds[s] if worlds else r.world
        if r.resume == "weights" and s == RESUME_AT:  # weights only: the optimizer starts afresh
            opt = torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=0.1, foreach=False)
        low, uses = _compute_copy(model, dt) if (dt != torch.float32 or r.step or per_rank) else (model, None)
        if r.grad_hook and (low is not model or s == 0):  # a fresh compute copy each step (ids are reused)
            hook_param(low)
        for fn in r.step:
            fn(model, low, dt)
        total = 0.0
        for micro in range(r.accum):
            parts = [batch("llama", s, micro, k, vocab=r.vocab) for k in range(world)]
            others = [batch("llama", s + STEPS, micro, k, vocab=r.vocab) for k in range(world)]
            if per_rank:
                summed: list[dict] = []  # per backward call: each use's gradient summed over the ranks

                def harvest():
                    if len(summed) <= calls[0]:
                        summed.append({id(q): torch.zeros_like(p) for p in params for q in uses[id(p)]})
                    for p in params:
                        for q in uses[id(p)]:
                            if q.grad is not None:
                                summed[calls[0]][id(q)] += q.grad.float()
                                q.grad = None
                    calls[0] += 1
                for k, (inputs, other) in enumerate(zip(parts, others)):
                    calls = [0]
                    loss, g, _ = forward_backward(r, low, inputs, other, scaler, harvest)
                    total += loss / r.accum / world
                    if k == 0 and g is not None:
                        aux.append(g)
                for each in summed:  # folded per backward call, as the engine reduces each
                    for p in params:
                        for q in reversed(uses[id(p)]):  # the last use's gradient is reduced first
                            acc = each[id(q)]
                            p.grad = acc * (1.0 / world) if p.grad is None else p.grad.add_(acc, alpha=1.0 / world)
            else:
                inputs = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
                other = {k: torch.cat([p[k] for p in others]) for k in others[0]}
                loss, _, _ = forward_backward(r, low, inputs, other, scaler)
                total += loss / r.accum
        if low is not model and not per_rank:
            for p in params:
                p.grad = sum(q.grad.float() for q in uses[id(p)])
        losses.append(total)
        optimizer_step(r, opt, scaler, lambda: torch.nn.utils.clip_grad_norm_(params, MAX_NORM), norms, scales)
        opt.zero_grad()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, norms, sd, trainable, init, dict(scales=scales, aux=aux)


def _compute_copy(model, dtype):
    """The model with its parameters in ``dtype`` (buffers such as RoPE's inv_freq stay as they are,
    as the engine leaves them), each use of a tied weight its own tensor (the engine reduces each
    use's gradient on its own). Returns it and, per parameter of ``model``, its uses in ``low`` in
    module order."""
    low = copy.deepcopy(model)
    uses: dict[int, list] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner, _, attr = name.rpartition(".")
        mod = low.get_submodule(owner)
        q = getattr(mod, attr)
        if id(p) in uses:  # a tied use: untie it
            q = nn.Parameter(q.detach().clone(), requires_grad=q.requires_grad)
            setattr(mod, attr, q)
        q.data = q.data.to(dtype)
        uses.setdefault(id(p), []).append(q)
    return low, uses


def rel_l2(a: dict, b: dict, keys) -> float:
    num = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in keys)
    den = sum(float(b[k].float().pow(2).sum()) for k in keys)
    return (num / den) ** 0.5


def rel_seq(a, b) -> float:
    """The largest relative difference; a non-finite value (an fp16 overflow's norm) must be met by
    a non-finite one."""
    def d(x, y):
        if not (math.isfinite(x) and math.isfinite(y)):
            return 0.0 if not (math.isfinite(x) or math.isfinite(y)) else math.inf
        return abs(x - y) / max(abs(y), 1e-12)
    assert len(a) == len(b), (a, b)
    return max((d(x, y) for x, y in zip(a, b)), default=0.0)
