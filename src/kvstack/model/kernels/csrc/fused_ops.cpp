// Fused per-token ops of the Llama layer for CPU (kvstack): one pass over each row instead
// of the 4-10 PyTorch ops (and temporaries) each replaces.
//
//   rms_norm        out = x * rsqrt(mean(x^2) + eps) * w           (Zhang & Sennrich, 2019)
//   add_rms_norm    residual += x; x = rms_norm(residual)          (in place, as vLLM's
//                                                                   fused_add_rms_norm)
//   silu_and_mul    out = silu(g) * u  for gu = [g | u]            (SwiGLU, Shazeer 2020)
//   rope_and_cache  RoPE (rotate-half) on the q and k heads of qkv in place, then k and v
//                   written to the paged cache at their slots     (vLLM's rotary_embedding
//                                                                   + reshape_and_cache)
//
// Rounding follows the PyTorch path of model/arch/ops.py (TorchOps): rope and silu_and_mul
// round to the activation dtype wherever PyTorch's separate ops do, so rope is bit-exact
// in bf16 and fp32; the norms accumulate in float32 and round once (as F.rms_norm).
// Vectorized with AVX-512 (16 lanes) or, on CPUs without it, AVX2 + FMA (8 lanes); the
// scalar loop takes the tails.
#include <ATen/Parallel.h>

#include <type_traits>

#include "kvstack_ops.h"
#include "simd.h"

namespace {

// Rows per parallel task: small batches (decode) stay on one thread.
int64_t grain_for(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_elems, 1)); }

template <typename T>
float sum_squares(const T* x, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(KVSTACK_AVX512)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  s = _mm512_reduce_add_ps(acc);
#elif defined(KVSTACK_AVX2)
  // Two 8-lane partial sums, as PyTorch's vectorized reduction on AVX2 (a sequential float
  // sum over 576 squares drifted 4.5 ulps from it).
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = load8(x + i), v1 = load8(x + i + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  s = hsum8(_mm256_add_ps(a0, a1));
#endif
  for (; i < n; ++i) s += to_f(x[i]) * to_f(x[i]);
  return s;
}

// out[i] = (x[i] * inv) * w[i], rounded once to T.
template <typename T>
void scale_row(const T* x, const T* w, T* out, int64_t n, float inv) {
  int64_t i = 0;
#if defined(KVSTACK_AVX512)
  const __m512 iv = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16)
    store16(out + i, _mm512_mul_ps(_mm512_mul_ps(load16(x + i), iv), load16(w + i)));
#elif defined(KVSTACK_AVX2)
  const __m256 iv = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8)
    store8(out + i, _mm256_mul_ps(_mm256_mul_ps(load8(x + i), iv), load8(w + i)));
#endif
  for (; i < n; ++i) out[i] = static_cast<T>((to_f(x[i]) * inv) * to_f(w[i]));
}

// r[i] = T(r[i] + x[i]) (the residual add, rounded as PyTorch's add).
template <typename T>
void add_row(T* r, const T* x, int64_t n) {
  int64_t i = 0;
#if defined(KVSTACK_AVX512)
  for (; i + 16 <= n; i += 16) store16(r + i, _mm512_add_ps(load16(r + i), load16(x + i)));
#elif defined(KVSTACK_AVX2)
  for (; i + 8 <= n; i += 8) store8(r + i, _mm256_add_ps(load8(r + i), load8(x + i)));
#endif
  for (; i < n; ++i) r[i] = static_cast<T>(to_f(r[i]) + to_f(x[i]));
}

// Rows [b, e) of rms_norm (residual null) or add_rms_norm (residual += x first).
template <typename T>
void norm_rows(const T* x, const T* w, T* out, int64_t b, int64_t e, int64_t n, float eps,
               T* residual) {
  for (int64_t r = b; r < e; ++r) {
    const T* src = x + r * n;
    if (residual != nullptr) {
      add_row(residual + r * n, src, n);
      src = residual + r * n;
    }
    const float inv = 1.f / std::sqrt(sum_squares(src, n) / static_cast<float>(n) + eps);
    scale_row(src, w, out + r * n, n, inv);
  }
}

template <typename T>
void rms_norm_impl(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps,
                   T* residual) {
  at::parallel_for(0, rows, grain_for(n), [&](int64_t b, int64_t e) {
    norm_rows(x, w, out, b, e, n, eps, residual);
  });
}

#if defined(KVSTACK_AVX512)
// 1 / d: exact division in float32; for bf16 outputs rcp14 and one Newton step (~2^-23
// relative, far below bf16's 2^-8), which avoids the slow vdivps.
template <typename T>
inline __m512 recip(__m512 d) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_div_ps(_mm512_set1_ps(1.f), d);
  } else {
    const __m512 r = _mm512_rcp14_ps(d);
    return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
  }
}
#endif

