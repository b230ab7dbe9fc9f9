// Whole blocks of a per-token codec (int8, fp8 e4m3 / e5m2, int4, rotated4) or of kivi2
// dequantized in C++ for the prefill chunks that read earlier KV (chunked prefill, prefix hits) with more
// rows than the codec attention kernel takes: the same values as the codec's PyTorch
// `gather` (kv/codecs/per_token.py: `decode(codes[ids], params[ids]).to(dtype)`), bit for
// bit (tests/model/test_codec_write.py), read in place and in one pass instead of an
// indexing copy and three to five elementwise ops over the whole context.
//
//   int8, fp8  x = float(code) * s            (one float32 product, then the dtype)
//   int4       x = float(code) * s_g + z_g    (a product, then a sum: no fused multiply-add)
//   rotated4   the int4 row of one group, then x R^T (codec_rows.h rotate(), inverse; the
//              Python decode runs the same fast Walsh-Hadamard transform)
//   kivi2      x = float(code) * s + z, keys' (s, z) per block and channel, values' per
//              group; a block that is still filling copied from the residual pool
//
// Rows go through codec_rows.h row_scalar (the codec attention's portable reader), int4
// rows 32 channels at a time with AVX-512.
#include <ATen/Parallel.h>

#include <string>
#include <vector>

#include "codec_rows.h"
#include "kvstack_ops.h"

namespace {

// Row r (token-major: block, token, head) of the K or V storage into dst[HD], float32
// (rotated4: turned back, x R^T).
void decode_row(const CodecView& cv, bool is_k, int64_t r, float* dst) {
#if defined(__AVX512F__)
  if (cv.kind == Codec::kInt4 && cv.group % 32 == 0) {  // 16 bytes = 32 channels, one group
    const uint8_t* code = (is_k ? cv.kc : cv.vc) + r * cv.code_bytes;
    const c10::BFloat16* p = (is_k ? cv.kp : cv.vp) + r * cv.k_cols;
    const __m512i even = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i odd = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t c0 = 0; c0 < cv.HD; c0 += 32) {
      const int64_t g = c0 / cv.group;
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code + c0 / 2)));
      const __m512 s = _mm512_set1_ps(bf(p[2 * g])), z = _mm512_set1_ps(bf(p[2 * g + 1]));
      const __m512 lo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), s), z);
      const __m512 hi = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), s), z);
      _mm512_storeu_ps(dst + c0, _mm512_permutex2var_ps(lo, even, hi));  // low nibbles: even channels
      _mm512_storeu_ps(dst + c0 + 16, _mm512_permutex2var_ps(lo, odd, hi));
    }
  } else
#endif
  {
    const int64_t per_block = cv.BS * cv.KVH;
    // kivi2: a block with a residual slot (still filling) is read from the pool.
    row_scalar(cv, is_k, r / per_block, r % per_block / cv.KVH, r % cv.KVH, true, dst);
  }
  if (cv.signs) rotate(dst, cv.signs, cv.HD, true);
}

template <typename T>
void gather_rows(const CodecView& cv, bool is_k, const int64_t* ids, int64_t n_ids, T* out) {
  const int64_t per_block = cv.BS * cv.KVH, HD = cv.HD;
  at::parallel_for(0, n_ids * per_block, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(HD);
    for (int64_t w = begin; w < end; ++w) {
      decode_row(cv, is_k, ids[w / per_block] * per_block + w % per_block, buf.data());
      for (int64_t i = 0; i < HD; ++i) out[w * HD + i] = static_cast<T>(buf[i]);
    }
  });
}

}  // namespace

