// What every file of the CPU kernels includes: ATen's tensor and the few operators the kernels call, each
// from its own header (ATen/ATen.h, torch/types.h or torch/extension.h would cost a file 6 to 20 s to
// compile; these about 3: the build compiles the files in parallel, and every one pays its includes), ATen's
// parallel_for, the namespace, and the threshold below which a kernel stays on one thread.
//
// Each output element is computed by the same sequence of floating-point operations whatever else is in the
// batch, so a token's result never depends on what it is batched with (bitwise, on these paths).
//
// Legend: T tokens, S sequences, H query heads, G key/value heads, Dh head dim, E experts, max_k slots per
// token (token_k: a row's own k, at most max_k), D hidden, I expert intermediate size, N output and K input
// features of a linear, NB blocks, BS block size (a multiple of 16; latent_attention's: any). Cache layout:
// k_cache [NB, G, Dh, BS] (transposed within a block), v_cache [NB, G, BS, Dh].
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace moe_serve {

using bf16 = at::BFloat16;

inline bool small_work(int64_t work) { return work < (1 << 15); }  // below this, a thread handoff costs more

}  // namespace moe_serve
