// The Python module of moe-serve's CPU kernels, moe_serve_cpu_kernels (moe_serve/kernels/__init__.py builds
// every .cpp of this folder into one library): the parts of a step that PyTorch runs as many small ops or as
// bandwidth-poor matrix-vector products. This file only binds them; each file opens with what it owns:
//
//   linear.cpp            linear, linear_packed (y = x W^T + b over fp32, bf16, int8 or int4 weights, W
//                         streamed from memory once) and head_linear (latent attention's per-head maps)
//   int_dot.cpp           quantize_activations (int8 activation rows in blocks of 32) and the integer-block
//                         dot products of such rows with int8 and int4 weights (--cpu-activations int8)
//   bf16_dot.cpp          activation rows rounded to bf16 and their vdpbf16ps dot products with bf16
//                         weights (--cpu-activations bf16)
//   moe.cpp               moe_experts, moe_experts_packed (grouped experts, a slot-ordered combine) and
//                         topk_route (top-k experts per row and their combine weights)
//   attention.cpp         rms_norm, rotary_write (rotary and the paged KV cache's writes), paged_attention,
//                         packed_attention
//   latent_attention.cpp  latent_attention (DeepSeek's MLA, absorbed form, over its own paged cache)
//   decode_stack.cpp      DecodeStack: every layer of a decode-only step in one call over the kernels above
//   sampling.cpp          mask_logits (a structured output's grammar masks applied to their rows of the logits)
//                         and greedy_rows (each row's argmax and finiteness)
//
// and the headers they share: common.h (includes, the legend of the names the comments use), vec.h (16-lane
// float vectors: AVX-512, or AVX2 + FMA + F16C on CPUs without it; built with -march=native), formats.h
// (weight formats and operands), linear.h (the dot-product blocks), attention.h (the online softmax).

#include <torch/python.h>  // pybind11 and torch's casters; torch/extension.h adds the C++ frontend (7 s more)

#include <map>

#include "attention.h"
#include "bf16_dot.h"
#include "decode_stack.h"
#include "int_dot.h"
#include "latent_attention.h"
#include "linear.h"
#include "moe.h"
#include "sampling.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace moe_serve;
  m.def("isa", [] { return std::string(ISA); }, "the vector instructions this build uses: avx512 or avx2");
  pybind11::class_<DecodeStack>(m, "DecodeStack", "the decoder layers of a decode step in one call")
      .def(pybind11::init<int64_t>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_expert_load", &DecodeStack::set_expert_load)
      .def("set_head", &DecodeStack::set_head)
      .def("run", &DecodeStack::run, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("run_logits", &DecodeStack::run_logits, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("set_timing", &DecodeStack::set_timing)
      .def("timings", &DecodeStack::timings)
      .def("num_layers", &DecodeStack::num_layers);
  m.def("linear", &linear, "y = x W^T + b, streaming W once, a fixed FMA chain per output");
  m.def("linear_packed", &linear_packed, "linear over a packed weight: data, scales (int8, int4), format name");
  m.def("int_dot_isa", [] { return std::string(int_dot_isa()); },
        "the integer dot products' instructions (int8 activations): avx512-vnni or avx2");
  m.def("quantize_activations", &quantize_activations, "activation rows -> int8 blocks of 32: (q, scales, sums)");
  m.def("has_bf16_dot", &has_bf16_dot, "whether this build has the bf16 dot products (AVX-512 BF16)");
  m.def("round_activations_bf16", [](const at::Tensor& x) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "round_activations_bf16: x must be float32 [M, K]");
    auto xc = x.contiguous();
    BBuffer out(xc.size(0), xc.size(1));
    round_rows_bf16(xc.data_ptr<float>(), xc.size(1), xc.size(0), xc.size(1), out);
    return out.x;
  }, "activation rows rounded to bf16 as the bf16 dot products take them (for the tests)");
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
  m.def("mask_logits", &mask_logits, "grammar bitmasks applied to their rows of the logits, in place");
  m.def("greedy_rows", &greedy_rows, "each row's argmax (torch.argmax's) and whether the row is finite");
  m.def("rotary_write", &rotary_write, "rotary on q and k in place, k and v into the paged cache");
  m.def("paged_attention", &paged_attention, "attention over the paged KV cache, online softmax");
  m.def("packed_attention", &packed_attention, "attention over packed (varlen) keys, online softmax");
  m.def("head_linear", &head_linear, "per-head linear maps y[t, h] = w[h] x[t, h], rows independent of T");
  m.def("latent_attention", &latent_attention,
        "multi-head latent attention over its paged cache of rows (keys and values at once), online softmax");
}
