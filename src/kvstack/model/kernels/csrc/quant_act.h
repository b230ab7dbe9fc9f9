// Activations quantized to int8 per 32-value chunk, as llama.cpp quantizes them for its
// Q4_0 / Q4_1 / Q8_0 dot products (block_q8_0 / block_q8_1, ggml-quants.c):
//   d = max |x[32c .. 32c+31]| / 127,   xq = round(x / d) in [-127, 127] (nearest even)
// Shared by quant_vnni.cpp (row-major weights) and quant_gemv.cpp (16-row tiles).
#pragma once
#include <algorithm>
#include <cmath>
#include <utility>

#include "simd.h"

namespace kvstack_quant {

// One chunk's scale d, the sum of its 32 codes and of its first 16 (the second half's is
// sum - sum_lo: 8-bit weights in groups of 16, Q6_K, take each half's sum).
struct Chunk {
  float d;
  int sum;
  int sum_lo;
};

// One chunk of 32 activations: codes to q, returns its Chunk.
template <typename T>
inline Chunk quantize_chunk(const T* src, int8_t* q) {
#if defined(KVSTACK_AVX512)
  const __m512 v0 = load16(src), v1 = load16(src + 16);
  const __m512 mag = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
  const float d = _mm512_reduce_max_ps(mag) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  // cvtps_epi32 rounds to nearest even, as nearbyint below
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  const int lo = _mm512_reduce_add_epi32(q0);
  return {d, lo + _mm512_reduce_add_epi32(q1), lo};
#elif defined(KVSTACK_AVX2)
  __m256 v[4];
  __m256 mag = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(src + 8 * i);
    mag = _mm256_max_ps(mag, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mag), _mm256_extractf128_ps(mag, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  __m256i qi[4];  // cvtps_epi32 rounds to nearest even, as nearbyint below
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
  // int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back
  const __m256i w01 = _mm256_packs_epi32(qi[0], qi[1]), w23 = _mm256_packs_epi32(qi[2], qi[3]);
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), b);
  const auto hsum = [](__m256i s) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s4);
  };
  const int lo = hsum(_mm256_add_epi32(qi[0], qi[1]));
  return {d, lo + hsum(_mm256_add_epi32(qi[2], qi[3])), lo};
#else
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(to_f(src[j])));
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  int sum = 0, lo = 0;
  for (int j = 0; j < 32; ++j) {
    const int v = static_cast<int>(std::nearbyint(to_f(src[j]) * inv));
    q[j] = static_cast<int8_t>(v);
    sum += v;
    if (j == 15) lo = sum;
  }
  return {d, sum, lo};
#endif
}

}  // namespace kvstack_quant
