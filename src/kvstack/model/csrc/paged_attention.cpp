// Paged decode attention for CPU (kvstack).
//
// One query token per request attends to its whole context, reading K and V in place
// from the paged cache [num_blocks, block_size, kv_heads, head_dim] through the
// request's block table: no gather, no copy (vLLM PagedAttention's idea, on CPU).
// The head_dim-64 AVX-512 path (below) splits long contexts into partitions and runs an
// online softmax; other shapes take the generic kernel, split over (request, kv head).
// The q heads of one GQA group share each K/V row.
//
// Sliding windows (Mistral, Qwen2 sliding layers, Gemma 3 local layers): with window W > 0
// a row whose context is L tokens attends only the last W of them, as transformers'
// masking_utils.sliding_window_overlay (kv_idx > q_idx - W):
//
//   keys:  0 1 2 ... L-W-1 | L-W ... L-1      (row at position L - 1, window W)
//          skipped, never   | scored
//          read             |
//
// so both paths start at key max(0, L - W); the blocks before it are never touched.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "kvstack_ops.h"
#include "simd.h"

// First key a row of context L attends under window W (0: no window).
static inline int64_t window_start(int64_t L, int64_t W) { return W > 0 && L > W ? L - W : 0; }

// Row d reads block table tidx[d] (prefill rows of one sequence share its table), or
// table d when tidx is null (decode: one table per row).
static inline int64_t table_row(const int64_t* tidx, int64_t d) { return tidx ? tidx[d] : d; }

