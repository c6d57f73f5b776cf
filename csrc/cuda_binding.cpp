// The CUDA implementations of the yafsdp ops (schemas: ops.cpp): argument checks,
// device guard and current stream, then the plain-CUDA launchers of
// cuda_kernels.h. Built only where torch has CUDA, as module `yafsdp._C_cuda`,
// which must be imported after `yafsdp._C` (it registers into that library).

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include "checks.h"
#include "cuda_kernels.h"

namespace yafsdp {
namespace {

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "yafsdp: CUDA kernel of ", op, " failed: ",
              cudaGetErrorString(err));
}

void check_device(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(t.is_cuda(), "yafsdp: ", op, " CUDA kernel got ", what, " on ", t.device());
}

// A one-element lr/step tensor: on the param's device the kernel reads it (no host
// synchronisation); on the CPU it is read here (no synchronisation either).
const float* device_scalar(const at::Tensor& t, const at::Tensor& param, double* host_value,
                           const char* what) {
  if (t.is_cpu()) {
    *host_value = t.item<double>();
    return nullptr;
  }
  TORCH_CHECK(t.device() == param.device(), "yafsdp: ", what, " is on ", t.device(),
              " but param is on ", param.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, "yafsdp: ", what, " on ", t.device(),
              " must be float32, got dtype=", t.scalar_type());
  return t.const_data_ptr<float>();
}

void adamw_step_cuda(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                     at::Tensor& exp_avg_sq, const at::Tensor& step, double lr, double beta1,
                     double beta2, double weight_decay, double eps,
                     const std::optional<at::Tensor>& lr_tensor,
                     const std::optional<at::Tensor>& copy_out) {
  check_adamw(param, grad, exp_avg, exp_avg_sq, step, lr_tensor, copy_out);
  check_device(param, "adamw_step_", "param");
  const c10::cuda::CUDAGuard guard(param.device());
  AdamWHyper h{};
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.weight_decay = weight_decay;
  h.eps = eps;
  h.step_ptr = device_scalar(step, param, &h.step, "step");
  if (lr_tensor.has_value()) h.lr_ptr = device_scalar(*lr_tensor, param, &h.lr, "lr_tensor");
  void* out = copy_out.has_value() ? copy_out->data_ptr() : nullptr;
  const DType out_t = copy_out.has_value() ? kernel_dtype(*copy_out, "copy_out") : DType::kF32;
  check_launch(cuda::adamw(param.data_ptr<float>(), grad.const_data_ptr(),
                           kernel_dtype(grad, "grad"), exp_avg.data_ptr<float>(),
                           exp_avg_sq.data_ptr<float>(), out, out_t, param.numel(), h,
                           c10::cuda::getCurrentCUDAStream()),
               "adamw_step_");
}

void cast_cuda(at::Tensor& dst, const at::Tensor& src, double scale) {
  check_cast(dst, src);
  check_device(dst, "cast_", "dst");
  const c10::cuda::CUDAGuard guard(dst.device());
  check_launch(cuda::cast(dst.data_ptr(), kernel_dtype(dst, "dst"), src.const_data_ptr(),
                          kernel_dtype(src, "src"), static_cast<float>(scale), dst.numel(),
                          c10::cuda::getCurrentCUDAStream()),
               "cast_");
}

void accumulate_cuda(at::Tensor& dst, const at::Tensor& src, double scale) {
  check_accumulate(dst, src);
  check_device(dst, "accumulate_", "dst");
  const c10::cuda::CUDAGuard guard(dst.device());
  check_launch(cuda::accumulate(dst.data_ptr<float>(), src.const_data_ptr(),
                                kernel_dtype(src, "src"), static_cast<float>(scale), dst.numel(),
                                c10::cuda::getCurrentCUDAStream()),
               "accumulate_");
}

