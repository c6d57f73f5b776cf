"""What an optimizer over a wrapped model may not hold: refused at its construction or first step.

[Note: optimizers that would train the wrong thing]
Three PyTorch habits build an optimizer that runs without an error over a wrapped model and trains
something else than the unsharded model would; each is refused, naming what to do instead:

- **the parameters as they were before wrapping** (``opt = AdamW(model.parameters()); model =
  YaFSDP(model)``, or a list of them kept from before): wrapping moves the values into flat shards
  and the module's attributes to ShardedParameters ([Note: the module tree after wrapping] in
  engine/orig_params.py), so the old tensors never get a gradient and ``step()`` skips them: the
  model would not train at all. ``orig_params.install`` marks each of them (``_yafsdp_replaced``);
  an optimizer holding one is refused when a group is added (after wrapping) or at its first step
  (built before).
- **an optimizer that is not element-wise** (Adafactor's factored second moment, LBFGS's dot
  products and line search, Muon's orthogonalized matrices, LAMB/LARS trust ratios, Shampoo/SOAP
  preconditioners): it reads a parameter's shape or norm, and each rank holds a 1-D slice of a flat
  shard spanning many parameters, so it computes other updates than on the unsharded model. Known
  classes (and their subclasses) are refused when a group holding flat shards is added.
- **an empty param group beside the flat shards**: a weight-decay split by name over
  ``model.named_parameters()`` (``"bias" in name or "norm" in name``) matches nothing, since the
  wrapper's names are its shards' (``flat.<unit>``), so every norm would be decayed. A group with no
  parameters in an optimizer whose other groups decay a flat shard of 1-D parameters (the small group:
  norm weights, biases) is refused, pointing to the original names (``model.module.named_parameters()``)
  and ``model.param_groups(weight_decay)``. Beside shards of matrices only (LoRA adapters: their
  no-decay group is empty on the unsharded model too) an empty group passes.
"""
from __future__ import annotations

import re
import weakref

import torch

from ..engine import shards

__all__ = ["check_group", "check_before_step"]

# lower-case class names (any class in the optimizer's MRO) -> what it computes over a whole parameter
_NOT_ELEMENTWISE = {
    "adafactor": "a second moment factored over each matrix's rows and columns",
    "lbfgs": "dot products and a line search over all the parameters",
    "muon": "an orthogonalized update of each matrix",
    "sparseadam": "sparse gradients of whole embeddings",
    "shampoo": "preconditioners from each matrix's row and column statistics",
    "distributedshampoo": "preconditioners from each matrix's row and column statistics",
    "soap": "preconditioners from each matrix's row and column statistics",
    "came": "a factored second moment over each matrix's rows and columns",
}
_PATTERNS = [  # the families' variants (apex's Fused*, bitsandbytes' *8bit / Paged*, GaLore's wrappers)
    (re.compile(r"(fused|paged)?(lamb|lars)(8bit|32bit)?"), "a trust ratio from each parameter's norm"),
    (re.compile(r"galore\w*"), "low-rank projections of each matrix's gradient"),
]


def _not_elementwise(optimizer) -> str | None:
    """What ``optimizer``'s class computes over whole parameters, or None for an element-wise one."""
    for cls in type(optimizer).__mro__:
        name = cls.__name__.lower()
        if name in _NOT_ELEMENTWISE:
            return _NOT_ELEMENTWISE[name]
        for pattern, why in _PATTERNS:
            if pattern.fullmatch(name):
                return why
    return None


def _tensors(group: dict) -> list:
    params = group.get("params")
    if params is None or isinstance(params, (set, frozenset)):
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    return [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]


def _replaced_message(optimizer, p) -> str:
    return (f"yafsdp: {type(optimizer).__name__} holds parameter {p._yafsdp_replaced!r} as it was before "
            "yafsdp.YaFSDP wrapped its model: wrapping moved the values into flat shards, so this tensor gets no "
            "gradient and the optimizer would train nothing. Build the optimizer after wrapping, over "
            "model.parameters() (model: the yafsdp.YaFSDP wrapper), model.param_groups(weight_decay), or the "
            "wrapped module's parameters()")


def check_group(optimizer, group: dict) -> None:
    """Before ``Optimizer.add_param_group`` adds ``group`` (the original parameters already adopted:
    orig_params.adopt_param_group): see [Note: optimizers that would train the wrong thing]."""
    tensors = _tensors(group)
    _refuse_replaced(optimizer, tensors)
    earlier = [_tensors(g) for g in optimizer.param_groups]  # the groups added before this one
    if any(shards.info_of(p) is not None for p in tensors):
        why = _not_elementwise(optimizer)
        if why is not None:
            raise ValueError(
                f"yafsdp: {type(optimizer).__name__} cannot step a yafsdp.YaFSDP model's flat shards: it computes "
                f"{why}, and each rank holds a 1-D slice of a flat shard spanning many parameters, so its updates "
                "would differ from the unsharded model's. Use an element-wise optimizer (AdamW, Adam, SGD, RMSprop, "
                "Adagrad, NAdam, RAdam, Adamax, yafsdp.FusedAdamW)")
        empty = next((i for i, ts in enumerate(earlier) if not ts), None)
        if empty is not None and _decays_vectors(optimizer, group, tensors):
            raise ValueError(_empty_message(optimizer, empty))
    elif not tensors and any(_decays_vectors(optimizer, g, ts) for g, ts in zip(optimizer.param_groups, earlier)):
        raise ValueError(_empty_message(optimizer, len(earlier)))


def _refuse_replaced(optimizer, tensors) -> None:
    """The first habit: a parameter as it was before wrapping (marked by ``orig_params.install``)."""
    for p in tensors:
        if getattr(p, "_yafsdp_replaced", None) is not None:
            raise ValueError(_replaced_message(optimizer, p))


def _decays_vectors(optimizer, group: dict, tensors: list) -> bool:
    """Whether ``group`` decays a flat shard of 1-D parameters (norm weights, biases): what a no-decay split by
    the wrapper's names leaves behind. (An empty group beside shards of matrices only -- LoRA adapters, whose
    no-decay group is empty on the unsharded model too -- is no sign of it.)"""
    if group.get("weight_decay", getattr(optimizer, "defaults", {}).get("weight_decay", 0)) == 0:
        return False
    for p in tensors:
        info = shards.info_of(p)
        if info is not None and any(len(s) == 1 for s in info.param_shapes):
            return True
    return False


def _empty_message(optimizer, index: int) -> str:
    return (f"yafsdp: param group {index} of {type(optimizer).__name__} holds no parameters, beside groups holding "
            "the flat shards of a yafsdp.YaFSDP model. A split by name over the wrapper's named_parameters() "
            "(no weight decay for biases and norms) matches nothing: the wrapper's names are its shards' "
            "('flat.<unit>'), so every parameter would land in the other group. Select by the original names from "
            "model.module.named_parameters() (a unit's matrices and the 1-D parameters are separate shards), or use "
            "model.param_groups(weight_decay) (matrices decayed, norms and biases not); leave out a group meant to "
            "be empty")


_CHECKED: "weakref.WeakSet" = weakref.WeakSet()  # optimizers whose groups were checked at a step


def check_before_step(optimizer) -> None:
    """The first habit for an optimizer built before wrapping: refused at its first step (a group added
    later goes through ``check_group``)."""
    if optimizer in _CHECKED:
        return
    for g in optimizer.param_groups:
        _refuse_replaced(optimizer, g["params"])
    _CHECKED.add(optimizer)
