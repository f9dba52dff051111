// CPU kernels of moe-serve: the parts of a step that PyTorch runs as many small ops or as bandwidth-poor
// matrix-vector products. Each output element is computed by the same sequence of floating-point
// operations whatever else is in the batch, so a token's result never depends on what it is batched with
// (bitwise, on these paths).
//
//   linear         y[M, N] = x[M, K] W[N, K]^T + b: a register-blocked kernel that streams W from memory
//                  once; every output is one FMA chain over K in a fixed order.
//   moe_experts    sum over a token's slots of weight * expert(x): slots grouped by expert, each expert's
//                  weights streamed once for all of its slots; combined in slot order.
//   linear_packed, moe_experts_packed  the same over weights stored in fewer bits (bf16, int8, int4 with
//                  fp16 group scales: see "weight formats"), unpacked in registers; fp32 activations and sums.
//   topk_route     top-k experts per row (ties to the lower index) and their combine weights.
//   rms_norm       one pass per row.
//   rotary_write   rotary embedding of q and k in place, and the keys and values written to the cache.
//   paged_attention  decode/prefill over the paged cache: keys stored transposed in each block
//                  ([Dh, BS]) so 16 scores are one broadcast-FMA chain, with a vectorised online softmax;
//                  optionally a sliding window (each query sees its last `window` keys, gpt-oss), local
//                  chunks (each query sees the keys of its own chunk of `chunk` positions, Llama 4) and
//                  per-head attention sinks (a learned logit in every softmax's denominator, gpt-oss).
//   packed_attention  the same over keys packed with the queries (bidirectional encoders, no cache).
//   latent_attention  multi-head latent attention (DeepSeek's MLA, absorbed form) over its own paged cache of
//                  rows [NB, BS, C], one row a token that every head reads as key (C values) and value (its
//                  first R): the same online softmax, each row read once for a block of heads.
//   DecodeStack    every layer of a plain pre-norm MoE decoder for a decode-only step, in one call over the
//                  kernels above (moe_serve/models/decode_stack.py).
//
// Built with -march=native for AVX-512 or, on CPUs without it, AVX2 + FMA + F16C (see "16-lane float
// vectors").
//
// Legend: T tokens, S sequences, H query heads, G key/value heads, Dh head dim, E experts, K slots per
// token, D hidden, I expert intermediate size, NB blocks, BS block size (a multiple of 16; latent_attention's:
// any). Cache layout: k_cache [NB, G, Dh, BS] (transposed within a block), v_cache [NB, G, BS, Dh].

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <string>
#include <vector>

namespace {

using bf16 = at::BFloat16;

// ---- 16-lane float vectors ---------------------------------------------------------------------------
// Every kernel below works on 16 floats at a time (16 keys of a cache block, 16 values of a dot product):
// one AVX-512 register, or two AVX2 registers (lanes 0-7, 8-15) on CPUs without AVX-512 (AMD Zen 1-3,
// older Intel). The kernels are written once against these few operations, so both builds compute each
// output with the same sequence of operations per lane; only the horizontal sums' order differs by ISA.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

constexpr const char* ISA = "avx512";
using vf = __m512;
using mask16 = __mmask16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const bf16* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline vf vload_masked(mask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline vf vload_masked(mask16 m, const bf16* p) {
  __m256i v = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void vstore_masked(float* p, mask16 m, vf v) { _mm512_mask_storeu_ps(p, m, v); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
inline vf vfnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline vf vabs(vf a) { return _mm512_abs_ps(a); }
inline vf vfloor(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vf vscale_pow2(vf y, vf n) { return _mm512_scalef_ps(y, n); }  // y * 2^n, n integral
inline vf vkeep(mask16 m, vf a) { return _mm512_maskz_mov_ps(m, a); }  // lanes outside m: 0
inline vf vnegate_where_negative(vf sign_of, vf a) {
  return _mm512_mask_sub_ps(a, _mm512_cmp_ps_mask(sign_of, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_setzero_ps(), a);
}
inline vf vreverse(vf a) {
  return _mm512_permutexvar_ps(_mm512_set_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), a);
}
inline float vreduce_add(vf a) { return _mm512_reduce_add_ps(a); }
inline float vreduce_max_masked(mask16 m, vf a) { return _mm512_mask_reduce_max_ps(m, a); }
// Grouped weights (see "weight formats"): 16 int8 values times their group's scale; a group of 32 int4
// values (16 bytes, value j in byte j's low nibble, j + 16 in its high one) as (nibble - 8) * scale. A
// permute reads only the low 4 bits of each 32-bit index, so a nibble picks its level from a 16-entry table
// of (level - 8) * scale: one permute a vector (LM head at M = 1 on one core: 2.06 ms against 2.34 masking,
// converting and multiplying as the AVX2 branch does).
inline vf vload_int8(const int8_t* p, vf scale) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), scale);
}
inline void vload_int4(const uint8_t* p, vf scale, vf* w) {
  const __m512 levels = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  __m512 table = _mm512_mul_ps(levels, scale);
  __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  w[0] = _mm512_permutexvar_ps(bytes, table);                        // values 0-15: the low nibbles
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);  // values 16-31: the high nibbles
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

constexpr const char* ISA = "avx2";
struct vf {
  __m256 lo, hi;
};
using mask16 = uint16_t;
inline __m256i lane_bits8(unsigned bits) {  // lane i: all ones where bit i of `bits` is set
  const __m256i each = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), each), each);
}
inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen_bf16(__m128i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)); }
inline vf vload(const bf16* p) {
  return {widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline vf vload_masked(mask16 m, const float* p) {
  return {_mm256_maskload_ps(p, lane_bits8(m & 0xFF)), _mm256_maskload_ps(p + 8, lane_bits8(m >> 8))};
}
inline vf vload_masked(mask16 m, const bf16* p) {  // no 16-bit masked load in AVX2: a tail, copied
  alignas(32) uint16_t tail[16] = {0};
  for (int c = 0; c < 16; ++c)
    if ((m >> c) & 1) tail[c] = reinterpret_cast<const uint16_t*>(p)[c];
  return vload(reinterpret_cast<const bf16*>(tail));
}
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
inline void vstore_masked(float* p, mask16 m, vf v) {
  _mm256_maskstore_ps(p, lane_bits8(m & 0xFF), v.lo);
  _mm256_maskstore_ps(p + 8, lane_bits8(m >> 8), v.hi);
}
#define MOE_SERVE_BINARY(name, op) \
  inline vf name(vf a, vf b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
MOE_SERVE_BINARY(vadd, _mm256_add_ps)
MOE_SERVE_BINARY(vsub, _mm256_sub_ps)
MOE_SERVE_BINARY(vmul, _mm256_mul_ps)
MOE_SERVE_BINARY(vdiv, _mm256_div_ps)
MOE_SERVE_BINARY(vmin, _mm256_min_ps)
MOE_SERVE_BINARY(vmax, _mm256_max_ps)
#undef MOE_SERVE_BINARY
inline vf vfmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf vfnmadd(vf a, vf b, vf c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf vabs(vf a) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, magnitude), _mm256_and_ps(a.hi, magnitude)};
}
inline vf vfloor(vf a) { return {_mm256_floor_ps(a.lo), _mm256_floor_ps(a.hi)}; }
inline __m256 pow2(__m256i n) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23)); }
inline __m256 scale_pow2(__m256 y, __m256 n) {  // y * 2^n in two exact steps: each half of n is a normal exponent
  __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
  return _mm256_mul_ps(_mm256_mul_ps(y, pow2(half)), pow2(_mm256_sub_epi32(ni, half)));
}
inline vf vscale_pow2(vf y, vf n) { return {scale_pow2(y.lo, n.lo), scale_pow2(y.hi, n.hi)}; }
inline vf vkeep(mask16 m, vf a) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(lane_bits8(m & 0xFF))),
          _mm256_and_ps(a.hi, _mm256_castsi256_ps(lane_bits8(m >> 8)))};
}
inline vf vnegate_where_negative(vf sign_of, vf a) {
  __m256 zero = _mm256_setzero_ps();
  return {_mm256_blendv_ps(a.lo, _mm256_sub_ps(zero, a.lo), _mm256_cmp_ps(sign_of.lo, zero, _CMP_LT_OQ)),
          _mm256_blendv_ps(a.hi, _mm256_sub_ps(zero, a.hi), _mm256_cmp_ps(sign_of.hi, zero, _CMP_LT_OQ))};
}
inline vf vreverse(vf a) {
  const __m256i reverse8 = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  return {_mm256_permutevar8x32_ps(a.hi, reverse8), _mm256_permutevar8x32_ps(a.lo, reverse8)};
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vreduce_add(vf a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline float vreduce_max_masked(mask16 m, vf a) {
  alignas(32) float lanes[16];
  vstore(lanes, a);
  float best = -INFINITY;
  for (int c = 0; c < 16; ++c)
    if ((m >> c) & 1) best = std::max(best, lanes[c]);
  return best;
}
// Grouped weights (as in the AVX-512 branch): 8 lanes have no 16-entry permute, so the nibbles become
// signed bytes (nibble - 8) and are converted like int8.
inline __m256 int8x8_times(__m128i v, __m256 scale) {  // the low 8 bytes
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), scale);
}
inline vf int8x16_times(__m128i v, vf scale) { return {int8x8_times(v, scale.lo), int8x8_times(_mm_srli_si128(v, 8), scale.hi)}; }
inline vf vload_int8(const int8_t* p, vf scale) { return int8x16_times(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), scale); }
inline void vload_int4(const uint8_t* p, vf scale, vf* w) {
  const __m128i low4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  w[0] = int8x16_times(_mm_sub_epi8(_mm_and_si128(bytes, low4), eight), scale);
  w[1] = int8x16_times(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), eight), scale);
}

