"""The compiled kernels (torch.ops.yafsdp.*) against their pure-PyTorch twins.

Each kernel is checked bit for bit against its twin in yafsdp.kernels on every CPU instruction
set this machine supports (avx512, avx2, scalar), at sizes that leave vector tails and unaligned
heads. CUDA tests run under the `gpu` marker.

Tests that need the extension skip when it is not built, unless YAFSDP_REQUIRE_EXT=1 (CI sets
it after building), which turns the skip into a failure.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from yafsdp import kernels

HAS_EXT = kernels.backend("cpu") == "extension"
REQUIRE_EXT = os.environ.get("YAFSDP_REQUIRE_EXT", "") == "1"
HAS_CUDA_EXT = torch.cuda.is_available() and kernels.backend("cuda") == "extension"

needs_ext = pytest.mark.skipif(
    not HAS_EXT and not REQUIRE_EXT, reason="yafsdp._C is not built: " + kernels.describe()
)

SIZES = [0, 1, 17, 4097]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_extension_present_when_required():
    if REQUIRE_EXT:
        assert HAS_EXT, kernels.describe()
    assert kernels.backend("cpu") in ("extension", "torch")
    assert kernels.describe().startswith("yafsdp kernels:")


def _isas():
    if not HAS_EXT:
        return ["none"]
    from yafsdp import _C

    return _C.supported_cpu_isas()


@pytest.fixture(params=_isas())
def isa(request):
    """Run the test on one CPU instruction set; restore the best one afterwards."""
    if request.param == "none":
        pytest.fail("yafsdp._C is not built") if REQUIRE_EXT else pytest.skip("yafsdp._C is not built")
    from yafsdp import _C

    before = _C.cpu_isa()
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa(before)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Bitwise equality; NaNs only need to be NaN in both (payloads differ between converters)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    nan_a, nan_e = actual.isnan(), expected.isnan()
    assert torch.equal(nan_a, nan_e), f"{what}: NaN positions differ"
    a, e = _bits(actual)[~nan_a], _bits(expected)[~nan_e]
    bad = (a != e).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()} of {a.numel()} elements differ, first at {bad[0].item()}: "
        f"{actual[~nan_a][bad[0]].item()!r} vs {expected[~nan_e][bad[0]].item()!r}"
    )


def _special_fp32(n: int, seed: int) -> torch.Tensor:
    """Random fp32 values over all exponents, plus the cases conversions get wrong."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    special = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 65519.99, 65520.0, 1e30,
         -1e30, 6e-8, 3e-8, 2.98e-8, 1e-45, 1.17549435e-38, 1.0 + 2**-8, 1.0 + 3 * 2**-8,
         1.0 + 2**-11, 1.0 + 3 * 2**-11, 3.4028235e38]
    )
    k = min(n, special.numel())
    x[:k] = special[:k]
    return x


# ---------------------------------------------------------------------------
# cast_
# ---------------------------------------------------------------------------


@needs_ext
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("src_dtype", DTYPES)
def test_cast_matches_twin(isa, n, src_dtype, dst_dtype):
    src = _special_fp32(n, seed=n).to(src_dtype)
    dst = torch.full((n,), 7.0, dtype=dst_dtype)
    expected = kernels.cast_reference(torch.empty_like(dst), src)
    v0 = dst._version
    torch.ops.yafsdp.cast_(dst, src)
    assert_same_bits(dst, expected, f"{isa} {src_dtype}->{dst_dtype} n={n}")
    assert dst._version > v0, "cast_ must bump the version counter of dst"


@needs_ext
@pytest.mark.parametrize("n", [17, 4097])
@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("src_dtype", DTYPES)
def test_cast_scaled_matches_twin(isa, n, src_dtype, dst_dtype):
    """dst = src * (1/3): the product in fp32, one rounding (the engine's fresh grad fold)."""
    src = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(src_dtype)
    dst = torch.empty(n, dtype=dst_dtype)
    kernels.cast_(dst, src, 1 / 3)
    assert_same_bits(dst, kernels.cast_reference(torch.empty_like(dst), src, 1 / 3))
    if dst_dtype == torch.float32 and src_dtype != torch.float32:
        # not torch.mul(src, 1/3, out=dst), which rounds the product to src's dtype first
        assert_same_bits(dst, src.float() * (1 / 3))


