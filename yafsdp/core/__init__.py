"""The engine core: ``YaFSDP`` and its options, unit discovery, flat groups, the runtime and its step
protocol, allocation and placement, the autograd hooks, state dicts, per-parameter views, the
optimizer seams (``FusedAdamW``, shard gradients, optimizer state). docs/design.md has one line per
module."""
