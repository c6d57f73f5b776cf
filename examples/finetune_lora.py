"""Fine-tune a Llama with LoRA adapters (PEFT) under yafsdp: the base frozen, only the adapters train.

On a fresh CPU machine, with nothing downloaded (a few minutes on 2 cores): the job first pretrains
a small base on the embedded corpus with the pretraining job's code (into --out/base, reused by
later runs), then adapts it to the embedded instruction set (examples/data/instructions.jsonl) and
prints the held-out response loss before and after:

    torchrun --nproc-per-node 2 examples/finetune_lora.py

From a base of your own (a local HF Llama checkpoint, e.g. the pretraining job's --export-hf output),
on your instruction data, with a merged export at the end:

    torchrun --nproc-per-node 2 examples/finetune_lora.py --init-from-hf runs/default/hf \\
        --data my_instructions.jsonl --lora-r 16 --lora-alpha 32 --out runs/lora --merge-export runs/lora/merged

On one GPU node (bf16 compute, fp32 adapters and optimizer state):

    torchrun --nproc-per-node 8 examples/finetune_lora.py --init-from-hf /models/llama --tokenizer /models/llama \\
        --data instructions.jsonl --bf16 --seq-len 1024 --out runs/lora

QLoRA, the base's linear weights stored in 4-bit NF4 (YaFSDP(..., quantize_frozen="nf4")): add --qlora.
The adapters' fp32 master, grad shard and AdamW state in host memory, the optimizer step on the CPU
(YaFSDP(..., offload="optimizer")): add --offload (frees 16 bytes per trainable parameter / N per GPU);
--offload all puts the frozen base's shards in host memory too (Llama-2-70B QLoRA on 2 GPUs: docs/offload.md).

Continue a run (newest complete checkpoint in --out): add --resume. Also runs as plain ``python``.
--data takes what the pretraining job takes (plain text: the loss on every token) or an instruction
JSONL, one {"prompt": ..., "response": ...} per line (the loss on the response only; the template is
in docs/finetune.md). --out gets the pretraining job's files (metrics.jsonl, events.jsonl, loss.png,
run.json, checkpoints/) plus adapter/ (PEFT's format) and probe.pt. See docs/finetune.md.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import warnings
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from yafsdp.layout.config import OPTIONS

from pretrain import data as D  # examples/pretrain, beside this script (its directory is on sys.path)
from pretrain import instructions as I
from pretrain import job as J
from pretrain import progress as P
from pretrain import stream as S
from pretrain.ops import JobError, exit_fast

DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj"
# The fine-tuning defaults that differ from the pretraining job's (preset-dependent ones included:
# here they do not depend on --preset, which only shapes the base the job makes when it has none).
DEFAULTS = dict(steps=200, decay_steps=200, lr=3e-3, warmup=10, seq_len=96, batch_size=8, weight_decay=0.0,
                val_fraction=0.1, save_every=100, out="runs/finetune", sample_tokens=24,
                prompt=I.PROMPT_TEMPLATE.format(prompt="Spell backwards: garden"))


def parse_args(argv=None) -> argparse.Namespace:
    p = J.build_parser("finetune_lora.py", "Fine-tune a Llama with LoRA adapters under yafsdp (launch with "
                       "torchrun; see the file's docstring).")
    g = p.add_argument_group("LoRA")
    g.add_argument("--lora-r", type=int, default=8, help="adapter rank")
    g.add_argument("--lora-alpha", type=float, default=16.0, help="adapter scaling numerator (scale = alpha / r)")
    g.add_argument("--lora-targets", default=DEFAULT_TARGETS,
                   help="comma-separated names of the linear modules that get adapters")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    g.add_argument("--qlora", action="store_true",
                   help="QLoRA: store the frozen base's linear weights in 4-bit NF4 (YaFSDP quantize_frozen='nf4'; "
                   "~0.27x the bf16 bytes gathered); the adapters train against the dequantized base")
    g.add_argument("--offload", nargs="?", const="optimizer", default=None,
                   choices=[v for v in OPTIONS["offload"].choices() if v is not None],
                   help="keep the adapters' fp32 master, grad shard and AdamW state in (pinned) host memory and run "
                   "the optimizer step on the CPU (YaFSDP offload='optimizer'); --offload all: the frozen base's "
                   "shards (bf16 and NF4) too, copied to the device per layer ahead of its gather. Results are bit "
                   "for bit those without it")
    g.add_argument("--materialize-base", action="store_true",
                   help="read the whole base on every rank (from_pretrained) before wrapping, instead of building it "
                   "on meta and streaming each rank's slices in after wrapping (the default; see docs/io.md)")
    g.add_argument("--merge-export", default=None, metavar="DIR",
                   help="also write the base with the adapters merged as a plain HF checkpoint")
    g.add_argument("--prompt-column", default="prompt", help="instruction datasets: the prompt's column")
    g.add_argument("--response-column", default="response", help="instruction datasets: the response's column")
    g = p.add_argument_group("base (without --init-from-hf)")
    g.add_argument("--base-steps", type=int, default=200,
                   help="pretrain a base of --preset for this many steps on the embedded corpus with the "
                   "pretraining job, into --out/base (reused when its export exists)")
    p.set_defaults(**DEFAULTS)
    args = p.parse_args(argv)
    if args.tp > 1:  # before the shared checks, whose --tp refusals are the pretraining job's
        p.error(f"--tp {args.tp}: tensor parallelism is the pretraining job's (examples/pretrain_llama.py); LoRA adapters "
                "are not supported with TP parameters: run the fine-tune without --tp")
    args = J.check_args(p, args)
    if args.export_hf or args.export_only:
        p.error("--export-hf/--export-only are the pretraining job's; this job writes --out/adapter and, with "
                "--merge-export DIR, the merged model")
    if args.torchft:
        p.error("--torchft is the pretraining job's (examples/pretrain_llama.py); run the fine-tune without it")
    if args.lora_r < 1:
        p.error(f"--lora-r must be >= 1, got {args.lora_r}")
    if args.lora_alpha <= 0:
        p.error(f"--lora-alpha must be > 0, got {args.lora_alpha}")
    if not 0 <= args.lora_dropout < 1:
        p.error(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    if args.base_steps < 1:
        p.error(f"--base-steps must be >= 1, got {args.base_steps}")
    args.targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    if not args.targets:
        p.error(f"--lora-targets {args.lora_targets!r} names no module; give a comma list such as {DEFAULT_TARGETS}")
    return args


def response_loss(model, batch: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of the next token where the label is not ignored. ``batch`` is (B, 2, seq_len + 1):
    input ids and labels (see [Note: instruction template] in examples/pretrain/instructions.py)."""
    ids, labels = batch[:, 0], batch[:, 1]
    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=I.IGNORE,
                           reduction=reduction)


