// Declarations of kvstack's CPU kernels (bound to Python in bindings.cpp).
#pragma once
#include <torch/types.h>

#include <optional>
#include <string>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t window);
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, std::optional<torch::Tensor> table_index,
                              torch::Tensor context_lens, double scale, int64_t window);
torch::Tensor paged_attention_codec(
    torch::Tensor q, std::string kind, int64_t group, torch::Tensor k_codes,
    torch::Tensor v_codes, torch::Tensor k_params, torch::Tensor v_params,
    std::optional<torch::Tensor> res_k, std::optional<torch::Tensor> res_v,
    std::optional<torch::Tensor> residual_of, std::optional<torch::Tensor> rotation_signs,
    torch::Tensor block_tables,
    std::optional<torch::Tensor> table_index, torch::Tensor context_lens, double scale,
    int64_t window);
void codec_write(std::string kind, int64_t group, torch::Tensor k, torch::Tensor v,
                 torch::Tensor slots, torch::Tensor k_codes, torch::Tensor v_codes,
                 torch::Tensor k_params, torch::Tensor v_params,
                 std::optional<torch::Tensor> rotation_signs);
void kivi2_write(torch::Tensor x, torch::Tensor rows, torch::Tensor tmp, torch::Tensor res,
                 torch::Tensor old_pos, torch::Tensor old_slots, torch::Tensor done_pos,
                 torch::Tensor done_blocks, torch::Tensor live_pos, torch::Tensor live_slots,
                 torch::Tensor codes, torch::Tensor params, bool per_channel);
std::vector<torch::Tensor> codec_gather(std::string kind, int64_t group, torch::Tensor k_codes,
                                        torch::Tensor v_codes, torch::Tensor k_params,
                                        torch::Tensor v_params,
                                        std::optional<torch::Tensor> rotation_signs,
                                        torch::Tensor block_ids, int64_t head_dim,
                                        c10::ScalarType dtype,
                                        std::optional<torch::Tensor> res_k,
                                        std::optional<torch::Tensor> res_v,
                                        std::optional<torch::Tensor> residual_of);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps);
torch::Tensor silu_and_mul(torch::Tensor gu);
void rope_and_cache(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos,
                    torch::Tensor sin, std::optional<torch::Tensor> k_cache,
                    std::optional<torch::Tensor> v_cache, std::optional<torch::Tensor> slots,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);
torch::Tensor greedy_argmax(torch::Tensor logits);
void apply_token_bitmask(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask);
bool amx_linear_available();
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features);
bool bf16_linear_available();
std::string bf16_linear_isa();
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features);
bool causal_attention_available();
torch::Tensor causal_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               int64_t num_seqs, double scale,
                               const c10::optional<torch::Tensor>& positions);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                           std::optional<torch::Tensor> min, int64_t group, int64_t bits);
torch::Tensor quant_dequant(torch::Tensor q, torch::Tensor scale, std::optional<torch::Tensor> min,
                            int64_t group, int64_t bits, c10::ScalarType dtype);
bool quant_linear_vnni_ok(int64_t in_features, int64_t group, int64_t bits);
torch::Tensor quant_linear_vnni(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                                std::optional<torch::Tensor> min, int64_t group, int64_t bits);
bool quant_gemv_ok(int64_t out_features, int64_t in_features, int64_t group, int64_t bits);
torch::Tensor quant_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scale,
                         std::optional<torch::Tensor> min, int64_t group, int64_t bits);
std::vector<torch::Tensor> decode_stack(
    torch::Tensor residual, at::TensorList in_norms, at::TensorList post_norms,
    at::TensorList codes, at::TensorList scales,
    const c10::List<std::optional<at::Tensor>>& mins, at::IntArrayRef groups,
    at::IntArrayRef bits, at::IntArrayRef kinds, torch::Tensor positions, torch::Tensor cos,
    torch::Tensor sin,
    at::TensorList k_caches, at::TensorList v_caches, torch::Tensor slots,
    torch::Tensor block_tables, std::optional<torch::Tensor> table_index,
    torch::Tensor context_lens, double scale, at::IntArrayRef windows, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps);
std::vector<torch::Tensor> decode_team(
    torch::Tensor residual, at::TensorList in_norms, at::TensorList post_norms,
    at::TensorList codes, at::TensorList scales,
    const c10::List<std::optional<at::Tensor>>& mins, at::IntArrayRef groups,
    at::IntArrayRef bits, at::IntArrayRef kinds, torch::Tensor positions, torch::Tensor cos,
    torch::Tensor sin, at::TensorList k_caches, at::TensorList v_caches, torch::Tensor slots,
    torch::Tensor block_tables, std::optional<torch::Tensor> table_index,
    torch::Tensor context_lens, double scale, at::IntArrayRef windows, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, std::string codec, int64_t codec_group,
    at::TensorList k_params, at::TensorList v_params, std::optional<torch::Tensor> rotation_signs);
bool decode_team_supported(at::IntArrayRef kinds, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, std::string codec, int64_t codec_group);
