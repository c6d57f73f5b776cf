// yafsdp's operators: schemas (registered once, here), CPU and Meta implementations,
// and the Python module `yafsdp._C`. The CUDA implementations live in
// cuda_binding.cpp (module `yafsdp._C_cuda`, built only where torch has CUDA).
//
// All three ops mutate their first arguments in place and return nothing, so
// torch.compile can functionalise them (mutated arguments are marked `(a!)`).
// Like torch's own in-place ops they bump the version counter of what they
// mutate (the ADInplaceOrView kernels below): autograd and the engine's
// "compute copy is current" check (param._version) both rely on it.

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/TensorImpl.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/library.h>


#include "checks.h"
#include "cpu_kernels.h"

namespace yafsdp {
namespace {

double read_scalar(const at::Tensor& t) {
  if (t.is_cpu() && t.scalar_type() == at::kFloat) return *t.const_data_ptr<float>();
  return t.item<double>();  // another dtype or device: a host read
}

void adamw_step_cpu(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                    at::Tensor& exp_avg_sq, const at::Tensor& step, double lr, double beta1,
                    double beta2, double weight_decay, double eps,
                    const std::optional<at::Tensor>& lr_tensor,
                    const std::optional<at::Tensor>& copy_out) {
  check_adamw(param, grad, exp_avg, exp_avg_sq, step, lr_tensor, copy_out);
  TORCH_CHECK(param.is_cpu(), "yafsdp: adamw_step_ CPU kernel got param on ", param.device());
  AdamWHyper h{};
  h.lr = lr_tensor.has_value() ? read_scalar(*lr_tensor) : lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.weight_decay = weight_decay;
  h.eps = eps;
  h.step = read_scalar(step);
  void* out = copy_out.has_value() ? copy_out->data_ptr() : nullptr;
  const DType out_t = copy_out.has_value() ? kernel_dtype(*copy_out, "copy_out") : DType::kF32;
  cpu::adamw(param.data_ptr<float>(), grad.const_data_ptr(), kernel_dtype(grad, "grad"),
             exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), out, out_t, param.numel(),
             h);
}

void cast_cpu(at::Tensor& dst, const at::Tensor& src, double scale) {
  check_cast(dst, src);
  TORCH_CHECK(dst.is_cpu(), "yafsdp: cast_ CPU kernel got dst on ", dst.device());
  cpu::cast(dst.data_ptr(), kernel_dtype(dst, "dst"), src.const_data_ptr(),
            kernel_dtype(src, "src"), scale, dst.numel());
}

void accumulate_cpu(at::Tensor& dst, const at::Tensor& src, double scale) {
  check_accumulate(dst, src);
  TORCH_CHECK(dst.is_cpu(), "yafsdp: accumulate_ CPU kernel got dst on ", dst.device());
  cpu::accumulate(dst.data_ptr<float>(), src.const_data_ptr(), kernel_dtype(src, "src"), scale,
                  dst.numel());
}

void nf4_expand_cpu(at::Tensor& out, const at::Tensor& staging, const at::Tensor& codebook,
                    int64_t shard_numel) {
  check_nf4_expand(out, staging, codebook, shard_numel);
  TORCH_CHECK(out.is_cpu(), "yafsdp: nf4_expand_ CPU kernel got out on ", out.device());
  cpu::nf4_expand(out.data_ptr(), kernel_dtype(out, "out"), staging.const_data_ptr<uint8_t>(),
                  codebook.const_data_ptr(), shard_numel, out.numel());
}

void fp8_quantize_cpu(at::Tensor& record, const at::Tensor& src) {
  check_fp8_quantize(record, src);
  TORCH_CHECK(src.is_cpu(), "yafsdp: fp8_quantize_ CPU kernel got src on ", src.device());
  cpu::fp8_quantize(record.data_ptr<uint8_t>(), src.const_data_ptr<float>(), src.numel());
}

void fp8_expand_cpu(at::Tensor& out, const at::Tensor& staging, int64_t shard_numel) {
  check_fp8_expand(out, staging, shard_numel);
  TORCH_CHECK(out.is_cpu(), "yafsdp: fp8_expand_ CPU kernel got out on ", out.device());
  cpu::fp8_expand(out.data_ptr(), kernel_dtype(out, "out"), staging.const_data_ptr<uint8_t>(),
                  shard_numel, out.numel());
}

void adamw_step_fp8_cpu(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                        at::Tensor& exp_avg_sq, const at::Tensor& step, double lr, double beta1,
                        double beta2, double weight_decay, double eps,
                        const std::optional<at::Tensor>& lr_tensor, at::Tensor& record) {
  check_adamw_fp8(param, grad, exp_avg, exp_avg_sq, step, lr_tensor, record);
  TORCH_CHECK(param.is_cpu(), "yafsdp: adamw_step_fp8_ CPU kernel got param on ", param.device());
  AdamWHyper h{};
  h.lr = lr_tensor.has_value() ? read_scalar(*lr_tensor) : lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.weight_decay = weight_decay;
  h.eps = eps;
  h.step = read_scalar(step);
  cpu::adamw_fp8(param.data_ptr<float>(), grad.const_data_ptr(), kernel_dtype(grad, "grad"),
                 exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                 record.data_ptr<uint8_t>(), param.numel(), h);
}

// Meta: the ops return nothing, so shape inference is only the checks.
void adamw_step_meta(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                     at::Tensor& exp_avg_sq, const at::Tensor& step, double, double, double,
                     double, double, const std::optional<at::Tensor>& lr_tensor,
                     const std::optional<at::Tensor>& copy_out) {
  check_adamw(param, grad, exp_avg, exp_avg_sq, step, lr_tensor, copy_out);
}

void cast_meta(at::Tensor& dst, const at::Tensor& src, double) { check_cast(dst, src); }

void accumulate_meta(at::Tensor& dst, const at::Tensor& src, double) {
  check_accumulate(dst, src);
}

void nf4_expand_meta(at::Tensor& out, const at::Tensor& staging, const at::Tensor& codebook,
                     int64_t shard_numel) {
  check_nf4_expand(out, staging, codebook, shard_numel);
}

void fp8_quantize_meta(at::Tensor& record, const at::Tensor& src) { check_fp8_quantize(record, src); }

void fp8_expand_meta(at::Tensor& out, const at::Tensor& staging, int64_t shard_numel) {
  check_fp8_expand(out, staging, shard_numel);
}

void adamw_step_fp8_meta(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                         at::Tensor& exp_avg_sq, const at::Tensor& step, double, double, double,
                         double, double, const std::optional<at::Tensor>& lr_tensor,
                         at::Tensor& record) {
  check_adamw_fp8(param, grad, exp_avg, exp_avg_sq, step, lr_tensor, record);
}

// ADInplaceOrView: run the backend kernel, then bump the mutated tensors' versions.
void bump(const at::Tensor& t) { t.unsafeGetTensorImpl()->bump_version(); }

void adamw_step_inplace(c10::DispatchKeySet ks, at::Tensor& param, const at::Tensor& grad,
                        at::Tensor& exp_avg, at::Tensor& exp_avg_sq, const at::Tensor& step,
                        double lr, double beta1, double beta2, double weight_decay, double eps,
                        const std::optional<at::Tensor>& lr_tensor,
                        const std::optional<at::Tensor>& copy_out) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("yafsdp::adamw_step_", "")
                             .typed<decltype(adamw_step_cpu)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(ks & c10::after_ADInplaceOrView_keyset, param, grad, exp_avg, exp_avg_sq, step,
                  lr, beta1, beta2, weight_decay, eps, lr_tensor, copy_out);
  }
  bump(param);
  bump(exp_avg);
  bump(exp_avg_sq);
  if (copy_out.has_value()) bump(*copy_out);
}

