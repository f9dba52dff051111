// Multi-head latent attention's kernel (latent_attention.cpp).
#pragma once

#include "common.h"

namespace moe_serve {

// q [T, H, C], cache [NB, BS, C], block_tables [S, W] int32, seq_ids, positions [T] and num_keys [S] int64
// -> [T, H, R] (R = rank).
at::Tensor latent_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_ids, const at::Tensor& positions,
                            const at::Tensor& num_keys_of, int64_t rank, double scale);

}  // namespace moe_serve
