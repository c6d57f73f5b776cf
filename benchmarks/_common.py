"""Shared plumbing of the benchmark scripts: launching ranks, building the same model for every
engine, wrapping it with each engine, measuring memory, printing tables.

Nothing here knows which question a script answers; each script stays one standalone file per
question (bench_step.py, bench_overlap.py, model_scaling.py).
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import socket
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import yafsdp
from yafsdp.presets import build_llama

# "+fp8": YaFSDP(gather_dtype="fp8"), the decoder layers gathered as FP8 records (yafsdp/formats/fp8_codec.py)
ENGINES = ("yafsdp-z3", "yafsdp-z2", "yafsdp-z3+FusedAdamW", "yafsdp-z3+fp8", "yafsdp-z3+FusedAdamW+fp8", "fsdp2",
           "fsdp1", "ddp")
# Not in the default runs (ask for them with --engines): the reduce precisions of docs/reduce.md, bf16
# reduce-scatters (summed in bf16) and bf16 pieces summed in fp32 (reduce_accum_dtype=torch.float32);
# "+owngrad": chunk_outsized_grads=False, an outsized unit's gradient in a grad buffer of its own (the
# layout before chunked outsized gradients, docs/reduce.md "Memory").
# "+gradchunks2": grad_chunks=2, grad buffers half a decoder layer, each layer reduced in 2 chunks.
# "+gathered": sharded_lookup=False, the untied embedding gathered and reduce-scattered like any unit
# (the layout before the sharded lookup, docs/reduce.md "The sharded lookup of an embedding").
# "+prefetch2": prefetch=2, each gather issued two units ahead through a third weight buffer
# (docs/benchmarks.md "Prefetching two units ahead").
# "+held": at world 1 the weight buffers held for the run, the layout before [Note: world-1 buffers in use only]
# (yafsdp/layout/sizing.py; at world > 1 nothing changes).
REDUCE_ENGINES = ("yafsdp-z3+bf16reduce", "yafsdp-z3+bf16reduce+fp32acc", "yafsdp-z3+owngrad",
                  "yafsdp-z3+gradchunks2", "yafsdp-z3+gathered", "yafsdp-z3+prefetch2", "yafsdp-z3+held")


# ---------------------------------------------------------------------------- launching
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(rank: int, world: int, port: int, fn, args, threads: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    fn(args)
    gc.freeze()  # the rank exits next: see [Note: a fast exit] in examples/pretrain/ops.py


def launch(fn, args, world: int, port: int = 29512):
    """Run ``fn(args)`` on every rank. Under torchrun (RANK set) this process is one rank; on CUDA
    without torchrun this process is a world of one (on ``port``); otherwise spawn ``world`` CPU
    ranks here (gloo), so ``python benchmarks/<name>.py`` works without torchrun."""
    if getattr(args, "device", None) == "cuda" and "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))
    if "RANK" in os.environ:
        fn(args)
        return
    import torch.multiprocessing as mp

    threads = getattr(args, "threads", None) or max(1, (os.cpu_count() or 1) // world)
    mp.start_processes(_spawn_entry, args=(world, _free_port(), fn, args, threads), nprocs=world, join=True,
                       start_method="spawn")


def init_distributed(device_kind: str) -> torch.device:
    """Initialise the default group from the torchrun/spawn environment; returns this rank's device."""
    if device_kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
        return dev
    if "OMP_NUM_THREADS" in os.environ and "RANK" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    dist.init_process_group("gloo")
    return torch.device("cpu")


def finish_distributed() -> None:
    """End a rank as docs/api.md ("Ending a script") says: every rank meets after its last
    collective, the group is destroyed, and the collection frees the backend (its gloo worker
    threads are joined) while Python still runs. A rank main that only destroyed the group was seen
    to abort at exit in CI ("terminate called without an active exception": bench_io's export row)."""
    if dist.is_initialized():
        if dist.get_backend() != "fake":
            dist.barrier()
        dist.destroy_process_group()
    gc.collect()


def init_fake(world: int, device: torch.device):
    """A fake process group of ``world`` ranks in this one process: collectives do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)


def resolve_device(kind: str) -> str:
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return kind


def resolve_run(a) -> bool:
    """Fill the device, preset, batch and sequence defaults every benchmark shares; True on GPU."""
    a.device = resolve_device(a.device)
    gpu = a.device == "cuda"
    a.preset = a.preset or ("llama3-1b" if gpu else "cpu-6x256")
    a.batch = a.batch or 2
    a.seq = a.seq or (2048 if gpu else 128)
    return gpu


# ---------------------------------------------------------------------------- model and data
def make_model(preset: str, device: torch.device, seed: int = 0, layers: int | None = None, meta_init: bool = False,
               vocab: int | None = None, hf_checkpointing: bool = False):
    """The benchmark model: HF LlamaForCausalLM from ``preset``, same weights on every rank and for
    every engine (HF init under a fixed seed, on ``device``); ``layers``/``vocab`` override the preset's.
    ``hf_checkpointing``: HF's own activation checkpointing of every decoder layer (non-reentrant), as a
    user turns it on before wrapping."""
    model = _make_model(preset, device, seed, layers, meta_init, vocab)
    if hf_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _make_model(preset, device, seed, layers, meta_init, vocab):
    over = {"num_hidden_layers": layers} if layers else {}
    if vocab:
        over["vocab_size"] = vocab
    if meta_init:
        model = build_llama(preset, device="meta", **over)
        # Buffers (rotary frequencies) must be real; parameters stay on meta for the engine to fill.
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        model.model.rotary_emb = LlamaRotaryEmbedding(model.config).to(device)
        return model
    return build_llama(preset, device=device, seed=seed, **over)


def make_batch(step: int, rank: int, batch: int, seq: int, vocab: int, device) -> dict:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def decoder_layers(model):
    return list(model.model.layers)


# ---------------------------------------------------------------------------- engines
@dataclass
class Engine:
    name: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    autocast: torch.dtype | None = None  # DDP's mixed precision
    device: torch.device = torch.device("cpu")
    info: dict = field(default_factory=dict)

    def step(self, batch: dict, mark=None) -> float:
        """One training step; ``mark()``, if given, is called after the forward and after the
        backward (bench_step's ``--phases``)."""
        if self.autocast is not None:
            with torch.autocast(self.device.type, dtype=self.autocast):
                loss = self.model(**batch).loss
        else:
            loss = self.model(**batch).loss
        if mark is not None:
            mark()
        loss.backward()
        if mark is not None:
            mark()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def fused_adamw_available() -> bool:
    return hasattr(yafsdp, "FusedAdamW")


def _adamw(params, lr: float, device: torch.device):
    """torch AdamW, fused where the build has it for this device (else foreach)."""
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, fused=True)
    except (RuntimeError, ValueError):  # pragma: no cover - depends on the build
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, foreach=True)


