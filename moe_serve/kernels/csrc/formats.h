// Weight formats: how the dot-product kernels read a weight matrix stored in fp32, bf16, int8 or int4
// (llama.cpp Q8_0 / Q4_0-like groups of 32 values with an fp16 scale), unpacked in registers; and weight
// operands, the tensors Python passes for a weight, checked once at entry and read through their format's
// view. Inline (header-only): the views' loads compile into the micro-kernels of linear.h.
#pragma once

#include "vec.h"

namespace moe_serve {

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
inline constexpr FormatInfo FORMATS[] = {
    {Format::F32, "fp32", at::kFloat, "float32 [.., N, K]"},
    {Format::BF16, "bf16", at::kBFloat16, "bfloat16 [.., N, K]"},
    {Format::INT8, "int8", at::kChar, "int8 [.., N, K]"},
    {Format::INT4, "int4", at::kByte, "uint8 [.., N, K / 2]"},
};
inline constexpr int64_t GROUP = 32;  // values along K that share one fp16 scale (packed.GROUP_SIZE)

inline const FormatInfo& info(Format f) { return FORMATS[static_cast<int>(f)]; }

inline Format parse_format(const std::string& name) {
  for (const FormatInfo& f : FORMATS)
    if (name == f.name) return f.format;
  TORCH_CHECK(false, "unknown weight format '", name, "': fp32, bf16, int8 or int4");
}

// What the kernels round a weight's input activations to before the products (--cpu-activations): nothing
// (fp32, the exact mode), int8 blocks (int8 and int4 weights: int_dot.h) or bf16 (bf16 weights: bf16_dot.h).
enum class Activations { F32, INT8, BF16 };

// A kernel format, as Python passes it (moe_serve.kernels.vocabulary.kernel_format): a weight format, then
// "/int8" where the kernels quantize the weight's input to int8 (int8 and int4 weights), "/int8-tiled" where
// its data is also in int_dot.h's tiles of 8 rows, "/bf16" where they round it to bf16 (bf16 weights).
struct KernelFormat {
  Format format;
  Activations activations = Activations::F32;
  bool tiled = false;
};

inline KernelFormat parse_kernel_format(const std::string& name) {
  size_t slash = name.find('/');
  Format format = parse_format(name.substr(0, slash));
  if (slash == std::string::npos) return {format};
  std::string activations = name.substr(slash + 1);
  bool grouped = format == Format::INT8 || format == Format::INT4;
  if (grouped && (activations == "int8" || activations == "int8-tiled"))
    return {format, Activations::INT8, activations == "int8-tiled"};
  if (format == Format::BF16 && activations == "bf16") return {format, Activations::BF16};
  TORCH_CHECK(false, "kernel format '", name, "': int8 and int4 weights take int8 activations (int8/int8, int4/int8, "
              "int8/int8-tiled, int4/int8-tiled), bf16 weights bf16 ones (bf16/bf16)");
}

// Whether this build has bf16_dot.h's products (AVX-512 BF16); without them check_operand refuses a
// bf16-activation operand by name.
bool has_bf16_dot();

// Tiles of 8 rows (int_dot.h): the bytes of one group of 32 values of each of the 8 rows, interleaved by 4.
inline constexpr int64_t TILE_ROWS = 8;
inline int64_t tile_bytes(Format f) { return TILE_ROWS * (f == Format::INT4 ? GROUP / 2 : GROUP); }

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
// dequantized into an L1 tile (TILED, see dot_rows in linear.h). K is a multiple of GROUP (checked at entry).
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

// ---- weight operands ---------------------------------------------------------------------------------

// A weight as Python passes it (a float tensor, or a PackedWeight's data, scales and format), checked once
// at entry, then read through its format's view.
struct Operand {
  Format format;
  at::Tensor data, scales;  // scales: the grouped formats only
  int64_t K;                   // input features (int4 data holds K / 2 bytes a row)
  int64_t N;                   // output features (rows of each matrix)
  Activations activations = Activations::F32;  // what the input is rounded to before the products
  bool tiled = false;          // data [.., N / 8, K / 32, tile_bytes], scales [.., N / 8, K / 32, 8] (int_dot.h)
};

// `dims`: 2 for a matrix [N, K], 3 for an expert bank [E, N, K]; `what` names the operand in messages.
inline Operand check_operand(const std::string& what, const at::Tensor& data,
                             const c10::optional<at::Tensor>& scales, Format format, int64_t dims) {
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
  return {format, data, has_scales ? *scales : at::Tensor(), K, data.size(-2)};
}

inline Operand check_operand(const std::string& what, const at::Tensor& data, const c10::optional<at::Tensor>& scales,
                             KernelFormat format, int64_t dims) {
  if (!format.tiled) {
    Operand w = check_operand(what, data, scales, format.format, dims);
    w.activations = format.activations;
    if (w.activations == Activations::BF16) {
      TORCH_CHECK(has_bf16_dot(), what, ": bf16 activations need AVX-512 BF16 (vdpbf16ps), which this build lacks");
      TORCH_CHECK(w.K % 32 == 0, what, ": bf16 activations need K a multiple of 32, got K = ", w.K);
    }
    return w;
  }
  const FormatInfo& f = info(format.format);
  const int64_t bytes = tile_bytes(format.format);
  TORCH_CHECK(data.dim() == dims + 1 && data.size(-1) == bytes && data.scalar_type() == f.data && data.is_contiguous(), what,
              ": tiled ", f.name, " data must be contiguous ", f.data, " [.., N / 8, K / 32, ", bytes, "], got ",
              data.scalar_type(), " ", data.sizes());
  std::vector<int64_t> expected(data.sizes().begin(), data.sizes().end());
  expected.back() = TILE_ROWS;
  TORCH_CHECK(scales.has_value() && scales->defined() && scales->scalar_type() == at::kHalf &&
                  scales->sizes() == at::IntArrayRef(expected) && scales->is_contiguous(),
              what, ": tiled scales must be contiguous float16 ", at::IntArrayRef(expected));
  return {format.format, data, *scales, data.size(-2) * GROUP, data.size(-3) * TILE_ROWS, Activations::INT8, true};
}

inline const uint16_t* scales_of(const Operand& w) { return reinterpret_cast<const uint16_t*>(w.scales.data_ptr<at::Half>()); }

template <typename W>
W view(const Operand& w);
template <>
inline Dense<float> view(const Operand& w) { return {w.data.data_ptr<float>(), w.K}; }
template <>
inline Dense<bf16> view(const Operand& w) { return {w.data.data_ptr<bf16>(), w.K}; }
template <>
inline Int8 view(const Operand& w) { return {w.data.data_ptr<int8_t>(), scales_of(w), w.K}; }
template <>
inline Int4 view(const Operand& w) { return {w.data.data_ptr<uint8_t>(), scales_of(w), w.K}; }

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
inline at::Tensor check_bias(const std::string& what, const c10::optional<at::Tensor>& bias, at::IntArrayRef shape) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->sizes() == shape, what, ": expected shape ", shape, ", got ", bias->sizes());
  return bias->to(at::kFloat).contiguous();
}

inline const float* ptr_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// y[m, n] += bias[n] for columns [n0, n1) of M rows N apart (a bias is added after the products, one rounding).
inline void add_bias(float* y, const float* bias, int64_t M, int64_t N, int64_t n0, int64_t n1) {
  if (bias == nullptr) return;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) y[m * N + n] += bias[n];
}

}  // namespace moe_serve
