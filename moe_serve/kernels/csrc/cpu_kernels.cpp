// CPU kernels of moe-serve: the bandwidth-bound parts of a decode step, written so that each output
// element is computed by the same sequence of floating-point operations whatever else is in the batch
// (a token's result never depends on what it is batched with: bitwise, on these paths).
//
//   skinny_linear  y[M, N] = x[M, K] W[N, K]^T + b   for few rows: W is streamed from memory once, each
//                  weight row meets up to 8 rows of x while it is in L1.
//   moe_experts    sum over a token's slots of weight * expert(x): slots grouped by expert, each expert's
//                  weights streamed once for all of its slots (skinny), or an MKL GEMM for big groups.
//   attention      paged or packed (varlen) attention with an online softmax: O(head_dim) memory per
//                  query whatever the context, causal or not, with Transformer-XL's relative term.
//
// Legend: T tokens, S sequences, H query heads, G key/value heads, Dh head dim, E experts, K slots per
// token (k_max of the batch), D hidden, I expert intermediate size, BS block size.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using bf16 = at::BFloat16;

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 load16m(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16m(const bf16* p, __mmask16 m) {
  __m256i v = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// ---- dot products ----------------------------------------------------------------------------------

template <typename W>
inline float dot(const float* x, const W* w, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(load16(w + i), _mm512_loadu_ps(x + i), acc);
  if (i < n) {
    __mmask16 m = tail_mask(n - i);
    acc = _mm512_fmadd_ps(load16m(w + i, m), _mm512_maskz_loadu_ps(m, x + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// y[m * ldy] = dot(x[m], w) for MB rows of x (stride ldx): the weight row is loaded once per 16 values.
// Each row's dot product is the same sequence of operations as dot() above, whatever MB is.
template <typename W, int MB>
inline void dot_rows(const float* x, int64_t ldx, const W* w, int64_t n, float* y, int64_t ldy) {
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    __m512 wv = load16(w + k);
    for (int i = 0; i < MB; ++i) acc[i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i * ldx + k), acc[i]);
  }
  if (k < n) {
    __mmask16 m = tail_mask(n - k);
    __m512 wv = load16m(w + k, m);
    for (int i = 0; i < MB; ++i) acc[i] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + i * ldx + k), acc[i]);
  }
  for (int i = 0; i < MB; ++i) y[i * ldy] = _mm512_reduce_add_ps(acc[i]);
}

template <typename W>
void dot_rows_any(const float* x, int64_t ldx, int64_t rows, const W* w, int64_t n, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + 8 <= rows; m += 8) dot_rows<W, 8>(x + m * ldx, ldx, w, n, y + m * ldy, ldy);
  switch (rows - m) {
    case 7: dot_rows<W, 7>(x + m * ldx, ldx, w, n, y + m * ldy, ldy); break;
    case 6: dot_rows<W, 6>(x + m * ldx, ldx, w, n, y + m * ldy, ldy); break;
    case 5: dot_rows<W, 5>(x + m * ldx, ldx, w, n, y + m * ldy, ldy); break;
    case 4: dot_rows<W, 4>(x + m * ldx, ldx, w, n, y + m * ldy, ldy); break;
    case 3: dot_rows<W, 3>(x + m * ldx, ldx, w, n, y + m * ldy, ldy); break;
    case 2: dot_rows<W, 2>(x + m * ldx, ldx, w, n, y + m * ldy, ldy); break;
    case 1: dot_rows<W, 1>(x + m * ldx, ldx, w, n, y + m * ldy, ldy); break;
    default: break;
  }
}

// Rows per parallel task: enough work to amortise scheduling, and all threads busy.
int64_t grain_for(int64_t rows, int64_t cost_per_row) {
  int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t by_threads = (rows + threads * 4 - 1) / (threads * 4);
  int64_t by_cost = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, cost_per_row));
  return std::max<int64_t>(1, std::min(by_threads, by_cost));
}

// ---- skinny linear ---------------------------------------------------------------------------------

template <typename W>
void skinny_linear_impl(const float* x, int64_t M, int64_t K, const W* w, const float* bias, float* y, int64_t N) {
  at::parallel_for(0, N, grain_for(N, K * M), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      dot_rows_any<W>(x, K, M, w + r * K, K, y + r, N);
      if (bias != nullptr)
        for (int64_t m = 0; m < M; ++m) y[m * N + r] += bias[r];
    }
  });
}

torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "skinny_linear: shapes");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "skinny_linear: x must be float32");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto y = torch::empty({M, N}, xc.options());
  const float* b = nullptr;
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->to(at::kFloat).contiguous();
    b = bc.data_ptr<float>();
  }
  if (wc.scalar_type() == at::kFloat) {
    skinny_linear_impl<float>(xc.data_ptr<float>(), M, K, wc.data_ptr<float>(), b, y.data_ptr<float>(), N);
  } else {
    TORCH_CHECK(wc.scalar_type() == at::kBFloat16, "skinny_linear: weight must be float32 or bfloat16");
    skinny_linear_impl<bf16>(xc.data_ptr<float>(), M, K, wc.data_ptr<bf16>(), b, y.data_ptr<float>(), N);
  }
  return y;
}

// ---- MoE experts -----------------------------------------------------------------------------------

enum Activation : int64_t { RELU = 0, GELU = 1, GELU_TANH = 2, SILU = 3 };

inline float activate(float v, int64_t kind) {
  switch (kind) {
    case RELU: return v > 0.f ? v : 0.f;
    case GELU: return 0.5f * v * (1.f + std::erf(v * 0.70710678118654752f));
    case GELU_TANH: return 0.5f * v * (1.f + std::tanh(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    default: return v / (1.f + std::exp(-v));
  }
}

struct Work {
  int64_t expert, r0, r1;  // rows [r0, r1) of the expert's output, for all of its slots
};

// out_rows[s, r] = dot(in_rows[s], w[e, r]) (+ bias[e, r]) for the slots s of expert e; gate: also the
// second matrix, combined as act(first + b) * (second + b3). Small groups only (one task per row chunk).
template <typename W>
void expert_matmul(const std::vector<Work>& work, const std::vector<int64_t>& offsets, const float* in, int64_t ldin,
                   const W* w, const float* b, const W* w3, const float* b3, int64_t rows, int64_t cols,
                   int64_t act, bool activate_out, float* out, int64_t ldout) {
  at::parallel_for(0, (int64_t)work.size(), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> tmp;
    for (int64_t i = i0; i < i1; ++i) {
      const Work& job = work[i];
      int64_t s0 = offsets[job.expert], n = offsets[job.expert + 1] - s0;
      tmp.resize(n);
      for (int64_t r = job.r0; r < job.r1; ++r) {
        const W* wr = w + (job.expert * rows + r) * cols;
        float* y = out + s0 * ldout + r;
        dot_rows_any<W>(in + s0 * ldin, ldin, n, wr, cols, y, ldout);
        float bias = b != nullptr ? b[job.expert * rows + r] : 0.f;
        if (w3 != nullptr) {
          dot_rows_any<W>(in + s0 * ldin, ldin, n, w3 + (job.expert * rows + r) * cols, cols, tmp.data(), 1);
          float bias3 = b3 != nullptr ? b3[job.expert * rows + r] : 0.f;
          for (int64_t s = 0; s < n; ++s) y[s * ldout] = activate(y[s * ldout] + bias, act) * (tmp[s] + bias3);
        } else if (activate_out) {
          for (int64_t s = 0; s < n; ++s) y[s * ldout] = activate(y[s * ldout] + bias, act);
        } else if (b != nullptr) {
          for (int64_t s = 0; s < n; ++s) y[s * ldout] += bias;
        }
      }
    }
  });
}

torch::Tensor activation_tensor(const torch::Tensor& v, int64_t act) {
  switch (act) {
    case RELU: return torch::relu(v);
    case GELU: return torch::gelu(v);
    case GELU_TANH: return torch::gelu(v, "tanh");
    default: return torch::silu(v);
  }
}

// x [T, D] f32; topk_ids [T, K] int64 (-1: unused slot); topk_weights [T, K] f32;
// w1 [E, I, D] (+ b1 [E, I]); w3 [E, I, D] (+ b3) for gated experts; w2 [E, D, I] (+ b2 [E, D]).
// Expert e computes y = act(x w1^T + b1) [* (x w3^T + b3)] w2^T + b2; out[t] = sum_j weight[t, j] y[t, j].
torch::Tensor moe_experts(const torch::Tensor& x, const torch::Tensor& topk_ids, const torch::Tensor& topk_weights,
                          const torch::Tensor& w1, const c10::optional<torch::Tensor>& b1,
                          const c10::optional<torch::Tensor>& w3, const c10::optional<torch::Tensor>& b3,
                          const torch::Tensor& w2, const c10::optional<torch::Tensor>& b2, int64_t act,
                          int64_t big_group) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && topk_weights.scalar_type() == at::kFloat, "moe_experts: float32 x");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong, "moe_experts: int64 topk_ids");
  auto xc = x.contiguous();
  auto ids = topk_ids.contiguous();
  auto weights = topk_weights.contiguous();
  int64_t T = xc.size(0), D = xc.size(1), K = ids.size(1), E = w1.size(0), I = w1.size(1);
  TORCH_CHECK(w1.size(2) == D && w2.size(1) == D && w2.size(2) == I, "moe_experts: weight shapes");
  const int64_t* idp = ids.data_ptr<int64_t>();

  // Slots grouped by expert, in (token, slot) order inside each group: a counting sort.
  std::vector<int64_t> offsets(E + 1, 0);
  for (int64_t i = 0; i < T * K; ++i)
    if (idp[i] >= 0) {
      TORCH_CHECK(idp[i] < E, "moe_experts: expert id out of range");
      offsets[idp[i] + 1]++;
    }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  int64_t S = offsets[E];
  std::vector<int64_t> slot_of(T * K, -1), next(offsets.begin(), offsets.end() - 1);
  auto xs = torch::empty({S, D}, xc.options());
  float* xsp = xs.data_ptr<float>();
  const float* xp = xc.data_ptr<float>();
  for (int64_t i = 0; i < T * K; ++i)
    if (idp[i] >= 0) {
      int64_t s = next[idp[i]]++;
      slot_of[i] = s;
      std::copy(xp + (i / K) * D, xp + (i / K + 1) * D, xsp + s * D);
    }

  auto h = torch::empty({S, I}, xc.options());
  auto ys = torch::empty({S, D}, xc.options());
  auto opt = [](const c10::optional<torch::Tensor>& t) { return t.has_value() && t->defined(); };
  torch::Tensor b1f = opt(b1) ? b1->to(at::kFloat).contiguous() : torch::Tensor();
  torch::Tensor b3f = opt(b3) ? b3->to(at::kFloat).contiguous() : torch::Tensor();
  torch::Tensor b2f = opt(b2) ? b2->to(at::kFloat).contiguous() : torch::Tensor();
  const float* b1p = b1f.defined() ? b1f.data_ptr<float>() : nullptr;
  const float* b3p = b3f.defined() ? b3f.data_ptr<float>() : nullptr;
  const float* b2p = b2f.defined() ? b2f.data_ptr<float>() : nullptr;
  auto w1c = w1.contiguous(), w2c = w2.contiguous();
  torch::Tensor w3c = opt(w3) ? w3->contiguous() : torch::Tensor();

  // Big groups (prefill) go to MKL; the others stream their expert's weights once (skinny).
  std::vector<Work> up_work, down_work;
  int64_t up_grain = grain_for(I, D * 2), down_grain = grain_for(D, I * 2);
  for (int64_t e = 0; e < E; ++e) {
    int64_t n = offsets[e + 1] - offsets[e];
    if (n == 0) continue;
    if (n > big_group) {
      auto xe = xs.narrow(0, offsets[e], n);
      auto pre = torch::matmul(xe, w1c[e].to(at::kFloat).t());
      if (b1f.defined()) pre += b1f[e];
      auto he = activation_tensor(pre, act);
      if (w3c.defined()) {
        auto up = torch::matmul(xe, w3c[e].to(at::kFloat).t());
        if (b3f.defined()) up += b3f[e];
        he = he * up;
      }
      h.narrow(0, offsets[e], n).copy_(he);
      auto ye = torch::matmul(he, w2c[e].to(at::kFloat).t());
      if (b2f.defined()) ye += b2f[e];
      ys.narrow(0, offsets[e], n).copy_(ye);
      continue;
    }
    for (int64_t r = 0; r < I; r += up_grain) up_work.push_back({e, r, std::min(I, r + up_grain)});
    for (int64_t r = 0; r < D; r += down_grain) down_work.push_back({e, r, std::min(D, r + down_grain)});
  }
  float* hp = h.data_ptr<float>();
  float* ysp = ys.data_ptr<float>();
  if (w1c.scalar_type() == at::kFloat) {
    const float* w3p = w3c.defined() ? w3c.data_ptr<float>() : nullptr;
    expert_matmul<float>(up_work, offsets, xsp, D, w1c.data_ptr<float>(), b1p, w3p, b3p, I, D, act, true, hp, I);
    expert_matmul<float>(down_work, offsets, hp, I, w2c.data_ptr<float>(), b2p, nullptr, nullptr, D, I, act, false, ysp, D);
  } else {
    TORCH_CHECK(w1c.scalar_type() == at::kBFloat16, "moe_experts: weights must be float32 or bfloat16");
    const bf16* w3p = w3c.defined() ? w3c.data_ptr<bf16>() : nullptr;
    expert_matmul<bf16>(up_work, offsets, xsp, D, w1c.data_ptr<bf16>(), b1p, w3p, b3p, I, D, act, true, hp, I);
    expert_matmul<bf16>(down_work, offsets, hp, I, w2c.data_ptr<bf16>(), b2p, nullptr, nullptr, D, I, act, false, ysp, D);
  }

  // Combine each token's slots in slot order with their weights: no atomics, batch-independent.
  auto out = torch::zeros({T, D}, xc.options());
  float* op = out.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  at::parallel_for(0, T, grain_for(T, D * K), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t j = 0; j < K; ++j) {
        int64_t s = slot_of[t * K + j];
        if (s < 0) continue;
        float wt = wp[t * K + j];
        const float* y = ysp + s * D;
        float* o = op + t * D;
        for (int64_t d = 0; d < D; ++d) o[d] += wt * y[d];
      }
  });
  return out;
}

