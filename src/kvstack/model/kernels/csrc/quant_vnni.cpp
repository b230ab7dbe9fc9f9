// Weight-only quantized linears with int8 activations and integer dot products (kvstack):
// the decode path for bf16 activations when the CPU has AVX512-VNNI (vpdpbusd, 64 bytes at
// a time) or, without AVX-512, AVX2 (vpmaddubsw + vpmaddwd, 32 bytes: llama.cpp's AVX2
// arithmetic, as on AMD Zen 2 / 3).
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
// 8-bit groups of 16 (Q6_K): the 4-lane int32 sums of a 32-chunk never straddle its two
// 16-halves, so each takes its own group's scale (and, AVX-512, its own offset term).
// Needs K % 64 == 0 and group % 32 == 0 (or 16, 8 bits); quant_linear_vnni_ok says whether
// it applies.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "kvstack_ops.h"
#include "quant_act.h"
#include "simd.h"

namespace {

constexpr int kTileV = 4;  // rows of x per register tile

#if defined(KVSTACK_AVX512) && defined(__AVX512VNNI__)
#define KVSTACK_INT8_DOT_AVX512 1  // vpdpbusd
#elif defined(KVSTACK_AVX2) && !defined(KVSTACK_AVX512)
#define KVSTACK_INT8_DOT_AVX2 1  // vpmaddubsw + vpmaddwd
#endif

struct QuantAct {  // one call's quantized activations
  std::vector<int8_t> xq;  // [M, K]
  std::vector<float> dx;   // [M, K/32]: chunk scales
  std::vector<float> xs;   // [M, K/32]: dx * sum(xq) of each chunk
  std::vector<float> dxv;  // [M, K/64, 16]: dx of chunk 2p in lanes 0-7, of 2p+1 in 8-15
  std::vector<float> xsv;  // [M, K/64, 16]: xs / 8 laid out as dxv (8 lanes sum to xs)
  std::vector<float> dxq;  // [M, K/32, 4]: dx of each chunk in 4 lanes (AVX2, 4 bits)
  std::vector<float> xhv;  // [M, K/64, 16]: dx * sum(xq) of each 16-half / 4 in its 4 lanes
};

template <typename T>
QuantAct quantize_rows(const T* x, int64_t M, int64_t K) {
  const int64_t chunks = M * K / 32;  // rows are whole chunks: K % 64 == 0
  QuantAct a{std::vector<int8_t>(M * K), std::vector<float>(chunks), std::vector<float>(chunks),
             std::vector<float>(8 * chunks), std::vector<float>(8 * chunks),
             std::vector<float>(4 * chunks), std::vector<float>(8 * chunks)};
  for (int64_t i = 0; i < chunks; ++i) {
    const auto [d, sum, lo] = kvstack_quant::quantize_chunk(x + 32 * i, a.xq.data() + 32 * i);
    a.dx[i] = d;
    a.xs[i] = d * static_cast<float>(sum);
    std::fill_n(a.dxv.begin() + 8 * i, 8, d);  // chunk i -> 8 lanes of its pair's vector
    std::fill_n(a.xsv.begin() + 8 * i, 8, a.xs[i] * 0.125f);  // exact: a power of two
    std::fill_n(a.dxq.begin() + 4 * i, 4, d);
    std::fill_n(a.xhv.begin() + 8 * i, 4, d * static_cast<float>(lo) * 0.25f);
    std::fill_n(a.xhv.begin() + 8 * i + 4, 4, d * static_cast<float>(sum - lo) * 0.25f);
  }
  return a;
}

#if defined(KVSTACK_INT8_DOT_AVX512)
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

// Lanes 4i .. 4i+3 = v[a + h * (i & 1)] for i < 2, v[b + h * (i & 1)] for i >= 2: the scales
// of the 16-halves of chunks c (group a) and c+1 (group b); h = 1 for groups of 16.
inline __m512 quad_ps(const float* v, int32_t a, int32_t b, int32_t h) {
  const __m512 lo = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(v[a]), _mm512_set1_ps(v[a + h]));
  const __m512 hi = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(v[b]), _mm512_set1_ps(v[b + h]));
  return _mm512_mask_blend_ps(0xFF00, lo, hi);
}

