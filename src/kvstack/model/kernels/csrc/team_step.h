// What one decode_team step (decode_team.cpp) holds: its linears, per-layer caches and
// attention plans, the rows' indices and the activation buffers, shared by the team's
// threads; and how the attention items are grouped (plan_items).
#pragma once
#include <atomic>
#include <map>
#include <utility>
#include <vector>

#include "decode_split.h"
#include "paged_attention_hd64.h"
#include "team_codec.h"
#include "team_slices.h"

#if defined(__AVX512F__)
namespace {

using team::BF;
using PartFn = void (*)(const BF*, const BF*, const BF*, const int64_t*, int64_t, int64_t,
                        int64_t, int64_t, int64_t, int64_t, float, Partial*);

PartFn part_fn(int64_t group) {
  switch (group) {
#define KVSTACK_G(g) \
  case g:            \
    return &decode_part_hd64<BF, g>;
    KVSTACK_G(1) KVSTACK_G(2) KVSTACK_G(3) KVSTACK_G(4)
    KVSTACK_G(5) KVSTACK_G(6) KVSTACK_G(7) KVSTACK_G(8)
#undef KVSTACK_G
    default:
      return nullptr;
  }
}

// A split's attention items (p * units + u: partition p, KV heads of group u, longest
// first) in families: the items of rows that read one block table (a request's verify
// rows or chunk rows) with the same partition index and head group, which then run on one
// thread back to back, so the rows after the first read that K/V partition from the
// thread's own L2. Who runs an item never changes its result.
struct Plan {
  DecodeSplit split;
  std::vector<int64_t> start;  // [families + 1] into items
  std::vector<int64_t> items;
};

Plan plan_items(DecodeSplit split, const int64_t* tidx) {
  Plan p{std::move(split), {0}, {}};
  const DecodeSplit& sp = p.split;
  std::map<std::pair<int64_t, int64_t>, size_t> family;  // (table, index * units + u)
  std::vector<std::vector<int64_t>> members;
  for (const int64_t w : sp.order) {
    const int64_t pi = w / sp.units, d = sp.row[pi];
    const int64_t index = (pi - sp.first[d]) * sp.units + w % sp.units;
    const auto key = std::make_pair(table_row(tidx, d), index);
    const auto [it, fresh] = family.emplace(key, members.size());
    if (fresh) members.emplace_back();
    members[it->second].push_back(w);
  }
  for (const auto& m : members) {
    p.items.insert(p.items.end(), m.begin(), m.end());
    p.start.push_back(static_cast<int64_t>(p.items.size()));
  }
  return p;
}

struct Lin {
  int64_t kind;  // 0 quant_gemv, 1 bf16_linear
  team::GemvWeight q;  // kind 0
  const BF* packed;  // kind 1
  int64_t N, K;
};

struct Step {
  int64_t M, Hd, H, KVH, HD, I, BS, MB, heads_per_item;
  float eps, scale;
  PartFn part;
  std::vector<Lin> lins;  // 4 per layer: qkv, o, gate_up, down
  std::vector<const BF*> in_norm, post_norm;
  std::vector<BF*> kc, vc;
  std::vector<const Plan*> plan;  // per layer (by window)
  const int64_t *pos, *slots, *tables, *tidx, *lens;
  const float *cos, *sin;
  BF *res, *x, *qkv, *attn, *o, *gu, *act, *h;  // activations of the step
  team::GemvAct qa;  // the next quant_gemv's quantized input
  Partial* parts;
  std::atomic<int64_t>* next;  // per layer: the next attention item
  team_codec::Layers* codec;  // an encoded cache (team_codec.h), or null: the bf16 caches kc / vc
};

struct Share {
  int64_t b, e;
};

// Thread tid's contiguous share of n items.
inline Share share(int64_t n, int tid, int nt) {
  const int64_t per = (n + nt - 1) / nt;
  return {std::min(n, tid * per), std::min(n, (tid + 1) * per)};
}

}  // namespace
#endif