#else
#error "moe-serve's CPU kernels need AVX-512 (F, BW, VL) or AVX2 with FMA and F16C"
#endif

inline mask16 tail_mask(int64_t n) { return n >= 16 ? (mask16)0xFFFF : (mask16)((1u << n) - 1); }

// exp for x <= 88 (Cephes-style range reduction and polynomial; ~1 ulp).
inline vf exp16(vf x) {
  const vf log2e = vset1(1.44269504088896341f);
  x = vmin(vmax(x, vset1(-87.3365447504f)), vset1(88.3762626647949f));
  vf n = vfloor(vfmadd(x, log2e, vset1(0.5f)));
  vf r = vfnmadd(n, vset1(0.693359375f), x);
  r = vfnmadd(n, vset1(-2.12194440e-4f), r);
  vf y = vset1(1.9875691500e-4f);
  y = vfmadd(y, r, vset1(1.3981999507e-3f));
  y = vfmadd(y, r, vset1(8.3334519073e-3f));
  y = vfmadd(y, r, vset1(4.1665795894e-2f));
  y = vfmadd(y, r, vset1(1.6666665459e-1f));
  y = vfmadd(y, r, vset1(5.0000001201e-1f));
  y = vfmadd(y, vmul(r, r), vadd(r, vset1(1.f)));
  return vscale_pow2(y, n);
}

bool small_work(int64_t work) { return work < (1 << 15); }  // below this, a thread handoff costs more

// ---- weight formats ----------------------------------------------------------------------------------
// The dot-product kernels read a weight matrix [N, K] through a view of its stored format (the layouts of
// moe_serve/kernels/packed.py): `load(n, k, w)` gives row n's values [k, k + STEP) as STEP / 16 fp32
// vectors, unpacked in registers. Every value is exactly packed.dequantize's (a value times its fp32 scale
// is one rounding, as there) and the kernels run one FMA chain per output whatever the format, so a packed
// weight's results are bitwise the fp32 kernels' on its dequantized matrix, and as batch-invariant.
// Activations and accumulation stay fp32.

enum class Format { F32, BF16, INT8, INT4 };

struct FormatInfo {
  Format format;
  const char* name;  // moe_serve.kernels.packed.WeightFormat's value
  at::ScalarType data;
  const char* layout;  // of the data, for messages
};
constexpr FormatInfo FORMATS[] = {
    {Format::F32, "fp32", at::kFloat, "float32 [.., N, K]"},
    {Format::BF16, "bf16", at::kBFloat16, "bfloat16 [.., N, K]"},
    {Format::INT8, "int8", at::kChar, "int8 [.., N, K]"},
    {Format::INT4, "int4", at::kByte, "uint8 [.., N, K / 2]"},
};
constexpr int64_t GROUP = 32;  // values along K that share one fp16 scale (packed.GROUP_SIZE)

const FormatInfo& info(Format f) { return FORMATS[static_cast<int>(f)]; }

Format parse_format(const std::string& name) {
  for (const FormatInfo& f : FORMATS)
    if (name == f.name) return f.format;
  TORCH_CHECK(false, "unknown weight format '", name, "': fp32, bf16, int8 or int4");
}

inline vf vset1_fp16(uint16_t h) { return vset1(_cvtsh_ss(h)); }  // F16C

// float or bf16 [N, K], rows `ld` apart: converting is stateless (bf16 is a shift), so register blocks of
// several rows read it directly.
template <typename T>
struct Dense {
  static constexpr int STEP = 16;
  static constexpr bool TILED = false;
  const T* p;
  int64_t ld;
  Dense at(int64_t n) const { return {p + n * ld, ld}; }
  void load(int64_t n, int64_t k, vf* w) const { w[0] = vload(p + n * ld + k); }
  vf load_tail(int64_t n, int64_t k, mask16 m) const { return vload_masked(m, p + n * ld + k); }
};

// Grouped formats: a step is one group of GROUP values and its scale. Their rows need a scale and
// unpacking registers that a register block of several rows has no room for, so blocks read them
// dequantized into an L1 tile (TILED, see dot_rows). K is a multiple of GROUP (checked at entry).
struct Int8 {  // int8 [N, K], fp16 scales [N, K / GROUP]
  static constexpr int STEP = GROUP;
  static constexpr bool TILED = true;
  const int8_t* q;
  const uint16_t* d;
  int64_t K;
  Int8 at(int64_t n) const { return {q + n * K, d + n * (K / GROUP), K}; }
  void load(int64_t n, int64_t k, vf* w) const {
    vf scale = vset1_fp16(d[n * (K / GROUP) + k / GROUP]);
    w[0] = vload_int8(q + n * K + k, scale);
    w[1] = vload_int8(q + n * K + k + 16, scale);
  }
};

