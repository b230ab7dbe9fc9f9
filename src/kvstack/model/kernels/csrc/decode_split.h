// How the decode kernels (paged_attention_hd64.h, paged_attention_codecs.cpp) cut a
// step's rows into context partitions and hand (partition, KV head(s)) items to threads
// (flash-decoding's split-K, Dao et al. 2023).
//
// A row attending n keys [s0, L) is cut into p equal partitions (sizes differ by at most
// one key):
//
//   p = max(ceil(n / max_part), min(ceil(n / kMinPartKeys), ceil(2 * threads / KVH)))
//
//   keys  s0 ................................................ L
//         | part 0        | part 1        | ... | part p-1    |
//
// so one long row (a single user's decode: one row, few KV heads) still gives every
// thread work (two items each where an item is one KV head, one where it takes them all:
// paged_attention_hd64.h), and no partition holds more than max_part keys (the kernels'
// score buffers). p depends on the row's own n, the thread count and the model only, never
// on the other rows of the step: a row's result does not depend on its batch mates.
// Items run longest first, each thread taking the next one from a shared counter (dynamic
// scheduling: rows of very different lengths in one step do not leave a thread idle); an
// item's result does not depend on which thread runs it.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "simd.h"

// Fewest keys a partition gets when a row is split only to occupy threads.
constexpr int64_t kMinPartKeys = 128;

// KV heads per work item (the hd64 and codec kernels). A token's K (V) rows of all KV
// heads are one contiguous run in the cache ([block, token, kv head, row]: 384 B for
// SmolLM2's 3 heads in bf16, 192 B in int8), so an item takes the heads of a partition
// together, up to kItemQHeads q heads, and reads each token's rows as one span. Which
// heads share an item never changes a head's result. Measured on the 2-core Zen 5
// (2026-12-05): a gather of one head's 128-B rows (every 384 B) read 27 GB/s, of whole
// 384-B token rows 40-47.
constexpr int64_t kItemQHeads = 16;
inline int64_t kv_heads_per_item(int64_t KVH, int64_t G) {
  return std::max<int64_t>(1, std::min<int64_t>(KVH, kItemQHeads / std::max<int64_t>(1, G)));
}

struct DecodeSplit {
  std::vector<int64_t> first;  // [R + 1] first partition of each row
  std::vector<int64_t> t0, t1;  // [P] keys [t0, t1) of partition p
  std::vector<int64_t> row;  // [P] the row partition p belongs to
  std::vector<int64_t> order;  // [P * units] items p * units + u, longest first
  int64_t units = 0;  // items per partition: KV heads, or groups of them (hd64 kernel)

  int64_t parts() const { return static_cast<int64_t>(t0.size()); }
};

// Partitions of rows with contexts lens[0..R) under window W (0: none; keys
// [max(0, L - W), L)), at most max_part keys each, and units items per partition (0: one
// per KV head). The partitions never depend on units.
static inline DecodeSplit split_decode_rows(const int64_t* lens, int64_t R, int64_t W,
                                            int64_t KVH, int64_t max_part, int64_t units = 0) {
  DecodeSplit s;
  s.units = units > 0 ? units : KVH;
  s.first.assign(R + 1, 0);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t occupy = (2 * threads + KVH - 1) / KVH;  // partitions that fill the threads
  for (int64_t r = 0; r < R; ++r) {
    const int64_t L = lens[r], s0 = W > 0 && L > W ? L - W : 0, n = L - s0;
    const int64_t need = std::max<int64_t>(1, (n + max_part - 1) / max_part);
    const int64_t p = std::max(need, std::min((n + kMinPartKeys - 1) / kMinPartKeys, occupy));
    for (int64_t i = 0; i < p; ++i) {
      s.t0.push_back(s0 + i * n / p);
      s.t1.push_back(s0 + (i + 1) * n / p);
      s.row.push_back(r);
    }
    s.first[r + 1] = s.first[r] + p;
  }
  // A row's partitions are of one size (+-1 key): rows sorted by it order the items.
  std::vector<int64_t> rows(R);
  for (int64_t r = 0; r < R; ++r) rows[r] = r;
  auto part_keys = [&](int64_t r) { return s.t1[s.first[r]] - s.t0[s.first[r]]; };
  std::stable_sort(rows.begin(), rows.end(),
                   [&](int64_t a, int64_t b) { return part_keys(a) > part_keys(b); });
  s.order.reserve(s.parts() * s.units);
  for (const int64_t r : rows)
    for (int64_t p = s.first[r]; p < s.first[r + 1]; ++p)
      for (int64_t u = 0; u < s.units; ++u) s.order.push_back(p * s.units + u);
  return s;
}

// Runs fn(partition, unit) for every item of s, longest first, over the thread pool (the
// unit is the KV head where s.units == KVH, the default).
template <typename F>
static inline void run_decode_items(const DecodeSplit& s, F&& fn) {
  const int64_t items = static_cast<int64_t>(s.order.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(items, std::max<int64_t>(1, at::get_num_threads()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) {
      const int64_t w = s.order[i];
      fn(w / s.units, w % s.units);
    }
  });
}

// One (row, partition, q head) of a split decode: the partition's max score m, its sum of
// exp(score - m) l and its unnormalized head_dim-64 output acc (the hd64 and codec kernels).
struct Partial {
  float m, l;
  alignas(64) float acc[64];
};

#if defined(__AVX512F__)
// Row r's partitions [first[r], first[r + 1]) of q head h (parts[p * H + h]) merged into o
// (flash-decoding's combine):
//
//   o = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p,   M = max_p m_p
static inline void merge_partials(const Partial* parts, const int64_t* first, int64_t H,
                                  int64_t r, int64_t h, __m512* o) {
  float mx = -INFINITY, l = 0.f;
  for (int64_t pi = first[r]; pi < first[r + 1]; ++pi) mx = std::max(mx, parts[pi * H + h].m);
  for (int c = 0; c < 4; ++c) o[c] = _mm512_setzero_ps();
  for (int64_t pi = first[r]; pi < first[r + 1]; ++pi) {
    const Partial& pt = parts[pi * H + h];
    const float wgt = std::exp(pt.m - mx);
    l += wgt * pt.l;
    for (int c = 0; c < 4; ++c)
      o[c] = _mm512_fmadd_ps(_mm512_set1_ps(wgt), _mm512_load_ps(pt.acc + 16 * c), o[c]);
  }
  const __m512 inv = _mm512_set1_ps(1.f / l);
  for (int c = 0; c < 4; ++c) o[c] = _mm512_mul_ps(o[c], inv);
}
#endif
