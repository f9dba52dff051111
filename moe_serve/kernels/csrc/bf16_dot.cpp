// bf16 activations: the rounding and the vdpbf16ps dot products of bf16_dot.h, and bf16_linear (a linear over
// bf16 weights with its input rounded to bf16 first).
//
// Register blocks of up to 4 weight rows x 4 activation rows, one 16-lane accumulator each: a chunk of 32
// values costs 4 + 4 loads for 16 vdpbf16ps (32 multiply-adds each, against the fp32 kernels' 16 after a
// widening shift); up to 8 activation rows, one weight row at a time (bf16_dot_rows). The blocking only
// decides which outputs are computed together; each output's own chain is the one bf16_dot.h defines,
// whatever the block.

#include "bf16_dot.h"

namespace moe_serve {

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define MOE_SERVE_BF16_DOT 1
#endif

bool has_bf16_dot() {
#ifdef MOE_SERVE_BF16_DOT
  return true;
#else
  return false;
#endif
}

BBuffer::BBuffer(int64_t M, int64_t K) : x(at::empty({M, K}, at::TensorOptions().dtype(at::kBFloat16))) {}

namespace {

inline uint16_t round_bf16(float f) { return bf16(f).x; }  // PyTorch's rule: nearest, ties to even; NaN 0x7FC0

#ifdef __AVX512F__
// 16 floats rounded as round_bf16 does, in integer arithmetic: bits + 0x7FFF + (bit 16), the top half.
inline __m256i round16(const float* p) {
  __m512 v = _mm512_loadu_ps(p);
  __m512i bits = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
#endif

}  // namespace

void round_rows_bf16(const float* x, int64_t ldx, int64_t M, int64_t K, BBuffer& out) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out.x.data_ptr<bf16>());
  auto body = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = x + m * ldx;
      uint16_t* to = o + m * K;
      int64_t k = 0;
#ifdef __AVX512F__
      for (; k + 16 <= K; k += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + k), round16(row + k));
#endif
      for (; k < K; ++k) to[k] = round_bf16(row[k]);
    }
  };
  if (small_work(M * K)) body(0, M);
  else at::parallel_for(0, M, 1, body);
}

#ifdef MOE_SERVE_BF16_DOT
namespace {

// The lanes' fixed tree: (j + 8), then + 4, + 2, + 1 (bf16_dot.h; reference.bf16_linear_torch).
inline float reduce_lanes(__m512 v) {
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

inline __m512bh load_bf16(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// C[j * ldc + i] = dot(x row j, w row i) for i < RN, j < RM.
template <int RN, int RM>
void block(const bf16* w, int64_t ldw, const bf16* x, int64_t ldx, int64_t K, float* C, int64_t ldc) {
  __m512 acc[RN][RM];
  for (int i = 0; i < RN; ++i)
    for (int j = 0; j < RM; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[RN], xv[RM];
    for (int i = 0; i < RN; ++i) wv[i] = load_bf16(w + i * ldw + k);
    for (int j = 0; j < RM; ++j) xv[j] = load_bf16(x + j * ldx + k);
    for (int i = 0; i < RN; ++i)
      for (int j = 0; j < RM; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[j], wv[i]);
  }
  for (int i = 0; i < RN; ++i)
    for (int j = 0; j < RM; ++j) C[j * ldc + i] = reduce_lanes(acc[i][j]);
}

using Block = void (*)(const bf16*, int64_t, const bf16*, int64_t, int64_t, float*, int64_t);
constexpr int BLOCK_ROWS = 4;  // weight rows and activation rows a register block holds (16 accumulators)
constexpr int64_t FEW_ROWS = 8;
template <int RN>
constexpr Block blocks_of[BLOCK_ROWS] = {block<RN, 1>, block<RN, 2>, block<RN, 3>, block<RN, 4>};
constexpr const Block* BLOCKS[BLOCK_ROWS] = {blocks_of<1>, blocks_of<2>, blocks_of<3>, blocks_of<4>};

}  // namespace
#endif

void bf16_dot_rows(const BRows& x, int64_t M, const Dense<bf16>& w, int64_t K, int64_t n0, int64_t n1, float* C,
                   int64_t ldc) {
#ifdef MOE_SERVE_BF16_DOT
  TORCH_CHECK(K % 32 == 0, "bf16 activations: K must be a multiple of 32, got ", K);
  // Up to FEW_ROWS activation rows, one weight row at a time: several weight rows at once are several streams
  // through memory, which ran at half the bandwidth of one here (Zen 4: the LM head at M = 1, 12 against 23 GB/s
  // on one core); more activation rows are bound by the vdpbf16ps instead, which 4 x 4 blocks feed best.
  const int64_t weight_rows = M <= FEW_ROWS ? 1 : BLOCK_ROWS;
  for (int64_t n = n0; n < n1; n += weight_rows) {
    int64_t rn = std::min<int64_t>(weight_rows, n1 - n);
    for (int64_t m = 0; m < M; m += BLOCK_ROWS) {
      int64_t rm = std::min<int64_t>(BLOCK_ROWS, M - m);
      BLOCKS[rn - 1][rm - 1](w.p + n * w.ld, w.ld, x.x + m * x.ld, x.ld, K, C + m * ldc + n, ldc);
    }
  }
#else
  (void)x, (void)M, (void)w, (void)K, (void)n0, (void)n1, (void)C, (void)ldc;
  TORCH_CHECK(false, "bf16 activations need AVX-512 BF16 (vdpbf16ps), which this build lacks");
#endif
}

at::Tensor bf16_linear_operand(const at::Tensor& x, const Operand& w, const c10::optional<at::Tensor>& bias) {
  int64_t N = w.N, K = w.K;
  TORCH_CHECK(w.format == Format::BF16, "bf16 activations: bf16 weights, got ", info(w.format).name);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "bf16_linear: x must be [M, ", K, "] for a weight [", N, ", ", K, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat, "bf16_linear: x must be float32, got ", x.scalar_type());
  auto xc = x.contiguous();
  int64_t M = xc.size(0);
  BBuffer buffer(M, K);
  round_rows_bf16(xc.data_ptr<float>(), K, M, K, buffer);
  BRows rows = buffer.rows();
  auto y = at::empty({M, N}, xc.options());
  at::Tensor b = check_bias("bf16_linear: bias", bias, {N});
  const float* bp = ptr_or_null(b);
  float* yp = y.data_ptr<float>();
  Dense<bf16> view = moe_serve::view<Dense<bf16>>(w);
  auto body = [&](int64_t n0, int64_t n1) {
    bf16_dot_rows(rows, M, view, K, n0, n1, yp, N);
    add_bias(yp, bp, M, N, n0, n1);
  };
  int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  if (small_work(M * N * K / 4)) body(0, N);
  else at::parallel_for(0, N, std::max<int64_t>(16, N / (threads * 4)), body);  // any split: blocks only group outputs
  return y;
}

}  // namespace moe_serve
