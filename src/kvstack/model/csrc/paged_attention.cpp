// Paged decode attention for CPU (kvstack).
//
// One query token per request attends to its whole context, reading K and V in place
// from the paged cache [num_blocks, block_size, kv_heads, head_dim] through the
// request's block table: no gather, no copy (vLLM PagedAttention's idea, on CPU).
// Work is split over (request, kv head) pairs; the q heads of one GQA group share each
// K/V row, which is converted to float once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

template <typename T>
static void decode_kernel(const T* q, const T* kc, const T* vc, const int64_t* tables,
                          const int64_t* lens, T* out, int64_t D, int64_t H, int64_t KVH,
                          int64_t HD, int64_t BS, int64_t MB, float scale) {
  const int64_t G = H / KVH;
  at::parallel_for(0, D * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * HD), acc(G * HD), row(HD), scores;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t d = w / KVH, kh = w % KVH;
      const int64_t L = lens[d];
      scores.assign(G * L, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < HD; ++i)
          qf[g * HD + i] = static_cast<float>(q[(d * H + kh * G + g) * HD + i]) * scale;
      const int64_t* table = tables + d * MB;
      for (int64_t t = 0; t < L; ++t) {
        const T* k = kc + ((table[t / BS] * BS + t % BS) * KVH + kh) * HD;
        for (int64_t i = 0; i < HD; ++i) row[i] = static_cast<float>(k[i]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * HD;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < HD; ++i) s += qg[i] * row[i];
          scores[g * L + t] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float m = -INFINITY;
        for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          sg[t] = std::exp(sg[t] - m);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const T* v = vc + ((table[t / BS] * BS + t % BS) * KVH + kh) * HD;
        for (int64_t i = 0; i < HD; ++i) row[i] = static_cast<float>(v[i]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* ag = acc.data() + g * HD;
#pragma omp simd
          for (int64_t i = 0; i < HD; ++i) ag[i] += p * row[i];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < HD; ++i)
          out[(d * H + kh * G + g) * HD + i] = static_cast<T>(acc[g * HD + i]);
    }
  });
}

// q [D, H, HD]; k_cache/v_cache [NB, BS, KVH, HD]; block_tables [D, MB] int64;
// context_lens [D] int64. Returns [D, H, HD] in q's dtype.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  q = q.contiguous();
  block_tables = block_tables.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t D = q.size(0), H = q.size(1), HD = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), MB = block_tables.size(1);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == HD, "head shapes do not match");
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kBFloat16) {
    using T = c10::BFloat16;
    decode_kernel<T>(q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                     block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                     out.data_ptr<T>(), D, H, KVH, HD, BS, MB, static_cast<float>(scale));
  } else if (q.scalar_type() == torch::kFloat32) {
    decode_kernel<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                         v_cache.data_ptr<float>(), block_tables.data_ptr<int64_t>(),
                         context_lens.data_ptr<int64_t>(), out.data_ptr<float>(), D, H, KVH,
                         HD, BS, MB, static_cast<float>(scale));
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports bfloat16 and float32");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention reading a paged KV cache in place");
}
