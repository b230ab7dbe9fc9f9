// Registers kvstack's CPU kernels as the torch.ops.kvstack library (loaded by
// kvstack/model/kernels/loader.py), so they go through the dispatcher: torch.profiler names them
// (kvstack::rms_norm ...) and the schemas state which arguments are written in place.
#include <torch/library.h>

#include "kvstack_ops.h"

TORCH_LIBRARY(kvstack, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window=0) -> Tensor",
        &paged_decode_attention);
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor? table_index, Tensor context_lens, float scale, int window=0) -> Tensor",
        &paged_attention);
  m.def("paged_attention_codec(Tensor q, str kind, int group, Tensor k_codes, Tensor v_codes, "
        "Tensor k_params, Tensor v_params, Tensor? res_k, Tensor? res_v, Tensor? residual_of, "
        "Tensor? rotation_signs, Tensor block_tables, Tensor? table_index, Tensor context_lens, float scale, "
        "int window=0) -> Tensor",
        &paged_attention_codec);
  m.def("codec_write(str kind, int group, Tensor k, Tensor v, Tensor slots, Tensor(a!) k_codes, "
        "Tensor(b!) v_codes, Tensor(c!) k_params, Tensor(d!) v_params, Tensor? rotation_signs) -> ()",
        &codec_write);
  m.def("kivi2_write(Tensor x, Tensor rows, Tensor(a!) tmp, Tensor(b!) res, Tensor old_pos, "
        "Tensor old_slots, Tensor done_pos, Tensor done_blocks, Tensor live_pos, Tensor live_slots, "
        "Tensor(c!) codes, Tensor(d!) params, bool per_channel) -> ()",
        &kivi2_write);
  m.def("codec_gather(str kind, int group, Tensor k_codes, Tensor v_codes, Tensor k_params, "
        "Tensor v_params, Tensor? rotation_signs, Tensor block_ids, int head_dim, ScalarType dtype, "
        "Tensor? res_k=None, Tensor? res_v=None, Tensor? residual_of=None) -> Tensor[]",
        &codec_gather);
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor w, float eps) -> ()",
        &add_rms_norm);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &silu_and_mul);
  m.def("rope_and_cache(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(b!)? k_cache, Tensor(c!)? v_cache, Tensor? slots, int num_heads, "
        "int num_kv_heads, int head_dim) -> ()",
        &rope_and_cache);
  m.def("greedy_argmax(Tensor logits) -> Tensor", &greedy_argmax);
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor rows, Tensor bitmask) -> ()",
        &apply_token_bitmask);
  m.def("amx_linear_available() -> bool", &amx_linear_available);
  m.def("amx_linear(Tensor x, Tensor packed, int out_features) -> Tensor", &amx_linear);
  m.def("bf16_linear_available() -> bool", &bf16_linear_available);
  m.def("bf16_linear_isa() -> str", &bf16_linear_isa);
  m.def("bf16_linear(Tensor x, Tensor packed, int out_features) -> Tensor", &bf16_linear);
  m.def("causal_attention_available() -> bool", &causal_attention_available);
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, int num_seqs, float scale, "
        "Tensor? positions=None) -> Tensor",
        &causal_attention);
  m.def("quant_linear(Tensor x, Tensor q, Tensor scale, Tensor? min, int group, int bits) "
        "-> Tensor",
        &quant_linear);
  m.def("quant_dequant(Tensor q, Tensor scale, Tensor? min, int group, int bits, "
        "ScalarType dtype) -> Tensor",
        &quant_dequant);
  m.def("quant_linear_vnni(Tensor x, Tensor q, Tensor scale, Tensor? min, int group, int bits) "
        "-> Tensor",
        &quant_linear_vnni);
  m.def("quant_linear_vnni_ok(int in_features, int group, int bits) -> bool",
        &quant_linear_vnni_ok);
  m.def("quant_gemv(Tensor x, Tensor codes, Tensor scale, Tensor? min, int group, int bits) "
        "-> Tensor",
        &quant_gemv);
  m.def("decode_stack(Tensor(a!) residual, Tensor[] in_norms, Tensor[] post_norms, "
        "Tensor[] codes, Tensor[] scales, Tensor?[] mins, int[] groups, int[] bits, int[] kinds, "
        "Tensor positions, Tensor cos, Tensor sin, Tensor(b!)[] k_caches, "
        "Tensor(c!)[] v_caches, Tensor slots, Tensor block_tables, Tensor? table_index, "
        "Tensor context_lens, float scale, int[] windows, int num_heads, int num_kv_heads, "
        "int head_dim, float eps) -> Tensor[]",
        &decode_stack);
  m.def("decode_team(Tensor(a!) residual, Tensor[] in_norms, Tensor[] post_norms, "
        "Tensor[] codes, Tensor[] scales, Tensor?[] mins, int[] groups, int[] bits, int[] kinds, "
        "Tensor positions, Tensor cos, Tensor sin, Tensor(b!)[] k_caches, "
        "Tensor(c!)[] v_caches, Tensor slots, Tensor block_tables, Tensor? table_index, "
        "Tensor context_lens, float scale, int[] windows, int num_heads, int num_kv_heads, "
        "int head_dim, float eps, str codec, int codec_group, Tensor(d!)[] k_params, "
        "Tensor(e!)[] v_params, Tensor? rotation_signs) -> Tensor[]",
        &decode_team);
  m.def("decode_team_supported(int[] kinds, int num_heads, int num_kv_heads, int head_dim, "
        "str codec=\"\", int codec_group=0) -> bool",
        &decode_team_supported);
  m.def("quant_gemv_ok(int out_features, int in_features, int group, int bits) -> bool",
        &quant_gemv_ok);
}