// cg[c]: the weight group of 32-chunk c (precomputed: no division in the loop). The min
// term sum_c mn[g(c)] * xs[c] (8 bits: mn = -128 s) rides in the same accumulator: xsv
// holds xs / 8 in each of its chunk's 8 lanes.
// h16 (8 bits only): groups of 16, each 16-half of a chunk with its own scale (quad_ps)
// and offset term (xhv, the halves' sums); 4-lane int32 sums never straddle two halves.
template <int MT, int BITS>
void tile_vnni(const int64_t K, const int32_t* cg, const uint8_t* qrow, const float* srow,
               const float* mrow, const QuantAct& a, int64_t m0, float* out, int32_t h16) {
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t nc = K / 32;
  const float* xsrc = h16 != 0 ? a.xhv.data() : a.xsv.data();
  for (int64_t k0 = 0, c = 0; k0 < K; k0 += 64, c += 2) {
    const __m512i w = codes64<BITS>(qrow, k0);
    const __m512 sw =
        BITS == 4 ? pair_ps(srow, cg[c], cg[c + 1]) : quad_ps(srow, cg[c], cg[c + 1], h16);
    const __m512 mw =
        BITS == 4 ? pair_ps(mrow, cg[c], cg[c + 1]) : _mm512_mul_ps(sw, _mm512_set1_ps(-128.f));
    for (int m = 0; m < MT; ++m) {
      const int64_t row = m0 + m;
      const __m512i xv = _mm512_loadu_si512(a.xq.data() + row * K + k0);
      const __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
      const __m512 dx = _mm512_loadu_ps(a.dxv.data() + (row * nc + c) * 8);
      const __m512 xs = _mm512_loadu_ps(xsrc + (row * nc + c) * 8);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(sw, dx), acc[m]);
      acc[m] = _mm512_fmadd_ps(mw, xs, acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

#elif defined(KVSTACK_INT8_DOT_AVX2)
// sum_j w_j x_j of a 32-chunk of signed 8-bit codes in 8 int32 lanes, as float. vpmaddubsw
// multiplies unsigned by signed bytes and adds pairs in int16 (saturating), so the sign
// moves to x (llama.cpp's AVX2 trick): |w| * sign(x, w), where |w| <= 128 as an unsigned
// byte and |x| <= 127, so a pair is <= 2 * 128 * 127 < 2^15: never saturates.
inline __m256 dot32_s8(__m256i w_abs, __m256i w, __m256i x) {
  const __m256i p = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

// sum_c mn[g(c)] * xs[c] of one row (4 bits: the min term; gathers the chunks' mins
// unless the groups are the chunks, G == 32).
inline float min_term(int64_t nc, const int32_t* cg, bool g32, const float* mrow,
                      const float* xs) {
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= nc; c += 8) {
    const __m256 mv = g32 ? _mm256_loadu_ps(mrow + c)
                          : _mm256_i32gather_ps(mrow, _mm256_loadu_si256(
                                reinterpret_cast<const __m256i*>(cg + c)), 4);
    acc = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + c), acc);
  }
  float sum = hsum8(acc);
  for (; c < nc; ++c) sum += mrow[cg[c]] * xs[c];
  return sum;
}

// 4 bits: llama.cpp's nibble order lets one 32-byte load feed two chunks. Bytes 0-15 are
// chunk c (low nibbles its values 0..15, high nibbles 16..31), bytes 16-31 chunk c+1, so
//   lo = [c: 0..15 | c+1: 0..15]    hi = [c: 16..31 | c+1: 16..31]    (128-bit lanes)
// and the activations are stored in the same order (to_nibble_order). The two products'
// int16 pairs add without saturating (|pair| <= 2 * 15 * 127, two of them < 2^15); after
// vpmaddwd, lanes 0-3 hold chunk c and 4-7 chunk c+1, scaled by [s_c dx_c x4, s_c+1 dx_c+1 x4].
template <int MT>
void tile_nibbles(const int64_t K, const int32_t* cg, const uint8_t* qrow, const float* srow,
                  const float* mrow, const QuantAct& a, int64_t m0, float* out) {
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  const int64_t nc = K / 32;
  const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int64_t k0 = 0, c = 0; k0 < K; k0 += 64, c += 2) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qrow + k0 / 2));
    const __m256i lo = _mm256_and_si256(v, m4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    const __m256 sp = _mm256_blend_ps(_mm256_broadcast_ss(srow + cg[c]),
                                      _mm256_broadcast_ss(srow + cg[c + 1]), 0xF0);
    for (int m = 0; m < MT; ++m) {
      const int8_t* xr = a.xq.data() + (m0 + m) * K + k0;
      const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
      const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32));
      const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb));
      const __m256 d = _mm256_mul_ps(sp, _mm256_loadu_ps(a.dxq.data() + ((m0 + m) * nc + c) * 4));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), d, acc[m]);
    }
  }
  const bool g32 = cg[nc - 1] == nc - 1;
  for (int m = 0; m < MT; ++m)
    out[m] = hsum8(acc[m]) + min_term(nc, cg, g32, mrow, a.xs.data() + (m0 + m) * nc);
}

