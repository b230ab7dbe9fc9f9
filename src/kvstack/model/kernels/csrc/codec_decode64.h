// The head_dim-64 AVX-512 decode of an encoded KV cache (paged_attention_codecs.cpp's fast
// path): one (row, partition, KV head) in codec_head64 (scores through each codec's
// reader, softmax, P.V), partitions merged by codec_merge_rows. Shared by
// paged_attention_codecs.cpp and decode_team.cpp (team_codec.h), which run the same
// functions on the same partitions, so both give the same bits.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>

#include "codec_fp8.h"
#include "codec_int4.h"
#include "codec_int8.h"
#include "codec_rows.h"
#include "decode_split.h"

namespace codec64 {

constexpr int64_t kCodecPart = 512;  // tokens per partition
constexpr int kMaxG = 8;  // q heads per KV head on the fast path
constexpr int64_t kAheadBlocks = 3;  // blocks of K prefetched ahead while scoring

#if defined(KVSTACK_CODEC_AVX512)
// Prefetches the K or V rows (codes and per-row parameters) of head kh in block blk into
// L1 (_MM_HINT_T0) or L2 (_MM_HINT_T1).
template <int Hint>
inline void prefetch_block(const CodecView& cv, bool is_k, int64_t blk, int64_t kh) {
  const uint8_t* codes = is_k ? cv.kc : cv.vc;
  const c10::BFloat16* params = is_k ? cv.kp : cv.vp;
  const int64_t cols = is_k ? cv.k_cols : cv.v_cols;
  for (int64_t i = 0; i < cv.BS; ++i) {
    const int64_t r = (blk * cv.BS + i) * cv.KVH + kh;
    _mm_prefetch(reinterpret_cast<const char*>(codes + r * cv.code_bytes), static_cast<_mm_hint>(Hint));
    if (cols) _mm_prefetch(reinterpret_cast<const char*>(params + r * cols), static_cast<_mm_hint>(Hint));
    if (is_k) prefetch_item_heads(cv, r);
  }
}

// Where a pass is: block bi of the table, token i in it, the block's residual slot (kivi2:
// only in the row's own block, table index own) and its key parameters.
template <Codec C>
struct Cursor {
  const CodecView& cv;
  const int64_t* table;
  int64_t kh, nblocks, own, bi, i, blk, rs = -1;
  KiviKeys kk;
  Cursor(const CodecView& c, const int64_t* t, int64_t h, int64_t t0, int64_t t1, int64_t o,
         bool is_k)
      : cv(c), table(t), kh(h), nblocks((t1 + c.BS - 1) / c.BS), own(o), bi(t0 / c.BS),
        i(t0 % c.BS) {
    if (is_k)
      for (int64_t d = 0; d < kAheadBlocks && bi + d < nblocks; ++d) ahead(table[bi + d]);
    enter(is_k);
  }
  // Scattered blocks defeat the hardware prefetcher: the scoring pass asks for the K rows
  // kAheadBlocks blocks ahead into L1 and the same blocks' V rows into L2, where the P.V
  // pass finds them (it pulls the next block into L1).
  void ahead(int64_t b) {
    prefetch_block<_MM_HINT_T0>(cv, true, b, kh);
    prefetch_block<_MM_HINT_T1>(cv, false, b, kh);
  }
  __attribute__((always_inline)) inline void enter(bool is_k) {
    blk = table[bi];
    rs = bi == own ? cv.residual(blk) : -1;
    if constexpr (C == Codec::kKivi2)
      if (is_k && rs < 0) kk.load(cv, blk, kh);
    if (is_k && bi + kAheadBlocks < nblocks) ahead(table[bi + kAheadBlocks]);
    if (!is_k && bi + 1 < nblocks) prefetch_block<_MM_HINT_T0>(cv, false, table[bi + 1], kh);
  }
  // Row of the current token (in to_order's order) and its factor; then the next token.
  // Forced inline (and enter() with it): GCC had kept int4's out of line, and each call
  // spilled the row's four vectors through the stack (int4's P.V at batch 32 x 2,048 on
  // Zen 5, one thread: 3.9 -> 2.0 ms a layer); forcing only this one pushed kivi2's
  // enter() out of line instead.
  __attribute__((always_inline)) inline float next(bool is_k, __m512* x) {
    float f = 1.f;
    if (rs >= 0) {
      residual_row64(cv, is_k, rs, i, kh, x);
      to_order<C>(x);
    } else {
      f = row64<C>(cv, is_k, (blk * cv.BS + i) * cv.KVH + kh, x, &kk);
    }
    if (++i == cv.BS && ++bi < nblocks) {
      i = 0;
      enter(is_k);
    }
    return f;
  }
};

// Pass 1 of a partition: scores of tokens [t0, t1) of KV head kh for the G q heads
// (qv: their float vectors in to_order's order) into sc, padding lanes -inf. 16 rows at a
// time are decoded into an L1 buffer (bf16 pairs for AVX512-BF16 dot products when GT > 0,
// float32 otherwise), then per q head 16 dot products and one horizontal reduction.
template <Codec C, int GT>
void codec_scores(const CodecView& cv, __m512 (*qv)[4], int G, const int64_t* table, int64_t kh,
                  int64_t t0, int64_t t1, int64_t own, float scale, float (*sc)[kCodecPart]) {
  constexpr bool kBf16 = GT > 0 && kHasBf16Dot;
  const int64_t n = t1 - t0, np = (n + 15) / 16 * 16;
  alignas(64) float fac[16];
  alignas(64) float kf[16][64];  // decoded K rows (float32, or bf16 pairs in kb)
  alignas(64) uint16_t kb[16][64];
#if defined(__AVX512BF16__)
  __m512bh qh[kMaxG][2];
  if constexpr (kBf16)
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < 2; ++k) qh[g][k] = _mm512_cvtne2ps_pbh(qv[g][2 * k + 1], qv[g][2 * k]);
#endif
  Cursor<C> ck(cv, table, kh, t0, t1, own, true);
  for (int64_t j0 = 0; j0 < np; j0 += 16) {
    const int live_n = static_cast<int>(std::min<int64_t>(16, n - j0));
    for (int j = 0; j < 16; ++j) {
      __m512 x[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
      fac[j] = j < live_n ? ck.next(true, x) : 0.f;
      if constexpr (kBf16) {
#if defined(__AVX512BF16__)
        for (int k = 0; k < 2; ++k)
          _mm512_store_si512(kb[j] + 32 * k, (__m512i)_mm512_cvtne2ps_pbh(x[2 * k + 1], x[2 * k]));
#endif
      } else {
        for (int k = 0; k < 4; ++k) _mm512_store_ps(kf[j] + 16 * k, x[k]);
      }
    }
    const __mmask16 live = static_cast<__mmask16>(live_n == 16 ? 0xFFFF : (1u << live_n) - 1);
    const __m512 f = _mm512_mul_ps(_mm512_load_ps(fac), _mm512_set1_ps(scale));
    for (int g = 0; g < G; ++g) {
      __m512 d16[16];
      for (int j = 0; j < 16; ++j) {
        if constexpr (kBf16) {
#if defined(__AVX512BF16__)
          __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qh[g][0],
                                      (__m512bh)_mm512_load_si512(kb[j]));
          d16[j] = _mm512_dpbf16_ps(a, qh[g][1], (__m512bh)_mm512_load_si512(kb[j] + 32));
#endif
        } else {
          __m512 a = _mm512_mul_ps(qv[g][0], _mm512_load_ps(kf[j]));
          for (int k = 1; k < 4; ++k) a = _mm512_fmadd_ps(qv[g][k], _mm512_load_ps(kf[j] + 16 * k), a);
          d16[j] = a;
        }
      }
      const __m512 s = _mm512_mul_ps(hsum16(d16), f);
      _mm512_store_ps(sc[g] + j0, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, s));
    }
  }
}

