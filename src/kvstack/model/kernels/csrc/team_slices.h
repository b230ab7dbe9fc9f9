// Slices of kvstack's kernels for decode_team.cpp: the per-thread loops that the ops
// (quant_gemv, bf16_linear, rms_norm / add_rms_norm, silu_and_mul, rope_and_cache) run
// inside their own at::parallel_for, exported so that one parallel region can run a whole
// decode step. Each computes exactly what its op computes for the rows / column blocks
// it is given, and a row's (column's) result never depends on the range it sits in; no
// bounds are checked here (decode_team checks everything before its region starts).
#pragma once
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace team {
using BF = c10::BFloat16;

// Activations quantized for quant_gemv: int8 codes [M, K] (4 per int32), per 32-chunk scale
// dx and dx * sum(codes) xs [M, K/32], and dx * sum(codes) of each 16-half xh [M, K/16]
// (8-bit weights in groups of 16).
struct GemvAct {
  int32_t* xq;
  float* dx;
  float* xs;
  float* xh;
};

// A TiledWeight (model/quant/tiled.py) as quant_gemv takes it: N outputs, K inputs.
struct GemvWeight {
  const uint8_t* codes;
  const void* scale;
  const void* min;  // null for 8 bits
  bool half_scales;  // float16 scales/mins, else float32
  int64_t N, K, group, bits;
};

// quant_gemv.cpp
void gemv_quantize_rows(const BF* x, int64_t b, int64_t e, int64_t K, const GemvAct& a);
void gemv_tiles(const GemvAct& a, BF* out, const GemvWeight& w, int64_t M, int64_t b,
                int64_t e);
// bf16_linear.cpp (AVX512-BF16 builds): 16-column blocks [nb_begin, nb_end)
void bf16_columns(const BF* x, int64_t M, int64_t K, const BF* w, int64_t nb_begin,
                  int64_t nb_end, BF* y, int64_t N);
// fused_ops.cpp: rows [b, e)
void norm_rows(const BF* x, const BF* w, BF* out, int64_t b, int64_t e, int64_t n, float eps,
               BF* residual);
void silu_mul_rows(const BF* gu, BF* out, int64_t b, int64_t e, int64_t n);
void rope_cache_rows(BF* qkv, const int64_t* pos, const float* cos, const float* sin, BF* kc,
                     BF* vc, const int64_t* slots, int64_t b, int64_t e, int64_t H, int64_t KVH,
                     int64_t HD);
}  // namespace team