@needs_ext
def test_cast_rounding_exhaustive_16bit(isa):
    """Every bf16/fp16 bit pattern to fp32, and 2^20 random fp32 bit patterns to bf16/fp16."""
    all16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for dt in (torch.bfloat16, torch.float16):
        src = all16.view(dt)
        dst = torch.empty(src.numel(), dtype=torch.float32)
        torch.ops.yafsdp.cast_(dst, src)
        assert_same_bits(dst, src.float(), f"{isa} {dt}->fp32")
    bits = torch.randint(-(2**31), 2**31 - 1, (2**20,), generator=torch.Generator().manual_seed(1),
                         dtype=torch.int64).to(torch.int32)
    src = bits.view(torch.float32)
    for dt in (torch.bfloat16, torch.float16):
        dst = torch.empty(src.numel(), dtype=dt)
        torch.ops.yafsdp.cast_(dst, src)
        assert_same_bits(dst, src.to(dt), f"{isa} fp32->{dt}")


@needs_ext
@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float16])
def test_cast_large_unaligned_streaming(dst_dtype):
    """Above 4 MiB of output the kernel uses non-temporal stores after an unaligned head."""
    n = 2**21 + 37
    src = _special_fp32(n + 5, seed=3)[5:]  # src and dst both start off their 64-byte alignment
    dst = torch.empty(n + 3, dtype=dst_dtype)[3:]
    kernels.cast_(dst, src)
    assert_same_bits(dst, src.to(dst_dtype), "streaming cast")


def test_cast_dispatch_falls_back_for_strided():
    """Non-contiguous arguments take the twin (any backend) and give the same result."""
    src = torch.randn(64, 2)[:, 0]
    dst = torch.empty(64, dtype=torch.bfloat16)
    kernels.cast_(dst, src)
    assert_same_bits(dst, src.to(torch.bfloat16))


# ---------------------------------------------------------------------------
# accumulate_
# ---------------------------------------------------------------------------


@needs_ext
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_accumulate_matches_twin(isa, n, src_dtype, scale):
    g = torch.Generator().manual_seed(n)
    dst = torch.randn(n, generator=g)
    src = torch.randn(n, generator=g).to(src_dtype)
    expected = kernels.accumulate_reference(dst.clone(), src, scale)
    v0 = dst._version
    torch.ops.yafsdp.accumulate_(dst, src, scale)
    assert_same_bits(dst, expected, f"{isa} accumulate {src_dtype} n={n} scale={scale}")
    assert dst._version > v0


@needs_ext
def test_accumulate_large():
    n = 2**20 + 3
    dst = torch.randn(n)
    src = torch.randn(n).to(torch.bfloat16)
    expected = kernels.accumulate_reference(dst.clone(), src, 0.25)
    kernels.accumulate_(dst, src, 0.25)
    assert_same_bits(dst, expected, "accumulate 2^20+3")


# ---------------------------------------------------------------------------
# adamw_step_
# ---------------------------------------------------------------------------


