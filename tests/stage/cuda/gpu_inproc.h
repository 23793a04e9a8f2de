// GPU stages for tests/coordinator/inproc_pipeline.h: the scheduler driving real GPU stages in
// one process (the beam-search and prefix-reuse GPU tests). CUDA builds only.
#pragma once

#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "stage/cuda/gpu_stage_backend.h"
#include "tests/coordinator/inproc_pipeline.h"

namespace conveyor::testing {

// A stage backend on GPU 0 in `dtype`, deterministic mode, with the given K/V budget.
inline BackendMaker gpu_backend(DType dtype) {
  return [dtype](StageWeights w, int64_t kv_bytes) -> std::unique_ptr<StageBackend> {
    cuda::GpuStageOptions o;
    o.dtype = dtype;
    o.name = "stage " + std::to_string(w.layer_begin);
    o.max_tokens = 512;
    o.kv_cache_max_bytes = kv_bytes;
    auto b = cuda::GpuStageBackend::create(w, {0}, o);
    EXPECT_TRUE(b) << b.error();
    if (!b) return nullptr;
    return std::move(b).value();
  };
}

}  // namespace conveyor::testing
