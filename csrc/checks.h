// Argument checks shared by the CPU, Meta (ops.cpp) and CUDA (cuda_binding.cpp)
// kernels. Errors name the argument and carry its values. Sizes are read as
// SymInts so the Meta kernels also run on symbolic shapes (torch.compile).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymBool.h>
#include <torch/library.h>

#include <optional>

#include "common.h"

namespace yafsdp {

inline DType kernel_dtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kF16;
    default:
      TORCH_CHECK(false, "yafsdp: ", what, " has dtype=", t.scalar_type(),
                  "; the kernels take float32, bfloat16 or float16");
  }
}

inline void check_contiguous(const at::Tensor& t, const char* what) {
  TORCH_SYM_CHECK(t.sym_is_contiguous(), "yafsdp: ", what, " must be contiguous (shape=",
                  t.sym_sizes(), ", strides=", t.sym_strides(), ")");
}

inline void check_flat(const at::Tensor& t, const char* what, const at::Tensor& like,
                       const char* like_name) {
  check_contiguous(t, what);
  TORCH_SYM_CHECK(t.sym_numel().sym_eq(like.sym_numel()), "yafsdp: ", what, " has numel=",
                  t.sym_numel(), " but ", like_name, " has numel=", like.sym_numel());
  TORCH_CHECK(t.device() == like.device(), "yafsdp: ", what, " is on ", t.device(), " but ",
              like_name, " is on ", like.device());
}

inline void check_scalar_tensor(const at::Tensor& t, const char* what) {
  TORCH_SYM_CHECK(t.sym_numel().sym_eq(1), "yafsdp: ", what, " must hold one value, got shape=",
                  t.sym_sizes());
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), "yafsdp: ", what,
              " must be a floating-point tensor, got dtype=", t.scalar_type());
}

inline void check_adamw(const at::Tensor& param, const at::Tensor& grad,
                        const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                        const at::Tensor& step, const std::optional<at::Tensor>& lr_tensor,
                        const std::optional<at::Tensor>& copy_out) {
  TORCH_CHECK(param.scalar_type() == at::kFloat, "yafsdp: adamw_step_ updates float32 params; ",
              "param has dtype=", param.scalar_type());
  check_contiguous(param, "param");
  check_flat(grad, "grad", param, "param");
  kernel_dtype(grad, "grad");
  check_flat(exp_avg, "exp_avg", param, "param");
  check_flat(exp_avg_sq, "exp_avg_sq", param, "param");
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat && exp_avg_sq.scalar_type() == at::kFloat,
              "yafsdp: exp_avg and exp_avg_sq must be float32, got ", exp_avg.scalar_type(),
              " and ", exp_avg_sq.scalar_type());
  check_scalar_tensor(step, "step");
  if (lr_tensor.has_value()) check_scalar_tensor(*lr_tensor, "lr_tensor");
  if (copy_out.has_value()) {
    check_flat(*copy_out, "copy_out", param, "param");
    kernel_dtype(*copy_out, "copy_out");
  }
}

inline void check_cast(const at::Tensor& dst, const at::Tensor& src) {
  check_contiguous(dst, "cast_ dst");
  check_flat(src, "src", dst, "dst");
  kernel_dtype(dst, "dst");
  kernel_dtype(src, "src");
}

inline void check_accumulate(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.scalar_type() == at::kFloat, "yafsdp: accumulate_ dst must be float32, got ",
              dst.scalar_type());
  check_contiguous(dst, "accumulate_ dst");
  check_flat(src, "src", dst, "dst");
  kernel_dtype(src, "src");
}

// nf4_expand_: out (world * shard_numel elements) from `world` records in staging.
inline void check_nf4_expand(const at::Tensor& out, const at::Tensor& staging,
                             const at::Tensor& codebook, int64_t shard_numel) {
  check_contiguous(out, "nf4_expand_ out");
  check_contiguous(staging, "nf4_expand_ staging");
  check_contiguous(codebook, "nf4_expand_ codebook");
  kernel_dtype(out, "out");
  TORCH_CHECK(staging.scalar_type() == at::kByte, "yafsdp: nf4_expand_ staging must be uint8, got dtype=",
              staging.scalar_type());
  TORCH_CHECK(codebook.scalar_type() == out.scalar_type(),
              "yafsdp: nf4_expand_ codebook must hold 16 values of out's dtype (", out.scalar_type(),
              "), got dtype=", codebook.scalar_type());
  TORCH_SYM_CHECK(codebook.sym_numel().sym_eq(16),
                  "yafsdp: nf4_expand_ codebook must hold 16 values, got ", codebook.sym_numel());
  TORCH_CHECK(staging.device() == out.device() && codebook.device() == out.device(),
              "yafsdp: nf4_expand_ out is on ", out.device(), ", staging on ", staging.device(),
              ", codebook on ", codebook.device());
  TORCH_CHECK(shard_numel > 0 && shard_numel % kNF4Block == 0,
              "yafsdp: nf4_expand_ shard_numel=", shard_numel, " must be a positive multiple of ",
              kNF4Block);
  TORCH_SYM_CHECK(out.sym_numel().sym_eq(out.sym_numel() / shard_numel * shard_numel),
                  "yafsdp: nf4_expand_ out has numel=", out.sym_numel(),
                  ", not a multiple of shard_numel=", shard_numel);
  const int64_t item = out.scalar_type() == at::kFloat ? 4 : 2;
  TORCH_SYM_CHECK(staging.sym_numel().sym_eq(out.sym_numel() / shard_numel *
                                             nf4_record_bytes(shard_numel, item)),
                  "yafsdp: nf4_expand_ staging has ", staging.sym_numel(), " bytes, expected ",
                  out.sym_numel() / shard_numel, " records of ", nf4_record_bytes(shard_numel, item),
                  " bytes");
}

