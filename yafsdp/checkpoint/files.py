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
           "fsync_dir", "write_json_atomic", "remove_checkpoint", "publish_checkpoint", "rotate_checkpoints",
           "OLD_PREFIX", "remove_trash", "PINS", "pin_checkpoint", "pinned_checkpoints"]

FORMAT = "yafsdp-checkpoint/1"
MANIFEST = "checkpoint.json"  # completion marker and manifest
PREFIX = "step_"
TMP_PREFIX = ".tmp."
TRASH_PREFIX = ".trash."
OLD_PREFIX = ".old."  # a checkpoint being replaced by a new save of its step; see publish_checkpoint
PINS = "pinned.json"  # checkpoints that rotation keeps beyond ``keep``: see pin_checkpoint
_STEP_RE = re.compile(rf"^{PREFIX}(\d+)$")
_OLD_RE = re.compile(rf"^{re.escape(OLD_PREFIX)}{PREFIX}(\d+)$")


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
    """Complete checkpoints (those with a manifest) under ``root``, oldest first. A replacement
    interrupted between its two renames (see ``publish_checkpoint``) left the step's previous
    checkpoint as ``.old.step_N``: it is the step's checkpoint while no ``step_N`` is there."""
    out = {}
    if not os.path.isdir(root):
        return []
    names = os.listdir(root)
    for name in names:
        m = _STEP_RE.match(name) or _OLD_RE.match(name)
        path = os.path.join(root, name)
        if not m or not os.path.isfile(os.path.join(path, MANIFEST)):
            continue
        step = int(m.group(1))
        if step not in out or _STEP_RE.match(name):  # step_N wins over its .old.step_N
            out[step] = path
    return sorted(out.items())


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
        for root in (path, os.path.join(path, "checkpoints")):  # a folder of checkpoints, or a job's run folder
            found = list_checkpoints(root)
            if found:
                raise CheckpointError(
                    f"{path!r} is not a checkpoint but a folder holding {len(found)} (in {root!r}); pass one of them, "
                    f"e.g. the newest complete one: {found[-1][1]!r}")
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
    """Rename out of sight first (atomic), then delete: a half-deleted checkpoint is never visible.
    A symbolic link is removed as a link: what it points to (possibly outside ``root``) is never
    followed or deleted."""
    trash = os.path.join(root, f"{TRASH_PREFIX}{os.path.basename(path)}.{os.getpid()}")
    os.rename(path, trash)
    _remove(trash)
    remove_trash(root)


def _remove(path: str) -> None:
    if os.path.islink(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def remove_trash(root: str) -> None:
    """Delete the leftovers of removals a kill interrupted (``.trash.*``: never read; links unlinked)."""
    for name in os.listdir(root):
        if name.startswith(TRASH_PREFIX):
            _remove(os.path.join(root, name))


def pinned_checkpoints(root: str) -> dict[str, dict]:
    """The pinned checkpoints of ``root``: directory name -> why (``pin_checkpoint``)."""
    try:
        with open(os.path.join(root, PINS)) as f:
            pins = json.load(f)
        return pins if isinstance(pins, dict) else {}
    except (OSError, ValueError):
        return {}


def pin_checkpoint(path: str, reason: str, **info) -> None:
    """Keep the complete checkpoint ``path`` whatever ``keep`` says (rotation skips it); ``reason``
    and ``info`` are recorded in ``<root>/pinned.json``. Not collective: one process writes."""
    root, name = os.path.dirname(os.path.abspath(path)), os.path.basename(os.path.normpath(path))
    pins = pinned_checkpoints(root)
    pins[name] = dict(reason=reason, **info)
    write_json_atomic(os.path.join(root, PINS), pins)




def publish_checkpoint(tmp: str, final: str, root: str) -> None:
    """Rename the complete save ``tmp`` (manifest written) to ``final``.

    [Note: replacing a checkpoint] A checkpoint of the same step already there (a run resumed
    from further back) goes only once the new one is in place: it is renamed aside to
    ``.old.step_N``, the new one renamed to ``step_N``, then the old one deleted. A kill between
    the renames leaves ``.old.step_N`` (complete) and the new save as ``.tmp.step_N``: discovery
    (``list_checkpoints``) reads the former as the step's checkpoint, and the next save puts it
    back (``_restore_replaced``) before it drops the ``.tmp.*``. A kill after the second rename
    leaves ``step_N`` (the new one) and a stale ``.old.step_N``, removed by the next save. So at
    every moment there is a complete checkpoint of the step. A failed rename (OSError) puts the
    old one back and raises."""
    _restore_replaced(root)
    aside = None
    if os.path.isdir(final):
        aside = os.path.join(root, OLD_PREFIX + os.path.basename(final))
        os.rename(final, aside)
        fsync_dir(root)
    try:
        os.rename(tmp, final)
    except OSError:
        if aside is not None:
            os.rename(aside, final)
        raise
    fsync_dir(root)
    if aside is not None:
        remove_checkpoint(aside, root)


def _restore_replaced(root: str) -> None:
    """Finish replacements a kill interrupted (see [Note: replacing a checkpoint]): an
    ``.old.step_N`` goes back to ``step_N`` where that is absent, and is deleted where the new
    ``step_N`` is complete."""
    for name in sorted(os.listdir(root)):
        m = _OLD_RE.match(name)
        if not m:
            continue
        old, final = os.path.join(root, name), os.path.join(root, f"{PREFIX}{m.group(1)}")
        if os.path.isfile(os.path.join(final, MANIFEST)):
            remove_checkpoint(old, root)
        elif not os.path.exists(final):
            os.rename(old, final)
            fsync_dir(root)


def rotate_checkpoints(root: str, step: int, keep: int) -> list[str]:
    """After the save of ``step``: delete the complete checkpoints of steps up to ``step`` beyond
    the newest ``keep`` of them (the one just written counts and is never deleted). Checkpoints of
    later steps -- a continuation the caller went back from -- are not older than the new one and
    are left alone (the pretraining job sets them aside before it saves; see
    examples/pretrain/rundir.py). Pinned checkpoints (``pin_checkpoint``) are neither deleted nor
    counted. Returns the deleted paths."""
    pins = pinned_checkpoints(root)
    older = [path for s, path in list_checkpoints(root) if s <= step and os.path.basename(path) not in pins]
    gone = older[:-keep] if keep > 0 else []
    for path in gone:
        remove_checkpoint(path, root)
    return gone
