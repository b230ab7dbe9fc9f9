// Paged attention over an encoded KV cache (era 5 codecs), dequantizing in the kernel.
//
// The same rows as paged_attention.cpp (decodes, and prefill rows at KV position p scored
// as a decode of context p + 1), but K and V are read in place from a codec's storage
// (codec_rows.h: codes and bf16 scales, KIVI's residual pool) instead of an unencoded
// cache, so attention reads the codec's bytes, not a dequantized copy. Per-row factors
// (int8/fp8 scales) multiply one score or one probability instead of every channel; KIVI's
// per-channel key scales fold into the query once per block (q . (c s + z) = (q s) . c +
// q . z). rotated4 is int4 with one group per head vector, read in the rotated basis: the
// query is rotated once (q R) and the output once back (o R^T) instead of every key and
// value, R orthogonal (QuaRot's online Hadamard; codec_rows.h rotate()).
//
// head_dim 64 with AVX-512: work split over (row, 512-token partition, KV head), two
// passes per partition (scores into L1, then softmax and P.V), partitions merged by their
// maxima and sums (flash-decoding), as the bf16 kernel. With bf16 queries the scoring
// pass uses each codec's cheapest reader (codec_int8.h, codec_int4.h: integer dot products;
// codec_fp8.h: fp8 bits as bf16) and prefetches K rows ahead into L1 and their V rows into
// L2 for the P.V pass. AVX2 without AVX-512 (AMD EPYC Zen 2/3): decode_avx2.h, head_dim
// 64 / 128 / 256, the same split. Other shapes or ISAs: one task per (row, KV head) with the
// scalar reader (codec_generic.h). All compute in float32.
#include <ATen/Parallel.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "codec_fp8.h"
#include "codec_generic.h"
#include "codec_int4.h"
#include "codec_int8.h"
#include "codec_rows.h"
#include "decode_avx2.h"
#include "decode_split.h"
#include "kvstack_ops.h"

