"""Tools around the engine: labels and the timeline recorder (``trace``), measuring a step
(``measure``), the CPU checker of the CUDA stream schedule (``streamcheck``), the model presets of the
plan CLI, jobs and benchmarks (``presets``). Also importable as ``yafsdp.trace``, ``yafsdp.measure``,
``yafsdp.streamcheck``, ``yafsdp.presets``."""
