"""Streamed training data: corpora read as they are trained on, never whole into memory.

Two kinds (``open_source`` picks them from ``--data``):
- ``.bin`` shards (a folder of them): token ids read window by window (``data.ConcatTokens``) in the
  batch order of ``data.Batches`` over their concatenation; the cursor stays the whole position.
- text rows (``TextStream``): parquet, arrow, csv or jsonl files (one, or a folder of them: its files
  of ``--data-split`` the way ``datasets`` finds splits), or a Hugging Face dataset name read with
  ``datasets.load_dataset(name, split=--data-split, streaming=True)``. Each rank reads only its part,
  tokenizes it on the fly in a background thread, and packs the documents, EOS after each, into
  windows of ``seq_len + 1`` tokens (consecutive windows share one token, as in ``Batches``).

[Note: streamed positions]
A document is a row, keyed ``(epoch, shard, row)``; a shard is a file (or one of a dataset's
``n_shards``). Rank ``r`` of ``W`` owns, each epoch,
- by shard (``shard`` mode, when there are at least ``W`` shards): the rows of shards
  ``s = r, r + W, ...``;
- by row (``row`` mode, fewer shards): the rows with ``(s + row) mod W = r`` of every shard;
and reads them in increasing ``(shard, row)``, the epochs one after another with no shuffle. Its
position is where its next window starts: ``(epoch, shard, row, offset)``, ``offset`` the index
of that token in the document's ids (its EOS included). The checkpoint's state holds every rank's
position; a resume at the same world size seeks each rank to its own and produces the same windows
token for token, so the losses match the uninterrupted run bit for bit.

At another world size, the old ranks' positions become a *filter*: a document is consumed if its
old owner's position is past it; the document an old rank was inside continues at that rank's
offset. The new ranks own the documents by the new world's rule, start at the earliest epoch any
old rank was in, skip consumed documents and begin partly read ones at their offset. So every
document of the epoch is trained on exactly once: none is skipped, none is read twice, and the
tokens of a document cut by the checkpoint are split between the old and the new ranks without gap
or overlap (only the packing into windows differs from a run that never changed size). A later
world change adds another filter (the state keeps them all). Skipping to the first unconsumed
document reads the rows before it (not tokenizing them): a one-off cost of the resume.
"""
from __future__ import annotations

import glob
import os
import queue
import re
import sys
import threading
import zlib

import numpy as np
import torch

from pretrain.data import ConcatTokens, DataError, TokenView  # noqa: F401 - the .bin readers live in data

TEXT_EXT = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".jsonl": "json", ".json": "json"}
_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


# --------------------------------------------------------------------------------- which source
def stream_kind(data: str | None, stream: bool = False) -> str | None:
    """"bins" (a folder of .bin shards), "text" (streamed rows) or None (``data.load_corpus``'s
    sources, read whole as before: nothing, a text file, a .jsonl unless ``stream``, a .bin, a
    folder of .txt/.jsonl unless ``stream``)."""
    if data is None:
        return None
    if os.path.isdir(data):
        files = _files_under(data)
        if any(f.endswith(".bin") for f in files):
            return "bins"
        if any(os.path.splitext(f)[1] in (".parquet", ".arrow", ".csv") for f in files):
            return "text"
        if stream and any(f.endswith((".jsonl", ".json")) for f in files):
            return "text"
        return None
    ext = os.path.splitext(data)[1]
    if os.path.isfile(data):
        if ext in (".parquet", ".arrow", ".csv") or (stream and ext in (".jsonl", ".json")):
            return "text"
        return None
    if not ext and _NAME.match(data) and not data.startswith("."):
        return "text"  # a Hugging Face dataset name (not a local path)
    return None


def _files_under(folder: str) -> list[str]:
    return sorted(p for p in glob.glob(os.path.join(folder, "**", "*"), recursive=True) if os.path.isfile(p))


