"""The job's stages before training (``Setup``, the base of ``pretrain.job.Job``): check the world and
the run directory, read the data, build and wrap the model and its optimizer, load its weights from a
checkpoint, a Hugging Face checkpoint or the seeded init. Nothing is written to ``--out`` here (but
the lock, and a --rewind's setting aside)."""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import yafsdp
from pretrain import data as D
from pretrain import progress as P
from pretrain import stream as S
from pretrain import rundir as R
from pretrain.ckpt_auto import job_checkpointing
from pretrain.ops import JobError, agree, hsdp_mesh
from pretrain.presets import model_config_dict
from pretrain.saving import set_rng_state
from yafsdp import checkpoint as C

SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "tie_word_embeddings")


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
        limit = getattr(cfg, "max_position_embeddings", None)
        if limit and args.seq_len > limit:
            raise JobError(f"--seq-len {args.seq_len} exceeds max_position_embeddings {limit} of "
                           f"{os.path.join(args.init_from_hf, 'config.json')!r}: the model was not trained on positions "
                           f"past {limit}. Use --seq-len {limit} or less; for deliberate RoPE scaling, set rope_scaling "
                           "and max_position_embeddings in that config.json first")
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


@dataclass(frozen=True)
class BatchShape:
    """One optimizer step's batch, fixed by the flags and the world size: ``per_rank`` windows of
    ``seq_len`` tokens in each of ``accum`` micro-batches on each of ``ranks`` ranks."""

    per_rank: int  # --batch-size
    ranks: int  # the world size
    accum: int  # --grad-accum
    seq_len: int  # --seq-len (a window holds seq_len + 1 tokens: inputs and targets)

    @property
    def sequences(self) -> int:
        """The global batch: windows per optimizer step (the data cursor's advance)."""
        return self.per_rank * self.ranks * self.accum

    @property
    def tokens(self) -> int:
        """Tokens trained on per optimizer step."""
        return self.sequences * self.seq_len


