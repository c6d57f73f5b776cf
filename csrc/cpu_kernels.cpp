// CPU kernels: instruction-set dispatch, threading, and the scalar helpers.
//
// [Note: CPU instruction sets]
// The extension is compiled for the baseline x86-64 (no -march=native: a wheel or
// a CI cache may run on another machine). The loops in cpu_kernels_body.h are
// therefore compiled three times, each copy inside its own namespace under a
// target pragma: `avx512` (F/BW/VL/DQ), `avx2` (AVX2+FMA+F16C) and `scalar`. The
// best copy the CPU supports is chosen once, when the library loads; YAFSDP_CPU_ISA
// (avx512|avx2|scalar) picks a lower one, and tests run all of them through
// yafsdp._C.set_cpu_isa(). On other architectures only `scalar` exists and the
// compiler vectorises it as it can.
//
// [Note: AdamW numerics]
// torch.optim.AdamW(foreach=False) on fp32 runs, per element, with float scalars
// derived in double precision on the host:
//   p = p * (1 - lr*wd)
//   m = lerp(m, g, 1-b1)          vectorised as fmadd(w, g-m, m) for w < 0.5
//   v = v * b2;  v = fmadd((1-b2) * g, g, v)   (addcmul, as compiled into torch)
//   den = sqrt(v) / sqrt(1 - b2^t) + eps
//   p = p + ((-lr / (1 - b1^t)) * m) / den
// The kernels do the same operations in the same order, with the constants
// computed the same way (AdamWConsts in common.h). One difference remains:
// torch's CPU sqrt goes through MKL and is not correctly rounded (one ulp off for
// about a fifth of inputs), while ours is the IEEE sqrt. So exp_avg and exp_avg_sq
// match torch bit for bit and the param within a few ulps after many steps; the
// pure-PyTorch twin (yafsdp.kernels.adamw_step_reference) takes its sqrt in
// float64, which rounds to the IEEE float sqrt, and the kernels match it exactly.
// The compiler must not fuse other multiply-adds: -ffp-contract=off (setup.py).
//
// [Note: non-temporal stores]
// A copy-out or cast destination is written and not read again by this pass. A
// normal store first reads the destination line into the cache (write-allocate),
// which costs another sizeof(dst) bytes per element of memory traffic. Above
// kStreamMinBytes the kernels use non-temporal (streaming) stores, which skip
// that read; below it the destination likely stays in cache for the all-gather
// that reads it next, so normal stores are better.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#if defined(__GNUC__)
#define YAFSDP_X86_DISPATCH 1
#include <immintrin.h>
#endif
#endif

namespace yafsdp::cpu {
namespace {

// 16-bit storage types; the vector code converts them to and from fp32.
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};
struct NoOut {};  // "no copy-out" for the AdamW templates

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// Round to nearest even; NaN -> 0x7FC0, as c10::BFloat16.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7FFFu;
  if (em >= 0x7C00u) return bits_float(sign | 0x7F800000u | ((em & 0x3FFu) << 13));  // inf, NaN
  if (em < 0x400u) {  // zero, subnormal: em * 2^-24, exact in fp32
    const float f = static_cast<float>(em) * 5.9604644775390625e-08f;
    return sign ? -f : f;
  }
  return bits_float(sign | ((em << 13) + 0x38000000u));  // rebias 15 -> 127
}

// Round to nearest even, as IEEE conversion (F16C's vcvtps2ph) does.
inline uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00;       // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00;      // rounds to >= 65520: inf
  if (a < 0x38800000u) {                           // below 2^-14: subnormal half
    // Adding 0.5 puts the value's 2^-24 units into the low mantissa bits and
    // lets the FPU round them to nearest even.
    const float t = bits_float(a) + 0.5f;
    return sign | static_cast<uint16_t>(float_bits(t) - 0x3F000000u);
  }
  a += 0xFFFu + ((a >> 13) & 1u);  // round the 13 dropped bits to nearest even
  return sign | static_cast<uint16_t>((a - 0x38000000u) >> 13);
}

}  // namespace

// ----- the loops, once per instruction set (see [Note: CPU instruction sets]) -----

