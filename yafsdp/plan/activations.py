"""The activation estimate: a meta-device trace of one forward. See [Note: activation estimate]
in ``yafsdp/plan/__init__.py``."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ..layout.units import find_blocks
from ..layout.sizing import dtype_name


@dataclass
class ActivationEstimate:
    batch: int
    seq: int
    checkpointing: bool
    attention: str  # "fused" | "math"
    dtype: str
    saved: int  # bytes saved for backward at the end of forward
    transient: int  # bytes the backward adds on top (see [Note: activation estimate])
    per_block: int  # saved bytes of the largest block (without checkpointing)
    largest_saved: int  # the largest single saved tensor
    checkpointed: tuple[int, ...] = ()  # indices of the checkpointed blocks
    blocks: int = 0  # blocks in the model
    unit_grad_bytes: int = 0  # the largest unit's weight gradients (a backward transient)

    @property
    def total(self) -> int:
        return self.saved + self.transient


class _FusedAttentionStandIn(torch.autograd.Function):
    """Saves what flash / memory-efficient SDPA saves: q, k, v, output and an fp32 logsumexp."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the trace runs forward only
        raise RuntimeError("the activation trace runs forward only")


class _FusedSDPA(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = args[:3]
            return _FusedAttentionStandIn.apply(q, k, v)
        return func(*args, **kwargs)


def _meta_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module | None:
    """A fresh copy of ``module`` on the meta device in ``dtype``, or None if it cannot be built.
    Its parameters require grad where ``module``'s do (by name): a frozen weight saves nothing
    for its own gradient, so a LoRA base's activations differ from a full model's. See [Note: a
    meta copy of a wrapped model]."""
    copy = _meta_build(module)
    if copy is None:
        return None
    wants = {n: p.requires_grad for n, p in module.named_parameters()}
    for n, p in copy.named_parameters():
        if n in wants:
            p.requires_grad_(wants[n])
    return copy.to(dtype)


# [Note: a meta copy of a wrapped model]
# The trace runs a copy of the model on the meta device, never the model itself (its weights may be
# the engine's shards, or real and large). Four ways to build one, in order:
#   - an HF model (``config`` and ``_from_config``): its class built from its config on meta;
#   - a model whose parameters are all on meta already: a deep copy;
#   - a PEFT model (``peft_config`` and ``get_base_model()``, e.g. LoRA/QLoRA, wrapped by the engine
#     or with real weights): the meta copy of its base (recursively, so an HF base) with the same
#     adapters added again by PEFT's own class (``type(model)(base, config, adapter_name)``, each
#     further adapter by ``add_adapter``), the active one made active again.
#   - any other module holding such models (a wrapper of the user's, a training framework's module,
#     a PEFT model inside one): each outermost HF or PEFT model inside it built on meta as above, and
#     the modules around them cloned -- same class, same attributes (shared, not copied: the trace
#     only reads them), their own parameters and buffers as meta tensors of the same shapes, no
#     hooks (the engine's stay on the real modules). The wrapper's own ``forward`` runs in the
#     trace, so what it adds (its own layers, a second loss) is counted; it is called with the HF
#     inputs (``input_ids``, ``labels``) unless ``inputs_fn`` is given, and a forward that refuses
#     them is an error that asks for ``inputs_fn``.
# Then every parameter's ``requires_grad`` is set from the model's by name (the engine keeps the
# original names): PEFT freezes the base, and a frozen linear layer saves no input for its weight's
# gradient while its adapter's ``lora_A`` does.
# A module with no HF model inside and real weights cannot be copied without its weights: pass a
# meta model (``memory_plan(meta_model, world_size=..., inputs_fn=...)``).
def _meta_build(module: nn.Module) -> nn.Module | None:
    if _is_hf(module):
        with torch.device("meta"):
            return type(module)(module.config)
    if all(p.is_meta for p in module.parameters()):
        import copy as _copy

        return _copy.deepcopy(module)
    if _is_peft(module):
        return _meta_peft(module, module.peft_config)
    inside = models_inside(module)
    if not inside:
        return None
    built = {}
    for _, sub in inside:
        copy = _meta_build(sub)
        if copy is None:
            return None
        built[id(sub)] = copy
    return _meta_clone(module, built)


def _is_hf(module: nn.Module) -> bool:
    return getattr(module, "config", None) is not None and hasattr(type(module), "_from_config")


def _is_peft(module: nn.Module) -> bool:
    configs = getattr(module, "peft_config", None)
    return isinstance(configs, dict) and bool(configs) and callable(getattr(module, "get_base_model", None))


def models_inside(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost HF and PEFT models strictly inside ``module`` (path, module), in module order."""
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if sub is module or any(name.startswith(f + ".") for f, _ in found):
            continue
        if _is_hf(sub) or _is_peft(sub):
            found.append((name, sub))
    return found


def _meta_clone(module: nn.Module, built: dict[int, nn.Module]) -> nn.Module:
    """``module`` cloned around the meta models in ``built`` (by id of the module they replace; each
    clone is added, so a module held twice is cloned once); see [Note: a meta copy of a wrapped model]."""
    if id(module) in built:
        return built[id(module)]
    new = built[id(module)] = object.__new__(type(module))
    new.__dict__.update(module.__dict__)
    for key, value in module.__dict__.items():
        if "hooks" in key and isinstance(value, dict):
            new.__dict__[key] = type(value)()
    if "_yafsdp_forward" in new.__dict__:  # apply_checkpointing's switch: the trace runs the plain forward
        new.__dict__.pop("forward", None)
        del new.__dict__["_yafsdp_forward"]
    new._parameters = {n: None if p is None else
                       nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
                       for n, p in module._parameters.items()}
    new._buffers = {n: None if b is None else torch.empty(b.shape, dtype=b.dtype, device="meta")
                    for n, b in module._buffers.items()}
    new._modules = {n: None if m is None else _meta_clone(m, built) for n, m in module._modules.items()}
    return new


def _meta_peft(module: nn.Module, configs: dict) -> nn.Module | None:
    import copy as _copy

    base = _meta_build(module.get_base_model())
    if base is None:
        return None
    active = getattr(module, "active_adapter", None)
    active = active if isinstance(active, str) and active in configs else next(iter(configs))
    copy = type(module)(base, _copy.deepcopy(configs[active]), adapter_name=active)
    for name, cfg in configs.items():
        if name != active:
            copy.add_adapter(name, _copy.deepcopy(cfg))
    copy.set_adapter(active)
    return copy


@dataclass(frozen=True)
class TPTrace:
    """The trace under tensor parallelism: ``parallelize_llama(copy, mesh, sequence_parallel, loss_parallel)`` on
    the meta copy. See [Note: the activation trace under tensor parallelism]."""

    mesh: object  # a 1-D DeviceMesh of the TP degree (a real one, or over the fake process group)
    sequence_parallel: bool = True
    loss_parallel: bool = False


# [Note: the activation trace under tensor parallelism]
# Under torch's TP a rank saves the slices of the activations that its TP layout gives it: a colwise linear's
# output and the attention over its heads (1/T of them), the sequence-parallel norms' and residuals' inputs
# over 1/T of the sequence, but a colwise linear's input gathered over the whole sequence (its weight
# gradient reads it), and the logits over the whole vocabulary unless the loss is parallel. Rather than model
# each of these, the trace runs the meta copy parallelized as the real model is (yafsdp's Llama plan,
# ``parallelize_llama``, with the same sequence-parallel and loss-parallel choices) on a TP mesh: DTensor's
# sharding and redistributions run on meta tensors (torch's functional collectives have meta kernels and its
# scatter of a meta tensor sends nothing), so nothing is communicated, and each saved DTensor is counted by
# its local tensor (``_local_tensor``), which is what this rank's allocator holds. The mesh is the wrapped
# engine's own TP mesh, or, for a model planned before it is parallelized (``memory_plan(tp=N)``, the plan
# CLI's ``--tp``), a TP mesh over torch's fake process group of N ranks set up for the trace and taken down
# after it; this needs a process without a process group of its own (the trace cannot set up a second
# default group), so a distributed script plans the wrapped TP model instead. Another TP plan than
# Llama's is refused: the trace knows only the plan it can apply again.
def _hf_inputs(batch: int, seq: int, device) -> dict:
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    return {"input_ids": ids, "labels": ids}


@dataclass
class ActivationTrace:
    """What one traced forward saves for backward, by where it is saved: before the first block
    (``before``), in each block (``per_block[i]``, without checkpointing), after the last block
    (``after``: the head, the loss), and each block's input (``inputs[i]``: what a checkpointed
    block keeps instead). See [Note: activation estimate] and [Note: the peak of a checkpointed set]."""

    batch: int
    seq: int
    attention: str
    dtype: str
    before: int
    after: int
    per_block: list[int]
    inputs: list[int]
    largest_saved: int  # the largest single saved tensor
    blocks: list[str]  # the blocks' module paths, in forward order
    block_largest: list[int] = field(default_factory=list)  # the largest tensor each block saves

    def block_saved(self, checkpointed) -> list[int]:
        """Bytes each block holds from its forward to its backward, ``checkpointed`` a set of block indices."""
        return [self.inputs[i] if i in checkpointed else self.per_block[i] for i in range(len(self.per_block))]

    def saved(self, checkpointed=frozenset()) -> int:
        """Bytes saved for backward at the end of forward."""
        return self.before + sum(self.block_saved(checkpointed)) + self.after

    def peak(self, checkpointed=frozenset(), unit_grad_bytes: int = 0) -> int:
        """The predicted activation peak of a step; see [Note: the peak of a checkpointed set]."""
        held = self.block_saved(checkpointed)
        peak = self.saved(checkpointed) + max(2 * self.largest_saved, unit_grad_bytes)
        below = self.before
        for i, h in enumerate(held):
            if i in checkpointed:  # block i's recompute: blocks < i still held, the rest freed
                peak = max(peak, below + self.per_block[i] + self._block_transient(i, unit_grad_bytes))
            below += h
        return peak

    def _block_transient(self, i: int, unit_grad_bytes: int) -> int:
        return unit_grad_bytes + 2 * self.inputs[i] + self.block_largest[i]


# [Note: the peak of a checkpointed set]
# A checkpointed block keeps its input from its forward to its backward and saves everything else
# again during its recompute, which runs right before its backward: by then every later block's
# saved activations and the head's have been freed, and the earlier blocks' are still held. So the
# step's activation peak is the larger of
#   - the start of backward: everything saved at the end of forward (checkpointed blocks' inputs,
#     the other blocks' full sets, the head's) + the backward transient of the head;
#   - for each checkpointed block i: what blocks 0..i-1 hold + block i's full set + the gradients
#     in flight there (the unit's weight gradients, the incoming and outgoing hidden-state grads,
#     and the gradient of the block's largest saved tensor).
# With equal blocks, which ones are checkpointed does not change the end-of-forward sum but does
# change the second term: the earlier the block, the less is held below it. Checkpointing the
# first k blocks is therefore the best set of size k (yafsdp/plan/choose.py picks k).
def activation_trace(
    module: nn.Module,
    *,
    batch: int,
    seq: int,
    dtype: torch.dtype = torch.float32,
    attention: str = "fused",
    inputs_fn=None,
    tp: TPTrace | None = None,
) -> ActivationTrace | None:
    """Trace one forward of a meta copy of ``module``; see [Note: activation estimate]. ``tp``: the copy
    parallelized first, see [Note: the activation trace under tensor parallelism]."""
    if attention not in ("fused", "math"):
        raise ValueError(f"attention={attention!r}: use 'fused' or 'math'")
    model = _meta_copy(module, dtype)
    if model is None:
        return None
    loss_ctx = contextlib.nullcontext()
    if tp is not None:
        from ..integrations.tp_plans import loss_context, parallelize_llama

        if not _is_hf(model):
            raise ValueError(
                f"the activation trace under tensor parallelism parallelizes a meta copy with yafsdp's Llama plan; "
                f"{type(module).__name__} is not an HF causal LM with Llama's module names; plan the bytes without "
                "batch and seq")
        parallelize_llama(model, tp.mesh, sequence_parallel=tp.sequence_parallel, loss_parallel=tp.loss_parallel)
        loss_ctx = loss_context(tp.loss_parallel)
    wrapper = None  # a module around HF models, run on the HF inputs: its forward may refuse them
    if inputs_fn is None:
        if getattr(model, "config", None) is None:
            if not models_inside(model):
                return None
            wrapper = type(module).__name__
        inputs_fn = _hf_inputs
    model.train()
    blocks = find_blocks(model)
    names = {id(m): n for n, m in model.named_modules()}
    block_ids = {id(b): i for i, b in enumerate(blocks)}
    skip = {_local(p).untyped_storage()._cdata for p in model.parameters()}
    skip |= {_local(b).untyped_storage()._cdata for b in model.buffers()}
    saved: dict[int, tuple[int, object]] = {}  # storage -> (bytes, "before" | block index | "after")
    where: list[object] = ["before"]
    block_inputs = [0] * len(blocks)

    def pack(t: torch.Tensor):
        local = _local(t)
        key = local.untyped_storage()._cdata
        if key not in skip and key not in saved:
            saved[key] = (local.untyped_storage().nbytes(), where[0])
        return t

    def pre(mod, args, kwargs):
        i = block_ids[id(mod)]
        where[0] = i
        h = args[0] if args else kwargs.get("hidden_states")
        block_inputs[i] = _local(h).untyped_storage().nbytes() if isinstance(h, torch.Tensor) else 0

    def post(mod, args, kwargs, out):
        where[0] = "after"

    handles = [b.register_forward_pre_hook(pre, with_kwargs=True) for b in blocks]
    handles += [b.register_forward_hook(post, with_kwargs=True) for b in blocks]
    try:
        mode = _FusedSDPA() if attention == "fused" else None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), loss_ctx:
            if mode is not None:
                with mode:
                    model(**inputs_fn(batch, seq, "meta"))
            else:
                model(**inputs_fn(batch, seq, "meta"))
    except Exception as e:
        if wrapper is None:
            raise
        inside = ", ".join(repr(n) for n, _ in models_inside(model))
        raise ValueError(
            f"the activation trace ran {wrapper}.forward (around the HF model(s) {inside}) on a meta copy with "
            f"input_ids= and labels= of shape ({batch}, {seq}) and it raised {type(e).__name__}: {e}; pass "
            "inputs_fn=(batch, seq, device) -> the keyword arguments its forward takes "
            "(docs/activation_checkpointing.md)") from e
    finally:
        for h in handles:
            h.remove()
    per_block = [0] * len(blocks)
    block_largest = [0] * len(blocks)
    before = after = 0
    for nbytes, w in saved.values():
        if w == "before":
            before += nbytes
        elif w == "after":
            after += nbytes
        else:
            per_block[w] += nbytes
            block_largest[w] = max(block_largest[w], nbytes)
    return ActivationTrace(
        batch=batch, seq=seq, attention=attention, dtype=dtype_name(dtype), before=before, after=after,
        per_block=per_block, inputs=block_inputs, largest_saved=max((b for b, _ in saved.values()), default=0),
        blocks=[names.get(id(b), str(i)) for i, b in enumerate(blocks)], block_largest=block_largest,
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (what this rank holds), else ``t``."""
    return getattr(t, "_local_tensor", t)


def checkpointed_set(checkpointing, n_blocks: int) -> frozenset[int]:
    """``checkpointing`` (False / True: none / every block; or block indices) as a set of indices."""
    if checkpointing is True:
        return frozenset(range(n_blocks))
    if checkpointing is False or checkpointing is None:
        return frozenset()
    out = frozenset(int(i) for i in checkpointing)
    bad = sorted(i for i in out if not 0 <= i < n_blocks)
    if bad:
        raise ValueError(f"checkpointing: block indices {bad} out of range; the model has {n_blocks} blocks")
    return out


def activation_estimate(
    module: nn.Module,
    *,
    batch: int,
    seq: int,
    checkpointing=False,
    dtype: torch.dtype = torch.float32,
    attention: str = "fused",
    inputs_fn=None,
    unit_grad_bytes: int = 0,
    tp: TPTrace | None = None,
) -> ActivationEstimate | None:
    """Trace one forward of a meta copy of ``module``; see [Note: activation estimate].
    ``checkpointing``: False, True (every block) or the indices of the checkpointed blocks; ``tp``: see
    ``activation_trace``."""
    tr = activation_trace(module, batch=batch, seq=seq, dtype=dtype, attention=attention, inputs_fn=inputs_fn,
                          tp=tp)
    if tr is None:
        return None
    return estimate_from_trace(tr, checkpointing, unit_grad_bytes)


def estimate_from_trace(tr: ActivationTrace, checkpointing, unit_grad_bytes: int) -> ActivationEstimate:
    ck = checkpointed_set(checkpointing, len(tr.per_block))
    saved = tr.saved(ck)
    est = ActivationEstimate(
        batch=tr.batch, seq=tr.seq, checkpointing=bool(ck), attention=tr.attention, dtype=tr.dtype,
        saved=saved, transient=tr.peak(ck, unit_grad_bytes) - saved, per_block=max(tr.per_block, default=0),
        largest_saved=tr.largest_saved, checkpointed=tuple(sorted(ck)), blocks=len(tr.per_block),
        unit_grad_bytes=unit_grad_bytes,
    )
    est.trace = tr  # not a field (to_dict leaves it out): what choose_checkpointing evaluates other sets on
    return est
