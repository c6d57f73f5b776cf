// The engine's hot-path copies on CUDA: cast (fp32 master shard -> param_dtype
// compute copy; reduce output * 1/world -> fresh fp32 grad shard) and accumulate
// (grad shard += reduce output * 1/world).
// Plain CUDA C++; see cuda_kernels.h.

#include "cuda_common.cuh"
#include "cuda_kernels.h"

namespace yafsdp::cuda {
namespace {

// dst = src * scale: the product in fp32 (skipped when kScale is false), one rounding.
template <bool kScale, class S>
__device__ __forceinline__ float scaled(S x, float scale) {
  if constexpr (kScale) {
    return __fmul_rn(to_float(x), scale);
  } else {
    return to_float(x);
  }
}

template <bool kScale, class D, class S, int VEC>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(D* __restrict__ dst, const S* __restrict__ src, float scale, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * VEC;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; i < n;
       i += stride) {
    if (i + VEC <= n) {
      const Pack<S, VEC> s = load_pack<VEC>(src + i);
      Pack<D, VEC> d;
#pragma unroll
      for (int k = 0; k < VEC; ++k) d.x[k] = from_float<D>(scaled<kScale>(s.x[k], scale));
      store_pack<VEC>(dst + i, d);
    } else {
      for (int64_t j = i; j < n; ++j) dst[j] = from_float<D>(scaled<kScale>(src[j], scale));
    }
  }
}

// dst += src * scale as one fused multiply-add, like torch's dst.add_(src, alpha=scale).
template <class S, int VEC>
__global__ void __launch_bounds__(kThreads)
    accumulate_kernel(float* __restrict__ dst, const S* __restrict__ src, float scale,
                      int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * VEC;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; i < n;
       i += stride) {
    if (i + VEC <= n) {
      const Pack<S, VEC> s = load_pack<VEC>(src + i);
      Pack<float, VEC> d = load_pack<VEC>(dst + i);
#pragma unroll
      for (int k = 0; k < VEC; ++k) d.x[k] = __fmaf_rn(to_float(s.x[k]), scale, d.x[k]);
      store_pack<VEC>(dst + i, d);
    } else {
      for (int64_t j = i; j < n; ++j) dst[j] = __fmaf_rn(to_float(src[j]), scale, dst[j]);
    }
  }
}

template <bool kScale, class D, class S>
cudaError_t launch_cast_scaled(D* dst, const S* src, float scale, int64_t n, cudaStream_t stream) {
  if (aligned(dst, sizeof(D) * kVec) && aligned(src, sizeof(S) * kVec)) {
    cast_kernel<kScale, D, S, kVec><<<grid_for(n, kVec), kThreads, 0, stream>>>(dst, src, scale, n);
  } else {
    cast_kernel<kScale, D, S, 1><<<grid_for(n, 1), kThreads, 0, stream>>>(dst, src, scale, n);
  }
  return cudaGetLastError();
}

template <class D, class S>
cudaError_t launch_cast(D* dst, const S* src, float scale, int64_t n, cudaStream_t stream) {
  return scale == 1.0f ? launch_cast_scaled<false>(dst, src, scale, n, stream)
                       : launch_cast_scaled<true>(dst, src, scale, n, stream);
}

template <class D>
cudaError_t cast_from(D* dst, const void* src, DType src_t, float scale, int64_t n,
                      cudaStream_t stream) {
  switch (src_t) {
    case DType::kF32: return launch_cast(dst, static_cast<const float*>(src), scale, n, stream);
    case DType::kBF16:
      return launch_cast(dst, static_cast<const __nv_bfloat16*>(src), scale, n, stream);
    case DType::kF16: return launch_cast(dst, static_cast<const __half*>(src), scale, n, stream);
  }
  return cudaErrorInvalidValue;
}

template <class S>
cudaError_t launch_accumulate(float* dst, const S* src, float scale, int64_t n,
                              cudaStream_t stream) {
  if (aligned(dst, 4 * kVec) && aligned(src, sizeof(S) * kVec)) {
    accumulate_kernel<S, kVec><<<grid_for(n, kVec), kThreads, 0, stream>>>(dst, src, scale, n);
  } else {
    accumulate_kernel<S, 1><<<grid_for(n, 1), kThreads, 0, stream>>>(dst, src, scale, n);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t cast(void* dst, DType dst_t, const void* src, DType src_t, float scale, int64_t n,
                 cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (dst_t == src_t && scale == 1.0f) {
    const size_t bytes = static_cast<size_t>(n) * (dst_t == DType::kF32 ? 4 : 2);
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
  }
  switch (dst_t) {
    case DType::kF32: return cast_from(static_cast<float*>(dst), src, src_t, scale, n, stream);
    case DType::kBF16:
      return cast_from(static_cast<__nv_bfloat16*>(dst), src, src_t, scale, n, stream);
    case DType::kF16: return cast_from(static_cast<__half*>(dst), src, src_t, scale, n, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t accumulate(float* dst, const void* src, DType src_t, float scale, int64_t n,
                       cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (src_t) {
    case DType::kF32:
      return launch_accumulate(dst, static_cast<const float*>(src), scale, n, stream);
    case DType::kBF16:
      return launch_accumulate(dst, static_cast<const __nv_bfloat16*>(src), scale, n, stream);
    case DType::kF16:
      return launch_accumulate(dst, static_cast<const __half*>(src), scale, n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace yafsdp::cuda
