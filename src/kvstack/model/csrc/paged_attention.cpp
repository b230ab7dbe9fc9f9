// Paged decode attention for CPU (kvstack).
//
// One query token per request attends to its whole context, reading K and V in place
// from the paged cache [num_blocks, block_size, kv_heads, head_dim] through the
// request's block table: no gather, no copy (vLLM PagedAttention's idea, on CPU).
// Work is split over (request, kv head) pairs; the q heads of one GQA group share each
// K/V row, which is converted to float once.
#include <ATen/Parallel.h>

#include <vector>

#include "kvstack_ops.h"
#include "simd.h"

// Converts one K/V row of HD elements to float.
template <typename T>
static inline void row_to_float(const T* src, float* dst, int64_t HD) {
#if defined(__AVX512F__)
  if (HD % 16 == 0) {
    for (int64_t i = 0; i < HD; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
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
#endif
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
}

#if defined(__AVX512F__)
// Sums each of 16 vectors: lane t of the result = sum of v[t]'s lanes.
static inline __m512 hsum16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88),
                       _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
}

// head_dim 64, G query heads per KV head: scores for 16 keys at a time (one horizontal
// reduction per 16 keys instead of one per key), vectorized softmax, register accumulators.
template <typename T, int G>
static void decode_kernel_hd64(const T* q, const T* kc, const T* vc, const int64_t* tables,
                               const int64_t* lens, T* out, int64_t D, int64_t KVH, int64_t BS,
                               int64_t MB, float scale) {
  constexpr int64_t HD = 64;
  const int64_t H = KVH * G;
  at::parallel_for(0, D * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    alignas(64) float kf[16][HD];
    for (int64_t w = begin; w < end; ++w) {
      const int64_t d = w / KVH, kh = w % KVH;
      const int64_t L = lens[d], Lp = (L + 15) / 16 * 16;
      const int64_t* table = tables + d * MB;
      scores.assign(G * Lp, -INFINITY);
      __m512 qv[G][4];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c)
          qv[g][c] = _mm512_mul_ps(load16(q + (d * H + kh * G + g) * HD + 16 * c),
                                   _mm512_set1_ps(scale));
      for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, L - t0);
        for (int64_t j = 0; j < n; ++j) {
          const int64_t t = t0 + j;
          const T* k = kc + ((table[t / BS] * BS + t % BS) * KVH + kh) * HD;
          for (int c = 0; c < 4; ++c) _mm512_store_ps(kf[j] + 16 * c, load16(k + 16 * c));
        }
        for (int64_t j = n; j < 16; ++j)
          for (int c = 0; c < 4; ++c) _mm512_store_ps(kf[j] + 16 * c, _mm512_setzero_ps());
        for (int g = 0; g < G; ++g) {
          __m512 acc[16];
          for (int j = 0; j < 16; ++j) {
            __m512 a = _mm512_mul_ps(qv[g][0], _mm512_load_ps(kf[j]));
            a = _mm512_fmadd_ps(qv[g][1], _mm512_load_ps(kf[j] + 16), a);
            a = _mm512_fmadd_ps(qv[g][2], _mm512_load_ps(kf[j] + 32), a);
            acc[j] = _mm512_fmadd_ps(qv[g][3], _mm512_load_ps(kf[j] + 48), a);
          }
          _mm512_mask_storeu_ps(scores.data() + g * Lp + t0, (__mmask16)((1u << n) - 1),
                                hsum16(acc));
        }
      }
      for (int g = 0; g < G; ++g) {
        float* sg = scores.data() + g * Lp;
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < Lp; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sg + t));
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < Lp; t += 16) {
          __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mx));
          if (t + 16 > L) e = _mm512_maskz_mov_ps((__mmask16)((1u << (L - t)) - 1), e);
          _mm512_storeu_ps(sg + t, e);
          sum = _mm512_add_ps(sum, e);
        }
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
        for (int64_t t = 0; t < Lp; t += 16)
          _mm512_storeu_ps(sg + t, _mm512_mul_ps(_mm512_loadu_ps(sg + t), inv));
      }
      __m512 acc[G][4];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
      for (int64_t t = 0; t < L; ++t) {
        const T* v = vc + ((table[t / BS] * BS + t % BS) * KVH + kh) * HD;
        __m512 vv[4];
        for (int c = 0; c < 4; ++c) vv[c] = load16(v + 16 * c);
        for (int g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * Lp + t]);
          for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
        }
      }
      for (int g = 0; g < G; ++g) {
        alignas(64) float o[HD];
        for (int c = 0; c < 4; ++c) _mm512_store_ps(o + 16 * c, acc[g][c]);
        T* dst = out + (d * H + kh * G + g) * HD;
        for (int64_t i = 0; i < HD; ++i) dst[i] = static_cast<T>(o[i]);
      }
    }
  });
}

