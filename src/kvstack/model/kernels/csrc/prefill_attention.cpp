// Causal prefill attention on AVX512-BF16 (kvstack), for prompts without earlier KV or
// with a contiguous context before them.
//
// Why: PyTorch's CPU flash attention (F.scaled_dot_product_attention) ran 10 prompts x 200
// tokens (9 q heads, 3 KV heads, head_dim 64) at ~46 GFLOP/s on a 2-core AMD EPYC
// Zen 4, ~20 % of a 2,048-token prefill step; its GEMMs are small and oneDNN is not
// used for them. Here both products run through the register-blocked VDPBF16PS kernel of
// dpbf16.h, at the rate of the linears.
//
// Rows and keys: S sequences, each Lq query rows and Lk >= Lq keys (the last Lq of which
// are the queries' own tokens), row i of a sequence at position off + i, off = Lk - Lq,
// attends keys 0 .. off + i (causal; no window, no mask). With ``positions`` (one
// sequence; segment reuse's repair rows) row i sits at positions[i] instead (strictly
// ascending, < Lk; its own K/V are among the keys) and attends keys 0 .. positions[i]:
//
//   keys:    0 .. off-1 | off  off+1 ... Lk-1
//   row 0:   x  ..  x   |  x
//   row 1:   x  ..  x   |  x    x
//   row i:   x  ..  x   |  x    x  ...  (off + i)
//
// Phase 1, per (sequence, KV head): K packed as the "weights" of Q K^T (b[key block][d
// pair][16 keys][2]) and V as those of P V (b[d block][key pair][16 dims][2]); keys padded
// to a multiple of 16 with zeros. Phase 2, per (sequence, KV head, tile of kTile rows),
// for each of the G q heads sharing that KV head: scores of the tile's rows against the
// keys up to the tile's last position (float32), softmax per row over its causal keys
// (float32; the weights rounded to bf16 for the P V product, as PyTorch's bf16 flash
// attention does), P V in float32, divided by the softmax sum, rounded to bf16 once.
// Invariants: bf16 q/k/v with head_dim % 32 == 0 (checked; model/attention.py sends other
// cases to SDPA); masked and padded keys get weight exactly 0.
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "dpbf16.h"
#include "kvstack_ops.h"
#include "simd.h"

namespace {

#if defined(KVSTACK_AVX512_BF16)

using BF = at::BFloat16;
constexpr int64_t kTile = 32;  // query rows per work item

struct Dims {
  int64_t S, Lq, Lk, H, KVH, D, G, Lk16;
  int64_t qs, ks, vs;  // row strides (elements) of q, k, v
  const int64_t* pos = nullptr;  // sparse rows (S == 1): row i sits at position pos[i]

