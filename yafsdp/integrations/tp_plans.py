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
"""
from __future__ import annotations

__all__ = ["llama_tp_plan"]


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