def _adamw_inputs(n, grad_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 0.01
    v = torch.rand(n, generator=g) * 1e-3
    grads = [torch.randn(n, generator=g).to(grad_dtype) for _ in range(3)]
    return p, m, v, grads


@needs_ext
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
def test_adamw_matches_twin(isa, n, grad_dtype, out_dtype):
    hyper = dict(beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)
    p, m, v, grads = _adamw_inputs(n, grad_dtype, seed=n)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    out = None if out_dtype is None else torch.full((n,), 3.0, dtype=out_dtype)
    rout = None if out is None else out.clone()
    step = torch.tensor(0.0)
    for k, grad in enumerate(grads):
        step += 1
        lr = 1e-2 / (k + 1)
        kernels.adamw_step_reference(rp, grad, rm, rv, step, lr=lr, copy_out=rout, **hyper)
        versions = (p._version, m._version, v._version)
        torch.ops.yafsdp.adamw_step_(p, grad, m, v, step, lr, hyper["beta1"], hyper["beta2"],
                                     hyper["weight_decay"], hyper["eps"], None, out)
        assert p._version > versions[0] and m._version > versions[1] and v._version > versions[2]
    what = f"{isa} n={n} grad={grad_dtype} out={out_dtype}"
    assert_same_bits(m, rm, what + " exp_avg")
    assert_same_bits(v, rv, what + " exp_avg_sq")
    assert_same_bits(p, rp, what + " param")
    if out is not None:
        assert_same_bits(out, p.to(out_dtype), what + " copy_out")


@needs_ext
def test_adamw_options(isa):
    """lr as a tensor, beta1 < 0.5 (lerp's other branch), no weight decay, step > 1."""
    n = 1000
    for beta1, wd in ((0.3, 0.0), (0.9, 0.0), (0.6, 0.5)):
        p, m, v, grads = _adamw_inputs(n, torch.float32, seed=7)
        rp, rm, rv = p.clone(), m.clone(), v.clone()
        step = torch.tensor(41.0)
        lr = torch.tensor(3e-3)
        hyper = dict(beta1=beta1, beta2=0.999, weight_decay=wd, eps=1e-6)
        kernels.adamw_step_reference(rp, grads[0], rm, rv, step, lr=lr, **hyper)
        torch.ops.yafsdp.adamw_step_(p, grads[0], m, v, step, 0.0, beta1, 0.999, wd, 1e-6, lr, None)
        assert_same_bits(p, rp, f"beta1={beta1} wd={wd}")
        assert_same_bits(m, rm)
        assert_same_bits(v, rv)


@needs_ext
def test_adamw_large_streaming_copy_out():
    n = 2**21 + 37
    p, m, v, grads = _adamw_inputs(n + 1, torch.bfloat16, seed=5)
    p, m, v, grad = p[1:], m[1:], v[1:], grads[0][1:]  # unaligned starts
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    out = torch.empty(n + 1, dtype=torch.bfloat16)[1:]
    step = torch.tensor(1.0)
    hyper = dict(beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)
    kernels.adamw_step_reference(rp, grad, rm, rv, step, lr=1e-3, **hyper)
    assert kernels.adamw_step_(p, grad, m, v, step, lr=1e-3, copy_out=out, **hyper)
    assert_same_bits(p, rp, "param")
    assert_same_bits(out, p.to(torch.bfloat16), "copy_out")


@needs_ext
def test_op_errors_name_the_values():
    p = torch.zeros(8)
    with pytest.raises(RuntimeError, match=r"grad has numel=7 but param has numel=8"):
        torch.ops.yafsdp.adamw_step_(p, torch.zeros(7), torch.zeros(8), torch.zeros(8),
                                     torch.tensor(1.0), 1e-3, 0.9, 0.99, 0.0, 1e-8, None, None)
    with pytest.raises(RuntimeError, match=r"float32 params; param has dtype=BFloat16"):
        b = torch.zeros(8, dtype=torch.bfloat16)
        torch.ops.yafsdp.adamw_step_(b, b, p, p, torch.tensor(1.0), 1e-3, 0.9, 0.99, 0.0, 1e-8,
                                     None, None)
    with pytest.raises(RuntimeError, match=r"src must be contiguous"):
        torch.ops.yafsdp.cast_(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, 2)[:, 0])
    with pytest.raises(RuntimeError, match=r"dtype=Int"):
        torch.ops.yafsdp.cast_(torch.zeros(4, dtype=torch.int32), torch.zeros(4))
    with pytest.raises(RuntimeError, match=r"accumulate_ dst must be float32"):
        torch.ops.yafsdp.accumulate_(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4), 1.0)
    with pytest.raises(RuntimeError, match=r"step must hold one value"):
        torch.ops.yafsdp.adamw_step_(p, p, p.clone(), p.clone(), torch.ones(2), 1e-3, 0.9, 0.99,
                                     0.0, 1e-8, None, None)