// An FP8 record for `n` values: uint8, contiguous, fp8_record_bytes(n) bytes.
inline void check_fp8_record(const at::Tensor& record, const c10::SymInt& n, const char* op) {
  check_contiguous(record, "record");
  TORCH_CHECK(record.scalar_type() == at::kByte, "yafsdp: ", op, " record must be uint8, got dtype=",
              record.scalar_type());
  TORCH_SYM_CHECK(n.sym_eq(n / kFP8Block * kFP8Block), "yafsdp: ", op, " takes a multiple of ",
                  kFP8Block, " values, got ", n);
  TORCH_SYM_CHECK(record.sym_numel().sym_eq(n + n / kFP8Block * 4), "yafsdp: ", op, " record has ",
                  record.sym_numel(), " bytes, expected ", n, " codes + ", n / kFP8Block,
                  " float32 scales");
}

// fp8_quantize_: record <- src (float32).
inline void check_fp8_quantize(const at::Tensor& record, const at::Tensor& src) {
  check_contiguous(src, "fp8_quantize_ src");
  TORCH_CHECK(src.scalar_type() == at::kFloat, "yafsdp: fp8_quantize_ src must be float32, got dtype=",
              src.scalar_type());
  TORCH_CHECK(record.device() == src.device(), "yafsdp: fp8_quantize_ record is on ", record.device(),
              " but src is on ", src.device());
  check_fp8_record(record, src.sym_numel(), "fp8_quantize_");
}

// fp8_expand_: out (world * shard_numel elements) from `world` records in staging.
inline void check_fp8_expand(const at::Tensor& out, const at::Tensor& staging, int64_t shard_numel) {
  check_contiguous(out, "fp8_expand_ out");
  check_contiguous(staging, "fp8_expand_ staging");
  kernel_dtype(out, "out");
  TORCH_CHECK(staging.scalar_type() == at::kByte, "yafsdp: fp8_expand_ staging must be uint8, got dtype=",
              staging.scalar_type());
  TORCH_CHECK(staging.device() == out.device(), "yafsdp: fp8_expand_ out is on ", out.device(),
              ", staging on ", staging.device());
  TORCH_CHECK(shard_numel > 0 && shard_numel % kFP8Block == 0, "yafsdp: fp8_expand_ shard_numel=",
              shard_numel, " must be a positive multiple of ", kFP8Block);
  TORCH_SYM_CHECK(out.sym_numel().sym_eq(out.sym_numel() / shard_numel * shard_numel),
                  "yafsdp: fp8_expand_ out has numel=", out.sym_numel(),
                  ", not a multiple of shard_numel=", shard_numel);
  TORCH_SYM_CHECK(staging.sym_numel().sym_eq(out.sym_numel() / shard_numel * fp8_record_bytes(shard_numel)),
                  "yafsdp: fp8_expand_ staging has ", staging.sym_numel(), " bytes, expected ",
                  out.sym_numel() / shard_numel, " records of ", fp8_record_bytes(shard_numel), " bytes");
}

// adamw_step_fp8_: the AdamW arguments, and the record of the updated param.
inline void check_adamw_fp8(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                            const at::Tensor& exp_avg_sq, const at::Tensor& step,
                            const std::optional<at::Tensor>& lr_tensor, const at::Tensor& record) {
  check_adamw(param, grad, exp_avg, exp_avg_sq, step, lr_tensor, std::nullopt);
  TORCH_CHECK(record.device() == param.device(), "yafsdp: adamw_step_fp8_ record is on ", record.device(),
              " but param is on ", param.device());
  check_fp8_record(record, param.sym_numel(), "adamw_step_fp8_");
}

}  // namespace yafsdp
