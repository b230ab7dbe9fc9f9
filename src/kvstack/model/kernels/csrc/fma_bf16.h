// The AVX2 + FMA register-blocked micro-kernel for bf16 weights on CPUs without AVX-512
// (AMD EPYC Zen 2/3, Intel Haswell..Comet Lake): y[MR, 16] = x[MR, K] . W^T for one block of
// 16 output columns, x already widened to float32, W in the same packed pair layout as
// dpbf16.h and amx_linear.cpp,
//
//   b[kp][n][j] = W[16 nb + n][2 kp + j]          (one column block: K/2 x 16 x 2 bf16)
//
// Why: PyTorch 2.13's bf16 matmul on an AVX2-only CPU takes neither oneDNN (it needs
// AVX512-BF16/AMX for bf16) nor MKL, and ran at 7-8 GFLOP/s on the 2-core AMD EPYC (Zen 3)
// of 2026-12-02, against 44-59 GFLOP/s for float32 on the same CPU.
//
// A 32-byte load at (kp, n = 8 h .. 8 h + 7) holds 8 columns' pairs as 32-bit words; a bf16
// is the top half of a float32, so
//
//   even = word << 16          -> W[n][2 kp]      as float32 (exact)
//   odd  = word & 0xFFFF0000   -> W[n][2 kp + 1]  as float32 (exact)
//
// and acc[r][h] += x[r][2 kp] * even + x[r][2 kp + 1] * odd (two FMAs). MR <= kMR rows:
// 4 x 2 accumulators + 4 widened weight registers + 1 broadcast fit the 16 ymm registers.
// Invariants: x rows are ldx floats apart and hold K floats; products are exact in float32
// and summed with fused multiply-adds, so outputs equal a float32 matmul of the bf16 values
// up to summation order (denormals kept, unlike VDPBF16PS).
#pragma once
#include <torch/types.h>

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#define KVSTACK_AVX2_FMA 1
#include <immintrin.h>

namespace fmabf16 {

constexpr int kMR = 4;  // rows per register block

// Widens rows of bf16 to float32 (exact), 8 at a time.
inline void widen(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// acc = x[MR rows] . W[one 16-column block]^T over kpairs pairs; written to y as OutT
// (bf16: rounded to nearest even once, as c10::BFloat16; float: as accumulated).
// pf/pf_lines: a slice of the next panel prefetched into L2 over the K loop.
template <int MR, typename OutT>
void micro(const float* x, int64_t ldx, const at::BFloat16* b, int64_t kpairs, OutT* y,
           int64_t ldy, const char* pf, int64_t pf_lines) {
  __m256 acc[MR][2];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const __m256i hi = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const int64_t per_iter = (pf_lines + kpairs - 1) / kpairs;
  const auto* cols = reinterpret_cast<const __m256i*>(b);
  for (int64_t p = 0; p < kpairs; ++p) {
    for (int64_t l = p * per_iter, e = std::min(l + per_iter, pf_lines); l < e; ++l)
      _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
    const __m256i w0 = _mm256_loadu_si256(cols + 2 * p);
    const __m256i w1 = _mm256_loadu_si256(cols + 2 * p + 1);
    const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
    const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(w0, hi));
    const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
    const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(w1, hi));
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m256 xe = _mm256_broadcast_ss(x + i * ldx + 2 * p);
      acc[i][0] = _mm256_fmadd_ps(xe, e0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xe, e1, acc[i][1]);
      const __m256 xo = _mm256_broadcast_ss(x + i * ldx + 2 * p + 1);
      acc[i][0] = _mm256_fmadd_ps(xo, o0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xo, o1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    alignas(32) float out[16];
    _mm256_store_ps(out, acc[i][0]);
    _mm256_store_ps(out + 8, acc[i][1]);
    for (int c = 0; c < 16; ++c) y[i * ldy + c] = static_cast<OutT>(out[c]);
  }
}

template <typename OutT>
using MicroFn = void (*)(const float*, int64_t, const at::BFloat16*, int64_t, OutT*, int64_t,
                         const char*, int64_t);

template <typename OutT>
MicroFn<OutT> pick(int64_t rows) {
  switch (rows) {
    case 1: return micro<1, OutT>;
    case 2: return micro<2, OutT>;
    case 3: return micro<3, OutT>;
    default: return micro<kMR, OutT>;
  }
}

}  // namespace fmabf16

#endif  // __AVX2__ && __FMA__
