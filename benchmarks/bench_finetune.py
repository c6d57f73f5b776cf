"""Fine-tuning step time and peak memory per rank: LoRA and QLoRA under yafsdp (with and without
offload) against FSDP2 (LoRA; QLoRA with torchao's NF4Tensor when torchao imports), in one
interleaved run; the same engines with the fake process group at larger worlds (memory: plan vs
measured); and the bytes gathered per step for the frozen base, NF4 vs bf16 (benchmarks/nf4_gather.py).

    python benchmarks/bench_finetune.py                       # CPU, world 2 (gloo), spawned here
    python benchmarks/bench_finetune.py --fake-worlds 8,64    # + fake process group, rank 0 of each world
    python benchmarks/bench_finetune.py --md benchmarks/results/finetune_cpu_<date>.md --json ...

Engines (the same PEFT model: LoRA r on every linear layer but lm_head, the base frozen; same data):
  yafsdp-lora, yafsdp-lora+offload (offload="optimizer"), fsdp2-lora,
  yafsdp-qlora (quantize_frozen="nf4"), yafsdp-qlora+offload-all (offload="all"),
  fsdp2-qlora-torchao (every frozen nn.Linear weight a torchao NF4Tensor; only when torchao imports:
  it is looked for in ./.torchao as well).
Competitors are interleaved step by step, so per-step ratios see the same machine load; absolute
times on a shared 2-core VM move with it (see [Note: noise] in yafsdp/tools/measure.py). Memory: the
process heap above the pre-build baseline (glibc mallinfo2, all threads) for the real run; with the
fake process group the torch CPU allocator's live bytes (exact), next to yafsdp's plan. On a CPU,
"host" and "device" are the same memory: offload changes where bytes would live on a GPU, not the
CPU total (the table shows the plan's per-GPU figure for that).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

import yafsdp  # noqa: E402
from _common import (  # noqa: E402
    finish_distributed,
    MiB, decoder_layers, init_fake, launch, make_batch, md_table, versions, write_json,
)
from yafsdp.measure import measure_memory, noise_report  # noqa: E402
from yafsdp.presets import build_llama  # noqa: E402

ENGINES = ("yafsdp-lora", "yafsdp-lora+offload", "fsdp2-lora", "yafsdp-qlora", "yafsdp-qlora+offload-all",
           "fsdp2-qlora-torchao")


def torchao_nf4():
    """torchao's (to_nf4, linear_nf4), or None with the reason."""
    local = os.path.join(ROOT, ".torchao")
    if os.path.isdir(local) and local not in sys.path:
        sys.path.append(local)
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        return None, f"{type(e).__name__}: {e}"
    return (to_nf4, linear_nf4), None


def nf4_linear(linear, world: int = 1) -> bool:
    """``linear``'s weight as a torchao NF4Tensor (64-value blocks; the block scales double-quantized in
    the largest group size that divides, and whose groups split evenly over ``world`` ranks, as FSDP2
    splits every inner tensor), used through torchao's ``linear_nf4`` (no bias: Llama's linears have
    none). False, the weight left dense, where no group size fits (yafsdp keeps such weights bf16 too)."""
    (to_nf4, linear_nf4), why = torchao_nf4()
    w = linear.weight
    blocks = w.numel() // 64
    sbs = next((s for s in (256, 128, 64, 32, 16, 8) if w.numel() % 64 == 0
                and blocks % s == 0 and (blocks // s) % world == 0), None)
    if sbs is None:
        return False
    linear.weight = torch.nn.Parameter(to_nf4(w.detach(), 64, sbs), requires_grad=False)
    linear.forward = (lambda m: lambda x: linear_nf4(x, m.weight))(linear)
    return True


def lora_model(a, seed: int = 0, meta: bool = False):
    """The PEFT model. ``meta``: parameters on the meta device (rotary buffers real), for memory runs in
    which only what each engine allocates counts (the engines then hold zeros)."""
    import peft

    model = build_llama(a.preset, device="meta" if meta else "cpu", seed=seed)
    if meta:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        model.model.rotary_emb = LlamaRotaryEmbedding(model.config)
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, lora_dropout=0.0,
                                                       target_modules="all-linear"))
    if meta:
        return model
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # B starts at zero in PEFT: make the adapters matter from the first step
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    return model


def _adamw(params, lr):
    params = [p for p in params if p.requires_grad]
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    except (RuntimeError, ValueError):  # pragma: no cover - depends on the build
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True)


