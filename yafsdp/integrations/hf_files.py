"""The files of a Hugging Face checkpoint folder: which safetensors files hold the weights (one
``model.safetensors``, or the shards its ``model.safetensors.index.json`` lists) and the error that
names a file that cannot be used. A leaf module: ``hf`` (loading, export) and ``hf_stream`` (the
streaming reader) both build on it."""
from __future__ import annotations

import json
import os


WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint folder that cannot be used; the message names the file."""


def weight_files(path: str) -> list[str]:
    """The safetensors files of checkpoint ``path``: one file, or the shards its index lists."""
    single, index = os.path.join(path, WEIGHTS), os.path.join(path, INDEX)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise HFCheckpointError(f"{index!r} is not a safetensors index ({e})") from None
        files = [os.path.join(path, s) for s in shards]
        for f in files:
            if not os.path.isfile(f):
                raise HFCheckpointError(f"{index!r} lists {os.path.basename(f)!r}, which is missing")
        return files
    raise HFCheckpointError(f"{path!r} holds no {WEIGHTS} or {INDEX} (only safetensors weights are read)")
