"""Loading a checkpoint never runs code from it.

[Note: loading runs no code from the checkpoint]
A checkpoint directory is data someone may have edited: its manifest's CRC-32s prove only that
the files are the ones the manifest lists, and whoever edits a file can recompute them. Two
parts of a DCP checkpoint are pickles that torch reads with full unpickling:

- ``.metadata`` (``FileSystemReader.read_metadata``: ``pickle.load``). :class:`SafeReader`
  reads it with :class:`MetadataUnpickler`, which resolves only the classes DCP's metadata is
  made of (``torch.distributed.checkpoint.metadata``'s dataclasses, ``filesystem._StorageInfo``,
  ``torch.Size``, the dtypes and layouts, ``pathlib`` paths); any other global -- ``os.system``,
  ``builtins.eval``, a class of the attacker's choosing -- is refused before it is called, with
  the file named.
- the byte items (``state``, ``rank_state``, the optimizer's param groups and non-tensor state;
  DCP's ``DefaultLoadPlanner.load_bytes`` reads them with ``torch.load(weights_only=False)``).
  Ours (``dcp_glue.LoadPlanner``) reads them with ``weights_only=True``, and :func:`encode`
  makes sure at save time that these values need no more: tensors, numpy arrays (as a tagged
  byte tensor, see ``_ND``), numbers, strings, bytes, None and dicts / lists / tuples of them.
  Anything else is refused at save time naming its place (``rank_state['x']``), so that a
  checkpoint we write always loads.

Tensor data is read by DCP with ``torch.load(weights_only=True)`` already. The manifest is JSON.
"""
from __future__ import annotations

import io
import os
import pickle
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from .files import CheckpointError

__all__ = ["SafeReader", "MetadataUnpickler", "encode", "decode", "load_bytes"]

# module -> names a DCP .metadata may refer to (torch 2.4 ... 2.13 write these; see the
# Metadata dataclasses in torch/distributed/checkpoint/metadata.py and _StorageInfo /
# _StoragePrefix in filesystem.py).
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},  # a lookup of torch's layout objects by name
    "torch": {"Size"},  # and the dtypes (torch.float32, ...), checked below
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata classes and nothing else; ``file`` is named in the refusal."""

    def __init__(self, stream, file: str):
        super().__init__(stream)
        self.file = file

    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"checkpoint file {self.file!r} refers to {module}.{name}, which DCP's metadata never holds: "
            "loading it could run code from the file, so it is refused. Do not load this checkpoint; "
            "if you wrote it yourself, re-save it with yafsdp.checkpoint"
        )


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with ``.metadata`` read by :class:`MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = MetadataUnpickler(f, str(path)).load()
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - a damaged pickle: name the file
                raise CheckpointError(f"checkpoint file {str(path)!r} is not readable DCP metadata "
                                      f"({type(e).__name__}: {e})") from None
        if type(metadata).__name__ != "Metadata":
            raise CheckpointError(f"checkpoint file {str(path)!r} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def file_of(self, storage_index) -> str:
        """The data file that holds a read item (for error messages)."""
        info = (self.storage_data or {}).get(storage_index)
        return os.path.join(str(self.path), info.relative_path) if info is not None else str(self.path)


# ------------------------------------------------------------------------ values of byte items
_ND = "__yafsdp_ndarray__"  # a numpy array: {_ND: uint8 tensor of its bytes, "dtype": str, "shape": list}


def encode(x, where: str):
    """``x`` in a form ``torch.load(weights_only=True)`` reads back (see [Note: loading runs no
    code from the checkpoint]); CheckpointError naming ``where`` for anything else."""
    if x is None or isinstance(x, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return x
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:
            raise CheckpointError(f"{where} is a numpy array of Python objects: a checkpoint holds no pickled "
                                  "objects; convert it to numbers")
        raw = np.ascontiguousarray(x).tobytes()
        return {_ND: torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8),
                "dtype": x.dtype.str, "shape": list(x.shape)}
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise CheckpointError(f"{where} has a key of type {type(k).__name__}; use str or int keys")
            out[k] = encode(v, f"{where}[{k!r}]")
        return out
    if isinstance(x, (list, tuple)):
        items = [encode(v, f"{where}[{i}]") for i, v in enumerate(x)]
        return items if isinstance(x, list) else tuple(items)
    raise CheckpointError(
        f"{where} is a {type(x).__module__}.{type(x).__qualname__}: a checkpoint holds only tensors, numpy arrays, "
        "numbers, strings, bytes, None and dicts / lists / tuples of them (no pickled objects, so that loading a "
        "checkpoint never runs code from it); convert it to those"
    )


def decode(x):
    """Inverse of :func:`encode`."""
    if isinstance(x, dict):
        if _ND in x and set(x) == {_ND, "dtype", "shape"}:
            return np.frombuffer(x[_ND].numpy().tobytes(), dtype=np.dtype(x["dtype"])).reshape(x["shape"]).copy()
        return {k: decode(v) for k, v in x.items()}
    if isinstance(x, list):
        return [decode(v) for v in x]
    if isinstance(x, tuple):
        return tuple(decode(v) for v in x)
    return x


def _numpy_globals() -> list:
    """What a plain numpy array needs under weights_only: checkpoints written before ``encode``
    pickled ``rank_state``'s numpy RNG state as an array. Object arrays stay refused (their dtype
    class is left out)."""
    core = getattr(np, "_core", None) or np.core
    out = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        out += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType") and n != "ObjectDType"]
    return out


def load_bytes(value: io.BytesIO, fqn: str, file: str):
    """A byte item, read with ``weights_only=True``; CheckpointError naming the file otherwise."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return decode(torch.load(value, weights_only=True, map_location="cpu"))
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError (or others) for a refused global
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        why = next((x for x in lines if "WeightsUnpickler error" in x), lines[0] if lines else "")
        why = why.split(" was not an allowed global")[0].replace("WeightsUnpickler error: ", "")
        raise CheckpointError(
            f"checkpoint file {file!r}: entry {fqn!r} needs more than tensors, numbers and containers to load "
            f"({why}); loading it could run code from the file, so it is refused. Do not load this checkpoint"
        ) from None