// Converts one K/V row of HD elements to float.
template <typename T>
static inline void row_to_float(const T* src, float* dst, int64_t HD) {
#if defined(__AVX512F__)
  if (HD % 16 == 0) {
    for (int64_t i = 0; i < HD; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
    return;
  }
#elif defined(KVSTACK_AVX2)
  if (HD % 8 == 0) {
    for (int64_t i = 0; i < HD; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
    return;
  }
#endif
  for (int64_t i = 0; i < HD; ++i) dst[i] = static_cast<float>(src[i]);
}

static inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#elif defined(KVSTACK_AVX2)
  if (n % 16 == 0) {  // two accumulators: an FMA's latency is 4-5 cycles
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
    }
    return hsum8(_mm256_add_ps(a0, a1));
  }
#endif
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

static inline void axpy(float p, const float* __restrict x, float* __restrict y, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    const __m512 pv = _mm512_set1_ps(p);
    for (int64_t i = 0; i < n; i += 16)
      _mm512_storeu_ps(y + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    return;
  }
#elif defined(KVSTACK_AVX2)
  if (n % 8 == 0) {
    const __m256 pv = _mm256_set1_ps(p);
    for (int64_t i = 0; i < n; i += 8)
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
}

#if defined(__AVX512F__)
// ---------------------------------------------------------------- head_dim 64 fast path
// Work is split over (request, context partition, kv head): a partition holds up to
// kPartTokens tokens, so one long context still spreads over every thread (flash-decoding,
// Dao et al. 2023). Each work item runs an online softmax over its tokens, 16 at a time
// (one horizontal reduction per 16 keys), and leaves per q head the running max m, the sum
// l and the unnormalized output; a merge pass combines partitions:
//
//   out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p,   M = max_p m_p
//
// bf16 caches score with AVX512-BF16 dot products (vdpbf16ps: products exact in float32,
// float32 sums); V is converted once per row and shared by the G q heads of a KV head.
constexpr int64_t kPartTokens = 512;
constexpr int64_t kAhead = 48;  // rows prefetched ahead of the scoring loop

// Every cache line of one head_dim-64 K/V row (128 B in bf16, 256 B in float32).
// Locality 3 = into L1 (_MM_HINT_T0), 2 = into L2 (_MM_HINT_T1).
template <typename T, int Locality>
static inline void prefetch_row(const T* row) {
  const char* p = reinterpret_cast<const char*>(row);
  for (size_t b = 0; b < 64 * sizeof(T); b += 64) __builtin_prefetch(p + b, 0, Locality);
}

struct Partial {  // one (request, partition, q head): m, l, acc[64]
  float m, l;
  alignas(64) float acc[64];
};

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

// Tokens [t_begin, t_end) of request d against KV head kh: G partials. Two passes over
// the partition (scores of all its tokens into an L1-resident buffer, then one softmax and
// the P.V pass): an online update every 16 keys costs more in reduction latency than the
// second read of the scores.
template <typename T, int G>
static void decode_part_hd64(const T* q, const T* kc, const T* vc, const int64_t* table,
                             int64_t KVH, int64_t BS, int64_t kh, int64_t t_begin,
                             int64_t t_end, float scale, Partial* parts) {
  constexpr int64_t HD = 64;
  const int64_t n = t_end - t_begin, np = (n + 15) / 16 * 16;
  alignas(64) float sc[G][kPartTokens];
  int64_t offs[kPartTokens];  // element offset of each token's row for head kh
  for (int64_t j = 0, b = t_begin / BS, i = t_begin % BS; j < n; ++j) {
    offs[j] = ((table[b] * BS + i) * KVH + kh) * HD;
    if (++i == BS) i = 0, ++b;
  }
  for (int64_t j = n; j < np; ++j) offs[j] = offs[0];  // padding rows: masked below
  QReg<T> qr[G];
  for (int g = 0; g < G; ++g) qr[g].load(q + (kh * G + g) * HD);
  // Rows sit scattered over blocks, so the hardware prefetcher cannot follow them: K rows
  // kAhead ahead into L1 (a DRAM miss outlasts ~16 rows of scoring), V rows into L2 for
  // the second pass.
  for (int64_t j = 0; j < std::min(kAhead, n); ++j) {
    prefetch_row<T, 3>(kc + offs[j]);
    prefetch_row<T, 2>(vc + offs[j]);
  }
  for (int64_t j0 = 0; j0 < np; j0 += 16) {
    for (int64_t j = j0 + kAhead; j < std::min(j0 + kAhead + 16, n); ++j) {
      prefetch_row<T, 3>(kc + offs[j]);
      prefetch_row<T, 2>(vc + offs[j]);
    }
    const __mmask16 live = static_cast<__mmask16>(n - j0 >= 16 ? 0xFFFF : (1u << (n - j0)) - 1);
    for (int g = 0; g < G; ++g) {
      __m512 d16[16];
      for (int j = 0; j < 16; ++j) d16[j] = qr[g].dot(kc + offs[j0 + j]);
      const __m512 s = _mm512_mul_ps(hsum16(d16), _mm512_set1_ps(scale));
      _mm512_store_ps(sc[g] + j0, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, s));
    }
  }
  for (int g = 0; g < G; ++g) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < np; j += 16) mv = _mm512_max_ps(mv, _mm512_load_ps(sc[g] + j));
    const float m = _mm512_reduce_max_ps(mv);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < np; j += 16) {
      const __mmask16 live = static_cast<__mmask16>(n - j >= 16 ? 0xFFFF : (1u << (n - j)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(
          live, exp512(_mm512_sub_ps(_mm512_load_ps(sc[g] + j), _mm512_set1_ps(m))));
      _mm512_store_ps(sc[g] + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    parts[g].m = m;
    parts[g].l = _mm512_reduce_add_ps(sum);
  }
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (j + 16 < n) prefetch_row<T, 3>(vc + offs[j + 16]);
    const T* v = vc + offs[j];
    __m512 vv[4];
    for (int c = 0; c < 4; ++c) vv[c] = load16(v + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 pj = _mm512_set1_ps(sc[g][j]);
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(pj, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) _mm512_store_ps(parts[g].acc + 16 * c, acc[g][c]);
}

template <typename T, int G>
static void decode_kernel_hd64(const T* q, const T* kc, const T* vc, const int64_t* tables,
                               const int64_t* tidx, const int64_t* lens, T* out, int64_t D,
                               int64_t KVH, int64_t BS, int64_t MB, float scale, int64_t W) {
  constexpr int64_t HD = 64;
  const int64_t H = KVH * G;
  std::vector<int64_t> first(D + 1, 0);  // first partition index of each request
  for (int64_t d = 0; d < D; ++d) {
    const int64_t n = lens[d] - window_start(lens[d], W);  // keys the row attends
    first[d + 1] = first[d] + std::max<int64_t>(1, (n + kPartTokens - 1) / kPartTokens);
  }
  const int64_t P = first[D];
  std::vector<Partial> parts(P * H);
  at::parallel_for(0, P * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t pi = w / KVH, kh = w % KVH;
      const int64_t d = std::upper_bound(first.begin(), first.end(), pi) - first.begin() - 1;
      const int64_t t0 = window_start(lens[d], W) + (pi - first[d]) * kPartTokens;
      decode_part_hd64<T, G>(q + d * H * HD, kc, vc, tables + table_row(tidx, d) * MB, KVH, BS, kh, t0,
                             std::min(lens[d], t0 + kPartTokens), scale,
                             parts.data() + pi * H + kh * G);
    }
  });
  at::parallel_for(0, D * H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t d = w / H, h = w % H;
      float mx = -INFINITY;
      for (int64_t pi = first[d]; pi < first[d + 1]; ++pi) mx = std::max(mx, parts[pi * H + h].m);
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                       _mm512_setzero_ps()};
      float l = 0.f;
      for (int64_t pi = first[d]; pi < first[d + 1]; ++pi) {
        const Partial& pt = parts[pi * H + h];
        const float wgt = std::exp(pt.m - mx);
        l += wgt * pt.l;
        for (int c = 0; c < 4; ++c)
          acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(wgt), _mm512_load_ps(pt.acc + 16 * c), acc[c]);
      }
      const __m512 inv = _mm512_set1_ps(1.f / l);
      for (int c = 0; c < 4; ++c) store16(out + (d * H + h) * HD + 16 * c, _mm512_mul_ps(acc[c], inv));
    }
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

