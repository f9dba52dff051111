// int8 activations: the quantizer and the integer-block dot products of int_dot.h, and int8_linear (a linear
// over int8 or int4 weights with its input quantized first).
//
// Eight rows of W at a time, one output row per 32-bit lane. Bytes meet in vpmaddubsw (unsigned x signed ->
// pairs summed to int16: |pair| <= 2 * 127 * 127 or 2 * 15 * 127, no saturation) and vpmaddwd (-> int32);
// each block's eight exact sums become (d_w * d_x) * float(sum) added to the lanes' outputs. int8 weights go
// through the sign trick (|x| unsigned, w carrying x's sign; the format's values are in [-127, 127]); int4
// weights are unsigned nibbles u of value u - 8, so a block's sum is sum(u x) - 8 sum(x), the quantizer's
// block sum. Tiles (int_dot.h) feed a lane its row's bytes directly; rows as stored are eight streams whose
// eight int32 vectors a block are reduced by horizontal adds (2-4x slower from memory: the fallback for
// weights whose rows are not a multiple of 8).
//
// With AVX-512 VNNI (the AVX-512 build on Ice Lake, Zen 4 and later), vpdpbusd does a step's four products and
// their sum into int32 in one instruction, without the int16 stage. Its unsigned operand is then the weights:
// int8 values w as w + 128 (w ^ 0x80), whose block sum is sum((w + 128) x) - 128 sum(x), and int4 nibbles as
// they are. Integer sums are exact either way, so both builds give the same int32 and then the same floats.

#include "int_dot.h"

#include <cstring>
#include <limits>
#include <type_traits>

namespace moe_serve {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MOE_SERVE_VNNI 1
const char* int_dot_isa() { return "avx512-vnni"; }
#else
const char* int_dot_isa() { return "avx2"; }
#endif

namespace {

constexpr float TINY = 0x1p-120f;  // a block whose largest magnitude is smaller quantizes to 0 (1 / d would overflow)

// Keeps the compiler from fusing a rounded multiply into the add that follows (an FMA would round once, and
// the reference rounds twice).
inline __m256 rounded(__m256 v) {
  asm("" : "+x"(v));
  return v;
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// One block of 32 values: its int8 values and their magnitudes, scale and sum.
inline void quantize_block(const float* x, int8_t* q, int8_t* a, float* d, int32_t* s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  bool finite = true;
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    // x - x is 0 for a finite x and NaN for inf or NaN (max_ps would drop a NaN)
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_sub_ps(v[i], v[i]), _mm256_setzero_ps(), _CMP_EQ_OQ)) == 0xFF;
  }
  float m = hmax8(amax);
  if (!finite) {  // the block's outputs become NaN through its scale
    std::fill(q, q + GROUP, int8_t(0));
    std::fill(a, a + GROUP, int8_t(0));
    *d = std::numeric_limits<float>::quiet_NaN();
    *s = 0;
    return;
  }
  float scale = m >= TINY ? m / 127.f : 0.f;
  float inverse = scale != 0.f ? 1.f / scale : 0.f;
  const __m256 iv = _mm256_set1_ps(inverse);
  __m256i n[4];
  for (int i = 0; i < 4; ++i)
    n[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // packs work within 128-bit lanes: the bytes come out in the order 0-3, 8-11, 16-19, 24-27, 4-7, ... (by
  // groups of four), which the permute puts back.
  __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), _mm256_sign_epi8(bytes, bytes));
  *d = scale;
  *s = hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3])));
}

// Eight vectors of eight int32 partial sums -> one vector of their eight totals (exact: integer adds).
inline __m256i reduce_rows(const __m256i p[TILE_ROWS]) {
  __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

// A weight block of row n meeting the activation block (xq, and for int8 |xq|): eight int32 partial sums.
// (With VNNI, int8's are of w + 128: weight_offset below.)
inline __m256i block_sums(const Int8& w, int64_t n, int64_t k, __m256i xq, __m256i xabs) {
  __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + n * w.K + k));
#ifdef MOE_SERVE_VNNI
  (void)xabs;
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_xor_si256(wq, _mm256_set1_epi8(char(0x80))), xq);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(xabs, _mm256_sign_epi8(wq, xq)), _mm256_set1_epi16(1));
#endif
}
inline __m256i block_sums(const Int4& w, int64_t n, int64_t k, __m256i xq, __m256i) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q + n * (w.K / 2) + k / 2));
  // byte j holds value j (low nibble) and value j + 16 (high nibble): packed.py's layout
  __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low4), _mm_and_si128(packed, low4));
