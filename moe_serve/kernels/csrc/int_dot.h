// int8 activations (--cpu-activations int8): activation rows quantized in blocks of GROUP, and the integer
// dot products of such rows with int8 and int4 weights (int_dot.cpp; the experts of moe.cpp call them too).
//
// The quantizer (llama.cpp's Q8_0 on activations, with an fp32 scale): per row and block of 32 values,
// d = max|x| / 127, q = round_half_even(x * (1 / d)) (d = 0 and q = 0 where max|x| < 2^-120, whose 1 / d
// would overflow), each block's sum of q kept for int4's offset. A block's dot product with a weight block is then an exact int32 (its order does not matter), and
// an output is the fp32 sum over blocks b = 0, 1, .., K / 32 - 1 of (d_w[b] * d_x[b]) * float(isum[b]):
// two multiplies and an add a block, each rounded (no FMA), in an order fixed by K alone. A row's result is
// the same whatever it is batched with, and moe_serve.kernels.reference.int8_linear_torch reproduces it
// bit for bit. Non-finite activations give non-finite outputs (their block's scale is NaN).
//
// Weights in two layouts give the same bits: their rows as stored (formats.h's Int8, Int4), or repacked at
// load into tiles of 8 rows (Int8Tiles, Int4Tiles; moe_serve.kernels.packed.tile): per 8 rows and group of
// 32 values, the rows' bytes interleaved by 4 (step s holds bytes 4s..4s+3 of row 0, then of row 1, .., row 7;
// int8: 8 steps, int4: 4 steps of its 16 bytes a group, low nibbles values 4s..4s+3, high ones 16 + 4s..) and
// the 8 rows' fp16 scales. One 32-byte load then feeds one output row per 32-bit lane, with a broadcast of
// four activation bytes: the 8 rows' sums build up lane by lane, without horizontal adds, from one stream.
//
// The kernels use 256-bit integer instructions on both builds: vpmaddubsw and vpmaddwd, or AVX-512 VNNI's
// vpdpbusd where the AVX-512 build has it. Block sums are exact integers either way, so every build computes
// the same bits.
#pragma once

#include <type_traits>

#include "formats.h"

namespace moe_serve {

// The integer dot products' instructions in this build: "avx512-vnni" (vpdpbusd) or "avx2".
const char* int_dot_isa();

// Activation rows in int8: q [M, K] (rows K apart), a = |q| [M, K] (vpmaddubsw's unsigned operand against
// int8 weights, made once per row rather than per tile), d [M, K / GROUP] fp32 scales, s [M, K / GROUP] block sums.
struct QRows {
  const int8_t* q;
  const int8_t* a;
  const float* d;
  const int32_t* s;
  int64_t K;
  QRows at(int64_t m) const { return {q + m * K, a + m * K, d + m * (K / GROUP), s + m * (K / GROUP), K}; }
};

// Storage for M quantized rows of K values (K a multiple of GROUP).
struct QBuffer {
  at::Tensor q, a, d, s;
  QBuffer(int64_t M, int64_t K);
  QRows rows() const {
    return {q.data_ptr<int8_t>(), a.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<int32_t>(), q.size(1)};
  }
};

// Rows x[m * ldx, +K) for m < M quantized into out, a QBuffer(M, K) (K a multiple of GROUP).
void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, QBuffer& out);

// Tiled int8 [.., N / 8, K / 32, 256] and int4 [.., N / 8, K / 32, 128] data with scales [.., N / 8, K / 32, 8].
template <typename Q, int64_t BYTES>
struct Tiles {
  static constexpr int64_t TILE = BYTES;
  const Q* q;
  const uint16_t* d;
  int64_t K;
  Tiles at(int64_t n) const {  // from row n, a multiple of 8
    return {q + n / TILE_ROWS * (K / GROUP) * BYTES, d + n / TILE_ROWS * (K / GROUP) * TILE_ROWS, K};
  }
};
using Int8Tiles = Tiles<int8_t, TILE_ROWS * GROUP>;
using Int4Tiles = Tiles<uint8_t, TILE_ROWS * GROUP / 2>;

template <>
inline Int8Tiles view(const Operand& w) { return {w.data.data_ptr<int8_t>(), scales_of(w), w.K}; }
template <>
inline Int4Tiles view(const Operand& w) { return {w.data.data_ptr<uint8_t>(), scales_of(w), w.K}; }

// f(view) for an int8 or int4 operand, in its layout.
template <typename F>
void with_int_view(const Operand& w, F&& f) {
  TORCH_CHECK(w.format == Format::INT8 || w.format == Format::INT4, "int8 activations: int8 or int4 weights, got ",
              info(w.format).name);
  if (w.format == Format::INT8) {
    if (w.tiled) f(view<Int8Tiles>(w));
    else f(view<Int8>(w));
  } else {
    if (w.tiled) f(view<Int4Tiles>(w));
    else f(view<Int4>(w));
  }
}

// f(view) for any operand: with_int_view where its input is quantized to int8, else formats.h's with_view.
template <typename F>
void with_any_view(const Operand& w, F&& f) {
  if (w.activations == Activations::INT8) with_int_view(w, f);
  else with_view(w, f);
}

template <typename W>
inline constexpr bool is_tiles = std::is_same_v<W, Int8Tiles> || std::is_same_v<W, Int4Tiles>;
template <typename W>
inline constexpr bool has_int_kernel = std::is_same_v<W, Int8> || std::is_same_v<W, Int4> ||
                                       std::is_same_v<W, Int8Tiles> || std::is_same_v<W, Int4Tiles>;

// C[m * ldc + n] = the integer-block dot product of x's row m with row n of w, for n in [n0, n1) (W: Int8 or
// Int4 rows, formats.h, or their tiles, n0 and n1 then multiples of 8), every m < M.
template <typename W>
void int_dot_rows(const QRows& x, int64_t M, const W& w, int64_t n0, int64_t n1, float* C, int64_t ldc);

extern template void int_dot_rows(const QRows&, int64_t, const Int8&, int64_t, int64_t, float*, int64_t);
extern template void int_dot_rows(const QRows&, int64_t, const Int4&, int64_t, int64_t, float*, int64_t);
extern template void int_dot_rows(const QRows&, int64_t, const Int8Tiles&, int64_t, int64_t, float*, int64_t);
extern template void int_dot_rows(const QRows&, int64_t, const Int4Tiles&, int64_t, int64_t, float*, int64_t);

// x [M, K] f32 -> (q int8 [M, K], d f32 [M, K / GROUP], s int32 [M, K / GROUP]): the quantizer, for the tests.
std::vector<at::Tensor> quantize_activations(const at::Tensor& x);

// y [M, N] = x w^T + bias with x quantized to int8 first: over an int8 or int4 operand.
at::Tensor int8_linear_operand(const at::Tensor& x, const Operand& w, const c10::optional<at::Tensor>& bias);

}  // namespace moe_serve