// ---- attention -------------------------------------------------------------------------------------

// Where the keys and values of a sequence live: a paged cache (block tables) or packed with the queries.
struct PagedKV {
  const float* k;
  const float* v;
  const int32_t* block_tables;
  int64_t max_blocks, block_size, G, Dh;
  inline int64_t row(int64_t seq, int64_t j, int64_t g) const {
    int64_t block = block_tables[seq * max_blocks + j / block_size];
    return ((block * block_size + j % block_size) * G + g) * Dh;
  }
};

struct PackedKV {
  const float* k;
  const float* v;
  const int64_t* starts;  // first row of each sequence
  int64_t G, Dh;
  inline int64_t row(int64_t seq, int64_t j, int64_t g) const { return ((starts[seq] + j) * G + g) * Dh; }
};

constexpr int64_t kChunk = 32;  // keys scored before the running maximum is updated

// One (query token, head): softmax(q . k_j * scale + rel_j) v over the visible keys, online.
template <typename KV>
void attend_one(const KV& kv, int64_t seq, int64_t g, int64_t num_keys, const float* q, const float* q_rel,
                const float* r_k, int64_t rel_stride, int64_t rel_index0, float scale, float* out, float* acc) {
  const int64_t Dh = kv.Dh;
  float m = -INFINITY, l = 0.f;
  std::fill(acc, acc + Dh, 0.f);
  float scores[kChunk];
  for (int64_t j0 = 0; j0 < num_keys; j0 += kChunk) {
    int64_t n = std::min(kChunk, num_keys - j0);
    float chunk_max = -INFINITY;
    for (int64_t c = 0; c < n; ++c) {
      int64_t j = j0 + c;
      float s = dot(q, kv.k + kv.row(seq, j, g), Dh);
      if (r_k != nullptr) s += dot(q_rel, r_k + (rel_index0 - j) * rel_stride, Dh);
      s *= scale;
      scores[c] = s;
      chunk_max = std::max(chunk_max, s);
    }
    if (chunk_max > m) {
      float correction = std::exp(m - chunk_max);
      for (int64_t d = 0; d < Dh; ++d) acc[d] *= correction;
      l *= correction;
      m = chunk_max;
    }
    for (int64_t c = 0; c < n; ++c) {
      float p = std::exp(scores[c] - m);
      l += p;
      const float* v = kv.v + kv.row(seq, j0 + c, g);
      __m512 pv = _mm512_set1_ps(p);
      int64_t d = 0;
      for (; d + 16 <= Dh; d += 16)
        _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + d), _mm512_loadu_ps(acc + d)));
      for (; d < Dh; ++d) acc[d] += p * v[d];
    }
  }
  float inv = l > 0.f ? 1.f / l : 0.f;
  for (int64_t d = 0; d < Dh; ++d) out[d] = acc[d] * inv;
}