void nf4_expand_cuda(at::Tensor& out, const at::Tensor& staging, const at::Tensor& codebook,
                     int64_t shard_numel) {
  check_nf4_expand(out, staging, codebook, shard_numel);
  check_device(out, "nf4_expand_", "out");
  const c10::cuda::CUDAGuard guard(out.device());
  check_launch(cuda::nf4_expand(out.data_ptr(), kernel_dtype(out, "out"),
                                staging.const_data_ptr<uint8_t>(), codebook.const_data_ptr(),
                                shard_numel, out.numel(), c10::cuda::getCurrentCUDAStream()),
               "nf4_expand_");
}

void check_scales_aligned(const at::Tensor& bytes, int64_t codes, const char* op) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(bytes.const_data_ptr<uint8_t>() + codes) % 4 == 0,
              "yafsdp: ", op, " needs the float32 scales of every record 4-byte aligned");
}

void fp8_quantize_cuda(at::Tensor& record, const at::Tensor& src) {
  check_fp8_quantize(record, src);
  check_device(src, "fp8_quantize_", "src");
  check_scales_aligned(record, src.numel(), "fp8_quantize_");
  const c10::cuda::CUDAGuard guard(src.device());
  check_launch(cuda::fp8_quantize(record.data_ptr<uint8_t>(), src.const_data_ptr<float>(),
                                  src.numel(), c10::cuda::getCurrentCUDAStream()),
               "fp8_quantize_");
}

void fp8_expand_cuda(at::Tensor& out, const at::Tensor& staging, int64_t shard_numel) {
  check_fp8_expand(out, staging, shard_numel);
  check_device(out, "fp8_expand_", "out");
  check_scales_aligned(staging, shard_numel, "fp8_expand_");
  const c10::cuda::CUDAGuard guard(out.device());
  check_launch(cuda::fp8_expand(out.data_ptr(), kernel_dtype(out, "out"),
                                staging.const_data_ptr<uint8_t>(), shard_numel, out.numel(),
                                c10::cuda::getCurrentCUDAStream()),
               "fp8_expand_");
}

void adamw_step_fp8_cuda(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                         at::Tensor& exp_avg_sq, const at::Tensor& step, double lr, double beta1,
                         double beta2, double weight_decay, double eps,
                         const std::optional<at::Tensor>& lr_tensor, at::Tensor& record) {
  check_adamw_fp8(param, grad, exp_avg, exp_avg_sq, step, lr_tensor, record);
  check_device(param, "adamw_step_fp8_", "param");
  check_scales_aligned(record, param.numel(), "adamw_step_fp8_");
  const c10::cuda::CUDAGuard guard(param.device());
  AdamWHyper h{};
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.weight_decay = weight_decay;
  h.eps = eps;
  h.step_ptr = device_scalar(step, param, &h.step, "step");
  if (lr_tensor.has_value()) h.lr_ptr = device_scalar(*lr_tensor, param, &h.lr, "lr_tensor");
  check_launch(cuda::adamw_fp8(param.data_ptr<float>(), grad.const_data_ptr(),
                               kernel_dtype(grad, "grad"), exp_avg.data_ptr<float>(),
                               exp_avg_sq.data_ptr<float>(), record.data_ptr<uint8_t>(),
                               param.numel(), h, c10::cuda::getCurrentCUDAStream()),
               "adamw_step_fp8_");
}

}  // namespace

TORCH_LIBRARY_IMPL(yafsdp, CUDA, m) {
  m.impl("adamw_step_", &adamw_step_cuda);
  m.impl("cast_", &cast_cuda);
  m.impl("accumulate_", &accumulate_cuda);
  m.impl("nf4_expand_", &nf4_expand_cuda);
  m.impl("fp8_quantize_", &fp8_quantize_cuda);
  m.impl("fp8_expand_", &fp8_expand_cuda);
  m.impl("adamw_step_fp8_", &adamw_step_fp8_cuda);
}

}  // namespace yafsdp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "yafsdp CUDA kernels, registered as the CUDA implementations of torch.ops.yafsdp.*";
}
