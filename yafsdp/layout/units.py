"""Which parameters form which unit: automatic discovery and the wrap-time checks.

Rules (see docs/api.md, "Arguments": units):
- ``units=None``: every block of each of the model's repeated block lists (each run of two or more
  same-class, parameter-holding children of a ``ModuleList``/``Sequential``, or of a ``ModuleDict``
  when they are composite; HF decoders: ``model.model.layers``; T5: ``encoder.block`` and
  ``decoder.block``; torchtitan: ``layers``, a ModuleDict) is a unit. Every other module that
  directly holds a >=2-D parameter becomes a unit of its own (the embedding before the blocks, the
  head after them).
- ``units=[...]``: exactly those modules; every parameter must fall inside one of them.
- Every 1-D parameter (norm weights, biases) goes to the small group, whatever its unit.
- A parameter reachable from two units (tied embeddings) is placed in the first; a module of a
  later unit that holds nothing but such parameters becomes a *member* of the first unit (it
  gathers that unit when it runs). Any other sharing is an error.
"""
from __future__ import annotations

import dis
import inspect
import weakref

from dataclasses import dataclass, field

from torch import nn

from .flat import ParamInfo


# Modules that hold other modules or parameters but have no forward of their own: a unit must be a
# module whose forward runs (its hooks gather the weights), so these never are units themselves.
_CONTAINERS = (nn.ModuleDict, nn.ModuleList, nn.ParameterDict, nn.ParameterList)

_WRAPPED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # modules wrapped by a YaFSDP (and the wrappers)


def mark_wrapped(module: nn.Module) -> None:
    """Remember that ``module`` is (or is inside) a YaFSDP: wrapping it again is refused."""
    _WRAPPED.add(module)


class WrapError(ValueError):
    """Bad input found at wrap time; the message names the module or parameter at fault."""


@dataclass
class Member:
    """A module whose forward needs a unit gathered, and which of its attributes to point there."""

    module: nn.Module
    name: str
    assignments: list[tuple[nn.Module, str, int]] = field(default_factory=list)  # (owner, attr, param idx)


@dataclass
class UnitSpec:
    name: str
    params: list[ParamInfo]  # the >= 2-D parameters (the small ones are in the small group)
    members: list[Member]


def _already_wrapped(root: nn.Module) -> str | None:
    from torch.nn.parallel import DistributedDataParallel

    kinds = [(DistributedDataParallel, "DistributedDataParallel")]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        kinds.append((FullyShardedDataParallel, "FSDP"))
    except ImportError:  # pragma: no cover
        pass
    try:
        from torch.distributed.fsdp import FSDPModule

        kinds.append((FSDPModule, "FSDP2 (fully_shard)"))
    except ImportError:  # pragma: no cover
        pass
    for name, m in root.named_modules():
        if m in _WRAPPED:
            return f"module {name or '<root>'!r} is already wrapped by yafsdp.YaFSDP"
        for cls, what in kinds:
            if isinstance(m, cls):
                return f"module {name or '<root>'!r} is already wrapped by {what}"
    return None


def find_block_lists(root: nn.Module) -> list[list[nn.Module]]:
    """Every repeated block list of ``root``, in module order: each maximal run of two or more
    same-class, parameter-holding children of a ``ModuleList``/``Sequential`` (or composite ones of
    a ``ModuleDict``: [Note: blocks in a ModuleDict]) that is not inside a block already found. A
    decoder-only model has one (HF: ``model.model.layers``); an encoder-decoder has two (T5:
    ``encoder.block`` and ``decoder.block``); lists nested inside a block (e.g. a block's experts)
    stay part of that block."""
    lists: list[list[nn.Module]] = []
    inside: set[int] = set()  # every module in the subtree of a block found so far
    for m in root.modules():  # pre-order: an outer list is seen before anything inside it
        if id(m) in inside or not isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue
        runs: list[list[nn.Module]] = []
        run: list[nn.Module] = []
        for child in m.children():
            # A container (ModuleDict, ...) is never called: its children are, and they are found
            # as units (or lists) of their own. See [Note: blocks in a ModuleDict].
            has_params = (not isinstance(child, _CONTAINERS) and any(True for _ in child.parameters())
                          and (not isinstance(m, nn.ModuleDict) or _composite(child)))
            if run and has_params and type(child) is type(run[0]):
                run.append(child)
            else:
                run = [child] if has_params else []
                runs.append(run)
        for run in runs:
            if len(run) >= 2:
                lists.append(run)
                inside.update(id(sub) for b in run for sub in b.modules())
    return lists


