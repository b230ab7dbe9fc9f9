// bf16 linear layer on AVX512-BF16 (kvstack): y[M, N] = x[M, K] @ W[N, K]^T, for CPUs
// without AMX (AMD EPYC Zen 4/5, Intel Cooper Lake).
//
// Why: on the 2-core AMD EPYC of issue 15 (Zen 4, avx512_bf16, no AMX), oneDNN ran a
// batch-32 decode step's linears at ~280 GFLOP/s, 2.4x the time of reading their weights
// once (benchmarks/profile_step.py). Here each weight element is loaded once per block of
// MR rows from a register-blocked K loop of VDPBF16PS, with no packing of x and a per-call
// overhead of a few hundred nanoseconds.
//
// Weight layout: the same packed copy as amx_linear.cpp (model/amx_linear.py builds it),
//
//   packed[nb][kp][n][j] = W[16 * nb + n][2 * kp + j]      nb < N/16, kp < K/2, n < 16, j < 2
//
// so one 64-byte load at (nb, kp) is the VDPBF16PS B operand for 16 output columns and
// the input pair (2 kp, 2 kp + 1); a column block's K/2 loads are one contiguous stream.
//
// The loop, per thread over a contiguous range of 16-column blocks:
//
//   for rows in chunks of kRowChunk (x's chunk stays in L2 while the columns pass):
//     for each group of NR (<= 4) column blocks:          acc[MR][NR] zmm registers
//       for each block of MR (<= 6) rows:
//         acc = 0;  for kp: b[j] = load(nb + j, kp); a = broadcast(x[r][2kp:2kp+2]);
//                           acc[r][j] = dpbf16(acc[r][j], a, b[j])
//         y[r][16 (nb + j) ...] = bf16(acc[r][j])    (round to nearest even, once)
//
// Invariants: K % 32 == 0, N % 16 == 0 and packed holds N * K bf16 (checked; the Python
// side sends other shapes to oneDNN). VDPBF16PS multiplies bf16 pairs exactly and adds in
// float32 (denormal inputs and outputs flushed to zero, as oneDNN's bf16 kernels on this
// ISA do), so outputs equal a float32 matmul of the bf16 inputs up to summation order,
// rounded to bf16 once.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "kvstack_ops.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define KVSTACK_AVX512_BF16 1
#include <immintrin.h>
#endif

namespace {

#if defined(KVSTACK_AVX512_BF16)

constexpr int kMR = 6;   // rows per register block
constexpr int kNR = 4;   // 16-column blocks per register block (6 x 4 accumulators + 4 B)
constexpr int64_t kRowChunk = 96;

// Prefetch (into L2) of a slice of the next column group's panel, spread over the K loop.
struct Prefetch {
  const char* base;  // first line of the slice
  int64_t lines;     // 64-byte lines in the slice
  int64_t per_iter;  // lines issued per K step
};

template <int MR, int NR>
void micro(const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t block_elems,
           int64_t kpairs, at::BFloat16* y, int64_t ldy, Prefetch pf) {
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
      const __m256bh h = _mm512_cvtneps_pbh(acc[i][j]);
      std::memcpy(y + i * ldy + 16 * j, &h, 32);
    }
}

using MicroFn = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, int64_t,
                         at::BFloat16*, int64_t, Prefetch);

template <int NR>
MicroFn pick_rows(int64_t rows) {
  switch (rows) {
    case 1: return micro<1, NR>;
    case 2: return micro<2, NR>;
    case 3: return micro<3, NR>;
    case 4: return micro<4, NR>;
    case 5: return micro<5, NR>;
    default: return micro<kMR, NR>;
  }
}

MicroFn pick(int64_t rows, int64_t cols) {
  switch (cols) {
    case 1: return pick_rows<1>(rows);
    case 2: return pick_rows<2>(rows);
    case 3: return pick_rows<3>(rows);
    default: return pick_rows<kNR>(rows);
  }
}

void bf16_columns(const at::BFloat16* x, int64_t lda, int64_t M, int64_t K,
                  const at::BFloat16* w, int64_t nb_begin, int64_t nb_end, at::BFloat16* y,
                  int64_t ldy) {
  const int64_t block_elems = 16 * K, kpairs = K / 2;
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t m_end = std::min(M, m0 + kRowChunk);
    const int64_t row_blocks = (m_end - m0 + kMR - 1) / kMR;
    for (int64_t nb = nb_begin; nb < nb_end; nb += kNR) {
      const int64_t cols = std::min<int64_t>(kNR, nb_end - nb);
      const at::BFloat16* b = w + nb * block_elems;
      // The next group's panel (contiguous after this one) streams in from DRAM while this
      // group computes: each row block prefetches its share, so the weight read overlaps
      // the dot products instead of preceding them (cold weights: ~25 % of the time).
      const int64_t next_cols = std::min<int64_t>(kNR, nb_end - nb - cols);
      const int64_t next_lines = next_cols * block_elems * 2 / 64;
      const int64_t share = (next_lines + row_blocks - 1) / row_blocks;
      const char* next = reinterpret_cast<const char*>(b + cols * block_elems);
      for (int64_t r = m0, i = 0; r < m_end; r += kMR, ++i) {
        const int64_t rows = std::min<int64_t>(kMR, m_end - r);
        const int64_t first = std::min(next_lines, i * share);
        const int64_t lines = std::min(next_lines - first, share);
        const Prefetch pf{next + 64 * first, lines, (lines + kpairs - 1) / kpairs};
        pick(rows, cols)(x + r * lda, lda, b, block_elems, kpairs, y + r * ldy + 16 * nb, ldy, pf);
      }
    }
  }
}

#endif  // KVSTACK_AVX512_BF16

}  // namespace

bool bf16_linear_available() {
#if defined(KVSTACK_AVX512_BF16)
  return true;
#else
  return false;
#endif
}

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  TORCH_CHECK(bf16_linear_available(), "bf16_linear: AVX512-BF16 is not available in this build");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "bf16_linear: x must be 2-D bf16 with contiguous rows");
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kBFloat16,
              "bf16_linear: packed weight must be contiguous bf16");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % 32 == 0 && N % 16 == 0 && packed.numel() == N * K,
              "bf16_linear: needs K % 32 == 0, N % 16 == 0 and a packed [N, K] weight");
  auto y = torch::empty({M, N}, x.options());
#if defined(KVSTACK_AVX512_BF16)
  if (M == 0) return y;
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t lda = x.stride(0);
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    bf16_columns(xp, lda, M, K, wp, begin, end, yp, N);
  });
#endif
  return y;
}