def build(name: str, a, meta: bool = False):
    """(model, optimizer) for engine ``name`` around a fresh PEFT model (``meta``: zero weights, see lora_model)."""
    model = lora_model(a, meta=meta)
    if name.startswith("yafsdp"):
        opts = dict(quantize_frozen="nf4") if "qlora" in name else {}
        if name.endswith("+offload"):
            opts["offload"] = "optimizer"
        elif name.endswith("+offload-all"):
            opts["offload"] = "all"
        wrapped = yafsdp.YaFSDP(model, **opts)
        if meta:
            wrapped.mark_loaded()
        return wrapped, yafsdp.FusedAdamW([p for p in wrapped.parameters() if p.requires_grad], lr=a.lr,
                                          weight_decay=0.0)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if name == "fsdp2-qlora-torchao":
        import peft

        for mod in model.modules():
            if isinstance(mod, peft.tuners.lora.Linear):
                nf4_linear(mod.base_layer, dist.get_world_size())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in decoder_layers(model.base_model.model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if meta:
        rotary = model.base_model.model.model.rotary_emb
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        model.base_model.model.model.rotary_emb = LlamaRotaryEmbedding(rotary.config)
    return model, _adamw(model.parameters(), a.lr)


def step(engine, i: int, a, rank: int, vocab: int) -> float:
    model, opt = engine
    loss = model(**make_batch(i, rank, a.batch, a.seq, vocab, "cpu")).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def plan_of(name: str, a, world: int):
    """yafsdp's plan for engine ``name`` (None for FSDP2)."""
    if not name.startswith("yafsdp"):
        return None
    from yafsdp.plan import memory_plan

    off = "optimizer" if name.endswith("+offload") else "all" if name.endswith("+offload-all") else None
    return memory_plan(lora_model(a, meta=True), world_size=world, quantize_frozen="nf4" if "qlora" in name else None,
                       offload=off, batch=a.batch, seq=a.seq)


def run_real(a):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = build_llama(a.preset, device="meta").config.vocab_size
    names = list(a.engines)
    if "fsdp2-qlora-torchao" in names and torchao_nf4()[0] is None:
        names.remove("fsdp2-qlora-torchao")
    load_before = os.getloadavg()[0]
    engines = {n: build(n, a) for n in names}
    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    for i in range(a.warmup + a.steps):
        for n in names:  # interleaved: every engine runs step i before any runs step i + 1
            dist.barrier()
            t = time.perf_counter()
            loss = step(engines[n], i, a, rank, vocab)
            dt = time.perf_counter() - t
            if i >= a.warmup:
                times[n].append(dt * 1e3)
                losses[n].append(loss)
    del engines
    mems = {}
    for n in names:
        m = measure_memory(lambda n=n: build(n, a), lambda e, i: step(e, i, a, rank, vocab), a.mem_steps,
                           torch.device("cpu"), method="heap")
        mems[n] = m["peak_steady"] / MiB
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from nf4_gather import measure as gathered

    g = gathered()
    plans = {n: plan_of(n, a, world) for n in names}
    if rank == 0:
        report_real(a, world, names, times, losses, mems, plans, g, load_before)
    finish_distributed()


def report_real(a, world, names, times, losses, mems, plans, g, load_before):
    med = {n: statistics.median(times[n]) for n in names}
    rows = []
    for n in names:
        p = plans[n]
        vs = "fsdp2-qlora-torchao" if "qlora" in n and "fsdp2-qlora-torchao" in names else "fsdp2-lora"
        rows.append([n, med[n], min(times[n]), max(times[n]), med[n] / med[vs] if vs in med else None, mems[n],
                     p.total / MiB if p else None, p.device_total / MiB if p else None,
                     p.host_total / MiB if p else None, losses[n][-1]])
    header = ["engine", "step ms (median)", "min", "max", "x FSDP2 (same recipe)", "peak heap MiB (steps 2+)",
              "plan MiB (all)", "plan: per GPU MiB", "plan: host MiB", "last loss"]
    table = md_table(header, rows)
    goals = [dict(engine=n, vs="fsdp2-lora", ratio=med[n] / med["fsdp2-lora"], limit=None, met=None)
             for n in names if n.startswith("yafsdp-lora") and "fsdp2-lora" in med]
    noise, info = noise_report(times, goals, True, load_before, os.cpu_count() or 1,
                               competitors=("fsdp2-lora", "fsdp2-qlora-torchao"))
    skipped = [n for n in a.engines if n not in names]
    setup = (f"world {world} (gloo, CPU), preset {a.preset}, PEFT LoRA r={a.lora_r} on every linear layer but "
             f"lm_head (base frozen), fp32, batch {a.batch} x seq {a.seq} per rank, {a.steps} timed steps after "
             f"{a.warmup} warm-up, interleaved; memory: {a.mem_steps} steps per engine on its own")
    lines = [f"bench_finetune: {setup}", "", table, "",
             f"frozen base gathered per step (world {world}, benchmarks/nf4_gather.py): NF4 {g['base_nf4']:,} bytes vs "
             f"bf16 {g['base_bf16']:,} bytes = {g['ratio']:.3f}x (goal <= 0.30: "
             f"{'met' if g['ratio'] <= 0.30 else 'not met'})", *noise]
    if skipped:
        lines.append(f"not run: {', '.join(skipped)} ({torchao_nf4()[1]})")
    text = "\n".join(lines)
    print(text, flush=True)
    result = dict(kind="bench_finetune", command=a.argv, setup=setup, versions=versions(), times_ms=times,
                  losses=losses, peak_heap_mib=mems, table=table, gathered=g, noise=info, skipped=skipped,
                  plans={n: (p.to_dict() if p else None) for n, p in plans.items()})
    if a.json:
        write_json(a.json, result)
    if a.md:
        _write_md(a, result, text)


def run_fake(a) -> str:
    worlds = [int(w) for w in a.fake_worlds.split(",")]
    names = [n for n in a.engines if n != "fsdp2-qlora-torchao"]
    rows, out = [], []
    vocab = build_llama(a.preset, device="meta").config.vocab_size
    for w in worlds:
        init_fake(w, torch.device("cpu"))
        for n in names:
            m = measure_memory(lambda n=n: build(n, a, meta=True), lambda e, i: step(e, i, a, 0, vocab), 3,
                               torch.device("cpu"), method="torch")
            p = plan_of(n, a, w)
            row = dict(world=w, engine=n, peak_mib=m["peak_steady"] / MiB, growth=m["growth_from_step2"],
                       plan_mib=p.total / MiB if p else None, plan_gpu_mib=p.device_total / MiB if p else None,
                       plan_host_mib=p.host_total / MiB if p else None)
            out.append(row)
            rows.append([w, n, row["peak_mib"], row["plan_mib"],
                         (row["plan_mib"] / row["peak_mib"] if p else None), row["plan_gpu_mib"],
                         row["plan_host_mib"], row["growth"]])
            print(f"fake world {w} {n}: peak {row['peak_mib']:.1f} MiB", flush=True)
        finish_distributed()
    header = ["world", "engine", "measured peak MiB", "plan MiB", "plan / measured", "plan: per GPU MiB",
              "plan: host MiB", "growth B (step 2+)"]
    text = "\n".join([f"fake process group (rank 0 of each world, collectives do nothing), the same PEFT model built on "
                      "the meta device (each engine allocates only its own tensors, zeros), same batch; memory: torch "
                      "CPU allocator live bytes, steps 2-3", "", md_table(header, rows)])
    print(text, flush=True)
    a._fake_rows = out
    return text


def _write_md(a, result, text):
    v = result["versions"]
    body = [f"# bench_finetune — CPU ({v.get('cpus')} cores, {v.get('cpu', '')}) — {v['date']}", "",
            f"Command: `{' '.join(a.argv)}`", "",
            f"Versions: python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, "
            f"yafsdp {v['yafsdp']}; load average at the end {v['load_avg']}.", "",
            "A 2-core VM shared with other jobs and test runs: the competitors are interleaved step by step, so "
            "the ratios are the figures to read; absolute times move with the load.", "", "```", text, "```"]
    fake = getattr(a, "_fake_text", None)
    if fake:
        body += ["", "```", fake, "```"]
    os.makedirs(os.path.dirname(os.path.abspath(a.md)), exist_ok=True)
    with open(a.md, "w") as f:
        f.write("\n".join(body) + "\n")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="CPU ranks of the real (gloo) run")
    ap.add_argument("--preset", default="cpu-6x256", help="yafsdp.presets model (base of the PEFT model)")
    ap.add_argument("--lora-r", type=int, default=8, help="adapter rank")
    ap.add_argument("--batch", type=int, default=2, help="micro-batch per rank")
    ap.add_argument("--seq", type=int, default=128, help="sequence length")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per engine")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--mem-steps", type=int, default=3, help="steps of each engine's memory run")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, from: " + ", ".join(ENGINES))
    ap.add_argument("--fake-worlds", default="", help="also run the fake process group at these worlds (e.g. 8,64)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    ap.add_argument("--md", default=None, help="write a markdown report here")
    a = ap.parse_args(argv)
    a.engines = [e for e in a.engines.split(",") if e]
    bad = [e for e in a.engines if e not in ENGINES]
    if bad:
        ap.error(f"unknown engine(s) {bad}; choose from {', '.join(ENGINES)}")
    if "fsdp2-lora" not in a.engines:
        ap.error("--engines must include fsdp2-lora (the reference of the ratios)")
    a.argv = ["python", "benchmarks/bench_finetune.py", *(argv if argv is not None else sys.argv[1:])]
    return a


def main(argv=None):
    a = parse(argv)
    if a.fake_worlds:  # first, in this process (one rank emulated per world), so the real run's report can carry it
        import torch.multiprocessing as mp  # noqa: F401 - nothing spawned for the fake run

        a._fake_text = run_fake(a)
    launch(run_real, a, a.world)


if __name__ == "__main__":
    main()
