"""Streamed data (examples/pretrain/stream.py): each input kind, the positions across a world change
(in-process), bad input, and one job lane at world 2 (exact resume, --val-split, a bad file)."""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from job_utils import losses, run_job
from pretrain import data as D  # examples/ is on pytest's pythonpath (pyproject.toml)
from pretrain import stream as S

TOK = D.ByteTokenizer()
SEQ = 32


def docs(n=120):
    """Documents that name themselves at both ends, of varied lengths."""
    return [f"<{i}|" + "abcdefgh"[i % 8] * (3 + (i * 37) % 61) + f"|{i}>" for i in range(n)]


def write_parquet_shards(folder, texts, n_shards, prefix="train", column="text"):
    os.makedirs(folder, exist_ok=True)
    for k in range(n_shards):
        pq.write_table(pa.table({column: texts[k::n_shards]}),
                       os.path.join(folder, f"{prefix}-{k:05d}-of-{n_shards:05d}.parquet"), row_group_size=7)
    return folder


def stream_of(shards, rank, world, states=None):
    st = S.TextStream(shards, TOK, SEQ, rank, world, TOK.vocab_size, prefetch=4)
    if states is not None:
        st.restore(states)
    return st


def tokens_read(windows):
    """The token stream a rank trained on: each window without its last token (the next one's first)."""
    return [t for w in windows for t in w[:-1].tolist()]


def pieces(stream_tokens):
    """EOS-separated text pieces of one rank's stream (the last one unterminated)."""
    text = bytes(t if t < 256 else 0 for t in stream_tokens).decode()
    return text.split("\x00")


@pytest.mark.parametrize("n_shards,old,new", [(3, 2, 3), (1, 2, 1), (4, 2, 1)])
def test_world_change_reads_every_document_once(tmp_path, n_shards, old, new):
    """Positions of ``old`` ranks restored on ``new``: over the first epoch every document is read
    exactly once in total, those cut by the checkpoint split between old and new ranks with no gap
    or overlap (shard mode 3 shards on 2 ranks, row mode 1 shard, shard mode to row mode)."""
    texts = docs()
    shards, _ = S.text_shards(write_parquet_shards(str(tmp_path / "pq"), texts, n_shards), "text", "train")
    before, states = [], []
    for r in range(old):
        st = stream_of(shards, r, old)
        ws = [st.next_window() for _ in range(7 + 3 * r)]  # ranks at different documents
        before.append(tokens_read(ws))
        states.append(st.state())
        st.close()
    after = {}  # the new ranks' epoch-0 documents: id -> (the offset they start at, the text from there)
    for r in range(new):
        st = stream_of(shards, r, new, states)
        for (epoch, shard, row), ids, off in st._documents():
            if epoch > 0:
                break
            i = row * n_shards + shard  # write_parquet_shards puts texts[k::n] in shard k
            assert i not in after
            after[i] = (off, bytes(ids[off:-1].tolist()).decode())
    whole = []
    for stream, state in zip(before, states):
        *done, head = pieces(stream)
        whole += [p for p in done if p]
        if head:
            _, shard, row, _ = state["position"]
            i = row * n_shards + shard
            off, tail = after.pop(i)
            assert off == len(head) > 0 and head + tail == texts[i]  # cut by the checkpoint: no token lost or repeated
            whole.append(texts[i])
    assert all(off == 0 for off, _ in after.values())
    whole += [t for _, t in after.values()]
    assert sorted(whole) == sorted(texts)  # each document once: none skipped, none twice


def test_same_world_resume_is_the_same_windows(tmp_path):
    shards, _ = S.text_shards(write_parquet_shards(str(tmp_path / "pq"), docs(), 2), "text", "train")
    straight = stream_of(shards, 1, 2)
    ref = [straight.next_window() for _ in range(9)]
    first = stream_of(shards, 1, 2)
    [first.next_window() for _ in range(4)]
    other = stream_of(shards, 0, 2)
    [other.next_window() for _ in range(4)]
    again = stream_of(shards, 1, 2, [other.state(), first.state()])
    assert all(np.array_equal(a, b) for a, b in zip(ref[4:], [again.next_window() for _ in range(5)]))
    for s in (straight, first, other, again):
        s.close()


