// The head_dim-64 AVX-512 path of the paged decode attention (paged_attention.cpp):
// decode_fast() runs it for head_dim 64 and GQA groups of 1-8 q heads, else returns false
// and the caller takes the generic kernel. Included by paged_attention.cpp and by
// decode_team.cpp (which runs decode_part_hd64 and merge_hd64 inside its own region).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "decode_split.h"
#include "simd.h"

// First key a row of context L attends under window W (0: no window).
static inline int64_t window_start(int64_t L, int64_t W) { return W > 0 && L > W ? L - W : 0; }

// Row d reads block table tidx[d] (prefill rows of one sequence share its table), or
// table d when tidx is null (decode: one table per row).
static inline int64_t table_row(const int64_t* tidx, int64_t d) { return tidx ? tidx[d] : d; }

#if defined(__AVX512F__)
// ---------------------------------------------------------------- head_dim 64 fast path
// Work is split over (request, context partition, kv heads) (decode_split.h: at most
// kPartTokens keys a partition, a long row cut so that it occupies every thread). Each
// work item scores its keys 16 at a time (one horizontal reduction per 16 keys) and
// leaves per q head the running max m, the sum l and the unnormalized output; a merge
// pass combines partitions:
//
//   out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p,   M = max_p m_p
//
// bf16 caches score with AVX512-BF16 dot products (vdpbf16ps: products exact in float32,
// float32 sums); V is converted once per row and shared by the G q heads of a KV head.
// An item reads the K/V of all (or up to 16 / G of) a partition's KV heads.
constexpr int64_t kPartTokens = 512;
constexpr int64_t kAheadL1 = 16;   // K rows prefetched into L1 ahead of the scoring loop
constexpr int64_t kAheadL2 = 256;  // K and V rows prefetched into L2 ahead of it
constexpr int64_t kAheadPV = 32;   // V rows from L2 into L1 ahead of the P.V pass
                                   // (16: 1.000, 32: 0.981-0.989, 48: 0.989, none: 1.056)

// Every cache line of one head_dim-64 K/V row (128 B in bf16, 256 B in float32).
// Locality 3 = into L1 (_MM_HINT_T0), 2 = into L2 (_MM_HINT_T1).
template <typename T, int Locality>
static inline void prefetch_row(const T* row) {
  const char* p = reinterpret_cast<const char*>(row);
  for (size_t b = 0; b < 64 * sizeof(T); b += 64) __builtin_prefetch(p + b, 0, Locality);
}

// Query of one q head, kept in registers: bf16 pairs for vdpbf16ps, or float32.
template <typename T>
struct QReg;
template <>
struct QReg<float> {
  __m512 v[4];
  void load(const float* q) {
    for (int c = 0; c < 4; ++c) v[c] = _mm512_loadu_ps(q + 16 * c);
  }
  __m512 dot(const float* k) const {  // 16 partial sums of q . k
    __m512 a = _mm512_mul_ps(v[0], _mm512_loadu_ps(k));
    a = _mm512_fmadd_ps(v[1], _mm512_loadu_ps(k + 16), a);
    a = _mm512_fmadd_ps(v[2], _mm512_loadu_ps(k + 32), a);
    return _mm512_fmadd_ps(v[3], _mm512_loadu_ps(k + 48), a);
  }
};
template <>
struct QReg<c10::BFloat16> {
#if defined(__AVX512BF16__)
  __m512bh v[2];
  void load(const c10::BFloat16* q) {
    v[0] = (__m512bh)_mm512_loadu_si512(q);
    v[1] = (__m512bh)_mm512_loadu_si512(q + 32);
  }
  __m512 dot(const c10::BFloat16* k) const {
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), v[0], (__m512bh)_mm512_loadu_si512(k));
    return _mm512_dpbf16_ps(a, v[1], (__m512bh)_mm512_loadu_si512(k + 32));
  }
#else
  __m512 v[4];
  void load(const c10::BFloat16* q) {
    for (int c = 0; c < 4; ++c) v[c] = load16(q + 16 * c);
  }
  __m512 dot(const c10::BFloat16* k) const {
    __m512 a = _mm512_mul_ps(v[0], load16(k));
    a = _mm512_fmadd_ps(v[1], load16(k + 16), a);
    a = _mm512_fmadd_ps(v[2], load16(k + 32), a);
    return _mm512_fmadd_ps(v[3], load16(k + 48), a);
  }
#endif
};

