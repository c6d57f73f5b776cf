"""The pretraining job (``examples/pretrain_llama.py``): flags, the output plan, the stages of a run
and the training loop. ``examples/finetune_lora.py`` builds on the same code (its own flags, data
and model set-up; the same checkpoints, resume, metrics, plots and errors)."""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
import traceback
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import yafsdp
from pretrain import data as D  # examples/pretrain (the job script's directory is on sys.path)
from pretrain import progress as P
from pretrain import rundir as R
from pretrain import saving as S
from pretrain.rundir import describe_run, plan_output  # noqa: F401 - their home was here
from pretrain.ops import Diverged, JobError, OutLock, StopSignal, agree, init_distributed
from pretrain.presets import DEFAULT_PRESET, model_config_dict, presets
from yafsdp import checkpoint as C

# The config fields that decide parameter shapes: a checkpoint must match them to be resumed.
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "tie_word_embeddings")


# ------------------------------------------------------------------------------------------ args
class _Help(argparse.HelpFormatter):
    """Shows a flag's default where it has one (preset-dependent defaults say [preset])."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """One line per error, printed by rank 0 only (under torchrun every rank parses the same
    command line), exit status 2."""

    def error(self, message):
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def build_parser(prog: str = "pretrain_llama.py",
                 description: str = "Pretrain a Llama with yafsdp (launch with torchrun; see the file's docstring).",
                 ) -> argparse.ArgumentParser:
    """The job's flags; a job built on this one (examples/finetune_lora.py) adds its own groups."""
    table = presets()
    p = _Parser(
        prog=prog,
        description=description,
        formatter_class=_Help,
        allow_abbrev=False,  # --step must not silently mean --steps
    )
    g = p.add_argument_group("model")
    g.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(table),
                   help="model shape + training defaults (see docs/pretrain.md)")
    g.add_argument("--init-from-hf", metavar="DIR", default=None,
                   help="start from a local HF checkpoint (config.json + safetensors) instead of random weights")
    g.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation")
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, help="text file, .jsonl, pre-tokenized .bin, or a directory; "
                   "default: the embedded corpus")
    g.add_argument("--tokenizer", default=None, metavar="DIR", help="local HF tokenizer folder; default: bytes")
    g.add_argument("--text-key", default="text", help="JSONL field holding the text")
    g.add_argument("--data-dtype", default="uint16", help="dtype of the ids in a .bin file")
    g.add_argument("--val-fraction", type=float, default=0.05, help="tail of the data held out for validation")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=None, help="train until this optimizer step [preset]")
    g.add_argument("--seq-len", type=int, default=None, help="tokens per sequence [preset]")
    g.add_argument("--batch-size", type=int, default=None, help="sequences per rank per micro-batch [preset]")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate [preset]")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate / peak")
    g.add_argument("--warmup", type=int, default=None, help="linear warmup steps [preset]")
    g.add_argument("--decay-steps", type=int, default=None,
                   help="cosine decay horizon; fixed, so a run stopped early resumes exactly [preset steps]")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay of >= 2-D weights")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0: no clipping)")
    g.add_argument("--max-skipped-steps", type=int, default=5,
                   help="a step whose loss or grad norm is NaN/inf is skipped (no optimizer step); stop (exit 3) "
                   "after this many in a row")
    g.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 compute (fp32 master weights); default: on for CUDA, off on CPU")
    g.add_argument("--zero-stage", type=int, default=3, choices=[2, 3],
                   help="3: gather weights again for backward; 2: keep them from forward")
    g.add_argument("--gather-dtype", default="bf16", choices=["bf16", "fp8"],
                   help="fp8: gather the decoder layers' linear weights as float8 e4m3 + a float32 scale per 128 "
                        "(~1.03 instead of 2 bytes per parameter; YaFSDP gather_dtype='fp8'); the fp32 master, "
                        "gradients and optimizer are unchanged. bf16: gather in the compute dtype")
    g.add_argument("--hsdp", type=int, default=1, metavar="R",
                   help="HSDP: R replicas (e.g. R = nodes), each sharding the model over world / R ranks; gathers "
                   "and reduce-scatters stay inside a replica, gradients are all-reduced across replicas once per "
                   "step (1: shard over every rank)")
    g.add_argument("--activation-checkpointing", action="store_true", help="recompute each layer in backward")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each unit's modules on their own (YaFSDP.compile_units); the first steps "
                   "include the compilation")
    g.add_argument("--seed", type=int, default=0, help="init, data order and sampling")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available")
    g = p.add_argument_group("output")
    g.add_argument("--out", default="runs/default", help="checkpoints, metrics, plots")
    g.add_argument("--save-every", type=int, default=100, help="checkpoint every K steps (0: only at the end)")
    g.add_argument("--keep", type=int, default=3, help="complete checkpoints kept")
    g.add_argument("--async-save", action=argparse.BooleanOptionalAction, default=False,
                   help="write the periodic checkpoints in the background: training is blocked only for a host "
                   "copy of this rank's part of the checkpoint (see docs/checkpoints.md)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, metavar="auto|PATH",
                   help="continue from the newest complete checkpoint in --out (--resume), that one if any "
                   "(--resume auto), or a given checkpoint directory")
    g.add_argument("--rewind", action="store_true",
                   help="with --resume PATH of a checkpoint older than the run's newest: go back to it, setting the "
                   "continuation after it (checkpoints, metrics) aside in --out/abandoned/ (moved, never deleted)")
    g.add_argument("--allow-change", default=None, metavar="NAMES",
                   help="resume although these settings differ from the checkpoint's (comma-separated: seq_len, "
                   "seed, global_batch, data, model; see docs/pretrain.md); recorded in events.jsonl")
    g.add_argument("--overwrite", action="store_true",
                   help="start afresh in an --out that holds a run (deletes it, and says what it deleted)")
    g.add_argument("--export-hf", default=None, metavar="DIR", help="write a HF checkpoint at the end")
    g.add_argument("--export-only", action="store_true",
                   help="no training: load the newest checkpoint in --out (or --resume PATH) and write --export-hf")
    g.add_argument("--export-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the exported weights")
    g.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also log the metrics to this TensorBoard directory (needs the tensorboard package)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s of one device for MFU (default: known GPUs' dense bf16 peak; CPU: n/a)")
    g.add_argument("--eval-every", type=int, default=0, help="validation loss every K steps (0: at the end)")
    g.add_argument("--eval-batches", type=int, default=4, help="micro-batches per rank per validation")
    g.add_argument("--sample-tokens", type=int, default=None,
                   help="tokens sampled at the end (0: none; default: 120 below 1 B parameters, else 0)")
    g.add_argument("--prompt", default="We the People", help="prompt of the closing sample")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (metrics and summary only)")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fill the preset-dependent defaults and refuse bad values (``p.error``: one line, exit 2)."""
    pr = presets()[args.preset]
    for name, value in (("steps", pr.steps), ("seq_len", pr.seq_len), ("batch_size", pr.batch_size),
                        ("lr", pr.lr), ("warmup", pr.warmup)):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.decay_steps is None:
        args.decay_steps = pr.steps
    for name in ("steps", "warmup", "save_every", "eval_every"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("seq_len", "batch_size", "grad_accum", "decay_steps", "keep", "eval_batches", "max_skipped_steps",
                 "hsdp"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.val_fraction < 0.5:
        p.error(f"--val-fraction must be in [0, 0.5), got {args.val_fraction}")
    if args.lr <= 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if args.export_only and not args.export_hf:
        p.error("--export-only needs --export-hf DIR: the directory to write the Hugging Face export to")
    if args.export_only and args.overwrite:
        p.error("--export-only reads the run in --out; it cannot be combined with --overwrite")
    if args.rewind and args.resume in (None, "latest", "auto"):
        p.error("--rewind needs --resume PATH: the checkpoint to go back to")
    if args.rewind and args.export_only:
        p.error("--export-only reads the run as it is; it cannot be combined with --rewind")
    allowed = R.parse_allow_change(args.allow_change)
    if isinstance(allowed, str):
        p.error(allowed)
    args.allowed_changes = allowed
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        p.error(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    if args.async_save and args.hsdp > 1:
        p.error("--async-save is not supported with --hsdp yet (HSDP checkpoints are saved synchronously); drop one")
    args.preset_info = pr
    return args




def lr_at(args, step: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warmup, cosine to min, then flat."""
    peak, low = args.lr, args.lr * args.min_lr_ratio
    if args.warmup and step <= args.warmup:
        return peak * step / args.warmup
    if step >= args.decay_steps:
        return low
    t = (step - args.warmup) / max(1, args.decay_steps - args.warmup)
    return low + 0.5 * (peak - low) * (1 + math.cos(math.pi * t))


# ----------------------------------------------------------------------------------- checks
def model_config(args, tokenizer) -> tuple[dict, object]:
    """(shape dict for checks and checkpoints, the HF config)."""
    from transformers import LlamaConfig

    from yafsdp.hf import HFCheckpointError, read_hf_config

    if args.init_from_hf:
        try:
            cfg = read_hf_config(args.init_from_hf)
        except HFCheckpointError as e:
            raise JobError(f"--init-from-hf: {e}") from None
        if cfg.model_type != "llama":
            raise JobError(f"--init-from-hf {args.init_from_hf!r} is a {cfg.model_type!r} model; this job trains Llama")
        if tokenizer.vocab_size > cfg.vocab_size:
            raise JobError(f"the tokenizer has {tokenizer.vocab_size} ids but {args.init_from_hf!r} only "
                           f"{cfg.vocab_size} embeddings; pass its tokenizer with --tokenizer")
        cfg._attn_implementation = args.attn
    else:
        kw = model_config_dict(args.preset_info, tokenizer.vocab_size, args.seq_len)
        kw.setdefault("bos_token_id", getattr(tokenizer, "bos_id", None))
        kw.setdefault("eos_token_id", getattr(tokenizer, "eos_id", None))
        cfg = LlamaConfig(**kw, attn_implementation=args.attn)
    d = cfg.to_dict()
    shape = {k: d.get(k) for k in SHAPE_KEYS}
    if shape.get("head_dim") is None:
        shape["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
    return shape, cfg


# ------------------------------------------------------------------------------------------- job
class Job:
    """The pretraining job's stages (prepare, build, initialise, open_output, header, train, finish);
    a job built on it overrides the stages that differ (see examples/finetune_lora.py)."""

    name = "pretrain_llama"  # the header's job name; errors are printed as "<name>.py: error: ..."
    built = "built on meta"  # how make_model makes the model (the header's model line)

    @staticmethod
    def parse_args(argv=None) -> argparse.Namespace:
        return parse_args(argv)

    def __init__(self, args, env):
        self.args, self.env = args, env
        self.rank, self.world, self.device = env.rank, env.world, env.device
        self.main = env.rank == 0
        self.lock = OutLock(args.out) if self.main else None  # rank 0 holds it for the job
        self.reported: set[str] = set()  # checkpoint notes already printed

    def take_lock(self) -> None:
        """Collective: rank 0 locks --out (once); a job already there stops every rank."""
        R.take_out_lock(self)

    def say(self, msg: str) -> None:
        if self.main:
            print(msg, flush=True)

    def run(self):
        self.prepare()
        self.build()
        self.initialise()
        self.open_output()
        self.header()
        self.train()
        self.finish()

    # ---------------------------------------------------------------- set-up (nothing written yet)
    def prepare(self):
        a = self.args
        if self.world % a.hsdp:  # the same verdict on every rank: they all stop together
            raise JobError(f"--hsdp {a.hsdp} does not divide the world size {self.world}: HSDP needs {a.hsdp} "
                           f"replicas of equal size; launch a multiple of {a.hsdp} ranks (e.g. --hsdp = the number "
                           "of nodes) or pick --hsdp among the divisors of the world size")
        self.take_lock()  # before --out is read, also a new one: see [Note: one line per run directory]
        self.plan = R.plan_run(self)
        err = None
        try:
            self.tokenizer = D.make_tokenizer(a.tokenizer)
            self.shape, self.config = model_config(a, self.tokenizer)
            self.load_data()
            self.settings = R.run_settings(a, self.world, self.batches, self.config, self.model_settings())
            self.manifest = None
            self.changes = {}
            if self.plan["resume_path"]:
                self.manifest = C.read_manifest(self.plan["resume_path"])
                self.check_resumable(self.manifest.get("meta", {}))
        except (JobError, D.DataError, C.CheckpointError) as e:
            err = str(e)
        except Exception as e:  # noqa: BLE001 - unexpected: still stop every rank together
            traceback.print_exc()
            err = f"rank {self.rank}: {type(e).__name__}: {e}"
        agree(err)
        if self.plan["resume_path"]:  # every file's size and checksum, before building anything
            try:
                C.verify_checkpoint(self.plan["resume_path"])
            except C.CheckpointError as e:
                raise JobError(f"{e}; nothing was changed. Delete that checkpoint to fall back to an older one, "
                               f"or pass --resume PATH --rewind") from None
        if self.plan["rewind"]:
            self.rewind()

    def check_resumable(self, meta: dict, saved_settings: dict | None = None) -> None:
        """The checkpoint fits this run: the model's shapes (else refused), and the settings that
        decide the data stream or the model unless --allow-change accepts them (``self.changes``;
        see [Note: settings a resume keeps]). Not checked when nothing will be trained."""
        saved = meta.get("model_shape")
        if saved is not None and saved != self.shape:
            diff = ", ".join(f"{k} {saved.get(k)} (checkpoint) vs {self.shape.get(k)} (this run)"
                             for k in SHAPE_KEYS if saved.get(k) != self.shape.get(k))
            raise JobError(
                f"checkpoint {self.plan['resume_path']!r} was written for a different model: {diff}; "
                f"resume with the --preset/--tokenizer/--init-from-hf of the run that wrote it "
                f"(it was: {meta.get('preset_args', '?')})"
            )
        saved_settings = saved_settings if saved_settings is not None else meta.get("settings")
        step = self.manifest.get("step", 0) if self.manifest else 0
        if saved_settings and not self.args.export_only and step < self.args.steps:
            self.changes = R.check_settings(saved_settings, self.settings, self.args.allowed_changes,
                                            self.plan["resume_path"])

    def model_settings(self) -> dict:
        """What a derived job adds to the ``model`` setting a resume keeps (see [Note: settings a
        resume keeps]); here nothing beyond the architecture."""
        return {}

    def rewind(self) -> None:
        """Collective: rank 0 sets the continuation after the resumed checkpoint aside (see
        [Note: one line per run directory]); every rank then goes on or stops together."""
        err = None
        if self.main:
            try:
                self.rewound = R.set_aside(self.args.out, self.plan["rewind"])
            except OSError as e:
                err = f"--rewind: setting the continuation aside failed: {C.describe_os_error(e)}; nothing was deleted"
        agree(err)

    def load_data(self):
        """``self.corpus``, the training windows ``self.batches`` and the held-out ``self.val``
        (None if the data is too short to hold any out)."""
        a = self.args
        corpus = D.load_corpus(a.data, self.tokenizer, text_key=a.text_key, bin_dtype=a.data_dtype)
        train, val = D.split(corpus.tokens, a.val_fraction, a.seq_len)
        if val is not None and len(val) > 4_000_000:  # a large corpus: a fixed-size validation tail
            train, val = corpus.tokens[:-4_000_000], corpus.tokens[-4_000_000:]
        self.corpus = corpus
        self.batches = D.Batches(train, a.seq_len, a.seed, source=f"--data {a.data!r}" if a.data else "the corpus")
        self.val = D.Batches(val, a.seq_len, a.seed + 1) if val is not None else None
        head = np.asarray(corpus.tokens[: 1 << 20])
        if head.size and int(head.max()) >= self.shape["vocab_size"]:
            raise JobError(f"--data holds token id {int(head.max())}, but the model has "
                           f"{self.shape['vocab_size']} embeddings (wrong --tokenizer or --data-dtype?)")

    def describe_data(self) -> str:
        """The header's data line."""
        ntr = len(self.batches.tokens)
        nval = len(self.val.tokens) if self.val else 0
        tok = "bytes" if isinstance(self.tokenizer, D.ByteTokenizer) else self.tokenizer.name
        return (f"{self.corpus.source}: {len(self.corpus.tokens):,} tokens ({tok}); {ntr:,} train / "
                f"{nval:,} val; {self.batches.windows:,} windows of {self.args.seq_len}")

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        """The training (and validation) loss of one micro-batch ``x`` as the data gives it."""
        return causal_lm_loss(self.model, x)

    def make_model(self):
        """The unwrapped model; here on the meta device (each rank then allocates only its shards)."""
        from transformers import LlamaForCausalLM

        from yafsdp.init import meta_parameters

        with meta_parameters():
            return LlamaForCausalLM(self.config)

    def wrap_options(self) -> dict:
        """Extra ``yafsdp.YaFSDP`` options of a derived job (the LoRA job's ``--qlora``: quantize_frozen)."""
        return {}

    def build(self):
        """The model from ``make_model``, wrapped, and its optimizer."""
        a = self.args
        bf16 = a.bf16 if a.bf16 is not None else self.device.type == "cuda"
        self.param_dtype = torch.bfloat16 if bf16 else None
        options = dict(self.wrap_options())
        if a.gather_dtype != "bf16":  # See [Note: compact trainable gathers] in yafsdp/fp8.py
            options["gather_dtype"] = a.gather_dtype
        # The engine's options, checked as YaFSDP(...) and the plan check them (yafsdp/config.py),
        # before the model is built.
        config = yafsdp.build_config(param_dtype=self.param_dtype, zero_stage=a.zero_stage, **options)
        model = self.make_model()
        if a.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        self.n_params = sum(p.numel() for p in model.parameters())
        self.model = yafsdp.YaFSDP(model, config=config, device=self.device,
                                   **hsdp_mesh(a.hsdp, self.world, self.device))
        if a.compile:
            self.model.compile_units()
        self.opt, self.opt_name = make_optimizer(self.model, a, self.device)

    def initialise(self):
        """Weights and state: from a checkpoint, a HF checkpoint, or the seeded init."""
        a, m = self.args, self.model
        self.step, self.cursor, self.tokens_seen, self.elapsed_before = 0, 0, 0, 0.0
        self.resumed_from = None
        if self.plan["resume_path"]:
            try:
                loaded = C.load_checkpoint(self.plan["resume_path"], m, self.opt, verify=False)
            except C.CheckpointError as e:
                raise JobError(str(e)) from None
            st = loaded.state
            if "settings" not in loaded.meta:  # written before settings were recorded: what its state holds
                self.check_resumable({}, {k: st[k] for k in ("seq_len", "seed") if k in st})
            self.step, self.cursor = int(st["step"]), int(st["cursor"])
            self.tokens_seen, self.elapsed_before = int(st.get("tokens", 0)), float(st.get("elapsed", 0.0))
            self.resumed_from = (loaded.path, loaded.saved_world_size, st.get("global_batch"))
            set_rng_state(loaded.rank_state, a.seed, self.rank, self.step, self.device)
            self.init_desc = (f"resumed from {loaded.path} (step {self.step}, written by {loaded.saved_world_size} "
                              f"rank(s), loaded by {self.world})")
        else:
            self.init_weights()

    def init_weights(self):
        """A fresh run's weights: from --init-from-hf, or the seeded init."""
        a, m = self.args, self.model
        if a.init_from_hf:
            from yafsdp.hf import HFCheckpointError, load_hf_weights

            try:
                load_hf_weights(m, a.init_from_hf)
            except HFCheckpointError as e:
                raise JobError(f"--init-from-hf: {e}") from None
            set_rng_state(None, a.seed, self.rank, 0, self.device)
            self.init_desc = f"weights from {a.init_from_hf} (rank 0 read them; each rank kept its shards)"
        else:
            from yafsdp.init import init_shards_, normal_init

            init_shards_(m, normal_init(getattr(self.config, "initializer_range", 0.02)), seed=a.seed)
            set_rng_state(None, a.seed, self.rank, 0, self.device)
            self.init_desc = f"seeded init (seed {a.seed}; the same for any world size)"

    def open_output(self):
        """From here on files are written (rank 0)."""
        a = self.args
        out = a.out
        self.t_session = time.perf_counter()
        self.metrics_path = os.path.join(out, "metrics.jsonl")
        self.png_path = os.path.join(out, "loss.png")
        self.tb = P.TensorBoard(a.tensorboard, self.main and not a.export_only)
        err = None
        if self.main and a.export_only:  # the run's files stay as they are; only an "export" event is added
            self.metrics = None
            self.events = P.Events(os.path.join(out, "events.jsonl"))
        elif self.main:
            try:
                self._open_run_files()
            except OSError as e:
                err = f"cannot write the run's files in --out {out!r}: {C.describe_os_error(e)}"
        agree(err)

    def _open_run_files(self):
        a, out = self.args, self.args.out
        os.makedirs(out, exist_ok=True)
        if self.plan["wipe"]:
            print(f"overwrite discarded the run in {out}: {self.plan['discarded']}", flush=True)
            for name in ("metrics.jsonl", "events.jsonl", "loss.png", "run.json"):
                if os.path.exists(os.path.join(out, name)):
                    os.remove(os.path.join(out, name))
            # The run's checkpoints and killed saves; a step_* directory without a manifest is not
            # the run's (see yafsdp.checkpoint.foreign_dirs) and stays.
            for _, path in C.list_checkpoints(self.plan["ck_root"]):
                shutil.rmtree(path)
            for path in C.unfinished_saves(self.plan["ck_root"]):
                shutil.rmtree(path, ignore_errors=True)
        if self.plan["resume_path"]:
            P.truncate_metrics(self.metrics_path, self.step)
        self.metrics = P.JsonLines(self.metrics_path)
        self.events = P.Events(os.path.join(out, "events.jsonl"))
        with open(os.path.join(out, "run.json"), "w") as f:
            args = {k: v for k, v in vars(a).items() if k not in ("preset_info", "allowed_changes")}
            json.dump(dict(argv=sys.argv, args=args,
                           world=self.world, device=str(self.device), torch=torch.__version__,
                           yafsdp=yafsdp.__version__, optimizer=self.opt_name, model_shape=self.shape,
                           params=self.n_params), f, indent=1, default=str)

    # --------------------------------------------------------------------------------- the loop
    def header(self):
        a, m = self.args, self.model
        gb = a.batch_size * self.world * a.grad_accum
        self.tokens_per_step = gb * a.seq_len
        dtype = "bf16" if self.param_dtype == torch.bfloat16 else "fp32"
        units = len(m.flat_units)
        ac = " | activation checkpointing" if a.activation_checkpointing else ""
        if a.gather_dtype == "fp8":
            n8 = sum(1 for u in m.flat_units for g in u.groups if g.kind.gather_format == "fp8")
            ac += f" | fp8 weight gathers ({n8} units)"
        if a.hsdp > 1:
            ac += f" | HSDP {a.hsdp} replicas x {self.world // a.hsdp} shard ranks"
        self.say(f"yafsdp {yafsdp.__version__} | {self.name} | {self.world} rank(s) on {self.env.nodes} node(s) | "
                 f"{self.device.type} ({self.env.backend}) | {dtype} compute, fp32 master | ZeRO-{a.zero_stage}{ac}")
        self.say(f"flags    {non_default_flags(a, self.parse_args)}")
        preset = f"--init-from-hf {a.init_from_hf}" if a.init_from_hf else f"preset {a.preset}"
        c = self.shape
        self.say(f"model    {preset}: LlamaForCausalLM {P.fmt_count(self.n_params)} params ({c['num_hidden_layers']} "
                 f"layers x {c['hidden_size']}, vocab {c['vocab_size']}); {units} flat units, {self.built}")
        self.say(f"init     {self.init_desc}")
        self.say(f"data     {self.describe_data()}")
        total = max(0, a.steps - self.step)
        if a.export_only:
            steps = f"export only (--export-only): no training, the weights of step {self.step}"
        elif total == 0:
            steps = f"nothing to train: the checkpoint is at step {self.step}, --steps is {a.steps}"
        else:
            steps = (f"steps {self.step} -> {a.steps} ({P.fmt_count(total * self.tokens_per_step)} tokens, "
                     f"{total * gb / self.batches.windows:.1f} epochs)")
        self.say(f"batch    {a.batch_size} seq x {self.world} ranks x {a.grad_accum} accum = {gb} seq = "
                 f"{self.tokens_per_step:,} tokens/step; {steps}")
        self.say(f"optim    {self.opt_name}: lr {a.lr:g} (warmup {a.warmup}, cosine to {a.lr * a.min_lr_ratio:g} at "
                 f"step {a.decay_steps}), weight decay {a.weight_decay:g}, clip {a.grad_clip:g}")
        mem = sum(m.allocated_bytes().values())
        self.say(f"memory   engine allocations per rank: {mem / 2**20:.1f} MiB "
                 f"(model {4 * self.n_params / 2**20:.1f} MiB in fp32, unsharded)")
        c = self.shape
        emb = c["vocab_size"] * c["hidden_size"]
        self.flops_per_token = P.flops_per_token(self.n_params, emb, c["num_hidden_layers"], c["hidden_size"], a.seq_len)
        self.peak, peak_from = P.peak_tflops(self.device, self.param_dtype == torch.bfloat16, a.peak_tflops)
        mfu = f"MFU against {peak_from}" if self.peak else f"MFU n/a ({peak_from})"
        self.say(f"perf     {self.flops_per_token / 1e6:.2f} MFLOP/token (6 N + 12 L H S); {mfu}")
        every = f"every {a.save_every} steps and at the end" if a.save_every else "at the end"
        tb = f", TensorBoard {a.tensorboard}" if self.tb.writer is not None else ""
        self.say(f"out      {a.out}: metrics.jsonl, loss.png, checkpoints/ ({every}, keep {a.keep}){tb}")
        if self.tb.problem:
            self.say(f"note     {self.tb.problem}")
        if self.main and self.lock.note:
            self.say(f"note     {self.lock.note}")
        for note in self.plan.get("notes", []):
            self.say(f"note     {note}")
        if getattr(self, "rewound", None):
            r = self.rewound
            self.say(f"rewind   back to step {r['step']}: the continuation after it ({self.plan['rewind']['what']}) "
                     f"is set aside in {r['set_aside']} (moved, nothing deleted; recorded in events.jsonl)")
        if self.changes:
            self.say(f"note     settings changed from the checkpoint's: {R.describe_changes(self.changes)}; "
                     "recorded in events.jsonl")
        for path in self.plan["foreign"]:
            self.say(f"note     skipped {path}: no {C.MANIFEST}, not a complete checkpoint (not used by --resume, "
                     "left in place)")
        if self.resumed_from and self.resumed_from[2] not in (None, gb) and not a.export_only:
            self.say(f"note     the checkpoint's global batch was {self.resumed_from[2]} sequences, this run's is {gb}: "
                     "the data order continues, the step contents differ")
        if a.steps > a.decay_steps:
            self.say(f"note     --steps {a.steps} > --decay-steps {a.decay_steps}: the learning rate stays at "
                     f"{a.lr * a.min_lr_ratio:g} after step {a.decay_steps}")

    def train(self):
        a, m, opt = self.args, self.model, self.opt
        if a.export_only:
            self.first_loss = self.last_loss = self.val_loss = self.stopped_by = None
            self.train_time, self.trained_steps, self.step_times = 0.0, 0, []
            self.last_checkpoint = self.plan["resume_path"]
            return
        stop = StopSignal().install()
        bar = P.Bar(self.main and not a.no_progress, a.steps, self.step)
        self.first_loss = self.last_loss = None
        self.val_loss = None
        self.stopped_by = None
        last_saved = self.step if self.plan["resume_path"] else -1
        t_start = time.perf_counter()
        start_step = self.step
        step_times = []
        self.session_losses = []
        self.skipped_steps = 0
        in_row = 0  # consecutive non-finite steps
        self.losses_before = [r["loss"] for r in P.read_jsonl(self.metrics_path)] if self.main else []
        max_norm = a.grad_clip if a.grad_clip > 0 else float("inf")
        if self.main:
            kind = "resume" if self.plan["resume_path"] else "start"
            self.events.write(dict(event=kind, step=self.step, world=self.world, restart=self.env.restart_count,
                                   checkpoint=self.plan["resume_path"], optimizer=self.opt_name))
            if self.changes:  # accepted by --allow-change, or free; see [Note: settings a resume keeps]
                self.events.write(dict(event="settings_changed", step=self.step, checkpoint=self.plan["resume_path"],
                                       changes=self.changes))
        try:
            while self.step < a.steps:
                t0 = time.perf_counter()
                lr = lr_at(a, self.step + 1)
                for group in opt.param_groups:
                    group["lr"] = lr
                total = torch.zeros((), device=self.device)
                for micro in range(a.grad_accum):
                    x = self.batches.micro_batch(self.cursor, micro, self.rank, self.world, a.batch_size)
                    if int(x.max()) >= self.shape["vocab_size"]:
                        raise JobError(f"--data holds token id {int(x.max())} >= vocab {self.shape['vocab_size']}")
                    x = x.to(self.device, non_blocking=True)
                    loss = self.loss(x)
                    (loss / a.grad_accum).backward()
                    total += loss.detach().float()
                norm = m.clip_grad_norm_(max_norm)
                # [Note: non-finite steps] One all-reduce (the step's only host sync) carries the loss,
                # a stop signal, "this rank's loss or the grad norm is NaN/inf" and the norm, and it
                # comes before the optimizer step: every rank skips a bad step together (no update,
                # gradients dropped) instead of writing NaN into the weights, the optimizer state and
                # then every checkpoint. --max-skipped-steps in a row stop the run (exit 3).
                mean = total / a.grad_accum
                norm = torch.as_tensor(norm, device=self.device).detach().float()
                bad = torch.logical_not(torch.isfinite(mean) & torch.isfinite(norm)).float()
                stats = torch.stack([mean, torch.tensor(float(stop.signum is not None), device=self.device), bad,
                                     norm])
                dist.all_reduce(stats)
                loss_sum, n_stop, n_bad, norm_sum = stats.tolist()
                loss_val, stop_now, skipped = loss_sum / self.world, n_stop > 0, n_bad > 0
                grad_norm = norm_sum / self.world  # the same global norm on every rank
                if skipped:
                    opt.zero_grad(set_to_none=True)
                    self.skipped_steps += 1
                    in_row += 1
                else:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    in_row = 0
                self.step += 1
                self.cursor += a.batch_size * self.world * a.grad_accum
                self.tokens_seen += self.tokens_per_step
                dt = time.perf_counter() - t0
                step_times.append(dt)
                mem = P.peak_memory_gb(self.device)
                tok_s_dev = self.tokens_per_step / dt / self.world
                mfu = self.flops_per_token * tok_s_dev / (self.peak * 1e12) if self.peak else None
                row = dict(step=self.step, loss=loss_val, lr=lr, grad_norm=grad_norm,
                           tokens=self.tokens_seen, tokens_per_s=round(self.tokens_per_step / dt, 1),
                           tokens_per_s_per_device=round(tok_s_dev, 1), mfu=round(mfu, 5) if mfu is not None else None,
                           step_time_s=round(dt, 4), mem_gb=round(mem, 4),
                           epoch=round(self.batches.epoch_of(self.cursor), 4))
                if skipped:
                    row["skipped"] = True
                else:
                    if self.first_loss is None:
                        self.first_loss = loss_val
                    self.last_loss = loss_val
                    self.session_losses.append(loss_val)
                if self.val is not None and a.eval_every and self.step % a.eval_every == 0:
                    row["val_loss"] = self.val_loss = round(self.evaluate(), 6)
                if self.main:
                    self.metrics.write(row)
                    self.tb.write(row)
                bar.update(loss_val, self.tokens_per_step / dt, dt, mem, tok_s_dev, mfu)
                if skipped:
                    last = getattr(self, "last_checkpoint", None) or "none yet"
                    if self.main:
                        self.events.write(dict(event="skipped", step=self.step, loss=loss_val, grad_norm=grad_norm))
                    if in_row >= a.max_skipped_steps:
                        if self.main:
                            self.events.write(dict(event="diverged", step=self.step, skipped=in_row))
                        raise Diverged(
                            f"training diverged: the loss or grad norm was NaN/inf for {in_row} steps in a row (steps "
                            f"{self.step - in_row + 1}-{self.step}, lr {lr:g}; last loss {loss_val}, grad norm "
                            f"{grad_norm}); the weights are those of step {self.step - in_row}, no checkpoint holds a "
                            f"non-finite value; last checkpoint: {last}. "
                            "Resume from it with a lower --lr or a longer --warmup (or raise --max-skipped-steps)")
                    msg = (f"skipped  step {self.step}: loss {loss_val:.4g}, grad norm {grad_norm:.4g} (not finite); "
                           f"no optimizer step ({in_row} in a row, stop at {a.max_skipped_steps})")
                    if self.main:
                        bar.write(msg)
                if stop_now:
                    self.stopped_by = stop.name or "a signal on another rank"
                    break
                if a.save_every and self.step % a.save_every == 0 and self.step < a.steps:
                    self.save(bar)
                    last_saved = self.step
                S.poll(self, bar)
        except BaseException:
            S.drain(self, bar, quiet=True)  # the write in flight ends before the exception goes on
            raise
        else:
            S.drain(self, bar)
        finally:
            bar.close()
            stop.uninstall()
        self.train_time = time.perf_counter() - t_start
        self.trained_steps = self.step - start_step
        self.step_times = step_times
        if self.stopped_by and self.main:
            self.events.write(dict(event="signal", signal=self.stopped_by, step=self.step))
        if self.step != last_saved and (self.trained_steps > 0 or not self.plan["resume_path"]):
            self.save(None)

    def save(self, bar):
        a = self.args
        t0 = time.perf_counter()
        state = dict(step=self.step, cursor=self.cursor, tokens=self.tokens_seen,
                     elapsed=self.elapsed_before + time.perf_counter() - self.t_session,
                     global_batch=a.batch_size * self.world * a.grad_accum, seq_len=a.seq_len, seed=a.seed)
        meta = dict(model_shape=self.shape, settings=self.settings, preset_args=describe_model_args(a),
                    optimizer=self.opt_name,
                    tokenizer="bytes" if isinstance(self.tokenizer, D.ByteTokenizer) else self.tokenizer.name)
        self.check_finite()
        if a.async_save and bar is not None:  # periodic saves; the run's last one is synchronous
            return S.save(self, bar, state, meta, get_rng_state(self.device))
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always", C.CheckpointWarning)
            try:
                path = C.save_checkpoint(self.plan["ck_root"], self.step, self.model, self.opt, state=state,
                                         rank_state=get_rng_state(self.device), meta=meta, keep=a.keep)
            except C.CheckpointError as e:
                last = getattr(self, "last_checkpoint", None) or self.plan["resume_path"]
                raise JobError(f"step {self.step} was not saved: {e}; last complete checkpoint: "
                               f"{last or 'none'}") from None
        for w in notes:
            if issubclass(w.category, C.CheckpointWarning) and str(w.message) not in self.reported:
                self.reported.add(str(w.message))
                msg = f"note     {w.message}"
                if self.main:
                    bar.write(msg) if bar is not None else print(msg, flush=True)
        dt = time.perf_counter() - t0
        if self.main:
            self.events.write(dict(event="save", step=self.step, path=path, seconds=round(dt, 3)))
            msg = f"saved    {path} ({dt:.1f} s)"
            if bar is not None:
                bar.write(msg)
            else:
                print(msg, flush=True)
        self.last_checkpoint = path

    @torch.no_grad()
    def check_finite(self) -> None:
        """Collective: refuse to save NaN/inf weights or optimizer state (one all-reduce per save).
        Skipped steps (see [Note: non-finite steps]) keep them finite; this is the last guard, so
        that no checkpoint -- and no rotation by --keep -- ever replaces finite ones with garbage."""
        bad = torch.zeros((), device=self.device)
        for i in self.model.shard_info():
            bad += torch.logical_not(torch.isfinite(i.param)).sum()
            for v in self.opt.state.get(i.param, {}).values():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    bad += torch.logical_not(torch.isfinite(v)).sum()
        dist.all_reduce(bad)
        if bad.item() > 0:
            last = getattr(self, "last_checkpoint", None) or self.plan["resume_path"] or "none"
            raise Diverged(f"training diverged: {int(bad.item())} weights or optimizer-state values are NaN/inf at "
                           f"step {self.step}; not saved, the last complete checkpoint ({last}) is kept. Resume "
                           "from it with a lower --lr or a longer --warmup")

    @torch.no_grad()
    def evaluate(self) -> float:
        a = self.args
        total = torch.zeros((), device=self.device)
        for i in range(a.eval_batches):
            x = self.val.micro_batch(0, i, self.rank, self.world, a.batch_size).to(self.device)
            total += self.loss(x).float()
        dist.all_reduce(total)
        return total.item() / (a.eval_batches * self.world)

    @torch.no_grad()
    def sample(self, n_tokens: int) -> str:
        """Collective: sample ``n_tokens`` tokens after ``--prompt`` (temperature 0.8, seeded)."""
        a, tok = self.args, self.tokenizer
        ids = torch.as_tensor(tok.encode(a.prompt).astype(np.int64), device=self.device).view(1, -1)
        g = torch.Generator(device="cpu").manual_seed(a.seed)
        start = ids.shape[1]
        for _ in range(n_tokens):
            logits = self.model(input_ids=ids[:, -a.seq_len:], use_cache=False).logits[0, -1].float().cpu()
            nxt = torch.multinomial(torch.softmax(logits / 0.8, -1), 1, generator=g).to(self.device)
            dist.broadcast(nxt, src=0)  # every rank continues with rank 0's token
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            if tok.eos_id is not None and int(nxt) == tok.eos_id:
                break
        return a.prompt + tok.decode(ids[0, start:].tolist())

    def finish(self):
        a = self.args
        m = self.model
        if self.val is not None and self.trained_steps > 0 and not self.stopped_by:
            self.val_loss = self.evaluate()
        sample = None
        n_sample = a.sample_tokens if a.sample_tokens is not None else (120 if self.n_params < 1e9 else 0)
        readable = a.tokenizer is not None or not (a.data or "").endswith(".bin")  # else: ids of an unknown tokenizer
        if n_sample > 0 and readable and not self.stopped_by and self.trained_steps > 0:
            sample = self.sample(n_sample)
        exported = None
        if a.export_only:
            exported = self.export()
            if self.main:
                self.summary(None, exported)
                self.events.close()
            return
        if not self.stopped_by:
            exported = self.write_exports()
        if self.main:
            P.plot_loss(self.metrics_path, self.png_path,
                        title=f"{a.preset if not a.init_from_hf else 'from HF'}: {P.fmt_count(self.n_params)} params, "
                              f"{self.world} ranks", final_val=(self.step, self.val_loss),
                        events_path=os.path.join(a.out, "events.jsonl"))
            self.summary(sample, exported)
            self.events.write(dict(event="stopped" if self.stopped_by else "end", step=self.step,
                                   loss=self.last_loss, val_loss=self.val_loss))
            self.metrics.close()
            self.events.close()
            self.tb.close()
        del m

    def write_exports(self):
        """Collective: what a run that was not stopped writes at the end (here --export-hf); returns
        what ``summary`` reports."""
        a = self.args
        if not a.export_hf:
            return None
        if os.path.isdir(a.export_hf) and os.listdir(a.export_hf):
            self.say(f"export   {a.export_hf} already holds an export (restarted run): left as is")
            return None
        return self.export()

    def export(self):
        from yafsdp.hf import export_hf

        a = self.args
        dtype = torch.bfloat16 if a.export_dtype == "bfloat16" else torch.float32
        t0 = time.perf_counter()
        probe = torch.arange(min(32, a.seq_len), device=self.device).view(1, -1) % self.shape["vocab_size"]
        with torch.no_grad():
            ours = self.model(input_ids=probe, use_cache=False).logits.float().cpu()
        tok = self.tokenizer if isinstance(self.tokenizer, (D.ByteTokenizer, D.HFTokenizer)) else None
        # The exported config names the tokenizer's special tokens (generate() and pipelines read
        # them). Set here, not at build time: a pad_token_id in the training config would make HF
        # build the embedding with padding_idx, which changes nothing numerically for this data
        # but is not what the checkpoint was trained with.
        cfg = self.model.module.config
        for key in ("pad", "bos", "eos"):
            tid = getattr(self.tokenizer, f"{key}_id", None)
            if tid is not None:
                setattr(cfg, f"{key}_token_id", int(tid))
        export_hf(self.model, a.export_hf, dtype=dtype, tokenizer=tok)
        check = None
        if self.main and self.n_params <= 200_000_000:  # reload on rank 0 and compare the logits
            from transformers import LlamaForCausalLM
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            hf, info = LlamaForCausalLM.from_pretrained(a.export_hf, output_loading_info=True, dtype=torch.float32)
            with torch.no_grad():
                theirs = hf(input_ids=probe.cpu()).logits.float()
            check = dict(missing=len(info["missing_keys"]), unexpected=len(info["unexpected_keys"]),
                         max_abs_diff=float((theirs - ours).abs().max()))
        if self.main:
            self.events.write(dict(event="export", path=a.export_hf, dtype=a.export_dtype, check=check,
                                   seconds=round(time.perf_counter() - t0, 3)))
        return a.export_hf, check

    def summary(self, sample, exported):
        a = self.args
        st = self.step_times
        if st:
            med = sorted(st)[len(st) // 2]
            tps = self.tokens_per_step / med
            mfu = self.flops_per_token * tps / self.world / (self.peak * 1e12) if self.peak else None
            self.say(f"done     {self.trained_steps} steps in {P.fmt_time(self.train_time)} (median {med * 1e3:.0f} ms/step, "
                     f"{tps:,.0f} tokens/s = {tps / self.world:,.0f} per device, MFU {P.fmt_mfu(mfu)}, peak memory "
                     f"{P.peak_memory_gb(self.device):.2f} GB on rank 0); step {self.step}/{a.steps}")
            val = f"; val {self.val_loss:.4f}" if self.val_loss is not None else ""
            start = self.step - self.trained_steps
            self.say(f"loss     {P.loss_windows(self.losses_before, self.session_losses, start, self.step)}{val} "
                     f"(nats/token; uniform guess {math.log(self.shape['vocab_size']):.2f})")
        elif a.export_only:
            self.say(f"done     export only: the weights of step {self.step} ({self.plan['resume_path']})")
        else:
            self.say(f"done     nothing to train: already at step {self.step} (--steps {a.steps})")
        if self.stopped_by:
            self.say(f"stopped  by {self.stopped_by} at step {self.step}; checkpoint {self.last_checkpoint}; "
                     "continue with --resume")
        if sample is not None:
            self.say("sample   " + repr(sample[:300]))
        if exported:
            path, check = exported
            extra = ""
            if check:
                extra = (f"; reloaded with from_pretrained: {check['missing']} missing, {check['unexpected']} unexpected "
                         f"keys, max |logit diff| {check['max_abs_diff']:.2e}")
            self.say(f"export   {path}: config.json + model.safetensors ({a.export_dtype}){extra}")
        if not a.export_only:
            self.say(f"files    {self.metrics_path}, {self.png_path}, "
                     f"{getattr(self, 'last_checkpoint', '(no checkpoint)')}")


# --------------------------------------------------------------------------------------- helpers
def hsdp_mesh(replicas: int, world: int, device: torch.device) -> dict:
    """YaFSDP's mesh argument for ``--hsdp R``: a (R, world / R) mesh named ('replicate', 'shard')
    (torchrun numbers the ranks node by node, so with R = nodes each replica is one node); none for R = 1."""
    if replicas == 1:
        return {}
    from torch.distributed.device_mesh import init_device_mesh

    return dict(mesh=init_device_mesh(device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard")))


def causal_lm_loss(model, x: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over all ``seq_len`` positions of windows ``x`` (B, seq_len + 1)."""
    logits = model(input_ids=x[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())


def make_optimizer(model, args, device):
    """yafsdp.FusedAdamW when this install has it, else torch's AdamW (fused where supported)."""
    groups = model.param_groups(weight_decay=args.weight_decay, small_weight_decay=0.0)
    kw = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    fused_cls = getattr(yafsdp, "FusedAdamW", None)
    if fused_cls is None:
        try:
            from yafsdp.optim import FusedAdamW as fused_cls  # noqa: N813
        except Exception:  # noqa: BLE001 - not built / not there: fall back below
            fused_cls = None
    if fused_cls is not None:
        return fused_cls(groups, **kw), "yafsdp.FusedAdamW"
    try:
        return torch.optim.AdamW(groups, fused=True, **kw), "torch.optim.AdamW(fused)"
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(groups, foreach=True, **kw), "torch.optim.AdamW(foreach)"


def non_default_flags(args, parse_args) -> str:
    """The flags that differ from their defaults (the preset's, for preset-dependent ones), as a
    command line: the header shows every setting a reader cannot assume. ``parse_args`` is the
    job's own (its defaults are the reference)."""
    ref = parse_args(["--preset", args.preset])
    skip = {"preset_info", "allowed_changes", "out", "preset", "no_progress"}
    diff = []
    for k, v in vars(args).items():
        if k in skip or getattr(ref, k, None) == v:
            continue
        flag = "--" + k.replace("_", "-")
        if v is True or (k == "resume" and v == "latest"):
            diff.append(flag)
        else:
            diff.append(f"--no-{k.replace('_', '-')}" if v is False else f"{flag} {v}")
    return " ".join(diff) if diff else f"all defaults of preset {args.preset}"


def describe_model_args(args) -> str:
    parts = [f"--init-from-hf {args.init_from_hf}" if args.init_from_hf else f"--preset {args.preset}"]
    if args.tokenizer:
        parts.append(f"--tokenizer {args.tokenizer}")
    return " ".join(parts)


def get_rng_state(device) -> dict:
    st = dict(torch=torch.get_rng_state(), numpy=np.random.get_state(), python=random.getstate())
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def set_rng_state(st, seed: int, rank: int, step: int, device) -> None:
    if st is None:  # a fresh run, or a rank that did not exist in the saved world
        s = seed * 100003 + rank * 1009 + step
        torch.manual_seed(s)
        np.random.seed(s % 2**32)
        random.seed(s)
        return
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if device.type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"], device)


def shutdown_distributed() -> None:
    """Destroy the process group *and* its backend before the interpreter exits.

    [Note: teardown before exit] A gloo worker thread that drops the last C++ reference of a
    tensor while the interpreter finalizes aborts the process ("terminate called without an
    active exception", SIGABRT, after all the work was done; see [Note: gloo work and interpreter
    exit] in yafsdp/collectives.py for the mechanism and the engine's exit hook). The job goes
    further and ends the gloo backend itself before exit: ``destroy_process_group()`` only
    unregisters the group, and the backend (its worker threads) lives while Python objects hold it
    -- the model, the optimizer and the job, which sit in reference cycles. The caller has dropped
    its references and every rank met in a barrier after its last collective; the collection here
    frees the group while Python still runs, and the backend's destructor joins its threads. This
    holds on the error path too (the engine's autograd nodes hold it weakly: [Note: weak
    references from autograd nodes]); tests/test_job_failures.py checks that no thread but the
    main one is left after ``main()`` returns, on a normal and on an error exit."""
    import gc

    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    return check_args(p, p.parse_args(argv))


def main(argv=None, job_cls=Job) -> int:
    """Run ``job_cls`` through its stages; a JobError (every rank together) is one line on stderr
    and the exit status of its kind."""
    prog = f"{job_cls.name}.py"
    args = job_cls.parse_args(argv)
    try:
        env = init_distributed(args.device)
    except JobError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"{prog}: error: {e}", file=sys.stderr)
        return e.exit_code
    code = 0
    job = None
    try:
        job = job_cls(args, env)
        job.run()
        dist.barrier()  # see [Note: teardown before exit]
    except JobError as e:  # raised on every rank together (see agree); printed once
        if env.rank == 0:
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        code = e.exit_code
        dist.barrier()  # every rank raises a JobError together; see [Note: teardown before exit]
    finally:
        if job is not None and job.lock is not None:
            job.lock.release()
        job = None
        shutdown_distributed()
    return code