class Setup:
    """The stages before training: ``prepare`` (nothing built yet), ``build``, ``initialise``. A job
    built on this one overrides the hooks that differ (``load_data``, ``make_model``,
    ``wrap_options``, ``init_weights``, ...; see examples/finetune_lora.py)."""

    def prepare(self):
        a = self.args
        if self.world % a.hsdp:  # the same verdict on every rank: they all stop together
            raise JobError(f"--hsdp {a.hsdp} does not divide the world size {self.world}: HSDP needs {a.hsdp} "
                           f"replicas of equal size; launch a multiple of {a.hsdp} ranks (e.g. --hsdp = the number "
                           "of nodes) or pick --hsdp among the divisors of the world size")
        tp = getattr(a, "tp", 1)
        if tp > 1 and self.world % (a.hsdp * tp):
            raise JobError(f"--tp {tp}{f' with --hsdp {a.hsdp}' if a.hsdp > 1 else ''} does not divide the world size "
                           f"{self.world}: the ranks form a (data parallel, TP) mesh of groups of {tp} consecutive ranks; "
                           f"launch a multiple of {a.hsdp * tp} ranks or pick --tp among the divisors of the world size")
        self.run_dir.take_lock()  # before --out is read, also a new one: see [Note: one line per run directory]
        self.run_dir.make_plan(a, self.env)
        err = None
        try:
            self.tokenizer = D.make_tokenizer(a.tokenizer)
            self.shape, self.config = model_config(a, self.tokenizer)
            self.load_data()
            self.settings = R.run_settings(a, self.batch.ranks, self.batches, self.config, self.model_settings())
            self.manifest = None
            self.changes = {}
            if self.plan.resume_path:
                self.manifest = C.read_manifest(self.plan.resume_path)
                self.check_resumable(self.manifest.get("meta", {}))
        except (JobError, D.DataError, C.CheckpointError) as e:
            err = str(e)
        except Exception as e:  # noqa: BLE001 - unexpected: still stop every rank together
            traceback.print_exc()
            err = f"rank {self.rank}: {type(e).__name__}: {e}"
        agree(err)
        if self.plan.resume_path:  # every file's size and checksum, before building anything
            try:
                C.verify_checkpoint(self.plan.resume_path)
            except C.CheckpointError as e:
                raise JobError(f"{e}; nothing was changed. Delete that checkpoint to fall back to an older one, "
                               f"or pass --resume PATH --rewind") from None
        if self.plan.rewind:
            self.run_dir.rewind()

    @property
    def plan(self) -> R.RunPlan:
        """What the job does with --out: a fresh start, a resume, a rewind (``RunDir.make_plan``)."""
        return self.run_dir.plan

    def check_resumable(self, meta: dict, saved_settings: dict | None = None) -> None:
        """The checkpoint fits this run: the model's shapes (else refused), and the settings that
        decide the data stream or the model unless --allow-change accepts them (``self.changes``;
        see [Note: settings a resume keeps]). Not checked when nothing will be trained."""
        saved = meta.get("model_shape")
        if saved is not None and saved != self.shape:
            diff = ", ".join(f"{k} {saved.get(k)} (checkpoint) vs {self.shape.get(k)} (this run)"
                             for k in SHAPE_KEYS if saved.get(k) != self.shape.get(k))
            raise JobError(
                f"checkpoint {self.plan.resume_path!r} was written for a different model: {diff}; "
                f"resume with the --preset/--tokenizer/--init-from-hf of the run that wrote it "
                f"(it was: {meta.get('preset_args', '?')})"
            )
        saved_settings = saved_settings if saved_settings is not None else meta.get("settings")
        step = self.manifest.get("step", 0) if self.manifest else 0
        if saved_settings and not self.args.export_only and step < self.args.steps:
            self.changes = R.check_settings(saved_settings, self.settings, self.args.allowed_changes,
                                            self.plan.resume_path)

    def model_settings(self) -> dict:
        """What a derived job adds to the ``model`` setting a resume keeps (see [Note: settings a
        resume keeps]); here nothing beyond the architecture."""
        return {}

    def load_data(self):
        """``self.corpus``, the training windows ``self.batches`` and the held-out ``self.val``
        (None if the data is too short to hold any out). Streamed sources: see pretrain/stream.py."""
        a = self.args
        kind = S.stream_kind(a.data, a.stream)
        if kind == "text":
            return self.load_stream()
        if kind == "bins":
            tokens = S.bin_shards(a.data, a.data_dtype)
            corpus = D.Corpus(tokens, f"{a.data} ({len(tokens.paths)} .bin shards, {len(tokens):,} {a.data_dtype} ids, "
                                      "read by window)", -1)
        else:
            corpus = D.load_corpus(a.data, self.tokenizer, text_key=a.text_key, bin_dtype=a.data_dtype)
        if a.val_data or a.val_split:
            train, val = corpus.tokens, self.load_val_tokens()
        else:
            train, val = D.split(corpus.tokens, a.val_fraction, a.seq_len)
            if val is not None and len(val) > 4_000_000:  # a large corpus: a fixed-size validation tail
                n = len(corpus.tokens)
                train, val = corpus.tokens[:n - 4_000_000], corpus.tokens[n - 4_000_000:]
        self.corpus = corpus
        self.batches = D.Batches(train, a.seq_len, a.seed, source=f"--data {a.data!r}" if a.data else "the corpus",
                                 vocab=self.shape["vocab_size"])
        self.val = D.Batches(val, a.seq_len, a.seed + 1, source=f"--val-data {a.val_data!r}",
                             vocab=self.shape["vocab_size"]) if val is not None else None
        head = np.asarray(corpus.tokens[: 1 << 20])
        if head.size and int(head.max()) >= self.shape["vocab_size"]:
            raise JobError(f"--data holds token id {int(head.max())}, but the model has "
                           f"{self.shape['vocab_size']} embeddings (wrong --tokenizer or --data-dtype?)")

    def load_val_tokens(self):
        """--val-data of a non-streamed training source, read whole (a folder of .bin shards mapped)."""
        a = self.args
        if a.val_split:
            raise D.DataError(f"--val-split needs streamed --data (a dataset name or a parquet/arrow/csv folder); "
                              f"for {a.data or 'the embedded corpus'!r} use --val-data FILE or --val-fraction")
        if S.stream_kind(a.val_data, a.stream) == "text":
            raise D.DataError(f"--val-data {a.val_data!r} is streamed data; the training data is read whole: "
                              "prepare both as .bin (examples/prepare_data.py) or stream both")
        if S.stream_kind(a.val_data) == "bins":
            return S.bin_shards(a.val_data, a.data_dtype)
        return D.load_corpus(a.val_data, self.tokenizer, text_key=a.text_key, bin_dtype=a.data_dtype).tokens

    def load_stream(self):
        """Streamed rows (see [Note: streamed positions]): this rank's stream, checked at start by
        reading its first window (a bad file, column or token stops every rank before --out is
        written)."""
        a = self.args
        if getattr(a, "tp", 1) > 1:
            raise JobError(f"--tp {a.tp} with streamed --data {a.data!r}: a streamed position is kept per rank, not per "
                           "data-parallel rank; prepare the data as .bin (examples/prepare_data.py) or read it whole "
                           "(a .txt/.jsonl file without --stream)")
        if getattr(a, "torchft", False):
            raise JobError(f"--torchft with streamed --data {a.data!r}: a restarted replica group cannot take a "
                           "streamed position from another group; prepare the data as .bin (examples/prepare_data.py) "
                           "or read it whole (a .txt/.jsonl file without --stream)")
        vocab = self.shape["vocab_size"]
        shards, desc = S.text_shards(a.data, a.text_key, a.data_split)
        train = S.TextStream(shards, self.tokenizer, a.seq_len, self.rank, self.world, vocab)
        ident = dict(data=a.data, split=a.data_split, column=a.text_key, shards=[sh.name for sh in shards],
                     tokenizer=getattr(self.tokenizer, "name", "bytes"))
        self.batches = S.StreamBatches(train, desc, ident)
        self.corpus = D.Corpus(np.zeros(0, dtype=np.int64), desc, -1)
        self.val = None
        if a.val_data or a.val_split:
            vdata, vsplit = (a.val_data, a.data_split) if a.val_data else (a.data, a.val_split)
            if S.stream_kind(vdata, True) != "text":
                raise D.DataError(f"--val-data {vdata!r}: streamed training data takes streamed validation data "
                                  "(a parquet/arrow/csv/jsonl file or folder, or a dataset name)")
            vshards, vdesc = S.text_shards(vdata, a.text_key, vsplit)
            vstream = S.TextStream(vshards, self.tokenizer, a.seq_len, self.rank, self.world, vocab)
            self.val = S.StreamBatches(vstream, vdesc, {}, fixed=True)
        S.check_shards(train)
        train.peek()  # the first window: errors in the first rows now, not after --out is written

    def close_data(self) -> None:
        """Stop the streamed data's background readers (and wait for them) before the process ends;
        see ``TextStream.close``. Nothing to do for a corpus in memory or a memory-mapped file."""
        for b in (getattr(self, "batches", None), getattr(self, "val", None)):
            if isinstance(b, S.StreamBatches):
                b.close()

    def describe_data(self) -> str:
        """The header's data line."""
        tok = "bytes" if isinstance(self.tokenizer, D.ByteTokenizer) else self.tokenizer.name
        if isinstance(self.batches, S.StreamBatches):
            st = self.batches.stream
            val = f"val {self.val.description}" if self.val else \
                "no validation (pass --val-data or --val-split)"
            return (f"{self.batches.description}: streamed, tokenized on the fly ({tok}), each rank reads its part "
                    f"(by {st.mode}); windows of {self.args.seq_len}; {val}")
        ntr = len(self.batches.tokens)
        nval = len(self.val.tokens) if self.val else 0
        vsrc = f" (--val-data {self.args.val_data})" if self.args.val_data and self.val else ""
        return (f"{self.corpus.source}: {len(self.corpus.tokens):,} tokens ({tok}); {ntr:,} train / "
                f"{nval:,} val{vsrc}; {self.batches.windows:,} windows of {self.args.seq_len}")

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
        if a.gather_dtype != "bf16":  # See [Note: gather formats] in yafsdp/formats/base.py
            options["gather_dtype"] = a.gather_dtype
        if a.grad_quant != "none":  # See [Note: quantized gradient reduction] in yafsdp/comm/quant_reduce.py
            options.update(grad_quant=a.grad_quant, grad_quant_node=a.grad_quant_node)
        # The engine's options, checked as YaFSDP(...) and the plan check them (yafsdp/layout/config.py),
        # before the model is built.
        config = yafsdp.build_config(param_dtype=self.param_dtype, zero_stage=a.zero_stage, **options)
        model = self.make_model()
        if a.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        self.n_params = sum(p.numel() for p in model.parameters())
        c = self.shape  # the step's FLOPs and the device's peak, for MFU ([Note: model FLOPs utilisation])
        self.flops_per_token = P.flops_per_token(self.n_params, c["vocab_size"] * c["hidden_size"],
                                                 c["num_hidden_layers"], c["hidden_size"], a.seq_len)
        self.peak, self.peak_from = P.peak_tflops(self.device, bf16, a.peak_tflops)
        if getattr(a, "tp", 1) > 1:  # torch's TP on mesh["tp"], then the engine on the data-parallel dims (docs/tp.md)
            mesh = tp_mesh(model, a.tp, a.hsdp, self.world, self.device, a.loss_parallel)
        else:
            mesh = hsdp_mesh(a.hsdp, self.world, self.device)
        self.model = yafsdp.YaFSDP(model, config=config, device=self.device, **mesh)
        self.ckpt_choice = job_checkpointing(self)  # --checkpointing / --memory-budget (docs/activation_checkpointing.md)
        if a.compile:
            self.model.compile_units()
        self.opt, self.opt_name = make_optimizer(self.model, a, self.device)
        if getattr(a, "torchft", False):  # this torchrun is one replica group ([Note: the job under torchft])
            from pretrain.torchft_groups import ReplicaGroups

            self.ft = ReplicaGroups(self)

    def initialise(self):
        """Weights and state: from a checkpoint, a HF checkpoint, or the seeded init."""
        a, m = self.args, self.model
        self.step, self.cursor, self.tokens_seen, self.elapsed_before = 0, 0, 0, 0.0
        self.resumed_from = self.data_resume = None
        if self.plan.resume_path:
            # the flags decide the optimizer's options (weight decay, betas, eps: free to change on a resume), the
            # checkpoint its state: load_checkpoint restores the saved groups' options, as torch's load_state_dict
            flags = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
            try:
                loaded = C.load_checkpoint(self.plan.resume_path, m, self.opt, verify=False)
            except C.CheckpointError as e:
                raise JobError(str(e)) from None
            for group, options in zip(self.opt.param_groups, flags):
                group.update(options)
            st = loaded.state
            if "settings" not in loaded.meta:  # written before settings were recorded: what its state holds
                self.check_resumable({}, {k: st[k] for k in ("seq_len", "seed") if k in st})
            self.step, self.cursor = int(st["step"]), int(st["cursor"])
            self.restore_data(st)
            self.tokens_seen, self.elapsed_before = int(st.get("tokens", 0)), float(st.get("elapsed", 0.0))
            self.resumed_from = (loaded.path, loaded.saved_world_size, st.get("global_batch"))
            if getattr(self, "guard", None) is not None:  # the loss-spike guard's history ([Note: loss spikes])
                self.guard.recent = [float(x) for x in st.get("loss_history", [])]
            set_rng_state(loaded.rank_state, a.seed, self.rank, self.step, self.device)
            self.init_desc = (f"resumed from {loaded.path} (step {self.step}, written by {loaded.saved_world_size} "
                              f"rank(s), loaded by {self.world})")
        else:
            self.init_weights()
        if self.ft is not None:  # torchft's step is the job's
            self.ft.resumed(loaded.state if self.plan.resume_path else None, self.step)

    def restore_data(self, st: dict) -> None:
        """A streamed loader continues from the positions in the checkpoint's state (see
        [Note: streamed positions]); the cursor is the whole position of the other sources, in the
        window order the checkpoint names (see [Note: window order])."""
        self.data_resume = None
        if isinstance(self.batches, S.StreamBatches):
            if "stream" not in st:
                raise JobError(f"checkpoint {self.plan.resume_path!r} holds no streamed-data position (it was "
                               "written by a run over non-streamed data); resume with that run's --data")
            self.data_resume = f"streamed position restored: {self.batches.stream.restore(st['stream'])}"
            return
        try:
            order = D.order_of_state(st, self.plan.resume_path)
        except D.DataError as e:
            raise JobError(str(e)) from None
        if order != self.batches.order:
            for b in (self.batches, self.val):
                if b is not None:
                    b.use_order(order)
            self.data_resume = (f"window order {order!r} kept from the checkpoint (the run began before the order "
                                f"was named; it holds one int64 per window in memory: {self.batches.windows:,} windows)")

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
            self.init_desc = f"weights from {a.init_from_hf} (each rank read only its shards' slices)"
        else:
            from yafsdp.init import init_shards_, normal_init

            init_shards_(m, normal_init(getattr(self.config, "initializer_range", 0.02)), seed=a.seed)
            set_rng_state(None, a.seed, self.rank, 0, self.device)
            self.init_desc = f"seeded init (seed {a.seed}; the same for any world size)"