def split_files(folder: str, split: str) -> list[str]:
    """The data files of ``split`` in ``folder`` as ``datasets.load_dataset(folder)`` resolves them:
    the ``configs`` of its README.md where it has them, else by name (``train-*``, ``train/``,
    ``data/train-*``, ...; a folder without split names is all ``train``); a ``save_to_disk``
    folder's ``.arrow`` files (not its ``state.json``)."""
    import datasets

    try:
        found = datasets.load_dataset_builder(folder).config.data_files or {}
    except Exception as e:  # noqa: BLE001 - datasets raises several kinds
        raise DataError(f"--data {folder!r}: datasets finds no data files in it ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:300]})") from None
    files = {str(k): list(v) for k, v in found.items()}
    if split not in files:
        raise DataError(f"--data {folder!r} has no split {split!r} (it has {', '.join(sorted(files))}); "
                        "set --data-split / --val-split")
    out = [f for f in files[split] if os.path.splitext(f)[1] in TEXT_EXT or f.endswith(".bin")]
    if not out:
        raise DataError(f"--data {folder!r}: split {split!r} holds no .parquet/.arrow/.csv/.jsonl files")
    return sorted(out)


# ----------------------------------------------------------------------------------- .bin shards
def bin_shards(data: str, dtype: str) -> ConcatTokens:
    files = [f for f in _files_under(data) if f.endswith(".bin")]
    return ConcatTokens(files, dtype)


# ------------------------------------------------------------------------------------- text rows
class Shard:
    """One file (or one shard of a streamed dataset): ``rows(start)`` yields ``(row, text)``."""

    def __init__(self, name: str, column: str, path: str | None = None, dataset=None):
        self.name, self.column, self.path, self.dataset = name, column, path, dataset

    def _bad(self, what: str, row: int | None = None) -> DataError:
        where = f"{self.name!r}" + (f" row {row}" if row is not None else "")
        return DataError(f"--data {where}: {what}")

    def rows(self, start: int = 0):
        if self.path is not None and self.path.endswith(".parquet"):
            yield from self._parquet_rows(start)
            return
        yield from self._dataset_rows(start)

    def _parquet_rows(self, start: int):
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(self.path)
        except Exception as e:  # noqa: BLE001 - ArrowInvalid, OSError, ...
            raise self._bad(f"not a readable parquet file ({type(e).__name__}: {e})") from None
        names = pf.schema_arrow.names
        if self.column not in names:
            raise self._bad(f"no column {self.column!r} (it has {', '.join(names)}); set --data-column")
        md = pf.metadata
        first = 0
        for g in range(md.num_row_groups):
            n = md.row_group(g).num_rows
            if first + n <= start:
                first += n
                continue
            row = first
            batches = pf.iter_batches(batch_size=1024, row_groups=[g], columns=[self.column])
            while True:  # 1024 rows at a time: memory bounded by that, not by the row group
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                except Exception as e:  # noqa: BLE001
                    raise self._bad(f"cannot read row group {g} (rows {first}-{first + n - 1}): "
                                    f"{type(e).__name__}: {e}", row) from None
                values = batch.column(0).to_pylist()
                for i, v in enumerate(values):
                    if row + i >= start:
                        yield row + i, self._text(v, row + i)
                row += len(values)
            first += n

    def _dataset_rows(self, start: int):
        ds = self.dataset
        if ds is None:
            import datasets

            builder = TEXT_EXT[os.path.splitext(self.path)[1]]
            try:
                ds = datasets.load_dataset(builder, data_files=[self.path], split="train", streaming=True)
            except Exception as e:  # noqa: BLE001
                raise self._bad(f"cannot read it ({type(e).__name__}: {e})") from None
        it = iter(ds)
        row = 0
        while True:
            try:
                rec = next(it)
            except StopIteration:
                return
            except Exception as e:  # noqa: BLE001 - a parse error in the middle of the file
                raise self._bad(f"cannot read it ({type(e).__name__}: {str(e).splitlines()[0][:200]})", row) from None
            if row >= start:
                if self.column not in rec:
                    raise self._bad(f"no column {self.column!r} (it has {', '.join(rec)}); set --data-column", row)
                yield row, self._text(rec[self.column], row)
            row += 1

    def _text(self, value, row: int) -> str:
        if not isinstance(value, str):
            raise self._bad(f"column {self.column!r} holds {type(value).__name__}, not text", row)
        return value