  // The position of row i of a sequence: off + i, or pos[i] for sparse rows.
  int64_t at(int64_t i) const { return pos != nullptr ? pos[i] : Lk - Lq + i; }
};

// K of (s, kh) -> kp[nb][kp][n][j] = K[16 nb + n][2 kp + j]; V -> vp[db][kp][n][j] =
// V[2 kp + j][16 db + n]. Padding keys (>= Lk) are zero in both.
void pack_kv(const BF* k, const BF* v, const Dims& d, int64_t s, int64_t kh, BF* kp, BF* vp) {
  const int64_t D = d.D, pairs = D / 2;
  std::memset(kp, 0, sizeof(BF) * d.Lk16 * D);
  std::memset(vp, 0, sizeof(BF) * d.Lk16 * D);
  auto* kp32 = reinterpret_cast<int32_t*>(kp);
  for (int64_t t = 0; t < d.Lk; ++t) {
    const BF* row = k + (s * d.Lk + t) * d.ks + kh * D;
    int32_t* dst = kp32 + (t / 16) * pairs * 16 + t % 16;
    for (int64_t p = 0; p < pairs; ++p) std::memcpy(dst + 16 * p, row + 2 * p, 4);
  }
  const int64_t vblock = d.Lk16 * 16;  // elements per 16-dim block
  for (int64_t t = 0; t < d.Lk; ++t) {
    const BF* row = v + (s * d.Lk + t) * d.vs + kh * D;
    BF* dst = vp + (t / 2) * 32 + (t % 2);
    for (int64_t c = 0; c < D; ++c) dst[(c / 16) * vblock + (c % 16) * 2] = row[c];
  }
}

// Row scores [0, kpad) of one q head: ys[r][key], masked past each row's position.
void scores(const BF* q, const Dims& d, const BF* kp, int64_t rows, int64_t kpad, float* ys) {
  const int64_t pairs = d.D / 2, block = 16 * d.D;
  const dpbf16::Prefetch none{nullptr, 0, 0};
  for (int64_t r = 0; r < rows; r += dpbf16::kMR) {
    const int64_t mr = std::min<int64_t>(dpbf16::kMR, rows - r);
    for (int64_t nb = 0; nb < kpad / 16; nb += dpbf16::kNR) {
      const int64_t nr = std::min<int64_t>(dpbf16::kNR, kpad / 16 - nb);
      dpbf16::pick<float>(mr, nr)(q + r * d.qs, d.qs, kp + nb * block, block, pairs,
                                  ys + r * kpad + 16 * nb, kpad, none);
    }
  }
}

// Softmax of row r over keys [0, valid) in place into bf16 weights pw (zeros after valid,
// up to kpad); returns the float32 sum of the unrounded weights.
float softmax_row(float* sc, int64_t valid, int64_t kpad, float scale, BF* pw) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < kpad; j += 16) {
    const __mmask16 live = j + 16 <= valid ? 0xFFFF
                           : j >= valid     ? 0
                                            : static_cast<__mmask16>((1u << (valid - j)) - 1);
    const __m512 x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live,
                                        _mm512_mul_ps(_mm512_loadu_ps(sc + j), sv));
    _mm512_storeu_ps(sc + j, x);
    mv = _mm512_max_ps(mv, x);
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < kpad; j += 16) {
    const __mmask16 live = j + 16 <= valid ? 0xFFFF
                           : j >= valid     ? 0
                                            : static_cast<__mmask16>((1u << (valid - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + j), m)));
    sum = _mm512_add_ps(sum, e);
    const __m256bh h = _mm512_cvtneps_pbh(e);
    std::memcpy(pw + j, &h, 32);
  }
  return _mm512_reduce_add_ps(sum);
}

// One (sequence, KV head, tile): every q head of the group.
void tile(const BF* q, const Dims& d, const BF* kp, const BF* vp, int64_t s, int64_t kh,
          int64_t t0, float scale, BF* out, std::vector<float>& sc, std::vector<BF>& pw,
          std::vector<float>& o) {
  const int64_t D = d.D, rows = std::min(kTile, d.Lq - t0);
  const int64_t kpad = (d.at(t0 + rows - 1) + 1 + 15) / 16 * 16;  // rows sorted by position
  const dpbf16::Prefetch none{nullptr, 0, 0};
  float l[kTile];
  for (int64_t g = 0; g < d.G; ++g) {
    const int64_t h = kh * d.G + g;
    const BF* qh = q + (s * d.Lq + t0) * d.qs + h * D;
    scores(qh, d, kp, rows, kpad, sc.data());
    for (int64_t r = 0; r < rows; ++r)
      l[r] = softmax_row(sc.data() + r * kpad, d.at(t0 + r) + 1, kpad, scale, pw.data() + r * kpad);
    const int64_t vblock = d.Lk16 * 16;
    for (int64_t r = 0; r < rows; r += dpbf16::kMR) {
      const int64_t mr = std::min<int64_t>(dpbf16::kMR, rows - r);
      for (int64_t nb = 0; nb < D / 16; nb += dpbf16::kNR) {
        const int64_t nr = std::min<int64_t>(dpbf16::kNR, D / 16 - nb);
        dpbf16::pick<float>(mr, nr)(pw.data() + r * kpad, kpad, vp + nb * vblock, vblock,
                                    kpad / 2, o.data() + r * D + 16 * nb, D, none);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / l[r]);
      BF* dst = out + ((s * d.Lq + t0 + r) * d.H + h) * D;
      for (int64_t c = 0; c < D; c += 16)
        store16(dst + c, _mm512_mul_ps(_mm512_loadu_ps(o.data() + r * D + c), inv));
    }
  }
}