#ifdef MOE_SERVE_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, xq);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, xq), _mm256_set1_epi16(1));
#endif
}
// The eight rows are eight streams through memory, more than the hardware prefetchers follow well: each
// row's line PREFETCH_BLOCKS blocks ahead is asked for explicitly.
constexpr int64_t PREFETCH_BLOCKS = 16;
inline void prefetch_rows(const Int8& w, const int64_t* rows, int64_t k) {
  if (k >= w.K) return;
  for (int j = 0; j < TILE_ROWS; ++j) _mm_prefetch(reinterpret_cast<const char*>(w.q + rows[j] * w.K + k), _MM_HINT_T0);
}
inline void prefetch_rows(const Int4& w, const int64_t* rows, int64_t k) {
  if (k >= w.K || k % (2 * GROUP) != 0) return;
  for (int j = 0; j < TILE_ROWS; ++j) _mm_prefetch(reinterpret_cast<const char*>(w.q + rows[j] * (w.K / 2) + k / 2), _MM_HINT_T0);
}
// What block_sums' unsigned weights are offset by: a block's sum is theirs minus offset * sum(x).
template <typename W>
constexpr int32_t weight_offset() {
  if constexpr (std::is_same_v<W, Int4> || std::is_same_v<W, Int4Tiles>) return 8;
#ifdef MOE_SERVE_VNNI
  return 128;
#else
  return 0;
#endif
}

}  // namespace

QBuffer::QBuffer(int64_t M, int64_t K)
    : q(at::empty({M, K}, at::TensorOptions().dtype(at::kChar))),
      a(at::empty({M, K}, at::TensorOptions().dtype(at::kChar))),
      d(at::empty({M, K / GROUP}, at::TensorOptions().dtype(at::kFloat))),
      s(at::empty({M, K / GROUP}, at::TensorOptions().dtype(at::kInt))) {}

void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, QBuffer& out) {
  int8_t* q = out.q.data_ptr<int8_t>();
  int8_t* a = out.a.data_ptr<int8_t>();
  float* d = out.d.data_ptr<float>();
  int32_t* s = out.s.data_ptr<int32_t>();
  const int64_t B = K / GROUP;
  auto body = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < B; ++b)
        quantize_block(x + m * ldx + b * GROUP, q + m * K + b * GROUP, a + m * K + b * GROUP, d + m * B + b, s + m * B + b);
  };
  if (small_work(M * K)) body(0, M);
  else at::parallel_for(0, M, 1, body);
}

namespace {

// One output per lane: acc + (d_w * d_x) * float(sums), each product rounded (the definition's order).
inline __m256 add_block(__m256 acc, __m256 weight_scales, float x_scale, __m256i sums) {
  __m256 scale = rounded(_mm256_mul_ps(weight_scales, _mm256_set1_ps(x_scale)));
  return _mm256_add_ps(acc, rounded(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(sums))));
}

inline __m256i broadcast4(const int8_t* p) {  // bytes p[0..3] in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256 tile_scales(const uint16_t* d) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d)));
}

// Tiles: rows [n0, n1) in steps of 8; within a tile, ROW_GROUP activation rows at a time, each block of the
// tile loaded and unpacked once for the group (one accumulator a row, blocks in order: each output's operations
// are the same whatever the group, so the results are). AVX2 has 16 vector registers: 8 for a block's
// unpacked steps leave room for 2 rows' accumulators and chains; AVX-512's 32 hold 4.
#if defined(__AVX512VL__)
constexpr int ROW_GROUP = 4;
#else
constexpr int ROW_GROUP = 2;
#endif

// A group's rows: their quantized values, scales and block sums, and where their outputs go.
template <int R>
struct RowGroup {
  const int8_t* q[R];
  const int8_t* a[R];
  const float* d[R];
  const int32_t* s[R];
  float* c[R];
  RowGroup(const QRows& x, int64_t m0, float* C, int64_t ldc, int64_t n) {
    const int64_t K = x.K, B = K / GROUP;
    for (int r = 0; r < R; ++r) {
      q[r] = x.q + (m0 + r) * K;
      a[r] = x.a + (m0 + r) * K;
      d[r] = x.d + (m0 + r) * B;
      s[r] = x.s + (m0 + r) * B;
      c[r] = C + (m0 + r) * ldc + n;
    }
  }
};

template <int R>
void int8_tile_rows(const RowGroup<R>& x, const Int8Tiles& tile, int64_t B) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const int8_t* t = tile.q + b * Int8Tiles::TILE;
    __m256i w[8];
#ifdef MOE_SERVE_VNNI
    const __m256i flip = _mm256_set1_epi8(char(0x80));  // w -> w + 128, unsigned
    for (int s = 0; s < 8; ++s) w[s] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 * s)), flip);
#else
    for (int s = 0; s < 8; ++s) w[s] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 * s));
