// How the codec attention kernel (paged_attention_codecs.cpp) reads one K or V row of
// each KV codec in place from its block storage (kv/codecs/: one file per codec).
//
// Row r of a layer is token i of block b for KV head h: r = (b * BS + i) * KVH + h.
// Codes of row r start at byte r * code_bytes; per-row bf16 parameters at r * k_cols
// (k) or r * v_cols (v). KIVI keys are the exception: their (scale, zero) pairs are per
// block and channel, [NB, KVH, HD, 2], and a row reads the tokens of its own block (the
// block of its last context token) at full precision from the residual pool in the
// activation dtype when residual_of[b] >= 0 (the blocks the step wrote: the one still
// filling, or one the step filled and quantized), every earlier block from its codes.
//
// Two readers: row_scalar (any ISA, any head_dim; fully dequantized, natural order) and,
// with AVX-512, row64 (head_dim 64, four vectors of 16 channels; natural order, except
// for the packed codecs: see to_order).
// row64 may leave a per-row factor out of the vectors (int8 and fp8 scales): the caller
// multiplies the score (K) or the probability (V) by it once instead of every channel.
#pragma once
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstring>
#include <optional>
#include <string>

#include "simd.h"

enum class Codec : int { kBF16, kInt8, kFP8E4M3, kFP8E5M2, kInt4, kKivi2 };

struct CodecView {
  Codec kind;
  const uint8_t* kc;  // K codes of the layer
  const uint8_t* vc;
  const c10::BFloat16* kp;  // K parameters
  const c10::BFloat16* vp;
  int64_t code_bytes;  // bytes of one row's codes
  int64_t k_cols, v_cols;  // bf16 parameters per row
  int64_t group;  // channels per (scale, zero) pair: int4 and KIVI values
  const void* res_k;  // KIVI residual pool [cap, BS, KVH, HD] in the activation dtype
  const void* res_v;
  bool res_float;  // residual pool is float32 (else bfloat16)
  const int64_t* residual_of;  // [NB] residual slot of each block, -1 if none; or null
                               // (read only for a row's own block)
  const float* signs;  // rotated4: [HD] signs of the rotation (codes hold x R); or null
  int64_t KVH, BS, HD;
  int64_t span = 1;  // KV heads whose rows a token's prefetch takes (prefetch_item_heads)

  int64_t residual(int64_t blk) const { return residual_of ? residual_of[blk] : -1; }
};

// Rows r + 1 .. r + cv.span - 1 (the same token's rows of the work item's other KV heads,
// adjacent in [block, token, kv head, bytes]), K and V codes and parameters, into L2: the
// item's first head streams each token's rows of all its heads as one span, and the
// heads after it read theirs from L2 (paged_attention_codecs.cpp; decode_split.h's
// kv_heads_per_item).
static inline void prefetch_item_heads(const CodecView& cv, int64_t r) {
  if (cv.span <= 1) return;
  auto lines = [](const void* base, int64_t lo, int64_t hi) {
    const char* p = static_cast<const char*>(base);
    for (int64_t b = lo & ~int64_t{63}; b < hi; b += 64) __builtin_prefetch(p + b, 0, 2);
  };
  const int64_t lo = (r + 1) * cv.code_bytes, hi = (r + cv.span) * cv.code_bytes;
  lines(cv.kc, lo, hi);
  lines(cv.vc, lo, hi);
  if (cv.k_cols) lines(cv.kp, (r + 1) * cv.k_cols * 2, (r + cv.span) * cv.k_cols * 2);
  if (cv.v_cols) lines(cv.vp, (r + 1) * cv.v_cols * 2, (r + cv.span) * cv.v_cols * 2);
}

static inline Codec codec_kind(const std::string& kind) {
  if (kind == "bf16") return Codec::kBF16;
  if (kind == "int8") return Codec::kInt8;
  if (kind == "fp8_e4m3") return Codec::kFP8E4M3;
  if (kind == "fp8_e5m2") return Codec::kFP8E5M2;
  if (kind == "int4") return Codec::kInt4;
  if (kind == "kivi2") return Codec::kKivi2;
  TORCH_CHECK(false, "unknown codec layout '", kind, "'");
  return Codec::kInt8;  // not reached
}

