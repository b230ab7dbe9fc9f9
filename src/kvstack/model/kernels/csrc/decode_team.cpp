// decode_team: decode_stack's step (decode_stack.cpp) run inside ONE parallel region.
//
// Why (decoding with quantized weights): decode_stack calls ~10 kernels a layer, each opening its own
// at::parallel_for, allocating its output and checking its inputs; on the 2-core AMD EPYC
// Zen 5 one request's quant_gemv calls streamed their 66 MB of weights at ~43 GB/s, half of
// the ~90 GB/s this machine reads, most of the rest going to per-call work (activation
// quantization into fresh vectors, output allocation, fork/join, block-table checks
// repeated per layer). Here the team of threads enters one region for the whole step and
// meets at barriers (~0.2 us each) between the phases of a layer:
//
//   phase (split over the team)                           then
//   rows:   x = rms_norm(res) | res += h; x = rms_norm(res);  quantize x      barrier
//   tiles:  qkv = x W_qkv^T          (16-output tiles / 16-column blocks)     barrier
//   rows:   RoPE on q, k; k, v into layer l's cache at the rows' slots        barrier
//   items:  (partition, KV heads) attention partials, dynamic, longest first, barrier
//           a request's rows' items for one partition index and heads together
//   items:  (row, q head) partials merged into a                              barrier
//   rows:   quantize a                                     (quant_gemv only)  barrier
//   tiles:  o = a W_o^T                                                       barrier
//   rows:   res += o; x = rms_norm(res); quantize x                           barrier
//   tiles:  gu = x W_gate_up^T                                                barrier
//   rows:   act = silu(g) * u; quantize act                                   barrier
//   tiles:  h = act W_down^T                                                  barrier
//
// Every phase runs the very loops of the ops decode_stack calls (team_slices.h and
// paged_attention_hd64.h), with the attention split into the same partitions
// (split_decode_rows at the same thread count), and no row's, tile's or item's result
// depends on the thread that computes it: the outputs equal decode_stack's bit for bit
// (tests/model/test_decode_stack.py). Every input is checked before the region starts.
//
// Scope (decode_team_supported): bf16 activations and caches, head_dim 64 with 1..8 q
// heads per KV head on an AVX-512 build (the attention of paged_attention_hd64.h), every
// linear a quant_gemv tile weight (AVX512-VNNI) or a bf16_linear packed weight
// (AVX512-BF16). Otherwise (amx_linear, other head shapes, AVX2 builds) decode_stack runs.
// A per-token codec's cache (int8, fp8, int4, rotated4) takes the team too: its write,
// attention and merge phases are team_codec.h's (`codec` names its kernel layout, its
// codes come as k_caches / v_caches and its parameters as k_params / v_params).
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvstack_ops.h"
#include "paged_attention_hd64.h"
#include "team_slices.h"
#include "team_step.h"

