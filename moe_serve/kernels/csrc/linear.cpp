// linear: y[M, N] = x[M, K] W[N, K]^T + b, a register-blocked kernel (linear.h) that streams W from memory
// once, every output one FMA chain over K in a fixed order, over fp32, bf16, int8 or int4 weights; and
// head_linear, the per-head maps of latent attention. Also where dot_rows is instantiated for every format.

#include "linear.h"

#include "bf16_dot.h"
#include "int_dot.h"

namespace moe_serve {

template void dot_rows(const float*, int64_t, int64_t, const Dense<float>&, int64_t, int64_t, int64_t, float*, int64_t);
template void dot_rows(const float*, int64_t, int64_t, const Dense<bf16>&, int64_t, int64_t, int64_t, float*, int64_t);
template void dot_rows(const float*, int64_t, int64_t, const Int8&, int64_t, int64_t, int64_t, float*, int64_t);
template void dot_rows(const float*, int64_t, int64_t, const Int4&, int64_t, int64_t, int64_t, float*, int64_t);

namespace {

// Rows per parallel task: a multiple of 4, all threads busy.
int64_t row_grain(int64_t rows) {
  int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t grain = (rows + threads * 2 - 1) / (threads * 2);
  return std::max<int64_t>(4, (grain + 3) / 4 * 4);
}

template <typename W>
void linear_impl(const float* x_in, int64_t M, int64_t K, const W& w, const float* bias, float* y, int64_t N) {
  std::vector<float> padded;
  const float* x = x_in;
  int64_t ldx = K;
  if (M > 1) {
    ldx = padded_stride(K);
    padded.assign(M * ldx, 0.f);
    for (int64_t m = 0; m < M; ++m) std::copy(x_in + m * K, x_in + (m + 1) * K, padded.data() + m * ldx);
    x = padded.data();
  }
  auto body = [&](int64_t n0, int64_t n1) {
    dot_rows(x, ldx, M, w, K, n0, n1, y, N);
    add_bias(y, bias, M, N, n0, n1);
  };
  if (small_work(M * N * K)) body(0, N);
  else at::parallel_for(0, N, row_grain(N), body);
}

}  // namespace

at::Tensor linear_operand(const at::Tensor& x, const Operand& w, const c10::optional<at::Tensor>& bias) {
  if (w.activations == Activations::INT8) return int8_linear_operand(x, w, bias);
  if (w.activations == Activations::BF16) return bf16_linear_operand(x, w, bias);
  int64_t N = w.N, K = w.K;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "linear: x must be [M, ", K, "] for a weight [", N, ", ", K, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat, "linear: x must be float32, got ", x.scalar_type());
  auto xc = x.contiguous();
  int64_t M = xc.size(0);
  auto y = at::empty({M, N}, xc.options());
  at::Tensor b = check_bias("linear: bias", bias, {N});
  with_view(w, [&](const auto& view) { linear_impl(xc.data_ptr<float>(), M, K, view, ptr_or_null(b), y.data_ptr<float>(), N); });
  return y;
}

// weight [N, K] float32 or bfloat16.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "linear: weight must be float32 or bfloat16, got ", weight.scalar_type(), " (packed formats: linear_packed)");
  Format format = weight.scalar_type() == at::kFloat ? Format::F32 : Format::BF16;
  return linear_operand(x, check_operand("linear: weight", weight.contiguous(), c10::nullopt, format, 2), bias);
}

// A PackedWeight's data [N, K] | [N, K / 2], scales [N, K / 32] (int8, int4) and kernel format name.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& data, const c10::optional<at::Tensor>& scales,
                         const std::string& format, const c10::optional<at::Tensor>& bias) {
  c10::optional<at::Tensor> sc = scales.has_value() && scales->defined() ? c10::optional<at::Tensor>(scales->contiguous()) : c10::nullopt;
  return linear_operand(x, check_operand("linear_packed: weight", data.contiguous(), sc, parse_kernel_format(format), 2), bias);
}

// Per-head linear maps, y[t, h] = w[h] x[t, h] (x [T, H, K], w [H, N, K] float32 or bfloat16 -> [T, H, N]):
// multi-head latent attention's absorbed key and value maps (moe_serve/layers/latent_attention.py). Each head
// is a linear over its own rows of x through dot_rows, so a row's result is the same FMA chains whatever T
// is (a batched matmul picks its blocking by T: a request's log-probabilities moved with its batch).
at::Tensor head_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "head_linear: weight must be float32 or bfloat16, got ", weight.scalar_type());
  Operand w = check_operand("head_linear: weight", weight.contiguous(), c10::nullopt,
                            weight.scalar_type() == at::kFloat ? Format::F32 : Format::BF16, 3);
  const int64_t H = w.data.size(0), N = w.data.size(1), K = w.K;
  TORCH_CHECK(x.dim() == 3 && x.size(1) == H && x.size(2) == K, "head_linear: x must be [T, ", H, ", ", K,
              "] for a weight [", H, ", ", N, ", ", K, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat, "head_linear: x must be float32, got ", x.scalar_type());
  const int64_t T = x.size(0), ldx = padded_stride(K);
  // Each head's rows of x together, rows ldx apart (as linear_impl pads them: off each other's L1 sets).
  std::vector<float> rows(H * T * ldx, 0.f);
  auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) std::copy(xp + (t * H + h) * K, xp + (t * H + h + 1) * K, rows.data() + (h * T + t) * ldx);
  auto y = at::empty({T, H, N}, xc.options());
  float* yp = y.data_ptr<float>();
  with_view(w, [&](const auto& view) {
    auto body = [&](int64_t h0, int64_t h1) {
      for (int64_t h = h0; h < h1; ++h) dot_rows(rows.data() + h * T * ldx, ldx, T, view.at(h * N), K, 0, N, yp + h * N, H * N);
    };
    if (small_work(T * H * N * K)) body(0, H);
    else at::parallel_for(0, H, 1, body);
  });
  return y;
}

}  // namespace moe_serve
