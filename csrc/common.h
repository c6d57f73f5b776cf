// Plain C++ shared by the CPU kernels, the CUDA kernels and their bindings.
// No torch headers here: the .cu files include this and must compile with nvcc alone.
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define YAFSDP_HOST_DEVICE __host__ __device__
#else
#define YAFSDP_HOST_DEVICE
#endif

namespace yafsdp {

// The element types the kernels read and write. fp32 is the master/state type;
// bf16 and fp16 are the compute (param_dtype) and reduce types.
enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
  }
  return "?";
}

// One AdamW update's scalar inputs, as the caller has them.
// lr and step may live in device memory (lr_ptr/step_ptr non-null) so that a
// CUDA step needs no host synchronisation; otherwise lr/step hold the values.
// `step` is the 1-based number of this update (the caller has already
// incremented its step counter), as in torch.optim.AdamW's bias correction.
// The scalars are doubles, as in torch.optim.AdamW's Python arithmetic, so the
// derived constants (bias corrections, step size) round the same way.
struct AdamWHyper {
  double lr;
  double beta1;
  double beta2;
  double weight_decay;
  double eps;
  double step;
  const float* lr_ptr;    // nullable: overrides lr; float32 in the kernel's memory space
  const float* step_ptr;  // nullable: overrides step; float32 in the kernel's memory space
};

// The float constants of one AdamW step, derived in double precision and rounded
// to float as torch.optim.AdamW does (see [Note: AdamW numerics] in
// cpu_kernels.cpp). Per element the kernels then compute
//   p = p * decay
//   m = fma(lerp_w, g - m, lerp_small ? m : g)         (exp_avg.lerp_(g, 1-b1))
//   v = fma(w2 * g, g, v * beta2)                       (exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2))
//   p = p + (neg_step * m) / (sqrt(v) / bc2_sqrt + eps) (param.addcdiv_(m, denom, -step_size))
struct AdamWConsts {
  float decay;      // 1 - lr*wd
  float lerp_w;     // w = 1-b1 if |w| < 0.5 (lerp_small), else w - 1
  bool lerp_small;
  float beta2;
  float w2;         // 1 - b2
  float bc2_sqrt;   // sqrt(1 - b2^t)
  float eps;
  float neg_step;   // -lr / (1 - b1^t)
};

// Reads lr_ptr/step_ptr when set: call it where that memory is readable.
YAFSDP_HOST_DEVICE inline AdamWConsts make_adamw_consts(const AdamWHyper& h) {
  const double lr = h.lr_ptr ? static_cast<double>(*h.lr_ptr) : h.lr;
  const double step = h.step_ptr ? static_cast<double>(*h.step_ptr) : h.step;
  AdamWConsts c;
  c.decay = static_cast<float>(1.0 - lr * h.weight_decay);
  const float w = static_cast<float>(1.0 - h.beta1);
  c.lerp_small = fabsf(w) < 0.5f;
  c.lerp_w = c.lerp_small ? w : w - 1.0f;
  c.beta2 = static_cast<float>(h.beta2);
  c.w2 = static_cast<float>(1.0 - h.beta2);
  const double bc1 = 1.0 - pow(h.beta1, step);
  const double bc2 = 1.0 - pow(h.beta2, step);
  c.bc2_sqrt = static_cast<float>(pow(bc2, 0.5));  // Python's `bc2 ** 0.5`
  c.eps = static_cast<float>(h.eps);
  c.neg_step = static_cast<float>(-(lr / bc1));
  return c;
}

