// bf16 activations (--cpu-activations bf16, and auto where the CPU has AVX-512 BF16): the input rows of a
// bf16 weight rounded to bf16, and their dot products with its rows by vdpbf16ps (bf16_dot.cpp; the experts of
// moe.cpp call them too).
//
// Rounding: x to the nearest bf16, ties to even, NaN to 0x7FC0: PyTorch's float -> bfloat16 conversion, so
// `x.to(torch.bfloat16)` is the reference. Products: vdpbf16ps adds a pair of bf16 products to each fp32
// lane, rounding after each addition, with bf16 subnormals read as zero and fp32 subnormal results flushed
// to zero. Each output has one 16-lane accumulator over its K values in chunks of 32 (lane j takes values
// 32 c + 2j and 32 c + 2j + 1 of chunk c), chunk after chunk, and then one fixed tree over the lanes
// ((j + 8), then + 4, + 2, + 1): an order fixed by K alone. A row's result is therefore the same whatever it is
// batched with, and moe_serve.kernels.reference.bf16_linear_torch reproduces it bit for bit (for products in
// the normal range). K must be a multiple of 32 (Python keeps fp32 activations for other weights).
#pragma once

#include "formats.h"

namespace moe_serve {

// Activation rows rounded to bf16: [M, K], rows `ld` apart.
struct BRows {
  const bf16* x;
  int64_t ld;
  BRows at(int64_t m) const { return {x + m * ld, ld}; }
};

// Storage for M rounded rows of K values.
struct BBuffer {
  at::Tensor x;
  BBuffer(int64_t M, int64_t K);
  BRows rows() const { return {x.data_ptr<bf16>(), x.size(1)}; }
};

// Rows x[m * ldx, +K) for m < M rounded into out, a BBuffer(M, K).
void round_rows_bf16(const float* x, int64_t ldx, int64_t M, int64_t K, BBuffer& out);

// C[m * ldc + n] = the bf16 dot product of x's row m with row n of w, for n in [n0, n1), every m < M
// (w.ld == K, a multiple of 32).
void bf16_dot_rows(const BRows& x, int64_t M, const Dense<bf16>& w, int64_t K, int64_t n0, int64_t n1, float* C,
                   int64_t ldc);

// y [M, N] = x w^T + bias with x rounded to bf16 first: over a bf16 operand.
at::Tensor bf16_linear_operand(const at::Tensor& x, const Operand& w, const c10::optional<at::Tensor>& bias);

}  // namespace moe_serve
