// Weight-only quantized linears with int8 activations and AVX512-VNNI dot products
// (kvstack): the decode path for bf16 activations when the CPU has vpdpbusd.
//
// Weights are the packed layout of quant_linear.cpp (PackedWeight). Activations are
// quantized per row and 32-value chunk c, as llama.cpp quantizes them for its Q4_0 / Q4_1 /
// Q8_0 dot products (block_q8_0 / block_q8_1, ggml-quants.c):
//   dx[m, c] = max |x[m, 32c .. 32c+31]| / 127,   xq = round(x / dx) in [-127, 127]
// and then, with s / mn the weight's group scale and min,
//   y[m, n] = sum_c dx[m,c] * (s * sum_j xq_j q_j + mn * sum_j xq_j)
// 4-bit codes are 0..15 (unsigned: vpdpbusd's u8 x s8 directly); 8-bit codes are stored
// signed and offset by 128 for vpdpbusd, the offset removed as a min of -128 s.
//
// Deviation from the float path (quant_linear): the activations carry int8 rounding (a
// relative error of <= 1/254 of each chunk's largest value), exactly as llama.cpp's CPU
// path; the weights are not rounded. A row's result still depends only on that row.
// Needs K % 64 == 0 and group % 32 == 0; quant_linear_vnni_ok says whether it applies.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "kvstack_ops.h"
#include "simd.h"

namespace {

constexpr int kTileV = 4;  // rows of x per register tile

struct QuantAct {  // one call's quantized activations
  std::vector<int8_t> xq;  // [M, K]
  std::vector<float> dx;   // [M, K/32]: chunk scales
  std::vector<float> xs;   // [M, K/32]: dx * sum(xq) of each chunk
  std::vector<float> dxv;  // [M, K/64, 16]: dx of chunk 2p in lanes 0-7, of 2p+1 in 8-15
  std::vector<float> xsv;  // [M, K/64, 16]: xs / 8 laid out as dxv (8 lanes sum to xs)
};

// One chunk of 32 activations: codes to q, returns (scale d, sum of the codes).
template <typename T>
inline std::pair<float, int> quantize_chunk(const T* src, int8_t* q) {
#if defined(KVSTACK_AVX512)
  const __m512 v0 = load16(src), v1 = load16(src + 16);
  const __m512 mag = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
  const float d = _mm512_reduce_max_ps(mag) / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  // cvtps_epi32 rounds to nearest even, as nearbyint below
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
  return {d, _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1))};
#else
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(to_f(src[j])));
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  int sum = 0;
  for (int j = 0; j < 32; ++j) {
    const int v = static_cast<int>(std::nearbyint(to_f(src[j]) * inv));
    q[j] = static_cast<int8_t>(v);
    sum += v;
  }
  return {d, sum};
#endif
}

template <typename T>
QuantAct quantize_rows(const T* x, int64_t M, int64_t K) {
  const int64_t chunks = M * K / 32;  // rows are whole chunks: K % 64 == 0
  QuantAct a{std::vector<int8_t>(M * K), std::vector<float>(chunks), std::vector<float>(chunks),
             std::vector<float>(8 * chunks), std::vector<float>(8 * chunks)};
  for (int64_t i = 0; i < chunks; ++i) {
    const auto [d, sum] = quantize_chunk(x + 32 * i, a.xq.data() + 32 * i);
    a.dx[i] = d;
    a.xs[i] = d * static_cast<float>(sum);
    std::fill_n(a.dxv.begin() + 8 * i, 8, d);  // chunk i -> 8 lanes of its pair's vector
    std::fill_n(a.xsv.begin() + 8 * i, 8, a.xs[i] * 0.125f);  // exact: a power of two
  }
  return a;
}

#if defined(KVSTACK_AVX512) && defined(__AVX512VNNI__)
// 64 weight codes k0..k0+63 of a row as unsigned bytes in k order.
template <int BITS>
inline __m512i codes64(const uint8_t* qrow, int64_t k0) {
  if constexpr (BITS == 4) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qrow + k0 / 2));
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(v, m4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // lo0 lo1 hi0 hi1
    return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));            // lo0 hi0 lo1 hi1
  } else {
    const __m512i v = _mm512_loadu_si512(qrow + k0);
    return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));  // q + 128
  }
}

// Lanes 0-7 = v[a], lanes 8-15 = v[b].
inline __m512 pair_ps(const float* v, int32_t a, int32_t b) {
  return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(v[a]), _mm512_set1_ps(v[b]));
}

