// Decode attention for CPUs with AVX2 + FMA and no AVX-512 (AMD EPYC Zen 2/3, older Xeons),
// for the plain paged cache (paged_attention.cpp: bf16 or float32 rows) and for every KV
// codec read in place (paged_attention_codecs.cpp), head_dim 64 / 128 / 256, GQA groups of
// 1-8 q heads. Rows are read 8 channels at a time (codec_avx2.h: one reader per layout).
//
// Work is split as the AVX-512 kernels split it (decode_split.h: (row, partition, KV head)
// items, a long row cut so that it occupies every thread, items longest first), so a row's
// result never depends on its batch mates. Per item, three passes over its keys [t0, t1):
//
//   1. scores: 8 K rows decoded into an L1 tile, then per q head 8 dot products
//      (one FMA chain per row) and one 8x8 horizontal reduction, times the rows' factors
//      (int8 / fp8 scales) and the softmax scale; the K and V codes of the tokens
//      kL2Ahead8 ahead are prefetched into L2 (the first kL2Ahead8 when the item starts;
//      kivi2: with their block's key parameters), the K rows kAhead8 ahead into L1;
//   2. softmax numerators exp(s - m), their max m and sum l per q head;
//   3. P.V: the q heads in groups of up to 3 and the channels in slabs of 4 vectors (one
//      vector slab of 8 for a single head), so that the accumulators (<= 12) stay in the 16
//      ymm registers; each slab reads the slab's channels of every V row (the first slab
//      prefetches the first two lines of the V codes 16 tokens ahead into L1).
//
// Why the L2 prefetch: a row's blocks sit scattered over the pool, one head's rows 16
// apart at most, so the hardware prefetchers do not run ahead, and rows read from L3 or
// DRAM waited on one miss after another. Prefetching only the next 32 K rows into L1 (all
// there was before) kept a few misses in flight: one layer of a single 550-key row took
// ~95-160 us from DRAM (5 GB/s) against ~28 us with its KV in L2. With K and V 128 tokens
// ahead into L2 (L2 takes more misses in flight than L1), the same layer took 48-78 us and
// 32 rows x 2,048 keys 4.0-6.2 ms against 8.8-11.9 (2-core Zen 3, blocks at random, caches
// flushed by a 150 MB stream between calls as the weights flush them; 64 and 256 ahead
// measured the same as 128).
//
// Partitions are merged by their maxima and sums (flash-decoding, as paged_attention_hd64.h):
//
//   out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p,   M = max_p m_p
//
// Everything is float32 (queries widened once; rotated4's rotation applied to the query
// once and to the output once, codec_rows.h rotate()).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "codec_avx2.h"
#include "decode_split.h"

#if defined(KVSTACK_CODEC_AVX2)
#define KVSTACK_DECODE_AVX2 1

constexpr int64_t kPart8 = 512;  // keys per partition (the score buffer)
constexpr int kMaxG8 = 8;  // q heads per KV head
constexpr int64_t kAhead8 = 32;  // tokens whose K rows are prefetched into L1 ahead of pass 1
constexpr int64_t kL2Ahead8 = 128;  // tokens whose K and V codes are prefetched into L2

// Lane j of the result is the sum of v[j]'s 8 lanes.
static inline __m256 hsum8x8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// Rows of keys [t0, t0 + n) of KV head kh through a row's table, walked block by block:
// row index r[j], and res[j], the residual row's element offset (kivi2, the row's own block
// only) or -1.
static inline void locate8(const CodecView& cv, const int64_t* table, int64_t kh, int64_t own,
                           int64_t t0, int64_t n, int64_t* r, int64_t* res) {
  int64_t bi = t0 / cv.BS, i = t0 % cv.BS;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t blk = table[bi];
    r[j] = (blk * cv.BS + i) * cv.KVH + kh;
    const int64_t rs = bi == own ? cv.residual(blk) : -1;
    res[j] = rs >= 0 ? ((rs * cv.BS + i) * cv.KVH + kh) * cv.HD : -1;
    if (++i == cv.BS) {
      i = 0;
      ++bi;
    }
  }
}

