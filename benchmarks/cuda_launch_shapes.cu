// Launch shapes of the two memory-bound hot-path kernels, timed on their own (no torch, no dispatch):
// the cast fp32 -> bf16 (csrc/copy_cuda.cu) and AdamW with the bf16 copy-out (csrc/adamw_cuda.cu), each
// with VEC elements per vector access, UNR packs loaded per thread before any is stored, and the grid
// capped at `cap` blocks per SM (the extension's grid_for: 8) or not capped (0), against a device memcpy.
// Every variant's output is compared with the first one's, bit for bit ("same"). The last three rows time
// the extension's shape as FusedAdamW calls it (no copy-out; the step count read from device memory), to set
// against bench_optimizer.py's figures for the same elements.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc -o /tmp/launch_shapes benchmarks/cuda_launch_shapes.cu && /tmp/launch_shapes
//
// Result on an H200 (benchmarks/results/gpu_2026-11-27/launch_shapes_h200_2026-11-27.txt): the extension's
// shape is within 7 % of the best one for the cast and 2 % for AdamW (both 0.96x the memcpy's bandwidth);
// benchmarks/gpu_suite.sh part2 runs it (step launch-shapes); tests/gpu/test_gpu_suite.py compiles it
// wherever nvcc is installed. The exit status is 1 when a variant's result differs or CUDA reported an error.
#include <cstdio>
#include <vector>
#include <algorithm>
#include "cuda_common.cuh"
using namespace yafsdp;
using namespace yafsdp::cuda;

template <int VEC, int UNR>
__global__ void __launch_bounds__(kThreads) cast_v(__nv_bfloat16* __restrict__ d, const float* __restrict__ s, int64_t n) {
  const int64_t tile = (int64_t)kThreads * VEC * UNR;
  for (int64_t b = (int64_t)blockIdx.x * tile; b < n; b += (int64_t)gridDim.x * tile) {
    Pack<float, VEC> in[UNR];
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
      const int64_t i = b + ((int64_t)u * kThreads + threadIdx.x) * VEC;
      if (i + VEC <= n) in[u] = load_pack<VEC>(s + i);
    }
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
      const int64_t i = b + ((int64_t)u * kThreads + threadIdx.x) * VEC;
      if (i + VEC <= n) {
        Pack<__nv_bfloat16, VEC> o;
#pragma unroll
        for (int k = 0; k < VEC; ++k) o.x[k] = from_float<__nv_bfloat16>(in[u].x[k]);
        store_pack<VEC>(d + i, o);
      } else {
        for (int64_t j = i; j < n && j < i + VEC; ++j) d[j] = from_float<__nv_bfloat16>(s[j]);
      }
    }
  }
}

template <int VEC, int UNR>
__global__ void __launch_bounds__(kThreads) adamw_v(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
    float* __restrict__ v, __nv_bfloat16* __restrict__ out, int64_t n, AdamWHyper h) {
  const AdamWConsts c = make_adamw_consts(h);
  const int64_t tile = (int64_t)kThreads * VEC * UNR;
  for (int64_t b = (int64_t)blockIdx.x * tile; b < n; b += (int64_t)gridDim.x * tile) {
    Pack<float, VEC> pp[UNR], gp[UNR], mp[UNR], vp[UNR];
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
      const int64_t i = b + ((int64_t)u * kThreads + threadIdx.x) * VEC;
      if (i + VEC <= n) { pp[u] = load_pack<VEC>(p + i); gp[u] = load_pack<VEC>(g + i); mp[u] = load_pack<VEC>(m + i); vp[u] = load_pack<VEC>(v + i); }
    }
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
      const int64_t i = b + ((int64_t)u * kThreads + threadIdx.x) * VEC;
      if (i + VEC <= n) {
        Pack<__nv_bfloat16, VEC> op;
#pragma unroll
        for (int k = 0; k < VEC; ++k) { adamw_update(pp[u].x[k], gp[u].x[k], mp[u].x[k], vp[u].x[k], c); op.x[k] = from_float<__nv_bfloat16>(pp[u].x[k]); }
        store_pack<VEC>(p + i, pp[u]); store_pack<VEC>(m + i, mp[u]); store_pack<VEC>(v + i, vp[u]);
        if (out) store_pack<VEC>(out + i, op);
      } else {
        for (int64_t j = i; j < n && j < i + VEC; ++j) { float pj = p[j], mj = m[j], vj = v[j]; adamw_update(pj, g[j], mj, vj, c); p[j] = pj; m[j] = mj; v[j] = vj; if (out) out[j] = from_float<__nv_bfloat16>(pj); }
      }
    }
  }
}

static bool g_ok = true;  // every variant wrote what the first one did (the exit status says)
static int sms() { int c; cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, 0); return c; }
static int grid(int64_t n, int per_thread, int cap_per_sm) {
  int64_t need = (n + (int64_t)kThreads * per_thread - 1) / ((int64_t)kThreads * per_thread);
  if (cap_per_sm > 0) need = std::min<int64_t>(need, (int64_t)sms() * cap_per_sm);
  return (int)need;
}
template <class F> static float timeit(F f) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> t;
  for (int r = 0; r < 15; ++r) { cudaEventRecord(a); f(); cudaEventRecord(b); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b); t.push_back(ms); }
  std::sort(t.begin(), t.end()); return t[t.size() / 2];
}

