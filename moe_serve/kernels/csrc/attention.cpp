// Attention and the per-token kernels beside it:
//   rms_norm       one pass per row (before attention and before the experts).
//   rotary_write   rotary embedding of q and k in place, and the keys and values written to the cache.
//   paged_attention  decode/prefill over the paged cache: keys stored transposed in each block
//                  ([Dh, BS]) so 16 scores are one broadcast-FMA chain, with a vectorised online softmax;
//                  optionally a sliding window (each query sees its last `window` keys, gpt-oss), local
//                  chunks (each query sees the keys of its own chunk of `chunk` positions, Llama 4) and
//                  per-head attention sinks (a learned logit in every softmax's denominator, gpt-oss).
//   packed_attention  the same over keys packed with the queries (bidirectional encoders, no cache).

#include "attention.h"

namespace moe_serve {

// ---- norms -------------------------------------------------------------------------------------------

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 only");
  auto xc = x.contiguous();
  int64_t D = xc.size(-1), rows = xc.numel() / D;
  auto out = at::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto body = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * D;
      vf acc = vzero();
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) { vf v = vload(xr + d); acc = vfmadd(v, v, acc); }
      if (d < D) { vf v = vload_masked(tail_mask(D - d), xr + d); acc = vfmadd(v, v, acc); }
      float scale = 1.f / std::sqrt(vreduce_add(acc) / (float)D + (float)eps);
      for (d = 0; d < D; ++d) op[r * D + d] = wp[d] * (xr[d] * scale);
    }
  };
  if (small_work(rows * D)) body(0, rows);
  else at::parallel_for(0, rows, std::max<int64_t>(1, rows / (2 * at::get_num_threads())), body);
  return out;
}

// ---- rotary embedding and the KV cache ---------------------------------------------------------------

namespace {

// x [T, H, Dh] in place: HF's rotate-half convention, cos/sin [T, Dh] (their two halves equal).
void rotary_inplace(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  int64_t T = x.size(0), H = x.size(1), Dh = x.size(2), half = Dh / 2;
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float* v = xp + (t * H + h) * Dh;
      const float* c = cp + t * Dh;
      const float* s = sp + t * Dh;
      for (int64_t d = 0; d < half; ++d) {
        float a = v[d], b = v[d + half];
        v[d] = a * c[d] - b * s[d];
        v[d + half] = b * c[d + half] + a * s[d + half];
      }
    }
}

void write_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                 const at::Tensor& slot_mapping) {
  int64_t T = k.size(0), G = k.size(1), Dh = k.size(2), BS = k_cache.size(3);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    int64_t block = slots[t] / BS, off = slots[t] % BS;
    for (int64_t g = 0; g < G; ++g) {
      const float* kr = kp + (t * G + g) * Dh;
      float* kb = kc + ((block * G + g) * Dh) * BS + off;  // [Dh, BS] within the block
      for (int64_t d = 0; d < Dh; ++d) kb[d * BS] = kr[d];
      std::copy(vp + (t * G + g) * Dh, vp + (t * G + g + 1) * Dh, vc + ((block * G + g) * BS + off) * Dh);
    }
  }
}

}  // namespace

// q [T, H, Dh], k/v [T, G, Dh] (contiguous, float32): rotary on q and k in place (when cos is given), then
// k and v stored at their slots of the cache.
void rotary_write(at::Tensor q, at::Tensor k, const at::Tensor& v, const c10::optional<at::Tensor>& cos,
                  const c10::optional<at::Tensor>& sin, c10::optional<at::Tensor> k_cache,
                  c10::optional<at::Tensor> v_cache, const c10::optional<at::Tensor>& slot_mapping) {
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "rotary_write: contiguous q, k, v");
  if (cos.has_value() && cos->defined()) {
    auto c = cos->contiguous(), s = sin->contiguous();
    rotary_inplace(q, c, s);
    rotary_inplace(k, c, s);
  }
  if (k_cache.has_value() && k_cache->defined()) write_cache(k, v, *k_cache, *v_cache, *slot_mapping);
}

// ---- attention ---------------------------------------------------------------------------------------