// KV heads per work item: kv_heads_per_item (decode_split.h), up to kItemQHeads q heads,
// the score buffer's rows. Measured on the 2-core Zen 5 (2026-12-05): this op (32 rows x
// 300 keys, one layer from DRAM) 0.27 -> 0.25 ms with all heads in one item, and a
// batch-32 decode_team step 0.962-0.967x (in-process A/B).

// Lines [0, bytes) from row, prefetched (Locality as in prefetch_row).
template <int Locality>
static inline void prefetch_span(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, Locality);
}

// Tokens [t_begin, t_end) of one request against KV heads [kh0, kh1): G partials per KV
// head, parts[kh * G + g] (q holds the request row's H = KVH * G heads). Per head, two
// passes over the partition (scores of all its tokens into an L1-resident buffer, then
// one softmax and the P.V pass): an online update every 16 keys costs more in reduction
// latency than the second read of the scores. The scoring pass reads each token's K rows
// of all the item's heads (one contiguous span); the P.V pass runs head by head from L2.
template <typename T, int G>
static void decode_part_hd64(const T* q, const T* kc, const T* vc, const int64_t* table,
                             int64_t KVH, int64_t BS, int64_t kh0, int64_t kh1,
                             int64_t t_begin, int64_t t_end, float scale, Partial* parts) {
  constexpr int64_t HD = 64, kMaxKv = kItemQHeads / G > 0 ? kItemQHeads / G : 1;
  const int64_t n = t_end - t_begin, np = (n + 15) / 16 * 16, nh = kh1 - kh0;
  const int64_t span = nh * HD * static_cast<int64_t>(sizeof(T));  // bytes of a token's rows
  alignas(64) float sc[kMaxKv * G][kPartTokens];
  int64_t offs[kPartTokens];  // element offset of each token's row for head kh0
  for (int64_t j = 0, b = t_begin / BS, i = t_begin % BS; j < n; ++j) {
    offs[j] = ((table[b] * BS + i) * KVH + kh0) * HD;
    if (++i == BS) i = 0, ++b;
  }
  for (int64_t j = n; j < np; ++j) offs[j] = offs[0];  // padding rows: masked below
  // Without VDPBF16PS, bf16 K rows are widened to float32 once per row into an L1 tile
  // that the G q heads then read (widening per head cost G times the conversions).
  constexpr bool kWiden = std::is_same_v<T, c10::BFloat16> && !kHasBf16Dot;
  alignas(64) float kf[kWiden ? 16 : 1][64];
  // Rows sit scattered over blocks, so the hardware prefetcher cannot follow them: K and V
  // rows kAheadL2 ahead into L2 (far enough to keep DRAM busy; a guess at why: L2 keeps
  // more misses in flight than L1), then K rows kAheadL1 ahead into L1 for the scoring
  // loop; V is read from L2 by the second pass. Measured on the 2-core Zen 5 (2026-12-05,
  // batch-32 decode_team steps, in-process A/B): both kinds 48 rows ahead into their
  // levels 1.000, L2 192-512 ahead with L1 16 ahead 0.970-0.973 (L1 8: 0.987, 12-24:
  // 0.969-0.976).
  for (int64_t j = 0; j < std::min(kAheadL2, n); ++j) {
    prefetch_span<2>(kc + offs[j], span);
    prefetch_span<2>(vc + offs[j], span);
  }
  for (int64_t j = 0; j < std::min(kAheadL1, n); ++j) prefetch_span<3>(kc + offs[j], span);
  for (int64_t j0 = 0; j0 < np; j0 += 16) {
    for (int64_t j = j0 + kAheadL2; j < std::min(j0 + kAheadL2 + 16, n); ++j) {
      prefetch_span<2>(kc + offs[j], span);
      prefetch_span<2>(vc + offs[j], span);
    }
    for (int64_t j = j0 + kAheadL1; j < std::min(j0 + kAheadL1 + 16, n); ++j)
      prefetch_span<3>(kc + offs[j], span);
    const __mmask16 live = static_cast<__mmask16>(n - j0 >= 16 ? 0xFFFF : (1u << (n - j0)) - 1);
    for (int64_t hk = 0; hk < nh; ++hk) {
      const T* qh = q + (kh0 + hk) * G * HD;
      const T* kh = kc + hk * HD;
      if constexpr (kWiden)
        for (int j = 0; j < 16; ++j)
          for (int c = 0; c < 4; ++c)
            _mm512_store_ps(kf[j] + 16 * c, load16(kh + offs[j0 + j] + 16 * c));
      for (int g = 0; g < G; ++g) {
        __m512 d16[16];
        if constexpr (kWiden) {
          QReg<float> qf;
          for (int c = 0; c < 4; ++c) qf.v[c] = load16(qh + g * HD + 16 * c);
          for (int j = 0; j < 16; ++j) d16[j] = qf.dot(kf[j]);
        } else {
          QReg<T> qr;
          qr.load(qh + g * HD);
          for (int j = 0; j < 16; ++j) d16[j] = qr.dot(kh + offs[j0 + j]);
        }
        const __m512 s = _mm512_mul_ps(hsum16(d16), _mm512_set1_ps(scale));
        const __m512 masked = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, s);
        _mm512_store_ps(sc[hk * G + g] + j0, masked);
      }
    }
  }
  for (int64_t i = 0; i < nh * G; ++i)
    softmax_numerators(sc[i], n, np, &parts[kh0 * G + i].m, &parts[kh0 * G + i].l);
  for (int64_t hk = 0; hk < nh; ++hk) {
    const T* vh = vc + hk * HD;
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      if (j + kAheadPV < n) prefetch_row<T, 3>(vh + offs[j + kAheadPV]);
      const T* v = vh + offs[j];
      __m512 vv[4];
      for (int c = 0; c < 4; ++c) vv[c] = load16(v + 16 * c);
      for (int g = 0; g < G; ++g) {
        const __m512 pj = _mm512_set1_ps(sc[hk * G + g][j]);
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(pj, vv[c], acc[g][c]);
      }
    }
    Partial* pt = parts + (kh0 + hk) * G;
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) _mm512_store_ps(pt[g].acc + 16 * c, acc[g][c]);
  }
}

