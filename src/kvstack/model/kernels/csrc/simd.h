// SIMD helpers shared by kvstack's CPU kernels (AVX-512 when the compiler targets it; the
// 8-lane AVX2 + FMA subset below for CPUs without AVX-512, e.g. AMD EPYC Zen 2/3).
//
// bf16 <-> float32 conversions round to nearest even, exactly as c10::BFloat16 (and so
// PyTorch) does, so a kernel that rounds where PyTorch rounds gives bit-identical results.
#pragma once
#include <torch/types.h>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#define KVSTACK_AVX512 1

// 16 lanes -> float32 (bf16 is the upper half of a float32).
static inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// float32 -> bf16 bits, round to nearest even; NaN stays a quiet NaN.
static inline __m256i bf16_bits(__m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
static inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(v));
}
static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

// Rounds each lane to the nearest T value (identity for float; bf16 round trip).
template <typename T>
static inline __m512 round_to(__m512 v);
template <>
inline __m512 round_to<float>(__m512 v) { return v; }
template <>
inline __m512 round_to<c10::BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16));
}

// exp(x) as 2^n * 2^f with a degree-7 Taylor polynomial on |f ln2| <= 0.35 (truncation
// ~6e-9, below float32's epsilon), x clamped to
// [-87, 88] (exp(-87) ~ 1.6e-38 stands for 0, exp(88) ~ 1.6e38 for overflow).
static inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // y = x - n ln2 in two steps (Cody-Waite): ln2 = 0.693359375 - 2.12194440e-4.
  __m512 y = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  y = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), y);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Sums each of 16 vectors: lane t of the result = sum of v[t]'s lanes.
static inline __m512 hsum16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88),
                       _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
}

// Whether this build scores bf16 pairs with VDPBF16PS (AVX512-BF16).
#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif

// Softmax numerators of one row of n scores in place (s[0 .. np), np = n rounded up to 16,
// lanes past n -inf on entry): s = exp(s - m) with 0 past n; returns m = max and l = sum.
// The decode kernels' second pass (paged_attention_hd64.h, codec_decode64.h).
static inline void softmax_numerators(float* s, int64_t n, int64_t np, float* m, float* l) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < np; j += 16) mv = _mm512_max_ps(mv, _mm512_load_ps(s + j));
  *m = _mm512_reduce_max_ps(mv);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < np; j += 16) {
    const __mmask16 live = static_cast<__mmask16>(n - j >= 16 ? 0xFFFF : (1u << (n - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(
        live, exp512(_mm512_sub_ps(_mm512_load_ps(s + j), _mm512_set1_ps(*m))));
    _mm512_store_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  *l = _mm512_reduce_add_ps(sum);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVSTACK_AVX2 1

// 8 lanes -> float32.
static inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// Sum of the 8 lanes.
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Each lane rounded to the nearest bf16 (ties to even) and kept as float32; NaN becomes the
// quiet NaN 0x7FC0, as c10::BFloat16 does.
static inline __m256 round_bf16_8(__m256 v) {
  const __m256i i = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(i, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256 rounded = _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(-65536)));
  return _mm256_blendv_ps(rounded, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                          _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// Rounds each lane to the nearest T value (identity for float; bf16 round trip).
template <typename T>
static inline __m256 round_to8(__m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return round_bf16_8(v);
  }
}

static inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void store8(c10::BFloat16* p, __m256 v) {  // as .to(bfloat16)
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_8(v)), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

// exp(x) for 8 lanes, the same method and constants as exp512 (2^n by adding n to the
// exponent field; n in [-126, 127] after the clamp, so the result stays a normal float).
static inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 y = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  y = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), y);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f));
  // p in [0.7, 1.42]: multiplying by 2^n adds n to its exponent (no overflow past the clamp:
  // 2^127 * 1.42 < FLT_MAX; 2^-126 * 0.7 is normal except at the very bottom, ~0 anyway).
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}
#endif

// Scalar helpers (any ISA).
template <typename T>
static inline float to_f(T v) { return static_cast<float>(v); }
template <typename T>
static inline float round_f(float v) { return static_cast<float>(static_cast<T>(v)); }
