// Attention's kernels (attention.cpp) and what runs per token beside them: RMSNorm, rotary embedding and the
// paged KV cache's writes, attention over the paged cache and over packed keys. The online softmax is here,
// inline, for latent_attention.cpp too.
#pragma once

#include "vec.h"

namespace moe_serve {

// Online-softmax state of one (query, head): running max, normaliser and weighted values.
struct Softmax {
  float m = -INFINITY, l = 0.f;
  float* acc;
  int64_t Dh;
  // An attention sink: a logit with a zero value in the denominator, as if seen first (exp(sink - m) = 1).
  static Softmax with_sink(const float* sinks, int64_t h, float* acc, int64_t Dh) {
    return sinks == nullptr ? Softmax{-INFINITY, 0.f, acc, Dh} : Softmax{sinks[h], 1.f, acc, Dh};
  }
  // scores s (16 keys, invalid lanes masked out) with their values at v + c * v_stride.
  inline void add16(vf s, mask16 valid, const float* v, int64_t v_stride) {
    if (!valid) return;
    float block_max = vreduce_max_masked(valid, s);
    if (block_max > m) {
      float correction = m == -INFINITY ? 0.f : std::exp(m - block_max);
      for (int64_t d = 0; d < Dh; ++d) acc[d] *= correction;
      l *= correction;
      m = block_max;
    }
    vf p = vkeep(valid, exp16(vsub(s, vset1(m))));
    l += vreduce_add(p);
    alignas(64) float pc[16];
    vstore(pc, p);
    int keys[16], n = 0;
    for (int c = 0; c < 16; ++c)
      if ((valid >> c) & 1) keys[n++] = c;
    // acc[d] += p_c * v_c[d] for the keys c in order: 64 values of acc held in registers across the keys
    // (four independent FMA chains) rather than loaded and stored once per key, which made this loop
    // store-bound. Each acc[d] takes the same FMAs in the same order as one key at a time would.
    int64_t d = 0;
    for (; d + 64 <= Dh; d += 64) {
      vf a0 = vload(acc + d), a1 = vload(acc + d + 16), a2 = vload(acc + d + 32), a3 = vload(acc + d + 48);
      for (int i = 0; i < n; ++i) {
        vf pv = vset1(pc[keys[i]]);
        const float* vr = v + keys[i] * v_stride + d;
        a0 = vfmadd(pv, vload(vr), a0);
        a1 = vfmadd(pv, vload(vr + 16), a1);
        a2 = vfmadd(pv, vload(vr + 32), a2);
        a3 = vfmadd(pv, vload(vr + 48), a3);
      }
      vstore(acc + d, a0);
      vstore(acc + d + 16, a1);
      vstore(acc + d + 32, a2);
      vstore(acc + d + 48, a3);
    }
    for (; d < Dh; d += 16) {  // the rest, 16 (or fewer) at a time
      mask16 m2 = tail_mask(Dh - d);
      vf a = vload_masked(m2, acc + d);
      for (int i = 0; i < n; ++i) a = vfmadd(vset1(pc[keys[i]]), vload_masked(m2, v + keys[i] * v_stride + d), a);
      vstore_masked(acc + d, m2, a);
    }
  }
  inline void finish(float* out) const {
    float inv = l > 0.f ? 1.f / l : 0.f;
    for (int64_t d = 0; d < Dh; ++d) out[d] = acc[d] * inv;
  }
};

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rotary_write(at::Tensor q, at::Tensor k, const at::Tensor& v, const c10::optional<at::Tensor>& cos,
                  const c10::optional<at::Tensor>& sin, c10::optional<at::Tensor> k_cache,
                  c10::optional<at::Tensor> v_cache, const c10::optional<at::Tensor>& slot_mapping);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_ids,
                           const at::Tensor& positions, const at::Tensor& num_keys_of, bool causal,
                           double scale, const c10::optional<at::Tensor>& q_rel,
                           const c10::optional<at::Tensor>& r_kt, int64_t rel_offset, int64_t window,
                           int64_t chunk, const c10::optional<at::Tensor>& sinks);
at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& seq_starts, const at::Tensor& seq_ids,
                            const at::Tensor& positions, const at::Tensor& num_keys_of, bool causal,
                            double scale, const c10::optional<at::Tensor>& q_rel,
                            const c10::optional<at::Tensor>& r_kt, int64_t rel_offset, int64_t window,
                            int64_t chunk, const c10::optional<at::Tensor>& sinks);

}  // namespace moe_serve
