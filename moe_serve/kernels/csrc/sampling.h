// sampling.cpp: what sampling needs beyond PyTorch's ops (a grammar's token masks, greedy tokens).
#pragma once

#include "common.h"

namespace moe_serve {

// logits [R, V] float32 in place: for each m, row rows[m] keeps the tokens whose bit is set in bitmask[m]
// ([M, W] int32, W * 32 >= V) and the others become -inf.
void mask_logits(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bitmask);

// logits [R, V] float32 -> {argmax [R] int64, finite [R] bool}: each row's first maximal index, a NaN above
// every number (torch.argmax's), and whether every value of the row is finite. One read of each row.
std::vector<at::Tensor> greedy_rows(const at::Tensor& logits);

}  // namespace moe_serve
