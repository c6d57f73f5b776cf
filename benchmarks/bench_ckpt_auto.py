"""Activation checkpointing chosen by the plan (``yafsdp.plan.choose_checkpointing``): for memory
budgets from "every block checkpointed" to "none", the blocks the plan picks, its predicted peak
against the measured one, and the step time against checkpointing every block and none.

CPU (one process, a fake process group of --world ranks: the plan and the memory of one rank of a
--world-rank job, collectives skipped; the torch CPU allocator's live bytes measured exactly):
    python benchmarks/bench_ckpt_auto.py --md benchmarks/results/ckpt_auto_cpu_<date>.md \\
        --png benchmarks/results/ckpt_auto_cpu_<date>.png
Tensor parallel (CPU; --world ranks as dp x TP, yafsdp's Llama plan with sequence parallel; the plan traced on
the wrapped model's TP mesh):
    python benchmarks/bench_ckpt_auto.py --world 4 --tp 2 [--loss-parallel] --layers 4 --seq 128
GPU (world 1, bf16; CUDA's allocator counters):
    python benchmarks/bench_ckpt_auto.py --device cuda --preset llama3-1b --batch 2 --seq 2048 --bf16

Budgets: --points values evenly spaced from the plan's peak with every block checkpointed to its
peak with none. Memory: a fresh engine per distinct choice, 3 steps, the steady peak (steps 2-3).
Time: one engine whose checkpointed blocks are switched (``apply_checkpointing``) between the
choices, --rounds rounds of --steps steps per choice, interleaved so every choice sees the same
machine; medians. Goals: |predicted - measured| / measured <= 5%; step time between "all" and
"none", falling as the budget grows.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import finish_distributed, init_fake, make_batch, md_table, versions  # noqa: E402

import yafsdp  # noqa: E402
from yafsdp.integrations.tp_plans import loss_context  # noqa: E402
from yafsdp.measure import measure_memory  # noqa: E402
from yafsdp.plan import apply_checkpointing, choose_checkpointing  # noqa: E402
from yafsdp.presets import build_llama  # noqa: E402

MiB = 2**20


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--preset", default="cpu-6x256")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--vocab", type=int, default=2048,
                    help="override the preset's vocabulary (0: keep it); a small one lets the blocks' activations, "
                    "not the logits, decide the peak")
    ap.add_argument("--world", type=int, default=2, help="CPU: ranks of the fake process group")
    ap.add_argument("--tp", type=int, default=1, help="CPU: tensor parallel degree (--world = dp x TP)")
    ap.add_argument("--loss-parallel", action="store_true", help="with --tp: the logits split over the vocabulary")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--bf16", action="store_true", help="param_dtype bf16 (GPU)")
    ap.add_argument("--points", type=int, default=6, help="budgets from 'all' to 'none'")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per choice per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU: torch threads (1: on a shared machine more threads spin against other jobs)")
    ap.add_argument("--md", default=None)
    ap.add_argument("--png", default=None)
    return ap.parse_args()


def main():
    a = parse()
    over = {k: v for k, v in (("num_hidden_layers", a.layers), ("vocab_size", a.vocab or None)) if v}
    if a.device == "cuda":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
        world = 1
    else:
        torch.set_num_threads(a.threads)
        dev = torch.device("cpu")
        init_fake(a.world, dev)
        world = a.world
    pdt = torch.bfloat16 if a.bf16 else None
    mesh = None
    if a.tp > 1:
        if a.device != "cpu" or world % a.tp:
            raise SystemExit(f"--tp {a.tp}: the CPU only, with --world a multiple of it")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // a.tp, a.tp), mesh_dim_names=("dp", "tp"))
    meta = build_llama(a.preset, device="meta", **over)
    vocab = meta.config.vocab_size

    def wrap(model):
        if mesh is None:
            return yafsdp.YaFSDP(model, param_dtype=pdt, device=dev)
        from yafsdp.integrations.tp_plans import parallelize_llama

        parallelize_llama(model, mesh["tp"], sequence_parallel=True, loss_parallel=a.loss_parallel)
        return yafsdp.YaFSDP(model, param_dtype=pdt, device=dev, mesh=mesh["dp"])

    if mesh is None:  # the plan of the model before wrapping
        planned, opts = meta, dict(world_size=world, batch=a.batch, seq=a.seq, param_dtype=pdt)
    else:  # under TP: the wrapped model's plan, traced on its TP mesh (the world's process group is up)
        planned, opts = _meta_engine(a, over, dev, wrap), dict(batch=a.batch, seq=a.seq)
    ends = choose_checkpointing(planned, budget=1 << 60, **opts)  # peak_none / peak_all
    budgets = [ends.peak_all + (ends.peak_none - ends.peak_all) * i // (a.points - 1) for i in range(a.points)]
    choices = [choose_checkpointing(planned, budget=b, **opts) for b in budgets]
    del planned
    ks = sorted({len(c.indices) for c in choices} | {0, len(ends.all_blocks)})
    tp = f" = dp {world // a.tp} x TP {a.tp}{' (loss parallel)' if a.loss_parallel else ''}" if mesh is not None else ""
    print(f"{a.preset} {over} b={a.batch} s={a.seq} world={world}{tp}: blocks checkpointed per budget "
          f"{[len(c.indices) for c in choices]}", flush=True)

    def build(k, meta_init=True):
        def _build():
            # meta_init (the memory runs, as tests/unit/test_plan.py): each rank allocates only its shards, so
            # nothing but the engine, the optimizer and the step is live; the timed engine has real weights.
            model = build_llama(a.preset, device="meta" if meta_init else dev, **over)
            if meta_init:
                from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

                model.model.rotary_emb = LlamaRotaryEmbedding(model.config).to(dev)
            eng = wrap(model)
            if meta_init:
                eng.mark_loaded()
            apply_checkpointing(eng, range(k))
            return eng, torch.optim.AdamW(eng.parameters(), lr=1e-4, foreach=True)
        return _build

    def step(engine, i):
        model, opt = engine
        with loss_context(a.loss_parallel):
            model(**make_batch(i, 0, a.batch, a.seq, vocab, dev)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    method = "cuda" if a.device == "cuda" else "torch"
    measured, predicted = {}, {}
    for k in ks:
        m = measure_memory(build(k), step, 3, dev, method=method)
        measured[k] = m["peak_steady"]
        predicted[k] = ends.take(k).peak
        print(f"  k={k}: predicted {predicted[k] / MiB:.1f} MiB, measured {measured[k] / MiB:.1f} MiB "
              f"({100 * (predicted[k] - measured[k]) / measured[k]:+.1f}%)", flush=True)
    # Time: one engine, the checkpointed blocks switched between choices, interleaved rounds.
    engine = build(0, meta_init=False)()
    times = {k: [] for k in ks}
    for i in range(2):  # warm-up
        step(engine, i)
    for r in range(a.rounds):
        for k in ks:
            apply_checkpointing(engine[0], range(k))
            for s in range(a.steps):
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                step(engine, 100 + r * 100 + s)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    # The fastest step of each choice: on a busy shared machine the least disturbed, so the closest to
    # the choice's own cost (other jobs only ever add time); the table gives both.
    low = {k: min(v) for k, v in times.items()}
    n = len(ends.all_blocks)
    rows = []
    for b, c in zip(budgets, choices):
        k = len(c.indices)
        rows.append([f"{b / MiB:.1f}", f"{k}/{n}", f"{predicted[k] / MiB:.1f}", f"{measured[k] / MiB:.1f}",
                     f"{100 * (predicted[k] - measured[k]) / measured[k]:+.1f}%", f"{1e3 * med[k]:.1f}",
                     f"{med[k] / med[0]:.3f}", f"{med[k] / med[n]:.3f}", f"{1e3 * low[k]:.1f}",
                     f"{low[k] / low[0]:.3f}", f"{low[k] / low[n]:.3f}"])
    head = ["budget MiB", "checkpointed", "predicted peak MiB", "measured peak MiB", "error", "step ms (median)",
            "vs none", "vs all", "step ms (min)", "min vs none", "min vs all"]
    table = md_table(head, rows)
    spread = {k: (max(v) - min(v)) / statistics.median(v) for k, v in times.items()}
    v = versions(dev)
    worst = max(abs(predicted[k] - measured[k]) / measured[k] for k in ks)
    lines = [
        f"# Activation checkpointing chosen by the plan: {a.preset} on {a.device}, {v['date']}",
        "",
        "Command: `python benchmarks/bench_ckpt_auto.py " + " ".join(sys.argv[1:]) + "`",
        "",
        f"Model: {a.preset} with {over or 'its own shape'} ({n} blocks), batch {a.batch} x seq {a.seq}, "
        f"{'bf16' if a.bf16 else 'fp32'}, ZeRO-3, AdamW; " + (
            f"plan and memory of one rank of world {world}{tp} (fake process group: collectives skipped)."
            if a.device == "cpu" else "world 1."),
        f"Memory: {m['how']}; steady peak of steps 2-3, one fresh engine per choice. Time: medians of "
        f"{a.rounds} interleaved rounds x {a.steps} steps per choice, one engine switched between choices; "
        "'min': the fastest step of each choice (the least disturbed by other jobs; faint in the plot).",
        "",
        table,
        "",
        f"Largest |predicted - measured| / measured: {100 * worst:.1f}% (goal <= 5%).",
        "Own spread of the step times (max - min over median): "
        + ", ".join(f"{k}/{n} {100 * s:.0f}%" for k, s in spread.items()),
        "",
        f"Versions: python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, "
        f"{v.get('gpu') or v.get('cpu')} ({v['cpus']} CPUs); load average at the end {v['load_avg']}.",
    ]
    if a.device == "cpu":
        lines.append("The machine is shared (2 cores, several jobs at once) and noisy: the step-time ratios are "
                     "what counts, not the milliseconds; rerun on an idle machine for clean figures.")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.md:
        import json

        with open(os.path.splitext(a.md)[0] + ".json", "w") as f:  # the raw step times, for re-plotting
            json.dump(dict(budgets=budgets, checkpointed=[len(c.indices) for c in choices], predicted=predicted,
                           measured=measured, times=times, versions=v), f, indent=1)
        os.makedirs(os.path.dirname(os.path.abspath(a.md)), exist_ok=True)
        with open(a.md, "w") as f:
            f.write(text)
    if a.png:
        plot(a.png, budgets, choices, predicted, measured, med, low, n,
             f"{a.preset} b={a.batch} s={a.seq} ({a.device})")
    finish_distributed()


def _meta_engine(a, over, dev, wrap):
    """A wrapped model whose engine allocated only its shards (meta init), for the plan's choices under TP."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model = build_llama(a.preset, device="meta", **over)
    model.model.rotary_emb = LlamaRotaryEmbedding(model.config).to(dev)
    eng = wrap(model)
    eng.mark_loaded()
    return eng


