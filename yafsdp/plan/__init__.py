"""The memory plan: bytes per rank by role, computed without allocating.

    model.memory_plan(batch=4, seq=2048)                   # a wrapped model (YaFSDP)
    yafsdp.plan.memory_plan(meta_model, world_size=64)     # a plain model, e.g. on the meta device
    python -m yafsdp plan --preset llama3-8b --world-size 64 --param-dtype bf16 --batch 1 --seq 8192

[Note: one plan, one allocator]
The engine's buffers are sized by :func:`plan_buffers` and nothing else: the runtime's allocator calls
it, and the plan of a model that has never been wrapped calls it on layouts built by the engine's
own unit discovery (``units.discover``) and ``FlatLayout.build``. So the plan equals what the
engine allocates, byte for byte (tests/unit/test_plan.py checks it against ``allocated_bytes()``).

What the engine allocates per rank (Psi parameters, N ranks, every count padded as the engine pads):
- master shard (fp32) 4 Psi/N, grad shard (fp32) 4 Psi/N, compute copy (param_dtype; none in fp32)
- weight buffers: two in param_dtype holding the largest regular unit each (ZeRO-2: one per unit)
- grad buffers: two in reduce_dtype, each with a shard-sized reduce-scatter staging area on gloo
  (none on NCCL, which reduces in place: [Note: reduce-scatter in place] in comm/collectives.py)
- the small group (all 1-D parameters): its own weight and grad buffer
- outsized units (not a repeated block, padded size > outsized_ratio x the largest block; see
  [Note: outsized units]; a 128k-vocab embedding or head): one weight buffer they share, so they
  do not set the size of the pair; their gradients go through the grad pair in chunks ([Note:
  chunked outsized gradients] in sizing.py; ``chunk_outsized_grads=False`` or offload: one grad
  buffer they share)
Outside the engine and estimated here: optimizer state (AdamW: fp32 m and v, 8 bytes per shard
element) and activations.

[Note: activation estimate]
Activations are traced, not guessed: a copy of the model on the meta device runs one forward on
(batch, seq) inputs under ``saved_tensors_hooks``, and every tensor autograd saves for backward is
counted once per storage (parameters excluded: they are the engine's weight buffers). This is
exact for the model's own code, with one substitution: on the meta device SDPA would take its
"math" path and save the (seq x seq) attention probabilities, which the fused kernels used on GPU
(flash / memory-efficient) and on CPU (flash-for-CPU) do not; so SDPA is replaced during the trace
by a stand-in that saves what a fused kernel saves (q, k, v, output, fp32 logsumexp).
``attention="math"`` keeps the quadratic path. Under tensor parallelism the copy is parallelized as the
model is and each saved DTensor counted by its local slice ([Note: the activation trace under tensor
parallelism] in activations.py). With activation checkpointing (HF's per-layer
checkpoint), a block keeps only its inputs, and one block's activations live again during its
recompute (a chosen subset: [Note: the peak of a checkpointed set] in activations.py; the choice
of the subset for a memory budget: [Note: choosing the checkpointed blocks] in choose.py). The backward adds a transient the trace cannot see. Its peak is the larger of: two
tensors the size of the largest saved one, live while that one is still held (for a causal LM the
fp32 log-softmax of the logits: its incoming gradient and the logits' gradient), and the largest
unit's weight gradients as autograd produces them before the engine copies them into the grad
buffer (by then the log-softmax output has been freed, which makes room for the logits'
gradient). On CPU (fake process group, tests/unit/test_plan.py) plan and measured peak agree within a
few percent.
"""
from .activations import ActivationTrace, activation_estimate, activation_trace
from .choose import (
    CheckpointChoice, apply_checkpointing, checkpointed_blocks, choose_checkpointing, configure_checkpointing,
    parse_bytes,
)
from .cli import main
from .build import memory_plan
from .report import ActivationEstimate, MemoryPlan, UnitRow
from ..layout.sizing import OPTIMIZER_BYTES, BufferPlan, BufferSpec, plan_buffers, repeated_blocks, unit_align

__all__ = ["ActivationEstimate", "ActivationTrace", "BufferPlan", "BufferSpec", "CheckpointChoice", "MemoryPlan",
           "OPTIMIZER_BYTES", "UnitRow", "activation_estimate", "activation_trace", "apply_checkpointing",
           "checkpointed_blocks", "choose_checkpointing", "configure_checkpointing", "main", "memory_plan",
           "parse_bytes", "plan_buffers", "repeated_blocks", "unit_align"]