// Items w in [begin, end) (row d = w / H, q head h = w % H): the row's partitions of head
// h merged into out[d, h, :] (the formula above).
template <typename T>
static void merge_hd64(const Partial* parts, const int64_t* first, int64_t H, int64_t begin,
                       int64_t end, T* out) {
  constexpr int64_t HD = 64;
  for (int64_t w = begin; w < end; ++w) {
    __m512 o[4];
    merge_partials(parts, first, H, w / H, w % H, o);
    for (int c = 0; c < 4; ++c) store16(out + w * HD + 16 * c, o[c]);
  }
}

template <typename T, int G>
static void decode_kernel_hd64(const T* q, const T* kc, const T* vc, const int64_t* tables,
                               const int64_t* tidx, const int64_t* lens, T* out, int64_t D,
                               int64_t KVH, int64_t BS, int64_t MB, float scale, int64_t W) {
  constexpr int64_t HD = 64;
  const int64_t H = KVH * G;
  const int64_t per = kv_heads_per_item(KVH, G);
  const DecodeSplit sp = split_decode_rows(lens, D, W, KVH, kPartTokens, (KVH + per - 1) / per);
  const std::vector<int64_t>& first = sp.first;
  std::vector<Partial> parts(sp.parts() * H);
  run_decode_items(sp, [&](int64_t pi, int64_t u) {
    const int64_t d = sp.row[pi];
    decode_part_hd64<T, G>(q + d * H * HD, kc, vc, tables + table_row(tidx, d) * MB, KVH, BS,
                           u * per, std::min(KVH, (u + 1) * per), sp.t0[pi], sp.t1[pi], scale,
                           parts.data() + pi * H);
  });
  at::parallel_for(0, D * H, 16, [&](int64_t begin, int64_t end) {
    merge_hd64(parts.data(), first.data(), H, begin, end, out);
  });
}

template <typename T>
static bool decode_fast(const T* q, const T* kc, const T* vc, const int64_t* tables,
                        const int64_t* tidx, const int64_t* lens, T* out, int64_t D, int64_t H,
                        int64_t KVH, int64_t HD, int64_t BS, int64_t MB, float scale,
                        int64_t W) {
  if (HD != 64) return false;
  switch (H / KVH) {
#define KVSTACK_G(g)                                                                  \
  case g:                                                                             \
    decode_kernel_hd64<T, g>(q, kc, vc, tables, tidx, lens, out, D, KVH, BS, MB, scale, W); \
    return true;
    KVSTACK_G(1) KVSTACK_G(2) KVSTACK_G(3) KVSTACK_G(4)
    KVSTACK_G(5) KVSTACK_G(6) KVSTACK_G(7) KVSTACK_G(8)
#undef KVSTACK_G
    default:
      return false;
  }
}
#else
template <typename T>
static bool decode_fast(const T*, const T*, const T*, const int64_t*, const int64_t*,
                        const int64_t*, T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                        float, int64_t) {
  return false;
}
#endif
