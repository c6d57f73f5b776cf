"""Streaming-load throughput against reading the checkpoint's files, in one run, interleaved:
``load_hf_weights`` at world 2 (CPU, gloo) on an HF checkpoint made by bench_io.py, each row with
the page cache warm and cold (the files dropped from it first), next to a plain read of the files
in the same state. An optional second tree (``--other``: another checkout's root, e.g. the
previous loader) runs in alternation with this one, so that a ratio between them is measured under
the same load.

    python benchmarks/bench_io.py --dir /tmp/io --rows load      # makes the checkpoint once
    python benchmarks/bench_load.py --ckpt /tmp/io/ckpt_llama3-1b --reps 3 [--other /path/to/old/tree]

Cold: every rank's files are dropped from the page cache with posix_fadvise(POSIX_FADV_DONTNEED)
(and /proc/sys/vm/drop_caches when writable) right before the row; the file read row is measured
the same way. The goal: load throughput >= half of the files' read throughput (slicing and placing the tensors may
cost no more than reading the bytes again).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

GiB = 1 << 30


def drop_cache(files) -> str:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return "fadvise+drop_caches"
    except OSError:
        return "fadvise"


def read_files(files) -> float:
    buf = bytearray(64 << 20)
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t0


def rank_main(rank: int, world: int, port: int, ckpt: str, cold: bool, profile: str | None, qlora: bool = False):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import yafsdp
    from yafsdp.hf import load_hf_weights, read_hf_config
    from yafsdp.init import meta_parameters
    from transformers import LlamaForCausalLM

    if qlora:  # the fine-tuning job's path: a PEFT model on meta, the base streamed in, NF4 per slice
        import peft
        from yafsdp.peft_load import load_peft_base, meta_peft_model

        built = meta_peft_model(read_hf_config(ckpt), peft.LoraConfig(
            r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), seed=0)
        model = yafsdp.YaFSDP(built.model, param_dtype=torch.bfloat16, quantize_frozen="nf4")

        def load_hf_weights(model, path):  # noqa: F811 - the QLoRA load in the same place
            load_peft_base(model, path, built.adapters)
    else:
        with meta_parameters():
            m = LlamaForCausalLM(read_hf_config(ckpt))
        model = yafsdp.YaFSDP(m, param_dtype=torch.bfloat16)
    files = sorted(glob.glob(os.path.join(ckpt, "*.safetensors")))
    dist.barrier()
    if cold and rank == 0:
        drop_cache(files)
    dist.barrier()
    prof = None
    if profile and rank == 0:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    load_hf_weights(model, ckpt)
    t = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    got = [None] * world
    dist.all_gather_object(got, t)
    if rank == 0:
        print("RESULT", json.dumps(max(got)), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def one_load(tree: str, ckpt: str, cold: bool, port: int, profile: str | None = None, qlora: bool = False) -> float:
    env = dict(os.environ, PYTHONPATH=tree)
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            "import bench_load, torch.multiprocessing as mp; "
            f"mp.spawn(bench_load.rank_main, args=(2, {port}, {ckpt!r}, {cold}, {profile!r}, {qlora}), nprocs=2)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tree)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(out.stdout[-2000:] + out.stderr[-3000:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--other", default=None, help="a second tree's root, run in alternation (e.g. the old loader)")
    ap.add_argument("--profile", default=None, help="cProfile rank 0 of one extra warm load of this tree into this file")
    ap.add_argument("--qlora-profile", default=None,
                    help="cProfile rank 0 of one warm QLoRA load (meta PEFT + NF4) of this tree into this file")
    a = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this": here} | ({"other": os.path.abspath(a.other)} if a.other else {})
    files = sorted(glob.glob(os.path.join(a.ckpt, "*.safetensors")))
    size = sum(os.path.getsize(f) for f in files)
    res: dict[str, list[float]] = {}
    port = 29600
    if a.reps == 0 and a.qlora_profile:
        read_files(files)
        print(f"QLoRA load (meta PEFT + NF4, warm, profiled): {one_load(here, a.ckpt, False, port + 2, a.qlora_profile, True):.2f} s")
        return
    how = ""
    for rep in range(a.reps):
        for cold in (False, True):
            state = "cold" if cold else "warm"
            if cold:
                how = drop_cache(files)
            else:
                read_files(files)  # bring them in
            res.setdefault(f"read files ({state})", []).append(read_files(files))
            for name, tree in trees.items():
                if not cold:
                    read_files(files)
                port += 1
                try:
                    res.setdefault(f"load {name} ({state})", []).append(one_load(tree, a.ckpt, cold, port))
                except RuntimeError as e:  # e.g. the OOM killer on a shared box: the row is left out, said here
                    print(f"rep {rep} load {name} ({state}) failed: {str(e)[-300:]}", flush=True)
            print(rep, {k: round(v[-1], 2) for k, v in res.items()}, flush=True)
    if a.profile:
        read_files(files)
        one_load(here, a.ckpt, False, port + 1, a.profile)
    if a.qlora_profile:
        read_files(files)
        print(f"QLoRA load (meta PEFT + NF4, warm, profiled): {one_load(here, a.ckpt, False, port + 2, a.qlora_profile, True):.2f} s")
    print(f"checkpoint: {a.ckpt}: {len(files)} files, {size / GiB:.2f} GiB; cold = {how}; reps {a.reps}; "
          f"load average at the end {os.getloadavg()}")
    print("| row | median s | min s | max s | GB/s (median) |")
    print("|---|---|---|---|---|")
    med = {}
    for k, v in res.items():
        med[k] = statistics.median(v)
        print(f"| {k} | {med[k]:.2f} | {min(v):.2f} | {max(v):.2f} | {size / med[k] / 1e9:.2f} |")
    for state in ("warm", "cold"):
        r = med[f"read files ({state})"]
        for name in trees:
            if f"load {name} ({state})" not in med:
                continue
            l = med[f"load {name} ({state})"]
            print(f"{state}: load {name} / read files throughput = {r / l:.2f} "
                  f"({'met' if r / l >= 0.5 else 'NOT MET'}: goal >= 0.5)")
        if a.other and f"load other ({state})" in med and f"load this ({state})" in med:
            print(f"{state}: load this vs other: {med[f'load other ({state})'] / med[f'load this ({state})']:.2f}x faster")


if __name__ == "__main__":
    main()
