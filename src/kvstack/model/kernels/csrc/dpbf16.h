// The AVX512-BF16 register-blocked micro-kernel shared by bf16_linear.cpp (linears) and
// prefill_attention.cpp (Q K^T and P V): y[MR, 16 NR] = x[MR, 2 kpairs] . W^T, with W in
// the packed pair layout
//
//   b[nb][kp][n][j] = W[16 nb + n][2 kp + j]     (block_elems = 32 kpairs elements per nb)
//
// so one 64-byte load at (nb, kp) is the VDPBF16PS B operand for 16 columns; each row's
// pair x[r][2 kp : 2 kp + 2] is broadcast. MR <= kMR rows, NR <= kNR column blocks: 6 x 4
// float32 accumulators + 4 B registers + 1 broadcast fit the 32 zmm registers.
// Invariants: x rows are lda elements apart and hold 2 kpairs readable elements; y rows
// ldy apart; VDPBF16PS flushes denormals and adds bf16 products exactly in float32.
#pragma once
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define KVSTACK_AVX512_BF16 1
#include <immintrin.h>

namespace dpbf16 {

constexpr int kMR = 6;   // rows per register block
constexpr int kNR = 4;   // 16-column blocks per register block (6 x 4 accumulators + 4 B)

// Prefetch (into L2) of a slice of the next column group's panel, spread over the K loop.
struct Prefetch {
  const char* base;  // first line of the slice
  int64_t lines;     // 64-byte lines in the slice
  int64_t per_iter;  // lines issued per K step
};

// acc = x[MR rows] . W[NR blocks]^T over kpairs bf16 pairs; written to y as OutT (bf16:
// rounded to nearest even once; float: as accumulated).
template <int MR, int NR, typename OutT>
void micro(const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t block_elems,
           int64_t kpairs, OutT* y, int64_t ldy, Prefetch pf) {
  __m512 acc[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const char* rows[MR];
  for (int i = 0; i < MR; ++i) rows[i] = reinterpret_cast<const char*>(a + i * lda);
  const char* cols = reinterpret_cast<const char*>(b);
  const int64_t col_bytes = 2 * block_elems;
  for (int64_t p = 0; p < kpairs; ++p) {
    for (int64_t l = p * pf.per_iter, e = std::min(l + pf.per_iter, pf.lines); l < e; ++l)
      _mm_prefetch(pf.base + 64 * l, _MM_HINT_T1);
    __m512bh bv[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j)
      bv[j] = (__m512bh)_mm512_loadu_si512(cols + j * col_bytes + 64 * p);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, rows[i] + 4 * p, 4);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, bv[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      if constexpr (std::is_same_v<OutT, float>) {
        _mm512_storeu_ps(y + i * ldy + 16 * j, acc[i][j]);
      } else {
        const __m256bh h = _mm512_cvtneps_pbh(acc[i][j]);
        std::memcpy(y + i * ldy + 16 * j, &h, 32);
      }
    }
}

template <typename OutT>
using MicroFn = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, int64_t,
                         OutT*, int64_t, Prefetch);

template <typename OutT, int NR>
MicroFn<OutT> pick_rows(int64_t rows) {
  switch (rows) {
    case 1: return micro<1, NR, OutT>;
    case 2: return micro<2, NR, OutT>;
    case 3: return micro<3, NR, OutT>;
    case 4: return micro<4, NR, OutT>;
    case 5: return micro<5, NR, OutT>;
    default: return micro<kMR, NR, OutT>;
  }
}

// The kernel for a block of `rows` (<= kMR) rows and `cols` (<= kNR) 16-column blocks.
template <typename OutT>
MicroFn<OutT> pick(int64_t rows, int64_t cols) {
  switch (cols) {
    case 1: return pick_rows<OutT, 1>(rows);
    case 2: return pick_rows<OutT, 2>(rows);
    case 3: return pick_rows<OutT, 3>(rows);
    default: return pick_rows<OutT, kNR>(rows);
  }
}

}  // namespace dpbf16

#endif  // __AVX512BF16__
