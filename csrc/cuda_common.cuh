// Device helpers shared by the .cu files: element conversions, aligned packs,
// launch geometry. Plain CUDA C++.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace yafsdp::cuda {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Round to nearest even, as torch's device conversions.
template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// One AdamW element, with the operations and rounding of the CPU kernels (see
// make_adamw_consts in common.h). The _rn intrinsics keep the compiler from
// fusing multiply-adds other than the two written here. (adamw_cuda.cu, fp8_cuda.cu)
__device__ __forceinline__ void adamw_update(float& p, float g, float& m, float& v,
                                             const AdamWConsts& c) {
  p = __fmul_rn(p, c.decay);
  m = __fmaf_rn(c.lerp_w, __fsub_rn(g, m), c.lerp_small ? m : g);
  v = __fmaf_rn(__fmul_rn(c.w2, g), g, __fmul_rn(v, c.beta2));
  const float den = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.bc2_sqrt), c.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(c.neg_step, m), den));
}

// VEC elements of T loaded or stored with one vector instruction: the pointer is
// aligned to sizeof(Pack) (checked on the host by aligned()).
template <class T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T x[VEC];
};

template <int VEC, class T>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, VEC>*>(p);
}
template <int VEC, class T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, VEC>& v) {
  *reinterpret_cast<Pack<T, VEC>*>(p) = v;
}

// Elements per vector access: 16 bytes of fp32 (4 elements) for every buffer.
constexpr int kVec = 4;

inline bool aligned(const void* p, int64_t bytes) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

// Enough blocks to fill the device (8 resident blocks of 256 threads per SM), no
// more: a grid-stride loop covers the rest.
inline int grid_for(int64_t n, int per_thread) {
  static int sms[64] = {0};
  int dev = 0;
  cudaGetDevice(&dev);
  int& count = sms[dev & 63];
  if (count == 0) {
    int c = 0;
    cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, dev);
    count = c > 0 ? c : 1;
  }
  const int64_t per_block = static_cast<int64_t>(kThreads) * per_thread;
  const int64_t needed = (n + per_block - 1) / per_block;
  const int64_t cap = static_cast<int64_t>(count) * 8;
  return static_cast<int>(needed < cap ? needed : cap);
}

}  // namespace yafsdp::cuda
