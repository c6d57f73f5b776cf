"""The job's flags: the argparse definition (``build_parser``: one ``add_argument`` per flag, in
groups a derived job extends), their validation and preset-dependent defaults (``check_args``), and
what is derived from them alone: the learning-rate schedule, the header's flags line, the model
arguments a checkpoint records."""
from __future__ import annotations

import argparse
import math
import os
import sys

from yafsdp.layout.config import OPTIONS

from pretrain import rundir as R
from pretrain.presets import DEFAULT_PRESET, presets


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


def shard_size(args) -> int | str:
    """--max-shard-size as ``export_hf`` takes it: digits are bytes, anything else HF's size strings."""
    v = str(args.max_shard_size)
    return int(v) if v.isdigit() else v


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
    g.add_argument("--data", default=None, help="text file, .jsonl, pre-tokenized .bin, a directory of .txt/.jsonl "
                   "or of .bin shards; streamed: .parquet/.arrow/.csv (a file or a folder of shards) or a Hugging Face "
                   "dataset name; default: the embedded corpus")
    g.add_argument("--tokenizer", default=None, metavar="DIR", help="local HF tokenizer folder; default: bytes")
    g.add_argument("--text-key", "--data-column", dest="text_key", default="text",
                   help="JSONL field / dataset column holding the text")
    g.add_argument("--data-split", default="train", help="split of a dataset name or folder (streamed data)")
    g.add_argument("--stream", action="store_true",
                   help="stream a .jsonl file or folder too (read by rank and tokenized on the fly, not whole at start)")
    g.add_argument("--val-data", default=None, metavar="PATH",
                   help="validation data from this file, folder or dataset (any --data kind) instead of a held-out tail")
    g.add_argument("--val-split", default=None,
                   help="validation from this split of --data (streamed data), instead of a held-out tail")
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
    # the flags that mirror an engine option take its values (yafsdp/layout/config.py; formats from the registry)
    g.add_argument("--zero-stage", type=int, default=3, choices=OPTIONS["zero_stage"].choices(),
                   help="3: gather weights again for backward; 2: keep them from forward")
    g.add_argument("--gather-dtype", default="bf16", choices=OPTIONS["gather_dtype"].texts(none="bf16"),
                   help="a gather format (YaFSDP gather_dtype=, docs/formats.md): the decoder layers' linear weights "
                        "gathered as its records, e.g. fp8: float8 e4m3 + a float32 scale per 128 (~1.03 instead of "
                        "2 bytes per parameter); the fp32 master, gradients and optimizer are unchanged. bf16: "
                        "gather in the compute dtype")
    g.add_argument("--grad-quant", default="none", choices=OPTIONS["grad_quant"].texts(),
                   help="YaFSDP grad_quant= (docs/grad_quant.md): gradients sent across node groups (and HSDP's "
                   "replicas) as 8-bit blocks with an fp32 scale per 128, summed in fp32; none: in the reduce dtype")
    g.add_argument("--grad-quant-node", type=int, default=1, metavar="L",
                   help="with --grad-quant: consecutive ranks of a shard group on one node (their reduce stays full "
                   "precision), e.g. the GPUs per node")
    g.add_argument("--hsdp", type=int, default=1, metavar="R",
                   help="HSDP: R replicas (e.g. R = nodes), each sharding the model over world / R ranks; gathers "
                   "and reduce-scatters stay inside a replica, gradients are all-reduced across replicas once per "
                   "step (1: shard over every rank)")
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallel inside groups of N consecutive ranks (e.g. N = the GPUs of a node; docs/tp.md): "
                   "torch's TP with yafsdp's Llama plan (sequence parallel) on a ('dp', 'tp') mesh, the model sharded "
                   "over the world / N data-parallel ranks, each of which reads its batch for all its TP ranks "
                   "(1: no tensor parallelism)")
    g.add_argument("--loss-parallel", action="store_true",
                   help="with --tp: the head's logits stay split over the vocabulary and the cross-entropy is computed "
                   "on the slices (torch's loss_parallel), never gathering the full logits")
    g.add_argument("--activation-checkpointing", action="store_true", help="recompute each layer in backward")
    g.add_argument("--checkpointing", default=None, choices=["none", "all", "auto"],
                   help="activation checkpointing: all = --activation-checkpointing; auto: the fewest layers whose "
                   "predicted peak fits --memory-budget (docs/activation_checkpointing.md) [auto with a budget, else none]")
    g.add_argument("--memory-budget", default=None, metavar="BYTES",
                   help="bytes per device for --checkpointing auto, e.g. 60GiB (GPU default: free after the "
                   "engine's allocations minus a margin; required on CPU)")
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
    g.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest safetensors file of an export (bytes, or 5GB, 500MB, 2GiB as Hugging Face writes "
                   "them); a larger model is written as model-0000i-of-0000n.safetensors + an index")
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
    g = p.add_argument_group("faults (docs/errors.md)")
    g.add_argument("--hang-timeout", type=float, default=120.0, metavar="S",
                   help="after the first step: a rank without progress for S seconds is named with what every "
                   "rank was doing, and the job exits with status 4 (torchrun --max-restarts then restarts it)")
    g.add_argument("--init-timeout", type=float, default=600.0, metavar="S",
                   help="the same deadline before the first step (start-up, loading), and the process group's "
                   "timeout")
    g.add_argument("--save-timeout", type=float, default=1800.0, metavar="S",
                   help="the deadline while a checkpoint or an export is written")
    g.add_argument("--loss-spike", type=float, default=3.0, metavar="K",
                   help="a step whose loss exceeds K x the median of the last 20 good steps is a spike "
                   "(0: no check)")
    g.add_argument("--on-spike", default="skip", choices=["skip", "stop", "warn"],
                   help="skip: no optimizer step, counted with the non-finite steps towards --max-skipped-steps; "
                   "stop: exit 3 at once; warn: say so and go on")
    g = p.add_argument_group("replica groups under torchft (docs/hsdp.md)")
    g.add_argument("--torchft", action="store_true",
                   help="this torchrun is one replica group of a torchft run: it shards the model over its own ranks, "
                   "the gradients are averaged across the live groups through torchft (lighthouse: "
                   "$TORCHFT_LIGHTHOUSE); a group that dies does not stop the others, and rejoins with their state")
    g.add_argument("--replica-group", type=int, default=None, metavar="G",
                   help="with --torchft: this group's index, 0 .. --replica-groups - 1 (the same across its restarts)")
    g.add_argument("--replica-groups", type=int, default=None, metavar="R",
                   help="with --torchft: the run's replica groups (each reads its own part of every step's batch)")
    g.add_argument("--torchft-timeout", type=float, default=60.0, metavar="S",
                   help="with --torchft: the deadline of the all-reduce across groups, of the commit and of a "
                   "restarted group's state transfer; a group that hangs is dropped after it")
    g.add_argument("--torchft-wait", type=float, default=300.0, metavar="S",
                   help="with --torchft: the first step of a launch waits up to about S seconds for all "
                   "--replica-groups groups to join, so that the run starts with all of them (0: start with the "
                   "groups that are there; the others join later and take the state then)")
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
    for name, value in sorted(vars(args).items()):  # every float flag: NaN and inf are never meant
        if isinstance(value, float) and not math.isfinite(value):
            p.error(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    for name, low, high in (("min_lr_ratio", 0.0, 1.0), ("weight_decay", 0.0, None), ("grad_clip", 0.0, None)):
        value = getattr(args, name)
        if value < low or (high is not None and value > high):
            within = f"in [{low:g}, {high:g}]" if high is not None else f">= {low:g}"
            p.error(f"--{name.replace('_', '-')} must be {within}, got {value}")
    for name in ("hang_timeout", "init_timeout", "save_timeout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(args, name)}")
    if args.loss_spike and args.loss_spike <= 1:
        p.error(f"--loss-spike must be 0 (no check) or > 1 (a multiple of the recent median loss), got "
                f"{args.loss_spike}")
    if not 0 <= args.val_fraction < 0.5:
        p.error(f"--val-fraction must be in [0, 0.5), got {args.val_fraction}")
    if args.val_data and args.val_split:
        p.error("--val-data and --val-split both name the validation data; pass one")
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
    check_torchft(p, args)
    check_tp(p, args)
    from yafsdp.export import ExportError, parse_size

    try:
        parse_size(shard_size(args))
    except ExportError as e:
        p.error(f"--max-shard-size: {e}")
    args.preset_info = pr
    return args




def check_torchft(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--torchft and its group flags: both group flags with it, neither without it; no --hsdp (the
    replicate dimension is torchft's); a lighthouse to ask."""
    if not args.torchft:
        for name in ("replica_group", "replica_groups"):
            if getattr(args, name) is not None:
                p.error(f"--{name.replace('_', '-')} is a flag of --torchft runs; add --torchft (and start a "
                        "torchft lighthouse) or drop it")
        return
    if args.replica_group is None or args.replica_groups is None:
        p.error("--torchft needs --replica-group G and --replica-groups R: this torchrun's group index and the "
                "run's number of groups")
    if args.replica_groups < 1 or not 0 <= args.replica_group < args.replica_groups:
        p.error(f"--replica-group must be in 0 .. --replica-groups - 1 = {args.replica_groups - 1}, got "
                f"{args.replica_group} (and --replica-groups >= 1, got {args.replica_groups})")
    if args.hsdp > 1:
        p.error(f"--torchft with --hsdp {args.hsdp}: under torchft each torchrun is one replica group sharding the "
                "model over its own ranks, and torchft is the replicate dimension; drop --hsdp and launch one "
                "torchrun per replica group")
    if args.torchft_timeout <= 0:
        p.error(f"--torchft-timeout must be > 0 seconds, got {args.torchft_timeout}")
    if args.torchft_wait < 0:
        p.error(f"--torchft-wait must be >= 0 seconds, got {args.torchft_wait}")
    if not os.environ.get("TORCHFT_LIGHTHOUSE"):
        p.error("--torchft: TORCHFT_LIGHTHOUSE is not set; start a lighthouse (torchft_lighthouse --min_replicas 1 "
                "--bind [::]:29510) and export TORCHFT_LIGHTHOUSE=http://HOST:29510 for every replica group")


# The job's flags that do not run with tensor parallelism (docs/tp.md, "What is refused"): flag -> (its value
# when off, why). Refused by check_tp with one line before anything starts.
TP_REFUSED_FLAGS = {
    "gather_dtype": ("bf16", "compact gathers are not supported with TP parameters"),
    "grad_quant": ("none", "quantized gradient reduction is not supported with TP parameters"),
    "compile": (False, "compile_units() is not supported with TP parameters"),
    "init_from_hf": (None, "the job starts from HF weights at --tp 1 only; start there, save, and resume at --tp N "
                           "(checkpoints reshard across TP degrees)"),
    "torchft": (False, "replica groups under torchft are not combined with TP"),
}


def check_tp(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--tp N and --loss-parallel: the flags TP does not run with refused naming both, the sequence length a
    multiple of N (sequence parallelism splits it). The world size and the model's dims are checked once
    they are known (Setup.prepare, Setup.build)."""
    tp = getattr(args, "tp", 1)
    if tp < 1:
        p.error(f"--tp must be >= 1, got {tp}")
    if tp == 1:
        if getattr(args, "loss_parallel", False):
            p.error("--loss-parallel splits the logits over the TP ranks; it needs --tp N with N > 1")
        return
    for name, (off, why) in TP_REFUSED_FLAGS.items():
        value = getattr(args, name, off)
        if value != off:
            flag = f"--{name.replace('_', '-')}"
            p.error(f"--tp {tp} with {flag}{'' if value is True else ' ' + str(value)}: {why}; drop {flag} or --tp")
    if args.sample_tokens:
        p.error(f"--tp {tp} with --sample-tokens {args.sample_tokens}: sampling runs prompts whose length is not a "
                "multiple of the TP degree (sequence parallelism splits the sequence); use --sample-tokens 0 and sample "
                "from a checkpoint resumed at --tp 1")
    if args.seq_len % tp:
        p.error(f"--tp {tp} with --seq-len {args.seq_len}: sequence parallelism splits each sequence over the TP ranks; "
                f"give a --seq-len that is a multiple of {tp}")


def lr_at(args, step: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warmup, cosine to min, then flat."""
    peak, low = args.lr, args.lr * args.min_lr_ratio
    if args.warmup and step <= args.warmup:
        return peak * step / args.warmup
    if step >= args.decay_steps:
        return low
    t = (step - args.warmup) / max(1, args.decay_steps - args.warmup)
    return low + 0.5 * (peak - low) * (1 + math.cos(math.pi * t))


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    return check_args(p, p.parse_args(argv))


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