def _base_recipe(base_out: str) -> dict | None:
    """The flags the pretraining run in ``base_out`` was made with (its run.json), or None if unreadable."""
    try:
        with open(os.path.join(base_out, "run.json")) as f:
            args = json.load(f)["args"]
        return dict(preset=args["preset"], steps=args["steps"], seed=args["seed"], tokenizer=args["tokenizer"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def base_id(path: str) -> str:
    """The identity of an HF base folder: its weight files' count and bytes and a CRC-32 of the first and last MiB
    of each (header and data), so another trained model of the same shapes differs; a name that is not a local
    folder is its own identity."""
    if not os.path.isdir(path):
        return path
    files = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".bin")))
    crc, total, mib = 0, 0, 1 << 20
    for name in files:
        file = os.path.join(path, name)
        size = os.path.getsize(file)
        total += size
        with open(file, "rb") as f:
            crc = zlib.crc32(f.read(mib), crc)
            if size > mib:
                f.seek(max(mib, size - mib))
                crc = zlib.crc32(f.read(), crc)
    return f"{len(files)} weight file(s), {total:,} bytes, crc32 {crc:08x}"


class FinetuneJob(J.Job):
    """The pretraining job with a PEFT LoRA model, instruction data and adapter outputs."""

    name = "finetune_lora"
    built = "base built on meta (--materialize-base: read on every rank), adapters added by peft.get_peft_model"

    @staticmethod
    def parse_args(argv=None) -> argparse.Namespace:
        return parse_args(argv)

    # ------------------------------------------------------------------------------- set-up
    def prepare(self):
        a = self.args
        self.base_made = None
        m = a.merge_export
        if m and os.path.isdir(m) and os.listdir(m) and self.env.restart_count == 0:
            raise JobError(f"--merge-export {m!r} exists and is not empty; choose a new directory")
        if not a.init_from_hf:
            a.init_from_hf = self.make_base()
        super().prepare()

    def make_base(self) -> str:
        """Collective: the base of a run without --init-from-hf, pretrained by the pretraining job
        in this process (its own --out, --out/base); an existing export there is reused."""
        a = self.args
        base_out = os.path.join(a.out, "base")
        hf = os.path.join(base_out, "hf")
        if os.path.isfile(os.path.join(hf, "config.json")):
            made, want = _base_recipe(base_out), dict(preset=a.preset, steps=a.base_steps, seed=a.seed,
                                                      tokenizer=a.tokenizer)
            if made is None or made == want:
                self.base_made = f"{hf} (made by an earlier run)"
                return hf
            told = ", ".join(f"{k} {made.get(k)!r} -> {v!r}" for k, v in want.items() if made.get(k) != v)
            if not a.overwrite:
                raise JobError(
                    f"{hf!r} holds the base an earlier run made with other flags ({told}); this run would fine-tune "
                    "that one. Pass --overwrite to discard the run in --out and make the base again, --init-from-hf "
                    "to choose a base, or the earlier flags")
            if self.rank == 0:
                shutil.rmtree(hf)
            if dist.is_initialized():
                dist.barrier()
            self.say(f"base     --overwrite: the base in {hf} was made with other flags ({told}); making it again")
        argv = ["--preset", a.preset, "--steps", str(a.base_steps), "--decay-steps", str(a.base_steps),
                "--out", base_out, "--export-hf", hf, "--save-every", "0", "--keep", "1", "--seed", str(a.seed),
                "--device", a.device, "--sample-tokens", "0", "--no-progress"]
        if a.tokenizer:
            argv += ["--tokenizer", a.tokenizer]
        if os.path.isdir(base_out):  # an earlier base run stopped before its export: start it afresh
            argv.append("--overwrite")
        self.say(f"base     no --init-from-hf: pretraining one (pretrain_llama.py {' '.join(argv)})")
        job = J.Job(J.parse_args(argv), self.env)
        try:
            job.run()
        finally:
            job.run_dir.release()
        steps = job.step
        del job
        gc.collect()
        self.base_made = f"{hf} (pretrained here for {steps} steps on the embedded corpus)"
        self.say("base     done; fine-tuning it")
        return hf

    def load_data(self):
        a = self.args
        path = a.data if a.data is not None else I.EMBEDDED_INSTRUCTIONS
        self.instructions = I.is_instruction_jsonl(path)
        if path.endswith(".jsonl") and os.path.isfile(path):  # a chat or Alpaca-style JSONL
            first = I.first_jsonl_record(path)
            dataset = isinstance(first, dict) and ("messages" in first or {"instruction", "output"} <= set(first)
                                                   or {a.prompt_column, a.response_column} <= set(first))
        else:  # parquet/arrow/csv or a dataset name: instruction or chat rows
            dataset = S.stream_kind(path) == "text"
        if dataset and not self.instructions:
            try:
                rows = I.read_instruction_dataset(path, a.data_split, a.prompt_column, a.response_column)
                self.instructions = True
            except I.NotInstructions:  # text rows: the pretraining job's streamed data
                dataset = False
        else:
            dataset = False
        if not self.instructions:  # plain text: the pretraining job's data, the loss on every token
            return super().load_data()
        source = f"--data {path!r}" if a.data else f"the embedded instructions {path!r}"
        if dataset:
            examples, self.truncated = I.encode_examples(rows, self.tokenizer, a.seq_len, source)
        else:
            examples, self.truncated = I.encode_instructions(I.read_instructions(path), self.tokenizer, a.seq_len,
                                                             source)
        if int(examples[:, 0].max()) >= self.shape["vocab_size"]:
            raise JobError(f"{source} encodes to token id {int(examples[:, 0].max())}, but the model has "
                           f"{self.shape['vocab_size']} embeddings (wrong --tokenizer?)")
        n_val = int(len(examples) * a.val_fraction) if a.val_fraction > 0 else 0
        if a.val_fraction > 0 and n_val == 0 and len(examples) > 1:
            n_val = 1
        if n_val >= len(examples):
            raise JobError(f"{source} has {len(examples)} example(s): too few to hold out {a.val_fraction:g} of them "
                           "and train on the rest; add examples or pass --val-fraction 0")
        train = examples[: len(examples) - n_val]
        self.corpus = D.Corpus(examples[:, 0].reshape(-1), source, len(examples))
        self.batches = I.ExampleBatches(train, a.seed)
        self.val = I.ExampleBatches(examples[len(examples) - n_val:], a.seed + 1) if n_val else None

    def describe_data(self) -> str:
        if not self.instructions:
            return super().describe_data() + "; loss on every token"
        n_val = self.val.windows if self.val else 0
        cut = f", {self.truncated} cut at --seq-len" if self.truncated else ""
        return (f"{self.corpus.source}: {self.corpus.documents} instruction examples; {self.batches.windows} train / "
                f"{n_val} held out; sequences of {self.args.seq_len + 1} tokens{cut}; loss on response tokens only")

    def loss(self, x):
        return response_loss(self.model, x) if self.instructions else super().loss(x)

    def make_model(self):
        """The base with PEFT LoRA adapters. By default the base is built on the meta device and its
        weights stream in after wrapping, each rank reading only its slices (yafsdp.peft_load);
        --materialize-base: read whole on every rank (LlamaForCausalLM.from_pretrained). Either way the
        adapters' A is seeded (--seed; the same on every rank) and B starts at zero, as PEFT does."""
        try:
            import peft
        except ImportError:
            raise JobError("the LoRA job needs the peft package: pip install peft") from None
        from transformers import LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        from yafsdp.init import meta_parameters

        a = self.args
        hf_logging.disable_progress_bar()
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        self.adapters = None
        if a.materialize_base:
            base = LlamaForCausalLM.from_pretrained(a.init_from_hf, dtype=torch.float32, attn_implementation=a.attn)
        else:
            from yafsdp.hf import HFCheckpointError, read_hf_config

            try:
                cfg = read_hf_config(a.init_from_hf)
            except HFCheckpointError as e:
                raise JobError(f"--init-from-hf: {e}") from None
            with meta_parameters():
                base = LlamaForCausalLM._from_config(cfg, dtype=torch.float32, attn_implementation=a.attn)
        names = sorted({n.rsplit(".", 1)[-1] for n, mod in base.named_modules() if isinstance(mod, torch.nn.Linear)})
        missing = [t for t in a.targets if t not in names]
        if missing:
            raise JobError(f"--lora-targets {a.lora_targets!r}: {', '.join(repr(t) for t in missing)} matches no "
                           f"linear module of the model; its linear modules are {', '.join(names)}")
        cfg = peft.LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=a.lora_dropout,
                              target_modules=a.targets, task_type="CAUSAL_LM")
        if a.materialize_base:
            torch.manual_seed(a.seed)
            model = peft.get_peft_model(base, cfg)
        else:  # See [Note: adapters over a meta base] in yafsdp/integrations/peft_load.py
            from yafsdp.peft_load import meta_peft_model

            built = meta_peft_model(base, cfg, seed=a.seed)
            model, self.adapters = built.model, built.adapters
        self.n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return model

    def model_settings(self) -> dict:
        """The adapters' shape and scaling: a resume with another --lora-alpha would silently scale
        them differently (another rank or targets would not load); see [Note: settings a resume keeps].
        And the base's identity (``base_id``): see ``check_resumable``."""
        a = self.args
        return dict(lora_r=a.lora_r, lora_alpha=a.lora_alpha, lora_targets=sorted(a.targets),
                    base=base_id(a.init_from_hf))

    def check_resumable(self, meta: dict, saved_settings: dict | None = None) -> None:
        """A checkpoint holds its frozen base with the adapters, so a resume trains on the checkpoint's base
        whatever --init-from-hf says: another base is refused (not even --allow-change could make it the one
        trained on, and the adapter line would name the wrong one). A checkpoint from before the base was
        recorded is taken as written on this one."""
        saved = dict(saved_settings if saved_settings is not None else meta.get("settings") or {})
        model = dict(saved.get("model") or {})
        step = self.manifest.get("step", 0) if self.manifest else 0
        now = self.settings["model"]["base"]
        if "model" in saved and "base" not in model:
            model["base"] = now
            saved["model"] = model
        elif "model" in saved and model["base"] != now and not self.args.export_only and step < self.args.steps:
            raise JobError(
                f"checkpoint {self.plan.resume_path!r} was trained on another base than --init-from-hf "
                f"{self.args.init_from_hf!r}: {model['base']} (checkpoint) vs {now} "
                "(now). The checkpoint holds its frozen base, so a resume would go on training on that one while "
                "this run names the other; resume with the run's base, or start a new --out for a new base")
        super().check_resumable(meta, saved if saved else None)

    def wrap_options(self) -> dict:
        out = dict(quantize_frozen="nf4") if self.args.qlora else {}
        if self.args.offload:
            out["offload"] = self.args.offload
        return out

    def init_weights(self):
        a = self.args
        if self.adapters is not None:  # the base on meta: stream it in, with the adapters PEFT initialised
            from yafsdp.hf import HFCheckpointError
            from yafsdp.peft_load import load_peft_base

            try:
                load_peft_base(self.model, a.init_from_hf, self.adapters)
            except HFCheckpointError as e:
                raise JobError(f"--init-from-hf: {e}") from None
        self.adapters = None
        J.set_rng_state(None, self.args.seed, self.rank, 0, self.device)
        made = self.base_made or a.init_from_hf
        frozen = "frozen, its linear weights stored in NF4 (--qlora)" if a.qlora else "frozen"
        read = "every rank read it whole (--materialize-base)" if a.materialize_base else "each rank read its slices"
        self.init_desc = (f"base {made} ({read}; {frozen}); LoRA r {a.lora_r}, alpha "
                          f"{a.lora_alpha:g} on {','.join(a.targets)}: {P.fmt_count(self.n_trainable)} trainable params "
                          f"(A seeded by --seed {a.seed}, B zero)"
                          + ("; their fp32 master, grads and AdamW state in host memory, stepped on the CPU "
                             "(--offload)" if a.offload else "")
                          + ("; the frozen base's shards in host memory too (--offload all)" if a.offload == "all"
                             else ""))

    # -------------------------------------------------------------------------------- the run
    @torch.no_grad()
    def heldout_loss(self) -> float | None:
        """Collective: the mean loss over every held-out response token (each rank takes every
        world-th example), or None without held-out data. Plain-text data: the pretraining job's
        validation loss."""
        if self.val is None:
            return None
        if not self.instructions:
            return self.evaluate()
        a, per = self.args, self.args.batch_size * self.world
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for first in range(0, self.val.windows, per):
            rows, weight = self.val.in_order(first + self.rank * a.batch_size, a.batch_size)
            rows = rows.to(self.device)
            rows[:, 1][weight.to(self.device) == 0] = I.IGNORE  # padding rows add nothing
            total[0] += response_loss(self.model, rows, reduction="sum").double()
            total[1] += (rows[:, 1, 1:] != I.IGNORE).sum()
        dist.all_reduce(total)
        return (total[0] / total[1]).item()

    def train(self):
        """The pretraining job's loop, with the held-out loss measured before the first step of the
        run (recorded in events.jsonl, so a resumed run reports the same starting point)."""
        self.heldout_before = None
        if not self.args.export_only:
            if self.plan.resume_path:
                if self.main:
                    found = [e["loss"] for e in P.read_jsonl(os.path.join(self.args.out, "events.jsonl"))
                             if e.get("event") == "heldout_before"]
                    self.heldout_before = found[-1] if found else None
            else:
                self.heldout_before = self.heldout_loss()
                self.outputs.event(dict(event="heldout_before", step=self.step, loss=self.heldout_before))
        super().train()

    def finish(self):
        self.heldout_after = self.heldout_loss() if not self.stopped_by else None
        super().finish()

    def write_exports(self):
        """Collective: the adapter (--out/adapter, PEFT's format), the merged model (--merge-export),
        and probe.pt: a fixed input and this model's logits for it (what the tests compare with)."""
        from yafsdp.adapters import export_merged

        a = self.args
        adapter = os.path.join(a.out, "adapter")
        part = adapter + ".part"  # written whole, then renamed over the previous run's adapter
        if self.main and os.path.isdir(part):
            shutil.rmtree(part)
        dist.barrier()
        self.model.save_adapter(part)
        if self.main:
            if os.path.isdir(adapter):
                shutil.rmtree(adapter)
            os.replace(part, adapter)
        merged = None
        if a.merge_export:
            dtype = torch.bfloat16 if a.export_dtype == "bfloat16" else torch.float32
            merged = export_merged(self.model, a.merge_export, dtype=dtype, max_shard_size=J.shard_size(a))
        probe = self.val.examples[:1, 0] if (self.instructions and self.val is not None) else None
        if probe is None:
            probe = torch.arange(min(32, a.seq_len)).view(1, -1) % self.shape["vocab_size"]
        probe = torch.as_tensor(probe, dtype=torch.long)
        with torch.no_grad():
            logits = self.model(input_ids=probe.to(self.device), use_cache=False).logits.float().cpu()
        if self.main:
            torch.save(dict(input_ids=probe, logits=logits, base=a.init_from_hf), os.path.join(a.out, "probe.pt"))
        return adapter, merged

    def summary(self, sample, exported):
        super().summary(sample, None)
        if self.heldout_after is not None and self.heldout_before is not None:
            what = "response-token" if self.instructions else "validation"
            self.say(f"held-out {what} loss {self.heldout_before:.4f} (before fine-tuning) -> "
                     f"{self.heldout_after:.4f} (step {self.step})")
        if exported:
            adapter, merged = exported
            self.say(f"adapter  {adapter} (PEFT: PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained("
                     f"{self.args.init_from_hf!r}), {adapter!r}))")
            if self.args.qlora:
                self.say("         --qlora: the adapter was trained against the NF4-dequantized base; the merged export "
                         "and probe.pt hold that base")
            if merged:
                self.say(f"merged   {merged}: config.json + model.safetensors (the base with the adapters merged)")


if __name__ == "__main__":
    exit_fast(J.main(job_cls=FinetuneJob))  # sys.exit, without the collector's pass at exit (pretrain/ops.py)
