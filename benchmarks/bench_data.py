"""Streamed data against corpus size: time to the first step, peak host memory per rank, and the
loader's tokens/s against the step's (pretraining job, examples/pretrain/stream.py).

    python benchmarks/bench_data.py --sizes 0.1,1 --dir /tmp/bench_data [--out results.md]

For each size (GB of generated text / ids) it writes a folder of parquet shards (random words,
one document per row) and a folder of uint16 ``.bin`` shards, then for each:
- launches the job at world 2 (tiny preset, byte tokenizer, 3 steps) and reads the time from
  launch to the first step's metrics row and each rank's peak RSS (``--steps 3``; the job prints
  neither, so the script times the process and reads /proc via ``resource`` in a wrapper);
- reads one rank's stream in-process for 5 s: the loader's tokens/s (tokenize + pack, one
  thread), to compare with the step's tokens/s per rank from metrics.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
WRAP = ("import resource, runpy, sys, atexit, os\n"
        "atexit.register(lambda: print('PEAK_RSS_MB', os.environ.get('RANK'), "
        "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, file=sys.stderr, flush=True))\n"
        "sys.argv = sys.argv[1:]\nsys.path.insert(0, os.path.dirname(sys.argv[0]))\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")


def make_parquet(folder: str, gb: float, shard_mb: float = 100) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    words = np.array(["data", "stream", "token", "the", "of", "model", "rank", "shard", "window", "epoch",
                      "loss", "resume", "corpus", "parquet", "document", "people"])
    total, k = 0, 0
    while total < gb * 1e9:
        rows = []
        size = 0
        while size < min(shard_mb * 1e6, gb * 1e9):
            doc = " ".join(words[rng.integers(0, len(words), int(rng.integers(50, 2000)))])
            rows.append(doc)
            size += len(doc)
        pq.write_table(pa.table({"text": rows}), os.path.join(folder, f"train-{k:05d}.parquet"))
        total += size
        k += 1


def make_bin(folder: str, gb: float, shard_mb: int = 100) -> None:
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    n = int(gb * 1e9 / 2)
    per = shard_mb * 1_000_000 // 2
    for k in range(0, n, per):
        rng.integers(0, 259, min(per, n - k), dtype=np.uint16).tofile(os.path.join(folder, f"s{k // per:05d}.bin"))


def run_job(data: str, out: str) -> dict:
    wrap = os.path.join(out + ".wrap.py")
    with open(wrap, "w") as f:
        f.write(WRAP)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", wrap,
           os.path.join(ROOT, "examples", "pretrain_llama.py"), "--preset", "tiny", "--steps", "3", "--no-progress",
           "--sample-tokens", "0", "--val-fraction", "0", "--data", data, "--out", out, "--overwrite"]
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):  # an earlier run's rows would read as this run's first step at once
        os.remove(metrics)
    t0 = time.time()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = None
    while p.poll() is None:
        if first is None and os.path.exists(metrics) and os.path.getsize(metrics):
            first = time.time() - t0
        time.sleep(0.05)
    _, err = p.communicate()
    if p.returncode:
        raise SystemExit(err[-3000:])
    rows = [json.loads(x) for x in open(metrics)]
    peaks = [int(line.split()[2]) for line in err.splitlines() if line.startswith("PEAK_RSS_MB")]
    return dict(first_step_s=round(first or float("nan"), 2), peak_rss_mb=max(peaks),
                step_tok_s_per_rank=round(float(np.median([r["tokens_per_s_per_device"] for r in rows[1:]])), 0))


def loader_rate(data: str, kind: str, seconds: float = 5.0) -> float:
    from pretrain import data as D
    from pretrain import stream as S

    tok = D.ByteTokenizer()
    if kind == "bin":
        b = D.Batches(S.bin_shards(data, "uint16"), 256, 0, vocab=259)
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            b.micro_batch(n, 0, 0, 2, 8)
            n += 16
        return n / 2 * 256 / (time.perf_counter() - t0)
    shards, _ = S.text_shards(data, "text", "train")
    st = S.TextStream(shards, tok, 256, 0, 2, 259)
    st.next_window()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        st.next_window()
        n += 1
    st.close()
    return n * 256 / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="0.1,1")
    ap.add_argument("--dir", default="/tmp/bench_data")
    ap.add_argument("--out", default=None, help="append the table to this markdown file")
    ap.add_argument("--kinds", default="parquet,bin", help="inputs to measure")
    ap.add_argument("--loader-seconds", type=float, default=5.0, help="how long the loader is read")
    a = ap.parse_args()
    lines = ["| input | size GB | first step s | peak RSS / rank MB | loader tok/s (1 rank) | step tok/s per rank |",
             "|---|---|---|---|---|---|"]
    for gb in [float(s) for s in a.sizes.split(",")]:
        for kind, make in (("parquet", make_parquet), ("bin", make_bin)):
            if kind not in a.kinds.split(","):
                continue
            data = os.path.join(a.dir, f"{kind}_{gb}")
            if not os.path.isdir(data):
                make(data, gb)
            r = run_job(data, os.path.join(a.dir, f"run_{kind}_{gb}"))
            rate = loader_rate(data, kind, a.loader_seconds)
            lines.append(f"| {kind} | {gb} | {r['first_step_s']} | {r['peak_rss_mb']} | {rate:,.0f} | "
                         f"{r['step_tok_s_per_rank']:,.0f} |")
            print(lines[-1], flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
