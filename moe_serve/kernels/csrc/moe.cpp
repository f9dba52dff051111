// MoE experts and routing. moe_experts: sum over a token's slots of weight * expert(x), slots grouped by
// expert, each expert's weights streamed once for all of its slots (through linear.h's dot_rows), combined
// in slot order; moe_experts_packed the same over banks stored in fewer bits (formats.h). topk_route: top-k
// experts per row (ties to the lower index) and their combine weights.

#include "moe.h"

#include <numeric>

#include "bf16_dot.h"
#include "int_dot.h"
#include "linear.h"

namespace moe_serve {

// ---- MoE experts -------------------------------------------------------------------------------------

namespace {

// erf, |error| < 1.2e-7 (Numerical Recipes' erfc Chebyshev fit).
inline vf erf16(vf x) {
  vf z = vabs(x);
  vf t = vdiv(vset1(1.f), vfmadd(z, vset1(0.5f), vset1(1.f)));
  const float c[] = {0.17087277f, -0.82215223f, 1.48851587f, -1.13520398f, 0.27886807f, -0.18628806f,
                     0.09678418f, 0.37409196f, 1.00002368f, -1.26551223f};
  vf p = vset1(c[0]);
  for (int i = 1; i < 10; ++i) p = vfmadd(p, t, vset1(c[i]));
  vf erfc = vmul(t, exp16(vsub(p, vmul(z, z))));
  vf r = vsub(vset1(1.f), erfc);
  return vnegate_where_negative(x, r);
}

inline vf activate16(vf v, int64_t kind) {
  const vf one = vset1(1.f), half = vset1(0.5f);
  switch (kind) {
    case RELU: return vmax(v, vzero());
    case GELU: return vmul(vmul(half, v), vadd(one, erf16(vmul(v, vset1(0.70710678118654752f)))));
    case GELU_TANH: {
      vf y = vmul(vset1(0.79788456080286536f), vfmadd(vmul(vset1(0.044715f), v), vmul(v, v), v));
      vf tanh = vsub(one, vdiv(vset1(2.f), vadd(one, exp16(vadd(y, y)))));
      return vmul(vmul(half, v), vadd(one, tanh));
    }
    default: return vdiv(v, vadd(one, exp16(vsub(vzero(), v))));
  }
}

// out[r0:r1] = act(out + b) [* (up + b3)], or out + b without act: 16 values at a time.
inline void epilogue(float* out, const float* up, const float* b, const float* b3, int64_t n, const Act& act,
                     bool gated, bool activated) {
  for (int64_t r = 0; r < n; r += 16) {
    mask16 m = tail_mask(n - r);
    vf v = vload_masked(m, out + r);
    if (b != nullptr) v = vadd(v, vload_masked(m, b + r));
    if (gated) {
      vf u = vload_masked(m, up + r);
      if (b3 != nullptr) u = vadd(u, vload_masked(m, b3 + r));
      if (act.kind == SWIGLU_OAI) {
        const vf limit = vset1(act.limit), one = vset1(1.f);
        vf g = vmin(v, limit);
        vf glu = vdiv(g, vadd(one, exp16(vmul(vset1(-act.alpha), g))));  // g * sigmoid(alpha g)
        v = vmul(glu, vadd(vmax(vmin(u, limit), vsub(vzero(), limit)), one));
      } else {
        v = vmul(activate16(v, act.kind), u);
      }
    } else if (activated) {
      v = activate16(v, act.kind);
    }
    vstore_masked(out + r, m, v);
  }
}

struct Work {
  int64_t expert, r0, r1;  // rows [r0, r1) of the expert's output, for all of its slots
};

// out[s, r] for the slots s of each work item's expert: dot(in[s], w[e, r]) (+ b[e, r]); gated (w3): the
// first matrix activated times the second; activate: act(first + b). w and w3 are banks [E * rows, cols].
// rounded: the same rows quantized to int8 (int_dot.h) or rounded to bf16 (bf16_dot.h), whose products then
// replace the float ones.
struct RoundedRows {
  const QRows* int8 = nullptr;
  const BRows* bf16 = nullptr;
};

template <typename W>
void expert_matmul(const std::vector<Work>& work, const std::vector<int64_t>& offsets, const float* in, int64_t ldin,
                   const RoundedRows& rounded, const W& w, const float* b, const W* w3, const float* b3, int64_t rows,
                   int64_t cols, const Act& act, bool activate_out, float* out, int64_t ldout, float* scratch) {
  auto dot = [&](const W& bank, int64_t s0, int64_t n, const Work& job, float* to) {
    if constexpr (has_int_kernel<W>) {
      if (rounded.int8 != nullptr) {
        int_dot_rows(rounded.int8->at(s0), n, bank.at(job.expert * rows), job.r0, job.r1, to + s0 * ldout, ldout);
        return;
      }
    }
    if constexpr (std::is_same_v<W, Dense<bf16>>) {
      if (rounded.bf16 != nullptr) {
        bf16_dot_rows(rounded.bf16->at(s0), n, bank.at(job.expert * rows), cols, job.r0, job.r1, to + s0 * ldout, ldout);
        return;
      }
    }
    if constexpr (!is_tiles<W>)  // tiles are read with int8 activations only
      dot_rows(in + s0 * ldin, ldin, n, bank.at(job.expert * rows), cols, job.r0, job.r1, to + s0 * ldout, ldout);
  };
  auto body = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Work& job = work[i];
      int64_t s0 = offsets[job.expert], n = offsets[job.expert + 1] - s0;
      dot(w, s0, n, job, out);
      if (w3 != nullptr) dot(*w3, s0, n, job, scratch);
      const float* be = b != nullptr ? b + job.expert * rows + job.r0 : nullptr;
      const float* b3e = b3 != nullptr ? b3 + job.expert * rows + job.r0 : nullptr;
      for (int64_t s = s0; s < s0 + n; ++s)
        epilogue(out + s * ldout + job.r0, w3 != nullptr ? scratch + s * ldout + job.r0 : nullptr, be, b3e,
                 job.r1 - job.r0, act, w3 != nullptr, activate_out);
    }
  };
  if (work.size() <= 1) body(0, (int64_t)work.size());
  else at::parallel_for(0, (int64_t)work.size(), 1, body);
}

