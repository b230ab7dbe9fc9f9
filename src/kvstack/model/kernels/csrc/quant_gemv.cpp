// Weight-only quantized linears for decode-sized inputs (M <= ~16 rows) on AVX512-VNNI:
// weights repacked at load into 16-row tiles so that one vpdpbusd multiplies 64 weight
// codes by 4 broadcast int8 activations and leaves 16 output rows in 16 int32 lanes -- no
// horizontal sums (quant_vnni.cpp reduces a 16-lane vector per output row, ~1/3 of its
// instructions). The same arithmetic as quant_vnni.cpp and llama.cpp's Q4_1 x Q8_1 /
// Q8_0 x Q8_0 dot products (quant_act.h quantizes the activations):
//   y[m, n] = sum_c dx[m,c] * (s[n,g(c)] * sum_j xq[m,32c+j] q[n,32c+j] + mn[n,g(c)] * sum_j xq)
// 8-bit codes are stored as q + 128 (vpdpbusd multiplies unsigned by signed bytes) and
// the offset leaves as a min of -128 s. 8-bit groups of 16 (Q6_K): each 32-chunk's two
// halves are summed apart (two int32 sums) and scaled by their own scales.
//
// Tile layout (quant/tiled.py writes it; tile t = rows 16t .. 16t+15, K % 32 == 0):
//   codes [N/16, K * bits / 8 * 16] uint8: per tile, per 32-chunk c, vectors v of 64 bytes,
//     lane j (row 16t + j) 4 bytes:
//       bits 8: v = 0..7, byte b = q[32c + 4v + b] + 128
//       bits 4: v = 0..3, byte b = q[32c + 8v + b] | q[32c + 8v + 4 + b] << 4
//   scale, min [N/16, K/group, 16] float32 or float16 (GGUF's fp16 scales kept as they are)
// so vector i of a chunk (after the nibble split, i = 0..7) meets activation int32
// 8c + i (4 bytes). Float sums run in a different order than quant_vnni.cpp: results agree
// to float32 rounding, not bit for bit. A row's result depends only on that row.
#include <ATen/Parallel.h>

#include <optional>
#include <vector>

#include "kvstack_ops.h"
#include "quant_act.h"
#include "simd.h"
#include "team_slices.h"

