// with_dtype(dtype, f): calls f(half{}) for F16 and f(bf16{}) otherwise, so one generic
// lambda runs the templated kernels in the stage's element type. A GpuStage's dtype is F16
// or BF16 (checked at creation).
#pragma once

#include "common/dtype.h"
#include "kernels/cuda/ops.h"

namespace conveyor::cuda {

template <class F>
void with_dtype(DType d, F&& f) {
  if (d == DType::F16) f(half{});
  else f(bf16{});
}

}  // namespace conveyor::cuda
