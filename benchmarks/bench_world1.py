"""World 1 pays nothing? Peak memory of one training step at world 1: yafsdp against plain PyTorch
with the same optimizer and against torch FSDP2 (``fully_shard``), in fp32 and bf16, for a full
fine-tune, for PEFT LoRA and for QLoRA (bf16), with the torch CPU allocator's exact counts.

    python benchmarks/bench_world1.py --md benchmarks/results/world1_cpu_<date>.md
    python benchmarks/bench_world1.py --device cuda --preset llama3-1b --md benchmarks/results/world1_<gpu>_<date>.md

One process, a fake process group of one rank (collectives do nothing; no gloo threads, so every
allocation and free is on this thread and :class:`yafsdp.measure.CpuAllocTracker` sees it exactly).
``--device cuda``: the same on the GPU, measured with the CUDA caching allocator
(``torch.cuda.max_memory_allocated`` per step, and ``max_memory_reserved``: what the allocator held).
Every engine: the same HF Llama (``--preset``, ``--layers``), torch AdamW (fused where the build has
it) over the trainable parameters, batch x seq random tokens, HF's loss, 3 steps,
``zero_grad(set_to_none=True)``; the steady peak is steps 2-3.

- **yafsdp**: ``YaFSDP(model, param_dtype=...)`` (ZeRO-3, fp32 reduce), built on meta and
  ``mark_loaded`` (zero shards: memory only).
- **plain**: the model itself, fp32 parameters (the master), AdamW; bf16: ``torch.autocast("cpu",
  torch.bfloat16)`` (its cast weights live for the forward; the backward recasts nothing). LoRA, bf16:
  the frozen base stored in bf16, the adapters fp32, as a user keeps a LoRA base.
- **fsdp2**: ``fully_shard`` per decoder layer and at the root, ``MixedPrecisionPolicy(bf16, fp32
  reduce)`` in bf16. LoRA, bf16: the base in bf16 before sharding, the adapters fp32.
- **QLoRA** (``bf16-qlora``): the LoRA model with every frozen linear weight NF4: yafsdp
  ``quantize_frozen="nf4"``; plain and FSDP2 torchao's ``NF4Tensor`` (``linear_nf4``; torchao is looked
  for in ./.torchao as well). FSDP2 with torchao's NF4 fails at world 1; its row says why.

The yafsdp row also gives the plan's figures (``memory_plan`` of a meta model): the state it holds
between steps and its predicted peak. Goal: yafsdp's peak <= 1.00x FSDP2's and <= 1.00x
plain PyTorch's in every configuration.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MiB, _adamw, finish_distributed, init_fake, make_batch, md_table, versions  # noqa: E402

import yafsdp  # noqa: E402
from yafsdp.measure import measure_memory  # noqa: E402
from yafsdp.presets import build_llama  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-6x256")
    ap.add_argument("--layers", type=int, default=2, help="override the preset's layer count (0: keep it)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--configs", default="fp32-full,bf16-full,fp32-lora,bf16-lora,bf16-qlora",
                    help="comma list of {fp32,bf16}-{full,lora} and bf16-qlora")
    ap.add_argument("--engines", default="yafsdp,plain,fsdp2")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cpu: the torch CPU allocator's exact counts; cuda: the caching allocator's allocated and "
                         "reserved peaks")
    ap.add_argument("--md", default=None, help="write the report here (and its JSON beside it)")
    return ap.parse_args(argv)


def _model(a, meta: bool, lora: bool, base_dtype=None):
    """The preset Llama (meta: parameters on meta, real rotary buffers), with PEFT LoRA adapters."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    over = {"num_hidden_layers": a.layers} if a.layers else {}
    dev = "meta" if meta else a.device
    model = build_llama(a.preset, device=dev, **over)
    if meta:
        model.model.rotary_emb = LlamaRotaryEmbedding(model.config).to(a.device)
    if lora:
        import peft

        model.requires_grad_(False)
        if base_dtype is not None:
            model.to(base_dtype)
            # its fp32 frequencies, as HF keeps them
            model.model.rotary_emb = LlamaRotaryEmbedding(model.config).to(a.device)
        model = peft.get_peft_model(model, peft.LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, target_modules=TARGETS,
                                                           lora_dropout=0.0, task_type="CAUSAL_LM"))
        for n, p in model.named_parameters():  # the adapters train in fp32 whatever the base's dtype
            if p.requires_grad:
                p.data = p.data.float()
    return model