// Checks the bytes of one row's codes and the bf16 parameters K and V carry (group > 0).
static inline void check_codec_tensors(Codec kind, int64_t group, int64_t HD, const torch::Tensor& kc,
                         const torch::Tensor& kp, const torch::Tensor& vp) {
  TORCH_CHECK(kc.dim() == 4, "codes must be [num_blocks, block_size, kv_heads, bytes]");
  const int64_t want = kind == Codec::kBF16 ? 2 * HD
                       : kind == Codec::kInt4 ? HD / 2
                       : kind == Codec::kKivi2 ? HD / 4
                                               : HD;
  TORCH_CHECK(kc.size(3) * kc.element_size() == want, "codes of ", kc.size(3) * kc.element_size(),
              " bytes per row, expected ", want);
  if (kind == Codec::kBF16) return;
  TORCH_CHECK(kp.scalar_type() == torch::kBFloat16 && vp.scalar_type() == torch::kBFloat16,
              "codec parameters must be bfloat16");
  if (kind == Codec::kInt4 || kind == Codec::kKivi2)
    TORCH_CHECK(group > 0 && HD % group == 0, "group ", group, " does not divide ", HD);
  const int64_t nb = kc.size(0), bs = kc.size(1), kvh = kc.size(2);
  const int64_t per_row = kind == Codec::kInt4 ? 2 * HD / group : 1;
  if (kind == Codec::kKivi2) {
    TORCH_CHECK(kp.numel() == nb * kvh * HD * 2, "kivi2 key parameters must be [NB, KVH, HD, 2]");
    TORCH_CHECK(vp.numel() == nb * bs * kvh * 2 * HD / group, "kivi2 value parameters size");
  } else {
    TORCH_CHECK(kp.numel() == nb * bs * kvh * per_row && vp.numel() == kp.numel(),
                "codec parameters must be [NB, BS, KVH, ", per_row, "]");
  }
}

static inline float bf(c10::BFloat16 x) { return static_cast<float>(x); }

// Row index (token-major: block, token, head) of tokens t0 .. t0 + n - 1 of KV head kh
// through one sequence's block table. The block and the slot in it are stepped, not
// divided out per token: a 64-bit division a token was ~20 % of fp8's scoring pass
// (perf on the Zen 5, batch 32 x 2,048).
static inline void partition_rows(const CodecView& cv, const int64_t* table, int64_t kh,
                                  int64_t t0, int64_t n, int64_t* rows) {
  for (int64_t j = 0, b = t0 / cv.BS, i = t0 % cv.BS; j < n; ++j) {
    rows[j] = (table[b] * cv.BS + i) * cv.KVH + kh;
    if (++i == cv.BS) i = 0, ++b;
  }
}

// Attaches kivi2's residual pool (res_k / res_v [cap, BS, KVH, HD], float32 or bf16, and
// residual_of [NB]) to cv after checking it; res_t keeps the int64 copy of residual_of
// alive. Returns cap (0 without a pool).
static inline int64_t attach_residual(CodecView& cv, int64_t NB,
                                      const std::optional<torch::Tensor>& res_k,
                                      const std::optional<torch::Tensor>& res_v,
                                      const std::optional<torch::Tensor>& residual_of,
                                      torch::Tensor& res_t) {
  if (!residual_of.has_value()) return 0;
  TORCH_CHECK(cv.kind == Codec::kKivi2 && res_k.has_value() && res_v.has_value(),
              "a residual pool needs kivi2 and res_k, res_v");
  res_t = residual_of->to(torch::kInt64).contiguous();
  TORCH_CHECK(res_t.numel() == NB, "one residual slot per block");
  TORCH_CHECK(res_k->is_contiguous() && res_v->is_contiguous() && res_k->sizes() == res_v->sizes() &&
                  res_k->dim() == 4 && res_k->size(1) == cv.BS && res_k->size(2) == cv.KVH &&
                  res_k->size(3) == cv.HD,
              "residual pool must be [cap, BS, KVH, HD]");
  TORCH_CHECK(res_k->scalar_type() == torch::kFloat32 || res_k->scalar_type() == torch::kBFloat16,
              "residual pool must be float32 or bfloat16");
  TORCH_CHECK(res_v->scalar_type() == res_k->scalar_type(), "res_k and res_v differ in dtype");
  cv.res_k = res_k->data_ptr();
  cv.res_v = res_v->data_ptr();
  cv.res_float = res_k->scalar_type() == torch::kFloat32;
  cv.residual_of = res_t.data_ptr<int64_t>();
  return res_k->size(0);
}