def test_input_kinds_give_the_same_documents(tmp_path):
    """parquet, jsonl (--stream), csv and arrow files and a .bin shard folder: the same token stream."""
    texts = docs(40)
    pq_dir = write_parquet_shards(str(tmp_path / "pq"), texts, 1)
    jl = tmp_path / "d.jsonl"
    jl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    csv = tmp_path / "d.csv"
    import pyarrow.csv as pcsv

    pcsv.write_csv(pa.table({"text": texts}), str(csv))
    arrow = tmp_path / "d.arrow"
    with pa.ipc.new_stream(str(arrow), pa.schema([("text", pa.string())])) as w:
        w.write_table(pa.table({"text": texts}))
    assert S.stream_kind(str(jl)) is None and S.stream_kind(str(jl), stream=True) == "text"
    ref = None
    for path in (pq_dir, str(jl), str(csv), str(arrow)):
        assert S.stream_kind(path, stream=True) == "text"
        shards, _ = S.text_shards(path, "text", "train")
        st = stream_of(shards, 0, 1)
        got = [st.next_window() for _ in range(10)]
        st.close()
        ref = ref or got
        assert all(np.array_equal(a, b) for a, b in zip(ref, got)), path
    # .bin shards: Batches over the folder read by window == over the concatenated ids
    ids = D.load_corpus(str(jl), TOK).tokens
    bins = tmp_path / "bins"
    bins.mkdir()
    for k, part in enumerate(np.array_split(ids, 3)):
        D.write_bin(part, str(bins / f"part-{k}.bin"))
    assert S.stream_kind(str(bins)) == "bins"
    cat = S.bin_shards(str(bins), "uint16")
    a, b = D.Batches(cat, SEQ, 0), D.Batches(ids, SEQ, 0)
    assert a.windows == b.windows and all(np.array_equal(a.sample(g), b.sample(g)) for g in range(a.windows))


def test_bad_input(tmp_path):
    texts = docs(30)
    good = write_parquet_shards(str(tmp_path / "ok"), texts, 1)
    shards, _ = S.text_shards(good, "body", "train")  # missing column
    with pytest.raises(D.DataError, match=r"train-00000-of-00001.parquet.*no column 'body' \(it has text\)"):
        S.check_shards(stream_of(shards, 0, 1))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train-0.parquet").write_bytes(b"PAR1 this is not parquet")
    shards, _ = S.text_shards(str(bad), "text", "train")
    with pytest.raises(D.DataError, match=r"train-0.parquet.*not a readable parquet file"):
        S.check_shards(stream_of(shards, 0, 1))
    empty = tmp_path / "empty"
    write_parquet_shards(str(empty), texts, 1)
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), str(empty / "train-zz.parquet"))
    shards, _ = S.text_shards(str(empty), "text", "train")
    with pytest.raises(D.DataError, match=r"train-zz.parquet.*empty shard \(0 rows\)"):
        S.check_shards(stream_of(shards, 0, 1))
    jl = tmp_path / "late.jsonl"  # a bad row after good ones: named with its row
    jl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts) + json.dumps({"text": 7}) + "\n")
    shards, _ = S.text_shards(str(jl), "text", "train")
    st = stream_of(shards, 0, 1)
    with pytest.raises(D.DataError, match=r"late.jsonl' row 30: column 'text' holds int, not text"):
        while True:
            st.next_window()
    # a token id >= vocab far past the first 2^20 ids of a .bin shard folder: named with the file
    bins = tmp_path / "bins"
    bins.mkdir()
    D.write_bin(np.full(1 << 20, 5), str(bins / "a.bin"))
    late = np.full(1 << 16, 5)
    late[40_000] = 300
    D.write_bin(late, str(bins / "b.bin"))
    b = D.Batches(S.bin_shards(str(bins), "uint16"), SEQ, 0, vocab=TOK.vocab_size)
    with pytest.raises(D.DataError, match=r"b.bin' at token 40,000: token id 300 >= the model's vocabulary 259"):
        for g in range(b.windows):
            b.sample(g)
    (bins / "c.bin").write_bytes(b"")
    with pytest.raises(D.DataError, match=r"c.bin'.*empty shard"):
        S.bin_shards(str(bins), "uint16")


def test_close_waits_for_the_reader_thread(tmp_path):
    """close() stops the background reader and returns once it has ended (bench_data.py exited with
    -6, "terminate called without an active exception", when a thread it had closed was still inside
    pyarrow's reader at interpreter exit); the job closes its streams in its teardown."""
    data = write_parquet_shards(str(tmp_path / "pq"), docs(400), 2)
    shards, _ = S.text_shards(data, "text", "train")
    st = stream_of(shards, 0, 1)
    st.next_window()  # starts the thread, which fills its queue (4) and waits to put the next window
    st.close()
    assert not st._thread.is_alive()
    sb = S.StreamBatches(stream_of(shards, 0, 1), "pq", {})
    sb.micro_batch(0, 0, 0, 1, 2)
    sb.close()
    assert not sb.stream._thread.is_alive()


