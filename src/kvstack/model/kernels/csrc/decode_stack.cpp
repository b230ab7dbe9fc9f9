// decode_stack: a step's whole decoder stack in one call, for steps whose every row goes to
// the C++ paged attention and whose every linear runs one of kvstack's own kernels at this
// row count: a tiled quant_gemv weight, or a packed bf16 weight of bf16_linear or
// amx_linear (why:
// one request decoding with quantized weights runs ~120 linears and ~250 small ops a
// token; each Python call and dispatch costs ~1-2 us, ~0.5 ms a token in all).
//
// It calls the very kernels the Python loop of model/arch/decoder.py calls, in the same order
// and on the same tensors, so its results are the Python path's bit for bit:
//
//   x = rms_norm(res, in_norm[0])                              (layer 0)
//   per layer l:
//     x, res = add_rms_norm(h, res, in_norm[l])                (l > 0: res += h, in place)
//     qkv = gemv(x, W_qkv);  rope_and_cache(qkv -> K/V cache of l at slots)
//     a = paged_attention(q (a view of qkv), K_l, V_l, tables, index, lens, window_l)
//     x, res = add_rms_norm(gemv(a, W_o), res, post_norm[l])
//     h = gemv(silu_and_mul(gemv(x, W_gate_up)), W_down)
//   returns [h, res]  (the final norm and the lm_head stay in Python)
//
// Linear i of layer l is entry 4 l + i of the lists (qkv, o, gate_up, down); kinds[j] says
// which kernel: 0 quant_gemv(x, codes, scales, mins, groups, bits), 1 bf16_linear(x,
// codes = the packed weight, groups = out_features), 2 amx_linear (the same arguments).
#include <optional>
#include <vector>

#include "kvstack_ops.h"

namespace {

struct Linears {
  at::TensorList codes, scales;
  const c10::List<std::optional<at::Tensor>>& mins;
  at::IntArrayRef groups, bits, kinds;

  torch::Tensor operator()(const torch::Tensor& x, size_t i) const {
    switch (kinds[i]) {
      case 0:
        return quant_gemv(x, codes[i], scales[i], mins.get(i), groups[i], bits[i]);
      case 1:
        return bf16_linear(x, codes[i], groups[i]);
      case 2:
        return amx_linear(x, codes[i], groups[i]);
      default:
        TORCH_CHECK(false, "decode_stack: unknown linear kind ", kinds[i]);
    }
  }
};

}  // namespace

std::vector<torch::Tensor> decode_stack(
    torch::Tensor residual, at::TensorList in_norms, at::TensorList post_norms,
    at::TensorList codes, at::TensorList scales,
    const c10::List<std::optional<at::Tensor>>& mins, at::IntArrayRef groups,
    at::IntArrayRef bits, at::IntArrayRef kinds, torch::Tensor positions, torch::Tensor cos,
    torch::Tensor sin, at::TensorList k_caches, at::TensorList v_caches, torch::Tensor slots,
    torch::Tensor block_tables, std::optional<torch::Tensor> table_index,
    torch::Tensor context_lens, double scale, at::IntArrayRef windows, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps) {
  const size_t layers = in_norms.size();
  TORCH_CHECK(layers > 0 && post_norms.size() == layers && k_caches.size() == layers &&
                  v_caches.size() == layers && windows.size() == layers,
              "decode_stack: one norm pair, K/V cache and window per layer");
  TORCH_CHECK(codes.size() == 4 * layers && scales.size() == 4 * layers &&
                  mins.size() == 4 * layers && groups.size() == 4 * layers &&
                  bits.size() == 4 * layers && kinds.size() == 4 * layers,
              "decode_stack: four linears per layer");
  const Linears gemv{codes, scales, mins, groups, bits, kinds};
  const int64_t t = residual.size(0);
  const int64_t q_size = num_heads * head_dim;
  torch::Tensor h;
  torch::Tensor x = rms_norm(residual, in_norms[0], eps);
  for (size_t l = 0; l < layers; ++l) {
    if (l > 0) {
      add_rms_norm(h, residual, in_norms[l], eps);
      x = h;
    }
    torch::Tensor qkv = gemv(x, 4 * l);
    rope_and_cache(qkv, positions, cos, sin, k_caches[l], v_caches[l], slots, num_heads,
                   num_kv_heads, head_dim);
    torch::Tensor q =
        qkv.view({t, num_heads + 2 * num_kv_heads, head_dim}).slice(1, 0, num_heads);
    torch::Tensor a = paged_attention(q, k_caches[l], v_caches[l], block_tables, table_index,
                                      context_lens, scale, windows[l]);
    x = gemv(a.reshape({t, q_size}), 4 * l + 1);
    add_rms_norm(x, residual, post_norms[l], eps);
    torch::Tensor act = silu_and_mul(gemv(x, 4 * l + 2));
    h = gemv(act, 4 * l + 3);
  }
  return {h, residual};
}
