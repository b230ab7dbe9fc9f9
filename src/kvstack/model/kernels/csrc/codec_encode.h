// The per-token codecs' encoders (int8, fp8 e4m3 / e5m2, int4, rotated4) for one K or V
// row of head_dim channels: the formulas at the top of codec_write.cpp, bit for bit the
// codec's PyTorch `encode`. Shared by codec_write.cpp (the KV write op) and
// decode_team.cpp (the same write as a phase of its region, team_codec.h).
#pragma once
#include <algorithm>
#include <cmath>

#include "codec_rows.h"

namespace codec_encode {

// Symmetric per-row codes (int8, fp8): returns the bf16 scale.
template <Codec C>
inline c10::BFloat16 encode_symmetric(const float* x, int64_t n, uint8_t* out) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float fmax = C == Codec::kInt8 ? 127.f : C == Codec::kFP8E4M3 ? 448.f : 57344.f;
  const c10::BFloat16 sb(std::max(amax / fmax, 1e-12f));
  const float s = static_cast<float>(sb);
  for (int64_t i = 0; i < n; ++i) {
    const float y = x[i] / s;
    if constexpr (C == Codec::kInt8) {
      out[i] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(std::nearbyint(y), -127.f, 127.f)));
    } else if constexpr (C == Codec::kFP8E4M3) {
      out[i] = c10::Float8_e4m3fn(std::clamp(y, -fmax, fmax)).x;
    } else {
      out[i] = c10::Float8_e5m2(std::clamp(y, -fmax, fmax)).x;
    }
  }
  return sb;
}

// Asymmetric 4-bit codes in groups of `group` channels: (scale, zero) per group.
inline void encode_int4(const float* x, int64_t n, int64_t group, uint8_t* out, c10::BFloat16* params) {
  std::fill(out, out + n / 2, 0);
  for (int64_t g0 = 0; g0 < n; g0 += group) {
    float lo = x[g0], hi = x[g0];
    for (int64_t i = g0; i < g0 + group; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
    const c10::BFloat16 sb(std::max((hi - lo) / 15.f, 1e-12f)), zb(lo);
    const float s = static_cast<float>(sb), z = static_cast<float>(zb);
    for (int64_t i = g0; i < g0 + group; ++i) {
      const float q = std::clamp(std::nearbyint((x[i] - z) / s), 0.f, 15.f);
      out[i / 2] |= static_cast<uint8_t>(static_cast<int>(q) << (4 * (i & 1)));
    }
    params[2 * (g0 / group)] = sb;
    params[2 * (g0 / group) + 1] = zb;
  }
}

// Row x (HD floats; rotated4 rotates it in place first) encoded into codes and params.
inline void encode_row(Codec kind, int64_t group, const float* signs, float* x, int64_t HD,
                       uint8_t* codes, c10::BFloat16* params) {
  switch (kind) {
    case Codec::kInt8: params[0] = encode_symmetric<Codec::kInt8>(x, HD, codes); break;
    case Codec::kFP8E4M3: params[0] = encode_symmetric<Codec::kFP8E4M3>(x, HD, codes); break;
    case Codec::kFP8E5M2: params[0] = encode_symmetric<Codec::kFP8E5M2>(x, HD, codes); break;
    case Codec::kInt4:
      if (signs) rotate(x, signs, HD, false);
      encode_int4(x, HD, group, codes, params);
      break;
    default: TORCH_CHECK(false, "codec_write: not a per-token codec");
  }
}

}  // namespace codec_encode