#if defined(__AVX512F__)
namespace {

void linear(const Step& s, const Lin& w, const BF* x, BF* y, int tid, int nt) {
  const Share t = share(w.N / 16, tid, nt);
  if (t.b >= t.e) return;
  if (w.kind == 0)
    team::gemv_tiles(s.qa, y, w.q, s.M, t.b, t.e);
  else
    team::bf16_columns(x, s.M, w.K, w.packed, t.b, t.e, y, w.N);
}

void quantize(const Step& s, const Lin& w, const BF* x, Share rows) {
  if (w.kind == 0 && rows.b < rows.e) team::gemv_quantize_rows(x, rows.b, rows.e, w.K, s.qa);
}

void attention(const Step& s, size_t l) {
  const Plan& p = *s.plan[l];
  const DecodeSplit& sp = p.split;
  const int64_t families = static_cast<int64_t>(p.start.size()) - 1;
  const int64_t width = (s.H + 2 * s.KVH) * s.HD, per = s.heads_per_item;
  for (int64_t f = s.next[l].fetch_add(1); f < families; f = s.next[l].fetch_add(1)) {
    for (int64_t j = p.start[f]; j < p.start[f + 1]; ++j) {
      const int64_t w = p.items[j], pi = w / sp.units, u = w % sp.units, d = sp.row[pi];
      const int64_t* table = s.tables + table_row(s.tidx, d) * s.MB;
      const int64_t kh0 = u * per, kh1 = std::min(s.KVH, (u + 1) * per);
#if defined(KVSTACK_CODEC_AVX512)
      if (s.codec) {
        const team_codec::Layers& c = *s.codec;
        codec64::codec_item64(c.head, c.views[l], c.qf.data() + d * s.H * 64, table, kh0, kh1,
                              sp.t0[pi], sp.t1[pi], (s.lens[d] - 1) / s.BS,
                              static_cast<int>(s.H / s.KVH), s.scale, s.parts + pi * s.H);
        continue;
      }
#endif
      s.part(s.qkv + d * width, s.kc[l], s.vc[l], table, s.KVH, s.BS, kh0, kh1, sp.t0[pi],
             sp.t1[pi], s.scale, s.parts + pi * s.H);
    }
  }
}

// One decoder layer, by thread tid of nt (the phases of the header).
void layer(const Step& s, size_t l, int tid, int nt) {
  const Share rows = share(s.M, tid, nt);
  const Lin* w = &s.lins[4 * l];
  if (rows.b < rows.e) {
    if (l == 0)
      team::norm_rows(s.res, s.in_norm[0], s.x, rows.b, rows.e, s.Hd, s.eps, nullptr);
    else
      team::norm_rows(s.h, s.in_norm[l], s.x, rows.b, rows.e, s.Hd, s.eps, s.res);
  }
  quantize(s, w[0], s.x, rows);
#pragma omp barrier
  linear(s, w[0], s.x, s.qkv, tid, nt);
#pragma omp barrier
  if (rows.b < rows.e) {
    const bool raw = s.codec == nullptr;  // else the codec stores K and V (team_codec.h)
    team::rope_cache_rows(s.qkv, s.pos, s.cos, s.sin, raw ? s.kc[l] : nullptr,
                          raw ? s.vc[l] : nullptr, s.slots, rows.b, rows.e, s.H, s.KVH, s.HD);
#if defined(KVSTACK_CODEC_AVX512)
    if (!raw) team_codec::write_rows(*s.codec, l, s.qkv, s.slots, rows.b, rows.e, s.H, s.KVH);
#endif
  }
#pragma omp barrier
  attention(s, l);
#pragma omp barrier
  const Share items = share(s.M * s.H, tid, nt);
  const int64_t* first = s.plan[l]->split.first.data();
#if defined(KVSTACK_CODEC_AVX512)
  if (s.codec)
    codec64::codec_merge_rows(s.parts, first, s.H, s.codec->signs, items.b, items.e, s.attn);
  else
#endif
    merge_hd64(s.parts, first, s.H, items.b, items.e, s.attn);
#pragma omp barrier
  if (w[1].kind == 0) {
    quantize(s, w[1], s.attn, rows);
#pragma omp barrier
  }
  linear(s, w[1], s.attn, s.o, tid, nt);
#pragma omp barrier
  if (rows.b < rows.e)
    team::norm_rows(s.o, s.post_norm[l], s.x, rows.b, rows.e, s.Hd, s.eps, s.res);
  quantize(s, w[2], s.x, rows);
#pragma omp barrier
  linear(s, w[2], s.x, s.gu, tid, nt);
#pragma omp barrier
  if (rows.b < rows.e) team::silu_mul_rows(s.gu, s.act, rows.b, rows.e, s.I);
  quantize(s, w[3], s.act, rows);
#pragma omp barrier
  linear(s, w[3], s.act, s.h, tid, nt);
#pragma omp barrier
}

// Linear j as decode_team runs it, checked against its expected [N, K].
Lin make_lin(size_t j, at::TensorList codes, at::TensorList scales,
             const c10::List<std::optional<at::Tensor>>& mins, at::IntArrayRef groups,
             at::IntArrayRef bits, at::IntArrayRef kinds, int64_t N, int64_t K) {
  Lin w{kinds[j], {}, nullptr, N, K};
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "decode_team: linear ", j, " is [", N, ", ", K,
              "]: needs N % 16 == 0 and K % 32 == 0");
  const at::Tensor& c = codes[j];
  TORCH_CHECK(c.is_contiguous(), "decode_team: linear ", j, " is not contiguous");
  if (w.kind == 1) {
    TORCH_CHECK(c.scalar_type() == torch::kBFloat16 && c.numel() == N * K && groups[j] == N,
                "decode_team: linear ", j, " must be a packed bf16 [", N, ", ", K, "] weight");
    w.packed = c.data_ptr<BF>();
    return w;
  }
  TORCH_CHECK(w.kind == 0, "decode_team: linear kind ", w.kind, " is not 0 or 1");
  const int64_t b = bits[j], g = groups[j];
  TORCH_CHECK(quant_gemv_ok(N, K, g, b) && c.scalar_type() == torch::kUInt8 && c.dim() == 2 &&
                  c.size(0) == N / 16 && c.size(1) == K * b / 8 * 16,
              "decode_team: linear ", j, " must be tiled codes of a [", N, ", ", K, "] weight");
  const at::Tensor& sc = scales[j];
  const auto st = sc.scalar_type();
  TORCH_CHECK((st == torch::kFloat16 || st == torch::kFloat32) && sc.is_contiguous() &&
                  sc.dim() == 3 && sc.size(0) == N / 16 && sc.size(1) == K / g && sc.size(2) == 16,
              "decode_team: linear ", j, " has scales of the wrong shape");
  const std::optional<at::Tensor> mn = mins.get(j);
  TORCH_CHECK(mn.has_value() == (b == 4), "decode_team: mins are given exactly for 4 bits");
  if (mn.has_value())
    TORCH_CHECK(mn->scalar_type() == st && mn->is_contiguous() && mn->sizes() == sc.sizes(),
                "decode_team: linear ", j, " has mins unlike its scales");
  w.q = {c.data_ptr<uint8_t>(), sc.data_ptr(), mn.has_value() ? mn->data_ptr() : nullptr,
         st == torch::kFloat16, N, K, g, b};
  return w;
}