// k_codes/v_codes [NB, BS, KVH, bytes] and k_params/v_params [NB, BS, KVH, cols] of one
// layer (kv/codecs/per_token.py); block_ids any shape; group and rotation_signs as
// codec_write. Returns K and V as block_ids.shape + [BS, KVH, HD] in `dtype`.
// The storage of kivi2 (kv/codecs/kivi.py): 2-bit codes, keys' (scale, zero) per block and
// channel, values' per token and group, and the residual pool of the filling blocks.
static CodecView kivi2_view(int64_t group, int64_t HD, const torch::Tensor& kc, const torch::Tensor& vc,
                            const torch::Tensor& kp, const torch::Tensor& vp) {
  for (const auto* t : {&kc, &vc, &kp, &vp})
    TORCH_CHECK(t->is_contiguous(), "codes and parameters must be contiguous");
  TORCH_CHECK(kc.sizes() == vc.sizes(), "K and V codes differ in shape");
  check_codec_tensors(Codec::kKivi2, group, HD, kc, kp, vp);
  return CodecView{Codec::kKivi2, static_cast<const uint8_t*>(kc.data_ptr()),
                   static_cast<const uint8_t*>(vc.data_ptr()), kp.data_ptr<c10::BFloat16>(),
                   vp.data_ptr<c10::BFloat16>(), HD / 4, 0, 2 * HD / group, group, nullptr,
                   nullptr, false, nullptr, nullptr, kc.size(2), kc.size(1), HD};
}

// k_codes/v_codes [NB, BS, KVH, bytes] and k_params/v_params of one layer as the codec
// stores them (kv/codecs/per_token.py, kivi.py); block_ids any shape; group and
// rotation_signs as codec_write; kivi2: res_k/res_v [cap, BS, KVH, HD] and residual_of [NB],
// a block with a slot read from the pool (the codec's `gather`). Returns K and V as
// block_ids.shape + [BS, KVH, HD] in `dtype`.
std::vector<torch::Tensor> codec_gather(std::string kind, int64_t group, torch::Tensor k_codes,
                                        torch::Tensor v_codes, torch::Tensor k_params,
                                        torch::Tensor v_params,
                                        std::optional<torch::Tensor> rotation_signs,
                                        torch::Tensor block_ids, int64_t head_dim,
                                        c10::ScalarType dtype, std::optional<torch::Tensor> res_k,
                                        std::optional<torch::Tensor> res_v,
                                        std::optional<torch::Tensor> residual_of) {
  const Codec c = codec_kind(kind);
  TORCH_CHECK(dtype == torch::kBFloat16 || dtype == torch::kFloat32, "dtype must be bfloat16 or float32");
  const int64_t HD = head_dim;
  CodecView cv;
  torch::Tensor signs, res_t;
  int64_t cap = 0;
  if (c == Codec::kKivi2) {
    TORCH_CHECK(!rotation_signs.has_value(), "kivi2 has no rotation");
    cv = kivi2_view(group, HD, k_codes, v_codes, k_params, v_params);
    cap = attach_residual(cv, k_codes.size(0), res_k, res_v, residual_of, res_t);
  } else {
    TORCH_CHECK(!residual_of.has_value() && !res_k.has_value() && !res_v.has_value(),
                "only kivi2 has a residual pool");
    const auto [grp, code_bytes, cols] =
        check_per_token_storage(c, group, HD, k_codes, v_codes, k_params, v_params, rotation_signs);
    if (rotation_signs.has_value()) signs = rotation_signs->to(torch::kFloat32).contiguous();
    cv = CodecView{c, static_cast<const uint8_t*>(k_codes.data_ptr()),
                   static_cast<const uint8_t*>(v_codes.data_ptr()),
                   k_params.data_ptr<c10::BFloat16>(), v_params.data_ptr<c10::BFloat16>(),
                   code_bytes, cols, cols, grp, nullptr, nullptr, false, nullptr,
                   signs.defined() ? signs.data_ptr<float>() : nullptr, k_codes.size(2),
                   k_codes.size(1), HD};
  }
  const int64_t NB = k_codes.size(0), BS = cv.BS, KVH = cv.KVH;
  const torch::Tensor ids = block_ids.to(torch::kInt64).contiguous();
  const int64_t n = ids.numel();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < NB, "block id ", ip[i], " out of range [0, ", NB, ")");
    TORCH_CHECK(cv.residual(ip[i]) < cap, "residual slot ", cv.residual(ip[i]), " outside the pool");
  }
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.insert(shape.end(), {BS, KVH, HD});
  std::vector<torch::Tensor> out;
  for (const bool is_k : {true, false}) {
    torch::Tensor o = torch::empty(shape, torch::TensorOptions().dtype(dtype));
    if (dtype == torch::kBFloat16)
      gather_rows(cv, is_k, ip, n, o.data_ptr<c10::BFloat16>());
    else
      gather_rows(cv, is_k, ip, n, o.data_ptr<float>());
    out.push_back(o);
  }
  return out;
}
