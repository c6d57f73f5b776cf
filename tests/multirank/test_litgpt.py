"""litgpt's own training scripts under ``Fabric(strategy="yafsdp")``, against the same scripts under Fabric's
DDP, gloo at world 2, one spawn. Each run calls the script's ``main(fabric, ...)`` (what its ``setup`` launches)
with a Fabric built here, on a tiny ``litgpt.Config`` (2 layers, uneven widths), a base checkpoint, tokenizer
and JSON data made here:

- ``litgpt.pretrain.main`` (meta init with litgpt's ``reset_parameters`` partials, ``fabric.clip_gradients``,
  ``fabric.save`` of ``{"model", "optimizer", "train_dataloader", "iter_num", ...}``): the logged losses of 4
  steps equal DDP's and the checkpoints it writes (step 2 and final, ``state_dict_type="full"``) hold DDP's keys
  and weights. ``torch.compile(model)`` in ``main`` is made the identity for both runs (the test's time; see
  docs/frameworks.md#litgpt).
- ``litgpt.finetune.full.main``: the base checkpoint loaded through litgpt's ``load_checkpoint``
  (``model.load_state_dict``), 4 steps equal to DDP's (losses, final weights); resumed from the step-2
  checkpoint through litgpt's own ``resume=`` path, its last two losses and final weights equal the
  uninterrupted run's bit for bit.
- ``litgpt.finetune.lora.main``: 2 steps equal to DDP's from a base checkpoint that holds the LoRA weights too
  (under DDP litgpt's ``empty_init`` leaves them unset otherwise); the adapter it saves from
  ``model.state_dict()`` is DDP's, and ``merge_lora`` on it runs; from a plain base checkpoint
  (``strict=False``), the LoRA weights start from ``reset_parameters()`` and train.
- The set-up module's ``state_dict()`` / ``load_state_dict(strict=False)`` directly: missing and unexpected
  keys as ``nn.Module`` reports them, a tied pair loaded from either name, every rank answered; a strict load
  with keys missing, ``keep_vars=True`` and ``assign=True`` refused, nothing changed.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("litgpt", reason="litgpt is not installed (.ci/run installs litgpt==0.5.13 --no-deps)")

from dist_utils import run_ranks  # noqa: E402

LR = 1e-2
TOL = 1e-6  # fp32: the flat AdamW against torch's per-parameter one


def _config(lora: bool = False, **kw):
    from litgpt import Config
    from litgpt.lora import Config as LoRAConfig

    base = dict(name="tiny", block_size=48, vocab_size=80, padded_vocab_size=80, n_layer=2, n_head=4, n_embd=40,
                rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
                mlp_class_name="LLaMAMLP", intermediate_size=44)
    if lora:
        return LoRAConfig(**base, **kw)
    return Config(**base)


LORA = dict(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True, lora_value=True, lora_mlp=True)
LORA_ARGV = ["--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.0", "--lora_mlp", "true"]


def _make_base(d: Path) -> None:
    """A litgpt checkpoint directory: tokenizer, model_config.yaml, lit_model.pth (and one with LoRA weights),
    and JSON instruction data."""
    from litgpt import GPT
    from litgpt.lora import GPT as LoRAGPT
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    d.mkdir(parents=True)
    words = "the quick brown fox jumps over a lazy dog below is an instruction that describes task write response"
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([words] * 4, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    save_config(_config(), d)
    torch.manual_seed(0)
    torch.save(GPT(_config()).state_dict(), d / "lit_model.pth")
    lora_base = d.parent / "lora_base"
    lora_base.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "model_config.yaml"):
        (lora_base / f).write_bytes((d / f).read_bytes())
    torch.manual_seed(0)
    torch.save(LoRAGPT(_config(lora=True, **LORA)).state_dict(), lora_base / "lit_model.pth")
    samples = [{"instruction": f"write the {w} fox", "input": "", "output": f"the {w} quick dog"}
               for w in words.split()[:8]]
    (d.parent / "data").mkdir()
    (d.parent / "data" / "train.json").write_text(json.dumps(samples))
    (d.parent / "data" / "val.json").write_text(json.dumps(samples[:2]))


def _pretrain_data():
    from litgpt.data import DataModule
    from torch.utils.data import DataLoader

    class Blocks(DataModule):
        """Random token blocks, litgpt's pretraining batch shape (max_seq_length + 1)."""

        def connect(self, tokenizer=None, batch_size=1, max_seq_length=None):
            self.batch_size, self.length = batch_size, max_seq_length

        def _loader(self, n, seed):
            g = torch.Generator().manual_seed(seed)
            return DataLoader(torch.randint(0, 80, (n, self.length + 1), generator=g), batch_size=self.batch_size)

        def train_dataloader(self):
            return self._loader(32, 0)

        def val_dataloader(self):
            return self._loader(4, 1)

    return Blocks()


