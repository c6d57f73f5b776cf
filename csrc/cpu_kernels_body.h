// The CPU kernels' loops, written once over a small vector type `Vec`.
//
// No include guard: cpu_kernels.cpp includes this file once per instruction set,
// each time inside its own namespace (YAFSDP_ISA_NS) and under a target pragma.
// See [Note: CPU instruction sets] in cpu_kernels.cpp.
//
// Numerics follow torch's vectorised CPU kernels op by op (see [Note: AdamW
// numerics] in cpu_kernels.cpp), so results match torch.optim.AdamW(foreach=False)
// to the last bit or within one rounding.

namespace YAFSDP_ISA_NS {

#if defined(YAFSDP_ISA_AVX512)

struct Vec {
  using V = __m512;
  static constexpr int W = 16;
  static inline V set1(float x) { return _mm512_set1_ps(x); }
  static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  static inline V load(const bf16* p) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  }
  static inline V load(const f16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // fp32 -> bf16, round to nearest even; NaN -> 0x7FC0 (as c10::BFloat16 does).
  static inline __m256i to_bf16(V x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }
  static inline __m256i to_f16(V x) {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static inline void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static inline void store(bf16* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x));
  }
  static inline void store(f16* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_f16(x));
  }
  // Non-temporal stores: the pointer is aligned to W * sizeof(T) bytes.
  static inline void stream(float* p, V x) { _mm512_stream_ps(p, x); }
  static inline void stream(bf16* p, V x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_bf16(x));
  }
  static inline void stream(f16* p, V x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_f16(x));
  }
  static inline void fence() { _mm_sfence(); }
  static inline V add(V a, V b) { return _mm512_add_ps(a, b); }
  static inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static inline V div(V a, V b) { return _mm512_div_ps(a, b); }
  static inline V sqrt(V a) { return _mm512_sqrt_ps(a); }
  static inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }  // a*b+c, one rounding
};

#elif defined(YAFSDP_ISA_AVX2)

struct Vec {
  using V = __m256;
  static constexpr int W = 8;
  static inline V set1(float x) { return _mm256_set1_ps(x); }
  static inline V load(const float* p) { return _mm256_loadu_ps(p); }
  static inline V load(const bf16* p) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  static inline V load(const f16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline __m128i to_bf16(V x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // Every lane is in [0, 0xFFFF], so the unsigned-saturating pack is exact.
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  static inline __m128i to_f16(V x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }
  static inline void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static inline void store(bf16* p, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(x));
  }
  static inline void store(f16* p, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_f16(x));
  }
  static inline void stream(float* p, V x) { _mm256_stream_ps(p, x); }
  static inline void stream(bf16* p, V x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_bf16(x));
  }
  static inline void stream(f16* p, V x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_f16(x));
  }
  static inline void fence() { _mm_sfence(); }
  static inline V add(V a, V b) { return _mm256_add_ps(a, b); }
  static inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static inline V div(V a, V b) { return _mm256_div_ps(a, b); }
  static inline V sqrt(V a) { return _mm256_sqrt_ps(a); }
  static inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
};

#else  // portable scalar code, one element at a time

struct Vec {
  using V = float;
  static constexpr int W = 1;
  static inline V set1(float x) { return x; }
  static inline V load(const float* p) { return *p; }
  static inline V load(const bf16* p) { return bf16_to_float(p->bits); }
  static inline V load(const f16* p) { return f16_to_float(p->bits); }
  static inline void store(float* p, V x) { *p = x; }
  static inline void store(bf16* p, V x) { p->bits = float_to_bf16(x); }
  static inline void store(f16* p, V x) { p->bits = float_to_f16(x); }
  template <class T>
  static inline void stream(T* p, V x) { store(p, x); }
  static inline void fence() {}
  static inline V add(V a, V b) { return a + b; }
  static inline V sub(V a, V b) { return a - b; }
  static inline V mul(V a, V b) { return a * b; }
  static inline V div(V a, V b) { return a / b; }
  static inline V sqrt(V a) { return std::sqrt(a); }
  static inline V fmadd(V a, V b, V c) { return std::fma(a, b, c); }
};

#endif

constexpr int W = Vec::W;
using V = Vec::V;

// Elements from p until p is aligned for a non-temporal store of one vector.
template <class T>
inline int64_t head_to_stream_alignment(const T* p, int64_t n) {
  constexpr uintptr_t A = sizeof(T) * W;
  const uintptr_t mis = reinterpret_cast<uintptr_t>(p) % A;
  const int64_t head = mis == 0 ? 0 : static_cast<int64_t>((A - mis) / sizeof(T));
  return head < n ? head : n;
}

// ---------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------

