"""Does quantized gradient reduction (``grad_quant``, docs/grad_quant.md) train like the fp32 reduce, and
what does it save on the links between nodes?

1. Convergence: the pretraining job (examples/pretrain_llama.py) with its default preset and settings, at
   world 4 as 2 node groups of 2 ranks, run twice from the same seed -- the plain reduce, then
   ``--grad-quant int8 --grad-quant-node 2`` (optionally fp8 too) -- and the losses compared: the final loss
   (the mean of the last ``--tail`` steps' training losses) must be within ``--margin`` (relative) of the plain
   run's. The job runs as its users run it (``python -m torch.distributed.run``).
2. Bytes: one step of the same model (a short batch: bytes do not depend on it) per configuration, the
   engine's own counters (``schedule.counted``: bytes each rank put into each kind of collective), turned
   into bytes each rank sends per step over links inside a node group and across node groups, for a
   direct exchange (each rank sends each peer that peer's part; a ring moves the same totals):
   a reduce-scatter or all-to-all of ``X`` bytes over ``k`` ranks sends ``X (k - 1) / k``; a gather of
   ``X`` gathered bytes over ``k`` ranks sends ``X (k - 1) / k``; HSDP's plain all-reduce of ``X``
   bytes over ``R`` replicas ``2 X (R - 1) / R``. In a flat world of ``W`` ranks a share ``(W - L) / (W - 1)``
   of the peers is on another node.

CPU (not in CI; ~15-30 min on 2 busy cores):
    python benchmarks/bench_grad_quant.py --md runs/grad_quant.md
The result: benchmarks/results/grad_quant_cpu_2026-11-28.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist
from _common import init_distributed, launch, make_batch, make_model, md_table, versions

import yafsdp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {  # name -> (job flags, engine options, HSDP replicas)
    "fp32 reduce": ([], {}, 1),
    "int8, node 2": (["--grad-quant", "int8", "--grad-quant-node", "2"], dict(grad_quant="int8", grad_quant_node=2), 1),
    "fp8, node 2": (["--grad-quant", "fp8", "--grad-quant-node", "2"], dict(grad_quant="fp8", grad_quant_node=2), 1),
    "HSDP 2x2": (["--hsdp", "2"], {}, 2),
    "HSDP 2x2, int8": (["--hsdp", "2", "--grad-quant", "int8", "--grad-quant-node", "2"],
                       dict(grad_quant="int8", grad_quant_node=2), 2),
}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--node", type=int, default=2, help="ranks per node group")
    ap.add_argument("--preset", default="cpu-4x128", help="the job's preset (its default: cpu-4x128)")
    ap.add_argument("--steps", type=int, default=None, help="default: the preset's (300)")
    ap.add_argument("--train", nargs="*", default=["fp32 reduce", "int8, node 2"], help="configurations trained")
    ap.add_argument("--tail", type=int, default=20, help="final loss: mean of the last TAIL steps")
    ap.add_argument("--margin", type=float, default=0.01, help="relative final-loss margin")
    ap.add_argument("--out", default="runs/bench_grad_quant")
    ap.add_argument("--md", default=None)
    ap.add_argument("--skip-train", action="store_true", help="only count the bytes")
    a = ap.parse_args(argv)
    a.argv = " ".join(sys.argv)
    return a


# ------------------------------------------------------------------------------------ convergence
def train(a, name: str) -> dict:
    flags, _, _ = CONFIGS[name]
    out = os.path.join(a.out, name.replace(" ", "").replace(",", "_"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.world),
           os.path.join(ROOT, "examples", "pretrain_llama.py"), "--out", out, "--overwrite", "--save-every", "0",
           "--preset", a.preset, *(["--steps", str(a.steps)] if a.steps else []), *flags]
    t = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    losses = [r["loss"] for r in rows if "loss" in r]
    shown = [os.path.relpath(c, ROOT) if os.path.isabs(c) else c for c in cmd[2:]]
    return dict(losses=losses, final=sum(losses[-a.tail:]) / len(losses[-a.tail:]), seconds=time.time() - t,
                command=" ".join(shown))


# ------------------------------------------------------------------------------------ bytes
def _count(a):
    dev = init_distributed("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (_, opts, replicas) in CONFIGS.items():
        kw = {}
        if replicas > 1:
            from torch.distributed.device_mesh import init_device_mesh

            kw["mesh"] = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
        model = yafsdp.YaFSDP(make_model(a.preset, dev), **kw, **opts)
        b = make_batch(0, rank, 1, 16, model.module.config.vocab_size, dev)
        model(**b).loss.backward()
        model.sync_grads()
        kinds = Counter()
        for (kind, _), v in model.schedule.counted.items():
            kinds[kind] += v
        out[name] = dict(kinds=dict(kinds), replicas=replicas)
        del model
    if rank == 0:
        with open(a.bytes_json, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def links(kinds: dict, world: int, node: int, replicas: int) -> tuple[float, float, float]:
    """(bytes sent inside node groups, across them, and of those across the gradients') per rank and step:
    see the module docstring."""
    shard = world // replicas  # the shard group's ranks
    k = shard
    intra = cross = 0.0
    share_cross = (k - min(node, k)) / (k - 1) if k > 1 else 0.0
    gather = kinds.get("gather", 0) * (k - 1) / k
    intra, cross = intra + gather * (1 - share_cross), cross + gather * share_cross
    weights = cross
    if "reduce_quant" in kinds:  # the node stage (over `node` ranks) and the records (over the nodes)
        nodes = k // node
        intra += kinds.get("reduce", 0) * (node - 1) / node
        cross += kinds["reduce_quant"] * (nodes - 1) / nodes
    else:
        red = kinds.get("reduce", 0) * (k - 1) / k
        intra, cross = intra + red * (1 - share_cross), cross + red * share_cross
    if replicas > 1:  # every replica is on other nodes
        cross += kinds.get("all_reduce", 0) * 2 * (replicas - 1) / replicas
        cross += kinds.get("all_reduce_quant", 0) * (replicas - 1) / replicas
    return intra, cross, cross - weights


def main(argv=None):
    a = parse(argv)
    os.makedirs(a.out, exist_ok=True)
    a.bytes_json = os.path.join(a.out, "bytes.json")
    launch(_count, a, a.world)
    counted = json.load(open(a.bytes_json))
    rows = []
    for name, c in counted.items():
        intra, cross, grads = links(c["kinds"], a.world, a.node, c["replicas"])
        rows.append([name, f"{intra / 1e6:.3f}", f"{cross / 1e6:.3f}", f"{grads / 1e6:.3f}",
                     ", ".join(f"{k} {v / 1e6:.3f}" for k, v in sorted(c["kinds"].items()))])
    base = {r[0]: float(r[3]) for r in rows}
    for r in rows:
        ref = base["HSDP 2x2"] if r[0].startswith("HSDP") else base["fp32 reduce"]
        r.insert(4, f"{float(r[3]) / ref:.2f}x" if ref else "-")
    table = md_table(["configuration", "MB/step inside node groups", "MB/step across", "of which gradients",
                      "gradients across vs plain", "counted (MB put into collectives, by kind)"], rows)
    print(table)
    trained = {} if a.skip_train else {name: train(a, name) for name in a.train}
    lines = [f"# Quantized gradient reduction: convergence and bytes ({time.strftime('%Y-%m-%d')})", "",
             f"Command: `{a.argv}`", "", f"Versions: {versions()}", "",
             f"## Bytes per rank and step (world {a.world}, node groups of {a.node}; the {a.preset} preset, fp32)",
             "", table, ""]
    if trained:
        ref = trained[a.train[0]]
        lines += [f"## Convergence (the job's preset {a.preset}, world "
                  f"{a.world} = {a.world // a.node} node groups x {a.node})", "",
                  f"Final loss: the mean training loss of the last {a.tail} steps; margin {a.margin:.1%} relative.", ""]
        trows = []
        for name, t in trained.items():
            rel = (t["final"] - ref["final"]) / ref["final"]
            ok = abs(rel) <= a.margin
            trows.append([name, len(t["losses"]), f"{t['losses'][0]:.4f}", f"{t['final']:.4f}", f"{rel:+.2%}",
                          "yes" if ok else "NO", f"{t['seconds']:.0f}"])
        lines += [md_table(["configuration", "steps", "first loss", "final loss", "vs fp32", "within margin",
                            "seconds"], trows), ""]
        lines += [f"- `{name}`: `{t['command']}`" for name, t in trained.items()]
        if any(r[5] == "NO" for r in trows):
            print("\n".join(lines))
            raise SystemExit(f"final loss outside the {a.margin:.1%} margin")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