def _fabric(strategy):
    import lightning as L
    from lightning.fabric.loggers import Logger

    class Losses(Logger):
        """The losses litgpt logs, per step."""

        def __init__(self):
            super().__init__()
            self.losses = []

        name = property(lambda self: "losses")
        version = property(lambda self: 0)

        def log_metrics(self, metrics, step=None):
            if "loss" in metrics:
                self.losses.append(float(metrics["loss"]))

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    if strategy != "ddp":
        import yafsdp.lightning as yl

        strategy = yl.YaFSDPFabricStrategy(state_dict_type="full")
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true", loggers=Losses())
    fabric.launch()
    return fabric


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _pretrain(tmp: Path, rank: int) -> dict:
    import unittest.mock

    import litgpt.pretrain as pretrain
    from litgpt.args import EvalArgs, TrainArgs

    sys.argv = ["litgpt", "pretrain", "tiny"]  # what save_hyperparameters() parses
    out = {}
    for strategy in ("ddp", "yafsdp"):
        fabric = _fabric(strategy)
        train = TrainArgs(save_interval=2, log_interval=1, global_batch_size=4, micro_batch_size=2,
                          max_tokens=4 * 2 * 16 * 2, max_seq_length=16, max_norm=0.5, lr_warmup_steps=1,
                          min_lr=1e-3, tie_embeddings=False)
        with unittest.mock.patch.object(torch, "compile", lambda m, *a, **k: m):
            pretrain.main(fabric=fabric, devices=2, seed=42, initial_checkpoint_dir=None, resume=False,
                          config=_config(), data=_pretrain_data(), out_dir=tmp / f"pretrain_{strategy}",
                          tokenizer_dir=None, tokenizer=None, train=train, eval=EvalArgs(interval=100, max_iters=1),
                          optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": LR}})
        out[strategy] = fabric.logger.losses
    if rank == 0:
        for name in ("step-00000002", "final"):
            a, b = (_load(tmp / f"pretrain_{s}" / name / "lit_model.pth") for s in ("ddp", "yafsdp"))
            out[name] = (sorted(a) == sorted(b), _diff(a["model"], b["model"]),
                         (a["iter_num"], a["step_count"]) == (b["iter_num"], b["step_count"]),
                         sorted(b["optimizer"]["state"]) == sorted(b["model"]))
    return out


def _finetune(tmp: Path, rank: int) -> dict:
    import litgpt.finetune.full as full
    import litgpt.finetune.lora as lora
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import JSON

    def args(steps):
        train = TrainArgs(save_interval=2, log_interval=1, global_batch_size=4, micro_batch_size=2, lr_warmup_steps=1,
                          epochs=8, max_steps=steps, max_seq_length=24)
        # eval.interval past the last step: litgpt's generate_example (a forward on rank 0 alone in the LoRA
        # script) is not run
        return train, EvalArgs(interval=100, max_new_tokens=2, max_iters=1)

    base, opt = tmp / "base", {"class_path": "torch.optim.AdamW", "init_args": {"lr": LR}}
    out = {}
    sys.argv = ["litgpt", "finetune_full", str(base)]
    for strategy, steps, resume in (("ddp", 4, False), ("yafsdp", 4, False), ("resumed", 4, True)):
        fabric = _fabric(strategy)
        resume = (tmp / "full_yafsdp" / "step-000002" / "lit_model.pth") if resume else False
        full.main(fabric, 2, resume, 1337, _config(), JSON(tmp / "data", num_workers=0), base, tmp / f"full_{strategy}",
                  *args(steps), opt)
        out[f"full_{strategy}"] = fabric.logger.losses
    if rank == 0:
        w = {s: _load(tmp / f"full_{s}" / "final" / "lit_model.pth")["model"] for s in ("ddp", "yafsdp", "resumed")}
        out["full_weights"] = (_diff(w["ddp"], w["yafsdp"]), _diff(w["yafsdp"], w["resumed"]),
                               _diff(w["yafsdp"], _load(base / "lit_model.pth")))

    sys.argv = ["litgpt", "finetune_lora", str(tmp / "lora_base"), *LORA_ARGV]
    for strategy, ckpt in (("ddp", "lora_base"), ("yafsdp", "lora_base"), ("plain", "base")):
        fabric = _fabric(strategy)
        lora.main(fabric, 2, 1337, _config(lora=True, **LORA), JSON(tmp / "data", num_workers=0), tmp / ckpt,
                  tmp / f"lora_{strategy}", *args(2), opt, 1, "32-true")
        out[f"lora_{strategy}"] = fabric.logger.losses
    if rank == 0:
        a = {s: _load(tmp / f"lora_{s}" / "final" / "lit_model.pth.lora")["model"] for s in ("ddp", "yafsdp", "plain")}
        init = _load(tmp / "lora_base" / "lit_model.pth")
        merged, base_sd = _load(tmp / "lora_plain" / "final" / "lit_model.pth"), _load(base / "lit_model.pth")
        adapted = ("attn.qkv.", "mlp.")  # the layers LORA puts adapters on
        out["lora"] = (_diff(a["ddp"], a["yafsdp"]), sorted(a["plain"]) == sorted(k for k in init if "lora_" in k),
                       min((a["plain"][k] != 0).float().mean().item() for k in a["plain"] if "lora_B" in k),
                       sorted(merged) == sorted(base_sd),
                       all(torch.equal(merged[k], v) for k, v in base_sd.items() if not any(t in k for t in adapted)),
                       all(not torch.equal(merged[k], v) for k, v in base_sd.items() if any(t in k for t in adapted)))
    return out


def _module_state(rank: int) -> dict:
    """The set-up module's own state_dict() / load_state_dict() (what litgpt's load_checkpoint and LoRA save call)."""
    from litgpt import GPT

    fabric = _fabric("yafsdp")
    torch.manual_seed(3)
    gpt = GPT(_config())
    gpt.lm_head.weight = gpt.transformer.wte.weight  # a tied pair
    want = {k: v.clone() for k, v in gpt.state_dict().items()}
    model = fabric.setup(gpt)
    sd = model.state_dict()  # every rank: the unsharded values
    same = sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in want)
    new = torch.full_like(want["lm_head.weight"], 0.5)
    partial = {"lm_head.weight": new, "transformer.ln_f.weight": torch.full_like(want["transformer.ln_f.weight"], 2.0),
               "not.a.key": torch.zeros(1)}
    refused = {}
    for name, call in (("strict", lambda: model.load_state_dict(partial)), ("keep_vars", lambda: model.state_dict(
            keep_vars=True)), ("assign", lambda: model.load_state_dict(partial, strict=False, assign=True))):
        try:
            call()
            refused[name] = None
        except (ValueError, RuntimeError) as e:
            refused[name] = str(e)
    untouched = all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    res = model.load_state_dict(partial, strict=False)
    after = model.state_dict()
    changed = {k for k in want if not torch.equal(after[k], want[k])}
    return {"same": same, "refused": refused, "untouched": untouched,
            "missing": sorted(res.missing_keys), "unexpected": res.unexpected_keys,
            "changed": sorted(changed), "tied": torch.equal(after["transformer.wte.weight"], new),
            "expected_missing": sorted(k for k in want if k not in partial and k != "transformer.wte.weight")}


