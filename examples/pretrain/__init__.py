"""Helpers of ``examples/pretrain_llama.py``: presets, data, progress and operations."""
