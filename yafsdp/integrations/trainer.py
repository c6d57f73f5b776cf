"""yafsdp under Hugging Face's ``transformers.Trainer`` and TRL's ``SFTTrainer``, patching nothing.

    model = yafsdp.YaFSDP(peft.get_peft_model(base, lora_config))      # or a full model
    trainer = yafsdp.trainer.YaFSDPTrainer(model=model, args=TrainingArguments(...), train_dataset=ds)
    trainer = yafsdp.trainer.YaFSDPSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds)   # TRL
    trainer.train()                                   # torchrun --nproc-per-node N train.py

[Note: a sharding engine inside Trainer]
accelerate has no registry for a third-party sharding engine: ``prepare()`` wraps any model with
trainable parameters in DDP when the world has several processes, and Trainer reads and writes
checkpoints through ``model.state_dict()``. Neither may happen to a wrapped model: DDP would
broadcast rank 0's flat shards over every rank's own slice (silently one slice everywhere), and
``state_dict()`` of a shard is refused. The Trainer subclass here changes only what has to change,
through Trainer's own overridable methods; accelerate keeps everything else (the data loaders and
their sharding, gradient accumulation, the optimizer wrapper, GradScaler, logging, callbacks):

- the model is marked as already prepared (accelerate's own ``_is_accelerate_prepared`` flag:
  ``prepare()`` returns such a model unchanged), so it is neither wrapped in DDP nor given an
  autocast forward; the engine's ``param_dtype`` is the compute dtype, so ``bf16=True`` /
  ``fp16=True`` must agree with it (refused otherwise, naming both);
- ``get_decay_parameter_names``: Trainer's rule (norms and biases by name) is applied to the
  original parameter names and answered in the wrapper's flat names, so Trainer's own
  ``create_optimizer`` builds the two groups over the flat shards (every optimizer Trainer knows
  and ``optimizer_cls_and_kwargs`` work unchanged). A flat shard mixing both classes is refused
  ([Note: weight decay of flat shards]);
- checkpoints: ``checkpoint-N/`` holds a yafsdp sharded checkpoint (model + optimizer, DCP,
  ``yafsdp.checkpoint``) next to Trainer's own files (trainer_state.json, scheduler, scaler, RNG
  states); ``resume_from_checkpoint`` loads it once the optimizer exists; ``load_best_model_at_end``
  loads the model part;
- ``save_model(dir)`` writes an HF checkpoint (``from_pretrained`` loads it) or, for a PEFT model,
  the adapter in PEFT's format (``PeftModel.from_pretrained``), plus the tokenizer and the args;
- the inner model answers Trainer's introspection (label names, loss kwargs), as it would unwrapped.

``clip_grad_norm_`` (``max_grad_norm``) is accelerate's, which calls torch's on ``model.parameters()``:
the global norm ([Note: shard gradients that know they are shards] in shard_grad.py), as is
GradScaler's inf check. Refused at construction, naming what to do: a model that is not a
``yafsdp.YaFSDP``, an accelerate FSDP or DeepSpeed configuration, ``device_map`` placement,
``torch_compile=True`` (use ``model.compile_units()``), DataParallel (several GPUs in one process).
"""
from __future__ import annotations

import os
import shutil
from datetime import timedelta

import torch
import torch.distributed as dist

from ..wrapper.api import YaFSDP
from ..wrapper.module_methods import has_adapters
from ..engine.ddp_guard import wrapped_twice_message
from ..tools.watchdog import Watchdog

__all__ = ["YaFSDPTrainerMixin", "YaFSDPTrainer", "YaFSDPSFTTrainer", "with_yafsdp", "decay_parameter_names",
           "TrainerSetupError", "check_launch"]


class TrainerSetupError(ValueError):
    """A Trainer configuration that cannot work with a yafsdp-wrapped model."""


