// sampling.cpp: what sampling needs beyond PyTorch's ops (a grammar's token masks).
#pragma once

#include "common.h"

namespace moe_serve {

// logits [R, V] float32 in place: for each m, row rows[m] keeps the tokens whose bit is set in bitmask[m]
// ([M, W] int32, W * 32 >= V) and the others become -inf.
void mask_logits(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bitmask);

}  // namespace moe_serve
