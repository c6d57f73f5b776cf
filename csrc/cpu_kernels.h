// CPU kernels over flat, contiguous buffers: raw pointers and element counts.
// Multi-threaded (at::parallel_for) and vectorised; see cpu_kernels.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace yafsdp::cpu {

// The fused AdamW step over n elements: param, exp_avg, exp_avg_sq fp32 and
// updated in place; grad fp32/bf16/fp16; copy_out (nullable) receives the
// updated param converted to out_t in the same pass.
void adamw(float* param, const void* grad, DType grad_t, float* exp_avg, float* exp_avg_sq,
           void* copy_out, DType out_t, int64_t n, const AdamWHyper& h);

// dst[i] = src[i] * scale converted to dst_t: the product in fp32, then one rounding
// (to nearest even). scale == 1 is a pure conversion.
void cast(void* dst, DType dst_t, const void* src, DType src_t, double scale, int64_t n);

// dst[i] += src[i] * scale, dst fp32.
void accumulate(float* dst, const void* src, DType src_t, double scale, int64_t n);

// NF4 expand: out (n elements of out_t, n = world * shard_numel) from the byte records
// of `world` ranks laid end to end in `staging`; codebook: the 16 levels in out_t.
// See [Note: NF4 shard records] in common.h.
void nf4_expand(void* out, DType out_t, const uint8_t* staging, const void* codebook,
                int64_t shard_numel, int64_t n);

// FP8 gather records (see [Note: FP8 gather records] in common.h).
// fp8_quantize: n fp32 values (a multiple of kFP8Block) -> one record (codes, then scales).
void fp8_quantize(uint8_t* record, const float* src, int64_t n);
// fp8_expand: out (n elements of out_t, n = world * shard_numel) from the records of
// `world` ranks laid end to end in `staging`.
void fp8_expand(void* out, DType out_t, const uint8_t* staging, int64_t shard_numel, int64_t n);
// The fused AdamW step of adamw() whose copy-out is the record of the updated param
// (n a multiple of kFP8Block): each run of blocks is stepped, then quantized while in cache.
void adamw_fp8(float* param, const void* grad, DType grad_t, float* exp_avg, float* exp_avg_sq,
               uint8_t* record, int64_t n, const AdamWHyper& h);

// The instruction set the kernels use ("avx512", "avx2" or "scalar"): the best one
// this CPU supports, unless YAFSDP_CPU_ISA names another at load time or set_isa() does.
std::string isa();
std::vector<std::string> supported_isas();
void set_isa(const std::string& name);  // throws std::invalid_argument

}  // namespace yafsdp::cpu