// Pass 1 through the fastest reader of codec C: integer dot products for int8 and 4-bit
// codes (codec_int8.h, codec_int4.h), bf16 dot products on fp8 codes' own bits
// (codec_fp8.h), else rows decoded to float (codec_scores). All with bf16 queries only.
template <Codec C, int GT>
void scores(const CodecView& cv, const float* q, __m512 (*qv)[4], int G, const int64_t* table,
            int64_t kh, int64_t t0, int64_t t1, int64_t own, float scale, float (*sc)[kCodecPart]) {
#if defined(KVSTACK_CODEC_INT8_VNNI)  // integer dot products: no AVX512-BF16 needed
  if constexpr (GT > 0 && C == Codec::kInt8)
    return int8_scores<GT, kCodecPart>(cv, q, table, kh, t0, t1, scale, sc);
  if constexpr (GT > 0 && C == Codec::kInt4)
    if (cv.group == 32 || cv.group == 64) return int4_scores<GT, kCodecPart>(cv, q, table, kh, t0, t1, scale, sc);
#endif
#if defined(KVSTACK_CODEC_FP8_BITS)
  if constexpr (GT > 0 && (C == Codec::kFP8E4M3 || C == Codec::kFP8E5M2))
    return fp8_scores<C, GT, kCodecPart>(cv, q, table, kh, t0, t1, scale, sc);
#endif
  codec_scores<C, GT>(cv, qv, G, table, kh, t0, t1, own, scale, sc);
}

