"""Tokenizers, corpora and the deterministic, resumable batch order of the pretraining job.

Data sources (``--data``):
- nothing: the embedded corpus, every ``examples/data/*.txt`` (public-domain texts), one document
  per file;
- a text file (any other extension): one document, UTF-8;
- ``.jsonl``: one JSON object per line, its ``--text-key`` field (default ``text``) a document;
- ``.bin``: pre-tokenized ids, a flat array of ``--data-dtype`` (default uint16) read by
  slices with ``os.pread`` (nanoGPT's format; see [Note: reading .bin files]); documents are already
  separated by the tokenizer's EOS;
- a directory: its ``*.txt`` and ``*.jsonl`` files, in name order.
Text is encoded with the byte-level tokenizer (default) or a local HF tokenizer (``--tokenizer``);
each document is followed by the tokenizer's EOS id.

[Note: batch order]
The token stream is cut into windows of ``seq_len + 1`` tokens starting at multiples of
``seq_len``. Epoch ``e`` visits the windows in an order keyed by ``(seed, e)``; sample ``g`` of
the run (counting from 0 over all epochs) is window ``order_e(g mod W)`` with ``e = g div W``.
A step takes the next ``world x grad_accum x batch`` samples from a global ``cursor``:
micro-batch ``m`` of rank ``r`` gets samples ``cursor + (m x world + r) x batch + [0, batch)``.
The cursor is all the data position there is: it goes into every checkpoint, with the name of
the order, so a resumed run sees exactly the samples the uninterrupted one would. Changing the
world size keeps the sample sequence; with ``batch`` and ``world x grad_accum`` unchanged it also
keeps each step's samples and their split into micro-batches.

[Note: window order]
``order_e`` is a permutation of ``0 .. W-1`` computed per sample, so nothing grows with the
corpus (``FeistelOrder``, named "feistel" in the checkpoint): a balanced Feistel network of six
rounds on ``2b`` bits, ``2^(2b)`` the first even power of two >= ``W`` (at least 4), each round
``L, R = R, L xor F(R, k_i)`` with ``F`` the splitmix64 finaliser of ``R xor k_i`` cut to ``b``
bits and the round keys ``k_i`` a BLAKE2b hash of ``(seed, e, i)``. A Feistel network is a
bijection of its ``2^(2b)`` values whatever ``F`` is; an index whose image is ``>= W`` is mapped
again until it lands below ``W`` ("cycle walking"), which keeps a bijection of ``0 .. W-1``
(the walk follows the permutation's cycle from the index, and that cycle returns to ``0 .. W-1``)
and takes fewer than 4 steps on average (the domain is under ``4 W``).
Before the order was named, epoch ``e`` was ``numpy.random.Generator(PCG64([seed, e]))
.permutation(W)``, one int64 per window held in memory (``PermutationOrder``, named
"pcg64-permutation"); a checkpoint whose data position has no order name was written with it and
resumes with it, so its run continues the same token stream.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
EMBEDDED_DIR = os.path.join(os.path.dirname(HERE), "data")


class DataError(ValueError):
    """Bad ``--data``/``--tokenizer`` input; the message names the file."""


# ------------------------------------------------------------------------------------ tokenizers
class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 is <bos>, 257 <eos>, 258 <pad>. Lossless for any text."""

    name = "bytes"
    vocab_size = 259
    bos_id, eos_id, pad_id = 256, 257, 258

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, path: str) -> None:
        """Write an equivalent HF fast tokenizer (``AutoTokenizer.from_pretrained(path)`` loads it):
        byte-level BPE with no merges, whose ids are the byte values."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        # GPT-2's printable stand-in for each byte, so every byte is one token of the vocabulary.
        stand_in = pre_tokenizers.ByteLevel.alphabet()
        byte_chars = _bytes_to_unicode()
        assert set(byte_chars.values()) == set(stand_in)
        vocab = {byte_chars[b]: b for b in range(256)}
        vocab.update({"<bos>": 256, "<eos>": 257, "<pad>": 258})
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
        fast.save_pretrained(path)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (printable bytes map to themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


class HFTokenizer:
    """A local HF tokenizer folder (no network)."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise DataError(f"--tokenizer {path!r}: not a directory (expected a local HF tokenizer folder)")
        try:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - HF raises many kinds
            raise DataError(f"--tokenizer {path!r}: cannot load a tokenizer from it ({type(e).__name__}: {e})") from None
        self.name = os.path.abspath(path)
        self.path = path
        self._lock = threading.Lock()
        self.vocab_size = len(self.tok)
        self.eos_id = self.tok.eos_token_id if self.tok.eos_token_id is not None else self.tok.sep_token_id
        self.bos_id = self.tok.bos_token_id
        self.pad_id = self.tok.pad_token_id  # None when the tokenizer defines no padding token

    def encode(self, text: str) -> np.ndarray:
        with self._lock:  # the streamed loaders' threads share it (HF's wrapper may reset its truncation)
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return np.asarray(ids, dtype=np.uint32 if self.vocab_size > 65535 else np.uint16)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def save_pretrained(self, path: str) -> None:
        self.tok.save_pretrained(path)