namespace isa_impl {
using yafsdp::DType;

#define YAFSDP_ISA_NS scalar
#include "cpu_kernels_body.h"
#undef YAFSDP_ISA_NS

#if defined(YAFSDP_X86_DISPATCH)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#define YAFSDP_ISA_NS avx2
#define YAFSDP_ISA_AVX2 1
#include "cpu_kernels_body.h"
#undef YAFSDP_ISA_AVX2
#undef YAFSDP_ISA_NS
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#if defined(__clang__)
#pragma clang attribute push(                                                              \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif
#define YAFSDP_ISA_NS avx512
#define YAFSDP_ISA_AVX512 1
#include "cpu_kernels_body.h"
#undef YAFSDP_ISA_AVX512
#undef YAFSDP_ISA_NS
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // YAFSDP_X86_DISPATCH
}  // namespace isa_impl

// ----- dispatch and threading -----

namespace {

using AdamWFn = void (*)(float*, const void*, DType, float*, float*, void*, DType, int64_t,
                         const AdamWConsts&, bool);
using CastFn = void (*)(void*, DType, const void*, DType, float, int64_t, bool);
using AccumulateFn = void (*)(float*, const void*, DType, float, int64_t);

struct Isa {
  const char* name;
  AdamWFn adamw;
  CastFn cast;
  AccumulateFn accumulate;
  bool (*supported)();
};

#if defined(YAFSDP_X86_DISPATCH)
bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
#endif
bool always() { return true; }

// Best first.
const Isa kIsas[] = {
#if defined(YAFSDP_X86_DISPATCH)
    {"avx512", isa_impl::avx512::adamw, isa_impl::avx512::cast, isa_impl::avx512::accumulate,
     has_avx512},
    {"avx2", isa_impl::avx2::adamw, isa_impl::avx2::cast, isa_impl::avx2::accumulate, has_avx2},
#endif
    {"scalar", isa_impl::scalar::adamw, isa_impl::scalar::cast, isa_impl::scalar::accumulate,
     always},
};
constexpr int kNumIsas = sizeof(kIsas) / sizeof(kIsas[0]);

int find_isa(const std::string& name) {
  for (int i = 0; i < kNumIsas; ++i) {
    if (name == kIsas[i].name) return i;
  }
  return -1;
}

int initial_isa() {
  if (const char* env = std::getenv("YAFSDP_CPU_ISA")) {
    const int i = find_isa(env);
    if (i >= 0 && kIsas[i].supported()) return i;
    // An unknown or unsupported name falls back to detection: the kernels still run.
  }
  for (int i = 0; i < kNumIsas; ++i) {
    if (kIsas[i].supported()) return i;
  }
  return kNumIsas - 1;
}

std::atomic<int> g_isa{initial_isa()};

const Isa& current() { return kIsas[g_isa.load(std::memory_order_relaxed)]; }

// Threads split a buffer into whole blocks: kBlock is a multiple of every vector
// width and of a cache line for every dtype, so no two threads write one line.
constexpr int64_t kBlock = 1024;
// At least this many blocks per thread (32K elements); smaller buffers run on
// the calling thread, where a parallel region would cost more than it saves.
constexpr int64_t kGrainBlocks = 32;
// See [Note: non-temporal stores].
constexpr int64_t kStreamMinBytes = int64_t{4} << 20;

template <class F>
void parallel_blocks(int64_t n, const F& f) {
  if (n <= 0) return;
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, nblocks, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    const int64_t begin = b0 * kBlock;
    const int64_t end = std::min(n, b1 * kBlock);
    if (end > begin) f(begin, end - begin);
  });
}

int64_t element_size(DType t) { return t == DType::kF32 ? 4 : 2; }

template <class T>
T* offset(T* p, int64_t elements, DType t) {
  using Byte = std::conditional_t<std::is_const_v<T>, const char, char>;
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(p) + elements * element_size(t));
}

}  // namespace

void adamw(float* param, const void* grad, DType grad_t, float* exp_avg, float* exp_avg_sq,
           void* copy_out, DType out_t, int64_t n, const AdamWHyper& h) {
  const AdamWConsts c = make_adamw_consts(h);
  const AdamWFn fn = current().adamw;
  const bool stream = copy_out != nullptr && n * element_size(out_t) >= kStreamMinBytes;
  parallel_blocks(n, [&](int64_t begin, int64_t count) {
    fn(param + begin, offset(grad, begin, grad_t), grad_t, exp_avg + begin, exp_avg_sq + begin,
       copy_out ? offset(copy_out, begin, out_t) : nullptr, out_t, count, c, stream);
  });
}