# [Note: blocks in a ModuleDict]
# torchtitan keeps its decoder blocks in an ``nn.ModuleDict`` keyed "0", "1", ... (so that pipeline
# stages can drop some and keep the others' names) and runs them as ``for layer in
# self.layers.values()``: in insertion order, which is the dict's module order. Its same-class
# children are therefore a block list like a ``ModuleList``'s. Only *composite* children count
# (modules with submodules holding parameters): PEFT keeps one leaf layer per adapter in
# ``ModuleDict``s (``lora_A = {"default": Linear, "other": Linear}``) -- alternatives, not a
# sequence of blocks -- and those stay units of their own or part of the block around them, as
# before. (Nothing depends on the dict order being the call order: the prefetch plan is the order
# the previous forward ran the units in, runtime.py.)


def _composite(module: nn.Module) -> bool:
    return any(any(True for _ in c.parameters()) for c in module.children())


def find_blocks(root: nn.Module) -> list[nn.Module]:
    """The blocks of every repeated block list (``find_block_lists``), in module order."""
    return [b for blocks in find_block_lists(root) for b in blocks]


def discover(root: nn.Module, units: list[nn.Module] | None) -> tuple[list[UnitSpec], list[ParamInfo]]:
    """Return the units (in module order) and the small group's parameters."""
    why = _already_wrapped(root)
    if why:
        raise WrapError(f"yafsdp.YaFSDP: {why}; unwrap it first (wrap the plain model once)")

    names = {id(m): n or "<root>" for n, m in root.named_modules(remove_duplicate=False)}
    # Every (module, attribute) reference to every parameter, in registration order.
    infos: dict[int, ParamInfo] = {}
    for mname, m in root.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is None:
                continue
            info = infos.get(id(p))
            if info is None:
                fqn = f"{mname}.{attr}" if mname else attr
                info = infos[id(p)] = ParamInfo(fqn, p.shape, p.dtype, [], small=p.dim() <= 1,
                                                frozen=not p.requires_grad)
                info.param = p  # type: ignore[attr-defined]
            if not any(o is m and a == attr for o, a in info.owners):
                info.owners.append((m, attr))
    if not infos:
        raise WrapError("yafsdp.YaFSDP: the module has no parameters to shard")
    explicit = units is not None
    if explicit:
        units = list(units)
        seen: dict[int, int] = {}
        for i, u in enumerate(units):
            if not isinstance(u, nn.Module):
                raise WrapError(f"units[{i}] is a {type(u).__name__}, not an nn.Module")
            if id(u) not in names:
                raise WrapError(f"units[{i}] ({type(u).__name__}) is not a submodule of the wrapped module")
            if id(u) in seen:
                raise WrapError(f"module {names[id(u)]!r} is listed twice in units= (positions {seen[id(u)]} and {i})")
            if isinstance(u, _CONTAINERS):
                inside = ", ".join(repr(f"{names[id(u)]}.{n}") for n, _ in list(u.named_children())[:3])
                raise WrapError(
                    f"unit {names[id(u)]!r} is an {type(u).__name__}, whose forward is never called, so its weights "
                    f"would never be gathered; list the modules inside it that run instead ({inside or 'its children'}), "
                    "or the module that reads its parameters"
                )
            seen[id(u)] = i
        for u in units:
            for sub_name, sub in u.named_modules():
                if sub is not u and id(sub) in seen:
                    raise WrapError(
                        f"unit {names[id(sub)]!r} is nested inside unit {names[id(u)]!r}; units must not overlap"
                    )
        for u in units:
            if not any(True for _ in u.parameters()):
                raise WrapError(f"unit {names[id(u)]!r} has no parameters")
    else:
        units = find_blocks(root)

    owner_of: dict[int, UnitSpec] = {}  # id(ParamInfo) -> unit holding it
    specs: list[UnitSpec] = []

    def add_unit(module: nn.Module, params: list[ParamInfo]):
        """A unit rooted at ``module`` holding ``params`` (the large ones not placed yet)."""
        name = names[id(module)]
        big = [p for p in params if not p.small]
        fresh = [p for p in big if id(p) not in owner_of]
        shared = [p for p in big if id(p) in owner_of]
        if shared:
            # a module all of whose parameters (its subtree's) belong to one other unit, or are small: a member of
            # that unit (a tied head; PEFT's trainable tokens on a tied head, whose base layer is the tied head)
            homes = {id(owner_of[id(p)]) for p in shared}
            subtree = [infos[id(q)] for q in module.parameters()]
            only_shared = not fresh and all(q.small or id(q) in owner_of for q in subtree)
            if len(homes) > 1 or not only_shared or any(
                    not q.small and owner_of[id(q)] is not owner_of[id(shared[0])] for q in subtree):
                p = shared[0]
                raise WrapError(
                    f"parameter {p.fqn!r} is shared between unit {owner_of[id(p)].name!r} and unit {name!r} in an "
                    "unsupported way: a shared parameter is supported only when every parameter of the second unit "
                    "belongs to one other unit (tied embeddings) or is a bias or norm; pass units= so that the "
                    "modules sharing it are in one unit"
                )
            home = owner_of[id(shared[0])]
            home.members.append(_member(module, name, home.params, infos))
            return
        if not fresh:
            return  # only small parameters: they live in the small group
        spec = UnitSpec(name, fresh, [])
        for p in fresh:
            owner_of[id(p)] = spec
        spec.members.append(_member(module, name, fresh, infos))
        specs.append(spec)

    unit_ids = {id(u) for u in units}
    for u in units:
        add_unit(u, _params_in(u, infos))
    covered = {id(infos[id(p)]) for u in units for p in u.parameters()}
    leftovers = [i for i in infos.values() if id(i) not in covered]
    if explicit and leftovers:
        listed = ", ".join(repr(i.fqn) for i in leftovers[:5]) + (" ..." if len(leftovers) > 5 else "")
        raise WrapError(
            f"{len(leftovers)} parameter(s) are in no unit: {listed}; add their modules to units= or pass units=None"
        )
    if not explicit:
        under = _under_units(root, unit_ids)
        for mname, m in root.named_modules():
            if id(m) in unit_ids or id(m) in under:
                continue
            if isinstance(m, (nn.ParameterList, nn.ParameterDict)):
                continue  # never called: the module holding it reads its parameters (below)
            own = [infos[id(p)] for p in m._parameters.values() if p is not None]
            for c in m.children():
                if isinstance(c, (nn.ParameterList, nn.ParameterDict)):
                    own += [infos[id(p)] for p in c._parameters.values() if p is not None]
            if any(not p.small for p in own):
                if _reads_base_layer(m):  # See [Note: wrappers that read their child's weight]
                    add_unit(m, _params_in(m, infos))
                    under.update(id(sub) for sub in m.modules() if sub is not m)
                else:
                    add_unit(m, own)
    # Members beyond a unit's home module see parameters owned elsewhere in their subtree only.
    order = {id(m): i for i, (_, m) in enumerate(root.named_modules())}
    specs.sort(key=lambda s: order[id(s.members[0].module)])
    small = [i for i in infos.values() if i.small]
    return specs, small


