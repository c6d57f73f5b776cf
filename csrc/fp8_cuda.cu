// FP8 gather records on CUDA (see [Note: FP8 gather records] in common.h): the
// quantizer (fp32 master -> record), the expand (gathered records -> param_dtype
// values in the weight buffer) and the AdamW step that writes the record of its
// updated param in the same pass. Plain CUDA C++; see cuda_kernels.h.
//
// Quantizing needs a block's amax before any of its codes: one warp per block of
// kFP8Block = 128 values, each lane holding 4 of them (lane, lane+32, lane+64,
// lane+96: coalesced loads), the amax by a warp butterfly. The arithmetic is the
// shared host/device helpers of common.h with IEEE division (no fast math), so the
// codes and scales equal the CPU kernels' and the PyTorch twin's bit for bit.

#include "cuda_common.cuh"
#include "cuda_kernels.h"

namespace yafsdp::cuda {
namespace {

constexpr int kPerLane = static_cast<int>(kFP8Block / 32);
constexpr int kWarpsPerBlock = kThreads / 32;

// A warp's 4-per-lane values of block b -> codes and scale of the record.
__device__ __forceinline__ void quantize_warp(const float (&x)[kPerLane], uint8_t* codes,
                                              float* scales, int64_t b, int lane) {
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) amax = fmaxf(amax, fabsf(x[k]));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float s = fp8_scale(amax);
  if (lane == 0) scales[b] = s;
  uint8_t* c = codes + b * kFP8Block;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) c[lane + 32 * k] = s == 0.0f ? 0 : fp8_quantize_one(x[k], s);
}

__global__ void __launch_bounds__(kThreads)
    fp8_quantize_kernel(uint8_t* __restrict__ record, const float* __restrict__ src, int64_t n) {
  const int lane = threadIdx.x & 31;
  const int64_t nblocks = n / kFP8Block;
  float* scales = reinterpret_cast<float*>(record + n);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
       b < nblocks; b += stride) {
    float x[kPerLane];
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) x[k] = src[b * kFP8Block + lane + 32 * k];
    quantize_warp(x, record, scales, b, lane);
  }
}

template <class G>
__global__ void __launch_bounds__(kThreads)
    adamw_fp8_kernel(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
                     float* __restrict__ v, uint8_t* __restrict__ record, int64_t n, AdamWHyper h) {
  const AdamWConsts c = make_adamw_consts(h);  // lr and step may live in device memory
  const int lane = threadIdx.x & 31;
  const int64_t nblocks = n / kFP8Block;
  float* scales = reinterpret_cast<float*>(record + n);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
       b < nblocks; b += stride) {
    float x[kPerLane];
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int64_t i = b * kFP8Block + lane + 32 * k;
      float pi = p[i], mi = m[i], vi = v[i];
      adamw_update(pi, to_float(g[i]), mi, vi, c);
      p[i] = pi;
      m[i] = mi;
      v[i] = vi;
      x[k] = pi;
    }
    quantize_warp(x, record, scales, b, lane);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    fp8_expand_kernel(T* __restrict__ out, const uint8_t* __restrict__ staging,
                      int64_t shard_numel, int64_t n) {
  const int64_t record = fp8_record_bytes(shard_numel);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t r = i / shard_numel, j = i % shard_numel;  // rank, element in its shard
    const uint8_t* rec = staging + r * record;
    const float s = reinterpret_cast<const float*>(rec + shard_numel)[j / kFP8Block];
    out[i] = from_float<T>(__fmul_rn(fp8_e4m3_to_float(rec[j]), s));
  }
}

int warp_grid(int64_t nblocks) { return grid_for(nblocks * 32, 1); }

template <class T>
cudaError_t launch_expand(T* out, const uint8_t* staging, int64_t shard_numel, int64_t n,
                          cudaStream_t stream) {
  fp8_expand_kernel<T><<<grid_for(n, 1), kThreads, 0, stream>>>(out, staging, shard_numel, n);
  return cudaGetLastError();
}

template <class G>
cudaError_t launch_adamw(float* p, const G* g, float* m, float* v, uint8_t* record, int64_t n,
                         const AdamWHyper& h, cudaStream_t stream) {
  adamw_fp8_kernel<G><<<warp_grid(n / kFP8Block), kThreads, 0, stream>>>(p, g, m, v, record, n, h);
  return cudaGetLastError();
}

}  // namespace

cudaError_t fp8_quantize(uint8_t* record, const float* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  fp8_quantize_kernel<<<warp_grid(n / kFP8Block), kThreads, 0, stream>>>(record, src, n);
  return cudaGetLastError();
}

cudaError_t fp8_expand(void* out, DType out_t, const uint8_t* staging, int64_t shard_numel,
                       int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (out_t) {
    case DType::kF32:
      return launch_expand(static_cast<float*>(out), staging, shard_numel, n, stream);
    case DType::kBF16:
      return launch_expand(static_cast<__nv_bfloat16*>(out), staging, shard_numel, n, stream);
    case DType::kF16:
      return launch_expand(static_cast<__half*>(out), staging, shard_numel, n, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t adamw_fp8(float* param, const void* grad, DType grad_t, float* exp_avg,
                      float* exp_avg_sq, uint8_t* record, int64_t n, const AdamWHyper& h,
                      cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (grad_t) {
    case DType::kF32:
      return launch_adamw(param, static_cast<const float*>(grad), exp_avg, exp_avg_sq, record, n,
                          h, stream);
    case DType::kBF16:
      return launch_adamw(param, static_cast<const __nv_bfloat16*>(grad), exp_avg, exp_avg_sq,
                          record, n, h, stream);
    case DType::kF16:
      return launch_adamw(param, static_cast<const __half*>(grad), exp_avg, exp_avg_sq, record,
                          n, h, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace yafsdp::cuda