# [Note: weight decay of flat shards]
# An optimizer applies weight decay per param group, and each group holds whole flat shards. A
# unit's trainable shard holds its 2-D weights and the small group every 1-D parameter (norm
# weights, biases), so for HF models Trainer's classes (decay: everything but norms and biases)
# fall on whole shards and the grouping is exactly Trainer's on the unsharded model. When a shard
# mixes the classes (a 1-D parameter Trainer decays, say a learned scale named ``gamma``, sits in
# the small group with the norms), no grouping of shards can express it: refused, naming the
# parameters, rather than decaying the norms or not decaying the scale. The mapping stays although an
# optimizer built over the original parameters is now adopted onto the shards ([Note: what a parent
# module sees] in engine/orig_params.py): Trainer builds its groups from ``self.model``'s
# ``named_parameters()``, and the wrapper's own are the flat shards (what clipping, checkpoints and the
# fused path key on); and the mixed-shard refusal here names Trainer's rule and ``weight_decay=0``.
def decay_parameter_names(model: YaFSDP, inner_decay_names, weight_decay: float) -> list[str]:
    """The wrapper's flat shard names (``flat.<unit>``) whose original parameters are all in
    ``inner_decay_names`` (Trainer's rule applied to ``model.module``). Raises TrainerSetupError for a
    shard that mixes decayed and non-decayed parameters when ``weight_decay`` is not 0."""
    decay = set(inner_decay_names)
    out = []
    for info in model.shard_info():
        if info.kind != "trainable":
            continue
        yes = [n for n in info.param_names if n in decay]
        no = [n for n in info.param_names if n not in decay]
        if yes and no and weight_decay != 0:
            raise TrainerSetupError(
                f"yafsdp.trainer: flat shard {info.name!r} (unit {info.unit!r}) holds parameters Trainer decays "
                f"({yes[:3]}) and parameters it does not ({no[:3]}); one shard is one optimizer entry, so one "
                "weight decay. Use weight_decay=0, or build the optimizer yourself (optimizers=(opt, None)), e.g. "
                "over model.param_groups(weight_decay, small_weight_decay)")
        if yes:
            out.append(info.name)
    return out