def make_tokenizer(path: str | None):
    return ByteTokenizer() if path is None else HFTokenizer(path)


# ---------------------------------------------------------------------------------------- corpora
@dataclass
class Corpus:
    tokens: np.ndarray  # 1-D integer ids (a .bin: a ConcatTokens, read by slices)
    source: str  # for the header: what was read
    documents: int  # -1 if unknown (.bin)


def read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"--data {path!r}: cannot read it ({e.strerror})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"--data {path!r}: not UTF-8 text (invalid byte at offset {e.start}); pass text, .jsonl, "
            "or pre-tokenized ids as .bin"
        ) from None


def jsonl_objects(path: str):
    """(line number, parsed object) of every non-blank line of a JSONL file; DataError naming the line."""
    for n, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except ValueError as e:
            raise DataError(f"--data {path!r}: line {n} is not JSON ({e})") from None


def _jsonl_docs(path: str, key: str) -> list[str]:
    docs = []
    for n, obj in jsonl_objects(path):
        if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
            raise DataError(f"--data {path!r}: line {n} has no string field {key!r} (set --text-key)")
        docs.append(obj[key])
    return docs


def _encode_docs(docs: list[str], tokenizer) -> np.ndarray:
    parts = []
    eos = np.asarray([tokenizer.eos_id], dtype=np.int64) if tokenizer.eos_id is not None else None
    for d in docs:
        parts.append(tokenizer.encode(d).astype(np.int64))
        if eos is not None:
            parts.append(eos)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def load_corpus(data: str | None, tokenizer, *, text_key: str = "text", bin_dtype: str = "uint16") -> Corpus:
    """Read ``data`` (see the module docstring); DataError naming the file if it cannot be used."""
    if data is None:
        files = sorted(f for f in os.listdir(EMBEDDED_DIR) if f.endswith(".txt"))
        if not files:
            raise DataError(f"the embedded corpus is missing: no .txt files in {EMBEDDED_DIR!r}")
        docs = [read_text(os.path.join(EMBEDDED_DIR, f)) for f in files]
        size = sum(len(d.encode()) for d in docs)
        return Corpus(_encode_docs(docs, tokenizer), f"embedded corpus ({len(files)} public-domain texts, {size / 1e3:.0f} KB)", len(docs))
    if not os.path.exists(data):
        raise DataError(f"--data {data!r}: no such file or directory")
    if os.path.isdir(data):
        files = sorted(f for f in os.listdir(data) if f.endswith((".txt", ".jsonl")))
        if not files:
            raise DataError(f"--data {data!r}: the directory holds no .txt or .jsonl files")
        docs = []
        for f in files:
            p = os.path.join(data, f)
            docs += _jsonl_docs(p, text_key) if f.endswith(".jsonl") else [read_text(p)]
        return Corpus(_encode_docs(docs, tokenizer), f"{data} ({len(files)} files)", len(docs))
    if data.endswith(".bin"):
        try:
            dtype = np.dtype(bin_dtype)
        except TypeError:
            raise DataError(f"--data-dtype {bin_dtype!r} is not a NumPy dtype") from None
        if dtype.kind not in "ui":
            raise DataError(f"--data-dtype {bin_dtype!r} must be an integer dtype (uint16, uint32, ...)")
        size = os.path.getsize(data)
        if size == 0 or size % dtype.itemsize:
            raise DataError(
                f"--data {data!r}: {size} bytes is not a whole number of {bin_dtype} token ids "
                "(wrong file, truncated, or wrong --data-dtype)"
            )
        tokens = ConcatTokens([data], bin_dtype)
        return Corpus(tokens, f"{data} ({len(tokens):,} pre-tokenized {bin_dtype} ids)", -1)
    if data.endswith(".jsonl"):
        docs = _jsonl_docs(data, text_key)
        if not docs:
            raise DataError(f"--data {data!r}: no documents")
        return Corpus(_encode_docs(docs, tokenizer), f"{data} ({len(docs)} documents)", len(docs))
    return Corpus(_encode_docs([read_text(data)], tokenizer), data, 1)