def _body(rank, world, tmp):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # Lightning: the processes exist already
    tmp = Path(tmp)
    if rank == 0:
        _make_base(tmp / "base")
    torch.distributed.barrier()
    return {"pretrain": _pretrain(tmp, rank), "finetune": _finetune(tmp, rank), "module_state": _module_state(rank)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_body, 2, str(tmp_path_factory.mktemp("litgpt")), timeout_s=120)


def test_pretrain_matches_ddp_and_writes_its_checkpoints(runs):
    for rank, r in enumerate(runs):
        p = r["pretrain"]
        assert len(p["yafsdp"]) == 4 and p["yafsdp"] == pytest.approx(p["ddp"], rel=1e-6, abs=1e-7), p
        if rank == 0:
            for name in ("step-00000002", "final"):
                same_keys, diff, same_counters, optim_by_name = p[name]
                assert same_keys and same_counters and optim_by_name and diff <= TOL, (name, p[name])


def test_full_finetune_matches_ddp_and_resumes_exactly(runs):
    for rank, r in enumerate(runs):
        f = r["finetune"]
        assert len(f["full_yafsdp"]) == 4 and f["full_yafsdp"] == pytest.approx(f["full_ddp"], rel=1e-6, abs=1e-7)
        assert f["full_resumed"] == f["full_yafsdp"][2:], (f["full_resumed"], f["full_yafsdp"])
        if rank == 0:
            to_ddp, to_resumed, trained = f["full_weights"]
            assert to_ddp <= TOL and to_resumed == 0.0 and trained > 1e-3, f["full_weights"]


def test_lora_finetune_matches_ddp_and_saves_the_adapter(runs):
    for rank, r in enumerate(runs):
        f = r["finetune"]
        assert len(f["lora_yafsdp"]) == 2 and f["lora_yafsdp"] == pytest.approx(f["lora_ddp"], rel=1e-6, abs=1e-7)
        assert len(f["lora_plain"]) == 2 and all(l == l and l < 10 for l in f["lora_plain"]), f["lora_plain"]
        if rank == 0:
            to_ddp, adapter_keys, lora_b_nonzero, merged_keys, frozen_kept, adapted_moved = f["lora"]
            assert to_ddp <= TOL and adapter_keys and merged_keys, f["lora"]
            assert lora_b_nonzero > 0.5, f["lora"]  # lora_B starts at zero: it trained
            assert frozen_kept and adapted_moved, f["lora"]  # merge_lora: the base as loaded, plus B @ A


def test_module_state_dict_and_partial_load(runs):
    for r in runs:
        m = r["module_state"]
        assert m["same"] and m["untouched"]
        refused = m["refused"]
        assert "missing keys" in refused["strict"] and "not.a.key" in refused["strict"], refused
        assert "keep_vars=True" in refused["keep_vars"] and "fabric.save" in refused["keep_vars"], refused
        assert "assign=True" in refused["assign"], refused
        assert m["unexpected"] == ["not.a.key"] and m["missing"] == m["expected_missing"], m
        assert m["changed"] == ["lm_head.weight", "transformer.ln_f.weight", "transformer.wte.weight"], m
        assert m["tied"]