class YaFSDPTrainerMixin:
    """Mixed in front of ``transformers.Trainer`` or a subclass of it (TRL's trainers): see
    [Note: a sharding engine inside Trainer]."""

    def __init__(self, model=None, args=None, *rest, hang_timeout: float = 120.0, **kwargs):
        check_model(model)
        if not (isinstance(hang_timeout, (int, float)) and 0 < hang_timeout < float("inf")):
            raise TrainerSetupError(f"yafsdp.trainer: hang_timeout must be a finite number of seconds > 0, got "
                                    f"{hang_timeout!r}")
        self._yafsdp_hang_timeout = float(hang_timeout)
        self._yafsdp_watchdog = None
        super().__init__(model, args, *rest, **kwargs)
        self._yafsdp_setup()

    # ------------------------------------------------------------------ under the watchdog
    def train(self, *args, **kwargs):
        """Trainer.train under the watchdog ([Note: the watchdog] in yafsdp/tools/watchdog.py): a rank
        without progress for ``hang_timeout`` seconds after the first step (``TrainingArguments.ddp_timeout``
        before it, also the process group's timeout) is named and every process ends with status 4; an
        exception raised on one rank reaches the others, which end with status 1 instead of waiting in
        their next collective."""
        if dist.is_initialized():  # TrainingArguments.ddp_timeout, also where the script made the group itself
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=self.args.ddp_timeout))
        wd = self._yafsdp_watchdog = Watchdog(timeout=self._yafsdp_hang_timeout,
                                              startup_timeout=float(self.args.ddp_timeout)).start()
        callback = _watchdog_callback(wd)
        self.callback_handler.callbacks.insert(0, callback)  # first: a step is done before any user callback runs
        try:
            return super().train(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - published, then raised on as it was
            if dist.is_initialized() and dist.get_world_size() > 1:
                wd.fail(f"{type(e).__name__}: {e}", 1)
            raise
        finally:
            wd.stop()
            self._yafsdp_watchdog = None
            self.remove_callback(callback)

    def _save_checkpoint(self, *args, **kwargs):
        """A checkpoint's deadline is the longer one of saves (at least 1800 s)."""
        wd = self._yafsdp_watchdog
        if wd is None:
            return super()._save_checkpoint(*args, **kwargs)
        with wd.phase("save", timeout=max(1800.0, self._yafsdp_hang_timeout)):
            return super()._save_checkpoint(*args, **kwargs)

    # ------------------------------------------------------------------------------ set-up
    def _yafsdp_setup(self) -> None:
        model, args = self.model, self.args
        check_model(model)  # a subclass's __init__ may have replaced it
        from accelerate.utils import DistributedType

        dt = self.accelerator.distributed_type
        # See [Note: accelerate's launchers]
        launched = check_launch(dist.get_world_size() if dist.is_initialized() else 1)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled or args.fsdp or args.deepspeed or launched or dt in (
                DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
            dt = launched or dt
            raise TrainerSetupError(
                f"yafsdp.trainer: accelerate is configured for {getattr(dt, 'value', dt)} (an accelerate config file, "
                "ACCELERATE_USE_FSDP/DEEPSPEED, or TrainingArguments fsdp=/deepspeed=); the model is already sharded "
                "by yafsdp. Launch with torchrun, or `accelerate launch` with a multi-GPU/multi-CPU config "
                "(distributed_type MULTI_GPU, with use_cpu: true on CPU; no fsdp_config or deepspeed_config)")
        device_map = getattr(model.module, "hf_device_map", None) or getattr(
            getattr(model.module, "get_base_model", lambda: None)(), "hf_device_map", None)
        if device_map and len(set(map(str, device_map.values()))) > 1:
            raise TrainerSetupError(
                f"yafsdp.trainer: the model was loaded with a device_map over {sorted(set(map(str, device_map.values())))}; "
                "yafsdp shards the whole model over the process group instead. Load it without device_map (on the CPU "
                "or the meta device) and wrap it")
        if args.torch_compile:
            raise TrainerSetupError(
                "yafsdp.trainer: torch_compile=True would compile the whole wrapped model, engine hooks included; call "
                "model.compile_units() after wrapping instead (each unit's modules compiled, the engine outside)")
        if args.n_gpu > 1:
            raise TrainerSetupError(
                f"yafsdp.trainer: {args.n_gpu} GPUs in one process (Trainer would use nn.DataParallel); launch one "
                "process per GPU with torchrun --nproc-per-node N")
        want = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        if want is not None and model.param_dtype != want:
            flag = "bf16" if args.bf16 else "fp16"
            raise TrainerSetupError(
                f"yafsdp.trainer: TrainingArguments {flag}=True but the model was wrapped with "
                f"param_dtype={model.param_dtype}; under yafsdp the compute dtype is param_dtype (no autocast): wrap with "
                f"yafsdp.YaFSDP(model, param_dtype=torch.{str(want).split('.')[-1]})")
        if args.fp16 and getattr(self.accelerator, "scaler", None) is None:
            raise TrainerSetupError(
                f"yafsdp.trainer: fp16=True but accelerate made no GradScaler (it makes none on {args.device.type}); "
                "fp16 gradients without loss scaling underflow. Use bf16 (param_dtype=torch.bfloat16, bf16=True) or "
                "fp32 here")
        if model.param_dtype == torch.float16 and not args.fp16:
            raise TrainerSetupError(
                "yafsdp.trainer: the model computes in float16 (param_dtype) but fp16=False: without Trainer's "
                "GradScaler fp16 gradients underflow. Pass fp16=True (a torch GradScaler) or use bfloat16")
        # See [Note: a sharding engine inside Trainer]: accelerate's prepare() returns it unchanged.
        model._is_accelerate_prepared = True
        if "forward" in model.__dict__:  # TRL patched the wrapper: see [Note: TRL's fused LM head]
            del model.__dict__["forward"]
            install_fused_head(unwrap_peft_model_of(model))
        # Trainer's introspection, as it would answer for the unwrapped model.
        from transformers.trainer_utils import unwrap_peft_model
        from transformers.utils import can_return_loss, find_labels

        inner = unwrap_peft_model(model.module)
        if args.label_names is None:
            self.label_names = find_labels(inner.__class__)
        self.can_return_loss = can_return_loss(inner.__class__)
        if hasattr(inner, "accepts_loss_kwargs"):
            self.model_accepts_loss_kwargs = inner.accepts_loss_kwargs
        else:
            import inspect

            params = inspect.signature(inner.forward).parameters.values()
            self.model_accepts_loss_kwargs = any(p.kind == p.VAR_KEYWORD for p in params)
        if hasattr(self, "_loss_shifts_labels"):  # transformers >= 5.x: how num_items_in_batch counts labels
            from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

            self._loss_shifts_labels = LOSS_MAPPING.get(getattr(inner, "loss_type", None)) is ForCausalLMLoss and not \
                getattr(getattr(inner, "config", None), "is_encoder_decoder", False)

    def _set_signature_columns_if_needed(self) -> None:
        # The columns the model's forward takes (remove_unused_columns): the wrapper's forward is
        # (*args, **kwargs), so let Trainer (or TRL) inspect the wrapped module, as it would unwrapped.
        if self._signature_columns is None:
            model = self.model
            self.model = model.module
            try:
                super()._set_signature_columns_if_needed()
            finally:
                self.model = model

    # ------------------------------------------------------------------------------ optimizer
    def get_decay_parameter_names(self, model) -> list[str]:
        if isinstance(model, YaFSDP):  # See [Note: weight decay of flat shards]
            return decay_parameter_names(model, super().get_decay_parameter_names(model.module),
                                         self.args.weight_decay)
        return super().get_decay_parameter_names(model)

    def _yafsdp_optimizer(self):
        opt = self.optimizer
        return getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps the real one

    # ------------------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        from .. import checkpoint as ckpt

        ckpt.save_checkpoint(output_dir, self.state.global_step, self.model, self._yafsdp_optimizer())
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _yafsdp_checkpoint_in(self, folder: str) -> str:
        from .. import checkpoint as ckpt

        found = ckpt.latest_checkpoint(folder) if os.path.isdir(folder) else None
        if found is None:
            raise TrainerSetupError(
                f"yafsdp.trainer: {folder!r} holds no yafsdp checkpoint (a step_* folder written by YaFSDPTrainer); "
                "a checkpoint of a run without yafsdp (model.safetensors, optimizer.pt) cannot resume a sharded run: "
                "load its weights with yafsdp.hf.load_hf_weights(model, folder) and start a new run")
        return found

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # Called before the optimizer exists: check now, load with the optimizer in
        # _load_optimizer_and_scheduler (one collective load of model and optimizer state).
        self._yafsdp_checkpoint_in(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        from .. import checkpoint as ckpt

        path = self._yafsdp_checkpoint_in(checkpoint)
        ckpt.load_checkpoint(path, self.model, self._yafsdp_optimizer())
        sched = os.path.join(checkpoint, "scheduler.pt")
        if self.lr_scheduler is not None and os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, map_location="cpu", weights_only=True))

    def _load_best_model(self) -> None:
        from .. import checkpoint as ckpt

        best = self.state.best_model_checkpoint
        ckpt.load_checkpoint(self._yafsdp_checkpoint_in(best), self.model)

    # ------------------------------------------------------------------------------ exports
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective. ``_internal_call`` (a checkpoint): the sharded checkpoint is written with the
        optimizer (``_save_optimizer_and_scheduler``); with ``save_only_model`` the model alone here.
        Otherwise ``output_dir`` gets an HF checkpoint, or the PEFT adapter of a PEFT model."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if _internal_call:
            if self.args.save_only_model:
                from .. import checkpoint as ckpt

                ckpt.save_checkpoint(output_dir, self.state.global_step, self.model)
            return
        export(self.model, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        if dist.is_initialized():
            dist.barrier()


def export(model: YaFSDP, output_dir: str) -> None:
    """Collective: ``model``'s HF checkpoint (config.json + model.safetensors), or its PEFT adapter
    (adapter_config.json + adapter_model.safetensors) for a PEFT model, written into ``output_dir``
    (created; files of other names already there are kept, as ``save_pretrained`` does)."""
    from .hf import write_hf

    is_peft = has_adapters(model.module)
    tmp = output_dir.rstrip("/") + ".yafsdp-export"
    if model.coordinator:
        shutil.rmtree(tmp, ignore_errors=True)
    if is_peft:
        model.save_adapter(tmp)  # collective
    else:
        sd = model.full_state_dict()  # collective; rank 0 only
        if model.coordinator:
            write_hf(sd, model.module, tmp)
    if model.coordinator:
        os.makedirs(output_dir, exist_ok=True)
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))
        shutil.rmtree(tmp, ignore_errors=True)