struct Int4 {  // uint8 [N, K / 2], two values a byte (vload_int4), fp16 scales [N, K / GROUP]
  static constexpr int STEP = GROUP;
  static constexpr bool TILED = true;
  const uint8_t* q;
  const uint16_t* d;
  int64_t K;
  Int4 at(int64_t n) const { return {q + n * (K / 2), d + n * (K / GROUP), K}; }
  void load(int64_t n, int64_t k, vf* w) const {
    vload_int4(q + n * (K / 2) + k / 2, vset1_fp16(d[n * (K / GROUP) + k / GROUP]), w);
  }
};

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

// Rows [n, n + rows) of w in fp32 (the values its loads give), rows `ld` apart.
template <typename W>
void dequantize_rows(const W& w, int64_t n, int64_t rows, int64_t K, float* out, int64_t ld) {
  constexpr int V = W::STEP / 16;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; k += W::STEP) {
      vf v[V];
      w.load(n + r, k, v);
      for (int i = 0; i < V; ++i) vstore(out + r * ld + k + 16 * i, v[i]);
    }
}

// C[m, n] = dot(X[m], W[n]) for all M rows of X and rows [n0, n1) of W. W is read from memory once: with
// up to 4 rows of X, one row of W at a time (a single sequential stream per thread: the prefetchers keep
// up, ~30 GB/s here against ~23 with four interleaved streams); with more, blocks of BLOCK_W rows of W sit
// in L1 while the rows of X stream past BLOCK_X at a time from L2 (grouped formats: dequantized once into
// an L1 tile first). Every output is the same FMA chain: the results are identical whatever M is.
//
// Grouped formats, measured on one Zen 4 core (LM head 32000 x 1024 from memory, benchmarks/packed_gemv.py):
// - up to 4 rows, unpacked in registers at each step: int4 2.06 ms at M = 1, int8 2.04 (fp32 4.05), one
//   accumulator chain a row (two chained FMAs a group); two or four rows of W at a time (independent
//   chains) were slower from memory (int4 2.88, 2.84 ms: several streams again);
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

// Rows per parallel task: a multiple of 4, all threads busy.
int64_t row_grain(int64_t rows) {
  int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t grain = (rows + threads * 2 - 1) / (threads * 2);
  return std::max<int64_t>(4, (grain + 3) / 4 * 4);
}

// ---- weight operands ---------------------------------------------------------------------------------

// A weight as Python passes it (a float tensor, or a PackedWeight's data, scales and format), checked once
// at entry, then read through its format's view.
struct Operand {
  Format format;
  torch::Tensor data, scales;  // scales: the grouped formats only
  int64_t K;                   // input features (int4 data holds K / 2 bytes a row)
};

// `dims`: 2 for a matrix [N, K], 3 for an expert bank [E, N, K]; `what` names the operand in messages.
Operand check_operand(const std::string& what, const torch::Tensor& data, const c10::optional<torch::Tensor>& scales,
                      Format format, int64_t dims) {
  const FormatInfo& f = info(format);
  TORCH_CHECK(data.dim() == dims, what, ": expected ", dims, " dimensions, got ", data.sizes());
  TORCH_CHECK(data.scalar_type() == f.data, what, ": ", f.name, " data must be ", f.layout, ", got ", data.scalar_type());
  TORCH_CHECK(data.is_contiguous(), what, ": the data must be contiguous");
  int64_t K = data.size(-1) * (format == Format::INT4 ? 2 : 1);
  bool has_scales = scales.has_value() && scales->defined();
  if (format == Format::INT8 || format == Format::INT4) {
    TORCH_CHECK(K % GROUP == 0, what, ": ", f.name, " needs K a multiple of ", GROUP, ", got K = ", K);
    TORCH_CHECK(has_scales, what, ": ", f.name, " data needs its fp16 group scales");
    std::vector<int64_t> expected(data.sizes().begin(), data.sizes().end());
    expected.back() = K / GROUP;
    TORCH_CHECK(scales->scalar_type() == at::kHalf && scales->sizes() == at::IntArrayRef(expected), what,
                ": scales must be float16 ", at::IntArrayRef(expected), " (one per ", GROUP, " values), got ",
                scales->scalar_type(), " ", scales->sizes());
    TORCH_CHECK(scales->is_contiguous(), what, ": the scales must be contiguous");
  } else {
    TORCH_CHECK(!has_scales, what, ": ", f.name, " weights have no scales");
  }
  return {format, data, has_scales ? *scales : torch::Tensor(), K};
}

const uint16_t* scales_of(const Operand& w) { return reinterpret_cast<const uint16_t*>(w.scales.data_ptr<at::Half>()); }

template <typename W>
W view(const Operand& w);
template <>
Dense<float> view(const Operand& w) { return {w.data.data_ptr<float>(), w.K}; }
template <>
Dense<bf16> view(const Operand& w) { return {w.data.data_ptr<bf16>(), w.K}; }
template <>
Int8 view(const Operand& w) { return {w.data.data_ptr<int8_t>(), scales_of(w), w.K}; }
template <>
Int4 view(const Operand& w) { return {w.data.data_ptr<uint8_t>(), scales_of(w), w.K}; }

// f(view): f instantiated for the operand's format.
template <typename F>
void with_view(const Operand& w, F&& f) {
  switch (w.format) {
    case Format::F32: f(view<Dense<float>>(w)); break;
    case Format::BF16: f(view<Dense<bf16>>(w)); break;
    case Format::INT8: f(view<Int8>(w)); break;
    case Format::INT4: f(view<Int4>(w)); break;
  }
}

// A float bias [n] (any float dtype, converted), or an undefined tensor.
torch::Tensor check_bias(const std::string& what, const c10::optional<torch::Tensor>& bias, at::IntArrayRef shape) {
  if (!bias.has_value() || !bias->defined()) return torch::Tensor();
  TORCH_CHECK(bias->sizes() == shape, what, ": expected shape ", shape, ", got ", bias->sizes());
  return bias->to(at::kFloat).contiguous();
}

const float* ptr_or_null(const torch::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// ---- linear ------------------------------------------------------------------------------------------

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
    if (bias != nullptr)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) y[m * N + n] += bias[n];
  };
  if (small_work(M * N * K)) body(0, N);
  else at::parallel_for(0, N, row_grain(N), body);
}

torch::Tensor linear_operand(const torch::Tensor& x, const Operand& w, const c10::optional<torch::Tensor>& bias) {
  int64_t N = w.data.size(0), K = w.K;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "linear: x must be [M, ", K, "] for a weight [", N, ", ", K, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat, "linear: x must be float32, got ", x.scalar_type());
  auto xc = x.contiguous();
  int64_t M = xc.size(0);
  auto y = torch::empty({M, N}, xc.options());
  torch::Tensor b = check_bias("linear: bias", bias, {N});
  with_view(w, [&](const auto& view) { linear_impl(xc.data_ptr<float>(), M, K, view, ptr_or_null(b), y.data_ptr<float>(), N); });
  return y;
}

// weight [N, K] float32 or bfloat16.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "linear: weight must be float32 or bfloat16, got ", weight.scalar_type(), " (packed formats: linear_packed)");
  Format format = weight.scalar_type() == at::kFloat ? Format::F32 : Format::BF16;
  return linear_operand(x, check_operand("linear: weight", weight.contiguous(), c10::nullopt, format, 2), bias);
}