// out = T(T(silu(g)) * u): silu rounded to T first, as PyTorch's silu then mul.
template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t b, int64_t e, int64_t n) {
  for (int64_t r = b; r < e; ++r) {
    const T* g = gu + r * 2 * n;
    const T* u = g + n;
    T* o = out + r * n;
    int64_t i = 0;
#if defined(KVSTACK_AVX512)
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= n; i += 16) {
      const __m512 gv = load16(g + i);
      const __m512 den = _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
      const __m512 s = round_to<T>(_mm512_mul_ps(gv, recip<T>(den)));
      store16(o + i, _mm512_mul_ps(s, load16(u + i)));
    }
#elif defined(KVSTACK_AVX2)
    const __m256 one = _mm256_set1_ps(1.f), neg = _mm256_set1_ps(-0.f);
    for (; i + 8 <= n; i += 8) {
      const __m256 gv = load8(g + i);
      const __m256 den = _mm256_add_ps(one, exp256(_mm256_xor_ps(gv, neg)));
      const __m256 s = round_to8<T>(_mm256_div_ps(gv, den));
      store8(o + i, _mm256_mul_ps(s, load8(u + i)));
    }
#endif
    for (; i < n; ++i) {
      const float gv = to_f(g[i]);
      const float s = round_f<T>(gv / (1.f + std::exp(-gv)));
      o[i] = static_cast<T>(s * to_f(u[i]));
    }
  }
}

template <typename T>
void silu_mul_impl(const T* gu, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, grain_for(2 * n), [&](int64_t b, int64_t e) {
    silu_mul_rows(gu, out, b, e, n);
  });
}

// One head of HD values in place: [x1 | x2] -> [x1 c - x2 s | x2 c + x1 s], every product
// and sum rounded to T as PyTorch's x * cos + rotate_half(x) * sin with T-typed cos/sin.
template <typename T>
void rope_head(T* x, const float* cos, const float* sin, int64_t half) {
  int64_t i = 0;
#if defined(KVSTACK_AVX512)
  for (; i + 16 <= half; i += 16) {
    const __m512 c = round_to<T>(_mm512_loadu_ps(cos + i));
    const __m512 s = round_to<T>(_mm512_loadu_ps(sin + i));
    const __m512 x1 = load16(x + i), x2 = load16(x + half + i);
    const __m512 a = _mm512_add_ps(round_to<T>(_mm512_mul_ps(x1, c)),
                                   round_to<T>(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s)));
    const __m512 b2 = _mm512_add_ps(round_to<T>(_mm512_mul_ps(x2, c)),
                                    round_to<T>(_mm512_mul_ps(x1, s)));
    store16(x + i, a);
    store16(x + half + i, b2);
  }
#elif defined(KVSTACK_AVX2)
  const __m256 neg = _mm256_set1_ps(-0.f);  // -x2 flips the sign, as PyTorch's neg
  for (; i + 8 <= half; i += 8) {
    const __m256 c = round_to8<T>(_mm256_loadu_ps(cos + i));
    const __m256 s = round_to8<T>(_mm256_loadu_ps(sin + i));
    const __m256 x1 = load8(x + i), x2 = load8(x + half + i);
    const __m256 a = _mm256_add_ps(round_to8<T>(_mm256_mul_ps(x1, c)),
                                   round_to8<T>(_mm256_mul_ps(_mm256_xor_ps(x2, neg), s)));
    const __m256 b2 = _mm256_add_ps(round_to8<T>(_mm256_mul_ps(x2, c)),
                                    round_to8<T>(_mm256_mul_ps(x1, s)));
    store8(x + i, a);
    store8(x + half + i, b2);
  }
#endif
  for (; i < half; ++i) {
    const float c = round_f<T>(cos[i]), s = round_f<T>(sin[i]);
    const float x1 = to_f(x[i]), x2 = to_f(x[half + i]);
    x[i] = static_cast<T>(round_f<T>(x1 * c) + round_f<T>(-x2 * s));
    x[half + i] = static_cast<T>(round_f<T>(x2 * c) + round_f<T>(x1 * s));
  }
}

template <typename T>
void rope_cache_rows(T* qkv, const int64_t* pos, const float* cos, const float* sin, T* kc,
                     T* vc, const int64_t* slots, int64_t b, int64_t e, int64_t H, int64_t KVH,
                     int64_t HD) {
  const int64_t width = (H + 2 * KVH) * HD, kv_width = KVH * HD;
  for (int64_t r = b; r < e; ++r) {
    const int64_t p = pos[r];  // bounds checked by the caller
    T* row = qkv + r * width;
    for (int64_t h = 0; h < H + KVH; ++h)
      rope_head(row + h * HD, cos + p * HD, sin + p * HD, HD / 2);
    if (kc == nullptr) continue;
    const int64_t slot = slots[r];
    std::memcpy(kc + slot * kv_width, row + H * HD, kv_width * sizeof(T));
    std::memcpy(vc + slot * kv_width, row + (H + KVH) * HD, kv_width * sizeof(T));
  }
}