namespace {

// Relative term for 16 consecutive keys j0..j0+15: sum_d q_rel[d] * rkt[d][index0 - j], rkt [Dh, R]
// (this head's projected sinusoid of each distance), index0 = position + offset.
inline vf relative16(const float* q_rel, const float* rkt, int64_t R, int64_t Dh, int64_t index0, int64_t j0, mask16 valid) {
  // lanes c = 0..15 read distance index0 - j0 - c: a reversed contiguous range [lo, lo + 16).
  int64_t lo = index0 - j0 - 15;
  mask16 in_range = 0;
  for (int c = 0; c < 16; ++c) {
    int64_t idx = lo + c;
    if (idx >= 0 && idx < R) in_range |= (mask16)(1u << c);
  }
  vf acc = vzero();
  for (int64_t d = 0; d < Dh; ++d) {
    vf r = vload_masked(in_range, rkt + d * R + lo);
    acc = vfmadd(vset1(q_rel[d]), r, acc);
  }
  return vkeep(valid, vreverse(acc));
}

// The first key a causal query at `pos` sees: 0; with a sliding window of W keys, pos - W + 1 (transformers'
// sliding_window_overlay: kv > q - W); with local chunks of C positions, the first of its chunk
// (chunked_overlay: kv // C == q // C).
inline int64_t first_key(int64_t pos, int64_t window, int64_t chunk) {
  int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  return chunk > 0 ? std::max(first, pos / chunk * chunk) : first;
}

void check_span(int64_t window, int64_t chunk, bool causal) {
  TORCH_CHECK(window >= 0 && chunk >= 0, "attention: window and chunk must be positive (0: none), got ", window, ", ", chunk);
  TORCH_CHECK(causal || (window == 0 && chunk == 0), "attention: windows and local chunks are causal only");
}

// sinks: [H] float32 (one logit a query head), or none.
at::Tensor check_sinks(const c10::optional<at::Tensor>& sinks, int64_t H) {
  if (!sinks.has_value() || !sinks->defined()) return at::Tensor();
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == H, "attention: sinks must be [", H, "] (one a query head), got ",
              sinks->sizes());
  return sinks->to(at::kFloat).contiguous();
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_ids,
                           const at::Tensor& positions, const at::Tensor& num_keys_of, bool causal,
                           double scale, const c10::optional<at::Tensor>& q_rel,
                           const c10::optional<at::Tensor>& r_kt, int64_t rel_offset, int64_t window,
                           int64_t chunk, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat, "attention: float32 only");
  check_span(window, chunk, causal);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "attention: contiguous cache");
  int64_t G = k_cache.size(1), Dh = k_cache.size(2), BS = k_cache.size(3);
  TORCH_CHECK(BS % 16 == 0, "attention: the block size must be a multiple of 16");
  auto qc = q.contiguous();
  int64_t T = qc.size(0), H = qc.size(1), group = H / G;
  auto tables = block_tables.to(at::kInt).contiguous();
  int64_t width = tables.size(1);
  at::Tensor sink = check_sinks(sinks, H);
  const float* sinkp = sink.defined() ? sink.data_ptr<float>() : nullptr;
  auto out = at::empty_like(qc);
  const float* qp = qc.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t* sp = seq_ids.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t* np = num_keys_of.data_ptr<int64_t>();
  at::Tensor qr, rk;
  const float* qrp = nullptr;
  const float* rkp = nullptr;
  int64_t R = 0;
  if (r_kt.has_value() && r_kt->defined()) {
    qr = q_rel->contiguous();
    rk = r_kt->contiguous();  // [H, Dh, R]
    qrp = qr.data_ptr<float>();
    rkp = rk.data_ptr<float>();
    R = rk.size(2);
  }
  float* op = out.data_ptr<float>();
  const float fscale = (float)scale;
  auto body = [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(Dh), qs(Dh), qrs(Dh);
    for (int64_t i = i0; i < i1; ++i) {
      int64_t t = i / H, h = i % H, g = h / group, seq = sp[t], pos = pp[t];
      int64_t num_keys = causal ? std::min(pos + 1, np[seq]) : np[seq];
      for (int64_t d = 0; d < Dh; ++d) qs[d] = qp[i * Dh + d];
      if (qrp != nullptr)
        for (int64_t d = 0; d < Dh; ++d) qrs[d] = qrp[i * Dh + d];
      Softmax sm = Softmax::with_sink(sinkp, h, acc.data(), Dh);
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t first = first_key(pos, window, chunk);  // blocks wholly before it are never read (nor need to exist)
      for (int64_t j0 = first / 16 * 16; j0 < num_keys; j0 += 16) {
        int64_t block = tp[seq * width + j0 / BS], off = j0 % BS;
        const float* kt = kc + ((block * G + g) * Dh) * BS + off;  // [Dh, BS], columns off..off+15
        const float* vb = vc + ((block * G + g) * BS + off) * Dh;
        mask16 valid = tail_mask(num_keys - j0) & (mask16)~tail_mask(std::max<int64_t>(0, first - j0));
        vf s = vzero();
        for (int64_t d = 0; d < Dh; ++d) s = vfmadd(vset1(qs[d]), vload(kt + d * BS), s);
        if (rkp != nullptr) s = vadd(s, relative16(qrs.data(), rkp + h * Dh * R, R, Dh, pos + rel_offset, j0, valid));
        sm.add16(vmul(s, vset1(fscale)), valid, vb, Dh);
      }
      sm.finish(op + i * Dh);
    }
  };
  // The work is every query's keys: one query deep in a long prompt (a decode, or a one-token chunk at 2,000
  // cached keys) is worth both threads. Each (token, head) is one thread's, in the same order: the same bits.
  int64_t keys = 0;
  for (int64_t t = 0; t < T; ++t) {
    int64_t pos = pp[t], num_keys = causal ? std::min(pos + 1, np[sp[t]]) : np[sp[t]];
    keys += std::max<int64_t>(num_keys - first_key(pos, window, chunk), 16);
  }
  if (small_work(keys * H * Dh)) body(0, T * H);
  else at::parallel_for(0, T * H, 1, body);
  return out;
}

