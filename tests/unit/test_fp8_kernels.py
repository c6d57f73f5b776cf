"""FP8 gather records, kernels: the C++ CPU kernels (every instruction set) equal their pure-PyTorch
twins bit for bit, and the twins' codes equal torch's own ``float8_e4m3fn`` cast of the scaled values
(saturation, rounding ties, subnormals, zero blocks). See [Note: FP8 gather records] in csrc/common.h."""
import os

import pytest
import torch

from yafsdp.formats import fp8_codec as fp8

from yafsdp import kernels

HAS_EXT = kernels.backend("cpu") == "extension"
REQUIRE_EXT = os.environ.get("YAFSDP_REQUIRE_EXT", "") == "1"
HAS_CUDA_EXT = torch.cuda.is_available() and kernels.backend("cuda") == "extension"
needs_ext = pytest.mark.skipif(not HAS_EXT and not REQUIRE_EXT, reason="yafsdp._C is not built: " + kernels.describe())
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _values(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g) * 0.02
    v[:128] = 0  # a zero block (padding): scale 0, codes 0, expands to +0
    v[128:256] = torch.randn(128, generator=g) * 1e-30  # tiny values: subnormal codes in their block
    v[256] = 7.0  # an outlier sets its block's scale; the rest of the block lands on subnormals
    v[384:512] = torch.linspace(-3, 3, 128)
    v[512:640] = -v[512:640].abs()  # an all-negative block (amax from the negative side)
    return v


def _isas():
    if not HAS_EXT:
        return [None]
    from yafsdp import _C

    return _C.supported_cpu_isas()


def test_twin_codes_are_torchs_e4m3_cast():
    """The twin's codes are torch's float8_e4m3fn cast of clamp(x / scale) and its scales amax / 448;
    the dequantized values are within e4m3's half-ulp of the input."""
    x = _values(4096)
    codes, scales = fp8.quantize(x)
    blocks = x.view(-1, 128)
    s = blocks.abs().amax(1) / 448.0
    assert torch.equal(bits(scales), bits(s))
    scaled = torch.where(s[:, None] == 0, 0.0, blocks / s[:, None]).clamp(-448, 448)
    assert torch.equal(codes, scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1))
    assert (codes[:128] == 0).all()
    back = fp8.dequantize(codes, scales, torch.float32)
    err = (back - x).abs().view(-1, 128)
    assert (err <= blocks.abs().amax(1, keepdim=True) / 448 * 16).all()  # <= half an e4m3 ulp at 448 (32)
    assert back.view(-1, 128).abs().amax(1).sub(blocks.abs().amax(1)).abs().max() <= 1e-6  # amax maps to 448


@needs_ext
@pytest.mark.parametrize("isa", _isas())
def test_quantize_kernel_equals_twin_and_every_code(isa):
    from yafsdp import _C

    before = _C.cpu_isa()
    _C.set_cpu_isa(isa)
    try:
        x = _values(128 * 300, seed=1)
        # every finite e4m3 value times a scale of 1 (a block whose amax is 448), and each midpoint
        # between neighbours (ties round to even), and values past 448 within the block (saturate)
        levels = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        pos = levels[:127].sort().values  # 0 .. 448
        mids = (pos[1:] + pos[:-1]) / 2
        x[640:640 + 127] = pos
        x[640 + 127] = -448.0
        x[768:768 + 126] = mids
        x[768 + 126:768 + 128] = torch.tensor([448.0, -448.0])
        got = torch.full((fp8.record_bytes(x.numel()),), 0xAB, dtype=torch.uint8)
        want = torch.zeros_like(got)
        kernels.fp8_quantize_(got, x)
        kernels.fp8_quantize_reference(want, x)
        assert torch.equal(got, want)
    finally:
        _C.set_cpu_isa(before)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", [1, 3])
def test_expand_kernel_equals_twin(dtype, world):
    shard = 128 * 40
    x = _values(world * shard, seed=world)
    staging = torch.cat([torch.zeros(fp8.record_bytes(shard), dtype=torch.uint8) for _ in range(world)])
    for r in range(world):
        kernels.fp8_quantize_reference(staging[r * fp8.record_bytes(shard):(r + 1) * fp8.record_bytes(shard)],
                                       x[r * shard:(r + 1) * shard])
    got = torch.full((world * shard,), float("nan"), dtype=dtype)
    want = torch.empty_like(got)
    kernels.fp8_expand_(got, staging, shard)
    kernels.fp8_expand_reference(want, staging, shard)
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(bits(got[:128]), bits(torch.zeros(128, dtype=dtype)))
    assert torch.equal(bits(want), bits(fp8.fake_quantize(x, dtype)))  # per-shard blocks = blocks of the whole