// A PackedWeight's data [N, K] | [N, K / 2], scales [N, K / 32] (int8, int4) and format name.
torch::Tensor linear_packed(const torch::Tensor& x, const torch::Tensor& data, const c10::optional<torch::Tensor>& scales,
                            const std::string& format, const c10::optional<torch::Tensor>& bias) {
  c10::optional<torch::Tensor> sc = scales.has_value() && scales->defined() ? c10::optional<torch::Tensor>(scales->contiguous()) : c10::nullopt;
  return linear_operand(x, check_operand("linear_packed: weight", data.contiguous(), sc, parse_format(format), 2), bias);
}

// Per-head linear maps, y[t, h] = w[h] x[t, h] (x [T, H, K], w [H, N, K] float32 or bfloat16 -> [T, H, N]):
// multi-head latent attention's absorbed key and value maps (moe_serve/layers/latent_attention.py). Each head
// is a linear over its own rows of x through dot_rows, so a row's result is the same FMA chains whatever T
// is (a batched matmul picks its blocking by T: a request's log-probabilities moved with its batch).
torch::Tensor head_linear(const torch::Tensor& x, const torch::Tensor& weight) {
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
  auto y = torch::empty({T, H, N}, xc.options());
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

// ---- MoE experts -------------------------------------------------------------------------------------

enum Activation : int64_t { RELU = 0, GELU = 1, GELU_TANH = 2, SILU = 3, SWIGLU_OAI = 4 };

// An expert's activation (ops.ACTIVATION_IDS). SWIGLU_OAI, gpt-oss's gated unit, is defined on the pair
// (gate, up) only: min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clamp(up, -limit, limit) + 1).
struct Act {
  int64_t kind;
  float alpha = 0.f, limit = 0.f;
};

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
template <typename W>
void expert_matmul(const std::vector<Work>& work, const std::vector<int64_t>& offsets, const float* in, int64_t ldin,
                   const W& w, const float* b, const W* w3, const float* b3, int64_t rows, int64_t cols, const Act& act,
                   bool activate_out, float* out, int64_t ldout, float* scratch) {
  auto body = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Work& job = work[i];
      int64_t s0 = offsets[job.expert], n = offsets[job.expert + 1] - s0;
      dot_rows(in + s0 * ldin, ldin, n, w.at(job.expert * rows), cols, job.r0, job.r1, out + s0 * ldout, ldout);
      if (w3 != nullptr)
        dot_rows(in + s0 * ldin, ldin, n, w3->at(job.expert * rows), cols, job.r0, job.r1, scratch + s0 * ldout, ldout);
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
  int64_t chunk = std::max<int64_t>(4, ((rows + pieces - 1) / pieces + 3) / 4 * 4);
  std::vector<Work> work;
  for (int64_t e = 0; e < E; ++e)
    if (offsets[e + 1] > offsets[e])
      for (int64_t r = 0; r < rows; r += chunk) work.push_back({e, r, std::min(rows, r + chunk)});
  return work;
}

// x [T, D] f32; topk_ids [T, K] int64 (-1: unused slot); topk_weights [T, K] f32; the banks w1 [E, I, D]
// (+ b1 [E, I]), w3 [E, I, D] (+ b3) for gated experts, in one format; w2 [E, D, I] (+ b2 [E, D]) in its own.
// Expert e computes y = act(x w1^T + b1) [* (x w3^T + b3)] w2^T + b2; out[t] = sum_j weight[t, j] y[t, j].
torch::Tensor moe_experts_operands(const torch::Tensor& x, const torch::Tensor& topk_ids, const torch::Tensor& topk_weights,
                                   const Operand& w1, const c10::optional<torch::Tensor>& b1, const c10::optional<Operand>& w3,
                                   const c10::optional<torch::Tensor>& b3, const Operand& w2,
                                   const c10::optional<torch::Tensor>& b2, const Act& act) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && topk_weights.scalar_type() == at::kFloat, "moe_experts: float32 x");
  TORCH_CHECK(act.kind >= RELU && act.kind <= SWIGLU_OAI, "moe_experts: unknown activation ", act.kind);
  TORCH_CHECK(act.kind != SWIGLU_OAI || (w3.has_value() && act.limit > 0.f),
              "moe_experts: the clamped SwiGLU needs gated experts (w3) and a positive limit");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong, "moe_experts: int64 topk_ids");
  auto xc = x.contiguous();
  auto ids = topk_ids.contiguous();
  auto weights = topk_weights.contiguous();
  int64_t T = xc.size(0), D = xc.size(1), K = ids.size(1), E = w1.data.size(0), I = w1.data.size(1);
  TORCH_CHECK(w1.K == D, "moe_experts: w1 must be [E, I, D] with D = ", D, " (x's), got K = ", w1.K);
  TORCH_CHECK(w2.data.size(0) == E && w2.data.size(1) == D && w2.K == I, "moe_experts: w2 must be [E, D, I] = [", E, ", ",
              D, ", ", I, "], got ", w2.data.sizes(), " holding K = ", w2.K);
  TORCH_CHECK(!w3.has_value() || (w3->format == w1.format && w3->data.sizes() == w1.data.sizes()),
              "moe_experts: w3 must match w1's format and shape");
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
  // xs [S, D], h [S, I], up [S, I], ys [S, D], rows padded apart (see padded_stride)
  const int64_t ldd = padded_stride(D), ldi = padded_stride(I);
  auto buffers = torch::empty({S * (ldd + 2 * ldi + D)}, xc.options());
  float* xsp = buffers.data_ptr<float>();
  float* hp = xsp + S * ldd;
  float* upp = hp + S * ldi;
  float* ysp = upp + S * ldi;
  const float* xp = xc.data_ptr<float>();
  for (int64_t i = 0; i < T * K; ++i)
    if (idp[i] >= 0) {
      int64_t s = next[idp[i]]++;
      slot_of[i] = s;
      std::copy(xp + (i / K) * D, xp + (i / K + 1) * D, xsp + s * ldd);
    }

  torch::Tensor b1f = check_bias("moe_experts: b1", b1, {E, I});
  torch::Tensor b3f = check_bias("moe_experts: b3", b3, {E, I});
  torch::Tensor b2f = check_bias("moe_experts: b2", b2, {E, D});
  std::vector<Work> up_work = plan(offsets, I, D), down_work = plan(offsets, D, I);
  with_view(w1, [&](const auto& up) {
    using W = std::decay_t<decltype(up)>;
    W gate = w3.has_value() ? view<W>(*w3) : W{};
    expert_matmul(up_work, offsets, xsp, ldd, up, ptr_or_null(b1f), w3.has_value() ? &gate : nullptr, ptr_or_null(b3f), I,
                  D, act, true, hp, ldi, upp);
  });
  with_view(w2, [&](const auto& down) {
    expert_matmul(down_work, offsets, hp, ldi, down, ptr_or_null(b2f), decltype(&down)(nullptr), nullptr, D, I, act, false,
                  ysp, D, nullptr);
  });

  // Combine each token's slots in slot order with their weights: no atomics, batch-independent.
  auto out = torch::zeros({T, D}, xc.options());
  float* op = out.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) {
      int64_t s = slot_of[t * K + j];
      if (s < 0) continue;
      float wt = wp[t * K + j];
      const float* y = ysp + s * D;
      float* o = op + t * D;
      for (int64_t d = 0; d < D; ++d) o[d] += wt * y[d];
    }
  return out;
}

