// The NF4 expand on CUDA: a gathered compact group (byte records of every rank,
// end to end in the weight buffer's staging area) -> its param_dtype values in the
// weight buffer. See [Note: NF4 shard records] in common.h. Plain CUDA C++; see
// cuda_kernels.h.

#include "cuda_common.cuh"
#include "cuda_kernels.h"

namespace yafsdp::cuda {
namespace {

// One thread per packed byte (two elements); the 16 levels are read once per block
// into shared memory. Reads 0.53 bytes and writes 2 bytes per bf16 element: bound
// by memory bandwidth, like the all-gather it follows.
template <class T>
__global__ void __launch_bounds__(kThreads)
    nf4_expand_kernel(T* __restrict__ out, const uint8_t* __restrict__ staging,
                      const T* __restrict__ codebook, int64_t shard_numel, int64_t n) {
  __shared__ float code[16];
  if (threadIdx.x < 16) code[threadIdx.x] = to_float(codebook[threadIdx.x]);
  __syncthreads();
  const int64_t record = nf4_record_bytes(shard_numel, sizeof(T));
  const int64_t half_shard = shard_numel / 2;
  const int64_t pairs = n / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs;
       p += stride) {
    const int64_t r = p / half_shard, k = p % half_shard;  // rank, byte within its codes
    const uint8_t* rec = staging + r * record;
    const uint8_t byte = rec[k];
    const T* scales = reinterpret_cast<const T*>(rec + half_shard);
    const float scale = to_float(scales[(2 * k) / kNF4Block]);
    // The product of two bf16/fp16 values is exact in fp32; one rounding to T.
    out[2 * p] = from_float<T>(__fmul_rn(code[byte >> 4], scale));
    out[2 * p + 1] = from_float<T>(__fmul_rn(code[byte & 15], scale));
  }
}

template <class T>
cudaError_t launch(T* out, const uint8_t* staging, const T* codebook, int64_t shard_numel,
                   int64_t n, cudaStream_t stream) {
  nf4_expand_kernel<T><<<grid_for(n / 2, 1), kThreads, 0, stream>>>(out, staging, codebook,
                                                                      shard_numel, n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t nf4_expand(void* out, DType out_t, const uint8_t* staging, const void* codebook,
                       int64_t shard_numel, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (out_t) {
    case DType::kF32:
      return launch(static_cast<float*>(out), staging, static_cast<const float*>(codebook),
                    shard_numel, n, stream);
    case DType::kBF16:
      return launch(static_cast<__nv_bfloat16*>(out), staging,
                    static_cast<const __nv_bfloat16*>(codebook), shard_numel, n, stream);
    case DType::kF16:
      return launch(static_cast<__half*>(out), staging, static_cast<const __half*>(codebook),
                    shard_numel, n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace yafsdp::cuda
