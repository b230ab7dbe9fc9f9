// Weight-only quantized linear layers for CPU (kvstack): y = x W^T with W kept packed and
// dequantized in registers, 32 weights at a time, never expanded in memory.
//
// Packed layout (kvstack/model/quant/packed.py, PackedWeight), W is [N, K], groups of G
// consecutive weights of a row share a float32 scale (and, for 4 bits, a float32 min):
//   bits 8: q int8  [N, K],   scale [N, K/G]         W[n, k] = scale[n, k/G] * q[n, k]
//   bits 4: q uint8 [N, K/2], scale, min [N, K/G]    W[n, k] = scale * q[n, k] + min, q 0..15
//           the 32 values k0..k0+31 of a row (k0 % 32 == 0) are the 16 bytes at k0/2, byte
//           j = q[k0 + j] | q[k0 + 16 + j] << 4: llama.cpp's block_q4_0 / block_q4_1 nibble
//           order (ggml-common.h), so Q4_0 / Q4_1 bytes are used as they are; G % 32 == 0.
//
// Exactness: a weight is dequantized with one fma (4 bits) or one multiply (8 bits). For
// every format kvstack packs, scale * q is exact in float32 (GGUF scales are fp16, or fp16
// times a 6-bit integer for Q4_K; kvstack's int4 rounds its scales to fp16), so the fma
// rounds once exactly as the reference's ``q * scale + min`` does: the dequantized weights
// are bit-identical to gguf-py's dequantize (float32). The products are then summed in
// float32 in an order of this kernel's own:
//   float32 x: fp32 FMAs, 16 lanes, one accumulator per row of x;
//   bf16 x:    the weights are rounded to bf16 (round to nearest even, as the dequantize-
//              to-bf16 path and PyTorch's .to(bfloat16)) and multiplied with vdpbf16ps
//              (AVX512-BF16; exact bf16 products, float32 sums), or the same with FMAs.
// So at every M a row's result depends only on that row (never on batch mates); the
// prefill path (quant_dequant + oneDNN) multiplies the same weights.
//
// 8-bit groups need not be whole 32-chunks: Q6_K's are 16 (two scales per 32-chunk, both
// paths; the AVX-512 loop masks any other tail).
//
// Decode (M = 1..32) is memory-bound: each thread takes rows n of W, reads the row's
// packed bytes once per tile of up to 8 rows of x (kept in 8 zmm accumulators), so the
// bytes are read from memory once and from L1 for the further tiles. Without AVX-512 (AMD
// Zen 2 / 3: AVX2 + FMA) the same loops run 8 lanes wide (tile_dot_avx2, dequant32_avx2);
// other CPUs take the scalar loop (weight_at).
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <type_traits>

#include "kvstack_ops.h"
#include "simd.h"

namespace {

#if defined(__AVX512F__) || !defined(__AVX2__)
constexpr int kTile = 8;  // rows of x per register tile
#else
constexpr int kTile = 4;  // AVX2: 16 ymm registers (tile_dot_avx2)
#endif

struct Packed {
  const uint8_t* q;
  const float* scale;
  const float* mn;  // nullptr for 8 bits
  int64_t N, K, G, bits;
  int64_t row_bytes() const { return bits == 8 ? K : K / 2; }
  int64_t groups() const { return K / G; }
};

Packed check_packed(const torch::Tensor& q, const torch::Tensor& scale,
                    const std::optional<torch::Tensor>& mn, int64_t group, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous(), "q must be a contiguous [N, row_bytes] matrix");
  TORCH_CHECK(q.scalar_type() == (bits == 8 ? torch::kInt8 : torch::kUInt8),
              "q must be int8 (bits 8) or uint8 (bits 4)");
  const int64_t N = q.size(0), K = bits == 8 ? q.size(1) : 2 * q.size(1);
  TORCH_CHECK(group > 0 && K % group == 0, "group must divide in_features");
  TORCH_CHECK(bits == 8 || group % 32 == 0, "4-bit groups must be multiples of 32");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() &&
                  scale.dim() == 2 && scale.size(0) == N && scale.size(1) == K / group,
              "scale must be float32 [N, K / group]");
  TORCH_CHECK(mn.has_value() == (bits == 4), "min is given exactly for 4-bit weights");
  const float* mp = nullptr;
  if (mn.has_value()) {
    TORCH_CHECK(mn->scalar_type() == torch::kFloat32 && mn->is_contiguous() &&
                    mn->sizes() == scale.sizes(),
                "min must be float32 shaped as scale");
    mp = mn->data_ptr<float>();
  }
  return Packed{reinterpret_cast<const uint8_t*>(q.data_ptr()), scale.data_ptr<float>(), mp,
                N, K, group, bits};
}