// Keys packed with the queries ([T, G, Dh], each sequence's rows from seq_starts): a gather of 16 keys'
// dot products at a time, then the same online softmax.
at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& seq_starts, const at::Tensor& seq_ids,
                            const at::Tensor& positions, const at::Tensor& num_keys_of, bool causal,
                            double scale, const c10::optional<at::Tensor>& q_rel,
                            const c10::optional<at::Tensor>& r_kt, int64_t rel_offset, int64_t window,
                            int64_t chunk, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat, "attention: float32 only");
  check_span(window, chunk, causal);
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  int64_t T = qc.size(0), H = qc.size(1), Dh = qc.size(2), G = kc.size(1), group = H / G;
  at::Tensor sink = check_sinks(sinks, H);
  const float* sinkp = sink.defined() ? sink.data_ptr<float>() : nullptr;
  auto out = at::empty_like(qc);
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int64_t* starts = seq_starts.data_ptr<int64_t>();
  const int64_t* sp = seq_ids.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t* np = num_keys_of.data_ptr<int64_t>();
  at::Tensor qr, rk;
  const float* qrp = nullptr;
  const float* rkp = nullptr;
  int64_t R = 0;
  if (r_kt.has_value() && r_kt->defined()) {
    qr = q_rel->contiguous();
    rk = r_kt->contiguous();
    qrp = qr.data_ptr<float>();
    rkp = rk.data_ptr<float>();
    R = rk.size(2);
  }
  float* op = out.data_ptr<float>();
  const float fscale = (float)scale;
  auto body = [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(Dh);
    alignas(64) float scores[16];
    for (int64_t i = i0; i < i1; ++i) {
      int64_t t = i / H, h = i % H, g = h / group, seq = sp[t], pos = pp[t];
      int64_t num_keys = causal ? std::min(pos + 1, np[seq]) : np[seq];
      const float* qi = qp + i * Dh;
      Softmax sm = Softmax::with_sink(sinkp, h, acc.data(), Dh);
      std::fill(acc.begin(), acc.end(), 0.f);
      int64_t row0 = starts[seq];
      const int64_t first = first_key(pos, window, chunk);
      for (int64_t j0 = first / 16 * 16; j0 < num_keys; j0 += 16) {
        mask16 valid = tail_mask(num_keys - j0) & (mask16)~tail_mask(std::max<int64_t>(0, first - j0));
        for (int c = 0; c < 16; ++c) {
          if (j0 + c >= num_keys || j0 + c < first) { scores[c] = 0.f; continue; }
          const float* kr = kp + ((row0 + j0 + c) * G + g) * Dh;
          vf a = vzero();
          int64_t d = 0;
          for (; d + 16 <= Dh; d += 16) a = vfmadd(vload(qi + d), vload(kr + d), a);
          if (d < Dh) { mask16 m = tail_mask(Dh - d); a = vfmadd(vload_masked(m, qi + d), vload_masked(m, kr + d), a); }
          scores[c] = vreduce_add(a);
        }
        vf s = vload(scores);
        if (rkp != nullptr) s = vadd(s, relative16(qrp + i * Dh, rkp + h * Dh * R, R, Dh, pos + rel_offset, j0, valid));
        sm.add16(vmul(s, vset1(fscale)), valid, vp + ((row0 + j0) * G + g) * Dh, G * Dh);
      }
      sm.finish(op + i * Dh);
    }
  };
  if (small_work(T * H * Dh * 16)) body(0, T * H);
  else at::parallel_for(0, T * H, 1, body);
  return out;
}

}  // namespace moe_serve
