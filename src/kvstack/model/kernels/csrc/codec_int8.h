// Decode scores over int8 KV codes with integer dot products (paged_attention_codecs.cpp,
// pass 1 of a partition, bf16 queries, AVX512-VNNI).
//
// An int8 key row is c * s (64 codes c, one bf16 scale s per token and KV head). Widening
// the codes to float32 and rounding them to bf16 pairs for VDPBF16PS cost ~10 vector
// instructions a row, more than the dot products themselves: on a Zen 5 EPYC that made
// int8 attention 2x slower than bf16's, though it reads half the bytes. Here the query is
// put in int16 once per (row, q head): q16 = round(q / qs), qs = max|q| / 32767, and
//
//   q . k  ~=  qs * s * sum_i q16_i c_i
//
// with the sum exact in int32 (VPDPWSSD on int16 pairs: |sum| <= 64 * 32767 * 127 < 2^31).
// The codes are sign-extended to int16 once per row (VPMOVSXBW). The query's rounding error
// is at most qs / 2 per channel (2^-16 of max|q|), below what the reference path's bf16
// rounding of the dequantized keys (2^-9 relative per channel) already adds; float32
// queries keep the float32 path.
#pragma once
#include "codec_rows.h"

#if defined(KVSTACK_CODEC_AVX512) && defined(__AVX512VNNI__)
#define KVSTACK_CODEC_INT8_VNNI 1

// Stages 1-3 of hsum16's network on int32 lanes: y[0] holds, per 128-bit chunk, the sums of
// rows 0-3 over chunk 0 + 1, rows 0-3 over chunks 2 + 3, rows 4-7 over 0 + 1, rows 4-7 over
// 2 + 3 (lane k of a chunk = row k); y[1] the same for rows 8-15.
static inline void hsum16i_halves(const __m512i* v, __m512i* y) {
  __m512i w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(w[2 * i], w[2 * i + 1]),
                            _mm512_unpackhi_epi64(w[2 * i], w[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(x[2 * i], x[2 * i + 1], 0x88),
                            _mm512_shuffle_i32x4(x[2 * i], x[2 * i + 1], 0xDD));
}

// Lane j of the result is the sum of v[j]'s 16 int32 lanes (hsum16's network on integers).
static inline __m512i hsum16i(const __m512i* v) {
  __m512i y[2];
  hsum16i_halves(v, y);
  return _mm512_add_epi32(_mm512_shuffle_i32x4(y[0], y[1], 0x88),
                          _mm512_shuffle_i32x4(y[0], y[1], 0xDD));
}

// One q head of 64 float channels as int16 (two vectors of 32, natural order); returns qs.
static inline float query_int16(const float* q, __m512i* q16) {
  __m512 a = _mm512_setzero_ps();
  for (int k = 0; k < 4; ++k) a = _mm512_max_ps(a, _mm512_abs_ps(_mm512_loadu_ps(q + 16 * k)));
  const float amax = _mm512_reduce_max_ps(a);
  const float qs = amax > 0.f ? amax / 32767.f : 1.f;
  const __m512 inv = _mm512_set1_ps(1.f / qs);
  __m256i h[4];
  for (int k = 0; k < 4; ++k)
    h[k] = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + 16 * k), inv)));
  q16[0] = _mm512_inserti64x4(_mm512_castsi256_si512(h[0]), h[1], 1);
  q16[1] = _mm512_inserti64x4(_mm512_castsi256_si512(h[2]), h[3], 1);
  return qs;
}

// Token row r's K codes into L1 for this pass, its V codes into L2 for the P.V pass (rows
// sit scattered over blocks: the hardware prefetcher cannot follow them).
static inline void prefetch_int8_row(const CodecView& cv, int64_t r) {
  _mm_prefetch(reinterpret_cast<const char*>(cv.kc + r * 64), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(cv.vc + r * 64), _MM_HINT_T1);
  prefetch_item_heads(cv, r);
}

// Scores of tokens [t0, t1) (one partition, n <= kPart) of KV head kh for G q heads (q: G
// float rows of 64) into sc[g][0 .. roundup16(n)), padding lanes -inf; times `scale`.
// Code rows are prefetched kAhead tokens ahead (one 64-byte line each, K and V).
template <int G, int64_t kPart>
void int8_scores(const CodecView& cv, const float* q, const int64_t* table, int64_t kh,
                 int64_t t0, int64_t t1, float scale, float (*sc)[kPart]) {
  constexpr int64_t kAhead = 64;
  const int64_t n = t1 - t0, np = (n + 15) / 16 * 16;
  __m512i q16[G][2];
  float qs[G];
  for (int g = 0; g < G; ++g) qs[g] = query_int16(q + 64 * g, q16[g]);
  int64_t rows[kPart];
  partition_rows(cv, table, kh, t0, n, rows);
  for (int64_t j = 0; j < std::min(kAhead, n); ++j) prefetch_int8_row(cv, rows[j]);
  alignas(64) int16_t kb[16][64];
  alignas(64) float fac[16];
  for (int64_t j0 = 0; j0 < np; j0 += 16) {
    const int live_n = static_cast<int>(std::min<int64_t>(16, n - j0));
    for (int64_t j = j0 + kAhead; j < std::min(j0 + kAhead + 16, n); ++j)
      prefetch_int8_row(cv, rows[j]);
    for (int j = 0; j < 16; ++j) {
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      fac[j] = 0.f;
      if (j < live_n) {
        const uint8_t* c = cv.kc + rows[j0 + j] * 64;
        lo = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
        hi = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32)));
        fac[j] = bf(cv.kp[rows[j0 + j]]);
      }
      _mm512_store_si512(kb[j], lo);
      _mm512_store_si512(kb[j] + 32, hi);
    }
    const __mmask16 live = static_cast<__mmask16>(live_n == 16 ? 0xFFFF : (1u << live_n) - 1);
    const __m512 f = _mm512_load_ps(fac);
    for (int g = 0; g < G; ++g) {
      __m512i d16[16];
      for (int j = 0; j < 16; ++j) {
        const __m512i a = _mm512_dpwssd_epi32(_mm512_setzero_si512(), q16[g][0], _mm512_load_si512(kb[j]));
        d16[j] = _mm512_dpwssd_epi32(a, q16[g][1], _mm512_load_si512(kb[j] + 32));
      }
      const __m512 s = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hsum16i(d16)), f),
                                     _mm512_set1_ps(qs[g] * scale));
      _mm512_store_ps(sc[g] + j0, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, s));
    }
  }
}
#endif