// Split each expert's output rows into tasks so both threads stay busy however many experts are active.
std::vector<Work> plan(const std::vector<int64_t>& offsets, int64_t rows, int64_t inner) {
  int64_t E = (int64_t)offsets.size() - 1, slots = offsets[E], active = 0;
  for (int64_t e = 0; e < E; ++e) active += offsets[e + 1] > offsets[e];
  int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t pieces = small_work(slots * rows * inner) ? 1 : (threads * 4 + active - 1) / std::max<int64_t>(active, 1);
  // A multiple of 8 rows: the tiles of int8 activations (int_dot.h) hold 8 rows each.
  int64_t chunk = std::max<int64_t>(8, ((rows + pieces - 1) / pieces + 7) / 8 * 8);
  std::vector<Work> work;
  for (int64_t e = 0; e < E; ++e)
    if (offsets[e + 1] > offsets[e])
      for (int64_t r = 0; r < rows; r += chunk) work.push_back({e, r, std::min(rows, r + chunk)});
  return work;
}

}  // namespace

// x [T, D] f32; topk_ids [T, max_k] int64 (-1: unused slot); topk_weights [T, max_k] f32; the banks
// w1 [E, I, D] (+ b1 [E, I]), w3 [E, I, D] (+ b3) for gated experts, in one format; w2 [E, D, I] (+ b2 [E, D])
// in its own.
// Expert e computes y = act(x w1^T + b1) [* (x w3^T + b3)] w2^T + b2; out[t] = sum_j weight[t, j] y[t, j].
at::Tensor moe_experts_operands(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                const Operand& w1, const c10::optional<at::Tensor>& b1, const c10::optional<Operand>& w3,
                                const c10::optional<at::Tensor>& b3, const Operand& w2,
                                const c10::optional<at::Tensor>& b2, const Act& act) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && topk_weights.scalar_type() == at::kFloat, "moe_experts: float32 x");
  TORCH_CHECK(act.kind >= RELU && act.kind <= SWIGLU_OAI, "moe_experts: unknown activation ", act.kind);
  TORCH_CHECK(act.kind != SWIGLU_OAI || (w3.has_value() && act.limit > 0.f),
              "moe_experts: the clamped SwiGLU needs gated experts (w3) and a positive limit");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong, "moe_experts: int64 topk_ids");
  auto xc = x.contiguous();
  auto ids = topk_ids.contiguous();
  auto weights = topk_weights.contiguous();
  int64_t T = xc.size(0), D = xc.size(1), max_k = ids.size(1), E = w1.data.size(0), I = w1.N;
  TORCH_CHECK(w1.K == D, "moe_experts: w1 must be [E, I, D] with D = ", D, " (x's), got K = ", w1.K);
  TORCH_CHECK(w2.data.size(0) == E && w2.N == D && w2.K == I, "moe_experts: w2 must be [E, D, I] = [", E, ", ",
              D, ", ", I, "], got ", w2.data.sizes(), " holding K = ", w2.K);
  TORCH_CHECK(!w3.has_value() || (w3->format == w1.format && w3->tiled == w1.tiled &&
                                   w3->activations == w1.activations && w3->data.sizes() == w1.data.sizes()),
              "moe_experts: w3 must match w1's format, layout and shape");
  const int64_t* idp = ids.data_ptr<int64_t>();

  // Slots grouped by expert, in (token, slot) order inside each group: a counting sort.
  std::vector<int64_t> offsets(E + 1, 0);
  for (int64_t i = 0; i < T * max_k; ++i)
    if (idp[i] >= 0) {
      TORCH_CHECK(idp[i] < E, "moe_experts: expert id out of range");
      offsets[idp[i] + 1]++;
    }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  int64_t S = offsets[E];
  std::vector<int64_t> slot_of(T * max_k, -1), next(offsets.begin(), offsets.end() - 1);
  // xs [S, D], h [S, I], up [S, I], ys [S, D], rows padded apart (see padded_stride)
  const int64_t ldd = padded_stride(D), ldi = padded_stride(I);
  auto buffers = at::empty({S * (ldd + 2 * ldi + D)}, xc.options());
  float* xsp = buffers.data_ptr<float>();
  float* hp = xsp + S * ldd;
  float* upp = hp + S * ldi;
  float* ysp = upp + S * ldi;
  const float* xp = xc.data_ptr<float>();
  for (int64_t i = 0; i < T * max_k; ++i)
    if (idp[i] >= 0) {
      int64_t s = next[idp[i]]++;
      slot_of[i] = s;
      std::copy(xp + (i / max_k) * D, xp + (i / max_k + 1) * D, xsp + s * ldd);
    }

  at::Tensor b1f = check_bias("moe_experts: b1", b1, {E, I});
  at::Tensor b3f = check_bias("moe_experts: b3", b3, {E, I});
  at::Tensor b2f = check_bias("moe_experts: b2", b2, {E, D});
  std::vector<Work> up_work = plan(offsets, I, D), down_work = plan(offsets, D, I);
  // int8 or bf16 activations: the slots' rows rounded once for the up projection (and the gate), the
  // activated rows once for the down projection.
  c10::optional<QBuffer> xq, hq;
  c10::optional<BBuffer> xb, hb;
  auto round = [&](const Operand& w, const float* rows, int64_t ld, int64_t K, c10::optional<QBuffer>& q,
                   c10::optional<BBuffer>& b) {
    if (w.activations == Activations::INT8) quantize_rows(rows, ld, S, K, q.emplace(S, K));
    if (w.activations == Activations::BF16) round_rows_bf16(rows, ld, S, K, b.emplace(S, K));
  };
  round(w1, xsp, ldd, D, xq, xb);
  with_any_view(w1, [&](const auto& up) {
    using W = std::decay_t<decltype(up)>;
    W gate = w3.has_value() ? view<W>(*w3) : W{};
    QRows qrows = xq.has_value() ? xq->rows() : QRows{};
    BRows brows = xb.has_value() ? xb->rows() : BRows{};
    RoundedRows rounded{xq.has_value() ? &qrows : nullptr, xb.has_value() ? &brows : nullptr};
    expert_matmul(up_work, offsets, xsp, ldd, rounded, up, ptr_or_null(b1f), w3.has_value() ? &gate : nullptr,
                  ptr_or_null(b3f), I, D, act, true, hp, ldi, upp);
  });
  round(w2, hp, ldi, I, hq, hb);
  with_any_view(w2, [&](const auto& down) {
    QRows qrows = hq.has_value() ? hq->rows() : QRows{};
    BRows brows = hb.has_value() ? hb->rows() : BRows{};
    RoundedRows rounded{hq.has_value() ? &qrows : nullptr, hb.has_value() ? &brows : nullptr};
    expert_matmul(down_work, offsets, hp, ldi, rounded, down, ptr_or_null(b2f), decltype(&down)(nullptr), nullptr, D,
                  I, act, false, ysp, D, nullptr);
  });

  // Combine each token's slots in slot order with their weights: no atomics, batch-independent.
  auto out = at::zeros({T, D}, xc.options());
  float* op = out.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < max_k; ++j) {
      int64_t s = slot_of[t * max_k + j];
      if (s < 0) continue;
      float wt = wp[t * max_k + j];
      const float* y = ysp + s * D;
      float* o = op + t * D;
      for (int64_t d = 0; d < D; ++d) o[d] += wt * y[d];
    }
  return out;
}