def test_close_names_a_reader_that_does_not_stop(tmp_path, capsys):
    """A read that does not return (a stalled remote file): close() waits its bound, then says which rank's
    reader and which shard it left behind, and returns -- the job's teardown never hangs on it."""
    data = write_parquet_shards(str(tmp_path / "pq"), docs(40), 2)
    shards, _ = S.text_shards(data, "text", "train")
    release = threading.Event()

    class Stalled(S.Shard):
        def rows(self, start=0):
            for i, row in enumerate(super().rows(start)):
                if i == 3:
                    release.wait(60)  # stuck in the read until the test lets it go
                yield row

    stalled = [Stalled(sh.name, sh.column, sh.path, sh.dataset) for sh in shards]
    st = stream_of(stalled, 0, 1)
    st.next_window()
    t0 = time.monotonic()
    st.close(timeout=0.5)
    waited = time.monotonic() - t0
    try:
        assert st._thread.is_alive() and 0.5 <= waited < 5, waited
        err = capsys.readouterr().err
        assert f"data: rank 0's reader did not stop within 0.5 s (still reading {stalled[0].name!r})" in err, err
    finally:
        release.set()
        st._thread.join(10)
    assert not st._thread.is_alive()


def test_job_streamed_parquet(tmp_path):
    """World 2 over a parquet folder: 4 steps straight == 2 steps, then --resume to 4 (bit for bit),
    validation from --val-split; the step-2 checkpoint resumed on 1 rank (2 -> 1); a corrupt shard:
    exit 2, one line naming it, nothing in --out."""
    texts = docs(300)
    data = write_parquet_shards(str(tmp_path / "pq"), texts, 3)
    write_parquet_shards(data, texts[:40], 1, prefix="validation")
    common = ["--data", data, "--val-split", "validation"]
    a, b, out = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c")
    bad = str(tmp_path / "bad")
    os.makedirs(bad)
    write_parquet_shards(bad, texts, 2)
    with open(os.path.join(bad, "train-00001-of-00002.parquet"), "r+b") as f:
        f.truncate(100)
    jl = tmp_path / "val.jsonl"  # --val-data beside non-streamed training data (the embedded corpus)
    jl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:60]))
    n_val = len(D.load_corpus(str(jl), TOK).tokens)
    with ThreadPoolExecutor(4) as pool:  # independent launches side by side
        first = pool.submit(run_job, common + ["--steps", "4", "--out", a])
        half = pool.submit(run_job, common + ["--steps", "2", "--out", b])
        failed = pool.submit(run_job, ["--data", bad, "--steps", "2", "--out", out], check=False)
        val = pool.submit(run_job, ["--val-data", str(jl), "--steps", "1", "--out", str(tmp_path / "v")], nproc=0)
        first, p, val = first.result(), failed.result(), val.result()
        half.result()
    assert f"{n_val:,} val (--val-data {jl})" in val.stdout and "; val " in val.stdout
    assert "streamed, tokenized on the fly" in first.stdout and "val " + data in first.stdout
    to1 = str(tmp_path / "to1")  # b's step-2 checkpoint also resumed on 1 rank, beside b's own resume
    shutil.copytree(b, to1)
    with ThreadPoolExecutor(1) as pool:
        # 2 -> 1 rank: every rank's position was in the checkpoint; the rest of the epoch is read once
        third = pool.submit(run_job, common + ["--steps", "5", "--resume", "--grad-accum", "2", "--out", to1], nproc=1)
        second = run_job(common + ["--steps", "4", "--resume", "--out", b])
        third = third.result()
    assert "streamed position restored: each rank at its own position" in second.stdout
    assert losses(a) == losses(b) and len(losses(a)) == 4
    assert "2 -> 1 ranks: every document not yet read is read once, none twice" in third.stdout
    assert len(losses(to1)) == 5
    # the corrupt shard (rank 1's): exit 2 on that rank, one line naming it, nothing written
    assert p.returncode != 0 and "exitcode  : 2" in p.stderr, p.stderr[-3000:]  # torchrun: the first rank's
    assert p.stderr.count("train-00001-of-00002.parquet': not a readable parquet file") == 1
    assert not os.path.exists(out)