@needs_ext
def test_set_cpu_isa_rejects_unknown():
    from yafsdp import _C

    with pytest.raises(ValueError, match="supported"):
        _C.set_cpu_isa("sse9")


# ---------------------------------------------------------------------------
# torch.library.opcheck: schemas, fake (Meta) kernels, autograd registration, torch.compile
# ---------------------------------------------------------------------------


def _opcheck_cases(device):
    n = 37
    g = torch.Generator().manual_seed(0)

    def t(dtype=torch.float32):
        return torch.randn(n, generator=g).to(dtype).to(device)

    step = torch.tensor(3.0, device=device)
    return [
        (torch.ops.yafsdp.adamw_step_.default,
         (t(), t(), t(), t().abs(), step, 1e-3, 0.9, 0.95, 0.1, 1e-8, None, t(torch.bfloat16))),
        (torch.ops.yafsdp.adamw_step_.default,
         (t(), t(torch.bfloat16), t(), t().abs(), step, 0.0, 0.9, 0.95, 0.0, 1e-8,
          torch.tensor(1e-3, device=device), None)),
        (torch.ops.yafsdp.cast_.default, (t(torch.bfloat16), t())),
        (torch.ops.yafsdp.cast_.default, (t(), t(torch.float16), 0.25)),
        (torch.ops.yafsdp.accumulate_.default, (t(), t(torch.bfloat16), 0.5)),
    ]


@needs_ext
@pytest.mark.parametrize("case", range(5))
def test_opcheck(case):
    op, args = _opcheck_cases("cpu")[case]
    torch.library.opcheck(op, args)


# ---------------------------------------------------------------------------
# backend choice: once at import, visible, and a clear error when asked for and missing
# ---------------------------------------------------------------------------


def _hide_extension(monkeypatch):
    """Make `from . import _C` fail, as when the extension was never built."""
    import yafsdp

    for name in ("_C", "_C_cuda"):
        monkeypatch.setitem(sys.modules, f"yafsdp.{name}", None)
        if hasattr(yafsdp, name):
            monkeypatch.delattr(yafsdp, name)


def test_load_without_extension_falls_back(monkeypatch):
    _hide_extension(monkeypatch)
    monkeypatch.delenv("YAFSDP_KERNELS", raising=False)
    cpu, cuda, why, cuda_why = kernels._load()
    assert cpu is None and cuda is None and "yafsdp._C is not built" in why and cuda_why == why
    # What the module then does, as at import without the extension:
    monkeypatch.setattr(kernels, "_C", None)
    monkeypatch.setattr(kernels, "_C_CUDA", None)
    monkeypatch.setattr(kernels, "_WHY_NOT", why)
    monkeypatch.setattr(kernels, "_EXT_DEVICES", frozenset())
    assert kernels.backend("cpu") == "torch" and kernels.backend("cuda") == "torch"
    assert "pure-PyTorch twins" in kernels.describe()
    with pytest.raises(kernels.ExtensionMissingError, match="pip install --no-build-isolation"):
        kernels.require_extension()
    d, s, acc = torch.empty(5, dtype=torch.bfloat16), torch.randn(5), torch.randn(5)
    kernels.cast_(d, s)
    assert_same_bits(d, s.to(torch.bfloat16))
    expected = acc.clone().add_(d.float(), alpha=0.5)
    kernels.accumulate_(acc, d, 0.5)
    assert_same_bits(acc, expected)


def test_explicit_extension_request_fails_when_missing(monkeypatch):
    _hide_extension(monkeypatch)
    monkeypatch.setenv("YAFSDP_KERNELS", "extension")
    with pytest.raises(kernels.ExtensionMissingError, match="pip install --no-build-isolation"):
        kernels._load()


def test_env_forces_twins(monkeypatch):
    monkeypatch.setenv("YAFSDP_KERNELS", "torch")
    assert kernels._load() == (None, None, "YAFSDP_KERNELS=torch", "YAFSDP_KERNELS=torch")
    monkeypatch.setenv("YAFSDP_KERNELS", "fast")
    with pytest.raises(ValueError, match="YAFSDP_KERNELS='fast'"):
        kernels._load()


