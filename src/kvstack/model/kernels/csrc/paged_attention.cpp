// Paged decode attention for CPU (kvstack).
//
// One query token per request attends to its whole context, reading K and V in place
// from the paged cache [num_blocks, block_size, kv_heads, head_dim] through the
// request's block table: no gather, no copy (vLLM PagedAttention's idea, on CPU).
// The head_dim-64 AVX-512 path (paged_attention_hd64.h) splits long contexts into
// partitions and runs an online softmax; on AVX2 CPUs without AVX-512 decode_avx2.h does
// the same for head_dim 64 / 128 / 256; other shapes take the generic kernel, split over
// (request, kv head).
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

#include "decode_avx2.h"
#include "paged_attention_hd64.h"

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
#if defined(KVSTACK_DECODE_AVX2)
  if (q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kFloat32) {
    const bool b16 = q.scalar_type() == torch::kBFloat16;
    const CodecView cv{Codec::kBF16, static_cast<const uint8_t*>(k_cache.data_ptr()),
                       static_cast<const uint8_t*>(v_cache.data_ptr()), nullptr, nullptr,
                       HD * static_cast<int64_t>(k_cache.element_size()), 0, 0, HD, nullptr,
                       nullptr, false, nullptr, nullptr, KVH, BS, HD};
    const bool done = b16 ? decode_avx2<c10::BFloat16>(Rd::kBF16, cv, q.data_ptr<c10::BFloat16>(), tab_p, tidx,
                                                       lens_p, out.data_ptr<c10::BFloat16>(), R, H, MB, sc, window)
                          : decode_avx2<float>(Rd::kF32, cv, q.data_ptr<float>(), tab_p, tidx, lens_p,
                                               out.data_ptr<float>(), R, H, MB, sc, window);
    if (done) return out;
  }
#endif
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