// A per-token codec's storage (codec_write.cpp, codec_gather.cpp): K/V codes [NB, BS, KVH,
// bytes] and bf16 parameters [NB, BS, KVH, cols]; int4 group 0 means the whole head.
struct PerTokenLayout {
  int64_t group, code_bytes, cols;
};
static inline PerTokenLayout check_per_token_storage(Codec c, int64_t group, int64_t HD,
                                                     const torch::Tensor& kc, const torch::Tensor& vc,
                                                     const torch::Tensor& kp, const torch::Tensor& vp,
                                                     const std::optional<torch::Tensor>& signs) {
  TORCH_CHECK(c != Codec::kBF16 && c != Codec::kKivi2, "not a per-token codec");
  if (c == Codec::kInt4 && group == 0) group = HD;
  TORCH_CHECK(HD > 0 && (c != Codec::kInt4 || (group > 0 && HD % group == 0 && group % 2 == 0)),
              "int4 group ", group, " must be even and divide head_dim ", HD);
  for (const auto* t : {&kc, &vc, &kp, &vp})
    TORCH_CHECK(t->is_contiguous() && t->dim() == 4, "codes and parameters must be contiguous [NB, BS, KVH, cols]");
  TORCH_CHECK(kc.sizes() == vc.sizes() && kp.sizes() == vp.sizes(), "K and V storage differ in shape");
  const int64_t code_bytes = kc.size(3) * kc.element_size();
  TORCH_CHECK(code_bytes == (c == Codec::kInt4 ? HD / 2 : HD), "codes of ", code_bytes,
              " bytes per row do not fit head_dim ", HD);
  const int64_t cols = c == Codec::kInt4 ? 2 * HD / group : 1;
  TORCH_CHECK(kp.scalar_type() == torch::kBFloat16 && kp.size(3) == cols,
              "parameters must be bfloat16 with ", cols, " per row");
  TORCH_CHECK(!signs.has_value() || (c == Codec::kInt4 && signs->numel() == HD && (HD & (HD - 1)) == 0),
              "rotation_signs need the int4 layout, [head_dim] with head_dim a power of two");
  return {group, code_bytes, cols};
}

// rotated4's rotation R = diag(signs) H / sqrt(n) (H Sylvester's
// Hadamard matrix, symmetric), applied as a fast Walsh-Hadamard transform: forward
// x R = H (x ⊙ signs) / sqrt(n), inverse x R^T = (H x / sqrt(n)) ⊙ signs. n log n adds
// in a fixed order, so a row's result never depends on how many rows run with it.
static inline void fwht(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}
static inline void rotate(float* x, const float* signs, int64_t n, bool inverse) {
  const float norm = 1.f / std::sqrt(static_cast<float>(n));
  if (!inverse)
    for (int64_t i = 0; i < n; ++i) x[i] *= signs[i];
  fwht(x, n);
  for (int64_t i = 0; i < n; ++i) x[i] *= inverse ? norm * signs[i] : norm;
}

// Token i of residual slot rs, head kh, to float.
static inline void residual_row_scalar(const CodecView& c, bool is_k, int64_t rs, int64_t i,
                                       int64_t kh, float* dst) {
  const int64_t off = ((rs * c.BS + i) * c.KVH + kh) * c.HD;
  const void* base = is_k ? c.res_k : c.res_v;
  for (int64_t d = 0; d < c.HD; ++d)
    dst[d] = c.res_float ? static_cast<const float*>(base)[off + d]
                         : bf(static_cast<const c10::BFloat16*>(base)[off + d]);
}