namespace {

#if defined(KVSTACK_AVX512) && defined(__AVX512VNNI__)
#define KVSTACK_GEMV_VNNI 1

constexpr int kRows = 16;  // output rows per tile: one zmm of int32 / float lanes
constexpr int kMT = 4;     // activation rows per pass over a tile
constexpr int kPrefetch = 2048;  // software prefetch distance in code bytes

using Act = team::GemvAct;  // int8 codes, chunk scales dx and dx * sum(codes)

// Rows [b, e) of x [M, K] quantized into a.
template <typename T>
void quantize_rows(const T* x, int64_t b, int64_t e, int64_t K, const Act& a) {
  auto* codes = reinterpret_cast<int8_t*>(a.xq);
  for (int64_t i = b * K / 32; i < e * K / 32; ++i) {
    const auto [d, sum, lo] = kvstack_quant::quantize_chunk(x + 32 * i, codes + 32 * i);
    a.dx[i] = d;
    a.xs[i] = d * static_cast<float>(sum);
    a.xh[2 * i] = d * static_cast<float>(lo);
    a.xh[2 * i + 1] = d * static_cast<float>(sum - lo);
  }
}

inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The 8 code vectors of chunk c, each lane's 4 bytes unsigned.
template <int BITS>
inline void chunk_codes(const uint8_t* tile, int64_t c, __m512i* w) {
  if constexpr (BITS == 4) {
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int v = 0; v < 4; ++v) {
      const __m512i raw = _mm512_loadu_si512(tile + (4 * c + v) * 64);
      w[2 * v] = _mm512_and_si512(raw, m4);
      w[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
    }
  } else {
    for (int v = 0; v < 8; ++v) w[v] = _mm512_loadu_si512(tile + (8 * c + v) * 64);
  }
}

// acc[m] (16 rows) += the tile's dot products with activation rows m0 .. m0+MT-1. G16:
// 8-bit groups of 16 (Q6_K): each 32-chunk's halves (vectors 0-3 and 4-7) are summed apart
// and scaled by their own group's scale, the +128 offset removed per half (xh).
template <int BITS, int MT, bool G16, typename S>
void tile_rows(const uint8_t* tile, const S* sc, const S* mn, int64_t K, int64_t G,
               const Act& a, int64_t m0, __m512* acc) {
  const int64_t nc = K / 32, per_group = G16 ? 1 : G / 32;
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t c = 0, g = 0, left = per_group; c < nc; ++c) {
    __m512i w[8];
    // the stream kPrefetch bytes ahead (into the next tile at the end: a thread's tiles
    // are contiguous); ~10 % less time on weights cycled from DRAM than the hardware
    // prefetcher alone (2-core AMD EPYC Zen 5, 1 KiB 0.95x, 2 and 4 KiB 0.9x)
    const char* next = reinterpret_cast<const char*>(tile + BITS * c * 64) + kPrefetch;
    for (int v = 0; v < BITS; ++v) _mm_prefetch(next + 64 * v, _MM_HINT_T0);
    if (G16 || (c & 1) == 0)
      _mm_prefetch(reinterpret_cast<const char*>(sc + (G16 ? 2 * c : g) * kRows) + kPrefetch / 8,
                   _MM_HINT_T0);
    chunk_codes<BITS>(tile, c, w);
    if constexpr (G16) {
      const __m512 s0 = load_scales(sc + 2 * c * kRows), s1 = load_scales(sc + (2 * c + 1) * kRows);
      const __m512 m128 = _mm512_set1_ps(-128.f);
      const __m512 mw0 = _mm512_mul_ps(s0, m128), mw1 = _mm512_mul_ps(s1, m128);
      for (int m = 0; m < MT; ++m) {
        const int32_t* xi = a.xq + (m0 + m) * (K / 4) + 8 * c;
        __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(xi[0]));
        __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4], _mm512_set1_epi32(xi[4]));
        for (int i = 1; i < 4; ++i) {
          i0 = _mm512_dpbusd_epi32(i0, w[i], _mm512_set1_epi32(xi[i]));
          i1 = _mm512_dpbusd_epi32(i1, w[i + 4], _mm512_set1_epi32(xi[i + 4]));
        }
        const int64_t at = (m0 + m) * nc + c;
        const __m512 dx = _mm512_set1_ps(a.dx[at]);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(s0, dx), acc[m]);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(s1, dx), acc[m]);
        acc[m] = _mm512_fmadd_ps(mw0, _mm512_set1_ps(a.xh[2 * at]), acc[m]);
        acc[m] = _mm512_fmadd_ps(mw1, _mm512_set1_ps(a.xh[2 * at + 1]), acc[m]);
      }
      continue;
    }
    const __m512 s = load_scales(sc + g * kRows);
    const __m512 mw =
        BITS == 4 ? load_scales(mn + g * kRows) : _mm512_mul_ps(s, _mm512_set1_ps(-128.f));
    for (int m = 0; m < MT; ++m) {
      const int32_t* xi = a.xq + (m0 + m) * (K / 4) + 8 * c;
      __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(xi[0]));
      __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(xi[1]));
      for (int i = 2; i < 8; i += 2) {
        i0 = _mm512_dpbusd_epi32(i0, w[i], _mm512_set1_epi32(xi[i]));
        i1 = _mm512_dpbusd_epi32(i1, w[i + 1], _mm512_set1_epi32(xi[i + 1]));
      }
      const int64_t at = (m0 + m) * nc + c;
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1));
      acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s, _mm512_set1_ps(a.dx[at])), acc[m]);
      acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.xs[at]), acc[m]);
    }
    if (--left == 0) ++g, left = per_group;
  }
}