#if defined(KVSTACK_AVX512)
// The 32 weights of row `qrow` from k0 as float32: lo = k0..k0+15, hi = k0+16..k0+31.
// `mask` (8 bits only) marks the ones inside the group; the others are 0. 8 bits: `s_hi`
// scales hi (groups of 16: the next group's scale; else s).
template <int BITS>
inline void dequant32(const uint8_t* qrow, int64_t k0, __m512 s, __m512 s_hi, __m512 mn,
                      __mmask32 mask, __m512& lo, __m512& hi) {
  if constexpr (BITS == 4) {
    const __m512i v =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + k0 / 2)));
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), s, mn);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s, mn);
  } else {
    const __m256i b = _mm256_maskz_loadu_epi8(mask, qrow + k0);
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b))), s);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1))),
                       s_hi);
  }
}

// out[m] = sum_k x[m, k] W[n, k] for MT rows of x (stride K): float32 or bf16 x.
template <int MT, int BITS, typename T>
void tile_dot(const Packed& w, int64_t n, const T* x, float* out) {
  // Two accumulators per row (even / odd 32-chunks) so that consecutive FMAs of a row
  // do not wait on each other's latency (one chain made M = 1 latency-bound).
  __m512 acc2[2][MT];
  for (int m = 0; m < MT; ++m) acc2[0][m] = acc2[1][m] = _mm512_setzero_ps();
  int parity = 0;
  const uint8_t* qrow = w.q + n * w.row_bytes();
  const int64_t ng = w.groups(), K = w.K;
  // 8-bit groups of 16 (Q6_K) are taken in pairs: one 32-chunk, a scale per half
  const bool pairs = BITS == 8 && w.G == 16;
  for (int64_t g = 0; g < ng;) {
    const int64_t step = pairs && g + 1 < ng ? 2 : 1;
    const __m512 s = _mm512_set1_ps(w.scale[n * ng + g]);
    const __m512 s_hi = _mm512_set1_ps(w.scale[n * ng + g + step - 1]);
    const __m512 mn = BITS == 4 ? _mm512_set1_ps(w.mn[n * ng + g]) : _mm512_setzero_ps();
    const int64_t end = (g + step) * w.G;
    for (int64_t k0 = g * w.G; k0 < end; k0 += 32) {
      const int64_t len = std::min<int64_t>(32, end - k0);
      const __mmask32 mask = len == 32 ? 0xFFFFFFFFu : (1u << len) - 1u;
      __m512 lo, hi;
      dequant32<BITS>(qrow, k0, s, s_hi, mn, mask, lo, hi);
      __m512* acc = acc2[parity];
      parity ^= 1;
      if constexpr (std::is_same_v<T, float>) {
        const __mmask16 m0 = static_cast<__mmask16>(mask), m1 = static_cast<__mmask16>(mask >> 16);
        for (int m = 0; m < MT; ++m) {
          acc[m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m0, x + m * K + k0), lo, acc[m]);
          acc[m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m1, x + m * K + k0 + 16), hi, acc[m]);
        }
      } else {
#if defined(__AVX512BF16__)
        const __m512bh wb = _mm512_cvtne2ps_pbh(hi, lo);  // element i = W[k0 + i]
        for (int m = 0; m < MT; ++m) {
          const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + m * K + k0);
          acc[m] = _mm512_dpbf16_ps(acc[m], reinterpret_cast<const __m512bh&>(xv), wb);
        }
#else
        lo = round_to<c10::BFloat16>(lo);
        hi = round_to<c10::BFloat16>(hi);
        const __mmask16 m0 = static_cast<__mmask16>(mask), m1 = static_cast<__mmask16>(mask >> 16);
        for (int m = 0; m < MT; ++m) {
          const T* xr = x + m * K + k0;
          const __m512 x0 = _mm512_castsi512_ps(_mm512_slli_epi32(
              _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m0, xr)), 16));
          const __m512 x1 = _mm512_castsi512_ps(_mm512_slli_epi32(
              _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m1, xr + 16)), 16));
          acc[m] = _mm512_fmadd_ps(x0, lo, acc[m]);
          acc[m] = _mm512_fmadd_ps(x1, hi, acc[m]);
        }
