"""NF4 frozen storage, kernels: the expand kernel (C++ CPU, CUDA) equals its pure-PyTorch twin bit
for bit, and quantize + twin equal torchao's NF4 (codebook, packed codes, dequantized values) bit for
bit. See [Note: NF4 frozen groups] in yafsdp/formats/nf4_codec.py."""
import importlib
import os
import sys

import pytest
import torch

from yafsdp import kernels

from yafsdp.formats import nf4_codec as nf4

HAS_EXT = kernels.backend("cpu") == "extension"
REQUIRE_EXT = os.environ.get("YAFSDP_REQUIRE_EXT", "") == "1"
HAS_CUDA_EXT = torch.cuda.is_available() and kernels.backend("cuda") == "extension"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]

needs_ext = pytest.mark.skipif(not HAS_EXT and not REQUIRE_EXT, reason="yafsdp._C is not built: " + kernels.describe())


# torchao is the independent reference. CI installs it into <repo>/.torchao (pip --target, --no-deps),
# not site-wide: installed site-wide, transformers and peft import it on every `import transformers`
# (its CPU wheel's CUDA libraries then print "Failed to load" on stderr). YAFSDP_TORCHAO_DIR overrides.
TORCHAO_DIR = os.environ.get("YAFSDP_TORCHAO_DIR",
                             os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".torchao"))


def _torchao_nf4():
    """torchao's NF4 module (its path moved between versions), or None when torchao is not importable.
    The directory is on sys.path only while importing, so that processes spawned later (which
    inherit sys.path) do not see it."""
    added = os.path.isdir(TORCHAO_DIR) and TORCHAO_DIR not in sys.path
    if added:
        sys.path.insert(0, TORCHAO_DIR)
    try:
        for path in ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor"):
            try:
                return importlib.import_module(path)
            except ImportError:
                continue
        return None
    finally:
        if added:
            sys.path.remove(TORCHAO_DIR)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def records(values: torch.Tensor, world: int) -> torch.Tensor:
    """The gathered staging area of ``world`` ranks' shards of ``values``."""
    shard = values.numel() // world
    out = []
    for r in range(world):
        rec = torch.zeros(nf4.record_bytes(shard, values.dtype), dtype=torch.uint8)
        nf4.quantize_into(rec, values[r * shard:(r + 1) * shard])
        out.append(rec)
    return torch.cat(out)


def _values(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g) * 0.05
    v[:64] = 0  # a zero block (padding) expands to zeros
    v[64:128] = torch.linspace(-1, 1, 64)  # every level, ties included
    v[200] = 3.0  # an outlier block
    return v.to(dtype)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", [1, 3])
def test_expand_kernel_equals_twin(dtype, world):
    shard = nf4.shard_align(dtype) * 2
    vals = _values(world * shard, dtype, seed=world)
    staging = records(vals, world)
    got = torch.full((world * shard,), float("nan"), dtype=dtype)
    want = torch.empty_like(got)
    kernels.nf4_expand_(got, staging, nf4.codebook(dtype), shard)
    kernels.nf4_expand_reference(want, staging, nf4.codebook(dtype), shard)
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(bits(got[:64]), bits(torch.zeros(64, dtype=dtype)))  # +0.0, not -0.0
    # the round trip is close (within half the widest level gap times the block's absmax)
    err = (got.float() - vals.float()).abs().view(-1, 64).amax(1)
    assert (err <= 0.1625 * vals.float().abs().view(-1, 64).amax(1) + 1e-6).all()


@needs_ext
def test_expand_kernel_checks_and_opcheck():
    dtype, shard = torch.bfloat16, 512
    staging = records(_values(2 * shard, dtype), 2)
    out = torch.empty(2 * shard, dtype=dtype)
    torch.library.opcheck(torch.ops.yafsdp.nf4_expand_.default, (out, staging, nf4.codebook(dtype), shard))
    with pytest.raises(RuntimeError, match="staging has"):
        torch.ops.yafsdp.nf4_expand_(out, staging[:-2], nf4.codebook(dtype), shard)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        torch.ops.yafsdp.nf4_expand_(out, staging, nf4.codebook(dtype), 100)
    with pytest.raises(RuntimeError, match="16 values"):
        torch.ops.yafsdp.nf4_expand_(out, staging, nf4.codebook(torch.float32), shard)


@pytest.mark.parametrize("dtype", DTYPES)
def test_twin_equals_torchao_bit_for_bit(dtype):
    """torchao's to_nf4 (blocks of 64): the same codebook, the same packed codes, and its own
    dequantization (get_original_weight) with the plain absmax scales gives our values, bit for bit.
    (torchao also double-quantizes the scales; yafsdp keeps them exact, so that step is replaced
    by torchao's own get_block_absmax.)"""
    ao = _torchao_nf4()
    if ao is None:
        pytest.skip(f"torchao is not importable, site-wide or from {TORCHAO_DIR} (the independent NF4 reference; "
                    "install it as .ci/run does: pip install --no-deps --target .torchao torchao==0.18.0)")
    g = torch.Generator().manual_seed(3)
    for shape in ((128, 256), (64, 64), (192, 64)):
        w = (torch.randn(shape, generator=g) * 0.02).to(dtype)
        w.view(-1)[:64] = torch.linspace(-1, 1, 64, dtype=dtype)  # ties between levels
        t = ao.to_nf4(w, 64, w.numel() // 64 if w.numel() // 64 < 256 else 256)
        assert torch.equal(bits(t.nf4), bits(nf4.codebook(dtype)))
        packed, scales = nf4.quantize(w.reshape(-1))
        assert torch.equal(t.quantized_data, packed)
        flat = w.reshape(-1)
        t.dequantize_scalers = lambda *a, **k: ao.get_block_absmax(flat, 64)
        want = t.get_original_weight().reshape(-1)
        got = nf4.dequantize_record(torch.cat([packed, scales.view(torch.uint8)]), w.numel(), dtype)
        assert torch.equal(bits(got), bits(want)), (dtype, shape)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA_EXT, reason="needs CUDA and yafsdp._C_cuda")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_expand_equals_cpu(dtype):
    shard = nf4.shard_align(dtype) * 1000
    vals = _values(3 * shard, dtype)
    staging = records(vals, 3)
    cpu = torch.empty(3 * shard, dtype=dtype)
    kernels.nf4_expand_reference(cpu, staging, nf4.codebook(dtype), shard)
    gpu = torch.empty(3 * shard, dtype=dtype, device="cuda")
    kernels.nf4_expand_(gpu, staging.cuda(), nf4.codebook(dtype, "cuda"), shard)
    assert torch.equal(bits(gpu.cpu()), bits(cpu))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_code_table_equals_the_nearest_level_search_on_every_value(dtype):
    """The quantizer's lookup ([Note: the NF4 code table]) gives the 16-level search's code for every
    finite value in [-1, 1] of the dtype (each block scaled by 1: a 1.0 leads it), including ties."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    v = every[torch.isfinite(every) & (every.abs() <= 1)]
    v = torch.cat([v, v[: -v.numel() % 63]]).view(-1, 63)  # whole blocks of 63 + the leading 1.0
    values = torch.cat([torch.ones(v.shape[0], 1, dtype=dtype), v], 1).reshape(-1)
    codes, scales = nf4.quantize(values)
    want = nf4._nearest(values, nf4.codebook(dtype)).to(torch.uint8)
    assert torch.equal(scales, torch.ones_like(scales))
    assert torch.equal(codes, want[0::2] << 4 | want[1::2])
