// Whole blocks of a per-token codec (int8, fp8 e4m3 / e5m2, int4, rotated4) dequantized in
// C++ for the prefill chunks that read earlier KV (chunked prefill, prefix hits) with more
// rows than the codec attention kernel takes: the same values as the codec's PyTorch
// `gather` (kv/codecs/per_token.py: `decode(codes[ids], params[ids]).to(dtype)`), bit for
// bit (tests/model/test_codec_write.py), read in place and in one pass instead of an
// indexing copy and three to five elementwise ops over the whole context.
//
//   int8, fp8  x = float(code) * s            (one float32 product, then the dtype)
//   int4       x = float(code) * s_g + z_g    (a product, then a sum: no fused multiply-add)
//   rotated4   the int4 row of one group, then x R^T (codec_rows.h rotate(), inverse; the
//              Python decode runs the same fast Walsh-Hadamard transform)
#include <ATen/Parallel.h>

#include <string>
#include <vector>

#include "codec_rows.h"
#include "kvstack_ops.h"

namespace {

// Row r of the layer (token-major: block, token, head) dequantized into dst[HD] (float).
void decode_row(Codec c, int64_t group, const float* signs, const uint8_t* code,
                const c10::BFloat16* p, int64_t HD, float* dst) {
  switch (c) {
    case Codec::kInt8:
      for (int64_t i = 0; i < HD; ++i) dst[i] = static_cast<float>(static_cast<int8_t>(code[i])) * bf(p[0]);
      return;
    case Codec::kFP8E4M3:
      for (int64_t i = 0; i < HD; ++i)
        dst[i] = static_cast<float>(c10::Float8_e4m3fn(code[i], c10::Float8_e4m3fn::from_bits())) * bf(p[0]);
      return;
    case Codec::kFP8E5M2:
      for (int64_t i = 0; i < HD; ++i)
        dst[i] = static_cast<float>(c10::Float8_e5m2(code[i], c10::Float8_e5m2::from_bits())) * bf(p[0]);
      return;
    case Codec::kInt4:
#if defined(__AVX512F__)
      if (group % 32 == 0) {  // 16 bytes = 32 channels of one group at a time
        const __m512i even = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const __m512i odd = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        for (int64_t c0 = 0; c0 < HD; c0 += 32) {
          const int64_t g = c0 / group;
          const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code + c0 / 2)));
          const __m512 s = _mm512_set1_ps(bf(p[2 * g])), z = _mm512_set1_ps(bf(p[2 * g + 1]));
          const __m512 lo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), s), z);
          const __m512 hi = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), s), z);
          _mm512_storeu_ps(dst + c0, _mm512_permutex2var_ps(lo, even, hi));  // low nibbles: even channels
          _mm512_storeu_ps(dst + c0 + 16, _mm512_permutex2var_ps(lo, odd, hi));
        }
        if (signs) rotate(dst, signs, HD, true);
        return;
      }
#endif
      for (int64_t i = 0; i < HD; ++i) {
        const int64_t g = i / group;
        const float q = static_cast<float>((code[i / 2] >> (4 * (i & 1))) & 15);
        const float prod = q * bf(p[2 * g]);
        dst[i] = prod + bf(p[2 * g + 1]);
      }
      if (signs) rotate(dst, signs, HD, true);
      return;
    default: TORCH_CHECK(false, "codec_gather: not a per-token codec");
  }
}

template <typename T>
void gather_rows(Codec c, int64_t group, const float* signs, const uint8_t* codes,
                 const c10::BFloat16* params, int64_t code_bytes, int64_t cols,
                 const int64_t* ids, int64_t n_ids, int64_t rows_per_block, int64_t HD, T* out) {
  at::parallel_for(0, n_ids * rows_per_block, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(HD);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t r = ids[w / rows_per_block] * rows_per_block + w % rows_per_block;
      decode_row(c, group, signs, codes + r * code_bytes, params + r * cols, HD, buf.data());
      for (int64_t i = 0; i < HD; ++i) out[w * HD + i] = static_cast<T>(buf[i]);
    }
  });
}

}  // namespace

