// Decode scores over 4-bit KV codes (int4: groups of 32 channels; rotated4: one group per
// head vector) with integer dot products (paged_attention_codecs.cpp, pass 1 of a
// partition, bf16 queries, AVX512-VNNI, head_dim 64).
//
// A key channel i of group g is c_i s_g + z_g (codes 0..15), so
//
//   q . k  =  sum_g  s_g (q_g . c_g)  +  z_g sum(q_g)
//
// The sums of the query over each group are taken once per partition; q . c runs on
// integers as for int8 (codec_int8.h): the query in int16 (q16 = round(q / qs)), the 32
// bytes of a row widened to int16 once (VPMOVZXBW), low nibbles = even channels, high
// nibbles = odd ones, and VPDPWSSD sums pairs into int32 (exact: a group's sum is at most
// 32 * 32767 * 15 < 2^24, so also exact in float32). Int32 lanes 0-7 of a row then belong
// to group 0 (channels 0-31) and lanes 8-15 to group 1: the first three stages of the
// horizontal reduction leave each row's two group sums apart, where they are scaled by
// s_0 and s_1, before the last stage adds them (for rotated4 s_0 = s_1 = s, z likewise).
// Instead of ~12 instructions a row to widen the nibbles to float32 with their scale and
// zero, and 4 to round them to bf16 pairs, about 5.
#pragma once
#include "codec_int8.h"

#if defined(KVSTACK_CODEC_INT8_VNNI)

// The query of one q head (64 float channels, natural order) as int16 even channels and
// odd channels (vectors 0 and 1) and the float sums of its two 32-channel halves.
static inline float query_int16_nibbles(const float* q, __m512i* q16, float* half_sums) {
  alignas(64) float even[32], odd[32];
  for (int i = 0; i < 32; ++i) even[i] = q[2 * i], odd[i] = q[2 * i + 1];
  __m512 a = _mm512_setzero_ps();
  for (int k = 0; k < 2; ++k) {
    a = _mm512_max_ps(a, _mm512_abs_ps(_mm512_load_ps(even + 16 * k)));
    a = _mm512_max_ps(a, _mm512_abs_ps(_mm512_load_ps(odd + 16 * k)));
  }
  const float amax = _mm512_reduce_max_ps(a);
  const float qs = amax > 0.f ? amax / 32767.f : 1.f;
  const __m512 inv = _mm512_set1_ps(1.f / qs);
  for (int v = 0; v < 2; ++v) {
    const float* src = v == 0 ? even : odd;
    const __m256i lo = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(src), inv)));
    const __m256i hi = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(src + 16), inv)));
    q16[v] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  for (int h = 0; h < 2; ++h) {
    float s = 0.f;
    for (int i = 32 * h; i < 32 * h + 32; ++i) s += q[i];
    half_sums[h] = s;
  }
  return qs;
}

// Each row's two 32-channel group sums apart (hsum16i_halves), in float32 (exact: < 2^24):
// y[0] lanes = rows 0-3 group 0, rows 0-3 group 1, rows 4-7 group 0, rows 4-7 group 1
// (4 lanes each); y[1] the same for rows 8-15.
static inline void group_sums16(const __m512i* v, __m512* y) {
  __m512i yi[2];
  hsum16i_halves(v, yi);
  for (int i = 0; i < 2; ++i) y[i] = _mm512_cvtepi32_ps(yi[i]);
}

// Scores of tokens [t0, t1) (n <= kPart) of KV head kh for G q heads into sc (as
// int8_scores). Rotated4 passes the query already rotated (q R); its rows carry one
// (scale, zero) pair (cols 2), int4's two (cols 4: s0, z0, s1, z1).
template <int G, int64_t kPart>
void int4_scores(const CodecView& cv, const float* q, const int64_t* table, int64_t kh,
                 int64_t t0, int64_t t1, float scale, float (*sc)[kPart]) {
  constexpr int64_t kAhead = 64;
  const int64_t n = t1 - t0, np = (n + 15) / 16 * 16, cols = cv.k_cols;
  __m512i q16[G][2];
  float qs[G], qsum[G][2];
  for (int g = 0; g < G; ++g) qs[g] = query_int16_nibbles(q + 64 * g, q16[g], qsum[g]);
  int64_t rows[kPart];
  partition_rows(cv, table, kh, t0, n, rows);
  auto prefetch = [&](int64_t r) {
    _mm_prefetch(reinterpret_cast<const char*>(cv.kc + r * 32), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cv.kp + r * cols), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cv.vc + r * 32), _MM_HINT_T1);
    prefetch_item_heads(cv, r);
  };
  for (int64_t j = 0; j < std::min(kAhead, n); ++j) prefetch(rows[j]);
  // Lanes of y[0] / y[1] (group_sums16) -> rows of the 16-row scale arrays s[0..1][16].
  const __m512i idx0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i idx1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  alignas(64) int16_t kb[16][64];
  alignas(64) float s[2][16], z[2][16];
  for (int64_t j0 = 0; j0 < np; j0 += 16) {
    const int live_n = static_cast<int>(std::min<int64_t>(16, n - j0));
    for (int64_t j = j0 + kAhead; j < std::min(j0 + kAhead + 16, n); ++j) prefetch(rows[j]);
    for (int j = 0; j < 16; ++j) {
      __m512i w = _mm512_setzero_si512();
      s[0][j] = s[1][j] = z[0][j] = z[1][j] = 0.f;
      if (j < live_n) {
        const int64_t r = rows[j0 + j];
        w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(cv.kc + r * 32)));
        const c10::BFloat16* p = cv.kp + r * cols;
        s[0][j] = bf(p[0]), z[0][j] = bf(p[1]);
        s[1][j] = bf(p[cols - 2]), z[1][j] = bf(p[cols - 1]);
      }
      _mm512_store_si512(kb[j], _mm512_and_si512(w, _mm512_set1_epi16(15)));
      _mm512_store_si512(kb[j] + 32, _mm512_srli_epi16(w, 4));
    }
    const __mmask16 live = static_cast<__mmask16>(live_n == 16 ? 0xFFFF : (1u << live_n) - 1);
    const __m512 s0 = _mm512_load_ps(s[0]), s1 = _mm512_load_ps(s[1]);
    const __m512 sy0 = _mm512_permutex2var_ps(s0, idx0, s1), sy1 = _mm512_permutex2var_ps(s0, idx1, s1);
    const __m512 z0 = _mm512_load_ps(z[0]), z1 = _mm512_load_ps(z[1]);
    for (int g = 0; g < G; ++g) {
      __m512i d16[16];
      for (int j = 0; j < 16; ++j) {
        const __m512i a = _mm512_dpwssd_epi32(_mm512_setzero_si512(), q16[g][0], _mm512_load_si512(kb[j]));
        d16[j] = _mm512_dpwssd_epi32(a, q16[g][1], _mm512_load_si512(kb[j] + 32));
      }
      __m512 y[2];
      group_sums16(d16, y);
      const __m512 a = _mm512_mul_ps(y[0], sy0), b = _mm512_mul_ps(y[1], sy1);
      const __m512 dot = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
      const __m512 zt = _mm512_fmadd_ps(z1, _mm512_set1_ps(qsum[g][1]), _mm512_mul_ps(z0, _mm512_set1_ps(qsum[g][0])));
      const __m512 sv = _mm512_mul_ps(_mm512_fmadd_ps(dot, _mm512_set1_ps(qs[g]), zt), _mm512_set1_ps(scale));
      _mm512_store_ps(sc[g] + j0, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, sv));
    }
  }
}
#endif