namespace {

constexpr int64_t kCodecPart = 512;  // tokens per partition
constexpr int kMaxG = 8;  // q heads per KV head on the fast path
constexpr int64_t kAheadBlocks = 3;  // blocks of K prefetched ahead while scoring


#if defined(KVSTACK_CODEC_AVX512)
struct CodecPartial {  // one (row, partition, q head): max m, sum l, unnormalized acc
  float m, l;
  alignas(64) float acc[64];
};

// Prefetches the K or V rows (codes and per-row parameters) of head kh in block blk into
// L1 (_MM_HINT_T0) or L2 (_MM_HINT_T1).
template <int Hint>
inline void prefetch_block(const CodecView& cv, bool is_k, int64_t blk, int64_t kh) {
  const uint8_t* codes = is_k ? cv.kc : cv.vc;
  const c10::BFloat16* params = is_k ? cv.kp : cv.vp;
  const int64_t cols = is_k ? cv.k_cols : cv.v_cols;
  for (int64_t i = 0; i < cv.BS; ++i) {
    const int64_t r = (blk * cv.BS + i) * cv.KVH + kh;
    _mm_prefetch(reinterpret_cast<const char*>(codes + r * cv.code_bytes), static_cast<_mm_hint>(Hint));
    if (cols) _mm_prefetch(reinterpret_cast<const char*>(params + r * cols), static_cast<_mm_hint>(Hint));
    if (is_k) prefetch_item_heads(cv, r);
  }
}

#if defined(__AVX512BF16__)
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif

// Where a pass is: block bi of the table, token i in it, the block's residual slot (kivi2:
// only in the row's own block, table index own) and its key parameters.
template <Codec C>
struct Cursor {
  const CodecView& cv;
  const int64_t* table;
  int64_t kh, nblocks, own, bi, i, blk, rs = -1;
  KiviKeys kk;
  Cursor(const CodecView& c, const int64_t* t, int64_t h, int64_t t0, int64_t t1, int64_t o,
         bool is_k)
      : cv(c), table(t), kh(h), nblocks((t1 + c.BS - 1) / c.BS), own(o), bi(t0 / c.BS),
        i(t0 % c.BS) {
    if (is_k)
      for (int64_t d = 0; d < kAheadBlocks && bi + d < nblocks; ++d) ahead(table[bi + d]);
    enter(is_k);
  }
  // Scattered blocks defeat the hardware prefetcher: the scoring pass asks for the K rows
  // kAheadBlocks blocks ahead into L1 and the same blocks' V rows into L2, where the P.V
  // pass finds them (it pulls the next block into L1).
  void ahead(int64_t b) {
    prefetch_block<_MM_HINT_T0>(cv, true, b, kh);
    prefetch_block<_MM_HINT_T1>(cv, false, b, kh);
  }
  __attribute__((always_inline)) inline void enter(bool is_k) {
    blk = table[bi];
    rs = bi == own ? cv.residual(blk) : -1;
    if constexpr (C == Codec::kKivi2)
      if (is_k && rs < 0) kk.load(cv, blk, kh);
    if (is_k && bi + kAheadBlocks < nblocks) ahead(table[bi + kAheadBlocks]);
    if (!is_k && bi + 1 < nblocks) prefetch_block<_MM_HINT_T0>(cv, false, table[bi + 1], kh);
  }
  // Row of the current token (in to_order's order) and its factor; then the next token.
  // Forced inline (and enter() with it): GCC had kept int4's out of line, and each call
  // spilled the row's four vectors through the stack (int4's P.V at batch 32 x 2,048 on
  // Zen 5, one thread: 3.9 -> 2.0 ms a layer); forcing only this one pushed kivi2's
  // enter() out of line instead.
  __attribute__((always_inline)) inline float next(bool is_k, __m512* x) {
    float f = 1.f;
    if (rs >= 0) {
      residual_row64(cv, is_k, rs, i, kh, x);
      to_order<C>(x);
    } else {
      f = row64<C>(cv, is_k, (blk * cv.BS + i) * cv.KVH + kh, x, &kk);
    }
    if (++i == cv.BS && ++bi < nblocks) {
      i = 0;
      enter(is_k);
    }
    return f;
  }
};

// Pass 1 of a partition: scores of tokens [t0, t1) of KV head kh for the G q heads
// (qv: their float vectors in to_order's order) into sc, padding lanes -inf. 16 rows at a
// time are decoded into an L1 buffer (bf16 pairs for AVX512-BF16 dot products when GT > 0,
// float32 otherwise), then per q head 16 dot products and one horizontal reduction.
template <Codec C, int GT>
void codec_scores(const CodecView& cv, __m512 (*qv)[4], int G, const int64_t* table, int64_t kh,
                  int64_t t0, int64_t t1, int64_t own, float scale, float (*sc)[kCodecPart]) {
  constexpr bool kBf16 = GT > 0 && kHasBf16Dot;
  const int64_t n = t1 - t0, np = (n + 15) / 16 * 16;
  alignas(64) float fac[16];
  alignas(64) float kf[16][64];  // decoded K rows (float32, or bf16 pairs in kb)
  alignas(64) uint16_t kb[16][64];
#if defined(__AVX512BF16__)
  __m512bh qh[kMaxG][2];
  if constexpr (kBf16)
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < 2; ++k) qh[g][k] = _mm512_cvtne2ps_pbh(qv[g][2 * k + 1], qv[g][2 * k]);
#endif
  Cursor<C> ck(cv, table, kh, t0, t1, own, true);
  for (int64_t j0 = 0; j0 < np; j0 += 16) {
    const int live_n = static_cast<int>(std::min<int64_t>(16, n - j0));
    for (int j = 0; j < 16; ++j) {
      __m512 x[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
      fac[j] = j < live_n ? ck.next(true, x) : 0.f;
      if constexpr (kBf16) {
#if defined(__AVX512BF16__)
        for (int k = 0; k < 2; ++k)
          _mm512_store_si512(kb[j] + 32 * k, (__m512i)_mm512_cvtne2ps_pbh(x[2 * k + 1], x[2 * k]));
#endif
      } else {
        for (int k = 0; k < 4; ++k) _mm512_store_ps(kf[j] + 16 * k, x[k]);
      }
    }
    const __mmask16 live = static_cast<__mmask16>(live_n == 16 ? 0xFFFF : (1u << live_n) - 1);
    const __m512 f = _mm512_mul_ps(_mm512_load_ps(fac), _mm512_set1_ps(scale));
    for (int g = 0; g < G; ++g) {
      __m512 d16[16];
      for (int j = 0; j < 16; ++j) {
        if constexpr (kBf16) {
#if defined(__AVX512BF16__)
          __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qh[g][0],
                                      (__m512bh)_mm512_load_si512(kb[j]));
          d16[j] = _mm512_dpbf16_ps(a, qh[g][1], (__m512bh)_mm512_load_si512(kb[j] + 32));
#endif
        } else {
          __m512 a = _mm512_mul_ps(qv[g][0], _mm512_load_ps(kf[j]));
          for (int k = 1; k < 4; ++k) a = _mm512_fmadd_ps(qv[g][k], _mm512_load_ps(kf[j] + 16 * k), a);
          d16[j] = a;
        }
      }
      const __m512 s = _mm512_mul_ps(hsum16(d16), f);
      _mm512_store_ps(sc[g] + j0, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, s));
    }
  }
}