// Every index the step reads is inside its tensor: positions, slots, tables, lengths.
void check_indices(const Step& s, int64_t S, int64_t positions, int64_t NB) {
  const int64_t* L = s.lens;
  std::vector<int64_t> need(S, 0);
  for (int64_t r = 0; r < s.M; ++r) {
    TORCH_CHECK(s.pos[r] >= 0 && s.pos[r] < positions, "position ", s.pos[r], " outside [0, ",
                positions, ")");
    TORCH_CHECK(s.slots[r] >= 0 && s.slots[r] < NB * s.BS, "KV slot ", s.slots[r], " outside [0, ",
                NB * s.BS, ")");
    const int64_t t = table_row(s.tidx, r);
    TORCH_CHECK(t >= 0 && t < S, "table index ", t, " outside [0, ", S, ")");
    TORCH_CHECK(L[r] >= 1 && L[r] <= s.MB * s.BS, "context length ", L[r], " outside [1, ",
                s.MB * s.BS, "]");
    need[t] = std::max(need[t], L[r]);
  }
  for (int64_t t = 0; t < S; ++t)
    for (int64_t b = 0; b < (need[t] + s.BS - 1) / s.BS; ++b)
      TORCH_CHECK(s.tables[t * s.MB + b] >= 0 && s.tables[t * s.MB + b] < NB, "block id ",
                  s.tables[t * s.MB + b], " outside the cache");
}


// The weights of every layer into s (checked): norms, linears, caches.
void add_layers(Step& s, at::TensorList in_norms, at::TensorList post_norms,
                at::TensorList codes, at::TensorList scales,
                const c10::List<std::optional<at::Tensor>>& mins, at::IntArrayRef groups,
                at::IntArrayRef bits, at::IntArrayRef kinds, at::TensorList k_caches,
                at::TensorList v_caches, at::IntArrayRef windows) {
  const int64_t q_size = s.H * s.HD, width = q_size + 2 * s.KVH * s.HD;
  s.I = (kinds[2] == 0 ? 16 * codes[2].size(0) : groups[2]) / 2;
  for (size_t l = 0; l < in_norms.size(); ++l) {
    const int64_t shapes[4][2] = {{width, s.Hd}, {s.Hd, q_size}, {2 * s.I, s.Hd}, {s.Hd, s.I}};
    for (size_t i = 0; i < 4; ++i)
      s.lins.push_back(make_lin(4 * l + i, codes, scales, mins, groups, bits, kinds,
                                shapes[i][0], shapes[i][1]));
    for (const at::Tensor& n : {in_norms[l], post_norms[l]})
      TORCH_CHECK(n.dim() == 1 && n.size(0) == s.Hd && n.is_contiguous() &&
                      n.scalar_type() == torch::kBFloat16,
                  "decode_team: norm weights must be contiguous bf16 [hidden]");
    s.in_norm.push_back(in_norms[l].data_ptr<BF>());
    s.post_norm.push_back(post_norms[l].data_ptr<BF>());
    TORCH_CHECK(windows[l] >= 0, "window ", windows[l], " is negative (0: no window)");
    if (s.codec) continue;  // team_codec::setup checks the codes
    const at::Tensor &k = k_caches[l], &v = v_caches[l];
    TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.is_contiguous() &&
                    k.scalar_type() == torch::kBFloat16 && v.scalar_type() == torch::kBFloat16 &&
                    k.sizes() == v.sizes() && k.sizes() == k_caches[0].sizes() &&
                    k.size(2) == s.KVH && k.size(3) == s.HD,
                "decode_team: K/V caches must be contiguous bf16 [blocks, block_size, ",
                s.KVH, ", ", s.HD, "], one shape for every layer");
    s.kc.push_back(k.data_ptr<BF>());
    s.vc.push_back(v.data_ptr<BF>());
  }
}