# [Note: reading .bin files]
# A ``.bin`` is read by slices with ``os.pread`` into fresh arrays, not memory-mapped. The pages a
# read of a mapping touches stay mapped into the process, and the kernel maps the cached pages
# around each fault with them (measured: 1.5 MB per window of 512 bytes, whole page-cache folios),
# so random windows of a mapped corpus grow the resident set toward the corpus's size (a 48 MB file
# was wholly resident after 320 windows of 256 ids): not memory the job holds, but counted in its
# RSS, its peak and a container's limit. ``pread`` costs
# one system call per window and leaves only the copies; the file stays in the page cache, shared
# with the other ranks. At most ``MAX_OPEN`` files are open at once (a corpus of many shards
# otherwise meets the limit on open files); the least recently opened is closed first.
MAX_OPEN = 64


class ConcatTokens:
    """Token ids of one or several ``.bin`` files as one read-only 1-D sequence; only the slices
    asked for are read (see [Note: reading .bin files])."""

    def __init__(self, paths: list[str], dtype: str):
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise DataError(f"--data-dtype {dtype!r} is not a NumPy dtype") from None
        if self.dtype.kind not in "ui":
            raise DataError(f"--data-dtype {dtype!r} must be an integer dtype (uint16, uint32, ...)")
        self.paths, sizes = [], []
        for p in paths:
            try:
                size = os.path.getsize(p)
            except OSError as e:
                raise DataError(f"--data {p!r}: cannot read it ({e.strerror})") from None
            if size == 0:
                raise DataError(f"--data {p!r}: an empty shard (0 bytes); delete it or write it again")
            if size % self.dtype.itemsize:
                raise DataError(f"--data {p!r}: {size} bytes is not a whole number of {dtype} token ids "
                                "(wrong file, truncated, or wrong --data-dtype)")
            self.paths.append(p)
            sizes.append(size // self.dtype.itemsize)
        self.starts = np.cumsum([0] + sizes)
        self.n = int(self.starts[-1])
        self._fds: dict[int, int] = {}  # file index -> open descriptor, oldest first

    def __len__(self) -> int:
        return self.n

    def file_at(self, i: int) -> tuple[str, int]:
        """The file holding global index ``i`` and the index inside it."""
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.paths[k], i - int(self.starts[k])

    def __getitem__(self, sl) -> "TokenView":
        return TokenView(self, 0, self.n)[sl]

    def __array__(self, dtype=None, copy=None):
        return TokenView(self, 0, self.n).__array__(dtype)

    def _fd(self, k: int) -> int:
        fd = self._fds.get(k)
        if fd is None:
            if len(self._fds) >= MAX_OPEN:
                os.close(self._fds.pop(next(iter(self._fds))))
            try:
                fd = self._fds[k] = os.open(self.paths[k], os.O_RDONLY)
            except OSError as e:
                raise DataError(f"--data {self.paths[k]!r}: cannot read it ({e.strerror})") from None
        return fd

    def read(self, a: int, b: int) -> np.ndarray:
        """Ids ``a .. b - 1`` in a new array (only those bytes of those files are read)."""
        out = np.empty(max(0, b - a), dtype=self.dtype)
        view, size = memoryview(out).cast("B"), self.dtype.itemsize
        k = int(np.searchsorted(self.starts, a, side="right")) - 1 if b > a else 0
        pos = 0
        while a < b:
            s, e = int(self.starts[k]), int(self.starts[k + 1])
            want, off = (min(b, e) - a) * size, (a - s) * size
            while want:  # pread may return fewer bytes than asked (a large read)
                chunk = os.pread(self._fd(k), want, off)
                if not chunk:
                    raise DataError(f"--data {self.paths[k]!r}: ends early (was it changed while the job read it?)")
                view[pos:pos + len(chunk)] = chunk
                pos, off, want = pos + len(chunk), off + len(chunk), want - len(chunk)
            a = min(b, e)
            k += 1
        return out

    def close(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)
        self._fds = {}

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit ``os`` may be gone; the OS closes them then
            pass


class TokenView:
    """``base[a:b]`` of a ``ConcatTokens``, not read until it is made an array (``np.asarray``):
    slicing one (``data.split``, ``Batches``) reads nothing."""

    def __init__(self, base: ConcatTokens, a: int, b: int):
        self.base, self.a, self.b = base, a, b

    def __len__(self) -> int:
        return self.b - self.a

    def __getitem__(self, sl) -> "TokenView":
        if not isinstance(sl, slice) or sl.step not in (None, 1):
            raise TypeError(".bin token files take contiguous slices only")
        a, b, _ = sl.indices(len(self))
        return TokenView(self.base, self.a + a, self.a + max(a, b))

    def __array__(self, dtype=None, copy=None):
        arr = self.base.read(self.a, self.b)
        return arr.astype(dtype) if dtype is not None else arr

    def file_at(self, i: int) -> tuple[str, int]:
        return self.base.file_at(self.a + i)


def write_bin(tokens: np.ndarray, path: str, dtype: str = "uint16") -> None:
    """Save ids as a ``.bin`` the job reads with ``--data path --data-dtype dtype``."""
    arr = np.asarray(tokens)
    if arr.size and int(arr.max()) > np.iinfo(np.dtype(dtype)).max:
        raise DataError(f"ids up to {int(arr.max())} do not fit {dtype}; use uint32")
    arr.astype(dtype).tofile(path)


# ----------------------------------------------------------------------------------- batch order


_U64 = (1 << 64) - 1


def _mix64(z):
    """splitmix64's finaliser: of a uint64 array (wrapping arithmetic), or of an int below 2^64."""
    if isinstance(z, np.ndarray):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


class FeistelOrder:
    """Epoch ``epoch``'s order of ``n`` windows keyed by ``seed``, computed per index: no array per
    window. See [Note: window order]."""

    name = "feistel"
    ROUNDS = 6
    VECTOR = 256  # from this many indices on, the arithmetic runs on uint64 arrays (the same values)

    def __init__(self, n: int, seed: int, epoch: int):
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)  # the domain 2^(2 half) >= n, at least 4
        self.mask = (1 << self.half) - 1
        self.keys = [int.from_bytes(hashlib.blake2b(f"window order {seed} {epoch} {i}".encode(), digest_size=8)
                                    .digest(), "little") for i in range(self.ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix64(right ^ k) & self.mask)
        return (left << self.half) | right

    def _encrypt_array(self, x: np.ndarray) -> np.ndarray:
        half, mask = np.uint64(self.half), np.uint64(self.mask)
        left, right = x >> half, x & mask
        for k in self.keys:
            left, right = right, left ^ (_mix64(right ^ np.uint64(k)) & mask)
        return (left << half) | right

    def __call__(self, i) -> np.ndarray:
        """The windows at positions ``i`` (ints, each in ``0 .. n-1``) of this epoch, as int64."""
        i = np.asarray(i, dtype=np.int64)
        if i.size < self.VECTOR:
            out = []
            for x in i.tolist():
                x = self._encrypt(x)
                while x >= self.n:  # cycle walking: map again until inside 0 .. n-1
                    x = self._encrypt(x)
                out.append(x)
            return np.asarray(out, dtype=np.int64).reshape(i.shape)
        x = self._encrypt_array(i.astype(np.uint64))
        out = x >= self.n
        while out.any():
            x[out] = self._encrypt_array(x[out])
            out = x >= self.n
        return x.astype(np.int64)


class PermutationOrder:
    """The order before [Note: window order]: a stored permutation of all windows (8 bytes each),
    kept so that a checkpoint written with it resumes the same token stream."""

    name = "pcg64-permutation"

    def __init__(self, n: int, seed: int, epoch: int):
        self.perm = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n)

    def __call__(self, i: np.ndarray) -> np.ndarray:
        return self.perm[np.asarray(i, dtype=np.int64)]