struct AdamWVec {
  V decay, lerp_w, beta2, w2, bc2_sqrt, eps, neg_step;
  bool lerp_small;
  explicit AdamWVec(const AdamWConsts& c)
      : decay(Vec::set1(c.decay)),
        lerp_w(Vec::set1(c.lerp_w)),
        beta2(Vec::set1(c.beta2)),
        w2(Vec::set1(c.w2)),
        bc2_sqrt(Vec::set1(c.bc2_sqrt)),
        eps(Vec::set1(c.eps)),
        neg_step(Vec::set1(c.neg_step)),
        lerp_small(c.lerp_small) {}
};

// One vector of W elements. O is NoOut when there is no copy-out.
template <class G, class O, bool kStream>
inline void adamw_vec(float* p, const G* g, float* m, float* v, O* out, const AdamWVec& c) {
  V pv = Vec::load(p);
  const V gv = Vec::load(g);
  V mv = Vec::load(m);
  V vv = Vec::load(v);
  pv = Vec::mul(pv, c.decay);                                  // param.mul_(1 - lr*wd)
  mv = Vec::fmadd(c.lerp_w, Vec::sub(gv, mv), c.lerp_small ? mv : gv);  // exp_avg.lerp_(g, 1-b1)
  vv = Vec::mul(vv, c.beta2);                                  // exp_avg_sq.mul_(b2)
  vv = Vec::fmadd(Vec::mul(c.w2, gv), gv, vv);                 //   .addcmul_(g, g, 1-b2)
  const V den = Vec::add(Vec::div(Vec::sqrt(vv), c.bc2_sqrt), c.eps);
  pv = Vec::add(pv, Vec::div(Vec::mul(c.neg_step, mv), den));  // param.addcdiv_(m, den, -step_size)
  Vec::store(p, pv);
  Vec::store(m, mv);
  Vec::store(v, vv);
  if constexpr (!std::is_same_v<O, NoOut>) {
    if constexpr (kStream) {
      Vec::stream(out, pv);
    } else {
      Vec::store(out, pv);
    }
  }
}

// Fewer than W elements: run the same vector code on a padded copy, so a
// tensor's last elements round exactly like the others.
template <class G, class O>
inline void adamw_partial(float* p, const G* g, float* m, float* v, O* out, int64_t n,
                          const AdamWVec& c) {
  float pb[W] = {}, mb[W] = {}, vb[W] = {};
  G gb[W] = {};
  O ob[W] = {};
  for (int64_t i = 0; i < n; ++i) {
    pb[i] = p[i];
    gb[i] = g[i];
    mb[i] = m[i];
    vb[i] = v[i];
  }
  adamw_vec<G, O, false>(pb, gb, mb, vb, ob, c);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = pb[i];
    m[i] = mb[i];
    v[i] = vb[i];
    if constexpr (!std::is_same_v<O, NoOut>) out[i] = ob[i];
  }
}

template <class G, class O>
void adamw_range(float* p, const G* g, float* m, float* v, O* out, int64_t n,
                 const AdamWConsts& consts, bool stream) {
  const AdamWVec c(consts);
  int64_t i = 0;
  if constexpr (!std::is_same_v<O, NoOut>) {
    if (stream && W > 1) {
      const int64_t head = head_to_stream_alignment(out, n);
      if (head > 0) adamw_partial(p, g, m, v, out, head, c);
      for (i = head; i + W <= n; i += W) {
        adamw_vec<G, O, true>(p + i, g + i, m + i, v + i, out + i, c);
      }
      Vec::fence();
    }
  }
  for (; i + W <= n; i += W) {
    if constexpr (std::is_same_v<O, NoOut>) {
      adamw_vec<G, O, false>(p + i, g + i, m + i, v + i, out, c);
    } else {
      adamw_vec<G, O, false>(p + i, g + i, m + i, v + i, out + i, c);
    }
  }
  if (i < n) {
    if constexpr (std::is_same_v<O, NoOut>) {
      adamw_partial(p + i, g + i, m + i, v + i, out, n - i, c);
    } else {
      adamw_partial(p + i, g + i, m + i, v + i, out + i, n - i, c);
    }
  }
}

template <class G>
void adamw_out(float* p, const G* g, float* m, float* v, void* out, DType out_t, int64_t n,
               const AdamWConsts& c, bool stream) {
  if (out == nullptr) {
    NoOut none[W];
    adamw_range<G, NoOut>(p, g, m, v, none, n, c, false);
    return;
  }
  switch (out_t) {
    case DType::kF32: return adamw_range(p, g, m, v, static_cast<float*>(out), n, c, stream);
    case DType::kBF16: return adamw_range(p, g, m, v, static_cast<bf16*>(out), n, c, stream);
    case DType::kF16: return adamw_range(p, g, m, v, static_cast<f16*>(out), n, c, stream);
  }
}