// The banks as float32 or bfloat16 tensors (w3, when given, of w1's dtype).
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& w1, const c10::optional<at::Tensor>& b1,
                       const c10::optional<at::Tensor>& w3, const c10::optional<at::Tensor>& b3,
                       const at::Tensor& w2, const c10::optional<at::Tensor>& b2, int64_t act, double alpha,
                       double limit) {
  auto plain = [](const char* what, const at::Tensor& w) {
    TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "moe_experts: ", what,
                " must be float32 or bfloat16, got ", w.scalar_type(), " (packed formats: moe_experts_packed)");
    return check_operand(std::string("moe_experts: ") + what, w, c10::nullopt,
                         w.scalar_type() == at::kFloat ? Format::F32 : Format::BF16, 3);
  };
  c10::optional<Operand> gate;
  if (w3.has_value() && w3->defined()) gate = plain("w3", *w3);
  return moe_experts_operands(x, topk_ids, topk_weights, plain("w1", w1), b1, gate, b3, plain("w2", w2), b2,
                              Act{act, (float)alpha, (float)limit});
}

// The banks as PackedWeight fields: w1 and w3 (data, scales) in format_up, w2 in format_down (any of fp32,
// bf16, int8, int4; scales None for fp32 and bf16).
at::Tensor moe_experts_packed(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                              const std::string& format_up, const at::Tensor& w1, const c10::optional<at::Tensor>& s1,
                              const c10::optional<at::Tensor>& b1, const c10::optional<at::Tensor>& w3,
                              const c10::optional<at::Tensor>& s3, const c10::optional<at::Tensor>& b3,
                              const std::string& format_down, const at::Tensor& w2,
                              const c10::optional<at::Tensor>& s2, const c10::optional<at::Tensor>& b2, int64_t act,
                              double alpha, double limit) {
  KernelFormat up = parse_kernel_format(format_up);
  c10::optional<Operand> gate;
  if (w3.has_value() && w3->defined()) gate = check_operand("moe_experts_packed: w3", *w3, s3, up, 3);
  return moe_experts_operands(x, topk_ids, topk_weights, check_operand("moe_experts_packed: w1", w1, s1, up, 3), b1, gate,
                              b3, check_operand("moe_experts_packed: w2", w2, s2, parse_kernel_format(format_down), 3), b2,
                              Act{act, (float)alpha, (float)limit});
}

