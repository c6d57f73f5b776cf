"""yafsdp.FusedAdamW against torch.optim.AdamW: trajectories, state_dict interop, the engine's
copy-out contract, and the engine training identically with either optimizer.

torch's CPU sqrt is not correctly rounded (MKL) while the kernel's is, so exp_avg and exp_avg_sq
match torch bit for bit and the params within a few ulps (PARAM_TOL); against the twin with an
exact sqrt (yafsdp.kernels.adamw_step_reference) the params match bit for bit.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from yafsdp import kernels, shards
from yafsdp.optim.adamw import FusedAdamW

HAS_EXT = kernels.backend("cpu") == "extension"
needs_ext = pytest.mark.skipif(
    not HAS_EXT and os.environ.get("YAFSDP_REQUIRE_EXT", "") != "1",
    reason="yafsdp._C is not built: " + kernels.describe(),
)
PARAM_TOL = dict(rtol=2e-6, atol=2e-6)  # a few ulps at |p| ~ 1 after 20 steps of lr 1e-2
STEPS = 20


def _grads(shape, dtype, steps, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(steps)]


def _set_grad(p: torch.Tensor, grad: torch.Tensor) -> None:
    if grad.dtype != p.dtype:
        p.grad_dtype = None  # allow a bf16 gradient on an fp32 parameter (like a YaFSDP grad shard)
    p.grad = grad.clone()


@pytest.mark.parametrize("n", [0, 1, 17, 4097])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_adamw(n, weight_decay, grad_dtype):
    torch.manual_seed(n)
    init = torch.randn(n)
    ours, ref = nn.Parameter(init.clone()), nn.Parameter(init.clone())
    twin = init.clone()
    twin_m, twin_v, twin_step = torch.zeros(n), torch.zeros(n), torch.tensor(0.0)
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    opt = FusedAdamW([ours], **hyper)
    ref_opt = torch.optim.AdamW([ref], foreach=False, **hyper)
    for grad in _grads(n, grad_dtype, STEPS, seed=n + 1):
        _set_grad(ours, grad)
        ref.grad = grad.float()
        opt.step()
        ref_opt.step()
        twin_step += 1
        kernels.adamw_step_reference(twin, grad, twin_m, twin_v, twin_step, lr=1e-2, beta1=0.9,
                                     beta2=0.95, weight_decay=weight_decay, eps=1e-8)
    st, ref_st = opt.state[ours], ref_opt.state[ref]
    assert st["step"].item() == ref_st["step"].item() == STEPS
    assert torch.equal(st["exp_avg"], ref_st["exp_avg"])
    assert torch.equal(st["exp_avg_sq"], ref_st["exp_avg_sq"])
    torch.testing.assert_close(ours.detach(), ref.detach(), **PARAM_TOL)
    if HAS_EXT:
        assert torch.equal(ours.detach(), twin), "the kernel must match its exact twin bit for bit"
    if n:
        assert (ours.detach() - init).abs().max() > 1e-4  # it trained


def test_large_shard_with_copy_out():
    """2^20+3 elements, a compute copy: the copy-out equals param.to(bf16) after every step."""
    n = 2**20 + 3
    torch.manual_seed(0)
    init = torch.randn(n)
    ours, ref = nn.Parameter(init.clone()), nn.Parameter(init.clone())
    copy = torch.empty(n, dtype=torch.bfloat16)
    written = []
    shards.set_copy_out(ours, copy, lambda: written.append(ours._version))
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt, ref_opt = FusedAdamW([ours], **hyper), torch.optim.AdamW([ref], foreach=False, **hyper)
    for k, grad in enumerate(_grads(n, torch.float32, STEPS, seed=1)):
        ours.grad, ref.grad = grad, grad
        opt.step()
        ref_opt.step()
        assert torch.equal(copy, ours.detach().to(torch.bfloat16)), f"step {k}"
        assert written[-1] == ours._version  # recorded after the update, nothing changed since
    assert len(written) == STEPS
    assert torch.equal(opt.state[ours]["exp_avg_sq"], ref_opt.state[ref]["exp_avg_sq"])
    torch.testing.assert_close(ours.detach(), ref.detach(), **PARAM_TOL)
    v = ours._version
    with torch.no_grad():
        ours.mul_(2)
    assert ours._version > v  # a later in-place change is visible to the engine


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(17, 33), nn.LayerNorm(33), nn.GELU(), nn.Linear(33, 5))


def _groups(model, lr_scale=1.0):
    a, norm, _, b = model
    return [
        dict(params=[a.weight, b.weight], lr=1e-2 * lr_scale, weight_decay=0.1),
        dict(params=[a.bias, b.bias], lr=3e-3 * lr_scale, betas=(0.8, 0.99), weight_decay=0.0),
        dict(params=list(norm.parameters()), eps=1e-6, weight_decay=0.5),
    ]


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 17, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def test_param_groups_with_different_options():
    ours, ref = _model(), _model()
    opt = FusedAdamW(_groups(ours), lr=5e-3, betas=(0.9, 0.95))
    ref_opt = torch.optim.AdamW(_groups(ref), lr=5e-3, betas=(0.9, 0.95), foreach=False)
    _train(ours, opt, STEPS, seed=1)
    _train(ref, ref_opt, STEPS, seed=1)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **PARAM_TOL, msg=name)
        # the params' ulp differences feed back through the gradients: states are close, not equal
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"],
                                   rtol=1e-4, atol=0.0, msg=name)
    assert [g["betas"] for g in opt.param_groups] == [(0.9, 0.95), (0.8, 0.99), (0.9, 0.95)]


@pytest.mark.parametrize("direction", ["torch_to_fused", "fused_to_torch"])
def test_state_dict_round_trip(direction):
    """Train 5 steps with one optimizer, load its state_dict into the other, train 5 more: the
    trajectory equals training 10 steps with the first one alone."""
    first_cls, second_cls = (
        (torch.optim.AdamW, FusedAdamW) if direction == "torch_to_fused" else (FusedAdamW, torch.optim.AdamW)
    )
    kw = lambda cls: dict(foreach=False) if cls is torch.optim.AdamW else {}  # noqa: E731
    whole, a, b = _model(), _model(), _model()
    opt_whole = first_cls(_groups(whole), **kw(first_cls))
    opt_a = first_cls(_groups(a), **kw(first_cls))
    _train(whole, opt_whole, 10, seed=3)
    _train(a, opt_a, 5, seed=3)
    sd = opt_a.state_dict()
    b.load_state_dict(a.state_dict())
    opt_b = second_cls(_groups(b, lr_scale=7.0), **kw(second_cls))  # options come from the checkpoint
    opt_b.load_state_dict(sd)
    for g, h in zip(opt_b.param_groups, opt_a.param_groups):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in h.items() if k != "params"}
    for p in b.parameters():
        step = opt_b.state[p]["step"]
        assert torch.is_tensor(step) and step.item() == 5.0
        if second_cls is FusedAdamW:
            assert step.dtype == torch.float32 and step.device == p.device
    # continue with the same batches as the second half of the 10-step run
    g = torch.Generator().manual_seed(3)
    for k in range(10):
        x = torch.randn(8, 17, generator=g)
        if k < 5:
            continue
        opt_b.zero_grad()
        b(x).square().mean().backward()
        opt_b.step()
    for (name, p), q in zip(b.named_parameters(), whole.parameters()):
        torch.testing.assert_close(p, q, **PARAM_TOL, msg=name)
    assert set(opt_b.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_state_dict_format_matches_torch():
    ours, ref = _model(), _model()
    opt, ref_opt = FusedAdamW(_groups(ours)), torch.optim.AdamW(_groups(ref))
    _train(ours, opt, 1, seed=0)
    _train(ref, ref_opt, 1, seed=0)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert [set(g) for g in sd["param_groups"]] == [set(g) for g in ref_sd["param_groups"]]
    assert sd["param_groups"] == ref_sd["param_groups"]
    assert sd["state"].keys() == ref_sd["state"].keys()
    for k, st in sd["state"].items():
        assert st.keys() == ref_sd["state"][k].keys()
        assert st["step"].dtype == ref_sd["state"][k]["step"].dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(amsgrad=True), "amsgrad"),
        (dict(maximize=True), "maximize"),
        (dict(differentiable=True), "differentiable"),
        (dict(lr=-1.0), "learning rate"),
        (dict(betas=(1.0, 0.9)), "beta parameter at index 0"),
        (dict(lr=torch.tensor([1e-3, 1e-3])), "1-element"),
    ],
)
def test_unsupported_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedAdamW([nn.Parameter(torch.zeros(3))], **kwargs)


def test_bad_parameters_raise():
    half = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    half.grad = torch.zeros(4, dtype=torch.float16)
    with pytest.raises(TypeError, match="float32 parameters; got dtype=torch.float16"):
        FusedAdamW([half]).step()
    strided = nn.Parameter(torch.zeros(4, 3).t())
    strided.grad = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"contiguous parameters; got shape=\(3, 4\) strides=\(1, 3\)"):
        FusedAdamW([strided]).step()
    p = nn.Parameter(torch.zeros(4))
    p.grad = torch.zeros(4)
    shards.set_copy_out(p, torch.zeros(5, dtype=torch.bfloat16), lambda: None)
    with pytest.raises(ValueError, match=r"p.numel\(\)=4 elements .* numel=5"):
        FusedAdamW([p]).step()


def test_fused_true_requires_extension(monkeypatch):
    monkeypatch.setattr(kernels, "_EXT_DEVICES", frozenset())
    monkeypatch.setattr(kernels, "_C", None)
    monkeypatch.setattr(kernels, "_WHY_NOT", "yafsdp._C is not built (test)")
    with pytest.raises(kernels.ExtensionMissingError, match="pip install --no-build-isolation"):
        FusedAdamW([nn.Parameter(torch.zeros(3))], fused=True)
    # fused=None falls back to the twin, says so (with the build command), and still trains like torch.
    ours, ref = _model(), _model()
    opt, ref_opt = FusedAdamW(ours.parameters()), torch.optim.AdamW(ref.parameters(), foreach=False)
    with pytest.warns(RuntimeWarning, match="pure-PyTorch fallback.*is not built \\(test\\).*fused=False"):
        _train(ours, opt, 5, seed=2)
    _train(ref, ref_opt, 5, seed=2)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **PARAM_TOL)


def test_fused_false_uses_twin_and_tensor_lr():
    a, b, c = _model(), _model(), _model()
    opt_a = FusedAdamW(a.parameters(), lr=torch.tensor(3e-3))
    opt_b = FusedAdamW(b.parameters(), lr=float(torch.tensor(3e-3)))  # the same float32 value
    opt_c = FusedAdamW(c.parameters(), lr=float(torch.tensor(3e-3)), fused=False)
    for m, o in ((a, opt_a), (b, opt_b), (c, opt_c)):
        _train(m, o, 5, seed=4)
    for p, q, r in zip(a.parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q)
        torch.testing.assert_close(r, p, **PARAM_TOL)


# ---------------------------------------------------------------------------
# The engine trains identically with FusedAdamW and with torch.optim.AdamW
# ---------------------------------------------------------------------------

# fp32 (no compute copy), and bf16 with the copy-out under ZeRO-3 and ZeRO-2 + accumulation.
# The cost is the spawn and imports; a case adds ~0.2 s.
ENGINE_CASES = ["llama_z3", "llama_bf16_z3_tied", "llama_bf16_z2_accum3"]


def _fused_factory(params):
    import parity

    return FusedAdamW(params, lr=parity.LR, weight_decay=0.1)


def _train_both(rank, world, names):
    """On each rank: the parity harness with torch's AdamW, then with FusedAdamW, counting the
    engine's cast passes (the fused kernel's copy-out should replace all but the first)."""
    import parity

    import yafsdp.kernels as k

    calls = {"n": 0}
    cast = k.cast_

    def counting_cast(dst, src, scale=1.0):
        if dst.dtype != torch.float32:  # the cast pass into a compute copy (folds write fp32 grads)
            calls["n"] += 1
        return cast(dst, src, scale)

    k.cast_ = counting_cast
    out = {}
    for label, factory in (("torch", None), ("fused", _fused_factory)):
        for name in names:
            calls["n"] = 0
            result = parity.train_sharded(rank, world, [name], optimizer_factory=factory)[name]
            out[(label, name)] = (*result, calls["n"])
    return out


def test_engine_trains_identically_with_fused_adamw():
    from dist_utils import run_ranks
    import parity

    out = run_ranks(_train_both, 2, ENGINE_CASES)[0]
    for name in ENGINE_CASES:
        t_losses, t_norms, t_sd, t_casts = out[("torch", name)]
        f_losses, f_norms, f_sd, f_casts = out[("fused", name)]
        assert parity.rel_seq(f_losses, t_losses) < 1e-6, (name, f_losses, t_losses)
        assert parity.rel_seq(f_norms, t_norms) < 1e-6, (name, f_norms, t_norms)
        assert parity.rel_l2(f_sd, t_sd) < 1e-6, name
        print(name, "fused vs torch:", parity.rel_seq(f_losses, t_losses), parity.rel_l2(f_sd, t_sd))
        if parity.CASES[name].get("dtype") is None:
            assert parity.rel_l2(f_sd, parity.train_reference(name, 2)[2]) < 1e-4, name
            assert t_casts == f_casts == 0, (name, t_casts, f_casts)  # fp32: no compute copy
        else:
            # torch's AdamW: the engine casts each step; FusedAdamW: only before the first step.
            assert t_casts == parity.STEPS and f_casts == 1, (name, t_casts, f_casts)


# ---------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_torch_and_never_syncs():
    ours, ref = _model().cuda(), _model().cuda()
    w = ours[0].weight
    w_copy = torch.empty(w.numel(), dtype=torch.bfloat16, device="cuda")
    shards.set_copy_out(w, w_copy, lambda: None)
    opt = FusedAdamW(_groups(ours), lr=torch.tensor(5e-3, device="cuda"))
    ref_opt = torch.optim.AdamW(_groups(ref), lr=5e-3, foreach=False)
    g = torch.Generator().manual_seed(0)
    for k in range(STEPS):
        x = torch.randn(8, 17, generator=g).cuda()
        for m, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
        ref_opt.step()
        if k == 0:
            opt.step()  # state initialisation
            continue
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
        assert opt.state[p]["step"].device == p.device
    assert torch.equal(w_copy, w.detach().reshape(-1).to(torch.bfloat16))
    assert kernels.backend("cuda") == "extension", kernels.describe()


# ------------------------------------------------------------------ the fallback on accelerators
class _CountSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts host reads of tensor values (``.item()``, ``float(t)``: aten._local_scalar_dense),
    which on CUDA are host synchronisations."""

    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("lr_tensor", [False, True])