// Pass 1 through the fastest reader of codec C: integer dot products for int8 and 4-bit
// codes (codec_int8.h, codec_int4.h), bf16 dot products on fp8 codes' own bits
// (codec_fp8.h), else rows decoded to float (codec_scores). All with bf16 queries only.
template <Codec C, int GT>
void scores(const CodecView& cv, const float* q, __m512 (*qv)[4], int G, const int64_t* table,
            int64_t kh, int64_t t0, int64_t t1, int64_t own, float scale, float (*sc)[kCodecPart]) {
#if defined(KVSTACK_CODEC_INT8_VNNI)  // integer dot products: no AVX512-BF16 needed
  if constexpr (GT > 0 && C == Codec::kInt8)
    return int8_scores<GT, kCodecPart>(cv, q, table, kh, t0, t1, scale, sc);
  if constexpr (GT > 0 && C == Codec::kInt4)
    if (cv.group == 32 || cv.group == 64) return int4_scores<GT, kCodecPart>(cv, q, table, kh, t0, t1, scale, sc);
#endif
#if defined(KVSTACK_CODEC_FP8_BITS)
  if constexpr (GT > 0 && (C == Codec::kFP8E4M3 || C == Codec::kFP8E5M2))
    return fp8_scores<C, GT, kCodecPart>(cv, q, table, kh, t0, t1, scale, sc);
#endif
  codec_scores<C, GT>(cv, qv, G, table, kh, t0, t1, own, scale, sc);
}

// Tokens [t0, t1) of one row against KV head kh: G partials (GT: G known at compile time,
// then bf16 queries score with AVX512-BF16 dot products, or int8 codes with VNNI integer
// ones (codec_int8.h); 0: G = g_rt, float32 dots). q: G float rows of 64. Pass 1 the
// scores (codec_scores), pass 2 the softmax, pass 3 P.V, each row decoded once for the G
// heads. The next block is prefetched.
template <Codec C, int GT>
void codec_part64(const CodecView& cv, const float* q, const int64_t* table, int64_t kh,
                  int64_t t0, int64_t t1, int64_t own, int g_rt, float scale,
                  CodecPartial* parts) {
  const int G = GT > 0 ? GT : g_rt;
  const int64_t n = t1 - t0, np = (n + 15) / 16 * 16;
  alignas(64) float sc[kMaxG][kCodecPart];
  __m512 qv[kMaxG][4];
  for (int g = 0; g < G; ++g) {
    for (int k = 0; k < 4; ++k) qv[g][k] = _mm512_loadu_ps(q + 64 * g + 16 * k);
    to_order<C>(qv[g]);
  }
  scores<C, GT>(cv, q, qv, G, table, kh, t0, t1, own, scale, sc);
  for (int g = 0; g < G; ++g) {  // softmax numerators, max and sum
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
  __m512 acc[kMaxG][4];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < 4; ++k) acc[g][k] = _mm512_setzero_ps();
  Cursor<C> cvv(cv, table, kh, t0, t1, own, false);
  for (int64_t j = 0; j < n; ++j) {
    __m512 x[4];
    const float f = cvv.next(false, x);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(sc[g][j] * f);
      for (int k = 0; k < 4; ++k) acc[g][k] = _mm512_fmadd_ps(p, x[k], acc[g][k]);
    }
  }
  for (int g = 0; g < G; ++g) {
    from_order<C>(acc[g]);
    for (int k = 0; k < 4; ++k) _mm512_store_ps(parts[g].acc + 16 * k, acc[g][k]);
  }
}