void cast(void* dst, DType dst_t, const void* src, DType src_t, double scale, int64_t n) {
  const float s = static_cast<float>(scale);
  if (dst_t == src_t && s == 1.0f) {
    parallel_blocks(n, [&](int64_t begin, int64_t count) {
      std::memcpy(offset(dst, begin, dst_t), offset(src, begin, src_t),
                  count * element_size(dst_t));
    });
    return;
  }
  const CastFn fn = current().cast;
  const bool stream = n * element_size(dst_t) >= kStreamMinBytes;
  parallel_blocks(n, [&](int64_t begin, int64_t count) {
    fn(offset(dst, begin, dst_t), dst_t, offset(src, begin, src_t), src_t, s, count, stream);
  });
}

void accumulate(float* dst, const void* src, DType src_t, double scale, int64_t n) {
  const AccumulateFn fn = current().accumulate;
  const float s = static_cast<float>(scale);
  parallel_blocks(n, [&](int64_t begin, int64_t count) {
    fn(dst + begin, offset(src, begin, src_t), src_t, s, count);
  });
}

// NF4 expand (see [Note: NF4 shard records] in common.h). Scalar: the kernel is
// bound by memory (0.53 bytes read, 2 written per element in bf16), and the compiler
// vectorises the inner loop as it can. One task per run of whole blocks.
namespace {

template <class T>
inline float nf4_load(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return *p;
  } else if constexpr (std::is_same_v<T, bf16>) {
    return bf16_to_float(p->bits);
  } else {
    return f16_to_float(p->bits);
  }
}

template <class T>
inline T nf4_store(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, bf16>) {
    return bf16{float_to_bf16(x)};
  } else {
    return f16{float_to_f16(x)};
  }
}

template <class T>
void nf4_expand_typed(T* out, const uint8_t* staging, const T* codebook, int64_t shard_numel,
                      int64_t n) {
  float code[16];
  for (int k = 0; k < 16; ++k) code[k] = nf4_load(codebook + k);
  const int64_t record = nf4_record_bytes(shard_numel, sizeof(T));
  const int64_t blocks_per_rank = shard_numel / kNF4Block;
  const int64_t nblocks = n / kNF4Block;
  at::parallel_for(0, nblocks, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = b / blocks_per_rank, jb = b % blocks_per_rank;
      const uint8_t* rec = staging + r * record;
      const uint8_t* data = rec + jb * (kNF4Block / 2);
      T scale_raw;
      std::memcpy(&scale_raw, rec + shard_numel / 2 + jb * sizeof(T), sizeof(T));
      const float scale = nf4_load(&scale_raw);
      T* o = out + b * kNF4Block;
      for (int64_t k = 0; k < kNF4Block / 2; ++k) {
        const uint8_t byte = data[k];
        o[2 * k] = nf4_store<T>(code[byte >> 4] * scale);
        o[2 * k + 1] = nf4_store<T>(code[byte & 15] * scale);
      }
    }
  });
}

}  // namespace

void nf4_expand(void* out, DType out_t, const uint8_t* staging, const void* codebook,
                int64_t shard_numel, int64_t n) {
  if (n <= 0) return;
  switch (out_t) {
    case DType::kF32:
      return nf4_expand_typed(static_cast<float*>(out), staging,
                              static_cast<const float*>(codebook), shard_numel, n);
    case DType::kBF16:
      return nf4_expand_typed(static_cast<bf16*>(out), staging,
                              static_cast<const bf16*>(codebook), shard_numel, n);
    case DType::kF16:
      return nf4_expand_typed(static_cast<f16*>(out), staging, static_cast<const f16*>(codebook),
                              shard_numel, n);
  }
}