// The step's rows: positions, slots, block tables, lengths (int64 copies kept in keep).
void add_rows(Step& s, std::vector<torch::Tensor>& keep, const torch::Tensor& positions,
              const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slots,
              const torch::Tensor& block_tables, const std::optional<torch::Tensor>& table_index,
              const torch::Tensor& context_lens, int64_t num_blocks) {
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 &&
                  cos.size(1) == s.HD,
              "decode_team: cos/sin must be contiguous float32 [max_pos, head_dim]");
  s.cos = cos.data_ptr<float>(), s.sin = sin.data_ptr<float>();
  const auto i64 = [&](const torch::Tensor& t, const char* what) {
    keep.push_back(t.to(torch::kInt64).contiguous());
    TORCH_CHECK(keep.back().numel() == s.M, "decode_team: one ", what, " per row");
    return keep.back().data_ptr<int64_t>();
  };
  s.pos = i64(positions, "position"), s.slots = i64(slots, "slot");
  s.lens = i64(context_lens, "context length");
  keep.push_back(block_tables.to(torch::kInt64).contiguous());
  const torch::Tensor tables = keep.back();
  TORCH_CHECK(tables.dim() == 2, "decode_team: block tables must be 2-D");
  if (table_index.has_value())
    s.tidx = i64(*table_index, "table index");
  else
    TORCH_CHECK(tables.size(0) == s.M, "decode_team: one block table per row");
  s.tables = tables.data_ptr<int64_t>(), s.MB = tables.size(1);
  check_indices(s, tables.size(0), cos.size(0), num_blocks);
}

// Layer l's attention partitions, as paged_attention cuts them at this thread count, and
// their families (one plan per distinct window, owned by plans); returns the most
// partitions of any.
int64_t add_plans(Step& s, std::map<int64_t, std::unique_ptr<Plan>>& plans,
                  at::IntArrayRef windows) {
  int64_t most = 0;
  for (const int64_t w : windows) {
    auto& p = plans[w];
    if (!p)
      p = std::make_unique<Plan>(
          plan_items(split_decode_rows(s.lens, s.M, w, s.KVH, kPartTokens,
                                       (s.KVH + s.heads_per_item - 1) / s.heads_per_item),
                     s.tidx));
    s.plan.push_back(p.get());
    most = std::max(most, p->split.parts());
  }
  return most;
}

// The step's activations carved out of one bf16 tensor (returned, with h).
std::vector<torch::Tensor> add_buffers(Step& s, const torch::Tensor& residual) {
  const int64_t q_size = s.H * s.HD, width = q_size + 2 * s.KVH * s.HD;
  const auto opts = residual.options();
  torch::Tensor buf = torch::empty({s.M, 2 * s.Hd + width + q_size + 3 * s.I}, opts);
  torch::Tensor h = torch::empty({s.M, s.Hd}, opts);
  s.res = residual.data_ptr<BF>(), s.h = h.data_ptr<BF>();
  BF* p = buf.data_ptr<BF>();
  const std::pair<BF**, int64_t> parts[] = {{&s.x, s.Hd}, {&s.o, s.Hd}, {&s.qkv, width},
                                            {&s.attn, q_size}, {&s.gu, 2 * s.I}, {&s.act, s.I}};
  for (const auto& [b, cols] : parts) *b = p, p += s.M * cols;
  return {buf, h};
}

}  // namespace
#endif