// The dequantized row (K if is_k, else V) of token i of block blk, head kh: dst[HD];
// own: blk is the reading row's own block (its residual rows, if any, are read).
// Equal to the codec's PyTorch decode in float32 (same products, no rounding after).
static void row_scalar(const CodecView& c, bool is_k, int64_t blk, int64_t i, int64_t kh,
                       bool own, float* dst) {
  const int64_t HD = c.HD, r = (blk * c.BS + i) * c.KVH + kh;
  const int64_t rs = own ? c.residual(blk) : -1;
  if (rs >= 0) return residual_row_scalar(c, is_k, rs, i, kh, dst);
  const uint8_t* code = (is_k ? c.kc : c.vc) + r * c.code_bytes;
  const c10::BFloat16* p = is_k ? c.kp + r * c.k_cols : c.vp + r * c.v_cols;
  switch (c.kind) {
    case Codec::kBF16:
      for (int64_t d = 0; d < HD; ++d) dst[d] = bf(reinterpret_cast<const c10::BFloat16*>(code)[d]);
      return;
    case Codec::kInt8:
      for (int64_t d = 0; d < HD; ++d) dst[d] = static_cast<float>(static_cast<int8_t>(code[d])) * bf(p[0]);
      return;
    case Codec::kFP8E4M3:
      for (int64_t d = 0; d < HD; ++d)
        dst[d] = static_cast<float>(c10::Float8_e4m3fn(code[d], c10::Float8_e4m3fn::from_bits())) * bf(p[0]);
      return;
    case Codec::kFP8E5M2:
      for (int64_t d = 0; d < HD; ++d)
        dst[d] = static_cast<float>(c10::Float8_e5m2(code[d], c10::Float8_e5m2::from_bits())) * bf(p[0]);
      return;
    case Codec::kInt4:
      for (int64_t d = 0; d < HD; ++d) {
        const int64_t g = d / c.group;
        const float q = static_cast<float>((code[d / 2] >> (4 * (d & 1))) & 15);
        dst[d] = q * bf(p[2 * g]) + bf(p[2 * g + 1]);
      }
      return;
    case Codec::kKivi2: {
      const c10::BFloat16* kb = c.kp + (blk * c.KVH + kh) * HD * 2;  // per channel
      for (int64_t d = 0; d < HD; ++d) {
        const float q = static_cast<float>((code[d / 4] >> (2 * (d & 3))) & 3);
        if (is_k) {
          dst[d] = q * bf(kb[2 * d]) + bf(kb[2 * d + 1]);
        } else {
          const int64_t g = d / c.group;
          dst[d] = q * bf(p[2 * g]) + bf(p[2 * g + 1]);
        }
      }
      return;
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVSTACK_CODEC_AVX512 1
// 32 e4m3 codes times 2^-8, exactly, as two vectors: each code sign-extended to 16
// bits and shifted left by 7 is the fp16 of value / 2^8 (exponent bias 15 instead of 7;
// subnormals map to fp16 subnormals, which vcvtph2ps converts exactly) once bit 14, the
// sign's copy, is cleared.
static inline void e4m3x32_div256(const uint8_t* p, __m512* lo, __m512* hi) {
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i h = _mm512_and_si512(_mm512_slli_epi16(w, 7), _mm512_set1_epi16(static_cast<short>(0xBFFF)));
  *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

// 32 e5m2 codes: an e5m2 byte is the upper byte of the fp16 of the same value.
static inline void e5m2x32(const uint8_t* p, __m512* lo, __m512* hi) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i h = _mm512_slli_epi16(w, 8);
  *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

static inline __m512 bcast(c10::BFloat16 x) { return _mm512_set1_ps(bf(x)); }

// Token i of residual slot rs, head kh (head_dim 64), as four vectors.
static inline void residual_row64(const CodecView& c, bool is_k, int64_t rs, int64_t i,
                                  int64_t kh, __m512* x) {
  const int64_t off = ((rs * c.BS + i) * c.KVH + kh) * 64;
  const void* base = is_k ? c.res_k : c.res_v;
  for (int k = 0; k < 4; ++k)
    x[k] = c.res_float ? _mm512_loadu_ps(static_cast<const float*>(base) + off + 16 * k)
                       : load16(static_cast<const c10::BFloat16*>(base) + off + 16 * k);
}

// Channel order of row64's four vectors: natural, except for the packed codecs, where it
// is the order one load unpacks at once. int4: vectors 2h and 2h + 1 hold the even and
// the odd channels of 32h .. 32h + 31 (low and high nibbles of 16 bytes); kivi2: vector
// j, lane l holds channel 4l + j (the j-th 2-bit field of byte l). The query (and KIVI's
// per-channel scales, and its residual rows) go into that order once, the P.V sums come
// back once per task: a permutation of channels changes no dot product.
template <Codec C>
static inline void to_order(__m512* v) {
  if constexpr (C == Codec::kInt4) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int h = 0; h < 2; ++h) {
      const __m512 a = v[2 * h], b = v[2 * h + 1];
      v[2 * h] = _mm512_permutex2var_ps(a, even, b);
      v[2 * h + 1] = _mm512_permutex2var_ps(a, odd, b);
    }
  } else if constexpr (C == Codec::kKivi2) {  // lanes 0-7 from v[0], v[1]; 8-15 from v[2], v[3]
    __m512 out[4];
    for (int j = 0; j < 4; ++j) {
      const __m512i idx = _mm512_setr_epi32(j, 4 + j, 8 + j, 12 + j, 16 + j, 20 + j, 24 + j, 28 + j,
                                            j, 4 + j, 8 + j, 12 + j, 16 + j, 20 + j, 24 + j, 28 + j);
      out[j] = _mm512_mask_blend_ps(0xFF00, _mm512_permutex2var_ps(v[0], idx, v[1]),
                                    _mm512_permutex2var_ps(v[2], idx, v[3]));
    }
    for (int j = 0; j < 4; ++j) v[j] = out[j];
  }
}

template <Codec C>
static inline void from_order(__m512* v) {
  if constexpr (C == Codec::kInt4) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int h = 0; h < 2; ++h) {
      const __m512 a = v[2 * h], b = v[2 * h + 1];
      v[2 * h] = _mm512_permutex2var_ps(a, lo, b);
      v[2 * h + 1] = _mm512_permutex2var_ps(a, hi, b);
    }
  } else if constexpr (C == Codec::kKivi2) {
    alignas(64) float buf[64], nat[64];
    for (int j = 0; j < 4; ++j) _mm512_store_ps(buf + 16 * j, v[j]);
    for (int c = 0; c < 64; ++c) nat[c] = buf[16 * (c % 4) + c / 4];
    for (int k = 0; k < 4; ++k) v[k] = _mm512_load_ps(nat + 16 * k);
  }
}

