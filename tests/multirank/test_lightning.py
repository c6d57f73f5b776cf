"""``strategy="yafsdp"`` (yafsdp.lightning) in Lightning's Trainer and Fabric, against Lightning's own
DDP on the unsharded model, gloo at world 2, one spawn:

- Trainer: losses, per-parameter gradient norms (before clipping) and weights equal DDP's over 4 steps
  with ``gradient_clip_val``, and with ``accumulate_grad_batches=2``; ModelSummary counts the unsharded model; a checkpoint written in the
  middle of the run (``trainer.save_checkpoint`` at step 2, "full" and "sharded") resumed with
  ``fit(ckpt_path=...)`` continues exactly as the uninterrupted run (a checkpoint saved after a fit that
  ``max_steps`` stopped does not, under Lightning's DDP either: the loops restart the epoch);
  ``strategy="ddp"`` around a model wrapped in ``configure_model`` is refused naming yafsdp and the
  setting; ``precision="16-true"`` and a disagreeing ``param_dtype`` are refused naming both;
  ``trainer.init_module(empty_init=True)`` gives ``reset_parameters()``'s values;
  ``"bf16-true"`` wraps with ``param_dtype=torch.bfloat16`` over fp32 shards.
- Fabric: the same parity with ``fabric.clip_gradients``; ``fabric.save`` / ``fabric.load`` (sharded
  and full) resume exactly; ``fabric.load_raw`` of an unsharded state dict; ``init_module(empty_init=True)``
  gives ``reset_parameters()``'s values; ``Fabric(strategy="ddp")`` around a wrapped model is refused
  and leaves the shards untouched.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lightning")

from dist_utils import run_ranks  # noqa: E402
from models import Stack  # noqa: E402

STEPS = 4
CLIP = 0.05  # small enough that every step clips
LR = 1e-2


def _data():
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(16, 7, generator=g), torch.randn(16, 5, generator=g))
    # 4 per rank per step (Lightning adds the DistributedSampler): an epoch is 2 steps
    return DataLoader(ds, batch_size=4)


def _lm_class():
    import lightning.pytorch as pl

    import yafsdp

    class LM(pl.LightningModule):
        def __init__(self, wrap_in_configure=False):
            super().__init__()
            self.wrap_in_configure = wrap_in_configure
            if not wrap_in_configure:
                self.model = Stack(seed=1)
            self.losses, self.norms = [], []

        def configure_model(self):
            if self.wrap_in_configure and not hasattr(self, "model"):
                self.model = yafsdp.YaFSDP(Stack(seed=1))

        def training_step(self, batch, i):
            loss = self.model(batch[0], batch[1])
            self.losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer):
            if isinstance(self.model, yafsdp.YaFSDP):
                norms = {k: v.item() for k, v in self.model.named_grad_norms().items()}
            else:
                norms = {k: p.grad.norm().item() for k, p in self.model.named_parameters()}
            self.norms.append(norms)

        def configure_optimizers(self):  # the LightningModule's own parameters() once: originals and shards
            params = self.parameters() if self.wrap_in_configure else self.model.parameters()
            return torch.optim.AdamW(params, lr=LR)

    return LM


def _trainer(strategy, steps, **kw):
    import lightning.pytorch as pl

    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, gradient_clip_val=CLIP, **kw)


def _weights(lm):
    import yafsdp

    m = lm.model
    sd = m.full_state_dict() if isinstance(m, yafsdp.YaFSDP) else m.state_dict()
    return {k: v.detach().clone() for k, v in sd.items()}


def _refused(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the message is what is asserted
        return f"{type(e).__name__}: {e}"
    return "not refused"


def _reset_reference(seed: int) -> dict:
    """The unsharded Stack's state dict after every module's reset_parameters() from ``seed``, in
    ``nn.Module.apply``'s order (what the strategy runs on a meta-built model after wrapping)."""
    ref = Stack(seed=1)
    torch.manual_seed(seed)
    ref.apply(lambda m: m.reset_parameters() if any(True for _ in m.parameters(recurse=False)) else None)
    return ref.state_dict()