// Prefetch distance (rows) of the generic kernel, and a row's lines into L1 (locality 3)
// or L2 (2).
constexpr int64_t kGenericAhead = 16;
template <int Locality>
static inline void prefetch_bytes(const void* row, size_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, Locality);
}

template <typename T>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int64_t* tables,
                          const int64_t* tidx, const int64_t* lens, T* out, int64_t D, int64_t H,
                          int64_t KVH, int64_t HD, int64_t BS, int64_t MB, float scale,
                          int64_t W) {
  const int64_t G = H / KVH;
  at::parallel_for(0, D * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * HD), acc(G * HD), row(HD), scores;
    std::vector<int64_t> offs;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t d = w / KVH, kh = w % KVH;
      const int64_t s0 = window_start(lens[d], W);  // keys [s0, lens[d]), L of them
      const int64_t L = lens[d] - s0;
      scores.resize(G * L);
      for (int64_t g = 0; g < G; ++g) {
        row_to_float(q + (d * H + kh * G + g) * HD, qf.data() + g * HD, HD);
        for (int64_t i = 0; i < HD; ++i) qf[g * HD + i] *= scale;
      }
      const int64_t* table = tables + table_row(tidx, d) * MB;
      // Rows sit scattered over blocks: their offsets first, then K rows prefetched
      // kGenericAhead ahead of the scoring loop and V rows into L2 for the second pass.
      offs.resize(L);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t k = s0 + t;
        offs[t] = ((table[k / BS] * BS + k % BS) * KVH + kh) * HD;
      }
      for (int64_t t = 0; t < L; ++t) {
        if (t + kGenericAhead < L) {
          prefetch_bytes<3>(kc + offs[t + kGenericAhead], HD * sizeof(T));
          prefetch_bytes<2>(vc + offs[t + kGenericAhead], HD * sizeof(T));
        }
        row_to_float(kc + offs[t], row.data(), HD);
        for (int64_t g = 0; g < G; ++g) scores[g * L + t] = dot(qf.data() + g * HD, row.data(), HD);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float m = -INFINITY;
        for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
        float sum = 0.f;
        int64_t t = 0;
#if defined(KVSTACK_AVX2) && !defined(__AVX512F__)
        __m256 sum8 = _mm256_setzero_ps();
        for (; t + 8 <= L; t += 8) {
          const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), _mm256_set1_ps(m)));
          _mm256_storeu_ps(sg + t, e);
          sum8 = _mm256_add_ps(sum8, e);
        }
        sum = hsum8(sum8);
#endif
        for (; t < L; ++t) {
          sg[t] = std::exp(sg[t] - m);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        if (t + kGenericAhead < L) prefetch_bytes<3>(vc + offs[t + kGenericAhead], HD * sizeof(T));
        row_to_float(vc + offs[t], row.data(), HD);
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * L + t], row.data(), acc.data() + g * HD, HD);
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < HD; ++i)
          out[(d * H + kh * G + g) * HD + i] = static_cast<T>(acc[g * HD + i]);
    }
  });
}