// KIVI keys of block blk, head kh: k[t][ch] = code * s[ch] + z[ch], the per-channel
// (scale, zero) pairs of the block in to_order's order, loaded once per block.
struct KiviKeys {
  __m512 s[4], z[4];
  void load(const CodecView& c, int64_t blk, int64_t kh) {
    const uint32_t* sz = reinterpret_cast<const uint32_t*>(c.kp + (blk * c.KVH + kh) * 128);
    for (int k = 0; k < 4; ++k) {  // 16 (scale, zero) bf16 pairs = 16 uint32
      const __m512i w = _mm512_loadu_si512(sz + 16 * k);
      s[k] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      z[k] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(0xFFFF0000)));
    }
    to_order<Codec::kKivi2>(s);
    to_order<Codec::kKivi2>(z);
  }
};

// The float32 bits of 64 e4m3 values times 2^-120: each code sign-extended to 32 bits and
// shifted so its exponent and mantissa fields land at the bottom of float32's (bias 127
// instead of 7), the sign's copy at bit 27 cleared. Subnormal codes become float32
// subnormals of the same scaled value: exact, as the fp16 route (e4m3x32_div256) is, in
// three integer instructions a 16 codes instead of a widening, two shifts and two
// vcvtph2ps a 32; the NaN code reads as 480 on both. The P.V pass takes V
// rows this way: its products (p * 2^120 s) * (v * 2^-120) are p * s * v rounded as the
// fp16 route's (p * 256 s) * (v / 256) are, power-of-two factors apart. K rows keep the
// fp16 route (codec_scores' float dot products would sum products near float32's
// smallest normal). Measured on the 2-core Zen 5 (2026-12-05, batch 32 x 2,048, whole
// decode_team step, in-process A/B, 30 steps a variant): 0.982x (the same for e5m2's
// own route gave 0.998x and would read its inf / NaN codes as numbers: not taken).
static inline void e4m3_row64_scaled(const uint8_t* code, __m512* x) {
  const __m512i keep = _mm512_set1_epi32(static_cast<int>(0x87F00000u));
  for (int k = 0; k < 4; ++k) {
    const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code + 16 * k)));
    x[k] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(w, 20), keep));
  }
}
// A row scale below this keeps the factor 2^120 s finite with room to spare.
constexpr float kFp8ScaledMax = 0x1p7f;

