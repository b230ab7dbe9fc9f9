// bf16 linear layer on AVX512-BF16 (kvstack): y[M, N] = x[M, K] @ W[N, K]^T, for CPUs
// without AMX (AMD EPYC Zen 4/5, Intel Cooper Lake); on CPUs with AVX-512F but no BF16
// (Skylake-SP .. Ice Lake Xeons, VMs hiding the flags) the same loop runs fma512_bf16.h's
// micro-kernel, and on CPUs with only AVX2 + FMA (AMD EPYC Zen 2/3, older Xeons)
// fma_bf16.h's, each over x widened to float32 once per call (see those headers for why:
// PyTorch's bf16 matmul is 3-7x slower than float32 there).
//
// Why: on a 2-core AMD EPYC (Zen 4, avx512_bf16, no AMX), oneDNN ran a
// batch-32 decode step's linears at ~280 GFLOP/s, 2.4x the time of reading their weights
// once (benchmarks/profile_step.py). Here each weight element is loaded once per block of
// MR rows from a register-blocked K loop of VDPBF16PS, with no packing of x and a per-call
// overhead of a few hundred nanoseconds.
//
// Weight layout: the same packed copy as amx_linear.cpp (model/kernels/amx_linear.py builds it),
//
//   packed[nb][kp][n][j] = W[16 * nb + n][2 * kp + j]      nb < N/16, kp < K/2, n < 16, j < 2
//
// so one 64-byte load at (nb, kp) is the VDPBF16PS B operand for 16 output columns and
// the input pair (2 kp, 2 kp + 1); a column block's K/2 loads are one contiguous stream.
//
// Threads split the 16-column blocks (decode-sized inputs: each weight element is read
// once in all) or, from kRowSplitRows rows, the rows (a prefill: each thread reads the rows
// of x its core just wrote, and the weight from L2/L3). Either way a row's result is the
// same: its K sum runs in one fixed order whatever the row count, the block it falls in
// or the thread (batch invariance, model/kernels/packed_linear.py). The loop, per thread:
//
//   for rows in chunks of kRowChunk (kSplitChunk when rows are split; x's chunk stays in
//   L2 while the columns pass):
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
#include <string>
#include <vector>

#include "kvstack_ops.h"
#include "team_slices.h"

#include "dpbf16.h"
#include "fma512_bf16.h"
#include "fma_bf16.h"

namespace {

// Row chunks of `chunk` rows, in blocks of up to MR rows, against groups of up to NR
// 16-column blocks in [nb_begin, nb_end): micro(r, rows, nb, cols, b, pf) computes one
// (row block, group), b being the group's panel. The next group's panel (contiguous after
// this one) streams in from DRAM while this group computes: each row block prefetches its
// share (pf, into L2), so the weight read overlaps the dot products instead of preceding
// them (cold weights: ~25 % of the time).
template <int MR, int NR, typename PF, typename Micro>
[[maybe_unused]] void column_groups(int64_t M, int64_t K, int64_t chunk, const at::BFloat16* w,
                                    int64_t nb_begin, int64_t nb_end, Micro micro) {
  const int64_t block_elems = 16 * K, kpairs = K / 2;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m_end = std::min(M, m0 + chunk);
    const int64_t row_blocks = (m_end - m0 + MR - 1) / MR;
    for (int64_t nb = nb_begin; nb < nb_end; nb += NR) {
      const int64_t cols = std::min<int64_t>(NR, nb_end - nb);
      const at::BFloat16* b = w + nb * block_elems;
      const int64_t next_cols = std::min<int64_t>(NR, nb_end - nb - cols);
      const int64_t next_lines = next_cols * block_elems * 2 / 64;
      const int64_t share = (next_lines + row_blocks - 1) / row_blocks;
      const char* next = reinterpret_cast<const char*>(b + cols * block_elems);
      for (int64_t r = m0, i = 0; r < m_end; r += MR, ++i) {
        const int64_t rows = std::min<int64_t>(MR, m_end - r);
        const int64_t first = std::min(next_lines, i * share);
        const int64_t lines = std::min(next_lines - first, share);
        micro(r, rows, nb, cols, b, PF{next + 64 * first, lines, (lines + kpairs - 1) / kpairs});
      }
    }
  }
}

// Rows per chunk: the chunk's float32 x (rows x K x 4 B) stays in L2 (<= 256 KiB) while
// every column block of the thread passes over it; a multiple of mr.
[[maybe_unused]] int64_t row_chunk(int64_t K, int64_t mr) {
  const int64_t rows = (256 * 1024) / (4 * K);
  return std::max<int64_t>(mr, rows / mr * mr);
}

#if defined(KVSTACK_AVX512_BF16)

constexpr int64_t kRowChunk = 96;
// From this many rows bf16_linear splits rows, not columns, between threads: a prefill's
// x was just written by the previous op, each thread's rows into its own core's cache,
// and a column split makes every thread read all of x (half of it from the other core).
constexpr int64_t kRowSplitRows = 256;
constexpr int64_t kSplitChunk = 384;  // rows per chunk there (x's chunk: 432 KiB at K 576)

void bf16_columns(const at::BFloat16* x, int64_t lda, int64_t M, int64_t K,
                  const at::BFloat16* w, int64_t nb_begin, int64_t nb_end, at::BFloat16* y,
                  int64_t ldy, int64_t chunk = kRowChunk) {
  using dpbf16::Prefetch;
  column_groups<dpbf16::kMR, dpbf16::kNR, Prefetch>(
      M, K, chunk, w, nb_begin, nb_end,
      [&](int64_t r, int64_t rows, int64_t nb, int64_t cols, const at::BFloat16* b, Prefetch pf) {
        dpbf16::pick<at::BFloat16>(rows, cols)(x + r * lda, lda, b, 16 * K, K / 2,
                                               y + r * ldy + 16 * nb, ldy, pf);
      });
}