void cast_inplace(c10::DispatchKeySet ks, at::Tensor& dst, const at::Tensor& src,
                  double scale) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("yafsdp::cast_", "").typed<decltype(cast_cpu)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(ks & c10::after_ADInplaceOrView_keyset, dst, src, scale);
  }
  bump(dst);
}

void accumulate_inplace(c10::DispatchKeySet ks, at::Tensor& dst, const at::Tensor& src,
                        double scale) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("yafsdp::accumulate_", "")
                             .typed<decltype(accumulate_cpu)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(ks & c10::after_ADInplaceOrView_keyset, dst, src, scale);
  }
  bump(dst);
}

void nf4_expand_inplace(c10::DispatchKeySet ks, at::Tensor& out, const at::Tensor& staging,
                        const at::Tensor& codebook, int64_t shard_numel) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("yafsdp::nf4_expand_", "")
                             .typed<decltype(nf4_expand_cpu)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(ks & c10::after_ADInplaceOrView_keyset, out, staging, codebook, shard_numel);
  }
  bump(out);
}

void fp8_quantize_inplace(c10::DispatchKeySet ks, at::Tensor& record, const at::Tensor& src) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("yafsdp::fp8_quantize_", "")
                             .typed<decltype(fp8_quantize_cpu)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(ks & c10::after_ADInplaceOrView_keyset, record, src);
  }
  bump(record);
}

void fp8_expand_inplace(c10::DispatchKeySet ks, at::Tensor& out, const at::Tensor& staging,
                        int64_t shard_numel) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("yafsdp::fp8_expand_", "")
                             .typed<decltype(fp8_expand_cpu)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(ks & c10::after_ADInplaceOrView_keyset, out, staging, shard_numel);
  }
  bump(out);
}