def _trainer_cases(rank, tmp):
    import yafsdp
    import yafsdp.lightning as yl
    from lightning.pytorch.callbacks import ModelSummary

    LM = _lm_class()
    out = {}
    # parity with Lightning DDP on the unsharded model (gradient clipping every step)
    ddp = LM()
    _trainer("ddp", STEPS).fit(ddp, _data())
    import lightning.pytorch as pl

    class SaveAt2(pl.Callback):  # a checkpoint in the middle of the run (as ModelCheckpoint writes one)
        def __init__(self, path):
            self.path = path

        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                trainer.save_checkpoint(self.path)

    for kind in ("full", "sharded"):  # each run: parity with DDP, and a checkpoint at step 2
        path = os.path.join(tmp, f"{kind}.ckpt")
        ours = LM()
        tr = _trainer(yl.YaFSDPStrategy(state_dict_type=kind), STEPS, callbacks=[SaveAt2(path)])
        tr.fit(ours, _data())
        out[f"yafsdp_{kind}"] = (ours.losses, ours.norms, _weights(ours))
        out[f"is_dir_{kind}"] = os.path.isdir(path)
        resumed = LM()
        _trainer(yl.YaFSDPStrategy(state_dict_type=kind), STEPS).fit(resumed, _data(), ckpt_path=path)
        out[f"resume_{kind}"] = (ours.losses[:2] + resumed.losses, _weights(resumed))
    out["ddp"] = (ddp.losses, ddp.norms, _weights(ddp))
    out["yafsdp"] = out["yafsdp_full"]
    summary = next(cb for cb in tr.callbacks if isinstance(cb, ModelSummary))._summary(tr, ours)
    out["summary"] = (summary.total_parameters, summary.trainable_parameters, summary.param_nums)
    out["numel"] = sum(p.numel() for p in Stack().parameters())

    # gradient accumulation over 2 micro-batches
    acc = {}
    for strat in ("ddp", "yafsdp"):
        lm = LM()
        _trainer(strat, 2, accumulate_grad_batches=2).fit(lm, _data())
        acc[strat] = (lm.losses, _weights(lm))
    out["accumulate"] = acc

    # model wrapped in configure_model: strategy="ddp" refused by DDP's constructor; "yafsdp" trains
    wrapped = LM(wrap_in_configure=True)
    out["ddp_around"] = _refused(lambda: _trainer("ddp", 1).fit(wrapped, _data()))
    wrapped = LM(wrap_in_configure=True)
    _trainer("yafsdp", STEPS).fit(wrapped, _data())
    out["configure_model"] = wrapped.losses
    out["fp16_true"] = _refused(lambda: _trainer("yafsdp", 1, precision="16-true").fit(LM(), _data()))
    out["dtype_clash"] = _refused(lambda: _trainer(yl.YaFSDPStrategy(param_dtype=torch.float32), 1,
                                                   precision="bf16-true").fit(LM(), _data()))
    # trainer.init_module(empty_init=True): built on meta, reset_parameters() after wrapping
    tr = _trainer("yafsdp", 0)
    with tr.init_module(empty_init=True):
        meta = LM()
    out["trainer_meta_built"] = meta.model.inp.weight.is_meta
    torch.manual_seed(5)
    tr.fit(meta, _data())
    expect = _reset_reference(5)
    full = meta.model.full_state_dict()
    out["trainer_meta_init"] = rank != 0 or all(torch.equal(full[k], v) for k, v in expect.items())
    bf16 = LM()
    _trainer("yafsdp", 1, precision="bf16-true").fit(bf16, _data())
    out["bf16"] = (bf16.model.param_dtype, {p.dtype for p in bf16.model.parameters()}, bf16.losses)
    return out


def _fabric(strategy, **kw):
    import lightning.fabric as lf

    return lf.Fabric(accelerator="cpu", devices=2, strategy=strategy, **kw)