template <typename T>
void rope_cache_impl(T* qkv, const int64_t* pos, const float* cos, const float* sin,
                     T* kc, T* vc, const int64_t* slots, int64_t rows, int64_t H, int64_t KVH,
                     int64_t HD) {
  const int64_t width = (H + 2 * KVH) * HD;
  at::parallel_for(0, rows, grain_for(width), [&](int64_t b, int64_t e) {
    rope_cache_rows(qkv, pos, cos, sin, kc, vc, slots, b, e, H, KVH, HD);
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, " must be a contiguous 2-d tensor");
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kFloat32,
              name, " must be bfloat16 or float32");
}

// Every value of the int64 tensor t lies in [0, limit): checked before any write.
void check_range(const torch::Tensor& t, int64_t limit, const char* what) {
  const int64_t* v = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    TORCH_CHECK(v[i] >= 0 && v[i] < limit, what, " ", v[i], " outside [0, ", limit, ")");
}

}  // namespace

#define KVSTACK_DISPATCH(dtype, ...)                      \
  if ((dtype) == torch::kBFloat16) {                      \
    using T = c10::BFloat16;                              \
    __VA_ARGS__();                                        \
  } else {                                                \
    using T = float;                                      \
    __VA_ARGS__();                                        \
  }

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "weight must be [hidden] in x's dtype");
  w = w.contiguous();
  auto out = torch::empty_like(x);
  KVSTACK_DISPATCH(x.scalar_type(), [&] {
    rms_norm_impl<T>(x.data_ptr<T>(), w.data_ptr<T>(), out.data_ptr<T>(), x.size(0),
                     x.size(1), static_cast<float>(eps), nullptr);
  });
  return out;
}

void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual differ in shape or dtype");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "weight must be [hidden] in x's dtype");
  w = w.contiguous();
  KVSTACK_DISPATCH(x.scalar_type(), [&] {
    rms_norm_impl<T>(x.data_ptr<T>(), w.data_ptr<T>(), x.data_ptr<T>(), x.size(0), x.size(1),
                     static_cast<float>(eps), residual.data_ptr<T>());
  });
}

torch::Tensor silu_and_mul(torch::Tensor gu) {
  check_rows(gu, "gate_up");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gate_up must have an even number of columns");
  const int64_t n = gu.size(1) / 2;
  auto out = torch::empty({gu.size(0), n}, gu.options());
  KVSTACK_DISPATCH(gu.scalar_type(), [&] {
    silu_mul_impl<T>(gu.data_ptr<T>(), out.data_ptr<T>(), gu.size(0), n);
  });
  return out;
}

void rope_and_cache(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos,
                    torch::Tensor sin, std::optional<torch::Tensor> k_cache,
                    std::optional<torch::Tensor> v_cache, std::optional<torch::Tensor> slots,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim && head_dim % 2 == 0,
              "qkv width does not match the head counts");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.size(1) == head_dim,
              "cos/sin must be contiguous float32 [max_pos, head_dim]");
  positions = positions.to(torch::kInt64).contiguous();
  TORCH_CHECK(positions.numel() == qkv.size(0), "one position per row");
  check_range(positions, cos.size(0), "position");
  const bool write = k_cache.has_value();
  int64_t num_slots = 0;
  if (write) {
    TORCH_CHECK(v_cache.has_value() && slots.has_value(), "k_cache needs v_cache and slots");
    TORCH_CHECK(k_cache->is_contiguous() && v_cache->is_contiguous() &&
                    k_cache->scalar_type() == qkv.scalar_type() &&
                    v_cache->sizes() == k_cache->sizes(),
                "caches must be contiguous, in qkv's dtype, of one shape");
    num_slots = k_cache->numel() / (num_kv_heads * head_dim);
    *slots = slots->to(torch::kInt64).contiguous();
    TORCH_CHECK(slots->numel() == qkv.size(0), "one slot per row");
    check_range(*slots, num_slots, "KV slot");
  }
  KVSTACK_DISPATCH(qkv.scalar_type(), [&] {
    rope_cache_impl<T>(qkv.data_ptr<T>(), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                       sin.data_ptr<float>(), write ? k_cache->data_ptr<T>() : nullptr,
                       write ? v_cache->data_ptr<T>() : nullptr,
                       write ? slots->data_ptr<int64_t>() : nullptr, qkv.size(0), num_heads,
                       num_kv_heads, head_dim);
  });
}

// Row slices for decode_team.cpp (team_slices.h): the same row functions as the ops above.
namespace team {
using BF = c10::BFloat16;

void norm_rows(const BF* x, const BF* w, BF* out, int64_t b, int64_t e, int64_t n, float eps,
               BF* residual) {
  ::norm_rows<BF>(x, w, out, b, e, n, eps, residual);
}

void silu_mul_rows(const BF* gu, BF* out, int64_t b, int64_t e, int64_t n) {
  ::silu_mul_rows<BF>(gu, out, b, e, n);
}

void rope_cache_rows(BF* qkv, const int64_t* pos, const float* cos, const float* sin, BF* kc,
                     BF* vc, const int64_t* slots, int64_t b, int64_t e, int64_t H, int64_t KVH,
                     int64_t HD) {
  ::rope_cache_rows<BF>(qkv, pos, cos, sin, kc, vc, slots, b, e, H, KVH, HD);
}
}  // namespace team
