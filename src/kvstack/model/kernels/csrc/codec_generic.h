// The portable codec attention path (paged_attention_codecs.cpp): every ISA, every head
// size, one task per (row, KV head), rows fully dequantized by row_scalar (codec_rows.h),
// float32 softmax and P.V. The AVX-512 head_dim-64 path is the fast one; this one is the
// kernel's reference for shapes the fast path does not take.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "codec_rows.h"

// Row r reads block table tidx[r] (rows of one chunk share their sequence's), or table r.
static inline int64_t codec_table_of(const int64_t* tidx, int64_t r) { return tidx ? tidx[r] : r; }

// First key a row of context L attends under sliding window W (0: none): keys (L - 1 - W,
// L - 1], as paged_attention's window_start. Blocks before it are never read (a hybrid KV
// manager may have freed them: page 0 in the table).
static inline int64_t codec_window_start(int64_t L, int64_t W) { return W > 0 && L > W ? L - W : 0; }

// One row r, KV head kh, all tokens: softmax(q K^T * scale) V for its G q heads.
template <typename T>
static void codec_rows_generic(const CodecView& cv, const T* q, const int64_t* tables,
                        const int64_t* tidx, const int64_t* lens, T* out, int64_t R, int64_t H,
                        int64_t MB, float scale, int64_t W) {
  const int64_t KVH = cv.KVH, HD = cv.HD, BS = cv.BS, G = H / KVH;
  at::parallel_for(0, R * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * HD), acc(G * HD), row(HD), sc;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / KVH, kh = w % KVH, L = lens[r], own = (L - 1) / BS;
      const int64_t s0 = codec_window_start(L, W);  // keys [s0, L)
      const int64_t* table = tables + codec_table_of(tidx, r) * MB;
      sc.assign(G * L, 0.f);
      for (int64_t i = 0; i < G * HD; ++i) qf[i] = static_cast<float>(q[(r * H + kh * G) * HD + i]);
      if (cv.signs)
        for (int64_t g = 0; g < G; ++g) rotate(qf.data() + g * HD, cv.signs, HD, false);
      for (int64_t t = s0; t < L; ++t) {
        row_scalar(cv, true, table[t / BS], t % BS, kh, t / BS == own, row.data());
        for (int64_t g = 0; g < G; ++g) {
          float s = 0.f;
          for (int64_t i = 0; i < HD; ++i) s += qf[g * HD + i] * row[i];
          sc[g * L + t] = s * scale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = sc.data() + g * L;
        const float m = *std::max_element(s + s0, s + L);
        float sum = 0.f;
        for (int64_t t = s0; t < L; ++t) sum += (s[t] = std::exp(s[t] - m));
        for (int64_t t = s0; t < L; ++t) s[t] /= sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = s0; t < L; ++t) {
        row_scalar(cv, false, table[t / BS], t % BS, kh, t / BS == own, row.data());
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < HD; ++i) acc[g * HD + i] += sc[g * L + t] * row[i];
      }
      if (cv.signs)
        for (int64_t g = 0; g < G; ++g) rotate(acc.data() + g * HD, cv.signs, HD, true);
      for (int64_t i = 0; i < G * HD; ++i) out[(r * H + kh * G) * HD + i] = static_cast<T>(acc[i]);
    }
  });
}