// The banks as float32 or bfloat16 tensors (w3, when given, of w1's dtype).
torch::Tensor moe_experts(const torch::Tensor& x, const torch::Tensor& topk_ids, const torch::Tensor& topk_weights,
                          const torch::Tensor& w1, const c10::optional<torch::Tensor>& b1,
                          const c10::optional<torch::Tensor>& w3, const c10::optional<torch::Tensor>& b3,
                          const torch::Tensor& w2, const c10::optional<torch::Tensor>& b2, int64_t act, double alpha,
                          double limit) {
  auto plain = [](const char* what, const torch::Tensor& w) {
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
torch::Tensor moe_experts_packed(const torch::Tensor& x, const torch::Tensor& topk_ids, const torch::Tensor& topk_weights,
                                 const std::string& format_up, const torch::Tensor& w1, const c10::optional<torch::Tensor>& s1,
                                 const c10::optional<torch::Tensor>& b1, const c10::optional<torch::Tensor>& w3,
                                 const c10::optional<torch::Tensor>& s3, const c10::optional<torch::Tensor>& b3,
                                 const std::string& format_down, const torch::Tensor& w2,
                                 const c10::optional<torch::Tensor>& s2, const c10::optional<torch::Tensor>& b2, int64_t act,
                                 double alpha, double limit) {
  Format up = parse_format(format_up);
  c10::optional<Operand> gate;
  if (w3.has_value() && w3->defined()) gate = check_operand("moe_experts_packed: w3", *w3, s3, up, 3);
  return moe_experts_operands(x, topk_ids, topk_weights, check_operand("moe_experts_packed: w1", w1, s1, up, 3), b1, gate,
                              b3, check_operand("moe_experts_packed: w2", w2, s2, parse_format(format_down), 3), b2,
                              Act{act, (float)alpha, (float)limit});
}

// ---- routing -----------------------------------------------------------------------------------------

// The codes of moe_serve.kernels.ops.Weighting (the router kinds name theirs; tests compare the two tables).
enum RouteMode : int64_t { SOFTMAX_CHOSEN = 0, SOFTMAX_ALL = 1, UNIFORM = 2 };

// logits [R, N] f32, top_k [R] int64 -> (ids [R, max_k] int64, -1 beyond a row's k; weights [R, max_k] f32).
std::vector<torch::Tensor> topk_route(const torch::Tensor& logits, const torch::Tensor& top_k, int64_t max_k, int64_t mode) {
  auto lc = logits.contiguous();
  auto kc = top_k.to(at::kLong).contiguous();
  int64_t R = lc.size(0), N = lc.size(1);
  auto ids = torch::full({R, max_k}, -1, lc.options().dtype(at::kLong));
  auto weights = torch::zeros({R, max_k}, lc.options());
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
    if (mode == SOFTMAX_ALL)
      for (int64_t n = 0; n < N; ++n) total += std::exp(row[n] - peak);
    else if (mode == SOFTMAX_CHOSEN)
      for (int64_t j = 0; j < k; ++j) total += std::exp(row[order[j]] - peak);
    for (int64_t j = 0; j < k; ++j) {
      ip[r * max_k + j] = order[j];
      wp[r * max_k + j] = mode == UNIFORM ? 1.f / (float)kp[r] : std::exp(row[order[j]] - peak) / total;
    }
  }
  return {ids, weights};
}

// ---- norms -------------------------------------------------------------------------------------------

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 only");
  auto xc = x.contiguous();
  int64_t D = xc.size(-1), rows = xc.numel() / D;
  auto out = torch::empty_like(xc);
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

// x [T, H, Dh] in place: HF's rotate-half convention, cos/sin [T, Dh] (their two halves equal).
void rotary_inplace(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
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

void write_cache(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache, torch::Tensor& v_cache,
                 const torch::Tensor& slot_mapping) {
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

// q [T, H, Dh], k/v [T, G, Dh] (contiguous, float32): rotary on q and k in place (when cos is given), then
// k and v stored at their slots of the cache.
void rotary_write(torch::Tensor q, torch::Tensor k, const torch::Tensor& v, const c10::optional<torch::Tensor>& cos,
                  const c10::optional<torch::Tensor>& sin, c10::optional<torch::Tensor> k_cache,
                  c10::optional<torch::Tensor> v_cache, const c10::optional<torch::Tensor>& slot_mapping) {
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "rotary_write: contiguous q, k, v");
  if (cos.has_value() && cos->defined()) {
    auto c = cos->contiguous(), s = sin->contiguous();
    rotary_inplace(q, c, s);
    rotary_inplace(k, c, s);
  }
  if (k_cache.has_value() && k_cache->defined()) write_cache(k, v, *k_cache, *v_cache, *slot_mapping);
}

// ---- attention ---------------------------------------------------------------------------------------

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
torch::Tensor check_sinks(const c10::optional<torch::Tensor>& sinks, int64_t H) {
  if (!sinks.has_value() || !sinks->defined()) return torch::Tensor();
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == H, "attention: sinks must be [", H, "] (one a query head), got ",
              sinks->sizes());
  return sinks->to(at::kFloat).contiguous();
}

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& seq_ids,
                              const torch::Tensor& positions, const torch::Tensor& num_keys_of, bool causal,
                              double scale, const c10::optional<torch::Tensor>& q_rel,
                              const c10::optional<torch::Tensor>& r_kt, int64_t rel_offset, int64_t window,
                              int64_t chunk, const c10::optional<torch::Tensor>& sinks) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat, "attention: float32 only");
  check_span(window, chunk, causal);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "attention: contiguous cache");
  int64_t G = k_cache.size(1), Dh = k_cache.size(2), BS = k_cache.size(3);
  TORCH_CHECK(BS % 16 == 0, "attention: the block size must be a multiple of 16");
  auto qc = q.contiguous();
  int64_t T = qc.size(0), H = qc.size(1), group = H / G;
  auto tables = block_tables.to(at::kInt).contiguous();
  int64_t width = tables.size(1);
  torch::Tensor sink = check_sinks(sinks, H);
  const float* sinkp = sink.defined() ? sink.data_ptr<float>() : nullptr;
  auto out = torch::empty_like(qc);
  const float* qp = qc.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t* sp = seq_ids.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t* np = num_keys_of.data_ptr<int64_t>();
  torch::Tensor qr, rk;
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
  if (small_work(T * H * Dh * 16)) body(0, T * H);
  else at::parallel_for(0, T * H, 1, body);
  return out;
}

// Keys packed with the queries ([T, G, Dh], each sequence's rows from seq_starts): a gather of 16 keys'
// dot products at a time, then the same online softmax.
torch::Tensor packed_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& seq_starts, const torch::Tensor& seq_ids,
                               const torch::Tensor& positions, const torch::Tensor& num_keys_of, bool causal,
                               double scale, const c10::optional<torch::Tensor>& q_rel,
                               const c10::optional<torch::Tensor>& r_kt, int64_t rel_offset, int64_t window,
                               int64_t chunk, const c10::optional<torch::Tensor>& sinks) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat, "attention: float32 only");
  check_span(window, chunk, causal);
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  int64_t T = qc.size(0), H = qc.size(1), Dh = qc.size(2), G = kc.size(1), group = H / G;
  torch::Tensor sink = check_sinks(sinks, H);
  const float* sinkp = sink.defined() ? sink.data_ptr<float>() : nullptr;
  auto out = torch::empty_like(qc);
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int64_t* starts = seq_starts.data_ptr<int64_t>();
  const int64_t* sp = seq_ids.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t* np = num_keys_of.data_ptr<int64_t>();
  torch::Tensor qr, rk;
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