// Row r of codec C (head_dim 64) as four vectors; returns the factor left out of them.
// KIVI keys take their block's per-channel parameters from kk.
template <Codec C>
static inline float row64(const CodecView& c, bool is_k, int64_t r, __m512* x,
                          const KiviKeys* kk = nullptr) {
  const uint8_t* code = (is_k ? c.kc : c.vc) + r * c.code_bytes;
  const c10::BFloat16* p = is_k ? c.kp + r * c.k_cols : c.vp + r * c.v_cols;
  if constexpr (C == Codec::kBF16) {
    for (int k = 0; k < 4; ++k) x[k] = load16(reinterpret_cast<const c10::BFloat16*>(code) + 16 * k);
    return 1.f;
  } else if constexpr (C == Codec::kInt8) {
    for (int k = 0; k < 4; ++k)
      x[k] = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code + 16 * k))));
    return bf(p[0]);
  } else if constexpr (C == Codec::kFP8E4M3) {
    if (!is_k && bf(p[0]) < kFp8ScaledMax) {  // V rows (K: codec_fp8.h or below)
      e4m3_row64_scaled(code, x);
      return 0x1p120f * bf(p[0]);
    }
    e4m3x32_div256(code, x, x + 1);
    e4m3x32_div256(code + 32, x + 2, x + 3);
    return 256.f * bf(p[0]);
  } else if constexpr (C == Codec::kFP8E5M2) {
    e5m2x32(code, x, x + 1);
    e5m2x32(code + 32, x + 2, x + 3);
    return bf(p[0]);
  } else if constexpr (C == Codec::kInt4) {  // in to_order's order
    for (int h = 0; h < 2; ++h) {
      const __m512i b = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(code + 16 * h)));
      const int64_t g = 32 * h / c.group;
      const __m512 s = bcast(p[2 * g]), z = bcast(p[2 * g + 1]);
      x[2 * h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), s, z);
      x[2 * h + 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), s, z);
    }
    return 1.f;
  } else {  // kKivi2, in to_order's order: lanes 0-7 are channels < 32 (value group 0)
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code)));
    for (int j = 0; j < 4; ++j)
      x[j] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(b, _mm512_set1_epi32(2 * j)),
                                                 _mm512_set1_epi32(3)));
    if (is_k) {
      for (int j = 0; j < 4; ++j) x[j] = _mm512_fmadd_ps(x[j], kk->s[j], kk->z[j]);
      return 1.f;
    }
    const __m512 s = _mm512_mask_blend_ps(0xFF00, bcast(p[0]), bcast(p[2]));
    const __m512 z = _mm512_mask_blend_ps(0xFF00, bcast(p[1]), bcast(p[3]));
    for (int j = 0; j < 4; ++j) x[j] = _mm512_fmadd_ps(x[j], s, z);
    return 1.f;
  }
}

#endif