template <typename T>
static bool decode_fast(const T* q, const T* kc, const T* vc, const int64_t* tables,
                        const int64_t* lens, T* out, int64_t D, int64_t H, int64_t KVH,
                        int64_t HD, int64_t BS, int64_t MB, float scale) {
  if (HD != 64) return false;
  switch (H / KVH) {
#define KVSTACK_G(g)                                                                  \
  case g:                                                                             \
    decode_kernel_hd64<T, g>(q, kc, vc, tables, lens, out, D, KVH, BS, MB, scale); \
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
static bool decode_fast(const T*, const T*, const T*, const int64_t*, const int64_t*, T*,
                        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float) {
  return false;
}
#endif

template <typename T>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int64_t* tables,
                          const int64_t* lens, T* out, int64_t D, int64_t H, int64_t KVH,
                          int64_t HD, int64_t BS, int64_t MB, float scale) {
  const int64_t G = H / KVH;
  at::parallel_for(0, D * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * HD), acc(G * HD), row(HD), scores;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t d = w / KVH, kh = w % KVH;
      const int64_t L = lens[d];
      scores.resize(G * L);
      for (int64_t g = 0; g < G; ++g) {
        row_to_float(q + (d * H + kh * G + g) * HD, qf.data() + g * HD, HD);
        for (int64_t i = 0; i < HD; ++i) qf[g * HD + i] *= scale;
      }
      const int64_t* table = tables + d * MB;
      for (int64_t t = 0; t < L; ++t) {
        row_to_float(kc + ((table[t / BS] * BS + t % BS) * KVH + kh) * HD, row.data(), HD);
        for (int64_t g = 0; g < G; ++g) scores[g * L + t] = dot(qf.data() + g * HD, row.data(), HD);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float m = -INFINITY;
        for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          sg[t] = std::exp(sg[t] - m);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        row_to_float(vc + ((table[t / BS] * BS + t % BS) * KVH + kh) * HD, row.data(), HD);
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * L + t], row.data(), acc.data() + g * HD, HD);
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < HD; ++i)
          out[(d * H + kh * G + g) * HD + i] = static_cast<T>(acc[g * HD + i]);
    }
  });
}

// q [D, H, HD]; k_cache/v_cache [NB, BS, KVH, HD]; block_tables [D, MB] int64;
// context_lens [D] int64. Returns [D, H, HD] in q's dtype.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  q = q.contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t D = q.size(0), H = q.size(1), HD = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), MB = block_tables.size(1);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == HD, "head shapes do not match");
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kBFloat16) {
    using T = c10::BFloat16;
    if (!decode_fast<T>(q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                        block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                        out.data_ptr<T>(), D, H, KVH, HD, BS, MB, static_cast<float>(scale)))
    decode_kernel<T>(q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                     block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                     out.data_ptr<T>(), D, H, KVH, HD, BS, MB, static_cast<float>(scale));
  } else if (q.scalar_type() == torch::kFloat32) {
    if (!decode_fast<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                            v_cache.data_ptr<float>(), block_tables.data_ptr<int64_t>(),
                            context_lens.data_ptr<int64_t>(), out.data_ptr<float>(), D, H, KVH,
                            HD, BS, MB, static_cast<float>(scale)))
    decode_kernel<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                         v_cache.data_ptr<float>(), block_tables.data_ptr<int64_t>(),
                         context_lens.data_ptr<int64_t>(), out.data_ptr<float>(), D, H, KVH,
                         HD, BS, MB, static_cast<float>(scale));
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports bfloat16 and float32");
  }
  return out;
}