// ---- multi-head latent attention (DeepSeek's MLA in the absorbed form: moe_serve/kernels/latent.py) -----
// Every query head attends to the same keys, one cache row of C values per token (the normed latent in its
// first R values, the rotated rope key after), and reads the row's first R values as its value: multi-query
// attention with key size C and value size R. A row is key and value at once, so it is not transposed as
// paged_attention's keys are: a score is one FMA chain along the row, and a pass over a key row serves up to
// LATENT_HEADS heads, which load the row once. A work item is a token and a block of its heads, so every key
// row is read from memory once per block of heads rather than once per head.
//
// Any block size: the keys go a block at a time, in runs of up to 16 within one block (a block of 12 is one
// run of 12, a block of 40 runs of 16, 16 and 8), so a run's rows are evenly spaced for Softmax::add16. The
// runs depend on the sequence's own keys only, and each (token, head) is one online softmax over them in key
// order, so a row's result is bitwise the same whatever else is in the batch and however the heads are
// blocked.

#if defined(__AVX512F__)
constexpr int LATENT_HEADS = 8;  // 8 accumulators (8 zmm): as many FMA chains in flight as the FMA units take
#else
constexpr int LATENT_HEADS = 4;  // 4 accumulators of two ymm each: 8 chains, leaving registers for the row
#endif

// scores[h * 16 + c] = q_h . row_c over C values, for NH heads (q_h at q + h * C) and n <= 16 rows at
// rows + c * C: one FMA chain per (head, key) in the order of d, then one horizontal sum, whatever NH is.
template <int NH>
inline void latent_scores(const float* q, const float* rows, int64_t n, int64_t C, float* scores) {
  for (int64_t c = 0; c < n; ++c) {
    const float* r = rows + c * C;
    vf a[NH];
    for (int h = 0; h < NH; ++h) a[h] = vzero();
    int64_t d = 0;
    for (; d + 16 <= C; d += 16) {
      vf x = vload(r + d);
      for (int h = 0; h < NH; ++h) a[h] = vfmadd(vload(q + h * C + d), x, a[h]);
    }
    if (d < C) {
      mask16 m = tail_mask(C - d);
      vf x = vload_masked(m, r + d);
      for (int h = 0; h < NH; ++h) a[h] = vfmadd(vload_masked(m, q + h * C + d), x, a[h]);
    }
    for (int h = 0; h < NH; ++h) scores[h * 16 + c] = vreduce_add(a[h]);
  }
}

// The scores of nh heads: in passes of LATENT_HEADS heads, the rest in halving passes (H = 4 with AVX-512:
// one pass of 4).
inline void latent_scores_heads(const float* q, int64_t nh, const float* rows, int64_t n, int64_t C, float* scores) {
  int64_t h = 0;
  for (; h + LATENT_HEADS <= nh; h += LATENT_HEADS) latent_scores<LATENT_HEADS>(q + h * C, rows, n, C, scores + h * 16);
#if defined(__AVX512F__)
  if (h + 4 <= nh) { latent_scores<4>(q + h * C, rows, n, C, scores + h * 16); h += 4; }
#endif
  if (h + 2 <= nh) { latent_scores<2>(q + h * C, rows, n, C, scores + h * 16); h += 2; }
  if (h < nh) latent_scores<1>(q + h * C, rows, n, C, scores + h * 16);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Heads per work item. A block of all of a token's heads reads its keys once, but a step of few tokens (one
// decode) must still reach every thread: the heads are split until there are about two items a thread, into
// blocks of no fewer than LATENT_HEADS heads (below that a pass over a row feeds too few FMA chains).
int64_t latent_head_block(int64_t T, int64_t H) {
  int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t blocks = std::clamp<int64_t>(ceil_div(2 * threads, std::max<int64_t>(T, 1)), 1, ceil_div(H, LATENT_HEADS));
  return ceil_div(H, blocks);
}

// The inputs' shapes and dtypes, and every block a query will read inside the table and the cache (a bad
// index would read outside the cache, not fail). Returns the keys the step reads in all (for small_work).
int64_t check_latent_inputs(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& tables,
                            const torch::Tensor& seq_ids, const torch::Tensor& positions,
                            const torch::Tensor& num_keys_of, int64_t rank) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu() && tables.device().is_cpu() && seq_ids.device().is_cpu() &&
                  positions.device().is_cpu() && num_keys_of.device().is_cpu(),
              "latent_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "latent_attention: q must be float32 [T, H, C], got ",
              q.scalar_type(), " ", q.sizes());
  TORCH_CHECK(cache.dim() == 3 && cache.scalar_type() == at::kFloat,
              "latent_attention: the cache must be float32 [NB, BS, C], got ", cache.scalar_type(), " ", cache.sizes());
  TORCH_CHECK(cache.is_contiguous(), "latent_attention: the cache must be contiguous");
  const int64_t T = q.size(0), C = cache.size(2), NB = cache.size(0), BS = cache.size(1);
  TORCH_CHECK(q.size(2) == C, "latent_attention: q's last dimension (", q.size(2), ") must be the cache rows' width (",
              C, ")");
  TORCH_CHECK(rank > 0 && rank < C, "latent_attention: the rank R must be in [1, C) (C = ", C, "), got ", rank);
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kInt, "latent_attention: block_tables must be int32 [S, W], got ",
              tables.scalar_type(), " ", tables.sizes());
  const int64_t S = tables.size(0), W = tables.size(1);
  for (const auto& [name, t, n] : {std::make_tuple("seq_ids", seq_ids, T), std::make_tuple("positions", positions, T),
                                   std::make_tuple("num_keys", num_keys_of, S)})
    TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.scalar_type() == at::kLong, "latent_attention: ", name,
                " must be int64 [", n, "], got ", t.scalar_type(), " ", t.sizes());
  auto sc = seq_ids.contiguous(), pc = positions.contiguous(), nc = num_keys_of.contiguous(), tc = tables.contiguous();
  const int64_t* sp = sc.data_ptr<int64_t>();
  const int64_t* pp = pc.data_ptr<int64_t>();
  const int64_t* np = nc.data_ptr<int64_t>();
  const int32_t* tp = tc.data_ptr<int32_t>();
  std::vector<int64_t> reach(S, 0);  // the keys each sequence's queries read, at most
  int64_t keys = 0;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "latent_attention: token ", t, "'s sequence ", sp[t], " is not in [0, ", S, ")");
    TORCH_CHECK(pp[t] >= 0, "latent_attention: token ", t, "'s position is negative (", pp[t], ")");
    int64_t n = std::max<int64_t>(0, std::min(pp[t] + 1, np[sp[t]]));
    reach[sp[t]] = std::max(reach[sp[t]], n);
    keys += n;
  }
  for (int64_t s = 0; s < S; ++s) {
    int64_t blocks = ceil_div(reach[s], BS);
    TORCH_CHECK(blocks <= W, "latent_attention: sequence ", s, " reads ", reach[s], " keys, ", blocks,
                " blocks, past its table's ", W);
    for (int64_t b = 0; b < blocks; ++b)
      TORCH_CHECK(tp[s * W + b] >= 0 && tp[s * W + b] < NB, "latent_attention: sequence ", s, "'s block ", b, " is ",
                  tp[s * W + b], ", not a block of the cache [0, ", NB, ")");
  }
  return keys;
}

