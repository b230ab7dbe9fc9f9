// Greedy token choice straight from the lm_head's logits (kvstack).
//
// greedy_argmax(logits [R, V] bf16 | float32) -> [R] int64: the first index of each row's
// maximum, exactly torch.argmax of the row converted to float32 (bf16 -> float32 is
// exact, so no float32 copy of the logits is needed), or -1 when the row holds a NaN or
// its maximum is not finite (+inf, or every logit -inf): the sampler then takes its full
// path, which sanitizes such rows first. Two passes per row, parallel over rows: the
// maximum (and a NaN check), then the first position equal to it; 16 lanes at a time with
// AVX-512, 8 with AVX2.
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "kvstack_ops.h"
#include "simd.h"

namespace {

template <typename T>
int64_t row_argmax(const T* x, int64_t V) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
#if defined(KVSTACK_AVX512)
  __m512 mv = _mm512_set1_ps(m);
  __mmask16 bad = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = load16(x + i);
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mv = _mm512_max_ps(mv, v);
  }
  m = _mm512_reduce_max_ps(mv);
  nan = bad != 0;
#elif defined(KVSTACK_AVX2)
  __m256 mv = _mm256_set1_ps(m), bad = _mm256_setzero_ps();
  for (; i + 8 <= V; i += 8) {
    const __m256 v = load8(x + i);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mv = _mm256_max_ps(mv, v);  // a NaN lane may stick here: the row is refused below
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (const float v : lanes) m = std::max(m, v);
  nan = _mm256_movemask_ps(bad) != 0;
#endif
  for (; i < V; ++i) {
    const float v = static_cast<float>(x[i]);
    nan |= std::isnan(v);
    m = std::max(m, v);
  }
  if (nan || !std::isfinite(m)) return -1;
  i = 0;
#if defined(KVSTACK_AVX512)
  const __m512 target = _mm512_set1_ps(m);
  for (; i + 16 <= V; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(load16(x + i), target, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(static_cast<unsigned>(eq));
  }
#elif defined(KVSTACK_AVX2)
  const __m256 target = _mm256_set1_ps(m);
  for (; i + 8 <= V; i += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(load8(x + i), target, _CMP_EQ_OQ));
    if (eq) return i + __builtin_ctz(static_cast<unsigned>(eq));
  }
#endif
  for (; i < V; ++i)
    if (static_cast<float>(x[i]) == m) return i;
  return -1;  // unreachable: m is one of the row's values
}

template <typename T>
void argmax_rows(const T* x, int64_t* out, int64_t R, int64_t V) {
  at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) out[r] = row_argmax(x + r * V, V);
  });
}

}  // namespace

torch::Tensor greedy_argmax(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2, "logits must be [rows, vocab]");
  TORCH_CHECK(logits.size(1) > 0, "empty vocabulary");
  logits = logits.contiguous();
  const int64_t R = logits.size(0), V = logits.size(1);
  auto out = torch::empty({R}, logits.options().dtype(torch::kInt64));
  if (logits.scalar_type() == torch::kBFloat16)
    argmax_rows(logits.data_ptr<c10::BFloat16>(), out.data_ptr<int64_t>(), R, V);
  else if (logits.scalar_type() == torch::kFloat32)
    argmax_rows(logits.data_ptr<float>(), out.data_ptr<int64_t>(), R, V);
  else
    TORCH_CHECK(false, "greedy_argmax supports bfloat16 and float32");
  return out;
}
