// The AVX-512F register-blocked micro-kernel for bf16 weights on CPUs with AVX-512 but
// neither AVX512-BF16 nor AMX (Intel Skylake-SP .. Ice Lake Xeons, and virtual machines
// that hide those flags): y[MR, 16 NR] = x[MR, K] . W^T, x already widened to float32, W in
// the packed pair layout of dpbf16.h and amx_linear.cpp,
//
//   b[nb][kp][n][j] = W[16 nb + n][2 kp + j]     (block_elems = 32 kpairs elements per nb)
//
// Why: oneDNN runs bf16 there by converting in software, at 35-60 GFLOP/s on the 2-core
// Xeon of 2026-12-02 (no avx512_bf16 / amx flags) against 150-300 for float32 GEMM.
//
// A 64-byte load at (nb, kp) holds 16 columns' pairs as 32-bit words; a bf16 is the top
// half of a float32, so
//
//   even = word << 16          -> W[n][2 kp]      as float32 (exact)
//   odd  = word & 0xFFFF0000   -> W[n][2 kp + 1]  as float32 (exact)
//
// and acc[r][j] += x[r][2 kp] * even_j + x[r][2 kp + 1] * odd_j (two FMAs). MR <= kMR rows,
// NR <= kNR column blocks: 5 x 4 accumulators + 8 widened weight registers + 1 broadcast
// fit the 32 zmm registers. Invariants: x rows are ldx floats apart and hold K floats;
// products are exact in float32 and summed with fused multiply-adds, so outputs equal a
// float32 matmul of the bf16 values up to summation order (denormals kept, unlike
// VDPBF16PS), rounded to bf16 once.
#pragma once
#include <torch/types.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"

#if defined(__AVX512F__)
#define KVSTACK_AVX512_FMA 1
#include <immintrin.h>

namespace fma512 {

constexpr int kMR = 5;  // rows per register block
constexpr int kNR = 4;  // 16-column blocks per register block

// Prefetch (into L2) of a slice of the next column group's panel, spread over the K loop.
struct Prefetch {
  const char* base;  // first line of the slice
  int64_t lines;     // 64-byte lines in the slice
  int64_t per_iter;  // lines issued per K step
};

// Widens rows of bf16 to float32 (exact), 16 at a time.
inline void widen(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// acc = x[MR rows] . W[NR blocks]^T over kpairs pairs; written to y as bf16, rounded to
// nearest even once (c10::BFloat16's rounding).
template <int MR, int NR>
void micro(const float* x, int64_t ldx, const at::BFloat16* b, int64_t block_elems,
           int64_t kpairs, at::BFloat16* y, int64_t ldy, Prefetch pf) {
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i hi = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const char* cols = reinterpret_cast<const char*>(b);
  const int64_t col_bytes = 2 * block_elems;
  for (int64_t p = 0; p < kpairs; ++p) {
    for (int64_t l = p * pf.per_iter, e = std::min(l + pf.per_iter, pf.lines); l < e; ++l)
      _mm_prefetch(pf.base + 64 * l, _MM_HINT_T1);
    __m512 even[NR], odd[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const __m512i w = _mm512_loadu_si512(cols + j * col_bytes + 64 * p);
      even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      odd[j] = _mm512_castsi512_ps(_mm512_and_si512(w, hi));
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 xe = _mm512_set1_ps(x[i * ldx + 2 * p]);
      const __m512 xo = _mm512_set1_ps(x[i * ldx + 2 * p + 1]);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        acc[i][j] = _mm512_fmadd_ps(xe, even[j], acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(xo, odd[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) store16(y + i * ldy + 16 * j, acc[i][j]);
}

using MicroFn = void (*)(const float*, int64_t, const at::BFloat16*, int64_t, int64_t,
                         at::BFloat16*, int64_t, Prefetch);

template <int NR>
MicroFn pick_rows(int64_t rows) {
  switch (rows) {
    case 1: return micro<1, NR>;
    case 2: return micro<2, NR>;
    case 3: return micro<3, NR>;
    case 4: return micro<4, NR>;
    default: return micro<kMR, NR>;
  }
}

// The kernel for a block of `rows` (<= kMR) rows and `cols` (<= kNR) 16-column blocks.
inline MicroFn pick(int64_t rows, int64_t cols) {
  switch (cols) {
    case 1: return pick_rows<1>(rows);
    case 2: return pick_rows<2>(rows);
    case 3: return pick_rows<3>(rows);
    default: return pick_rows<kNR>(rows);
  }
}

}  // namespace fma512

#endif  // __AVX512F__