// ---- routing -----------------------------------------------------------------------------------------

// logits [R, N] f32, token_k [R] int64 (each row's k) -> (ids [R, max_k] int64, -1 beyond a row's k;
// weights [R, max_k] f32, as `weighting` says).
std::vector<at::Tensor> topk_route(const at::Tensor& logits, const at::Tensor& token_k, int64_t max_k,
                                   int64_t weighting) {
  auto lc = logits.contiguous();
  auto kc = token_k.to(at::kLong).contiguous();
  int64_t R = lc.size(0), N = lc.size(1);
  auto ids = at::full({R, max_k}, -1, lc.options().dtype(at::kLong));
  auto weights = at::zeros({R, max_k}, lc.options());
  const float* lp = lc.data_ptr<float>();
  const int64_t* kp = kc.data_ptr<int64_t>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* wp = weights.data_ptr<float>();
  std::vector<int64_t> order(N);
  for (int64_t r = 0; r < R; ++r) {
    const float* row = lp + r * N;
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return row[a] > row[b]; });
    int64_t k = std::min(kp[r], max_k);
    float peak = row[order[0]], total = 0.f;
    if (weighting == SOFTMAX_ALL)
      for (int64_t n = 0; n < N; ++n) total += std::exp(row[n] - peak);
    else if (weighting == SOFTMAX_CHOSEN)
      for (int64_t j = 0; j < k; ++j) total += std::exp(row[order[j]] - peak);
    for (int64_t j = 0; j < k; ++j) {
      ip[r * max_k + j] = order[j];
      wp[r * max_k + j] = weighting == UNIFORM ? 1.f / (float)kp[r] : std::exp(row[order[j]] - peak) / total;
    }
  }
  return {ids, weights};
}

}  // namespace moe_serve
