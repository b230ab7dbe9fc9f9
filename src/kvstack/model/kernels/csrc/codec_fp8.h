// Decode scores over fp8 KV codes (e4m3 / e5m2) with AVX512-BF16 dot products on the codes'
// own bits (paged_attention_codecs.cpp, pass 1 of a partition, bf16 queries).
//
// An fp8 byte's exponent and mantissa fields, shifted into a bf16's, are a bf16 of the same
// value times a power of two: e4m3 (bias 7) placed at bit 4 reads as value * 2^-120, e5m2
// (bias 15) placed at bit 5 as value * 2^-112, the sign going to bit 15:
//
//   e4m3  s eeee mmm   ->  bf16  s 0000eeee mmm0000     sign-extend to 16 bits, << 4,
//   e5m2  s eeeee mm   ->  bf16  s 000eeeee mm00000     keep 0x87F0 (e5m2: << 5, 0x8FE0)
//
// three integer instructions per 32 codes, where widening to float32 (vcvtph2ps) and
// rounding back to bf16 pairs took eight. The query is scaled by 2^100 first (exact) so
// the products stay far above float32's smallest normal; the row factor carries the scale
// times 2^20 (e4m3) or 2^12 (e5m2). One deviation: fp8 subnormal codes (e4m3: |x| below
// 2^-6 of the row's scale, i.e. amax / 28,672) become bf16 subnormals, which VDPBF16PS reads
// as zero: such a channel adds nothing to the score instead of at most 3.5e-5 of the row's
// amax times the query (the reference path's own bf16 rounding of a dequantized key is up
// to 2^-9 of each channel). The P.V pass still decodes values exactly (codec_rows.h).
#pragma once
#include "codec_rows.h"

#if defined(KVSTACK_CODEC_AVX512) && defined(__AVX512BF16__)
#define KVSTACK_CODEC_FP8_BITS 1

// 32 fp8 codes as bf16 bits of value * 2^-120 (e4m3) or value * 2^-112 (e5m2).
template <Codec C>
static inline __m512i fp8x32_bf16_bits(const uint8_t* p) {
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  if constexpr (C == Codec::kFP8E4M3)
    return _mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(static_cast<short>(0x87F0)));
  else
    return _mm512_and_si512(_mm512_slli_epi16(w, 5), _mm512_set1_epi16(static_cast<short>(0x8FE0)));
}

// Scores of tokens [t0, t1) (n <= kPart) of KV head kh for G q heads (q: G float rows of
// 64) into sc[g][0 .. roundup16(n)), padding lanes -inf; times `scale`. K rows are
// prefetched kAhead tokens ahead into L1, V rows into L2 for the P.V pass.
template <Codec C, int G, int64_t kPart>
void fp8_scores(const CodecView& cv, const float* q, const int64_t* table, int64_t kh,
                int64_t t0, int64_t t1, float scale, float (*sc)[kPart]) {
  constexpr int64_t kAhead = 64;
  constexpr float kUp = 0x1p100f, kFactor = C == Codec::kFP8E4M3 ? 0x1p20f : 0x1p12f;
  const int64_t n = t1 - t0, np = (n + 15) / 16 * 16;
  __m512bh qh[G][2];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < 2; ++k)
      qh[g][k] = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(q + 64 * g + 32 * k + 16), _mm512_set1_ps(kUp)),
                                     _mm512_mul_ps(_mm512_loadu_ps(q + 64 * g + 32 * k), _mm512_set1_ps(kUp)));
  int64_t rows[kPart];
  partition_rows(cv, table, kh, t0, n, rows);
  auto prefetch = [&](int64_t r) {
    _mm_prefetch(reinterpret_cast<const char*>(cv.kc + r * 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cv.vc + r * 64), _MM_HINT_T1);
    prefetch_item_heads(cv, r);
  };
  for (int64_t j = 0; j < std::min(kAhead, n); ++j) prefetch(rows[j]);
  alignas(64) uint16_t kb[16][64];
  alignas(64) float fac[16];
  for (int64_t j0 = 0; j0 < np; j0 += 16) {
    const int live_n = static_cast<int>(std::min<int64_t>(16, n - j0));
    for (int64_t j = j0 + kAhead; j < std::min(j0 + kAhead + 16, n); ++j) prefetch(rows[j]);
    for (int j = 0; j < 16; ++j) {
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      fac[j] = 0.f;
      if (j < live_n) {
        const uint8_t* c = cv.kc + rows[j0 + j] * 64;
        lo = fp8x32_bf16_bits<C>(c);
        hi = fp8x32_bf16_bits<C>(c + 32);
        fac[j] = bf(cv.kp[rows[j0 + j]]) * kFactor;
      }
      _mm512_store_si512(kb[j], lo);
      _mm512_store_si512(kb[j] + 32, hi);
    }
    const __mmask16 live = static_cast<__mmask16>(live_n == 16 ? 0xFFFF : (1u << live_n) - 1);
    const __m512 f = _mm512_mul_ps(_mm512_load_ps(fac), _mm512_set1_ps(scale));
    for (int g = 0; g < G; ++g) {
      __m512 d16[16];
      for (int j = 0; j < 16; ++j) {
        const __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qh[g][0], (__m512bh)_mm512_load_si512(kb[j]));
        d16[j] = _mm512_dpbf16_ps(a, qh[g][1], (__m512bh)_mm512_load_si512(kb[j] + 32));
      }
      const __m512 s = _mm512_mul_ps(hsum16(d16), f);
      _mm512_store_ps(sc[g] + j0, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, s));
    }
  }
}
#endif