void adamw(float* p, const void* g, DType grad_t, float* m, float* v, void* out, DType out_t,
           int64_t n, const AdamWConsts& c, bool stream) {
  switch (grad_t) {
    case DType::kF32:
      return adamw_out(p, static_cast<const float*>(g), m, v, out, out_t, n, c, stream);
    case DType::kBF16:
      return adamw_out(p, static_cast<const bf16*>(g), m, v, out, out_t, n, c, stream);
    case DType::kF16:
      return adamw_out(p, static_cast<const f16*>(g), m, v, out, out_t, n, c, stream);
  }
}

// ---------------------------------------------------------------------------
// cast: dst = src * scale, converted (fp32 master -> param_dtype compute copy with
// scale 1; reduce output -> fp32 grad shard with scale 1/world). The product is
// taken in fp32, then rounded once to dst's dtype.
// ---------------------------------------------------------------------------

template <bool kScale, class S>
inline V load_scaled(const S* src, V s) {
  if constexpr (kScale) {
    return Vec::mul(Vec::load(src), s);
  } else {
    return Vec::load(src);
  }
}

template <bool kScale, class D, class S>
void cast_range(D* dst, const S* src, float scale, int64_t n, bool stream) {
  const V s = Vec::set1(scale);
  int64_t i = 0;
  if (stream && W > 1) {
    const int64_t head = head_to_stream_alignment(dst, n);
    for (; i < head; ++i) {
      D db[W] = {};
      S sb[W] = {};
      sb[0] = src[i];
      Vec::store(db, load_scaled<kScale>(sb, s));
      dst[i] = db[0];
    }
    for (; i + W <= n; i += W) Vec::stream(dst + i, load_scaled<kScale>(src + i, s));
    Vec::fence();
  }
  for (; i + W <= n; i += W) Vec::store(dst + i, load_scaled<kScale>(src + i, s));
  if (i < n) {
    D db[W] = {};
    S sb[W] = {};
    for (int64_t j = 0; j < n - i; ++j) sb[j] = src[i + j];
    Vec::store(db, load_scaled<kScale>(sb, s));
    for (int64_t j = 0; j < n - i; ++j) dst[i + j] = db[j];
  }
}

template <class D, class S>
void cast_scaled(D* dst, const S* src, float scale, int64_t n, bool stream) {
  if (scale == 1.0f) {
    cast_range<false>(dst, src, scale, n, stream);  // a pure conversion, bit for bit
  } else {
    cast_range<true>(dst, src, scale, n, stream);
  }
}

template <class D>
void cast_from(D* dst, const void* src, DType src_t, float scale, int64_t n, bool stream) {
  switch (src_t) {
    case DType::kF32: return cast_scaled(dst, static_cast<const float*>(src), scale, n, stream);
    case DType::kBF16: return cast_scaled(dst, static_cast<const bf16*>(src), scale, n, stream);
    case DType::kF16: return cast_scaled(dst, static_cast<const f16*>(src), scale, n, stream);
  }
}

void cast(void* dst, DType dst_t, const void* src, DType src_t, float scale, int64_t n,
          bool stream) {
  switch (dst_t) {
    case DType::kF32: return cast_from(static_cast<float*>(dst), src, src_t, scale, n, stream);
    case DType::kBF16: return cast_from(static_cast<bf16*>(dst), src, src_t, scale, n, stream);
    case DType::kF16: return cast_from(static_cast<f16*>(dst), src, src_t, scale, n, stream);
  }
}

// ---------------------------------------------------------------------------
// accumulate: dst(fp32) += src * scale (reduce output -> grad shard)
// ---------------------------------------------------------------------------

template <class S>
void accumulate_range(float* dst, const S* src, float scale, int64_t n) {
  const V s = Vec::set1(scale);
  int64_t i = 0;
  // dst.add_(src, alpha=scale): torch's vectorised add is fmadd(src, alpha, dst).
  for (; i + W <= n; i += W) {
    Vec::store(dst + i, Vec::fmadd(Vec::load(src + i), s, Vec::load(dst + i)));
  }
  if (i < n) {
    float db[W] = {};
    S sb[W] = {};
    for (int64_t j = 0; j < n - i; ++j) {
      db[j] = dst[i + j];
      sb[j] = src[i + j];
    }
    Vec::store(db, Vec::fmadd(Vec::load(sb), s, Vec::load(db)));
    for (int64_t j = 0; j < n - i; ++j) dst[i + j] = db[j];
  }
}

void accumulate(float* dst, const void* src, DType src_t, float scale, int64_t n) {
  switch (src_t) {
    case DType::kF32: return accumulate_range(dst, static_cast<const float*>(src), scale, n);
    case DType::kBF16: return accumulate_range(dst, static_cast<const bf16*>(src), scale, n);
    case DType::kF16: return accumulate_range(dst, static_cast<const f16*>(src), scale, n);
  }
}

}  // namespace YAFSDP_ISA_NS
