"""Tensor-parallel plans for Hugging Face models: what to pass to torch's ``parallelize_module`` on
``mesh["tp"]`` before wrapping with ``yafsdp.YaFSDP(model, mesh=mesh["dp"])`` (docs/tp.md).

[Note: a TP plan for HF's Llama]
torchtitan's Llama plan, written for HF's module names: the attention's q/k/v and the MLP's gate/up
projections column-parallel, the attention's output and the MLP's down projection row-parallel, the
embedding row-parallel (each rank looks up its rows and the outputs are summed), the head
column-parallel. With sequence parallelism the norms run on a shard of the sequence
(``SequenceParallel``), the row-parallel outputs are reduce-scattered over the sequence instead of
all-reduced, and each attention and MLP gathers the sequence at its input. One difference from
torchtitan: HF's ``LlamaModel`` builds the causal mask, the positions and the rotary tables from the
embedding's output, so that output stays whole here (all-reduced, not reduce-scattered) and the first
decoder layer takes its share of the sequence at its input. The sequence length must then be a
multiple of the TP degree. ``loss_parallel=True`` leaves the logits split over the vocabulary
(``Shard(-1)``) for ``torch.distributed.tensor.parallel.loss_parallel()``, inside which both the
forward (HF computes the loss in it) and the backward must run.

[Note: tied embeddings under TP]
``parallelize_module`` replaces each module's parameters with DTensors one module at a time, so a head
tied to the embedding (Llama-3.2-1B and -3B, ``config.tie_word_embeddings``) comes out as two separate
parameters: each is trained on its own from then on, silently, and the model is no longer the one its
config describes. Under this plan both are split the same way (the embedding row-parallel and the head
column-parallel both cut the ``(vocab, hidden)`` weight on dim 0, ``Shard(0)``, into the same chunks), so
the head can take the embedding's DTensor back: :func:`parallelize_llama` does, and
``yafsdp.YaFSDP`` refuses a TP model whose config ties them while its parameters are two
(yafsdp/wrapper/tp_state.py ``check_module``).
"""
from __future__ import annotations

__all__ = ["llama_tp_local_shapes", "llama_tp_plan", "loss_context", "parallelize_llama", "untied_by_tp"]


def llama_tp_plan(model, sequence_parallel: bool = True, loss_parallel: bool = False) -> dict:
    """The ``parallelize_module`` plan of an HF ``LlamaForCausalLM`` (or any HF causal LM with Llama's module
    names: Mistral, Qwen2, ...): ``{module name: ParallelStyle}``. See [Note: a TP plan for HF's Llama]. The
    attention and key-value head counts and the MLP width must be multiples of the TP degree."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    base = model.model
    layers = [f"model.layers.{i}" for i in range(len(base.layers))]
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        plan["model.norm"] = SequenceParallel()
        plan[layers[0]] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                             use_local_output=True)
    for layer in layers:
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{layer}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{layer}.{name}"] = RowwiseParallel(output_layouts=seq)
        if sequence_parallel:
            plan[f"{layer}.input_layernorm"] = SequenceParallel()
            plan[f"{layer}.post_attention_layernorm"] = SequenceParallel()
            plan[f"{layer}.self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                            desired_input_kwarg_layouts={"hidden_states": Replicate()})
            plan[f"{layer}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def parallelize_llama(model, tp_mesh, sequence_parallel: bool = True, loss_parallel: bool = False):
    """``parallelize_module(model, tp_mesh, llama_tp_plan(model, ...))``, then a head tied to the embedding tied
    again (see [Note: tied embeddings under TP]); returns ``model``."""
    from torch.distributed.tensor.parallel import parallelize_module

    tied = _ties(model) and model.get_output_embeddings().weight is model.get_input_embeddings().weight
    parallelize_module(model, tp_mesh, llama_tp_plan(model, sequence_parallel, loss_parallel))
    if tied:
        head, emb = model.get_output_embeddings(), model.get_input_embeddings()
        if head.weight.placements != emb.weight.placements or head.weight.shape != emb.weight.shape:
            raise ValueError(
                f"yafsdp.integrations.tp_plans.parallelize_llama: the tied head and embedding came out of "
                f"parallelize_module as {head.weight.placements} and {emb.weight.placements}; they cannot share one "
                "weight")
        head.weight = emb.weight
    # what the memory plan's activation trace applies again to a meta copy ([Note: the activation trace under
    # tensor parallelism] in yafsdp/plan/activations.py)
    model._yafsdp_llama_tp = {"sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel}
    return model


def loss_context(loss_parallel: bool):
    """Where a loss over the head's logits and its backward run: torch's ``loss_parallel()`` when the head was
    parallelized with ``loss_parallel=True`` (logits split over the vocabulary), else a null context."""
    if not loss_parallel:
        import contextlib

        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel as split_loss

    return split_loss()


def _ties(model) -> bool:
    """Whether ``model``'s config ties its output embedding to its input embedding."""
    cfg = getattr(model, "config", None)
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if not getattr(cfg, "tie_word_embeddings", False) or get_in is None or get_out is None:
        return False
    inp, out = get_in(), get_out()
    return inp is not None and out is not None and hasattr(inp, "weight") and hasattr(out, "weight")