// codec_part64 for one KV head, G picked at compile time for the common GQA ratios (bf16
// queries), at run time otherwise and for float32 queries (float32 dots).
template <Codec C, typename T>
void codec_head64(const CodecView& cv, const float* qf, const int64_t* table, int64_t kh,
                  int64_t t0, int64_t t1, int64_t own, int g, float scale, CodecPartial* pp) {
  if (!std::is_same_v<T, c10::BFloat16>) return codec_part64<C, 0>(cv, qf, table, kh, t0, t1, own, g, scale, pp);
  switch (g) {
    case 1: return codec_part64<C, 1>(cv, qf, table, kh, t0, t1, own, g, scale, pp);
    case 2: return codec_part64<C, 2>(cv, qf, table, kh, t0, t1, own, g, scale, pp);
    case 3: return codec_part64<C, 3>(cv, qf, table, kh, t0, t1, own, g, scale, pp);
    case 4: return codec_part64<C, 4>(cv, qf, table, kh, t0, t1, own, g, scale, pp);
    case 8: return codec_part64<C, 8>(cv, qf, table, kh, t0, t1, own, g, scale, pp);
    default: return codec_part64<C, 0>(cv, qf, table, kh, t0, t1, own, g, scale, pp);
  }
}

template <Codec C, typename T>
void codec_rows64(const CodecView& cv, const T* q, const int64_t* tables, const int64_t* tidx,
                  const int64_t* lens, T* out, int64_t R, int64_t H, int64_t MB, float scale,
                  int64_t W) {
  const int64_t KVH = cv.KVH, G = H / KVH;
  const int64_t per = kv_heads_per_item(KVH, G);  // KV heads per work item
  const DecodeSplit sp = split_decode_rows(lens, R, W, KVH, kCodecPart, (KVH + per - 1) / per);
  const std::vector<int64_t>& first = sp.first;
  const int64_t P = sp.parts();
  std::vector<CodecPartial> parts(P * H);
  std::vector<float> qall(R * H * 64);  // float queries (rotated4: q R), once per row
  at::parallel_for(0, R * H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t i = 0; i < 64; ++i) qall[w * 64 + i] = static_cast<float>(q[w * 64 + i]);
      if (cv.signs) rotate(qall.data() + w * 64, cv.signs, 64, false);
    }
  });
  run_decode_items(sp, [&](int64_t pi, int64_t u) {
    const int64_t r = sp.row[pi], t0 = sp.t0[pi], t1 = sp.t1[pi], own = (lens[r] - 1) / cv.BS;
    const int64_t* table = tables + codec_table_of(tidx, r) * MB;
    const int64_t kh0 = u * per, kh1 = std::min(KVH, kh0 + per);
    for (int64_t kh = kh0; kh < kh1; ++kh) {  // the first head's prefetches take all heads' rows
      CodecView c = cv;
      c.span = kh == kh0 ? kh1 - kh0 : 1;
      codec_head64<C, T>(c, qall.data() + (r * H + kh * G) * 64, table, kh, t0, t1, own,
                         static_cast<int>(G), scale, parts.data() + pi * H + kh * G);
    }
  });
  at::parallel_for(0, R * H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = w / H, h = w % H;
      float mx = -INFINITY, l = 0.f;
      for (int64_t pi = first[r]; pi < first[r + 1]; ++pi) mx = std::max(mx, parts[pi * H + h].m);
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                       _mm512_setzero_ps()};
      for (int64_t pi = first[r]; pi < first[r + 1]; ++pi) {
        const CodecPartial& pt = parts[pi * H + h];
        const float wgt = std::exp(pt.m - mx);
        l += wgt * pt.l;
        for (int k = 0; k < 4; ++k)
          acc[k] = _mm512_fmadd_ps(_mm512_set1_ps(wgt), _mm512_load_ps(pt.acc + 16 * k), acc[k]);
      }
      alignas(64) float o[64];
      for (int k = 0; k < 4; ++k) _mm512_store_ps(o + 16 * k, _mm512_mul_ps(acc[k], _mm512_set1_ps(1.f / l)));
      if (cv.signs) rotate(o, cv.signs, 64, true);
      for (int k = 0; k < 4; ++k) store16(out + (r * H + h) * 64 + 16 * k, _mm512_load_ps(o + 16 * k));
    }
  });
}

