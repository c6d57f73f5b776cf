"""Offline preparation: any ``--data`` input of the pretraining job as ``.bin`` token shards.

    python examples/prepare_data.py IN OUT_DIR [--tokenizer DIR] [--column text] [--split train]
                                    [--workers N] [--dtype uint16|uint32]

IN is anything ``--data`` takes: a text file, ``.jsonl``, a folder of ``.txt``/``.jsonl``, a parquet,
arrow, csv or jsonl file or folder of shards, or a Hugging Face dataset name. Each input shard (a
file, or one of a dataset's shards) is tokenized by one of ``--workers`` processes into
``OUT_DIR/shard-<k>.bin`` (ids, EOS after each document), in input order, so the folder of
``.bin`` files is the corpus in the same document order; train on it with ``--data OUT_DIR``
(read window by window, the cursor as the position). A progress bar counts the shards done and the ids
written. Writes each shard to a temporary name and renames it, so an interrupted run leaves no
partial shard behind.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pretrain import data as D  # noqa: E402
from pretrain import stream as S  # noqa: E402


def _work(job):
    """Tokenize one input shard into one .bin (in a worker process); returns (index, ids written)."""
    k, kind, spec, tok_path, column, split, dtype, out = job
    tok = D.make_tokenizer(tok_path)
    if kind == "text":
        shards, _ = S.text_shards(spec, column, split)
        shard = shards[k]
        parts = []
        for _, text in shard.rows(0):
            parts.append(np.asarray(tok.encode(text), dtype=np.int64))
            if tok.eos_id is not None:
                parts.append(np.asarray([tok.eos_id], dtype=np.int64))
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if not len(ids):
            raise D.DataError(f"{shard.name!r}: an empty shard (no rows)")
    else:
        ids = D.load_corpus(spec, tok, text_key=column).tokens
    path = os.path.join(out, f"shard-{k:05d}.bin")
    D.write_bin(ids, path + ".tmp", dtype)
    os.replace(path + ".tmp", path)
    return k, len(ids)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input")
    ap.add_argument("output", help="folder for the .bin shards (created)")
    ap.add_argument("--tokenizer", default=None, metavar="DIR", help="local HF tokenizer folder; default: bytes")
    ap.add_argument("--column", "--text-key", dest="column", default="text", help="the text column / JSONL field")
    ap.add_argument("--split", default="train", help="split of a dataset name or folder")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    ap.add_argument("--dtype", default=None, help="uint16 (default where the vocabulary fits) or uint32")
    a = ap.parse_args(argv)
    try:
        tok = D.make_tokenizer(a.tokenizer)
        dtype = a.dtype or ("uint16" if tok.vocab_size <= 65536 else "uint32")
        if S.stream_kind(a.input, stream=True) == "text":
            shards, desc = S.text_shards(a.input, a.column, a.split)
            jobs = [(k, "text", a.input, a.tokenizer, a.column, a.split, dtype, a.output) for k in range(len(shards))]
        elif os.path.isdir(a.input):
            files = sorted(f for f in os.listdir(a.input) if f.endswith((".txt", ".jsonl")))
            if not files:
                raise D.DataError(f"{a.input!r}: no .txt, .jsonl, .parquet, .arrow or .csv files")
            jobs = [(k, "file", os.path.join(a.input, f), a.tokenizer, a.column, a.split, dtype, a.output)
                    for k, f in enumerate(files)]
            desc = f"{a.input} ({len(files)} files)"
        else:
            jobs = [(0, "file", a.input, a.tokenizer, a.column, a.split, dtype, a.output)]
            desc = a.input
        if os.path.isdir(a.output) and any(f.endswith(".bin") for f in os.listdir(a.output)):
            raise D.DataError(f"{a.output!r} already holds .bin shards; pass an empty or new folder")
        os.makedirs(a.output, exist_ok=True)
        t0, total, done = time.perf_counter(), 0, 0
        with ProcessPoolExecutor(max(1, min(a.workers, len(jobs)))) as pool:
            futures = [pool.submit(_work, j) for j in jobs]
            for f in as_completed(futures):
                _, n = f.result()
                total, done = total + n, done + 1
                bar = "#" * (30 * done // len(jobs))
                rate = total / max(1e-9, time.perf_counter() - t0)
                print(f"\r[{bar:<30}] {done}/{len(jobs)} shards, {total:,} ids ({rate / 1e6:.2f} M ids/s)",
                      end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    except D.DataError as e:
        print(f"prepare_data.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {total:,} {dtype} ids from {desc} to {a.output} ({len(jobs)} shards); "
          f"train with --data {a.output}" + (f" --data-dtype {dtype}" if dtype != "uint16" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