@needs_ext
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_adamw_fp8_kernel_equals_twin(isa, grad_dtype):
    """The fused step writes param, moments and record exactly as the AdamW twin followed by the
    quantizer twin; over several steps, with a tensor lr, and a size that is not a whole 1024-run."""
    from yafsdp import _C

    before = _C.cpu_isa()
    _C.set_cpu_isa(isa)
    try:
        n = 128 * 77
        g = torch.Generator().manual_seed(5)
        p0 = torch.randn(n, generator=g) * 0.02
        p0[:128] = 0
        state = [p0.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(())]
        ref = [p0.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(())]
        rec, rec_ref = (torch.zeros(fp8.record_bytes(n), dtype=torch.uint8) for _ in range(2))
        for it in range(3):
            grad = (torch.randn(n, generator=g) * 0.01).to(grad_dtype)
            grad[:128] = 0
            hyper = dict(lr=torch.tensor(1e-2) if it == 1 else 1e-2, beta1=0.9, beta2=0.95, weight_decay=0.1,
                         eps=1e-8)
            state[3] += 1
            ref[3] += 1
            assert kernels.adamw_step_fp8_(state[0], grad, state[1], state[2], state[3], record=rec, **hyper)
            kernels.adamw_step_fp8_reference(ref[0], grad, ref[1], ref[2], ref[3], record=rec_ref, **hyper)
            for a, b in zip(state[:3], ref[:3]):
                assert torch.equal(bits(a), bits(b))
            assert torch.equal(rec, rec_ref), it
    finally:
        _C.set_cpu_isa(before)


@needs_ext
def test_fp8_ops_check_arguments_and_opcheck():
    n = 1024
    x = _values(n)
    rec = torch.zeros(fp8.record_bytes(n), dtype=torch.uint8)
    torch.library.opcheck(torch.ops.yafsdp.fp8_quantize_.default, (rec, x))
    out = torch.empty(n, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.yafsdp.fp8_expand_.default, (out, rec, n))
    p, m, v = x.clone(), torch.zeros(n), torch.zeros(n)
    torch.library.opcheck(torch.ops.yafsdp.adamw_step_fp8_.default,
                          (p, torch.ones(n), m, v, torch.ones(()), 1e-3, 0.9, 0.99, 0.0, 1e-8, None, rec))
    with pytest.raises(RuntimeError, match="record has"):
        torch.ops.yafsdp.fp8_quantize_(rec[:-4], x)
    with pytest.raises(RuntimeError, match="multiple of 128"):
        torch.ops.yafsdp.fp8_quantize_(torch.zeros(fp8.record_bytes(128) + 100, dtype=torch.uint8), x[:100])
    with pytest.raises(RuntimeError, match="staging has"):
        torch.ops.yafsdp.fp8_expand_(out, rec[:-1], n)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.yafsdp.fp8_quantize_(rec, x.bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA_EXT, reason="needs CUDA and yafsdp._C_cuda")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_fp8_kernels_equal_cpu(dtype):
    n = 128 * 1000
    x = _values(n)
    want = torch.zeros(fp8.record_bytes(n), dtype=torch.uint8)
    kernels.fp8_quantize_reference(want, x)
    got = torch.zeros_like(want, device="cuda")
    kernels.fp8_quantize_(got, x.cuda())
    assert torch.equal(got.cpu(), want)
    out = torch.empty(n, dtype=dtype, device="cuda")
    kernels.fp8_expand_(out, got, n)
    assert torch.equal(bits(out.cpu()), bits(fp8.fake_quantize(x, dtype)))
    g = torch.randn(n) * 0.01
    ref = [x.clone(), torch.zeros(n), torch.zeros(n), torch.ones(())]
    dev = [t.cuda() for t in ref]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)
    kernels.adamw_step_fp8_reference(ref[0], g, ref[1], ref[2], ref[3], record=want, **hyper)
    kernels.adamw_step_fp8_(dev[0], g.cuda(), dev[1], dev[2], dev[3], record=got, **hyper)
    assert torch.equal(bits(dev[0].cpu()), bits(ref[0])) and torch.equal(got.cpu(), want)