def unwrap_peft_model_of(model: YaFSDP):
    """The causal LM inside the wrapper (under the PEFT model, if any)."""
    from transformers.trainer_utils import unwrap_peft_model

    return unwrap_peft_model(model.module)


# [Note: TRL's fused LM head]
# TRL's SFTTrainer replaces the model's forward by one that, called with ``fused_lm_head=True``,
# runs the backbone and then multiplies the hidden states by ``lm_head.weight`` itself, in chunks,
# without calling the head module. Under yafsdp that read happens outside the head's unit forward,
# where the weight is not gathered (refused, naming it). TRL patches the object it is given, here the
# wrapper; the trainer removes that patch and gives the causal LM inside the same interface with
# the head *called*: the unit is gathered, its gradient reduced as any other. It computes the full
# logits of the batch (what Trainer's own loss does), then the per-token fields SFTTrainer reads:
# log_probs, entropy, is_top1 and label_mask (zero where the label is -100), with TRL's
# temperature 1, logit scale and softcapping.
def install_fused_head(lm) -> None:
    """Give causal LM ``lm`` TRL's ``fused_lm_head=True`` interface, the head called as a module."""
    import types

    from trl.trainer.utils import FusedCausalLMOutput

    original = lm.forward
    cfg = lm.config.get_text_config()
    cap = getattr(cfg, "final_logit_softcapping", None)
    scale = next((v for v in (getattr(cfg, k, None) for k in ("logit_scale", "output_multiplier",
                                                              "lm_head_multiplier")) if v is not None), None)
    if scale is None and getattr(cfg, "logits_scaling", None) is not None:
        scale = cfg.logits_scaling if cfg.model_type == "hyperclovax" else 1 / cfg.logits_scaling
    scale = 1.0 if scale is None else scale

    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            extra = dict(labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
            return original(*args, **kwargs, **{k: v for k, v in extra.items() if v is not None})
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        logits = self.get_output_embeddings()(hidden).float() * scale
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        mask = labels != -100
        logp = torch.log_softmax(logits, dim=-1)
        target = labels.clamp(min=0).unsqueeze(-1)
        log_probs = logp.gather(-1, target).squeeze(-1).masked_fill(~mask, 0)
        entropy = -(logp.exp() * logp).sum(-1).masked_fill(~mask, 0)
        is_top1 = (logits.argmax(-1) == labels) & mask
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy,
                                   is_top1=is_top1, label_mask=mask)

    lm.forward = types.MethodType(forward, lm)