#elif defined(KVSTACK_AVX512_FMA)

// As bf16_columns, over x widened to float32 once per call (fma512_bf16.h).
void fma512_columns(const float* x, int64_t M, int64_t K, const at::BFloat16* w,
                    int64_t nb_begin, int64_t nb_end, at::BFloat16* y, int64_t ldy) {
  using fma512::Prefetch;
  column_groups<fma512::kMR, fma512::kNR, Prefetch>(
      M, K, row_chunk(K, fma512::kMR), w, nb_begin, nb_end,
      [&](int64_t r, int64_t rows, int64_t nb, int64_t cols, const at::BFloat16* b, Prefetch pf) {
        fma512::pick(rows, cols)(x + r * K, K, b, 16 * K, K / 2, y + r * ldy + 16 * nb, ldy, pf);
      });
}

#elif defined(KVSTACK_AVX2_FMA)

void fma_columns(const float* x, int64_t M, int64_t K, const at::BFloat16* w, int64_t nb_begin,
                 int64_t nb_end, at::BFloat16* y, int64_t ldy) {
  const int64_t block_elems = 16 * K, kpairs = K / 2, chunk = row_chunk(K, fmabf16::kMR);
  const int64_t lines = block_elems * 2 / 64;  // 64-byte lines in one column block's panel
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m_end = std::min(M, m0 + chunk);
    const int64_t row_blocks = (m_end - m0 + fmabf16::kMR - 1) / fmabf16::kMR;
    const int64_t share = (lines + row_blocks - 1) / row_blocks;
    for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
      const at::BFloat16* b = w + nb * block_elems;
      // The next block's panel streams into L2 while this one computes (none after the last).
      const int64_t next_lines = nb + 1 < nb_end ? lines : 0;
      const char* next = reinterpret_cast<const char*>(b + block_elems);
      for (int64_t r = m0, i = 0; r < m_end; r += fmabf16::kMR, ++i) {
        const int64_t rows = std::min<int64_t>(fmabf16::kMR, m_end - r);
        const int64_t first = std::min(next_lines, i * share);
        const int64_t count = std::min(next_lines - first, share);
        fmabf16::pick<at::BFloat16>(rows)(x + r * K, K, b, kpairs, y + r * ldy + 16 * nb, ldy,
                                          next + 64 * first, count);
      }
    }
  }
}

#endif  // KVSTACK_AVX512_BF16 / KVSTACK_AVX512_FMA / KVSTACK_AVX2_FMA

}  // namespace

bool bf16_linear_available() {
#if defined(KVSTACK_AVX512_BF16) || defined(KVSTACK_AVX512_FMA) || defined(KVSTACK_AVX2_FMA)
  return true;
#else
  return false;
#endif
}

// Which micro-kernel bf16_linear runs: "avx512_bf16", "avx512_fma", "avx2_fma" or "" (none
// in this build).
std::string bf16_linear_isa() {
#if defined(KVSTACK_AVX512_BF16)
  return "avx512_bf16";
#elif defined(KVSTACK_AVX512_FMA)
  return "avx512_fma";
#elif defined(KVSTACK_AVX2_FMA)
  return "avx2_fma";
#else
  return "";
#endif
}

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  TORCH_CHECK(bf16_linear_available(),
              "bf16_linear: neither AVX512-BF16, AVX-512F nor AVX2+FMA is available in this build");
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
  if (M >= kRowSplitRows) {  // long inputs: each thread its own rows, every column
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    at::parallel_for(0, M, (M + threads - 1) / threads, [&](int64_t r0, int64_t r1) {
      bf16_columns(xp + r0 * lda, lda, r1 - r0, K, wp, 0, N / 16, yp + r0 * N, N, kSplitChunk);
    });
    return y;
  }
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    bf16_columns(xp, lda, M, K, wp, begin, end, yp, N);
  });
#elif defined(KVSTACK_AVX512_FMA) || defined(KVSTACK_AVX2_FMA)
  if (M == 0) return y;
  std::vector<float> xf(M * K);
  const auto* xp = x.data_ptr<at::BFloat16>();
  const int64_t lda = x.stride(0);
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
#if defined(KVSTACK_AVX512_FMA)
    for (int64_t r = begin; r < end; ++r) fma512::widen(xp + r * lda, xf.data() + r * K, K);
#else
    for (int64_t r = begin; r < end; ++r) fmabf16::widen(xp + r * lda, xf.data() + r * K, K);
#endif
  });
  const auto* wp = packed.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
#if defined(KVSTACK_AVX512_FMA)
    fma512_columns(xf.data(), M, K, wp, begin, end, yp, N);
#else
    fma_columns(xf.data(), M, K, wp, begin, end, yp, N);
#endif
  });
#endif
  return y;
}

// Column blocks [nb_begin, nb_end) of y[M, N] = x[M, K] @ W^T for decode_team.cpp
// (team_slices.h): the loop bf16_linear runs on each thread.
void team::bf16_columns(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* w,
                        int64_t nb_begin, int64_t nb_end, c10::BFloat16* y, int64_t N) {
#if defined(KVSTACK_AVX512_BF16)
  ::bf16_columns(x, K, M, K, w, nb_begin, nb_end, y, N);
#else
  (void)x, (void)M, (void)K, (void)w, (void)nb_begin, (void)nb_end, (void)y, (void)N;
  TORCH_CHECK(false, "decode_team: bf16 linears need AVX512-BF16");
#endif
}