// Activations of each 64-value chunk pair reordered [c: 0..15, c+1: 0..15, c: 16..31,
// c+1: 16..31] to match tile_nibbles' weight bytes (integer sums: the order is free).
inline void to_nibble_order(QuantAct& a) {
  for (size_t i = 0; i + 64 <= a.xq.size(); i += 64) {
    auto* p = reinterpret_cast<__m256i*>(a.xq.data() + i);
    const __m256i c0 = _mm256_loadu_si256(p), c1 = _mm256_loadu_si256(p + 1);
    _mm256_storeu_si256(p, _mm256_permute2x128_si256(c0, c1, 0x20));
    _mm256_storeu_si256(p + 1, _mm256_permute2x128_si256(c0, c1, 0x31));
  }
}

// 8 bits with AVX2 (K % 64 == 0: chunks in pairs, even / odd chunks in separate
// accumulators so that a row's FMAs do not wait on each other). The codes are signed
// here: no +128 offset, no min term; 4 bits go to tile_nibbles.
template <int MT, int BITS>
void tile_vnni(const int64_t K, const int32_t* cg, const uint8_t* qrow, const float* srow,
               const float* mrow, const QuantAct& a, int64_t m0, float* out, int32_t h16) {
  if constexpr (BITS == 4) {
    return tile_nibbles<MT>(K, cg, qrow, srow, mrow, a, m0, out);
  } else {
    __m256 acc0[MT], acc1[MT];
    for (int m = 0; m < MT; ++m) acc0[m] = acc1[m] = _mm256_setzero_ps();
    const int64_t nc = K / 32;
    const int8_t* xq = a.xq.data() + m0 * K;
    const float* dx = a.dx.data() + m0 * nc;
    for (int64_t k0 = 0, c = 0; k0 < K; k0 += 64, c += 2) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qrow + k0));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qrow + k0 + 32));
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
      // lanes 0-3 sum the chunk's first 16 codes, 4-7 its last 16: with groups of 16
      // (h16 = 1) each half takes its own group's scale
      const __m256 s0 = _mm256_blend_ps(_mm256_broadcast_ss(srow + cg[c]),
                                        _mm256_broadcast_ss(srow + cg[c] + h16), 0xF0);
      const __m256 s1 = _mm256_blend_ps(_mm256_broadcast_ss(srow + cg[c + 1]),
                                        _mm256_broadcast_ss(srow + cg[c + 1] + h16), 0xF0);
      for (int m = 0; m < MT; ++m) {
        const int8_t* xr = xq + m * K + k0;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32));
        acc0[m] = _mm256_fmadd_ps(dot32_s8(a0, w0, x0),
                                  _mm256_mul_ps(s0, _mm256_set1_ps(dx[m * nc + c])), acc0[m]);
        acc1[m] = _mm256_fmadd_ps(dot32_s8(a1, w1, x1),
                                  _mm256_mul_ps(s1, _mm256_set1_ps(dx[m * nc + c + 1])), acc1[m]);
      }
    }
    for (int m = 0; m < MT; ++m) out[m] = hsum8(_mm256_add_ps(acc0[m], acc1[m]));
  }
}
#endif

