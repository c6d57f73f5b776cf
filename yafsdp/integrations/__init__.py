"""What the engine meets outside itself: Hugging Face safetensors load and export (``hf``,
``hf_stream``, ``hf_export``, ``export``), PEFT adapters and QLoRA bases (``adapters``, ``peft_load``),
world-size-independent meta initialisation (``init``), transformers.Trainer / TRL (``trainer``).
Each is also importable at its documented path (``yafsdp.hf``, ``yafsdp.adapters``, ...)."""