// q [T, H, C], cache [NB, BS, C], block_tables [S, W] int32, seq_ids, positions [T] and num_keys [S] int64
// -> [T, H, R]: each query's softmax(scale * q . row) over its sequence's keys 0..min(position, num_keys - 1),
// times the rows' first R values.
torch::Tensor latent_attention(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& block_tables,
                               const torch::Tensor& seq_ids, const torch::Tensor& positions,
                               const torch::Tensor& num_keys_of, int64_t rank, double scale) {
  const int64_t keys = check_latent_inputs(q, cache, block_tables, seq_ids, positions, num_keys_of, rank);
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto sc = seq_ids.contiguous(), pc = positions.contiguous(), nc = num_keys_of.contiguous();
  const int64_t T = qc.size(0), H = qc.size(1), C = qc.size(2), R = rank, BS = cache.size(1), W = tables.size(1);
  auto out = torch::empty({T, H, R}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const float* rowp = cache.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t* sp = sc.data_ptr<int64_t>();
  const int64_t* pp = pc.data_ptr<int64_t>();
  const int64_t* np = nc.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = (float)scale;
  const int64_t HB = latent_head_block(T, H), blocks = ceil_div(H, HB);
  auto body = [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(HB * R), scores(HB * 16);
    std::vector<Softmax> sm(HB, Softmax{-INFINITY, 0.f, nullptr, R});
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / blocks, h0 = i % blocks * HB, nh = std::min(HB, H - h0), seq = sp[t];
      const int64_t num_keys = std::min(pp[t] + 1, np[seq]);
      const float* qh = qp + (t * H + h0) * C;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t h = 0; h < nh; ++h) sm[h] = Softmax{-INFINITY, 0.f, acc.data() + h * R, R};
      for (int64_t j = 0; j < num_keys;) {
        const int64_t off = j % BS, n = std::min({(int64_t)16, BS - off, num_keys - j});
        const float* rows = rowp + ((int64_t)tp[seq * W + j / BS] * BS + off) * C;
        latent_scores_heads(qh, nh, rows, n, C, scores.data());  // lanes past n: stale, masked out below
        for (int64_t h = 0; h < nh; ++h)
          sm[h].add16(vmul(vload(scores.data() + h * 16), vset1(fscale)), tail_mask(n), rows, C);
        j += n;
      }
      for (int64_t h = 0; h < nh; ++h) sm[h].finish(op + (t * H + h0 + h) * R);
    }
  };
  if (small_work(keys * H * C)) body(0, T * blocks);
  else at::parallel_for(0, T * blocks, 1, body);
  return out;
}

// ---- the decoder layers of a decode step, without per-layer Python -----------------------------------
//
// A batch-1 decode step of a small MoE spends a large share of its time in the host glue between kernels
// (~150 Python module calls a step). DecodeStack holds, once, every operand of a plain pre-norm decoder
// (RMSNorm, fused q/k/v, rotary, paged attention, a top-k router, an expert bank) and runs all layers of a
// decode-only step in one call. It calls the kernels above with the same operands in the same order as the
// Python layers do (moe_serve/models/decode_stack.py decides which models qualify), so its results are the
// Python path's, bitwise.

struct StackLinear {
  Operand weight;
  torch::Tensor bias;           // [N] float32, or undefined
  int64_t mkl_above_rows = -1;  // fp32 weights: above this many rows the Python path uses MKL (at::linear)

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (weight.format == Format::F32 && mkl_above_rows >= 0 && x.size(0) > mkl_above_rows)
      return at::linear(x, weight.data, bias.defined() ? c10::optional<torch::Tensor>(bias) : c10::nullopt);
    return linear_operand(x, weight, bias.defined() ? c10::optional<torch::Tensor>(bias) : c10::nullopt);
  }
};

struct StackLayer {
  torch::Tensor attn_norm, ffn_norm;  // RMSNorm weights [D] float32
  double attn_eps, ffn_eps;
  StackLinear qkv, o;
  int64_t heads, kv_heads, head_dim;
  double scale;
  StackLinear router;  // [N, D] float32
  int64_t weighting;
  Operand w1, w2;
  c10::optional<Operand> w3;
  torch::Tensor b1, b2, b3;
  int64_t activation;
  torch::Tensor k_cache, v_cache;
  torch::Tensor expert_load;  // [N] int64 while the engine tracks expert load, else undefined
};

Operand stack_operand(const std::string& what, const torch::Tensor& data, const c10::optional<torch::Tensor>& scales,
                      const std::string& format, int64_t dims) {
  c10::optional<torch::Tensor> s = scales.has_value() && scales->defined() ? c10::optional<torch::Tensor>(scales->contiguous()) : c10::nullopt;
  return check_operand(what, data.contiguous(), s, parse_format(format), dims);
}

torch::Tensor defined_or_empty(const c10::optional<torch::Tensor>& t) {
  return t.has_value() && t->defined() ? t->to(at::kFloat).contiguous() : torch::Tensor();
}

class DecodeStack {
 public:
  explicit DecodeStack(int64_t linear_max_rows) : linear_max_rows_(linear_max_rows) {}