def test_fallback_with_device_scalars_reads_nothing_on_the_host(lr_tensor):
    """The twin as it runs for CUDA parameters (step and lr as tensors where the parameter is):
    no value is read on the host, and the trajectory is torch's AdamW within a few ulps."""
    p0 = torch.randn(257)
    ref = p0.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    p, m, v = p0.clone(), torch.zeros(257), torch.zeros(257)
    copy = torch.empty(257, dtype=torch.bfloat16)
    step = torch.zeros(())
    lr = torch.tensor(1e-2) if lr_tensor else 1e-2
    mode = _CountSyncs()
    for g in _grads(257, torch.float32, 5, seed=3):
        ref.grad = g.clone()
        opt.step()
        step += 1
        with mode:
            kernels.adamw_step_reference(p, g, m, v, step, lr=lr, beta1=0.9, beta2=0.95, weight_decay=0.1,
                                         eps=1e-8, copy_out=copy, exact=False, host_scalars=False)
    assert mode.syncs == 0
    torch.testing.assert_close(p, ref.detach(), **PARAM_TOL)
    assert torch.equal(copy, p.to(torch.bfloat16))
    with mode:  # the host path (CPU tensors) does read them: the counter can see it
        kernels.adamw_step_reference(p, g, m, v, step, lr=lr, beta1=0.9, beta2=0.95, weight_decay=0.1,
                                     eps=1e-8, exact=False, host_scalars=True)
    assert mode.syncs >= 1


