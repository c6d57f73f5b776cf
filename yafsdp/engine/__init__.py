"""The engine: the runtime and its step protocol (forward gathers, the backward gate, a gradient's
path to its grad shard, HSDP's all-reduce across replicas), the buffers, allocation and placement,
the autograd nodes and hooks, the original parameters' stand-ins, the shard registry and the
shard gradients the optimizer reads. docs/design.md has one line per module."""
