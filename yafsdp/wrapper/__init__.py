"""The module facade: ``YaFSDP`` (the wrapper users hold: its arguments, forward and methods), its
device anchor, state dicts, full views of parameters and gradients, EMA. docs/design.md has one
line per module."""
