// The vector layer: 16 floats at a time, as one AVX-512 register or a pair of AVX2 registers, and the few
// vector functions built on it (tail masks, exp). Every kernel is written once against these operations;
// everything here is inline so that it compiles into the micro-kernels' loops.
#pragma once

#include <immintrin.h>

#include "common.h"

namespace moe_serve {

// ---- 16-lane float vectors ---------------------------------------------------------------------------
// Every kernel works on 16 floats at a time (16 keys of a cache block, 16 values of a dot product):
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
inline mask16 vmask_eq(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }  // lane i set: a == b
// Grouped weights (formats.h): 16 int8 values times their group's scale; a group of 32 int4
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
inline mask16 vmask_eq(vf a, vf b) {
  unsigned lo = _mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ));
  unsigned hi = _mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ));
  return (mask16)(lo | hi << 8);
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

}  // namespace moe_serve