template <typename T>
bool codec_fast(const CodecView& cv, const T* q, const int64_t* tables, const int64_t* tidx,
                const int64_t* lens, T* out, int64_t R, int64_t H, int64_t MB, float scale,
                int64_t W) {
  const int64_t G = H / cv.KVH;
  if (cv.HD != 64 || G > kMaxG || cv.group % 16 || 64 % cv.group) return false;
  if (cv.kind == Codec::kKivi2 && cv.group != 32) return false;  // row64's value groups
  switch (cv.kind) {
#define KVSTACK_CODEC(c)                                                    \
  case c:                                                                   \
    codec_rows64<c, T>(cv, q, tables, tidx, lens, out, R, H, MB, scale, W); \
    return true;
    KVSTACK_CODEC(Codec::kBF16)
    KVSTACK_CODEC(Codec::kInt8)
    KVSTACK_CODEC(Codec::kFP8E4M3)
    KVSTACK_CODEC(Codec::kFP8E5M2)
    KVSTACK_CODEC(Codec::kInt4)
    KVSTACK_CODEC(Codec::kKivi2)
#undef KVSTACK_CODEC
  }
  return false;
}
#elif defined(KVSTACK_DECODE_AVX2)
template <typename T>
bool codec_fast(const CodecView& cv, const T* q, const int64_t* tables, const int64_t* tidx,
                const int64_t* lens, T* out, int64_t R, int64_t H, int64_t MB, float scale,
                int64_t W) {
  return decode_avx2<T>(reader_of(cv.kind), cv, q, tables, tidx, lens, out, R, H, MB, scale, W);
}
#else
template <typename T>
bool codec_fast(const CodecView&, const T*, const int64_t*, const int64_t*, const int64_t*, T*,
                int64_t, int64_t, int64_t, float, int64_t) {
  return false;
}
#endif

}  // namespace