#endif
    const __m256 scales = tile_scales(tile.d + b * TILE_ROWS);
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = x.q[r] + b * GROUP;
#ifdef MOE_SERVE_VNNI
      // two chains of four steps (an integer add joins them: the same sum)
      __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
      for (int s = 0; s < 8; s += 2) {
        even = _mm256_dpbusd_epi32(even, w[s], broadcast4(xq + 4 * s));
        odd = _mm256_dpbusd_epi32(odd, w[s + 1], broadcast4(xq + 4 * s + 4));
      }
      __m256i sums = _mm256_sub_epi32(_mm256_add_epi32(even, odd), _mm256_set1_epi32(128 * x.s[r][b]));
#else
      const int8_t* xa = x.a[r] + b * GROUP;  // |q| unsigned, w taking q's sign
      __m256i sums = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s) {
        __m256i pairs = _mm256_maddubs_epi16(broadcast4(xa + 4 * s), _mm256_sign_epi8(w[s], broadcast4(xq + 4 * s)));
        sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
      }
#endif
      acc[r] = add_block(acc[r], scales, x.d[r][b], sums);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(x.c[r], acc[r]);
}

template <int R>
void int4_tile_rows(const RowGroup<R>& x, const Int4Tiles& tile, int64_t B) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* t = tile.q + b * Int4Tiles::TILE;
    __m256i lo[4], hi[4];  // a step's nibbles: values 4s..4s+3 (low) and 16+4s.. (high) of each row
    for (int s = 0; s < 4; ++s) {
      __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32 * s));
      lo[s] = _mm256_and_si256(bytes, low4);
      hi[s] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
    }
    const __m256 scales = tile_scales(tile.d + b * TILE_ROWS);
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = x.q[r] + b * GROUP;
#ifdef MOE_SERVE_VNNI
      __m256i low = _mm256_setzero_si256(), high = _mm256_setzero_si256();  // two chains, joined exactly
      for (int s = 0; s < 4; ++s) {
        low = _mm256_dpbusd_epi32(low, lo[s], broadcast4(xb + 4 * s));
        high = _mm256_dpbusd_epi32(high, hi[s], broadcast4(xb + 16 + 4 * s));
      }
      __m256i sums = _mm256_sub_epi32(_mm256_add_epi32(low, high), _mm256_set1_epi32(8 * x.s[r][b]));
#else
      // int16 pair sums of nibbles (<= 15) and int8 values: 4 steps x 2 halves x 2 * 15 * 127 < 2^15
      __m256i pairs = _mm256_setzero_si256();
      for (int s = 0; s < 4; ++s) {
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(lo[s], broadcast4(xb + 4 * s)));
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(hi[s], broadcast4(xb + 16 + 4 * s)));
      }
      __m256i sums = _mm256_sub_epi32(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)), _mm256_set1_epi32(8 * x.s[r][b]));
#endif
      acc[r] = add_block(acc[r], scales, x.d[r][b], sums);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(x.c[r], acc[r]);
}

template <int R, typename W>
void tile_rows(const QRows& x, int64_t m0, const W& tile, int64_t B, float* C, int64_t ldc, int64_t n) {
  RowGroup<R> group(x, m0, C, ldc, n);
  if constexpr (std::is_same_v<W, Int8Tiles>) int8_tile_rows<R>(group, tile, B);
  else int4_tile_rows<R>(group, tile, B);
}

template <typename W>
void int_dot_tiles(const QRows& x, int64_t M, const W& w, int64_t n0, int64_t n1, float* C, int64_t ldc) {
  const int64_t B = w.K / GROUP;
  for (int64_t n = n0; n < n1; n += TILE_ROWS) {
    W tile = w.at(n);
    int64_t m = 0;
    for (; m + ROW_GROUP <= M; m += ROW_GROUP) tile_rows<ROW_GROUP>(x, m, tile, B, C, ldc, n);
    switch (M - m) {  // the last rows, fewer than a group
      case 3: tile_rows<3>(x, m, tile, B, C, ldc, n); break;
      case 2: tile_rows<2>(x, m, tile, B, C, ldc, n); break;
      case 1: tile_rows<1>(x, m, tile, B, C, ldc, n); break;
      default: break;
    }
  }
}

