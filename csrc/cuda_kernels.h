// CUDA kernels over flat, contiguous device buffers: raw pointers, element
// counts and a stream. Plain CUDA C++ (no torch headers), so the .cu files
// compile with nvcc alone; cuda_binding.cpp adapts them to torch tensors.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common.h"

namespace yafsdp::cuda {

// Same contracts as the CPU kernels in cpu_kernels.h. h.lr_ptr/h.step_ptr, when
// set, point to float32 device memory: the step then needs no host synchronisation.
// Each returns the launch's error (cudaSuccess when n == 0: nothing is launched).
cudaError_t adamw(float* param, const void* grad, DType grad_t, float* exp_avg,
                  float* exp_avg_sq, void* copy_out, DType out_t, int64_t n,
                  const AdamWHyper& h, cudaStream_t stream);

cudaError_t cast(void* dst, DType dst_t, const void* src, DType src_t, float scale, int64_t n,
                 cudaStream_t stream);

cudaError_t accumulate(float* dst, const void* src, DType src_t, float scale, int64_t n,
                       cudaStream_t stream);

// See nf4_expand in cpu_kernels.h; codebook: 16 values of out_t in device memory.
cudaError_t nf4_expand(void* out, DType out_t, const uint8_t* staging, const void* codebook,
                       int64_t shard_numel, int64_t n, cudaStream_t stream);

// FP8 gather records: see fp8_quantize, fp8_expand and adamw_fp8 in cpu_kernels.h
// ([Note: FP8 gather records] in common.h). The records' scales must be 4-byte aligned.
cudaError_t fp8_quantize(uint8_t* record, const float* src, int64_t n, cudaStream_t stream);

cudaError_t fp8_expand(void* out, DType out_t, const uint8_t* staging, int64_t shard_numel,
                       int64_t n, cudaStream_t stream);

cudaError_t adamw_fp8(float* param, const void* grad, DType grad_t, float* exp_avg,
                      float* exp_avg_sq, uint8_t* record, int64_t n, const AdamWHyper& h,
                      cudaStream_t stream);

}  // namespace yafsdp::cuda
