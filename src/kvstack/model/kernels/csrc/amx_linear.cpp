// bf16 linear layer on Intel AMX tiles (kvstack): y[M, N] = x[M, K] @ W[N, K]^T.
//
// Why: oneDNN's brgemm reaches ~200-550 GFLOP/s at decode sizes (M = 1..128) on the
// 2-core AMX Xeon this was written on, while one core's TDPBF16PS peak is ~1.7 TFLOP/s,
// so a decode step's linears ran at ~3x the time of reading their weights once. Here each
// weight tile is read once per step for up to 32 rows of x at a time, the K loop is a
// straight sequence of tile loads and dot products, and the per-call work outside it is
// a few hundred nanoseconds.
//
// Weight layout (amx_pack_weight in model/kernels/amx_linear.py builds it with a permute):
//
//   packed[nb][kb][kp][n][j] = W[16 * nb + n][32 * kb + 2 * kp + j]
//          nb < N/16, kb < K/32, kp < 16, n < 16, j < 2
//
// i.e. for each block of 16 output columns, K/32 consecutive 1-KiB tiles in the VNNI
// order TDPBF16PS expects for its B operand (16 rows of 16 bf16 pairs).
//
// The loop, per thread over a contiguous range of column pairs (32 outputs each):
//
//   for rows in chunks of MC (x's chunk stays in L2 while the thread's columns pass):
//     for each column pair (two 16-column blocks: B0, B1):
//       for each 32-row block (A0 = rows 0-15, A1 = rows 16-31; A1 skipped if <= 16 rows):
//         C00..C11 = 0;  for kb: load A0, A1, B0, B1; 4 x TDPBF16PS
//         C tiles -> float32 scratch -> bf16 (round to nearest even) -> y
//
// Invariants: K % 32 == 0, N % 16 == 0 (checked; model/kernels/amx_linear.py sends other shapes
// to oneDNN); a row block with fewer than 32 (or 16) rows is copied into a zero-padded
// scratch so a tile load never reads past x; accumulation is float32 in K order, so
// outputs equal a float32 matmul of the bf16 inputs up to summation order, rounded once.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kvstack_ops.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVSTACK_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if defined(KVSTACK_AMX)

constexpr int64_t kRowChunk = 256;  // rows of x per pass over a thread's columns

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool request_amx() {
  constexpr int kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr int kXtiledata = 18;         // XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {  // every tile 16 rows x 64 bytes
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// float32 [16, 16] scratch rows -> bf16 y rows (only the first `rows`).
void write_rows(const float* c, int64_t rows, at::BFloat16* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_loadu_ps(c + 16 * r);
    const __m256bh h = _mm512_cvtneps_pbh(v);
    std::memcpy(y + r * ldy, &h, 32);
  }
}

// One block of up to 32 rows against one or two 16-column weight blocks.
void tile_block(const at::BFloat16* a, int64_t lda, int64_t rows, const at::BFloat16* b0,
                const at::BFloat16* b1, int64_t kblocks, at::BFloat16* y, int64_t ldy,
                float* scratch) {
  const bool two_rows = rows > 16, two_cols = b1 != nullptr;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t stride = lda * 2;  // bytes
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    _tile_loadd(4, a + 32 * kb, stride);
    _tile_loadd(6, b0 + 512 * kb, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two_cols) {
      _tile_loadd(7, b1 + 512 * kb, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (two_rows) {
      _tile_loadd(5, a + 16 * lda + 32 * kb, stride);
      _tile_dpbf16ps(2, 5, 6);
      if (two_cols) _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t top = std::min<int64_t>(rows, 16), bottom = rows - top;
  _tile_stored(0, scratch, 64);
  write_rows(scratch, top, y, ldy);
  if (two_cols) {
    _tile_stored(1, scratch, 64);
    write_rows(scratch, top, y + 16, ldy);
  }
  if (two_rows) {
    _tile_stored(2, scratch, 64);
    write_rows(scratch, bottom, y + 16 * ldy, ldy);
    if (two_cols) {
      _tile_stored(3, scratch, 64);
      write_rows(scratch, bottom, y + 16 * ldy + 16, ldy);
    }
  }
}

void amx_columns(const at::BFloat16* x, int64_t lda, int64_t M, int64_t K,
                 const at::BFloat16* w, int64_t nblocks, int64_t pair_begin, int64_t pair_end,
                 at::BFloat16* y, int64_t ldy) {
  configure_tiles();  // per task: oneDNN may have loaded another configuration
  const int64_t kblocks = K / 32, tile_elems = 512 * kblocks;  // one 16-column block
  alignas(64) float scratch[256];
  // The last row block, when it is not 16 or 32 rows, copied once into a zero-padded
  // buffer (tile loads read whole 16-row tiles; re-padding per column pair cost more
  // than the product at M = 1).
  const int64_t tail = M % 32, tail_start = M - tail;
  const bool pad_tail = tail != 0 && tail != 16;
  std::vector<at::BFloat16> pad;
  if (pad_tail) {
    pad.assign((tail > 16 ? 32 : 16) * K, at::BFloat16(0.0f));
    for (int64_t i = 0; i < tail; ++i) std::memcpy(&pad[i * K], x + (tail_start + i) * lda, 2 * K);
  }
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t m_end = std::min(M, m0 + kRowChunk);
    for (int64_t p = pair_begin; p < pair_end; ++p) {
      const int64_t nb = 2 * p;
      const at::BFloat16* b0 = w + nb * tile_elems;
      const at::BFloat16* b1 = nb + 1 < nblocks ? b0 + tile_elems : nullptr;
      for (int64_t r = m0; r < m_end; r += 32) {
        const int64_t rows = std::min<int64_t>(32, m_end - r);
        const bool padded = pad_tail && r == tail_start;
        const at::BFloat16* a = padded ? pad.data() : x + r * lda;
        tile_block(a, padded ? K : lda, rows, b0, b1, kblocks, y + r * ldy + 16 * nb, ldy,
                   scratch);
      }
    }
  }
  _tile_release();
}

#endif  // KVSTACK_AMX

}  // namespace

bool amx_linear_available() {
#if defined(KVSTACK_AMX)
  static const bool ok = request_amx();
  return ok;
#else
  return false;
#endif
}

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  TORCH_CHECK(amx_linear_available(), "amx_linear: AMX is not available on this CPU/build");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "amx_linear: x must be 2-D bf16 with contiguous rows");
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kBFloat16,
              "amx_linear: packed weight must be contiguous bf16");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % 32 == 0 && N % 16 == 0 && packed.numel() == N * K,
              "amx_linear: needs K % 32 == 0, N % 16 == 0 and a packed [N, K] weight");
  auto y = torch::empty({M, N}, x.options());
#if defined(KVSTACK_AMX)
  if (M == 0) return y;
  const int64_t nblocks = N / 16, pairs = (nblocks + 1) / 2;
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t lda = x.stride(0);
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    amx_columns(xp, lda, M, K, wp, nblocks, begin, end, yp, N);
  });
#endif
  return y;
}