// Every line of a K row's codes and its parameters into L1, the V row's parameters into L2
// (V codes: pv8).
static inline void prefetch_row8(const CodecView& cv, int64_t r) {
  for (int64_t b = 0; b < cv.code_bytes; b += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(cv.kc + r * cv.code_bytes + b), _MM_HINT_T0);
  }
  if (cv.k_cols) _mm_prefetch(reinterpret_cast<const char*>(cv.kp + r * cv.k_cols), _MM_HINT_T0);
  if (cv.v_cols) _mm_prefetch(reinterpret_cast<const char*>(cv.vp + r * cv.v_cols), _MM_HINT_T1);
}

// Pass 1: scores of keys [t0, t1) for G q heads (q: G float rows of HD) into sc, times
// `scale`; fills vrows with the V rows of the same tokens for pass 3.
template <Rd R>
static void scores8(const CodecView& cv, const float* q, int G, const int64_t* table, int64_t kh,
                    int64_t t0, int64_t t1, int64_t own, float scale, float (*sc)[kPart8],
                    Row8* vrows) {
  const int64_t HD = cv.HD, NV = HD / 8, n = t1 - t0;
  alignas(32) float kf[8][256];
  alignas(32) float fac[8];
  KeyParams8 kk;
  int64_t kk_block = -1, rows[kPart8], res[kPart8];
  locate8(cv, table, kh, own, t0, n, rows, res);
  auto to_l2 = [&](int64_t j) {
    for (int64_t b = 0; b < cv.code_bytes; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(cv.kc + rows[j] * cv.code_bytes + b), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(cv.vc + rows[j] * cv.code_bytes + b), _MM_HINT_T1);
    }
    if constexpr (R == Rd::kKivi2) {  // a block's key (scale, zero) pairs: 2 x HD bf16
      const int64_t t = t0 + j;
      if (j == 0 || t % cv.BS == 0) {
        const char* p = reinterpret_cast<const char*>(cv.kp + (table[t / cv.BS] * cv.KVH + kh) * cv.HD * 2);
        for (int64_t b = 0; b < 4 * cv.HD; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
      }
    }
  };
  for (int64_t j = 0; j < std::min(kL2Ahead8, n); ++j) to_l2(j);
  for (int64_t j = 0; j < std::min(kAhead8, n); ++j) prefetch_row8(cv, rows[j]);
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int live = static_cast<int>(std::min<int64_t>(8, n - j0));
    for (int j = 0; j < 8; ++j) {
      fac[j] = 0.f;
      if (j >= live) {
        for (int64_t v = 0; v < NV; ++v) _mm256_store_ps(kf[j] + 8 * v, _mm256_setzero_ps());
        continue;
      }
      const int64_t jj = j0 + j, t = t0 + jj;
      if (jj + kAhead8 < n) prefetch_row8(cv, rows[jj + kAhead8]);
      if (jj + kL2Ahead8 < n) to_l2(jj + kL2Ahead8);
      if constexpr (R == Rd::kKivi2)
        if (res[jj] < 0 && t / cv.BS != kk_block) {
          kk_block = t / cv.BS;
          kk.load(cv, table[kk_block], kh);
        }
      const Row8 kr = make_row8<R>(cv, true, rows[jj], res[jj], &kk);
      vrows[jj] = make_row8<R>(cv, false, rows[jj], res[jj], nullptr);
      fac[j] = kr.f;
      for (int64_t v = 0; v < NV; v += 4) {
        __m256 x[4];
        slab4<R>(cv, kr, v, x);
        for (int k = 0; k < 4; ++k) _mm256_store_ps(kf[j] + 8 * (v + k), x[k]);
      }
    }
    const __m256 f = _mm256_mul_ps(_mm256_load_ps(fac), _mm256_set1_ps(scale));
    const __m256 dead = _mm256_cmp_ps(
        _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps(static_cast<float>(live)), _CMP_GE_OQ);
    for (int g = 0; g < G; ++g) {
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
      for (int64_t v = 0; v < NV; ++v) {
        const __m256 qv = _mm256_loadu_ps(q + g * HD + 8 * v);
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_load_ps(kf[j] + 8 * v), a[j]);
      }
      const __m256 s = _mm256_mul_ps(hsum8x8(a), f);
      _mm256_storeu_ps(sc[g] + j0, _mm256_blendv_ps(s, _mm256_set1_ps(-INFINITY), dead));
    }
  }
}