// k_codes/v_codes [NB, BS, KVH, bytes] and k_params/v_params [NB, BS, KVH, cols] of one
// layer (kv/codecs/per_token.py); block_ids any shape; group and rotation_signs as
// codec_write. Returns K and V as block_ids.shape + [BS, KVH, HD] in `dtype`.
std::vector<torch::Tensor> codec_gather(std::string kind, int64_t group, torch::Tensor k_codes,
                                        torch::Tensor v_codes, torch::Tensor k_params,
                                        torch::Tensor v_params,
                                        std::optional<torch::Tensor> rotation_signs,
                                        torch::Tensor block_ids, int64_t head_dim,
                                        c10::ScalarType dtype) {
  const Codec c = codec_kind(kind);
  TORCH_CHECK(c != Codec::kBF16 && c != Codec::kKivi2, "codec_gather: '", kind,
              "' is not a per-token codec");
  TORCH_CHECK(dtype == torch::kBFloat16 || dtype == torch::kFloat32, "dtype must be bfloat16 or float32");
  const int64_t HD = head_dim;
  if (c == Codec::kInt4 && group == 0) group = HD;
  TORCH_CHECK(HD > 0 && (c != Codec::kInt4 || (group > 0 && HD % group == 0 && group % 2 == 0)),
              "int4 group ", group, " must be even and divide head_dim ", HD);
  for (const auto& t : {k_codes, v_codes, k_params, v_params})
    TORCH_CHECK(t.is_contiguous() && t.dim() == 4, "codes and parameters must be contiguous [NB, BS, KVH, cols]");
  TORCH_CHECK(k_codes.sizes() == v_codes.sizes() && k_params.sizes() == v_params.sizes(),
              "K and V storage differ in shape");
  const int64_t NB = k_codes.size(0), BS = k_codes.size(1), KVH = k_codes.size(2);
  const int64_t code_bytes = k_codes.size(3) * k_codes.element_size();
  TORCH_CHECK(code_bytes == (c == Codec::kInt4 ? HD / 2 : HD), "codes of ", code_bytes,
              " bytes per row do not fit head_dim ", HD);
  const int64_t cols = c == Codec::kInt4 ? 2 * HD / group : 1;
  TORCH_CHECK(k_params.scalar_type() == torch::kBFloat16 && k_params.size(3) == cols,
              "parameters must be bfloat16 with ", cols, " per row");
  torch::Tensor signs;
  if (rotation_signs.has_value()) {
    TORCH_CHECK(c == Codec::kInt4, "rotation needs the int4 layout");
    signs = rotation_signs->to(torch::kFloat32).contiguous();
    TORCH_CHECK(signs.numel() == HD && (HD & (HD - 1)) == 0,
                "rotation_signs must be [head_dim], head_dim a power of two");
  }
  const torch::Tensor ids = block_ids.to(torch::kInt64).contiguous();
  const int64_t n = ids.numel();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < NB, "block id ", ip[i], " out of range [0, ", NB, ")");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.insert(shape.end(), {BS, KVH, HD});
  const float* sg = signs.defined() ? signs.data_ptr<float>() : nullptr;
  std::vector<torch::Tensor> out;
  for (const auto& [codes, params] : {std::pair{k_codes, k_params}, std::pair{v_codes, v_params}}) {
    torch::Tensor o = torch::empty(shape, torch::TensorOptions().dtype(dtype));
    const auto* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
    const auto* pp = params.data_ptr<c10::BFloat16>();
    if (dtype == torch::kBFloat16)
      gather_rows(c, group, sg, cp, pp, code_bytes, cols, ip, n, BS * KVH, HD, o.data_ptr<c10::BFloat16>());
    else
      gather_rows(c, group, sg, cp, pp, code_bytes, cols, ip, n, BS * KVH, HD, o.data_ptr<float>());
    out.push_back(o);
  }
  return out;
}