def test_import_without_extension_end_to_end():
    """A fresh interpreter where yafsdp._C cannot be imported still imports yafsdp and runs."""
    code = (
        "import sys; sys.modules['yafsdp._C'] = None; sys.modules['yafsdp._C_cuda'] = None\n"
        "import torch, yafsdp\n"
        "from yafsdp import kernels\n"
        "d = torch.empty(5, dtype=torch.bfloat16); s = torch.randn(5)\n"
        "kernels.cast_(d, s); assert torch.equal(d, s.bfloat16())\n"
        "print(kernels.backend(), kernels.describe())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "YAFSDP_KERNELS"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("torch yafsdp kernels: pure-PyTorch twins"), r.stdout


# ---------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_extension_built():
    kernels.require_extension("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA_EXT, reason="needs CUDA and yafsdp._C_cuda")
@pytest.mark.parametrize("n", SIZES + [2**20 + 3])
def test_cuda_kernels_match_cpu_kernels(n):
    """The CUDA kernels round exactly like the CPU kernels (same operations, IEEE sqrt/div)."""
    for src_dtype in DTYPES:
        for dst_dtype in DTYPES:
            src = _special_fp32(n, seed=n).to(src_dtype)
            dst = torch.empty(n, dtype=dst_dtype, device="cuda")
            kernels.cast_(dst, src.cuda())
            assert_same_bits(dst.cpu(), src.to(dst_dtype), f"cuda cast {src_dtype}->{dst_dtype}")
            kernels.cast_(dst, src.cuda(), 1 / 3)
            cpu = torch.empty(n, dtype=dst_dtype)
            kernels.cast_(cpu, src, 1 / 3)
            assert_same_bits(dst.cpu(), cpu, f"cuda scaled cast {src_dtype}->{dst_dtype}")
        dst = torch.randn(n)
        dst_cuda = dst.cuda()
        kernels.accumulate_(dst, src, 0.5)
        kernels.accumulate_(dst_cuda, src.cuda(), 0.5)
        assert_same_bits(dst_cuda.cpu(), dst, f"cuda accumulate {src_dtype}")
    hyper = dict(beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)
    for grad_dtype in DTYPES:
        p, m, v, grads = _adamw_inputs(n, grad_dtype, seed=n)
        cp, cm, cv = p.cuda(), m.cuda(), v.cuda()
        out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        step, cstep = torch.tensor(0.0), torch.tensor(0.0, device="cuda")
        lr, clr = torch.tensor(1e-2), torch.tensor(1e-2, device="cuda")  # the same float32 lr
        for grad in grads:
            step += 1
            cstep += 1
            kernels.adamw_step_(p, grad, m, v, step, lr=lr, **hyper)
            assert kernels.adamw_step_(cp, grad.cuda(), cm, cv, cstep, lr=clr, copy_out=out, **hyper)
        for a, b, what in ((cp, p, "param"), (cm, m, "exp_avg"), (cv, v, "exp_avg_sq")):
            assert_same_bits(a.cpu(), b, f"cuda adamw {grad_dtype} n={n} {what}")
        assert_same_bits(out.cpu(), p.to(torch.bfloat16), "cuda copy_out")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA_EXT, reason="needs CUDA and yafsdp._C_cuda")
@pytest.mark.parametrize("case", range(5))
def test_opcheck_cuda(case):
    op, args = _opcheck_cases("cuda")[case]
    torch.library.opcheck(op, args)


def test_extension_lookup_names_the_top_package():
    """The compiled modules sit in ``yafsdp`` beside the ``kernels`` subpackage: looked up as
    ``yafsdp.kernels._C_cuda`` after the layout move, the CUDA kernels were never found on a GPU (every
    CUDA op ran the twins, with only a warning)."""
    spec = kernels.extension_spec("_C")
    assert spec is not None and spec.name == "yafsdp._C"
    assert kernels.extension_spec("_C_does_not_exist") is None