// q [T, H, Dh]; seq_ids [T] (int64) the sequence of each query; positions [T] (int64) its position;
// num_keys_of [S] keys of each sequence (bidirectional: all of them; causal: position + 1 at most).
// Relative (Transformer-XL): q_rel [T, H, Dh] = q + r_r_bias and r_k [R, H, Dh] with row
// position - j + rel_offset for key j.
template <typename KV>
torch::Tensor attention_impl(const KV& kv, const torch::Tensor& q, const torch::Tensor& seq_ids,
                             const torch::Tensor& positions, const torch::Tensor& num_keys_of, bool causal,
                             double scale, const c10::optional<torch::Tensor>& q_rel,
                             const c10::optional<torch::Tensor>& r_k, int64_t rel_offset) {
  auto qc = q.contiguous();
  int64_t T = qc.size(0), H = qc.size(1), Dh = qc.size(2), group = H / kv.G;
  auto out = torch::empty_like(qc);
  const int64_t* sp = seq_ids.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t* np = num_keys_of.data_ptr<int64_t>();
  torch::Tensor qr, rk;
  const float* qrp = nullptr;
  const float* rkp = nullptr;
  if (r_k.has_value() && r_k->defined()) {
    qr = q_rel->contiguous();
    rk = r_k->contiguous();
    qrp = qr.data_ptr<float>();
    rkp = rk.data_ptr<float>();
  }
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(Dh);
    for (int64_t i = i0; i < i1; ++i) {
      int64_t t = i / H, h = i % H, seq = sp[t], pos = pp[t];
      int64_t num_keys = causal ? std::min(pos + 1, np[seq]) : np[seq];
      attend_one(kv, seq, h / group, num_keys, qp + i * Dh, qrp ? qrp + i * Dh : nullptr,
                 rkp ? rkp + h * Dh : nullptr, H * Dh, pos + rel_offset, (float)scale, op + i * Dh, acc.data());
    }
  });
  return out;
}

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& seq_ids,
                              const torch::Tensor& positions, const torch::Tensor& num_keys_of, bool causal,
                              double scale, const c10::optional<torch::Tensor>& q_rel,
                              const c10::optional<torch::Tensor>& r_k, int64_t rel_offset) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat, "attention: float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "attention: contiguous cache");
  auto tables = block_tables.to(at::kInt).contiguous();
  PagedKV kv{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables.data_ptr<int32_t>(), tables.size(1),
             k_cache.size(1), k_cache.size(2), k_cache.size(3)};
  return attention_impl(kv, q, seq_ids, positions, num_keys_of, causal, scale, q_rel, r_k, rel_offset);
}

torch::Tensor packed_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& seq_starts, const torch::Tensor& seq_ids,
                               const torch::Tensor& positions, const torch::Tensor& num_keys_of, bool causal,
                               double scale, const c10::optional<torch::Tensor>& q_rel,
                               const c10::optional<torch::Tensor>& r_k, int64_t rel_offset) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat, "attention: float32 only");
  auto kc = k.contiguous(), vc = v.contiguous();
  PackedKV kv{kc.data_ptr<float>(), vc.data_ptr<float>(), seq_starts.data_ptr<int64_t>(), kc.size(1), kc.size(2)};
  return attention_impl(kv, q, seq_ids, positions, num_keys_of, causal, scale, q_rel, r_k, rel_offset);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "y = x W^T + b, streaming W once (few rows of x)");
  m.def("moe_experts", &moe_experts, "grouped experts with a slot-ordered combine");
  m.def("paged_attention", &paged_attention, "attention over a paged KV cache, online softmax");
  m.def("packed_attention", &packed_attention, "attention over packed (varlen) keys, online softmax");
}