# [Note: accelerate's launchers]
# ``accelerate launch`` starts processes in one of two ways (accelerate 1.15, commands/launch.py). A
# multi-GPU configuration (``distributed_type: MULTI_GPU``, ``--multi_gpu``; with ``use_cpu: true`` on a
# machine without GPUs) goes through torchrun: ``num_processes`` processes with RANK / WORLD_SIZE set.
# Every other one -- ``distributed_type: MULTI_CPU`` included -- goes through the "simple launcher",
# which starts exactly one process (under ``mpirun`` only when ``mpirun_hostfile`` is set: MULTI_CPU is
# accelerate's MPI mode, one ``accelerate launch`` per rank otherwise). With ``num_processes`` above 1 it
# still exports MASTER_ADDR / MASTER_PORT, and ACCELERATE_USE_CPU marks its processes; a script that then
# starts a process group of one trains at world 1 with the others never started. And an FSDP or
# DeepSpeed configuration reaches the process only as ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED:
# on the CPU accelerate's state then reports MULTI_CPU (or NO), not FSDP. Both are read from the
# environment here, where the launcher left them.
_ENGINE_ENV = {"ACCELERATE_USE_FSDP": "FSDP", "ACCELERATE_USE_DEEPSPEED": "DEEPSPEED",
               "ACCELERATE_USE_MEGATRON_LM": "MEGATRON_LM"}