def tp_mesh(model, tp: int, replicas: int, world: int, device, loss_parallel: bool) -> dict:
    """--tp N: a (world / N, N) mesh named ('dp', 'tp') -- with --hsdp R (R, world / (R N), N) named ('replicate',
    'shard', 'tp') --, yafsdp's Llama plan (sequence parallel) applied to ``model`` on mesh["tp"]; YaFSDP's mesh
    argument (the data-parallel dims). torchrun numbers the ranks node by node, so a TP group of N = the GPUs of a
    node is one node."""
    from torch.distributed.device_mesh import init_device_mesh

    from yafsdp.integrations.tp_plans import llama_tp_local_shapes, parallelize_llama

    try:
        llama_tp_local_shapes(model, tp)  # the head counts and the MLP width split over TP: refused by name
    except ValueError as e:
        raise JobError(f"--tp {tp}: {e}") from None
    if replicas > 1:
        mesh = init_device_mesh(device.type, (replicas, world // (replicas * tp), tp),
                                mesh_dim_names=("replicate", "shard", "tp"))
        dp = mesh["replicate", "shard"]
    else:
        mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
    parallelize_llama(model, mesh["tp"], sequence_parallel=True, loss_parallel=loss_parallel)  # re-ties a tied head
    return dict(mesh=dp)


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
            from yafsdp.optim.adamw import FusedAdamW as fused_cls  # noqa: N813
        except Exception:  # noqa: BLE001 - not built / not there: fall back below
            fused_cls = None
    if fused_cls is not None:
        return fused_cls(groups, **kw), "yafsdp.FusedAdamW"
    try:
        return torch.optim.AdamW(groups, fused=True, **kw), "torch.optim.AdamW(fused)"
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(groups, foreach=True, **kw), "torch.optim.AdamW(foreach)"