// Tokens [t0, t1) of one row against KV head kh: G partials (GT: G known at compile time,
// then bf16 queries score with AVX512-BF16 dot products, or int8 codes with VNNI integer
// ones (codec_int8.h); 0: G = g_rt, float32 dots). q: G float rows of 64. Pass 1 the
// scores (codec_scores), pass 2 the softmax, pass 3 P.V, each row decoded once for the G
// heads. The next block is prefetched.
template <Codec C, int GT>
void codec_part64(const CodecView& cv, const float* q, const int64_t* table, int64_t kh,
                  int64_t t0, int64_t t1, int64_t own, int g_rt, float scale,
                  Partial* parts) {
  const int G = GT > 0 ? GT : g_rt;
  const int64_t n = t1 - t0, np = (n + 15) / 16 * 16;
  alignas(64) float sc[kMaxG][kCodecPart];
  __m512 qv[kMaxG][4];
  for (int g = 0; g < G; ++g) {
    for (int k = 0; k < 4; ++k) qv[g][k] = _mm512_loadu_ps(q + 64 * g + 16 * k);
    to_order<C>(qv[g]);
  }
  scores<C, GT>(cv, q, qv, G, table, kh, t0, t1, own, scale, sc);
  for (int g = 0; g < G; ++g) softmax_numerators(sc[g], n, np, &parts[g].m, &parts[g].l);
  __m512 acc[kMaxG][4];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < 4; ++k) acc[g][k] = _mm512_setzero_ps();
  Cursor<C> cvv(cv, table, kh, t0, t1, own, false);
  for (int64_t j = 0; j < n; ++j) {
    __m512 x[4];
    const float f = cvv.next(false, x);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(sc[g][j] * f);
      for (int k = 0; k < 4; ++k) acc[g][k] = _mm512_fmadd_ps(p, x[k], acc[g][k]);
    }
  }
  for (int g = 0; g < G; ++g) {
    from_order<C>(acc[g]);
    for (int k = 0; k < 4; ++k) _mm512_store_ps(parts[g].acc + 16 * k, acc[g][k]);
  }
}

// codec_part64 for one KV head, G picked at compile time for the common GQA ratios (bf16
// queries), at run time otherwise and for float32 queries (float32 dots).
template <Codec C, typename T>
void codec_head64(const CodecView& cv, const float* qf, const int64_t* table, int64_t kh,
                  int64_t t0, int64_t t1, int64_t own, int g, float scale, Partial* pp) {
  if (!std::is_same_v<T, c10::BFloat16>) return codec_part64<C, 0>(cv, qf, table, kh, t0, t1, own, g, scale, pp);
  switch (g) {
    case 1: return codec_part64<C, 1>(cv, qf, table, kh, t0, t1, own, g, scale, pp);
    case 2: return codec_part64<C, 2>(cv, qf, table, kh, t0, t1, own, g, scale, pp);
    case 3: return codec_part64<C, 3>(cv, qf, table, kh, t0, t1, own, g, scale, pp);
    case 4: return codec_part64<C, 4>(cv, qf, table, kh, t0, t1, own, g, scale, pp);
    case 8: return codec_part64<C, 8>(cv, qf, table, kh, t0, t1, own, g, scale, pp);
    default: return codec_part64<C, 0>(cv, qf, table, kh, t0, t1, own, g, scale, pp);
  }
}

// Query head w of a row as float32 into qf (rotated4: q R, signs given), once per row.
template <typename T>
inline void query_float64(const T* q, const float* signs, float* qf) {
  for (int64_t i = 0; i < 64; ++i) qf[i] = static_cast<float>(q[i]);
  if (signs) rotate(qf, signs, 64, false);
}

// One work item: KV heads [kh0, kh1) of a row (qf: its float q heads, G per KV head)
// against keys [t0, t1), one head after another through head (codec_head64 of a codec),
// the first head's prefetches taking every head's rows (CodecView::span); parts: the
// row's partials of this partition.
template <typename Head>
inline void codec_item64(Head head, const CodecView& cv, const float* qf, const int64_t* table,
                         int64_t kh0, int64_t kh1, int64_t t0, int64_t t1, int64_t own, int G,
                         float scale, Partial* parts) {
  for (int64_t kh = kh0; kh < kh1; ++kh) {
    CodecView v = cv;
    v.span = kh == kh0 ? kh1 - kh0 : 1;
    head(v, qf + kh * G * 64, table, kh, t0, t1, own, G, scale, parts + kh * G);
  }
}

// Items w in [begin, end) (row r = w / H, q head h = w % H): the row's partitions of head
// h merged (as paged_attention_hd64.h's merge_hd64), turned back by R^T for rotated4
// (signs), into out[r, h, :].
template <typename T>
void codec_merge_rows(const Partial* parts, const int64_t* first, int64_t H,
                      const float* signs, int64_t begin, int64_t end, T* out) {
  for (int64_t w = begin; w < end; ++w) {
    __m512 acc[4];
    merge_partials(parts, first, H, w / H, w % H, acc);
    alignas(64) float o[64];
    for (int k = 0; k < 4; ++k) _mm512_store_ps(o + 16 * k, acc[k]);
    if (signs) rotate(o, signs, 64, true);
    for (int k = 0; k < 4; ++k) store16(out + w * 64 + 16 * k, _mm512_load_ps(o + 16 * k));
  }
}

#endif  // KVSTACK_CODEC_AVX512

}  // namespace codec64