def _fabric_steps(fabric, model, opt, steps, start=0, clip=True):
    import yafsdp

    g = torch.Generator().manual_seed(3)
    losses, norms = [], []
    for step in range(steps):
        x, y = torch.randn(8, 7, generator=g), torch.randn(8, 5, generator=g)
        if step < start:
            continue
        mine = slice(4 * fabric.global_rank, 4 * fabric.global_rank + 4)
        x, y = x[mine], y[mine]
        opt.zero_grad()
        loss = model(x, y)
        fabric.backward(loss)
        if clip:
            norms.append(fabric.clip_gradients(model, opt, max_norm=CLIP).item())
        opt.step()
        losses.append(loss.item())
    inner = model._forward_module if hasattr(model, "_forward_module") else model
    inner = getattr(inner, "module", inner) if not isinstance(inner, yafsdp.YaFSDP) else inner  # DDP's
    sd = inner.full_state_dict() if isinstance(inner, yafsdp.YaFSDP) else inner.state_dict()
    return losses, norms, {k: v.detach().clone() for k, v in sd.items()}


def _fabric_cases(rank, tmp):
    import yafsdp
    import yafsdp.lightning as yl

    out = {}
    f = _fabric("ddp")
    f.launch()
    ref = f.setup_module(Stack(seed=1))
    out["ddp"] = _fabric_steps(f, ref, f.setup_optimizers(torch.optim.AdamW(ref.parameters(), lr=LR)), STEPS)

    # DDP (Fabric's strategy="ddp") around a wrapped model: refused, shards untouched
    wrapped = yafsdp.YaFSDP(Stack(seed=1))
    before = [p.detach().clone() for p in wrapped.parameters()]
    out["fabric_ddp_around"] = _refused(lambda: f.setup_module(wrapped))
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(before, wrapped.parameters()))

    f = _fabric("yafsdp")
    f.launch()
    model = f.setup_module(Stack(seed=1))
    opt = f.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    out["yafsdp"] = _fabric_steps(f, model, opt, STEPS)
    orig = model._original_module
    out["split_groups"] = _refused(lambda: f.setup_optimizers(torch.optim.AdamW(
        [{"params": list(model._forward_module.parameters())}, {"params": [orig.inp.weight], "weight_decay": 0.0}])))
    out["setup_both"] = _refused(lambda: f.setup(Stack(), torch.optim.SGD(Stack().parameters(), lr=0.1)))

    for kind in ("sharded", "full"):
        f = _fabric(yl.YaFSDPFabricStrategy(state_dict_type=kind))
        f.launch()
        model = f.setup_module(Stack(seed=1))
        opt = f.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
        head = _fabric_steps(f, model, opt, 2)
        path = os.path.join(tmp, f"fabric_{kind}")
        f.save(path, {"model": model, "optimizer": opt, "step": 2})
        model2 = f.setup_module(Stack(seed=5))
        opt2 = f.setup_optimizers(torch.optim.AdamW(model2.parameters(), lr=LR))
        state = {"model": model2, "optimizer": opt2, "step": 0}
        f.load(path, state)
        tail = _fabric_steps(f, model2, opt2, STEPS, start=2)
        out[f"resume_{kind}"] = (head[0] + tail[0], tail[2], state["step"])

    # load_raw of an unsharded state dict; meta init with reset_parameters
    f = _fabric("yafsdp")
    f.launch()
    plain = Stack(seed=9).state_dict()
    raw_path = os.path.join(tmp, "raw.pt")
    if rank == 0:
        torch.save(plain, raw_path)
    f.barrier()
    model = f.setup_module(Stack(seed=1))
    f.load_raw(raw_path, model)
    full = model._forward_module.full_state_dict()
    out["load_raw"] = rank != 0 or all(torch.equal(full[k], v) for k, v in plain.items())
    with f.init_module(empty_init=True):
        meta = Stack(seed=1)
    out["meta_built"] = meta.inp.weight.is_meta
    torch.manual_seed(11)
    model = f.setup_module(meta)
    expect = _reset_reference(11)
    full = model._forward_module.full_state_dict()
    out["meta_init"] = rank != 0 or all(torch.equal(full[k], v) for k, v in expect.items())
    return out


def _body(rank, world, tmp):
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # Lightning: the processes exist already
    return {"trainer": _trainer_cases(rank, tmp), "fabric": _fabric_cases(rank, tmp)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_body, 2, str(tmp_path_factory.mktemp("lightning")))


