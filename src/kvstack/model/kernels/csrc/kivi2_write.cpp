// One layer's K or V write of the kivi2 codec (kv/codecs/kivi.py, Kivi2Codec.write) in
// C++, bit for bit (tests/model/test_kivi2_write.py): the step's touched blocks are
// assembled at full precision in `tmp` (the residual rows of blocks that were filling,
// then this step's rows), the blocks this step filled are quantized to 2-bit codes, and
// the blocks still filling go back to their residual slots:
//
//   tmp[old_pos[i]]   = res[old_slots[i]]          (whole blocks)
//   tmp rows[t]       = x[t]                       (token rows of tmp viewed [n * bs, H, d])
//   keys   (per channel over the block's bs tokens, as quant_asym(full, 2, 1)):
//            s = bf16(max((hi - lo) / 3, 1e-12)), z = bf16(lo),
//            q = clamp(round((x - z) / s), 0, 3)  -> params[b, h, c] = (s, z)
//   values (per token, groups of 32 channels, as quant_asym(..., 2, -1)):
//            the same per group                   -> params[b, i, h] = (s0, z0, s1, z1 ...)
//   codes[b, i, h, c / 4] = q_c0 | q_c1 << 2 | q_c2 << 4 | q_c3 << 6   (bits.pack)
//   res[live_slots[j]] = tmp[live_pos[j]]
//
// The same float32 operations in the same order as PyTorch's: (hi - lo) / 3 and
// (x - z) / s divide, round half to even (std::nearbyint), bf16 round to nearest even.
// One PyTorch op per stage becomes one pass; the Python write took ~10 ops a layer.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kvstack_ops.h"

namespace {

constexpr int64_t kVGroup = 32;

struct Quant {
  float s, z;
  c10::BFloat16 sb, zb;
};

Quant quant_params(float lo, float hi) {
  const c10::BFloat16 sb(std::max((hi - lo) / 3.f, 1e-12f)), zb(lo);
  return {static_cast<float>(sb), static_cast<float>(zb), sb, zb};
}

uint8_t code2(float x, const Quant& p) {
  return static_cast<uint8_t>(std::clamp(std::nearbyint((x - p.z) / p.s), 0.f, 3.f));
}

// Keys of one full block: src [bs, H, d] -> codes [bs, H, d / 4], params [H, d, 2].
template <typename T>
void quant_keys(const T* src, int64_t bs, int64_t H, int64_t d, uint8_t* codes,
                c10::BFloat16* params) {
  std::memset(codes, 0, bs * H * d / 4);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t c = 0; c < d; ++c) {
      float lo = static_cast<float>(src[h * d + c]), hi = lo;
      for (int64_t i = 1; i < bs; ++i) {
        const float x = static_cast<float>(src[(i * H + h) * d + c]);
        lo = std::min(lo, x), hi = std::max(hi, x);
      }
      const Quant p = quant_params(lo, hi);
      params[(h * d + c) * 2] = p.sb;
      params[(h * d + c) * 2 + 1] = p.zb;
      for (int64_t i = 0; i < bs; ++i) {
        const uint8_t q = code2(static_cast<float>(src[(i * H + h) * d + c]), p);
        codes[(i * H + h) * (d / 4) + c / 4] |= static_cast<uint8_t>(q << (2 * (c % 4)));
      }
    }
}

// Values of one full block: each token's head vector in groups of 32 channels;
// params [bs, H, d / 32 * 2].
template <typename T>
void quant_values(const T* src, int64_t bs, int64_t H, int64_t d, uint8_t* codes,
                  c10::BFloat16* params) {
  std::memset(codes, 0, bs * H * d / 4);
  for (int64_t r = 0; r < bs * H; ++r) {
    const T* x = src + r * d;
    for (int64_t g = 0; g < d / kVGroup; ++g) {
      const int64_t c0 = g * kVGroup;
      float lo = static_cast<float>(x[c0]), hi = lo;
      for (int64_t c = c0 + 1; c < c0 + kVGroup; ++c) {
        const float v = static_cast<float>(x[c]);
        lo = std::min(lo, v), hi = std::max(hi, v);
      }
      const Quant p = quant_params(lo, hi);
      params[r * (d / kVGroup * 2) + 2 * g] = p.sb;
      params[r * (d / kVGroup * 2) + 2 * g + 1] = p.zb;
      for (int64_t c = c0; c < c0 + kVGroup; ++c)
        codes[r * (d / 4) + c / 4] |= static_cast<uint8_t>(code2(static_cast<float>(x[c]), p) << (2 * (c % 4)));
    }
  }
}

const int64_t* index_ptr(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.dim() == 1 && t.is_contiguous(), what,
              " must be a contiguous int64 vector");
  return t.data_ptr<int64_t>();
}

