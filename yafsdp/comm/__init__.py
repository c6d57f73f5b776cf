"""Communication: the schedule that orders gathers and reduces (``schedule``: the interface and its
CUDA stream + event and gloo handle implementations), the one seam over torch.distributed
(``collectives``), process-group helpers (``groups``), HSDP's replica sync (``hsdp``) and the narrow
reduce with fp32 accumulation (``reduce_accum``)."""

from .checked import CheckedSchedule, make_schedule
from .cuda import CudaStreams, StreamSchedule, use_stream_api
from .gloo import HandleSchedule
from .schedule import Schedule, StreamAPI

__all__ = ["StreamAPI", "CudaStreams", "Schedule", "StreamSchedule", "HandleSchedule", "CheckedSchedule",
           "make_schedule", "use_stream_api"]