_MPI_SIZE = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "WORLD_SIZE")


def check_launch(world_size: int, environ=None) -> str | None:
    """Which sharding engine accelerate's launcher asked for through the environment ("FSDP",
    "DEEPSPEED", "MEGATRON_LM"; the trainer refuses it), else None. Raises TrainerSetupError when
    accelerate's simple launcher was asked for several processes but this process group has one
    ([Note: accelerate's launchers])."""
    env = os.environ if environ is None else environ
    for key, name in _ENGINE_ENV.items():
        if env.get(key, "false").lower() == "true":
            return name
    several = "ACCELERATE_USE_CPU" in env and "MASTER_ADDR" in env and not any(
        int(env.get(k, "1") or 1) > 1 for k in _MPI_SIZE)
    if world_size == 1 and several:
        raise TrainerSetupError(
            "yafsdp.trainer: accelerate's launcher was asked for several processes (MASTER_ADDR is set with "
            "ACCELERATE_USE_CPU: a distributed_type MULTI_CPU config or --cpu with num_processes > 1), but it "
            "starts one process for such a config (MULTI_CPU is its MPI mode: one process per `accelerate launch`, "
            "or mpirun with mpirun_hostfile), and this run's process group has world size 1. Launch with "
            "torchrun --nproc-per-node N, or accelerate launch --multi_gpu --num_processes N (a config with "
            "distributed_type: MULTI_GPU and use_cpu: true on CPU)")
    return None


def check_model(model) -> None:
    """Refuse a model these trainers cannot train: not a ``yafsdp.YaFSDP``, or wrapped again."""
    if isinstance(model, YaFSDP):
        return
    # The engine's own check and words (DistributedDataParallel's constructor refuses the same way):
    # see [Note: DDP around a sharded model] in engine/ddp_guard.py.
    if isinstance(model, torch.nn.Module) and any(isinstance(m, YaFSDP) for m in model.modules()):
        raise TrainerSetupError(
            wrapped_twice_message(f"the model passed to the trainer is a {type(model).__name__}") +
            ". Pass the yafsdp.YaFSDP model itself")
    raise TrainerSetupError(
        f"yafsdp.trainer: the model is a {type(model).__name__}, not a yafsdp.YaFSDP model; wrap it first: "
        "model = yafsdp.YaFSDP(model, param_dtype=...) (a PEFT model: wrap peft.get_peft_model(base, config)). "
        "Passing a model name or a peft_config to the trainer is not supported: the trainer would build an "
        "unsharded model")


_CLASSES: dict = {}


def with_yafsdp(trainer_cls):
    """``trainer_cls`` (``transformers.Trainer`` or a subclass: TRL's SFTTrainer, ...) with the
    mixin in front; one class per ``trainer_cls``."""
    if trainer_cls not in _CLASSES:
        _CLASSES[trainer_cls] = type(f"YaFSDP{trainer_cls.__name__}", (YaFSDPTrainerMixin, trainer_cls),
                                     {"__module__": __name__, "__doc__": YaFSDPTrainerMixin.__doc__})
    return _CLASSES[trainer_cls]


def __getattr__(name):  # the classes are built on first use: transformers / trl are imported only then
    if name == "YaFSDPTrainer":
        from transformers import Trainer

        return with_yafsdp(Trainer)
    if name == "YaFSDPSFTTrainer":
        from trl import SFTTrainer

        return with_yafsdp(SFTTrainer)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _watchdog_callback(wd):
    """A TrainerCallback marking the watchdog's steps and phases (made here: transformers is imported on
    first use only)."""
    from transformers import TrainerCallback

    class WatchdogCallback(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            wd.set_phase("train")

        def on_step_end(self, args, state, control, **kw):
            wd.step(state.global_step)

        def on_evaluate(self, args, state, control, **kw):
            wd.progress()

    return WatchdogCallback()
