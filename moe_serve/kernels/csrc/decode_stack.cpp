// The decode stack's layers (decode_stack.h): each a fixed sequence of calls to the kernels, as the Python
// layers make them.

#include "decode_stack.h"

#include <chrono>

#include <ATen/TensorOperators.h>
#include <ATen/ops/div.h>
#include <ATen/ops/linear.h>

#include "attention.h"
#include "linear.h"
#include "moe.h"

namespace moe_serve {
namespace {

Operand stack_operand(const std::string& what, const at::Tensor& data, const c10::optional<at::Tensor>& scales,
                      const std::string& format, int64_t dims) {
  c10::optional<at::Tensor> s = scales.has_value() && scales->defined() ? c10::optional<at::Tensor>(scales->contiguous()) : c10::nullopt;
  return check_operand(what, data.contiguous(), s, parse_kernel_format(format), dims);
}

at::Tensor defined_or_empty(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->to(at::kFloat).contiguous() : at::Tensor();
}

// Adds the seconds from its construction to its end to a part's sum, where the timers are on.
class PartTimer {
 public:
  PartTimer(StackTimers& timers, const char* part) : timers_(timers), part_(part) {
    if (timers_.enabled) start_ = std::chrono::steady_clock::now();
  }
  ~PartTimer() {
    if (timers_.enabled)
      timers_.seconds[part_] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  StackTimers& timers_;
  const char* part_;
  std::chrono::steady_clock::time_point start_;
};

// f() timed as `part`.
template <typename F>
auto timed(StackTimers& timers, const char* part, F&& f) {
  PartTimer timer(timers, part);
  return f();
}

}  // namespace

at::Tensor StackLinear::operator()(const at::Tensor& x) const {
  if (weight.format == Format::F32 && mkl_above_rows >= 0 && x.size(0) > mkl_above_rows)
    return at::linear(x, weight.data, bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt);
  return linear_operand(x, weight, bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt);
}

void DecodeStack::add_layer(
    const at::Tensor& attn_norm, double attn_eps, const at::Tensor& ffn_norm, double ffn_eps,
    const std::string& qkv_format, const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_scales,
    const c10::optional<at::Tensor>& qkv_bias, const std::string& o_format, const at::Tensor& o,
    const c10::optional<at::Tensor>& o_scales, const c10::optional<at::Tensor>& o_bias, int64_t heads,
    int64_t kv_heads, int64_t head_dim, double scale, const at::Tensor& router_weight,
    const c10::optional<at::Tensor>& router_bias, int64_t weighting, const std::string& up_format,
    const at::Tensor& w1, const c10::optional<at::Tensor>& s1, const c10::optional<at::Tensor>& b1,
    const c10::optional<at::Tensor>& w3, const c10::optional<at::Tensor>& s3, const c10::optional<at::Tensor>& b3,
    const std::string& down_format, const at::Tensor& w2, const c10::optional<at::Tensor>& s2,
    const c10::optional<at::Tensor>& b2, int64_t activation, const at::Tensor& k_cache,
    const at::Tensor& v_cache) {
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

void DecodeStack::set_expert_load(const std::vector<c10::optional<at::Tensor>>& loads) {
  TORCH_CHECK(loads.size() == layers_.size(), "DecodeStack: one expert-load entry per layer");
  for (size_t i = 0; i < loads.size(); ++i) {
    at::Tensor load = loads[i].has_value() && loads[i]->defined() ? *loads[i] : at::Tensor();
    if (load.defined())
      TORCH_CHECK(load.scalar_type() == at::kLong && load.is_contiguous() && load.device().is_cpu() &&
                      load.numel() == layers_[i].w1.data.size(0),
                  "DecodeStack: expert load must be a contiguous CPU int64 [", layers_[i].w1.data.size(0), "]");
    layers_[i].expert_load = load;
  }
}

at::Tensor DecodeStack::run(at::Tensor h, const c10::optional<at::Tensor>& cos_table,
                            const c10::optional<at::Tensor>& sin_table, const at::Tensor& positions,
                            const at::Tensor& seq_ids, const at::Tensor& num_keys,
                            const at::Tensor& block_tables, const at::Tensor& slot_mapping,
                            const at::Tensor& token_k, int64_t max_k) const {
  int64_t T = h.size(0);
  c10::optional<at::Tensor> cos, sin;
  if (cos_table.has_value() && cos_table->defined()) {
    cos = cos_table->index_select(0, positions);
    sin = sin_table->index_select(0, positions);
  }
  const c10::optional<at::Tensor> none;
  StackTimers& t = timers_;
  for (const StackLayer& layer : layers_) {
    int64_t H = layer.heads, G = layer.kv_heads, Dh = layer.head_dim;
    auto normed = timed(t, "norms", [&] { return rms_norm(h, layer.attn_norm, layer.attn_eps); });
    auto qkv = timed(t, "qkv projection", [&] { return layer.qkv(normed); });  // [T, (H + 2G) Dh]
    auto parts = qkv.split_with_sizes({H * Dh, G * Dh, G * Dh}, 1);
    auto q = parts[0].reshape({T, H, Dh}).contiguous();
    auto k = parts[1].reshape({T, G, Dh}).contiguous();
    auto v = parts[2].reshape({T, G, Dh}).contiguous();
    timed(t, "rotary and cache writes", [&] { rotary_write(q, k, v, cos, sin, layer.k_cache, layer.v_cache, slot_mapping); });
    auto attended = timed(t, "attention", [&] {
      return paged_attention(q, layer.k_cache, layer.v_cache, block_tables, seq_ids, positions, num_keys,
                             /*causal=*/true, layer.scale, none, none, 0, /*window=*/0, /*chunk=*/0, none);
    });
    h = h + timed(t, "o projection", [&] { return layer.o(attended.reshape({T, H * Dh})); });
    auto x = timed(t, "norms", [&] { return rms_norm(h, layer.ffn_norm, layer.ffn_eps); });
    auto logits = timed(t, "router", [&] { return layer.router(x); });
    auto routed = timed(t, "top-k", [&] { return topk_route(logits, token_k, max_k, layer.weighting); });
    if (layer.expert_load.defined()) count_experts(routed[0], layer.expert_load);
    h = h + timed(t, "experts", [&] {
      return moe_experts_operands(x, routed[0], routed[1], layer.w1, opt(layer.b1), layer.w3, opt(layer.b3), layer.w2,
                                  opt(layer.b2), Act{layer.activation});
    });
  }
  return h;
}

void DecodeStack::set_head(const c10::optional<at::Tensor>& norm, double eps, const std::string& format,
                           const at::Tensor& data, const c10::optional<at::Tensor>& scales,
                           const c10::optional<at::Tensor>& bias, double divisor) {
  StackHead head;
  if (norm.has_value() && norm->defined()) {
    TORCH_CHECK(norm->scalar_type() == at::kFloat, "DecodeStack: the final norm's weight must be float32");
    head.norm = norm->contiguous();
  }
  head.eps = eps;
  head.linear = {stack_operand("DecodeStack: LM head", data, scales, format, 2), defined_or_empty(bias), linear_max_rows_};
  head.divisor = divisor;
  head_ = std::move(head);
}

at::Tensor DecodeStack::run_logits(const at::Tensor& h, const c10::optional<at::Tensor>& cos_table,
                                   const c10::optional<at::Tensor>& sin_table, const at::Tensor& positions,
                                   const at::Tensor& seq_ids, const at::Tensor& num_keys,
                                   const at::Tensor& block_tables, const at::Tensor& slot_mapping,
                                   const at::Tensor& token_k, int64_t max_k) const {
  TORCH_CHECK(head_.has_value(), "DecodeStack: run_logits needs the head (set_head)");
  const StackHead& head = *head_;
  auto out = run(h, cos_table, sin_table, positions, seq_ids, num_keys, block_tables, slot_mapping, token_k, max_k);
  if (head.norm.defined()) out = timed(timers_, "final norm", [&] { return rms_norm(out, head.norm, head.eps); });
  auto logits = timed(timers_, "LM head", [&] { return head.linear(out); });
  return head.divisor != 1.0 ? at::div(logits, head.divisor) : logits;
}

std::map<std::string, double> DecodeStack::timings() {
  std::map<std::string, double> out;
  out.swap(timers_.seconds);
  return out;
}

}  // namespace moe_serve