def _nf4_base(model) -> int:
    """QLoRA for the competitors: every frozen ``nn.Linear`` weight of the PEFT model (the adapted
    layers' bases, the MLP, ``lm_head``; bf16 already) becomes a torchao NF4Tensor
    (bench_finetune.nf4_linear) -- the weights yafsdp's ``quantize_frozen="nf4"`` stores as NF4. Returns
    how many; raises when torchao does not import."""
    from bench_finetune import nf4_linear, torchao_nf4

    if torchao_nf4()[0] is None:
        raise RuntimeError(f"torchao's NF4 is not available: {torchao_nf4()[1]}")
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and not m.weight.requires_grad
               and m.bias is None]
    return sum(nf4_linear(m) for m in linears)


def build(a, engine: str, bf16: bool, lora: bool, qlora: bool = False):
    """() -> (model, optimizer, autocast dtype or None). ``qlora``: a LoRA model whose frozen linear
    weights are NF4 (yafsdp: ``quantize_frozen="nf4"``; the others: torchao's NF4Tensor)."""
    pdt = torch.bfloat16 if bf16 else None

    def _build():
        if engine == "yafsdp":
            model = yafsdp.YaFSDP(_model(a, True, lora), param_dtype=pdt, reduce_dtype=torch.float32, device=a.device,
                                  quantize_frozen="nf4" if qlora else None)
            model.mark_loaded()
            cast = None
        elif engine == "plain":
            model = _model(a, False, lora, base_dtype=pdt if lora else None)
            if qlora:
                _nf4_base(model)
            cast = pdt
        elif engine == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            # QLoRA: real weights (torchao quantizes values; on meta there are none to quantize)
            model = _model(a, not qlora, lora, base_dtype=pdt if lora else None)
            if qlora:
                _nf4_base(model)
            mesh = init_device_mesh(a.device, (1,))
            mp = MixedPrecisionPolicy(param_dtype=pdt, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
            hf = model.get_base_model() if lora else model
            for layer in hf.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            if not qlora:
                rotary = hf.model.rotary_emb
                model.to_empty(device=a.device)
                with torch.no_grad():
                    for p in model.parameters():
                        p.zero_()
                from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

                hf.model.rotary_emb = LlamaRotaryEmbedding(rotary.config).to(a.device)
            cast = None
        else:
            raise ValueError(f"unknown engine {engine!r}: use yafsdp, plain or fsdp2")
        opt = _adamw([p for p in model.parameters() if p.requires_grad], 1e-4, torch.device(a.device))
        return model, opt, cast

    return _build


def step_fn(a, vocab: int):
    def step(engine, i):
        model, opt, cast = engine
        b = make_batch(i, 0, a.batch, a.seq, vocab, a.device)
        if cast is not None:
            with torch.autocast(a.device, dtype=cast):
                loss = model(**b).loss
        else:
            loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def plan_of(a, bf16: bool, lora: bool, qlora: bool = False):
    from yafsdp.plan import memory_plan

    p = memory_plan(_model(a, True, lora), world_size=1, param_dtype="bf16" if bf16 else None, batch=a.batch,
                    seq=a.seq, backend="nccl" if a.device == "cuda" else "gloo",
                    quantize_frozen="nf4" if qlora else None)
    return p


def main(argv=None):
    a = parse(argv)
    torch.set_num_threads(1)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    init_fake(1, dev)
    vocab = build_llama(a.preset, device="meta").config.vocab_size
    rows, raw = [], {}
    engines = a.engines.split(",")
    worst = {}
    for cfg in a.configs.split(","):
        dt, kind = cfg.split("-")
        bf16, lora, qlora = dt == "bf16", kind in ("lora", "qlora"), kind == "qlora"
        if qlora and not bf16:
            raise SystemExit(f"{cfg}: QLoRA computes in bf16 here; use bf16-qlora")
        res = {}
        for e in engines:
            try:
                res[e] = measure_memory(build(a, e, bf16, lora, qlora), step_fn(a, vocab), 3, dev,
                                        method="cuda" if cuda else "torch")
            except Exception as exc:  # noqa: BLE001 - a competitor that cannot run this configuration says why
                res[e] = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            print(cfg, e, {k: v for k, v in res[e].items() if k != "how"}, flush=True)
        plan = plan_of(a, bf16, lora, qlora) if "yafsdp" in engines else None
        raw[cfg] = dict(measured=res, plan=None if plan is None else dict(
            state=plan.engine_total + plan.optimizer_state, total=plan.total, engine=plan.engine_bytes()))
        for e in engines:
            m = res[e]
            if "error" in m:
                rows.append([cfg, e, "", "", "", *([""] if cuda else []), "", "", "", m["error"]])
                continue
            ratio = {o: m["peak_steady"] / res[o]["peak_steady"] for o in ("plain", "fsdp2")
                     if o in res and "error" not in res[o]}
            if e == "yafsdp":
                worst[cfg] = ratio
            pl = [f"{(plan.engine_total + plan.optimizer_state) / MiB:.1f}", f"{plan.total / MiB:.1f}"] \
                if e == "yafsdp" and plan is not None else ["", ""]
            rows.append([cfg, e, f"{m['built'] / MiB:.1f}", f"{m['step_end'][-1] / MiB:.1f}",
                         f"{m['peak_steady'] / MiB:.1f}", *([f"{m['reserved'] / MiB:.1f}"] if cuda else []),
                         f"{ratio.get('plain', float('nan')):.3f}",
                         f"{ratio.get('fsdp2', float('nan')):.3f}", " / ".join(pl) if pl[0] else "", ""])
    head = ["config", "engine", "after build MiB", "between steps MiB", "peak MiB (steps 2-3)",
            *(["reserved MiB (step 3)"] if cuda else []), "x plain", "x FSDP2", "plan: state / total MiB", "note"]
    v = versions(dev)
    where = f"CUDA ({v['gpu']})" if cuda else "CPU"
    how = ("the CUDA caching allocator: torch.cuda.max_memory_allocated per step (peak, x ratios) and "
           "max_memory_reserved of the last step; 'between steps' memory_allocated after step 3" if cuda else
           "torch CPU allocator live bytes (profiler memory events), exact; 'between steps' after step 3")
    goals = [f"goal yafsdp <= 1.00x plain and <= 1.00x FSDP2, {cfg}: "
             + ", ".join(f"x{r:.3f} {o} -> {'met' if r <= 1.0 else 'NOT met'}" for o, r in rs.items())
             for cfg, rs in worst.items()]
    text = "\n".join([
        f"# World 1 peak memory: yafsdp vs plain PyTorch vs FSDP2 — {where}, {v['date']}",
        "",
        "Command: `python benchmarks/bench_world1.py " + " ".join(sys.argv[1:] if argv is None else argv) + "`",
        "",
        f"Model: {a.preset} ({a.layers or 'all'} layers), batch {a.batch} x seq {a.seq}; LoRA r {a.lora_r} on "
        f"{','.join(TARGETS)}; QLoRA: that LoRA with every frozen linear weight NF4 (yafsdp quantize_frozen='nf4'; "
        f"plain and FSDP2: torchao's NF4Tensor and linear_nf4); torch AdamW over the trainable parameters; world 1 "
        f"(fake process group). Memory: {how}.",
        "",
        md_table(head, rows),
        "",
        *goals,
        "",
        f"Versions: python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, yafsdp {v['yafsdp']}.",
    ]) + "\n"
    print(text)
    if a.md:
        import json

        os.makedirs(os.path.dirname(os.path.abspath(a.md)), exist_ok=True)
        with open(a.md, "w") as f:
            f.write(text)
        with open(os.path.splitext(a.md)[0] + ".json", "w") as f:
            json.dump(raw, f, indent=1, default=str)
    finish_distributed()


if __name__ == "__main__":
    main()
