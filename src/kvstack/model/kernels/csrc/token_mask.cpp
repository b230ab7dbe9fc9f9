// apply_token_bitmask: structured outputs' grammar mask applied to a batch of logits.
//
//   logits   float32 [B, V]           written in place
//   rows     int64   [R]              batch row of each mask row (each in [0, B))
//   bitmask  int32   [R, ceil(V/32)]  bit t % 32 of word t / 32 set = token t allowed
//
// Every token of row rows[i] whose bit is clear becomes -inf; bits past V are ignored.
// A word with all bits set (most words of a permissive grammar) is skipped whole. This
// is the same result as model/structured/bitmask.py's PyTorch path (the tested
// reference), without materializing a [R, V] bool mask. Rows are checked before writing.
#include <cstdint>
#include <limits>

#include "kvstack_ops.h"

void apply_token_bitmask(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask) {
  TORCH_CHECK(logits.is_cpu() && rows.is_cpu() && bitmask.is_cpu(), "CPU tensors only");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 &&
                  logits.is_contiguous(),
              "logits must be a contiguous float32 [B, V] tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64, "rows must be int64 [R]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 &&
                  bitmask.is_contiguous(),
              "bitmask must be a contiguous int32 [R, W] tensor");
  const int64_t B = logits.size(0), V = logits.size(1), R = rows.size(0);
  const int64_t W = bitmask.size(1);
  TORCH_CHECK(bitmask.size(0) == R, "bitmask has ", bitmask.size(0), " rows, rows has ", R);
  TORCH_CHECK(W * 32 >= V, "bitmask covers ", W * 32, " tokens, the vocabulary has ", V);
  auto rows_c = rows.contiguous();
  const int64_t* row_ids = rows_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < B, "mask row ", i, " targets batch row ",
                row_ids[i], " outside [0, ", B, ")");
  }
  float* x = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float neg_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static) if (R * V >= (int64_t{1} << 22))
  for (int64_t i = 0; i < R; ++i) {
    float* row = x + row_ids[i] * V;
    const uint32_t* words = bits + i * W;
    for (int64_t w = 0; w * 32 < V; ++w) {
      const uint32_t word = words[w];
      if (word == 0xFFFFFFFFu) continue;
      const int64_t base = w * 32;
      const int64_t n = V - base < 32 ? V - base : 32;
      for (int64_t b = 0; b < n; ++b) {
        if (!((word >> b) & 1u)) row[base + b] = neg_inf;
      }
    }
  }
}