// [Note: NF4 shard records]
// A compact (NF4) frozen group's shard, of shard_numel elements (a multiple of
// kNF4Block), is one byte record: the 4-bit codes packed two per byte (element 2k
// in the high nibble of byte k, 2k+1 in the low one: torchao's order), then one
// absmax scale per block of kNF4Block elements, stored in the gather dtype T.
// The all-gather of the records lands them end to end, rank after rank, in the
// weight buffer's staging area; the expand kernel writes element i of the group
// (rank i / shard_numel, position j = i % shard_numel in that rank's record) as
// T(float(codebook[code]) * float(scale)): the product is exact in fp32 for bf16
// and fp16 operands, so the one rounding is torch's `codebook[code] * scale` in T.
constexpr int64_t kNF4Block = 64;

YAFSDP_HOST_DEVICE inline int64_t nf4_record_bytes(int64_t shard_numel, int64_t scale_bytes) {
  return shard_numel / 2 + (shard_numel / kNF4Block) * scale_bytes;
}


// [Note: FP8 gather records]
// A trainable group gathered compact (YaFSDP(gather_dtype="fp8")) has, besides its fp32
// master shard of shard_numel elements (a multiple of kFP8Block), one byte record per
// rank: shard_numel e4m3fn codes (one byte each), then one float32 scale per block of
// kFP8Block elements. Quantizing a block of fp32 values x:
//   amax = max |x|;  s = amax / 448 (fp32 division);  code = e4m3(clamp(x / s, -448, 448))
// with x / s an fp32 division and e4m3() torch's round-to-nearest-even cast to
// float8_e4m3fn; a block whose amax is 0 keeps s = 0 and codes 0. Expanding writes
// T(float(code) * s): the product in fp32 (one rounding), then one rounding to T.
// The same arithmetic on the CPU, on CUDA and in the PyTorch twin: bit for bit.
// The values must be finite (a NaN or inf in the master makes its block NaN).
constexpr int64_t kFP8Block = 128;
constexpr float kFP8Max = 448.0f;

YAFSDP_HOST_DEVICE inline int64_t fp8_record_bytes(int64_t shard_numel) {
  return shard_numel + (shard_numel / kFP8Block) * 4;
}

YAFSDP_HOST_DEVICE inline uint32_t f32_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

YAFSDP_HOST_DEVICE inline float bits_to_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// fp32 -> float8_e4m3fn code, round to nearest even; x must already lie in
// [-448, 448] (the quantizer clamps); NaN -> 0x7F with x's sign, as torch.
YAFSDP_HOST_DEVICE inline uint8_t fp8_e4m3_from_float(float x) {
  const uint32_t u = f32_to_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7F;
  if (a < 0x3C800000u) {  // below 2^-6: a subnormal code, in units of 2^-9 (exact scaling)
    return sign | static_cast<uint8_t>(rintf(bits_to_f32(a) * 512.0f));  // 8 -> 2^-6, code 8
  }
  a += 0x7FFFFu + ((a >> 20) & 1u);  // round the 20 dropped mantissa bits to nearest even
  return sign | static_cast<uint8_t>((((a >> 23) - 120u) << 3) | ((a >> 20) & 7u));
}

YAFSDP_HOST_DEVICE inline float fp8_e4m3_to_float(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t e = (c >> 3) & 15u, m = c & 7u;
  if ((c & 0x7Fu) == 0x7Fu) return bits_to_f32(sign | 0x7FC00000u);
  if (e == 0) {
    const float f = static_cast<float>(m) * 0.001953125f;  // m * 2^-9, exact
    return sign ? -f : f;
  }
  return bits_to_f32(sign | ((e + 120u) << 23) | (m << 20));
}

// The dequantization scale of one block from its amax (0 for a zero block).
YAFSDP_HOST_DEVICE inline float fp8_scale(float amax) { return amax / kFP8Max; }

// One value of a block with scale s > 0 -> its code.
YAFSDP_HOST_DEVICE inline uint8_t fp8_quantize_one(float x, float s) {
  float q = x / s;
  q = q > kFP8Max ? kFP8Max : (q < -kFP8Max ? -kFP8Max : q);  // NaN passes through
  return fp8_e4m3_from_float(q);
}

}  // namespace yafsdp
