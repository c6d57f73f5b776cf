"""A checkpoint directory on disk: names, discovery, the manifest, checksums, atomic writes.

See [Note: atomic saves] in ``yafsdp/checkpoint/__init__.py``. Nothing here is collective.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import zlib

__all__ = ["CheckpointError", "CheckpointWarning", "describe_os_error", "unfinished_saves", "foreign_dirs", "FORMAT", "MANIFEST", "PREFIX", "TMP_PREFIX", "TRASH_PREFIX", "checkpoint_dir",
           "list_checkpoints", "incomplete_checkpoints", "latest_checkpoint", "read_manifest", "crc32",
           "fsync_dir", "write_json_atomic", "remove_checkpoint"]

FORMAT = "yafsdp-checkpoint/1"
MANIFEST = "checkpoint.json"  # completion marker and manifest
PREFIX = "step_"
TMP_PREFIX = ".tmp."
TRASH_PREFIX = ".trash."
_STEP_RE = re.compile(rf"^{PREFIX}(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the model; the message names
    the directory and, where one is at fault, the file."""


class CheckpointWarning(UserWarning):
    """Something under a checkpoint root was left alone (a ``step_*`` directory without a
    manifest): the message names the directory."""


def describe_os_error(e: BaseException) -> str:
    """``[Errno 28] No space left on device: 'path'`` -- the errno, its text and the path."""
    if isinstance(e, OSError) and e.errno is not None:
        where = f": {e.filename!r}" if e.filename else ""
        return f"[Errno {e.errno}] {e.strerror}{where}"
    return f"{type(e).__name__}: {e}"


def checkpoint_dir(root: str, step: int) -> str:
    return os.path.join(root, f"{PREFIX}{step:08d}")


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints (those with a manifest) under ``root``, oldest first."""
    out = []
    if not os.path.isdir(root):
        return out
    for name in os.listdir(root):
        m = _STEP_RE.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, MANIFEST)):
            out.append((int(m.group(1)), path))
    return sorted(out)


def incomplete_checkpoints(root: str) -> list[str]:
    """Directories under ``root`` that look like checkpoints but are not complete: saves in
    progress or killed (``.tmp.*``), and ``step_*`` directories without a manifest."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        if name.startswith(TMP_PREFIX) or (_STEP_RE.match(name) and not os.path.isfile(os.path.join(path, MANIFEST))):
            out.append(path)
    return out


def unfinished_saves(root: str) -> list[str]:
    """``.tmp.*`` directories under ``root``: saves in progress or killed. Never a complete
    checkpoint (the rename to ``step_*`` is the last act of a save), so safe to remove when no
    save is running."""
    return [p for p in incomplete_checkpoints(root) if os.path.basename(p).startswith(TMP_PREFIX)]


def foreign_dirs(root: str) -> list[str]:
    """``step_*`` directories under ``root`` without a manifest. A save never leaves one (it
    renames a complete ``.tmp.*``), so someone else put it there -- a copy in progress, a
    manifest deleted by hand: never read as a checkpoint and never deleted."""
    return [p for p in incomplete_checkpoints(root) if not os.path.basename(p).startswith(TMP_PREFIX)]


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under ``root`` (incomplete ones are skipped), or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint ``path``; CheckpointError naming the file if absent or unreadable."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    if not os.path.isfile(file):
        raise CheckpointError(f"checkpoint {path!r} is incomplete: {MANIFEST} is missing (a save was interrupted)")
    try:
        with open(file) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path!r}: {MANIFEST} is unreadable or corrupt ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path!r}: {MANIFEST} is not a {FORMAT} manifest (format={manifest.get('format')!r})"
            if isinstance(manifest, dict) else f"checkpoint {path!r}: {MANIFEST} is not a JSON object"
        )
    return manifest


def crc32(path: str, chunk: int = 1 << 24) -> str:
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj) -> None:
    tmp = path + ".part"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    fsync_dir(os.path.dirname(path))


def remove_checkpoint(path: str, root: str) -> None:
    """Rename out of sight first (atomic), then delete: a half-deleted checkpoint is never visible."""
    trash = os.path.join(root, f"{TRASH_PREFIX}{os.path.basename(path)}.{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
    for name in os.listdir(root):  # leftovers of an earlier interrupted removal
        if name.startswith(TRASH_PREFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