def untied_by_tp(model) -> tuple[str, str] | None:
    """``(head weight's name, embedding weight's name)`` when ``model``'s config ties them but they are two
    parameters (what ``parallelize_module`` leaves: [Note: tied embeddings under TP]), else None."""
    if not _ties(model):
        return None
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out.weight is inp.weight:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    return f"{names.get(id(out), 'output embedding')}.weight", f"{names.get(id(inp), 'input embedding')}.weight"


def llama_tp_local_shapes(model, tp: int, tp_rank: int = 0) -> dict:
    """The local shape of each parameter of ``model`` (a plain HF Llama-like causal LM, no DTensors) that
    :func:`llama_tp_plan` splits, on TP coordinate ``tp_rank`` of a TP degree ``tp``: ``{canonical name
    (the first in model.named_parameters()): torch.Size}``; the parameters it leaves whole are not listed.
    What torch's ``ColwiseParallel`` / ``RowwiseParallel`` do to the modules the plan names: a Linear's
    weight split on dim 0 (column-parallel, its bias too) or dim 1 (row-parallel, its bias whole), an
    Embedding's on dim 1 (column-parallel) or dim 0 (row-parallel); each split as DTensor's ``Shard``
    cuts it (``torch.chunk``: the first ranks take ``ceil(n / tp)`` rows, an uneven vocabulary's last
    rank fewer). Refuses a model the plan does not fit, and a ``tp`` that does not divide the head
    counts or the MLP width, naming the dimension. Used by ``yafsdp.plan.memory_plan(..., tp=)``."""
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if tp < 1 or not 0 <= tp_rank < tp:
        raise ValueError(f"yafsdp.integrations.tp_plans: tp={tp}, tp_rank={tp_rank}; give a TP degree of at least 1 "
                         "and a coordinate 0 <= tp_rank < tp")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers) or not all(
            hasattr(b, "self_attn") and hasattr(b, "mlp") for b in layers):
        raise ValueError(
            f"yafsdp.integrations.tp_plans: {type(model).__name__} has no model.layers[*].self_attn / .mlp; the "
            "TP degree plans the layout of llama_tp_plan, which is Llama's (HF LlamaForCausalLM and the causal LMs "
            "with its module names); for another model apply its TP plan, wrap it and call model.memory_plan()")
    cfg = getattr(model, "config", None)
    dims = {d: getattr(cfg, d, None) for d in ("num_attention_heads", "num_key_value_heads", "intermediate_size")}
    for dim, size in dims.items():
        if size is not None and size % tp:
            raise ValueError(
                f"yafsdp.integrations.tp_plans: TP degree {tp} does not divide the model's {dim} ({size}); "
                "column-parallel projections split it over the TP ranks: pick a TP degree that divides "
                + ", ".join(f"{d} ({n})" for d, n in dims.items() if n is not None))
    canonical = {}
    for name, p in model.named_parameters():
        canonical.setdefault(id(p), name)
    out = {}
    for mname, style in llama_tp_plan(model, sequence_parallel=False).items():
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue  # the norms and the input/output preparations: nothing split
        module = model.get_submodule(mname)
        col = isinstance(style, ColwiseParallel)
        if isinstance(module, nn.Embedding):
            split = {"weight": 1 if col else 0}
        elif isinstance(module, nn.Linear):
            split = {"weight": 0 if col else 1, **({"bias": 0} if col else {})}
        else:
            raise ValueError(
                f"yafsdp.integrations.tp_plans: {mname!r} is a {type(module).__name__}; llama_tp_plan splits "
                "nn.Linear and nn.Embedding modules only (torch's ColwiseParallel / RowwiseParallel)")
        for attr, d in split.items():
            p = module._parameters.get(attr)
            if p is None:
                continue
            shape = list(p.shape)
            chunk = -(-shape[d] // tp)
            shape[d] = max(0, min(chunk, shape[d] - tp_rank * chunk))
            out[canonical[id(p)]] = torch.Size(shape)
    return out