void run(const BF* q, const BF* k, const BF* v, const Dims& d, float scale, BF* out) {
  const int64_t per = d.Lk16 * d.D, items = d.S * d.KVH;
  std::vector<BF> kp(items * per), vp(items * per);
  at::parallel_for(0, items, 1, [&](int64_t b, int64_t e) {
    for (int64_t w = b; w < e; ++w)
      pack_kv(k, v, d, w / d.KVH, w % d.KVH, kp.data() + w * per, vp.data() + w * per);
  });
  const int64_t tiles = (d.Lq + kTile - 1) / kTile;
  at::parallel_for(0, items * tiles, 1, [&](int64_t b, int64_t e) {
    std::vector<float> sc(kTile * d.Lk16), o(kTile * d.D);
    std::vector<BF> pw(kTile * d.Lk16);
    for (int64_t w = b; w < e; ++w) {
      const int64_t sk = w / tiles, t = w % tiles;
      tile(q, d, kp.data() + sk * per, vp.data() + sk * per, sk / d.KVH, sk % d.KVH,
           t * kTile, scale, out, sc, pw, o);
    }
  });
}

#endif  // KVSTACK_AVX512_BF16

void check_heads(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.scalar_type() == torch::kBFloat16, "causal_attention: ", name,
              " must be a 3-d bf16 tensor [rows, heads, head_dim]");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), "causal_attention: ", name,
              " must have contiguous heads (rows may be strided)");
}

}  // namespace

bool causal_attention_available() {
#if defined(KVSTACK_AVX512_BF16)
  return true;
#else
  return false;
#endif
}

torch::Tensor causal_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               int64_t num_seqs, double scale,
                               const c10::optional<torch::Tensor>& positions) {
  check_heads(q, "q");
  check_heads(k, "k");
  check_heads(v, "v");
  TORCH_CHECK(k.sizes() == v.sizes(), "causal_attention: k and v differ in shape");
  const int64_t S = num_seqs, H = q.size(1), KVH = k.size(1), D = q.size(2);
  TORCH_CHECK(S >= 1 && q.size(0) % S == 0 && k.size(0) % S == 0,
              "causal_attention: rows must split into num_seqs equal sequences");
  TORCH_CHECK(k.size(2) == D && D % 32 == 0 && KVH >= 1 && H % KVH == 0,
              "causal_attention: needs head_dim % 32 == 0 and whole GQA groups");
  const int64_t Lq = q.size(0) / S, Lk = k.size(0) / S;
  TORCH_CHECK(Lk >= Lq, "causal_attention: fewer keys than queries");
  const int64_t* pos = nullptr;
  if (positions.has_value()) {  // sparse rows: ascending positions among the Lk keys
    const auto& p = *positions;
    TORCH_CHECK(S == 1 && p.dim() == 1 && p.size(0) == Lq && p.scalar_type() == torch::kLong &&
                    p.is_contiguous(),
                "causal_attention: positions must be one sequence's [rows] int64");
    pos = p.data_ptr<int64_t>();
    for (int64_t i = 0; i < Lq; ++i)
      TORCH_CHECK(pos[i] >= 0 && pos[i] < Lk && (i == 0 || pos[i] > pos[i - 1]),
                  "causal_attention: positions must ascend within [0, keys)");
  }
  // After the input checks, so a bad input gets the same error on every CPU.
  TORCH_CHECK(causal_attention_available(),
              "causal_attention: AVX512-BF16 is not available in this build");
  auto out = torch::empty({q.size(0), H, D}, q.options());
#if defined(KVSTACK_AVX512_BF16)
  if (Lq == 0) return out;
  const Dims d{S, Lq, Lk, H, KVH, D, H / KVH, (Lk + 15) / 16 * 16,
               q.stride(0), k.stride(0), v.stride(0), pos};
  run(q.data_ptr<BF>(), k.data_ptr<BF>(), v.data_ptr<BF>(), d, static_cast<float>(scale),
      out.data_ptr<BF>());
#endif
  return out;
}
