"""The layout: which modules are units, how a unit's parameters lie in flat groups, the validated
engine options, and the sizing of every buffer -- what the allocator (engine/alloc.py) and the
memory plan (yafsdp.plan) both read. docs/design.md has one line per module."""
