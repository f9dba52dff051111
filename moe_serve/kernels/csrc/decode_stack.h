// DecodeStack: every layer of a plain pre-norm MoE decoder for a decode-only step, in one call over the
// kernels of linear.h, attention.h and moe.h (decode_stack.cpp).
#pragma once

#include <map>

#include "formats.h"

namespace moe_serve {

// ---- the decoder layers of a decode step, without per-layer Python -----------------------------------
//
// A batch-1 decode step of a small MoE spends a large share of its time in the host glue between kernels
// (~150 Python module calls a step). DecodeStack holds, once, every operand of a plain pre-norm decoder
// (RMSNorm, fused q/k/v, rotary, paged attention, a top-k router, an expert bank) and runs all layers of a
// decode-only step in one call. It calls the kernels of the other files with the same operands in the same
// order as the Python layers do (moe_serve/engine/decode_stack.py decides which models qualify), so its
// results are the Python path's, bitwise.

struct StackLinear {
  Operand weight;
  at::Tensor bias;           // [N] float32, or undefined
  int64_t mkl_above_rows = -1;  // fp32 weights: above this many rows the Python path uses MKL (at::linear)
  at::Tensor operator()(const at::Tensor& x) const;
};

struct StackLayer {
  at::Tensor attn_norm, ffn_norm;  // RMSNorm weights [D] float32
  double attn_eps, ffn_eps;
  StackLinear qkv, o;
  int64_t heads, kv_heads, head_dim;
  double scale;
  StackLinear router;  // [N, D] float32
  int64_t weighting;
  Operand w1, w2;
  c10::optional<Operand> w3;
  at::Tensor b1, b2, b3;
  int64_t activation;
  at::Tensor k_cache, v_cache;
  at::Tensor expert_load;  // [N] int64 while the engine tracks expert load, else undefined
};

// After the layers, for steps whose every row samples its next token: the final norm, the LM head (or the
// tied embedding) and the logits' divisor, as MoETransformer.forward and lm_logits apply them.
struct StackHead {
  at::Tensor norm;  // the final RMSNorm's weight [D] float32; undefined: the model has no final norm
  double eps = 0.0;
  StackLinear linear;
  double divisor = 1.0;  // ModelConfig.logits_divisor (Granite's logits_scaling): the logits divided by it
};

// Where a stacked step's time goes, by part (set_timing): seconds summed since the last read.
struct StackTimers {
  bool enabled = false;
  std::map<std::string, double> seconds;
};

class DecodeStack {
 public:
  explicit DecodeStack(int64_t linear_max_rows) : linear_max_rows_(linear_max_rows) {}

  void add_layer(const at::Tensor& attn_norm, double attn_eps, const at::Tensor& ffn_norm, double ffn_eps,
                 const std::string& qkv_format, const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_scales,
                 const c10::optional<at::Tensor>& qkv_bias, const std::string& o_format, const at::Tensor& o,
                 const c10::optional<at::Tensor>& o_scales, const c10::optional<at::Tensor>& o_bias,
                 int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, const at::Tensor& router_weight,
                 const c10::optional<at::Tensor>& router_bias, int64_t weighting, const std::string& up_format,
                 const at::Tensor& w1, const c10::optional<at::Tensor>& s1, const c10::optional<at::Tensor>& b1,
                 const c10::optional<at::Tensor>& w3, const c10::optional<at::Tensor>& s3,
                 const c10::optional<at::Tensor>& b3, const std::string& down_format, const at::Tensor& w2,
                 const c10::optional<at::Tensor>& s2, const c10::optional<at::Tensor>& b2, int64_t activation,
                 const at::Tensor& k_cache, const at::Tensor& v_cache);

  // The expert-load counters of each layer ([N] int64; None: not tracked), updated in place by run.
  void set_expert_load(const std::vector<c10::optional<at::Tensor>>& loads);

  // The final norm (norm undefined: none), the LM head's operand and bias, and the logits' divisor.
  void set_head(const c10::optional<at::Tensor>& norm, double eps, const std::string& format, const at::Tensor& data,
                const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& bias, double divisor);

  // h [T, D] after the embeddings -> after the last layer. One token per sequence (a decode step).
  at::Tensor run(at::Tensor h, const c10::optional<at::Tensor>& cos_table, const c10::optional<at::Tensor>& sin_table,
                 const at::Tensor& positions, const at::Tensor& seq_ids, const at::Tensor& num_keys,
                 const at::Tensor& block_tables, const at::Tensor& slot_mapping, const at::Tensor& token_k,
                 int64_t max_k) const;

  // run, then the head (set_head first): every row's logits [T, V] float32.
  at::Tensor run_logits(const at::Tensor& h, const c10::optional<at::Tensor>& cos_table,
                        const c10::optional<at::Tensor>& sin_table, const at::Tensor& positions,
                        const at::Tensor& seq_ids, const at::Tensor& num_keys, const at::Tensor& block_tables,
                        const at::Tensor& slot_mapping, const at::Tensor& token_k, int64_t max_k) const;

  // Time each part of the steps from now on (or stop); timings() returns the seconds per part since the
  // last call and starts the sums again.
  void set_timing(bool enabled) { timers_.enabled = enabled; }
  std::map<std::string, double> timings();

  int64_t num_layers() const { return (int64_t)layers_.size(); }

 private:
  static c10::optional<at::Tensor> opt(const at::Tensor& t) {
    return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
  }
  // The tokens of each used slot (id >= 0) added to its expert's counter, as MoEBlock._count does.
  static void count_experts(const at::Tensor& ids, const at::Tensor& load) {
    const int64_t* ip = ids.data_ptr<int64_t>();
    int64_t* lp = load.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); ++i)
      if (ip[i] >= 0) lp[ip[i]] += 1;
  }

  int64_t linear_max_rows_;
  std::vector<StackLayer> layers_;
  c10::optional<StackHead> head_;
  mutable StackTimers timers_;  // run is const: the sums are bookkeeping, not state a step reads
};

}  // namespace moe_serve