bool decode_team_supported(at::IntArrayRef kinds, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, std::string codec, int64_t codec_group) {
#if defined(__AVX512F__)
  const bool bf16 = bf16_linear_isa() == "avx512_bf16", vnni = quant_gemv_ok(16, 32, 32, 4);
  for (const int64_t k : kinds)
    if (!((k == 0 && vnni) || (k == 1 && bf16))) return false;
  if (head_dim != 64 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 ||
      part_fn(num_heads / num_kv_heads) == nullptr)
    return false;
  if (codec.empty()) return true;
#if defined(KVSTACK_CODEC_AVX512)
  static_assert(codec64::kCodecPart == kPartTokens, "the codec and bf16 kernels cut rows alike");
  return team_codec::supported(codec, codec_group, num_heads / num_kv_heads);
#else
  return false;
#endif
#else
  (void)kinds, (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)codec, (void)codec_group;
  return false;
#endif
}

std::vector<torch::Tensor> decode_team(
    torch::Tensor residual, at::TensorList in_norms, at::TensorList post_norms,
    at::TensorList codes, at::TensorList scales,
    const c10::List<std::optional<at::Tensor>>& mins, at::IntArrayRef groups,
    at::IntArrayRef bits, at::IntArrayRef kinds, torch::Tensor positions, torch::Tensor cos,
    torch::Tensor sin, at::TensorList k_caches, at::TensorList v_caches, torch::Tensor slots,
    torch::Tensor block_tables, std::optional<torch::Tensor> table_index,
    torch::Tensor context_lens, double scale, at::IntArrayRef windows, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, std::string codec, int64_t codec_group,
    at::TensorList k_params, at::TensorList v_params,
    std::optional<torch::Tensor> rotation_signs) {
  TORCH_CHECK(decode_team_supported(kinds, num_heads, num_kv_heads, head_dim, codec, codec_group),
              "decode_team: this model's layers, KV codec or this CPU are outside its scope");
#if defined(__AVX512F__)
  const size_t layers = in_norms.size();
  TORCH_CHECK(layers > 0 && post_norms.size() == layers && k_caches.size() == layers &&
                  v_caches.size() == layers && windows.size() == layers &&
                  codes.size() == 4 * layers && scales.size() == 4 * layers &&
                  mins.size() == 4 * layers && groups.size() == 4 * layers &&
                  bits.size() == 4 * layers && kinds.size() == 4 * layers,
              "decode_team: one norm pair, K/V cache, window and four linears per layer");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() &&
                  residual.scalar_type() == torch::kBFloat16 && residual.size(0) > 0,
              "decode_team: residual must be a contiguous bf16 [rows, hidden]");
  Step s{};
  s.M = residual.size(0), s.Hd = residual.size(1), s.H = num_heads, s.KVH = num_kv_heads;
  s.HD = head_dim, s.eps = static_cast<float>(eps), s.scale = static_cast<float>(scale);
  s.part = part_fn(num_heads / num_kv_heads);
  s.heads_per_item = kv_heads_per_item(num_kv_heads, num_heads / num_kv_heads);
#if defined(KVSTACK_CODEC_AVX512)
  team_codec::Layers codec_layers;  // an encoded cache: its views, float queries, partials
  torch::Tensor signs;
  if (!codec.empty()) {
    s.codec = &codec_layers;
    team_codec::setup(codec_layers, codec, codec_group, k_caches, v_caches, k_params, v_params,
                      rotation_signs, signs, s.M, s.H, s.KVH);
  }
#endif
  add_layers(s, in_norms, post_norms, codes, scales, mins, groups, bits, kinds, k_caches,
             v_caches, windows);
  s.BS = k_caches[0].size(1);
  std::vector<torch::Tensor> keep;
  add_rows(s, keep, positions, cos, sin, slots, block_tables, table_index, context_lens,
           k_caches[0].size(0));
  std::map<int64_t, std::unique_ptr<Plan>> plans;
  std::vector<Partial> parts(add_plans(s, plans, windows) * s.H);
  s.parts = parts.data();
  std::vector<std::atomic<int64_t>> next(layers);
  for (auto& n : next) n.store(0);
  s.next = next.data();
  const std::vector<torch::Tensor> bufs = add_buffers(s, residual);
  const int64_t kmax = std::max({s.Hd, s.H * s.HD, s.I});
  std::vector<int32_t> xq(s.M * kmax / 4);
  std::vector<float> dx(s.M * kmax / 32), xs(s.M * kmax / 32), xh(s.M * kmax / 16);
  s.qa = {xq.data(), dx.data(), xs.data(), xh.data()};
#pragma omp parallel num_threads(std::max(1, at::get_num_threads()))
  {
    const int tid = omp_get_thread_num(), team_size = omp_get_num_threads();
    for (size_t l = 0; l < layers; ++l) layer(s, l, tid, team_size);
  }
  return {bufs[1], residual};
#else
  return {};
#endif
}