// q [R, H, HD] (bf16 or float32; the output's dtype); k_codes/v_codes [NB, BS, KVH, bytes]
// and k_params/v_params as kv/codecs/ stores them for one layer; res_k/res_v [cap, BS, KVH,
// HD] and residual_of [NB] for kivi2; rotation_signs [HD] for rotated4 (the codes hold
// x diag(signs) H / sqrt(HD)); rows, tables and context lengths as paged_attention.
torch::Tensor paged_attention_codec(torch::Tensor q, std::string kind, int64_t group,
                                    torch::Tensor k_codes, torch::Tensor v_codes,
                                    torch::Tensor k_params, torch::Tensor v_params,
                                    std::optional<torch::Tensor> res_k,
                                    std::optional<torch::Tensor> res_v,
                                    std::optional<torch::Tensor> residual_of,
                                    std::optional<torch::Tensor> rotation_signs,
                                    torch::Tensor block_tables,
                                    std::optional<torch::Tensor> table_index,
                                    torch::Tensor context_lens, double scale, int64_t window) {
  const Codec c = codec_kind(kind);
  TORCH_CHECK(window >= 0, "window ", window, " is negative (0: no window)");
  TORCH_CHECK(q.dim() == 3 && block_tables.dim() == 2, "bad shapes");
  for (const auto* t : {&k_codes, &v_codes, &k_params, &v_params})
    TORCH_CHECK(t->is_contiguous(), "codec tensors must be contiguous");
  TORCH_CHECK(k_codes.sizes() == v_codes.sizes(), "k and v codes differ in shape");
  q = q.contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t R = q.size(0), H = q.size(1), HD = q.size(2);
  const int64_t NB = k_codes.size(0), BS = k_codes.size(1), KVH = k_codes.size(2);
  const int64_t S = block_tables.size(0), MB = block_tables.size(1);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "head shapes do not match");
  if (group <= 0) group = HD;  // one (scale, zero) pair per head vector
  check_codec_tensors(c, group, HD, k_codes, k_params, v_params);
  TORCH_CHECK(context_lens.numel() == R, "one context length per row");
  torch::Tensor tidx_t, res_t;
  const int64_t* tidx = nullptr;
  if (table_index.has_value()) {
    tidx_t = table_index->to(torch::kInt64).contiguous();
    TORCH_CHECK(tidx_t.numel() == R, "one table index per row");
    tidx = tidx_t.data_ptr<int64_t>();
  } else {
    TORCH_CHECK(S == R, "one block table per row");
  }
  CodecView cv{c, static_cast<const uint8_t*>(k_codes.data_ptr()),
               static_cast<const uint8_t*>(v_codes.data_ptr()),
               static_cast<const c10::BFloat16*>(k_params.data_ptr()),
               static_cast<const c10::BFloat16*>(v_params.data_ptr()),
               k_codes.size(3) * k_codes.element_size(), 0, 0, group,
               nullptr, nullptr, false, nullptr, nullptr, KVH, BS, HD};
  if (c == Codec::kInt4) cv.k_cols = cv.v_cols = 2 * HD / cv.group;
  if (c == Codec::kInt8 || c == Codec::kFP8E4M3 || c == Codec::kFP8E5M2) cv.k_cols = cv.v_cols = 1;
  if (c == Codec::kKivi2) cv.v_cols = 2 * HD / cv.group;
  torch::Tensor signs_t;
  if (rotation_signs.has_value()) {
    signs_t = rotation_signs->to(torch::kFloat32).contiguous();
    TORCH_CHECK(signs_t.numel() == HD && HD > 0 && (HD & (HD - 1)) == 0,
                "rotation signs need a power-of-two head_dim, one sign per channel");
    cv.signs = signs_t.data_ptr<float>();
  }
  const int64_t cap = attach_residual(cv, NB, res_k, res_v, residual_of, res_t);
  // Every index checked before any read (as paged_attention).
  const int64_t* lens_p = context_lens.data_ptr<int64_t>();
  const int64_t* tab_p = block_tables.data_ptr<int64_t>();
  std::vector<int64_t> need(S, 0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = codec_table_of(tidx, r);
    TORCH_CHECK(t >= 0 && t < S, "table index ", t, " outside [0, ", S, ")");
    TORCH_CHECK(lens_p[r] >= 1 && lens_p[r] <= MB * BS, "context length ", lens_p[r],
                " outside [1, ", MB * BS, "]");
    need[t] = std::max(need[t], lens_p[r]);
  }
  for (int64_t t = 0; t < S; ++t)  // (blocks before a window are checked too: page 0 passes)
    for (int64_t b = 0; b < (need[t] + BS - 1) / BS; ++b) {
      const int64_t blk = tab_p[t * MB + b];
      TORCH_CHECK(blk >= 0 && blk < NB, "block id ", blk, " outside the cache");
      TORCH_CHECK(cv.residual(blk) < cap, "residual slot ", cv.residual(blk), " outside the pool");
    }
  auto out = torch::empty_like(q);
  if (R == 0) return out;
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == torch::kBFloat16) {
    using T = c10::BFloat16;
    const T* qp = q.data_ptr<T>();
    if (!codec_fast<T>(cv, qp, tab_p, tidx, lens_p, out.data_ptr<T>(), R, H, MB, sc, window))
      codec_rows_generic<T>(cv, qp, tab_p, tidx, lens_p, out.data_ptr<T>(), R, H, MB, sc, window);
  } else if (q.scalar_type() == torch::kFloat32) {
    const float* qp = q.data_ptr<float>();
    if (!codec_fast<float>(cv, qp, tab_p, tidx, lens_p, out.data_ptr<float>(), R, H, MB, sc,
                           window))
      codec_rows_generic<float>(cv, qp, tab_p, tidx, lens_p, out.data_ptr<float>(), R, H, MB, sc,
                                window);
  } else {
    TORCH_CHECK(false, "codec attention supports bfloat16 and float32 queries");
  }
  return out;
}
