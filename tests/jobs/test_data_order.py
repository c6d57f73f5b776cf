"""The window order of non-streamed data (examples/pretrain/data.py, [Note: window order]): a true
permutation computed per index for many sizes, keyed by seed and epoch, the ranks' split of each
step; the order's name in the checkpoint (a position written before it was named resumes in the
old order, an unknown one is refused); the pages of a mapped .bin dropped ([Note: mapped pages])."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from job_utils import FAST, JOB, env, losses, metrics, run_job, torchrun_cmd, tree_digest
from pretrain import data as D  # examples/ is on pytest's pythonpath (pyproject.toml)

SIZES = [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 31, 64, 97, 255, 256, 257, 1000, 1021, 4096, 65537]


@pytest.mark.parametrize("n", SIZES)
def test_feistel_order_is_a_permutation(n):
    """Every window exactly once per epoch, in two epochs and two seeds; the per-index arithmetic
    (short calls) and the array arithmetic (long ones) give the same windows."""
    for seed, epoch in ((0, 0), (0, 1), (5, 0)):
        order = D.FeistelOrder(n, seed, epoch)
        whole = order(np.arange(n))
        assert whole.dtype == np.int64 and np.array_equal(np.sort(whole), np.arange(n)), (n, seed, epoch)
        probe = np.arange(n) if n <= 4096 else np.random.default_rng(n).choice(n, 500, replace=False)
        pieces = np.concatenate([order(probe[a:a + 7]) for a in range(0, len(probe), 7)])
        assert np.array_equal(pieces, whole[probe])
    assert 2 ** (2 * D.FeistelOrder(n, 0, 0).half) < 4 * max(n, 2)  # cycle walking: under 4 steps on average


def test_feistel_orders_differ_by_seed_and_epoch():
    n = 1000
    base = D.FeistelOrder(n, 0, 0)(np.arange(n))
    others = [D.FeistelOrder(n, s, e)(np.arange(n)) for s, e in ((1, 0), (0, 1), (2, 3))]
    for o in others:
        assert (o != base).mean() > 0.9  # not a shifted or nearly equal order
    assert not np.array_equal(base, np.arange(n))
    assert abs(np.corrcoef(base, np.arange(n))[0, 1]) < 0.1
    # the order is a function of (n, seed, epoch) alone: a new object gives the same windows
    assert np.array_equal(D.FeistelOrder(n, 0, 0)(np.arange(n)), base)
    # both orders of 2 windows occur across seeds
    assert {tuple(D.FeistelOrder(2, s, 0)(np.arange(2))) for s in range(16)} == {(0, 1), (1, 0)}


@pytest.mark.parametrize("windows,world,accum,batch", [(1, 1, 1, 1), (37, 2, 1, 3), (64, 3, 2, 2), (101, 4, 1, 5)])
def test_ranks_split_each_step_and_an_epoch_is_every_window(windows, world, accum, batch):
    """Rank r's micro-batch m of a step holds samples cursor + (m x world + r) x batch + [0, batch):
    within a step the ranks' samples are disjoint and make up the step; over the steps of an epoch
    every window comes exactly once."""
    seq = 8
    b = D.Batches(np.arange(windows * seq + 1), seq, seed=11)
    assert b.windows == windows and b.order == "feistel"
    per_step = world * accum * batch
    seen = []
    for cursor in range(0, windows - windows % per_step, per_step):
        step = [b.micro_batch(cursor, m, r, world, batch) for m in range(accum) for r in range(world)]
        starts = [int(x[0]) // seq for mb in step for x in mb]
        assert len(set(starts)) == per_step
        assert sorted(starts) == sorted(b.window_index(np.arange(cursor, cursor + per_step)).tolist())
        seen += starts
    rest = windows - len(seen)
    seen += b.window_index(np.arange(len(seen), len(seen) + rest)).tolist()
    assert sorted(seen) == list(range(windows))
    # the next epoch is every window again, in another order (where there are enough to differ)
    nxt = b.window_index(np.arange(windows, 2 * windows)).tolist()
    assert sorted(nxt) == list(range(windows))
    if windows > 30:
        assert nxt != b.window_index(np.arange(windows)).tolist()
    # windows are contiguous runs of the stream
    x = b.batch(windows - 2, 4)
    assert all(torch.equal(r, torch.arange(int(r[0]), int(r[0]) + seq + 1)) for r in x)


def test_the_unnamed_order_is_the_old_permutation():
    """A checkpoint's position without an order name resumes in the order written before it was
    named: numpy.random.Generator(PCG64([seed, epoch])).permutation(windows), as data.py had it."""
    tokens = np.arange(300 * 4 + 1)
    old = D.Batches(tokens, 4, seed=3, order="pcg64-permutation")
    for epoch in (0, 1):
        perm = np.random.Generator(np.random.PCG64([3, epoch])).permutation(300)
        got = [int(old.sample(epoch * 300 + i)[0]) // 4 for i in range(300)]
        assert got == perm.tolist()
    assert D.order_of_state({"cursor": 5, "seed": 3}, "ck") == "pcg64-permutation"
    assert D.order_of_state({"cursor": 5, "order": "feistel"}, "ck") == "feistel"
    assert D.order_of_state({"cursor": 0, "stream": []}, "ck") == "feistel"  # streamed: no window order
    with pytest.raises(D.DataError, match=r"checkpoint 'runs/x/step_4': its data position is in the window order "
                                          r"'feistel9', which this version of the job does not know"):
        D.order_of_state({"cursor": 5, "order": "feistel9"}, "runs/x/step_4")


def test_bin_windows_leave_no_pages_resident(tmp_path):
    """Reading random windows of a .bin maps none of it into the process (the resident set does not
    grow toward the file's size, see [Note: reading .bin files]) and every id read is right."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc/self/status to read the resident set from")
    n = 24 << 20  # 48 MB of uint16 ids
    ids = (np.arange(n, dtype=np.int64) * 7919) % 259
    path = str(tmp_path / "c.bin")
    D.write_bin(ids, path)
    corpus = D.load_corpus(path, D.ByteTokenizer())
    assert isinstance(corpus.tokens, D.ConcatTokens) and len(corpus.tokens) == n
    b = D.Batches(corpus.tokens, 256, 0, vocab=259)

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

    b.batch(0, 16)
    start = rss_mb()
    for g in range(16, 2016, 16):  # 2000 windows: with the file mapped, nearly all of it resident
        x = b.batch(g, 16).numpy()
        w = b.window_index(np.arange(g, g + 16))
        assert all(np.array_equal(x[k], ids[w[k] * 256:w[k] * 256 + 257]) for k in range(16))
    assert rss_mb() - start < 8, (start, rss_mb())
    with open("/proc/self/maps") as f:
        assert path not in f.read()
    # reads across files and past a read's first chunk; more files than may be open at once
    parts = np.array_split(ids[:100_003], D.MAX_OPEN + 6)
    for k, part in enumerate(parts):
        D.write_bin(part, str(tmp_path / f"s{k:03d}.bin"))
    from pretrain import stream as S

    cat = S.bin_shards(str(tmp_path), "uint16")
    cat = D.ConcatTokens([p for p in cat.paths if "/s" in p], "uint16")
    assert np.array_equal(np.asarray(cat), ids[:100_003])
    assert np.array_equal(np.asarray(cat[1500:61_234], dtype=np.int64), ids[1500:61_234])
    assert len(cat._fds) == D.MAX_OPEN


# --------------------------------------------------------------------- the order's name in a checkpoint
# The job as it was before the order was named: the old permutation, and a data position without an
# order name (the other state keys as they were). With TEST_ORDER_NAME: the new order, its position
# under that name (a version of the job from after this one).
BEFORE = """import os, runpy, sys
sys.path.insert(0, {examples!r})
from pretrain import data as D, saving
name = os.environ.get("TEST_ORDER_NAME")
if name is None:
    D.DEFAULT_ORDER = "pcg64-permutation"
_contents = saving.contents
def contents(job):
    state, meta = _contents(job)
    del state["order"]
    if name is not None:
        state["order"] = name
    return state, meta
saving.contents = contents
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_resume_keeps_the_order_of_the_checkpoint(tmp_path):
    """A checkpoint written before the order was named (the old permutation, no name) resumes in the
    old order, bit for bit with the old run, and says so, and so does one of its continuation (named);
    an unknown name is refused: one line naming the checkpoint, exit 2, nothing written. (A new
    position resumes in the new order: the exact-resume tests of test_pretrain.py and this file's
    resume from the unnamed position would fail if the name were not saved.)"""
    corpus = D.load_corpus(None, D.ByteTokenizer())
    data = str(tmp_path / "c.bin")
    D.write_bin(np.asarray(corpus.tokens)[:60_000], data)
    ids = D.load_corpus(data, D.ByteTokenizer()).tokens
    new, old = D.Batches(ids, 32, 0), D.Batches(ids, 32, 0, order="pcg64-permutation")
    assert not np.array_equal(new.window_index(np.arange(40)), old.window_index(np.arange(40)))
    wrap = tmp_path / "before.py"
    wrap.write_text(BEFORE.format(examples=os.path.dirname(JOB)))
    common = ["--data", data, "--save-every", "2"]

    def before(args, name=None):
        e = env()
        if name is not None:
            e["TEST_ORDER_NAME"] = name
        cmd = [*torchrun_cmd(2)[:-1], str(wrap), JOB]
        p = subprocess.run(cmd + FAST + common + args, capture_output=True, text=True, timeout=240, env=e)
        assert p.returncode == 0, p.stderr[-4000:]
        return p

    out = {k: str(tmp_path / k) for k in ("old6", "old2", "later")}
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(before, ["--steps", "6", "--out", out["old6"]]),
                pool.submit(before, ["--steps", "2", "--out", out["later"]], "feistel9")]
        [j.result() for j in jobs]
    # the old run stopped at step 2: its folder without the checkpoints and the metrics after step 2
    shutil.copytree(out["old6"], out["old2"])
    for step in (4, 6):
        shutil.rmtree(os.path.join(out["old2"], "checkpoints", f"step_{step:08d}"))
    rows = metrics(out["old2"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    with open(os.path.join(out["old2"], "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[:2])
    later_files = tree_digest(out["later"])
    with ThreadPoolExecutor(2) as pool:
        refused = pool.submit(run_job, common + ["--steps", "4", "--resume", "--out", out["later"]], check=False)
        for steps in (4, 6):  # from the unnamed position, then from its continuation's (named) one
            p = run_job(common + ["--steps", str(steps), "--resume", "--out", out["old2"]])
            assert "data     window order 'pcg64-permutation' kept from the checkpoint" in p.stdout, p.stdout
        p = refused.result()
    assert losses(out["old2"]) == losses(out["old6"]) and len(losses(out["old6"])) == 6
    assert p.returncode != 0 and "exitcode  : 2" in p.stderr, p.stderr[-3000:]
    line = ("step_00000002': its data position is in the window order 'feistel9', which this version of the job "
            "does not know (it knows feistel, pcg64-permutation); resume it with the version that wrote it")
    assert p.stderr.count(line) == 1, p.stderr[-3000:]
    assert tree_digest(out["later"]) == later_files