def build_engine(name: str, preset: str, device: torch.device, mixed: bool, *, lr: float = 3e-4, seed: int = 0,
                 layers: int | None = None, meta_init: bool = False, vocab: int | None = None,
                 hf_checkpointing: bool = False) -> Engine:
    """``name`` in ENGINES, wrapped around a fresh model from ``preset``. ``mixed``: bf16 compute
    and fp32 reduce (GPU); otherwise fp32 throughout. ``hf_checkpointing``: see :func:`make_model`."""
    bf16 = torch.bfloat16 if mixed else None
    model = make_model(preset, device, seed, layers, meta_init=meta_init, vocab=vocab, hf_checkpointing=hf_checkpointing)
    if name.startswith("yafsdp"):
        zero = 2 if name.startswith("yafsdp-z2") else 3
        from yafsdp.layout import sizing

        sizing.IN_USE_WORLD1 = "+held" not in name  # read at the build only
        try:
            wrapped = yafsdp.YaFSDP(model, param_dtype=bf16, zero_stage=zero, device=device,
                                    gather_dtype="fp8" if name.endswith("+fp8") else None, **reduce_options(name))
        finally:
            sizing.IN_USE_WORLD1 = True
        if meta_init:  # zero shards, like the other engines' meta-built models: timing and memory only
            wrapped.mark_loaded()
        if "+FusedAdamW" in name:
            opt = yafsdp.FusedAdamW(wrapped.parameters(), lr=lr, weight_decay=0.1)
        else:
            opt = _adamw(wrapped.parameters(), lr, device)
        return Engine(name, wrapped, opt, device=device)
    if name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
        if not meta_init:
            model = model.to(device)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        if meta_init:
            model.to_empty(device=device)
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            model.model.rotary_emb = LlamaRotaryEmbedding(model.config).to(device)
        return Engine(name, model, _adamw(model.parameters(), lr, device), device=device)
    if name == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        layer_cls = type(decoder_layers(model)[0])
        mp = MixedPrecision(param_dtype=bf16, reduce_dtype=torch.float32) if mixed else None
        wrapped = FSDP(
            model, auto_wrap_policy=ModuleWrapPolicy({layer_cls}), use_orig_params=True, mixed_precision=mp,
            device_id=device, limit_all_gathers=True,
        )
        return Engine(name, wrapped, _adamw(wrapped.parameters(), lr, device), device=device)
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                      gradient_as_bucket_view=True)
        return Engine(name, wrapped, _adamw(wrapped.parameters(), lr, device), autocast=bf16, device=device)
    raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")


def reduce_options(name: str) -> dict:
    """The reduce options of a yafsdp engine name: fp32, or one of REDUCE_ENGINES'."""
    own = dict(chunk_outsized_grads=False) if "+owngrad" in name else {}
    if "+gathered" in name:
        own["sharded_lookup"] = False
    if "+gradchunks" in name:  # "+gradchunks2": grad_chunks=2
        own["grad_chunks"] = int(name.split("+gradchunks")[1].split("+")[0])
    if "+prefetch" in name:  # "+prefetch2": prefetch=2
        own["prefetch"] = int(name.split("+prefetch")[1].split("+")[0])
    if "+bf16reduce" not in name:
        return dict(reduce_dtype=torch.float32, **own)
    return dict(reduce_dtype=torch.bfloat16, reduce_accum_dtype=torch.float32 if name.endswith("+fp32acc") else None,
                **own)


def free_engine(e: Engine | None):
    if e is None:
        return
    e.model = e.opt = None
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- reporting
def versions(device: torch.device | None = None) -> dict:
    import transformers

    out = dict(
        python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
        yafsdp=yafsdp.__version__, host=platform.node(), cpus=os.cpu_count(),
        date=datetime.date.today().isoformat(),
        load_avg=[round(x, 2) for x in os.getloadavg()],  # 1/5/15 min, when the report was written
    )
    if device is not None and device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["cuda"] = torch.version.cuda
    else:
        out["cpu"] = _cpu_model()
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover - not Linux
        pass
    return platform.processor() or platform.machine()


def median_min_max(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def md_table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:,.0f}"
        if isinstance(v, int):
            return f"{v:,}"
        return "" if v is None else str(v)

    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    line = lambda r: "| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def write_json(path: str, obj):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)


MiB = 1024**2