#if defined(KVSTACK_INT8_DOT_AVX512) || defined(KVSTACK_INT8_DOT_AVX2)
template <int BITS>
void run_vnni(const int64_t mt, const int64_t K, const int32_t* cg, const uint8_t* qrow,
              const float* srow, const float* mrow, const QuantAct& a, int64_t m0, float* out,
              int32_t h16) {
  switch (mt) {
    case 1: return tile_vnni<1, BITS>(K, cg, qrow, srow, mrow, a, m0, out, h16);
    case 2: return tile_vnni<2, BITS>(K, cg, qrow, srow, mrow, a, m0, out, h16);
    case 3: return tile_vnni<3, BITS>(K, cg, qrow, srow, mrow, a, m0, out, h16);
    default: return tile_vnni<4, BITS>(K, cg, qrow, srow, mrow, a, m0, out, h16);
  }
}

template <int BITS, typename T>
void vnni_impl(const T* x, T* out, int64_t M, const torch::Tensor& q, const float* scale,
               const float* mn, int64_t N, int64_t K, int64_t G) {
  QuantAct a = quantize_rows(x, M, K);
#if defined(KVSTACK_INT8_DOT_AVX2)
  if constexpr (BITS == 4) to_nibble_order(a);
#endif
  const auto* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const int64_t row_bytes = BITS == 8 ? K : K / 2, ng = K / G;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(M * K, 1));
  const int32_t h16 = G == 16 ? 1 : 0;  // 8 bits: a chunk's second half is the next group
  std::vector<int32_t> cg(K / 32);  // 32-chunk -> its weight group (of its first half)
  for (int64_t c = 0; c < K / 32; ++c) cg[c] = static_cast<int32_t>(c * 32 / G);
  at::parallel_for(0, N, grain, [&](int64_t b, int64_t e) {
    float tmp[kTileV];
    for (int64_t n = b; n < e; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += kTileV) {
        const int64_t mt = std::min<int64_t>(kTileV, M - m0);
        run_vnni<BITS>(mt, K, cg.data(), qp + n * row_bytes, scale + n * ng,
                       mn != nullptr ? mn + n * ng : nullptr, a, m0, tmp, h16);
        for (int64_t i = 0; i < mt; ++i) out[(m0 + i) * N + n] = static_cast<T>(tmp[i]);
      }
  });
}
#endif

}  // namespace

bool quant_linear_vnni_ok(int64_t in_features, int64_t group, int64_t bits) {
#if defined(KVSTACK_INT8_DOT_AVX512) || defined(KVSTACK_INT8_DOT_AVX2)
  return in_features % 64 == 0 &&
         (group % 32 == 0 ? bits == 4 || bits == 8 : group == 16 && bits == 8);
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
              "quant_linear_vnni needs AVX512-VNNI or AVX2 (without AVX-512), in_features % 64 == 0, "
              "group % 32 == 0 (or 16 for 8 bits)");
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
#if defined(KVSTACK_INT8_DOT_AVX512) || defined(KVSTACK_INT8_DOT_AVX2)
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