void adamw_step_fp8_inplace(c10::DispatchKeySet ks, at::Tensor& param, const at::Tensor& grad,
                            at::Tensor& exp_avg, at::Tensor& exp_avg_sq, const at::Tensor& step,
                            double lr, double beta1, double beta2, double weight_decay, double eps,
                            const std::optional<at::Tensor>& lr_tensor, at::Tensor& record) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("yafsdp::adamw_step_fp8_", "")
                             .typed<decltype(adamw_step_fp8_cpu)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(ks & c10::after_ADInplaceOrView_keyset, param, grad, exp_avg, exp_avg_sq, step,
                  lr, beta1, beta2, weight_decay, eps, lr_tensor, record);
  }
  bump(param);
  bump(exp_avg);
  bump(exp_avg_sq);
  bump(record);
}

}  // namespace

TORCH_LIBRARY(yafsdp, m) {
  // One AdamW step (torch.optim.AdamW semantics, decoupled weight decay) over a flat
  // fp32 buffer; `step` is this update's 1-based number (the caller increments it);
  // `lr_tensor`, when given, overrides `lr`; `copy_out`, when given, receives the
  // updated param in its dtype (the next all-gather input) in the same pass.
  m.def(
      "adamw_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor step, float lr, float beta1, float beta2, float weight_decay, float eps, "
      "Tensor? lr_tensor=None, Tensor(d!)? copy_out=None) -> ()");
  // dst = src * scale, converted to dst's dtype: the product in fp32, one rounding.
  // fp32 master shard -> param_dtype compute copy (scale 1: a pure conversion), and
  // reduce output -> fp32 grad shard (scale 1/world).
  m.def("cast_(Tensor(a!) dst, Tensor src, float scale=1.0) -> ()");
  // dst(fp32) += src * scale (reduce-scatter output -> grad shard).
  m.def("accumulate_(Tensor(a!) dst, Tensor src, float scale) -> ()");
  // out = the NF4 group expanded from `world` byte records (packed codes + absmax
  // scales) laid end to end in staging: out[i] = codebook[code] * scale in out's
  // dtype. See [Note: NF4 shard records] in common.h.
  m.def("nf4_expand_(Tensor(a!) out, Tensor staging, Tensor codebook, int shard_numel) -> ()");
  // FP8 gather records (see [Note: FP8 gather records] in common.h): the record (e4m3
  // codes, then one float32 scale per 128 values) of float32 src; the values of `world`
  // records laid end to end in staging; and the AdamW step whose copy-out is the record.
  m.def("fp8_quantize_(Tensor(a!) record, Tensor src) -> ()");
  m.def("fp8_expand_(Tensor(a!) out, Tensor staging, int shard_numel) -> ()");
  m.def(
      "adamw_step_fp8_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor step, float lr, float beta1, float beta2, float weight_decay, float eps, "
      "Tensor? lr_tensor, Tensor(d!) record) -> ()");
}

TORCH_LIBRARY_IMPL(yafsdp, CPU, m) {
  m.impl("adamw_step_", &adamw_step_cpu);
  m.impl("cast_", &cast_cpu);
  m.impl("accumulate_", &accumulate_cpu);
  m.impl("nf4_expand_", &nf4_expand_cpu);
  m.impl("fp8_quantize_", &fp8_quantize_cpu);
  m.impl("fp8_expand_", &fp8_expand_cpu);
  m.impl("adamw_step_fp8_", &adamw_step_fp8_cpu);
}

TORCH_LIBRARY_IMPL(yafsdp, ADInplaceOrView, m) {
  m.impl("adamw_step_", TORCH_FN(adamw_step_inplace));
  m.impl("cast_", TORCH_FN(cast_inplace));
  m.impl("accumulate_", TORCH_FN(accumulate_inplace));
  m.impl("nf4_expand_", TORCH_FN(nf4_expand_inplace));
  m.impl("fp8_quantize_", TORCH_FN(fp8_quantize_inplace));
  m.impl("fp8_expand_", TORCH_FN(fp8_expand_inplace));
  m.impl("adamw_step_fp8_", TORCH_FN(adamw_step_fp8_inplace));
}

TORCH_LIBRARY_IMPL(yafsdp, Meta, m) {
  m.impl("adamw_step_", &adamw_step_meta);
  m.impl("cast_", &cast_meta);
  m.impl("accumulate_", &accumulate_meta);
  m.impl("nf4_expand_", &nf4_expand_meta);
  m.impl("fp8_quantize_", &fp8_quantize_meta);
  m.impl("fp8_expand_", &fp8_expand_meta);
  m.impl("adamw_step_fp8_", &adamw_step_fp8_meta);
}

}  // namespace yafsdp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "yafsdp CPU kernels; the operators are torch.ops.yafsdp.*";
  m.def("cpu_isa", &yafsdp::cpu::isa,
        "The instruction set the CPU kernels use: avx512, avx2 or scalar.");
  m.def("supported_cpu_isas", &yafsdp::cpu::supported_isas,
        "The instruction sets this CPU supports, best first.");
  m.def("set_cpu_isa", &yafsdp::cpu::set_isa,
        "Use another supported instruction set (tests, benchmarks).");
}