// Pass 2 for one q head: s[j] <- exp(s[j] - m) for j < n, 0 up to the next multiple of 8;
// returns the sum, m in *m.
static inline float softmax8(float* s, int64_t n, float* m) {
  const int64_t np = (n + 7) / 8 * 8;
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < np; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
  alignas(32) float mx[8];
  _mm256_store_ps(mx, mv);
  *m = *std::max_element(mx, mx + 8);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < np; j += 8) {
    const __m256 live = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                      _mm256_set1_ps(static_cast<float>(n - j)), _CMP_LT_OQ);
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(*m))), live);
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum8(sum);
}

// Pass 3 for q heads g0 .. g0 + GB - 1: acc[g][:] = sum_j p[g][j] f_j V_j.
template <Rd R, int GB>
static void pv8(const CodecView& cv, const Row8* vrows, int64_t n, float (*sc)[kPart8], int g0,
                float* acc) {
  constexpr int NV = GB == 1 ? 8 : 4;  // vectors per slab: <= 12 accumulators
  const int64_t HD = cv.HD;
  for (int64_t v0 = 0; v0 < HD / 8; v0 += NV) {
    __m256 a[GB][NV];
    for (int g = 0; g < GB; ++g)
      for (int k = 0; k < NV; ++k) a[g][k] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const Row8& row = vrows[j];
      if (v0 == 0 && j + 16 < n && vrows[j + 16].code) {
        _mm_prefetch(reinterpret_cast<const char*>(vrows[j + 16].code), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vrows[j + 16].code) + 64, _MM_HINT_T0);
      }
      __m256 p[GB];
      for (int g = 0; g < GB; ++g) p[g] = _mm256_set1_ps(sc[g0 + g][j] * row.f);
      for (int k0 = 0; k0 < NV; k0 += 4) {
        __m256 x[4];
        slab4<R>(cv, row, v0 + k0, x);
        for (int k = 0; k < 4; ++k)
          for (int g = 0; g < GB; ++g) a[g][k0 + k] = _mm256_fmadd_ps(p[g], x[k], a[g][k0 + k]);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int k = 0; k < NV; ++k) _mm256_storeu_ps(acc + (g0 + g) * HD + 8 * (v0 + k), a[g][k]);
  }
}

// One item: keys [t0, t1) of KV head kh for the row's G q heads; leaves per q head m, l and
// the unnormalized output acc (G x HD).
template <Rd R>
static void part8(const CodecView& cv, const float* q, int G, const int64_t* table, int64_t kh,
                  int64_t t0, int64_t t1, int64_t own, float scale, float* m, float* l,
                  float* acc) {
  alignas(32) float sc[kMaxG8][kPart8];
  Row8 vrows[kPart8];
  const int64_t n = t1 - t0;
  scores8<R>(cv, q, G, table, kh, t0, t1, own, scale, sc, vrows);
  for (int g = 0; g < G; ++g) l[g] = softmax8(sc[g], n, m + g);
  for (int g0 = 0; g0 < G; g0 += 3) {
    switch (std::min(3, G - g0)) {
      case 1: pv8<R, 1>(cv, vrows, n, sc, g0, acc); break;
      case 2: pv8<R, 2>(cv, vrows, n, sc, g0, acc); break;
      default: pv8<R, 3>(cv, vrows, n, sc, g0, acc);
    }
  }
}