# [Note: wrappers that read their child's weight]
# A unit's weights are gathered while one of its member modules' forward runs; a weight read by
# another module's forward is not ([Note: the module tree after wrapping] in orig_params.py: such
# a read raises). PEFT's tuner layers hold parameters of their own next to a wrapped ``base_layer``
# whose weight some of them read directly, without calling ``base_layer``'s forward: the trainable
# tokens layer (``trainable_token_indices``) computes ``F.embedding(x, W)`` from
# ``base_layer.weight`` with its rows replaced. Such a module (own >= 2-D parameters and a
# ``base_layer`` child that holds parameters) is made one unit with its whole subtree, so the
# base weight is gathered whenever the wrapper runs.


def _reads_base_layer(module: nn.Module) -> bool:
    base = getattr(module, "_modules", {}).get("base_layer")
    return base is not None and any(True for _ in base.parameters())


def _plain_embedding(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward
        and not module.sparse and all(_grad_switch(h) for h in module._forward_hooks.values())
        and not module._forward_pre_hooks
    )


def _grad_switch(hook) -> bool:
    """A forward hook that does nothing but ``output.requires_grad_(...)``: what Hugging Face's
    ``enable_input_require_grads`` puts on the input embedding (and ``gradient_checkpointing_enable``
    calls it since transformers 5), and PEFT's ``prepare_model_for_kbit_training`` likewise. It
    reads no weight, so the embedding's backward stays weight-free. Judged by its code: a plain
    function whose only loads are of its third argument and whose only name is ``requires_grad_``."""
    code = getattr(hook, "__code__", None)
    if code is None or not inspect.isfunction(hook) or code.co_argcount != 3 or code.co_freevars:
        return False
    if code.co_names != ("requires_grad_",):
        return False
    out = code.co_varnames[2]
    used = set()  # the local variables the code loads, stores or deletes
    for ins in dis.get_instructions(code):
        if ins.opname.startswith(("LOAD_FAST", "STORE_FAST", "DELETE_FAST", "LOAD_DEREF", "LOAD_CLOSURE")):
            used.update(ins.argval if isinstance(ins.argval, tuple) else (ins.argval,))
    return used <= {out}