ORDERS = {o.name: o for o in (FeistelOrder, PermutationOrder)}
DEFAULT_ORDER = FeistelOrder.name  # a fresh run's order
UNNAMED_ORDER = PermutationOrder.name  # a checkpoint's data position without a name was written in it


def order_of_state(state: dict, path: str) -> str:
    """The window order a checkpoint's ``state`` continues in (see [Note: window order]);
    DataError naming the checkpoint if this version does not know it."""
    if "order" in state:
        name = state["order"]
    elif "stream" in state:  # a streamed run's: it had no window order
        name = DEFAULT_ORDER
    else:
        name = UNNAMED_ORDER
    if name not in ORDERS:
        raise DataError(f"checkpoint {path!r}: its data position is in the window order {name!r}, which this "
                        f"version of the job does not know (it knows {', '.join(ORDERS)}); resume it with the "
                        "version that wrote it, or start a new run")
    return name


class Batches:
    """Windows of a token stream in a seeded, epoch-wise shuffled order. See [Note: batch order]."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, source: str = "data", vocab: int | None = None,
                 order: str | None = None):
        self.tokens = tokens
        self.vocab = vocab  # each window read is checked against it (None: not checked)
        self.source = source
        self.seq_len = seq_len
        self.seed = seed
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise DataError(
                f"{source} has {len(tokens)} tokens, fewer than --seq-len + 1 = {seq_len + 1}; use a shorter "
                "--seq-len or more data"
            )
        self.use_order(order or DEFAULT_ORDER)

    def use_order(self, name: str) -> None:
        """Visit the windows in the order ``name`` (a key of ``ORDERS``) from now on."""
        self.order = name
        self._epoch, self._order = -1, None

    def window_index(self, g) -> np.ndarray:
        """The windows of samples ``g`` (an int or int64 array; see [Note: batch order])."""
        g = np.atleast_1d(np.asarray(g, dtype=np.int64))
        epoch, i = np.divmod(g, self.windows)
        out = np.empty_like(g)
        for e in np.unique(epoch):
            if e != self._epoch:
                self._order, self._epoch = ORDERS[self.order](self.windows, self.seed, int(e)), int(e)
            sel = epoch == e
            out[sel] = self._order(i[sel])
        return out

    def window(self, w: int) -> np.ndarray:
        """Window ``w``'s ``seq_len + 1`` ids as int64, checked against the vocabulary."""
        start = w * self.seq_len
        win = np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)
        if self.vocab is not None and int(win.max()) >= self.vocab:
            j = start + int(np.argmax(win >= self.vocab))
            where = f"{self.source} at token {j:,}"
            if hasattr(self.tokens, "file_at"):
                f, k = self.tokens.file_at(j)
                where = f"--data {f!r} at token {k:,}"
            raise DataError(f"{where}: token id {int(win.max())} >= the model's vocabulary {self.vocab} "
                            "(wrong --tokenizer or --data-dtype, or a corrupt file)")
        return win

    def sample(self, g: int) -> np.ndarray:
        return self.window(int(self.window_index(g)[0]))

    def batch(self, first: int, count: int) -> torch.Tensor:
        """Samples ``first .. first + count - 1`` as a (count, seq_len + 1) int64 tensor."""
        idx = self.window_index(np.arange(first, first + count))
        return torch.from_numpy(np.stack([self.window(int(w)) for w in idx]))

    def micro_batch(self, cursor: int, micro: int, rank: int, world: int, batch: int) -> torch.Tensor:
        return self.batch(cursor + (micro * world + rank) * batch, batch)

    def epoch_of(self, cursor: int) -> float:
        return cursor / self.windows


def split(tokens: np.ndarray, val_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Hold out the last ``val_fraction`` of the stream for validation (None if too short)."""
    n_val = int(len(tokens) * val_fraction)
    if val_fraction <= 0 or n_val < seq_len + 1 or len(tokens) - n_val < seq_len + 1:
        return tokens, None
    return tokens[:-n_val], tokens[-n_val:]




if __name__ == "__main__":  # pre-tokenize: python examples/pretrain/data.py IN OUT.bin [--tokenizer DIR]
    import argparse

    ap = argparse.ArgumentParser(description="Pre-tokenize a text/.jsonl file or directory into a .bin")
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--text-key", default="text")
    ap.add_argument("--dtype", default=None, help="uint16 (default if the vocabulary fits) or uint32")
    a = ap.parse_args()
    tok = make_tokenizer(a.tokenizer)
    corpus = load_corpus(a.input, tok, text_key=a.text_key)
    dt = a.dtype or ("uint16" if tok.vocab_size <= 65536 else "uint32")
    write_bin(corpus.tokens, a.output, dt)
    print(f"wrote {len(corpus.tokens):,} ids ({dt}) from {corpus.source} to {a.output}")