def plot(path, budgets, choices, predicted, measured, med, low, n, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [b / MiB for b in budgets]
    ks = [len(c.indices) for c in choices]
    fig, ax = plt.subplots(figsize=(7, 5.2))
    ax.plot(x, [1e3 * med[k] for k in ks], "o-", color="C0", label="step time (median), auto")
    ax.plot(x, [1e3 * low[k] for k in ks], "o", color="C0", alpha=0.35, label="step time (fastest step), auto")
    ax.axhline(1e3 * med[n], color="C0", ls=":", label="step time, every block checkpointed")
    ax.axhline(1e3 * med[0], color="C0", ls="--", label="step time, none checkpointed")
    for xi, k, t in zip(x, ks, [1e3 * med[k] for k in ks]):
        ax.annotate(f"{k}/{n}", (xi, t), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xlabel("memory budget per device (MiB)")
    ax.set_ylabel("step time (ms)", color="C0")
    ax2 = ax.twinx()
    ax2.plot(x, [predicted[k] / MiB for k in ks], "s--", color="C1", label="peak, predicted")
    ax2.plot(x, [measured[k] / MiB for k in ks], "^-", color="C3", label="peak, measured")
    ax2.plot(x, x, color="gray", lw=0.8, label="budget")
    ax2.set_ylabel("peak memory (MiB)", color="C3")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    ax.set_title(f"checkpointing chosen by the plan: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
