// The fused AdamW step on CUDA: one pass over param, grad, exp_avg, exp_avg_sq
// and, optionally, the param_dtype copy-out (the next all-gather input):
// 4+4+4+4+4+4+4 = 28 bytes per parameter, +2 with a bf16/fp16 copy-out (the floor
// of 30 named in the design). Plain CUDA C++; see cuda_kernels.h.

#include <type_traits>

#include "cuda_common.cuh"
#include "cuda_kernels.h"

namespace yafsdp::cuda {
namespace {

struct NoOut {};  // "no copy-out"

template <class G, class O, int VEC>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
                 float* __restrict__ v, O* __restrict__ out, int64_t n, AdamWHyper h) {
  constexpr bool kOut = !std::is_same_v<O, NoOut>;
  // lr and step may be read from device memory here: no host round trip.
  const AdamWConsts c = make_adamw_consts(h);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * VEC;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; i < n;
       i += stride) {
    if (i + VEC <= n) {
      Pack<float, VEC> pp = load_pack<VEC>(p + i);
      const Pack<G, VEC> gp = load_pack<VEC>(g + i);
      Pack<float, VEC> mp = load_pack<VEC>(m + i);
      Pack<float, VEC> vp = load_pack<VEC>(v + i);
#pragma unroll
      for (int k = 0; k < VEC; ++k) adamw_update(pp.x[k], to_float(gp.x[k]), mp.x[k], vp.x[k], c);
      store_pack<VEC>(p + i, pp);
      store_pack<VEC>(m + i, mp);
      store_pack<VEC>(v + i, vp);
      if constexpr (kOut) {
        Pack<O, VEC> op;
#pragma unroll
        for (int k = 0; k < VEC; ++k) op.x[k] = from_float<O>(pp.x[k]);
        store_pack<VEC>(out + i, op);
      }
    } else {  // the last, partial pack
      for (int64_t j = i; j < n; ++j) {
        float pj = p[j], mj = m[j], vj = v[j];
        adamw_update(pj, to_float(g[j]), mj, vj, c);
        p[j] = pj;
        m[j] = mj;
        v[j] = vj;
        if constexpr (kOut) out[j] = from_float<O>(pj);
      }
    }
  }
}

template <class G, class O>
cudaError_t launch(float* p, const G* g, float* m, float* v, O* out, int64_t n,
                   const AdamWHyper& h, cudaStream_t stream) {
  bool vec = aligned(p, 4 * kVec) && aligned(g, sizeof(G) * kVec) && aligned(m, 4 * kVec) &&
             aligned(v, 4 * kVec);
  if constexpr (!std::is_same_v<O, NoOut>) vec = vec && aligned(out, sizeof(O) * kVec);
  if (vec) {
    adamw_kernel<G, O, kVec><<<grid_for(n, kVec), kThreads, 0, stream>>>(p, g, m, v, out, n, h);
  } else {
    adamw_kernel<G, O, 1><<<grid_for(n, 1), kThreads, 0, stream>>>(p, g, m, v, out, n, h);
  }
  return cudaGetLastError();
}

template <class G>
cudaError_t launch_out(float* p, const G* g, float* m, float* v, void* out, DType out_t,
                       int64_t n, const AdamWHyper& h, cudaStream_t stream) {
  if (out == nullptr) return launch<G, NoOut>(p, g, m, v, nullptr, n, h, stream);
  switch (out_t) {
    case DType::kF32: return launch(p, g, m, v, static_cast<float*>(out), n, h, stream);
    case DType::kBF16: return launch(p, g, m, v, static_cast<__nv_bfloat16*>(out), n, h, stream);
    case DType::kF16: return launch(p, g, m, v, static_cast<__half*>(out), n, h, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t adamw(float* param, const void* grad, DType grad_t, float* exp_avg,
                  float* exp_avg_sq, void* copy_out, DType out_t, int64_t n,
                  const AdamWHyper& h, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (grad_t) {
    case DType::kF32:
      return launch_out(param, static_cast<const float*>(grad), exp_avg, exp_avg_sq, copy_out,
                        out_t, n, h, stream);
    case DType::kBF16:
      return launch_out(param, static_cast<const __nv_bfloat16*>(grad), exp_avg, exp_avg_sq,
                        copy_out, out_t, n, h, stream);
    case DType::kF16:
      return launch_out(param, static_cast<const __half*>(grad), exp_avg, exp_avg_sq, copy_out,
                        out_t, n, h, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace yafsdp::cuda