def test_prepare_data(tmp_path):
    """examples/prepare_data.py: a parquet folder -> .bin shards (2 processes) holding the same ids
    as the streamed reading, in the same order; a bad input: exit 2, one line."""
    import subprocess
    import sys

    from job_utils import ROOT, env

    texts = docs(50)
    data = write_parquet_shards(str(tmp_path / "pq"), texts, 3)
    out = str(tmp_path / "bins")
    script = os.path.join(ROOT, "examples", "prepare_data.py")
    p = subprocess.run([sys.executable, script, data, out, "--workers", "2"], capture_output=True, text=True,
                       env=env(), timeout=120)
    assert p.returncode == 0, p.stderr
    assert "3/3 shards" in p.stderr and f"train with --data {out}" in p.stdout
    got = np.asarray(S.bin_shards(out, "uint16")[:])
    want = np.concatenate([np.append(TOK.encode(t), TOK.eos_id) for k in range(3) for t in texts[k::3]])
    assert np.array_equal(got, want)
    p = subprocess.run([sys.executable, script, data, str(tmp_path / "x"), "--column", "body"], capture_output=True,
                       text=True, env=env(), timeout=120)
    assert p.returncode == 2 and "no column 'body'" in p.stderr.strip().splitlines()[-1]


def test_dataset_name_is_streamed_by_shard(tmp_path, monkeypatch):
    """A dataset name goes to datasets.load_dataset(name, split=..., streaming=True) (no network here:
    the name is answered by the same parquet files), read by its shards like the folder."""
    import datasets

    texts = docs(60)
    folder = write_parquet_shards(str(tmp_path / "pq"), texts, 3)
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder))
    real = datasets.load_dataset
    calls = []

    def fake(name, split=None, streaming=False, **kw):
        calls.append((name, split, streaming))
        return real("parquet", data_files=files, split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert S.stream_kind("someorg/corpus") == "text"
    shards, desc = S.text_shards("someorg/corpus", "text", "train")
    assert calls == [("someorg/corpus", "train", True)] and len(shards) == 3 and "3 shard(s)" in desc
    monkeypatch.setattr(datasets, "load_dataset", real)
    ref_shards, _ = S.text_shards(folder, "text", "train")
    for r in range(2):
        a, b = stream_of(shards, r, 2), stream_of(ref_shards, r, 2)
        assert all(np.array_equal(a.next_window(), b.next_window()) for _ in range(6))
        a.close()
        b.close()


def test_local_dataset_folders_resolve_like_load_dataset(tmp_path):
    """A ``save_to_disk`` folder (Dataset, DatasetDict) streams its .arrow files, not its JSON state;
    a folder whose README.md declares ``configs`` gives each split the files the config names (the
    validation files are not trained on) -- as ``datasets.load_dataset(folder)`` would."""
    import datasets

    texts = docs(40)
    ref_shards, _ = S.text_shards(write_parquet_shards(str(tmp_path / "pq"), texts, 1), "text", "train")
    ref = stream_of(ref_shards, 0, 1)
    want = [ref.next_window() for _ in range(8)]
    ref.close()
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts}),
                          "test": datasets.Dataset.from_dict({"text": ["held out"]})}).save_to_disk(str(tmp_path / "dd"))
    for folder in ("saved", "dd"):
        path = str(tmp_path / folder)
        assert S.stream_kind(path) == "text"
        files = S.split_files(path, "train")
        assert [os.path.splitext(f)[1] for f in files] == [".arrow"], files
        shards, _ = S.text_shards(path, "text", "train")
        st = stream_of(shards, 0, 1)
        assert all(np.array_equal(a, st.next_window()) for a in want), folder
        st.close()
    assert S.split_files(str(tmp_path / "dd"), "test")[0].endswith(os.path.join("test", "data-00000-of-00001.arrow"))
    cfg = tmp_path / "cfg"
    write_parquet_shards(str(cfg / "corpus"), texts, 2, prefix="part")
    write_parquet_shards(str(cfg / "extra"), ["held out"] * 5, 1, prefix="part")
    (cfg / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                   "    path: corpus/*.parquet\n  - split: validation\n    path: extra/*.parquet\n---\n")
    assert [os.path.relpath(f, cfg) for f in S.split_files(str(cfg), "train")] == \
        [os.path.join("corpus", "part-00000-of-00002.parquet"), os.path.join("corpus", "part-00001-of-00002.parquet")]
    assert [os.path.relpath(f, cfg) for f in S.split_files(str(cfg), "validation")] == \
        [os.path.join("extra", "part-00000-of-00001.parquet")]
    with pytest.raises(D.DataError, match=r"cfg' has no split 'test' \(it has train, validation\)"):
        S.split_files(str(cfg), "test")