// Rows r of q [R, H, HD] against their tables (tidx[r], or table r) and contexts lens[r]
// under window W; out [R, H, HD] in T.
template <Rd R, typename T>
static void decode8(const CodecView& cv, const T* q, const int64_t* tables, const int64_t* tidx,
                    const int64_t* lens, T* out, int64_t NR, int64_t H, int64_t MB, float scale,
                    int64_t W) {
  const int64_t KVH = cv.KVH, G = H / KVH, HD = cv.HD;
  const DecodeSplit sp = split_decode_rows(lens, NR, W, KVH, kPart8);
  const int64_t P = sp.parts();
  std::vector<float> pm(P * H), pl(P * H), pacc(P * H * HD), qall(NR * H * HD);
  at::parallel_for(0, NR * H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t i = 0; i < HD; ++i) qall[w * HD + i] = static_cast<float>(q[w * HD + i]);
      if (cv.signs) rotate(qall.data() + w * HD, cv.signs, HD, false);
    }
  });
  run_decode_items(sp, [&](int64_t pi, int64_t kh) {
    const int64_t r = sp.row[pi], own = (lens[r] - 1) / cv.BS, o = pi * H + kh * G;
    const int64_t* table = tables + (tidx ? tidx[r] : r) * MB;
    part8<R>(cv, qall.data() + (r * H + kh * G) * HD, static_cast<int>(G), table, kh, sp.t0[pi],
             sp.t1[pi], own, scale, pm.data() + o, pl.data() + o, pacc.data() + o * HD);
  });
  at::parallel_for(0, NR * H, 16, [&](int64_t begin, int64_t end) {
    alignas(32) float o[256];
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / H, h = w % H;
      float mx = -INFINITY, l = 0.f;
      for (int64_t pi = sp.first[r]; pi < sp.first[r + 1]; ++pi) mx = std::max(mx, pm[pi * H + h]);
      for (int64_t v = 0; v < HD / 8; ++v) _mm256_store_ps(o + 8 * v, _mm256_setzero_ps());
      for (int64_t pi = sp.first[r]; pi < sp.first[r + 1]; ++pi) {
        const float wgt = std::exp(pm[pi * H + h] - mx);
        l += wgt * pl[pi * H + h];
        const float* a = pacc.data() + (pi * H + h) * HD;
        for (int64_t v = 0; v < HD / 8; ++v)
          _mm256_store_ps(o + 8 * v, _mm256_fmadd_ps(_mm256_set1_ps(wgt), _mm256_loadu_ps(a + 8 * v),
                                                     _mm256_load_ps(o + 8 * v)));
      }
      const float inv = 1.f / l;
      for (int64_t i = 0; i < HD; ++i) o[i] *= inv;
      if (cv.signs) rotate(o, cv.signs, HD, true);
      for (int64_t i = 0; i < HD; ++i) out[w * HD + i] = static_cast<T>(o[i]);
    }
  });
}

// Runs the AVX2 kernel for layout rd when it takes the shapes (head_dim 64 / 128 / 256,
// <= 8 q heads per KV head, 4-bit groups of a multiple of 8 channels); else returns false.
template <typename T>
static bool decode_avx2(Rd rd, const CodecView& cv, const T* q, const int64_t* tables,
                        const int64_t* tidx, const int64_t* lens, T* out, int64_t NR, int64_t H,
                        int64_t MB, float scale, int64_t W) {
  const int64_t HD = cv.HD;
  if ((HD != 64 && HD != 128 && HD != 256) || H / cv.KVH > kMaxG8) return false;
  if ((rd == Rd::kInt4 || rd == Rd::kKivi2) && (cv.group % 8 || HD % cv.group)) return false;
  switch (rd) {
#define KVSTACK_RD(x)                                                       \
  case x:                                                                   \
    decode8<x, T>(cv, q, tables, tidx, lens, out, NR, H, MB, scale, W); \
    return true;
    KVSTACK_RD(Rd::kBF16)
    KVSTACK_RD(Rd::kF32)
    KVSTACK_RD(Rd::kInt8)
    KVSTACK_RD(Rd::kE4M3)
    KVSTACK_RD(Rd::kE5M2)
    KVSTACK_RD(Rd::kInt4)
    KVSTACK_RD(Rd::kKivi2)
#undef KVSTACK_RD
  }
  return false;
}
#endif
