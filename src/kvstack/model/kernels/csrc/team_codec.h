// decode_team over an encoded KV cache: the per-token KV codecs (int8, fp8 e4m3 / e5m2,
// int4, rotated4) as phases of the team's region, so a codec's decode step is one parallel
// region as an unencoded cache's is (why: with a codec the layers had run in Python,
// where decode_team saves ~8 % a step).
//
//   rows:  RoPE on q, k (no bf16 cache); K and V rows encoded at the rows' slots
//          (codec_encode.h, as codec_write); q as float32 (rotated4: q R)         barrier
//   items: (partition, KV heads): codec_item64 (codec_decode64.h)               barrier
//   items: (row, q head): codec_merge_rows (rotated4: turned back by R^T)         barrier
//
// The same functions on the same partitions as paged_attention_codec's fast path
// (codec_fast: head_dim 64, 1..8 q heads per KV head, groups of 16..64), so the step's
// outputs equal the Python loop's (codec_write then paged_attention_codec) bit for bit.
// kivi2 (a residual pool and block quantization kept by Python) stays in the Python loop.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "codec_decode64.h"
#include "codec_encode.h"
#include "team_slices.h"

namespace team_codec {
struct Layers;
}

#if defined(KVSTACK_CODEC_AVX512)
namespace team_codec {

using team::BF;
using HeadFn = void (*)(const CodecView&, const float*, const int64_t*, int64_t, int64_t,
                        int64_t, int64_t, int, float, Partial*);

// Whether decode_team takes codec `kind` (kv/codecs' kernel layout names) with `group`
// channels per (scale, zero) pair (0: the whole head) at G q heads per KV head: the
// per-token codecs on paged_attention_codec's fast path.
inline bool supported(const std::string& kind, int64_t group, int64_t G) {
  if (kind != "int8" && kind != "fp8_e4m3" && kind != "fp8_e5m2" && kind != "int4") return false;
  const int64_t g = group > 0 ? group : 64;
  return G >= 1 && G <= codec64::kMaxG && g % 16 == 0 && 64 % g == 0;
}

// A step's codec state: one view per layer and the float queries (the partials are the
// step's own, decode_team's Step::parts).
struct Layers {
  Codec kind = Codec::kInt8;
  const float* signs = nullptr;  // rotated4's [64] signs, or null
  HeadFn head = nullptr;
  std::vector<CodecView> views;  // per layer
  std::vector<uint8_t*> kw, vw;  // per layer: the codes the write phase stores into
  std::vector<BF*> kpw, vpw;
  std::vector<float> qf;  // [M, H, 64]
};

inline HeadFn head_fn(Codec c) {
  switch (c) {
    case Codec::kInt8: return &codec64::codec_head64<Codec::kInt8, BF>;
    case Codec::kFP8E4M3: return &codec64::codec_head64<Codec::kFP8E4M3, BF>;
    case Codec::kFP8E5M2: return &codec64::codec_head64<Codec::kFP8E5M2, BF>;
    case Codec::kInt4: return &codec64::codec_head64<Codec::kInt4, BF>;
    default: return nullptr;
  }
}

// Layer storage (codes and bf16 parameters [NB, BS, KVH, ...], as kv/codecs/per_token.py
// keeps them) checked and viewed; signs: rotated4's, kept alive by the caller.
inline void add_layer(Layers& c, int64_t group, const at::Tensor& kc, const at::Tensor& vc,
                      const at::Tensor& kp, const at::Tensor& vp,
                      const std::optional<at::Tensor>& signs, int64_t KVH) {
  const auto [grp, code_bytes, cols] = check_per_token_storage(c.kind, group, 64, kc, vc, kp, vp, signs);
  TORCH_CHECK(kc.size(2) == KVH, "decode_team: codes hold ", kc.size(2), " KV heads, not ", KVH);
  auto* k = static_cast<uint8_t*>(kc.data_ptr());
  auto* v = static_cast<uint8_t*>(vc.data_ptr());
  BF *kpp = kp.data_ptr<BF>(), *vpp = vp.data_ptr<BF>();
  c.views.push_back(CodecView{c.kind, k, v, kpp, vpp, code_bytes, cols, cols, grp > 0 ? grp : 64,
                              nullptr, nullptr, false, nullptr, c.signs, KVH, kc.size(1), 64});
  c.kw.push_back(k), c.vw.push_back(v), c.kpw.push_back(kpp), c.vpw.push_back(vpp);
}

// c for a step of M rows over codec `kind`'s storage of every layer (codes kc / vc and
// parameters kp / vp, one shape for all layers); signs_keep holds rotated4's signs.
inline void setup(Layers& c, const std::string& kind, int64_t group, at::TensorList kc,
                  at::TensorList vc, at::TensorList kp, at::TensorList vp,
                  const std::optional<at::Tensor>& signs, at::Tensor& signs_keep, int64_t M,
                  int64_t H, int64_t KVH) {
  TORCH_CHECK(supported(kind, group, H / KVH), "decode_team: KV codec '", kind, "' (group ",
              group, ", ", H / KVH, " q heads per KV head) is outside its scope");
  TORCH_CHECK(vc.size() == kc.size() && kp.size() == kc.size() && vp.size() == kc.size(),
              "decode_team: one K/V codes and parameters tensor per layer");
  c.kind = codec_kind(kind);
  c.head = head_fn(c.kind);
  if (signs.has_value()) {
    signs_keep = signs->to(torch::kFloat32).contiguous();
    c.signs = signs_keep.data_ptr<float>();
  }
  for (size_t l = 0; l < kc.size(); ++l) {
    TORCH_CHECK(kc[l].sizes() == kc[0].sizes() && kp[l].sizes() == kp[0].sizes(),
                "decode_team: the codes and parameters of every layer must have one shape");
    add_layer(c, group, kc[l], vc[l], kp[l], vp[l], signs, KVH);
  }
  c.qf.assign(M * H * 64, 0.f);
}

// Rows [b, e) of qkv after RoPE: every KV head's K and V row encoded into layer l at the
// row's slot, and the row's q heads as float32 (rotated4: q R) into c.qf.
inline void write_rows(Layers& c, size_t l, const BF* qkv, const int64_t* slots, int64_t b,
                       int64_t e, int64_t H, int64_t KVH) {
  constexpr int64_t HD = 64;
  const CodecView& v = c.views[l];
  const int64_t width = (H + 2 * KVH) * HD;
  alignas(64) float buf[HD];
  for (int64_t r = b; r < e; ++r) {
    const BF* row = qkv + r * width;
    for (int64_t h = 0; h < KVH; ++h)
      for (int which = 0; which < 2; ++which) {
        const BF* src = row + (H + which * KVH + h) * HD;
        for (int64_t i = 0; i < HD; ++i) buf[i] = static_cast<float>(src[i]);
        const int64_t at = slots[r] * KVH + h;
        codec_encode::encode_row(c.kind, v.group, c.signs, buf, HD,
                                 (which ? c.vw[l] : c.kw[l]) + at * v.code_bytes,
                                 (which ? c.vpw[l] : c.kpw[l]) + at * v.k_cols);
      }
    for (int64_t h = 0; h < H; ++h)
      codec64::query_float64(row + h * HD, c.signs, c.qf.data() + (r * H + h) * HD);
  }
}

}  // namespace team_codec
#endif