#define CAST(VEC, UNR, CAP) { float ms = timeit([&]{ cast_v<VEC, UNR><<<grid(n, VEC*UNR, CAP), kThreads>>>(d, s, n); }); \
  cudaMemcpy(h2.data(), d, n*2, cudaMemcpyDeviceToHost); bool same = h2 == h1 || (h1.empty() ? (h1 = h2, true) : false); g_ok = g_ok && same; \
  printf("cast VEC=%d UNR=%d cap=%d/SM: %.3f ms %.0f GB/s %s\n", VEC, UNR, CAP, ms, n*6/ms/1e6, same ? "same" : "DIFFERENT"); }
#define ADAMX(VEC, UNR, CAP, OUT, HY, WHAT, BYTES) { cudaMemcpy(p, p0, n*4, cudaMemcpyDeviceToDevice); cudaMemset(m, 0, n*4); cudaMemset(v, 0, n*4); \
  adamw_v<VEC, UNR><<<grid(n, VEC*UNR, CAP), kThreads>>>(p, g, m, v, OUT, n, HY); cudaMemcpy(a2.data(), p, n*4, cudaMemcpyDeviceToHost); \
  bool same = a2 == a1 || (a1.empty() ? (a1 = a2, true) : false); g_ok = g_ok && same; \
  float ms = timeit([&]{ adamw_v<VEC, UNR><<<grid(n, VEC*UNR, CAP), kThreads>>>(p, g, m, v, OUT, n, HY); }); \
  printf("%s VEC=%d UNR=%d cap=%d/SM: %.3f ms %.0f GB/s %s\n", WHAT, VEC, UNR, CAP, ms, n*(BYTES)/ms/1e6, same ? "same" : "DIFFERENT"); }
#define ADAM(VEC, UNR, CAP) ADAMX(VEC, UNR, CAP, o, hy, "adamw+bf16", 30)

int main() {
  const int64_t n = 100000000;
  float *s, *p, *p0, *g, *m, *v; __nv_bfloat16 *d, *o;
  cudaMalloc(&s, n*4); cudaMalloc(&p, n*4); cudaMalloc(&p0, n*4); cudaMalloc(&g, n*4); cudaMalloc(&m, n*4); cudaMalloc(&v, n*4);
  cudaMalloc(&d, n*2); cudaMalloc(&o, n*2);
  std::vector<float> hs(n); for (int64_t i = 0; i < n; ++i) hs[i] = (float)((i * 2654435761u) % 1000003) * 1e-3f - 500.f;
  cudaMemcpy(s, hs.data(), n*4, cudaMemcpyHostToDevice); cudaMemcpy(p0, hs.data(), n*4, cudaMemcpyHostToDevice);
  for (int64_t i = 0; i < n; ++i) hs[i] = hs[(i * 7919) % n] * 1e-3f;
  cudaMemcpy(g, hs.data(), n*4, cudaMemcpyHostToDevice);
  AdamWHyper hy{}; hy.lr = 1e-3; hy.beta1 = 0.9; hy.beta2 = 0.999; hy.eps = 1e-8; hy.weight_decay = 0.01; hy.step = 1;
  std::vector<__nv_bfloat16> h1, h2(n); std::vector<float> a1, a2(n);
  { float ms = timeit([&]{ cudaMemcpy(p, s, n*4, cudaMemcpyDeviceToDevice); }); printf("memcpy fp32: %.3f ms %.0f GB/s\n", ms, n*8/ms/1e6); }
  CAST(4, 1, 8) CAST(4, 1, 0) CAST(8, 1, 8) CAST(8, 1, 0) CAST(4, 2, 8) CAST(4, 4, 8) CAST(8, 2, 8) CAST(4, 4, 0) CAST(4, 2, 16) CAST(8, 2, 0)
  ADAM(4, 1, 8) ADAM(4, 1, 0) ADAM(4, 2, 8) ADAM(4, 2, 0) ADAM(4, 4, 8) ADAM(8, 1, 8) ADAM(8, 1, 0) ADAM(4, 2, 16) ADAM(2, 2, 8) ADAM(4, 1, 16)
  // The extension's shape as FusedAdamW calls it: no copy-out (28 B), and the step count read from device
  // memory by every thread (AdamWHyper.step_ptr; bench_optimizer.py's "yafsdp FusedAdamW" row).
  ADAMX(4, 1, 8, (__nv_bfloat16*)nullptr, hy, "adamw (no copy-out)", 28)
  float* dstep; cudaMalloc(&dstep, 4); const float one = 1.f; cudaMemcpy(dstep, &one, 4, cudaMemcpyHostToDevice);
  AdamWHyper hyd = hy; hyd.step_ptr = dstep;
  ADAMX(4, 1, 8, (__nv_bfloat16*)nullptr, hyd, "adamw (no copy-out, step from device memory)", 28)
  ADAMX(4, 1, 8, o, hyd, "adamw+bf16 (step from device memory)", 30)
  cudaError_t e = cudaGetLastError(); printf("last error: %s\n", cudaGetErrorString(e));
  return e == cudaSuccess && g_ok ? 0 : 1;
}