#endif
      }
    }
    g += step;
  }
  for (int m = 0; m < MT; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc2[0][m], acc2[1][m]));
}
#endif

#if defined(KVSTACK_AVX2) && !defined(KVSTACK_AVX512)
#define KVSTACK_QUANT_AVX2 1
// AVX2 (no AVX-512: AMD Zen 2 / 3 ...): the same arithmetic 8 lanes at a time, for groups of
// whole 32-chunks (G % 32 == 0) or 8-bit pairs of 16-groups in whole 32-chunks (Q6_K:
// avx2_rows); other shapes take the scalar path. s_hi scales 8-bit weights k0+16..k0+31.
// w[i] = weights k0 + 8i .. k0 + 8i + 7 of row `qrow`, as float32.
template <int BITS>
inline void dequant32_avx2(const uint8_t* qrow, int64_t k0, __m256 s, __m256 s_hi, __m256 mn,
                           __m256* w) {
  if constexpr (BITS == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + k0 / 2));
    const __m128i m4 = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[i])), s, mn);
  } else {
    for (int i = 0; i < 4; ++i) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qrow + k0 + 8 * i));
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), i < 2 ? s : s_hi);
    }
  }
}

// As tile_dot (AVX-512), 8 lanes, tiles of up to 4 rows of x (kTile): two accumulators per
// row (the 8-lane quarters 0, 2 and 1, 3 of each 32-chunk) so that a row's consecutive FMAs
// do not wait on each other, the same two at every MT (a row's sums never depend on MT).
template <int MT, int BITS, typename T>
void tile_dot_avx2(const Packed& w, int64_t n, const T* x, float* out) {
  constexpr int P = 2;
  __m256 acc[MT][P];
  for (int m = 0; m < MT; ++m)
    for (int p = 0; p < P; ++p) acc[m][p] = _mm256_setzero_ps();
  const uint8_t* qrow = w.q + n * w.row_bytes();
  const int64_t ng = w.groups(), K = w.K, step = w.G == 16 ? 2 : 1;  // 16: pairs of groups
  for (int64_t g = 0; g < ng; g += step) {
    const __m256 s = _mm256_set1_ps(w.scale[n * ng + g]);
    const __m256 s_hi = _mm256_set1_ps(w.scale[n * ng + g + step - 1]);
    const __m256 mn = BITS == 4 ? _mm256_set1_ps(w.mn[n * ng + g]) : _mm256_setzero_ps();
    for (int64_t k0 = g * w.G; k0 < (g + step) * w.G; k0 += 32) {
      __m256 wv[4];
      dequant32_avx2<BITS>(qrow, k0, s, s_hi, mn, wv);
      for (int i = 0; i < 4; ++i) {
        if constexpr (!std::is_same_v<T, float>) wv[i] = round_bf16_8(wv[i]);
        for (int m = 0; m < MT; ++m)
          acc[m][i % P] = _mm256_fmadd_ps(load8(x + m * K + k0 + 8 * i), wv[i], acc[m][i % P]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m256 t = acc[m][0];
    for (int p = 1; p < P; ++p) t = _mm256_add_ps(t, acc[m][p]);
    out[m] = hsum8(t);
  }
}
#endif

#if defined(KVSTACK_QUANT_AVX2) || defined(KVSTACK_AVX512)
// Whether a row is whole 32-chunks of one group, or (8 bits) of two groups of 16.
inline bool avx2_rows(const Packed& w) {
  return w.G % 32 == 0 || (w.bits == 8 && w.G == 16 && w.K % 32 == 0);
}
#endif

// Weight (n, k) as float32, rounded to T's precision (the scalar path and tails).
template <typename T>
inline float weight_at(const Packed& w, int64_t n, int64_t k) {
  const int64_t gi = n * w.groups() + k / w.G;
  float v;
  if (w.bits == 8) {
    v = static_cast<float>(reinterpret_cast<const int8_t*>(w.q)[n * w.K + k]) * w.scale[gi];
  } else {
    const int64_t c = k / 32 * 32, j = k - c;
    const uint8_t b = w.q[n * w.row_bytes() + c / 2 + (j & 15)];
    const int qv = j < 16 ? (b & 15) : (b >> 4);
    v = std::fma(static_cast<float>(qv), w.scale[gi], w.mn[gi]);
  }
  return round_f<T>(v);
}

template <typename T>
void tile_dot_scalar(const Packed& w, int64_t n, const T* x, int mt, float* out) {
  for (int m = 0; m < mt; ++m) out[m] = 0.f;
  for (int64_t k = 0; k < w.K; ++k) {
    const float wk = weight_at<T>(w, n, k);
    for (int m = 0; m < mt; ++m) out[m] += to_f(x[m * w.K + k]) * wk;
  }
}

template <int BITS, typename T>
void run_tile(const Packed& w, int64_t n, const T* x, int mt, float* out) {
#if defined(KVSTACK_AVX512)
  switch (mt) {
    case 1: return tile_dot<1, BITS>(w, n, x, out);
    case 2: return tile_dot<2, BITS>(w, n, x, out);
    case 3: return tile_dot<3, BITS>(w, n, x, out);
    case 4: return tile_dot<4, BITS>(w, n, x, out);
    case 5: return tile_dot<5, BITS>(w, n, x, out);
    case 6: return tile_dot<6, BITS>(w, n, x, out);
    case 7: return tile_dot<7, BITS>(w, n, x, out);
    default: return tile_dot<8, BITS>(w, n, x, out);
  }
#elif defined(KVSTACK_QUANT_AVX2)
  if (avx2_rows(w)) {
    switch (mt) {
      case 1: return tile_dot_avx2<1, BITS>(w, n, x, out);
      case 2: return tile_dot_avx2<2, BITS>(w, n, x, out);
      case 3: return tile_dot_avx2<3, BITS>(w, n, x, out);
      default: return tile_dot_avx2<4, BITS>(w, n, x, out);
    }
  }
  tile_dot_scalar(w, n, x, mt, out);
#else
  tile_dot_scalar(w, n, x, mt, out);
#endif
}

template <int BITS, typename T>
void linear_impl(const Packed& w, const T* x, T* out, int64_t M) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(M * w.K, 1));
  at::parallel_for(0, w.N, grain, [&](int64_t b, int64_t e) {
    float tmp[kTile];
    for (int64_t n = b; n < e; ++n) {
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {
        const int mt = static_cast<int>(std::min<int64_t>(kTile, M - m0));
        run_tile<BITS>(w, n, x + m0 * w.K, mt, tmp);
        for (int i = 0; i < mt; ++i) out[(m0 + i) * w.N + n] = static_cast<T>(tmp[i]);
      }
    }
  });
}

template <typename T>
void dequant_impl(const Packed& w, T* out) {
  at::parallel_for(0, w.N, 16, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      T* row = out + n * w.K;
      int64_t k = 0;
#if defined(KVSTACK_AVX512)
      if (avx2_rows(w)) {  // whole 32-chunks: one group, or (8 bits) two of 16
        const uint8_t* qrow = w.q + n * w.row_bytes();
        for (; k < w.K; k += 32) {
          const int64_t gi = n * w.groups() + k / w.G, hi_gi = n * w.groups() + (k + 16) / w.G;
          const __m512 s = _mm512_set1_ps(w.scale[gi]);
          __m512 lo, hi;
          if (w.bits == 4)
            dequant32<4>(qrow, k, s, s, _mm512_set1_ps(w.mn[gi]), 0xFFFFFFFFu, lo, hi);
          else
            dequant32<8>(qrow, k, s, _mm512_set1_ps(w.scale[hi_gi]), _mm512_setzero_ps(),
                         0xFFFFFFFFu, lo, hi);
          store16(row + k, lo);
          store16(row + k + 16, hi);
        }
      }
#elif defined(KVSTACK_QUANT_AVX2)
      if (avx2_rows(w)) {
        const uint8_t* qrow = w.q + n * w.row_bytes();
        for (; k < w.K; k += 32) {
          const int64_t gi = n * w.groups() + k / w.G, hi_gi = n * w.groups() + (k + 16) / w.G;
          const __m256 s = _mm256_set1_ps(w.scale[gi]);
          __m256 wv[4];
          if (w.bits == 4)
            dequant32_avx2<4>(qrow, k, s, s, _mm256_set1_ps(w.mn[gi]), wv);
          else
            dequant32_avx2<8>(qrow, k, s, _mm256_set1_ps(w.scale[hi_gi]), _mm256_setzero_ps(), wv);
          for (int i = 0; i < 4; ++i) store8(row + k + 8 * i, wv[i]);
        }
      }
#endif
      for (; k < w.K; ++k) row[k] = static_cast<T>(weight_at<float>(w, n, k));
    }
  });
}

}  // namespace

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                           std::optional<torch::Tensor> min, int64_t group, int64_t bits) {
  const Packed w = check_packed(q, scale, min, group, bits);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.K, "x must be [M, in_features]");
  x = x.contiguous();
  const int64_t M = x.size(0);
  auto out = torch::empty({M, w.N}, x.options());
  if (x.scalar_type() == torch::kBFloat16) {
    auto* xp = x.data_ptr<c10::BFloat16>();
    auto* op = out.data_ptr<c10::BFloat16>();
    bits == 4 ? linear_impl<4>(w, xp, op, M) : linear_impl<8>(w, xp, op, M);
  } else if (x.scalar_type() == torch::kFloat32) {
    auto* xp = x.data_ptr<float>();
    auto* op = out.data_ptr<float>();
    bits == 4 ? linear_impl<4>(w, xp, op, M) : linear_impl<8>(w, xp, op, M);
  } else {
    TORCH_CHECK(false, "quant_linear supports bfloat16 and float32 activations");
  }
  return out;
}

torch::Tensor quant_dequant(torch::Tensor q, torch::Tensor scale, std::optional<torch::Tensor> min,
                            int64_t group, int64_t bits, c10::ScalarType dtype) {
  const Packed w = check_packed(q, scale, min, group, bits);
  auto out = torch::empty({w.N, w.K}, scale.options().dtype(dtype));
  if (dtype == torch::kBFloat16)
    dequant_impl(w, out.data_ptr<c10::BFloat16>());
  else if (dtype == torch::kFloat32)
    dequant_impl(w, out.data_ptr<float>());
  else
    TORCH_CHECK(false, "quant_dequant writes bfloat16 or float32");
  return out;
}