def weight_free_backward(spec: UnitSpec) -> bool:
    """True when no backward of ``spec`` reads its weights, so ZeRO-3 need not re-gather it.

    That holds when every module using the unit's parameters is a plain dense ``nn.Embedding``:
    its weight gradient is built from the indices and the output gradient alone, and its integer
    input has no gradient. A tied head (a member that is a ``Linear``), a subclass with its own
    ``forward``, sparse gradients or user forward hooks (which could read the weight) rule it out; a
    hook that only switches its output's ``requires_grad`` on (:func:`_grad_switch`, Hugging Face's with
    gradient checkpointing) does not."""
    mods = [m.module for m in spec.members] + [owner for p in spec.params for owner, _ in p.owners]
    return bool(mods) and all(_plain_embedding(m) for m in mods)


def _params_in(module: nn.Module, infos: dict[int, ParamInfo]) -> list[ParamInfo]:
    out, seen = [], set()
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(infos[id(p)])
    return out


def _under_units(root: nn.Module, unit_ids: set[int]) -> set[int]:
    """ids of the modules with a unit among their ancestors, on the first path from ``root`` in
    depth-first order (the path a walk from the root finds first), in one walk: linear in the modules (a PEFT
    Llama-2-70B has ~5,000 of them; one walk from the root per module took ~15 s)."""
    seen: set[int] = set()
    under: set[int] = set()
    stack = [(root, False)]
    while stack:
        m, below = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if below:
            under.add(id(m))
        stack.extend((c, below or id(m) in unit_ids) for c in reversed(list(m.children())))
    return under


def _member(module: nn.Module, name: str, unit_params: list[ParamInfo], infos) -> Member:
    """Which attributes inside ``module``'s subtree point at ``unit_params``."""
    subtree = {id(m) for m in module.modules()}
    member = Member(module, name)
    for idx, p in enumerate(unit_params):
        for owner, attr in p.owners:
            if id(owner) in subtree:
                member.assignments.append((owner, attr, idx))
    return member
