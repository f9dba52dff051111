// What sampling needs beyond PyTorch's ops:
//
//   mask_logits  a structured output's grammar masks applied to their rows of the logits, in place: bit b of
//                word w of a row's mask (llguidance's bitmask layout) set lets token 32 w + b through, clear
//                makes its logit -inf. torch's unpack-then-masked_fill took 5 ms at 64 rows of a 32,000-token
//                vocabulary (benchmarks/structured_cost.py); a word that lets all 32 tokens through (most of
//                them, inside a JSON string) is skipped here, one that lets none through is 32 stores.
//   greedy_rows  each row's argmax and whether the row is finite, which every step's sampling needs (a row
//                with a NaN or an inf fails alone): one pass for the maximum and the finiteness, then the
//                first index holding the maximum, found from L1/L2 by vector compares. Where torch took
//                three ops (a row sum, isfinite, argmax) and their dispatches.

#include "sampling.h"

#include "vec.h"

#include <algorithm>
#include <limits>

namespace moe_serve {

void mask_logits(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "mask_logits: logits must be contiguous float32 [R, V]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "mask_logits: rows must be int64 [M]");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous() &&
                  bitmask.size(0) == rows.size(0),
              "mask_logits: bitmask must be contiguous int32 [M, W], one row per entry of rows");
  const int64_t R = logits.size(0), V = logits.size(1), M = rows.size(0), W = bitmask.size(1);
  TORCH_CHECK(W * 32 >= V, "mask_logits: the bitmask covers ", W * 32, " tokens, fewer than the ", V, " logits");
  float* lp = logits.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  for (int64_t m = 0; m < M; ++m) TORCH_CHECK(rp[m] >= 0 && rp[m] < R, "mask_logits: row ", rp[m], " out of range");
  const float off = -std::numeric_limits<float>::infinity();
  auto body = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float* row = lp + rp[m] * V;
      const uint32_t* words = mp + m * W;
      for (int64_t w = 0; w * 32 < V; ++w) {
        uint32_t word = words[w];
        if (word == 0xffffffffu) continue;
        int64_t base = w * 32, end = std::min<int64_t>(32, V - base);
        if (word == 0) {  // none allowed (most words of a structural position): one vectorised fill
          std::fill(row + base, row + base + end, off);
          continue;
        }
        for (uint32_t clear = ~word; clear; clear &= clear - 1) {  // each clear bit, lowest first
          int64_t b = __builtin_ctz(clear);
          if (b < end) row[base + b] = off;
        }
      }
    }
  };
  if (small_work(M * V)) body(0, M);
  else at::parallel_for(0, M, 1, body);
}

namespace {

// torch.argmax's answer for a row holding a NaN or an inf: the first NaN, else the first maximum.
int64_t argmax_nonfinite(const float* row, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 1; i < V && !std::isnan(row[best]); ++i)
    if (std::isnan(row[i]) || row[i] > row[best]) best = i;
  return best;
}

// One row: its argmax, and whether every value is finite (x - x is 0 for a finite x, NaN otherwise).
int64_t greedy_row(const float* row, int64_t V, bool* finite) {
  int64_t full = V / 16 * 16;
  vf top = vset1(-INFINITY), bad = vzero();
  for (int64_t i = 0; i < full; i += 16) {
    vf x = vload(row + i);
    top = vmax(top, x);
    bad = vadd(bad, vsub(x, x));
  }
  float best = vreduce_max_masked(0xFFFF, top), tail_bad = 0.f;
  for (int64_t i = full; i < V; ++i) {
    best = std::max(best, row[i]);
    tail_bad += row[i] - row[i];
  }
  *finite = vreduce_add(bad) == 0.f && tail_bad == 0.f;
  if (!*finite) return argmax_nonfinite(row, V);
  const vf target = vset1(best);
  for (int64_t i = 0; i < full; i += 16) {
    mask16 hit = vmask_eq(vload(row + i), target);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (int64_t i = full; i < V; ++i)
    if (row[i] == best) return i;
  return 0;  // unreachable: best is one of the row's values
}

}  // namespace

std::vector<at::Tensor> greedy_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0,
              "greedy_rows: logits must be float32 [R, V] with V > 0, got ", logits.scalar_type(), " ", logits.sizes());
  auto x = logits.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  auto tokens = at::empty({R}, x.options().dtype(at::kLong));
  auto finite = at::empty({R}, x.options().dtype(at::kBool));
  const float* xp = x.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  bool* fp = finite.data_ptr<bool>();
  auto body = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) tp[r] = greedy_row(xp + r * V, V, fp + r);
  };
  if (small_work(R * V)) body(0, R);
  else at::parallel_for(0, R, 1, body);
  return {tokens, finite};
}

}  // namespace moe_serve