def text_shards(data: str, column: str, split: str) -> tuple[list[Shard], str]:
    """The shards of a streamed text source and a description for the header."""
    if os.path.isdir(data):
        files = split_files(data, split)
        return [Shard(f, column, path=f) for f in files], f"{data} ({len(files)} files of split {split!r})"
    if os.path.isfile(data):
        return [Shard(data, column, path=data)], data
    import datasets

    try:
        ds = datasets.load_dataset(data, split=split, streaming=True)
    except Exception as e:  # noqa: BLE001 - not found, no network, bad split, ...
        raise DataError(f"--data {data!r}: not a local path, and datasets.load_dataset cannot open it as a "
                        f"dataset name ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None
    n = int(getattr(ds, "num_shards", None) or getattr(ds, "n_shards", 1) or 1)
    shards = [Shard(f"{data}[{split}] shard {s}/{n}", column, dataset=ds.shard(num_shards=n, index=s) if n > 1 else ds)
              for s in range(n)]
    return shards, f"dataset {data} (split {split!r}, {n} shard(s), streamed)"


def owner(mode: str, world: int, shard: int, row: int) -> int:
    """The rank that reads ``(shard, row)``; see [Note: streamed positions]."""
    return shard % world if mode == "shard" else (shard + row) % world


def _consumed(f: dict, key: tuple) -> int | None:
    """Under filter ``f``: None if document ``key`` = (epoch, shard, row) is unread, -1 if read,
    else the offset its reading continues at."""
    r = owner(f["mode"], f["world"], key[1], key[2])
    e, s, row, off = f["positions"][r]
    if key < (e, s, row):
        return -1
    if key == (e, s, row) and off > 0:
        return off
    return None


class Packer:
    """Documents of one rank in, windows of ``seq_len + 1`` tokens out, each with the position of
    the next window's first token (see [Note: streamed positions])."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.buf = np.zeros(0, dtype=np.int64)
        self.segs: list[list] = []  # [key, offset of buf's first token of this doc ... ] per doc in buf
        self.seg_start: list[int] = []  # index in buf where each doc's part starts

    def add(self, key: tuple, ids: np.ndarray, offset: int):
        self.seg_start.append(len(self.buf))
        self.segs.append([key, offset])
        self.buf = np.concatenate([self.buf, ids[offset:]])
        while len(self.buf) >= self.seq_len + 1:
            w = self.buf[: self.seq_len + 1].copy()
            self.buf = self.buf[self.seq_len:]
            # drop the documents that end before the next window's start
            k = 0
            while k + 1 < len(self.seg_start) and self.seg_start[k + 1] <= self.seq_len:
                k += 1
            self.segs, self.seg_start = self.segs[k:], self.seg_start[k:]
            self.segs[0][1] += self.seq_len - self.seg_start[0]
            self.seg_start = [0] + [s - self.seq_len for s in self.seg_start[1:]]
            key0, off0 = self.segs[0]
            yield w, (*key0, int(off0))


class TextStream:
    """The windows of rank ``rank`` of ``world`` from text shards (see [Note: streamed positions]),
    tokenized and packed ahead in a background thread."""

    def __init__(self, shards: list[Shard], tokenizer, seq_len: int, rank: int, world: int, vocab: int,
                 prefetch: int = 64):
        self.shards, self.tok, self.seq_len = shards, tokenizer, seq_len
        self.rank, self.world, self.vocab = rank, world, vocab
        self.mode = "shard" if len(shards) >= world else "row"
        self.filters: list[dict] = []
        self.start = (0, 0, 0, 0)
        self.pos = self.start  # of the next window handed out
        self.prefetch = prefetch
        self._thread = None
        self._q: queue.Queue | None = None
        self._stop = threading.Event()
        self.reading: str | None = None  # the shard the background thread reads (named by close)

    # -- state
    def state(self) -> dict:
        return dict(mode=self.mode, world=self.world, position=list(self.pos), filters=self.filters)

    def restore(self, states: list[dict]) -> str:
        """Continue from every old rank's ``state()`` (the checkpoint's); returns what was done."""
        if self._thread is not None:
            raise RuntimeError("restore before the first window")
        old_world = len(states)
        self.filters = [dict(f) for f in states[0]["filters"]]
        if old_world == self.world and states[0]["mode"] == self.mode:
            self.start = self.pos = tuple(states[self.rank]["position"])
            return "each rank at its own position"
        positions = [tuple(s["position"]) for s in states]
        self.filters.append(dict(mode=states[0]["mode"], world=old_world, positions=[list(p) for p in positions]))
        self.start = self.pos = (min(p[0] for p in positions), 0, 0, 0)
        return (f"{old_world} -> {self.world} ranks: every document not yet read is read once, none twice "
                "(documents cut by the checkpoint continue at their next token)")

    # -- documents and windows
    def _owned_shards(self):
        n = len(self.shards)
        return range(self.rank, n, self.world) if self.mode == "shard" else range(n)

    def _documents(self):
        epoch, s0, row0, off0 = self.start
        eos = self.tok.eos_id
        empty_epochs = 0
        while not self._stop.is_set():
            got = False
            for s in self._owned_shards():
                if (epoch, s) < (self.start[0], s0):
                    continue
                first = row0 if (epoch, s) == (self.start[0], s0) else 0
                shard = self.shards[s]
                self.reading = shard.name  # named by close() if the thread does not stop
                for row, text in shard.rows(first):
                    if self.mode == "row" and (s + row) % self.world != self.rank:
                        continue
                    key = (epoch, s, row)
                    off = off0 if (epoch, s, row) == self.start[:3] else 0
                    skip = False
                    for f in self.filters:
                        c = _consumed(f, key)
                        if c == -1:
                            skip = True
                        elif c is not None:
                            off = max(off, c)
                    if skip:
                        continue
                    got = True
                    ids = np.asarray(self.tok.encode(text), dtype=np.int64)
                    if eos is not None:
                        ids = np.concatenate([ids, [eos]])
                    if ids.size and int(ids.max()) >= self.vocab:
                        raise DataError(f"--data {shard.name!r} row {row}: token id {int(ids.max())} >= the "
                                        f"model's vocabulary {self.vocab} (wrong --tokenizer?)")
                    if off >= len(ids):
                        continue
                    yield key, ids, off
                    if self._stop.is_set():
                        return
            empty_epochs = 0 if got else empty_epochs + 1
            if empty_epochs >= 2:
                raise DataError(f"--data: rank {self.rank} of {self.world} has no documents to read "
                                f"({len(self.shards)} shard(s), {self.mode} mode); use fewer ranks or more data")
            epoch += 1

    def peek(self) -> None:
        """Read this rank's first window from its start, synchronously (the thread is not started):
        a bad file, column, row or token id raises DataError here."""
        gen = self.windows()
        try:
            next(gen)
        finally:
            gen.close()

    def windows(self):
        """(window, position after it) forever; the background thread's loop."""
        p = Packer(self.seq_len)
        for key, ids, off in self._documents():
            yield from p.add(key, ids, off)

    def _run(self):
        try:
            for item in self.windows():
                while not self._stop.is_set():
                    try:
                        self._q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            while not self._stop.is_set():  # (a full queue and a closed stream: nobody reads it)
                try:
                    self._q.put(e, timeout=0.1)
                    return
                except queue.Full:
                    continue

    def next_window(self) -> np.ndarray:
        if self._thread is None:
            self._q = queue.Queue(maxsize=self.prefetch)
            self._thread = threading.Thread(target=self._run, name=f"data-rank{self.rank}", daemon=True)
            self._thread.start()
        item = self._q.get()
        if isinstance(item, BaseException):
            self._q.put(item)  # every later call raises it too
            raise item
        w, self.pos = item
        return w

    def close(self, timeout: float = 10.0) -> None:
        """Stop the background thread and wait for it (up to ``timeout`` s): it stops between two
        documents. A thread left reading a parquet file (pyarrow's C++ readers) at interpreter exit
        can end the process with ``terminate called without an active exception`` (exit -6)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
            if t.is_alive():  # a read that does not return (a remote file system, a stalled download)
                print(f"data: rank {self.rank}'s reader did not stop within {timeout:g} s (still reading "
                      f"{self.reading!r}); the process goes on without waiting for it",
                      file=sys.stderr, flush=True)


def check_shards(stream: TextStream) -> None:
    """The local files this rank reads exist, are readable, hold the column and are not empty
    (parquet: its footer only; others: their size). DataError naming the file."""
    import pyarrow.parquet as pq

    for s in stream._owned_shards():
        sh = stream.shards[s]
        if sh.path is None:
            continue
        if os.path.getsize(sh.path) == 0:
            raise DataError(f"--data {sh.path!r}: an empty shard (0 bytes); delete it or write it again")
        if sh.path.endswith(".parquet"):
            try:
                pf = pq.ParquetFile(sh.path)
            except Exception as e:  # noqa: BLE001
                raise DataError(f"--data {sh.path!r}: not a readable parquet file ({type(e).__name__}: {e})") from None
            if sh.column not in pf.schema_arrow.names:
                raise DataError(f"--data {sh.path!r}: no column {sh.column!r} (it has "
                                f"{', '.join(pf.schema_arrow.names)}); set --data-column")
            if pf.metadata.num_rows == 0:
                raise DataError(f"--data {sh.path!r}: an empty shard (0 rows); delete it or write it again")


class StreamBatches:
    """``Batches``' interface over this rank's ``TextStream``: each ``micro_batch`` call takes the
    next ``batch`` windows (the calls must come in the job's order: the cursor is checked, not
    used to seek). ``fixed``: the same first windows at every call (validation)."""

    windows = None  # unknown: a stream has no length

    def __init__(self, stream: TextStream, description: str, identity: dict, fixed: bool = False):
        self.stream, self.description, self.identity, self.fixed = stream, description, identity, fixed
        self.seq_len = stream.seq_len
        self._expect = None
        self._cache: list[np.ndarray] = []

    def micro_batch(self, cursor: int, micro: int, rank: int, world: int, batch: int) -> torch.Tensor:
        if (rank, world) != (self.stream.rank, self.stream.world):
            raise RuntimeError(f"stream of rank {self.stream.rank}/{self.stream.world} asked for rank {rank}/{world}")
        if self.fixed:
            while len(self._cache) < (micro + 1) * batch:
                self._cache.append(self.stream.next_window())
            return torch.from_numpy(np.stack(self._cache[micro * batch:(micro + 1) * batch]))
        first = cursor + micro * world * batch
        if self._expect is not None and first != self._expect:
            raise RuntimeError(f"streamed batches must be read in order: sample {first} asked, {self._expect} next")
        self._expect = first + world * batch
        return torch.from_numpy(np.stack([self.stream.next_window() for _ in range(batch)]))

    def epoch_of(self, cursor: int) -> float:
        return float(self.stream.pos[0])

    def fingerprint(self) -> dict:
        crc = zlib.crc32(repr(sorted(self.identity.items())).encode())
        return dict(tokens=-1, crc32=f"{crc:08x}", source=self.description)

    def state(self) -> dict:
        return self.stream.state()

    def close(self) -> None:
        self.stream.close()