// cg[c]: the weight group of 32-chunk c (precomputed: no division in the loop). The min
// term sum_c mn[g(c)] * xs[c] (8 bits: mn = -128 s) rides in the same accumulator: xsv
// holds xs / 8 in each of its chunk's 8 lanes.
template <int MT, int BITS>
void tile_vnni(const int64_t K, const int32_t* cg, const uint8_t* qrow, const float* srow,
               const float* mrow, const QuantAct& a, int64_t m0, float* out) {
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t nc = K / 32;
  for (int64_t k0 = 0, c = 0; k0 < K; k0 += 64, c += 2) {
    const __m512i w = codes64<BITS>(qrow, k0);
    const __m512 sw = pair_ps(srow, cg[c], cg[c + 1]);
    const __m512 mw =
        BITS == 4 ? pair_ps(mrow, cg[c], cg[c + 1]) : _mm512_mul_ps(sw, _mm512_set1_ps(-128.f));
    for (int m = 0; m < MT; ++m) {
      const int64_t row = m0 + m;
      const __m512i xv = _mm512_loadu_si512(a.xq.data() + row * K + k0);
      const __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
      const __m512 dx = _mm512_loadu_ps(a.dxv.data() + (row * nc + c) * 8);
      const __m512 xs = _mm512_loadu_ps(a.xsv.data() + (row * nc + c) * 8);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(sw, dx), acc[m]);
      acc[m] = _mm512_fmadd_ps(mw, xs, acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

template <int BITS>
void run_vnni(const int64_t mt, const int64_t K, const int32_t* cg, const uint8_t* qrow,
              const float* srow, const float* mrow, const QuantAct& a, int64_t m0, float* out) {
  switch (mt) {
    case 1: return tile_vnni<1, BITS>(K, cg, qrow, srow, mrow, a, m0, out);
    case 2: return tile_vnni<2, BITS>(K, cg, qrow, srow, mrow, a, m0, out);
    case 3: return tile_vnni<3, BITS>(K, cg, qrow, srow, mrow, a, m0, out);
    default: return tile_vnni<4, BITS>(K, cg, qrow, srow, mrow, a, m0, out);
  }
}

template <int BITS, typename T>
void vnni_impl(const T* x, T* out, int64_t M, const torch::Tensor& q, const float* scale,
               const float* mn, int64_t N, int64_t K, int64_t G) {
  const QuantAct a = quantize_rows(x, M, K);
  const auto* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const int64_t row_bytes = BITS == 8 ? K : K / 2, ng = K / G;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(M * K, 1));
  std::vector<int32_t> cg(K / 32);  // 32-chunk -> its weight group
  for (int64_t c = 0; c < K / 32; ++c) cg[c] = static_cast<int32_t>(c * 32 / G);
  at::parallel_for(0, N, grain, [&](int64_t b, int64_t e) {
    float tmp[kTileV];
    for (int64_t n = b; n < e; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += kTileV) {
        const int64_t mt = std::min<int64_t>(kTileV, M - m0);
        run_vnni<BITS>(mt, K, cg.data(), qp + n * row_bytes, scale + n * ng,
                       mn != nullptr ? mn + n * ng : nullptr, a, m0, tmp);
        for (int64_t i = 0; i < mt; ++i) out[(m0 + i) * N + n] = static_cast<T>(tmp[i]);
      }
  });
}
#endif

}  // namespace

bool quant_linear_vnni_ok(int64_t in_features, int64_t group, int64_t bits) {
#if defined(KVSTACK_AVX512) && defined(__AVX512VNNI__)
  return in_features % 64 == 0 && group % 32 == 0 && (bits == 4 || bits == 8);
#else
  (void)in_features, (void)group, (void)bits;
  return false;
#endif
}

torch::Tensor quant_linear_vnni(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                                std::optional<torch::Tensor> min, int64_t group, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous(), "q must be a contiguous matrix");
  const int64_t N = q.size(0), K = bits == 8 ? q.size(1) : 2 * q.size(1);
  TORCH_CHECK(quant_linear_vnni_ok(K, group, bits),
              "quant_linear_vnni needs AVX512-VNNI, in_features % 64 == 0, group % 32 == 0");
  TORCH_CHECK(K % group == 0 && scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() &&
                  scale.dim() == 2 && scale.size(0) == N && scale.size(1) == K / group,
              "scale must be float32 [N, K / group]");
  TORCH_CHECK(min.has_value() == (bits == 4), "min is given exactly for 4-bit weights");
  if (min.has_value())
    TORCH_CHECK(min->scalar_type() == torch::kFloat32 && min->is_contiguous() &&
                    min->sizes() == scale.sizes(),
                "min must be float32 shaped as scale");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, in_features]");
  x = x.contiguous();
  auto out = torch::empty({x.size(0), N}, x.options());
#if defined(KVSTACK_AVX512) && defined(__AVX512VNNI__)
  const float* sp = scale.data_ptr<float>();
  const float* mp = min.has_value() ? min->data_ptr<float>() : nullptr;
  const int64_t M = x.size(0);
  if (x.scalar_type() == torch::kBFloat16) {
    auto* xp = x.data_ptr<c10::BFloat16>();
    auto* op = out.data_ptr<c10::BFloat16>();
    bits == 4 ? vnni_impl<4>(xp, op, M, q, sp, mp, N, K, group)
              : vnni_impl<8>(xp, op, M, q, sp, mp, N, K, group);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "bfloat16 or float32 activations");
    auto* xp = x.data_ptr<float>();
    auto* op = out.data_ptr<float>();
    bits == 4 ? vnni_impl<4>(xp, op, M, q, sp, mp, N, K, group)
              : vnni_impl<8>(xp, op, M, q, sp, mp, N, K, group);
  }
#endif
  return out;
}
