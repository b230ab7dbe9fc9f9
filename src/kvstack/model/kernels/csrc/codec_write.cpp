// The KV write of the per-token codecs (kv/codecs/: int8, fp8 e4m3 / e5m2, int4, rotated4)
// in C++: each new token's K and V rows of each KV head are encoded and stored at their
// slots, as the codec's PyTorch `encode` + `index_copy_` do, bit for bit (tested in
// tests/model/test_codec_write.py): the same float32 operations in the same order, the
// scales rounded to bf16 where PyTorch rounds them, round half to even.
//
//   int8      s = bf16(max(amax / 127, 1e-12));      code = clamp(round(x / s), -127, 127)
//   fp8       s = bf16(max(amax / FMAX, 1e-12));     code = fp8(clamp(x / s, -FMAX, FMAX))
//   int4      per group: s = bf16(max((hi - lo) / 15, 1e-12)), z = bf16(lo),
//             code = clamp(round((x - z) / s), 0, 15), two codes a byte, low nibble first
//   rotated4  int4 with one group per head vector, of x R (codec_rows.h rotate(): the
//             same fast Walsh-Hadamard transform the Python encode runs)
//
// One task per (token, KV head) row; a step's decode rows (one token each) cost what
// the fused RoPE + cache write of an unencoded cache costs, not ~10 PyTorch ops a layer.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "codec_encode.h"
#include "codec_rows.h"
#include "kvstack_ops.h"

namespace {

struct WriteTarget {
  uint8_t* codes;
  c10::BFloat16* params;
  int64_t code_bytes, param_cols;
};

template <typename T>
void write_rows(Codec kind, int64_t group, const float* signs, const T* x, int64_t row_stride,
                const int64_t* slots, int64_t rows, int64_t KVH, int64_t HD, WriteTarget dst) {
  at::parallel_for(0, rows * KVH, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(HD);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t t = w / KVH, h = w % KVH;
      const T* src = x + t * row_stride + h * HD;
      for (int64_t i = 0; i < HD; ++i) buf[i] = static_cast<float>(src[i]);
      const int64_t r = slots[t] * KVH + h;
      uint8_t* codes = dst.codes + r * dst.code_bytes;
      c10::BFloat16* params = dst.params + r * dst.param_cols;
      codec_encode::encode_row(kind, group, signs, buf.data(), HD, codes, params);
    }
  });
}

void check_rows(const torch::Tensor& x, const torch::Tensor& ref, const char* what) {
  TORCH_CHECK(x.dim() == 3 && x.sizes() == ref.sizes(), what, " must be [T, kv_heads, head_dim] like k");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), what, " rows must be contiguous per token");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32,
              what, " must be bfloat16 or float32");
  TORCH_CHECK(x.scalar_type() == ref.scalar_type(), "k and v dtypes differ");
}

}  // namespace

// k, v [T, KVH, HD] (bf16 or float32; rows may be strided, as views into a fused qkv);
// slots [T]; k_codes/v_codes [NB, BS, KVH, bytes] and k_params/v_params [NB, BS, KVH,
// cols] of one layer, as kv/codecs/per_token.py stores them; group: int4's channels per
// (scale, zero) pair (0: the whole head, rotated4); rotation_signs: rotated4's [HD] signs.
void codec_write(std::string kind, int64_t group, torch::Tensor k, torch::Tensor v,
                 torch::Tensor slots, torch::Tensor k_codes, torch::Tensor v_codes,
                 torch::Tensor k_params, torch::Tensor v_params,
                 std::optional<torch::Tensor> rotation_signs) {
  const Codec c = codec_kind(kind);
  check_rows(k, k, "k");
  check_rows(v, k, "v");
  const int64_t T = k.size(0), KVH = k.size(1), HD = k.size(2);
  const auto [grp, code_bytes, cols] =
      check_per_token_storage(c, group, HD, k_codes, v_codes, k_params, v_params, rotation_signs);
  group = grp;
  TORCH_CHECK(k_codes.size(2) == KVH, "codes hold ", k_codes.size(2), " KV heads, k has ", KVH);
  torch::Tensor signs;
  if (rotation_signs.has_value()) signs = rotation_signs->to(torch::kFloat32).contiguous();
  slots = slots.to(torch::kInt64).contiguous();
  TORCH_CHECK(slots.numel() == T, "one slot per row");
  const int64_t num_slots = k_codes.size(0) * k_codes.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "KV slot ", sp[t], " out of range [0, ", num_slots, ")");
  const float* sg = signs.defined() ? signs.data_ptr<float>() : nullptr;
  const std::pair<torch::Tensor, WriteTarget> jobs[2] = {
      {k, {reinterpret_cast<uint8_t*>(k_codes.data_ptr()), k_params.data_ptr<c10::BFloat16>(), code_bytes, cols}},
      {v, {reinterpret_cast<uint8_t*>(v_codes.data_ptr()), v_params.data_ptr<c10::BFloat16>(), code_bytes, cols}},
  };
  for (const auto& [x, dst] : jobs) {
    if (x.scalar_type() == torch::kBFloat16)
      write_rows(c, group, sg, x.data_ptr<c10::BFloat16>(), x.stride(0), sp, T, KVH, HD, dst);
    else
      write_rows(c, group, sg, x.data_ptr<float>(), x.stride(0), sp, T, KVH, HD, dst);
  }
}