def _same_weights(a: dict, b: dict, tol: float = 1e-6) -> float:
    assert a.keys() == b.keys()
    d = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert d <= tol, d
    return d


def test_trainer_matches_ddp_with_clipping_and_summary(runs):
    for rank, r in enumerate(runs):
        t = r["trainer"]
        (l_ddp, n_ddp, w_ddp), (l_us, n_us, w_us) = t["ddp"], t["yafsdp"]
        assert len(l_us) == STEPS and l_us == pytest.approx(l_ddp, rel=1e-6, abs=1e-7)
        for a, b in zip(n_ddp, n_us):
            assert a.keys() == b.keys() and all(b[k] == pytest.approx(a[k], rel=1e-5) for k in a)
        assert max(sum(v ** 2 for v in n.values()) ** 0.5 for n in n_us) > CLIP  # the clipping ran
        if rank == 0:  # full_state_dict() is rank 0's
            _same_weights(w_ddp, w_us)
        total, trainable, per_layer = t["summary"]
        assert total == trainable == t["numel"] and per_layer == [t["numel"]], t["summary"]
        assert t["configure_model"] == pytest.approx(l_ddp, rel=1e-6, abs=1e-7)
        assert t["yafsdp_sharded"][0] == l_us


def test_trainer_accumulation_matches_ddp(runs):
    for rank, r in enumerate(runs):
        acc = r["trainer"]["accumulate"]
        assert len(acc["yafsdp"][0]) == 4 and acc["yafsdp"][0] == pytest.approx(acc["ddp"][0], rel=1e-6, abs=1e-7)
        if rank == 0:
            _same_weights(acc["ddp"][1], acc["yafsdp"][1])


def test_trainer_resumes_exactly(runs):
    for rank, r in enumerate(runs):
        t = r["trainer"]
        for kind in ("full", "sharded"):
            losses, weights = t[f"resume_{kind}"]
            assert losses == t["yafsdp"][0], (kind, losses, t["yafsdp"][0])
            if rank == 0:
                _same_weights(weights, t["yafsdp"][2], tol=0.0)
        assert t["is_dir_sharded"] and not t["is_dir_full"]


def test_trainer_refusals_and_bf16(runs):
    t = runs[0]["trainer"]
    assert "WrappedTwiceError" in t["ddp_around"] and 'strategy="yafsdp"' in t["ddp_around"], t["ddp_around"]
    assert "16-true" in t["fp16_true"] and "bf16-mixed" in t["fp16_true"], t["fp16_true"]
    assert "param_dtype=torch.float32" in t["dtype_clash"] and "torch.bfloat16" in t["dtype_clash"], t["dtype_clash"]
    assert t["trainer_meta_built"] and t["trainer_meta_init"]
    dtype, shard_dtypes, losses = t["bf16"]
    assert dtype == torch.bfloat16 and shard_dtypes == {torch.float32} and len(losses) == 1


def test_fabric_matches_ddp_saves_loads_and_inits(runs):
    for rank, r in enumerate(runs):
        f = r["fabric"]
        (l_ddp, n_ddp, w_ddp), (l_us, n_us, w_us) = f["ddp"], f["yafsdp"]
        assert l_us == pytest.approx(l_ddp, rel=1e-6, abs=1e-7)
        assert n_us == pytest.approx(n_ddp, rel=1e-5) and min(n_us) > CLIP
        if rank == 0:
            _same_weights(w_ddp, w_us)
        assert "WrappedTwiceError" in f["fabric_ddp_around"] and 'strategy="yafsdp"' in f["fabric_ddp_around"]
        assert f["untouched"]
        assert "setup_module" in f["setup_both"]
        assert "'inp.weight'" in f["split_groups"] and "param_groups(weight_decay)" in f["split_groups"]
        for kind in ("sharded", "full"):
            losses, weights, step = f[f"resume_{kind}"]
            assert losses == l_us, (kind, losses, l_us)
            if rank == 0:
                _same_weights(weights, w_us, tol=0.0)
            assert step == 2
        assert f["load_raw"] and f["meta_built"] and f["meta_init"]