  void add_layer(const torch::Tensor& attn_norm, double attn_eps, const torch::Tensor& ffn_norm, double ffn_eps,
                 const std::string& qkv_format, const torch::Tensor& qkv, const c10::optional<torch::Tensor>& qkv_scales,
                 const c10::optional<torch::Tensor>& qkv_bias, const std::string& o_format, const torch::Tensor& o,
                 const c10::optional<torch::Tensor>& o_scales, const c10::optional<torch::Tensor>& o_bias,
                 int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, const torch::Tensor& router_weight,
                 const c10::optional<torch::Tensor>& router_bias, int64_t weighting, const std::string& up_format,
                 const torch::Tensor& w1, const c10::optional<torch::Tensor>& s1, const c10::optional<torch::Tensor>& b1,
                 const c10::optional<torch::Tensor>& w3, const c10::optional<torch::Tensor>& s3,
                 const c10::optional<torch::Tensor>& b3, const std::string& down_format, const torch::Tensor& w2,
                 const c10::optional<torch::Tensor>& s2, const c10::optional<torch::Tensor>& b2, int64_t activation,
                 const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
    TORCH_CHECK(router_weight.scalar_type() == at::kFloat && attn_norm.scalar_type() == at::kFloat &&
                    ffn_norm.scalar_type() == at::kFloat, "DecodeStack: router and norm weights must be float32");
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() && v_cache.is_contiguous(),
                "DecodeStack: a contiguous float32 KV cache");
    StackLayer layer;
    layer.attn_norm = attn_norm.contiguous();
    layer.ffn_norm = ffn_norm.contiguous();
    layer.attn_eps = attn_eps;
    layer.ffn_eps = ffn_eps;
    layer.qkv = {stack_operand("DecodeStack: qkv", qkv, qkv_scales, qkv_format, 2), defined_or_empty(qkv_bias), linear_max_rows_};
    layer.o = {stack_operand("DecodeStack: o", o, o_scales, o_format, 2), defined_or_empty(o_bias), linear_max_rows_};
    layer.heads = heads;
    layer.kv_heads = kv_heads;
    layer.head_dim = head_dim;
    layer.scale = scale;
    layer.router = {stack_operand("DecodeStack: router", router_weight, c10::nullopt, "fp32", 2),
                    defined_or_empty(router_bias), linear_max_rows_};
    layer.weighting = weighting;
    layer.w1 = stack_operand("DecodeStack: w1", w1, s1, up_format, 3);
    if (w3.has_value() && w3->defined()) layer.w3 = stack_operand("DecodeStack: w3", *w3, s3, up_format, 3);
    layer.w2 = stack_operand("DecodeStack: w2", w2, s2, down_format, 3);
    layer.b1 = defined_or_empty(b1);
    layer.b2 = defined_or_empty(b2);
    layer.b3 = defined_or_empty(b3);
    TORCH_CHECK(activation >= RELU && activation <= SILU, "DecodeStack: activation ", activation,
                " (the clamped SwiGLU's models are not stacked)");
    layer.activation = activation;
    layer.k_cache = k_cache;
    layer.v_cache = v_cache;
    layers_.push_back(std::move(layer));
  }

  // The expert-load counters of each layer ([N] int64; None: not tracked), updated in place by run.
  void set_expert_load(const std::vector<c10::optional<torch::Tensor>>& loads) {
    TORCH_CHECK(loads.size() == layers_.size(), "DecodeStack: one expert-load entry per layer");
    for (size_t i = 0; i < loads.size(); ++i) {
      torch::Tensor load = loads[i].has_value() && loads[i]->defined() ? *loads[i] : torch::Tensor();
      if (load.defined())
        TORCH_CHECK(load.scalar_type() == at::kLong && load.is_contiguous() && load.device().is_cpu() &&
                        load.numel() == layers_[i].w1.data.size(0),
                    "DecodeStack: expert load must be a contiguous CPU int64 [", layers_[i].w1.data.size(0), "]");
      layers_[i].expert_load = load;
    }
  }

  // h [T, D] after the embeddings -> after the last layer. One token per sequence (a decode step).
  torch::Tensor run(torch::Tensor h, const c10::optional<torch::Tensor>& cos_table, const c10::optional<torch::Tensor>& sin_table,
                    const torch::Tensor& positions, const torch::Tensor& seq_ids, const torch::Tensor& num_keys,
                    const torch::Tensor& block_tables, const torch::Tensor& slot_mapping, const torch::Tensor& token_k,
                    int64_t max_k) const {
    int64_t T = h.size(0);
    c10::optional<torch::Tensor> cos, sin;
    if (cos_table.has_value() && cos_table->defined()) {
      cos = cos_table->index_select(0, positions);
      sin = sin_table->index_select(0, positions);
    }
    const c10::optional<torch::Tensor> none;
    for (const StackLayer& layer : layers_) {
      int64_t H = layer.heads, G = layer.kv_heads, Dh = layer.head_dim;
      auto qkv = layer.qkv(rms_norm(h, layer.attn_norm, layer.attn_eps));  // [T, (H + 2G) Dh]
      auto parts = qkv.split_with_sizes({H * Dh, G * Dh, G * Dh}, 1);
      auto q = parts[0].reshape({T, H, Dh}).contiguous();
      auto k = parts[1].reshape({T, G, Dh}).contiguous();
      auto v = parts[2].reshape({T, G, Dh}).contiguous();
      rotary_write(q, k, v, cos, sin, layer.k_cache, layer.v_cache, slot_mapping);
      auto attended = paged_attention(q, layer.k_cache, layer.v_cache, block_tables, seq_ids, positions, num_keys,
                                      /*causal=*/true, layer.scale, none, none, 0, /*window=*/0, /*chunk=*/0, none);
      h = h + layer.o(attended.reshape({T, H * Dh}));
      auto x = rms_norm(h, layer.ffn_norm, layer.ffn_eps);
      auto routed = topk_route(layer.router(x), token_k, max_k, layer.weighting);
      if (layer.expert_load.defined()) count_experts(routed[0], layer.expert_load);
      h = h + moe_experts_operands(x, routed[0], routed[1], layer.w1, opt(layer.b1), layer.w3, opt(layer.b3), layer.w2,
                                   opt(layer.b2), Act{layer.activation});
    }
    return h;
  }

  int64_t num_layers() const { return (int64_t)layers_.size(); }

 private:
  static c10::optional<torch::Tensor> opt(const torch::Tensor& t) {
    return t.defined() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
  }
  // The tokens of each used slot (id >= 0) added to its expert's counter, as MoEBlock._count does.
  static void count_experts(const torch::Tensor& ids, const torch::Tensor& load) {
    const int64_t* ip = ids.data_ptr<int64_t>();
    int64_t* lp = load.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); ++i)
      if (ip[i] >= 0) lp[ip[i]] += 1;
  }

  int64_t linear_max_rows_;
  std::vector<StackLayer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", [] { return std::string(ISA); }, "the vector instructions this build uses: avx512 or avx2");
  pybind11::class_<DecodeStack>(m, "DecodeStack", "the decoder layers of a decode step in one call")
      .def(pybind11::init<int64_t>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_expert_load", &DecodeStack::set_expert_load)
      .def("run", &DecodeStack::run, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("num_layers", &DecodeStack::num_layers);
  m.def("linear", &linear, "y = x W^T + b, streaming W once, a fixed FMA chain per output");
  m.def("linear_packed", &linear_packed, "linear over a packed weight: data, scales (int8, int4), format name");
  m.def("moe_experts", &moe_experts, "grouped experts with a slot-ordered combine");
  m.def("moe_experts_packed", &moe_experts_packed, "moe_experts over packed banks (up: w1, w3; down: w2)");
  m.def("weight_formats", [] {
    std::vector<std::string> names;
    for (const FormatInfo& f : FORMATS) names.push_back(f.name);
    return names;
  }, "the weight formats' names (moe_serve.kernels.packed.WeightFormat)");
  m.def("topk_route", &topk_route, "top-k experts per row and their weights");
  m.def("weighting_codes", [] {
    return std::map<std::string, int64_t>{{"softmax_chosen", SOFTMAX_CHOSEN}, {"softmax_all", SOFTMAX_ALL}, {"uniform", UNIFORM}};
  }, "topk_route's weighting codes by name");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension");
  m.def("rotary_write", &rotary_write, "rotary on q and k in place, k and v into the paged cache");
  m.def("paged_attention", &paged_attention, "attention over the paged KV cache, online softmax");
  m.def("packed_attention", &packed_attention, "attention over packed (varlen) keys, online softmax");
  m.def("head_linear", &head_linear, "per-head linear maps y[t, h] = w[h] x[t, h], rows independent of T");
  m.def("latent_attention", &latent_attention,
        "multi-head latent attention over its paged cache of rows (keys and values at once), online softmax");
}