template <int BITS, bool G16, typename S>
void run_rows_g(int64_t mt, const uint8_t* tile, const S* sc, const S* mn, int64_t K, int64_t G,
                const Act& a, int64_t m0, __m512* acc) {
  switch (mt) {
    case 1: return tile_rows<BITS, 1, G16>(tile, sc, mn, K, G, a, m0, acc);
    case 2: return tile_rows<BITS, 2, G16>(tile, sc, mn, K, G, a, m0, acc);
    case 3: return tile_rows<BITS, 3, G16>(tile, sc, mn, K, G, a, m0, acc);
    default: return tile_rows<BITS, 4, G16>(tile, sc, mn, K, G, a, m0, acc);
  }
}

template <int BITS, typename S>
void run_rows(int64_t mt, const uint8_t* tile, const S* sc, const S* mn, int64_t K, int64_t G,
              const Act& a, int64_t m0, __m512* acc) {
  if constexpr (BITS == 8) {
    if (G == 16) return run_rows_g<8, true>(mt, tile, sc, mn, K, G, a, m0, acc);
  }
  run_rows_g<BITS, false>(mt, tile, sc, mn, K, G, a, m0, acc);
}

// Output tiles [b, e) (rows 16 b .. 16 e - 1 of the weight) for every activation row.
template <int BITS, typename S, typename T>
void gemv_tiles(const Act& a, T* out, int64_t M, int64_t N, int64_t K, int64_t G,
                const uint8_t* codes, const S* sc, const S* mn, int64_t b, int64_t e) {
  const int64_t tile_bytes = K * BITS / 8 * kRows, tile_scales = K / G * kRows;
  __m512 acc[kMT];
  for (int64_t t = b; t < e; ++t) {
    const S* tmn = mn != nullptr ? mn + t * tile_scales : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += kMT) {
      const int64_t mt = std::min<int64_t>(kMT, M - m0);
      run_rows<BITS>(mt, codes + t * tile_bytes, sc + t * tile_scales, tmn, K, G, a, m0, acc);
      for (int64_t i = 0; i < mt; ++i) store16(out + (m0 + i) * N + t * kRows, acc[i]);
    }
  }
}

template <int BITS, typename S, typename T>
void gemv_impl(const T* x, T* out, int64_t M, int64_t N, int64_t K, int64_t G,
               const uint8_t* codes, const S* sc, const S* mn) {
  std::vector<int32_t> xq(M * K / 4);
  std::vector<float> dx(M * K / 32), xs(M * K / 32), xh(M * K / 16);
  const Act a{xq.data(), dx.data(), xs.data(), xh.data()};
  quantize_rows(x, 0, M, K, a);
  at::parallel_for(0, N / kRows, 1, [&](int64_t b, int64_t e) {
    gemv_tiles<BITS>(a, out, M, N, K, G, codes, sc, mn, b, e);
  });
}

template <typename S, typename T>
void gemv_dispatch(const T* x, T* out, int64_t M, int64_t N, int64_t K, int64_t G, int64_t bits,
                   const torch::Tensor& codes, const torch::Tensor& scale,
                   const std::optional<torch::Tensor>& min) {
  const auto* cp = codes.data_ptr<uint8_t>();
  const S* sp = scale.data_ptr<S>();
  const S* mp = min.has_value() ? min->data_ptr<S>() : nullptr;
  bits == 4 ? gemv_impl<4>(x, out, M, N, K, G, cp, sp, mp)
            : gemv_impl<8>(x, out, M, N, K, G, cp, sp, mp);
}
#endif

}  // namespace

