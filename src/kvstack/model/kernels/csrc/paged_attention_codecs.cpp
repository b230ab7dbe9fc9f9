// Paged attention over an encoded KV cache (the KV codecs of kv/codecs/), dequantizing in the kernel.
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

#include "codec_decode64.h"
#include "codec_generic.h"
#include "codec_rows.h"
#include "decode_avx2.h"
#include "decode_split.h"
#include "kvstack_ops.h"

namespace {

#if defined(KVSTACK_CODEC_AVX512)
using namespace codec64;

template <Codec C, typename T>
void codec_rows64(const CodecView& cv, const T* q, const int64_t* tables, const int64_t* tidx,
                  const int64_t* lens, T* out, int64_t R, int64_t H, int64_t MB, float scale,
                  int64_t W) {
  const int64_t KVH = cv.KVH, G = H / KVH;
  const int64_t per = kv_heads_per_item(KVH, G);  // KV heads per work item
  const DecodeSplit sp = split_decode_rows(lens, R, W, KVH, kCodecPart, (KVH + per - 1) / per);
  const std::vector<int64_t>& first = sp.first;
  const int64_t P = sp.parts();
  std::vector<Partial> parts(P * H);
  std::vector<float> qall(R * H * 64);  // float queries (rotated4: q R), once per row
  at::parallel_for(0, R * H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) query_float64(q + w * 64, cv.signs, qall.data() + w * 64);
  });
  run_decode_items(sp, [&](int64_t pi, int64_t u) {
    const int64_t r = sp.row[pi], kh0 = u * per;
    codec_item64(&codec_head64<C, T>, cv, qall.data() + r * H * 64,
                 tables + codec_table_of(tidx, r) * MB, kh0, std::min(KVH, kh0 + per), sp.t0[pi],
                 sp.t1[pi], (lens[r] - 1) / cv.BS, static_cast<int>(G), scale,
                 parts.data() + pi * H);
  });
  at::parallel_for(0, R * H, 16, [&](int64_t begin, int64_t end) {
    codec_merge_rows(parts.data(), first.data(), H, cv.signs, begin, end, out);
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