template <typename T>
void write_layer(const torch::Tensor& x, const int64_t* rows, torch::Tensor& tmp, torch::Tensor& res,
                 const int64_t* old_pos, const int64_t* old_slots, int64_t n_old,
                 const int64_t* done_pos, const int64_t* done_blocks, int64_t n_done,
                 const int64_t* live_pos, const int64_t* live_slots, int64_t n_live,
                 torch::Tensor& codes, torch::Tensor& params, bool per_channel) {
  const int64_t bs = tmp.size(1), H = tmp.size(2), d = tmp.size(3), blk = bs * H * d;
  T* tp = tmp.data_ptr<T>();
  T* rp = res.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  for (int64_t i = 0; i < n_old; ++i)
    std::memcpy(tp + old_pos[i] * blk, rp + old_slots[i] * blk, blk * sizeof(T));
  for (int64_t t = 0; t < x.size(0); ++t)
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(tp + (rows[t] * H + h) * d, xp + t * x.stride(0) + h * x.stride(1), d * sizeof(T));
  uint8_t* cp = codes.data_ptr<uint8_t>();
  c10::BFloat16* pp = params.data_ptr<c10::BFloat16>();
  const int64_t code_blk = bs * H * d / 4, param_blk = per_channel ? H * d * 2 : bs * H * (d / kVGroup * 2);
  at::parallel_for(0, n_done, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const T* src = tp + done_pos[j] * blk;
      const int64_t b = done_blocks[j];
      if (per_channel)
        quant_keys(src, bs, H, d, cp + b * code_blk, pp + b * param_blk);
      else
        quant_values(src, bs, H, d, cp + b * code_blk, pp + b * param_blk);
    }
  });
  for (int64_t j = 0; j < n_live; ++j)
    std::memcpy(rp + live_slots[j] * blk, tp + live_pos[j] * blk, blk * sizeof(T));
}

}  // namespace

// x [T, H, d] (rows with unit inner stride), rows [T]; tmp [n, bs, H, d] zeros (out);
// res [cap, bs, H, d] (in/out), same dtype as x and tmp (bf16 or float32); the plan's
// index vectors (kivi.py _WritePlan); codes [N, bs, H, d / 4] uint8; params bf16: keys
// [N, H, d, 2] (per_channel), values [N, bs, H, d / 32 * 2].
void kivi2_write(torch::Tensor x, torch::Tensor rows, torch::Tensor tmp, torch::Tensor res,
                 torch::Tensor old_pos, torch::Tensor old_slots, torch::Tensor done_pos,
                 torch::Tensor done_blocks, torch::Tensor live_pos, torch::Tensor live_slots,
                 torch::Tensor codes, torch::Tensor params, bool per_channel) {
  TORCH_CHECK(tmp.dim() == 4 && tmp.is_contiguous() && res.dim() == 4 && res.is_contiguous(),
              "kivi2_write: tmp and res must be contiguous [*, bs, H, d]");
  TORCH_CHECK(res.sizes().slice(1) == tmp.sizes().slice(1), "kivi2_write: tmp and res shapes");
  const int64_t bs = tmp.size(1), H = tmp.size(2), d = tmp.size(3);
  TORCH_CHECK(x.dim() == 3 && x.size(1) == H && x.size(2) == d && x.stride(2) == 1,
              "kivi2_write: x must be [T, H, d] with contiguous head rows");
  TORCH_CHECK(x.scalar_type() == tmp.scalar_type() && res.scalar_type() == tmp.scalar_type(),
              "kivi2_write: x, tmp and res must share one dtype");
  TORCH_CHECK(d % kVGroup == 0, "kivi2_write: head_dim must be a multiple of 32");
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 4 &&
                  codes.size(1) == bs && codes.size(2) == H && codes.size(3) == d / 4,
              "kivi2_write: codes must be contiguous uint8 [N, bs, H, d / 4]");
  const int64_t N = codes.size(0);
  TORCH_CHECK(params.scalar_type() == torch::kBFloat16 && params.is_contiguous() &&
                  params.numel() == N * (per_channel ? H * d * 2 : bs * H * (d / kVGroup * 2)),
              "kivi2_write: params must be contiguous bf16 of the codec's layout");
  const int64_t n = tmp.size(0), cap = res.size(0);
  const int64_t* rp = index_ptr(rows, "rows");
  TORCH_CHECK(rows.numel() == x.size(0), "kivi2_write: one row index per token");
  for (int64_t t = 0; t < rows.numel(); ++t)
    TORCH_CHECK(rp[t] >= 0 && rp[t] < n * bs, "kivi2_write: row ", rp[t], " outside tmp");
  auto check = [](const torch::Tensor& pos, const torch::Tensor& dst, int64_t n_pos, int64_t n_dst,
                  const char* what) {
    const int64_t* p = index_ptr(pos, what);
    const int64_t* q = index_ptr(dst, what);
    TORCH_CHECK(pos.numel() == dst.numel(), "kivi2_write: ", what, " lengths differ");
    for (int64_t i = 0; i < pos.numel(); ++i)
      TORCH_CHECK(p[i] >= 0 && p[i] < n_pos && q[i] >= 0 && q[i] < n_dst, "kivi2_write: ", what,
                  " index out of range");
  };
  check(old_pos, old_slots, n, cap, "old_pos/old_slots");
  check(done_pos, done_blocks, n, N, "done_pos/done_blocks");
  check(live_pos, live_slots, n, cap, "live_pos/live_slots");
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    write_layer<T>(x, rp, tmp, res, old_pos.data_ptr<int64_t>(), old_slots.data_ptr<int64_t>(),
                   old_pos.numel(), done_pos.data_ptr<int64_t>(), done_blocks.data_ptr<int64_t>(),
                   done_pos.numel(), live_pos.data_ptr<int64_t>(), live_slots.data_ptr<int64_t>(),
                   live_pos.numel(), codes, params, per_channel);
  };
  if (tmp.scalar_type() == torch::kBFloat16)
    run(c10::BFloat16());
  else if (tmp.scalar_type() == torch::kFloat32)
    run(float());
  else
    TORCH_CHECK(false, "kivi2_write: dtype must be bfloat16 or float32");
}