// q [R, H, HD]; k_cache/v_cache [NB, BS, KVH, HD]; block_tables [S, MB] int64;
// table_index [R] int64 (row r reads table table_index[r]; None: S == R, row r table r);
// context_lens [R] int64: row r attends tokens [0, context_lens[r]) of its table. A
// prefill row at KV position p passes p + 1 (causal), so a prompt token is scored exactly
// as a decode of that position would be: same partitions, same order, bit-identical.
// window > 0: each row attends only its last `window` tokens (window_start above); 0: all.
// Returns [R, H, HD] in q's dtype.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, std::optional<torch::Tensor> table_index,
                              torch::Tensor context_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && block_tables.dim() == 2, "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k and v caches differ in shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "q and cache dtypes differ");
  q = q.contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t R = q.size(0), H = q.size(1), HD = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), MB = block_tables.size(1);
  const int64_t S = block_tables.size(0), NB = k_cache.size(0);
  TORCH_CHECK(KVH > 0 && H % KVH == 0 && k_cache.size(3) == HD, "head shapes do not match");
  TORCH_CHECK(context_lens.numel() == R, "one context length per row");
  TORCH_CHECK(window >= 0, "window ", window, " is negative (0: no window)");
  torch::Tensor tidx_t;
  const int64_t* tidx = nullptr;
  if (table_index.has_value()) {
    tidx_t = table_index->to(torch::kInt64).contiguous();
    TORCH_CHECK(tidx_t.numel() == R, "one table index per row");
    tidx = tidx_t.data_ptr<int64_t>();
  } else {
    TORCH_CHECK(S == R, "one block table per row");
  }
  // Checked before any read: no input reads out of bounds. Each table is checked once, up
  // to the longest context that reads it.
  const int64_t* lens_p = context_lens.data_ptr<int64_t>();
  const int64_t* tab_p = block_tables.data_ptr<int64_t>();
  std::vector<int64_t> need(S, 0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = table_row(tidx, r);
    TORCH_CHECK(t >= 0 && t < S, "table index ", t, " outside [0, ", S, ")");
    TORCH_CHECK(lens_p[r] >= 1 && lens_p[r] <= MB * BS, "context length ", lens_p[r],
                " outside [1, ", MB * BS, "]");
    need[t] = std::max(need[t], lens_p[r]);
  }
  for (int64_t t = 0; t < S; ++t)
    for (int64_t b = 0; b < (need[t] + BS - 1) / BS; ++b)
      TORCH_CHECK(tab_p[t * MB + b] >= 0 && tab_p[t * MB + b] < NB, "block id ",
                  tab_p[t * MB + b], " outside the cache");
  auto out = torch::empty_like(q);
  if (R == 0) return out;
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == torch::kBFloat16) {
    using T = c10::BFloat16;
    const T *qp = q.data_ptr<T>(), *kp = k_cache.data_ptr<T>(), *vp = v_cache.data_ptr<T>();
    if (!decode_fast<T>(qp, kp, vp, tab_p, tidx, lens_p, out.data_ptr<T>(), R, H, KVH, HD, BS,
                        MB, sc, window))
      decode_kernel<T>(qp, kp, vp, tab_p, tidx, lens_p, out.data_ptr<T>(), R, H, KVH, HD, BS,
                       MB, sc, window);
  } else if (q.scalar_type() == torch::kFloat32) {
    const float *qp = q.data_ptr<float>(), *kp = k_cache.data_ptr<float>();
    const float* vp = v_cache.data_ptr<float>();
    if (!decode_fast<float>(qp, kp, vp, tab_p, tidx, lens_p, out.data_ptr<float>(), R, H, KVH,
                            HD, BS, MB, sc, window))
      decode_kernel<float>(qp, kp, vp, tab_p, tidx, lens_p, out.data_ptr<float>(), R, H, KVH,
                           HD, BS, MB, sc, window);
  } else {
    TORCH_CHECK(false, "paged attention supports bfloat16 and float32");
  }
  return out;
}

// The decode case: one query row, one block table per request.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t window) {
  return paged_attention(q, k_cache, v_cache, block_tables, std::nullopt, context_lens, scale,
                         window);
}