def test_fallback_warns_once_when_the_kernels_were_expected(monkeypatch):
    """A device whose compiled kernels are missing (a mis-built GPU machine) runs the twin with a
    RuntimeWarning naming the reason, once per optimizer and device; fused=False chooses the twin
    silently."""
    import warnings

    monkeypatch.setattr(kernels, "_EXT_DEVICES", frozenset())
    monkeypatch.setattr(kernels, "_TWINS_CHOSEN", False)
    p = nn.Parameter(torch.randn(17))
    opt = FusedAdamW([p], lr=1e-3)
    p.grad = torch.randn(17)
    with pytest.warns(RuntimeWarning, match=r"cpu parameters run the pure-PyTorch fallback.*no yafsdp kernels"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # said once
        FusedAdamW([p], lr=1e-3, fused=False).step()  # chosen: silent
    monkeypatch.setattr(kernels, "_EXT_DEVICES", frozenset(["cpu"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FusedAdamW([p], lr=1e-3).step()  # the kernels serve the device: silent


def test_optimizers_that_are_not_elementwise_are_known_by_name():
    """yafsdp/optim/guard.py: the classes refused over flat shards (by name in the MRO, the families' variants
    included), and names that only look alike left alone."""
    from yafsdp.optim.guard import _not_elementwise

    def named(name, base=object):
        return type(name, (base,), {})()

    for name in ("Adafactor", "LBFGS", "Muon", "FusedLAMB", "LAMB8bit", "PagedLARS", "GaLoreAdamW8bit", "SOAP",
                 "DistributedShampoo"):
        assert _not_elementwise(named(name)), name
    assert _not_elementwise(named("MyAdafactor", type("Adafactor", (), {})))  # a subclass of one
    for name in ("AdamW", "SGD", "Lion", "LambdaOptimizer", "Larsen", "FusedAdamW", "Adam8bit"):
        assert _not_elementwise(named(name)) is None, name
