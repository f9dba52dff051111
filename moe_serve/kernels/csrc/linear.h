// The dot-product blocks every matrix product of the kernels runs (linear, head_linear, the experts of
// moe.cpp): register-blocked micro-kernels over a weight format's view, templates here so that the vector
// layer and the formats' loads inline into them; dot_rows is instantiated once per format, in linear.cpp.
// Then the linear entry points (linear.cpp).
#pragma once

#include "formats.h"

namespace moe_serve {

// ---- dot-product blocks ------------------------------------------------------------------------------

// C[m * ldc + n] = dot(X[m], W[n]) for MB rows of X and NB rows of W, over K: one accumulator per output,
// the same FMA chain (k = 0, 1, .., K - 1 in each lane) whatever MB, NB and W's format are.
template <typename W, int MB, int NB>
inline void micro(const float* X, int64_t ldx, const W& w, int64_t K, float* C, int64_t ldc) {
  constexpr int V = W::STEP / 16;
  vf acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = vzero();
  int64_t k = 0;
  for (; k + W::STEP <= K; k += W::STEP) {
    vf wv[NB][V];
    for (int j = 0; j < NB; ++j) w.load(j, k, wv[j]);
    for (int v = 0; v < V; ++v)
      for (int i = 0; i < MB; ++i) {
        vf x = vload(X + i * ldx + k + 16 * v);
        for (int j = 0; j < NB; ++j) acc[i][j] = vfmadd(x, wv[j][v], acc[i][j]);
      }
  }
  if constexpr (!W::TILED) {  // a tail shorter than 16 (grouped formats have none)
    if (k < K) {
      mask16 m = tail_mask(K - k);
      vf wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = w.load_tail(j, k, m);
      for (int i = 0; i < MB; ++i) {
        vf x = vload_masked(m, X + i * ldx + k);
        for (int j = 0; j < NB; ++j) acc[i][j] = vfmadd(x, wv[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) C[i * ldc + j] = vreduce_add(acc[i][j]);
}

// Above 4 rows of X, a block of BLOCK_W rows of W meets BLOCK_X rows of X: BLOCK_X * BLOCK_W accumulators.
// AVX-512: 5 x 5, 5 loads of W and 5 of X per 25 FMAs. Measured at 64 rows against 8x2 blocks: 160 GFLOP/s
// against 93 (1024 x 32000); 4x6 143, 6x4 127 (25 accumulators + 5 W + 1 X fill 31 of the 32 registers).
// AVX2 has 16 registers and a vf takes two: 2 x 2 (8 for the accumulators, 4 for W, 2 for X); at 64 rows
// (1024 x 32000) 79 GFLOP/s on 2 Zen cores against 72 for 3 x 2 (which spills) and 65 for 4 x 1.
#if defined(__AVX512F__)
constexpr int BLOCK_X = 5, BLOCK_W = 5;
#else
constexpr int BLOCK_X = 2, BLOCK_W = 2;
#endif

template <typename W, int NB>
inline void micro_rows(const float* X, int64_t ldx, int64_t mb, const W& w, int64_t K, float* C, int64_t ldc) {
  switch (mb) {
    case 8: micro<W, 8, NB>(X, ldx, w, K, C, ldc); break;
    case 7: micro<W, 7, NB>(X, ldx, w, K, C, ldc); break;
    case 6: micro<W, 6, NB>(X, ldx, w, K, C, ldc); break;
    case 5: micro<W, 5, NB>(X, ldx, w, K, C, ldc); break;
    case 4: micro<W, 4, NB>(X, ldx, w, K, C, ldc); break;
    case 3: micro<W, 3, NB>(X, ldx, w, K, C, ldc); break;
    case 2: micro<W, 2, NB>(X, ldx, w, K, C, ldc); break;
    default: micro<W, 1, NB>(X, ldx, w, K, C, ldc); break;
  }
}

// A row stride for copies of X (and tiles of W) that keeps their rows out of each other's L1 sets: rows
// 4 KiB apart (K a multiple of 1024 floats) all land in the same set and evict each other and the W stream.
inline int64_t padded_stride(int64_t K) { return (K + 15) / 16 * 16 + 16; }

// Register blocks of BLOCK_X rows of X by BLOCK_W rows of W, then W's remaining rows one at a time.
template <typename W>
void dot_blocks(const float* X, int64_t ldx, int64_t M, const W& w, int64_t K, int64_t n0, int64_t n1, float* C, int64_t ldc) {
  int64_t n = n0;
  for (; n + BLOCK_W <= n1; n += BLOCK_W)
    for (int64_t m = 0; m < M; m += BLOCK_X)
      micro_rows<W, BLOCK_W>(X + m * ldx, ldx, std::min<int64_t>(BLOCK_X, M - m), w.at(n), K, C + m * ldc + n, ldc);
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; m += 8)
      micro_rows<W, 1>(X + m * ldx, ldx, std::min<int64_t>(8, M - m), w.at(n), K, C + m * ldc + n, ldc);
}

// Rows [n, n + rows) of w in fp32 (the values its loads give), rows `ld` apart. Inline: out of line (as
// GCC left it for Int8 once dot_rows had external linkage) the tiles of 5-16 rows were 2-4% slower.
template <typename W>
inline void dequantize_rows(const W& w, int64_t n, int64_t rows, int64_t K, float* out, int64_t ld) {
  constexpr int V = W::STEP / 16;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; k += W::STEP) {
      vf v[V];
      w.load(n + r, k, v);
      for (int i = 0; i < V; ++i) vstore(out + r * ld + k + 16 * i, v[i]);
    }
}

// One row of X against rows [n0, n1) of a grouped format: rows n and n + half together, two independent
// chains (a lone chain's FMA latency and unpacking hold a row at ~8 GB/s a core) from two sequential streams
// (rows n and n + 1 together, 512 bytes apart, ran 1.5-2.4x slower from memory: the pattern the prefetchers
// lose). Each output is micro<W, 1, 1>'s chain, so the results are the same.
template <typename W>
void dot_row_pairs(const float* X, const W& w, int64_t K, int64_t n0, int64_t n1, float* C) {
  constexpr int V = W::STEP / 16;
  const int64_t half = (n1 - n0) / 2;
  for (int64_t n = n0; n < n0 + half; ++n) {
    W a = w.at(n), b = w.at(n + half);
    vf acc_a = vzero(), acc_b = vzero();
    for (int64_t k = 0; k < K; k += W::STEP) {
      vf wa[V], wb[V];
      a.load(0, k, wa);
      b.load(0, k, wb);
      for (int v = 0; v < V; ++v) {
        vf x = vload(X + k + 16 * v);
        acc_a = vfmadd(x, wa[v], acc_a);
        acc_b = vfmadd(x, wb[v], acc_b);
      }
    }
    C[n] = vreduce_add(acc_a);
    C[n + half] = vreduce_add(acc_b);
  }
  if ((n1 - n0) % 2) micro<W, 1, 1>(X, 0, w.at(n1 - 1), K, C + n1 - 1, 1);
}

// C[m, n] = dot(X[m], W[n]) for all M rows of X and rows [n0, n1) of W. W is read from memory once: with
// up to 4 rows of X, one row of W at a time (a single sequential stream per thread: the prefetchers keep
// up, ~30 GB/s here against ~23 with four interleaved streams); with more, blocks of BLOCK_W rows of W sit
// in L1 while the rows of X stream past BLOCK_X at a time from L2 (grouped formats: dequantized once into
// an L1 tile first). Every output is the same FMA chain: the results are identical whatever M is.
//
// Grouped formats, measured on one Zen 4 core (LM head 32000 x 1024 from memory, benchmarks/packed_gemv.py):
// - up to 4 rows, unpacked in registers at each step: int4 2.06 ms at M = 1, int8 2.04 (fp32 4.05), one
//   accumulator chain a row (two chained FMAs a group); two or four adjacent rows of W at a time
//   (independent chains) were slower from memory (int4 2.88, 2.84 ms: several streams again). At M = 1 the
//   grouped formats now take rows n and n + half instead (dot_row_pairs): two streams that stay sequential.
//   A batch-1 decode step of the medium model at k = 2, interleaved A/B in one process (25 rounds, medians):
//   int4 6.40 -> 5.67 ms (fp32 activations), 5.06 -> 4.84 (auto, attention's projections), int8 7.24 ->
//   6.52; bf16 (9.83, 9.77) and fp32 (16.04, 15.89) read at the copy bandwidth already and stay one chain;
// - two or four chains an output (vector t of K into chain t % C, the chains summed pairwise at the end),
//   which the blocks above 4 rows compute in C passes over K for the same results (the other core busy,
//   load average 6, each call interleaved with the one-chain kernel's): at M = 1 int4 2.12 -> 1.84 ms,
//   int8 2.64 -> 2.22 with 2 chains (4 no better: the unpacking's throughput, not the FMA latency, holds
//   the rest), fp32 6.6 from memory either way; but the passes cost the blocks a store, a load and an add
//   an output and chain, each reading every C-th vector of its rows: M = 64 fp32 50.4 -> 61.9 ms, int4
//   44.7 -> 45.5 (1024 x 1024: fp32 1.52 -> 1.80, int4 1.46 -> 1.59), 4 chains slower still; AVX2 at
//   M = 1 int4 2.59 -> 2.56, at M = 64 64.1 -> 73.4. Not taken: one chain;
// - partial sums per group times the scale (sum x q, then one FMA by the scale): 1.68 / 1.64 ms at M = 1,
//   but another summation order, which the register blocks above 4 rows have no registers for (25 sums,
//   10 W vectors, 5 scales), so a row's result would depend on its batch: not taken;
// - above 4 rows, tiles: as fast as unpacking in registers for 5-16 rows (int4 M = 16: 13.1 ms both), and
//   the fp32 blocks' speed at prefill; for 1-4 rows they were slower (int8 M = 4: 8.1 ms against 4.8,
//   int4 M = 1: 3.16 against 2.25: five chains from the tile, but a store and a load more a vector).
//   bf16 through tiles was slower too (M = 5: 9.8 ms against 7.1): its shift stays in the blocks.
template <typename W>
void dot_rows(const float* X, int64_t ldx, int64_t M, const W& w, int64_t K, int64_t n0, int64_t n1, float* C, int64_t ldc) {
  if constexpr (W::TILED) {
    if (M == 1) return dot_row_pairs(X, w, K, n0, n1, C);
  }
  if (M <= 4) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; m += 2)  // the second pair reads the row of W from L1
        micro_rows<W, 1>(X + m * ldx, ldx, std::min<int64_t>(2, M - m), w.at(n), K, C + m * ldc + n, ldc);
    return;
  }
  if constexpr (W::TILED) {
    const int64_t ld = padded_stride(K);
    std::vector<float> buffer(BLOCK_W * ld + 16);
    float* tile = buffer.data() + (16 - reinterpret_cast<uintptr_t>(buffer.data()) / 4 % 16) % 16;  // 64-byte aligned
    for (int64_t n = n0; n < n1; n += BLOCK_W) {
      int64_t rows = std::min<int64_t>(BLOCK_W, n1 - n);
      dequantize_rows(w, n, rows, K, tile, ld);
      dot_blocks(X, ldx, M, Dense<float>{tile, ld}, K, 0, rows, C + n, ldc);
    }
  } else {
    dot_blocks(X, ldx, M, w, K, n0, n1, C, ldc);
  }
}

// dot_rows for the four formats: instantiated in linear.cpp, which the experts (moe.cpp) call too.
extern template void dot_rows(const float*, int64_t, int64_t, const Dense<float>&, int64_t, int64_t, int64_t, float*, int64_t);
extern template void dot_rows(const float*, int64_t, int64_t, const Dense<bf16>&, int64_t, int64_t, int64_t, float*, int64_t);
extern template void dot_rows(const float*, int64_t, int64_t, const Int8&, int64_t, int64_t, int64_t, float*, int64_t);
extern template void dot_rows(const float*, int64_t, int64_t, const Int4&, int64_t, int64_t, int64_t, float*, int64_t);

// ---- linear (linear.cpp) -----------------------------------------------------------------------------

// y [M, N] = x [M, K] w^T + bias, over a checked operand (the decode stack's linears call it directly).
at::Tensor linear_operand(const at::Tensor& x, const Operand& w, const c10::optional<at::Tensor>& bias);
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& data, const c10::optional<at::Tensor>& scales,
                         const std::string& format, const c10::optional<at::Tensor>& bias);
at::Tensor head_linear(const at::Tensor& x, const at::Tensor& weight);

}  // namespace moe_serve
