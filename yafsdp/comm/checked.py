"""Which schedule an engine gets (:func:`make_schedule`), and the debug mode that checks every
collective across ranks first (:class:`CheckedSchedule`, ``YAFSDP_DEBUG_SYNC=1``)."""
from __future__ import annotations

import torch

from .groups import check_collective, debug_sync
from .cuda import _STREAM_API_OVERRIDE, CudaStreams, StreamSchedule
from .gloo import HandleSchedule
from .schedule import Schedule

__all__ = ["CheckedSchedule", "make_schedule"]


class CheckedSchedule:
    """Debug mode: ``inner`` with every gather and reduce checked across ranks first; everything
    else (ordering methods, the comm stream, the recorder) is the inner schedule's."""

    def __init__(self, inner: Schedule, group):
        self.inner = inner
        self.group = group

    @property
    def recorder(self):  # a property, so that setting it reaches the inner schedule
        return self.inner.recorder

    @recorder.setter
    def recorder(self, rec):
        self.inner.recorder = rec

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)

    def gather(self, sync, out, shard, unit, expand=None, stage=None, group=None):
        # a secondary gather is checked over the whole shard group too: every rank issues it in the same order
        check_collective(f"{'gather' if group is None else 'secondary gather'} of unit {unit!r}", self.group)
        self.inner.gather(sync, out, shard, unit, expand, stage, group)

    def reduce(self, sync, out, full, unit, then, pieces=False, collective=None):
        what = "quantized reduce" if collective is not None else "all-to-all" if pieces else "reduce-scatter"
        check_collective(f"{what} of unit {unit!r}", self.group)
        self.inner.reduce(sync, out, full, unit, then, pieces, collective)

    def reduce_rows_into(self, target, full, unit):
        check_collective(f"reduce-scatter of unit {unit!r}", self.group)
        self.inner.reduce_rows_into(target, full, unit)

    def gather_rows_into(self, out, shard, unit):
        check_collective(f"gather of unit {unit!r}", self.group)
        self.inner.gather_rows_into(out, shard, unit)

    def replicate(self, grad, unit):
        check_collective(f"all-reduce across replicas of {unit!r}", self.inner.replicate_group)
        self.inner.replicate(grad, unit)


def make_schedule(device: torch.device, group, replicate_group=None) -> Schedule:
    """The schedule for an engine on ``device``: the stream schedule on CUDA (or over a
    :func:`use_stream_api` override), work handles elsewhere; checked across ranks in debug mode.
    ``replicate_group``: HSDP's group across replicas (see yafsdp/comm/hsdp.py), or None."""
    if _STREAM_API_OVERRIDE:
        schedule = StreamSchedule(_STREAM_API_OVERRIDE[-1], group, replicate_group)
    elif device.type == "cuda":
        schedule = StreamSchedule(CudaStreams(device), group, replicate_group)
    else:
        schedule = HandleSchedule(group, replicate_group)
    return CheckedSchedule(schedule, group) if debug_sync() else schedule
