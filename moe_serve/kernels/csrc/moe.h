// The MoE layer's kernels (moe.cpp): the experts, each expert's weights streamed once for all of its slots
// and combined in slot order, over banks in any weight format; and routing, each row's top-k experts and
// their combine weights.
#pragma once

#include "formats.h"

namespace moe_serve {

enum Activation : int64_t { RELU = 0, GELU = 1, GELU_TANH = 2, SILU = 3, SWIGLU_OAI = 4 };

// An expert's activation (moe_serve.kernels.vocabulary.ACTIVATION_IDS). SWIGLU_OAI, gpt-oss's gated unit, is defined on the pair
// (gate, up) only: min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clamp(up, -limit, limit) + 1).
struct Act {
  int64_t kind;
  float alpha = 0.f, limit = 0.f;
};

// x [T, D] through the banks w1, w3 (gated experts), w2 as checked operands, combined by topk_weights (the
// decode stack calls it directly).
at::Tensor moe_experts_operands(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                const Operand& w1, const c10::optional<at::Tensor>& b1, const c10::optional<Operand>& w3,
                                const c10::optional<at::Tensor>& b3, const Operand& w2,
                                const c10::optional<at::Tensor>& b2, const Act& act);
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& w1, const c10::optional<at::Tensor>& b1,
                       const c10::optional<at::Tensor>& w3, const c10::optional<at::Tensor>& b3,
                       const at::Tensor& w2, const c10::optional<at::Tensor>& b2, int64_t act, double alpha,
                       double limit);
at::Tensor moe_experts_packed(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                              const std::string& format_up, const at::Tensor& w1, const c10::optional<at::Tensor>& s1,
                              const c10::optional<at::Tensor>& b1, const c10::optional<at::Tensor>& w3,
                              const c10::optional<at::Tensor>& s3, const c10::optional<at::Tensor>& b3,
                              const std::string& format_down, const at::Tensor& w2,
                              const c10::optional<at::Tensor>& s2, const c10::optional<at::Tensor>& b2, int64_t act,
                              double alpha, double limit);

// How topk_route weighs a row's chosen experts: the codes of moe_serve.kernels.vocabulary.Weighting (the router
// kinds name theirs; bindings.cpp's weighting_codes gives this table to Python, and the tests compare the two).
enum Weighting : int64_t { SOFTMAX_CHOSEN = 0, SOFTMAX_ALL = 1, UNIFORM = 2 };

std::vector<at::Tensor> topk_route(const at::Tensor& logits, const at::Tensor& token_k, int64_t max_k,
                                   int64_t weighting);

}  // namespace moe_serve
