// How the AVX2 decode kernel (decode_avx2.h) reads a K or V row: 8 channels at a time, in
// natural channel order, as float32, for the plain cache (bf16 / float32 rows) and each KV
// codec's storage (codec_rows.h describes the layouts; row_scalar is the reference these
// readers match, up to fused multiply-adds).
//
//   bf16     8 x 2 bytes, widened (bf16 is the upper half of a float32)
//   float32  8 x 4 bytes
//   int8     8 codes, sign-extended; the row's scale is left out (Row8::f)
//   fp8      8 codes: e4m3 sign-extended and shifted into an fp16 of value / 2^8 (the 2^8
//            goes into f), e5m2 the upper byte of the fp16 of the same value; F16C widens
//   int4     (slab4, 32 channels from 16 bytes) low / high nibbles interleaved back to
//            channel order, times the group's scale plus its zero
//   kivi2    2 bytes: the 2-bit fields of channels 8v .. 8v + 7; keys take the block's
//            per-channel (scale, zero) (KeyParams8), values the token's group pair
//
// kivi2 rows of a row's own block come from the residual pool at full precision instead
// (Row8::res, float32 or bf16).
#pragma once
#include <cstring>

#include "codec_rows.h"

#if defined(KVSTACK_AVX2) && !defined(__AVX512F__) && defined(__F16C__)
#define KVSTACK_CODEC_AVX2 1

// The row layouts the AVX2 reader takes (Codec, plus the float32 plain cache).
enum class Rd : int { kBF16, kF32, kInt8, kE4M3, kE5M2, kInt4, kKivi2 };

static inline Rd reader_of(Codec c) {
  switch (c) {
    case Codec::kBF16: return Rd::kBF16;
    case Codec::kInt8: return Rd::kInt8;
    case Codec::kFP8E4M3: return Rd::kE4M3;
    case Codec::kFP8E5M2: return Rd::kE5M2;
    case Codec::kInt4: return Rd::kInt4;
    case Codec::kKivi2: return Rd::kKivi2;
  }
  return Rd::kBF16;  // not reached
}

// One row as the readers take it: its codes, its parameters, or its residual row, and the
// factor left out of its channels (multiplies a score or a probability once).
struct Row8 {
  const uint8_t* code;
  const c10::BFloat16* p;
  const float* ksz;  // kivi2 keys: the block's scales [HD] then zeros [HD]
  const void* res;  // residual row (kivi2), or null
  float f;
};

// A kivi2 block's per-channel key (scale, zero) pairs as two float rows.
struct KeyParams8 {
  alignas(32) float sz[2][256];
  void load(const CodecView& c, int64_t blk, int64_t kh) {
    const c10::BFloat16* p = c.kp + (blk * c.KVH + kh) * c.HD * 2;
    for (int64_t d = 0; d < c.HD; ++d) {
      sz[0][d] = bf(p[2 * d]);
      sz[1][d] = bf(p[2 * d + 1]);
    }
  }
};

// Row r (K if is_k) of layout R, or the residual row at element offset res (>= 0).
template <Rd R>
static inline Row8 make_row8(const CodecView& c, bool is_k, int64_t r, int64_t res,
                             const KeyParams8* kk) {
  if (res >= 0) {
    const void* base = is_k ? c.res_k : c.res_v;
    const void* row = c.res_float ? static_cast<const void*>(static_cast<const float*>(base) + res)
                                  : static_cast<const void*>(static_cast<const c10::BFloat16*>(base) + res);
    return {nullptr, nullptr, nullptr, row, 1.f};
  }
  const uint8_t* code = (is_k ? c.kc : c.vc) + r * c.code_bytes;
  const c10::BFloat16* p = is_k ? c.kp + r * c.k_cols : c.vp + r * c.v_cols;
  float f = 1.f;
  if constexpr (R == Rd::kInt8 || R == Rd::kE5M2) f = bf(p[0]);
  if constexpr (R == Rd::kE4M3) f = 256.f * bf(p[0]);
  return {code, p, kk ? &kk->sz[0][0] : nullptr, nullptr, f};
}

// log2 of the channels per (scale, zero) pair: decode_avx2 takes groups that divide a
// head_dim of 64 / 128 / 256 only, so a power of two (a shift, not a 64-bit division per
// chunk: that division took ~12 % of int4's decode attention on a Zen 3).
static inline int group_shift(const CodecView& c) {
  return __builtin_ctzll(static_cast<uint64_t>(c.group));
}

static inline __m256 widen8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }

// Channels 8v .. 8v + 7 of row x (without its factor x.f).
template <Rd R>
static inline __m256 chunk8(const CodecView& c, const Row8& x, int64_t v) {
  if (x.res)
    return c.res_float ? _mm256_loadu_ps(static_cast<const float*>(x.res) + 8 * v)
                       : load8(static_cast<const c10::BFloat16*>(x.res) + 8 * v);
  if constexpr (R == Rd::kBF16) {
    return load8(reinterpret_cast<const c10::BFloat16*>(x.code) + 8 * v);
  } else if constexpr (R == Rd::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(x.code) + 8 * v);
  } else if constexpr (R == Rd::kInt8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(x.code + 8 * v));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  } else if constexpr (R == Rd::kE4M3) {  // fp16 of value / 2^8 (codec_rows.h e4m3x32_div256)
    const __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x.code + 8 * v)));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<short>(0xBFFF))));
  } else if constexpr (R == Rd::kE5M2) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x.code + 8 * v)));
    return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
  } else {  // kKivi2: channel 4l + j is bits 2j of byte l
    static_assert(R == Rd::kKivi2, "int4 rows are read 32 channels at a time: slab4");
    uint16_t two;
    std::memcpy(&two, x.code + 2 * v, 2);
    const __m256i q = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(two), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
        _mm256_set1_epi32(3));
    const __m256 qf = _mm256_cvtepi32_ps(q);
    if (x.ksz) return _mm256_fmadd_ps(qf, _mm256_load_ps(x.ksz + 8 * v), _mm256_load_ps(x.ksz + 256 + 8 * v));
    const int64_t g = (8 * v) >> group_shift(c);
    return _mm256_fmadd_ps(qf, _mm256_set1_ps(bf(x.p[2 * g])), _mm256_set1_ps(bf(x.p[2 * g + 1])));
  }
}

// Channels 8v0 .. 8v0 + 31 of row x into o[0..3] (without x.f): chunk8 four times, except
// int4, whose 16 bytes are read and unpacked at once (low / high nibbles interleaved back
// to channel order, times each 8 channels' group scale plus its zero). int4 rows never
// have a residual row (attach_residual: kivi2 only).
template <Rd R>
static inline void slab4(const CodecView& c, const Row8& x, int64_t v0, __m256* o) {
  if constexpr (R == Rd::kInt4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x.code + 4 * v0));
    const __m128i low = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    const __m128i n0 = _mm_unpacklo_epi8(lo, hi), n1 = _mm_unpackhi_epi8(lo, hi);
    const __m128i part[4] = {n0, _mm_srli_si128(n0, 8), n1, _mm_srli_si128(n1, 8)};
    const int sh = group_shift(c);
    for (int k = 0; k < 4; ++k) {
      const int64_t g = (8 * (v0 + k)) >> sh;
      o[k] = _mm256_fmadd_ps(widen8(part[k]), _mm256_set1_ps(bf(x.p[2 * g])),
                             _mm256_set1_ps(bf(x.p[2 * g + 1])));
    }
  } else {
    for (int k = 0; k < 4; ++k) o[k] = chunk8<R>(c, x, v0 + k);
  }
}
#endif
