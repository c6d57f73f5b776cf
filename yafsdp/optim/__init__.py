"""The optimizer seams: ``FusedAdamW``, the hooks around any optimizer's step, optimizer state
dicts over flat shards, and parameters no rank used. docs/design.md has one line per module."""
