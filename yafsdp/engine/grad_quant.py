"""The engine's side of ``grad_quant``: the process groups of the quantized reduce and which grad
buffer uses which room. The collectives themselves, their rooms and their error bound are in
yafsdp/comm/quant_reduce.py ([Note: quantized gradient reduction]); the plan sizes the rooms
(``layout.sizing.quant_plan``, ``plan_buffers(quant=)``)."""
from __future__ import annotations

import torch.distributed as dist

from ..comm.quant_reduce import QuantAllReduce, QuantReduce
from ..comm.subgroups import consecutive_subgroups, strided_subgroups
from ..layout.sizing import QuantPlan

__all__ = ["connect"]


def connect(rt, grad_buffers: list, plan: QuantPlan | None) -> None:
    """Collective over the world (every rank builds the same subgroups): give each grad buffer of
    ``rt`` its quantized reduce when its shard group spans several node groups, and the schedule the
    quantized all-reduce across replicas (HSDP). Nothing when ``plan`` is None."""
    if plan is None:
        return
    regular = [gb for gb in grad_buffers if gb.name != "replica"]
    if plan.nodes > 1:
        node_group = consecutive_subgroups(rt.group, plan.node, what="grad_quant_node") if plan.node > 1 else None
        cross_group = strided_subgroups(rt.group, plan.node, what="grad_quant_node")
        qr = QuantReduce(plan.codec, rt.world_size, dist.get_rank(rt.group), plan.node, node_group, cross_group,
                         in_place=not plan.staged)
        for gb in regular:
            gb.quant_reduce = qr.on(gb.quant)
    if plan.replicas > 1:
        room = next(gb.quant for gb in grad_buffers if gb.name == "replica")
        segment = max(gb.capacity // rt.world_size for gb in regular)
        rt.schedule.use_across(QuantAllReduce(plan.codec, rt.replicate_group, room, segment))