// Rows as stored: eight rows' blocks reduced to one vector of sums by horizontal adds.
template <typename W>
void int_dot_stored(const QRows& x, int64_t M, const W& w, int64_t n0, int64_t n1, float* C, int64_t ldc) {
  const int64_t K = w.K, B = K / GROUP;
  std::vector<float> scales(B * TILE_ROWS);  // [b][lane]: the eight rows' weight scales, block by block
  for (int64_t n = n0; n < n1; n += TILE_ROWS) {
    int64_t rows = std::min<int64_t>(TILE_ROWS, n1 - n);
    int64_t row_of[TILE_ROWS];  // a partial block repeats its last row: every lane computes, the tail is not stored
    for (int j = 0; j < TILE_ROWS; ++j) row_of[j] = n + std::min<int64_t>(j, rows - 1);
    for (int64_t b = 0; b < B; ++b)
      for (int j = 0; j < TILE_ROWS; ++j) scales[b * TILE_ROWS + j] = _cvtsh_ss(w.d[row_of[j] * B + b]);
    for (int64_t m = 0; m < M; ++m) {
      QRows xm = x.at(m);
      __m256 acc = _mm256_setzero_ps();
      for (int64_t b = 0; b < B; ++b) {
        __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm.q + b * GROUP));
        __m256i xabs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm.a + b * GROUP));
        __m256i p[TILE_ROWS];
        if (b % 2 == 0) prefetch_rows(w, row_of, (b + PREFETCH_BLOCKS) * GROUP);
        for (int j = 0; j < TILE_ROWS; ++j) p[j] = block_sums(w, row_of[j], b * GROUP, xq, xabs);
        __m256i sums = reduce_rows(p);
        if constexpr (weight_offset<W>() != 0) sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(weight_offset<W>() * xm.s[b]));
        acc = add_block(acc, _mm256_loadu_ps(scales.data() + b * TILE_ROWS), xm.d[b], sums);
      }
      alignas(32) float out[TILE_ROWS];
      _mm256_store_ps(out, acc);
      std::copy(out, out + rows, C + m * ldc + n);
    }
  }
}

}  // namespace

template <typename W>
void int_dot_rows(const QRows& x, int64_t M, const W& w, int64_t n0, int64_t n1, float* C, int64_t ldc) {
  if constexpr (is_tiles<W>) {
    TORCH_CHECK(n0 % TILE_ROWS == 0 && n1 % TILE_ROWS == 0, "int_dot_rows: tiles take rows in steps of 8");
    int_dot_tiles(x, M, w, n0, n1, C, ldc);
  } else {
    int_dot_stored(x, M, w, n0, n1, C, ldc);
  }
}

template void int_dot_rows(const QRows&, int64_t, const Int8&, int64_t, int64_t, float*, int64_t);
template void int_dot_rows(const QRows&, int64_t, const Int4&, int64_t, int64_t, float*, int64_t);
template void int_dot_rows(const QRows&, int64_t, const Int8Tiles&, int64_t, int64_t, float*, int64_t);
template void int_dot_rows(const QRows&, int64_t, const Int4Tiles&, int64_t, int64_t, float*, int64_t);

std::vector<at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quantize_activations: x must be float32 [M, K], got ",
              x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) % GROUP == 0, "quantize_activations: K must be a multiple of ", GROUP, ", got ", x.size(1));
  auto xc = x.contiguous();
  QBuffer buffer(xc.size(0), xc.size(1));
  quantize_rows(xc.data_ptr<float>(), xc.size(1), xc.size(0), xc.size(1), buffer);
  return {buffer.q, buffer.d, buffer.s};
}

at::Tensor int8_linear_operand(const at::Tensor& x, const Operand& w, const c10::optional<at::Tensor>& bias) {
  int64_t N = w.N, K = w.K;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "int8_linear: x must be [M, ", K, "] for a weight [", N, ", ", K, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int8_linear: x must be float32, got ", x.scalar_type());
  auto xc = x.contiguous();
  int64_t M = xc.size(0);
  QBuffer buffer(M, K);
  quantize_rows(xc.data_ptr<float>(), K, M, K, buffer);
  QRows rows = buffer.rows();
  auto y = at::empty({M, N}, xc.options());
  at::Tensor b = check_bias("int8_linear: bias", bias, {N});
  const float* bp = ptr_or_null(b);
  float* yp = y.data_ptr<float>();
  with_int_view(w, [&](const auto& view) {
    auto body = [&](int64_t b0, int64_t b1) {  // blocks of 8 rows: a tile each
      int64_t n0 = b0 * TILE_ROWS, n1 = std::min(N, b1 * TILE_ROWS);
      int_dot_rows(rows, M, view, n0, n1, yp, N);
      add_bias(yp, bp, M, N, n0, n1);
    };
    int64_t blocks = (N + TILE_ROWS - 1) / TILE_ROWS;
    int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    if (small_work(M * N * K / 4)) body(0, blocks);
    else at::parallel_for(0, blocks, std::max<int64_t>(1, blocks / (threads * 4)), body);
  });
  return y;
}

}  // namespace moe_serve
