"""Host memory and wall time of reading and writing Hugging Face checkpoints with yafsdp, against
the naive path (``from_pretrained`` on every rank, and the old whole-state-dict export).

CPU, gloo, world 2 (spawns its own ranks); a Llama-3.2-1B-shaped checkpoint with random bf16
weights, sharded like HF (made once under --dir, reused):
    python benchmarks/bench_io.py --md benchmarks/results/io_cpu_<date>.md
A minute-long check of the script itself (a tiny Llama):
    python benchmarks/bench_io.py --small

Each row runs in fresh processes (every rank a new interpreter), so a row's memory is its own.
Per rank the process measures its resident memory: the peak (VmHWM, reset through
/proc/self/clear_refs before the measured call, and VmRSS sampled every 5 ms in a thread) minus
the resident memory just before the call ("growth"). The goals, printed with the values -- a streamed
load or export holds a rank's own slices and one unit at a time, never the model (docs/io.md):
  load:   growth per rank <= its shard bytes + 1.2 x the largest unit + 1 GiB;
  export: the writer's growth <= one output shard + the largest unit + 1 GiB;
  load throughput >= half of what reading the files takes on this disk (the files were just
  written or read: the page cache holds them, so this compares with a cached read).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
from _common import finish_distributed, init_distributed, launch, md_table, versions  # this script's directory is on sys.path

GiB = 1 << 30


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama3-1b")
    ap.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the preset's)")
    ap.add_argument("--small", action="store_true", help="a tiny Llama (checks the script, not the goals' scale)")
    ap.add_argument("--dir", default=None, help="where the checkpoint is made (default: a folder in /tmp, removed)")
    ap.add_argument("--ckpt-shard-size", default="1GB", help="file size of the made checkpoint (HF sharding)")
    ap.add_argument("--max-shard-size", default="1GB", help="file size of the exports")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="load,qlora,export,old_export,merged,naive",
                    help="comma-separated rows to run")
    ap.add_argument("--md", default=None, help="write a markdown report here")
    ap.add_argument("--json", default=None, help="write the raw results here")
    a = ap.parse_args(argv)
    a.argv = " ".join(sys.argv)
    if a.small:
        a.preset, a.ckpt_shard_size, a.max_shard_size = "tiny", "100KB", "100KB"
    return a


# ---------------------------------------------------------------------------- measuring
class Resident:
    """Peak resident memory of this process over a block, minus the resident memory at its start."""

    def __enter__(self):
        self.base = self._status("VmRSS")
        try:  # "5": reset the peak resident set (VmHWM) to the current one (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self.peak, self._stop = self.base, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._status("VmRSS"))

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._status("VmHWM"), self._status("VmRSS"))
        self.growth = self.peak - self.base

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        return 0


# ---------------------------------------------------------------------------- the checkpoint
def make_checkpoint(a, path: str) -> dict:
    """A random-weight HF Llama checkpoint of preset ``a.preset`` in bf16, sharded like HF
    (config.json + model-0000i-of-0000n.safetensors + index), written tensor by tensor."""
    from yafsdp.export import ShardWriter
    from yafsdp.init import meta_parameters
    from yafsdp.presets import llama_config

    from transformers import LlamaForCausalLM

    cfg = llama_config(a.preset, **({"num_hidden_layers": a.layers} if a.layers else {}))
    with meta_parameters():
        meta = LlamaForCausalLM(cfg)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    plan = [(k, tuple(v.shape), torch.bfloat16) for k, v in meta.state_dict().items() if k not in tied]
    marker = os.path.join(path, "config.json")
    if not os.path.isfile(marker):
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        w = ShardWriter(tmp, plan, a.ckpt_shard_size)
        g = torch.Generator().manual_seed(0)
        for k, shape, _ in plan:
            t = torch.ones(shape) if k.endswith("norm.weight") else torch.randn(shape, generator=g) * 0.02
            w.write(k, t)
        w.close()
        cfg.architectures = ["LlamaForCausalLM"]
        cfg.torch_dtype = torch.bfloat16
        cfg.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.rename(tmp, path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    size = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    buf = bytearray(64 << 20)
    t0 = time.perf_counter()
    for f in files:  # the files read once, whole: what the disk (here: the page cache) gives
        with open(os.path.join(path, f), "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    read_s = time.perf_counter() - t0
    n = sum(torch.Size(s).numel() for _, s, _ in plan)
    return dict(files=len(files), bytes=size, params=n, read_s=read_s, read_gbps=size / read_s / 1e9)


# ---------------------------------------------------------------------------- rows (on every rank)
def _wrapped(a, path, peft_cfg=None):
    import yafsdp
    from yafsdp.hf import read_hf_config
    from yafsdp.init import meta_parameters

    from transformers import LlamaForCausalLM

    cfg = read_hf_config(path)
    with meta_parameters():
        model = LlamaForCausalLM(cfg)
    if peft_cfg is not None:
        import peft

        model = peft.get_peft_model(model, peft_cfg)
    return yafsdp.YaFSDP(model, param_dtype=torch.bfloat16)


def _unit_bytes(model) -> int:
    return max(sum(g.layout.padded_numel * g.shard.element_size() for g in u.groups) for u in model._rt.all)


def _shard_bytes(model) -> int:
    return sum(g.shard.numel() * g.shard.element_size() for u in model._rt.all for g in u.groups)


def row_load(a, path, out):
    from yafsdp.hf import export_hf, load_hf_weights, write_hf

    model = _wrapped(a, path)
    with Resident() as r:
        load_hf_weights(model, path)
    res = dict(load=_m(r, shard=_shard_bytes(model), unit=_unit_bytes(model)))
    if "export" in a.row_set:
        with Resident() as r:
            export_hf(model, os.path.join(out, "export"), dtype=torch.bfloat16, max_shard_size=a.max_shard_size)
        res["export"] = _m(r, unit=_unit_bytes(model))
    if "old_export" in a.row_set:
        with Resident() as r:
            sd = model.full_state_dict()
            if model.coordinator:
                write_hf(sd, model.module, os.path.join(out, "old_export"), dtype=torch.bfloat16)
            del sd
        res["old_export"] = _m(r, unit=_unit_bytes(model))
    return res


def row_qlora(a, path, out):
    try:
        from yafsdp.peft_load import load_peft_base, meta_peft_model
    except ImportError:
        return dict(skipped="yafsdp.peft_load (meta PEFT model + streamed base) is not in this version of yafsdp")
    import yafsdp
    from yafsdp.hf import read_hf_config

    built = meta_peft_model(read_hf_config(path), _lora_config(), seed=0)
    model = yafsdp.YaFSDP(built.model, param_dtype=torch.bfloat16, quantize_frozen="nf4")
    with Resident() as r:
        load_peft_base(model, path, built.adapters)
    return dict(qlora=_m(r, shard=_shard_bytes(model), unit=_unit_bytes(model)))


def _lora_config():
    import peft

    return peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                           lora_dropout=0.0)


def row_merged(a, path, out):
    import yafsdp

    try:  # the base from the checkpoint when the streamed PEFT load exists; else zero weights (time, memory)
        from yafsdp.peft_load import load_peft_base, meta_peft_model
        from yafsdp.hf import read_hf_config

        built = meta_peft_model(read_hf_config(path), _lora_config(), seed=0)
        model = yafsdp.YaFSDP(built.model, param_dtype=torch.bfloat16)
        load_peft_base(model, path, built.adapters)
        how = "base loaded from the checkpoint"
    except ImportError:
        model = _wrapped(a, path, _lora_config())
        model.mark_loaded()
        how = "weights zero (no streamed PEFT load in this version of yafsdp)"
    with Resident() as r:
        yafsdp.adapters.export_merged(model, os.path.join(out, "merged"), dtype=torch.bfloat16,
                                      max_shard_size=a.max_shard_size)
    return dict(merged=dict(_m(r, unit=_unit_bytes(model)), how=how))


def row_naive(a, path, out):
    from transformers import LlamaForCausalLM

    with Resident() as r:
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    return dict(naive=dict(_m(r), model_bytes=n))


ROWS = dict(load=row_load, qlora=row_qlora, merged=row_merged, naive=row_naive)


def _m(r: Resident, **extra) -> dict:
    return dict(growth=r.growth, base=r.base, seconds=r.seconds, **extra)


def _rank_main(a):
    init_distributed("cpu")
    rank = dist.get_rank()
    try:
        res = ROWS[a.row](a, a.ckpt, a.out)
    except Exception as e:  # noqa: BLE001 - reported in the table, the other rows still run
        res = dict(error=f"{type(e).__name__}: {e}"[:300])
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, res)
    if rank == 0:
        with open(a.result_file, "w") as f:
            json.dump(got, f)
    finish_distributed()


# ---------------------------------------------------------------------------- report
def main(argv=None):
    a = parse(argv)
    rows = [r for r in a.rows.split(",") if r]
    a.row_set = set(rows)
    own_dir = a.dir is None
    root = a.dir or tempfile.mkdtemp(prefix="bench_io_", dir="/tmp")
    os.makedirs(root, exist_ok=True)
    a.ckpt = os.path.join(root, f"ckpt_{a.preset}" + (f"_{a.layers}layers" if a.layers else ""))
    a.out = os.path.join(root, "out")
    lines = []

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    try:
        disk = shutil.disk_usage(root)
        ck = make_checkpoint(a, a.ckpt)
        say(f"checkpoint: {a.preset}" + (f" with {a.layers} layers" if a.layers else "")
            + f", {ck['params']:,} parameters, bf16, {ck['files']} files, "
            f"{ck['bytes'] / GiB:.2f} GiB in {a.ckpt} ({disk.free / GiB:.0f} GiB free there); "
            f"reading the files: {ck['read_s']:.2f} s = {ck['read_gbps']:.2f} GB/s (page cache warm)")
        results = {}
        for row in ("load", "qlora", "merged", "naive"):
            if row not in a.row_set and not (row == "load" and a.row_set & {"export", "old_export"}):
                continue
            shutil.rmtree(a.out, ignore_errors=True)
            os.makedirs(a.out)
            a.row, a.result_file = row, os.path.join(root, f"result_{row}.json")
            t0 = time.perf_counter()
            launch(_rank_main, a, a.world)
            with open(a.result_file) as f:
                per_rank = json.load(f)
            print(f"  row {row}: {time.perf_counter() - t0:.1f} s with the interpreters' start", flush=True)
            for rank, res in enumerate(per_rank):
                for k, v in res.items():
                    if k in ("error", "skipped"):
                        results.setdefault(k, []).append(f"row {row}, rank {rank}: {v}")
                    else:
                        results.setdefault(k, [None] * len(per_rank))[rank] = v
        report(a, ck, results, say)
        say("")
        say(f"command: {a.argv}")
        say("versions: " + json.dumps(versions()))
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        say(f"machine: {os.cpu_count()} cores, {mem / GiB:.0f} GiB memory, shared with other jobs (load average "
            f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} at the end): times are indicative")
        if a.md:
            with open(a.md, "w") as f:
                f.write("# bench_io: HF checkpoint load and export, host memory and time\n\n```\n" +
                        "\n".join(lines) + "\n```\n")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(checkpoint=ck, results=results), f, indent=1)
    finally:
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)
        else:
            shutil.rmtree(a.out, ignore_errors=True)


def report(a, ck, results, say):
    rows, goals = [], []
    for name, label in (("load", "load_hf_weights (streaming)"), ("qlora", "QLoRA load (meta PEFT + NF4)"),
                        ("export", "export_hf (streaming)"), ("old_export", "full_state_dict + write_hf (old)"),
                        ("merged", "export_merged (streaming)"), ("naive", "from_pretrained on every rank")):
        per = results.get(name)
        if per is None:
            continue
        for rank, m in enumerate(per):
            if m is None:
                continue
            gbps = ck["bytes"] / m["seconds"] / 1e9 if name in ("load", "qlora", "naive") else None
            rows.append([label, rank, f"{m['growth'] / GiB:.3f}", f"{m['seconds']:.2f}",
                         f"{gbps:.2f}" if gbps else "-", m.get("how", "")])
            if name == "load":
                bound = m["shard"] + 1.2 * m["unit"] + GiB
                goals.append((f"load rank {rank}: growth {m['growth'] / GiB:.3f} GiB <= shard {m['shard'] / GiB:.3f} + "
                              f"1.2 x unit {m['unit'] / GiB:.3f} + 1 GiB = {bound / GiB:.3f} GiB", m["growth"] <= bound))
            if name in ("export", "merged", "old_export") and rank == 0:
                from yafsdp.export import parse_size

                bound = parse_size(a.max_shard_size) + m["unit"] + GiB
                goals.append((f"{name} writer: growth {m['growth'] / GiB:.3f} GiB <= shard {parse_size(a.max_shard_size) / GiB:.3f}"
                              f" + unit {m['unit'] / GiB:.3f} + 1 GiB = {bound / GiB:.3f} GiB"
                              + (" (the old path, for comparison)" if name == "old_export" else ""), m["growth"] <= bound))
        if name == "qlora":  # what streaming is for: a base larger than one rank's share of host memory
            share = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / a.world
            for rank, m in enumerate(per):
                if m is None:
                    continue
                peak = m["base"] + m["growth"]
                goals.append((f"QLoRA rank {rank}: base {ck['bytes'] / GiB:.2f} GiB on disk > one rank's share of host "
                              f"memory {share / GiB:.2f} GiB, and the rank's peak resident memory {peak / GiB:.2f} GiB "
                              f"({m['base'] / GiB:.2f} before the load, with the interpreter and the wrapped NF4 model, "
                              f"+ {m['growth'] / GiB:.2f} growth) fits in that share", ck["bytes"] > share and peak < share))
        if name == "load":
            slow = max(m["seconds"] for m in per)
            gbps = ck["bytes"] / slow / 1e9
            goals.append((f"load throughput {gbps:.2f} GB/s >= half the files' read {ck['read_gbps']:.2f} GB/s",
                          gbps >= 0.5 * ck["read_gbps"]))
    say(md_table(["path", "rank", "RSS growth GiB", "seconds", "GB/s of the files", "note"], rows))
    for name in ("error", "skipped"):
        for v in results.get(name, []):
            say(f"{name}: {v}")
    say("")
    say("goals (a rank holds its slices and one unit at a time; docs/io.md):")
    for text, ok in goals:
        say(f"  [{'met' if ok else 'NOT MET'}] {text}")


if __name__ == "__main__":
    main()