// ----- FP8 gather records (see [Note: FP8 gather records] in common.h) -----
// Scalar code: quantize reads 4 bytes and writes ~1.03 per element, expand reads ~1.03
// and writes 2 (bf16); both are bound by memory and vectorised by the compiler as it can.
namespace {

// Blocks [b0, b1) of fp32 values src (block b at src + b * kFP8Block) -> codes/scales.
void fp8_quantize_blocks(uint8_t* codes, uint8_t* scales, const float* src, int64_t b0,
                         int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const float* x = src + b * kFP8Block;
    uint8_t* c = codes + b * kFP8Block;
    float amax = 0.0f;
    for (int64_t k = 0; k < kFP8Block; ++k) amax = std::max(amax, std::fabs(x[k]));
    const float s = fp8_scale(amax);
    std::memcpy(scales + b * 4, &s, 4);
    if (s == 0.0f) {
      std::memset(c, 0, kFP8Block);
      continue;
    }
    for (int64_t k = 0; k < kFP8Block; ++k) c[k] = fp8_quantize_one(x[k], s);
  }
}

template <class T>
void fp8_expand_typed(T* out, const uint8_t* staging, int64_t shard_numel, int64_t n) {
  const int64_t record = fp8_record_bytes(shard_numel);
  const int64_t blocks_per_rank = shard_numel / kFP8Block;
  const int64_t nblocks = n / kFP8Block;
  float table[256];  // every code's value
  for (int k = 0; k < 256; ++k) table[k] = fp8_e4m3_to_float(static_cast<uint8_t>(k));
  at::parallel_for(0, nblocks, 128, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = b / blocks_per_rank, jb = b % blocks_per_rank;
      const uint8_t* rec = staging + r * record;
      const uint8_t* c = rec + jb * kFP8Block;
      float s;
      std::memcpy(&s, rec + shard_numel + jb * 4, 4);
      T* o = out + b * kFP8Block;
      for (int64_t k = 0; k < kFP8Block; ++k) o[k] = nf4_store<T>(table[c[k]] * s);
    }
  });
}

}  // namespace

void fp8_quantize(uint8_t* record, const float* src, int64_t n) {
  const int64_t nblocks = n / kFP8Block;
  at::parallel_for(0, nblocks, 128, [&](int64_t b0, int64_t b1) {
    fp8_quantize_blocks(record, record + n, src, b0, b1);
  });
}

void fp8_expand(void* out, DType out_t, const uint8_t* staging, int64_t shard_numel, int64_t n) {
  if (n <= 0) return;
  switch (out_t) {
    case DType::kF32:
      return fp8_expand_typed(static_cast<float*>(out), staging, shard_numel, n);
    case DType::kBF16:
      return fp8_expand_typed(static_cast<bf16*>(out), staging, shard_numel, n);
    case DType::kF16:
      return fp8_expand_typed(static_cast<f16*>(out), staging, shard_numel, n);
  }
}

void adamw_fp8(float* param, const void* grad, DType grad_t, float* exp_avg, float* exp_avg_sq,
               uint8_t* record, int64_t n, const AdamWHyper& h) {
  const AdamWConsts c = make_adamw_consts(h);
  const AdamWFn fn = current().adamw;
  static_assert(kBlock % kFP8Block == 0, "a thread's run of elements must be whole FP8 blocks");
  parallel_blocks(n, [&](int64_t begin, int64_t count) {
    // kBlock elements at a time: stepped by the AdamW loop, then quantized from the cache.
    for (int64_t i = begin; i < begin + count; i += kBlock) {
      const int64_t len = std::min(kBlock, begin + count - i);
      fn(param + i, offset(grad, i, grad_t), grad_t, exp_avg + i, exp_avg_sq + i, nullptr,
         DType::kF32, len, c, false);
      fp8_quantize_blocks(record, record + n, param, i / kFP8Block, (i + len) / kFP8Block);
    }
  });
}

std::string isa() { return current().name; }

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const Isa& i : kIsas) {
    if (i.supported()) out.emplace_back(i.name);
  }
  return out;
}

void set_isa(const std::string& name) {
  const int i = find_isa(name);
  if (i < 0 || !kIsas[i].supported()) {
    std::string have;
    for (const std::string& s : supported_isas()) have += (have.empty() ? "" : ", ") + s;
    throw std::invalid_argument("yafsdp: CPU instruction set '" + name +
                                "' is not available here; supported: " + have);
  }
  g_isa.store(i, std::memory_order_relaxed);
}

}  // namespace yafsdp::cpu