bool quant_gemv_ok(int64_t out_features, int64_t in_features, int64_t group, int64_t bits) {
#if defined(KVSTACK_GEMV_VNNI)
  return out_features % 16 == 0 && in_features % 32 == 0 && in_features % group == 0 &&
         (group % 32 == 0 ? bits == 4 || bits == 8 : group == 16 && bits == 8);
#else
  (void)out_features, (void)in_features, (void)group, (void)bits;
  return false;
#endif
}

torch::Tensor quant_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scale,
                         std::optional<torch::Tensor> min, int64_t group, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2, "x must be [M, in_features]");
  const int64_t K = x.size(1), N = 16 * codes.size(0);
  TORCH_CHECK(quant_gemv_ok(N, K, group, bits),
              "quant_gemv needs AVX512-VNNI, out_features % 16 == 0, in_features % 32 == 0 "
              "and group % 32 == 0 (or 16 for 8 bits) dividing in_features");
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 2 &&
                  codes.size(1) == K * bits / 8 * 16,
              "codes must be uint8 [out_features / 16, in_features * bits / 8 * 16]");
  const auto st = scale.scalar_type();
  TORCH_CHECK((st == torch::kFloat32 || st == torch::kFloat16) && scale.is_contiguous() &&
                  scale.dim() == 3 && scale.size(0) == N / 16 && scale.size(1) == K / group &&
                  scale.size(2) == 16,
              "scale must be float32 or float16 [out_features / 16, in_features / group, 16]");
  TORCH_CHECK(min.has_value() == (bits == 4), "min is given exactly for 4-bit weights");
  if (min.has_value())
    TORCH_CHECK(min->scalar_type() == st && min->is_contiguous() && min->sizes() == scale.sizes(),
                "min must be shaped and typed as scale");
  x = x.contiguous();
  auto out = torch::empty({x.size(0), N}, x.options());
#if defined(KVSTACK_GEMV_VNNI)
  const int64_t M = x.size(0);
  const auto run = [&](const auto* xp, auto* op) {
    st == torch::kFloat16
        ? gemv_dispatch<c10::Half>(xp, op, M, N, K, group, bits, codes, scale, min)
        : gemv_dispatch<float>(xp, op, M, N, K, group, bits, codes, scale, min);
  };
  if (x.scalar_type() == torch::kBFloat16) {
    run(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "bfloat16 or float32 activations");
    run(x.data_ptr<float>(), out.data_ptr<float>());
  }
#endif
  return out;
}

// Slices for decode_team.cpp (team_slices.h): bf16 activations, a TiledWeight's arrays.
namespace team {

void gemv_quantize_rows(const c10::BFloat16* x, int64_t b, int64_t e, int64_t K,
                        const GemvAct& a) {
#if defined(KVSTACK_GEMV_VNNI)
  quantize_rows(x, b, e, K, a);
#else
  (void)x, (void)b, (void)e, (void)K, (void)a;
  TORCH_CHECK(false, "quant_gemv needs AVX512-VNNI");
#endif
}

void gemv_tiles(const GemvAct& a, c10::BFloat16* out, const GemvWeight& w, int64_t M,
                int64_t b, int64_t e) {
#if defined(KVSTACK_GEMV_VNNI)
  const auto run = [&](const auto* sc, const auto* mn) {
    w.bits == 4 ? ::gemv_tiles<4>(a, out, M, w.N, w.K, w.group, w.codes, sc, mn, b, e)
                : ::gemv_tiles<8>(a, out, M, w.N, w.K, w.group, w.codes, sc, mn, b, e);
  };
  if (w.half_scales)
    run(static_cast<const c10::Half*>(w.scale), static_cast<const c10::Half*>(w.min));
  else
    run(static_cast<const float*>(w.scale), static_cast<const float*>(w.min));
#else
  (void)a, (void)out, (void)w, (void)M, (void)b, (void)e;
  TORCH_CHECK(false, "quant_gemv needs AVX512-VNNI");
#endif
}

}  // namespace team
